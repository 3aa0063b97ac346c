//! Every statement the relay runs against an outbox table, built once at start-up from the
//! validated configuration. Identifiers are quoted by [`crate::config::Ident`]; every value
//! is a bound parameter.
//!
//! A statement that acts on rows chosen by a subquery of the same table names them as an
//! array, `id = ANY (ARRAY(SELECT ...))`, never as `id IN (SELECT ...)`: planned on the
//! statistics of an outbox analyzed empty, the join of `IN` became a walk of the whole
//! primary key that ran the subquery again for every entry (see [`budgeted`]); an array's
//! ids can only be looked up in the index.

use crate::config::{OnPublish, Ordering, TableConfig};

use super::schema::TableShape;

mod admin;
mod claim;
mod floor;
mod parts;
mod retention;
mod settle;

/// Below every order value: the `after` of a claim's bucket reads when the claim read no
/// first window (they read like one), and where walks of the table start.
pub const FIRST_WINDOW: i64 = i64::MIN;

/// Fresh rows the floor's look reads at most (`super::floor`'s walk: its straggler cap plus
/// one). Written into [`TableSql::advance`] rather than bound, and the stragglers bound as
/// `(SELECT $2)`: with every value the planner could use fixed or hidden, the look's
/// custom and generic plans cost the same, so PostgreSQL keeps the generic plan after five
/// runs instead of planning every look, every tick of the floor's keeper per relay process
/// and table while rows flow. (A custom plan saw the usually empty straggler list and
/// costed its index probe far below the generic plan's, so every look was planned.) The
/// relay's sessions now force the generic plan (`plan_cache_mode`, see
/// `source::session::settings`); the hidden values keep the plan the same in a session
/// that does not.
pub(crate) const LOOK_LIMIT: usize = 1001;

/// Held rows a claim's statement lists at most, with their keys, so that the rows it reads
/// are told held back or not by a hash table instead of an index probe each (see
/// `parts::Parts::not_held_back`). Bounded so that listing them stays cheap and the list
/// fits the hash table PostgreSQL keeps in `work_mem` (its estimate is this many rows);
/// beyond it the rows of keys not listed are probed one by one, as before.
pub(crate) const HELD_LISTED: usize = 1000;

/// A claim's first window reads at most this many rows, four for each bucket, and at most
/// [`WINDOW_FACTOR`] times the batch size ([`TableSql::window_rows`]).
pub(crate) const WINDOW_ROWS: i64 = 4 * BUCKETS as i64;
/// Rows a claim's first window reads, as a multiple of the rows it claims: large enough to
/// find free keys past the heads other workers hold.
pub(crate) const WINDOW_FACTOR: usize = 4;

/// The rows a first window reads for a claim of `rows` rows: [`WINDOW_FACTOR`] times as
/// many, at most [`WINDOW_ROWS`]. Per table for a whole batch ([`TableSql::window_rows`]),
/// per claim for what it may take.
pub(crate) fn window_rows(rows: usize) -> i64 {
    (rows.saturating_mul(WINDOW_FACTOR) as i64).min(WINDOW_ROWS)
}

/// Key buckets: a key's bucket is `hashtext(key) & (BUCKETS - 1)`, as the bucket index
/// of migration 0004 computes it (see [`bucket_of`]).
pub const BUCKETS: i32 = 64;

/// A row's key bucket, exactly as `migrations/0004_bucket_index.concurrent.sql` writes it
/// (PostgreSQL uses the index only for the same expression). `o` is a table alias with
/// its dot, or empty.
pub(crate) fn bucket_of(o: &str, key: &str, id: &str) -> String {
    format!(
        "((COALESCE(hashtext(({o}{key})::text COLLATE \"C\")::int8, ({o}{id})::int8) & {})::int4)",
        BUCKETS - 1
    )
}

