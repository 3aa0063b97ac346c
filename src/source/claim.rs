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
//! it taken would have to walk the table past them: measured, 8 relays of 4 workers on
//! one table delivered 0.12 of what one relay did, and 0.05 on 20 hot keys.
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
//! (a key's row published ahead of 21,000 earlier ids of its key; 2 of 4 runs failed).
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
//! claimers own in it, until one takes rows: measured on 8 relays of 4 workers, 20 hot
//! keys, first windows read fell from 1,483 to 586 per 200,000 rows. A hot key's backlog
//! fills only its bucket: the other buckets are read through the
//! index without passing its rows. How many buckets a claim asks for at once follows how
//! deep they have been lately ([`BucketDepth`]): one when a bucket fills a batch, several
//! when the backlog is spread thin.
//!
//! # Round trips
//!
//! Each statement of a claim waits one round trip to the database, which on a distant
//! database (another zone: 5-20 ms) is most of a batch's time. Three rules keep them few:
//!
//! - *Tails ride along.* The tails of a key this claim owns are locked with its next
//!   round's heads, and only those not tried yet are left for the last statement (often
//!   none).
//! - *Lanes above 0 take buckets first* on a deep backlog, once a pick has shown how many
//!   buckets fill a batch: the claim of a surplus lane ([`claim_as_surplus`]), starting
//!   with a pick in the order the last deep first window ranked the buckets (up to
//!   [`MAX_PICKS`] picks), instead of the first window, its lock round and then a pick.
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
//! one statement was tried and made each pick cost about three times as much
//! (docs/benchmark.md, *What did not work, and why*).
//!
//! Measured with `outbox-bench --distant` (100,000 rows, 4 workers, batches of 500):
//! 8.5-8.9 round trips per batch before these rules, 4.1-4.4 after the first three
//! (every connection's, the floor keeper's included), 2.9-3.1 with the fourth and a
//! batch's `COMMIT` carrying the next claim (`relay::batch`, *Batches that follow on*).
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

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};

use tokio_postgres::Row;

pub use super::floor::FloorView;
use super::sql::{RowLayout, TableSql, WINDOW_FACTOR};
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

/// Lock rounds per claim: each round locks the heads planned from what is left.
const MAX_ROUNDS: usize = 8;

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

/// A shallow first window (it holds every pending row) is planned as it is, in id order.
///
/// Lanes: every worker reads the same first window, so without lanes they would all plan
/// the same heads, and all but one would find them locked and plan again (measured: 4.3
/// lock statements per batch with 4 workers on a deep backlog, 2.1 with lanes). When the
/// first window is deep enough, the claim of lane `l` starts planning `l` batches into it,
/// leaving the keys met before that point to the lanes below (they are marked blocked, so
/// the head rule holds: a key planned here has no pending row earlier in the window).
/// Lane 0 always starts at the oldest pending row, and a shallow window is planned from its
/// start by every lane, so no row waits on a lane that is not claiming.
///
/// A deep first window (more pending rows than it holds) only ranks the buckets: the claim
/// takes buckets instead, see *Buckets* in the module doc.
///
/// Also says whether the claim left the window's first keys to lower lanes.
///
/// A lane's offset assumes the lanes below it claim too. When they do not (one worker
/// took an idle table's look, the others are elsewhere) and every key of the window's
/// first batches was left to them, the claim would take nothing and call the table empty:
/// on a deep backlog of few keys, its rows then waited for a lower lane's next look, and
/// when a lane above 0 kept taking the looks they waited for good (found by
/// `faults::a_hung_database_connection_is_discarded_not_reused`: 1,000 rows over 10 keys,
/// worker 1 claiming alone every 5 s and finding nothing, 1 run in 10). So
/// [`claim_batch`] plans again as lane 0, from the oldest row, when a claim that left
/// keys to lower lanes took nothing.
async fn claim_by_key(
    tx: &Tx<'_>,
    sql: &TableSql,
    budget: Budget,
    lane: usize,
    floor: &FloorView,
    depth: &BucketDepth,
) -> Result<(Claimed, bool), SourceError> {
    let mut plan = KeyPlan::new(budget);
    let mut rows: HashMap<i64, ClaimedRow> = HashMap::new();
    let limit = budget.rows;
    let stragglers: &[i64] = &floor.stragglers;
    // Past a few rows per bucket the first window only ranks buckets: a deep claim reads
    // its rows from the buckets it gets. Every claim reads it, idle claimers' included
    // (measured: 8 relays of 4 workers at 0.64 of one relay with 2,000 rows read per
    // claim, most of them by claimers that then found every bucket taken).
    let window_size = super::sql::window_rows(limit).min(sql.window_rows);
    let read = tx
        .query(&sql.window, &[&window_size, &floor.value, &stragglers])
        .await?;
    // Rows of withheld keys from their hidden part on are left alone (see *Withheld keys*
    // in `super::floor`): what is left holds a prefix of every key's pending rows.
    let first: Vec<Candidate> = read
        .iter()
        .map(Candidate::from_row)
        .filter(|c| !floor.hides(c.key.as_deref(), c.id))
        .collect();
    let end_of_first = read.last().map(|r| r.get::<_, i64>(0));
    let offset = (lane % WINDOW_FACTOR) * limit;
    let mut cursor = 0;
    let deferred = offset > 0 && first.len() >= offset + limit;
    if deferred {
        plan.leave_to_lower_lanes(&first[..offset]);
        cursor = offset;
    }
    let reached = lock_rounds(tx, sql, &mut plan, &first, cursor, &mut rows).await?;
    // A deep backlog whose first window did not fill the batch (its keys are other
    // claimers'): take buckets, read after the first window. Only once the rounds went
    // through the whole window: a key with rows left in it unplanned must not get tails
    // after it (its run would have a gap).
    let deep = (read.len() as i64) >= window_size;
    depth.note_deep(deep);
    let mut contended = false;
    if let (Some(last), true) = (end_of_first, deep && reached == first.len()) {
        // Keys of the first window that the rounds did not reach (the round limit) have
        // rows there that were not planned: their rows after it are not their heads.
        plan.leave_to_lower_lanes(&first);
        let candidates = ranked_buckets(&first);
        depth.remember_ranking(&candidates);
        // A bucket read starts at the floor: room for the first window's rows it reads
        // again (the most any one bucket had there).
        let reread = most_in_one_bucket(&first);
        let reread_bytes = first.iter().map(|c| c.size).sum();
        let picks = take_buckets(
            tx,
            sql,
            &mut plan,
            &mut rows,
            candidates,
            last,
            reread,
            reread_bytes,
            floor,
            depth,
        )
        .await?;
        // Every bucket is another claimer's, or every key this claim met is: the table
        // has rows, and this claimer is one too many for now.
        contended = picks.none_free || plan.reserved == 0;
    }
    let batch = finish_claim(tx, sql, &mut plan, rows).await?;
    let contended = contended && batch.is_empty();
    Ok((
        Claimed {
            contended,
            rows: batch,
        },
        deferred,
    ))
}

