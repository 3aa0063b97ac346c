//! The claim's low-water mark: claims start at a remembered *floor* instead of the pending
//! index's left end, so their cost depends on the batch, not on the table's history.
//!
//! # Why
//!
//! A row published (deleted, or marked) leaves its entry in the pending index until VACUUM
//! removes it, and VACUUM removes nothing a snapshot still open anywhere may see: a report,
//! `pg_dump`, a forgotten `BEGIN`, a replica with `hot_standby_feedback`. A claim that
//! starts at the left end visits every such entry, and the heap tuple behind it, before the
//! first pending row: measured here, a second drain of 300,000 rows behind one held
//! REPEATABLE READ snapshot ran at 0.57 of the first, which ran at 0.44 of a drain without
//! it (stdout sink, key order, 4 workers, batch 1,000).
//!
//! # The invariant
//!
//! Call a pending row *fresh* while its `next_attempt_at` is NULL (no failure history). Then,
//! for the floor `F` and the list of *stragglers* `S` a claim reads:
//!
//! > Every fresh pending row with an id below `F` is in `S`, except rows whose id was drawn
//! > before their transaction had an xid (see *The sweep*).
//!
//! Rows with a failure history (waiting for a retry, or released by `requeue`, which sets
//! `next_attempt_at`) are found below the floor through the retry index. So a claim that
//! reads `id >= F`, plus `S`, plus the retry index, sees every pending row: its window is
//! still a prefix of the pending rows, and the head rule of [`super::claim`] holds.
//! Stragglers are fresh rows held back by an earlier held row of their key (dead, or with a
//! failure history): the floor passes them rather than stay behind a dead row for days.
//! They are looked up by primary key, at most [`STRAGGLER_CAP`]; beyond that the floor stays
//! below them.
//!
//! # Raising the floor: a fence
//!
//! Every [`TICK`] the keeper looks at the table in one snapshot: the first fresh pending row
//! from the floor on that is not held back (a *candidate* `c` for the floor; when there is
//! none, one past the highest id this process had claimed before the look began: that row
//! was committed before the look too, which is all the argument below needs), the fresh
//! rows before it (all held back), which stragglers are still fresh and pending, and the
//! snapshot's `xmin` and `xmax`. A row below `c` that this snapshot could not see belongs to
//! a transaction still running, which may commit later: the floor must not pass it yet. So
//! the candidate is adopted only at a later look whose `xmin` is at least the candidate's
//! `xmax`, when every transaction that was running then has ended. That look walks the
//! table again from the current floor, so it sees those late rows if they committed:
//!
//! - the new floor is `f = min(c, c')`, `c'` the later look's own candidate;
//! - the new stragglers are the old ones still fresh and pending, plus the later look's
//!   held-back rows below `f` (all of its rows below `c'` are held back, by definition).
//!
//! Proof sketch. Take a fresh pending row `r < f` after adoption. If the later look saw it,
//! it is a straggler (above the old floor) or was one already (below it). If it did not,
//! `r` was drawn before `c` (ids from one sequence grow), `c` was committed before the first
//! look, so `r`'s transaction had begun before it, and with an xid below that look's `xmax`:
//! it had ended before the later look, which would have seen `r`. Rows that become pending
//! again later (`requeue`) get `next_attempt_at` and the retry index.
//!
//! A candidate waits for its fence while batches run; it is not replaced by a newer one
//! meanwhile (under steady load some transaction is always running, and a fresher
//! candidate would never see its fence pass). The floor trails the newest pending row by
//! about one batch's duration plus a tick.
//!
//! # The sweep
//!
//! The proof assumes a row's transaction holds an xid when the row's id is drawn. Inside an
//! `INSERT` the id's default is evaluated a moment before the row is written and the xid
//! assigned; an application may also draw ids with `nextval` long before inserting; ids
//! from a sequence with `CACHE` above 1 do not grow across sessions; an operator may make a
//! row pending again by hand. So the keeper also sweeps: it walks the range below the floor
//! in steps, lowering the floor to any fresh pending row it finds that is not held back
//! (and listing held-back ones as stragglers). Lowering the floor, or listing more
//! stragglers, is always safe. Each step covers a span of ids sized to take a few
//! milliseconds, and steps are spaced so the sweep takes at most about 5% of one
//! connection's time. A row of those kinds is published within one sweep cycle: about a
//! second on a table VACUUM keeps clean; with a snapshot held, as long as 20 times the
//! walk through the dead entries below the floor takes.

