//! One worker: wait while the circuit is open, run a batch on the next table that has
//! rows ([`super::batch`]; batches that go through follow on, each claiming the next with
//! its `COMMIT`), back off after trouble, and otherwise wait for a NOTIFY or the poll
//! interval.
//!
//! Only the idle wait, the breaker wait, the back-off pause and the claim race against
//! `stop`; a batch whose rows are claimed runs to its commit unless `abort` fires.

use std::sync::Arc;
use std::time::Duration;

use super::batch::{relay_batch, Batch, Ended};
use super::breaker::BreakerState;
use super::drain::Left;
use super::{Shared, TableFailed};
use crate::error::ErrorClass;
use crate::retry::Backoff;

/// A worker's first pause after a transient failure: short, since most are momentary
/// (a connection replaced, a lock timeout).
const TROUBLE_FIRST: Duration = Duration::from_millis(100);
/// Its longest pause: a worker resumes within it once the trouble is over (the breaker,
/// not this, holds the workers off a broker that is down).
const TROUBLE_MAX: Duration = Duration::from_secs(5);

/// What one round over the tables came to.
enum Round {
    /// A batch committed and nothing went wrong: claim again at once.
    Worked,
    /// Every table was empty: wait for a NOTIFY or the poll interval.
    Idle,
    /// Nothing claimed, but a table has rows that other claimers hold: wait, longer each
    /// time it happens again.
    Contended,
    /// Nothing claimed: a table's `max_rate` allows the next row after this long.
    Throttled(Duration),
    /// Something failed for a transient reason: back off.
    Trouble(String),
    /// The worker is done (stopped, aborted, or the run failed).
    Exit,
}

pub(crate) struct Worker {
    /// The worker's number, `0..workers`: where its rounds start, and how its claims
    /// spread over a deep backlog (`source::claim`). Logged as `worker`.
    pub(crate) lane: usize,
    pub(crate) shared: Arc<Shared>,
}

impl Worker {
    pub(crate) async fn run(self) {
        let shared = &self.shared;
        let stop = shared.shutdown.stop_token().clone();
        let mut backoff = Backoff::new(TROUBLE_FIRST, TROUBLE_MAX);
        // A claimer one too many for a table's buckets waits a poll interval, doubling up to
        // eight: it tries again soon enough to take a bucket that frees up, without every
        // surplus claimer reading the first window at every poll (many relays on a few hot
        // keys then spent several times the CPU per row of one relay: benchmark S). In
        // `drain` it does not double: a process whose workers all waited up to eight polls
        // when the table emptied exited that much later after the last row was stored,
        // and a surplus claim costs one statement now (`source::claim`, surplus lanes).
        let poll = shared.relay.poll_interval;
        let mut surplus = poll;
        // Workers start spread over the tables, and each round starts past the last table
        // that had rows, so no table starves another. At start every table is due: spread
        // out, each is claimed first by about one worker rather than by each in turn.
        let tables = shared.tables.len();
        let mut next = self.lane * tables / shared.relay.workers.max(1) % tables;
        while !stop.is_cancelled() {
            shared.ops.health.alive();
            // While the broker is down nobody claims (see `breaker`).
            if shared.breaker.state() == BreakerState::Open {
                if !shared.breaker.wait_closed(&stop).await {
                    return;
                }
                backoff.reset();
            }
            // Registered before the claim, so a NOTIFY during the claim is not missed.
            let notified = shared.wakes.workers.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();

            match self.round(&mut next).await {
                Round::Exit => return,
                Round::Trouble(error) => {
                    if shared.breaker.state() == BreakerState::Open {
                        continue; // the breaker's prober decides when to try again
                    }
                    let pause = backoff.next_pause();
                    tracing::warn!(worker = self.lane, %error, retry_in = ?pause, "Batch failed; backing off");
                    if !sleep_unless_stopped(&stop, pause).await {
                        return;
                    }
                }
                Round::Worked => {
                    backoff.reset();
                    surplus = poll;
                }
                Round::Throttled(wait) => {
                    backoff.reset();
                    if !sleep_unless_stopped(&stop, wait).await {
                        return;
                    }
                }
                Round::Contended => {
                    if !sleep_unless_stopped(&stop, surplus).await {
                        return;
                    }
                    if !shared.drain {
                        surplus = (surplus * 2).min(poll * 8);
                    }
                }
                Round::Idle => {
                    backoff.reset();
                    surplus = poll;
                    if !self.rest(notified).await {
                        return;
                    }
                }
            }
        }
    }

