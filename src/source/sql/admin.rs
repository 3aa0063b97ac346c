//! The operator's and the probe's statements: what is left and held, re-queue and
//! replay, the backlog gauge.

use super::parts::Parts;
use crate::config::Ordering;

/// See the fields of the same names on [`super::TableSql`], by group.
pub(super) struct Admin {
    pub(crate) probes: Probes,
    pub(crate) status: Status,
    pub(crate) requeue: Requeue,
    pub(crate) replay: Replay,
}

/// What is left to publish, read by the probe, `drain`, the poller and the metrics:
/// `any_row`, `publishable_exists`, `claimable`, `waiting`, `backlog`.
pub(super) struct Probes {
    pub(crate) any_row: String,
    pub(crate) publishable_exists: String,
    pub(crate) claimable: (String, String),
    pub(crate) waiting: String,
    pub(crate) backlog: String,
}

/// `status`: `status` and `held_rows`.
pub(super) struct Status {
    pub(crate) status: String,
    pub(crate) held_rows: String,
}

/// `requeue`: `requeue_ids`, `requeue_waiting`, `requeue_all`.
pub(super) struct Requeue {
    pub(crate) ids: String,
    pub(crate) waiting: String,
    pub(crate) all: String,
}

/// `replay`: `replay_ids`, `replay_range`, `replay_count`, `replay_hold_ids`,
/// `replay_hold_range`, `replay_release`.
pub(super) struct Replay {
    pub(crate) ids: String,
    pub(crate) range: Option<String>,
    pub(crate) count: Option<String>,
    pub(crate) hold_ids: Option<String>,
    pub(crate) hold_range: Option<String>,
    pub(crate) release: String,
}

/// The next attempt of a row `replay` holds: far enough never to come, finite so that
/// `now()` can be subtracted from it (PostgreSQL before 17 cannot subtract an infinite
/// timestamp), and a value no backoff ever sets, so a hold is told by it alone.
const REPLAY_HOLD: &str = "'9999-12-31 00:00:00+00'::timestamptz";

pub(super) fn statements(p: &Parts) -> Admin {
    Admin {
        probes: probes(p),
        status: status(p),
        requeue: requeue(p),
        replay: replay(p),
    }
}

fn probes(p: &Parts) -> Probes {
    let Parts {
        t,
        id,
        key,
        published_at,
        dead_at,
        pending,
        due,
        not_behind_dead,
        low_stragglers,
        low_retrying,
        created_at,
        ordering,
        held_rows,
        of_table,
        ..
    } = p;
    Probes {
        any_row: format!("EXISTS (SELECT 1 FROM {t})"),
        claimable: (
            format!("(EXISTS (SELECT 1 FROM {t} WHERE {pending} AND {due} AND {id} >= (SELECT "),
            format!(
                "::bigint)) OR EXISTS (SELECT 1 FROM {held_rows} WHERE {of_table} \
                 AND d.dead_at IS NULL AND d.next_attempt_at <= now()))"
            ),
        ),
        publishable_exists: match ordering {
            Ordering::Key => format!(
                "SELECT EXISTS (SELECT 1 FROM {t} o WHERE o.{published_at} IS NULL \
                 AND o.{dead_at} IS NULL AND (o.{key} IS NULL OR {not_behind_dead}))"
            ),
            Ordering::None => format!("SELECT EXISTS (SELECT 1 FROM {t} WHERE {pending})"),
        },
        waiting: format!(
            "SELECT count(*), (min(d.next_attempt_at) - now())::text, \
             extract(epoch FROM min(d.next_attempt_at) - now())::float8 FROM {held_rows} \
             WHERE {of_table} AND d.dead_at IS NULL AND d.next_attempt_at > now()"
        ),
        backlog: format!(
            "SELECT (SELECT count(*) FROM {t} WHERE {pending} AND {id} >= (SELECT $1::bigint)) \
             + (SELECT count(*) FROM {t} WHERE {pending} AND {low_stragglers}) \
             + (SELECT count(*) FROM {t} WHERE {pending} AND {low_retrying}), \
             COALESCE(({}), 0)::float8",
            match created_at {
                Some(c) => format!(
                    "SELECT extract(epoch FROM now() - LEAST(\
                     (SELECT {c} FROM {t} WHERE {pending} AND {id} >= (SELECT $1::bigint) \
                     ORDER BY {id} LIMIT 1), \
                     (SELECT min({c}) FROM {t} WHERE {pending} AND {low_stragglers}), \
                     (SELECT min({c}) FROM {t} WHERE {pending} AND {low_retrying})))",
                    c = c.quoted()
                ),
                None => "NULL".to_owned(),
            }
        ),
    }
}

