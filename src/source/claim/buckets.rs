//! Buckets: where a claim of a deep backlog looks past its first window. One statement
//! takes the first free buckets and locks their first rows ([`take_buckets`]);
//! [`BucketDepth`] remembers how deep buckets have been lately, how many to ask for, and
//! which lanes are surplus. See *Buckets* and *Round trips* in the parent module's doc.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Mutex;

use tokio_postgres::Row;

use super::super::sql::{RowLayout, TableSql, BUCKETS};
use super::super::{SourceError, Tx};
use super::plan::{plan_locked, Candidate, KeyPlan};
use super::{ClaimedRow, FloorView};

/// What [`take_buckets`] found.
pub(super) struct Picks {
    /// Its first pick got no bucket: other claimers hold every one asked for.
    pub(super) none_free: bool,
    /// Some bucket it got had rows to plan.
    pub(super) saw_rows: bool,
}

/// The buckets a claim tries, and what of its first window their reads take again.
pub(super) struct Pick {
    /// The buckets to try, in order.
    pub(super) candidates: Vec<i32>,
    /// Where the first window ended ([`super::FIRST_WINDOW`] when the claim read none): a bucket
    /// read's rows up to it of keys the plan already met are theirs (planned, or left to
    /// others) and dropped.
    pub(super) after: i64,
    /// Room added per bucket for those rows.
    pub(super) reread: usize,
    /// Bytes added for them to what a pick may lock.
    pub(super) reread_bytes: u64,
}

/// Takes buckets (see *Buckets* in the module doc) from `pick`'s candidates, in order, for
/// the room `plan` has left, and plans and locks their rows; at most [`MAX_PICKS`] picks.
pub(super) async fn take_buckets(
    tx: &Tx<'_>,
    sql: &TableSql,
    plan: &mut KeyPlan,
    rows: &mut HashMap<i64, ClaimedRow>,
    pick: Pick,
    floor: &FloorView,
    depth: &BucketDepth,
) -> Result<Picks, SourceError> {
    let Pick {
        mut candidates,
        after,
        reread,
        reread_bytes,
    } = pick;
    let mut picks = 0;
    let mut found = Picks {
        none_free: false,
        saw_rows: false,
    };
    while plan.has_room() && !candidates.is_empty() && picks < MAX_PICKS {
        picks += 1;
        let room = plan.room();
        let want = depth.buckets_for(room);
        let (per_bucket, cap) = pick_limits(plan, room, want, reread, reread_bytes);
        let read = (&candidates, after, floor);
        let Picked {
            window,
            got,
            tried,
            locked,
        } = pick_lock(tx, sql, read, per_bucket, want, cap).await?;
        // The read starts at the floor, in its own snapshot: its rows up to the first
        // window's end of keys this claim met there are theirs already (planned, or
        // left to others); those of other keys are their heads now.
        let window: Vec<Candidate> = window
            .into_iter()
            .filter(|c| c.id > after || c.key.as_deref().is_some_and(|k| !plan.knows(k)))
            .filter(|c| !floor.hides(c.key.as_deref(), c.id))
            .collect();
        if got.is_empty() {
            found.none_free = picks == 1;
            break;
        }
        found.saw_rows |= !window.is_empty();
        // Buckets before the last one got were tried and are held elsewhere.
        let last = candidates.iter().position(|b| Some(b) == got.last());
        candidates.drain(..=last.unwrap_or(candidates.len() - 1));
        let keys = window
            .iter()
            .filter_map(|c| c.key.as_deref())
            .collect::<HashSet<_>>()
            .len();
        let before = plan.reserved;
        // A bucket read's rows planned partly are fine: its keys get no later rows. The
        // rows it locked are known: the rounds are planned without another statement.
        let locked_ids: HashSet<i64> = locked.keys().copied().collect();
        rows.extend(locked);
        plan_locked(plan, &window, &tried, &locked_ids);
        depth.observe(got.len(), keys, plan.reserved - before, room);
        // Fewer buckets than asked for: the pick tried every candidate and the others are
        // held elsewhere, so another pick would try the same ones again, and under
        // contention mostly get none (benchmark S). The batch goes with what it has.
        if got.len() < want {
            break;
        }
    }
    Ok(found)
}

