//! Shutdown: signals feed a two-level cancellation-token tree.
//!
//! ```text
//! abort  (deadline reached, or a second signal): roll back what is not acknowledged
//!   └── stop  (first SIGTERM/SIGINT, drain done, drain --timeout, fatal error):
//!             stop claiming, let in-flight batches finish
//! ```
//!
//! A relay whose tables are found by pattern runs its workers in generations
//! ([`Shutdown::generation`]): each generation's `stop` is a child of the run's, cancelled
//! alone ([`Shutdown::end_generation`]) when the set of tables changes, so the workers
//! finish their batches and a new generation starts with the new set.
//!
//! Cancelling `abort` cancels `stop` too. Workers race only their idle wait and their claim
//! against `stop`; publish -> ack -> mark -> commit runs to its end or to `abort`.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The relay's shutdown state; cheap to clone, shared by every task.
#[derive(Debug, Clone)]
pub struct Shutdown {
    abort: CancellationToken,
    stop: CancellationToken,
    /// The run's `stop`: `stop` itself, or for a generation its parent.
    run: CancellationToken,
    /// Made by [`Shutdown::generation`].
    generation: bool,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Shutdown {
        let abort = CancellationToken::new();
        let stop = abort.child_token();
        Shutdown {
            abort,
            run: stop.clone(),
            stop,
            generation: false,
        }
    }

    /// A generation of the run's workers: its `stop` fires with the run's, or alone at
    /// [`Shutdown::end_generation`]; `abort` and [`Shutdown::request_stop`] are the run's.
    pub(crate) fn generation(&self) -> Shutdown {
        Shutdown {
            abort: self.abort.clone(),
            stop: self.run.child_token(),
            run: self.run.clone(),
            generation: true,
        }
    }

    /// Ends this generation only: its workers stop claiming and finish their batches.
    /// Nothing for a run without generations.
    pub(crate) fn end_generation(&self) {
        if self.generation {
            self.stop.cancel();
        }
    }

    /// Cancelled when the whole run should stop claiming (not at a generation's end).
    pub(crate) fn run_stop_token(&self) -> &CancellationToken {
        &self.run
    }

    /// Cancelled when the relay should stop claiming.
    pub(crate) fn stop_token(&self) -> &CancellationToken {
        &self.stop
    }

    /// Cancelled when in-flight work must be rolled back now.
    pub(crate) fn abort_token(&self) -> &CancellationToken {
        &self.abort
    }

    /// First signal: stop claiming, drain what is in flight.
    pub fn request_stop(&self) {
        self.run.cancel();
        self.stop.cancel();
    }

    /// Deadline or second signal: give up on in-flight work.
    pub fn abort(&self) {
        self.abort.cancel();
    }

    /// Starts the drain clock: `deadline` after the stop request, abort. Needs a runtime.
    pub(crate) fn arm_deadline(&self, deadline: Duration) {
        let this = self.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = this.stop.cancelled() => {}
                _ = this.abort.cancelled() => return,
            }
            tokio::select! {
                _ = tokio::time::sleep(deadline) => {
                    tracing::warn!(?deadline, "Drain deadline reached; rolling back unacknowledged rows");
                    this.abort.cancel();
                }
                _ = this.abort.cancelled() => {}
            }
        });
    }

    /// Routes SIGTERM and SIGINT here: the first requests a stop, the second aborts.
    /// The handler thread lives for the rest of the process.
    pub fn install_signal_handlers(&self) -> std::io::Result<()> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])?;
        let this = self.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    if this.stop.is_cancelled() {
                        tracing::warn!(signal, "Second signal; aborting in-flight batches");
                        this.abort.cancel();
                    } else {
                        tracing::info!(signal, "Signal received; finishing in-flight batches");
                        this.stop.cancel();
                    }
                }
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn abort_follows_stop_after_the_deadline() {
        let s = Shutdown::new();
        s.arm_deadline(Duration::from_secs(25));
        s.request_stop();
        assert!(s.stop_token().is_cancelled());
        assert!(!s.abort_token().is_cancelled());
        tokio::time::sleep(Duration::from_secs(26)).await;
        assert!(s.abort_token().is_cancelled());
    }

    #[test]
    fn a_generation_ends_alone_and_stops_with_the_run() {
        let s = Shutdown::new();
        s.end_generation();
        assert!(!s.stop_token().is_cancelled());
        let first = s.generation();
        first.end_generation();
        assert!(first.stop_token().is_cancelled());
        assert!(!s.stop_token().is_cancelled());
        let second = s.generation();
        second.request_stop();
        assert!(s.stop_token().is_cancelled() && second.stop_token().is_cancelled());
        assert!(s.generation().stop_token().is_cancelled());
    }

    #[test]
    fn abort_implies_stop() {
        let s = Shutdown::new();
        s.abort();
        assert!(s.stop_token().is_cancelled());
    }
}
