-- outbox-relay migration 0002, built CONCURRENTLY (outside any transaction, so a large
-- live table keeps taking inserts while it builds): rows that hold back the later rows of
-- their key - dead, or waiting for their next attempt. Small by construction (only
-- failing rows), it answers the claim's "is any row of this key before me held?" probe and
-- the uncorrelated "is any row held at all?" test that lets the common case skip it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{held_index}}
    ON {{table}} ({{key}}, {{order}})
    WHERE {{published_at}} IS NULL AND ({{dead_at}} IS NOT NULL OR {{next_attempt_at}} IS NOT NULL)