/// The claim of a lane whose last claim was contended ([`BucketDepth`]): buckets first, in
/// one statement, where [`claim_by_key`] would read the first window and try the heads
/// other claimers own in it before it asked for buckets. The buckets are tried in the
/// order the last deep first window ranked them (the oldest work first), then the others.
/// `None` when the buckets it got held no row: the backlog has moved on, and the claim is
/// planned as every claim is.
///
/// Why order holds: this is a claim whose first window is empty. Each bucket read holds,
/// in its own snapshot, every pending row of its keys from the very first up to where it
/// stops (see *Buckets*), so a key's first row there is its head, and the rows are
/// planned and locked under the same head rule.
async fn claim_as_surplus(
    tx: &Tx<'_>,
    sql: &TableSql,
    budget: Budget,
    floor: &FloorView,
    depth: &BucketDepth,
) -> Result<Option<Claimed>, SourceError> {
    let mut plan = KeyPlan::new(budget);
    let mut rows = HashMap::new();
    let ranking = depth.probe_ranking();
    let picks = take_buckets(
        tx,
        sql,
        &mut plan,
        &mut rows,
        ranking,
        super::sql::FIRST_WINDOW,
        0,
        0,
        floor,
        depth,
    )
    .await?;
    if plan.reserved > 0 {
        let rows = finish_claim(tx, sql, &mut plan, rows).await?;
        // Heads it owns are in the batch: never empty here.
        return Ok(Some(Claimed {
            contended: false,
            rows,
        }));
    }
    // No bucket free, or every key in the ones it got is another claimer's.
    Ok((picks.none_free || picks.saw_rows).then(|| Claimed {
        rows: Vec::new(),
        contended: true,
    }))
}

/// What [`take_buckets`] found.
struct Picks {
    /// Its first pick got no bucket: other claimers hold every one asked for.
    none_free: bool,
    /// Some bucket it got had rows to plan.
    saw_rows: bool,
}

