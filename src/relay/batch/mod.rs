//! One batch, in four phases, each short and each bounded:
//!
//! 1. **claim**: open a transaction and lock up to a batch of rows (see
//!    [`crate::source::claim`]); the only phase that `stop` may cut short, since nothing
//!    was sent yet (the transaction rolls back).
//! 2. **publish**: turn rows into messages and send them in per-key order
//!    ([`super::order`]), bounded by `sink.publish_timeout`, cut short by a lost broker
//!    connection; outcomes are recorded row by row as acknowledgements arrive.
//! 3. **settle** ([`settle`], pure): from the outcomes alone, decide what is written back.
//!    Only rows the broker acknowledged are marked or deleted; a row refused for its own
//!    sake records an attempt; a row whose destination cannot take it now is postponed
//!    without one; everything else stays pending as it was.
//! 4. **finalize**: write that back and commit.
//!
//! From the claim on, only `abort` (the shutdown deadline) interrupts: the transaction is
//! dropped and rolled back, so every row not committed as published stays pending.
//!
//! # Batches that follow on
//!
//! A batch whose every row was published does not wait for its `COMMIT` before the next
//! claim: the next batch's `BEGIN` and first claim statement go out behind it on the same
//! session ([`Tx::execute_commit_then`]), and the worker goes on with what comes back
//! ([`relay_batches`]). On a distant database that is one of the few round trips a batch
//! waits (benchmark L). Nothing else changes:
//!
//! - **What the claim sees.** PostgreSQL runs what one session sends in order, so the
//!   claim runs after the `COMMIT`, in a snapshot that has this batch's rows deleted or
//!   marked, exactly as if it had waited. The claim invariant and the floor's proof
//!   (`source::claim`, `source::floor`) are about what a claim sees and locks, and do not
//!   know the difference.
//! - **A failed commit.** The claim ran after the rollback: its transaction is dropped
//!   (rolled back) with the error, and the batch's rows stay pending as before.
//! - **Which table.** The one the worker's next round would take ([`follow_on`]):
//!   the next after this one that is due for a look, so several tables still take turns.
//!   A table with `max_rate` never follows on (its tokens are taken per batch).
//! - **`stop`.** No batch follows on once `stop` fired; one that was claimed with the
//!   `COMMIT` when it fired is rolled back unsent, like a claim `stop` cuts short.
//! - **Trouble.** A batch with a failed, postponed or unacknowledged row does not follow
//!   on: the worker backs off or the breaker opens as before.

mod dead_letter;
mod observe;
mod phases;

use std::time::{Duration, Instant};

use tracing::Instrument;

use super::order::RowOutcome;
use super::{RunTable, Shared};
use crate::error::ErrorClass;
use crate::sink::SinkError;
use crate::source::claim::{Claimed, ClaimedRow};
use crate::source::rate::Grant;
use crate::source::settle::Settlement;
use crate::source::{Source, SourceError, Tx};

use self::phases::run_phases;
use super::breaker::BreakerState;
use super::wake::Ticket;

/// Why a batch could not run; each maps to retry-later or stop-the-process.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BatchError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("{0}")]
    Sink(SinkError),
}

impl BatchError {
    pub(crate) fn class(&self) -> ErrorClass {
        match self {
            BatchError::Source(e) => e.class(),
            BatchError::Sink(e) => e.class,
        }
    }
}

/// How one attempt at a table ended.
pub(crate) enum Batch {
    /// Nothing to claim in this table.
    Empty,
    /// Rows are there, but other claimers hold every bucket of them.
    Contended,
    /// The table's `max_rate` has no token left: the next is due after this long.
    Throttled(std::time::Duration),
    /// Claimed, published what it could, committed. `trouble` is set when some rows failed
    /// for a transient reason: the worker backs off before claiming again.
    Done {
        trouble: Option<SinkError>,
        published: usize,
        /// Rows claimed (the tokens a rate-limited table's batch used).
        claimed: usize,
        /// The soonest retry this batch scheduled, if any row failed for itself.
        retry_in: Option<std::time::Duration>,
    },
    /// `stop` fired during the claim: nothing was claimed.
    Stopped,
    /// `abort` fired with rows in flight: rolled back.
    Aborted,
}

/// What a batch's outcomes decide: what it writes back, and whether the worker backs off.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Decision {
    /// What is written back to the table ([`commit_batch`]).
    pub(crate) settlement: Settlement,
    /// Some rows failed for the broker's sake or got no answer in time: they stay pending
    /// and the worker backs off.
    pub(crate) trouble: Option<SinkError>,
}

