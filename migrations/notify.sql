-- The trigger that wakes sleeping relays the moment rows commit. Not a numbered
-- migration: `outbox-relay migrate` installs it, `migrate --no-notify` removes it.
-- It fires once per INSERT statement (not per row), and only while a relay is asleep on
-- the table: its WHEN condition reads the table's sleep sequence (migration 0007), 1 + the
-- number of relays asleep on it and NULL while none is, without a query and without
-- calling the function while no relay sleeps. PostgreSQL parses and plans a WHEN
-- condition for every statement: `IS NOT NULL` is the shortest that reads the sequence. A NOTIFY makes the committing transaction hold a database-wide lock
-- until its commit is flushed, so writers that all notified would commit one at a time.
-- PostgreSQL folds identical notifications within a transaction into one. Why a relay
-- misses no row all the same is in the relay's src/relay/sleep.rs.
--
-- Releases before this one installed `outbox_relay_notify`, which notified on every
-- statement; it is replaced here. Its function stays (other tables of the schema may
-- still use it until they are migrated).

CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_relay_notify ON {{table}};
DROP TRIGGER IF EXISTS outbox_relay_wake ON {{table}};
CREATE TRIGGER outbox_relay_wake
    AFTER INSERT ON {{table}}
    FOR EACH STATEMENT
    WHEN (pg_catalog.pg_sequence_last_value({{sleeping_literal}}::pg_catalog.regclass) IS NOT NULL)
    EXECUTE FUNCTION {{schema}}.outbox_relay_wake();