use std::sync::atomic::{AtomicI64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::sql::TableSql;
use super::{Source, SourceError};

/// How often the keeper looks at the table. The floor trails the newest pending row by
/// about a batch's duration plus a tick or two; with a snapshot held, every claim walks the
/// entries of the rows published in that time.
pub const TICK: Duration = Duration::from_millis(25);
/// Stragglers listed at most; beyond them the floor stays below.
pub const STRAGGLER_CAP: usize = 1000;
/// Fresh rows one look reads at most (written into the look's SQL).
const WALK: usize = super::sql::LOOK_LIMIT;
const _: () = assert!(WALK == STRAGGLER_CAP + 1);
/// Pause between two sweep cycles.
const SWEEP_PAUSE: Duration = Duration::from_secs(1);
/// A sweep step's span of ids: the first, and its bounds.
const SPAN_START: i64 = 1 << 16;
const SPAN_MIN: i64 = 1 << 10;
const SPAN_MAX: i64 = 1 << 40;
/// A step faster than this doubles the span; slower than `SLOW_STEP` halves it.
const FAST_STEP: Duration = Duration::from_millis(5);
const SLOW_STEP: Duration = Duration::from_millis(20);
/// Steps are spaced by at least this many times their own duration (about 5% duty).
const SWEEP_SPACING: u32 = 19;

/// What claims read: start at `value`; below it, read the stragglers and the retry index.
#[derive(Debug, Clone)]
pub struct FloorView {
    pub value: i64,
    pub stragglers: Arc<[i64]>,
    /// Some pending row may have a failure history (`ordering = "none"` claims below the
    /// floor only then; key-ordered windows always look).
    pub retrying: bool,
}

impl Default for FloorView {
    fn default() -> Self {
        FloorView {
            value: i64::MIN,
            stragglers: Arc::from([]),
            retrying: true,
        }
    }
}

/// The floor of one table, shared by the keeper (who moves it) and the claims (who read it
/// and say how far they got).
#[derive(Debug)]
pub struct FloorCell {
    view: Mutex<FloorView>,
    /// The highest id a claim of this process has locked (`i64::MIN`: none yet).
    claimed: AtomicI64,
}

impl Default for FloorCell {
    fn default() -> Self {
        FloorCell {
            view: Mutex::default(),
            claimed: AtomicI64::new(i64::MIN),
        }
    }
}

impl FloorCell {
    pub fn view(&self) -> FloorView {
        self.view.lock().unwrap().clone()
    }

    /// A claim locked rows up to `max`: committed rows, so every id drawn before it is
    /// committed, or belongs to a transaction running now (see *Raising the floor*).
    pub fn note_claimed(&self, max: Option<i64>) {
        if let Some(max) = max {
            self.claimed.fetch_max(max, AtomicOrdering::Relaxed);
        }
    }

    /// One past the highest id claimed so far, if any.
    fn claimed_past(&self) -> Option<i64> {
        let claimed = self.claimed.load(AtomicOrdering::Relaxed);
        (claimed > i64::MIN).then(|| claimed.saturating_add(1))
    }

    /// A worker recorded a failure: rows with a failure history exist now.
    pub fn note_retrying(&self) {
        self.view.lock().unwrap().retrying = true;
    }

    fn publish(&self, floor: &Floor) {
        let mut view = self.view.lock().unwrap();
        view.value = floor.value;
        view.stragglers = Arc::from(floor.stragglers.as_slice());
        view.retrying = floor.retrying;
    }
}

/// One look at the table from the floor, in one snapshot.
#[derive(Debug, Clone, Default)]
pub struct Observation {
    pub xmin: i64,
    pub xmax: i64,
    pub retrying: bool,
    /// Fresh pending rows from the floor on, in order, at most [`WALK`], each with whether
    /// an earlier held row of its key holds it back.
    pub walk: Vec<(i64, bool)>,
    /// The stragglers still fresh and pending.
    pub kept: Vec<i64>,
    /// One past the highest id this process had claimed before the look began.
    pub claimed_past: Option<i64>,
}

impl Observation {
    /// The first row not held back; if every row read was held back and the read was cut
    /// short, the last one read (nothing beyond it was seen); if no fresh row is left
    /// unheld, one past the highest id claimed before the look. The relay keeps up in
    /// steady state, so looks mostly find no fresh row: without this last case the floor
    /// would stay where it was, and claims would walk every row published since.
    fn candidate(&self) -> Option<i64> {
        match self.walk.iter().find(|(_, held)| !held) {
            Some((id, _)) => Some(*id),
            None if self.walk.len() >= WALK => self.walk.last().map(|(id, _)| *id),
            None => self.claimed_past,
        }
    }
}

/// The keeper's state: the floor, its stragglers, the candidate waiting for its fence, and
/// the sweep's position.
#[derive(Debug)]
pub struct Floor {
    value: i64,
    stragglers: Vec<i64>,
    retrying: bool,
    /// A proposed floor and the `xmax` of the snapshot that saw it.
    candidate: Option<(i64, i64)>,
    /// The first floor adopted: the sweep's first step covers everything below it.
    base: Option<i64>,
    sweep: Sweep,
}

#[derive(Debug)]
struct Sweep {
    /// Where the next step starts; `None` between cycles.
    pos: Option<i64>,
    span: i64,
    next_at: Instant,
}

impl Floor {
    pub fn new(now: Instant) -> Floor {
        Floor {
            value: i64::MIN,
            stragglers: Vec::new(),
            retrying: true,
            candidate: None,
            base: None,
            sweep: Sweep {
                pos: None,
                span: SPAN_START,
                next_at: now + SWEEP_PAUSE,
            },
        }
    }

    pub fn value(&self) -> i64 {
        self.value
    }

    pub fn stragglers(&self) -> &[i64] {
        &self.stragglers
    }

    /// Takes in one look made from the current floor with the current stragglers.
    pub fn observe(&mut self, look: Observation) {
        self.retrying = look.retrying;
        let mut kept = look.kept.clone();
        kept.retain(|id| *id < self.value);
        self.stragglers = kept;
        let now_candidate = look.candidate();
        if let Some((candidate, xmax)) = self.candidate {
            if look.xmin >= xmax {
                self.candidate = None;
                let f = candidate.min(now_candidate.unwrap_or(i64::MAX));
                if f > self.value {
                    // Every row of this look below `f` is held back (f <= its candidate).
                    let held = look.walk.iter().map(|(id, _)| *id).filter(|id| *id < f);
                    let mut listed: Vec<i64> =
                        self.stragglers.iter().copied().chain(held).collect();
                    listed.sort_unstable();
                    listed.dedup();
                    self.set(f, listed);
                    self.base.get_or_insert(self.value);
                }
            }
        }
        if self.candidate.is_none() {
            self.candidate = now_candidate
                .filter(|c| *c > self.value)
                .map(|c| (c, look.xmax));
        }
    }

    /// Sets the floor to `value` and the stragglers to those of `listed` below it, keeping
    /// at most [`STRAGGLER_CAP`]: the floor stays at the first one beyond.
    fn set(&mut self, mut value: i64, mut listed: Vec<i64>) {
        listed.retain(|id| *id < value);
        if listed.len() > STRAGGLER_CAP {
            value = listed[STRAGGLER_CAP];
            listed.truncate(STRAGGLER_CAP);
        }
        self.value = value;
        self.stragglers = listed;
    }

    /// The range of ids the next sweep step covers, if one is due at `now`.
    pub fn sweep_due(&mut self, now: Instant) -> Option<(i64, i64)> {
        let base = self.base?;
        if now < self.sweep.next_at {
            return None;
        }
        let (lo, hi) = match self.sweep.pos {
            // A cycle starts with everything below where this process began.
            None => (i64::MIN, base.min(self.value)),
            Some(pos) => (pos, pos.saturating_add(self.sweep.span).min(self.value)),
        };
        if lo >= hi {
            self.end_cycle(now);
            return self.sweep_due(now);
        }
        Some((lo, hi))
    }

    /// Takes in one sweep step over `[_, hi)`: the fresh pending rows found there that
    /// are not stragglers yet, at most [`WALK`], and how long the step took.
    pub fn swept(&mut self, hi: i64, found: &[(i64, bool)], took: Duration, now: Instant) {
        let free = found.iter().find(|(_, held)| !held).map(|(id, _)| *id);
        let mut listed = self.stragglers.clone();
        listed.extend(
            found
                .iter()
                .map(|(id, _)| *id)
                .filter(|id| free.is_none_or(|f| *id < f)),
        );
        listed.sort_unstable();
        listed.dedup();
        let value = free.map_or(self.value, |f| f.min(self.value));
        if value < self.value {
            tracing::info!(
                from = self.value,
                to = value,
                "The sweep found a pending row below the claim floor (an id drawn before its transaction began, or a row made pending by hand); lowering the floor"
            );
        }
        self.set(value, listed);
        // Cut short with every row held back: go on after the last one read.
        let next = match (free, found.last()) {
            (None, Some((last, _))) if found.len() >= WALK => last.saturating_add(1),
            _ => hi,
        };
        self.sweep.span = if took < FAST_STEP {
            self.sweep.span.saturating_mul(2).min(SPAN_MAX)
        } else if took > SLOW_STEP {
            (self.sweep.span / 2).max(SPAN_MIN)
        } else {
            self.sweep.span
        };
        self.sweep.pos = Some(next);
        self.sweep.next_at = now + (took * SWEEP_SPACING).max(TICK);
        if next >= self.value {
            self.end_cycle(now);
        }
    }

    fn end_cycle(&mut self, now: Instant) {
        self.sweep.pos = None;
        self.sweep.next_at = now + SWEEP_PAUSE;
    }
}

/// How often the keeper of an idle table looks (see [`Pace`]).
pub const IDLE_TICK: Duration = Duration::from_secs(5);

/// How fast the keeper goes: a look every [`TICK`] while the table is `active` (rows were
/// claimed or announced lately), else every [`IDLE_TICK`] or at a `poke`. The floor only
/// saves claims work, so an idle table's floor may wait; its rows are not held back by it.
/// `lowered` is told when the sweep lowered the floor: a row is pending below it, and
/// claims should look.
pub struct Pace<'a> {
    pub active: &'a (dyn Fn() -> bool + Sync),
    pub poke: &'a tokio::sync::Notify,
    pub lowered: &'a (dyn Fn() + Sync),
}

