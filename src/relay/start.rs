//! Start-up: the HTTP endpoints first (a start-up probe sees a 503 with the reason, not a
//! closed port), then the broker and the tables at once, each waited for with the one
//! backoff while it answers with a transient failure (a database or broker still
//! starting), for as long as `stop` allows (`drain --timeout` bounds start-up too).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::pause::PauseState;
use super::tasks::TaskSet;
use super::{Mode, RelayError};
use crate::config::{Config, TableConfig, TableName};
use crate::error::ErrorClass;
use crate::ops::{self, Ops};
use crate::retry::Backoff;
use crate::shutdown::Shutdown;
use crate::sink::{Sink, SinkError};
use crate::source::pause::Paused;
use crate::source::table::{self, TablePlan};
use crate::source::{discover, SessionLimits, Source, SourceError};

/// Runs `attempt` until it succeeds, fails for good, or `shutdown` stops the wait (during
/// an attempt too); failures `class` calls transient are retried with backoff. `reached`
/// hears whether each attempt got an answer.
pub(super) async fn retry_transient<T, E, F, Fut>(
    what: &str,
    shutdown: &Shutdown,
    class: fn(&E) -> ErrorClass,
    reached: impl Fn(bool),
    mut attempt: F,
) -> Result<T, RelayError>
where
    E: Into<RelayError> + std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let stop = shutdown.stop_token();
    let unreachable = |last_error: String| RelayError::Unreachable {
        what: what.to_owned(),
        last_error,
    };
    let mut backoff = Backoff::reconnect();
    let mut last_error = "stopped before the first attempt ended".to_owned();
    loop {
        let result = tokio::select! {
            biased;
            _ = stop.cancelled() => return Err(unreachable(last_error)),
            r = attempt() => r,
        };
        match result {
            Ok(value) => {
                reached(true);
                return Ok(value);
            }
            Err(e) if class(&e) == ErrorClass::Transient => {
                reached(false);
                let pause = backoff.next_pause();
                tracing::warn!(error = %e, retry_in = ?pause, "{what} not reachable yet");
                last_error = e.to_string();
                tokio::select! {
                    _ = stop.cancelled() => return Err(unreachable(last_error)),
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// What start-up learned of the database before any claim.
pub(crate) struct Prepared {
    pub(crate) source: Source,
    pub(crate) tables: Vec<TablePlan>,
    pub(crate) pauses: PauseState,
    /// The pause state as first read, for every table in order.
    pub(crate) paused: Vec<Option<Paused>>,
    /// What the patterns matched (see [`Found`]).
    pub(crate) found: Found,
}

/// The tables the `[[tables]]` patterns matched when a generation was prepared.
#[derive(Debug, Default)]
pub(crate) struct Found {
    /// Every table matched, relayed or not.
    pub(crate) matched: BTreeSet<TableName>,
    /// Matched tables left out because their check failed (a tenant's table created but
    /// not migrated yet), with the problems: looked at again at each discovery.
    pub(crate) left_out: Vec<(TableConfig, String)>,
    /// Matched tables left out because two entries match them, with the sentence that
    /// says so.
    pub(crate) ambiguous: Vec<(TableName, String)>,
}

/// Opens the pool (learning how sessions get their settings), checks every table and
/// reads the pause state, waiting out transient failures.
///
/// The checks, the pause state and the workers' sessions are asked for together: each
/// waits a few round trips, and one after the other they were most of a start-up 10 ms
/// from the database. A table's problems are reported before the pause state's.
pub(crate) async fn prepare_tables(
    config: &Config,
    mode: Mode,
    limits: SessionLimits,
    shutdown: &Shutdown,
    ops: &Ops,
) -> Result<Prepared, RelayError> {
    let matches = match mode {
        Mode::Run => Matches::RunStart,
        Mode::Drain => Matches::Drain,
    };
    retry_transient(
        "PostgreSQL",
        shutdown,
        SourceError::class,
        |up| ops.postgres_reachable(up),
        || async {
            let source = Source::open(&config.postgres, limits).await?;
            if !config.patterns.is_empty() {
                return prepare_found(source, config, matches).await;
            }
            let pauses = PauseState::new(config.tables.iter().map(|t| t.name.clone()).collect());
            let (tables, paused, ()) = tokio::join!(
                table::prepare(&source, config),
                pauses.read(&source),
                source.warm(config.relay.workers),
            );
            let tables = tables?;
            let paused = paused?;
            Ok::<_, SourceError>(Prepared {
                source,
                tables,
                pauses,
                paused,
                found: Found::default(),
            })
        },
    )
    .await
}

/// What [`prepare_found`] does with a matched table it cannot relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Matches {
    /// `drain`: a table matched twice, or whose check fails, is an error (exit 2, exit 1),
    /// as a listed table's would be: `drain` exits 0 only when every table is empty.
    Drain,
    /// `run` starting: a table matched twice is an error; one whose check fails is left
    /// out (one tenant's table not migrated yet stops no one) and looked at again.
    RunStart,
    /// `run`, a later generation (`discovery`): both are left out, and said so.
    RunLater,
}

/// [`prepare_tables`] for a configuration with patterns, on `source`: reads what they
/// match, checks every table, and (by `matches`) fails on or leaves out a matched table
/// it cannot relay.
pub(crate) async fn prepare_found(
    source: Source,
    config: &Config,
    matches: Matches,
) -> Result<Prepared, SourceError> {
    let matched = source
        .in_transaction(async |tx| discover::matching(tx.client(), &config.patterns).await)
        .await?;
    let mut found = Found {
        matched: matched.iter().map(|(_, name)| name.clone()).collect(),
        ..Found::default()
    };
    let (config, ambiguous) = discover::expand(config, matched);
    if let (false, Some((_, problem))) = (matches == Matches::RunLater, ambiguous.first()) {
        return Err(SourceError::Config(problem.clone()));
    }
    found.ambiguous = ambiguous;
    let (checked, ()) = tokio::join!(
        table::prepare_each(&source, &config),
        source.warm(config.relay.workers),
    );
    let mut tables = Vec::new();
    for (table, checked) in config.tables.iter().zip(checked?) {
        match checked {
            Ok(plan) => tables.push(plan),
            Err(problems) if table.pattern.is_some() && matches != Matches::Drain => {
                found.left_out.push((table.clone(), problems));
            }
            Err(problems) => return Err(SourceError::Schema(problems)),
        }
    }
    let pauses = PauseState::new(tables.iter().map(|t| t.config.name.clone()).collect());
    let paused = pauses.read(&source).await?;
    Ok(Prepared {
        source,
        tables,
        pauses,
        paused,
        found,
    })
}

/// Connects the configured sink, waiting out transient failures.
pub(crate) async fn connect_sink(
    config: &Config,
    shutdown: &Shutdown,
    ops: &Ops,
) -> Result<Sink, RelayError> {
    retry_transient(
        "Broker",
        shutdown,
        |e: &SinkError| e.class,
        |up| ops.broker_reachable(up),
        || Sink::connect(&config.sink),
    )
    .await
}

/// The run's background: the endpoints' state, and every task that outlives the workers
/// (the HTTP endpoints, served from the moment the configuration is valid until the relay
/// returns, the probe, the watchdog, each table's floor keeper, ...).
pub(crate) struct Background {
    pub(crate) ops: Arc<Ops>,
    /// Stops the HTTP server and the other background tasks when dropped, should the run
    /// end without [`Background::stop`] (a panic).
    _done: tokio_util::sync::DropGuard,
    /// The parent of every task that outlives the workers (probe, watchdog, floor keeper).
    pub(crate) done: CancellationToken,
    /// Those tasks, awaited by [`Background::stop`].
    pub(crate) tasks: TaskSet,
}

impl Background {
    pub(crate) async fn start(config: &Config) -> Result<Background, RelayError> {
        let ops = Ops::new(config.relay.poll_interval);
        let done = CancellationToken::new();
        let tasks = TaskSet::default();
        if let Some(http) = &config.http {
            let listener = ops::http::bind(http.listen).await?;
            tracing::info!(listen = %http.listen, "Serving /metrics, /healthz, /readyz");
            tasks.spawn(
                "http",
                ops::http::serve(listener, ops.clone(), done.clone()),
            );
        }
        Ok(Background {
            ops,
            _done: done.clone().drop_guard(),
            done,
            tasks,
        })
    }

    /// Stops the background tasks and waits `within` at most for them; returns the names
    /// of those still running then (named in a WARN too, and left behind).
    pub(crate) async fn stop(self, within: Duration) -> Vec<String> {
        self.tasks.stop(&self.done, within).await
    }
}