/// Takes buckets (see *Buckets* in the module doc) from `candidates`, in order, for the
/// room `plan` has left, and plans and locks their rows; at most [`MAX_PICKS`] picks.
/// A bucket read's rows up to `after` of keys the plan already met are theirs (planned,
/// or left to others) and dropped; `reread` is room added per bucket for them, and
/// `reread_bytes` bytes to what a pick may lock.
#[allow(clippy::too_many_arguments)]
async fn take_buckets(
    tx: &Tx<'_>,
    sql: &TableSql,
    plan: &mut KeyPlan,
    rows: &mut HashMap<i64, ClaimedRow>,
    mut candidates: Vec<i32>,
    after: i64,
    reread: usize,
    reread_bytes: u64,
    floor: &FloorView,
    depth: &BucketDepth,
) -> Result<Picks, SourceError> {
    let stragglers: &[i64] = &floor.stragglers;
    let mut picks = 0;
    let mut found = Picks {
        none_free: false,
        saw_rows: false,
    };
    while plan.has_room() && !candidates.is_empty() && picks < MAX_PICKS {
        picks += 1;
        let room = plan.room();
        let want = depth.buckets_for(room);
        // Twice a bucket's share of the room, and at least a quarter of the room, so that
        // a few buckets fill the batch (other claimers may hold most of the buckets asked
        // for: with an eighth of the room a bucket, a claim on 50 keys after a database
        // restart took batches of 12-40 rows of 100), not so many that a pick of many
        // buckets reads many batches. Half the room at least read 1,500-2,000 rows a pick
        // of 6-8 buckets to lock 625 with a third of the keys held back (every row read
        // cost a held-row probe then, before `sql::parts::Parts::not_held_back` told the
        // held keys' rows by a hash table; a quarter of the room read less and let the
        // other keys' rows flow faster in benchmark K). Up
        // to the rows it may lock (a quarter more than the room): a bucket whose keys
        // are partly held elsewhere still fills the batch in one pick, where reading at
        // most the room needed a second pick (and round trip) about twice as often
        // (benchmark L).
        let per_bucket = room
            .div_ceil(want)
            .saturating_mul(2)
            .max(room / 4)
            .min(room + room / 4)
            .max(1)
            + reread;
        // The rows the statement locks, and sends back with their payloads: the batch's
        // room and a quarter more, in id order, within the bytes it has left (a quarter
        // more too), so the answer stays within the budget (more only when the keys met
        // first are held elsewhere), and the rows of known keys it reads again.
        let cap = Candidates {
            rows: room + room / 4 + reread,
            bytes: plan
                .bytes_left()
                .saturating_add(plan.bytes_left() / 4)
                .saturating_add(reread_bytes)
                .max(1),
        };
        let read = tx
            .query(
                &sql.pick_lock,
                &[
                    &after,
                    &(per_bucket as i64),
                    &candidates,
                    &floor.value,
                    &stragglers,
                    &sql.tag,
                    &(want as i64),
                    &(cap.rows as i64),
                    &(cap.bytes.min(i64::MAX as u64) as i64),
                ],
            )
            .await?;
        let Picked {
            window,
            got,
            tried,
            locked,
        } = Picked::split(&read, &sql.layout, cap);
        // The read starts at the floor, in its own snapshot: its rows up to the first
        // window's end of keys this claim met there are theirs already (planned, or
        // left to others); those of other keys are their heads now.
        let window: Vec<Candidate> = window
            .into_iter()
            .filter(|c| c.id > after || c.key.as_deref().is_some_and(|k| !plan.knows(k)))
            .filter(|c| !floor.hides(c.key.as_deref(), c.id))
            .collect();
        if got.is_empty() {
            found.none_free = picks == 1;
            break;
        }
        found.saw_rows |= !window.is_empty();
        // Buckets before the last one got were tried and are held elsewhere.
        let last = candidates.iter().position(|b| Some(b) == got.last());
        candidates.drain(..=last.unwrap_or(candidates.len() - 1));
        let keys = window
            .iter()
            .filter_map(|c| c.key.as_deref())
            .collect::<HashSet<_>>()
            .len();
        let before = plan.reserved;
        // A bucket read's rows planned partly are fine: its keys get no later rows. The
        // rows it locked are known: the rounds are planned without another statement.
        let locked_ids: HashSet<i64> = locked.keys().copied().collect();
        rows.extend(locked);
        plan_locked(plan, &window, &tried, &locked_ids);
        depth.observe(got.len(), keys, plan.reserved - before, room);
        // Fewer buckets than asked for: the pick tried every candidate and the others are
        // held elsewhere, so another pick would try the same ones again (measured, 8
        // relays of 4 workers: 311 of 378 second picks got no bucket on 2,000 keys, 978
        // of 1,071 on 20 keys). The batch goes with what it has.
        if got.len() < want {
            break;
        }
    }
    Ok(found)
}

/// Locks the planned tails not tried yet and returns the batch, in id order.
async fn finish_claim(
    tx: &Tx<'_>,
    sql: &TableSql,
    plan: &mut KeyPlan,
    mut rows: HashMap<i64, ClaimedRow>,
) -> Result<Vec<ClaimedRow>, SourceError> {
    let tails = plan.tails_to_try();
    let mut locked_tails = HashSet::new();
    // A few tails are not worth a round trip: they end their keys' runs here and wait
    // for a later claim (a run may end anywhere, see `KeyPlan::finish`).
    if !tails.is_empty() && tails.len() * TAILS_PER_STATEMENT > plan.reserved {
        for r in tx.query(&sql.lock_rows, &[&tails]).await? {
            locked_tails.insert(r.get::<_, i64>(0));
            rows.insert(r.get(0), ClaimedRow::from_row(&r, &sql.layout));
        }
    }
    let mut batch: Vec<ClaimedRow> = plan
        .finish(&locked_tails)
        .into_iter()
        .filter_map(|id| rows.remove(&id))
        .collect();
    batch.sort_unstable_by_key(|r| r.id);
    Ok(batch)
}

/// Plans `window` from `cursor` in rounds, locking each round's heads, until the batch is
/// full, the window is used up, or [`MAX_ROUNDS`] rounds were run; returns how far into
/// the window planning got.
///
/// Each round's statement also carries the tails not tried yet of keys owned since an
/// earlier statement: see *Round trips* in the module doc.
async fn lock_rounds(
    tx: &Tx<'_>,
    sql: &TableSql,
    plan: &mut KeyPlan,
    window: &[Candidate],
    mut cursor: usize,
    rows: &mut HashMap<i64, ClaimedRow>,
) -> Result<usize, SourceError> {
    let mut rounds = 0;
    while plan.has_room() && cursor < window.len() && rounds < MAX_ROUNDS {
        let mut ids = plan.plan_round(window, &mut cursor);
        if ids.is_empty() {
            break;
        }
        rounds += 1;
        ids.extend(plan.tails_to_try());
        let locked = tx.query(&sql.lock_rows, &[&ids]).await?;
        let locked_ids: HashSet<i64> = locked.iter().map(|r| r.get(0)).collect();
        plan.settle_round(&locked_ids);
        rows.extend(
            locked
                .iter()
                .map(|r| (r.get(0), ClaimedRow::from_row(r, &sql.layout))),
        );
    }
    Ok(cursor)
}

/// Every bucket, those of `window`'s rows first in the order of their first row (the
/// oldest work first), then the others.
fn ranked_buckets(window: &[Candidate]) -> Vec<i32> {
    let mut seen = [false; BUCKETS as usize];
    let mut ranked = Vec::with_capacity(BUCKETS as usize);
    for b in window
        .iter()
        .map(|c| c.bucket)
        .chain(0..BUCKETS)
        .filter(|b| (0..BUCKETS).contains(b))
    {
        if !std::mem::replace(&mut seen[b as usize], true) {
            ranked.push(b);
        }
    }
    ranked
}

