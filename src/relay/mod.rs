//! The supervisor: prepares the tables, connects the sink, runs the workers and the
//! LISTEN task under one [`TaskTracker`], and reports how the run ended.
//!
//! `run` relays until stopped; `drain` relays until no publishable row is left. Either
//! way, stopping means: stop claiming, let in-flight batches commit, flush the sink. If
//! the deadline (`abort`) comes first, in-flight batches roll back and the report says so.

pub mod breaker;
mod message;
pub mod order;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, RelayConfig, TableConfig};
use crate::error::ErrorClass;
use crate::ops::{self, Ops};
use crate::shutdown::Shutdown;
use crate::sink::{Sink, SinkError};
use crate::source::floor::{self, FloorCell};
use crate::source::retention;
use crate::source::schema;
use crate::source::sql::TableSql;
use crate::source::vacuum;
use crate::source::{session_config, SessionLimits, Source, SourceError};

use crate::retry::Backoff;

/// A failure that ends the run (exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("{0}")]
    Fatal(String),
    /// Stopped (drain --timeout, a signal) before a dependency was ever reached.
    #[error("{what} was never reached: {last_error}")]
    Unreachable { what: String, last_error: String },
}

/// What a run or drain achieved.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub published: u64,
    pub failed: u64,
    pub dead: u64,
    pub elapsed: Duration,
    /// The deadline cut in-flight batches short: they were rolled back.
    pub aborted: bool,
    /// `drain` only: no publishable row was left when it finished.
    pub drained: bool,
    /// Rows still waiting for their next attempt when the run ended: how many, and when
    /// the earliest is due (as PostgreSQL prints an interval from now).
    pub waiting: Option<(i64, String)>,
}

/// An outbox table, ready to relay.
pub struct TablePlan {
    pub config: TableConfig,
    pub sql: TableSql,
    /// Where claims start (see [`crate::source::floor`]).
    pub floor: FloorCell,
}

#[derive(Default)]
struct Stats {
    published: AtomicU64,
    failed: AtomicU64,
    dead: AtomicU64,
}

/// State shared by the workers.
struct Shared {
    source: Source,
    sink: Sink,
    tables: Vec<TablePlan>,
    relay: RelayConfig,
    publish_timeout: Duration,
    shutdown: Shutdown,
    /// Woken by NOTIFY.
    wake: Arc<Notify>,
    /// Workers inside a batch (claim to commit).
    active: AtomicUsize,
    /// Drain mode: stop once nothing publishable is left.
    drain: bool,
    drained: AtomicBool,
    aborted: AtomicBool,
    fatal: Mutex<Option<String>>,
    stats: Stats,
    breaker: breaker::Breaker,
    ops: Arc<Ops>,
    /// Rows published when the backlog gauges were last read (drain's progress line
    /// subtracts what was published since).
    published_at_backlog_read: AtomicU64,
}

impl Shared {
    /// Records a fatal error and stops the relay.
    fn fail(&self, message: String) {
        tracing::error!(error = %message, "Stopping: this needs an operator");
        self.fatal.lock().unwrap().get_or_insert(message);
        self.shutdown.request_stop();
    }

    /// True when no worker is inside a batch and no table has a row a relay could publish.
    async fn nothing_publishable(&self) -> bool {
        if self.active.load(Relaxed) > 0 {
            return false;
        }
        let check = async {
            let session = self.source.bounded(self.source.session()).await?;
            let result = self
                .source
                .bounded(async {
                    for table in &self.tables {
                        let row = session
                            .query_one(&table.sql.publishable_exists, &[])
                            .await?;
                        if row.get::<_, bool>(0) {
                            return Ok(false);
                        }
                    }
                    Ok(self.active.load(Relaxed) == 0)
                })
                .await;
            Source::release(session, result.as_ref().err());
            result
        };
        match check.await {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!(error = %e, "Could not check for remaining rows");
                false
            }
        }
    }
}

