//! The supervisor: prepares the tables, connects the sink, runs the workers and the
//! LISTEN task under one [`TaskTracker`], the tasks that outlive them under another
//! (`tasks`, awaited once the run is over), and reports how the run ended.
//!
//! `run` relays until stopped; `drain` relays until no publishable row is left. Either
//! way, stopping means: stop claiming, let in-flight batches commit, flush the sink. If
//! the deadline (`abort`) comes first, in-flight batches roll back and the report says so.

mod batch;
mod breaker;
mod discovery;
mod drain;
mod envelope;
mod error;
mod message;
mod order;
mod pause;
mod postponed;
mod sleep;
mod start;
mod state;
mod tasks;
mod valve;
mod wake;
mod worker;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, RelayConfig, TableHistograms};
use crate::ops::metrics::TableMeters;
use crate::ops::otel::Otel;
use crate::ops::{self, Ops};
use crate::shutdown::Shutdown;
use crate::sink::Sink;
use crate::source::rate::Bucket;
use crate::source::table::TablePlan;
use crate::source::{floor, retention};
use crate::source::{SessionLimits, Source};

pub use error::{RelayError, TableFailed};
use start::Background;
use start::{connect_sink, prepare_tables};
use state::RunState;
use tasks::TaskSet;

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
    /// `drain` only: paused tables that still hold publishable rows, each with its pause
    /// (`drain` does not wait for them, and exits 3).
    pub paused_left: Vec<(String, crate::source::pause::Paused)>,
    /// Background tasks (the probe, a floor keeper, ...) that did not stop in time once the
    /// run was over: left behind as the process exits (a WARN names them too).
    pub unstopped: Vec<String>,
}

/// What the workers share: the dependencies, the run's settings and its state.
struct Shared {
    source: Source,
    sink: Arc<Sink>,
    /// The run's tables, in the configuration's order (those patterns matched after the
    /// others, see `discovery`).
    tables: Vec<RunTable>,
    relay: RelayConfig,
    publish_timeout: Duration,
    /// Drain mode: stop once nothing publishable is left.
    drain: bool,
    shutdown: Shutdown,
    /// Which tables are due for a claim; idle workers wait on it (see `wake`).
    wakes: Arc<wake::Wakes>,
    /// Which tables are paused, for every relay (see `pause`).
    pauses: pause::PauseState,
    /// The bad-row valve, unless turned off (see `valve`).
    valve: Option<valve::Valve>,
    breaker: breaker::Breaker,
    ops: Arc<Ops>,
    /// The run's, across generations (`discovery`).
    state: Arc<RunState>,
    /// Trace spans, when exported.
    otel: Arc<Otel>,
    /// `drain`: held by the worker looking for rows left (`drain::left`).
    drain_look: tokio::sync::Mutex<()>,
}

/// What every generation of a run's workers shares (see `discovery`): the sink, the span
/// exporter and the run's state.
struct RunWide {
    sink: Arc<Sink>,
    otel: Arc<Otel>,
    state: Arc<RunState>,
}

/// One of the run's tables, as a batch carries it from the claim to the commit: its plan
/// and what the run keeps for it.
struct RunTable {
    /// Its place among the run's tables: [`wake::Wakes`], [`pause::PauseState`] and the
    /// valve know a table by it.
    index: usize,
    plan: TablePlan,
    /// Its `max_rate` bucket, if it has one (see `source::rate`).
    rate: Option<Bucket>,
    /// Its batch metrics, from its first batch on (a series appears once it has something
    /// to say).
    meters: OnceLock<TableMeters>,
    /// The label of its latency histograms (`http.table_histograms`): its name, or its
    /// entry's pattern.
    histograms: String,
    /// A table a pattern matched was dropped: claims leave it alone (`Shared::let_go`).
    gone: AtomicBool,
}

impl RunTable {
    fn new(index: usize, plan: TablePlan, histograms: TableHistograms) -> RunTable {
        let config = &plan.config;
        let rate = config.max_rate.map(|rate| Bucket::new(&config.name, rate));
        let histograms = match (histograms, &config.pattern) {
            (TableHistograms::Entry, Some(pattern)) => pattern.to_string(),
            _ => config.name.to_string(),
        };
        RunTable {
            index,
            plan,
            rate,
            meters: OnceLock::new(),
            histograms,
            gone: AtomicBool::new(false),
        }
    }