/// The most rows of `window` in any one bucket.
fn most_in_one_bucket(window: &[Candidate]) -> usize {
    let mut counts = [0usize; BUCKETS as usize];
    for c in window.iter().filter(|c| (0..BUCKETS).contains(&c.bucket)) {
        counts[c.bucket as usize] += 1;
    }
    counts.into_iter().max().unwrap_or(0)
}

/// How many of a pick's rows it tries to lock (see [`TableSql::pick_lock`]): the first in
/// id order, at most `rows` rows and `bytes` payload bytes (the first whatever its size).
#[derive(Debug, Clone, Copy)]
struct Candidates {
    rows: usize,
    bytes: u64,
}

impl Candidates {
    /// The rows of `window` (in id order) the statement tried, as it chose them.
    fn of(self, window: &[Candidate]) -> HashSet<i64> {
        debug_assert!(window.is_sorted_by_key(|c| c.id));
        let mut run: u64 = 0;
        let mut chosen = HashSet::new();
        for (n, Candidate { id, size, .. }) in window.iter().enumerate() {
            if n >= self.rows || run >= self.bytes {
                break;
            }
            run = run.saturating_add(*size);
            chosen.insert(*id);
        }
        chosen
    }
}

/// What one [`TableSql::pick_lock`] read, locked and got.
struct Picked {
    /// The rows read, in id order.
    window: Vec<Candidate>,
    /// The buckets got, in the order they were got.
    got: Vec<i32>,
    /// The rows the statement tried to lock: the first of `window` in id order.
    tried: HashSet<i64>,
    /// The rows it locked.
    locked: HashMap<i64, ClaimedRow>,
}

impl Picked {
    /// Splits a pick's answer: each row read is the locked row's columns (NULL when not
    /// locked) then the four of the read; a bucket got is a row of NULLs but its bucket.
    fn split(read: &[Row], layout: &RowLayout, cap: Candidates) -> Picked {
        let at = layout.width();
        let mut picked = Picked {
            window: Vec::new(),
            got: Vec::new(),
            tried: HashSet::new(),
            locked: HashMap::new(),
        };
        for r in read {
            if r.get::<_, Option<i64>>(at).is_none() {
                picked.got.push(r.get(at + 3));
                continue;
            }
            picked.window.push(Candidate::from_row_at(r, at));
            if r.get::<_, Option<i64>>(0).is_some() {
                let row = ClaimedRow::from_row(r, layout);
                picked.locked.insert(row.id, row);
            }
        }
        picked.window.sort_unstable_by_key(|c| c.id);
        picked.tried = cap.of(&picked.window);
        picked
    }
}

/// Plans `window`, whose rows in `tried` were locked (those in `locked`) by the statement
/// that read it, in rounds as [`lock_rounds`] does, without a statement: a head that was
/// not tried counts as held elsewhere (its key is blocked); a tail that was not tried
/// stays for the claim's last statement.
fn plan_locked(
    plan: &mut KeyPlan,
    window: &[Candidate],
    tried: &HashSet<i64>,
    locked: &HashSet<i64>,
) {
    let mut cursor = 0;
    let mut rounds = 0;
    while plan.has_room() && cursor < window.len() && rounds < MAX_ROUNDS {
        if plan.plan_round(window, &mut cursor).is_empty() {
            break;
        }
        rounds += 1;
        plan.tails_tried_where(|id| tried.contains(&id));
        plan.settle_round(locked);
    }
}

/// What this process has seen of a table's buckets lately, from its picks: how many
/// buckets a claim asks for at once. Two needs set it. Rows: a bucket that filled a batch
/// alone asks for one; a backlog spread thin asks for several, so a middling backlog does
/// not cost one statement per bucket. Keys: a batch of few keys is sent in many waves (a
/// key's next row waits for its last one's ack on NATS, see `relay::order`), so a claim
/// asks for enough buckets to hold about one key per [`ROWS_PER_KEY`] rows of room (at
/// least [`MIN_KEYS`]): on 20 hot keys, one bucket a claim sent each batch as 500 waves
/// of one message, slower than the claim before buckets, which took every key at once
/// (benchmark S, 20 keys); 16 keys a claim still made batches of 100 on
/// 50 keys go out in about 8 waves instead of 2, too slow for `faults::postgres_restarted_…`
/// to drain 100,000 rows in a loaded CI run.
///
/// It also remembers which lanes are *surplus* (their last claim of a deep backlog found
/// every bucket, or every key it met, taken) and the buckets the last deep first window
/// met, oldest work first: a surplus lane tries those buckets before anything else (see
/// [`claim_as_surplus`]).
#[derive(Debug, Default)]
pub struct BucketDepth {
    /// Rows the last pick took per bucket got (0: unknown yet).
    rows_per_bucket: AtomicUsize,
    /// Keys per bucket got in the last pick, times 16 (0: unknown yet).
    keys_per_bucket_x16: AtomicUsize,
    /// Bit `lane % 64`: that lane's last claim was contended.
    surplus: AtomicU64,
    /// The last deep first window's bucket ranking ([`ranked_buckets`]).
    recent: Mutex<Vec<i32>>,
    /// The last first window read was deep (it did not hold every pending row).
    deep: AtomicBool,
}

fn lane_bit(lane: usize) -> u64 {
    1 << (lane % 64)
}

/// Buckets one pick takes at most: all of them.
const MAX_PICK: usize = BUCKETS as usize;
/// Picks per claim at most.
const MAX_PICKS: usize = 4;
/// The claim's last statement locks the tails its earlier ones did not try only when
/// they are more than one in this many of the rows planned; fewer are left for a later
/// claim (*Round trips*).
const TAILS_PER_STATEMENT: usize = 8;
/// A claim aims at one key per this many rows of room (a batch in about this many waves),
/// when there are that many keys.
const ROWS_PER_KEY: usize = 4;
/// And at this many keys at least.
const MIN_KEYS: usize = 16;

