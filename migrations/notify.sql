-- The wake-up: a sleeping relay hears of rows the moment they commit. Not a numbered
-- migration: `outbox-relay migrate` installs it, `migrate --no-notify` removes it.
--
-- It is the default of the attempts column, which every INSERT of the application leaves
-- out: a call of outbox_relay_nudge below, which is always 0 and sends a NOTIFY only
-- while a relay is asleep on the table. It reads the table's sleep sequence (migration
-- 0007), 1 + the number of relays asleep on it and NULL while none is, without a query.
-- PostgreSQL inlines the function into the INSERT's plan, so a prepared INSERT pays one
-- read of the sequence a row; a trigger's WHEN condition is parsed and planned again for
-- every statement, which cost a one-row INSERT several times as much. A NOTIFY makes the
-- committing transaction hold a database-wide lock until its commit is flushed, so
-- writers that all notified would commit one at a time. PostgreSQL folds identical
-- notifications within a transaction into one.
--
-- The first test is never true: it gives the transaction its id before the sequence is
-- read. PostgreSQL computes a row's defaults before it writes the row (which is when a
-- transaction that has written nothing yet gets its id), and the relay's proof that it
-- misses no row (src/relay/sleep.rs) needs every writer that read NULL to have had its
-- id by then.
--
-- This file creates the function; `migrate` then sets the column's default to
--     <schema>.outbox_relay_nudge('<schema>.<table>_sleeping', '<schema>.<table>')
-- and drops the statement trigger releases before this one installed (`outbox_relay_wake`
-- or, before that, `outbox_relay_notify`), each only where the table differs
-- (src/source/migrate.rs): both lock the table, which a run that changes nothing must not.
-- The old triggers' functions stay (other tables of the schema may still use them until
-- they are migrated).

CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_nudge(sleeping regclass, payload text)
RETURNS integer
LANGUAGE sql VOLATILE AS $$
    SELECT CASE
        WHEN pg_catalog.pg_current_xact_id() IS NULL THEN 0
        WHEN pg_catalog.pg_sequence_last_value(sleeping) IS NULL THEN 0
        WHEN pg_catalog.pg_notify('outbox_relay', payload) IS NULL THEN 0
        ELSE 0
    END
$$;
-- Every role that inserts outbox rows calls it, also where default privileges withhold
-- EXECUTE from PUBLIC.
GRANT EXECUTE ON FUNCTION {{schema}}.outbox_relay_nudge(regclass, text) TO PUBLIC;
