-- Retired: migrate no longer builds this index and drops one an earlier release built; the
-- held index (0002) finds the dead rows (src/source/migrate.rs, `Kept::Retired`).
-- outbox-relay migration 0001, built CONCURRENTLY: dead rows by key, for `status` and the
-- closing check of `drain` (a dead row takes its key's later rows out of the work left).
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{dead_index}}
    ON {{table}} ({{key}}, {{order}}) WHERE {{dead_at}} IS NOT NULL AND {{published_at}} IS NULL
