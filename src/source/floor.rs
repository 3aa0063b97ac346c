//! The claim's low-water mark: claims start at a remembered *floor* instead of the pending
//! index's left end, so their cost depends on the batch, not on the table's history.
//!
//! # Why
//!
//! A row published (deleted, or marked) leaves its entry in the pending index until VACUUM
//! removes it, and VACUUM removes nothing a snapshot still open anywhere may see: a report,
//! `pg_dump`, a forgotten `BEGIN`, a replica with `hot_standby_feedback`. A claim that
//! starts at the left end visits every such entry, and the heap tuple behind it, before the
//! first pending row: behind one held snapshot, a claim costs more with every row published
//! since, so each drain is slower than the last (benchmark E3 measures a new process
//! draining behind a held snapshot).
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
//! `next_attempt_at`) are found below the floor in `outbox_relay_held`. So a claim that
//! reads `id >= F`, plus `S`, plus the rows with a failure history below `F`, sees every
//! pending row: its window is still a prefix of the pending rows, and the head rule of
//! [`super::claim`] holds.
//! Stragglers are fresh rows held back by an earlier held row of their key (dead, or with a
//! failure history): the floor passes them rather than stay behind a dead row for days.
//! They are looked up by primary key, at most [`STRAGGLER_CAP`]; beyond that their keys are
//! withheld (see *Withheld keys*).
//!
//! # Raising the floor: a fence
//!
//! At each look (see *The pace*) the keeper reads the table in one snapshot: the first
//! fresh pending row from the floor on that is not held back (a *candidate* `c` for the
//! floor; when there is none, one past the highest id this process had claimed before the
//! look began: that row was committed before the look too, which is all the argument below
//! needs), the fresh
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
//! again later (`requeue`) get `next_attempt_at` and a row in `outbox_relay_held`.
//!
//! A candidate waits for its fence while batches run; it is not replaced by a newer one
//! meanwhile (under steady load some transaction is always running, and a fresher
//! candidate would never see its fence pass). The floor trails the newest pending row by
//! about one batch's duration plus a tick.
//!
//! # The pace: the floor costs what its process claims
//!
//! Every relay process keeps its own floor, and a look walks the index entries of the rows
//! published since the floor was last raised whose tuples are not yet dead to every
//! transaction (those of about the last batch's duration): a look costs about the same
//! whichever process makes it. Looking every [`TICK`] whatever the process claims, eight
//! relays of four workers on one table made eight times the looks of one relay, each
//! walking more blocks (benchmark S's statement profile showed it), and a fleet of
//! sidecars would load the database in proportion to its size. So while a table is active, its keeper looks every tick only
//! while its process claims at least [`LOOK_ROWS`] rows a tick; otherwise once its process
//! has claimed that many since the last look, and at least every [`MAX_TICK`] (or when a
//! sweep step is due; and every tick until its first floor is adopted, since until then
//! its claims walk the table from its start, unless its last look found no pending row:
//! an empty table has no floor to adopt and nothing a floor would spare its claims).
//! Relays sharing a table look about as often together as one relay alone. A process that
//! claims a small share of the table keeps a floor up to [`MAX_TICK`] behind, and its
//! claims walk the entries of that much more; those are mostly dead to every transaction
//! by then and skipped in the index without a heap visit.
//!
//! # Withheld keys: passing more held-back rows than can be listed
//!
//! One stuck Kafka partition holds back a third of the keys, tens of thousands of rows:
//! far more than [`STRAGGLER_CAP`]. With the floor kept below them, every claim walked
//! them and the entries of every row published above them, and the other keys flowed at a
//! fraction of their rate (benchmark K). So when a floor would list more stragglers than
//! the cap, it *withholds* their keys instead: a key `K` is listed once, with `w(K)`, the
//! lowest of its held-back rows below the floor, and claims leave alone every row of `K`
//! from `w(K)` on ([`FloorView::hides`]), wherever they read it. The invariant becomes:
//!
//! > Every fresh pending row with an id below `F` is in `S`, or is a row of a withheld key
//! > `K` with an id of at least `w(K)` (again except ids drawn before their xid).
//!
//! Why the claim's rule still holds: what a claim may see of any key is a *prefix* of the
//! key's pending rows in id order. For a key not withheld, nothing changed. For a
//! withheld key `K`, the claim sees exactly its pending rows below `w(K)`: the fresh ones
//! among them are in `S` (none of `K`'s fresh rows below `F` is unlisted below `w(K)`),
//! and its rows with a failure history are found in `outbox_relay_held`. Hiding is by id
//! alone, not by whether the key is still held, so no change to the table between the
//! keeper's look and a claim (a held row coming due, published, re-queued or deleted by
//! hand) can make a later row look like a head: the worst it does is leave `K` waiting.
//! A smaller `w(K)` only hides more, so `w(K)` may trail (the sweep lowers it when it
//! finds a row of `K` below it). While keys are withheld, a look also summarizes every
//! held-back row before its candidate by key (the key and its first such row), however
//! many there are, so one adoption withholds them all and passes them: listed row by row,
//! the floor moved at most [`STRAGGLER_CAP`] of them a look and trailed the claims.
//!
//! Releasing. A withheld key is released when no row of it below `w(K)` is dead or has
//! a failure history ([`TableSql::withheld_released`], checked every [`RELEASE_CHECK`]):
//! its held row was published, or deleted. The floor is then lowered to `w(K)` (always
//! safe), and `K`'s rows are read from the floor on again. While `K`'s held row is due but
//! not yet published, `K` stays withheld: a claim takes that row alone (it is `K`'s head:
//! everything of `K` before it is visible), and a row postponed again (its partition
//! still down) keeps `K` withheld without lowering the floor once a second.
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::sql::TableSql;
use super::{Source, SourceError};

