-- outbox-relay migration 0002: a per-row retry schedule. After a failed publish a row is
-- not claimed again before next_attempt_at (NULL = due now), so max_attempts spreads over
-- retry_backoff .. retry_backoff_max instead of burning within milliseconds.
-- Nullable, no default: PostgreSQL adds the column without rewriting the table, and
-- relays older than this migration simply ignore it.

ALTER TABLE {{table}}
    ADD COLUMN IF NOT EXISTS {{next_attempt_at}} timestamptz;
