-- outbox-relay migration 0007: sleep marks, read by the wake-up trigger (notify.sql).
-- A row here says that the relay whose LISTEN session has backend `pid` is asleep on
-- `table_name` (`schema.table`, as NOTIFY names it). One table per schema, a few rows at
-- most (one per relay and outbox table). UNLOGGED: no WAL for the relays' frequent
-- updates; after a crash of PostgreSQL, or on a promoted standby, it starts empty and
-- every relay arms again. Every role that inserts outbox rows reads it (the trigger runs
-- as the writer), so SELECT goes to PUBLIC: it holds table names and backend pids only.
CREATE UNLOGGED TABLE IF NOT EXISTS {{schema}}.outbox_relay_sleepers (
    table_name text NOT NULL,
    pid integer NOT NULL,
    asleep boolean NOT NULL DEFAULT false,
    PRIMARY KEY (table_name, pid)
);
GRANT SELECT ON {{schema}}.outbox_relay_sleepers TO PUBLIC;