    /// Whether the table was let go (dropped while relayed, see `Shared::let_go`).
    fn is_gone(&self) -> bool {
        self.gone.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The table's name, as the configuration gives it.
    fn name(&self) -> &crate::config::TableName {
        &self.plan.config.name
    }
}

/// How long the relay waits at exit for the last trace spans to reach the collector.
const OTEL_FLUSH: Duration = Duration::from_secs(2);

impl Shared {
    /// The run's shared state over its dependencies (the database, the broker, the
    /// endpoints' state and the span exporter) and its checked tables.
    fn new(
        config: &Config,
        mode: Mode,
        (source, ops, run): (Source, Arc<Ops>, &RunWide),
        (tables, pauses): (Vec<TablePlan>, pause::PauseState),
        shutdown: &Shutdown,
    ) -> Shared {
        // NOTIFY names a table as `schema.table`, unquoted (migrations/notify.sql, and
        // `requeue`/`replay`): the name's Display form.
        let wakes = Arc::new(wake::Wakes::new(
            tables
                .iter()
                .map(|t| (t.config.name.to_string(), t.wake))
                .collect(),
            config.relay.poll_interval,
            mode == Mode::Drain,
        ));
        let valve = valve::Valve::new(config.relay.bad_row_valve, tables.len());
        let histograms = config
            .http
            .as_ref()
            .map_or(TableHistograms::Table, |h| h.table_histograms);
        Shared {
            source,
            sink: run.sink.clone(),
            tables: tables
                .into_iter()
                .enumerate()
                .map(|(t, plan)| RunTable::new(t, plan, histograms))
                .collect(),
            relay: config.relay.clone(),
            publish_timeout: config.sink.publish_timeout,
            drain: mode == Mode::Drain,
            shutdown: shutdown.clone(),
            wakes,
            pauses,
            valve,
            breaker: breaker::Breaker::default(),
            ops,
            state: run.state.clone(),
            otel: run.otel.clone(),
            drain_look: tokio::sync::Mutex::new(()),
        }
    }

    /// The batch metrics of `table`.
    fn meters<'t>(&self, table: &'t RunTable) -> &'t TableMeters {
        table.meters.get_or_init(|| {
            let name = table.name().to_string();
            self.ops
                .metrics
                .table_meters(&name, &table.histograms, self.sink.name())
        })
    }

    /// Lets table `t` go if `error` says it was dropped and a pattern matched it: one WARN,
    /// no more claims from it, and the next generation starts without it (`discovery`).
    /// False for any other error, which stays what it was.
    fn let_go(&self, t: usize, error: &batch::BatchError) -> bool {
        let table = &self.tables[t];
        let dropped = matches!(error, batch::BatchError::Source(e) if e.is_missing_relation());
        if !(dropped && table.plan.config.pattern.is_some()) {
            return false;
        }
        if !table.gone.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(table = %table.name(), %error, "Table dropped; letting it go");
            self.shutdown.end_generation();
        }
        true
    }

    /// Records a fatal error and stops the relay.
    fn fail(&self, failed: TableFailed) {
        tracing::error!(error = %failed, "Stopping: this needs an operator");
        self.state.record_fatal(failed);
        self.shutdown.request_stop();
    }
}

/// Whether the relay runs until stopped or until the outbox is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Run,
    Drain,
}

/// How long the background tasks get to return once `done` fires: each looks at it at
/// every wait, so only one in the middle of a statement takes any time.
const BACKGROUND_STOP: Duration = Duration::from_secs(1);
/// The same after an abort, which must exit at once (as [`FLUSH_ABORTED`]).
const BACKGROUND_STOP_ABORTED: Duration = Duration::from_millis(250);
/// After an abort, how long the workers get to drop their transactions: each races its
/// publish against `abort`, so a second is plenty; one that takes longer is given up on.
const WORKERS_AFTER_ABORT: Duration = Duration::from_secs(1);
/// How long the sink's closing flush may take: every batch awaited its acks already, so
/// there is little left to send.
const FLUSH: Duration = Duration::from_secs(2);
/// The same after an abort, which must exit at once.
const FLUSH_ABORTED: Duration = Duration::from_millis(250);
/// After an abort, how long each closing look at the tables (drained? waiting? paused?)
/// may take, instead of a statement deadline: the process must exit at once.
const CLOSING_LOOK_ABORTED: Duration = Duration::from_secs(1);

/// Runs the relay with the sink the configuration names.
pub async fn run(config: &Config, mode: Mode, shutdown: Shutdown) -> Result<Report, RelayError> {
    let background = Background::start(config).await?;
    let sink = connect_sink(config, &shutdown, &background.ops);
    let relayed = relay(config, mode, sink, shutdown.clone(), &background).await;
    stop_background(relayed, background, &shutdown).await
}