fn status(p: &Parts) -> Status {
    let Parts {
        t,
        id,
        key,
        published_at,
        dead_at,
        attempts,
        last_error,
        next,
        pending,
        held,
        waiting,
        held_back,
        created_at,
        held_rows,
        ..
    } = p;
    Status {
        status: format!(
            "SELECT count(*) FILTER (WHERE {pending}), \
             count(*) FILTER (WHERE {pending} AND {attempts} > 0), \
             count(*) FILTER (WHERE {dead_at} IS NOT NULL AND {published_at} IS NULL), \
             count(*) FILTER (WHERE {published_at} IS NOT NULL), \
             count(*) FILTER (WHERE {waiting}), \
             min({next}) FILTER (WHERE {waiting})::text, \
             {held_back}, {} FROM {t} o",
            match created_at {
                Some(c) => format!(
                    "extract(epoch FROM now() - min({}) FILTER (WHERE {pending}))::float8",
                    c.quoted()
                ),
                None => "NULL::float8".to_owned(),
            }
        ),
        held_rows: format!(
            "SELECT d.{id}::bigint, d.{attempts}::bigint, d.{dead_at}::text, \
             d.{next}::text, d.{last_error}::text, d.{key}::text, \
             (SELECT count(*) FROM {t} o WHERE o.{key} = d.{key} AND o.{id} > d.{id} \
             AND o.{published_at} IS NULL AND o.{dead_at} IS NULL) \
             FROM (SELECT d.id FROM {held_rows} WHERE {held} ORDER BY d.id LIMIT $1) h \
             JOIN {t} d ON d.{id} = h.id ORDER BY d.{id}"
        ),
    }
}

fn requeue(p: &Parts) -> Requeue {
    let Parts {
        t,
        id,
        published_at,
        dead_at,
        attempts,
        next,
        waiting,
        ..
    } = p;
    Requeue {
        // Released rows keep `next_attempt_at` (due now), and with it their place in the
        // held rows until published: see `held_in_window`.
        ids: format!(
            "UPDATE {t} SET {dead_at} = NULL, {attempts} = 0, {next} = now() \
             WHERE {id} = ANY($1::bigint[]) AND {dead_at} IS NOT NULL \
             AND {published_at} IS NULL RETURNING {id}::bigint"
        ),
        waiting: format!(
            "UPDATE {t} SET {next} = now() WHERE {id} = ANY ({}) AND {waiting} \
             RETURNING {id}::bigint",
            p.held_ids("d.dead_at IS NULL AND d.next_attempt_at > now()")
        ),
        all: format!(
            "UPDATE {t} SET {dead_at} = NULL, {attempts} = 0, {next} = now() \
             WHERE {id} = ANY ({}) AND {dead_at} IS NOT NULL AND {published_at} IS NULL \
             RETURNING {id}::bigint",
            p.held_ids("d.dead_at IS NOT NULL")
        ),
    }
}

