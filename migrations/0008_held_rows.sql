-- outbox-relay migration 0008: the rows that hold back their key, kept beside the outbox
-- instead of in two partial indexes on it. A partial index costs every INSERT into the
-- table even when the new row does not enter it (PostgreSQL opens it and tests its
-- predicate for each statement), and no fresh row is ever held: so the held and retry
-- indexes (migrations 0002, 0003) go, and this table holds what they held.
--
-- A row of outbox_relay_held mirrors an outbox row that is not published and is dead or
-- has a failure history (`next_attempt_at` set): its order value, key, next attempt and
-- dead time. Exactly those rows, at every commit: the triggers below keep it, in the
-- transaction that changes the row, whoever changes it (a relay of any release,
-- `requeue`, `replay`, SQL by hand). Only UPDATE, DELETE and TRUNCATE can make or unmake
-- a held row (an application inserts fresh rows), so the application's INSERT runs no
-- trigger. One table per schema, shared by the outbox tables in it.
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_relay_held (
    table_name text NOT NULL,
    id bigint NOT NULL,
    key text,
    next_attempt_at timestamptz,
    dead_at timestamptz,
    PRIMARY KEY (table_name, id)
);
-- "Is any row of this key before this one held?": the claim's probe.
CREATE INDEX IF NOT EXISTS outbox_relay_held_key_idx
    ON {{schema}}.outbox_relay_held (table_name, key, id);

-- The triggers' function, one per schema. Its arguments name the outbox table (as
-- `schema.table`) and its order, key, published_at, dead_at and next_attempt_at columns
-- (mapped with [tables.columns]). SECURITY DEFINER: a role that may update the outbox
-- keeps the mirror without any privilege on it. Its statements are static, so PL/pgSQL
-- plans them once per session; they name the table through the function's search_path,
-- not in its body, where a schema name could end the quoted text. pg_catalog comes
-- first, so nothing in the schema stands in for a built-in.
CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_hold() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, {{schema}}, pg_temp AS $$
DECLARE
    old_row jsonb;
    new_row jsonb;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM outbox_relay_held WHERE table_name = TG_ARGV[0];
        RETURN NULL;
    END IF;
    old_row := to_jsonb(OLD);
    IF TG_OP = 'UPDATE' THEN
        new_row := to_jsonb(NEW);
        IF new_row -> TG_ARGV[3] = 'null'::jsonb
           AND (new_row -> TG_ARGV[4] <> 'null'::jsonb OR new_row -> TG_ARGV[5] <> 'null'::jsonb)
        THEN
            -- Held after the change. Its row is written in place (a retry rescheduled
            -- changes no indexed column of it), unless its order value changed.
            IF new_row -> TG_ARGV[1] <> old_row -> TG_ARGV[1] THEN
                DELETE FROM outbox_relay_held
                 WHERE table_name = TG_ARGV[0] AND id = (old_row ->> TG_ARGV[1])::bigint;
            END IF;
            INSERT INTO outbox_relay_held AS h
            VALUES (TG_ARGV[0], (new_row ->> TG_ARGV[1])::bigint, new_row ->> TG_ARGV[2],
                    (new_row ->> TG_ARGV[5])::timestamptz, (new_row ->> TG_ARGV[4])::timestamptz)
                ON CONFLICT (table_name, id) DO UPDATE
               SET key = excluded.key, next_attempt_at = excluded.next_attempt_at,
                   dead_at = excluded.dead_at;
            RETURN NULL;
        END IF;
    END IF;
    DELETE FROM outbox_relay_held
     WHERE table_name = TG_ARGV[0] AND id = (old_row ->> TG_ARGV[1])::bigint;
    RETURN NULL;
END
$$;
-- Only the triggers below call it: no other role may attach it to a table of its own
-- (firing a trigger checks no privilege on its function; creating one does).
REVOKE ALL ON FUNCTION {{schema}}.outbox_relay_hold() FROM PUBLIC;

-- Fired only where a row enters or leaves the held state, or changes while held (the
-- WHEN conditions): a relay's UPDATE that marks fresh rows published, or its DELETE of
-- them, calls nothing.
DROP TRIGGER IF EXISTS outbox_relay_hold ON {{table}};
CREATE TRIGGER outbox_relay_hold
    AFTER UPDATE OF {{order}}, {{key}}, {{published_at}}, {{dead_at}}, {{next_attempt_at}} ON {{table}}
    FOR EACH ROW
    WHEN ((OLD.{{published_at}} IS NULL AND (OLD.{{dead_at}} IS NOT NULL OR OLD.{{next_attempt_at}} IS NOT NULL))
       OR (NEW.{{published_at}} IS NULL AND (NEW.{{dead_at}} IS NOT NULL OR NEW.{{next_attempt_at}} IS NOT NULL)))
    EXECUTE FUNCTION {{schema}}.outbox_relay_hold({{hold_arguments}});
DROP TRIGGER IF EXISTS outbox_relay_hold_delete ON {{table}};
CREATE TRIGGER outbox_relay_hold_delete
    AFTER DELETE ON {{table}}
    FOR EACH ROW
    WHEN (OLD.{{published_at}} IS NULL AND (OLD.{{dead_at}} IS NOT NULL OR OLD.{{next_attempt_at}} IS NOT NULL))
    EXECUTE FUNCTION {{schema}}.outbox_relay_hold({{hold_arguments}});
DROP TRIGGER IF EXISTS outbox_relay_hold_truncate ON {{table}};
CREATE TRIGGER outbox_relay_hold_truncate
    AFTER TRUNCATE ON {{table}}
    FOR EACH STATEMENT
    EXECUTE FUNCTION {{schema}}.outbox_relay_hold({{hold_arguments}});

-- The rows held now. The triggers above lock the table against writes until this
-- transaction commits, so no row changes between this read and the commit; the held
-- index (migration 0002), where it exists, finds them at once.
INSERT INTO {{schema}}.outbox_relay_held
SELECT {{table_literal}}, {{order}}, {{key}}::text, {{next_attempt_at}}, {{dead_at}}
  FROM {{table}}
 WHERE {{published_at}} IS NULL AND ({{dead_at}} IS NOT NULL OR {{next_attempt_at}} IS NOT NULL)
    ON CONFLICT DO NOTHING;
