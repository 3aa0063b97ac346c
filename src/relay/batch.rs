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
//!    sake records an attempt; everything else stays pending as it was.
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
//! ([`relay_batches`]). On a database 10 ms away that is one round trip of the four or so
//! a batch waits. Nothing else changes:
//!
//! - **What the claim sees.** PostgreSQL runs what one session sends in order, so the
//!   claim runs after the `COMMIT`, in a snapshot that has this batch's rows deleted or
//!   marked, exactly as if it had waited. The claim invariant and the floor's proof
//!   (`source::claim`, `source::floor`) are about what a claim sees and locks, and do not
//!   know the difference.
//! - **A failed commit.** The claim ran after the rollback: its transaction is dropped
//!   (rolled back) with the error, and the batch's rows stay pending as before.
//! - **Which table.** The one the worker's next round would take ([`Shared::follow_on`]):
//!   the next after this one that is due for a look, so several tables still take turns.
//!   A table with `max_rate` never follows on (its tokens are taken per batch).
//! - **`stop`.** No batch follows on once `stop` fired; one that was claimed with the
//!   `COMMIT` when it fired is rolled back unsent, like a claim `stop` cuts short.
//! - **Trouble.** A batch with a failed, postponed or unacknowledged row does not follow
//!   on: the worker backs off or the breaker opens as before.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tracing::Instrument;

use super::message::{message_id, to_message};
use super::order::{publish_in_order, RowOutcome};
use super::{RunTable, Shared};
use crate::config::{NullColumn, Ordering, TableConfig};
use crate::error::ErrorClass;
use crate::ops::otel::BatchTrace;
use crate::retry;
use crate::sink::{Message, Sink, SinkError};
use crate::source::claim::{claim_batch, Budget, Claimed, ClaimedRow};
use crate::source::rate::Grant;
use crate::source::settle::{commit_batch, Settlement};
use crate::source::table::TablePlan;
use crate::source::{Source, SourceError, Tx};

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
/// several on one session when each claims the next with its `COMMIT` ([`Shared::follow_on`]).
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
        shared.went_through(table.index);
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

/// The batch statements of `table` (claim, lock, delete/mark): those a session lacks are
/// prepared together ([`Tx::prepare_together`]) inside the first claim of each session a
/// worker takes from the pool, not in every claim (that would look up every statement's
/// text once more per batch); a claim that follows on to another table prepares what it
/// lacks as it goes. A session another task used first (the floor keeper's look) has
/// some already.
fn batch_statements<'t>(shared: &Shared, table: &'t TablePlan) -> Vec<&'t str> {
    let relay = &shared.relay;
    table.sql.batch_statements(relay.ordering, relay.on_publish)
}

impl Shared {
    /// Where a worker's batch on table `t` that published every row goes on, its claim
    /// sent with the `COMMIT`: the table the worker's next round would claim from (the
    /// next one after `t`, in order, that is due for a look and has no `max_rate`, `t`
    /// itself when no other is), with that look's ticket. None once `stop` fired or the
    /// breaker opened.
    fn follow_on(&self, t: usize) -> Option<(usize, Ticket)> {
        if self.shutdown.stop_token().is_cancelled() || self.breaker.state() == BreakerState::Open {
            return None;
        }
        // Rows were there: there may be more (`wake`, rule 1).
        self.wakes.raise(t, false);
        let (n, now) = (self.tables.len(), Instant::now());
        (1..=n).map(|k| (t + k) % n).find_map(|u| {
            if self.tables[u].rate.is_some() {
                return None;
            }
            self.wakes.begin(u, now).map(|ticket| (u, ticket))
        })
    }

