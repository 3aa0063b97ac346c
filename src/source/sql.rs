//! Every statement the relay runs against an outbox table, built once at start-up from the
//! validated configuration. Identifiers are quoted by [`crate::config::Ident`]; every value
//! is a bound parameter.

use crate::config::{Ordering, TableConfig};

use super::schema::{PayloadType, TableShape};

/// Below every order value: the `after` of a claim's bucket reads when the claim read no
/// first window (they read like one), and where walks of the table start.
pub const FIRST_WINDOW: i64 = i64::MIN;

/// Fresh rows the floor's look reads at most (`super::floor`'s walk: its straggler cap plus
/// one). Written into [`TableSql::advance`] rather than bound, and the stragglers bound as
/// `(SELECT $2)`: with every value the planner could use fixed or hidden, the look's
/// custom and generic plans cost the same, so PostgreSQL keeps the generic plan after five
/// runs instead of planning every look, 40 times a second per relay process and table
/// while rows flow. (A custom plan saw the usually empty straggler list and costed its
/// index probe at a tenth of the generic plan's: every look was planned, 2,424 plans for
/// 2,376 looks in a drain by 8 relays.)
pub const LOOK_LIMIT: usize = 1001;

/// Key buckets: a key's bucket is `hashtext(key) & (BUCKETS - 1)`, as the bucket index
/// of migration 0004 computes it (see [`bucket_of`]).
pub const BUCKETS: i32 = 64;

/// A row's key bucket, exactly as `migrations/0004_bucket_index.concurrent.sql` writes it
/// (PostgreSQL uses the index only for the same expression). `o` is a table alias with
/// its dot, or empty.
pub fn bucket_of(o: &str, key: &str, id: &str) -> String {
    format!(
        "((COALESCE(hashtext(({o}{key})::text COLLATE \"C\")::int8, ({o}{id})::int8) & {})::int4)",
        BUCKETS - 1
    )
}

