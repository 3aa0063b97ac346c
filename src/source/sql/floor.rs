//! The claim floor's statements: its look, the release of withheld keys and the sweep
//! (see `source::floor`).

use super::parts::{Parts, Read};
use super::LOOK_LIMIT;
use crate::config::Ordering;

/// See the fields of the same names on [`super::TableSql`].
pub(super) struct Floor {
    pub(crate) advance: String,
    pub(crate) withheld_released: String,
    pub(crate) sweep: String,
}

pub(super) fn statements(p: &Parts) -> Floor {
    let Parts {
        t,
        id,
        key,
        retrying,
        fresh,
        held_back_row,
        held_rows,
        published_at,
        dead_at,
        next,
        of_table,
        ..
    } = p;
    let (held_keys, not_held_back) = match p.ordering {
        Ordering::Key => (
            format!("{}, ", p.held_keys(Read::FloorLook)),
            p.not_held_back(Read::FloorLook, Some("$1::bigint")),
        ),
        Ordering::None => (String::new(), "true".to_owned()),
    };
    Floor {
        // One statement, so one snapshot: pg_current_snapshot() is the statement's own.
        // The candidate is the first fresh row not held back; the rows before it are
        // all held back (read only up to it, at most `$2`).
        // Held back or not: see `Parts::not_held_back` (without key order, nothing is, and
        // the statement lists no held keys).
        // A candidate inserted with `next_attempt_at` in the future (a scheduled publish)
        // is fresh only until it has its row in `outbox_relay_held`: `m` gives it one (its
        // UPDATE fires the trigger), so the next look passes it and claims find it there.
        // A data-modifying CTE runs once whether or not the statement reads it.
        advance: format!(
            "WITH {held_keys}c AS MATERIALIZED (SELECT o.{id}::bigint AS id FROM {t} o \
             WHERE {fresh} AND o.{id} >= (SELECT $1::bigint) AND {not_held_back} \
             ORDER BY o.{id} LIMIT 1), \
             m AS (UPDATE {t} SET {next} = {next} WHERE {id} = (SELECT id FROM c) \
             AND {published_at} IS NULL AND {dead_at} IS NULL AND {next} > now()), \
             h AS MATERIALIZED (SELECT o.{id}::bigint AS id, o.{key}::text AS key FROM {t} o \
             WHERE {fresh} AND o.{id} >= (SELECT $1::bigint) \
             AND o.{id} < COALESCE((SELECT id FROM c), 9223372036854775807) \
             ORDER BY o.{id} LIMIT {LOOK_LIMIT}) \
             SELECT pg_snapshot_xmin(pg_current_snapshot())::text::int8, \
             pg_snapshot_xmax(pg_current_snapshot())::text::int8, \
             EXISTS (SELECT 1 FROM {t} WHERE {retrying}), \
             (SELECT id FROM c), \
             ARRAY(SELECT id FROM h ORDER BY id), \
             ARRAY(SELECT o.{id}::bigint FROM {t} o \
             WHERE o.{id} = ANY((SELECT $2::bigint[])::bigint[]) AND {fresh}), \
             ARRAY(SELECT key FROM h ORDER BY id), \
             s.keys, s.firsts FROM (SELECT array_agg(k) AS keys, array_agg(f) AS firsts \
             FROM (SELECT o.{key}::text AS k, min(o.{id})::bigint AS f FROM {t} o \
             WHERE (SELECT $3::bool) AND {fresh} AND o.{id} >= (SELECT $1::bigint) \
             AND o.{id} < COALESCE((SELECT id FROM c), 9223372036854775807) \
             GROUP BY o.{key}) g) s",
        ),
        // The keys come as text whatever the column's type, as `outbox_relay_held` keeps them.
        withheld_released: format!(
            "SELECT h.k FROM unnest($1::text[], $2::int8[]) AS h(k, w) \
             WHERE NOT EXISTS (SELECT 1 FROM {held_rows} WHERE {of_table} AND d.key = h.k \
             AND (d.id + 0) < h.w)"
        ),
        sweep: format!(
            "SELECT o.{id}::bigint, {held_back_row}, o.{key}::text FROM {t} o WHERE {fresh} \
             AND o.{id} >= (SELECT $1::bigint) AND o.{id} < (SELECT $2::bigint) \
             AND o.{id} <> ALL($3::bigint[]) \
             ORDER BY o.{id} LIMIT $4"
        ),
    }
}
