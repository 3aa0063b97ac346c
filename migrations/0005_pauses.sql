-- outbox-relay migration 0005: pause and resume (`outbox-relay pause`, the bad-row valve).
-- A row here pauses its table for every relay: none claims from it until `outbox-relay
-- resume` deletes the row. One table per schema, shared by the outbox tables in it; the
-- relays read it about twice a second (a few rows at most).
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_relay_pauses (
    table_name text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL,
    reason text NOT NULL DEFAULT ''
);
