-- outbox-relay migration 0004: no change inside the transaction; its index
-- (0004_bucket_index.concurrent.sql) is built CONCURRENTLY afterwards.
SELECT 1;
