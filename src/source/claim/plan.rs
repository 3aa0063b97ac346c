//! The pure part of a key-ordered claim: [`KeyPlan`] decides which heads to lock and
//! which rows follow them, from the rows a window read and the locks a statement got.
//! No I/O here; the tests below prove the head rule on it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::Budget;

/// Lock rounds per claim: each round locks the heads planned from what is left.
pub(super) const MAX_ROUNDS: usize = 8;

/// Plans `window`, whose rows in `tried` were locked (those in `locked`) by the statement
/// that read it, in rounds as [`lock_rounds`] does, without a statement: a head that was
/// not tried counts as held elsewhere (its key is blocked); a tail that was not tried
/// stays for the claim's last statement.
pub(super) fn plan_locked(
    plan: &mut KeyPlan,
    window: &[Candidate],
    tried: &HashSet<i64>,
    locked: &HashSet<i64>,
) {
    let mut cursor = 0;
    let mut rounds = 0;
    while plan.has_room() && cursor < window.len() && rounds < MAX_ROUNDS {
        if plan.plan_round(window, &mut cursor).is_empty() {
            break;
        }
        rounds += 1;
        plan.tails_tried_where(|id| tried.contains(&id));
        plan.settle_round(locked);
    }
}

/// A pending row seen in a window: its id, key, size and bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) id: i64,
    /// Shared by the claim's maps of keys, not copied into them.
    pub(crate) key: Option<Arc<str>>,
    /// Payload bytes.
    pub(crate) size: u64,
    /// The key's bucket ([`super::super::sql::bucket_of`]; by id for a row without a key).
    pub(crate) bucket: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyState {
    /// Head planned in the current round, lock not yet tried.
    Planned { head: i64 },
    /// Head locked by this transaction.
    Owned { head: i64 },
    /// Head locked by someone else, or seen in an earlier window and not owned.
    Blocked,
}

/// The pure part of a key-ordered claim: which heads to lock, which rows follow them.
#[derive(Debug)]
pub(crate) struct KeyPlan {
    capacity: usize,
    pub(super) reserved: usize,
    /// Payload bytes the batch may take, and those reserved so far.
    byte_budget: u64,
    bytes: u64,
    /// The next row did not fit the byte budget: planning stops until rows are released.
    full: bool,
    /// Sizes of the rows reserved.
    sizes: HashMap<i64, u64>,
    keys: HashMap<Arc<str>, KeyState>,
    /// Rows after the head, per key, in id order.
    tails: HashMap<Arc<str>, Vec<i64>>,
    /// Tail rows a lock statement has tried (sent), and those it got.
    tried: HashSet<i64>,
    locked_tails: HashSet<i64>,
    /// Rows without a key locked so far.
    unkeyed: Vec<i64>,
    /// Rows without a key planned in the current round.
    unkeyed_planned: Vec<i64>,
}

impl KeyPlan {
    pub(crate) fn new(budget: Budget) -> KeyPlan {
        KeyPlan {
            capacity: budget.rows,
            reserved: 0,
            byte_budget: budget.bytes,
            bytes: 0,
            full: false,
            sizes: HashMap::new(),
            keys: HashMap::new(),
            tails: HashMap::new(),
            tried: HashSet::new(),
            locked_tails: HashSet::new(),
            unkeyed: Vec::new(),
            unkeyed_planned: Vec::new(),
        }
    }

    pub(crate) fn has_room(&self) -> bool {
        self.reserved < self.capacity && !self.full
    }

    /// Rows the batch may still take.
    pub(crate) fn room(&self) -> usize {
        self.capacity - self.reserved
    }

    /// Reserves `row`'s bytes, unless they do not fit beside rows already reserved (the
    /// first row fits whatever its size).
    fn take_bytes(&mut self, row: &Candidate) -> bool {
        if self.reserved > 0 && self.bytes.saturating_add(row.size) > self.byte_budget {
            self.full = true;
            return false;
        }
        self.bytes += row.size;
        self.sizes.insert(row.id, row.size);
        true
    }

    /// Gives back the reservation of row `id`.
    fn release(&mut self, id: i64) {
        self.reserved -= 1;
        self.bytes -= self.sizes.remove(&id).unwrap_or(0);
        self.full = false;
    }

