//! One worker: claim -> publish -> await acks -> mark -> commit, in a loop.
//!
//! Only the idle wait and the claim race against `stop`; once rows are claimed, the batch
//! runs to its commit unless `abort` fires, in which case the transaction is dropped and
//! rolled back: every row not committed as published stays pending. The publish phase is
//! bounded by `sink.publish_timeout`, so a stalled broker never holds the transaction and
//! its row locks longer than that.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use super::breaker::BreakerState;
use super::order::{publish_in_order, RowOutcome};
use super::{message::to_message, Shared, TablePlan};
use crate::config::{OnPublish, Ordering};
use crate::error::ErrorClass;
use crate::ops::Metrics;
use crate::retry::{self, Backoff};
use crate::sink::SinkError;
use crate::source::claim::claim_batch;
use crate::source::{Source, SourceError};

/// Why a batch could not run; each maps to retry-later or stop-the-process.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("{0}")]
    Sink(SinkError),
}

impl WorkerError {
    fn class(&self) -> ErrorClass {
        match self {
            WorkerError::Source(e) => e.class(),
            WorkerError::Sink(e) => e.class,
        }
    }
}

/// How one attempt at a table ended.
enum Batch {
    /// Nothing to claim in this table.
    Empty,
    /// Claimed, published what it could, committed. `trouble` is set when some rows failed
    /// for a transient reason: the worker backs off before claiming again.
    Done {
        trouble: Option<SinkError>,
        published: usize,
    },
    /// `stop` fired during the claim: nothing was claimed.
    Stopped,
    /// `abort` fired with rows in flight: rolled back.
    Aborted,
}

pub(super) struct Worker {
    pub id: usize,
    pub shared: Arc<Shared>,
}

impl Worker {
    pub async fn run(self) {
        let shared = &self.shared;
        let stop = shared.shutdown.stop_token().clone();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let tables = shared.tables.len();
        let mut next = self.id % tables;
        while !stop.is_cancelled() {
            shared.ops.health.alive();
            // While the broker is down nobody claims (see `breaker`).
            if shared.breaker.state() == BreakerState::Open {
                if !shared.breaker.wait_closed(&stop).await {
                    return;
                }
                backoff.reset();
            }
            // Registered before the claim, so a NOTIFY during the claim is not missed.
            let notified = shared.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();

            let mut worked = false;
            let mut trouble: Option<String> = None;
            for k in 0..tables {
                let t = (next + k) % tables;
                let result = self.relay_batch(&shared.tables[t]).await;
                if matches!(result, Ok(Batch::Empty | Batch::Done { .. })) {
                    shared.ops.health.progress();
                }
                match result {
                    Ok(Batch::Empty) => continue,
                    Ok(Batch::Done {
                        trouble: t_err,
                        published,
                    }) => {
                        worked = true;
                        next = (t + 1) % tables; // the next cycle starts at another table
                        match (&t_err, published) {
                            (Some(e), 0) => shared.breaker.record_failure(&e.message),
                            _ => shared.breaker.record_success(),
                        }
                        trouble = t_err.map(|e| e.message);
                        break;
                    }
                    Ok(Batch::Stopped) => return,
                    Ok(Batch::Aborted) => {
                        shared.aborted.store(true, Relaxed);
                        return;
                    }
                    Err(e) if e.class() == ErrorClass::Fatal => {
                        shared.fail(format!("table {}: {e}", shared.tables[t].config.name));
                        return;
                    }
                    Err(e) => {
                        trouble = Some(e.to_string());
                        break;
                    }
                }
            }
            if let Some(error) = trouble {
                if shared.breaker.state() == BreakerState::Open {
                    continue; // the breaker's prober decides when to try again
                }
                let pause = backoff.next_pause();
                tracing::warn!(worker = self.id, %error, retry_in = ?pause, "Publishing failed; backing off");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                continue;
            }
            backoff.reset();
            if worked {
                continue;
            }
            if shared.drain && shared.nothing_publishable().await {
                shared.drained.store(true, Relaxed);
                shared.shutdown.request_stop();
                return;
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = &mut notified => {}
                _ = tokio::time::sleep(shared.relay.poll_interval) => {}
            }
        }
    }

