//! Which tables a worker claims from, and when: an idle table costs next to nothing.
//!
//! Rules (`run`; for `drain`, see the last one):
//!
//! 1. A table is *due* after something says it may have rows: a NOTIFY naming it, the
//!    LISTEN connection (re)subscribing (rows may have committed unheard), a batch of it
//!    that published rows (there may be more) or failed before it knew (a claim that
//!    timed out finds out nothing), its floor lowered by the sweep, or a retry
//!    this process scheduled coming due.
//! 2. A claim that finds nothing settles the table, but only for what was raised before
//!    the claim began: a NOTIFY during the claim keeps it due (a counter, not a flag).
//! 3. A table that is not due is *polled*: the poller asks, in one statement for all the
//!    tables it asks about ([`crate::source::sql::TableSql::claimable`]), which of them
//!    hold a claimable row, makes those due and settles the others as a claim that found
//!    nothing would (rule 2). It asks about the tables NOTIFY does not cover (no
//!    wake-up, LISTEN not subscribed: behind PgBouncer without `listen_url`, or not yet
//!    asleep: rule 6) every `relay.poll_interval`, and about every table every
//!    [`IDLE_RECHECK`], so a row NOTIFY did not announce (inserted with the wake-up
//!    removed, a retry scheduled by a relay that died) is found then. Quiet tables cost
//!    one statement per interval together, not a claim each: a claim per table and
//!    recheck made a relay's idle cost grow with its tables (benchmark I).
//! 4. The floor keeper ([`crate::source::floor`]) ticks only while the table was active in
//!    the last [`ACTIVE_FOR`]; an idle table's keeper looks every few seconds.
//! 5. A paused table ([`crate::source::pause`]) is never due, in `drain` too; its resume
//!    raises it.
//! 6. With this release's wake-up, writers notify only while a relay is asleep on the
//!    table ([`super::sleep`]). A table settled by rule 2 is *wanted* asleep; the poller
//!    marks it so in the database (*pending*) and confirms it (*asleep*) by the sleep
//!    protocol; only then does NOTIFY cover it. A raise of an asleep table makes it
//!    *busy*: due, with its mark kept, so a look that finds it empty again puts it back
//!    to sleep without a transaction. A table is woken for good (the poller clears the
//!    mark, and writers stop notifying) when its NOTIFYs come faster than
//!    [`BUSY_NOTIFY_RATE`], and then not marked again for [`CROWD_AWAKE`], polled every
//!    `poll_interval` meanwhile (a claim that finds it empty does not bring the poll
//!    forward); or by a raise while it is wanted or pending, a pause or a new LISTEN
//!    session.
//! 7. `drain` has no LISTEN and no poller, and must end: the tables a first look finds
//!    rows in start due ([`Wakes::settle_all_but`]; every table if that look fails), and a
//!    table settled (then, or by rule 2) stays settled until a look finds rows in it. A round that
//!    finds nothing, with no worker inside a batch, asks the database for the first table
//!    (in configuration order) that has a publishable row and makes that one due again
//!    ([`Wakes::rearm`]; every table when the look fails), or ends the drain when there is
//!    none. While a worker is inside a batch, its commit says where rows are (rule 1). So
//!    a busy table among idle ones is claimed back to back, never after a look at every
//!    idle table, even when its claims find only keys other workers hold, and a row
//!    committed to a settled table is found by the first look that finds nothing before
//!    it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::source::schema::Wakeup;

/// How often every table is polled anyway when nothing raised it (rule 3): a row
/// inserted with the wake-up removed, a retry scheduled by a relay that died.
pub(crate) const IDLE_RECHECK: Duration = Duration::from_secs(5);
/// How long a table counts as active after its last sign of rows.
pub(crate) const ACTIVE_FOR: Duration = Duration::from_secs(2);
/// The NOTIFYs a second up to which a busy table keeps its sleep mark (rule 6). Below it,
/// a writer's NOTIFY rarely meets another's at commit, so the notify lock costs next to
/// nothing, and the relay is spared a mark and its clearing for every gap between
/// commits. Above it, notifying commits queue on the lock: the mark is cleared and the
/// writers commit as into a table without a wake-up.
pub(crate) const BUSY_NOTIFY_RATE: u32 = 200;
/// How long a table whose writers notified faster than [`BUSY_NOTIFY_RATE`] stays awake
/// and unmarked: a crowd of writers that keeps it busy then commits without a NOTIFY,
/// instead of paying for one in every gap the relay finds between their commits.
pub(crate) const CROWD_AWAKE: Duration = Duration::from_secs(2);

