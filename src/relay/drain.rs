//! When `drain` is done, and what it leaves behind: no worker inside a batch and no row
//! any relay could publish now in a table that is not paused; rows that wait for a retry
//! are reported, not waited for, and so are paused tables that still hold rows.

use super::Shared;
use crate::source::SourceError;

/// True when no worker is inside a batch and no table that is not paused has a row a
/// relay could publish.
pub(super) async fn nothing_publishable(shared: &Shared) -> bool {
    if !shared.state.idle() {
        return false;
    }
    let check = shared.source.in_transaction(async |tx| {
        for table in shared.tables.iter().filter(|t| !t.is_gone()) {
            if shared.wakes.paused(table.index) {
                continue;
            }
            if table.plan.has_publishable(tx).await? {
                return Ok(false);
            }
        }
        Ok(shared.state.idle())
    });
    match check.await {
        Ok(done) => done,
        Err(e) => {
            tracing::warn!(error = %e, "Could not check for remaining rows");
            false
        }
    }
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
