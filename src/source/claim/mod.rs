//! Claiming a batch: which rows one transaction takes, and why per-key order survives any
//! number of workers and relay processes.
//!
//! # The invariant (`ordering = "key"`)
//!
//! Call a row *pending* while `published_at` and `dead_at` are NULL, and the *head* of a key
//! its pending row with the lowest id. Then:
//!
//! > A transaction publishes a row of key K only while it holds the row lock on K's head,
//! > and on every pending row of K between the head and that row, all taken with
//! > `FOR UPDATE SKIP LOCKED` in that same transaction.
//!
//! The head's row lock *is* the key's ownership token. No table of leases, no advisory
//! lock (those break behind PgBouncer in transaction mode), no hash to keep stable across
//! versions: the rows themselves are the locks, and they work wherever row locks work.
//!
//! Why order follows. Take rows a < b of key K, both committed. While a is pending, a (or
//! a lower pending row) is K's head, so the only transaction that may publish b is one
//! holding a's lock, and it holds the lock on every pending row between the head and b,
//! a included: it publishes a before b in the same batch (the relay sends a key's rows in
//! id order and sends b only after a was acknowledged, see `relay::order`), or, if a failed,
//! does not publish b at all. Ownership moves only when the owner's transaction ends:
//! rows it published are deleted or marked in that commit, rows it did not stay pending
//! and stay the head. A second claimer either finds the head locked (`SKIP LOCKED`:
//! skips the key) or, after the commit, finds the new head. A dead row keeps its later rows
//! out of the window (see `sql::TableSql::window`), so they wait for re-queue or deletion.
//!
//! The claim reads a *window* of pending `(id, key)` pairs in id order without locks, picks
//! heads from it (a key's first row in the window is its head: the window is a prefix of
//! the pending rows, so nothing earlier is pending), locks those heads, and only then locks
//! the rows after each owned head, keeping for each key the unbroken run it got. Keys whose
//! head is locked elsewhere are skipped.
//!
//! # Buckets: many claimers, one table
//!
//! Every claimer reads the same first window. When it holds every pending row (a shallow
//! backlog) the claim plans from it as above. When it does not (a deep backlog), claimers
//! that all planned from it would meet on the same heads, and one that found every key in
//! it taken would have to walk the table past them: many relays on one table delivered a
//! fraction of what one relay did, and less still on a few hot keys (benchmark S).
//!
//! So a claim plans from its first window as above, and when that window is deep and
//! left room in the batch (its keys are other claimers'), takes *buckets* for the rest.
//! A key's bucket is `hashtext(key) & 63`
//! ([`super::sql::bucket_of`]; a row without a key goes by its id), and the bucket index
//! (migration 0004) holds the pending rows by bucket, then id. The claim ranks the buckets
//! by their first row in the first window (the oldest work first, then every other
//! bucket), and one statement ([`super::sql::TableSql::pick_lock`]) takes the
//! transaction-level advisory lock `(table tag, bucket)` of the first bucket(s) no other
//! transaction holds and reads each one's pending rows through the index, from the floor
//! on (with the bucket's stragglers and rows with a failure history below it), as a
//! prefix in id order of what nothing holds back. A key the first window met is this
//! claim's already (owned, or left to others): its rows in a bucket read up to the first
//! window's end are dropped, and an owned key's rows after it continue its run there
//! unbroken. Any other key has its head in the bucket read: the read holds every pending
//! row of its buckets' keys, from the very first, up to where it stops. The claim plans
//! the rows of all buckets got in id order and locks them exactly as above; a key's rows
//! are all in its bucket, so no key is cut short by where another bucket's read stopped.
//!
//! *Two statements, two snapshots.* The first window and a bucket read are separate
//! statements, and under READ COMMITTED each sees the commits made before it began. So a
//! bucket read must not lean on the first window for a key the first window did not
//! meet. It once did, reading only after the first window's end: a key left out of the
//! first window because its oldest row was waiting for its next attempt (`now()` is each
//! transaction's own start, so a row due for a claimer that began a moment later is not
//! yet due for this one) could have that row published by the other claimer in between,
//! leaving a head before the first window's end that the bucket read never saw, and the
//! key's later rows were taken as if one of them were its head. Found by
//! `ordering::keys_held_back_for_an_unavailable_destination_keep_their_order_and_lose_nothing`
//! (a key's row published ahead of earlier rows of its key).
//! Reading from the floor, in the bucket read's own snapshot, a key's first row there is
//! its head in that snapshot. The rows it reads again (the first window's rows of its
//! bucket) are added to its per-bucket limit; benchmark S did not slow down with it.
//!
//! Why order still follows: nothing above changed. The bucket lock is a hint about where
//! to look, never a right to publish: a row is published only under its head's row lock,
//! taken with `SKIP LOCKED` in the claim's transaction. A claimer that takes no bucket
//! locks (a shallow claim, a relay of an earlier release during a rolling upgrade) and one
//! that does still exclude each other key by key.
//!
//! Why it scales: claimers in different buckets never meet on a key. A claimer that finds
//! every bucket taken, or every key it met held by others, learns it from one statement
//! and goes idle, instead of walking the table. It is *surplus* then, and its next claims
//! start with that one statement ([`claim_as_surplus`]: buckets first, in the order the
//! last deep first window ranked them), not with the first window and the heads other
//! claimers own in it, until one takes rows: otherwise every surplus claimer reads the
//! first window again at each look, only to find its heads owned (benchmark S, 20 hot
//! keys). A hot key's backlog fills only its bucket: the other buckets are read through
//! the index without passing its rows. How many buckets a claim asks for at once follows
//! how deep they have been lately ([`BucketDepth`]): one when a bucket fills a batch,
//! several when the backlog is spread thin.
//!
//! # Round trips
//!
//! Each statement of a claim waits one round trip to the database, which on a distant
//! database (another zone: 5-20 ms) is most of a batch's time. Four rules keep them few:
//!
//! - *Tails ride along.* The tails of a key this claim owns are locked with its next
//!   round's heads, and only those not tried yet are left for the last statement (often
//!   none).
//! - *Lanes above 0 take buckets first* on a deep backlog, once a pick has shown how many
//!   buckets fill a batch: the claim of a surplus lane ([`claim_as_surplus`]), starting
//!   with a pick in the order the last deep first window ranked the buckets (up to
//!   [`buckets::MAX_PICKS`] picks), instead of the first window, its lock round and then a pick.
//!   Lane 0 keeps reading the first window (unless it is surplus itself), so the oldest
//!   rows keep a claimer and the ranking stays fresh; a lane whose buckets hold no row
//!   plans from the first window as every claim does.
//! - *A pick locks what it read* ([`super::sql::TableSql::pick_lock`]): the statement
//!   that reads the buckets also locks, `SKIP LOCKED`, its first rows in id order (about
//!   the room and the payload bytes the batch has left, a quarter more, and the first
//!   window's rows it reads again), and the claim plans its rounds in memory from what
//!   came back. Order holds as in any round: a key is taken only if its head (its first
//!   row in the read, which is a prefix of its pending rows, see *Buckets*) was got, and
//!   then only the unbroken run of rows got behind it; a row this transaction locked
//!   but does not take is never published, only released when it ends.
//!
//! - *A few tails wait.* Tails planned but not tried by an earlier statement (the pick
//!   locked only its first rows in id order) are locked by the claim's last statement
//!   only when they are more than an eighth of the batch; fewer end their keys' runs
//!   there and wait for a later claim, as a tail held elsewhere does (a statement, and
//!   a round trip, for a few rows is what a distant database cannot afford: benchmark L).
//!
//! The cost of the third rule: a pick also locks rows it will not take, the heads and
//! tails of keys another claimer holds among them, and holds them until its transaction
//! ends; a claimer that owns such a key meets its tail locked and its run stops there,
//! so that key's next rows wait for a later batch (nothing is skipped: they stay
//! pending, behind a head). Locking only heads, then the runs behind the heads got, in
//! one statement was tried and made each pick much slower
//! (docs/benchmark.md, *What did not work, and why*).
//!
//! Benchmark L (`outbox-bench --distant`) counts the round trips a batch waits, every
//! connection's (the floor keeper's included), with these rules and a batch's `COMMIT`
//! carrying the next claim (`relay::batch`, *Batches that follow on*).
//!
//! Throughout, "id" means the table's order column: `id` in the default table, or the
//! column `[tables.columns] order` names (an integer with a unique index).
//!
//! # The known traps, and how this design meets them
//!
//! - *A hash that changes under you.* Designs that hash keys into lanes need the hash to
//!   be stable. Here the hash decides only where a claim looks, with one exception: the
//!   bucket index stores each row's bucket when the row is written, so a key must hash to
//!   the same bucket for as long as any of its rows is pending, or a bucket window could
//!   miss its head. `hashtext` of the key's bytes (the C collation: no ICU version in it)
//!   is what hash indexes and hash partitions store as well, and `pg_upgrade` keeps both
//!   valid only because it does not change between major versions; if a future release
//!   ever changed it, its release notes would call for a `REINDEX`, which repairs this
//!   index too.
//! - *Session advisory locks behind PgBouncer.* In transaction pooling a session lock
//!   outlives the transaction on a server connection another client may get next. The
//!   relay takes no session-level lock: its row locks and bucket locks are taken inside the
//!   claim's own transaction and released by its commit or rollback, so they work through
//!   PgBouncer in transaction mode. An application that happens to take the same
//!   two-integer advisory lock only makes the relay skip that bucket while it holds it.
//! - *Ownership handed over too early.* A key's next owner can only lock the head after the
//!   previous owner's transaction ended, and by then the rows it published are deleted or
//!   marked in that same commit: there is no lease to expire while a slow owner is still
//!   publishing, so no fencing epoch is needed. A crashed owner's transaction is rolled
//!   back by PostgreSQL when its connection drops (or at `idle_in_transaction_session_timeout`).
//! - *A hot key.* See *Buckets*: its backlog fills its bucket only.
//! - *Id order is not commit order.* See below: the one case no relay can order.
//! - *A held row released between two windows of one claim.* Windows leave out the rows
//!   behind a held row (dead, or waiting for its next attempt). If an operator's `requeue`
//!   commits between a claim's first window and its bucket window (which reads after the
//!   first), the bucket window must not take a later row of the released key as its head.
//!   `requeue` keeps `next_attempt_at` set (to the time of the requeue), and bucket reads
//!   past a first window treat any pending row with `next_attempt_at` set as holding back
//!   its key (`sql::TableSql::pick_lock`, `held_in_window`); the released row is due,
//!   and the next claim's first window takes it as the head. Time alone cannot cause it:
//!   `now()` is fixed for the whole claim transaction. (A surplus claim reads no first
//!   window: its bucket reads are its first look, and take the released row as the head.)
//!
//! # What the invariant cannot cover
//!
//! Ids are handed out when a row is inserted, but rows become visible when their
//! transaction commits. If two transactions insert rows of one key and the one holding
//! the lower id commits later, the relay may already have published the higher id: no
//! relay can publish a row it cannot see. Application writers keep same-key rows in commit
//! order by inserting the outbox row *after* locking the aggregate it describes (e.g.
//! `SELECT ... FOR UPDATE` on the order row, then the business write, then the outbox
//! insert), so same-key transactions are serialized and commit in id order. Rows without a
//! key carry no order promise at all. Either way no row is skipped: the claim never keeps a
//! high-water mark, it always scans from the lowest pending id.