/// Runs [`TableSql::pick_lock`] once: of the buckets `candidates` (in order), takes the
/// first `want` free ones and reads at most `per_bucket` rows of each from the floor on
/// (again up to `after`), and locks the first of them within `cap`.
async fn pick_lock(
    tx: &Tx<'_>,
    sql: &TableSql,
    (candidates, after, floor): (&Vec<i32>, i64, &FloorView),
    per_bucket: usize,
    want: usize,
    cap: Candidates,
) -> Result<Picked, SourceError> {
    let stragglers: &[i64] = &floor.stragglers;
    let read = tx
        .query(
            &sql.pick_lock,
            &[
                &after,
                &(per_bucket as i64),
                candidates,
                &floor.value,
                &stragglers,
                &sql.tag,
                &(want as i64),
                &(cap.rows as i64),
                &(cap.bytes.min(i64::MAX as u64) as i64),
            ],
        )
        .await?;
    Ok(Picked::split(&read, &sql.layout, cap))
}

/// How many rows one pick of `want` buckets reads per bucket, and how many of them it
/// locks, with `room` rows left in `plan` and `reread` rows (`reread_bytes` bytes) of the
/// first window read again.
fn pick_limits(
    plan: &KeyPlan,
    room: usize,
    want: usize,
    reread: usize,
    reread_bytes: u64,
) -> (usize, Candidates) {
    // A bucket's share of the room, and at least a quarter of the room, so that a few
    // buckets fill the batch (other claimers may hold most of the buckets asked for:
    // with an eighth of the room a bucket, a claim after a database restart took
    // batches far below the batch size), not so many that a pick of many buckets
    // reads many batches (with half the room at least and a third of the keys held back,
    // a pick read several times the rows it locked; a quarter of the room read less and
    // let the other keys' rows flow faster in benchmark K). Twice the share read and
    // sent back several rows for each one a single relay's claims took, and cost it
    // more database time a row than the claims before buckets (benchmark S, 1 x 4).
    // Up to the rows it may lock (a quarter more than the room): a bucket whose keys
    // are partly held elsewhere still fills the batch in one pick, where reading at
    // most the room needed a second pick (and round trip) more often (benchmark L).
    let per_bucket = room
        .div_ceil(want)
        .max(room / 4)
        .min(room + room / 4)
        .max(1)
        + reread;
    // The rows the statement locks, and sends back with their payloads: the batch's
    // room and a quarter more, in id order, within the bytes it has left (a quarter
    // more too), so the answer stays within the budget (more only when the keys met
    // first are held elsewhere), and the rows of known keys it reads again.
    let cap = Candidates {
        rows: room + room / 4 + reread,
        bytes: plan
            .bytes_left()
            .saturating_add(plan.bytes_left() / 4)
            .saturating_add(reread_bytes)
            .max(1),
    };
    (per_bucket, cap)
}

/// Every bucket, those of `window`'s rows first in the order of their first row (the
/// oldest work first), then the others.
pub(super) fn ranked_buckets(window: &[Candidate]) -> Vec<i32> {
    let mut seen = [false; BUCKETS as usize];
    let mut ranked = Vec::with_capacity(BUCKETS as usize);
    for b in window
        .iter()
        .map(|c| c.bucket)
        .chain(0..BUCKETS)
        .filter(|b| (0..BUCKETS).contains(b))
    {
        if !std::mem::replace(&mut seen[b as usize], true) {
            ranked.push(b);
        }
    }
    ranked
}

/// The most rows of `window` in any one bucket.
pub(super) fn most_in_one_bucket(window: &[Candidate]) -> usize {
    let mut counts = [0usize; BUCKETS as usize];
    for c in window.iter().filter(|c| (0..BUCKETS).contains(&c.bucket)) {
        counts[c.bucket as usize] += 1;
    }
    counts.into_iter().max().unwrap_or(0)
}

