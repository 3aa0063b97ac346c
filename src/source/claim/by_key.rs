//! The key-ordered claim: plan from the first window and lock each round's heads
//! ([`claim_by_key`]), or start with buckets when this lane is surplus
//! ([`claim_as_surplus`]); then lock the tails left and hand back the batch. Why order
//! holds is the parent module's doc.

use std::collections::{HashMap, HashSet};

use super::super::sql::{TableSql, WINDOW_FACTOR};
use super::super::{SourceError, Tx};
use super::buckets::{most_in_one_bucket, ranked_buckets, take_buckets, BucketDepth, Pick};
use super::plan::{Candidate, KeyPlan, MAX_ROUNDS};
use super::{Budget, Claimed, ClaimedRow, FloorView};

/// A shallow first window (it holds every pending row) is planned as it is, in id order.
///
/// Lanes: every worker reads the same first window, so without lanes they would all plan
/// the same heads, and all but one would find them locked and plan again, a lock statement
/// (and a round trip) each time. When the first window is deep enough, the claim of lane
/// `l` starts planning `l` batches into it, leaving the keys met before that point to the
/// lanes below (they are marked blocked, so the head rule holds: a key planned here has no
/// pending row earlier in the window).
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
/// `faults::a_hung_database_connection_is_discarded_not_reused`, where worker 1, claiming
/// alone on a backlog of few keys, found nothing look after look). So
/// [`claim_batch`] plans again as lane 0, from the oldest row, when a claim that left
/// keys to lower lanes took nothing.
pub(super) async fn claim_by_key(
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
    // its rows from the buckets it gets. Every claim reads it, idle claimers' included: a
    // larger window was read mostly by claimers that then found every bucket taken, and
    // held many relays on one table well below one relay's rate (benchmark S).
    let window_size = super::super::sql::window_rows(limit).min(sql.window_rows);
    let read = tx
        .query(&sql.window, &[&window_size, &floor.value, &stragglers])
        .await?;
    // Rows of withheld keys from their hidden part on are left alone (see *Withheld keys*
    // in `source::floor`): what is left holds a prefix of every key's pending rows.
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
        let pick = Pick {
            candidates,
            after: last,
            reread,
            reread_bytes,
        };
        let picks = take_buckets(tx, sql, &mut plan, &mut rows, pick, floor, depth).await?;
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
pub(super) async fn claim_as_surplus(
    tx: &Tx<'_>,
    sql: &TableSql,
    budget: Budget,
    floor: &FloorView,
    depth: &BucketDepth,
) -> Result<Option<Claimed>, SourceError> {
    let mut plan = KeyPlan::new(budget);
    let mut rows = HashMap::new();
    let ranking = depth.probe_ranking();
    let pick = Pick {
        candidates: ranking,
        after: super::super::sql::FIRST_WINDOW,
        reread: 0,
        reread_bytes: 0,
    };
    let picks = take_buckets(tx, sql, &mut plan, &mut rows, pick, floor, depth).await?;
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

/// Locks the planned tails not tried yet and returns the batch, in id order.
pub(super) async fn finish_claim(
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
pub(super) async fn lock_rounds(
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

/// The claim's last statement locks the tails its earlier ones did not try only when
/// they are more than one in this many of the rows planned; fewer are left for a later
/// claim (*Round trips*).
const TAILS_PER_STATEMENT: usize = 8;