mod buckets;
mod by_key;
mod plan;

use std::sync::Arc;

use tokio_postgres::Row;

pub use self::buckets::BucketDepth;
use self::by_key::{claim_as_surplus, claim_by_key};
use self::plan::Candidate;
pub use super::floor::FloorView;
use super::sql::{RowLayout, TableSql};
pub use super::sql::{BUCKETS, FIRST_WINDOW};
use super::{SourceError, Tx};
use crate::config::Ordering;

/// One claimed row, as read from the table.
#[derive(Debug, Clone, Default)]
pub struct ClaimedRow {
    /// The order column's value (`id` by default): the row's handle in the claim, the
    /// mark and the delete.
    pub id: i64,
    /// The message id column's value as text, when it is not the order column.
    pub(crate) message_id: Option<String>,
    /// Shared with the message built from the row.
    pub key: Option<Arc<str>>,
    /// `None`: the column is NULL (a Kafka tombstone).
    pub(crate) payload: Option<Vec<u8>>,
    /// The headers column as JSON text, unchecked.
    pub(crate) headers: Option<String>,
    /// Failed attempts so far.
    pub(crate) attempts: i32,
    /// Seconds from the row's creation time to its claim (`None` without that column).
    pub(crate) age: Option<f64>,
    /// The row's creation time, in milliseconds since the Unix epoch (`None` without that
    /// column).
    pub(crate) created_ms: Option<i64>,
    /// Made pending again by `replay` (its lag is not a delivery lag).
    pub(crate) replayed: bool,
    /// Values of the topic template's columns, in template order.
    pub(crate) topic_values: Vec<Option<String>>,
    /// Values of the header columns, in configuration order.
    pub(crate) header_values: Vec<Option<String>>,
    /// Values of the dead-letter topic template's columns, in template order.
    pub(crate) dead_letter_values: Vec<Option<String>>,
    /// Values of the CloudEvents templates' columns, in their order (type, source,
    /// subject, datacontenttype).
    pub(crate) envelope_values: Vec<Option<String>>,
}

