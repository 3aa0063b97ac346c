//! The bad-row valve: when a destination goes away under a table (a stream or topic
//! deleted, a publish permission revoked, a bad deploy of the writing service), every row
//! fails for its own sake, and without the valve the relay would dead-letter the whole
//! table row after row. With `relay.pause_after_bad_rows = N` and `relay.bad_row_window =
//! W`, once N rows of a table failed for their own sake within W in this process, and they
//! were most of its attempts there, the relay pauses the table for every relay, as
//! `outbox-relay pause` would, and says what to check and how to resume.
//!
//! Each relay counts what it sees itself (no write per batch to share counts): with R
//! relays sharing a failing table evenly, the first of them reaches N after about R x N
//! failures in all, and its pause stops every relay. Rows that failed before keep their
//! attempts; nothing is lost; `requeue` and `resume` bring everything back.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One table's recent outcomes in this process.
#[derive(Default)]
struct Window {
    /// (when, rows failed for their own sake, rows published), one entry per batch.
    batches: VecDeque<(Instant, usize, usize)>,
    failed: usize,
    published: usize,
}

/// The valve of every table of this process.
pub(crate) struct Valve {
    threshold: usize,
    window: Duration,
    tables: Vec<Mutex<Window>>,
}

impl Valve {
    /// `None` when the valve is off (`pause_after_bad_rows = 0`).
    pub(crate) fn new(setting: Option<(u32, Duration)>, tables: usize) -> Option<Valve> {
        let (threshold, window) = setting?;
        Some(Valve {
            threshold: threshold as usize,
            window,
            tables: (0..tables).map(|_| Mutex::default()).collect(),
        })
    }

    /// Counts one batch of table `t`: whether the table should pause now, with how many
    /// rows failed within the window. The count starts again after a trip.
    pub(crate) fn trips(
        &self,
        t: usize,
        failed: usize,
        published: usize,
        now: Instant,
    ) -> Option<usize> {
        let mut w = self.tables[t].lock().unwrap_or_else(|e| e.into_inner());
        while let Some(&(at, f, p)) = w.batches.front() {
            if now.duration_since(at) <= self.window {
                break;
            }
            w.batches.pop_front();
            w.failed -= f;
            w.published -= p;
        }
        if failed + published == 0 {
            return None;
        }
        w.batches.push_back((now, failed, published));
        w.failed += failed;
        w.published += published;
        // Most of its attempts: more failed than published.
        if w.failed >= self.threshold && w.failed > w.published {
            let n = w.failed;
            *w = Window::default();
            return Some(n);
        }
        None
    }

    /// The window, for the messages.
    pub(crate) fn window(&self) -> Duration {
        self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_at_the_threshold_when_most_attempts_failed() {
        let valve = Valve::new(Some((100, Duration::from_secs(60))), 1).unwrap();
        let t0 = Instant::now();
        assert_eq!(valve.trips(0, 60, 0, t0), None);
        assert_eq!(valve.trips(0, 40, 10, t0), Some(100));
        // Counted afresh after a trip.
        assert_eq!(valve.trips(0, 99, 0, t0), None);
    }

    #[test]
    fn does_not_trip_while_most_rows_are_published() {
        let valve = Valve::new(Some((100, Duration::from_secs(60))), 1).unwrap();
        let t0 = Instant::now();
        assert_eq!(valve.trips(0, 150, 500, t0), None);
    }

    #[test]
    fn failures_older_than_the_window_do_not_count() {
        let valve = Valve::new(Some((100, Duration::from_secs(60))), 1).unwrap();
        let t0 = Instant::now();
        assert_eq!(valve.trips(0, 90, 0, t0), None);
        let later = t0 + Duration::from_secs(61);
        assert_eq!(valve.trips(0, 20, 0, later), None);
        assert_eq!(valve.trips(0, 80, 0, later), Some(100));
    }

    #[test]
    fn off_when_the_threshold_is_zero() {
        assert!(Valve::new(None, 1).is_none());
    }
}