/// Statements for one outbox table. Its fields are `source`'s own: other layers call the
/// typed methods that bind and read them ([`super::settle`], [`super::table`],
/// [`super::operator`], [`super::poll::Poll`]).
#[derive(Debug, Clone)]
pub struct TableSql {
    /// `ordering = "none"`: lock the oldest pending rows that are due from the floor `$2`
    /// on, skipping locked ones, at most `$1`, and return those whose payloads add up to
    /// at most `$3` bytes (the first one whatever its size when `$4`). Returns rows as
    /// [`RowLayout`] describes.
    pub(super) claim_unordered: String,
    /// `ordering = "none"`: the same for rows below the floor `$2` with a failure history
    /// (found in `outbox_relay_held`).
    pub(super) claim_unordered_low: String,
    /// `ordering = "key"`, a claim's first window: order values, keys, payload sizes and
    /// buckets of the oldest pending, due rows, at most `$1` (and at most
    /// [`TableSql::window_rows`]), without locking, leaving out
    /// rows held back by an earlier held row of their key (dead, or waiting for its next
    /// attempt). Rows are read from the floor `$2` on, and below it only the stragglers
    /// `$3` and rows with a failure history (see [`super::floor`]).
    pub window: String,
    /// The rows [`TableSql::window`] reads at most, whatever its `$1`: [`WINDOW_FACTOR`]
    /// batches, at most [`WINDOW_ROWS`]. Written into the statement rather than bound, with
    /// its floor and stragglers hidden from the planner as `(SELECT $n)`, for the reason
    /// [`LOOK_LIMIT`] gives: bound as `LIMIT $1`, the generic plan estimated a tenth of the
    /// table for it, so PostgreSQL planned every first window anew, planning costing about
    /// as much as running it. A
    /// claim that wants fewer rows (a partial batch) cuts the answer with the outer `LIMIT
    /// $1`, which only the final sort sees. From the batch size, not a constant, so a table
    /// claimed a few rows at a time reads a few rows a window, as when the limit was bound.
    pub(super) window_rows: i64,
    /// `ordering = "key"`, a claim's buckets, past a deep first window ending at `$1`
    /// ([`FIRST_WINDOW`] when the claim read none): takes the advisory locks (table tag
    /// `$6`) of the first `$7` buckets in `$3` (in that order) that no other transaction
    /// holds, and returns each one's pending, due rows from the floor `$4` on, at most `$2`
    /// a bucket, read through the bucket index, with the stragglers `$5` and the rows with
    /// a failure history below the floor, in no particular order. Rows up to `$1` are read again on purpose (see
    /// *Buckets* in `claim/mod.rs`). Rows held back are left out as in
    /// [`TableSql::window`], and past a first window also those behind a row with a
    /// failure history (see `held_in_window`).
    ///
    /// In the same statement, it locks the first rows read in id order (at most `$8`
    /// rows and `$9` payload bytes, the first whatever its size) that are still pending
    /// and due, `SKIP LOCKED`: each row read comes back as the locked row's
    /// columns ([`RowLayout`], all NULL when it was not locked), then its order value,
    /// key, size and bucket; a bucket got as a row of NULLs but its bucket.
    pub pick_lock: String,
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
    pub(super) sweep: String,
    /// The floor's withheld keys `$1` (each hidden from `$2`, the same position) that are
    /// released: no row of the key below that id is dead or has a failure history.
    pub(super) withheld_released: String,
    /// Locks the rows `$1` (order values) that are still pending and due, skipping locked
    /// ones.
    /// Returns rows as [`RowLayout`] describes.
    pub(super) lock_rows: String,
    /// Deletes the published rows `$1`.
    pub(super) delete: String,
    /// Sets `published_at` on the published rows `$1`.
    pub(super) mark: String,
    /// Counts one failed attempt for rows `$1` with errors `$2`; dead-letters those that
    /// reach `$3` attempts, and gives the others their next attempt `$4` microseconds from
    /// now. Returns each row's order value and whether it is now dead.
    pub(super) record_failures: String,
    /// Rows that wait without an attempt counted (`$1` ids, `$2` errors, `$3`
    /// microseconds): postponed for an unavailable destination, or at their last attempt
    /// and unable to reach their dead-letter topic.
    pub(super) postpone: String,
    /// The rows postponed for an unavailable destination that still wait are due now
    /// (their destination is back): those whose `last_error` starts with `$1`, the
    /// sink's mark of a postponed row.
    pub(super) release_postponed: String,
    /// A boolean expression: whether the table holds any row at all. Planned in a moment,
    /// where [`TableSql::publishable_exists`] weighs the table's indexes and its held
    /// rows: a look over many tables asks this of all of them in one statement
    /// ([`super::poll::any_rows`]), and that only of the tables that hold rows.
    pub(super) any_row: String,
    /// Whether any row is left that a relay could publish now or after a wait: pending,
    /// and (key order) not held back by a dead row. Public for the tests of its plan.
    pub publishable_exists: String,
    /// The two halves of a boolean expression that is true when a claim may find a row
    /// ([`TableSql::claimable`] puts the floor's parameter between them).
    claimable: (String, String),
    /// Rows waiting for their next attempt: how many, and the earliest one due in (as
    /// interval text and seconds).
    pub(super) waiting: String,
    /// `status`: pending, failing (pending with attempts), dead, kept-published and
    /// waiting counts, the earliest next attempt as text, the pending rows held back by
    /// a held row of their key, and the oldest pending row's age in seconds (NULL
    /// without `created_at`).
    pub(super) status: String,
    /// `status`: the oldest held rows (dead or waiting), at most `$1`: order value,
    /// attempts, dead_at and next_attempt_at as text, last_error, key, and how many later
    /// pending rows of its key it holds back.
    pub(super) held_rows: String,
    /// `requeue --id`: clears dead_at and attempts of the dead rows `$1`; returns their
    /// order values.
    pub(super) requeue_ids: String,
    /// `requeue --all`: the same for every dead row.
    pub(super) requeue_all: String,
    /// `requeue --waiting`: rows waiting for their next attempt are due now.
    pub(super) requeue_waiting: String,
    /// `replay`: the rows `$1` kept as published (not dead) are pending and due again;
    /// returns their order values. `$2`: count only (`--dry-run`), change nothing.
    pub(super) replay_ids: String,
    /// `replay --since/--until`: order values after `$3`, at most `$4`, of rows kept as
    /// published (not dead) created in [`$1`, `$2`) (RFC 3339 text), in order. `None`
    /// without a creation-time column.
    pub(super) replay_range: Option<String>,
    /// `replay --since/--until`: how many rows kept as published (not dead) were created in
    /// [`$1`, `$2`), `$2` no later than now, and that end as RFC 3339 text (UTC), for the
    /// statements that follow. `None` without a creation-time column.
    pub(super) replay_count: Option<String>,
    /// `replay`, first: the first row of each key among the rows `$1` kept as published
    /// (not dead) is pending again, held (`next_attempt_at` far in the future), so its
    /// key's later rows wait behind it; returns their order values. `None` without key
    /// order.
    pub(super) replay_hold_ids: Option<String>,
    /// The same for the rows created in [`$1`, `$2`). `None` without key order or a
    /// creation-time column.
    pub(super) replay_hold_range: Option<String>,
    /// `replay`, last: every row a replay holds is due now; returns their order values.
    pub(super) replay_release: String,
    /// Metrics: pending rows and the oldest pending row's age in seconds (0 when none or
    /// without a creation-time column), read like a claim from the floor `$1` and below it
    /// the stragglers `$2` and rows with a failure history, so it costs what a claim costs.
    pub(super) backlog: String,
    /// Retention (mark mode, [`super::retention`]): looks at the `$2` rows after `$1` in
    /// order and deletes those published more than `$3` seconds ago, skipping rows locked
    /// by others. Returns the chunk's last order value (NULL when empty), its row count,
    /// rows deleted, whether it holds a row created within the last `$3` seconds, whether
    /// it holds a row published within them, and how many of its rows were old enough
    /// (those beyond the rows deleted were locked).
    /// `None` without a creation-time column (retention needs one, checked at start-up).
    pub(super) retire: Option<String>,
    pub(super) layout: RowLayout,
    /// The first key of this table's bucket advisory locks (the second is the bucket).
    pub tag: i32,
}

