//! Which tables a worker claims from, and when: an idle table costs next to nothing.
//!
//! Rules (`run`; a `drain` looks at every table in every round, as it must end):
//!
//! 1. A table is *due* after something says it may have rows: a NOTIFY naming it, the
//!    LISTEN connection (re)subscribing (rows may have committed unheard), a batch of it
//!    that published rows (there may be more) or failed before it knew (a claim that
//!    timed out finds out nothing), its floor lowered by the sweep, or a retry
//!    this process scheduled coming due.
//! 2. A claim that finds nothing settles the table, but only for what was raised before
//!    the claim began: a NOTIFY during the claim keeps it due (a counter, not a flag).
//! 3. A table that is not due is still claimed from every [`IDLE_RECHECK`]. One NOTIFY
//!    does not cover (no trigger, or LISTEN not subscribed: behind PgBouncer without
//!    `listen_url`) is also *polled* every `relay.poll_interval`: one statement a poll for
//!    every such table of the process ([`crate::source::sql::TableSql::claimable`]),
//!    which makes a table with a claimable row due and settles the others as a claim
//!    that found nothing would (rule 2). Polled by a claim each, 50 tables cost 546
//!    transactions a second at the default 100 ms (benchmark I); polled together, one
//!    statement per interval for all of them.
//! 4. The floor keeper ([`crate::source::floor`]) ticks only while the table was active in
//!    the last [`ACTIVE_FOR`]; an idle table's keeper looks every few seconds.
//! 5. A paused table ([`crate::source::pause`]) is never due, in `drain` too; its resume
//!    raises it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// How often a table that NOTIFY covers is looked at anyway when nothing raised it: a
/// row inserted with the trigger disabled, a retry scheduled by a relay that died.
pub(crate) const IDLE_RECHECK: Duration = Duration::from_secs(5);
/// How long a table counts as active after its last sign of rows.
pub(crate) const ACTIVE_FOR: Duration = Duration::from_secs(2);

/// The wake state of every table, and the signal idle workers wait on.
pub(crate) struct Wakes {
    tables: Vec<TableWake>,
    /// Idle workers wait on this.
    pub(crate) workers: Notify,
    /// LISTEN is subscribed now.
    listening: AtomicBool,
    poll_interval: Duration,
    /// `drain`: every table is always due.
    always: bool,
}

struct TableWake {
    name: String,
    /// The table has the NOTIFY trigger.
    trigger: bool,
    raised: AtomicU64,
    settled: AtomicU64,
    /// When the table is looked at again if nothing raises it.
    next_check: Mutex<Instant>,
    /// The soonest retry this process scheduled and has not looked for yet.
    retry_at: Mutex<Option<Instant>>,
    last_active: Mutex<Instant>,
    /// Pokes the table's floor keeper out of its idle wait.
    keeper: Notify,
    /// Paused for every relay (rule 5).
    paused: AtomicBool,
}

/// A ticket from [`Wakes::begin`]: what a claim saw raised when it began.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket(u64);

impl Wakes {
    /// `tables`: each table's qualified name as NOTIFY sends it (`schema.table`) and
    /// whether it has the trigger.
    pub(crate) fn new(tables: Vec<(String, bool)>, poll_interval: Duration, always: bool) -> Wakes {
        let now = Instant::now();
        Wakes {
            tables: tables
                .into_iter()
                .map(|(name, trigger)| TableWake {
                    name,
                    trigger,
                    // Every table starts due: rows may be waiting.
                    raised: AtomicU64::new(1),
                    settled: AtomicU64::new(0),
                    next_check: Mutex::new(now),
                    retry_at: Mutex::new(None),
                    last_active: Mutex::new(now),
                    keeper: Notify::new(),
                    paused: AtomicBool::new(false),
                })
                .collect(),
            workers: Notify::new(),
            listening: AtomicBool::new(false),
            poll_interval,
            always,
        }
    }

