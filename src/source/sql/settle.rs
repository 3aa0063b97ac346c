//! What a batch writes when it ends: published rows deleted or marked, failures
//! recorded, rows postponed.

use super::parts::Parts;

/// See the fields of the same names on [`super::TableSql`].
pub(super) struct Settle {
    pub(crate) delete: String,
    pub(crate) mark: String,
    pub(crate) record_failures: String,
    pub(crate) postpone: String,
    pub(crate) release_postponed: String,
}

pub(super) fn statements(p: &Parts) -> Settle {
    let Parts {
        t,
        id,
        published_at,
        dead_at,
        attempts,
        last_error,
        next,
        ..
    } = p;
    Settle {
        delete: format!("DELETE FROM {t} WHERE {id} = ANY($1::bigint[])"),
        mark: format!("UPDATE {t} SET {published_at} = now() WHERE {id} = ANY($1::bigint[])"),
        record_failures: format!(
            "UPDATE {t} AS o SET {attempts} = o.{attempts} + 1, {last_error} = f.err, \
             {dead_at} = CASE WHEN o.{attempts} + 1 >= $3 THEN now() END, \
             {next} = CASE WHEN o.{attempts} + 1 < $3 \
             THEN clock_timestamp() + f.wait * interval '1 microsecond' END \
             FROM unnest($1::bigint[], $2::text[], $4::int8[]) AS f(id, err, wait) \
             WHERE o.{id} = f.id \
             RETURNING o.{id}::bigint, o.{dead_at} IS NOT NULL"
        ),
        postpone: format!(
            "UPDATE {t} AS o SET {last_error} = f.err, \
             {next} = clock_timestamp() + f.wait * interval '1 microsecond' \
             FROM unnest($1::bigint[], $2::text[], $3::int8[]) AS f(id, err, wait) \
             WHERE o.{id} = f.id"
        ),
        // Only the rows waiting for a retry are read (found in `outbox_relay_held`).
        release_postponed: format!(
            "UPDATE {t} SET {next} = now() WHERE {id} = ANY ({}) AND {published_at} IS NULL \
             AND {dead_at} IS NULL AND {next} > now() \
             AND starts_with({last_error}, $1::text)",
            p.held_ids("d.dead_at IS NULL AND d.next_attempt_at > now()")
        ),
    }
}