impl ClaimedRow {
    fn from_row(row: &Row, layout: &RowLayout) -> ClaimedRow {
        let mut i = 8;
        let message_id = layout.message_id.then(|| {
            i += 1;
            row.get(8)
        });
        let topic_values = (i..i + layout.topic_columns).map(|n| row.get(n)).collect();
        i += layout.topic_columns;
        let header_values = (i..i + layout.header_columns).map(|n| row.get(n)).collect();
        i += layout.header_columns;
        let dead_letter_values = (i..i + layout.dead_letter_columns)
            .map(|n| row.get(n))
            .collect();
        i += layout.dead_letter_columns;
        let envelope_values = (i..i + layout.envelope_columns)
            .map(|n| row.get(n))
            .collect();
        ClaimedRow {
            id: row.get(0),
            message_id,
            key: row.get::<_, Option<&str>>(1).map(Arc::from),
            payload: row.get::<_, Option<Vec<u8>>>(2),
            headers: row.get(3),
            attempts: row.get(4),
            age: row.get(5),
            replayed: row.get(6),
            created_ms: row.get(7),
            topic_values,
            header_values,
            dead_letter_values,
            envelope_values,
        }
    }
}

impl Candidate {
    fn from_row(r: &Row) -> Candidate {
        Candidate::from_row_at(r, 0)
    }