/// How often the keeper looks at the table. The floor trails the newest pending row by
/// about a batch's duration plus a tick or two; with a snapshot held, every claim walks the
/// entries of the rows published in that time.
pub(crate) const TICK: Duration = Duration::from_millis(25);
/// While its process claims fewer rows than this a tick, the keeper looks only once its
/// process has claimed this many since its last look, or [`MAX_TICK`] after it (see
/// *The pace* in the module doc).
pub(crate) const LOOK_ROWS: u64 = 500;
/// The longest an active table's keeper goes without a look.
pub(crate) const MAX_TICK: Duration = Duration::from_millis(200);
/// Stragglers listed at most; beyond them their keys are withheld.
pub(crate) const STRAGGLER_CAP: usize = 1000;
/// Keys withheld at most; beyond them the floor stays below the rows it could not list.
pub(crate) const WITHHELD_CAP: usize = 10_000;
/// How often the keeper asks whether withheld keys were released.
pub(crate) const RELEASE_CHECK: Duration = Duration::from_millis(100);
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

/// What claims read: start at `value`; below it, read the stragglers and the rows with a failure history;
/// leave alone what [`FloorView::hides`].
#[derive(Debug, Clone)]
pub struct FloorView {
    pub(crate) value: i64,
    pub(crate) stragglers: Arc<[i64]>,
    /// Some pending row may have a failure history (`ordering = "none"` claims below the
    /// floor only then; key-ordered windows always look).
    pub(crate) retrying: bool,
    /// Withheld keys, each with the id from which its rows are hidden (see *Withheld
    /// keys*).
    pub(crate) withheld: Arc<HashMap<String, i64>>,
}

impl Default for FloorView {
    fn default() -> Self {
        FloorView {
            value: i64::MIN,
            stragglers: Arc::from([]),
            retrying: true,
            withheld: Arc::default(),
        }
    }
}

impl FloorView {
    /// Whether a claim must leave the row `id` of `key` alone: its key is withheld and the
    /// row is not below where the key's hidden rows start.
    pub(crate) fn hides(&self, key: Option<&str>, id: i64) -> bool {
        key.and_then(|k| self.withheld.get(k))
            .is_some_and(|from| id >= *from)
    }

    /// Where a count of every pending row must start: the floor, or the lowest row of a
    /// withheld key below it.
    pub(crate) fn lowest(&self) -> i64 {
        self.withheld
            .values()
            .fold(self.value, |low, w| low.min(*w))
    }
}