/// How many of a pick's rows it tries to lock (see [`TableSql::pick_lock`]): the first in
/// id order, at most `rows` rows and `bytes` payload bytes (the first whatever its size).
#[derive(Debug, Clone, Copy)]
struct Candidates {
    rows: usize,
    bytes: u64,
}

impl Candidates {
    /// The rows of `window` (in id order) the statement tried, as it chose them.
    fn of(self, window: &[Candidate]) -> HashSet<i64> {
        debug_assert!(window.is_sorted_by_key(|c| c.id));
        let mut run: u64 = 0;
        let mut chosen = HashSet::new();
        for (n, Candidate { id, size, .. }) in window.iter().enumerate() {
            if n >= self.rows || run >= self.bytes {
                break;
            }
            run = run.saturating_add(*size);
            chosen.insert(*id);
        }
        chosen
    }
}

/// What one [`TableSql::pick_lock`] read, locked and got.
struct Picked {
    /// The rows read, in id order.
    window: Vec<Candidate>,
    /// The buckets got, in the order they were got.
    got: Vec<i32>,
    /// The rows the statement tried to lock: the first of `window` in id order.
    tried: HashSet<i64>,
    /// The rows it locked.
    locked: HashMap<i64, ClaimedRow>,
}

impl Picked {
    /// Splits a pick's answer: a row locked has its columns first (the rest NULL), a row
    /// read its four columns last (the rest NULL), a bucket got only its bucket.
    fn split(read: &[Row], layout: &RowLayout, cap: Candidates) -> Picked {
        let at = layout.width();
        let mut picked = Picked {
            window: Vec::new(),
            got: Vec::new(),
            tried: HashSet::new(),
            locked: HashMap::new(),
        };
        for r in read {
            if r.get::<_, Option<i64>>(0).is_some() {
                let row = ClaimedRow::from_row(r, layout);
                picked.locked.insert(row.id, row);
            } else if r.get::<_, Option<i64>>(at).is_some() {
                picked.window.push(Candidate::from_row_at(r, at));
            } else {
                picked.got.push(r.get(at + 3));
            }
        }
        picked.window.sort_unstable_by_key(|c| c.id);
        picked.tried = cap.of(&picked.window);
        picked
    }
}

/// What this process has seen of a table's buckets lately, from its picks: how many
/// buckets a claim asks for at once. Two needs set it. Rows: a bucket that filled a batch
/// alone asks for one; a backlog spread thin asks for several, so a middling backlog does
/// not cost one statement per bucket. Keys: a batch of few keys is sent in many waves (a
/// key's next row waits for its last one's ack on NATS, see `relay::order`), so a claim
/// asks for enough buckets to hold about one key per [`ROWS_PER_KEY`] rows of room (at
/// least [`MIN_KEYS`]): on a few hot keys, one bucket a claim sent each batch as one wave
/// per row, slower than the claim before buckets, which took every key at once
/// (benchmark S, 20 keys); [`MIN_KEYS`] alone still sent small batches on a few dozen keys
/// in several times the waves a claim of every key needs, too slow for
/// `faults::postgres_restarted_…` to drain in a loaded CI run.
///
/// It also remembers which lanes are *surplus* (their last claim of a deep backlog found
/// every bucket, or every key it met, taken) and the buckets the last deep first window
/// met, oldest work first: a surplus lane tries those buckets before anything else (see
/// [`claim_as_surplus`]).
#[derive(Debug, Default)]
pub struct BucketDepth {
    /// Rows the last pick took per bucket got (0: unknown yet).
    rows_per_bucket: AtomicUsize,
    /// Keys per bucket got in the last pick, times 16 (0: unknown yet).
    keys_per_bucket_x16: AtomicUsize,
    /// Bit `lane % 64`: that lane's last claim was contended.
    surplus: AtomicU64,
    /// The last deep first window's bucket ranking ([`ranked_buckets`]).
    recent: Mutex<Vec<i32>>,
    /// The last first window read was deep (it did not hold every pending row).
    deep: AtomicBool,
}

fn lane_bit(lane: usize) -> u64 {
    1 << (lane % 64)
}

