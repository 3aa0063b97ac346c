//! Following the pause state of the tables (see [`crate::source::pause`]): read before the
//! first claim, then every [`pause::POLL`]; a paused table is not claimed from (its
//! batches in flight finish), and each change is logged once and shown in the
//! `outbox_relay_table_paused` gauge.

use std::sync::Mutex;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::config::TableName;
use crate::ops::metrics::TableLabel;
use crate::source::pause::{self, Paused};
use crate::source::SourceError;

/// What this process knows of the pause state.
pub struct PauseState {
    sql: String,
    names: Vec<TableName>,
    known: Mutex<Vec<Option<Paused>>>,
}

impl PauseState {
    pub fn new(names: Vec<TableName>) -> PauseState {
        PauseState {
            sql: pause::read_sql(&names),
            known: Mutex::new(vec![None; names.len()]),
            names,
        }
    }

    /// The pause of table `t` as last read.
    pub fn of(&self, t: usize) -> Option<Paused> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())[t].clone()
    }
}

impl Shared {
    /// Reads the pause state once and applies it: flags, gauge, one log line per change.
    pub(super) async fn refresh_pauses(&self) -> Result<(), SourceError> {
        let pauses = &self.pauses;
        let read = self
            .source
            .in_transaction(async |tx| pause::read(tx, &pauses.sql, &pauses.names).await)
            .await?;
        let mut known = pauses.known.lock().unwrap_or_else(|e| e.into_inner());
        for (t, now) in read.into_iter().enumerate() {
            let name = &pauses.names[t];
            if self.wakes.set_paused(t, now.is_some()) {
                match &now {
                    Some(p) => tracing::info!(
                        table = %name, since = %p.since, by = %p.by, reason = %p.reason,
                        "Table paused: not claiming from it until `outbox-relay resume`"
                    ),
                    None => tracing::info!(table = %name, "Table resumed: claiming from it again"),
                }
            }
            self.ops
                .metrics
                .table_paused
                .get_or_create(&TableLabel {
                    table: name.to_string(),
                })
                .set(i64::from(now.is_some()));
            known[t] = now;
        }
        Ok(())
    }

    /// Reads the pause state until it is known, before any claim: a table paused while no
    /// relay ran must not get one batch. A missing pause table stops the relay.
    pub(super) async fn first_pauses(&self) -> Result<(), SourceError> {
        loop {
            match self.refresh_pauses().await {
                Ok(()) => return Ok(()),
                Err(e @ SourceError::Schema(_)) => return Err(e),
                Err(e) if self.shutdown.stop_token().is_cancelled() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "Could not read the pause state; trying again");
                    tokio::select! {
                        _ = self.shutdown.stop_token().cancelled() => return Err(e),
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
            }
        }
    }

    /// Follows the pause state every [`pause::POLL`] until `done`.
    pub(super) async fn follow_pauses(&self, done: CancellationToken) {
        loop {
            tokio::select! {
                _ = done.cancelled() => return,
                _ = tokio::time::sleep(pause::POLL) => {}
            }
            if let Err(e) = self.refresh_pauses().await {
                tracing::debug!(error = %e, "Could not read the pause state");
            }
        }
    }
}
