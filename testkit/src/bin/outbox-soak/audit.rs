//! The independent audit: what the table holds against what the stream stores, computed
//! without the relay's own bookkeeping (its metrics, its logs) beyond the table's columns.
//!
//! - The table is the truth of what was committed (mark mode keeps every row; a row
//!   exists iff its transaction committed). Rows the writer saw committed must all be
//!   there (else PostgreSQL lost a commit, reported apart).
//! - A message is matched to its row by `Nats-Msg-Id` (`public.outbox:<id>`) and must
//!   carry the row's subject and payload; otherwise it is a phantom.
//! - Lost: a good row (not poison) that is not in the stream - marked published without
//!   being there, or still pending after the settle time.
//! - Order: per key (the table's), the first occurrence of each id in stream order must
//!   come in id order.
//! - Stall: the longest time, while the writer was writing, in which the stream received
//!   nothing.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

/// A row as the table holds it at the end.
#[derive(Debug, Clone)]
pub(crate) struct TableRow {
    pub(crate) id: i64,
    pub(crate) key: Option<String>,
    pub(crate) topic: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) published: bool,
    pub(crate) dead: bool,
}

impl TableRow {
    fn poison(&self) -> bool {
        self.topic.starts_with("poison.")
    }
}

/// A message as the stream stores it.
#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub(crate) msg_id: Option<String>,
    pub(crate) subject: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) stored_at: SystemTime,
}

#[derive(Debug, Default, PartialEq)]
pub(crate) struct Findings {
    pub(crate) rows: usize,
    pub(crate) good_rows: usize,
    pub(crate) poison_rows: usize,
    pub(crate) delivered: usize,
    /// Good rows marked published that the stream does not hold.
    pub(crate) marked_not_stored: Vec<i64>,
    /// Good rows neither published nor dead at the end.
    pub(crate) undelivered: Vec<i64>,
    /// Messages with no committed row, or not matching their row's subject and payload.
    pub(crate) phantoms: Vec<String>,
    /// Messages stored beyond the first of their id.
    pub(crate) duplicates: usize,
    /// Keys whose ids arrived out of order, with the first inversion (earlier id, later id).
    pub(crate) order_violations: Vec<(String, i64, i64)>,
    pub(crate) poison_dead: usize,
    /// Good rows dead-lettered (a transient fault counted as the row's own failure).
    pub(crate) good_dead: Vec<i64>,
    /// Poison rows that reached the stream (must be impossible: no stream captures them).
    pub(crate) poison_stored: usize,
    /// Ids the writer saw committed that the table lacks (PostgreSQL lost a commit).
    pub(crate) acked_missing: Vec<i64>,
    /// The longest time without a stored message while the writer wrote: (start, length).
    pub(crate) longest_stall: Option<(SystemTime, Duration)>,
    /// Every such time of at least [`STALL`]: (start, length).
    pub(crate) stalls: Vec<(SystemTime, Duration)>,
}

/// A gap between stored messages this long counts as a stall (the writer commits every
/// 10 ms, so a healthy relay stores something several times a second).
pub(crate) const STALL: Duration = Duration::from_millis(500);

impl Findings {
    pub(crate) fn lost(&self) -> usize {
        self.marked_not_stored.len() + self.undelivered.len()
    }

    /// Whether the relay kept every promise the soak checks.
    pub(crate) fn clean(&self) -> bool {
        self.lost() == 0
            && self.phantoms.is_empty()
            && self.order_violations.is_empty()
            && self.good_dead.is_empty()
            && self.poison_stored == 0
            && self.poison_dead == self.poison_rows
    }
}

pub(crate) fn audit(
    table: &[TableRow],
    stream: &[Message],
    acked: &[i64],
    writing: (SystemTime, SystemTime),
) -> Findings {
    let rows: HashMap<i64, &TableRow> = table.iter().map(|r| (r.id, r)).collect();
    let mut f = Findings {
        rows: table.len(),
        poison_rows: table.iter().filter(|r| r.poison()).count(),
        ..Findings::default()
    };
    f.good_rows = f.rows - f.poison_rows;

    let mut seen: HashSet<i64> = HashSet::new();
    // Per key: the last id seen first, and whether it is already reported.
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut reported: HashSet<&str> = HashSet::new();
    for m in stream {
        let id = m
            .msg_id
            .as_deref()
            .and_then(|id| id.strip_prefix("public.outbox:"))
            .and_then(|id| id.parse::<i64>().ok());
        let row = id.and_then(|id| rows.get(&id));
        let Some(row) = row.filter(|r| r.topic == m.subject && r.payload == m.payload) else {
            f.phantoms.push(format!(
                "{} on {} ({} bytes)",
                m.msg_id.as_deref().unwrap_or("no Nats-Msg-Id"),
                m.subject,
                m.payload.len()
            ));
            continue;
        };
        if !seen.insert(row.id) {
            f.duplicates += 1;
            continue;
        }
        if row.poison() {
            f.poison_stored += 1;
        }
        if let Some(key) = row.key.as_deref() {
            if let Some(&before) = last.get(key) {
                if before > row.id && reported.insert(key) {
                    f.order_violations.push((key.to_owned(), before, row.id));
                }
            }
            let e = last.entry(key).or_insert(row.id);
            *e = (*e).max(row.id);
        }
    }
    f.delivered = seen.len();

    for r in table {
        match (r.poison(), r.dead, seen.contains(&r.id)) {
            (true, true, _) => f.poison_dead += 1,
            (false, true, _) => f.good_dead.push(r.id),
            (false, false, false) if r.published => f.marked_not_stored.push(r.id),
            (false, false, false) => f.undelivered.push(r.id),
            _ => {}
        }
    }
    f.acked_missing = acked
        .iter()
        .filter(|id| !rows.contains_key(id))
        .copied()
        .collect();
    let gaps = gaps(stream, writing);
    f.longest_stall = gaps.iter().copied().max_by_key(|(_, d)| *d);
    f.stalls = gaps.into_iter().filter(|(_, d)| *d >= STALL).collect();
    f
}

