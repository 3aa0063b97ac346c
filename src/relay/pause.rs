//! Following the pause state of the tables (see [`crate::source::pause`]): read before the
//! first claim, then every [`pause::POLL`]; a paused table is not claimed from (its
//! batches in flight finish), and each change is logged once and shown in the
//! `outbox_relay_table_paused` gauge.

use std::sync::Mutex;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::{RunTable, Shared};
use crate::config::TableName;
use crate::ops::metrics::TableLabel;
use crate::source::pause::{self, Paused};
use crate::source::settle::Settlement;
use crate::source::{Source, SourceError};

/// What this process knows of the pause state.
pub(crate) struct PauseState {
    sql: String,
    names: Vec<TableName>,
    known: Mutex<Vec<Option<Paused>>>,
}

impl PauseState {
    pub(crate) fn new(names: Vec<TableName>) -> PauseState {
        PauseState {
            sql: pause::read_sql(&names),
            known: Mutex::new(vec![None; names.len()]),
            names,
        }
    }

    /// The pause of table `t` as last read.
    pub(crate) fn of(&self, t: usize) -> Option<Paused> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())[t].clone()
    }

    /// Reads the pause state of every table, in their order. A missing pause table is a
    /// [`SourceError::Schema`].
    pub(crate) async fn read(&self, source: &Source) -> Result<Vec<Option<Paused>>, SourceError> {
        if self.names.is_empty() {
            return Ok(Vec::new()); // a pattern that matches no table yet
        }
        source
            .in_transaction(async |tx| pause::read(tx, &self.sql, &self.names).await)
            .await
    }
}

/// Reads the pause state once and applies it.
async fn refresh_pauses(shared: &Shared) -> Result<(), SourceError> {
    let read = shared.pauses.read(&shared.source).await?;
    apply_pauses(shared, read);
    Ok(())
}

/// Applies the pause state `read` ([`PauseState::read`]): flags, gauge, one log line
/// per change. Start-up applies the first read before any claim
/// (`super::start::prepare_tables` reads it), so a table paused while no relay ran
/// gets no batch.
pub(super) fn apply_pauses(shared: &Shared, read: Vec<Option<Paused>>) {
    let pauses = &shared.pauses;
    let mut known = pauses.known.lock().unwrap_or_else(|e| e.into_inner());
    for (t, now) in read.into_iter().enumerate() {
        let name = &pauses.names[t];
        if shared.wakes.set_paused(t, now.is_some()) {
            match &now {
                Some(p) => tracing::info!(
                    table = %name, since = %p.since, by = %p.by, reason = %p.reason,
                    "Table paused: not claiming from it until `outbox-relay resume`"
                ),
                None => tracing::info!(table = %name, "Table resumed: claiming from it again"),
            }
        }
        shared
            .ops
            .metrics
            .table_paused
            .get_or_create(&TableLabel {
                table: name.to_string(),
            })
            .set(i64::from(now.is_some()));
        known[t] = now;
    }
}

/// Follows the pause state every [`pause::POLL`] until `done`.
pub(super) async fn follow_pauses(shared: &Shared, done: CancellationToken) {
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(pause::POLL) => {}
        }
        if let Err(e) = refresh_pauses(shared).await {
            tracing::debug!(error = %e, "Could not read the pause state");
        }
    }
}

/// Counts a committed batch of `table` in the bad-row valve and, when it trips, pauses
/// the table for every relay (at once in this process) and says what to do.
pub(super) async fn count_bad_rows(shared: &Shared, table: &RunTable, settlement: &Settlement) {
    let Some(valve) = &shared.valve else {
        return;
    };
    let t = table.index;
    let (failed, published) = (settlement.failed.ids.len(), settlement.published.len());
    let Some(n) = valve.trips(t, failed, published, Instant::now()) else {
        return;
    };
    let name = table.name();
    let last_error = settlement.failed.errors.last().cloned().unwrap_or_default();
    let reason = format!(
        "{n} rows failed for their own sake within {}, most of its attempts; last error: \
         {last_error}",
        humantime::format_duration(valve.window())
    );
    shared.wakes.set_paused(t, true);
    let by = pause::by_valve();
    let paused = shared
        .source
        .in_transaction(async |tx| pause::pause(tx, name, &by, &reason).await)
        .await;
    match paused {
        Ok(_) => {
            shared
                .ops
                .metrics
                .valve_paused
                .get_or_create(&TableLabel {
                    table: name.to_string(),
                })
                .inc();
            tracing::error!(
                table = %name, failed = n, %last_error,
                "Table paused by the bad-row valve: its rows keep failing for their own \
                 sake. Check that its stream or topic exists and this relay may publish \
                 to it (`outbox-relay check`), and the writing service's last deploy; \
                 then `outbox-relay requeue --all --table {name}` for rows dead-lettered \
                 meanwhile, and `outbox-relay resume --table {name}`"
            );
        }
        Err(e) => {
            // Not paused for the others: neither here (the next look would undo it).
            shared.wakes.set_paused(t, false);
            tracing::warn!(table = %name, error = %e, "The bad-row valve could not pause the table");
        }
    }
}