impl Shared {
    /// Rows waiting for their next attempt, over every table, and the earliest due time;
    /// `None` when there are none or the database does not answer.
    async fn waiting(&self) -> Option<(i64, String)> {
        let read = self.source.bounded(async {
            let session = self.source.session().await?;
            let mut total = 0;
            let mut next: Option<(f64, String)> = None;
            for table in &self.tables {
                let row = session.query_one(&table.sql.waiting, &[]).await?;
                total += row.get::<_, i64>(0);
                if let (Some(text), Some(secs)) = (
                    row.get::<_, Option<String>>(1),
                    row.get::<_, Option<f64>>(2),
                ) {
                    if next.as_ref().is_none_or(|(s, _)| secs < *s) {
                        next = Some((secs, text));
                    }
                }
            }
            Ok::<_, SourceError>((total, next))
        });
        match read.await {
            Ok((n, Some((_, next)))) if n > 0 => Some((n, next)),
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(error = %e, "Could not count rows waiting for a retry");
                None
            }
        }
    }
}

/// Follows the broker connection: the moment the client reports it lost, readiness says
/// so and the breaker opens, so no worker claims rows it cannot publish.
async fn watch_connection(
    shared: Arc<Shared>,
    mut connection: tokio::sync::watch::Receiver<bool>,
    done: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            r = connection.wait_for(|up| !*up) => if r.is_err() { return },
        }
        shared.ops.broker_reachable(false);
        shared.breaker.trip("connection to the broker lost");
        tokio::select! {
            _ = done.cancelled() => return,
            r = connection.wait_for(|up| *up) => if r.is_err() { return },
        }
    }
}

/// `drain` on a terminal: one live line on stderr with rows published, the rate over the
/// last second and the backlog left (as of the last gauge refresh).
async fn progress(shared: Arc<Shared>, done: CancellationToken) {
    let started = Instant::now();
    let mut last = (Instant::now(), 0u64);
    loop {
        tokio::select! {
            _ = done.cancelled() => break,
            _ = shared.shutdown.stop_token().cancelled() => break,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let published = shared.stats.published.load(Relaxed);
        let rate = (published - last.1) as f64 / last.0.elapsed().as_secs_f64();
        last = (Instant::now(), published);
        let backlog: i64 = shared
            .tables
            .iter()
            .map(|t| {
                let label = ops::metrics::TableLabel {
                    table: t.config.name.to_string(),
                };
                shared.ops.metrics.backlog.get_or_create(&label).get()
            })
            .sum();
        // The gauge is a few seconds old: take off what was published since.
        let since = published.saturating_sub(shared.published_at_backlog_read.load(Relaxed));
        let backlog = (backlog - since as i64).max(0);
        ops::progress::draw(&format!(
            "draining: {published} rows published in {:.0}s, {rate:.0} rows/s, backlog {backlog}",
            started.elapsed().as_secs_f64()
        ));
    }
    ops::progress::clear();
}

/// Every [`ops::PROBE_INTERVAL`]: is PostgreSQL reachable, is the broker; the circuit
/// gauges; and every [`ops::GAUGE_INTERVAL`] the backlog gauges, from the pending index.
async fn probe(shared: Arc<Shared>, done: CancellationToken) {
    let ops = &shared.ops;
    let sink = shared.sink.name().to_owned();
    let sink_label = ops::metrics::SinkLabel { sink: sink.clone() };
    let mut opened_seen = 0;
    let mut gauges_due = Instant::now();
    let mut watch = vacuum::Watch::default();
    loop {
        let limit = Duration::from_secs(2);
        let postgres = shared.source.ping(limit).await.is_ok();
        let broker = shared.breaker.state() != breaker::BreakerState::Open
            && matches!(
                tokio::time::timeout(limit, shared.sink.healthcheck()).await,
                Ok(Ok(()))
            );
        ops.postgres_reachable(postgres);
        ops.broker_reachable(broker);
        let open = shared.breaker.state() == breaker::BreakerState::Open;
        ops.metrics
            .circuit_open
            .get_or_create(&sink_label)
            .set(i64::from(open));
        let opened = shared.breaker.times_opened();
        ops.metrics
            .circuit_opened
            .get_or_create(&sink_label)
            .inc_by(opened - opened_seen);
        opened_seen = opened;

        if postgres && Instant::now() >= gauges_due {
            gauges_due = Instant::now() + ops::GAUGE_INTERVAL;
            let published = shared.stats.published.load(Relaxed);
            for table in &shared.tables {
                let label = ops::metrics::TableLabel {
                    table: table.config.name.to_string(),
                };
                let view = table.floor.view();
                let stragglers: &[i64] = &view.stragglers;
                let read = shared.source.bounded(async {
                    let session = shared.source.session().await?;
                    Ok(session
                        .query_one(&table.sql.backlog, &[&view.value, &stragglers])
                        .await?)
                });
                match read.await {
                    Ok(row) => {
                        ops.metrics.backlog.get_or_create(&label).set(row.get(0));
                        ops.metrics
                            .oldest_age_seconds
                            .get_or_create(&label)
                            .set(row.get::<_, f64>(1).max(0.0));
                    }
                    Err(e) => tracing::debug!(error = %e, "Could not refresh the backlog gauges"),
                }
            }
            shared.published_at_backlog_read.store(published, Relaxed);
            let read = shared.source.bounded(async {
                let session = shared.source.session().await?;
                let mut dead = Vec::new();
                for table in &shared.tables {
                    let quoted = table.config.name.quoted();
                    dead.push(vacuum::dead_tuples(&**session, &quoted).await?);
                }
                Ok((dead, vacuum::horizon(&**session).await?))
            });
            match read.await {
                Ok((dead, horizon)) => {
                    for (table, n) in shared.tables.iter().zip(dead) {
                        let label = ops::metrics::TableLabel {
                            table: table.config.name.to_string(),
                        };
                        ops.metrics.dead_tuples.get_or_create(&label).set(n);
                    }
                    ops.metrics
                        .oldest_snapshot_age_seconds
                        .set(horizon.oldest_secs());
                    ops.metrics
                        .oldest_snapshot_xid_age
                        .set(horizon.oldest_xid_age());
                    watch.observe(&horizon, Instant::now());
                }
                Err(e) => tracing::debug!(error = %e, "Could not read the vacuum horizon"),
            }
        }
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(ops::PROBE_INTERVAL) => {}
        }
    }
}

