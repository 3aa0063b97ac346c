-- The trigger that wakes sleeping relays the moment rows commit. Not a numbered
-- migration: `outbox-relay migrate` installs it, `migrate --no-notify` removes it.
-- It fires once per INSERT statement (not per row), and sends a NOTIFY only while a relay
-- is asleep on the table (a row of outbox_relay_sleepers, migration 0007): a NOTIFY makes
-- the committing transaction hold a database-wide lock until its commit is flushed, so
-- writers that all notified would commit one at a time. PostgreSQL folds identical
-- notifications within a transaction into one. The look runs with the statement's
-- snapshot; why a relay still misses no row is in the relay's src/relay/sleep.rs.
--
-- Releases before this one installed `outbox_relay_notify`, which notified on every
-- statement; it is replaced here. Its function stays (other tables of the schema may
-- still use it until they are migrated).

CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_wake() RETURNS trigger
LANGUAGE plpgsql AS {{body_quote}}
BEGIN
    IF EXISTS (SELECT FROM {{schema}}.outbox_relay_sleepers s
               WHERE s.table_name = TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME
                 AND s.asleep) THEN
        PERFORM pg_notify('outbox_relay', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    END IF;
    RETURN NULL;
END
{{body_quote}};

DROP TRIGGER IF EXISTS outbox_relay_notify ON {{table}};
DROP TRIGGER IF EXISTS outbox_relay_wake ON {{table}};
CREATE TRIGGER outbox_relay_wake
    AFTER INSERT ON {{table}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.outbox_relay_wake();