    /// Rule 1: table `t` may have rows; idle workers are woken when `wake_workers`.
    pub(crate) fn raise(&self, t: usize, wake_workers: bool) {
        let table = &self.tables[t];
        table.raised.fetch_add(1, Ordering::AcqRel);
        *table.last_active.lock().unwrap() = Instant::now();
        table.keeper.notify_waiters();
        if wake_workers {
            self.workers.notify_waiters();
        }
    }

    /// Every table may have rows (LISTEN (re)subscribed, or a NOTIFY naming no table this
    /// relay knows... see [`Wakes::rows_committed`]).
    pub(crate) fn raise_all(&self) {
        for t in 0..self.tables.len() {
            self.raise(t, false);
        }
        self.workers.notify_waiters();
    }

    /// A NOTIFY with `payload` (`schema.table`) arrived.
    pub(crate) fn rows_committed(&self, payload: &str) {
        if let Some(t) = self.tables.iter().position(|t| t.name == payload) {
            self.raise(t, true);
        }
    }

    /// LISTEN subscribed (`true`) or lost its connection (`false`).
    pub(crate) fn set_listening(&self, on: bool) {
        self.listening.store(on, Ordering::Release);
        if on {
            self.raise_all();
        }
    }

    /// Whether a worker should claim from table `t` now (rules 1 and 3); if so, the
    /// ticket to hand back with what the claim found.
    pub(crate) fn begin(&self, t: usize, now: Instant) -> Option<Ticket> {
        let table = &self.tables[t];
        if table.paused.load(Ordering::Acquire) {
            return None;
        }
        let raised = table.raised.load(Ordering::Acquire);
        if self.always || raised > table.settled.load(Ordering::Acquire) {
            return Some(Ticket(raised));
        }
        {
            let mut retry = table.retry_at.lock().unwrap();
            if retry.is_some_and(|at| at <= now) {
                *retry = None;
                return Some(Ticket(raised));
            }
        }
        let mut next = table.next_check.lock().unwrap();
        if now < *next {
            return None;
        }
        *next = now + IDLE_RECHECK;
        Some(Ticket(raised))
    }

    /// A claim of table `t` with `ticket` found nothing (rule 2); the table is looked at
    /// again at its next recheck unless something raises it first.
    pub(crate) fn found_nothing(&self, t: usize, ticket: Ticket) {
        let table = &self.tables[t];
        table.settled.fetch_max(ticket.0, Ordering::AcqRel);
        let mut next = table.next_check.lock().unwrap();
        *next = (*next).max(Instant::now() + IDLE_RECHECK);
    }

    /// This process scheduled a retry of a row of table `t` `after` from now.
    pub(crate) fn retry_in(&self, t: usize, after: Duration) {
        let at = Instant::now() + after;
        let mut retry = self.tables[t].retry_at.lock().unwrap();
        *retry = Some(retry.map_or(at, |r| r.min(at)));
    }

    /// Rule 3's poll: a ticket for each table the poller asks about now (NOTIFY does not
    /// cover it and it is not paused), `None` for the others; all `None` in `drain`,
    /// which claims from every table in every round.
    pub(crate) fn poll_tickets(&self) -> Vec<Option<Ticket>> {
        let listening = self.listening.load(Ordering::Acquire);
        self.tables
            .iter()
            .map(|table| {
                let notified = table.trigger && listening;
                let skip = self.always || notified || table.paused.load(Ordering::Acquire);
                (!skip).then(|| Ticket(table.raised.load(Ordering::Acquire)))
            })
            .collect()
    }

    /// The poll's answer for table `t`, asked with `ticket`: a claimable row makes the
    /// table due and wakes the workers; none settles what was raised before the poll
    /// began (rule 2: the poll's snapshot saw every row committed by then).
    pub(crate) fn polled(&self, t: usize, ticket: Ticket, rows: bool) {
        if rows {
            self.raise(t, true);
        } else {
            self.tables[t].settled.fetch_max(ticket.0, Ordering::AcqRel);
        }
    }

    /// When the earliest table that is not due is looked at again.
    pub(crate) fn next_check(&self) -> Instant {
        self.tables
            .iter()
            .flat_map(|t| {
                [
                    Some(*t.next_check.lock().unwrap()),
                    *t.retry_at.lock().unwrap(),
                ]
            })
            .flatten()
            .min()
            .unwrap_or_else(|| Instant::now() + self.poll_interval)
    }