/// Runs the relay with the given sink until `shutdown` stops it (`Mode::Run`) or nothing
/// publishable is left (`Mode::Drain`). For tests and benchmarks (the `testing` feature),
/// with the memory sink.
#[cfg(feature = "testing")]
pub async fn run_with_sink(
    config: &Config,
    mode: Mode,
    sink: Sink,
    shutdown: Shutdown,
) -> Result<Report, RelayError> {
    let background = Background::start(config).await?;
    background.ops.broker_reachable(true);
    let sink = async { Ok(sink) };
    let relayed = relay(config, mode, sink, shutdown.clone(), &background).await;
    stop_background(relayed, background, &shutdown).await
}

/// Stops the tasks that outlive the workers, once the run is over whichever way it ended,
/// and waits for them; a WARN and the report ([`Report::unstopped`]) name those that did
/// not stop in time.
async fn stop_background(
    relayed: Result<Report, RelayError>,
    background: Background,
    shutdown: &Shutdown,
) -> Result<Report, RelayError> {
    let within = if shutdown.abort_token().is_cancelled() {
        BACKGROUND_STOP_ABORTED
    } else {
        BACKGROUND_STOP
    };
    let unstopped = background.stop(within).await;
    relayed.map(|report| Report {
        unstopped,
        ..report
    })
}

/// Connects the sink (`sink`) and prepares the tables at once: neither needs the other,
/// and each waits out its own transient failures; the first to fail for good ends both.
/// Then runs the workers: in one generation, or (`run` with tables found by pattern) in one
/// per set of tables (`discovery`).
async fn relay(
    config: &Config,
    mode: Mode,
    sink: impl std::future::Future<Output = Result<Sink, RelayError>>,
    shutdown: Shutdown,
    background: &Background,
) -> Result<Report, RelayError> {
    let started = Instant::now();
    let limits = SessionLimits::relay(&config.postgres, config.sink.publish_timeout);
    let prepared = prepare_tables(config, mode, limits, &shutdown, &background.ops);
    let (sink, mut prepared) = tokio::try_join!(sink, prepared)?;
    shutdown.arm_deadline(config.shutdown.drain_timeout);
    let otel = match ops::otel::traces_url(&config.tracing) {
        None => Otel::off(),
        Some(url) => {
            let system = sink.name();
            tokio::task::spawn_blocking(move || Otel::start(url, system))
                .await
                .map_err(RelayError::TracingTask)??
        }
    };
    let run = RunWide {
        sink: Arc::new(sink),
        otel: Arc::new(otel),
        state: Arc::default(),
    };
    let watch = mode == Mode::Run && !config.patterns.is_empty();
    let mut said = discovery::Said::default();
    discovery::log_changes(None, &prepared, &mut said);
    loop {
        let (generation, tasks) = match watch {
            true => (
                shutdown.generation(),
                Some(discovery::Tasks::new(background)),
            ),
            false => (shutdown.clone(), None),
        };
        let found = std::mem::take(&mut prepared.found);
        let start::Prepared {
            source,
            tables,
            pauses,
            paused,
            ..
        } = prepared;
        let dependencies = (source, background.ops.clone(), &run);
        let tables = (tables, pauses);
        let shared = Arc::new(Shared::new(config, mode, dependencies, tables, &generation));
        pause::apply_pauses(&shared, paused);
        // Before the floor keepers start: they pace themselves by what it settles.
        if mode == Mode::Drain {
            drain::look_first(&shared).await;
        }
        let (set, done) = match &tasks {
            Some(t) => (&t.set, &t.done),
            None => (&background.tasks, &background.done),
        };
        spawn_background(&shared, mode, set, done);
        if watch {
            let (s, d) = (shared.clone(), done.clone());
            let patterns = config.patterns.clone();
            set.spawn("table discovery", discovery::watch(s, patterns, found, d));
        }
        run_workers(&shared, config, mode, limits).await;
        let next = match tasks {
            Some(tasks) => discovery::next(&shared, config, tasks, &mut said).await?,
            None => None,
        };
        match next {
            Some(next) => prepared = next,
            None => return finish(&shared, mode, started).await,
        }
    }
}

