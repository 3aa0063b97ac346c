-- outbox-relay migration 0006: `[[tables]] max_rate`, shared by every relay of a table.
-- One token bucket per rate-limited table: `tokens` as of `at`, refilled at max_rate per
-- second up to one second's worth. A relay takes tokens for a batch in a short statement
-- of its own before the claim (never inside it: the row would serialize the claims), and
-- gives back what the claim did not use. One table per schema.
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_relay_rates (
    table_name text PRIMARY KEY,
    tokens float8 NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- What the last take granted: the statement's answer (RETURNING sees only new values).
    granted float8 NOT NULL DEFAULT 0
);