    /// The worker's bookkeeping of a batch on table `t` that committed with every row
    /// published, when the next one followed on (the last one's is the worker's own).
    fn went_through(&self, t: usize) {
        self.ops.health.alive();
        self.ops.health.progress();
        self.wakes.raise(t, false);
        self.breaker.record_success();
    }
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

/// The batch that follows on ([`Shared::follow_on`]).
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

async fn run_phases<'s>(
    shared: &Shared,
    lane: usize,
    table: &RunTable,
    session: &'s deadpool_postgres::Object,
    allowed: usize,
    carried: Option<OpenClaim<'s>>,
    follow: bool,
) -> Result<Phases<'s>, BatchError> {
    let plan = &table.plan;
    // 1. Claim (or take the one that came with the previous batch's COMMIT).
    let OpenClaim {
        tx,
        claimed,
        took: claimed_in,
    } = match carried {
        Some(carried) => carried,
        None => match claim_phase(shared, lane, plan, session, allowed).await? {
            Some(claimed) => claimed,
            None => return Ok(Batch::Stopped.into()),
        },
    };
    let claim_started = SystemTime::now() - claimed_in;
    let mut rows = claimed.rows;
    if rows.is_empty() {
        return nothing_claimed(tx, claimed.contended);
    }
    // Rows in flight: a drain is not done until they are settled. (An empty claim does
    // not count: on a slow link some worker is always inside one, and a drain that waited
    // for all of them to be idle at once never ended.)
    let _active = shared.state.enter_batch();
    plan.floor
        .note_claimed(rows.iter().map(|r| r.id).max(), rows.len());
    let started = Instant::now();
    tracing::Span::current().record("rows", rows.len());
    let meters = shared.meters(table);
    let _in_flight = InFlight::new(&shared.ops.metrics.in_flight, rows.len());
    let mut trace = shared
        .otel
        .batch(table.name(), lane, rows.len(), claim_started);

    // 2. Publish.
    let Some((outcomes, messages)) =
        publish(shared, plan, &mut rows, trace.as_mut(), started).await
    else {
        return Ok(Batch::Aborted.into());
    };
    let acked_after = started.elapsed().as_secs_f64();
    meters.publish_seconds.observe(acked_after);

    // 3. Settle.
    let Some(decision) = settle_phase(shared, plan, &mut rows, &outcomes, messages).await? else {
        return Ok(Batch::Aborted.into());
    };
    let settlement = &decision.settlement;

    // 4. Finalize.
    let follow = follow && decision.went_through();
    let Some((dead, next)) =
        finalize_phase(shared, lane, table, tx, settlement, allowed, follow).await?
    else {
        return Ok(Batch::Aborted.into());
    };
    let committed = Committed {
        rows: &rows,
        outcomes: &outcomes,
        settlement,
        dead: &dead,
        claimed_in,
        started,
        acked_after,
    };
    observe(shared, plan, lane, meters, &committed);
    shared.count_bad_rows(table, settlement).await;
    if let Some(trace) = trace {
        trace.committed(settlement.published.len());
    }
    Ok(Phases {
        batch: decision.done(rows.len()),
        next,
    })
}

/// A claim that took nothing: its transaction is rolled back (sent, not waited for: the
/// session's next transaction follows the `ROLLBACK`).
fn nothing_claimed<'s>(tx: Tx<'_>, contended: bool) -> Result<Phases<'s>, BatchError> {
    tx.rollback()?;
    Ok(match contended {
        true => Batch::Contended,
        false => Batch::Empty,
    }
    .into())
}

/// Phase 1: opens a transaction on `session` and claims in it; `None` when `stop` fired
/// first (dropping the transaction rolls the claim back: nothing was sent).
async fn claim_phase<'s>(
    shared: &Shared,
    lane: usize,
    table: &TablePlan,
    session: &'s deadpool_postgres::Object,
    allowed: usize,
) -> Result<Option<OpenClaim<'s>>, BatchError> {
    let clock = Instant::now();
    let claim = claim(shared, lane, table, session, allowed);
    tokio::select! {
        biased;
        _ = shared.shutdown.stop_token().cancelled() => Ok(None),
        r = shared.source.bounded(claim) => {
            let (tx, claimed) = r?;
            Ok(Some(OpenClaim { tx, claimed, took: clock.elapsed() }))
        }
    }
}