fn replay(p: &Parts) -> Replay {
    let Parts {
        t,
        id,
        published_at,
        dead_at,
        attempts,
        last_error,
        next,
        pending,
        created_at,
        ordering,
        ..
    } = p;
    Replay {
        // Like requeue, a replayed row is due now with `next_attempt_at` set, not NULL:
        // that is how claims find it below the claim floor (in `outbox_relay_held`) and how
        // bucket reads past a first window hold its key's later pending rows back until
        // it is published.
        ids: format!(
            "WITH chosen AS (SELECT {id} FROM {t} WHERE {id} = ANY($1::bigint[]) \
             AND {published_at} IS NOT NULL AND {dead_at} IS NULL), \
             replayed AS (UPDATE {t} SET {published_at} = NULL, {attempts} = 0, \
             {last_error} = NULL, {next} = now() \
             WHERE {id} = ANY (ARRAY(SELECT {id} FROM chosen)) AND NOT $2::bool RETURNING {id}) \
             SELECT {id}::bigint FROM chosen ORDER BY 1"
        ),
        // The first of `replay`'s transactions: each key's first row to replay is pending
        // and held (waiting for an attempt that never comes), so that from its commit on
        // every later row of the key, the ones replay makes pending next and the ones
        // committed while it runs, is held back behind it (`held`, see
        // `Parts::not_held_back`) until `replay_release`. Rows without a key carry no
        // order, and without key order nothing is held back: neither is held.
        hold_ids: (*ordering == Ordering::Key)
            .then(|| hold(p, &format!("{id} = ANY($1::bigint[])"))),
        hold_range: match (ordering, created_at) {
            (Ordering::Key, Some(c)) => Some(hold(
                p,
                &format!(
                    "{c} >= $1::text::timestamptz AND {c} < $2::text::timestamptz",
                    c = c.quoted()
                ),
            )),
            _ => None,
        },
        // The last: every held row is due now. Every hold, this replay's and one a replay
        // that stopped part way left (run it again to finish it): see docs/operations.md.
        release: format!(
            "UPDATE {t} SET {next} = now() WHERE {id} = ANY ({}) AND {pending} \
             AND {next} = {REPLAY_HOLD} RETURNING {id}::bigint",
            p.held_ids(&format!("d.next_attempt_at = {REPLAY_HOLD}"))
        ),
        // `until` is never later than now, the replay's start: rows committed while it
        // runs are not replayed (those of keys it does not hold could be published by then).
        count: created_at.as_ref().map(|c| {
            format!(
                "SELECT count(*), to_char(LEAST($2::text::timestamptz, now()) \
                 AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
                 FROM {t} WHERE {published_at} IS NOT NULL AND {dead_at} IS NULL \
                 AND {c} >= $1::text::timestamptz \
                 AND {c} < LEAST($2::text::timestamptz, now())",
                c = c.quoted()
            )
        }),
        range: created_at.as_ref().map(|c| {
            format!(
                "SELECT {id}::bigint FROM {t} WHERE {published_at} IS NOT NULL \
                 AND {dead_at} IS NULL AND {c} >= $1::text::timestamptz \
                 AND {c} < $2::text::timestamptz AND {id} > $3::bigint \
                 ORDER BY {id} LIMIT $4",
                c = c.quoted()
            )
        }),
    }
}

/// `replay`'s hold: the first row of each key among the rows kept as published (not dead)
/// that `candidates` selects is pending again and waits for [`REPLAY_HOLD`]; returns their
/// order values.
fn hold(p: &Parts, candidates: &str) -> String {
    let Parts {
        t,
        id,
        key,
        published_at,
        dead_at,
        attempts,
        last_error,
        next,
        ..
    } = p;
    let kept = format!("{published_at} IS NOT NULL AND {dead_at} IS NULL");
    format!(
        "UPDATE {t} SET {published_at} = NULL, {attempts} = 0, {last_error} = NULL, \
         {next} = {REPLAY_HOLD} WHERE {id} = ANY (ARRAY(SELECT DISTINCT ON ({key}) {id} FROM {t} \
         WHERE {candidates} AND {kept} AND {key} IS NOT NULL ORDER BY {key}, {id})) \
         AND {kept} RETURNING {id}::bigint"
    )
}