    /// Rule 5: pauses or resumes table `t`; a resumed table is due at once and the idle
    /// workers hear of it. Returns whether that changed anything.
    pub(crate) fn set_paused(&self, t: usize, paused: bool) -> bool {
        let changed = self.tables[t].paused.swap(paused, Ordering::AcqRel) != paused;
        if changed && !paused {
            self.raise(t, true);
        }
        changed
    }

    /// Whether table `t` is paused.
    pub(crate) fn paused(&self, t: usize) -> bool {
        self.tables[t].paused.load(Ordering::Acquire)
    }

    /// Rule 4: whether table `t` showed signs of rows lately.
    pub(crate) fn active(&self, t: usize) -> bool {
        self.tables[t].last_active.lock().unwrap().elapsed() < ACTIVE_FOR
    }

    /// The notification table `t`'s floor keeper waits on while idle.
    pub(crate) fn keeper(&self, t: usize) -> &Notify {
        &self.tables[t].keeper
    }
}

/// Rule 3's poller (`run` only): every `interval`, while some table is not covered by
/// NOTIFY, asks in one statement which of them may hold a claimable row, and tells
/// `wakes`. A table whose floor lists stragglers counts as having rows (the statement
/// reads from the floor on). A poll that fails makes every table it asked about due: the
/// workers' claims meet the error and report it.
pub(crate) async fn poll(
    wakes: &Wakes,
    source: &crate::source::Source,
    tables: &[crate::source::table::TablePlan],
    interval: Duration,
    done: &tokio_util::sync::CancellationToken,
) {
    let sql = format!(
        "SELECT ARRAY[{}]::bool[]",
        tables
            .iter()
            .enumerate()
            .map(|(t, table)| table.sql.claimable(t + 1))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Polls start `interval` apart, however long each took: a row waits at most about one
    // interval for the poll that sees it.
    let mut every = tokio::time::interval(interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = every.tick() => {}
        }
        let tickets = wakes.poll_tickets();
        if tickets.iter().all(Option::is_none) {
            continue;
        }
        let views: Vec<_> = tables.iter().map(|t| t.floor.view()).collect();
        let floors: Vec<i64> = views.iter().map(|v| v.value).collect();
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = floors
            .iter()
            .map(|f| f as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        let asked = source.in_transaction(async |tx| {
            Ok(tx.query_one(&sql, &params).await?.get::<_, Vec<bool>>(0))
        });
        let found = tokio::select! {
            _ = done.cancelled() => return,
            found = asked => found,
        };
        for (t, ticket) in tickets.into_iter().enumerate() {
            let Some(ticket) = ticket else { continue };
            match &found {
                Ok(rows) => {
                    let rows =
                        rows.get(t).copied().unwrap_or(true) || !views[t].stragglers.is_empty();
                    wakes.polled(t, ticket, rows);
                }
                Err(_) => wakes.raise(t, true),
            }
        }
        if let Err(e) = found {
            tracing::debug!(error = %e, "Could not poll the tables NOTIFY does not cover");
        }
    }
}

impl crate::source::listen::Wake for Wakes {
    fn rows_committed(&self, payload: &str) {
        Wakes::rows_committed(self, payload);
    }

    fn listening(&self, on: bool) {
        self.set_listening(on);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wakes() -> Wakes {
        Wakes::new(
            vec![("public.a".into(), true), ("public.b".into(), false)],
            Duration::from_millis(100),
            false,
        )
    }

    #[test]
    fn a_table_stays_due_until_a_claim_that_began_after_its_last_raise_finds_nothing() {
        let w = wakes();
        let now = Instant::now();
        let ticket = w.begin(0, now).expect("due at start");
        w.rows_committed("public.a"); // a NOTIFY while the claim runs
        w.found_nothing(0, ticket);
        let ticket = w
            .begin(0, now)
            .expect("still due: the NOTIFY came after the claim began");
        w.found_nothing(0, ticket);
        assert!(w.begin(0, now).is_none(), "settled, and rechecked later");
    }

    #[test]
    fn an_idle_table_is_claimed_from_slowly_and_polled_only_where_notify_does_not_cover_it() {
        let w = wakes();
        let now = Instant::now();
        w.set_listening(true);
        for t in 0..2 {
            let ticket = w.begin(t, now).unwrap();
            w.found_nothing(t, ticket);
        }
        // Settled: the next claim waits for its recheck, with or without the trigger.
        let later = Instant::now() + Duration::from_millis(150);
        assert!(w.begin(0, later).is_none(), "a has the trigger: 5 s");
        assert!(
            w.begin(1, later).is_none(),
            "b has none: the poller looks at it"
        );
        assert!(w.begin(0, later + IDLE_RECHECK).is_some());
        assert!(w.begin(1, later + IDLE_RECHECK).is_some());
        // The poller asks about b only; about a too while LISTEN is down.
        let tickets = w.poll_tickets();
        assert!(tickets[0].is_none() && tickets[1].is_some());
        w.set_listening(false);
        assert!(w.poll_tickets().iter().all(Option::is_some));
    }

    #[test]
    fn a_poll_that_finds_rows_makes_the_table_due_and_one_that_finds_none_settles_it() {
        let w = wakes();
        let now = Instant::now();
        w.found_nothing(1, w.begin(1, now).unwrap());
        assert!(w.begin(1, now).is_none());
        let ticket = w.poll_tickets()[1].unwrap();
        w.polled(1, ticket, true);
        let claim = w.begin(1, now).expect("due: the poll saw a row");
        w.found_nothing(1, claim);
        // A NOTIFY-less raise (a batch that published) while a poll runs is not settled
        // by that poll's answer.
        let ticket = w.poll_tickets()[1].unwrap();
        w.raise(1, false);
        w.polled(1, ticket, false);
        assert!(w.begin(1, now).is_some(), "raised after the poll began");
        let ticket = w.poll_tickets()[1].unwrap();
        w.polled(1, ticket, false);
        assert!(
            w.begin(1, now).is_none(),
            "settled by a poll that found nothing"
        );
        // `drain` claims from every table in every round: nothing to poll.
        let drain = Wakes::new(
            vec![("public.b".into(), false)],
            Duration::from_millis(100),
            true,
        );
        assert!(drain.poll_tickets().iter().all(Option::is_none));
    }

    #[test]
    fn a_scheduled_retry_is_looked_for_when_due_whatever_the_recheck() {
        let w = wakes();
        w.set_listening(true);
        w.retry_in(0, Duration::from_millis(50));
        let now = Instant::now();
        w.found_nothing(0, w.begin(0, now).unwrap());
        assert!(w.begin(0, now).is_none());
        assert!(w.next_check() <= now + Duration::from_millis(60));
        let due = now + Duration::from_millis(60);
        assert!(w.begin(0, due).is_some(), "the retry is due");
        assert!(w.begin(0, due).is_none(), "once");
    }

    #[test]
    fn a_paused_table_is_never_due_and_its_resume_raises_it() {
        let w = wakes();
        let now = Instant::now();
        w.set_listening(true);
        w.found_nothing(0, w.begin(0, now).unwrap());
        assert!(w.set_paused(0, true));
        w.rows_committed("public.a");
        assert!(
            w.begin(0, now).is_none(),
            "a NOTIFY does not wake a paused table"
        );
        assert!(
            w.begin(0, now + IDLE_RECHECK * 2).is_none(),
            "nor does its recheck"
        );
        assert!(!w.set_paused(0, true), "no change, nothing to log");
        assert!(w.set_paused(0, false));
        assert!(w.begin(0, now).is_some(), "resumed: due at once");
    }

    #[test]
    fn a_notify_for_another_table_wakes_nothing() {
        let w = wakes();
        let now = Instant::now();
        w.set_listening(true);
        w.found_nothing(0, w.begin(0, now).unwrap());
        w.rows_committed("public.other");
        assert!(w.begin(0, now).is_none());
        w.rows_committed("public.a");
        assert!(w.begin(0, now).is_some());
    }
}