/// Phase 3: settles each row by its outcome, then sends the rows about to be
/// dead-lettered to the dead-letter topic (3b); `None` when `abort` fired during 3b.
async fn settle_phase(
    shared: &Shared,
    table: &TablePlan,
    rows: &mut [ClaimedRow],
    outcomes: &[RowOutcome],
    messages: Vec<Result<Message, SinkError>>,
) -> Result<Option<Decision>, BatchError> {
    let relay = &shared.relay;
    let mut decision = settle(rows, outcomes, |attempts| {
        retry::full_jitter(relay.retry_backoff, relay.retry_backoff_max, attempts)
    })
    .map_err(BatchError::Sink)?;
    if let Some(template) = &table.config.dead_letter_topic {
        let settlement = &mut decision.settlement;
        let dead_letter = dead_letter(shared, table, template, rows, messages, settlement);
        tokio::select! {
            _ = shared.shutdown.abort_token().cancelled() => return Ok(None),
            () = dead_letter => {}
        }
    }
    Ok(Some(decision))
}

/// Phase 4: writes the settlement and commits; with `follow`, the next batch's claim (on
/// the table [`Shared::follow_on`] picks, if any) goes with the `COMMIT`. Returns the
/// rows dead-lettered and the batch that follows on; `None` when `abort` fired first
/// (the transaction rolls back).
async fn finalize_phase<'s>(
    shared: &Shared,
    lane: usize,
    table: &RunTable,
    tx: Tx<'s>,
    settlement: &Settlement,
    allowed: usize,
    follow: bool,
) -> Result<Option<(Vec<i64>, Option<Next<'s>>)>, BatchError> {
    if !settlement.failed.ids.is_empty() || !settlement.postponed.ids.is_empty() {
        table.plan.floor.note_retrying();
    }
    let next_table = match follow {
        true => shared.follow_on(table.index),
        false => None,
    };
    let clock = Instant::now();
    let next_claim = next_table.map(|(u, _)| {
        let next = &shared.tables[u].plan;
        async move |tx: Tx<'s>| claim_in(shared, lane, next, tx, allowed).await
    });
    let (sql, relay) = (&table.plan.sql, &shared.relay);
    let max_attempts = relay.max_attempts as i32;
    let commit = commit_batch(
        tx,
        sql,
        relay.on_publish,
        max_attempts,
        settlement,
        next_claim,
    );
    let (dead, next_claim) = tokio::select! {
        _ = shared.shutdown.abort_token().cancelled() => return Ok(None),
        r = shared.source.bounded(commit) => r?,
    };
    let next = next_table
        .zip(next_claim)
        .map(|((table, ticket), claim)| Next {
            table,
            ticket,
            claim: claim.map(|(tx, claimed)| OpenClaim {
                tx,
                claimed,
                took: clock.elapsed(),
            }),
        });
    Ok(Some((dead, next)))
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

/// Phase 1: opens the transaction and claims up to a batch of rows from the floor on.
async fn claim<'a>(
    shared: &Shared,
    lane: usize,
    table: &TablePlan,
    session: &'a deadpool_postgres::Object,
    rows: usize,
) -> Result<(Tx<'a>, Claimed), SourceError> {
    let tx = shared.source.begin(session).await?;
    tx.prepare_together(&batch_statements(shared, table))
        .await?;
    claim_in(shared, lane, table, tx, rows).await
}

/// Claims up to `rows` rows of `table` in `tx`, a transaction just opened.
async fn claim_in<'a>(
    shared: &Shared,
    lane: usize,
    table: &TablePlan,
    tx: Tx<'a>,
    rows: usize,
) -> Result<(Tx<'a>, Claimed), SourceError> {
    let budget = Budget {
        rows,
        bytes: shared.relay.max_batch_bytes,
    };
    let (ordering, view) = (shared.relay.ordering, table.floor.view());
    let rows = claim_batch(&tx, &table.sql, ordering, budget, lane, &view, &table.depth).await?;
    Ok((tx, rows))
}

