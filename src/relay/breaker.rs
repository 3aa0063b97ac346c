//! The circuit breaker between the workers and the broker.
//!
//! While the broker is down, claiming rows only to watch every publish time out churns
//! row locks, holds transactions open for the publish timeout and floods the log. So the
//! circuit *opens* when the broker itself is unwell:
//! - [`THRESHOLD`] batches in a row failed for the broker's sake (transient errors, no row
//!   acknowledged), or
//! - the client reports the connection lost ([`Breaker::trip`], NATS), at once.
//!
//! While it is open, workers do not claim. One prober asks the broker whether it is back
//! ([`Sink::healthcheck`]: a JetStream round trip, a Kafka metadata request) after a pause
//! from one [`Backoff`]. A successful probe *half-opens* the circuit: workers claim again,
//! and the first batch decides. If the broker acknowledges rows, the circuit is closed
//! for good and the backoff starts over. If the batch fails for the broker's sake again,
//! the circuit re-opens at once and the next probe waits longer: the breaker can never
//! cycle faster than its backoff, however a broker misbehaves. One WARN when an outage
//! begins, one INFO when it ends; the trials in between log at DEBUG.
//!
//! Bad rows never count: a row the broker refuses for itself (too large, a subject no
//! stream captures) is the row's fault, recorded against that row, never the broker's.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::ops::{Health, Ops};
use crate::retry::Backoff;
use crate::sink::Sink;

/// Consecutive failed batches that open the circuit.
pub(crate) const THRESHOLD: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BreakerState {
    /// Workers claim and publish.
    Closed,
    /// A probe succeeded after an outage: workers claim, and the next batch decides.
    HalfOpen,
    /// The broker looks down: workers wait, the prober probes.
    Open,
}

pub(crate) struct Breaker {
    state: watch::Sender<BreakerState>,
    /// Batches in a row that failed for the broker's sake.
    failures: AtomicU32,
    /// Times an outage began (Closed -> Open) since start.
    opened: AtomicU64,
    /// The prober's pauses: grows across half-open trials, reset when rows flow again.
    backoff: Mutex<Backoff>,
    /// When the circuit last went half-open.
    half_open_at: Mutex<Option<std::time::Instant>>,
}

/// A half-open circuit that no batch failed for this long counts as recovered (an idle
/// relay has no batch to close it): the next failure begins a new outage.
pub(crate) const HALF_OPEN_SETTLES: Duration = Duration::from_secs(10);

/// The prober's first pause once the circuit opens: a broker that blinked is back in it.
const PROBE_FIRST: Duration = Duration::from_millis(200);
/// Its longest pause: a broker that comes back is probed, and the workers released, within
/// it, while one that stays down is asked only this often.
const PROBE_MAX: Duration = Duration::from_secs(5);

impl Default for Breaker {
    fn default() -> Self {
        Breaker::new(PROBE_FIRST, PROBE_MAX)
    }
}

impl Breaker {
    /// A closed breaker whose prober pauses `base`, doubling to `cap`.
    pub(crate) fn new(base: Duration, cap: Duration) -> Breaker {
        Breaker {
            state: watch::Sender::new(BreakerState::Closed),
            failures: AtomicU32::new(0),
            opened: AtomicU64::new(0),
            backoff: Mutex::new(Backoff::new(base, cap)),
            half_open_at: Mutex::new(None),
        }
    }

    pub(crate) fn state(&self) -> BreakerState {
        *self.state.borrow()
    }

    /// How many outages began since start.
    pub(crate) fn times_opened(&self) -> u64 {
        self.opened.load(Relaxed)
    }

    /// The broker acknowledged rows: a half-open circuit closes, the backoff starts over.
    pub(crate) fn record_success(&self) {
        self.failures.store(0, Relaxed);
        let closed = self.state.send_if_modified(|state| {
            let half_open = *state == BreakerState::HalfOpen;
            if half_open {
                *state = BreakerState::Closed;
            }
            half_open
        });
        if closed {
            self.backoff.lock().unwrap().reset();
            tracing::info!("Broker acknowledges rows again: circuit closed");
        }
    }

    /// A batch failed for the broker's sake, acknowledging nothing.
    pub(crate) fn record_failure(&self, error: &str) {
        let failures = self.failures.fetch_add(1, Relaxed) + 1;
        let trial_failed = self.state() == BreakerState::HalfOpen;
        if failures >= THRESHOLD || trial_failed {
            self.open(error);
        }
    }

    /// The client reports the connection lost: open now, without waiting for batches to
    /// time out.
    pub(crate) fn trip(&self, reason: &str) {
        self.open(reason);
    }

    fn open(&self, error: &str) {
        let mut before = self.state.send_replace(BreakerState::Open);
        let settled = self
            .half_open_at
            .lock()
            .unwrap()
            .is_some_and(|at| at.elapsed() >= HALF_OPEN_SETTLES);
        if before == BreakerState::HalfOpen && settled {
            self.backoff.lock().unwrap().reset();
            before = BreakerState::Closed;
        }
        match before {
            BreakerState::Closed => {
                self.opened.fetch_add(1, Relaxed);
                tracing::warn!(
                    %error,
                    "Broker unavailable: circuit open, no rows are claimed until it answers again"
                );
            }
            BreakerState::HalfOpen => {
                tracing::debug!(%error, "Broker still failing: circuit open again");
            }
            BreakerState::Open => {}
        }
    }