    /// Walks `window` from `cursor`, reserving rows until the batch is full, and returns
    /// the heads (and key-less rows) to lock in this round. Every key met in a window is
    /// settled at that point: its first row is its head.
    pub(crate) fn plan_round(&mut self, window: &[Candidate], cursor: &mut usize) -> Vec<i64> {
        let mut heads = Vec::new();
        while self.has_room() && *cursor < window.len() {
            let row = &window[*cursor];
            let blocked = matches!(
                row.key.as_ref().and_then(|k| self.keys.get(k)),
                Some(KeyState::Blocked)
            );
            // A row that does not fit stays at the cursor for a later round.
            if !blocked && !self.take_bytes(row) {
                break;
            }
            *cursor += 1;
            match &row.key {
                None => {
                    self.unkeyed_planned.push(row.id);
                    heads.push(row.id);
                    self.reserved += 1;
                }
                Some(key) => match self.keys.get(key) {
                    Some(KeyState::Blocked) => {}
                    Some(KeyState::Owned { .. } | KeyState::Planned { .. }) => {
                        self.tails.entry(key.clone()).or_default().push(row.id);
                        self.reserved += 1;
                    }
                    None => {
                        self.keys
                            .insert(key.clone(), KeyState::Planned { head: row.id });
                        heads.push(row.id);
                        self.reserved += 1;
                    }
                },
            }
        }
        heads
    }

    /// Leaves every key met in `prefix` to other claimers: they are blocked for this claim.
    pub(crate) fn leave_to_lower_lanes(&mut self, prefix: &[Candidate]) {
        for key in prefix.iter().filter_map(|row| row.key.as_ref()) {
            self.keys.entry(key.clone()).or_insert(KeyState::Blocked);
        }
    }

    /// Whether this claim has met `key` (planned, owned or left to others).
    pub(crate) fn knows(&self, key: &str) -> bool {
        self.keys.contains_key(key)
    }

    /// Tails to send with the next lock statement, each tried once: those of the keys
    /// owned so far.
    pub(crate) fn tails_to_try(&mut self) -> Vec<i64> {
        let mut ids = Vec::new();
        for (key, state) in &self.keys {
            if let (KeyState::Owned { .. }, Some(tail)) = (state, self.tails.get(key)) {
                ids.extend(tail.iter().filter(|id| !self.tried.contains(id)));
            }
        }
        self.tried.extend(&ids);
        ids.sort_unstable();
        ids
    }

    /// Payload bytes the batch may still take.
    pub(crate) fn bytes_left(&self) -> u64 {
        self.byte_budget.saturating_sub(self.bytes)
    }

    /// Marks as tried the tails (of keys owned or planned) that `tried` says a statement
    /// tried to lock along with the round's heads.
    pub(crate) fn tails_tried_where(&mut self, tried: impl Fn(i64) -> bool) {
        for (key, state) in &self.keys {
            if matches!(state, KeyState::Blocked) {
                continue;
            }
            if let Some(tail) = self.tails.get(key) {
                self.tried
                    .extend(tail.iter().copied().filter(|id| tried(*id)));
            }
        }
    }

    /// Records which of the round's heads this transaction locked; keys whose head it did
    /// not get are blocked and their reserved rows released (their tails this claim may
    /// have locked with the head are never published: only released at its end). Tails
    /// the statement got are recorded for [`KeyPlan::finish`].
    pub(crate) fn settle_round(&mut self, locked: &HashSet<i64>) {
        self.locked_tails
            .extend(locked.iter().filter(|id| self.tried.contains(id)));
        let mut released = Vec::new();
        for id in std::mem::take(&mut self.unkeyed_planned) {
            if locked.contains(&id) {
                self.unkeyed.push(id);
            } else {
                released.push(id);
            }
        }
        for (key, state) in self.keys.iter_mut() {
            if let KeyState::Planned { head } = *state {
                if locked.contains(&head) {
                    *state = KeyState::Owned { head };
                } else {
                    *state = KeyState::Blocked;
                    released.push(head);
                    released.extend(self.tails.remove(key).unwrap_or_default());
                }
            }
        }
        for id in released {
            self.release(id);
        }
    }