/// Phase 2: publishes `rows` (consuming their payloads) and returns each row's outcome and
/// message; `None` when `abort` fired first. With `trace`, each message gets its send span (and
/// that span's `traceparent`), ended with the row's outcome.
async fn publish(
    shared: &Shared,
    table: &TablePlan,
    rows: &mut [ClaimedRow],
    mut trace: Option<&mut BatchTrace<'_>>,
    claimed: Instant,
) -> Option<(Vec<RowOutcome>, Vec<Result<Message, SinkError>>)> {
    let mut topics = crate::config::RecentTopics::default();
    let mut messages: Vec<_> = rows
        .iter_mut()
        .map(|row| to_message(&table.config, row, &mut topics))
        .collect();
    if let Some(trace) = trace.as_deref_mut() {
        let since_claim = claimed.elapsed().as_secs_f64();
        for (row, message) in rows.iter().zip(&mut messages) {
            let wait = row.age.map(|age| age.max(0.0) + since_claim);
            trace.send(message.as_mut().ok(), row.id, wait);
        }
    }
    // Without a key-order promise every row travels independently: no waves, no holding
    // back.
    let keys: Vec<Option<&str>> = match shared.relay.ordering {
        Ordering::Key => rows.iter().map(|r| r.key.as_deref()).collect(),
        Ordering::None => vec![None; rows.len()],
    };
    let mut outcomes = vec![RowOutcome::Pending; rows.len()];
    let timeout = shared.publish_timeout;
    let publish = tokio::time::timeout(
        timeout,
        publish_in_order(&shared.sink, &keys, &messages, &mut outcomes),
    );
    tokio::select! {
        _ = shared.shutdown.abort_token().cancelled() => return None,
        r = publish => if r.is_err() {
            tracing::warn!(?timeout, "Broker did not acknowledge in time; unacknowledged rows stay pending");
        },
        // Acks cannot arrive over a lost connection: let go of the row locks now.
        _ = connection_lost(&shared.sink) => {
            tracing::warn!("Connection to the broker lost mid-batch; unacknowledged rows stay pending");
        }
    }
    if let Some(trace) = trace {
        for (i, outcome) in outcomes.iter().enumerate() {
            trace.sent(i, outcome.as_result());
        }
    }
    Some((outcomes, messages))
}

/// Phase 3b: publishes the rows this batch is about to dead-letter (their attempt reaches
/// `max_attempts`) to `template`, once, with their payload, key and message id, and headers
/// naming the error, the attempts and the original topic. A row whose dead-letter publish
/// fails for the broker's sake leaves the settlement: it stays pending, its attempt not
/// counted, and the worker backs off (`trouble`), so it is tried again, dead-letter topic
/// included, like any row the broker could not take; only its own key waits. One that
/// fails for its own sake (no such topic, a template column that is NULL) is dead-lettered
/// all the same, with an ERROR line: the table keeps it either way.
async fn dead_letter(
    shared: &Shared,
    table: &TablePlan,
    template: &crate::config::Template,
    rows: &mut [ClaimedRow],
    messages: Vec<Result<Message, SinkError>>,
    settlement: &mut Settlement,
) {
    let max = shared.relay.max_attempts as i32;
    let letters = letters(&table.config, template, max, rows, messages, settlement);
    if letters.is_empty() {
        return;
    }
    let unsent = send_letters(shared, table, &letters).await;
    // Postponed, attempt uncounted: out of the failures, highest index first (`unsent`
    // is in the failures' order).
    let postponed = &mut settlement.postponed;
    for (f, error) in unsent.into_iter().rev() {
        postponed.ids.push(settlement.failed.ids.remove(f));
        settlement.failed.errors.remove(f);
        postponed.errors.push(format!("dead-letter topic: {error}"));
        postponed
            .waits_us
            .push(settlement.failed.waits_us.remove(f));
    }
}

/// A dead letter: the index of its row among the settlement's failures, the row's id,
/// and its message for the dead-letter topic (or why the row has no such topic).
type Letter = (usize, i64, Result<Message, NullColumn>);