/// The first key of a table's bucket advisory locks: FNV-1a of its qualified name, the
/// same in every relay of every release that has buckets (no PostgreSQL hash in it).
pub(crate) fn table_tag(name: &str) -> i32 {
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
///
/// The rows returned are looked up by id as an array (the module doc's rule): joined with
/// `IN`, a claim of an outbox refilled after an analyze of it empty walked the whole
/// primary key once per row picked and ran into `statement_timeout`.
fn budgeted(filter: &str, columns: &str, t: &str, id: &str, size: &str) -> String {
    format!(
        "WITH locked AS MATERIALIZED (SELECT {id} AS id, {size} AS size FROM {t} \
         WHERE {filter} ORDER BY {id} LIMIT $1 FOR UPDATE SKIP LOCKED), \
         picked AS (SELECT id FROM (SELECT id, sum(size) OVER (ORDER BY id) AS running, \
         row_number() OVER (ORDER BY id) AS n FROM locked) s \
         WHERE running <= $3::int8 OR (n = 1 AND $4::bool)) \
         SELECT {columns} FROM {t} WHERE {id} = ANY (ARRAY(SELECT id FROM picked)) \
         ORDER BY {id}"
    )
}

/// The columns a claim returns: order value, key, payload bytes, headers JSON, attempts,
/// then the message id when it is not the order column, the topic template's columns and the
/// header columns, all as text.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowLayout {
    /// The message id is a column of its own (not the order column).
    pub(crate) message_id: bool,
    pub(crate) topic_columns: usize,
    pub(crate) header_columns: usize,
    pub(crate) dead_letter_columns: usize,
    /// The CloudEvents templates' columns (type, source, subject, datacontenttype).
    pub(crate) envelope_columns: usize,
}

