-- outbox-relay migration 0004, built CONCURRENTLY (outside any transaction, so a large
-- live table keeps taking inserts while it builds): pending rows by key bucket, then in
-- order. A key's bucket is hashtext(key) & 63 (the C collation: plain bytes, no ICU
-- version in it; a NULL key's row goes by its order value). Every row of a key is in its
-- bucket, so a claim can read one bucket's pending rows from its start and find each
-- key's head there, without walking the rows of keys other relays hold
-- (src/source/claim.rs, "Buckets"). The expression must stay exactly as the relay writes
-- it in its statements (src/source/sql.rs, `bucket_of`), or PostgreSQL will not use it.
-- `attempts >= 0` holds for every row (attempts only ever count up from 0); only the
-- bucket window states it, so no other statement's plan can pick this index: with stale
-- statistics (a table filled since its last ANALYZE) the planner took it, as a whole-index
-- scan, for the row locks by id (143 ms for 470 rows instead of 3 ms).
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{bucket_index}}
    ON {{table}} (((COALESCE(hashtext(({{key}})::text COLLATE "C")::int8, ({{order}})::int8) & 63)::int4), {{order}})
    WHERE {{published_at}} IS NULL AND {{dead_at}} IS NULL AND {{attempts}} >= 0