/// The dead letters of the failed rows whose attempt reaches `max`: each row's message
/// with the dead-letter topic and headers naming the error, the attempts and the original
/// topic.
fn letters(
    table: &TableConfig,
    template: &crate::config::Template,
    max: i32,
    rows: &mut [ClaimedRow],
    mut messages: Vec<Result<Message, SinkError>>,
    settlement: &Settlement,
) -> Vec<Letter> {
    let by_id: std::collections::HashMap<i64, usize> =
        rows.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
    let failed = settlement.failed.ids.iter().zip(&settlement.failed.errors);
    let mut letters = Vec::new();
    for (f, (id, error)) in failed.enumerate() {
        let i = by_id[id];
        let row = &mut rows[i];
        if row.attempts + 1 < max {
            continue;
        }
        let original = match std::mem::replace(&mut messages[i], Err(SinkError::bad_row(""))) {
            Ok(m) => m,
            // The row could not become a message (its topic or headers are bad): what it
            // holds still goes, without the headers column.
            Err(_) => Message {
                id: message_id(table, row),
                topic: Arc::from(""),
                key: row.key.clone(),
                payload: row.payload.take().map(bytes::Bytes::from),
                headers: Vec::new(),
                timestamp_ms: row.created_ms,
            },
        };
        let topic = template.render(&row.dead_letter_values);
        let mut headers = original.headers;
        headers.push((Arc::from("outbox-error"), error.clone()));
        headers.push((Arc::from("outbox-attempts"), (row.attempts + 1).to_string()));
        headers.push((Arc::from("outbox-topic"), original.topic.to_string()));
        let letter = topic.map(|topic| Message {
            topic,
            headers,
            ..original
        });
        letters.push((f, *id, letter));
    }
    letters
}

/// Sends `letters` in one batch and returns those the broker could not take for its own
/// sake (index among the failures, in order, and the error), to be postponed; letters
/// refused for their own sake are logged and dead-lettered in the table only.
async fn send_letters(
    shared: &Shared,
    table: &TablePlan,
    letters: &[Letter],
) -> Vec<(usize, String)> {
    let sendable: Vec<&Message> = letters
        .iter()
        .filter_map(|(_, _, m)| m.as_ref().ok())
        .collect();
    let sent = tokio::time::timeout(shared.publish_timeout, shared.sink.publish_batch(&sendable))
        .await
        .unwrap_or_else(|_| {
            vec![
                Err(SinkError::transient(
                    "the dead-letter topic did not acknowledge in time"
                ));
                sendable.len()
            ]
        });
    let mut sent = sent.into_iter();
    let mut unsent = Vec::new();
    for (f, id, message) in letters {
        let result = match message {
            Ok(_) => sent
                .next()
                .unwrap_or(Err(SinkError::transient("no answer"))),
            Err(e) => Err(SinkError::bad_row(e.to_string())),
        };
        match result {
            Ok(()) => {}
            Err(e) if e.class == ErrorClass::BadRow => tracing::error!(
                table = %table.config.name, id, error = %e,
                "Could not publish the row to its dead-letter topic; dead-lettered in the table only"
            ),
            Err(e) => {
                tracing::warn!(table = %table.config.name, id, error = %e, "Dead-letter topic unavailable; the row waits for its next attempt");
                unsent.push((*f, e.message().to_owned()));
            }
        }
    }
    unsent
}

/// A committed batch, as [`observe`] reads it.
struct Committed<'a> {
    rows: &'a [ClaimedRow],
    outcomes: &'a [RowOutcome],
    settlement: &'a Settlement,
    /// Rows dead-lettered by the commit.
    dead: &'a [i64],
    /// From the claim's first statement to its rows in hand.
    claimed_in: Duration,
    started: Instant,
    /// Seconds from the first send to the last acknowledgement.
    acked_after: f64,
}