impl RowLayout {
    /// Columns of a claimed row.
    pub(crate) fn width(&self) -> usize {
        8 + usize::from(self.message_id)
            + self.topic_columns
            + self.header_columns
            + self.dead_letter_columns
            + self.envelope_columns
    }
}

impl TableSql {
    /// Every statement of `table`, by concern: a claim's ([`claim`]), the floor's
    /// ([`floor`]), a batch's end ([`settle`]), the operator's and the probe's ([`admin`])
    /// and retention's ([`retention`]), all from one set of names and fragments
    /// ([`parts`]).
    pub(crate) fn new(
        table: &TableConfig,
        shape: &TableShape,
        ordering: Ordering,
        batch_size: usize,
    ) -> TableSql {
        let p = parts::Parts::new(table, shape, ordering);
        let most = window_rows(batch_size);
        let claim = claim::statements(&p, most);
        let floor = floor::statements(&p);
        let settle = settle::statements(&p);
        let admin = admin::statements(&p);
        let retention = retention::statements(&p);
        TableSql {
            claim_unordered: claim.claim_unordered,
            claim_unordered_low: claim.claim_unordered_low,
            window: claim.window,
            window_rows: most,
            pick_lock: claim.pick_lock,
            advance: floor.advance,
            sweep: floor.sweep,
            withheld_released: floor.withheld_released,
            lock_rows: claim.lock_rows,
            delete: settle.delete,
            mark: settle.mark,
            record_failures: settle.record_failures,
            postpone: settle.postpone,
            release_postponed: settle.release_postponed,
            any_row: admin.probes.any_row,
            publishable_exists: admin.probes.publishable_exists,
            claimable: admin.probes.claimable,
            waiting: admin.probes.waiting,
            status: admin.status.status,
            held_rows: admin.status.held_rows,
            requeue_ids: admin.requeue.ids,
            requeue_all: admin.requeue.all,
            requeue_waiting: admin.requeue.waiting,
            replay_ids: admin.replay.ids,
            replay_range: admin.replay.range,
            replay_count: admin.replay.count,
            replay_hold_ids: admin.replay.hold_ids,
            replay_hold_range: admin.replay.hold_range,
            replay_release: admin.replay.release,
            backlog: admin.probes.backlog,
            retire: retention.retire,
            layout: p.layout,
            tag: table_tag(&table.name.to_string()),
        }
    }
}

impl TableSql {
    /// The statement that settles a batch's published rows: delete or mark them.
    pub(super) fn published(&self, on_publish: OnPublish) -> &str {
        match on_publish {
            OnPublish::Delete => &self.delete,
            OnPublish::Mark => &self.mark,
        }
    }

    /// The statements every batch of this table runs (its claim's and the settling of its
    /// published rows), to be prepared together.
    pub(crate) fn batch_statements(&self, ordering: Ordering, on_publish: OnPublish) -> Vec<&str> {
        let claim = match ordering {
            Ordering::Key => vec![
                self.window.as_str(),
                self.pick_lock.as_str(),
                self.lock_rows.as_str(),
            ],
            Ordering::None => vec![self.claim_unordered.as_str()],
        };
        claim
            .into_iter()
            .chain([self.published(on_publish)])
            .collect()
    }

    /// A boolean expression, true when the table may hold a row a claim would take: a
    /// pending, due row from the floor (parameter `$n`) on, or a due row with a failure
    /// history anywhere (found in `outbox_relay_held`). What it leaves out, the caller knows: the
    /// floor's stragglers. True also for rows a claim leaves alone (a held key's), which
    /// only costs that claim. One index probe each when the table has no such row.
    pub(super) fn claimable(&self, n: usize) -> String {
        format!("{}${n}{}", self.claimable.0, self.claimable.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_expression_is_the_bucket_indexs_own() {
        let index = include_str!("../../../migrations/0004_bucket_index.concurrent.sql");
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
