//! Tests that must have the machine to themselves, in a binary whose tests run side by
//! side: [`alone`] waits until no other test holds a [`Shared`] guard and keeps new ones
//! out until it is dropped. [`Env`](super::Env) and [`kafka_outbox`](super::kafka_outbox)
//! take a [`Shared`] guard for their test, so a test started on them waits meanwhile.
//!
//! (When each test file was its own binary, a file's tests ran beside each other only;
//! `nats_cluster`, which measures a stall, ran its two tests one after the other and so
//! alone. In one binary it needs this.)

use std::cell::Cell;
use std::sync::{Condvar, Mutex};

/// Tests holding a [`Shared`] guard, and whether one holds an [`Alone`] guard.
static STATE: Mutex<(usize, bool)> = Mutex::new((0, false));
static CHANGED: Condvar = Condvar::new();

thread_local! {
    /// Whether this thread's test holds an [`Alone`] guard (its own [`Env`] then needs no
    /// [`Shared`] one: it would wait for itself).
    ///
    /// [`Env`]: super::Env
    static ALONE_HERE: Cell<bool> = const { Cell::new(false) };
}

fn state() -> std::sync::MutexGuard<'static, (usize, bool)> {
    // A test that panicked while holding the lock changed nothing half-way.
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Held by a test that may run beside others; `None` in a test that runs [`alone`].
pub struct Shared(());

/// Waits while a test runs [`alone`], then counts this one in until the guard drops.
pub fn shared() -> Option<Shared> {
    if ALONE_HERE.get() {
        return None;
    }
    let mut s = CHANGED
        .wait_while(state(), |(_, alone)| *alone)
        .unwrap_or_else(|e| e.into_inner());
    s.0 += 1;
    Some(Shared(()))
}

impl Drop for Shared {
    fn drop(&mut self) {
        state().0 -= 1;
        CHANGED.notify_all();
    }
}

/// Held by a test that has the machine to itself: see the module doc.
pub struct Alone(());

/// Waits until no other test holds a [`Shared`] or [`Alone`] guard; until the guard drops,
/// new ones wait. (A test started on neither may still run beside it.)
pub fn alone() -> Alone {
    let mut s = CHANGED
        .wait_while(state(), |(shared, alone)| *shared > 0 || *alone)
        .unwrap_or_else(|e| e.into_inner());
    s.1 = true;
    ALONE_HERE.set(true);
    Alone(())
}

impl Drop for Alone {
    fn drop(&mut self) {
        ALONE_HERE.set(false);
        state().1 = false;
        CHANGED.notify_all();
    }
}