impl BucketDepth {
    /// Buckets to ask for to fill `room` rows.
    fn buckets_for(&self, room: usize) -> usize {
        let by_rows = match self.rows_per_bucket.load(AtomicOrdering::Relaxed) {
            0 => 1,
            per => room.div_ceil(per),
        };
        let by_keys = match self.keys_per_bucket_x16.load(AtomicOrdering::Relaxed) {
            0 => 1,
            per => ((room / ROWS_PER_KEY).max(MIN_KEYS) * 16).div_ceil(per),
        };
        by_rows.max(by_keys).clamp(1, MAX_PICK)
    }

    /// Whether `lane`'s last claim was contended.
    fn is_surplus(&self, lane: usize) -> bool {
        self.surplus.load(AtomicOrdering::Relaxed) & lane_bit(lane) != 0
    }

    /// Records whether `lane`'s claim was contended.
    fn note_claim(&self, lane: usize, contended: bool) {
        if contended {
            self.surplus
                .fetch_or(lane_bit(lane), AtomicOrdering::Relaxed);
        } else {
            self.surplus
                .fetch_and(!lane_bit(lane), AtomicOrdering::Relaxed);
        }
    }

    /// Records whether the last first window read was deep.
    fn note_deep(&self, deep: bool) {
        self.deep.store(deep, AtomicOrdering::Relaxed);
    }

    /// Whether the last first window read was deep and a pick has shown how many buckets
    /// fill a batch: lanes above 0 claim buckets first then.
    fn is_deep(&self) -> bool {
        self.deep.load(AtomicOrdering::Relaxed)
            && self.rows_per_bucket.load(AtomicOrdering::Relaxed) > 0
    }

    /// Remembers the ranking of a deep first window ([`ranked_buckets`]).
    fn remember_ranking(&self, ranked: &[i32]) {
        let mut recent = self.recent.lock().unwrap();
        recent.clear();
        recent.extend_from_slice(ranked);
    }

    /// The order a surplus claim tries buckets in: the last deep first window's ranking
    /// (the buckets it met, oldest work first, then every other one); every bucket in
    /// order before any was remembered.
    fn probe_ranking(&self) -> Vec<i32> {
        let recent = self.recent.lock().unwrap();
        match recent.is_empty() {
            true => (0..BUCKETS).collect(),
            false => recent.clone(),
        }
    }

    /// A pick got `buckets` holding `keys`, and the claim took `taken` rows of them, with
    /// `room` left before.
    fn observe(&self, buckets: usize, keys: usize, taken: usize, room: usize) {
        let buckets = buckets.max(1);
        // A bucket that filled the batch may be deeper still: count it as full.
        let per = if taken >= room {
            room
        } else {
            (taken / buckets).max(1)
        };
        self.rows_per_bucket.store(per, AtomicOrdering::Relaxed);
        self.keys_per_bucket_x16
            .store((keys * 16 / buckets).max(1), AtomicOrdering::Relaxed);
    }
}

/// A pending row seen in a window: its id, key, size and bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) id: i64,
    /// Shared by the claim's maps of keys, not copied into them.
    pub(crate) key: Option<Arc<str>>,
    /// Payload bytes.
    pub(crate) size: u64,
    /// The key's bucket ([`super::sql::bucket_of`]; by id for a row without a key).
    pub(crate) bucket: i32,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyState {
    /// Head planned in the current round, lock not yet tried.
    Planned { head: i64 },
    /// Head locked by this transaction.
    Owned { head: i64 },
    /// Head locked by someone else, or seen in an earlier window and not owned.
    Blocked,
}

/// The pure part of a key-ordered claim: which heads to lock, which rows follow them.
#[derive(Debug)]
pub(crate) struct KeyPlan {
    capacity: usize,
    reserved: usize,
    /// Payload bytes the batch may take, and those reserved so far.
    byte_budget: u64,
    bytes: u64,
    /// The next row did not fit the byte budget: planning stops until rows are released.
    full: bool,
    /// Sizes of the rows reserved.
    sizes: HashMap<i64, u64>,
    keys: HashMap<Arc<str>, KeyState>,
    /// Rows after the head, per key, in id order.
    tails: HashMap<Arc<str>, Vec<i64>>,
    /// Tail rows a lock statement has tried (sent), and those it got.
    tried: HashSet<i64>,
    locked_tails: HashSet<i64>,
    /// Rows without a key locked so far.
    unkeyed: Vec<i64>,
    /// Rows without a key planned in the current round.
    unkeyed_planned: Vec<i64>,
}

impl KeyPlan {
    pub(crate) fn new(budget: Budget) -> KeyPlan {
        KeyPlan {
            capacity: budget.rows,
            reserved: 0,
            byte_budget: budget.bytes,
            bytes: 0,
            full: false,
            sizes: HashMap::new(),
            keys: HashMap::new(),
            tails: HashMap::new(),
            tried: HashSet::new(),
            locked_tails: HashSet::new(),
            unkeyed: Vec::new(),
            unkeyed_planned: Vec::new(),
        }
    }

    pub(crate) fn has_room(&self) -> bool {
        self.reserved < self.capacity && !self.full
    }

    /// Rows the batch may still take.
    pub(crate) fn room(&self) -> usize {
        self.capacity - self.reserved
    }

    /// Reserves `row`'s bytes, unless they do not fit beside rows already reserved (the
    /// first row fits whatever its size).
    fn take_bytes(&mut self, row: &Candidate) -> bool {
        if self.reserved > 0 && self.bytes.saturating_add(row.size) > self.byte_budget {
            self.full = true;
            return false;
        }
        self.bytes += row.size;
        self.sizes.insert(row.id, row.size);
        true
    }

