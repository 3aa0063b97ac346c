//! The phases of one batch (claim, publish, settle, finalize) and what each needs:
//! [`run_phases`] runs them in order, each short and bounded (see the parent module).

use std::time::{Instant, SystemTime};

use super::super::message::to_message;
use super::super::order::{publish_in_order, RowOutcome};
use super::super::{RunTable, Shared};
use super::dead_letter::dead_letter;
use super::observe::{observe, Committed, InFlight};
use super::{follow_on, settle, Batch, BatchError, Decision, Next, OpenClaim, Phases};
use crate::config::Ordering;
use crate::ops::otel::BatchTrace;
use crate::retry;
use crate::sink::{Message, Sink, SinkError};
use crate::source::claim::{claim_batch, Budget, Claimed, ClaimedRow};
use crate::source::settle::{commit_batch, Settlement};
use crate::source::table::TablePlan;
use crate::source::{SourceError, Tx};

/// Runs one batch of `table` on `session`, phase by phase: claims up to `allowed` rows (or
/// takes the claim `carried` from the previous batch's `COMMIT`), publishes, settles and
/// commits them; with `follow`, a batch whose every row was published sends the next
/// one's claim with its `COMMIT` ([`Phases::next`]).
pub(super) async fn run_phases<'s>(
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
    observe(shared, table, lane, &committed, trace).await;
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
/// the table [`follow_on`] picks, if any) goes with the `COMMIT`. Returns the
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
        true => follow_on(shared, table.index),
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

/// The work [`claim_phase`] races against `stop`: opens a transaction on `session`,
/// prepares the batch statements it lacks and claims up to `rows` rows in it.
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