/// How long the relay keeps a transaction open at most besides publishing: claim,
/// mark and commit each take one statement deadline at most.
pub fn session_limits(config: &Config) -> SessionLimits {
    SessionLimits {
        statement_timeout: config.postgres.statement_timeout,
        lock_timeout: Duration::from_secs(5).min(config.postgres.statement_timeout),
        idle_in_transaction_timeout: config.sink.publish_timeout + Duration::from_secs(10),
    }
}

/// Whether the relay runs until stopped or until the outbox is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Run,
    Drain,
}

/// Runs `attempt` until it succeeds, fails for good, or `shutdown` stops the wait (during
/// an attempt too: `drain --timeout` bounds start-up); failures `class` calls transient are
/// retried with backoff (a database or broker still starting). `reached` hears whether
/// each attempt got an answer.
async fn retry_transient<T, E, F, Fut>(
    what: &str,
    shutdown: &Shutdown,
    class: fn(&E) -> ErrorClass,
    reached: impl Fn(bool),
    mut attempt: F,
) -> Result<T, RelayError>
where
    E: Into<RelayError> + std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let stop = shutdown.stop_token();
    let unreachable = |last_error: String| RelayError::Unreachable {
        what: what.to_owned(),
        last_error,
    };
    let mut backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));
    let mut last_error = "stopped before the first attempt ended".to_owned();
    loop {
        let result = tokio::select! {
            biased;
            _ = stop.cancelled() => return Err(unreachable(last_error)),
            r = attempt() => r,
        };
        match result {
            Ok(value) => {
                reached(true);
                return Ok(value);
            }
            Err(e) if class(&e) == ErrorClass::Transient => {
                reached(false);
                let pause = backoff.next_pause();
                tracing::warn!(error = %e, retry_in = ?pause, "{what} not reachable yet");
                last_error = e.to_string();
                tokio::select! {
                    _ = stop.cancelled() => return Err(unreachable(last_error)),
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Checks every table and returns its statements, waiting out transient failures.
pub async fn prepare_tables(
    source: &Source,
    config: &Config,
    shutdown: &Shutdown,
    ops: &Ops,
) -> Result<Vec<TablePlan>, RelayError> {
    retry_transient(
        "PostgreSQL",
        shutdown,
        SourceError::class,
        |up| ops.postgres_reachable(up),
        || try_prepare_tables(source, config),
    )
    .await
}

/// Checks every table once and returns its statements; no retries.
pub async fn try_prepare_tables(
    source: &Source,
    config: &Config,
) -> Result<Vec<TablePlan>, SourceError> {
    let session = source.bounded(source.session()).await?;
    let mut plans = Vec::new();
    for table in &config.tables {
        let shape = source
            .bounded(async { schema::inspect(&**session, table, &config.relay).await })
            .await?
            .map_err(|problems| SourceError::Schema(problems.join("\n")))?;
        plans.push(TablePlan {
            sql: TableSql::new(table, &shape, config.relay.ordering),
            config: table.clone(),
            floor: FloorCell::default(),
        });
    }
    Ok(plans)
}

/// Connects the configured sink, waiting out transient failures.
pub async fn connect_sink(
    config: &Config,
    shutdown: &Shutdown,
    ops: &Ops,
) -> Result<Sink, RelayError> {
    retry_transient(
        "Broker",
        shutdown,
        |e: &SinkError| e.class,
        |up| ops.broker_reachable(up),
        || Sink::connect(&config.sink),
    )
    .await
}

/// The HTTP endpoints, served from the moment the configuration is valid (before any
/// dependency is reachable, so a start-up probe sees a 503 with the reason, not a closed
/// port) until the relay returns.
struct Endpoints {
    ops: Arc<Ops>,
    /// Stops the HTTP server and the other operations tasks when dropped.
    _done: tokio_util::sync::DropGuard,
    done: CancellationToken,
}

impl Endpoints {
    async fn start(config: &Config) -> Result<Endpoints, RelayError> {
        let ops = Ops::new(config.relay.poll_interval);
        let done = CancellationToken::new();
        if let Some(http) = &config.http {
            let listener = ops::http::bind(http.listen)
                .await
                .map_err(RelayError::Fatal)?;
            tracing::info!(listen = %http.listen, "Serving /metrics, /healthz, /readyz");
            tokio::spawn(ops::http::serve(listener, ops.clone(), done.clone()));
        }
        Ok(Endpoints {
            ops,
            _done: done.clone().drop_guard(),
            done,
        })
    }
}

/// Runs the relay with the sink the configuration names.
pub async fn run(config: &Config, mode: Mode, shutdown: Shutdown) -> Result<Report, RelayError> {
    let endpoints = Endpoints::start(config).await?;
    let sink = connect_sink(config, &shutdown, &endpoints.ops).await?;
    relay(config, mode, sink, shutdown, endpoints).await
}

/// Runs the relay with the given sink until `shutdown` stops it (`Mode::Run`) or nothing
/// publishable is left (`Mode::Drain`).
pub async fn run_with_sink(
    config: &Config,
    mode: Mode,
    sink: Sink,
    shutdown: Shutdown,
) -> Result<Report, RelayError> {
    let endpoints = Endpoints::start(config).await?;
    endpoints.ops.broker_reachable(true);
    relay(config, mode, sink, shutdown, endpoints).await
}

async fn relay(
    config: &Config,
    mode: Mode,
    sink: Sink,
    shutdown: Shutdown,
    endpoints: Endpoints,
) -> Result<Report, RelayError> {
    let started = Instant::now();
    let limits = session_limits(config);
    let source = Source::new(&config.postgres, limits)?;
    let tables = prepare_tables(&source, config, &shutdown, &endpoints.ops).await?;
    shutdown.arm_deadline(config.shutdown.drain_timeout);

    let shared = Arc::new(Shared {
        source,
        sink,
        tables,
        relay: config.relay.clone(),
        publish_timeout: config.sink.publish_timeout,
        shutdown: shutdown.clone(),
        wake: Arc::new(Notify::new()),
        active: AtomicUsize::new(0),
        drain: mode == Mode::Drain,
        drained: AtomicBool::new(false),
        aborted: AtomicBool::new(false),
        fatal: Mutex::new(None),
        stats: Stats::default(),
        breaker: breaker::Breaker::default(),
        ops: endpoints.ops.clone(),
        published_at_backlog_read: AtomicU64::new(0),
    });
    tracing::info!(
        tables = shared.tables.len(),
        workers = config.relay.workers,
        sink = shared.sink.name(),
        postgres = %config.postgres.redacted(),
        ?mode,
        "Relaying"
    );

    // Tasks that outlive the workers: HTTP, probes, watchdog. Stopped after the workers.
    let done = endpoints.done.clone();
    tokio::spawn(probe(shared.clone(), done.clone()));
    // Per table: the claim floor's keeper and, in mark mode with a retention, retention.
    for t in 0..shared.tables.len() {
        let (shared, done) = (shared.clone(), done.clone());
        let retention = config.relay.retention;
        tokio::spawn(async move {
            let table = &shared.tables[t];
            let name = table.config.name.to_string();
            let keeper = floor::keep(&name, &shared.source, &table.sql, &table.floor, &done);
            let Some(retention) = retention else {
                return keeper.await;
            };
            let label = ops::metrics::TableLabel {
                table: name.clone(),
            };
            let counter = shared
                .ops
                .metrics
                .retention_deleted
                .get_or_create(&label)
                .clone();
            let deleted = |n| {
                counter.inc_by(n);
            };
            let retire =
                retention::keep(&name, &shared.source, &table.sql, retention, deleted, &done);
            tokio::join!(keeper, retire);
        });
    }
    if let Some(connection) = shared.sink.connection() {
        tokio::spawn(watch_connection(shared.clone(), connection, done.clone()));
    }
    if mode == Mode::Drain && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        tokio::spawn(progress(shared.clone(), done.clone()));
    }
    if let Some(interval) = ops::watchdog_interval() {
        tokio::spawn(ops::watchdog(shared.ops.clone(), interval, done.clone()));
    }
    {
        let shared = shared.clone();
        tokio::spawn(async move {
            shared.shutdown.stop_token().cancelled().await;
            shared.ops.health.set_stopping();
            ops::notify_stopping();
        });
    }

    let tracker = TaskTracker::new();
    tracker.spawn(crate::source::listen::listen(
        config.postgres.clone(),
        session_config(&config.postgres, limits),
        shared.wake.clone(),
        shutdown.stop_token().clone(),
    ));
    {
        let shared = shared.clone();
        let stop = shutdown.stop_token().clone();
        tracker.spawn(async move {
            shared
                .breaker
                .run_prober(&shared.sink, &shared.ops.health, stop)
                .await
        });
    }
    for id in 0..config.relay.workers {
        tracker.spawn(
            worker::Worker {
                id,
                shared: shared.clone(),
            }
            .run(),
        );
    }
    tracker.close();
    ops::notify_ready();

    tokio::select! {
        _ = tracker.wait() => {}
        _ = shutdown.abort_token().cancelled() => {
            // Workers drop their transactions on abort; give them a moment to say so.
            if tokio::time::timeout(Duration::from_secs(1), tracker.wait()).await.is_err() {
                tracing::warn!(tasks = tracker.len(), "Tasks still running at the deadline; exiting anyway");
                shared.aborted.store(true, Relaxed);
            }
        }
    }
    // Every batch awaited its acks, so this flush has little to do; bound it anyway, and
    // tightly after an abort, which must exit at once.
    let flush = if shutdown.abort_token().is_cancelled() {
        Duration::from_millis(250)
    } else {
        Duration::from_secs(2)
    };
    if let Err(e) = shared.sink.close(flush).await {
        tracing::warn!(error = %e, "Sink did not flush in time");
    }

    if let Some(message) = shared.fatal.lock().unwrap().take() {
        return Err(RelayError::Fatal(message));
    }
    let aborted = shared.aborted.load(Relaxed);
    // After an abort (drain --timeout, the deadline, a second signal) the process must
    // exit at once: the closing look at the table gets a second, not a statement deadline.
    let closing = if shutdown.abort_token().is_cancelled() {
        Duration::from_secs(1)
    } else {
        shared.source.deadline()
    };
    if mode == Mode::Drain && !aborted && !shared.drained.load(Relaxed) {
        // Stopped by a signal or --timeout: the outbox may still have emptied meanwhile.
        let empty = tokio::time::timeout(closing, shared.nothing_publishable())
            .await
            .unwrap_or(false);
        shared.drained.store(empty, Relaxed);
    }
    let waiting = if mode == Mode::Drain && !shared.drained.load(Relaxed) {
        tokio::time::timeout(closing, shared.waiting())
            .await
            .ok()
            .flatten()
    } else {
        None
    };
    let report = Report {
        waiting,
        published: shared.stats.published.load(Relaxed),
        failed: shared.stats.failed.load(Relaxed),
        dead: shared.stats.dead.load(Relaxed),
        elapsed: started.elapsed(),
        aborted,
        drained: shared.drained.load(Relaxed) && !aborted,
    };
    tracing::info!(
        published = report.published,
        failed = report.failed,
        dead = report.dead,
        aborted = report.aborted,
        elapsed = ?report.elapsed,
        "Relay stopped"
    );
    Ok(report)
}