/// The bookkeeping of a committed batch: the run's counts, the table's metrics (each
/// acknowledged row's delivery lag: its age at the claim plus the publish; replayed rows
/// counted apart), and the log lines.
fn observe(
    shared: &Shared,
    table: &TablePlan,
    lane: usize,
    meters: &crate::ops::metrics::TableMeters,
    batch: &Committed<'_>,
) {
    let (published, failed, dead) = (
        &batch.settlement.published,
        &batch.settlement.failed,
        batch.dead,
    );
    shared
        .state
        .count(published.len(), failed.ids.len(), dead.len());
    meters.published.inc_by(published.len() as u64);
    meters.failed.inc_by(failed.ids.len() as u64);
    meters.dead.inc_by(dead.len() as u64);
    let elapsed = batch.started.elapsed();
    meters.batch_seconds.observe(elapsed.as_secs_f64());
    tracing::Span::current().record("duration_ms", elapsed.as_millis() as u64);
    let acked = batch
        .rows
        .iter()
        .zip(batch.outcomes)
        .filter(|(_, outcome)| matches!(outcome, RowOutcome::Published))
        .map(|(row, _)| row);
    let mut replayed = 0;
    for row in acked {
        match (row.replayed, row.age) {
            (true, _) => replayed += 1,
            (false, Some(age)) => meters
                .delivery_lag
                .observe(age.max(0.0) + batch.acked_after),
            (false, None) => {}
        }
    }
    meters.replayed.inc_by(replayed);
    for (id, error) in failed.ids.iter().zip(&failed.errors) {
        if dead.contains(id) {
            tracing::error!(table = %table.config.name, id, %error, "Row dead-lettered; its key is held back until it is re-queued or deleted");
        } else {
            tracing::warn!(table = %table.config.name, id, %error, "Row failed; will retry");
        }
    }
    tracing::debug!(
        worker = lane,
        table = %table.config.name,
        rows = batch.rows.len(),
        published = published.len(),
        claim = ?batch.claimed_in,
        publish = ?Duration::from_secs_f64(batch.acked_after),
        elapsed = ?elapsed,
        "Batch committed"
    );
}

/// Resolves when the sink's client reports its connection lost; never for sinks that do
/// not tell.
async fn connection_lost(sink: &Sink) {
    if let Some(mut connection) = sink.connection() {
        if connection.wait_for(|up| !*up).await.is_ok() {
            return;
        }
    }
    std::future::pending::<()>().await
}

/// Counts a batch's rows in the in-flight gauge until it ends, however it ends.
struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge, i64);

impl<'a> InFlight<'a> {
    fn new(gauge: &'a prometheus_client::metrics::gauge::Gauge, rows: usize) -> Self {
        gauge.inc_by(rows as i64);
        InFlight(gauge, rows as i64)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec_by(self.1);
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

    /// A row at its last attempt that could not become a message (here its topic column
    /// is NULL) is dead-lettered all the same, under the row's own message id: the id
    /// column when the table maps one apart from the order column, as for a row that did
    /// become a message (it used to be `<table>:<order column>` always).
    #[test]
    fn a_row_that_cannot_become_a_message_is_dead_lettered_under_its_message_id() {
        let config = crate::config::from_str(
            "[postgres]\nurl = \"postgres://db/app\"\n[sink]\nkind = \"stdout\"\n\
             [[tables]]\nname = \"public.outbox\"\ntopic = \"events.{type}\"\n\
             dead_letter_topic = \"dead\"\n\
             [tables.columns]\nid = \"event_id\"\norder = \"seq\"\n",
            |_| None,
            Vec::new(),
        )
        .unwrap();
        let table = &config.tables[0];
        let template = table.dead_letter_topic.as_ref().unwrap();
        let mut rows = vec![ClaimedRow {
            id: 7,
            message_id: Some("evt-7".to_owned()),
            key: Some(Arc::from("k")),
            payload: Some(b"{}".to_vec()),
            attempts: 2,
            ..ClaimedRow::default()
        }];
        let refused = || SinkError::bad_row("topic column type is NULL");
        let settlement = settle(&rows, &[RowOutcome::Failed(refused())], wait)
            .unwrap()
            .settlement;
        let dead = letters(
            table,
            template,
            3,
            &mut rows,
            vec![Err(refused())],
            &settlement,
        );
        assert_eq!(dead.len(), 1, "the row is at its last attempt");
        let (_, id, letter) = &dead[0];
        let letter = letter.as_ref().unwrap();
        assert_eq!(*id, 7);
        assert_eq!(letter.id, "public.outbox:evt-7");
        assert_eq!(&*letter.topic, "dead");
        assert_eq!(letter.payload.as_deref(), Some(&b"{}"[..]));
        let header = |name: &str| {
            letter
                .headers
                .iter()
                .find(|(n, _)| &**n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(header("outbox-error"), Some("topic column type is NULL"));
        assert_eq!(header("outbox-attempts"), Some("3"));
        // Below its last attempt, a row is not dead-lettered.
        rows[0].attempts = 0;
        assert!(letters(
            table,
            template,
            3,
            &mut rows,
            vec![Err(refused())],
            &settlement
        )
        .is_empty());
    }
}
