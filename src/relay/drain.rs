//! When `drain` is done, and what it leaves behind: no worker inside a batch and no row
//! any relay could publish now in a table that is not paused; rows that wait for a retry
//! are reported, not waited for, and so are paused tables that still hold rows.

use super::Shared;
use crate::source::{poll, SourceError};

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
/// One worker looks at a time: the others, which found nothing too, wait for its answer
/// rather than ask the same of every table beside it (after a look that found nothing the
/// drain is stopping, and they return [`Left::Working`] to stop with it).
pub(super) async fn left(shared: &Shared) -> Left {
    let _one = shared.drain_look.lock().await;
    if shared.shutdown.stop_token().is_cancelled() {
        return Left::Working;
    }
    look_left(shared).await
}

/// [`left`]'s look, whoever else looks.
async fn look_left(shared: &Shared) -> Left {
    if !shared.state.idle() {
        return Left::Working;
    }
    match publishable(shared, true).await {
        Ok(found) => match found.first() {
            Some(&t) => Left::In(t),
            None if shared.state.idle() => Left::Nothing,
            None => Left::Working,
        },
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
    match publishable(shared, false).await {
        Ok(found) => shared.wakes.settle_all_but(&found),
        Err(e) => tracing::warn!(error = %e, "Could not look for rows before the drain"),
    }
}

/// The tables, not paused and not let go, that hold a row a relay could publish, in
/// configuration order; with `first`, only the first of them. One statement asks which
/// tables hold any row; only those are asked about publishable rows, one statement each:
/// among hundreds of empty tables a look costs a statement, not one a table.
async fn publishable(shared: &Shared, first: bool) -> Result<Vec<usize>, SourceError> {
    let tables: Vec<&super::RunTable> = (shared.tables.iter())
        .filter(|t| !t.is_gone() && !shared.wakes.paused(t.index))
        .collect();
    shared
        .source
        .in_transaction(async |tx| {
            let any = poll::any_rows(tx, tables.iter().map(|t| &t.plan.sql)).await?;
            let mut found = Vec::new();
            for (table, _) in tables.iter().zip(any).filter(|(_, any)| *any) {
                if table.plan.has_publishable(tx).await? {
                    found.push(table.index);
                    if first {
                        break;
                    }
                }
            }
            Ok(found)
        })
        .await
}

/// True when no worker is inside a batch and no table that is not paused has a row a
/// relay could publish.
pub(super) async fn nothing_publishable(shared: &Shared) -> bool {
    look_left(shared).await == Left::Nothing
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