    /// Rows after owned heads, to lock once all rounds are done.
    #[cfg(test)]
    pub(crate) fn tails(&self) -> Vec<i64> {
        let mut ids: Vec<i64> = self.tails.values().flatten().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The batch: key-less rows locked, owned heads, and for each owned key the unbroken
    /// run of tail rows locked after its head. A tail row someone else holds (a row that
    /// committed late, below a head another claimer already took, or one a pick locked
    /// without taking it, see *Round trips*) ends its key's run there.
    pub(crate) fn finish(&self, locked_tails: &HashSet<i64>) -> Vec<i64> {
        let mut ids = self.unkeyed.clone();
        for (key, state) in &self.keys {
            if let KeyState::Owned { head } = state {
                ids.push(*head);
                if let Some(tail) = self.tails.get(key) {
                    ids.extend(tail.iter().take_while(|id| {
                        self.locked_tails.contains(id) || locked_tails.contains(id)
                    }));
                }
            }
        }
        ids.sort_unstable();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key's bucket is its first letter's place in the alphabet ('a': 0).
    fn window(rows: &[(i64, Option<&str>)]) -> Vec<Candidate> {
        rows.iter()
            .map(|(id, key)| Candidate {
                id: *id,
                key: key.map(Arc::from),
                size: 100,
                bucket: key.map_or(-1, |k| i32::from(k.as_bytes()[0] - b'a')),
            })
            .collect()
    }

    /// A budget of `n` rows and bytes enough for all of them.
    fn budget(n: usize) -> Budget {
        Budget {
            rows: n,
            bytes: u64::MAX,
        }
    }

    fn all(ids: &[i64]) -> HashSet<i64> {
        ids.iter().copied().collect()
    }

    #[test]
    fn heads_are_first_rows_of_each_key_and_tails_follow() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("b")),
            (3, Some("a")),
            (4, None),
            (5, Some("a")),
        ]);
        let mut plan = KeyPlan::new(budget(10));
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![1, 2, 4]);
        plan.settle_round(&all(&[1, 2, 4]));
        assert_eq!(plan.tails(), vec![3, 5]);
        assert_eq!(plan.finish(&all(&[3, 5])), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_key_whose_head_is_held_elsewhere_is_skipped_whole() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("b")),
            (3, Some("a")),
            (4, Some("b")),
        ]);
        let mut plan = KeyPlan::new(budget(10));
        let mut cursor = 0;
        plan.plan_round(&w, &mut cursor);
        plan.settle_round(&all(&[2])); // someone else holds row 1, head of "a"
        assert_eq!(plan.tails(), vec![4]);
        assert_eq!(plan.finish(&all(&[4])), vec![2, 4]);
    }

    #[test]
    fn capacity_freed_by_a_blocked_key_goes_to_later_keys() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("a")),
            (3, Some("b")),
            (4, Some("c")),
        ]);
        let mut plan = KeyPlan::new(budget(2));
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![1]);
        plan.settle_round(&HashSet::new()); // "a" is owned elsewhere
        assert!(plan.has_room());
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![3, 4]);
        plan.settle_round(&all(&[3, 4]));
        assert_eq!(plan.finish(&HashSet::new()), vec![3, 4]);
    }

    #[test]
    fn a_keys_run_stops_at_the_first_tail_row_it_could_not_lock() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("a")),
            (3, Some("a")),
            (4, Some("a")),
        ]);
        let mut plan = KeyPlan::new(budget(10));
        let mut cursor = 0;
        plan.plan_round(&w, &mut cursor);
        plan.settle_round(&all(&[1]));
        // Row 3 is held by another transaction: 4 must not be published before it.
        assert_eq!(plan.finish(&all(&[2, 4])), vec![1, 2]);
    }

    #[test]
    fn tails_ride_with_the_next_statement_and_each_is_tried_once() {
        // Round 1 owns a; round 2 (a later window) plans b and gets a's tails along.
        let first = window(&[(1, Some("a")), (2, Some("a"))]);
        let later = window(&[(3, Some("b")), (4, Some("a")), (5, Some("b"))]);
        let mut plan = KeyPlan::new(budget(10));
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&first, &mut cursor), vec![1]);
        assert_eq!(plan.tails_to_try(), Vec::<i64>::new(), "a is only planned");
        plan.settle_round(&all(&[1]));
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&later, &mut cursor), vec![3]);
        assert_eq!(
            plan.tails_to_try(),
            vec![2, 4],
            "a is owned: its tails ride"
        );
        plan.settle_round(&all(&[2, 3, 4]));
        // What is left for the last statement: b's tail only, not a's again.
        assert_eq!(plan.tails_to_try(), vec![5]);
        assert_eq!(plan.tails_to_try(), Vec::<i64>::new());
        assert_eq!(plan.finish(&all(&[5])), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_tail_locked_with_a_head_not_got_is_never_published() {
        // In a bucket this claim holds, tails go with their heads. Key a's head is held
        // elsewhere: its tails this claim got stay out of the batch and their room is
        // given back; b's run stops at the tail it could not get.
        let w = window(&[
            (1, Some("a")),
            (2, Some("b")),
            (3, Some("a")),
            (4, Some("b")),
            (5, Some("b")),
        ]);
        let mut plan = KeyPlan::new(budget(5));
        // The pick tried every row and got 2, 3 and 5.
        plan_locked(&mut plan, &w, &all(&[1, 2, 3, 4, 5]), &all(&[2, 3, 5]));
        assert_eq!(plan.room(), 2, "a's rows are given back");
        assert_eq!(plan.tails_to_try(), Vec::<i64>::new());
        assert_eq!(plan.finish(&HashSet::new()), vec![2]);
    }

    #[test]
    fn keys_seen_in_an_earlier_window_stay_blocked_in_later_ones() {
        let mut plan = KeyPlan::new(budget(10));
        let first = window(&[(1, Some("a"))]);
        let mut cursor = 0;
        plan.plan_round(&first, &mut cursor);
        plan.settle_round(&HashSet::new());
        let second = window(&[(7, Some("a")), (8, Some("b"))]);
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&second, &mut cursor), vec![8]);
    }

    #[test]
    fn a_lane_never_plans_a_key_met_before_its_start() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("b")),
            (3, Some("a")),
            (4, Some("c")),
            (5, None),
            (6, Some("b")),
        ]);
        let mut plan = KeyPlan::new(budget(10));
        plan.leave_to_lower_lanes(&w[..2]);
        let mut cursor = 2;
        // Row 3 is not a head ("a" starts at 1) and row 6 is not either: only "c" and the
        // key-less row are this lane's.
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![4, 5]);
        plan.settle_round(&all(&[4, 5]));
        assert_eq!(plan.finish(&HashSet::new()), vec![4, 5]);
        // Further on, "a" and "b" stay left to the lower lanes.
        let later = window(&[(7, Some("a")), (8, Some("b")), (9, Some("d"))]);
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&later, &mut cursor), vec![9]);
    }

    #[test]
    fn the_batch_never_exceeds_its_capacity() {
        let rows: Vec<(i64, Option<&str>)> = (1..=100)
            .map(|i| {
                (
                    i,
                    if i % 3 == 0 {
                        None
                    } else {
                        Some(["a", "b", "c", "d"][i as usize % 4])
                    },
                )
            })
            .collect();
        let w = window(&rows);
        let mut plan = KeyPlan::new(budget(17));
        let mut cursor = 0;
        let heads = plan.plan_round(&w, &mut cursor);
        plan.settle_round(&heads.iter().copied().collect());
        let tails: HashSet<i64> = plan.tails().into_iter().collect();
        assert_eq!(plan.finish(&tails).len(), 17);
    }

    #[test]
    fn the_byte_budget_ends_the_batch_and_a_larger_row_goes_alone() {
        let w = window(&[(1, Some("a")), (2, Some("b")), (3, Some("c"))]); // 100 bytes each
        let mut plan = KeyPlan::new(Budget {
            rows: 10,
            bytes: 250,
        });
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![1, 2]);
        assert!(!plan.has_room(), "row 3 would pass 250 bytes");

        let mut plan = KeyPlan::new(Budget {
            rows: 10,
            bytes: 50,
        });
        let mut cursor = 0;
        assert_eq!(
            plan.plan_round(&w, &mut cursor),
            vec![1],
            "alone, though larger"
        );
    }

    #[test]
    fn bytes_of_a_key_held_elsewhere_go_back_to_the_budget() {
        let w = window(&[
            (1, Some("a")),
            (2, Some("a")),
            (3, Some("b")),
            (4, Some("c")),
        ]);
        let mut plan = KeyPlan::new(Budget {
            rows: 10,
            bytes: 250,
        });
        let mut cursor = 0;
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![1]);
        plan.settle_round(&HashSet::new()); // "a" is held elsewhere: its 200 bytes return
        assert!(plan.has_room());
        assert_eq!(plan.plan_round(&w, &mut cursor), vec![3, 4]);
    }
}