    /// The candidate whose four columns start at column `at`.
    fn from_row_at(r: &Row, at: usize) -> Candidate {
        Candidate {
            id: r.get(at),
            key: r.get::<_, Option<&str>>(at + 1).map(Arc::from),
            size: r.get::<_, i64>(at + 2).max(0) as u64,
            bucket: r.get(at + 3),
        }
    }
}

/// Claims up to `limit` rows in the open transaction `tx`, returned in id order.
///
/// `lane` (the worker's number) spreads concurrent key-ordered claims over a deep backlog:
/// see [`claim_by_key`].
///
/// Claims read from `floor` on, and below it only what [`super::floor`] says may be there.
pub async fn claim_batch(
    tx: &Tx<'_>,
    sql: &TableSql,
    ordering: Ordering,
    budget: Budget,
    lane: usize,
    floor: &FloorView,
    depth: &BucketDepth,
) -> Result<Claimed, SourceError> {
    match ordering {
        Ordering::None => Ok(Claimed {
            rows: claim_unordered(tx, sql, budget, floor).await?,
            contended: false,
        }),
        Ordering::Key => {
            let buckets_first = depth.is_surplus(lane) || (lane > 0 && depth.is_deep());
            let surplus = match buckets_first {
                true => claim_as_surplus(tx, sql, budget, floor, depth).await?,
                false => None,
            };
            let claimed = match surplus {
                Some(claimed) => claimed,
                None => match claim_by_key(tx, sql, budget, lane, floor, depth).await? {
                    // Left everything to lower lanes that may not be claiming: see
                    // claim_by_key.
                    (claimed, true) if claimed.rows.is_empty() => {
                        claim_by_key(tx, sql, budget, 0, floor, depth).await?.0
                    }
                    (claimed, _) => claimed,
                },
            };
            depth.note_claim(lane, claimed.contended);
            Ok(claimed)
        }
    }
}

/// What a claim took.
#[derive(Debug, Default)]
pub struct Claimed {
    /// The rows, in id order.
    pub rows: Vec<ClaimedRow>,
    /// Nothing was taken because other claimers hold every bucket of a deep backlog, or
    /// every key this claim met in it: the table has rows, and this claimer is one too
    /// many for now.
    pub contended: bool,
}

/// How much one claim takes at most: rows, and payload bytes (one larger row goes alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub rows: usize,
    pub bytes: u64,
}

/// `ordering = "none"`: rows with a failure history below the floor first (when the
/// floor's keeper saw any), then from the floor on, within the budget.
async fn claim_unordered(
    tx: &Tx<'_>,
    sql: &TableSql,
    budget: Budget,
    floor: &FloorView,
) -> Result<Vec<ClaimedRow>, SourceError> {
    let max_bytes = budget.bytes.min(i64::MAX as u64) as i64;
    let mut rows: Vec<ClaimedRow> = Vec::new();
    let mut bytes: i64 = 0;
    let low = floor.retrying && floor.value > i64::MIN;
    let statements = low
        .then_some(&sql.claim_unordered_low)
        .into_iter()
        .chain([&sql.claim_unordered]);
    for statement in statements {
        let room = budget.rows.saturating_sub(rows.len());
        if room == 0 || (!rows.is_empty() && bytes >= max_bytes) {
            break;
        }
        let alone = rows.is_empty();
        for r in tx
            .query(
                statement,
                &[&(room as i64), &floor.value, &(max_bytes - bytes), &alone],
            )
            .await?
        {
            let row = ClaimedRow::from_row(&r, &sql.layout);
            bytes += row.payload.as_ref().map_or(0, Vec::len) as i64;
            rows.push(row);
        }
    }
    Ok(rows)
}
