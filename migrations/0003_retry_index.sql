-- outbox-relay migration 0003: no change inside the transaction; its index
-- (0003_retry_index.concurrent.sql) is built CONCURRENTLY afterwards.
SELECT 1;