/// The wake state of every table, and the signal idle workers wait on.
pub(crate) struct Wakes {
    tables: Vec<TableWake>,
    /// Idle workers wait on this.
    pub(crate) workers: Notify,
    /// LISTEN is subscribed now.
    listening: AtomicBool,
    /// The LISTEN session: how often it changed (a generation), and its backend pid
    /// while subscribed.
    listener: std::sync::Mutex<(u64, Option<i32>)>,
    /// Pokes the poller: a table is wanted asleep, or must be woken in the database.
    pub(crate) sleep: Notify,
    poll_interval: Duration,
    /// `drain`: rule 7 instead of rules 3 and 6.
    always: bool,
}

/// Where a table stands in the sleep protocol (rule 6), as the low [`SLEEP_BITS`] bits of
/// [`TableWake::sleep`]; the bits above hold the listener generation the state belongs to,
/// so the poller cannot confirm a state a new LISTEN session has reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sleep {
    /// Awake: writers need not notify.
    Awake = 0,
    /// Settled, and wanted asleep: the poller will mark it.
    Wanted = 1,
    /// Marked asleep in the database; polled until the protocol confirms it.
    Pending = 2,
    /// Asleep: NOTIFY covers it, nothing polls it.
    Asleep = 3,
    /// Raised while asleep, its mark kept: NOTIFY still covers it, nothing polls it, and
    /// a look that finds it empty makes it asleep again.
    Busy = 4,
}

/// The bits of [`TableWake::sleep`] that hold the [`Sleep`] state.
const SLEEP_BITS: u32 = 3;
const SLEEP_MASK: u64 = (1 << SLEEP_BITS) - 1;

impl Sleep {
    fn of(word: u64) -> Sleep {
        match word & SLEEP_MASK {
            0 => Sleep::Awake,
            1 => Sleep::Wanted,
            2 => Sleep::Pending,
            3 => Sleep::Asleep,
            _ => Sleep::Busy,
        }
    }

    /// NOTIFY reaches this relay for the table: its mark is settled and in place.
    fn covered(self) -> bool {
        matches!(self, Sleep::Asleep | Sleep::Busy)
    }
}

struct TableWake {
    name: String,
    /// The table's wake-up.
    wakeup: Wakeup,
    /// [`Sleep`] in the low bits, the listener generation above.
    sleep: AtomicU64,
    raised: AtomicU64,
    settled: AtomicU64,
    /// The soonest retry this process scheduled and has not looked for yet.
    retry_at: Mutex<Option<Instant>>,
    last_active: Mutex<Instant>,
    /// Pokes the table's floor keeper out of its idle wait.
    keeper: Notify,
    /// Paused for every relay (rule 5).
    paused: AtomicBool,
    /// The NOTIFYs heard in the current `poll_interval`: since when, and how many; and
    /// until when the table stays awake for a crowd of writers (rule 6).
    notifies: Mutex<Notifies>,
}

#[derive(Debug, Clone, Copy)]
struct Notifies {
    since: Instant,
    count: u32,
    crowd_until: Option<Instant>,
}

/// A ticket from [`Wakes::begin`]: what a claim saw raised when it began.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket(u64);

impl Wakes {
    /// `tables`: each table's qualified name as NOTIFY sends it (`schema.table`) and
    /// its wake-up.
    pub(crate) fn new(
        tables: Vec<(String, Wakeup)>,
        poll_interval: Duration,
        always: bool,
    ) -> Wakes {
        let now = Instant::now();
        Wakes {
            tables: tables
                .into_iter()
                .map(|(name, wakeup)| TableWake {
                    name,
                    wakeup,
                    sleep: AtomicU64::new(0),
                    // Every table starts due: rows may be waiting.
                    raised: AtomicU64::new(1),
                    settled: AtomicU64::new(0),
                    retry_at: Mutex::new(None),
                    last_active: Mutex::new(now),
                    keeper: Notify::new(),
                    paused: AtomicBool::new(false),
                    notifies: Mutex::new(Notifies {
                        since: now,
                        count: 0,
                        crowd_until: None,
                    }),
                })
                .collect(),
            workers: Notify::new(),
            listening: AtomicBool::new(false),
            listener: std::sync::Mutex::new((0, None)),
            sleep: Notify::new(),
            poll_interval,
            always,
        }
    }