/// Statements for one outbox table.
#[derive(Debug, Clone)]
pub struct TableSql {
    /// `ordering = "none"`: lock the oldest pending rows that are due from the floor `$2`
    /// on, skipping locked ones, at most `$1`, and return those whose payloads add up to
    /// at most `$3` bytes (the first one whatever its size when `$4`). Returns rows as
    /// [`RowLayout`] describes.
    pub claim_unordered: String,
    /// `ordering = "none"`: the same for rows below the floor `$2` with a failure history
    /// (the retry index).
    pub claim_unordered_low: String,
    /// `ordering = "key"`, a claim's first window: order values, keys, payload sizes and
    /// buckets of the oldest pending, due rows, at most `$1`, without locking, leaving out
    /// rows held back by an earlier held row of their key (dead, or waiting for its next
    /// attempt). Rows are read from the floor `$2` on, and below it only the stragglers
    /// `$3` and rows with a failure history (see [`super::floor`]).
    pub window: String,
    /// `ordering = "key"`, a claim's buckets, past a deep first window ending at `$1`
    /// ([`FIRST_WINDOW`] when the claim read none): takes the advisory locks (table tag
    /// `$6`) of the first `$7` buckets in `$3` (in that order) that no other transaction
    /// holds, and returns each one's pending, due rows from the floor `$4` on, at most `$2`
    /// a bucket, read through the bucket index, with the stragglers `$5` and the rows with
    /// a failure history below the floor, in no particular order; and one row per bucket
    /// got with a NULL order value. Rows up to `$1` are read again on purpose (see
    /// *Buckets* in `claim.rs`). Rows held back are left out as in
    /// [`TableSql::window`], and past a first window also those behind a row with a
    /// failure history (see `held_in_window`).
    pub pick_window: String,
    /// The floor's look at the table, one snapshot: its xmin and xmax, whether any pending
    /// row has a failure history, the first pending row without one from the floor `$1`
    /// on that no earlier held row of its key holds back (the candidate), the rows without
    /// one before it (all held back) at most [`LOOK_LIMIT`], which of the stragglers `$2`
    /// are still pending without one, and the keys of those held-back rows (as text); when
    /// `$3`, also every held-back row's key before the candidate, each with its first id
    /// (two arrays, without the cap: for the floor's withheld keys).
    pub advance: String,
    /// The floor's sweep: pending rows without a failure history in `[$1, $2)`, leaving
    /// out the stragglers `$3`, at most `$4`, in order, with whether each is held back and
    /// its key.
    pub sweep: String,
    /// The floor's withheld keys `$1` (each hidden from `$2`, the same position) that are
    /// released: no row of the key below that id is dead or has a failure history.
    pub withheld_released: String,
    /// Locks the rows `$1` (order values) that are still pending and due, skipping locked
    /// ones.
    /// Returns rows as [`RowLayout`] describes.
    pub lock_rows: String,
    /// Deletes the published rows `$1`.
    pub delete: String,
    /// Sets `published_at` on the published rows `$1`.
    pub mark: String,
    /// Counts one failed attempt for rows `$1` with errors `$2`; dead-letters those that
    /// reach `$3` attempts, and gives the others their next attempt `$4` microseconds from
    /// now. Returns each row's order value and whether it is now dead.
    pub record_failures: String,
    /// A row at its last attempt that could not reach its dead-letter topic: waits like a
    /// retry (`$1` ids, `$2` errors, `$3` microseconds), its attempt not counted.
    pub postpone: String,
    /// Whether any row is left that a relay could publish now or after a wait: pending,
    /// and (key order) not held back by a dead row.
    pub publishable_exists: String,
    /// Rows waiting for their next attempt: how many, and the earliest one due in (as
    /// interval text and seconds).
    pub waiting: String,
    /// `status`: pending, failing (pending with attempts), dead, kept-published and
    /// waiting counts, the earliest next attempt as text, the pending rows held back by
    /// a held row of their key, and the oldest pending row's age in seconds (NULL
    /// without `created_at`).
    pub status: String,
    /// `status`: the oldest held rows (dead or waiting), at most `$1`: order value,
    /// attempts, dead_at and next_attempt_at as text, last_error, key, and how many later
    /// pending rows of its key it holds back.
    pub held_rows: String,
    /// `requeue --id`: clears dead_at and attempts of the dead rows `$1`; returns their
    /// order values.
    pub requeue_ids: String,
    /// `requeue --all`: the same for every dead row.
    pub requeue_all: String,
    /// `requeue --waiting`: rows waiting for their next attempt are due now.
    pub requeue_waiting: String,
    /// `replay`: the rows `$1` kept as published (not dead) are pending and due again;
    /// returns their order values. `$2`: count only (`--dry-run`), change nothing.
    pub replay_ids: String,
    /// `replay --since/--until`: order values after `$3`, at most `$4`, of rows kept as
    /// published (not dead) created in [`$1`, `$2`) (RFC 3339 text), in order. `None`
    /// without a creation-time column.
    pub replay_range: Option<String>,
    /// Metrics: pending rows and the oldest pending row's age in seconds (0 when none or
    /// without a creation-time column), read like a claim from the floor `$1` and below it
    /// the stragglers `$2` and rows with a failure history, so it costs what a claim costs.
    pub backlog: String,
    /// Retention (mark mode, [`super::retention`]): looks at the `$2` rows after `$1` in
    /// order and deletes those published more than `$3` seconds ago, skipping rows locked
    /// by others. Returns the chunk's last order value (NULL when empty), its row count,
    /// rows deleted, whether it holds a row created within the last `$3` seconds, whether
    /// it holds a row published within them, and how many of its rows were old enough
    /// (those beyond the rows deleted were locked).
    /// `None` without a creation-time column (retention needs one, checked at start-up).
    pub retire: Option<String>,
    pub layout: RowLayout,
    /// The first key of this table's bucket advisory locks (the second is the bucket).
    pub tag: i32,
}

/// The first key of a table's bucket advisory locks: FNV-1a of its qualified name, the
/// same in every relay of every release that has buckets (no PostgreSQL hash in it).
pub fn table_tag(name: &str) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h as i32
}

/// A locking claim of the rows `filter` selects, in order, that returns only the prefix
/// within the byte budget. Sizes are read under the lock, payloads only for the rows
/// returned; rows locked beyond the budget stay pending and are let go at commit.
fn budgeted(filter: &str, columns: &str, t: &str, id: &str, size: &str) -> String {
    format!(
        "WITH locked AS MATERIALIZED (SELECT {id} AS id, {size} AS size FROM {t} \
         WHERE {filter} ORDER BY {id} LIMIT $1 FOR UPDATE SKIP LOCKED), \
         picked AS (SELECT id FROM (SELECT id, sum(size) OVER (ORDER BY id) AS running, \
         row_number() OVER (ORDER BY id) AS n FROM locked) s \
         WHERE running <= $3::int8 OR (n = 1 AND $4::bool)) \
         SELECT {columns} FROM {t} WHERE {id} IN (SELECT id FROM picked) ORDER BY {id}"
    )
}