    /// Waits until workers may claim; `false` when `stop` fired first.
    pub(crate) async fn wait_closed(&self, stop: &CancellationToken) -> bool {
        let mut rx = self.state.subscribe();
        tokio::select! {
            r = rx.wait_for(|s| *s != BreakerState::Open) => r.is_ok(),
            _ = stop.cancelled() => false,
        }
    }

    /// Probes `sink` whenever the circuit is open, until `stop`. Each probe counts as a
    /// loop going round for liveness.
    pub(crate) async fn run_prober(&self, sink: &Sink, health: &Health, stop: CancellationToken) {
        let mut rx = self.state.subscribe();
        loop {
            tokio::select! {
                r = rx.wait_for(|s| *s == BreakerState::Open) => if r.is_err() { return },
                _ = stop.cancelled() => return,
            }
            let pause = self.backoff.lock().unwrap().next_pause();
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                // The client reconnected: no reason to wait out the pause.
                _ = reconnected(sink) => {}
                _ = stop.cancelled() => return,
            }
            health.alive();
            match sink.healthcheck().await {
                Ok(()) => {
                    self.failures.store(0, Relaxed);
                    *self.half_open_at.lock().unwrap() = Some(std::time::Instant::now());
                    self.state.send_if_modified(|state| {
                        let open = *state == BreakerState::Open;
                        if open {
                            *state = BreakerState::HalfOpen;
                        }
                        open
                    });
                    tracing::debug!(after = ?pause, "Broker answers: circuit half-open, trying a batch");
                }
                Err(e) => tracing::debug!(error = %e.message(), "Broker still unreachable"),
            }
        }
    }
}

impl Breaker {
    /// Follows the broker connection (clients that report it: NATS) until `done`: the
    /// moment it is lost, readiness says so and the circuit opens, so no worker claims rows
    /// it cannot publish.
    pub(crate) async fn follow_connection(
        &self,
        ops: &Ops,
        mut connection: watch::Receiver<bool>,
        done: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = done.cancelled() => return,
                r = connection.wait_for(|up| !*up) => if r.is_err() { return },
            }
            ops.broker_reachable(false);
            self.trip("connection to the broker lost");
            tokio::select! {
                _ = done.cancelled() => return,
                r = connection.wait_for(|up| *up) => if r.is_err() { return },
            }
        }
    }
}

/// Resolves once the sink's client reports a connection after having lost it; never for
/// sinks that do not tell.
async fn reconnected(sink: &Sink) {
    if let Some(mut connection) = sink.connection() {
        if connection.wait_for(|up| !*up).await.is_ok()
            && connection.wait_for(|up| *up).await.is_ok()
        {
            return;
        }
    }
    std::future::pending::<()>().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_and_success_resets_the_count() {
        let b = Breaker::default();
        b.record_failure("x");
        b.record_success();
        b.record_failure("x");
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "failures must be consecutive"
        );
        b.record_failure("x");
        assert_eq!(b.state(), BreakerState::Open);
        b.record_failure("x");
        assert_eq!(b.times_opened(), 1);
    }

    #[test]
    fn a_lost_connection_opens_at_once() {
        let b = Breaker::default();
        b.trip("connection lost");
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.times_opened(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_breaker_never_cycles_faster_than_its_backoff() {
        // A broker that answers every probe but fails every batch: each trial re-opens
        // the circuit, and the probe pauses keep growing instead of starting over.
        let b = std::sync::Arc::new(Breaker::new(
            Duration::from_millis(100),
            Duration::from_secs(10),
        ));
        let sink = std::sync::Arc::new(Sink::Memory(crate::sink::memory::MemorySink::default()));
        let health = std::sync::Arc::new(Health::new(Duration::from_millis(100)));
        let stop = CancellationToken::new();
        let prober = {
            let (b, sink, health, stop) = (b.clone(), sink.clone(), health.clone(), stop.clone());
            tokio::spawn(async move { b.run_prober(&sink, &health, stop).await })
        };
        b.trip("down");
        let mut rx = b.state.subscribe();
        let start = tokio::time::Instant::now();
        let mut trials = 0;
        while start.elapsed() < Duration::from_secs(60) {
            rx.wait_for(|s| *s == BreakerState::HalfOpen).await.unwrap();
            trials += 1;
            b.record_failure("still failing");
            assert_eq!(b.state(), BreakerState::Open, "a failed trial re-opens");
        }
        stop.cancel();
        prober.await.unwrap();
        // Pauses drawn under 0.1, 0.2, 0.4 ... 10 s ceilings (full jitter, at least 10 ms):
        // a flapping breaker would go round thousands of times in 60 s.
        assert!(trials < 60, "{trials} trials in 60 s");
        assert_eq!(b.times_opened(), 1, "one outage, one WARN");
    }

    #[test]
    fn rows_acknowledged_in_a_trial_close_the_circuit_and_reset_the_backoff() {
        let b = Breaker::default();
        b.trip("down");
        for _ in 0..5 {
            b.backoff.lock().unwrap().next_pause();
        }
        b.state.send_replace(BreakerState::HalfOpen);
        b.record_success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(
            b.backoff.lock().unwrap().next_ceiling(),
            Duration::from_millis(200)
        );
    }
}
