//! The bookkeeping of a batch: the run's counts, the table's metrics and the log lines
//! of a committed batch ([`observe`]), and the in-flight gauge while it runs.

use std::time::{Duration, Instant};

use super::super::order::RowOutcome;
use super::super::{RunTable, Shared};
use crate::ops::otel::BatchTrace;
use crate::source::claim::ClaimedRow;
use crate::source::settle::Settlement;

/// A committed batch, as [`observe`] reads it.
pub(super) struct Committed<'a> {
    pub(super) rows: &'a [ClaimedRow],
    pub(super) outcomes: &'a [RowOutcome],
    pub(super) settlement: &'a Settlement,
    /// Rows dead-lettered by the commit.
    pub(super) dead: &'a [i64],
    /// From the claim's first statement to its rows in hand.
    pub(super) claimed_in: Duration,
    pub(super) started: Instant,
    /// Seconds from the first send to the last acknowledgement.
    pub(super) acked_after: f64,
}

/// The bookkeeping of a committed batch: the run's counts, the table's metrics (each
/// acknowledged row's delivery lag: its age at the claim plus the publish; replayed rows
/// counted apart), the log lines, the bad-row valve's count and the end of its trace.
pub(super) async fn observe(
    shared: &Shared,
    table: &RunTable,
    lane: usize,
    batch: &Committed<'_>,
    trace: Option<BatchTrace<'_>>,
) {
    let meters = shared.meters(table);
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
            tracing::error!(table = %table.name(), id, %error, "Row dead-lettered; the later rows of its key are held back until it is re-queued or deleted");
        } else {
            tracing::warn!(table = %table.name(), id, %error, "Row failed; will retry");
        }
    }
    tracing::debug!(
        worker = lane,
        table = %table.name(),
        rows = batch.rows.len(),
        published = published.len(),
        claim = ?batch.claimed_in,
        publish = ?Duration::from_secs_f64(batch.acked_after),
        elapsed = ?elapsed,
        "Batch committed"
    );
    super::super::pause::count_bad_rows(shared, table, batch.settlement).await;
    if let Some(trace) = trace {
        trace.committed(published.len());
    }
}

/// Counts a batch's rows in the in-flight gauge until it ends, however it ends.
pub(super) struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge, i64);

impl<'a> InFlight<'a> {
    pub(super) fn new(gauge: &'a prometheus_client::metrics::gauge::Gauge, rows: usize) -> Self {
        gauge.inc_by(rows as i64);
        InFlight(gauge, rows as i64)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec_by(self.1);
    }
}