/// The columns a claim returns: order value, key, payload bytes, headers JSON, attempts,
/// then the message id when it is not the order column, the topic template's columns and the
/// header columns, all as text.
#[derive(Debug, Clone, Copy)]
pub struct RowLayout {
    /// The message id is a column of its own (not the order column).
    pub message_id: bool,
    pub topic_columns: usize,
    pub header_columns: usize,
    pub dead_letter_columns: usize,
}

impl TableSql {
    pub fn new(table: &TableConfig, shape: &TableShape, ordering: Ordering) -> TableSql {
        let t = table.name.quoted();
        let c = &table.columns;
        // The order column is the row's handle everywhere: it is unique (checked).
        let id = c.order.quoted();
        let key = c.key.quoted();
        let published_at = c.published_at.quoted();
        let dead_at = c.dead_at.quoted();
        let attempts = c.attempts.quoted();
        let last_error = c.last_error.quoted();
        let next = c.next_attempt_at.quoted();
        let payload = match shape.payload {
            PayloadType::Bytea => c.payload.quoted(),
            PayloadType::Text => format!("convert_to({}::text, 'UTF8')", c.payload.quoted()),
        };
        // A row's payload bytes, read before the payload itself: for bytea and text the
        // stored length (no detoasting); jsonb is rendered as text to be measured.
        let size_of = |prefix: &str| match shape.payload {
            PayloadType::Bytea => {
                format!(
                    "COALESCE(octet_length({prefix}{}), 0)::int8",
                    c.payload.quoted()
                )
            }
            PayloadType::Text => {
                format!(
                    "COALESCE(octet_length({prefix}{}::text), 0)::int8",
                    c.payload.quoted()
                )
            }
        };
        let size = size_of("");
        let headers = match &shape.headers {
            Some(h) => format!("{}::text", h.quoted()),
            None => "NULL::text".to_owned(),
        };
        let layout = RowLayout {
            message_id: c.id != c.order,
            topic_columns: table.topic.columns().len(),
            header_columns: table.header_columns.len(),
            dead_letter_columns: table
                .dead_letter_topic
                .as_ref()
                .map_or(0, |d| d.columns().len()),
        };
        // Then the row's age when read (for the delivery-lag histogram: NULL without a
        // creation-time column) and whether `replay` made it pending again (the one writer
        // that clears `last_error` and sets `next_attempt_at` with no attempt counted).
        let age = match &shape.created_at {
            Some(c) => format!(
                "extract(epoch FROM clock_timestamp() - {})::float8",
                c.quoted()
            ),
            None => "NULL::float8".to_owned(),
        };
        // And the creation time in milliseconds since the epoch: the Kafka record's
        // timestamp (CreateTime), as Debezium's outbox router sets it.
        let created_ms = match &shape.created_at {
            Some(c) => format!("floor(extract(epoch FROM {}) * 1000)::int8", c.quoted()),
            None => "NULL::int8".to_owned(),
        };
        let mut columns = format!(
            "{id}::bigint, {key}::text, {payload}, {headers}, {attempts}::int4, {age}, \
             ({next} IS NOT NULL AND {attempts} = 0 AND {last_error} IS NULL), {created_ms}"
        );
        let extra = layout
            .message_id
            .then_some(&c.id)
            .into_iter()
            .chain(table.topic.columns())
            .chain(table.header_columns.iter().map(|(_, column)| column))
            .chain(table.dead_letter_topic.iter().flat_map(|d| d.columns()));
        for column in extra {
            columns.push_str(&format!(", {}::text", column.quoted()));
        }
        let pending = format!("{published_at} IS NULL AND {dead_at} IS NULL");
        // Not waiting for a later attempt. `now()` is the transaction's start: one instant
        // for every statement of a claim, so its window and its locks agree.
        let due = format!("({next} IS NULL OR {next} <= now())");
        // A *held* row holds back the later rows of its key: dead (until re-queued or
        // deleted), or waiting for its next attempt. The held index covers exactly these
        // rows (migrations/0002_held_index.concurrent.sql), so both probes below are index
        // lookups. The first, uncorrelated test runs once per statement (an InitPlan): with
        // no held row in the table, the common case, no row pays for the per-key probe
        // (measured on a 2,000-row window: 1.3 ms with the probe alone, 0.8 ms with the
        // test in front).
        let held =
            format!("d.{published_at} IS NULL AND (d.{dead_at} IS NOT NULL OR d.{next} > now())");
        // In a claim's bucket reads past its first window (`$1` past it), a row with a failure history
        // (`next_attempt_at` set: waiting, or released by `requeue`, which sets it to the
        // time of the requeue) holds back its key too. A key left out of the first window
        // because its head was held must not reappear in a later one with a later row as
        // its "head" when a requeue committed between the two windows; the head itself is
        // due and is taken by the next claim's first window. Every arm implies the held
        // index's predicate, so the probes stay on that small index.
        let held_in_window = format!(
            "d.{published_at} IS NULL AND (d.{dead_at} IS NOT NULL OR d.{next} > now() \
             OR ($1 > '{FIRST_WINDOW}'::bigint AND d.{next} IS NOT NULL))"
        );
        let not_held_back_by = |held: &str| {
            format!(
                "(NOT EXISTS (SELECT 1 FROM {t} d WHERE {held}) \
                 OR NOT EXISTS (SELECT 1 FROM {t} d WHERE d.{key} = o.{key} AND {held} \
                 AND d.{id} < o.{id}))"
            )
        };
        // Work left for `drain`: rows held back by a *waiting* row become publishable when
        // it is due, so only a dead row takes its key's rows out of the count.
        let dead = format!("d.{dead_at} IS NOT NULL AND d.{published_at} IS NULL");
        let not_behind_dead = format!(
            "(NOT EXISTS (SELECT 1 FROM {t} d WHERE {dead}) \
             OR NOT EXISTS (SELECT 1 FROM {t} d WHERE d.{key} = o.{key} AND {dead} \
             AND d.{id} < o.{id}))"
        );
        let waiting = format!("{pending} AND {next} > now()");
        let window_filter = format!(
            "o.{published_at} IS NULL AND o.{dead_at} IS NULL \
             AND (o.{next} IS NULL OR o.{next} <= now()) \
             AND (o.{key} IS NULL OR {})",
            not_held_back_by(&held)
        );
        // The same for a bucket read, with the rule of reads past a first window.
        let bucket_filter = format!(
            "o.{published_at} IS NULL AND o.{dead_at} IS NULL \
             AND (o.{next} IS NULL OR o.{next} <= now()) \
             AND (o.{key} IS NULL OR {})",
            not_held_back_by(&held_in_window)
        );
        let obucket = bucket_of("o.", &key, &id);
        // The floor's bookkeeping (super::floor): rows with a failure history are found
        // below the floor through the retry index; the others are *fresh*.
        let retrying = format!("{pending} AND {next} IS NOT NULL");
        let fresh =
            format!("o.{published_at} IS NULL AND o.{dead_at} IS NULL AND o.{next} IS NULL");
        // Bounds on the order column are written `(SELECT $n)`: an index condition all the
        // same, but a value the planner does not see. Seen, a bound in the first bucket of
        // the column's histogram (`i64::MIN` for a claim's first window; the floor, right
        // after ANALYZE) made every custom plan ask the index for the column's actual
        // minimum, walking the entries of every row published since the last VACUUM: a
        // drain of 3,000,000 rows slowed from 88,000 to 60,000 rows/s as it went (perf:
        // get_actual_variable_range under the planner), one of 200,000 rows did not.
        // Below the floor: the stragglers, by primary key (skipped outright, a one-time
        // filter, when there are none), and rows with a failure history, from the retry
        // index. The order column is hidden from the retry part's bounds (`+ 0`) so that no
        // plan - a cached generic one included - answers it with a range scan of the
        // pending index below the floor: that range holds the entries of every row
        // published since the last VACUUM (measured: a generic plan did, and with a
        // snapshot held p99 latency at 2,000 rows/s grew from 3 ms to 67 ms in 2 minutes).
        let stragglers_part =
            |o: &str, ids: &str| format!("cardinality({ids}) > 0 AND {o}{id} = ANY({ids})");
        let retry_part = |o: &str, floor: &str, ids: &str| {
            format!("{o}{next} IS NOT NULL AND ({o}{id} + 0) < {floor} AND {o}{id} <> ALL({ids})")
        };
        let low_stragglers = stragglers_part("", "$2::bigint[]");
        let low_retrying = retry_part("", "$1", "$2::bigint[]");
        // Whether a fresh row is held back by an earlier held row of its key (dead, or with
        // a failure history): the held index answers it.
        let held_back_row = match ordering {
            Ordering::Key => format!(
                "(o.{key} IS NOT NULL AND EXISTS (SELECT 1 FROM {t} d WHERE d.{key} = o.{key} \
                 AND d.{id} < o.{id} AND d.{published_at} IS NULL \
                 AND (d.{dead_at} IS NOT NULL OR d.{next} IS NOT NULL)))"
            ),
            Ordering::None => "false".to_owned(),
        };
        let held_back = match ordering {
            Ordering::Key => format!(
                "count(*) FILTER (WHERE {pending} AND {key} IS NOT NULL AND EXISTS \
                 (SELECT 1 FROM {t} d WHERE d.{key} = o.{key} AND d.{id} < o.{id} AND {held}))"
            ),
            Ordering::None => "0::bigint".to_owned(),
        };
        TableSql {
            claim_unordered: budgeted(
                &format!("{pending} AND {due} AND {id} >= (SELECT $2::bigint)"),
                &columns,
                &t,
                &id,
                &size,
            ),
            claim_unordered_low: budgeted(
                &format!(
                    "{pending} AND {next} IS NOT NULL AND {next} <= now() AND ({id} + 0) < $2"
                ),
                &columns,
                &t,
                &id,
                &size,
            ),
            // One statement, so one snapshot: a window read in two statements could see a
            // row's key released in one and not the other, and take a later row for its head.
            // The two parts are materialized and sorted together: as a UNION ALL under a
            // Merge Append, the same scans ran 3-4x slower in the relay (measured, 300,000
            // rows, key order).
            window: format!(
                "WITH low AS MATERIALIZED (SELECT o.{id}::bigint AS id, o.{key}::text AS key, \
                 {osize} AS size, {obucket} AS bucket FROM {t} o WHERE {stragglers} \
                 AND {window_filter} \
                 UNION ALL SELECT o.{id}::bigint, o.{key}::text, {osize}, {obucket} FROM {t} o \
                 WHERE {retrying} AND {window_filter}), \
                 main AS MATERIALIZED (SELECT o.{id}::bigint AS id, o.{key}::text AS key, \
                 {osize} AS size, {obucket} AS bucket \
                 FROM {t} o WHERE o.{id} >= (SELECT $2::bigint) AND {window_filter} \
                 ORDER BY o.{id} LIMIT $1) \
                 SELECT id, key, size, bucket FROM low UNION ALL \
                 SELECT id, key, size, bucket FROM main ORDER BY id LIMIT $1",
                osize = size_of("o."),
                stragglers = stragglers_part("o.", "$3::bigint[]"),
                retrying = retry_part("o.", "$2", "$3::bigint[]"),
            ),
            // The buckets first (a MATERIALIZED CTE, its rows pulled in order until `$7`
            // are got: the lock function runs once per bucket tried), then each bucket's
            // rows through the bucket index (a nested loop over the buckets got, one index
            // range each); the rows below the floor (few) filtered by bucket.
            //
            // The floor bound is written as a row comparison on the bucket index's two
            // columns, `(bucket, id) >= (b, floor)`: only that index can start a scan there.
            // Written `id >= floor`, the pending index (on `id`) could answer it too, reading
            // every bucket's rows in id order and filtering, and on a table with no
            // statistics yet (filled since the last ANALYZE: the planner takes the default
            // 0.5 % for `published_at IS NULL`, so both indexes look equally tiny) it did:
            // 15,851 rows read and dropped for 282 kept, 26 ms and 4,500 blocks a call, 7.5
            // s of a 100,000-row drain's 8 s of statement time (auto_explain, benchmark L).
            // With the row comparison the bucket index is chosen with or without
            // statistics (checked with EXPLAIN both ways).
            pick_window: format!(
                "WITH pick AS MATERIALIZED (SELECT c.b FROM unnest($3::int4[]) AS c(b) \
                 WHERE pg_try_advisory_xact_lock($6::int4, c.b) LIMIT $7), \
                 low AS MATERIALIZED (SELECT o.{id}::bigint AS id, o.{key}::text AS key, \
                 {osize} AS size, {obucket} AS bucket FROM {t} o WHERE {stragglers} \
                 AND {bucket_filter} \
                 UNION ALL SELECT o.{id}::bigint, o.{key}::text, {osize}, {obucket} FROM {t} o \
                 WHERE {retrying} AND {bucket_filter}), \
                 main AS MATERIALIZED (SELECT w.id, w.key, w.size, w.bucket \
                 FROM pick, LATERAL (SELECT o.{id}::bigint AS id, \
                 o.{key}::text AS key, {osize} AS size, pick.b AS bucket FROM {t} o \
                 WHERE {obucket} = pick.b AND o.{attempts} >= 0 \
                 AND ({obucket}, o.{id}) >= (pick.b, (SELECT $4::bigint)) AND {bucket_filter} \
                 ORDER BY o.{id} LIMIT $2) w) \
                 SELECT id, key, size, bucket FROM low WHERE bucket IN (SELECT b FROM pick) \
                 UNION ALL SELECT id, key, size, bucket FROM main \
                 UNION ALL SELECT NULL, NULL, NULL, b FROM pick",
                osize = size_of("o."),
                stragglers = stragglers_part("o.", "$5::bigint[]"),
                retrying = retry_part("o.", "$4", "$5::bigint[]"),
            ),
            // One statement, so one snapshot: pg_current_snapshot() is the statement's own.
            // The candidate is the first fresh row not held back; the rows before it are
            // all held back (read only up to it, at most `$2`).
            advance: format!(
                "WITH c AS MATERIALIZED (SELECT o.{id}::bigint AS id FROM {t} o \
                 WHERE {fresh} AND o.{id} >= (SELECT $1::bigint) AND NOT {held_back_row} \
                 ORDER BY o.{id} LIMIT 1), \
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
                 GROUP BY o.{key}) g) s"
            ),
            // `key::text`: the keys come as text whatever the column's type. For a text or
            // varchar key the cast is no cast at all, and the held index answers.
            withheld_released: format!(
                "SELECT h.k FROM unnest($1::text[], $2::int8[]) AS h(k, w) \
                 WHERE NOT EXISTS (SELECT 1 FROM {t} d WHERE d.{key}::text = h.k \
                 AND d.{id} < h.w AND d.{published_at} IS NULL \
                 AND (d.{dead_at} IS NOT NULL OR d.{next} IS NOT NULL))"
            ),
            sweep: format!(
                "SELECT o.{id}::bigint, {held_back_row}, o.{key}::text FROM {t} o WHERE {fresh} \
                 AND o.{id} >= (SELECT $1::bigint) AND o.{id} < (SELECT $2::bigint) \
                 AND o.{id} <> ALL($3::bigint[]) \
                 ORDER BY o.{id} LIMIT $4"
            ),
            lock_rows: format!(
                "SELECT {columns} FROM {t} WHERE {id} = ANY($1::bigint[]) AND {pending} \
                 AND {due} ORDER BY {id} FOR UPDATE SKIP LOCKED"
            ),
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
            publishable_exists: match ordering {
                Ordering::Key => format!(
                    "SELECT EXISTS (SELECT 1 FROM {t} o WHERE o.{published_at} IS NULL \
                     AND o.{dead_at} IS NULL AND (o.{key} IS NULL OR {not_behind_dead}))"
                ),
                Ordering::None => format!("SELECT EXISTS (SELECT 1 FROM {t} WHERE {pending})"),
            },
            waiting: format!(
                "SELECT count(*), (min({next}) - now())::text, \
                 extract(epoch FROM min({next}) - now())::float8 FROM {t} WHERE {waiting}"
            ),
            status: format!(
                "SELECT count(*) FILTER (WHERE {pending}), \
                 count(*) FILTER (WHERE {pending} AND {attempts} > 0), \
                 count(*) FILTER (WHERE {dead_at} IS NOT NULL AND {published_at} IS NULL), \
                 count(*) FILTER (WHERE {published_at} IS NOT NULL), \
                 count(*) FILTER (WHERE {waiting}), \
                 min({next}) FILTER (WHERE {waiting})::text, \
                 {held_back}, {} FROM {t} o",
                match &shape.created_at {
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
                 FROM {t} d WHERE {held} ORDER BY d.{id} LIMIT $1"
            ),
            // Released rows keep `next_attempt_at` (due now), and with it their place in the
            // held index until published: see `held_in_window`.
            requeue_ids: format!(
                "UPDATE {t} SET {dead_at} = NULL, {attempts} = 0, {next} = now() \
                 WHERE {id} = ANY($1::bigint[]) AND {dead_at} IS NOT NULL \
                 AND {published_at} IS NULL RETURNING {id}::bigint"
            ),
            requeue_waiting: format!(
                "UPDATE {t} SET {next} = now() WHERE {waiting} RETURNING {id}::bigint"
            ),
            // Like requeue, a replayed row is due now with `next_attempt_at` set, not NULL:
            // that is how claims find it below the claim floor (the retry index) and how
            // bucket reads past a first window hold its key's later pending rows back until
            // it is published.
            replay_ids: format!(
                "WITH chosen AS (SELECT {id} FROM {t} WHERE {id} = ANY($1::bigint[]) \
                 AND {published_at} IS NOT NULL AND {dead_at} IS NULL), \
                 replayed AS (UPDATE {t} SET {published_at} = NULL, {attempts} = 0, \
                 {last_error} = NULL, {next} = now() \
                 WHERE {id} IN (SELECT {id} FROM chosen) AND NOT $2::bool RETURNING {id}) \
                 SELECT {id}::bigint FROM chosen ORDER BY 1"
            ),
            replay_range: shape.created_at.as_ref().map(|c| {
                format!(
                    "SELECT {id}::bigint FROM {t} WHERE {published_at} IS NOT NULL \
                     AND {dead_at} IS NULL AND {c} >= $1::text::timestamptz \
                     AND {c} < $2::text::timestamptz AND {id} > $3::bigint \
                     ORDER BY {id} LIMIT $4",
                    c = c.quoted()
                )
            }),
            backlog: format!(
                "SELECT (SELECT count(*) FROM {t} WHERE {pending} AND {id} >= (SELECT $1::bigint)) \
                 + (SELECT count(*) FROM {t} WHERE {pending} AND {low_stragglers}) \
                 + (SELECT count(*) FROM {t} WHERE {pending} AND {low_retrying}), \
                 COALESCE(({}), 0)::float8",
                match &shape.created_at {
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
            requeue_all: format!(
                "UPDATE {t} SET {dead_at} = NULL, {attempts} = 0, {next} = now() \
                 WHERE {dead_at} IS NOT NULL AND {published_at} IS NULL RETURNING {id}::bigint"
            ),
            retire: shape.created_at.as_ref().map(|created_at| {
                let cutoff = "now() - $3::float8 * interval '1 second'";
                format!(
                    "WITH chunk AS MATERIALIZED (SELECT {id}::bigint AS id, \
                     {published_at} < {cutoff} AS old, {created_at} >= {cutoff} AS young, \
                     {published_at} >= {cutoff} AS ripening \
                     FROM {t} WHERE {id} > (SELECT $1::bigint) ORDER BY {id} LIMIT $2), \
                     gone AS (DELETE FROM {t} WHERE {id} IN (SELECT o.{id} FROM {t} o \
                     WHERE o.{id} = ANY(ARRAY(SELECT id FROM chunk WHERE old)) \
                     AND o.{published_at} < {cutoff} FOR UPDATE SKIP LOCKED) RETURNING 1) \
                     SELECT (SELECT max(id) FROM chunk), (SELECT count(*) FROM chunk), \
                     (SELECT count(*) FROM gone), \
                     COALESCE((SELECT bool_or(young) FROM chunk), false), \
                     COALESCE((SELECT bool_or(ripening) FROM chunk), false), \
                     (SELECT count(*) FROM chunk WHERE old)",
                    created_at = created_at.quoted()
                )
            }),
            layout,
            tag: table_tag(&table.name.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_expression_is_the_bucket_indexs_own() {
        let index = include_str!("../../migrations/0004_bucket_index.concurrent.sql");
        let expression = bucket_of("", "{{key}}", "{{order}}");
        assert!(
            index.contains(&format!("({expression}, {{{{order}}}})")),
            "{index}"
        );
    }

    #[test]
    fn the_table_tag_is_fixed_for_a_name() {
        // Relays of different builds must agree: the value is part of the protocol.
        assert_eq!(table_tag("public.outbox"), table_tag("public.outbox"));
        assert_eq!(table_tag(""), 0x811c_9dc5_u32 as i32);
        assert_ne!(table_tag("public.outbox"), table_tag("public.outbox2"));
    }
}