/// Keeps the floor of one table until `done`: a look every tick ([`Pace`]), sweep steps
/// when due. Failures are logged and retried at the next tick; meanwhile the floor stays
/// where it is, which is always safe.
pub async fn keep(
    table: &str,
    source: &Source,
    sql: &TableSql,
    cell: &FloorCell,
    pace: Pace<'_>,
    done: &tokio_util::sync::CancellationToken,
) {
    let mut floor = Floor::new(Instant::now());
    let mut failing = false;
    let mut shown = (floor.value(), 0);
    loop {
        let poked = pace.poke.notified();
        if (pace.active)() {
            tokio::select! {
                _ = done.cancelled() => return,
                _ = tokio::time::sleep(TICK) => {}
            }
        } else {
            tokio::select! {
                _ = done.cancelled() => return,
                _ = poked => {}
                _ = tokio::time::sleep(IDLE_TICK) => {}
            }
        }
        let before = floor.value();
        // Read before the look begins: every id claimed by then is committed.
        let claimed_past = cell.claimed_past();
        match source
            .bounded(tick(source, sql, &mut floor, claimed_past))
            .await
        {
            Ok(()) => {
                cell.publish(&floor);
                failing = false;
                if floor.value() < before {
                    (pace.lowered)();
                }
                let now = (floor.value(), floor.stragglers().len());
                if now != shown {
                    shown = now;
                    tracing::debug!(
                        table,
                        floor = now.0,
                        stragglers = now.1,
                        "Claim floor moved"
                    );
                }
            }
            Err(e) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(error = %e, "Could not move the claim floor; claims start where they did");
                }
            }
        }
    }
}

