//! Tables found by pattern while the relay runs (`run` only; `drain` relays the tables
//! matched when it started).
//!
//! Every [`DISCOVERY_INTERVAL`] one task asks the catalog which tables the patterns match
//! (one statement for every pattern: `source::discover`), and looks again at the tables
//! left out because their check failed. When the answer changed, it ends the *generation*:
//! the workers stop claiming and finish their batches (as at a stop, but the run goes on),
//! the generation's background tasks (floor keepers, poller, probe, ...) stop, and a new
//! generation starts with the tables found now, checked afresh. A table that appeared is
//! relayed from then on; a table that is gone is let go with one WARN.
//!
//! Why generations rather than tables added live: every part of a run knows its tables by
//! their place in one list (wake-ups, pauses, the valve, sleep marks), built once; a new
//! list is one restart of those parts, paid only when a table appears or goes, and the
//! order and at-least-once arguments hold unchanged (a generation ends as a run does).
//!
//! A table that is dropped while relayed makes its claims fail (`undefined_table`): the
//! worker lets it go at once (`Shared::let_go`: one WARN, no more claims, and the
//! generation ends) rather than stopping the relay as a missing table does at start.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::start::{self, Background, Found, Matches, Prepared};
use super::tasks::TaskSet;
use super::{RelayError, Shared, BACKGROUND_STOP, BACKGROUND_STOP_ABORTED};
use crate::config::{Config, TableConfig, TableName};
use crate::source::{discover, schema, SourceError};

/// How often a running relay looks for tables its patterns match: a new tenant's table is
/// relayed within this (and the time to start a generation) of its creation.
pub(super) const DISCOVERY_INTERVAL: Duration = Duration::from_secs(3);

/// A generation's background tasks, stopped when it ends.
pub(super) struct Tasks {
    pub(super) set: TaskSet,
    pub(super) done: CancellationToken,
}

impl Tasks {
    pub(super) fn new(background: &Background) -> Tasks {
        Tasks {
            set: TaskSet::default(),
            done: background.done.child_token(),
        }
    }
}

/// What was already said of the tables left out, so that each is logged once (until it
/// is relayed, or leaves, and comes back).
#[derive(Debug, Default)]
pub(super) struct Said {
    left_out: BTreeSet<TableName>,
    ambiguous: BTreeSet<TableName>,
}

/// Looks for a change every [`DISCOVERY_INTERVAL`] until `done`; at the first, ends the
/// generation of `shared`.
pub(super) async fn watch(
    shared: Arc<Shared>,
    patterns: Vec<TableConfig>,
    found: Found,
    done: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = done.cancelled() => return,
            _ = tokio::time::sleep(DISCOVERY_INTERVAL) => {}
        }
        match changed(&shared, &patterns, &found).await {
            Ok(false) => {}
            Ok(true) => {
                tracing::debug!("The tables the patterns match changed; starting a new generation");
                shared.shutdown.end_generation();
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, "Could not look for tables matching the patterns")
            }
        }
    }
}

/// Whether the patterns match other tables than `found`, or a table left out passes its
/// check now.
async fn changed(
    shared: &Shared,
    patterns: &[TableConfig],
    found: &Found,
) -> Result<bool, SourceError> {
    let relay = &shared.relay;
    shared
        .source
        .in_transaction(async |tx| {
            let matched = discover::matching(tx.client(), patterns).await?;
            let now: BTreeSet<TableName> = matched.into_iter().map(|(_, name)| name).collect();
            if now != found.matched {
                return Ok(true);
            }
            let left_out: Vec<&TableConfig> = found.left_out.iter().map(|(t, _)| t).collect();
            let checked = schema::inspect_all(tx.client(), &left_out, relay).await?;
            Ok(checked.iter().any(Result::is_ok))
        })
        .await
}

/// After a generation's workers stopped: stops its background tasks, then prepares the
/// next generation, or returns `None` when the run itself is stopping.
pub(super) async fn next(
    shared: &Arc<Shared>,
    config: &Config,
    tasks: Tasks,
    said: &mut Said,
) -> Result<Option<Prepared>, RelayError> {
    let within = if shared.shutdown.abort_token().is_cancelled() {
        BACKGROUND_STOP_ABORTED
    } else {
        BACKGROUND_STOP
    };
    tasks.set.stop(&tasks.done, within).await;
    if shared.shutdown.run_stop_token().is_cancelled() {
        return Ok(None);
    }
    // A table dropped between the checks and the pause state's read fails the read: the
    // next look at the catalog no longer finds it. Any other failure persists, and stops
    // the run as it would at start.
    let mut attempts = 0;
    let prepared = loop {
        let prepared = start::retry_transient(
            "PostgreSQL",
            &shared.shutdown.generation(),
            SourceError::class,
            |up| shared.ops.postgres_reachable(up),
            || start::prepare_found(shared.source.clone(), config, Matches::RunLater),
        )
        .await;
        attempts += 1;
        match prepared {
            Err(RelayError::Source(SourceError::Schema(e))) if attempts < 3 => {
                tracing::debug!(error = %e, "Tables changed while being prepared; looking again");
                tokio::select! {
                    _ = shared.shutdown.run_stop_token().cancelled() => return Ok(None),
                    _ = tokio::time::sleep(DISCOVERY_INTERVAL) => {}
                }
            }
            prepared => break prepared?,
        }
    };
    log_changes(Some(shared), &prepared, said);
    Ok(Some(prepared))
}

/// One line per change from the generation `before` (none: the first) to `after`: a table
/// found (INFO), a table gone (WARN, unless its worker said so already; its metrics
/// series removed), a table left out because its check fails (WARN) or two entries match
/// it (ERROR: an operator must act).
pub(super) fn log_changes(before: Option<&Shared>, after: &Prepared, said: &mut Said) {
    let found = &after.found;
    let now: BTreeSet<&TableName> = after.tables.iter().map(|t| &t.config.name).collect();
    if let Some(before) = before {
        let was: BTreeSet<&TableName> = before.tables.iter().map(|t| t.name()).collect();
        for t in after
            .tables
            .iter()
            .filter(|t| !was.contains(&t.config.name))
        {
            let entry = t.config.entry_name();
            tracing::info!(table = %t.config.name, %entry, "Table found by pattern; relaying it");
        }
        for t in before.tables.iter().filter(|t| !now.contains(t.name())) {
            if !t.is_gone() && !found.matched.contains(t.name()) {
                tracing::warn!(table = %t.name(), "Table no longer there; letting it go");
            }
            let name = t.name().to_string();
            before.ops.metrics.forget_table(&name, before.sink.name());
        }
    }
    for (table, problems) in &found.left_out {
        if !said.left_out.contains(&table.name) {
            tracing::warn!(
                table = %table.name, %problems,
                "Table matched by pattern cannot be relayed yet; looking again every few seconds"
            );
        }
    }
    for (table, problem) in &found.ambiguous {
        if !said.ambiguous.contains(table) {
            tracing::error!(%table, %problem, "Table left out: two [[tables]] entries match it");
        }
    }
    said.left_out = found.left_out.iter().map(|(t, _)| t.name.clone()).collect();
    said.ambiguous = found.ambiguous.iter().map(|(t, _)| t.clone()).collect();
}
