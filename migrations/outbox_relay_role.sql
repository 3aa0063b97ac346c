-- The least-privilege role for `outbox-relay run`, `drain`, `check`, `status` and
-- `requeue`: exactly what their statements need, nothing else. No TRUNCATE, no DDL, no
-- INSERT, not a superuser, cannot create roles or databases.
--
-- `outbox-relay migrate` creates tables, indexes and a trigger, so run it as the table's
-- owner, not as this role.
--
-- Run as a superuser (or the outbox table's owner with CREATEROLE), in the application's
-- database, after `outbox-relay migrate`:
--     psql -v ON_ERROR_STOP=1 -d app -f migrations/outbox_relay_role.sql
-- then give the role a password (psql prompts; it never lands in a file or the history):
--     \password outbox_relay
-- For another table, schema or mapped column names ([tables.columns]), change the names
-- below and repeat the GRANTs on the outbox for each table (those on the outbox_relay_ tables
-- once per schema). `outbox-relay check` names any
-- privilege that is still missing.

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'outbox_relay') THEN
        CREATE ROLE outbox_relay LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION
            NOBYPASSRLS;
    END IF;
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO outbox_relay', current_database());
END
$$;

GRANT USAGE ON SCHEMA public TO outbox_relay;
-- Read the rows to publish; DELETE is needed with on_publish = "delete", and in mark mode
-- only with relay.retention (it deletes old published rows): revoke it otherwise.
GRANT SELECT, DELETE ON public.outbox TO outbox_relay;
-- The bookkeeping columns: published_at (on_publish = "mark"), attempts, last_error,
-- dead_at and next_attempt_at (failures, the retry schedule, dead-lettering, `requeue`).
-- Row locks (FOR UPDATE) need UPDATE on at least one column, which this gives.
GRANT UPDATE (published_at, attempts, last_error, dead_at, next_attempt_at)
    ON public.outbox TO outbox_relay;
-- Pause state (migration 0005), one table per schema: `pause` and the bad-row valve insert
-- a row, `resume` deletes it, every relay reads it.
GRANT SELECT, INSERT, DELETE ON public.outbox_relay_pauses TO outbox_relay;
-- Rate buckets (migration 0006), one table per schema: only tables with `max_rate` use it.
GRANT SELECT, INSERT, UPDATE ON public.outbox_relay_rates TO outbox_relay;
-- Sleep marks (migration 0007): an idle relay marks itself asleep in the schema's table
-- and sets the outbox table's sleep sequence, so that writers notify only while a relay
-- sleeps. Not needed after `migrate --no-notify`.
GRANT SELECT, INSERT, UPDATE, DELETE ON public.outbox_relay_sleepers TO outbox_relay;
GRANT UPDATE ON SEQUENCE public.outbox_sleeping TO outbox_relay;
-- Held rows (migration 0008): claims read there which keys are held back. The outbox's
-- triggers write it, with their owner's rights: the relay only reads.
GRANT SELECT ON public.outbox_relay_held TO outbox_relay;
-- Optional: lets the relay see other roles' sessions in pg_stat_activity, so the
-- outbox_relay_oldest_snapshot_age_seconds gauge and its WARN can name a session of any
-- role that keeps VACUUM from cleaning the table (read-only statistics, no data).
-- GRANT pg_monitor TO outbox_relay;
