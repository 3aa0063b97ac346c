//! A claim's statements: the unordered claim, the first window, the bucket reads and the
//! row locks (see `source::claim`).

use super::budgeted;
use super::parts::{Parts, Read};

/// See the fields of the same names on [`super::TableSql`].
pub(super) struct Claim {
    pub(crate) claim_unordered: String,
    pub(crate) claim_unordered_low: String,
    pub(crate) window: String,
    pub(crate) pick_lock: String,
    pub(crate) lock_rows: String,
}

pub(super) fn statements(p: &Parts, window_rows: i64) -> Claim {
    let Parts {
        t,
        id,
        next,
        size,
        columns,
        pending,
        due,
        ..
    } = p;
    Claim {
        claim_unordered: budgeted(
            &format!("{pending} AND {due} AND {id} >= (SELECT $2::bigint)"),
            columns,
            t,
            id,
            size,
        ),
        claim_unordered_low: budgeted(
            &format!(
                "{id} = ANY ({}) AND {pending} AND {next} IS NOT NULL AND {next} <= now()",
                p.held_ids("d.dead_at IS NULL AND d.next_attempt_at <= now() AND d.id < $2")
            ),
            columns,
            t,
            id,
            size,
        ),
        window: window(p, window_rows),
        pick_lock: pick_lock(p),
        lock_rows: format!(
            "SELECT {columns} FROM {t} WHERE {id} = ANY($1::bigint[]) AND {pending} \
             AND {due} ORDER BY {id} FOR UPDATE SKIP LOCKED"
        ),
    }
}

/// The first window: pending `(id, key)` pairs in order from the floor, with the
/// stragglers and retried rows below it.
///
/// Its read's limit written in, its floor and stragglers hidden: see
/// [`super::TableSql::window_rows`].
/// One statement, so one snapshot: a window read in two statements could see a
/// row's key released in one and not the other, and take a later row for its head.
/// The two parts are materialized and sorted together: as a UNION ALL under a
/// Merge Append, the same scans ran several times slower in the relay.
fn window(p: &Parts, window_rows: i64) -> String {
    let Parts {
        t,
        id,
        key,
        obucket,
        ..
    } = p;
    let window_filter = p.claim_filter(Read::Window, Some("$2::bigint"));
    format!(
        "WITH {held_keys}, \
         {low}, \
         main AS MATERIALIZED (SELECT o.{id}::bigint AS id, o.{key}::text AS key, \
         {osize} AS size, {obucket} AS bucket, {odue} AS due \
         FROM {t} o WHERE o.{id} >= (SELECT $2::bigint) AND {window_filter} \
         ORDER BY o.{id} LIMIT {window_rows}), \
         read AS (SELECT id, key, size, bucket, due FROM low UNION ALL \
         SELECT id, key, size, bucket, due FROM main), {blockers} \
         {taken} ORDER BY id LIMIT $1",
        odue = p.odue(),
        blockers = Parts::blockers("read"),
        taken = Parts::blocked_in("read"),
        held_keys = p.held_keys(Read::Window),
        low = low(
            p,
            Read::Window,
            "(SELECT $2::bigint)",
            "(SELECT $3::bigint[])::bigint[]"
        ),
        osize = p.size_of("o."),
    )
}