    /// Gives back the reservation of row `id`.
    fn release(&mut self, id: i64) {
        self.reserved -= 1;
        self.bytes -= self.sizes.remove(&id).unwrap_or(0);
        self.full = false;
    }

    /// Walks `window` from `cursor`, reserving rows until the batch is full, and returns
    /// the heads (and key-less rows) to lock in this round. Every key met in a window is
    /// settled at that point: its first row is its head.
    pub(crate) fn plan_round(&mut self, window: &[Candidate], cursor: &mut usize) -> Vec<i64> {
        let mut heads = Vec::new();
        while self.has_room() && *cursor < window.len() {
            let row = &window[*cursor];
            let blocked = matches!(
                row.key.as_ref().and_then(|k| self.keys.get(k)),
                Some(KeyState::Blocked)
            );
            // A row that does not fit stays at the cursor for a later round.
            if !blocked && !self.take_bytes(row) {
                break;
            }
            *cursor += 1;
            match &row.key {
                None => {
                    self.unkeyed_planned.push(row.id);
                    heads.push(row.id);
                    self.reserved += 1;
                }
                Some(key) => match self.keys.get(key) {
                    Some(KeyState::Blocked) => {}
                    Some(KeyState::Owned { .. } | KeyState::Planned { .. }) => {
                        self.tails.entry(key.clone()).or_default().push(row.id);
                        self.reserved += 1;
                    }
                    None => {
                        self.keys
                            .insert(key.clone(), KeyState::Planned { head: row.id });
                        heads.push(row.id);
                        self.reserved += 1;
                    }
                },
            }
        }
        heads
    }

    /// Leaves every key met in `prefix` to other claimers: they are blocked for this claim.
    pub(crate) fn leave_to_lower_lanes(&mut self, prefix: &[Candidate]) {
        for key in prefix.iter().filter_map(|row| row.key.as_ref()) {
            self.keys.entry(key.clone()).or_insert(KeyState::Blocked);
        }
    }

    /// Whether this claim has met `key` (planned, owned or left to others).
    pub(crate) fn knows(&self, key: &str) -> bool {
        self.keys.contains_key(key)
    }

    /// Tails to send with the next lock statement, each tried once: those of the keys
    /// owned so far.
    pub(crate) fn tails_to_try(&mut self) -> Vec<i64> {
        let mut ids = Vec::new();
        for (key, state) in &self.keys {
            if let (KeyState::Owned { .. }, Some(tail)) = (state, self.tails.get(key)) {
                ids.extend(tail.iter().filter(|id| !self.tried.contains(id)));
            }
        }
        self.tried.extend(&ids);
        ids.sort_unstable();
        ids
    }

    /// Payload bytes the batch may still take.
    pub(crate) fn bytes_left(&self) -> u64 {
        self.byte_budget.saturating_sub(self.bytes)
    }

    /// Marks as tried the tails (of keys owned or planned) that `tried` says a statement
    /// tried to lock along with the round's heads.
    pub(crate) fn tails_tried_where(&mut self, tried: impl Fn(i64) -> bool) {
        for (key, state) in &self.keys {
            if matches!(state, KeyState::Blocked) {
                continue;
            }
            if let Some(tail) = self.tails.get(key) {
                self.tried
                    .extend(tail.iter().copied().filter(|id| tried(*id)));
            }
        }
    }

    /// Records which of the round's heads this transaction locked; keys whose head it did
    /// not get are blocked and their reserved rows released (their tails this claim may
    /// have locked with the head are never published: only released at its end). Tails
    /// the statement got are recorded for [`KeyPlan::finish`].
    pub(crate) fn settle_round(&mut self, locked: &HashSet<i64>) {
        self.locked_tails
            .extend(locked.iter().filter(|id| self.tried.contains(id)));
        let mut released = Vec::new();
        for id in std::mem::take(&mut self.unkeyed_planned) {
            if locked.contains(&id) {
                self.unkeyed.push(id);
            } else {
                released.push(id);
            }
        }
        for (key, state) in self.keys.iter_mut() {
            if let KeyState::Planned { head } = *state {
                if locked.contains(&head) {
                    *state = KeyState::Owned { head };
                } else {
                    *state = KeyState::Blocked;
                    released.push(head);
                    released.extend(self.tails.remove(key).unwrap_or_default());
                }
            }
        }
        for id in released {
            self.release(id);
        }
    }