/// Decides what to write back for `rows` given their `outcomes` (index-aligned).
/// `retry_wait(n)` is the wait before the next attempt of a row that has failed `n` times
/// before. A fatal outcome (retrying cannot help) is returned as the error: nothing is
/// written and the batch rolls back.
pub(crate) fn settle(
    rows: &[ClaimedRow],
    outcomes: &[RowOutcome],
    retry_wait: impl Fn(u32) -> Duration,
) -> Result<Decision, SinkError> {
    let mut d = Decision::default();
    let s = &mut d.settlement;
    for (row, outcome) in rows.iter().zip(outcomes) {
        match outcome {
            RowOutcome::Published => s.published.push(row.id),
            RowOutcome::Failed(e) => match e.class {
                ErrorClass::BadRow => {
                    s.failed.ids.push(row.id);
                    s.failed.errors.push(e.message().to_owned());
                    let wait = retry_wait(row.attempts.max(0) as u32);
                    s.failed.waits_us.push(wait.as_micros() as i64);
                }
                ErrorClass::Fatal => return Err(e.clone()),
                ErrorClass::Transient => d.trouble = Some(e.clone()),
            },
            RowOutcome::Pending => {
                d.trouble
                    .get_or_insert_with(|| SinkError::transient("publish timed out"));
            }
            // Not the broker's failure to answer: no backoff, the other keys go on.
            RowOutcome::Unavailable(not_now) => {
                s.postponed.ids.push(row.id);
                s.postponed.errors.push(not_now.reason.clone());
                s.postponed.waits_us.push(not_now.wait.as_micros() as i64);
            }
            RowOutcome::BehindFailure => {}
        }
    }
    Ok(d)
}

/// How a worker's batches ended: the table of the last one, the ticket of that look
/// ([`super::wake`]), and its outcome.
pub(super) struct Ended {
    pub(super) table: usize,
    pub(super) ticket: Ticket,
    pub(super) result: Result<Batch, BatchError>,
}

impl Ended {
    fn new(table: usize, ticket: Ticket, result: Result<Batch, BatchError>) -> Ended {
        Ended {
            table,
            ticket,
            result,
        }
    }
}

/// Runs batches for worker `lane` from `table` (looked at with `ticket`) on: one, or
/// several on one session when each claims the next with its `COMMIT` ([`follow_on`]).
pub(super) async fn relay_batch<'a>(
    shared: &'a Shared,
    lane: usize,
    table: &'a RunTable,
    ticket: Ticket,
) -> Ended {
    let ended = |result| Ended::new(table.index, ticket, result);
    // A rate-limited table's tokens first, in a statement of their own (`source::rate`).
    let Some(bucket) = &table.rate else {
        return relay_batches(shared, lane, table, ticket, shared.relay.batch_size, true).await;
    };
    let want = shared.relay.batch_size;
    let allowed = match shared
        .source
        .in_transaction(async |tx| bucket.take(tx, want).await)
        .await
    {
        Ok(Grant::Rows(n)) => n,
        Ok(Grant::Wait(wait)) => return ended(Ok(Batch::Throttled(wait))),
        Err(e) => return ended(Err(e.into())),
    };
    // Its tokens are counted for this table alone: no batch follows on.
    let done = relay_batches(shared, lane, table, ticket, allowed, false).await;
    let used = match &done.result {
        Ok(Batch::Done { claimed, .. }) => *claimed,
        _ => 0,
    };
    if used < allowed {
        let unused = allowed - used;
        let given = shared
            .source
            .in_transaction(async |tx| bucket.give_back(tx, unused).await);
        if let Err(e) = given.await {
            tracing::debug!(error = %e, "Could not give back unused rate tokens");
        }
    }
    done
}