/// The gaps between consecutive stored messages (and from the window's edges) within
/// `window`: (start, length).
fn gaps(stream: &[Message], (from, to): (SystemTime, SystemTime)) -> Vec<(SystemTime, Duration)> {
    let mut times: Vec<SystemTime> = stream
        .iter()
        .map(|m| m.stored_at)
        .filter(|t| *t >= from && *t <= to)
        .collect();
    times.sort();
    let mut edges = vec![from];
    edges.extend(times);
    edges.push(to);
    edges
        .windows(2)
        .map(|w| (w[0], w[1].duration_since(w[0]).unwrap_or_default()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, key: Option<&str>, published: bool, dead: bool) -> TableRow {
        TableRow {
            id,
            key: key.map(str::to_owned),
            topic: "soak.1".into(),
            payload: format!("w{id}").into_bytes(),
            published,
            dead,
        }
    }

    fn msg(id: i64, at_ms: u64) -> Message {
        Message {
            msg_id: Some(format!("public.outbox:{id}")),
            subject: "soak.1".into(),
            payload: format!("w{id}").into_bytes(),
            stored_at: SystemTime::UNIX_EPOCH + Duration::from_millis(at_ms),
        }
    }

    fn window(ms: u64) -> (SystemTime, SystemTime) {
        (
            SystemTime::UNIX_EPOCH,
            SystemTime::UNIX_EPOCH + Duration::from_millis(ms),
        )
    }

    #[test]
    fn every_row_stored_once_in_order_is_clean() {
        let table = [
            row(1, Some("a"), true, false),
            row(2, Some("a"), true, false),
        ];
        let f = audit(&table, &[msg(1, 10), msg(2, 20)], &[1, 2], window(30));
        assert!(f.clean(), "{f:?}");
        assert_eq!((f.delivered, f.duplicates), (2, 0));
        assert_eq!(f.longest_stall.unwrap().1, Duration::from_millis(10));
    }

    #[test]
    fn a_row_marked_but_not_stored_is_lost() {
        let table = [row(1, Some("a"), true, false), row(2, None, true, false)];
        let f = audit(&table, &[msg(1, 10)], &[], window(30));
        assert_eq!(f.marked_not_stored, vec![2]);
        assert!(!f.clean());
    }

    #[test]
    fn a_row_still_pending_is_lost() {
        let f = audit(&[row(1, None, false, false)], &[], &[], window(30));
        assert_eq!(f.undelivered, vec![1]);
        assert_eq!(f.lost(), 1);
    }

    #[test]
    fn a_message_without_its_row_or_with_another_payload_is_a_phantom() {
        let mut changed = msg(1, 10);
        changed.payload = b"other".to_vec();
        let f = audit(
            &[row(1, None, true, false)],
            &[changed, msg(9, 20)],
            &[],
            window(30),
        );
        assert_eq!(f.phantoms.len(), 2, "{f:?}");
        assert_eq!(f.undelivered.len() + f.marked_not_stored.len(), 1);
    }

    #[test]
    fn a_later_id_of_a_key_first_is_an_order_violation_but_a_redelivery_is_a_duplicate() {
        let table = [
            row(1, Some("a"), true, false),
            row(2, Some("a"), true, false),
        ];
        let redelivered = audit(&table, &[msg(1, 1), msg(2, 2), msg(1, 3)], &[], window(5));
        assert!(redelivered.clean());
        assert_eq!(redelivered.duplicates, 1);
        let swapped = audit(&table, &[msg(2, 1), msg(1, 2)], &[], window(5));
        assert_eq!(swapped.order_violations, vec![("a".to_owned(), 2, 1)]);
    }

    #[test]
    fn a_dead_good_row_fails_and_a_dead_poison_row_is_expected() {
        let mut poison = row(2, Some("poison-2"), false, true);
        poison.topic = "poison.2".into();
        let f = audit(&[row(1, None, false, true), poison], &[], &[], window(5));
        assert_eq!((f.good_dead.clone(), f.poison_dead), (vec![1], 1));
        assert!(!f.clean());
    }

    #[test]
    fn a_commit_the_writer_saw_and_the_table_lacks_is_reported() {
        let f = audit(&[], &[], &[7], window(5));
        assert_eq!(f.acked_missing, vec![7]);
    }

    #[test]
    fn the_stall_counts_from_the_window_edges() {
        let f = audit(
            &[row(1, None, true, false)],
            &[msg(1, 100)],
            &[],
            window(1_000),
        );
        assert_eq!(f.longest_stall.unwrap().1, Duration::from_millis(900));
        assert_eq!(f.stalls.len(), 1);
    }
}
