//! Retention's statement (mark mode, see `source::retention`).

use super::parts::Parts;

/// See the fields of the same names on [`super::TableSql`].
pub(super) struct Retention {
    pub(crate) retire: Option<String>,
}

pub(super) fn statements(p: &Parts) -> Retention {
    let Parts {
        t,
        id,
        published_at,
        created_at,
        ..
    } = p;
    Retention {
        retire: created_at.as_ref().map(|created_at| {
            let cutoff = "now() - $3::float8 * interval '1 second'";
            format!(
                "WITH chunk AS MATERIALIZED (SELECT {id}::bigint AS id, \
                 {published_at} < {cutoff} AS old, {created_at} >= {cutoff} AS young, \
                 {published_at} >= {cutoff} AS ripening \
                 FROM {t} WHERE {id} > (SELECT $1::bigint) ORDER BY {id} LIMIT $2), \
                 gone AS (DELETE FROM {t} WHERE {id} = ANY (ARRAY(SELECT o.{id} FROM {t} o \
                 WHERE o.{id} = ANY(ARRAY(SELECT id FROM chunk WHERE old)) \
                 AND o.{published_at} < {cutoff} FOR UPDATE SKIP LOCKED)) RETURNING 1) \
                 SELECT (SELECT max(id) FROM chunk), (SELECT count(*) FROM chunk), \
                 (SELECT count(*) FROM gone), \
                 COALESCE((SELECT bool_or(young) FROM chunk), false), \
                 COALESCE((SELECT bool_or(ripening) FROM chunk), false), \
                 (SELECT count(*) FROM chunk WHERE old)",
                created_at = created_at.quoted()
            )
        }),
    }
}