/// Runs the workers (and the LISTEN task and the breaker's prober) of one generation until
/// they stop.
async fn run_workers(shared: &Arc<Shared>, config: &Config, mode: Mode, limits: SessionLimits) {
    tracing::info!(
        tables = shared.tables.len(),
        workers = config.relay.workers,
        sink = shared.sink.name(),
        postgres = %config.postgres.redacted(),
        ?mode,
        "Relaying"
    );
    let tracker = TaskTracker::new();
    let stop = shared.shutdown.stop_token().clone();
    // A drain looks at every table in every round (`wake`), so NOTIFY would tell it
    // nothing: it opens no LISTEN session (one backend fewer per drain; eight drains
    // started at once open 48 sessions instead of 56).
    if mode == Mode::Run {
        tracker.spawn(crate::source::listen::listen(
            config.postgres.for_listen(),
            limits,
            shared.wakes.clone(),
            stop.clone(),
        ));
    }
    {
        let shared = shared.clone();
        tracker.spawn(async move {
            shared
                .breaker
                .run_prober(&shared.sink, &shared.ops.health, stop)
                .await
        });
    }
    // No table yet (a pattern that matches none): the workers wait for the next generation.
    let workers = if shared.tables.is_empty() {
        0
    } else {
        config.relay.workers
    };
    for lane in 0..workers {
        let shared = shared.clone();
        tracker.spawn(worker::Worker { lane, shared }.run());
    }
    tracker.close();
    ops::notify_ready();
    if workers == 0 {
        shared.shutdown.stop_token().cancelled().await;
    }
    wait_for_workers(shared, &tracker).await;
}

/// After the last generation: flushes the sink and the spans, and reports.
async fn finish(shared: &Arc<Shared>, mode: Mode, started: Instant) -> Result<Report, RelayError> {
    flush_sink(shared).await;
    if shared.otel.is_on() {
        let shared = shared.clone();
        let _ = tokio::task::spawn_blocking(move || shared.otel.shutdown(OTEL_FLUSH)).await;
    }
    if let Some(failed) = shared.state.take_fatal() {
        return Err(failed.into());
    }
    Ok(report(shared, mode, started).await)
}

/// Tasks that outlive the workers, stopped by `done` after them and awaited by
/// [`stop_background`]: the probe, the floor's keeper and retention per table, the pause,
/// connection and availability followers, drain's progress line on a terminal, the systemd watchdog,
/// and the STOPPING notification.
fn spawn_background(shared: &Arc<Shared>, mode: Mode, tasks: &TaskSet, done: &CancellationToken) {
    let progress = mode == Mode::Drain && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (s, d) = (shared.clone(), done.clone());
    tasks.spawn("probe", async move {
        let circuit = || {
            let open = s.breaker.state() == breaker::BreakerState::Open;
            (open, s.breaker.times_opened())
        };
        let plans: Vec<&TablePlan> = s.tables.iter().map(|t| &t.plan).collect();
        let probed = ops::probe::Probed {
            source: &s.source,
            sink: &s.sink,
            tables: &plans,
            circuit: &circuit,
            progress,
            published: s.state.published(),
        };
        ops::probe::run(&s.ops, probed, d).await
    });
    for table in &shared.tables {
        let name = format!("table keeper {}", table.name());
        tasks.spawn(name, keep_table(shared.clone(), table.index, done.clone()));
    }
    if mode == Mode::Run {
        let (s, d) = (shared.clone(), done.clone());
        tasks.spawn("poller", async move {
            let interval = s.relay.poll_interval;
            let plans: Vec<&TablePlan> = s.tables.iter().map(|t| &t.plan).collect();
            let rechecked = || s.ops.health.progress();
            sleep::poll(&s.wakes, &s.source, &plans, interval, &rechecked, &d).await
        });
    }
    let (s, d) = (shared.clone(), done.clone());
    tasks.spawn("pause follower", async move {
        pause::follow_pauses(&s, d).await
    });
    if let Some(connection) = shared.sink.connection() {
        let (s, d) = (shared.clone(), done.clone());
        tasks.spawn("connection follower", async move {
            s.breaker.follow_connection(&s.ops, connection, d).await
        });
    }
    if let Some(available_again) = shared.sink.available_again() {
        let (s, d) = (shared.clone(), done.clone());
        tasks.spawn("availability follower", async move {
            postponed::follow_availability(&s, available_again, d).await
        });
    }
    if progress {
        let (s, d) = (shared.clone(), done.clone());
        tasks.spawn("progress line", async move {
            let names: Vec<String> = s.tables.iter().map(|t| t.name().to_string()).collect();
            let (published, stop) = (s.state.published(), s.shutdown.stop_token());
            ops::progress::show(&s.ops, &names, published, stop, &d).await
        });
    }
    if let Some(interval) = ops::watchdog_interval() {
        tasks.spawn(
            "systemd watchdog",
            ops::watchdog(shared.ops.clone(), interval, done.clone()),
        );
    }
    let (s, d) = (shared.clone(), done.clone());
    tasks.spawn("stopping notice", async move {
        // `done` too: a run that ends without a stop (a failed start) has nothing to notify.
        tokio::select! {
            biased;
            _ = s.shutdown.run_stop_token().cancelled() => {}
            _ = d.cancelled() => return,
        }
        s.ops.health.set_stopping();
        ops::notify_stopping();
    });
}

