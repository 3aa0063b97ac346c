-- outbox-relay migration 0001, built CONCURRENTLY (outside any transaction, so a large live
-- table keeps taking inserts): pending rows in order, for the claim window and
-- `ordering = "none"` claims.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{pending_index}}
    ON {{table}} ({{order}}) WHERE {{published_at}} IS NULL AND {{dead_at}} IS NULL