/// Buckets one pick takes at most: all of them.
const MAX_PICK: usize = BUCKETS as usize;
/// Picks per claim at most.
pub(super) const MAX_PICKS: usize = 4;
/// A claim aims at one key per this many rows of room (a batch in about this many waves),
/// when there are that many keys.
const ROWS_PER_KEY: usize = 4;
/// And at this many keys at least.
const MIN_KEYS: usize = 16;

impl BucketDepth {
    /// Buckets to ask for to fill `room` rows.
    pub(super) fn buckets_for(&self, room: usize) -> usize {
        let by_rows = match self.rows_per_bucket.load(AtomicOrdering::Relaxed) {
            0 => 1,
            per => room.div_ceil(per),
        };
        let by_keys = match self.keys_per_bucket_x16.load(AtomicOrdering::Relaxed) {
            0 => 1,
            per => ((room / ROWS_PER_KEY).max(MIN_KEYS) * 16).div_ceil(per),
        };
        by_rows.max(by_keys).clamp(1, MAX_PICK)
    }

    /// Whether `lane`'s last claim was contended.
    pub(super) fn is_surplus(&self, lane: usize) -> bool {
        self.surplus.load(AtomicOrdering::Relaxed) & lane_bit(lane) != 0
    }

    /// Records whether `lane`'s claim was contended.
    pub(super) fn note_claim(&self, lane: usize, contended: bool) {
        if contended {
            self.surplus
                .fetch_or(lane_bit(lane), AtomicOrdering::Relaxed);
        } else {
            self.surplus
                .fetch_and(!lane_bit(lane), AtomicOrdering::Relaxed);
        }
    }

    /// Records whether the last first window read was deep.
    pub(super) fn note_deep(&self, deep: bool) {
        self.deep.store(deep, AtomicOrdering::Relaxed);
    }

    /// Whether the last first window read was deep and a pick has shown how many buckets
    /// fill a batch: lanes above 0 claim buckets first then.
    pub(super) fn is_deep(&self) -> bool {
        self.deep.load(AtomicOrdering::Relaxed)
            && self.rows_per_bucket.load(AtomicOrdering::Relaxed) > 0
    }

    /// Remembers the ranking of a deep first window ([`ranked_buckets`]).
    pub(super) fn remember_ranking(&self, ranked: &[i32]) {
        let mut recent = self.recent.lock().unwrap();
        recent.clear();
        recent.extend_from_slice(ranked);
    }

    /// The order a surplus claim tries buckets in: the last deep first window's ranking
    /// (the buckets it met, oldest work first, then every other one); every bucket in
    /// order before any was remembered.
    pub(super) fn probe_ranking(&self) -> Vec<i32> {
        let recent = self.recent.lock().unwrap();
        match recent.is_empty() {
            true => (0..BUCKETS).collect(),
            false => recent.clone(),
        }
    }