    /// Rule 1: table `t` may have rows; idle workers are woken when `wake_workers`.
    pub(crate) fn raise(&self, t: usize, wake_workers: bool) {
        let table = &self.tables[t];
        table.raised.fetch_add(1, Ordering::AcqRel);
        self.wake_up(t);
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

    /// `notifications` NOTIFYs with `payload` (`schema.table`) arrived (one burst).
    pub(crate) fn rows_committed(&self, payload: &str, notifications: u32) {
        if let Some(t) = self.tables.iter().position(|t| t.name == payload) {
            self.raise(t, true);
            if self.crowd_notifies(t, notifications) {
                self.wake_for_good(t);
            }
        }
    }

    /// Rule 6: counts `notifications` NOTIFYs of gated table `t`; whether they came faster
    /// than [`BUSY_NOTIFY_RATE`] in the current `poll_interval`, which keeps the table
    /// awake for [`CROWD_AWAKE`]. The count spans the table's turns between busy and
    /// asleep: under many writers it turns every few commits.
    fn crowd_notifies(&self, t: usize, notifications: u32) -> bool {
        let table = &self.tables[t];
        if table.wakeup != Wakeup::Gated {
            return false;
        }
        let limit = (u128::from(BUSY_NOTIFY_RATE) * self.poll_interval.as_millis())
            .div_ceil(1000)
            .max(1);
        let now = Instant::now();
        let mut notifies = table.notifies.lock().unwrap();
        if now.duration_since(notifies.since) >= self.poll_interval {
            notifies.since = now;
            notifies.count = 0;
        }
        notifies.count = notifies.count.saturating_add(notifications);
        let crowd = u128::from(notifies.count) > limit;
        if crowd {
            notifies.crowd_until = Some(now + CROWD_AWAKE);
        }
        crowd
    }

    /// Table `t` is kept awake for a crowd of writers now (rule 6): unmarked, it is polled
    /// every `poll_interval` as a table without the wake-up, and a claim that finds it
    /// empty does not poke the poller. A poll that finds rows wakes every worker, so a
    /// poll after each empty claim made many claims of a few rows each, on the CPU the
    /// writers need.
    fn crowded(&self, t: usize) -> bool {
        self.crowd_until(t, Instant::now()).is_some()
    }

    /// Rule 6: until when table `t` stays awake for a crowd of writers, if it does now:
    /// the poller does not mark it before then.
    pub(crate) fn crowd_until(&self, t: usize, now: Instant) -> Option<Instant> {
        let notifies = self.tables[t].notifies.lock().unwrap();
        notifies.crowd_until.filter(|&until| until > now)
    }

    /// LISTEN subscribed with the session of backend `pid`, or lost its connection
    /// (`None`). Either way every table is awake (rule 6) in a new listener generation:
    /// what was asleep was asleep for the session before.
    pub(crate) fn set_listening(&self, pid: Option<i32>) {
        {
            let mut listener = self.listener.lock().unwrap();
            listener.0 += 1;
            listener.1 = pid;
            for table in &self.tables {
                table
                    .sleep
                    .store(listener.0 << SLEEP_BITS, Ordering::Release);
            }
        }
        self.listening.store(pid.is_some(), Ordering::Release);
        self.sleep.notify_one();
        if pid.is_some() {
            self.raise_all();
        }
    }

    /// The LISTEN session's generation and backend pid (`None`: not subscribed).
    pub(crate) fn listener(&self) -> (u64, Option<i32>) {
        *self.listener.lock().unwrap()
    }

    /// Rule 6: table `t` was raised. Asleep, it becomes busy and keeps its mark; wanted
    /// or pending, it is awake (the poller hears of it and clears the mark).
    fn wake_up(&self, t: usize) {
        let sleep = &self.tables[t].sleep;
        let mut word = sleep.load(Ordering::Acquire);
        loop {
            let to = match Sleep::of(word) {
                Sleep::Awake | Sleep::Busy => return,
                Sleep::Asleep => Sleep::Busy,
                Sleep::Wanted | Sleep::Pending => Sleep::Awake,
            };
            let new = (word & !SLEEP_MASK) | to as u64;
            match sleep.compare_exchange(word, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => word = now,
            }
        }
        if Sleep::of(word) != Sleep::Asleep && !self.crowded(t) {
            self.sleep.notify_one();
        }
    }

    /// Rule 6: table `t` is awake whatever it was; the poller hears of it when it was not
    /// (and clears the mark).
    fn wake_for_good(&self, t: usize) {
        let was = self.tables[t]
            .sleep
            .fetch_and(!SLEEP_MASK, Ordering::AcqRel);
        if Sleep::of(was) != Sleep::Awake {
            self.sleep.notify_one();
        }
    }

    /// Rule 6: table `t` was settled by a look that began with `ticket`; it is wanted
    /// asleep if nothing raised it since, NOTIFY can reach this relay, and its wake-up
    /// notifies only for sleepers.
    fn want_asleep(&self, t: usize, ticket: Ticket) {
        let table = &self.tables[t];
        if table.wakeup != Wakeup::Gated
            || !self.listening.load(Ordering::Acquire)
            || table.paused.load(Ordering::Acquire)
            || table.raised.load(Ordering::Acquire) > ticket.0
        {
            return;
        }
        let word = table.sleep.load(Ordering::Acquire);
        let to = match Sleep::of(word) {
            Sleep::Awake => Sleep::Wanted,
            // Its mark never lapsed: asleep again at once, with nothing to write.
            Sleep::Busy => Sleep::Asleep,
            Sleep::Wanted | Sleep::Pending | Sleep::Asleep => return,
        };
        let new = (word & !SLEEP_MASK) | to as u64;
        let moved = table
            .sleep
            .compare_exchange(word, new, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if moved && to == Sleep::Wanted && !self.crowded(t) {
            self.sleep.notify_one();
        }
    }

    /// Where table `t` stands in the sleep protocol, and the listener generation of that.
    pub(crate) fn sleep_of(&self, t: usize) -> (Sleep, u64) {
        let word = self.tables[t].sleep.load(Ordering::Acquire);
        (Sleep::of(word), word >> SLEEP_BITS)
    }

    /// The poller moves table `t` from `from` to `to` in listener generation `generation`;
    /// `false` when the table moved meanwhile (woken, or a new LISTEN session).
    pub(crate) fn move_sleep(&self, t: usize, generation: u64, from: Sleep, to: Sleep) -> bool {
        let base = generation << SLEEP_BITS;
        self.tables[t]
            .sleep
            .compare_exchange(
                base | from as u64,
                base | to as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Whether table `t`'s wake-up notifies only for sleepers (rule 6 applies).
    pub(crate) fn gated(&self, t: usize) -> bool {
        self.tables[t].wakeup == Wakeup::Gated
    }

    /// Whether a worker should claim from table `t` now (rule 1, or a retry of this
    /// process come due); if so, the ticket to hand back with what the claim found.
    pub(crate) fn begin(&self, t: usize, now: Instant) -> Option<Ticket> {
        let table = &self.tables[t];
        if table.paused.load(Ordering::Acquire) {
            return None;
        }
        let raised = table.raised.load(Ordering::Acquire);
        if raised > table.settled.load(Ordering::Acquire) {
            return Some(Ticket(raised));
        }
        {
            let mut retry = table.retry_at.lock().unwrap();
            if retry.is_some_and(|at| at <= now) {
                *retry = None;
                return Some(Ticket(raised));
            }
        }
        // Not due: `run`'s poller looks (rule 3); `drain` waits for `rearm` (rule 7).
        None
    }

    /// `drain`: table `t` is due again (rule 7), or every table with `None`, without
    /// waking a worker.
    pub(crate) fn rearm(&self, t: Option<usize>) {
        let Some(t) = t else {
            for table in &self.tables {
                table.raised.fetch_add(1, Ordering::AcqRel);
            }
            return;
        };
        let table = &self.tables[t];
        table.raised.fetch_add(1, Ordering::AcqRel);
        // Its floor keeper may have waited since the table was found empty.
        *table.last_active.lock().unwrap() = Instant::now();
        table.keeper.notify_waiters();
    }

    /// `drain`, before its workers start: every table but those of `due` is settled, as if
    /// a claim had found it empty (rule 7).
    /// Their floor keepers wait too (rule 4: not active), until a look finds rows in them.
    pub(crate) fn settle_all_but(&self, due: &[usize]) {
        let now = Instant::now();
        let long_ago = now.checked_sub(ACTIVE_FOR).unwrap_or(now);
        for (t, table) in self.tables.iter().enumerate() {
            if !due.contains(&t) {
                table
                    .settled
                    .fetch_max(table.raised.load(Ordering::Acquire), Ordering::AcqRel);
                *table.last_active.lock().unwrap() = long_ago;
            }
        }
    }

    /// Whether a table is due by rule 1 (raised since it last settled) and not paused.
    pub(crate) fn any_due(&self) -> bool {
        self.tables.iter().any(|table| {
            !table.paused.load(Ordering::Acquire)
                && table.raised.load(Ordering::Acquire) > table.settled.load(Ordering::Acquire)
        })
    }

    /// A claim of table `t` with `ticket` found nothing (rule 2); the table is looked at
    /// again when something raises it, or a poll finds rows in it (rule 3).
    pub(crate) fn found_nothing(&self, t: usize, ticket: Ticket) {
        self.tables[t].settled.fetch_max(ticket.0, Ordering::AcqRel);
        self.want_asleep(t, ticket);
    }

    /// This process scheduled a retry of a row of table `t` `after` from now.
    pub(crate) fn retry_in(&self, t: usize, after: Duration) {
        let at = Instant::now() + after;
        let mut retry = self.tables[t].retry_at.lock().unwrap();
        *retry = Some(retry.map_or(at, |r| r.min(at)));
    }

    /// Rule 3's poll: a ticket for each table the poller asks about now (NOTIFY does not
    /// cover it, or every table at a `recheck`; not paused), `None` for the others; all
    /// `None` in `drain`, which has no poller.
    pub(crate) fn poll_tickets(&self, recheck: bool) -> Vec<Option<Ticket>> {
        let listening = self.listening.load(Ordering::Acquire);
        self.tables
            .iter()
            .map(|table| {
                let notified = !recheck
                    && listening
                    && match table.wakeup {
                        Wakeup::None => false,
                        Wakeup::Every => true,
                        Wakeup::Gated => Sleep::of(table.sleep.load(Ordering::Acquire)).covered(),
                    };
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
            self.want_asleep(t, ticket);
        }
    }

    /// When the soonest retry this process scheduled comes due, if any.
    pub(crate) fn next_retry(&self) -> Option<Instant> {
        self.tables
            .iter()
            .filter_map(|t| *t.retry_at.lock().unwrap())
            .min()
    }

    /// Rule 5: pauses or resumes table `t`; a resumed table is due at once and the idle
    /// workers hear of it. Returns whether that changed anything.
    pub(crate) fn set_paused(&self, t: usize, paused: bool) -> bool {
        let changed = self.tables[t].paused.swap(paused, Ordering::AcqRel) != paused;
        if changed && !paused {
            self.raise(t, true);
        } else if changed {
            // Nothing claims a paused table: its writers need not notify.
            self.wake_for_good(t);
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

impl crate::source::listen::Wake for Wakes {
    fn rows_committed(&self, payload: &str, notifications: u32) {
        Wakes::rows_committed(self, payload, notifications);
    }

    fn listening(&self, pid: Option<i32>) {
        self.set_listening(pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wakes() -> Wakes {
        Wakes::new(
            vec![
                ("public.a".into(), Wakeup::Every),
                ("public.b".into(), Wakeup::None),
            ],
            Duration::from_millis(100),
            false,
        )
    }

    #[test]
    fn a_table_stays_due_until_a_claim_that_began_after_its_last_raise_finds_nothing() {
        let w = wakes();
        let now = Instant::now();
        let ticket = w.begin(0, now).expect("due at start");
        w.rows_committed("public.a", 1); // a NOTIFY while the claim runs
        w.found_nothing(0, ticket);
        let ticket = w
            .begin(0, now)
            .expect("still due: the NOTIFY came after the claim began");
        w.found_nothing(0, ticket);
        assert!(w.begin(0, now).is_none(), "settled, and rechecked later");
    }

    #[test]
    fn an_idle_table_is_polled_not_claimed_where_notify_does_not_cover_it_or_at_a_recheck() {
        let w = wakes();
        let now = Instant::now();
        w.set_listening(Some(1));
        for t in 0..2 {
            let ticket = w.begin(t, now).unwrap();
            w.found_nothing(t, ticket);
        }
        // Settled: no claim until something raises it, however long it stays quiet.
        for t in 0..2 {
            assert!(w.begin(t, now + IDLE_RECHECK * 4).is_none(), "table {t}");
        }
        // The poller asks about b only (a has the wake-up); about both at a recheck, and
        // while LISTEN is down.
        let tickets = w.poll_tickets(false);
        assert!(tickets[0].is_none() && tickets[1].is_some());
        assert!(w.poll_tickets(true).iter().all(Option::is_some));
        let ticket = w.poll_tickets(true)[0].unwrap();
        w.polled(0, ticket, true);
        assert!(w.begin(0, now).is_some(), "the recheck found a row in a");
        w.set_listening(None);
        assert!(w.poll_tickets(false).iter().all(Option::is_some));
    }

    #[test]
    fn a_poll_that_finds_rows_makes_the_table_due_and_one_that_finds_none_settles_it() {
        let w = wakes();
        let now = Instant::now();
        w.found_nothing(1, w.begin(1, now).unwrap());
        assert!(w.begin(1, now).is_none());
        let ticket = w.poll_tickets(false)[1].unwrap();
        w.polled(1, ticket, true);
        let claim = w.begin(1, now).expect("due: the poll saw a row");
        w.found_nothing(1, claim);
        // A NOTIFY-less raise (a batch that published) while a poll runs is not settled
        // by that poll's answer.
        let ticket = w.poll_tickets(false)[1].unwrap();
        w.raise(1, false);
        w.polled(1, ticket, false);
        assert!(w.begin(1, now).is_some(), "raised after the poll began");
        let ticket = w.poll_tickets(false)[1].unwrap();
        w.polled(1, ticket, false);
        assert!(
            w.begin(1, now).is_none(),
            "settled by a poll that found nothing"
        );
        // `drain` has no poller (rule 7).
        let drain = Wakes::new(
            vec![("public.b".into(), Wakeup::None)],
            Duration::from_millis(100),
            true,
        );
        assert!(drain.poll_tickets(true).iter().all(Option::is_none));
    }

    /// A drain's wake-ups of two tables: `public.busy` (0) and `public.idle` (1).
    fn busy_and_idle_drain() -> Wakes {
        Wakes::new(
            vec![
                ("public.busy".into(), Wakeup::Gated),
                ("public.idle".into(), Wakeup::Gated),
            ],
            Duration::from_millis(100),
            true,
        )
    }

    #[test]
    fn a_drain_starts_with_only_the_tables_its_first_look_found_rows_in() {
        let w = busy_and_idle_drain();
        w.settle_all_but(&[0]);
        let now = Instant::now();
        assert!(w.begin(0, now).is_some(), "rows were found in it");
        assert!(w.begin(1, now).is_none(), "empty at the look: not claimed");
        assert!(!w.active(1), "its floor keeper waits");
        w.rearm(Some(1));
        assert!(w.active(1));
        assert!(w.begin(1, now).is_some(), "a later look found rows in it");
    }

    #[test]
    fn a_drain_skips_a_table_found_empty_until_a_round_finds_nothing() {
        let w = busy_and_idle_drain();
        let now = Instant::now();
        assert!(w.begin(0, now).is_some(), "every table starts due");
        w.found_nothing(1, w.begin(1, now).expect("every table starts due"));
        // The busy table published rows: due again at once; the idle one is skipped,
        // however much time passes.
        w.raise(0, false);
        let later = now + IDLE_RECHECK * 4;
        assert!(w.begin(0, later).is_some());
        assert!(
            w.begin(1, later).is_none(),
            "found empty, not looked at again"
        );
        // A round that found nothing, and a look that found rows in the idle table: that
        // table again, not the others.
        w.found_nothing(0, w.begin(0, later).expect("raised"));
        w.rearm(Some(1));
        assert!(w.begin(1, later).is_some());
        assert!(w.begin(0, later).is_none(), "only the table the look found");
        // A look that failed: every table again.
        w.rearm(None);
        assert!(w.begin(0, later).is_some());
    }

    #[test]
    fn a_scheduled_retry_is_looked_for_when_due_whatever_the_recheck() {
        let w = wakes();
        w.set_listening(Some(1));
        w.retry_in(0, Duration::from_millis(50));
        let now = Instant::now();
        w.found_nothing(0, w.begin(0, now).unwrap());
        assert!(w.begin(0, now).is_none());
        assert!(w.next_retry().unwrap() <= now + Duration::from_millis(60));
        let due = now + Duration::from_millis(60);
        assert!(w.begin(0, due).is_some(), "the retry is due");
        assert!(w.begin(0, due).is_none(), "once");
    }

    #[test]
    fn a_paused_table_is_never_due_and_its_resume_raises_it() {
        let w = wakes();
        let now = Instant::now();
        w.set_listening(Some(1));
        w.found_nothing(0, w.begin(0, now).unwrap());
        assert!(w.set_paused(0, true));
        w.rows_committed("public.a", 1);
        assert!(
            w.begin(0, now).is_none(),
            "a NOTIFY does not wake a paused table"
        );
        assert!(
            w.begin(0, now + IDLE_RECHECK * 2).is_none() && w.poll_tickets(true)[0].is_none(),
            "nor does a recheck"
        );
        assert!(!w.set_paused(0, true), "no change, nothing to log");
        assert!(w.set_paused(0, false));
        assert!(w.begin(0, now).is_some(), "resumed: due at once");
    }

    #[test]
    fn a_notify_for_another_table_wakes_nothing() {
        let w = wakes();
        let now = Instant::now();
        w.set_listening(Some(1));
        w.found_nothing(0, w.begin(0, now).unwrap());
        w.rows_committed("public.other", 1);
        assert!(w.begin(0, now).is_none());
        w.rows_committed("public.a", 1);
        assert!(w.begin(0, now).is_some());
    }

    fn gated() -> Wakes {
        Wakes::new(
            vec![("public.g".into(), Wakeup::Gated)],
            Duration::from_millis(100),
            false,
        )
    }

    /// Settles table 0 by a claim that found nothing (raising it first if it is settled).
    fn settle(w: &Wakes) {
        if !w.any_due() {
            w.raise(0, false);
        }
        let ticket = w.begin(0, Instant::now()).expect("due");
        w.found_nothing(0, ticket);
    }

    #[test]
    fn a_settled_gated_table_is_wanted_asleep_only_while_listening_and_not_paused() {
        let w = gated();
        settle(&w);
        assert_eq!(
            w.sleep_of(0).0,
            Sleep::Awake,
            "not listening: nobody hears NOTIFY"
        );
        w.set_listening(Some(7));
        settle(&w);
        assert_eq!(w.sleep_of(0).0, Sleep::Wanted);
        let ticket = w.poll_tickets(false)[0].expect("wanted tables are still polled");
        w.set_paused(0, true);
        assert_eq!(
            w.sleep_of(0).0,
            Sleep::Awake,
            "a paused table needs no NOTIFY"
        );
        w.polled(0, ticket, false);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake);
        // The oldest trigger, or none: nothing to mark.
        let w = wakes();
        w.set_listening(Some(7));
        for t in 0..2 {
            w.found_nothing(t, w.begin(t, Instant::now()).unwrap());
            assert_eq!(w.sleep_of(t).0, Sleep::Awake);
        }
    }

    #[test]
    fn a_table_raised_after_its_empty_claims_ticket_stays_due() {
        let w = gated();
        w.set_listening(Some(7));
        settle(&w);
        assert!(!w.any_due(), "settled");
        w.raise(0, false); // a batch that published
        let ticket = w.begin(0, Instant::now()).unwrap();
        w.raise(0, false); // the batch before it went through
        w.found_nothing(0, ticket);
        assert!(w.any_due(), "the raise came after the ticket");
        let ticket = w.begin(0, Instant::now()).expect("due");
        w.found_nothing(0, ticket);
        assert!(!w.any_due());
    }

    #[test]
    fn a_look_that_began_before_a_raise_does_not_make_the_table_wanted() {
        let w = gated();
        w.set_listening(Some(7));
        let ticket = w.begin(0, Instant::now()).unwrap();
        w.rows_committed("public.g", 1); // a NOTIFY during the claim
        w.found_nothing(0, ticket);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake);
        let ticket = w.poll_tickets(false)[0].unwrap();
        w.raise(0, false); // a batch published rows while the poll ran
        w.polled(0, ticket, false);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake);
    }

    /// Table 0 of `w`, listening, through wanted and pending to asleep.
    fn put_to_sleep(w: &Wakes) {
        settle(w);
        let (_, generation) = w.sleep_of(0);
        assert!(w.move_sleep(0, generation, Sleep::Wanted, Sleep::Pending));
        assert!(w.poll_tickets(false)[0].is_some(), "pending: still polled");
        assert!(w.move_sleep(0, generation, Sleep::Pending, Sleep::Asleep));
    }

    #[test]
    fn an_asleep_table_goes_unpolled_and_a_raise_makes_it_busy_with_its_mark_kept() {
        let w = gated();
        w.set_listening(Some(7));
        put_to_sleep(&w);
        assert!(
            w.poll_tickets(false)[0].is_none(),
            "asleep: NOTIFY covers it"
        );
        let poked = w.sleep.notified();
        tokio::pin!(poked);
        assert!(
            poked.as_mut().enable(),
            "a permit left from the marks above"
        );
        w.rows_committed("public.g", 1);
        assert_eq!(w.sleep_of(0).0, Sleep::Busy);
        assert!(w.any_due(), "busy: claimed at once");
        assert!(
            w.poll_tickets(false)[0].is_none(),
            "busy: NOTIFY still covers it"
        );
        let poked = w.sleep.notified();
        tokio::pin!(poked);
        assert!(!poked.as_mut().enable(), "no mark to clear");
        // The claim that empties it puts it back to sleep, with nothing to write.
        let ticket = w.begin(0, Instant::now()).expect("due");
        w.found_nothing(0, ticket);
        assert_eq!(w.sleep_of(0).0, Sleep::Asleep);
        // A recheck poll that began before a NOTIFY leaves it busy.
        let ticket = w.poll_tickets(true)[0].expect("rechecked");
        w.rows_committed("public.g", 1);
        w.polled(0, ticket, false);
        assert_eq!(w.sleep_of(0).0, Sleep::Busy);
        assert!(w.any_due());
    }

    #[test]
    fn a_busy_table_whose_writers_notify_faster_than_the_limit_is_woken_for_good() {
        let w = gated();
        w.set_listening(Some(7));
        put_to_sleep(&w);
        // 100 ms at BUSY_NOTIFY_RATE: 20 NOTIFYs keep the mark, the 21st clears it,
        // however often the table turns asleep and busy between them.
        let limit = (BUSY_NOTIFY_RATE / 10) as usize;
        for n in 0..limit {
            w.rows_committed("public.g", 1);
            assert_eq!(w.sleep_of(0).0, Sleep::Busy, "NOTIFY {n}");
            w.found_nothing(0, w.begin(0, Instant::now()).expect("due"));
            assert_eq!(w.sleep_of(0).0, Sleep::Asleep);
        }
        let poked = w.sleep.notified();
        tokio::pin!(poked);
        poked.as_mut().enable();
        w.rows_committed("public.g", 1);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake, "too many NOTIFYs");
        let poked = w.sleep.notified();
        tokio::pin!(poked);
        assert!(poked.as_mut().enable(), "told to clear the mark");
        assert!(w.poll_tickets(false)[0].is_some(), "awake: polled again");
    }

    #[test]
    fn a_table_kept_awake_for_a_crowd_is_polled_on_the_interval_not_after_each_empty_claim() {
        let w = gated();
        w.set_listening(Some(7));
        put_to_sleep(&w);
        w.rows_committed("public.g", BUSY_NOTIFY_RATE);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake, "a crowd");
        let poked = w.sleep.notified();
        tokio::pin!(poked);
        assert!(poked.as_mut().enable(), "told to clear the mark");
        for round in 0..3 {
            w.found_nothing(0, w.begin(0, Instant::now()).expect("due"));
            assert_eq!(w.sleep_of(0).0, Sleep::Wanted, "round {round}");
            assert!(w.poll_tickets(false)[0].is_some(), "polled on the interval");
            let poked = w.sleep.notified();
            tokio::pin!(poked);
            assert!(
                !poked.as_mut().enable(),
                "round {round}: no poll brought forward"
            );
            w.raise(0, true);
            assert_eq!(w.sleep_of(0).0, Sleep::Awake, "round {round}");
            let poked = w.sleep.notified();
            tokio::pin!(poked);
            assert!(!poked.as_mut().enable(), "round {round}: no mark to clear");
        }
    }

    #[test]
    fn a_crowd_heard_in_one_burst_counts_every_notify() {
        // A relay short of CPU reads its NOTIFYs late, many at once: they are one wake-up,
        // but each of them counts towards the busy limit.
        let w = gated();
        w.set_listening(Some(7));
        put_to_sleep(&w);
        let limit = BUSY_NOTIFY_RATE / 10;
        w.rows_committed("public.g", limit);
        assert_eq!(w.sleep_of(0).0, Sleep::Busy, "{limit} NOTIFYs in one burst");
        w.found_nothing(0, w.begin(0, Instant::now()).expect("due"));
        w.rows_committed("public.g", 2);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake, "the limit passed in bursts");
        let w = gated();
        w.set_listening(Some(7));
        put_to_sleep(&w);
        w.rows_committed("public.g", limit + 1);
        assert_eq!(
            w.sleep_of(0).0,
            Sleep::Awake,
            "the limit passed in one burst"
        );
    }

    #[test]
    fn a_raise_of_a_wanted_or_pending_table_or_a_pause_of_a_busy_one_wakes_it() {
        let w = gated();
        w.set_listening(Some(7));
        settle(&w);
        assert_eq!(w.sleep_of(0).0, Sleep::Wanted);
        w.raise(0, false);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake);
        settle(&w);
        let (_, generation) = w.sleep_of(0);
        assert!(w.move_sleep(0, generation, Sleep::Wanted, Sleep::Pending));
        w.rows_committed("public.g", 1);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake, "pending: not settled yet");
        put_to_sleep(&w);
        w.rows_committed("public.g", 1);
        assert_eq!(w.sleep_of(0).0, Sleep::Busy);
        w.set_paused(0, true);
        assert_eq!(
            w.sleep_of(0).0,
            Sleep::Awake,
            "a paused table needs no NOTIFY"
        );
    }

    #[test]
    fn a_new_listen_session_wakes_every_table_and_voids_the_old_sessions_moves() {
        let w = gated();
        w.set_listening(Some(7));
        settle(&w);
        let (_, old) = w.sleep_of(0);
        w.set_listening(None);
        assert_eq!(w.sleep_of(0).0, Sleep::Awake);
        w.set_listening(Some(8));
        settle(&w);
        assert_eq!(w.sleep_of(0).0, Sleep::Wanted);
        assert!(
            !w.move_sleep(0, old, Sleep::Wanted, Sleep::Pending),
            "a mark written for session 7 cannot make the table pending for session 8"
        );
        let (_, new) = w.sleep_of(0);
        assert!(w.move_sleep(0, new, Sleep::Wanted, Sleep::Pending));
        assert_eq!(w.listener(), (new, Some(8)));
    }
}
