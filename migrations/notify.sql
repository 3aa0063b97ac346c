-- The NOTIFY trigger that wakes idle relays the moment rows commit. Not a numbered
-- migration: `outbox-relay migrate` installs it, `migrate --no-notify` removes it.
-- It fires once per INSERT statement (not per row), and PostgreSQL folds identical
-- notifications within a transaction into one.

CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_relay_notify ON {{table}};
CREATE TRIGGER outbox_relay_notify
    AFTER INSERT ON {{table}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.outbox_relay_notify();