async fn tick(
    source: &Source,
    sql: &TableSql,
    floor: &mut Floor,
    claimed_past: Option<i64>,
) -> Result<(), SourceError> {
    source
        .in_transaction(async |tx| {
            let stragglers = floor.stragglers().to_vec();
            let row = tx
                .query_one(&sql.advance, &[&floor.value(), &stragglers])
                .await?;
            let candidate: Option<i64> = row.get(3);
            let held: Vec<i64> = row.get(4);
            // Rows beyond a cut-short list of held rows were not seen: no candidate then.
            let candidate = candidate.filter(|_| held.len() < WALK);
            let walk = held
                .into_iter()
                .map(|id| (id, true))
                .chain(candidate.map(|id| (id, false)))
                .collect();
            floor.observe(Observation {
                xmin: row.get(0),
                xmax: row.get(1),
                retrying: row.get(2),
                walk,
                kept: row.get(5),
                claimed_past,
            });
            if let Some((lo, hi)) = floor.sweep_due(Instant::now()) {
                let started = Instant::now();
                let stragglers = floor.stragglers().to_vec();
                let found: Vec<(i64, bool)> = tx
                    .query(&sql.sweep, &[&lo, &hi, &stragglers, &(WALK as i64)])
                    .await?
                    .iter()
                    .map(|r| (r.get(0), r.get(1)))
                    .collect();
                floor.swept(hi, &found, started.elapsed(), Instant::now());
            }
            Ok(())
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look(xmin: i64, xmax: i64, walk: &[(i64, bool)], kept: &[i64]) -> Observation {
        Observation {
            xmin,
            xmax,
            retrying: false,
            walk: walk.to_vec(),
            kept: kept.to_vec(),
            claimed_past: None,
        }
    }

    #[test]
    fn with_no_fresh_row_left_the_floor_rises_past_what_was_claimed() {
        let mut floor = Floor::new(Instant::now());
        // The relay keeps up: the looks find no fresh row, only what it claimed tells.
        let idle = |xmin, xmax, claimed_past| Observation {
            claimed_past,
            ..look(xmin, xmax, &[], &[])
        };
        floor.observe(idle(100, 110, None));
        floor.observe(idle(110, 120, None));
        assert_eq!(floor.value(), i64::MIN, "nothing claimed, nothing known");
        floor.observe(idle(120, 130, Some(501)));
        floor.observe(idle(130, 140, Some(801)));
        assert_eq!(floor.value(), 501);
        // A row committed late below 801 is seen by the fence's look: the floor stops at it.
        floor.observe(look(140, 150, &[(700, false)], &[]));
        assert_eq!(floor.value(), 700);
        floor.observe(idle(150, 160, Some(1001)));
        // Held rows before what was claimed are listed as stragglers.
        floor.observe(Observation {
            claimed_past: Some(1201),
            ..look(160, 170, &[(900, true)], &[])
        });
        assert_eq!(floor.value(), 1001);
        assert_eq!(floor.stragglers(), [900]);
        floor.observe(Observation {
            claimed_past: Some(1301),
            ..look(170, 180, &[], &[900])
        });
        assert_eq!(floor.value(), 1201);
        assert_eq!(floor.stragglers(), [900]);
    }

    #[test]
    fn the_floor_waits_for_every_transaction_running_when_its_candidate_was_seen() {
        let mut floor = Floor::new(Instant::now());
        floor.observe(look(100, 110, &[(50, false), (51, false)], &[]));
        assert_eq!(
            floor.value(),
            i64::MIN,
            "a candidate is not adopted at once"
        );
        floor.observe(look(105, 120, &[(50, false), (51, false)], &[]));
        assert_eq!(
            floor.value(),
            i64::MIN,
            "xid 105..109 may still commit a row below 50"
        );
        floor.observe(look(110, 130, &[(60, false)], &[]));
        assert_eq!(
            floor.value(),
            50,
            "the first candidate, not the later look's 60"
        );
    }

    #[test]
    fn a_row_that_committed_late_keeps_the_floor_below_it() {
        let mut floor = Floor::new(Instant::now());
        // Row 40 is invisible at the first look (its transaction runs), visible at the next.
        floor.observe(look(100, 110, &[(50, false)], &[]));
        floor.observe(look(110, 120, &[(40, false), (50, false)], &[]));
        assert_eq!(floor.value(), 40);
    }

    #[test]
    fn held_back_rows_become_stragglers_and_the_floor_passes_them() {
        let mut floor = Floor::new(Instant::now());
        floor.observe(look(1, 2, &[(10, true), (11, true), (12, false)], &[]));
        floor.observe(look(2, 3, &[(10, true), (11, true), (12, false)], &[]));
        assert_eq!(floor.value(), 12);
        assert_eq!(floor.stragglers(), [10, 11]);
        // Straggler 10 was published meanwhile: the next look no longer keeps it.
        floor.observe(look(3, 4, &[(12, false)], &[11]));
        assert_eq!(floor.stragglers(), [11]);
    }

    #[test]
    fn a_candidate_is_not_replaced_while_it_waits_for_its_fence() {
        let mut floor = Floor::new(Instant::now());
        floor.observe(look(100, 110, &[(50, false)], &[]));
        // Under load a transaction from before 110 is always running at first...
        for xmin in 101..109 {
            floor.observe(look(xmin, xmin + 20, &[(50 + xmin, false)], &[]));
        }
        // ...and the first candidate is adopted as soon as they have ended.
        floor.observe(look(110, 140, &[(300, false)], &[]));
        assert_eq!(floor.value(), 50);
    }

    #[test]
    fn stragglers_beyond_the_cap_keep_the_floor_below_them() {
        let mut floor = Floor::new(Instant::now());
        let walk: Vec<(i64, bool)> = (0..WALK as i64).map(|i| (i, true)).collect();
        floor.observe(look(1, 2, &walk, &[]));
        floor.observe(look(2, 3, &walk, &[]));
        // Every row read was held back and the read was cut short: the floor moves to the
        // last row read, which stays above it.
        assert_eq!(floor.value(), STRAGGLER_CAP as i64);
        assert_eq!(floor.stragglers().len(), STRAGGLER_CAP);
    }

    #[test]
    fn an_empty_table_leaves_the_floor_where_it_is() {
        let mut floor = Floor::new(Instant::now());
        floor.observe(look(1, 2, &[(7, false)], &[]));
        floor.observe(look(2, 3, &[], &[]));
        assert_eq!(floor.value(), 7);
        floor.observe(look(3, 4, &[], &[]));
        floor.observe(look(4, 5, &[], &[]));
        assert_eq!(floor.value(), 7);
    }

    #[test]
    fn the_sweep_lowers_the_floor_to_a_row_found_below_it() {
        let start = Instant::now();
        let mut floor = Floor::new(start);
        floor.observe(look(1, 2, &[(1000, false)], &[]));
        floor.observe(look(2, 3, &[(1000, false)], &[]));
        assert_eq!(floor.value(), 1000);
        assert_eq!(floor.sweep_due(start), None, "not before the pause");
        let later = start + SWEEP_PAUSE;
        // The first step covers everything below where the process began.
        assert_eq!(floor.sweep_due(later), Some((i64::MIN, 1000)));
        floor.swept(
            1000,
            &[(5, true), (6, false)],
            Duration::from_millis(1),
            later,
        );
        assert_eq!(floor.value(), 6);
        assert_eq!(floor.stragglers(), [5]);
    }

    #[test]
    fn sweep_steps_adapt_their_span_and_stay_under_a_twentieth_of_the_time() {
        let start = Instant::now();
        let mut floor = Floor::new(start);
        floor.observe(look(1, 2, &[(0, false)], &[]));
        floor.observe(look(2, 3, &[(0, false)], &[]));
        floor.observe(look(3, 4, &[(10_000_000, false)], &[]));
        floor.observe(look(4, 5, &[(10_000_000, false)], &[]));
        assert_eq!(floor.value(), 10_000_000);
        let mut now = start + SWEEP_PAUSE;
        let (lo, hi) = floor.sweep_due(now).unwrap();
        assert_eq!((lo, hi), (i64::MIN, 0));
        floor.swept(hi, &[], Duration::from_millis(1), now);
        now += TICK;
        let (lo, hi) = floor.sweep_due(now).unwrap();
        assert_eq!(
            (lo, hi - lo),
            (0, SPAN_START * 2),
            "a fast step doubles the span"
        );
        let took = Duration::from_millis(40);
        floor.swept(hi, &[], took, now);
        assert_eq!(
            floor.sweep_due(now + took * 18),
            None,
            "spaced by 19x its duration"
        );
        let (lo2, hi2) = floor.sweep_due(now + took * 19).unwrap();
        assert_eq!((lo2, hi2 - lo2), (hi, SPAN_START), "a slow step halves it");
    }

    #[test]
    fn a_sweep_cycle_ends_at_the_floor_and_the_next_starts_after_a_pause() {
        let start = Instant::now();
        let mut floor = Floor::new(start);
        floor.observe(look(1, 2, &[(100, false)], &[]));
        floor.observe(look(2, 3, &[(100, false)], &[]));
        let now = start + SWEEP_PAUSE;
        let (_, hi) = floor.sweep_due(now).unwrap();
        floor.swept(hi, &[], Duration::from_millis(1), now);
        assert_eq!(floor.sweep_due(now + TICK), None);
        assert!(floor.sweep_due(now + SWEEP_PAUSE).is_some());
    }
}