    async fn relay_batch(&self, table: &TablePlan) -> Result<Batch, WorkerError> {
        let shared = &self.shared;
        let stop = shared.shutdown.stop_token();
        let _active = ActiveGuard::enter(shared);

        let mut session = tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(Batch::Stopped),
            s = shared.source.session() => s?,
        };
        let span = tracing::debug_span!(
            "batch",
            worker = self.id,
            table = %table.config.name,
            rows = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
        );
        let result = self.batch_on(&mut session, table).instrument(span).await;
        // A session that timed out or broke mid-statement is never handed to the next batch.
        let error = match &result {
            Err(WorkerError::Source(e)) => Some(e),
            _ => None,
        };
        Source::release(session, error);
        result
    }

    async fn batch_on(
        &self,
        session: &mut deadpool_postgres::Object,
        table: &TablePlan,
    ) -> Result<Batch, WorkerError> {
        let shared = &self.shared;
        let stop = shared.shutdown.stop_token();
        let abort = shared.shutdown.abort_token();
        let claim = async {
            let tx = shared.source.begin(session).await?;
            let rows = claim_batch(
                &tx,
                &table.sql,
                shared.relay.ordering,
                crate::source::claim::Budget {
                    rows: shared.relay.batch_size,
                    bytes: shared.relay.max_batch_bytes,
                },
                self.id,
                &table.floor.view(),
            )
            .await?;
            Ok::<_, SourceError>((tx, rows))
        };
        // Dropping the transaction on `stop` rolls the claim back: nothing was sent yet.
        let (tx, mut rows) = tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(Batch::Stopped),
            r = shared.source.bounded(claim) => r?,
        };
        if rows.is_empty() {
            shared.source.bounded(tx.rollback()).await?;
            return Ok(Batch::Empty);
        }
        table.floor.note_claimed(rows.iter().map(|r| r.id).max());
        let started = Instant::now();
        let span = tracing::Span::current();
        span.record("rows", rows.len());
        let metrics = &shared.ops.metrics;
        let labels = Metrics::table_sink(&table.config.name.to_string(), shared.sink.name());
        let _in_flight = InFlight::new(&metrics.in_flight, rows.len());

        let messages: Vec<_> = rows
            .iter_mut()
            .map(|row| to_message(&table.config, row))
            .collect();
        // Without a key-order promise every row travels independently: no waves, no
        // holding back.
        let keys: Vec<Option<&str>> = match shared.relay.ordering {
            Ordering::Key => rows.iter().map(|r| r.key.as_deref()).collect(),
            Ordering::None => vec![None; rows.len()],
        };
        let mut outcomes = vec![RowOutcome::Pending; rows.len()];
        let publish = tokio::time::timeout(
            shared.publish_timeout,
            publish_in_order(&shared.sink, &keys, &messages, &mut outcomes),
        );
        tokio::select! {
            _ = abort.cancelled() => return Ok(Batch::Aborted),
            r = publish => if r.is_err() {
                tracing::warn!(timeout = ?shared.publish_timeout, "Broker did not acknowledge in time; unacknowledged rows stay pending");
            },
            // Acks cannot arrive over a lost connection: let go of the row locks now.
            _ = connection_lost(&shared.sink) => {
                tracing::warn!("Connection to the broker lost mid-batch; unacknowledged rows stay pending");
            }
        }
        metrics
            .publish_seconds
            .get_or_create(&labels)
            .observe(started.elapsed().as_secs_f64());

        let mut published: Vec<i64> = Vec::new();
        let mut bad_ids: Vec<i64> = Vec::new();
        let mut bad_errors: Vec<String> = Vec::new();
        // Each failed row's next attempt: full jitter under retry_backoff doubled per
        // attempt already made, up to retry_backoff_max.
        let mut bad_waits: Vec<i64> = Vec::new();
        let mut trouble: Option<SinkError> = None;
        for (row, outcome) in rows.iter().zip(&outcomes) {
            match outcome {
                RowOutcome::Published => published.push(row.id),
                RowOutcome::Failed(e) => match e.class {
                    ErrorClass::BadRow => {
                        bad_ids.push(row.id);
                        bad_errors.push(e.message.clone());
                        let wait = retry::full_jitter(
                            shared.relay.retry_backoff,
                            shared.relay.retry_backoff_max,
                            row.attempts.max(0) as u32,
                        );
                        bad_waits.push(wait.as_micros() as i64);
                    }
                    ErrorClass::Fatal => return Err(WorkerError::Sink(e.clone())),
                    ErrorClass::Transient => trouble = Some(e.clone()),
                },
                RowOutcome::Pending => {
                    trouble.get_or_insert_with(|| SinkError::transient("publish timed out"));
                }
                RowOutcome::HeldBack => {}
            }
        }

        let finalize = async {
            if !published.is_empty() {
                let sql = match shared.relay.on_publish {
                    OnPublish::Delete => &table.sql.delete,
                    OnPublish::Mark => &table.sql.mark,
                };
                tx.execute(sql, &[&published]).await?;
            }
            let mut dead = Vec::new();
            if !bad_ids.is_empty() {
                table.floor.note_retrying();
                let max = shared.relay.max_attempts as i32;
                for r in tx
                    .query(
                        &table.sql.record_failures,
                        &[&bad_ids, &bad_errors, &max, &bad_waits],
                    )
                    .await?
                {
                    if r.get::<_, bool>(1) {
                        dead.push(r.get::<_, i64>(0));
                    }
                }
            }
            tx.commit().await?;
            Ok::<_, SourceError>(dead)
        };
        let dead = tokio::select! {
            _ = abort.cancelled() => return Ok(Batch::Aborted),
            r = shared.source.bounded(finalize) => r?,
        };

        shared
            .stats
            .published
            .fetch_add(published.len() as u64, Relaxed);
        shared.stats.failed.fetch_add(bad_ids.len() as u64, Relaxed);
        shared.stats.dead.fetch_add(dead.len() as u64, Relaxed);
        metrics
            .published
            .get_or_create(&labels)
            .inc_by(published.len() as u64);
        metrics
            .failed
            .get_or_create(&labels)
            .inc_by(bad_ids.len() as u64);
        metrics
            .dead
            .get_or_create(&labels)
            .inc_by(dead.len() as u64);
        metrics
            .batch_seconds
            .get_or_create(&labels)
            .observe(started.elapsed().as_secs_f64());
        span.record("duration_ms", started.elapsed().as_millis() as u64);
        for (id, error) in bad_ids.iter().zip(&bad_errors) {
            if dead.contains(id) {
                tracing::error!(table = %table.config.name, id, %error, "Row dead-lettered; its key is held back until it is re-queued or deleted");
            } else {
                tracing::warn!(table = %table.config.name, id, %error, "Row failed; will retry");
            }
        }
        tracing::debug!(
            worker = self.id,
            table = %table.config.name,
            rows = rows.len(),
            published = published.len(),
            elapsed = ?started.elapsed(),
            "Batch committed"
        );
        Ok(Batch::Done {
            trouble,
            published: published.len(),
        })
    }
}

/// Resolves when the sink's client reports its connection lost; never for sinks that do
/// not tell.
async fn connection_lost(sink: &crate::sink::Sink) {
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

/// Counts the worker as busy with a batch, for drain detection.
struct ActiveGuard<'a>(&'a Shared);

impl<'a> ActiveGuard<'a> {
    fn enter(shared: &'a Shared) -> Self {
        shared.active.fetch_add(1, Relaxed);
        ActiveGuard(shared)
    }
}

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Relaxed);
    }
}
