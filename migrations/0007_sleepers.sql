-- outbox-relay migration 0007: sleep marks, which gate the wake-up trigger (notify.sql).
-- A row of outbox_relay_sleepers says that the relay whose LISTEN session has backend
-- `pid` is asleep on `table_name` (`schema.table`, as NOTIFY names it). One table per
-- schema, a few rows at most (one per relay and outbox table). UNLOGGED: no WAL for the
-- relays' frequent updates; after a crash of PostgreSQL, or on a promoted standby, it
-- starts empty and every relay marks itself again.
CREATE UNLOGGED TABLE IF NOT EXISTS {{schema}}.outbox_relay_sleepers (
    table_name text NOT NULL,
    pid integer NOT NULL,
    asleep boolean NOT NULL DEFAULT false,
    PRIMARY KEY (table_name, pid)
);
-- What the writers read, one per outbox table: 1 + the number of relays asleep on it, and
-- NULL (set with is_called false) while none is.
-- The relays set it (under one advisory lock, from the marks above) whenever a mark
-- changes. A sequence, because its value is read without a snapshot and without a query:
-- the trigger's WHEN condition reads it for every INSERT statement, and calls nothing
-- while it reads NULL. Every role that inserts outbox rows reads it, so SELECT goes to PUBLIC.
CREATE SEQUENCE IF NOT EXISTS {{sleeping}} MINVALUE 1;
GRANT SELECT ON SEQUENCE {{sleeping}} TO PUBLIC;
