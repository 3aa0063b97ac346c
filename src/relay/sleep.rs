//! The sleep protocol: idle relays are woken by NOTIFY, and the application's commits pay
//! for a NOTIFY only while a relay sleeps.
//!
//! A transaction that sends a NOTIFY takes one database-wide lock before it commits and
//! holds it until its commit record is flushed: writers that all notify commit one at a
//! time, one flush each, where they would otherwise share flushes (group commit). So the
//! wake-up (`migrations/notify.sql`: the attempts column's default, computed for every
//! row written) notifies only while the table's *sleep sequence* says a relay is asleep
//! on it ([`crate::source::sleepers`]: 1 + the relays asleep, NULL while none is, read
//! without a snapshot). A busy relay is awake: its writers commit as into a table without
//! a wake-up, but for the read, and it finds their rows by claiming and polling (`wake`,
//! rules 1-3).
//!
//! ## The protocol, per table and relay (the poller runs it; `wake` rule 6 holds the state)
//!
//! 1. LISTEN is subscribed (session pid `P`) before anything below.
//! 2. A look (claim or poll) finds the table empty and nothing raised it since: *wanted*.
//! 3. The poller commits the mark `asleep` for `(table, P)` and, in the same transaction,
//!    sets the sleep sequence from the marks (at instant `V`, before the commit). Then it
//!    reads `X`, the first transaction id not yet assigned, in a statement after the
//!    commit: *pending*.
//! 4. It polls the table as before, and asks in each poll whether the mark is *settled*: no
//!    transaction with an id below `X` is still running
//!    ([`crate::source::sleepers::SETTLED_SQL`]).
//! 5. The first poll that *begins after* a poll saw it settled, and finds no claimable row,
//!    makes the table *asleep*: NOTIFY covers it, and only the poll of every table each
//!    `IDLE_RECHECK` asks about it.
//! 6. Anything that raises an asleep table (a NOTIFY, a look that found rows) makes it
//!    *busy*: due at once, its mark kept, still unpolled. A look that began after the last
//!    raise and finds it empty makes it asleep again, with nothing written. A busy table
//!    whose NOTIFYs come faster than [`super::wake::BUSY_NOTIFY_RATE`], a raise of a
//!    wanted or pending table, a pause or a lost LISTEN session make it *awake*; the
//!    poller then clears the mark and recounts the sequence. The marks of a relay whose
//!    LISTEN session ended are removed, and the sequences recounted, by the next look of
//!    any relay of the schema. While a table is wanted or pending, it is polled every
//!    `poll_interval`.
//!
//! ## Why no row is left unwoken
//!
//! Claim: when the table is asleep, every row committed into it either reaches this relay
//! as a NOTIFY, or was visible to the poll of step 5.
//!
//! The sequence is at least 2 from `V` until step 6 clears this relay's mark: every
//! recount holds one advisory lock and counts the marks committed when it runs, and the
//! mark was committed before any later recount took the lock. Take a writer `W` that
//! inserts a row and does not notify: the wake-up of each of its rows read the sequence
//! as NULL, so before `V`. The wake-up gives `W` its transaction id `w` before it reads
//! the sequence (PostgreSQL computes a row's defaults before it writes the row, which is
//! when a transaction would otherwise get its id), so `w` was assigned before `V`, before
//! the commit, before `X` was read: `w < X`. At the settled poll `W`
//! was no longer running, so it had committed before the poll of step 5 began, which
//! therefore saw its row. This holds whatever `W`'s isolation level (the sequence is read
//! without a snapshot), and for a prepared transaction (its id runs until `COMMIT
//! PREPARED`). Every other writer's wake-up read a value, so it notifies, and LISTEN (step 1)
//! hears it. A NOTIFY that raced the table to sleep raised it (step 6): the table is
//! awake and due, which is safe. The same holds for each relay on its own, whatever the
//! others do: each waits on its own mark.
//!
//! A busy table that goes back to sleep (step 6) keeps the claim: its mark has stood
//! without a break since the poll of step 5, so the argument above holds for it
//! unchanged. The look that put it back to sleep began after the table's last raise
//! (rule 2 of `wake`), so every NOTIFY it was sent before that look began was answered
//! by the look itself, and every later one raises it again.
//!
//! What the writers pay: one read of a sequence per row while no relay sleeps; a NOTIFY for the commits that land while one is asleep or busy, which a crowd
//! of writers ends within one `poll_interval` by notifying faster than the busy limit.
//! What the relay pays: a mark and its clearing per sleep (a steady trickle of commits
//! keeps one mark), a poll or two per sleep, and polls every `poll_interval` while a
//! transaction that started writing before the mark is still open.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::wake::{Sleep, Wakes, IDLE_RECHECK};
use crate::config::TableName;
use crate::source::poll::Poll;
use crate::source::sleepers;
use crate::source::table::TablePlan;
use crate::source::Source;