/// The floor of one table, shared by the keeper (who moves it) and the claims (who read it
/// and say how far they got).
#[derive(Debug)]
pub(crate) struct FloorCell {
    view: Mutex<FloorView>,
    /// The highest id a claim of this process has locked (`i64::MIN`: none yet).
    claimed: AtomicI64,
    /// Rows the claims of this process have locked, all told (the keeper's pace).
    claimed_rows: AtomicU64,
}

impl Default for FloorCell {
    fn default() -> Self {
        FloorCell {
            view: Mutex::default(),
            claimed: AtomicI64::new(i64::MIN),
            claimed_rows: AtomicU64::new(0),
        }
    }
}

impl FloorCell {
    pub(crate) fn view(&self) -> FloorView {
        self.view.lock().unwrap().clone()
    }

    /// A claim locked `rows` rows, up to `max`: committed rows, so every id drawn before
    /// it is committed, or belongs to a transaction running now (see *Raising the floor*).
    pub(crate) fn note_claimed(&self, max: Option<i64>, rows: usize) {
        if let Some(max) = max {
            self.claimed.fetch_max(max, AtomicOrdering::Relaxed);
        }
        self.claimed_rows
            .fetch_add(rows as u64, AtomicOrdering::Relaxed);
    }

    /// Rows claimed by this process so far.
    fn claimed_rows(&self) -> u64 {
        self.claimed_rows.load(AtomicOrdering::Relaxed)
    }

    /// One past the highest id claimed so far, if any.
    fn claimed_past(&self) -> Option<i64> {
        let claimed = self.claimed.load(AtomicOrdering::Relaxed);
        (claimed > i64::MIN).then(|| claimed.saturating_add(1))
    }

    /// A worker recorded a failure: rows with a failure history exist now.
    pub(crate) fn note_retrying(&self) {
        self.view.lock().unwrap().retrying = true;
    }

    fn publish(&self, floor: &Floor) {
        let mut view = self.view.lock().unwrap();
        view.value = floor.value;
        view.stragglers = floor.stragglers.iter().map(|(id, _)| *id).collect();
        view.retrying = floor.retrying;
        if *view.withheld != floor.withheld {
            view.withheld = Arc::new(floor.withheld.clone());
        }
    }
}

/// One look at the table from the floor, in one snapshot.
#[derive(Debug, Clone, Default)]
pub(crate) struct Observation {
    pub(crate) xmin: i64,
    pub(crate) xmax: i64,
    pub(crate) retrying: bool,
    /// Fresh pending rows from the floor on, in order, at most [`WALK`], each with whether
    /// an earlier held row of its key holds it back.
    pub(crate) walk: Vec<(i64, bool)>,
    /// The keys of the held-back rows of `walk`.
    pub(crate) keys: HashMap<i64, String>,
    /// When the floor withholds keys: every key with held-back rows before the candidate,
    /// with the first of them, however many there are (`walk` may be cut short).
    pub(crate) summary: Option<HashMap<String, i64>>,
    /// The stragglers still fresh and pending.
    pub(crate) kept: Vec<i64>,
    /// One past the highest id this process had claimed before the look began.
    pub(crate) claimed_past: Option<i64>,
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
pub(crate) struct Floor {
    value: i64,
    /// Listed held-back rows below the floor, with their keys.
    stragglers: Vec<(i64, String)>,
    /// Withheld keys, each with the first id of its hidden rows.
    withheld: HashMap<String, i64>,
    /// When the keeper next asks which withheld keys were released.
    release_at: Instant,
    retrying: bool,
    /// A proposed floor and the `xmax` of the snapshot that saw it.
    candidate: Option<(i64, i64)>,
    /// The first floor adopted: the sweep's first step covers everything below it.
    base: Option<i64>,
    /// The last look saw no pending row from the floor on: claims have nothing to walk
    /// there but dead index entries, so the keeper need not hurry to a first floor.
    empty: bool,
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
    pub(crate) fn new(now: Instant) -> Floor {
        Floor {
            value: i64::MIN,
            stragglers: Vec::new(),
            withheld: HashMap::new(),
            release_at: now,
            retrying: true,
            candidate: None,
            base: None,
            empty: false,
            sweep: Sweep {
                pos: None,
                span: SPAN_START,
                next_at: now + SWEEP_PAUSE,
            },
        }
    }

