//! The tasks that outlive the workers (the HTTP server, the probe, each table's floor
//! keeper and retention, the pause, connection and availability followers, drain's
//! progress line, the systemd watchdog): spawned by name on one [`TaskTracker`], all
//! stopped by one `done` token, and awaited when the run ends, within a deadline. The ones
//! still running then are named (a WARN, and the run's [`super::Report::unstopped`]) and
//! left behind: the process exits anyway, as it did before they were awaited.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A set of named tasks: the background tasks of one run.
#[derive(Debug, Default)]
pub(crate) struct TaskSet {
    tracker: TaskTracker,
    /// The tasks still running, by a number of their own (two may share a name).
    running: Arc<Mutex<BTreeMap<u64, String>>>,
    next: std::sync::atomic::AtomicU64,
}

/// A task's entry on the running list: dropped, so taken off, when the task ends,
/// returned or panicked.
struct RunningEntry {
    running: Arc<Mutex<BTreeMap<u64, String>>>,
    id: u64,
}

impl Drop for RunningEntry {
    fn drop(&mut self) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        running.remove(&self.id);
    }
}

impl TaskSet {
    /// Runs `task` as `name` until it returns; it must return soon after `done` fires.
    pub(crate) fn spawn(
        &self,
        name: impl Into<String>,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        running.insert(id, name.into());
        let entry = RunningEntry {
            running: self.running.clone(),
            id,
        };
        self.tracker.spawn(async move {
            let _entry = entry;
            task.await
        });
    }

    /// Fires `done` and waits `within` at most for every task to return; returns the names
    /// of those that did not, after a WARN naming them.
    pub(crate) async fn stop(&self, done: &CancellationToken, within: Duration) -> Vec<String> {
        done.cancel();
        self.tracker.close();
        if tokio::time::timeout(within, self.tracker.wait())
            .await
            .is_ok()
        {
            return Vec::new();
        }
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let left: Vec<String> = running.values().cloned().collect();
        tracing::warn!(tasks = ?left, ?within, "TaskSet tasks did not stop in time; exiting anyway");
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn tasks_that_stop_at_done_are_awaited_and_none_is_named() {
        let (tasks, done) = (TaskSet::default(), CancellationToken::new());
        let stopped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for name in ["probe", "watchdog"] {
            let (done, stopped) = (done.clone(), stopped.clone());
            tasks.spawn(name, async move {
                done.cancelled().await;
                tokio::time::sleep(Duration::from_millis(10)).await;
                stopped.store(true, std::sync::atomic::Ordering::Relaxed);
            });
        }
        assert!(tasks.stop(&done, Duration::from_secs(1)).await.is_empty());
        assert!(
            stopped.load(std::sync::atomic::Ordering::Relaxed),
            "awaited, not dropped"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_does_not_stop_by_the_deadline_is_named() {
        let (tasks, done) = (TaskSet::default(), CancellationToken::new());
        let d = done.clone();
        tasks.spawn("probe", async move { d.cancelled().await });
        tasks.spawn("floor keeper public.outbox", async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        });
        let started = tokio::time::Instant::now();
        let left = tasks.stop(&done, Duration::from_secs(1)).await;
        assert_eq!(left, ["floor keeper public.outbox"]);
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(1),
            "waited the deadline, no more"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_panicked_is_not_named() {
        let (tasks, done) = (TaskSet::default(), CancellationToken::new());
        tasks.spawn("progress", async { panic!("drawn off the edge") });
        tokio::task::yield_now().await;
        assert!(tasks.stop(&done, Duration::from_secs(1)).await.is_empty());
    }
}