/// How long the poller tries to remove its marks at exit.
const FORGET_AT_EXIT: Duration = Duration::from_secs(2);

/// What the poller knows of its marks in the database, table by table.
#[derive(Debug, Clone, Default)]
struct Mark {
    /// The database row says asleep (as last written by this poller).
    asleep: bool,
    /// `X` of step 3, for the mark in place.
    horizon: Option<i64>,
    /// A poll saw the mark settled (step 4): the next poll may confirm (step 5).
    settled: bool,
}

/// The marks of every table, for the LISTEN session they were written for.
struct Marks {
    pid: Option<i32>,
    generation: u64,
    tables: Vec<Mark>,
}

/// The poller (`run` only): rule 3's polls, and the sleep protocol's marks. Every
/// `interval`, and whenever a table is wanted asleep or must be woken, it (1) removes the
/// marks of a LISTEN session that ended, (2) marks and clears what `wakes` asks for, and
/// (3) asks in one statement which polled tables (those NOTIFY does not cover; every
/// table each [`IDLE_RECHECK`]) may hold a claimable row and, while a mark is pending,
/// whether it is settled. A table whose floor lists stragglers counts as having rows (the
/// statement reads from the floor on). A poll that fails makes every table it asked about
/// due: the workers' claims meet the error and report it. `rechecked` is told when a poll
/// of every table answered (the database and the poller work: readiness).
pub(crate) async fn poll(
    wakes: &Wakes,
    source: &Source,
    tables: &[&TablePlan],
    interval: Duration,
    rechecked: &(dyn Fn() + Sync),
    done: &CancellationToken,
) {
    let statements = Poll::new(tables.iter().map(|t| &t.sql));
    let names: Vec<&TableName> = tables.iter().map(|t| &t.config.name).collect();
    let gated: Vec<&TableName> = (0..tables.len())
        .filter(|&t| wakes.gated(t))
        .map(|t| names[t])
        .collect();
    let mut marks = Marks {
        pid: None,
        generation: 0,
        tables: vec![Mark::default(); tables.len()],
    };
    // Polls start `interval` apart, however long each took: a row waits at most about one
    // interval for the poll that sees it.
    let mut every = tokio::time::interval(interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    let mut again = false;
    // When a table kept awake for a crowd of writers may be marked (`mark`).
    let mut crowd_ends: Option<tokio::time::Instant> = None;
    let mut recheck_at = tokio::time::Instant::now() + IDLE_RECHECK;
    loop {
        if !again {
            let crowd_ended = async {
                match crowd_ends {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = done.cancelled() => break,
                _ = every.tick() => {}
                _ = wakes.sleep.notified() => {}
                _ = crowd_ended => {}
                _ = tokio::time::sleep_until(recheck_at) => {}
            }
        }
        let now = tokio::time::Instant::now();
        let recheck = now >= recheck_at;
        if recheck {
            recheck_at = now + IDLE_RECHECK;
        }
        let work = async {
            if !gated.is_empty() {
                follow_listener(wakes, source, &gated, &names, &mut marks).await;
                crowd_ends = mark(wakes, source, &names, &mut marks)
                    .await
                    .map(tokio::time::Instant::from_std);
            }
            poll_once(wakes, source, tables, &statements, &mut marks, recheck).await
        };
        let polled = tokio::select! {
            _ = done.cancelled() => break,
            polled = work => polled,
        };
        if recheck && polled.is_ok() {
            rechecked();
        }
        again = polled.unwrap_or(false);
    }
    if let (Some(pid), false) = (marks.pid, gated.is_empty()) {
        let forgotten = tokio::time::timeout(
            FORGET_AT_EXIT,
            source.in_transaction(async |tx| sleepers::forget(tx, &gated, Some(pid)).await),
        )
        .await;
        if !matches!(forgotten, Ok(Ok(()))) {
            tracing::debug!(
                "Could not remove this relay's sleep marks at exit; the next relay will"
            );
        }
    }
}

/// Step 6 for a LISTEN session that ended: its marks are forgotten (with every other
/// dead session's), and what this poller knew of them reset.
async fn follow_listener(
    wakes: &Wakes,
    source: &Source,
    gated: &[&TableName],
    names: &[&TableName],
    marks: &mut Marks,
) {
    let (generation, pid) = wakes.listener();
    if generation == marks.generation {
        return;
    }
    // The old session's rows, asleep or cleared (a cleared mark keeps its row).
    if pid.is_some() || marks.pid.is_some() {
        let forgotten = source
            .in_transaction(async |tx| sleepers::forget(tx, gated, marks.pid).await)
            .await;
        if let Err(e) = forgotten {
            tracing::debug!(error = %e, "Could not remove the sleep marks of ended sessions");
            return; // tried again at the next poll
        }
    }
    for (t, mark) in marks.tables.iter().enumerate() {
        if mark.asleep {
            tracing::debug!(table = %names[t], "Awake: the LISTEN session changed, its sleep mark removed");
        }
    }
    marks.pid = pid;
    marks.generation = generation;
    marks.tables.fill(Mark::default());
}

/// Steps 3 and 6: marks the tables wanted asleep and clears the marks of awake tables,
/// in one transaction; then reads `X` for the new marks and makes them pending. Returns
/// when the first table it left unmarked for a crowd of writers may be marked.
async fn mark(
    wakes: &Wakes,
    source: &Source,
    names: &[&TableName],
    marks: &mut Marks,
) -> Option<Instant> {
    let pid = marks.pid?;
    let generation = marks.generation;
    let MarkPlan {
        to_sleep,
        to_wake,
        mut unsure,
        crowd_ends,
    } = plan_marks(wakes, marks, generation);
    if to_sleep.is_empty() && to_wake.is_empty() && unsure.is_empty() {
        return crowd_ends;
    }
    let pick = |ts: &[usize]| ts.iter().map(|&t| names[t]).collect::<Vec<_>>();
    let (sleep_names, wake_names) = (pick(&to_sleep), pick(&to_wake));
    let marked = source
        .in_transaction(async |tx| sleepers::mark(tx, pid, &sleep_names, &wake_names).await)
        .await;
    if let Err(e) = marked {
        tracing::debug!(error = %e, "Could not mark tables asleep or awake; trying again at the next poll");
        return crowd_ends;
    }
    for &t in &to_wake {
        marks.tables[t] = Mark::default();
        tracing::debug!(table = %names[t], "Awake: sleep mark cleared, writers stop notifying");
    }
    for &t in &to_sleep {
        marks.tables[t].asleep = true;
        tracing::debug!(table = %names[t], "Sleep mark set; polling until it is settled");
    }
    unsure.extend(to_sleep);
    if !unsure.is_empty() {
        read_horizon(wakes, source, generation, marks, &unsure).await;
    }
    crowd_ends
}

/// The tables [`mark`] changes, by what it does with each (indexes into `Marks::tables`).
struct MarkPlan {
    /// Wanted asleep and not marked: to mark.
    to_sleep: Vec<usize>,
    /// Marked and awake, or kept awake for a crowd of writers: to clear.
    to_wake: Vec<usize>,
    /// Marked, and waiting for a horizon.
    unsure: Vec<usize>,
    /// When the first table kept awake for a crowd of writers may be marked.
    crowd_ends: Option<Instant>,
}

/// What [`mark`] does with each table of this generation; a table marked without a break
/// since step 3 is made pending here, its horizon still holding.
fn plan_marks(wakes: &Wakes, marks: &Marks, generation: u64) -> MarkPlan {
    let now = Instant::now();
    let mut crowd_ends: Option<Instant> = None;
    let (mut to_sleep, mut to_wake, mut unsure) = (Vec::new(), Vec::new(), Vec::new());
    for (t, mark) in marks.tables.iter().enumerate() {
        let sleep = wakes.sleep_of(t);
        // Only a table wanted asleep can be held awake for a crowd of writers.
        let crowd = match sleep {
            (Sleep::Wanted, g) if g == generation => wakes.crowd_until(t, now),
            _ => None,
        };
        // Kept awake for a crowd of writers: unmarked until the crowd time ends, the mark
        // cleared if it was wanted again before the poller cleared it.
        if let Some(until) = crowd {
            crowd_ends = Some(crowd_ends.map_or(until, |end| end.min(until)));
            if mark.asleep {
                to_wake.push(t);
            }
            continue;
        }
        match sleep {
            (Sleep::Wanted, g) if g == generation => match (mark.asleep, mark.horizon) {
                (false, _) => to_sleep.push(t),
                // Marked without a break since step 3 (woken, then wanted again before
                // the mark was cleared): its horizon still holds.
                (true, Some(_)) => {
                    wakes.move_sleep(t, generation, Sleep::Wanted, Sleep::Pending);
                }
                (true, None) => unsure.push(t),
            },
            (Sleep::Awake, _) if mark.asleep => to_wake.push(t),
            _ => {}
        }
    }
    MarkPlan {
        to_sleep,
        to_wake,
        unsure,
        crowd_ends,
    }
}

/// Step 3's end for the `unsure` tables, marked and committed: reads the horizon `X`,
/// keeps it as theirs and makes them pending.
async fn read_horizon(
    wakes: &Wakes,
    source: &Source,
    generation: u64,
    marks: &mut Marks,
    unsure: &[usize],
) {
    match source
        .in_transaction(async |tx| sleepers::horizon(tx).await)
        .await
    {
        Ok(x) => {
            for &t in unsure {
                marks.tables[t].horizon = Some(x);
                marks.tables[t].settled = false;
                wakes.move_sleep(t, generation, Sleep::Wanted, Sleep::Pending);
            }
        }
        // Marked, not pending: the tables stay wanted and polled; the next round reads a
        // horizon for them (a later one is as good: the marks were committed before it).
        Err(e) => tracing::debug!(error = %e, "Could not read the transaction horizon"),
    }
}

/// Rule 3's poll (of every table at a `recheck`), with steps 4 and 5. Returns whether to
/// poll again at once (a mark was seen settled, so the next poll can confirm it), or
/// `Err` when the poll failed.
async fn poll_once(
    wakes: &Wakes,
    source: &Source,
    tables: &[&TablePlan],
    statements: &Poll,
    marks: &mut Marks,
    recheck: bool,
) -> Result<bool, ()> {
    let tickets = wakes.poll_tickets(recheck);
    if tickets.iter().all(Option::is_none) {
        return Ok(false);
    }
    let generation = marks.generation;
    let pending = |t: usize| wakes.sleep_of(t) == (Sleep::Pending, generation);
    // Pending marks not yet seen settled: the latest horizon among them answers for all.
    let horizon = (0..tables.len())
        .filter(|&t| pending(t) && !marks.tables[t].settled)
        .filter_map(|t| marks.tables[t].horizon)
        .max();
    let views: Vec<_> = tables.iter().map(|t| t.floor.view()).collect();
    let floors: Vec<i64> = views.iter().map(|v| v.value).collect();
    let asked = source
        .in_transaction(async |tx| statements.ask(tx, &floors, horizon).await)
        .await;
    for (t, ticket) in tickets.into_iter().enumerate() {
        let Some(ticket) = ticket else { continue };
        match &asked {
            Ok((rows, _)) => {
                let rows = rows.get(t).copied().unwrap_or(true) || !views[t].stragglers.is_empty();
                // Step 5: this poll began after the one that saw the mark settled.
                let confirm = !rows && pending(t) && marks.tables[t].settled;
                wakes.polled(t, ticket, rows);
                if confirm && wakes.move_sleep(t, generation, Sleep::Pending, Sleep::Asleep) {
                    tracing::debug!(table = %tables[t].config.name, "Asleep: NOTIFY covers the table");
                }
            }
            Err(_) => wakes.raise(t, true),
        }
    }
    match asked {
        Ok((_, Some(true))) => {
            let x = horizon.unwrap_or(i64::MAX);
            let mut any = false;
            for (t, mark) in marks.tables.iter_mut().enumerate() {
                if pending(t) && mark.horizon.is_some_and(|h| h <= x) && !mark.settled {
                    mark.settled = true;
                    any = true;
                }
            }
            Ok(any)
        }
        Ok(_) => Ok(false),
        Err(e) => {
            tracing::debug!(error = %e, "Could not poll the tables");
            Err(())
        }
    }
}