/// The bucket read of a pick: the buckets first (a MATERIALIZED CTE, its rows pulled in
/// order until `$7` are got: the lock function runs once per bucket tried), then each
/// bucket's rows through the bucket index (a nested loop over the buckets got, one index
/// range each); the rows below the floor (few) filtered by bucket.
///
/// The floor bound is written as a row comparison on the bucket index's two
/// columns, `(bucket, id) >= (b, floor)`: only that index can start a scan there.
/// Written `id >= floor`, the pending index (on `id`) could answer it too, reading
/// every bucket's rows in id order and filtering, and on a table with no
/// statistics yet (filled since the last ANALYZE: the planner takes the default
/// 0.5 % for `published_at IS NULL`, so both indexes look equally tiny) it did,
/// reading and dropping dozens of rows for each one kept, most of a drain's
/// statement time (found with auto_explain in benchmark L).
/// With the row comparison the bucket index is chosen with or without
/// statistics (checked with EXPLAIN both ways).
///
/// The per-bucket limit is hidden from the planner, `(SELECT $2)`, as in the generic
/// plan a session keeps after five runs. Seen as a value, in the custom plans of a
/// session's first five picks, a limit near the planner's estimate of a bucket's rows
/// (it estimates far fewer rows than a deep bucket holds) made it read each
/// bucket whole, a bitmap scan, and sort it: many times the rows it keeps, read, and
/// a pick several times as slow as in the generic plan. Relays started at once open
/// many sessions, so many of their picks were such first picks. (The relay's sessions
/// now force the generic plan, see `source::session::settings`; hidden, the limit
/// keeps the plan in any session.)
fn pick_read(p: &Parts) -> String {
    let Parts {
        t,
        id,
        key,
        attempts,
        obucket,
        ..
    } = p;
    let bucket_filter = p.claim_filter(Read::Buckets, Some("$4::bigint"));
    format!(
        "WITH pick AS MATERIALIZED (SELECT c.b FROM unnest($3::int4[]) AS c(b) \
         WHERE pg_try_advisory_xact_lock($6::int4, c.b) LIMIT $7), {held_keys}, \
         {low}, \
         main AS MATERIALIZED (SELECT w.id, w.key, w.size, w.bucket, w.due \
         FROM pick, LATERAL (SELECT o.{id}::bigint AS id, \
         o.{key}::text AS key, {osize} AS size, pick.b AS bucket, {odue} AS due FROM {t} o \
         WHERE {obucket} = pick.b AND o.{attempts} >= 0 \
         AND ({obucket}, o.{id}) >= (pick.b, (SELECT $4::bigint)) AND {bucket_filter} \
         ORDER BY o.{id} LIMIT (SELECT $2::int8)) w), \
         read AS (SELECT id, key, size, bucket, due FROM low \
         WHERE bucket IN (SELECT b FROM pick) \
         UNION ALL SELECT id, key, size, bucket, due FROM main), {blockers}, \
         seen AS ({taken})",
        odue = p.odue(),
        blockers = Parts::blockers("read"),
        taken = Parts::blocked_in("read"),
        held_keys = p.held_keys(Read::Buckets),
        low = low(p, Read::Buckets, "$4", "$5::bigint[]"),
        osize = p.size_of("o."),
    )
}

/// The `low` CTE of a read (the window or a bucket read): the rows below the floor it may
/// take, the floor's stragglers (ids in `stragglers`) and the rows with a failure history
/// below `floor` (`Parts::stragglers_part`, `Parts::retry_part`), each with the read's own
/// filter.
fn low(p: &Parts, read: Read, floor: &str, stragglers: &str) -> String {
    let Parts {
        t,
        id,
        key,
        obucket,
        ..
    } = p;
    let filter = p.claim_filter(read, None);
    format!(
        "low AS MATERIALIZED (SELECT o.{id}::bigint AS id, o.{key}::text AS key, \
         {osize} AS size, {obucket} AS bucket, {odue} AS due FROM {t} o WHERE {straggling} \
         AND {filter} \
         UNION ALL SELECT o.{id}::bigint, o.{key}::text, {osize}, {obucket}, {odue} \
         FROM {t} o WHERE {retrying} AND {filter})",
        odue = p.odue(),
        osize = p.size_of("o."),
        straggling = p.stragglers_part("o.", stragglers),
        retrying = p.retry_part("o.", floor, stragglers),
    )
}

/// The bucket read (`pick_read`, above), and in the same statement the row locks on
/// the first `$8` rows read (in id order) that are still pending and due,
/// `SKIP LOCKED`. It answers three kinds of rows, told apart by which columns are NULL:
/// each row locked (its columns, then four NULLs), each row read (NULLs, then its
/// candidate columns), each bucket got (NULLs, then the bucket). One round trip where a
/// pick and its lock round took two (`source::claim`, *Round trips*). The rows locked
/// and the rows read are not joined in SQL: the planner, which cannot tell how many rows
/// a pick reads, took a nested loop for that join, comparing every row read with every
/// row locked.
fn pick_lock(p: &Parts) -> String {
    let Parts {
        t,
        columns,
        pending,
        due,
        id,
        ..
    } = p;
    let pick_read = pick_read(p);
    format!(
        "{pick_read}, locked ({names}) AS MATERIALIZED (SELECT {columns} FROM {t} \
         WHERE {id} = ANY (ARRAY(SELECT id FROM (SELECT id, size, sum(size) \
         OVER (ORDER BY id ROWS UNBOUNDED PRECEDING) AS run FROM seen) r \
         WHERE run - size < $9::bigint ORDER BY id LIMIT $8)) \
         AND {pending} AND {due} ORDER BY {id} FOR UPDATE SKIP LOCKED) \
         SELECT l.*, NULL, NULL, NULL, NULL FROM locked l \
         UNION ALL SELECT {nulls}, s.id, s.key, s.size, s.bucket FROM seen s \
         UNION ALL SELECT {nulls}, NULL, NULL, NULL, b FROM pick",
        names = (0..p.layout.width())
            .map(|i| format!("c{i}"))
            .collect::<Vec<_>>()
            .join(", "),
        nulls = vec!["NULL"; p.layout.width()].join(", "),
    )
}
