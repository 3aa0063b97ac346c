-- outbox-relay migration 0003, built CONCURRENTLY (outside any transaction, so a large
-- live table keeps taking inserts while it builds): pending rows with a failure history -
-- waiting for their next attempt, or released by `requeue` - in order. Small by
-- construction (only failing rows). Claims start at a low-water mark instead of the
-- pending index's left end (see src/source/floor.rs); this index is how they still find
-- such rows below the mark, without walking the entries of every row published since the
-- last VACUUM.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{retry_index}}
    ON {{table}} ({{order}})
    WHERE {{published_at}} IS NULL AND {{dead_at}} IS NULL AND {{next_attempt_at}} IS NOT NULL