/// Batches of at most `allowed` rows on one session, from `table` on; with `follow`, a
/// batch whose rows were all published claims the next one with its `COMMIT`.
async fn relay_batches<'a>(
    shared: &'a Shared,
    lane: usize,
    mut table: &'a RunTable,
    mut ticket: Ticket,
    allowed: usize,
    follow: bool,
) -> Ended {
    let stop = shared.shutdown.stop_token();
    let asked = Instant::now();
    let session = tokio::select! {
        biased;
        _ = stop.cancelled() => Ok(None),
        s = shared.source.session() => s.map(Some),
    };
    let session = match session {
        Ok(Some(session)) => session,
        Ok(None) => return Ended::new(table.index, ticket, Ok(Batch::Stopped)),
        Err(e) => return Ended::new(table.index, ticket, Err(e.into())),
    };
    // The first batch waited this long for its session; those that follow on, nothing.
    let mut session_wait = asked.elapsed();
    let mut carried = None;
    let result = loop {
        let span = tracing::debug_span!(
            "batch",
            worker = lane,
            table = %table.name(),
            rows = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
            session_wait_us = std::mem::take(&mut session_wait).as_micros() as u64,
        );
        let phases = run_phases(
            shared,
            lane,
            table,
            &session,
            allowed,
            carried.take(),
            follow,
        );
        let Phases { batch, next } = match phases.instrument(span).await {
            Ok(phases) => phases,
            Err(e) => break Err(e),
        };
        let Some(next) = next else {
            break Ok(batch);
        };
        // Committed with every row published; the next claim came back with the COMMIT.
        went_through(shared, table.index);
        (table, ticket) = (&shared.tables[next.table], next.ticket);
        match next.claim {
            Ok(claim) if !stop.is_cancelled() => carried = Some(claim),
            // Dropped: ROLLBACK, nothing of it was sent.
            Ok(_) => break Ok(Batch::Stopped),
            Err(e) => break Err(e.into()),
        }
    };
    drop(carried);
    // A session that timed out or broke mid-statement is never handed to the next batch.
    let error = match &result {
        Err(BatchError::Source(e)) => Some(e),
        _ => None,
    };
    Source::release(session, error);
    Ended::new(table.index, ticket, result)
}

/// Where a worker's batch on table `t` that published every row goes on, its claim
/// sent with the `COMMIT`: the table the worker's next round would claim from (the
/// next one after `t`, in order, that is due for a look and has no `max_rate`, `t`
/// itself when no other is), with that look's ticket. None once `stop` fired or the
/// breaker opened.
fn follow_on(shared: &Shared, t: usize) -> Option<(usize, Ticket)> {
    if shared.shutdown.stop_token().is_cancelled() || shared.breaker.state() == BreakerState::Open {
        return None;
    }
    // Rows were there: there may be more (`wake`, rule 1).
    shared.wakes.raise(t, false);
    let (n, now) = (shared.tables.len(), Instant::now());
    (1..=n).map(|k| (t + k) % n).find_map(|u| {
        if shared.tables[u].rate.is_some() {
            return None;
        }
        shared.wakes.begin(u, now).map(|ticket| (u, ticket))
    })
}

/// The worker's bookkeeping of a batch on table `t` that committed with every row
/// published, when the next one followed on (the last one's is the worker's own).
fn went_through(shared: &Shared, t: usize) {
    shared.ops.health.alive();
    shared.ops.health.progress();
    shared.wakes.raise(t, false);
    shared.breaker.record_success();
}

/// A claim whose transaction is still open: that transaction, what it took, and how long
/// it took (for a claim made with the previous batch's `COMMIT`, the two together).
struct OpenClaim<'s> {
    tx: Tx<'s>,
    claimed: Claimed,
    took: Duration,
}

/// What one batch's phases came to.
struct Phases<'s> {
    batch: Batch,
    /// Every row was published and the next batch's claim went with the `COMMIT`.
    next: Option<Next<'s>>,
}

/// The batch that follows on ([`follow_on`]).
struct Next<'s> {
    table: usize,
    ticket: Ticket,
    claim: Result<OpenClaim<'s>, SourceError>,
}

impl From<Batch> for Phases<'_> {
    fn from(batch: Batch) -> Self {
        Phases { batch, next: None }
    }
}

impl Decision {
    /// Every row claimed was published and acknowledged: nothing failed, nothing waits.
    fn went_through(&self) -> bool {
        self.trouble.is_none() && self.settlement.all_published()
    }

