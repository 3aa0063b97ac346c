//! Retention in mark mode (`relay.retention`): published rows whose `published_at` is older
//! than the retention are deleted, so a marked outbox does not grow without bound. Pending
//! and dead rows are never touched: a dead row stays until an operator re-queues or
//! deletes it.
//!
//! # Small, and never in a claim's way
//!
//! The table is walked in order, [`CHUNK`] rows at a time, each chunk one statement in its
//! own transaction (milliseconds). A chunk deletes its rows published before the cutoff,
//! re-checked under the row lock, and skips rows locked by anyone: it never waits for a
//! claim, a `replay` or another relay's retention, and a claim never waits for it (claims
//! lock pending rows only, and a published row is never pending). Between chunks the walk
//! pauses as long as the chunk took, so it uses at most half of one connection.
//!
//! # Where the old rows end
//!
//! The walk stops at the first chunk holding a row created within the retention. Sound:
//! a row `x` with `created_at >= cutoff` drew its order value after the cutoff (inside its
//! transaction, which began at `created_at`). Every later row drew its value later still,
//! so committed after the cutoff, so was published after it: no row past `x` is old enough.
//! This takes `created_at` to be the insert's `now()` (the default) and values drawn from
//! one sequence; an application that writes `created_at` itself only moves where the walk
//! stops, never what it deletes.
//!
//! # Where the walk starts
//!
//! A cursor remembers where the next cycle starts: before the first chunk of this walk
//! that held a row published within the retention (it ages later) or created within it
//! (the stop), or a row old enough that someone else held locked. What is left before the
//! cursor is pending or dead (or was published after
//! the walk passed it: a dead row re-queued, a key held back for long). So a cycle reads
//! what was published since the last one, not the table's history (a held snapshot keeps
//! deleted rows' index entries until it ends, as for the claim floor). Every
//! [`Walk::full_every`] a cycle starts from the left end again, for the rows published
//! behind the cursor.
//!
//! Bound: a row is deleted within one [`Walk::cycle`] (plus the walk's own time) of its
//! `published_at` passing the retention; a row published after walks had passed it, or
//! locked when it was old enough, within one [`Walk::full_every`] more.

use std::time::{Duration, Instant};

use super::sql::{TableSql, FIRST_WINDOW};
use super::{Source, SourceError};

/// Rows looked at per statement.
pub(crate) const CHUNK: i64 = 1000;

/// What one chunk found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// The chunk's last order value; `None` when no row is left after the start.
    pub(crate) last: Option<i64>,
    /// Rows looked at.
    pub(crate) rows: i64,
    pub(crate) deleted: i64,
    /// It holds a row created within the retention: the walk stops here.
    pub(crate) young: bool,
    /// It holds a row published within the retention: a later cycle deletes it.
    pub(crate) ripening: bool,
    /// Rows old enough to go; those beyond `deleted` were locked by someone else.
    pub(crate) old: i64,
}

/// Where walks start and stop: a pure state machine, driven by [`keep`].
#[derive(Debug, Clone)]
pub(crate) struct Walk {
    /// The time between the starts of two cycles.
    pub(crate) cycle: Duration,
    /// The time between two walks from the left end.
    pub(crate) full_every: Duration,
    /// Where the next cycle starts unless a full walk is due.
    cursor: i64,
    /// This walk's first chunk with a row that is not old yet: the next cursor.
    resume: Option<i64>,
    full_due: Instant,
}

impl Walk {
    pub(crate) fn new(retention: Duration, now: Instant) -> Walk {
        Walk {
            cycle: (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60)),
            full_every: retention.clamp(Duration::from_secs(10), Duration::from_secs(3600)),
            cursor: FIRST_WINDOW,
            resume: None,
            full_due: now,
        }
    }

    /// Where a cycle starting `now` begins: the left end when a full walk is due, else
    /// where the last walk stopped.
    pub(crate) fn start(&mut self, now: Instant) -> i64 {
        self.resume = None;
        if now >= self.full_due {
            self.full_due = now + self.full_every;
            FIRST_WINDOW
        } else {
            self.cursor
        }
    }

    /// Takes a chunk read after `after`: the start of the next chunk, or `None` when the
    /// walk is over (at a young row, or the end of the table).
    pub(crate) fn next(&mut self, after: i64, chunk: Chunk) -> Option<i64> {
        if chunk.young || chunk.ripening || chunk.old > chunk.deleted {
            self.resume.get_or_insert(after);
        }
        match chunk.last {
            Some(last) if !chunk.young && chunk.rows >= CHUNK => Some(last),
            _ => {
                self.cursor = self.resume.take().unwrap_or(after);
                None
            }
        }
    }
}

/// Runs retention on one table until `done`: a cycle every [`Walk::cycle`].
pub(crate) async fn keep(
    table: &str,
    source: &Source,
    sql: &TableSql,
    retention: Duration,
    deleted: impl Fn(u64),
    done: &tokio_util::sync::CancellationToken,
) {
    let Some(retire) = &sql.retire else {
        // Start-up refuses retention on a table without a creation-time column.
        return;
    };
    let seconds = retention.as_secs_f64();
    let mut walk = Walk::new(retention, Instant::now());
    let mut failing = false;
    loop {
        let started = Instant::now();
        let mut after = walk.start(started);
        let mut total = 0;
        let outcome = loop {
            let begun = Instant::now();
            let chunk = match retire_chunk(source, retire, after, seconds).await {
                Ok(chunk) => chunk,
                Err(e) => break Err(e),
            };
            tracing::trace!(table, after, ?chunk, "Retention chunk");
            total += chunk.deleted;
            deleted(chunk.deleted as u64);
            match walk.next(after, chunk) {
                Some(next) => after = next,
                None => break Ok(()),
            }
            tokio::select! {
                _ = done.cancelled() => return,
                _ = tokio::time::sleep(begun.elapsed()) => {}
            }
        };
        match outcome {
            Ok(()) => {
                failing = false;
                tracing::debug!(table, deleted = total, elapsed = ?started.elapsed(), "Retention cycle");
            }
            Err(e) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(table, error = %e, "Retention could not delete old published rows; trying again next cycle");
                }
            }
        }
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(walk.cycle.saturating_sub(started.elapsed())) => {}
        }
    }
}

