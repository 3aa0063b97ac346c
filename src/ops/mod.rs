//! What operators see of a running relay: Prometheus metrics, `/healthz` and `/readyz`,
//! and systemd's readiness and watchdog notifications.
//!
//! - *Alive* (`/healthz`, the systemd watchdog): some loop of the relay (a worker, or the
//!   breaker's prober while the broker is down) went round within [`ALIVE_WINDOW`]. A
//!   relay stuck for longer is hung and should be restarted.
//! - *Ready* (`/readyz`): PostgreSQL answered and the broker answered within the last
//!   probe (every [`PROBE_INTERVAL`]), and a worker completed a claim within the progress
//!   window; not while stopping.

pub(crate) mod http;
pub(crate) mod metrics;
pub(crate) mod otel;
pub(crate) mod probe;
pub mod progress;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

pub(crate) use metrics::Metrics;

/// How often readiness is probed and the gauges that need the database are refreshed.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(2);
/// How often backlog and oldest-age gauges are refreshed.
pub(crate) const GAUGE_INTERVAL: Duration = Duration::from_secs(5);
/// A relay whose loops have not gone round for this long is not alive.
pub(crate) const ALIVE_WINDOW: Duration = Duration::from_secs(60);

/// Liveness and readiness state, updated by the relay's loops and the probe task.
pub(crate) struct Health {
    started: Instant,
    /// Milliseconds since `started` of the last loop iteration of any kind.
    alive_ms: AtomicU64,
    /// Milliseconds since `started` of the last completed claim.
    progress_ms: AtomicU64,
    /// Whether a claim counts as recent.
    progress_window: Duration,
    postgres_ok: AtomicBool,
    broker_ok: AtomicBool,
    postgres_seen: AtomicBool,
    broker_seen: AtomicBool,
    stopping: AtomicBool,
}

impl Health {
    pub(crate) fn new(poll_interval: Duration) -> Health {
        Health {
            started: Instant::now(),
            alive_ms: AtomicU64::new(0),
            progress_ms: AtomicU64::new(0),
            progress_window: (poll_interval * 5).max(Duration::from_secs(10)),
            postgres_ok: AtomicBool::new(false),
            broker_ok: AtomicBool::new(false),
            postgres_seen: AtomicBool::new(false),
            broker_seen: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn since(&self, ms: &AtomicU64) -> Duration {
        Duration::from_millis(self.now_ms().saturating_sub(ms.load(Relaxed)))
    }

    /// A loop went round.
    pub(crate) fn alive(&self) {
        self.alive_ms.store(self.now_ms(), Relaxed);
    }

    /// A claim completed (rows or none): the database and the loop work.
    pub(crate) fn progress(&self) {
        let now = self.now_ms();
        self.alive_ms.store(now, Relaxed);
        self.progress_ms.store(now, Relaxed);
    }

    pub(crate) fn set_stopping(&self) {
        self.stopping.store(true, Relaxed);
    }

    pub(crate) fn set_postgres_reachable(&self, up: bool) {
        self.postgres_ok.store(up, Relaxed);
        self.postgres_seen.fetch_or(up, Relaxed);
    }

    pub(crate) fn set_broker_reachable(&self, up: bool) {
        self.broker_ok.store(up, Relaxed);
        self.broker_seen.fetch_or(up, Relaxed);
    }

    /// `Ok` when alive; otherwise why not.
    pub(crate) fn liveness(&self) -> Result<(), String> {
        let quiet = self.since(&self.alive_ms);
        if quiet > ALIVE_WINDOW {
            return Err(format!("no relay loop went round for {}s", quiet.as_secs()));
        }
        Ok(())
    }

    /// `Ok` when ready; otherwise every reason why not.
    pub(crate) fn readiness(&self) -> Result<(), String> {
        let mut reasons = Vec::new();
        if self.stopping.load(Relaxed) {
            reasons.push("stopping".to_owned());
        }
        for (ok, seen, what) in [
            (&self.postgres_ok, &self.postgres_seen, "PostgreSQL"),
            (&self.broker_ok, &self.broker_seen, "broker"),
        ] {
            if !ok.load(Relaxed) {
                reasons.push(if seen.load(Relaxed) {
                    format!("{what} not reachable")
                } else {
                    format!("starting: {what} not reached yet")
                });
            }
        }
        let quiet = self.since(&self.progress_ms);
        if quiet > self.progress_window {
            reasons.push(format!("no claim completed for {}s", quiet.as_secs()));
        }
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(reasons.join("; "))
        }
    }
}

/// Metrics and health, shared by the relay and the HTTP server.
pub(crate) struct Ops {
    pub(crate) metrics: Metrics,
    pub(crate) health: Health,
    /// Rows published (run total) when the backlog gauges were last read: drain's progress
    /// line takes off what was published since.
    pub(crate) published_at_backlog_read: AtomicU64,
    /// `/metrics` requests answered so far: the gauges that cost a read follow them.
    scrapes: AtomicU64,
}

impl Ops {
    pub(crate) fn new(poll_interval: Duration) -> Arc<Ops> {
        Arc::new(Ops {
            metrics: Metrics::default(),
            health: Health::new(poll_interval),
            published_at_backlog_read: AtomicU64::new(0),
            scrapes: AtomicU64::new(0),
        })
    }

    /// Counts a `/metrics` request.
    pub(crate) fn scraped(&self) {
        self.scrapes.fetch_add(1, Relaxed);
    }

    /// `/metrics` requests answered so far: a gauge that costs a read is read again only
    /// once a scrape showed the last value (see `probe`).
    pub(crate) fn scrapes(&self) -> u64 {
        self.scrapes.load(Relaxed)
    }

    /// Records whether PostgreSQL answered: readiness and the `dependency_up` gauge.
    pub(crate) fn postgres_reachable(&self, up: bool) {
        self.health.alive();
        self.health.set_postgres_reachable(up);
        self.set_up("postgres", up);
    }

    /// Records whether the broker answered: readiness and the `dependency_up` gauge.
    pub(crate) fn broker_reachable(&self, up: bool) {
        self.health.alive();
        self.health.set_broker_reachable(up);
        self.set_up("broker", up);
    }

    fn set_up(&self, dependency: &str, up: bool) {
        let label = metrics::DependencyLabel {
            dependency: dependency.to_owned(),
        };
        self.metrics.up.get_or_create(&label).set(i64::from(up));
        self.metrics
            .ready
            .set(i64::from(self.health.readiness().is_ok()));
    }
}

/// Tells systemd (when it started us with `Type=notify`) that the relay is ready.
pub(crate) fn notify_ready() {
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
}

/// Tells systemd that the relay is stopping.
pub(crate) fn notify_stopping() {
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
}

/// The systemd watchdog interval, when one is set (`WatchdogSec=`).
pub(crate) fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled()
}

/// Pings the systemd watchdog while the relay is alive.
pub(crate) async fn watchdog(ops: Arc<Ops>, interval: Duration, stop: CancellationToken) {
    let period = interval / 2;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        match ops.health.liveness() {
            Ok(()) => {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
            }
            Err(reason) => tracing::error!(%reason, "Not pinging the systemd watchdog"),
        }
    }
}
