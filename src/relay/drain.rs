//! When `drain` is done, and what it leaves behind: no worker inside a batch and no row
//! any relay could publish now in a table that is not paused; rows that wait for a retry
//! are reported, not waited for, and so are paused tables that still hold rows.

use super::Shared;
use crate::source::SourceError;

/// What a look at the tables found: whether `drain` is done, and if not, where to look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Left {
    /// No worker is inside a batch, and no table that is not paused has a row a relay
    /// could publish.
    Nothing,
    /// Table `t` (an index into `Shared::tables`) has a row a relay could publish now.
    In(usize),
    /// A worker is inside a batch: its commit says where rows are.
    Working,
    /// The look failed: anything may be left.
    Unknown,
}

/// Looks for the first table, in configuration order, that is not paused and has a row a
/// relay could publish; [`Left::Working`] without a look while a worker is inside a batch.
pub(super) async fn left(shared: &Shared) -> Left {
    if !shared.state.idle() {
        return Left::Working;
    }
    let check = shared.source.in_transaction(async |tx| {
        for table in shared.tables.iter().filter(|t| !t.is_gone()) {
            if shared.wakes.paused(table.index) {
                continue;
            }
            if table.plan.has_publishable(tx).await? {
                return Ok(Left::In(table.index));
            }
        }
        Ok(match shared.state.idle() {
            true => Left::Nothing,
            false => Left::Working,
        })
    });
    match check.await {
        Ok(left) => left,
        Err(e) => {
            tracing::warn!(error = %e, "Could not check for remaining rows");
            Left::Unknown
        }
    }
}

/// Before the workers start: only the tables that hold a publishable row start due (rule
/// 7), so a drain among many empty tables does not begin with a claim on each of them from
/// every worker. If the look fails, every table stays due.
pub(super) async fn look_first(shared: &Shared) {
    let look = shared.source.in_transaction(async |tx| {
        let mut found = Vec::new();
        for table in &shared.tables {
            if !shared.wakes.paused(table.index) && table.plan.has_publishable(tx).await? {
                found.push(table.index);
            }
        }
        Ok(found)
    });
    match look.await {
        Ok(found) => shared.wakes.settle_all_but(&found),
        Err(e) => tracing::warn!(error = %e, "Could not look for rows before the drain"),
    }
}

/// True when no worker is inside a batch and no table that is not paused has a row a
/// relay could publish.
pub(super) async fn nothing_publishable(shared: &Shared) -> bool {
    left(shared).await == Left::Nothing
}

/// The paused tables that still hold publishable rows, with their pauses.
pub(super) async fn paused_left(shared: &Shared) -> Vec<(String, crate::source::pause::Paused)> {
    let mut left = Vec::new();
    for table in shared.tables.iter().filter(|t| !t.is_gone()) {
        let Some(paused) = shared.pauses.of(table.index) else {
            continue;
        };
        let rows = shared
            .source
            .in_transaction(async |tx| table.plan.has_publishable(tx).await)
            .await;
        // Unknown counts as left: exit 3 rather than claim an empty outbox.
        if rows.unwrap_or(true) {
            left.push((table.name().to_string(), paused));
        }
    }
    left
}

/// Rows waiting for their next attempt, over every table, and the earliest due time
/// (as PostgreSQL prints an interval from now); `None` when there are none or the
/// database does not answer.
pub(super) async fn waiting(shared: &Shared) -> Option<(i64, String)> {
    let read = shared.source.in_transaction(async |tx| {
        let mut total = 0;
        let mut next: Option<(f64, String)> = None;
        for table in shared.tables.iter().filter(|t| !t.is_gone()) {
            let waiting = table.plan.waiting(tx).await?;
            total += waiting.rows;
            if let Some((text, secs)) = waiting.next {
                if next.as_ref().is_none_or(|(s, _)| secs < *s) {
                    next = Some((secs, text));
                }
            }
        }
        Ok::<_, SourceError>((total, next))
    });
    match read.await {
        Ok((n, Some((_, next)))) if n > 0 => Some((n, next)),
        Ok(_) => None,
        Err(e) => {
            tracing::debug!(error = %e, "Could not count rows waiting for a retry");
            None
        }
    }
}
