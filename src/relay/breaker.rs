//! The circuit breaker between the workers and the broker.
//!
//! While the broker is down, claiming rows only to watch every publish time out churns
//! row locks, holds transactions open for the publish timeout and floods the log. So
//! after [`THRESHOLD`] batches in a row fail for the broker's sake (transient errors, no
//! row acknowledged), the circuit *opens*: workers stop claiming and wait. One prober
//! asks the broker whether it is back ([`Sink::healthcheck`]: a NATS round trip, a Kafka
//! metadata request) at capped, jittered intervals. The first probe that succeeds
//! *closes* the circuit and every waiting worker claims again at once; if the broker is
//! still unwell, the next failed batches open it again.
//!
//! Bad rows never count: they are the row's fault, not the broker's.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::worker::Backoff;
use crate::ops::Health;
use crate::sink::Sink;

/// Consecutive failed batches that open the circuit.
pub const THRESHOLD: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Workers claim and publish.
    Closed,
    /// The broker looks down: workers wait, the prober probes.
    Open,
}

pub struct Breaker {
    state: watch::Sender<BreakerState>,
    /// Batches in a row that failed for the broker's sake.
    failures: AtomicU32,
    /// Times the circuit opened since start.
    opened: AtomicU64,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: watch::Sender::new(BreakerState::Closed),
            failures: AtomicU32::new(0),
            opened: AtomicU64::new(0),
        }
    }
}

impl Breaker {
    pub fn state(&self) -> BreakerState {
        *self.state.borrow()
    }

    /// How often the circuit opened since start.
    pub fn times_opened(&self) -> u64 {
        self.opened.load(Relaxed)
    }

    /// The broker acknowledged rows.
    pub fn record_success(&self) {
        self.failures.store(0, Relaxed);
    }

    /// A batch failed for the broker's sake, acknowledging nothing.
    pub fn record_failure(&self, error: &str) {
        let failures = self.failures.fetch_add(1, Relaxed) + 1;
        if failures < THRESHOLD {
            return;
        }
        let opened = self.state.send_if_modified(|state| {
            let was_closed = *state == BreakerState::Closed;
            *state = BreakerState::Open;
            was_closed
        });
        if opened {
            self.opened.fetch_add(1, Relaxed);
            tracing::warn!(
                %error,
                failed_batches = failures,
                "Broker unavailable: circuit open, no rows are claimed until a probe succeeds"
            );
        }
    }

    /// Waits until the circuit is closed; `false` when `stop` fired first.
    pub async fn wait_closed(&self, stop: &CancellationToken) -> bool {
        let mut rx = self.state.subscribe();
        tokio::select! {
            r = rx.wait_for(|s| *s == BreakerState::Closed) => r.is_ok(),
            _ = stop.cancelled() => false,
        }
    }

    /// Probes `sink` whenever the circuit is open, until `stop`. Each probe counts as a
    /// loop going round for liveness.
    pub async fn run_prober(&self, sink: &Sink, health: &Health, stop: CancellationToken) {
        let mut rx = self.state.subscribe();
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        loop {
            tokio::select! {
                r = rx.wait_for(|s| *s == BreakerState::Open) => if r.is_err() { return },
                _ = stop.cancelled() => return,
            }
            let pause = backoff.next_pause();
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.cancelled() => return,
            }
            health.alive();
            match sink.healthcheck().await {
                Ok(()) => {
                    self.failures.store(0, Relaxed);
                    self.state.send_replace(BreakerState::Closed);
                    backoff.reset();
                    tracing::info!("Broker reachable again: circuit closed, claiming resumes");
                }
                Err(e) => tracing::debug!(error = %e.message, "Broker still unreachable"),
            }
        }
    }
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
}