    pub(crate) fn value(&self) -> i64 {
        self.value
    }

    /// Claims walk no more than the keeper knows of: a floor was adopted, or the last look
    /// found no pending row from the floor on (an empty table has none to adopt, and its
    /// claims walk nothing that a floor would spare them).
    pub(crate) fn settled(&self) -> bool {
        self.value > i64::MIN || self.empty
    }

    /// Nothing for a look to do but a sweep: the last look found no pending row from the
    /// floor on, and no straggler, withheld key, candidate or sweep cycle is in progress.
    pub(crate) fn quiet(&self) -> bool {
        self.empty
            && self.stragglers.is_empty()
            && self.withheld.is_empty()
            && self.candidate.is_none()
            && self.sweep.pos.is_none()
    }

    /// The stragglers' ids.
    pub(crate) fn stragglers(&self) -> Vec<i64> {
        self.stragglers.iter().map(|(id, _)| *id).collect()
    }

    /// The withheld keys and where each one's hidden rows start.
    pub(crate) fn withheld(&self) -> &HashMap<String, i64> {
        &self.withheld
    }

    /// Takes in one look made from the current floor with the current stragglers.
    pub(crate) fn observe(&mut self, look: Observation) {
        self.retrying = look.retrying;
        self.empty = look.walk.is_empty();
        let value = self.value;
        let kept: std::collections::HashSet<i64> = look.kept.iter().copied().collect();
        self.stragglers
            .retain(|(id, _)| *id < value && kept.contains(id));
        let now_candidate = look.candidate();
        if let Some((candidate, xmax)) = self.candidate {
            if look.xmin >= xmax {
                self.candidate = None;
                let f = candidate.min(now_candidate.unwrap_or(i64::MAX));
                if let (true, Some(summary)) = (f > self.value, &look.summary) {
                    // Every fresh row of this look below `f` is held back, and its key is
                    // in the summary with its first such row.
                    self.withhold(f, summary);
                } else if f > self.value {
                    // Every row of this look below `f` is held back (f <= its candidate).
                    let held = look
                        .walk
                        .iter()
                        .map(|(id, _)| *id)
                        .filter(|id| *id < f)
                        .map(|id| (id, look.keys.get(&id).cloned().unwrap_or_default()));
                    let listed = self.stragglers.iter().cloned().chain(held).collect();
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

    /// Sets the floor to `value` and the stragglers to those of `listed` below it (rows of
    /// withheld keys from their hidden part on left out: they are hidden already). More
    /// than [`STRAGGLER_CAP`]: their keys are withheld instead, as long as no more than
    /// [`WITHHELD_CAP`] keys are; beyond that the floor stays at the first row past the
    /// cap.
    fn set(&mut self, mut value: i64, mut listed: Vec<(i64, String)>) {
        listed.retain(|(id, key)| *id < value && self.withheld.get(key).is_none_or(|w| id < w));
        listed.sort_unstable();
        listed.dedup();
        if listed.len() > STRAGGLER_CAP {
            let rows = listed.iter().map(|(id, key)| (key.as_str(), *id));
            if let Some(withheld) = self.with_hidden(rows) {
                self.withheld = withheld;
                listed.clear();
            } else {
                value = listed[STRAGGLER_CAP].0;
                listed.truncate(STRAGGLER_CAP);
            }
        }
        self.value = value;
        self.stragglers = listed;
    }

    /// Raises the floor to `f`, withholding every key of `summary` from its first held-back
    /// row, if no more than [`WITHHELD_CAP`] keys are withheld then; else leaves it.
    fn withhold(&mut self, f: i64, summary: &HashMap<String, i64>) {
        let rows = summary
            .iter()
            .filter(|(_, first)| **first < f)
            .map(|(key, first)| (key.as_str(), *first));
        if let Some(withheld) = self.with_hidden(rows) {
            self.withheld = withheld;
            self.value = f;
        }
    }

    /// The withheld keys with `rows`' keys hidden from those rows on too (each key from
    /// its lowest), unless that would withhold more than [`WITHHELD_CAP`] keys or a row
    /// has no key.
    fn with_hidden<'a>(
        &self,
        rows: impl Iterator<Item = (&'a str, i64)>,
    ) -> Option<HashMap<String, i64>> {
        let mut withheld = self.withheld.clone();
        for (key, id) in rows {
            let w = withheld.entry(key.to_owned()).or_insert(id);
            *w = (*w).min(id);
        }
        (withheld.len() <= WITHHELD_CAP && !withheld.contains_key("")).then_some(withheld)
    }

    /// Whether the next look should summarize held-back rows by key (keys are withheld).
    pub(crate) fn summarizing(&self) -> bool {
        !self.withheld.is_empty()
    }

    /// The withheld keys to ask about at `now`, if it is time: names, and where each one's
    /// hidden rows start.
    pub(crate) fn release_due(&mut self, now: Instant) -> Option<(Vec<String>, Vec<i64>)> {
        if self.withheld.is_empty() || now < self.release_at {
            return None;
        }
        self.release_at = now + RELEASE_CHECK;
        Some(self.withheld.iter().map(|(k, w)| (k.clone(), *w)).unzip())
    }

    /// Takes in the withheld keys found released: the floor goes down to the lowest of
    /// their hidden rows, and claims read them from there.
    pub(crate) fn released(&mut self, keys: &[String]) {
        for key in keys {
            if let Some(w) = self.withheld.remove(key) {
                self.value = self.value.min(w);
            }
        }
        let value = self.value;
        self.stragglers.retain(|(id, _)| *id < value);
    }

    /// Whether a sweep step is due at `now` (a look runs it).
    fn sweep_ready(&self, now: Instant) -> bool {
        self.base.is_some() && now >= self.sweep.next_at
    }

    /// The range of ids the next sweep step covers, if one is due at `now`.
    pub(crate) fn sweep_due(&mut self, now: Instant) -> Option<(i64, i64)> {
        if !self.sweep_ready(now) {
            return None;
        }
        let base = self.base?;
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
    /// are not stragglers yet, at most [`WALK`], each with whether it is held back and its
    /// key, and how long the step took.
    pub(crate) fn swept(
        &mut self,
        hi: i64,
        found: &[(i64, bool, Option<String>)],
        took: Duration,
        now: Instant,
    ) {
        let free = found.iter().find(|(_, held, _)| !held).map(|(id, ..)| *id);
        let held = found
            .iter()
            .filter(|(id, ..)| free.is_none_or(|f| *id < f))
            .map(|(id, _, key)| (*id, key.clone().unwrap_or_default()));
        let mut listed = self.stragglers.clone();
        for (id, key) in held {
            // A row of a withheld key below its hidden part: hide from it on.
            match self.withheld.get_mut(&key) {
                Some(w) => *w = (*w).min(id),
                None => listed.push((id, key)),
            }
        }
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
            (None, Some((last, ..))) if found.len() >= WALK => last.saturating_add(1),
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
pub(crate) const IDLE_TICK: Duration = Duration::from_secs(5);
/// How many idle ticks the keeper of a quiet table waits between looks ([`Floor::quiet`]):
/// a relay of hundreds of quiet tables would otherwise pay a look per table every tick.
const QUIET_TICKS: u32 = 6;

/// How fast the keeper goes: a look every [`TICK`] while the table is `active` (rows were
/// claimed or announced lately; fewer while this process claims little, see *The pace* in
/// the module doc), else every `idle_tick` ([`IDLE_TICK`] for `run`; never in `drain`,
/// where an idle table's rows are found by the drain's own look) or at a `poke`, and
/// [`QUIET_TICKS`] times as long while the floor is quiet ([`Floor::quiet`]). The floor
/// only saves claims work, so an idle table's floor may wait; the rows a quiet one may
/// leave behind until its next look are those the sweep exists for (ids drawn long before
/// their commit), on a table that no NOTIFY or claim has made active since. `lowered` is told when the sweep lowered the floor: a row is pending below
/// it, and claims should look.
pub(crate) struct Pace<'a> {
    pub(crate) active: &'a (dyn Fn() -> bool + Sync),
    pub(crate) poke: &'a tokio::sync::Notify,
    pub(crate) lowered: &'a (dyn Fn() + Sync),
    pub(crate) idle_tick: Option<Duration>,
}

impl Pace<'_> {
    /// How long the keeper of an idle table waits for its next look.
    fn idle(&self, floor: &Floor) -> Option<Duration> {
        match floor.quiet() {
            true => self.idle_tick.map(|tick| tick * QUIET_TICKS),
            false => self.idle_tick,
        }
    }
}

/// Sleeps for `tick`; never ends without one.
async fn sleep_some(tick: Option<Duration>) {
    match tick {
        Some(tick) => tokio::time::sleep(tick).await,
        None => std::future::pending().await,
    }
}

/// Keeps the floor of one table until `done`: a look every tick ([`Pace`]), sweep steps
/// when due. Failures are logged and retried at the next tick; meanwhile the floor stays
/// where it is, which is always safe.
pub(crate) async fn keep(
    table: &str,
    source: &Source,
    sql: &TableSql,
    cell: &FloorCell,
    pace: Pace<'_>,
    done: &tokio_util::sync::CancellationToken,
) {
    let mut floor = Floor::new(Instant::now());
    let mut failing = false;
    let mut shown = (floor.value(), 0, 0);
    // When the last look began, and how many rows this process had claimed by then.
    let mut looked = (Instant::now(), cell.claimed_rows());
    loop {
        let poked = pace.poke.notified();
        if (pace.active)() {
            tokio::select! {
                _ = done.cancelled() => return,
                _ = tokio::time::sleep(TICK) => {}
            }
            // Until its first floor is adopted, a process's claims walk the table from
            // its start: the keeper looks every tick then, unless the table had no
            // pending row at its last look (a quiet table at start-up, or one row now and
            // then: an empty table never gives a first floor, and a relay of many quiet
            // tables would look at each of them every tick while they count as active).
            let now = Instant::now();
            let claimed = cell.claimed_rows() - looked.1;
            if floor.settled()
                && claimed < LOOK_ROWS
                && now.duration_since(looked.0) < MAX_TICK
                && !floor.sweep_ready(now)
            {
                continue;
            }
        } else {
            tokio::select! {
                _ = done.cancelled() => return,
                _ = poked => {}
                _ = sleep_some(pace.idle(&floor)) => {}
            }
        }
        let before = floor.value();
        looked = (Instant::now(), cell.claimed_rows());
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
                let now = (
                    floor.value(),
                    floor.stragglers.len(),
                    floor.withheld().len(),
                );
                if now != shown {
                    shown = now;
                    tracing::debug!(
                        table,
                        floor = now.0,
                        stragglers = now.1,
                        withheld_keys = now.2,
                        "Claim floor moved"
                    );
                }
            }
            Err(e) => {
                // A table dropped: its relay lets it go with a WARN of its own (relay::discovery).
                if !std::mem::replace(&mut failing, true) && !e.is_missing_relation() {
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
            if let Some((keys, from)) = floor.release_due(Instant::now()) {
                let released: Vec<String> = tx
                    .query(&sql.withheld_released, &[&keys, &from])
                    .await?
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                floor.released(&released);
            }
            let stragglers = floor.stragglers();
            let summarizing = floor.summarizing();
            let row = tx
                .query_one(&sql.advance, &[&floor.value(), &stragglers, &summarizing])
                .await?;
            let candidate: Option<i64> = row.get(3);
            let held: Vec<i64> = row.get(4);
            let held_keys: Vec<Option<String>> = row.get(6);
            let summary = summarizing.then(|| {
                let keys: Option<Vec<Option<String>>> = row.get(7);
                let firsts: Option<Vec<i64>> = row.get(8);
                keys.unwrap_or_default()
                    .into_iter()
                    .zip(firsts.unwrap_or_default())
                    .filter_map(|(k, f)| Some((k?, f)))
                    .collect()
            });
            // Rows beyond a cut-short list of held rows were not seen: no candidate then
            // (unless the summary saw them all).
            let candidate = candidate.filter(|_| summarizing || held.len() < WALK);
            let keys = held
                .iter()
                .zip(held_keys)
                .filter_map(|(id, key)| Some((*id, key?)))
                .collect();
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
                keys,
                summary,
                kept: row.get(5),
                claimed_past,
            });
            if let Some((lo, hi)) = floor.sweep_due(Instant::now()) {
                let started = Instant::now();
                let stragglers = floor.stragglers();
                let found: Vec<(i64, bool, Option<String>)> = tx
                    .query(&sql.sweep, &[&lo, &hi, &stragglers, &(WALK as i64)])
                    .await?
                    .iter()
                    .map(|r| (r.get(0), r.get(1), r.get(2)))
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
            keys: walk.iter().map(|(id, _)| (*id, format!("k{id}"))).collect(),
            summary: None,
            kept: kept.to_vec(),
            claimed_past: None,
        }
    }

    /// A look whose held-back rows `ids` belong to keys `k0`, `k1`, `k2` by id modulo 3,
    /// then the free row `free`; every straggler kept.
    fn keyed_look(xmin: i64, ids: std::ops::Range<i64>, free: i64, kept: &[i64]) -> Observation {
        let walk: Vec<(i64, bool)> = ids
            .clone()
            .map(|id| (id, true))
            .chain([(free, false)])
            .collect();
        Observation {
            keys: ids.map(|id| (id, format!("k{}", id % 3))).collect(),
            ..look(xmin, xmin + 1, &walk, kept)
        }
    }

    #[test]
    fn held_back_rows_beyond_the_cap_withhold_their_keys_and_the_floor_passes_them() {
        let mut floor = Floor::new(Instant::now());
        floor.observe(keyed_look(1, 0..600, 600, &[]));
        floor.observe(keyed_look(2, 0..600, 600, &[]));
        assert_eq!(floor.value(), 600);
        assert_eq!(floor.stragglers().len(), 600);
        let kept: Vec<i64> = (0..600).collect();
        floor.observe(keyed_look(3, 600..1200, 1200, &kept));
        floor.observe(keyed_look(4, 600..1200, 1200, &kept));
        assert_eq!(floor.value(), 1200, "past 1,200 held-back rows");
        assert!(floor.stragglers().is_empty(), "no row listed");
        let withheld: std::collections::BTreeMap<_, _> =
            floor.withheld().clone().into_iter().collect();
        assert_eq!(
            withheld,
            [
                ("k0".to_owned(), 0),
                ("k1".to_owned(), 1),
                ("k2".to_owned(), 2)
            ]
            .into(),
            "each key hidden from its lowest held-back row"
        );
        // Later held-back rows of withheld keys are hidden already: nothing to list.
        floor.observe(keyed_look(5, 1200..1500, 1500, &[]));
        floor.observe(keyed_look(6, 1200..1500, 1500, &[]));
        assert_eq!(floor.value(), 1500);
        assert!(floor.stragglers().is_empty());
    }

    #[test]
    fn with_keys_withheld_a_look_summarized_by_key_moves_the_floor_past_every_held_row() {
        let mut floor = Floor::new(Instant::now());
        floor.observe(keyed_look(1, 0..1200, 1200, &[]));
        floor.observe(keyed_look(2, 0..1200, 1200, &[]));
        assert!(floor.summarizing());
        // 50,000 held-back rows before the next free row: more than a walk lists, all
        // summarized by key (k3 new).
        let summarized = |xmin| Observation {
            summary: Some([("k1".to_owned(), 1201), ("k3".to_owned(), 1203)].into()),
            ..look(xmin, xmin + 1, &[(51_200, false)], &[])
        };
        floor.observe(summarized(3));
        floor.observe(summarized(4));
        assert_eq!(floor.value(), 51_200);
        assert_eq!(floor.withheld()["k1"], 1, "already hidden from lower");
        assert_eq!(floor.withheld()["k3"], 1203);
        assert!(floor.stragglers().is_empty());
    }

    #[test]
    fn a_released_key_lowers_the_floor_to_its_hidden_rows() {
        let start = Instant::now();
        let mut floor = Floor::new(start);
        floor.observe(keyed_look(1, 0..1200, 1200, &[]));
        floor.observe(keyed_look(2, 0..1200, 1200, &[]));
        assert_eq!(floor.withheld().len(), 3);
        let (keys, from) = floor.release_due(start).expect("asked at once");
        assert_eq!(keys.len(), 3);
        assert_eq!(
            keys.iter()
                .map(|k| &k[1..])
                .map(|n| n.parse::<i64>().unwrap())
                .collect::<Vec<_>>(),
            from
        );
        assert!(
            floor.release_due(start).is_none(),
            "not again before RELEASE_CHECK"
        );
        floor.released(&["k1".to_owned()]);
        assert_eq!(
            floor.value(),
            1,
            "k1's rows are read from its first hidden row"
        );
        assert!(!floor.withheld().contains_key("k1"));
        assert!(floor.release_due(start + RELEASE_CHECK).is_some());
    }

    #[test]
    fn the_sweep_lowers_a_withheld_keys_hidden_part_to_a_row_it_finds_below() {
        let start = Instant::now();
        let mut floor = Floor::new(start);
        floor.observe(keyed_look(1, 100..1300, 1300, &[]));
        floor.observe(keyed_look(2, 100..1300, 1300, &[]));
        assert_eq!(floor.withheld()["k1"], 100);
        let later = start + SWEEP_PAUSE;
        let (_, hi) = floor.sweep_due(later).unwrap();
        floor.swept(
            hi,
            &[(10, true, Some("k1".into())), (11, true, Some("x".into()))],
            Duration::from_millis(1),
            later,
        );
        assert_eq!(floor.withheld()["k1"], 10);
        assert_eq!(floor.stragglers(), [11], "a key not withheld is listed");
        assert_eq!(floor.value(), 1300);
    }

    #[test]
    fn a_view_hides_a_withheld_keys_rows_from_its_hidden_part_on() {
        let view = FloorView {
            withheld: Arc::new([("k".to_owned(), 50)].into()),
            value: 100,
            ..FloorView::default()
        };
        assert!(!view.hides(Some("k"), 49), "below: visible");
        assert!(view.hides(Some("k"), 50));
        assert!(view.hides(Some("k"), 500), "above the floor too");
        assert!(!view.hides(Some("other"), 500));
        assert!(!view.hides(None, 500));
        assert_eq!(view.lowest(), 50, "counts start at the hidden rows");
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
    fn stragglers_beyond_the_cap_keep_the_floor_below_them_when_no_more_keys_can_be_withheld() {
        let mut floor = Floor::new(Instant::now());
        floor.withheld = (0..WITHHELD_CAP).map(|n| (format!("w{n}"), -1)).collect();
        // 1,200 held-back rows of 1,200 other keys: more stragglers than the cap, and more
        // keys than may be withheld.
        let walk: Vec<(i64, bool)> = (0..1200)
            .map(|i| (i, true))
            .chain([(1200, false)])
            .collect();
        floor.observe(look(1, 2, &walk, &[]));
        floor.observe(look(2, 3, &walk, &[]));
        assert_eq!(
            floor.value(),
            STRAGGLER_CAP as i64,
            "stays at the first row not listed"
        );
        assert_eq!(floor.stragglers().len(), STRAGGLER_CAP);
        assert_eq!(floor.withheld().len(), WITHHELD_CAP);
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
    fn a_floor_is_quiet_only_with_nothing_left_to_do_but_sweep() {
        let mut floor = Floor::new(Instant::now());
        assert!(!floor.quiet(), "no look yet");
        floor.observe(look(1, 2, &[(7, false)], &[]));
        assert!(
            !floor.quiet(),
            "a pending row, a candidate waiting for its fence"
        );
        floor.observe(look(2, 3, &[], &[]));
        assert_eq!(floor.value(), 7);
        assert!(floor.quiet(), "adopted, and nothing pending from it on");
        floor.observe(look(3, 4, &[(9, true), (10, false)], &[]));
        assert!(!floor.quiet(), "rows again");
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
            &[(5, true, Some("k".into())), (6, false, Some("k".into()))],
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