    /// After a round that found nothing: ends a drain with nothing publishable left (and
    /// returns `false`), else waits until a NOTIFY or a poll raises a table (`notified`),
    /// the soonest retry of this process comes due (`run`; a poll interval in `drain`), or
    /// `stop` (`false`).
    async fn rest(&self, notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>) -> bool {
        let shared = &self.shared;
        if shared.drain {
            // Rows are left, maybe in a table found empty earlier (`wake`, rule 7): that
            // table is due again, the other settled ones stay settled.
            match super::drain::left(shared).await {
                Left::Nothing => {
                    shared.state.set_drained(true);
                    shared.shutdown.request_stop();
                    return false;
                }
                Left::In(t) => shared.wakes.rearm(Some(t)),
                Left::Working => {}
                Left::Unknown => shared.wakes.rearm(None),
            }
        }
        // A table raised after the ticket of the claim that found it empty is still due
        // (`wake`, rule 2): a batch's own "there may be more" comes after the ticket of
        // the claim that followed it on. Claim again rather than wait for a NOTIFY that
        // its writers may not send (they notify only while the relay sleeps on it).
        if !shared.drain && shared.wakes.any_due() {
            return true;
        }
        // `run`: a table not due is the poller's (wake rule 3) until it raises it; the
        // loop still goes round now and then, for liveness.
        let pause = if shared.drain {
            shared.relay.poll_interval
        } else {
            shared
                .wakes
                .next_retry()
                .map_or(super::wake::IDLE_RECHECK, |at| {
                    at.saturating_duration_since(std::time::Instant::now())
                })
                .clamp(Duration::from_millis(1), super::wake::IDLE_RECHECK)
        };
        tokio::select! {
            _ = shared.shutdown.stop_token().cancelled() => false,
            _ = notified => true,
            _ = tokio::time::sleep(pause) => true,
        }
    }

    /// Tries the tables from `next` on until one batch commits; tells the breaker how it
    /// went.
    async fn round(&self, next: &mut usize) -> Round {
        let shared = &self.shared;
        let tables = shared.tables.len();
        let mut contended = false;
        let mut throttled: Option<Duration> = None;
        for k in 0..tables {
            let t = (*next + k) % tables;
            if shared.tables[t].is_gone() {
                continue;
            }
            let Some(ticket) = shared.wakes.begin(t, std::time::Instant::now()) else {
                continue;
            };
            // The batches may have gone on to other tables: `t` is the last one's.
            let Ended {
                table: t,
                ticket,
                result,
            } = relay_batch(shared, self.lane, &shared.tables[t], ticket).await;
            if matches!(
                result,
                Ok(Batch::Empty | Batch::Contended | Batch::Throttled(_) | Batch::Done { .. })
            ) {
                shared.ops.health.progress();
            }
            match result {
                Ok(Batch::Empty) => {
                    shared.wakes.found_nothing(t, ticket);
                    continue;
                }
                Ok(Batch::Contended) => {
                    contended = true;
                    continue;
                }
                Ok(Batch::Throttled(wait)) => {
                    throttled = Some(throttled.map_or(wait, |w| w.min(wait)));
                    continue;
                }
                Ok(Batch::Done {
                    trouble,
                    published,
                    retry_in,
                    ..
                }) => {
                    *next = (t + 1) % tables;
                    return self.committed(t, trouble, published, retry_in);
                }
                Ok(Batch::Stopped) => return Round::Exit,
                Ok(Batch::Aborted) => {
                    shared.state.set_aborted();
                    return Round::Exit;
                }
                Err(e) if shared.let_go(t, &e) => continue,
                Err(e) if e.class() == ErrorClass::Fatal => {
                    let table = shared.tables[t].name().to_string();
                    shared.fail(TableFailed::new(table, e));
                    return Round::Exit;
                }
                Err(e) => {
                    // The claim found out nothing: the table stays due for the retry
                    // after the back-off, not for its next idle look (`wake`, rule 1).
                    shared.wakes.raise(t, false);
                    return Round::Trouble(e.to_string());
                }
            }
        }
        if let Some(wait) = throttled {
            Round::Throttled(wait)
        } else if contended {
            Round::Contended
        } else {
            Round::Idle
        }
    }

    /// After a batch of table `t` committed, `published` rows of it, with `trouble` (a
    /// transient failure) and the soonest retry it scheduled: the table's wake-up and the
    /// breaker learn of it.
    fn committed(
        &self,
        t: usize,
        trouble: Option<crate::sink::SinkError>,
        published: usize,
        retry_in: Option<Duration>,
    ) -> Round {
        let shared = &self.shared;
        // Rows were there: there may be more (`wake`, rule 1).
        shared.wakes.raise(t, false);
        if let Some(after) = retry_in {
            shared.wakes.retry_in(t, after);
        }
        match (&trouble, published) {
            (Some(e), 0) => shared.breaker.record_failure(e.message()),
            _ => shared.breaker.record_success(),
        }
        match trouble {
            Some(e) => Round::Trouble(e.message().to_owned()),
            None => Round::Worked,
        }
    }
}

/// Sleeps for `pause`; `false` when `stop` fired first.
async fn sleep_unless_stopped(stop: &tokio_util::sync::CancellationToken, pause: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(pause) => true,
    }
}
