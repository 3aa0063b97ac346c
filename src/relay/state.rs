//! What a run keeps track of while it runs: whether a worker is inside a batch, how the
//! run is ending (drained, aborted, a fatal error) and what it achieved so far.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

use super::TableFailed;

/// The run's flags and counters, shared by the workers and read for the report.
#[derive(Default)]
pub(crate) struct RunState {
    /// Workers with claimed rows in flight (claim returned rows, to commit or rollback).
    active: AtomicUsize,
    /// `drain` found nothing publishable left.
    drained: AtomicBool,
    /// The deadline cut batches short: they rolled back.
    aborted: AtomicBool,
    /// The first error that stopped the run.
    fatal: Mutex<Option<TableFailed>>,
    published: AtomicU64,
    failed: AtomicU64,
    dead: AtomicU64,
}

/// Totals of a run so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub(crate) published: u64,
    pub(crate) failed: u64,
    pub(crate) dead: u64,
}

impl RunState {
    /// Counts the caller as inside a batch until the guard is dropped.
    pub(crate) fn enter_batch(&self) -> ActiveGuard<'_> {
        self.active.fetch_add(1, Relaxed);
        ActiveGuard(&self.active)
    }

    /// No worker is inside a batch.
    pub(crate) fn idle(&self) -> bool {
        self.active.load(Relaxed) == 0
    }

    /// Adds one committed batch's rows.
    pub(crate) fn count(&self, published: usize, failed: usize, dead: usize) {
        self.published.fetch_add(published as u64, Relaxed);
        self.failed.fetch_add(failed as u64, Relaxed);
        self.dead.fetch_add(dead as u64, Relaxed);
    }

    pub(crate) fn totals(&self) -> Totals {
        Totals {
            published: self.published.load(Relaxed),
            failed: self.failed.load(Relaxed),
            dead: self.dead.load(Relaxed),
        }
    }

    /// The counter of published rows (for the progress line and the probe).
    pub(crate) fn published(&self) -> &AtomicU64 {
        &self.published
    }

    pub(crate) fn set_drained(&self, drained: bool) {
        self.drained.store(drained, Relaxed);
    }

    pub(crate) fn drained(&self) -> bool {
        self.drained.load(Relaxed)
    }

    pub(crate) fn set_aborted(&self) {
        self.aborted.store(true, Relaxed);
    }

    pub(crate) fn aborted(&self) -> bool {
        self.aborted.load(Relaxed)
    }

    /// Keeps the first fatal error; later ones are consequences.
    pub(crate) fn record_fatal(&self, failed: TableFailed) {
        self.fatal.lock().unwrap().get_or_insert(failed);
    }

    pub(crate) fn take_fatal(&self) -> Option<TableFailed> {
        self.fatal.lock().unwrap().take()
    }
}

/// Counts a worker as inside a batch, for drain detection, until dropped.
pub(crate) struct ActiveGuard<'a>(&'a AtomicUsize);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_counts_as_active_until_its_guard_drops_however_it_ends() {
        let state = RunState::default();
        assert!(state.idle());
        let a = state.enter_batch();
        let b = state.enter_batch();
        drop(a);
        assert!(!state.idle());
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _moved = b;
            panic!("a batch that panics");
        }));
        assert!(unwound.is_err());
        assert!(state.idle());
    }

    #[test]
    fn the_first_fatal_error_is_the_one_reported() {
        use crate::relay::batch::BatchError;
        use crate::sink::SinkError;
        use crate::source::SourceError;

        let state = RunState::default();
        let denied = SourceError::Schema("permission denied for table outbox".into());
        state.record_fatal(TableFailed::new(
            "public.outbox".into(),
            BatchError::Source(denied),
        ));
        let closed = SinkError::fatal("connection closed");
        state.record_fatal(TableFailed::new(
            "public.other".into(),
            BatchError::Sink(closed),
        ));
        let kept = state.take_fatal().expect("a fatal error");
        assert_eq!(kept.table(), "public.outbox");
        assert_eq!(
            kept.to_string(),
            "table public.outbox: permission denied for table outbox"
        );
        let source = std::error::Error::source(&kept).expect("its source");
        assert!(source.downcast_ref::<SourceError>().is_some());
    }
}
