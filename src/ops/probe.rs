//! The probe task: every [`PROBE_INTERVAL`], is PostgreSQL reachable, is the broker (for
//! `/readyz` and the `dependency_up` gauges), and the circuit gauges; every
//! [`GAUGE_INTERVAL`], the gauges that read the database: backlog, oldest pending age and
//! rows waiting to retry per table (from the pending rows and `outbox_relay_held`), dead
//! tuples, and the vacuum horizon with its WARN (see [`crate::source::vacuum`]).
//!
//! The backlog gauges count the pending rows, which costs in proportion to the backlog, in
//! every relay of the table. So they are read only when something shows them: `drain`'s
//! progress line, or a `/metrics` request that came since the last read (a scrape shows
//! the value read after the scrape before it: at most one scrape interval and
//! [`GAUGE_INTERVAL`] old). Read on a timer instead:
//!
//! - `drain` processes started at once on a deep backlog each counted it for nobody (a
//!   drain without the progress line no longer reads them);
//! - `run` sidecars with `[http]` on, nobody scraping, each counted the whole backlog
//!   while they published it (benchmark R): the reads follow the scrapes, so a sidecar
//!   whose metrics are scraped every 30 s counts once per 30 s, not every 5 s.
//!
//! And each read waits at least [`BACKLOG_SHARE`] times as long as the last one took, so
//! a deep backlog costs each relay at most about 2% of one connection.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::metrics::{SinkLabel, TableLabel};
use super::{Ops, GAUGE_INTERVAL, PROBE_INTERVAL};
use crate::sink::Sink;
use crate::source::table::TablePlan;
use crate::source::{vacuum, Source};

/// What the probe looks at.
pub(crate) struct Probed<'a> {
    pub(crate) source: &'a Source,
    pub(crate) sink: &'a Sink,
    pub(crate) tables: &'a [&'a TablePlan],
    /// The circuit breaker: whether it is open now, and how often it opened since start.
    pub(crate) circuit: &'a (dyn Fn() -> (bool, u64) + Sync),
    /// `drain`'s progress line shows the backlog: read it every [`GAUGE_INTERVAL`] (the
    /// metrics endpoint's reads follow its scrapes instead, see the module doc).
    pub(crate) progress: bool,
    /// Rows this process published so far (the progress line subtracts what was published
    /// after the backlog was read: [`Ops::published_at_backlog_read`]).
    pub(crate) published: &'a AtomicU64,
}

/// How many times as long as the last backlog read took the next one waits at least.
const BACKLOG_SHARE: u32 = 50;

/// Probes until `done`.
pub(crate) async fn run(ops: &Ops, probed: Probed<'_>, done: CancellationToken) {
    let mut opened_seen = 0;
    let mut gauges_due = Instant::now();
    let mut backlog_due = Instant::now();
    // Scrapes counted when the backlog was last read (none before the first scrape).
    let mut scrapes_at_read = 0;
    let mut watch = vacuum::Watch::default();
    loop {
        let look = async {
            let postgres = reachability(ops, &probed, &mut opened_seen).await;
            if postgres && Instant::now() >= gauges_due {
                gauges_due = Instant::now() + GAUGE_INTERVAL;
                let scrapes = ops.scrapes();
                let shown = probed.progress || scrapes != scrapes_at_read;
                if shown && Instant::now() >= backlog_due {
                    scrapes_at_read = scrapes;
                    let (began, published) = (Instant::now(), probed.published.load(Relaxed));
                    refresh_backlog(ops, &probed).await;
                    ops.published_at_backlog_read.store(published, Relaxed);
                    backlog_due = began + (began.elapsed() * BACKLOG_SHARE).max(GAUGE_INTERVAL);
                }
                refresh_vacuum(ops, &probed, &mut watch).await;
            }
        };
        // A look only refreshes gauges: dropped at `done`, it loses nothing, and a stalled
        // broker's health check or a long backlog count does not hold up the exit.
        tokio::select! {
            _ = done.cancelled() => return,
            _ = look => {}
        }
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(PROBE_INTERVAL) => {}
        }
    }
}

/// How long each dependency gets to answer the probe: a healthy one answers in
/// milliseconds; one slower than this is reported unreachable (`/readyz`), like one that
/// refuses, and the next look is not put off for long.
const REACH_LIMIT: Duration = Duration::from_secs(2);

/// Asks both dependencies for an answer within [`REACH_LIMIT`] and records it, with the
/// circuit gauges; returns whether PostgreSQL answered.
async fn reachability(ops: &Ops, probed: &Probed<'_>, opened_seen: &mut u64) -> bool {
    let limit = REACH_LIMIT;
    let postgres = probed.source.ping(limit).await.is_ok();
    let (open, opened) = (probed.circuit)();
    let broker = !open
        && matches!(
            tokio::time::timeout(limit, probed.sink.healthcheck()).await,
            Ok(Ok(()))
        );
    ops.postgres_reachable(postgres);
    ops.broker_reachable(broker);
    let label = SinkLabel {
        sink: probed.sink.name().to_owned(),
    };
    ops.metrics
        .circuit_open
        .get_or_create(&label)
        .set(i64::from(open));
    ops.metrics
        .circuit_opened
        .get_or_create(&label)
        .inc_by(opened - *opened_seen);
    *opened_seen = opened;
    postgres
}

/// Backlog and oldest pending age per table, counted from the claim floor on.
async fn refresh_backlog(ops: &Ops, probed: &Probed<'_>) {
    let source = probed.source;
    for table in probed.tables {
        let label = TableLabel {
            table: table.config.name.to_string(),
        };
        let read = source.in_transaction(async |tx| {
            let backlog = table.backlog(tx).await?;
            let waiting = table.waiting(tx).await?;
            Ok((backlog, waiting))
        });
        match read.await {
            Ok((backlog, waiting)) => {
                ops.metrics.backlog.get_or_create(&label).set(backlog.rows);
                ops.metrics
                    .oldest_age_seconds
                    .get_or_create(&label)
                    .set(backlog.oldest_seconds.max(0.0));
                ops.metrics
                    .waiting_retry
                    .get_or_create(&label)
                    .set(waiting.rows);
            }
            Err(e) => tracing::debug!(error = %e, "Could not refresh the backlog gauges"),
        }
    }
}

/// Dead tuples per table and the oldest snapshot holding back VACUUM.
async fn refresh_vacuum(ops: &Ops, probed: &Probed<'_>, watch: &mut vacuum::Watch) {
    let source = probed.source;
    let quoted: Vec<String> = probed
        .tables
        .iter()
        .map(|t| t.config.name.quoted())
        .collect();
    let read = source.in_transaction(async |tx| {
        let dead = vacuum::dead_tuples(tx.client(), &quoted).await?;
        Ok((dead, vacuum::horizon(tx.client()).await?))
    });
    match read.await {
        Ok((dead, horizon)) => {
            for (table, n) in probed.tables.iter().zip(dead) {
                let label = TableLabel {
                    table: table.config.name.to_string(),
                };
                ops.metrics.dead_tuples.get_or_create(&label).set(n);
            }
            let m = &ops.metrics;
            m.oldest_snapshot_age_seconds.set(horizon.oldest_secs());
            m.oldest_snapshot_xid_age.set(horizon.oldest_xid_age());
            watch.observe(&horizon, Instant::now());
        }
        Err(e) => tracing::debug!(error = %e, "Could not read the vacuum horizon"),
    }
}
