//! Rows postponed for an unavailable destination (a Kafka partition whose leader is
//! down: [`crate::sink::SinkService::unavailable`]) wait as long as their destination has
//! been down, up to [`crate::sink::HOLD_MAX`] ([`crate::sink::NotNow`]); when the sink
//! says a destination is available again ([`crate::sink::SinkService::available_again`]),
//! this follower makes every table's postponed rows due at once and wakes the workers, so
//! their keys follow as soon as the sink sees the destination back, not when their wait
//! ends.
//!
//! It releases every row postponed for any destination, not only those of the one that
//! is back: a row whose destination is still down is postponed again by the claim that
//! takes it, with a wait as long as that outage. Every relay process follows its own
//! sink, so rows that another process postponed with a view of the cluster older than
//! this one's are released again when that process sees the destination back. A process
//! also releases them once when it starts: it never saw the outage end if it began after
//! (a relay restarted, a replica added), and its sink decides afresh.

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::sink::POSTPONED_MARK;

/// How often a release that failed (the database unreachable) is tried again, and how many
/// times: past that, the rows come due by their own wait.
const RELEASE_RETRY: Duration = Duration::from_secs(1);
const RELEASE_TRIES: u32 = 5;

/// Until `done`: at once, then at each change of `available_again`, releases every
/// table's rows postponed for an unavailable destination.
pub(super) async fn follow_availability(
    shared: &Shared,
    mut available_again: watch::Receiver<u64>,
    done: CancellationToken,
) {
    available_again.mark_changed();
    let mut starting = true;
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            changed = available_again.changed() => if changed.is_err() { return },
        }
        for t in 0..shared.tables.len() {
            for tried in 1..=RELEASE_TRIES {
                match release_postponed(shared, t, starting).await {
                    Ok(()) => break,
                    Err(e) if tried == RELEASE_TRIES => {
                        tracing::warn!(
                            table = %shared.tables[t].name(), error = %e,
                            "Could not release the rows postponed for a destination that is back; they come due by their own wait"
                        );
                        break;
                    }
                    Err(e) => tracing::debug!(
                        table = %shared.tables[t].name(), error = %e,
                        "Could not release the rows postponed for a destination that is back; trying again"
                    ),
                }
                tokio::select! {
                    _ = done.cancelled() => return,
                    _ = tokio::time::sleep(RELEASE_RETRY) => {}
                }
            }
        }
        starting = false;
    }
}

/// Makes table `t`'s rows postponed for an unavailable destination due now, and wakes
/// the workers when there were some (`starting`: the process's first release).
async fn release_postponed(
    shared: &Shared,
    t: usize,
    starting: bool,
) -> Result<(), crate::source::SourceError> {
    let table = &shared.tables[t].plan;
    let released = shared
        .source
        .in_transaction(async |tx| table.release_postponed(tx, POSTPONED_MARK).await)
        .await?;
    if released > 0 {
        let name = &table.config.name;
        match starting {
            true => tracing::info!(
                table = %name, rows = released,
                "Rows postponed for an unavailable destination are due now: this relay's sink decides afresh"
            ),
            false => tracing::info!(
                table = %name, rows = released,
                "A destination is available again: the rows postponed for it are due now"
            ),
        }
        shared.wakes.raise(t, true);
    }
    Ok(())
}