    /// Rows after owned heads, to lock once all rounds are done.
    #[cfg(test)]
    pub(crate) fn tails(&self) -> Vec<i64> {
        let mut ids: Vec<i64> = self.tails.values().flatten().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The batch: key-less rows locked, owned heads, and for each owned key the unbroken
    /// run of tail rows locked after its head. A tail row someone else holds (a row that
    /// committed late, below a head another claimer already took, or one a pick locked
    /// without taking it, see *Round trips*) ends its key's run there.
    pub(crate) fn finish(&self, locked_tails: &HashSet<i64>) -> Vec<i64> {
        let mut ids = self.unkeyed.clone();
        for (key, state) in &self.keys {
            if let KeyState::Owned { head } = state {
                ids.push(*head);
                if let Some(tail) = self.tails.get(key) {
                    ids.extend(tail.iter().take_while(|id| {
                        self.locked_tails.contains(id) || locked_tails.contains(id)
                    }));
                }
            }
        }
        ids.sort_unstable();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key's bucket is its first letter's place in the alphabet ('a': 0).
    fn window(rows: &[(i64, Option<&str>)]) -> Vec<Candidate> {
        rows.iter()
            .map(|(id, key)| Candidate {
                id: *id,
                key: key.map(Arc::from),
                size: 100,
                bucket: key.map_or(-1, |k| i32::from(k.as_bytes()[0] - b'a')),
            })
            .collect()
    }

    /// A budget of `n` rows and bytes enough for all of them.
    fn budget(n: usize) -> Budget {
        Budget {
            rows: n,
            bytes: u64::MAX,
        }
    }

    fn all(ids: &[i64]) -> HashSet<i64> {
        ids.iter().copied().collect()
    }

    #[test]
    fn heads_are_first_rows_of_each_key_and_tails_follow() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("b")),
            (3, Some("a")),
            (4, None),
            (5, Some("a")),
        ]);
        let mut plan = KeyPlan::new(budget(10));
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![1, 2, 4]);
        plan.settle_round(&all(&[1, 2, 4]));
        assert_eq!(plan.tails(), vec![3, 5]);
        assert_eq!(plan.finish(&all(&[3, 5])), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_key_whose_head_is_held_elsewhere_is_skipped_whole() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("b")),
            (3, Some("a")),
            (4, Some("b")),
        ]);
        let mut plan = KeyPlan::new(budget(10));
        let mut cursor = 0;
        plan.plan_round(&w, &mut cursor);
        plan.settle_round(&all(&[2])); // someone else holds row 1, head of "a"
        assert_eq!(plan.tails(), vec![4]);
        assert_eq!(plan.finish(&all(&[4])), vec![2, 4]);
    }

    #[test]
    fn capacity_freed_by_a_blocked_key_goes_to_later_keys() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("a")),
            (3, Some("b")),
            (4, Some("c")),
        ]);
        let mut plan = KeyPlan::new(budget(2));
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![1]);
        plan.settle_round(&HashSet::new()); // "a" is owned elsewhere
        assert!(plan.has_room());
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![3, 4]);
        plan.settle_round(&all(&[3, 4]));
        assert_eq!(plan.finish(&HashSet::new()), vec![3, 4]);
    }

    #[test]
    fn a_keys_run_stops_at_the_first_tail_row_it_could_not_lock() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("a")),
            (3, Some("a")),
            (4, Some("a")),
        ]);
        let mut plan = KeyPlan::new(budget(10));
        let mut cursor = 0;
        plan.plan_round(&w, &mut cursor);
        plan.settle_round(&all(&[1]));
        // Row 3 is held by another transaction: 4 must not be published before it.
        assert_eq!(plan.finish(&all(&[2, 4])), vec![1, 2]);
    }

    #[test]
    fn tails_ride_with_the_next_statement_and_each_is_tried_once() {
        // Round 1 owns a; round 2 (a later window) plans b and gets a's tails along.
        let first = window(&[(1, Some("a")), (2, Some("a"))]);
        let later = window(&[(3, Some("b")), (4, Some("a")), (5, Some("b"))]);
        let mut plan = KeyPlan::new(budget(10));
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&first, &mut cursor), vec![1]);
        assert_eq!(plan.tails_to_try(), Vec::<i64>::new(), "a is only planned");
        plan.settle_round(&all(&[1]));
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&later, &mut cursor), vec![3]);
        assert_eq!(
            plan.tails_to_try(),
            vec![2, 4],
            "a is owned: its tails ride"
        );
        plan.settle_round(&all(&[2, 3, 4]));
        // What is left for the last statement: b's tail only, not a's again.
        assert_eq!(plan.tails_to_try(), vec![5]);
        assert_eq!(plan.tails_to_try(), Vec::<i64>::new());
        assert_eq!(plan.finish(&all(&[5])), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_picks_candidates_are_its_first_rows_within_rows_and_bytes() {
        let w: Vec<Candidate> = [(1, 100), (2, 100), (3, 900), (4, 100), (5, 100)]
            .into_iter()
            .map(|(id, size)| Candidate {
                id,
                key: Some("k".into()),
                size,
                bucket: 0,
            })
            .collect();
        let of = |rows, bytes| {
            let mut ids: Vec<i64> = Candidates { rows, bytes }.of(&w).into_iter().collect();
            ids.sort_unstable();
            ids
        };
        assert_eq!(of(3, u64::MAX), vec![1, 2, 3]);
        // Row 3 starts below 250 bytes and is taken whatever its size; row 4 is not.
        assert_eq!(of(10, 250), vec![1, 2, 3]);
        assert_eq!(of(10, 200), vec![1, 2]);
        assert_eq!(of(10, 1), vec![1], "a first row whatever its size");
    }

    #[test]
    fn a_tail_locked_with_a_head_not_got_is_never_published() {
        // In a bucket this claim holds, tails go with their heads. Key a's head is held
        // elsewhere: its tails this claim got stay out of the batch and their room is
        // given back; b's run stops at the tail it could not get.
        let w = window(&[
            (1, Some("a")),
            (2, Some("b")),
            (3, Some("a")),
            (4, Some("b")),
            (5, Some("b")),
        ]);
        let mut plan = KeyPlan::new(budget(5));
        // The pick tried every row and got 2, 3 and 5.
        plan_locked(&mut plan, &w, &all(&[1, 2, 3, 4, 5]), &all(&[2, 3, 5]));
        assert_eq!(plan.room(), 2, "a's rows are given back");
        assert_eq!(plan.tails_to_try(), Vec::<i64>::new());
        assert_eq!(plan.finish(&HashSet::new()), vec![2]);
    }

    #[test]
    fn keys_seen_in_an_earlier_window_stay_blocked_in_later_ones() {
        let mut plan = KeyPlan::new(budget(10));
        let first = window(&[(1, Some("a"))]);
        let mut cursor = 0;
        plan.plan_round(&first, &mut cursor);
        plan.settle_round(&HashSet::new());
        let second = window(&[(7, Some("a")), (8, Some("b"))]);
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&second, &mut cursor), vec![8]);
    }

    #[test]
    fn a_lane_never_plans_a_key_met_before_its_start() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("b")),
            (3, Some("a")),
            (4, Some("c")),
            (5, None),
            (6, Some("b")),
        ]);
        let mut plan = KeyPlan::new(budget(10));
        plan.leave_to_lower_lanes(&w[..2]);
        let mut cursor = 2;
        // Row 3 is not a head ("a" starts at 1) and row 6 is not either: only "c" and the
        // key-less row are this lane's.
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![4, 5]);
        plan.settle_round(&all(&[4, 5]));
        assert_eq!(plan.finish(&HashSet::new()), vec![4, 5]);
        // Further on, "a" and "b" stay left to the lower lanes.
        let later = window(&[(7, Some("a")), (8, Some("b")), (9, Some("d"))]);
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&later, &mut cursor), vec![9]);
    }

    #[test]
    fn the_batch_never_exceeds_its_capacity() {
        let rows: Vec<(i64, Option<&str>)> = (1..=100)
            .map(|i| {
                (
                    i,
                    if i % 3 == 0 {
                        None
                    } else {
                        Some(["a", "b", "c", "d"][i as usize % 4])
                    },
                )
            })
            .collect();
        let w = window(&rows);
        let mut plan = KeyPlan::new(budget(17));
        let mut cursor = 0;
        let heads = plan.plan_round(&w, &mut cursor);
        plan.settle_round(&heads.iter().copied().collect());
        let tails: HashSet<i64> = plan.tails().into_iter().collect();
        assert_eq!(plan.finish(&tails).len(), 17);
    }

    #[test]
    fn the_byte_budget_ends_the_batch_and_a_larger_row_goes_alone() {
        let w = window(&[(1, Some("a")), (2, Some("b")), (3, Some("c"))]); // 100 bytes each
        let mut plan = KeyPlan::new(Budget {
            rows: 10,
            bytes: 250,
        });
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![1, 2]);
        assert!(!plan.has_room(), "row 3 would pass 250 bytes");

        let mut plan = KeyPlan::new(Budget {
            rows: 10,
            bytes: 50,
        });
        let mut cursor = 0;
        assert_eq!(
            plan.plan_round(&w, &mut cursor),
            vec![1],
            "alone, though larger"
        );
    }

    #[test]
    fn bytes_of_a_key_held_elsewhere_go_back_to_the_budget() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("a")),
            (3, Some("b")),
            (4, Some("c")),
        ]);
        let mut plan = KeyPlan::new(Budget {
            rows: 10,
            bytes: 250,
        });
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![1]);
        plan.settle_round(&HashSet::new()); // "a" is held elsewhere: its 200 bytes return
        assert!(plan.has_room());
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![3, 4]);
    }

    #[test]
    fn buckets_are_ranked_by_their_oldest_row_then_the_rest() {
        let w: Vec<Candidate> = [(1, 5), (2, 3), (3, 5), (4, 9)]
            .iter()
            .map(|&(id, bucket)| Candidate {
                id,
                key: Some(format!("k{bucket}").into()),
                size: 1,
                bucket,
            })
            .collect();
        let ranked = ranked_buckets(&w);
        assert_eq!(&ranked[..5], &[5, 3, 9, 0, 1]);
        assert_eq!(ranked.len(), BUCKETS as usize, "every bucket, once");
    }

    #[test]
    fn a_claim_asks_for_more_buckets_when_they_are_thin_or_hold_few_keys() {
        let depth = BucketDepth::default();
        assert_eq!(depth.buckets_for(500), 1, "nothing seen yet");
        // One bucket filled the batch with 31 keys: enough buckets for 125 keys (500 rows
        // in about 4 waves).
        depth.observe(1, 31, 500, 500);
        assert_eq!(depth.buckets_for(500), 5);
        // Two buckets gave 40 rows: a batch needs 25 such buckets.
        depth.observe(2, 40, 40, 500);
        assert_eq!(depth.buckets_for(500), 25);
        // One hot key filled a bucket: every bucket (at most 64).
        depth.observe(1, 1, 500, 500);
        assert_eq!(depth.buckets_for(500), 64);
        // A batch of 100 in buckets of 4 keys: 25 keys, 7 buckets.
        depth.observe(4, 16, 100, 100);
        assert_eq!(depth.buckets_for(100), 7);
    }

    #[test]
    fn a_lane_is_surplus_from_a_contended_claim_until_it_takes_rows() {
        let depth = BucketDepth::default();
        assert!(!depth.is_surplus(3));
        depth.note_claim(3, true);
        assert!(depth.is_surplus(3));
        assert!(!depth.is_surplus(2), "lanes are marked apart");
        depth.note_claim(2, true);
        depth.note_claim(3, false);
        assert!(!depth.is_surplus(3));
        assert!(depth.is_surplus(2));
    }

    #[test]
    fn a_surplus_claim_tries_the_buckets_the_last_deep_window_met_first() {
        let depth = BucketDepth::default();
        assert_eq!(depth.probe_ranking(), (0..BUCKETS).collect::<Vec<_>>());
        let first: Vec<Candidate> = [9, 2, 40]
            .into_iter()
            .enumerate()
            .map(|(id, bucket)| Candidate {
                id: id as i64,
                key: Some(format!("k{bucket}").into()),
                size: 1,
                bucket,
            })
            .collect();
        depth.remember_ranking(&ranked_buckets(&first));
        let ranked = depth.probe_ranking();
        assert_eq!(&ranked[..5], &[9, 2, 40, 0, 1]);
        assert_eq!(ranked.len(), BUCKETS as usize, "every bucket, once");
    }
}