/// One retire statement: deletes up to [`CHUNK`] old published rows after `after`.
async fn retire_chunk(
    source: &Source,
    retire: &str,
    after: i64,
    seconds: f64,
) -> Result<Chunk, SourceError> {
    source
        .in_transaction(async |tx| {
            let row = tx.query_one(retire, &[&after, &CHUNK, &seconds]).await?;
            Ok(Chunk {
                last: row.get(0),
                rows: row.get(1),
                deleted: row.get(2),
                young: row.get(3),
                ripening: row.get(4),
                old: row.get(5),
            })
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(last: i64, rows: i64, young: bool) -> Chunk {
        Chunk {
            last: Some(last),
            rows,
            deleted: 0,
            young,
            ripening: false,
            old: 0,
        }
    }

    #[test]
    fn a_walk_goes_on_through_full_old_chunks_and_stops_at_a_young_one() {
        let t0 = Instant::now();
        let mut walk = Walk::new(Duration::from_secs(3600), t0);
        let start = walk.start(t0);
        assert_eq!(start, FIRST_WINDOW);
        assert_eq!(walk.next(start, chunk(1000, CHUNK, false)), Some(1000));
        assert_eq!(walk.next(1000, chunk(2500, CHUNK, false)), Some(2500));
        assert_eq!(walk.next(2500, chunk(3500, CHUNK, true)), None);
        // The next cycle starts before the young chunk, not at the left end.
        assert_eq!(walk.start(t0 + Duration::from_secs(60)), 2500);
    }

    #[test]
    fn the_next_cycle_starts_at_the_first_chunk_with_a_row_not_old_yet() {
        let t0 = Instant::now();
        let mut walk = Walk::new(Duration::from_secs(3600), t0);
        walk.start(t0);
        let ripening = Chunk {
            ripening: true,
            ..chunk(2000, CHUNK, false)
        };
        assert_eq!(
            walk.next(FIRST_WINDOW, chunk(1000, CHUNK, false)),
            Some(1000)
        );
        assert_eq!(walk.next(1000, ripening), Some(2000));
        assert_eq!(
            walk.next(
                2000,
                Chunk {
                    last: Some(3000),
                    ..ripening
                }
            ),
            Some(3000)
        );
        assert_eq!(walk.next(3000, chunk(4000, CHUNK, true)), None);
        assert_eq!(walk.start(t0 + Duration::from_secs(60)), 1000);
        // Once those rows are gone the cursor moves on.
        assert_eq!(walk.next(1000, chunk(3500, CHUNK, false)), Some(3500));
        assert_eq!(walk.next(3500, chunk(4000, CHUNK, true)), None);
        assert_eq!(walk.start(t0 + Duration::from_secs(120)), 3500);
        // An old row left behind because it was locked is looked at again next cycle.
        let locked = Chunk {
            old: 1000,
            deleted: 999,
            ..chunk(4500, CHUNK, false)
        };
        assert_eq!(walk.next(3500, locked), Some(4500));
        assert_eq!(walk.next(4500, chunk(5000, 10, false)), None);
        assert_eq!(walk.start(t0 + Duration::from_secs(180)), 3500);
    }

    #[test]
    fn a_short_chunk_is_the_end_of_the_table() {
        let t0 = Instant::now();
        let mut walk = Walk::new(Duration::from_secs(3600), t0);
        walk.start(t0);
        assert_eq!(walk.next(FIRST_WINDOW, chunk(10, 10, false)), None);
        assert_eq!(walk.start(t0 + Duration::from_secs(1)), FIRST_WINDOW);
        let empty = Chunk {
            last: None,
            rows: 0,
            deleted: 0,
            young: false,
            ripening: false,
            old: 0,
        };
        assert_eq!(walk.next(FIRST_WINDOW, empty), None);
    }

    #[test]
    fn a_walk_from_the_left_end_comes_every_full_every() {
        let t0 = Instant::now();
        let mut walk = Walk::new(Duration::from_secs(7 * 86_400), t0);
        assert_eq!(walk.cycle, Duration::from_secs(60));
        assert_eq!(walk.full_every, Duration::from_secs(3600));
        assert_eq!(walk.start(t0), FIRST_WINDOW);
        assert_eq!(
            walk.next(FIRST_WINDOW, chunk(4000, CHUNK, false)),
            Some(4000)
        );
        assert_eq!(walk.next(4000, chunk(5000, CHUNK, true)), None);
        assert_eq!(walk.start(t0 + Duration::from_secs(60)), 4000);
        assert_eq!(walk.start(t0 + Duration::from_secs(3599)), 4000);
        assert_eq!(walk.start(t0 + Duration::from_secs(3600)), FIRST_WINDOW);
        assert_eq!(walk.start(t0 + Duration::from_secs(3660)), 4000);
    }

    #[test]
    fn short_retentions_cycle_every_second_and_walk_fully_every_ten() {
        let walk = Walk::new(Duration::from_secs(2), Instant::now());
        assert_eq!(walk.cycle, Duration::from_secs(1));
        assert_eq!(walk.full_every, Duration::from_secs(10));
    }
}