/// Table `t`'s claim floor keeper and, in mark mode with a retention, its retention.
async fn keep_table(shared: Arc<Shared>, t: usize, done: CancellationToken) {
    let table = &shared.tables[t].plan;
    let name = table.config.name.to_string();
    let active = || shared.wakes.active(t);
    let lowered = || shared.wakes.raise(t, true);
    let pace = floor::Pace {
        active: &active,
        poke: shared.wakes.keeper(t),
        lowered: &lowered,
        idle_tick: (!shared.drain).then_some(floor::IDLE_TICK),
    };
    let keeper = floor::keep(&name, &shared.source, &table.sql, &table.floor, pace, &done);
    let Some(retention) = shared.relay.retention else {
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
    let retire = retention::keep(&name, &shared.source, &table.sql, retention, deleted, &done);
    tokio::join!(keeper, retire);
}

/// Waits for the workers to finish; at the deadline, gives them a moment to drop their
/// transactions and says which tasks did not.
async fn wait_for_workers(shared: &Shared, tracker: &TaskTracker) {
    tokio::select! {
        _ = tracker.wait() => {}
        _ = shared.shutdown.abort_token().cancelled() => {
            if tokio::time::timeout(WORKERS_AFTER_ABORT, tracker.wait()).await.is_err() {
                tracing::warn!(tasks = tracker.len(), "Tasks still running at the deadline; exiting anyway");
                shared.state.set_aborted();
            }
        }
    }
}

/// Every batch awaited its acks, so this flush has little to do; bound it anyway, and
/// tightly after an abort, which must exit at once.
async fn flush_sink(shared: &Shared) {
    let flush = if shared.shutdown.abort_token().is_cancelled() {
        FLUSH_ABORTED
    } else {
        FLUSH
    };
    if let Err(e) = shared.sink.close(flush).await {
        tracing::warn!(error = %e, "Sink did not flush in time");
    }
}

/// How the run ended. A drain stopped by a signal or `--timeout` looks once more whether
/// the outbox emptied meanwhile, and counts what waits for a retry.
async fn report(shared: &Shared, mode: Mode, started: Instant) -> Report {
    let aborted = shared.state.aborted();
    // After an abort (drain --timeout, the deadline, a second signal) the process must
    // exit at once: the closing look at the table gets a second, not a statement deadline.
    let closing = if shared.shutdown.abort_token().is_cancelled() {
        CLOSING_LOOK_ABORTED
    } else {
        shared.source.deadline()
    };
    if mode == Mode::Drain && !aborted && !shared.state.drained() {
        let empty = tokio::time::timeout(closing, drain::nothing_publishable(shared))
            .await
            .unwrap_or(false);
        shared.state.set_drained(empty);
    }
    let waiting = if mode == Mode::Drain && !shared.state.drained() {
        tokio::time::timeout(closing, drain::waiting(shared))
            .await
            .ok()
            .flatten()
    } else {
        None
    };
    let paused_left = if mode == Mode::Drain && !aborted {
        // No answer in time: every paused table counts as holding rows (exit 3).
        let every = || {
            (shared.tables.iter())
                .filter_map(|t| Some((t.name().to_string(), shared.pauses.of(t.index)?)))
                .collect()
        };
        tokio::time::timeout(closing, drain::paused_left(shared))
            .await
            .unwrap_or_else(|_| every())
    } else {
        Vec::new()
    };
    let totals = shared.state.totals();
    let report = Report {
        waiting,
        paused_left,
        published: totals.published,
        failed: totals.failed,
        dead: totals.dead,
        elapsed: started.elapsed(),
        aborted,
        drained: shared.state.drained() && !aborted,
        unstopped: Vec::new(),
    };
    tracing::info!(
        published = report.published,
        failed = report.failed,
        dead = report.dead,
        aborted = report.aborted,
        elapsed = ?report.elapsed,
        "Relay stopped"
    );
    report
}