    /// What the worker learns of a committed batch of `claimed` rows.
    fn done(self, claimed: usize) -> Batch {
        Batch::Done {
            retry_in: self.settlement.retry_in(),
            published: self.settlement.published.len(),
            claimed,
            trouble: self.trouble,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::settle::Failures;

    fn row(id: i64, attempts: i32) -> ClaimedRow {
        ClaimedRow {
            id,
            attempts,
            ..ClaimedRow::default()
        }
    }

    fn rows(n: i64) -> Vec<ClaimedRow> {
        (1..=n).map(|id| row(id, 0)).collect()
    }

    /// A fixed retry wait: `n` previous attempts -> n + 1 seconds.
    fn wait(attempts: u32) -> Duration {
        Duration::from_secs(u64::from(attempts) + 1)
    }

    #[test]
    fn only_published_rows_are_marked() {
        let outcomes = [
            RowOutcome::Published,
            RowOutcome::Failed(SinkError::transient("broker unavailable")),
            RowOutcome::Published,
            RowOutcome::Failed(SinkError::bad_row("too large")),
            RowOutcome::BehindFailure,
            RowOutcome::Pending,
        ];
        let s = settle(&rows(6), &outcomes, wait).unwrap();
        assert_eq!(s.settlement.published, [1, 3]);
        assert_eq!(s.settlement.failed.ids, [4]);
    }

    #[test]
    fn a_row_behind_a_failed_row_of_its_key_is_not_counted() {
        // Row 2 is held back behind row 1 of its key, which failed for its own sake: only
        // row 1 records an attempt; row 2 stays pending, untouched, and no trouble is
        // reported (the broker is fine).
        let outcomes = [
            RowOutcome::Failed(SinkError::bad_row("invalid subject")),
            RowOutcome::BehindFailure,
        ];
        let s = settle(&rows(2), &outcomes, wait).unwrap();
        assert!(s.settlement.published.is_empty());
        assert_eq!(s.settlement.failed.ids, [1]);
        assert_eq!(s.trouble, None);
    }

    #[test]
    fn a_timeout_leaves_rows_pending() {
        // The publish deadline passed with rows 2 and 3 unanswered: they are neither
        // marked nor charged an attempt, and the worker is told to back off.
        let outcomes = [
            RowOutcome::Published,
            RowOutcome::Pending,
            RowOutcome::Pending,
        ];
        let s = settle(&rows(3), &outcomes, wait).unwrap();
        assert_eq!(s.settlement.published, [1]);
        assert_eq!(s.settlement.failed, Failures::default());
        assert_eq!(s.trouble, Some(SinkError::transient("publish timed out")));
    }

    #[test]
    fn a_broker_failure_leaves_the_row_pending_and_reports_it() {
        let e = SinkError::transient("nats: no responders");
        let s = settle(&rows(1), &[RowOutcome::Failed(e.clone())], wait).unwrap();
        assert!(s.settlement.published.is_empty() && s.settlement.failed.ids.is_empty());
        assert_eq!(s.trouble, Some(e));
    }

    #[test]
    fn a_bad_row_records_its_error_and_a_wait_that_grows_with_its_attempts() {
        let rows = [row(7, 0), row(8, 3), row(9, -1)];
        let bad = |m: &str| RowOutcome::Failed(SinkError::bad_row(m));
        let s = settle(&rows, &[bad("a"), bad("b"), bad("c")], wait).unwrap();
        assert_eq!(
            s.settlement.failed,
            Failures {
                ids: vec![7, 8, 9],
                errors: vec!["a".into(), "b".into(), "c".into()],
                // 0 and 3 previous attempts; a negative count (edited by hand) counts as 0
                waits_us: vec![1_000_000, 4_000_000, 1_000_000],
            }
        );
    }

    #[test]
    fn an_unavailable_destination_postpones_the_row_without_an_attempt_or_a_backoff() {
        let not_now = crate::sink::NotNow::new("partition 1 has no leader", Duration::from_secs(5));
        let outcomes = [
            RowOutcome::Unavailable(not_now),
            RowOutcome::BehindFailure,
            RowOutcome::Published,
        ];
        let s = settle(&rows(3), &outcomes, wait).unwrap();
        assert_eq!(s.settlement.published, [3]);
        assert_eq!(
            s.settlement.failed,
            Failures::default(),
            "no attempt counted"
        );
        assert_eq!(s.trouble, None, "the worker does not back off");
        assert_eq!(
            s.settlement.postponed,
            Failures {
                ids: vec![1],
                errors: vec!["held back: partition 1 has no leader".into()],
                waits_us: vec![5_000_000],
            }
        );
    }

    #[test]
    fn a_fatal_outcome_writes_nothing() {
        let fatal = SinkError::fatal("authorization violation");
        let outcomes = [RowOutcome::Published, RowOutcome::Failed(fatal.clone())];
        assert_eq!(settle(&rows(2), &outcomes, wait), Err(fatal));
    }
}