    /// A pick got `buckets` holding `keys`, and the claim took `taken` rows of them, with
    /// `room` left before.
    pub(super) fn observe(&self, buckets: usize, keys: usize, taken: usize, room: usize) {
        let buckets = buckets.max(1);
        // A bucket that filled the batch may be deeper still: count it as full.
        let per = if taken >= room {
            room
        } else {
            (taken / buckets).max(1)
        };
        self.rows_per_bucket.store(per, AtomicOrdering::Relaxed);
        self.keys_per_bucket_x16
            .store((keys * 16 / buckets).max(1), AtomicOrdering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_picks_candidates_are_its_first_rows_within_rows_and_bytes() {
        let w: Vec<Candidate> = [(1, 100), (2, 100), (3, 900), (4, 100), (5, 100)]
            .into_iter()
            .map(|(id, size)| Candidate {
                id,
                key: Some("k".into()),
                size,
                bucket: 0,
            })
            .collect();
        let of = |rows, bytes| {
            let mut ids: Vec<i64> = Candidates { rows, bytes }.of(&w).into_iter().collect();
            ids.sort_unstable();
            ids
        };
        assert_eq!(of(3, u64::MAX), vec![1, 2, 3]);
        // Row 3 starts below 250 bytes and is taken whatever its size; row 4 is not.
        assert_eq!(of(10, 250), vec![1, 2, 3]);
        assert_eq!(of(10, 200), vec![1, 2]);
        assert_eq!(of(10, 1), vec![1], "a first row whatever its size");
    }

    /// A pick reads about the room it has, spread over the buckets it asks for, not a
    /// multiple of it: the rows it reads past what it locks are sent back and cost the
    /// database for nothing.
    #[test]
    fn a_pick_reads_about_its_room_over_the_buckets_it_asks_for() {
        let plan = KeyPlan::new(super::super::Budget {
            rows: 500,
            bytes: u64::MAX,
        });
        let read = |want: usize, reread: usize| {
            let (per_bucket, cap) = pick_limits(&plan, 500, want, reread, 0);
            (per_bucket * want, cap.rows)
        };
        assert_eq!(read(4, 0), (500, 625), "a quarter of the room a bucket");
        assert_eq!(read(2, 0), (500, 625));
        assert_eq!(read(1, 0), (500, 625), "the room from one bucket");
        assert_eq!(
            read(16, 0),
            (16 * 125, 625),
            "at least a quarter of the room a bucket"
        );
        assert_eq!(read(4, 10), (540, 635), "and the first window's rows again");
    }

    #[test]
    fn buckets_are_ranked_by_their_oldest_row_then_the_rest() {
        let w: Vec<Candidate> = [(1, 5), (2, 3), (3, 5), (4, 9)]
            .iter()
            .map(|&(id, bucket)| Candidate {
                id,
                key: Some(format!("k{bucket}").into()),
                size: 1,
                bucket,
            })
            .collect();
        let ranked = ranked_buckets(&w);
        assert_eq!(&ranked[..5], &[5, 3, 9, 0, 1]);
        assert_eq!(ranked.len(), BUCKETS as usize, "every bucket, once");
    }

    #[test]
    fn a_claim_asks_for_more_buckets_when_they_are_thin_or_hold_few_keys() {
        let depth = BucketDepth::default();
        assert_eq!(depth.buckets_for(500), 1, "nothing seen yet");
        // One bucket filled the batch with 31 keys: enough buckets for 125 keys (500 rows
        // in about 4 waves).
        depth.observe(1, 31, 500, 500);
        assert_eq!(depth.buckets_for(500), 5);
        // Two buckets gave 40 rows: a batch needs 25 such buckets.
        depth.observe(2, 40, 40, 500);
        assert_eq!(depth.buckets_for(500), 25);
        // One hot key filled a bucket: every bucket (at most 64).
        depth.observe(1, 1, 500, 500);
        assert_eq!(depth.buckets_for(500), 64);
        // A batch of 100 in buckets of 4 keys: 25 keys, 7 buckets.
        depth.observe(4, 16, 100, 100);
        assert_eq!(depth.buckets_for(100), 7);
    }

    #[test]
    fn a_lane_is_surplus_from_a_contended_claim_until_it_takes_rows() {
        let depth = BucketDepth::default();
        assert!(!depth.is_surplus(3));
        depth.note_claim(3, true);
        assert!(depth.is_surplus(3));
        assert!(!depth.is_surplus(2), "lanes are marked apart");
        depth.note_claim(2, true);
        depth.note_claim(3, false);
        assert!(!depth.is_surplus(3));
        assert!(depth.is_surplus(2));
    }

    #[test]
    fn a_surplus_claim_tries_the_buckets_the_last_deep_window_met_first() {
        let depth = BucketDepth::default();
        assert_eq!(depth.probe_ranking(), (0..BUCKETS).collect::<Vec<_>>());
        let first: Vec<Candidate> = [9, 2, 40]
            .into_iter()
            .enumerate()
            .map(|(id, bucket)| Candidate {
                id: id as i64,
                key: Some(format!("k{bucket}").into()),
                size: 1,
                bucket,
            })
            .collect();
        depth.remember_ranking(&ranked_buckets(&first));
        let ranked = depth.probe_ranking();
        assert_eq!(&ranked[..5], &[9, 2, 40, 0, 1]);
        assert_eq!(ranked.len(), BUCKETS as usize, "every bucket, once");
    }
}
