//! `outbox-relay check`: everything the relay needs, verified before it runs, one line per
//! finding, each saying what to fix. Used as systemd's `ExecStartPre`.
//!
//! Besides reachability and permissions it reports each destination's durability
//! ([`durability`]): a setting that lets the broker lose a message it acknowledged is a
//! warning naming the setting and the fix (a failure with `--strict`). `--format json`
//! gives the same as one document ([`Report::to_json`]).

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::json;

use crate::config::{Config, SinkTarget, TableConfig};
use crate::sink::nats::NatsSink;
use crate::source::{describe, schema, session, SessionLimits, SessionMode, SourceError};
use durability::Destination;
use tokio_postgres::GenericClient;

mod durability;
mod kafka;
mod nats;
mod patterns;

/// The longest `check` waits to connect to NATS (the publish timeout, if shorter): a
/// check must answer soon, and a server that is up answers well within it.
const CHECK_CONNECT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl Level {
    fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "fail",
        }
    }
}

/// One line of `check` output.
#[derive(Debug, Clone)]
pub struct Finding {
    pub level: Level,
    pub(crate) subject: String,
    pub(crate) message: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tag = match self.level {
            Level::Ok => "ok  ",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        };
        write!(f, "{tag} {}: {}", self.subject, self.message)
    }
}

/// What `check` found: its lines, and each destination's durability as data.
#[derive(Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    destinations: Vec<Destination>,
    /// Durability warnings were made failures.
    strict: bool,
}

impl Report {
    /// Whether any finding failed (with `--strict`, durability warnings included): exit 1.
    pub fn failed(&self) -> bool {
        self.findings.iter().any(|f| f.level == Level::Fail)
    }

    /// `check --format json`: `{"ok", "strict", "findings": [{level, subject, message}],
    /// "destinations": [{kind, name, settings: {...}, warnings: [{setting, message}]}]}`.
    pub fn to_json(&self) -> serde_json::Value {
        let findings: Vec<_> = self
            .findings
            .iter()
            .map(|f| json!({"level": f.level.as_str(), "subject": f.subject, "message": f.message}))
            .collect();
        let destinations: Vec<_> = self.destinations.iter().map(Destination::to_json).collect();
        json!({
            "ok": !self.failed(),
            "strict": self.strict,
            "findings": findings,
            "destinations": destinations,
        })
    }

    fn push(&mut self, level: Level, subject: impl Into<String>, message: impl Into<String>) {
        self.findings.push(Finding {
            level,
            subject: subject.into(),
            message: message.into(),
        });
    }

    /// A destination whose durability could not be read: a warning, a failure with
    /// `--strict` (what cannot be verified is not taken as safe).
    fn unverified(&mut self, subject: impl Into<String>, message: impl Into<String>) {
        let level = if self.strict {
            Level::Fail
        } else {
            Level::Warn
        };
        self.push(level, subject, message);
    }

    /// A destination's settings on one line, then a line per warning (a failure with
    /// `--strict`).
    fn durability(&mut self, subject: String, destination: Destination) {
        self.push(Level::Ok, subject.clone(), destination.summary());
        let level = if self.strict {
            Level::Fail
        } else {
            Level::Warn
        };
        for w in &destination.warnings {
            self.push(level, subject.clone(), w.message.clone());
        }
        self.destinations.push(destination);
    }
}

/// Runs every check. The configuration is already valid (it was loaded). `strict`: a
/// durability warning is a failure.
pub async fn check(config: &Config, strict: bool) -> Report {
    let mut out = Report {
        strict,
        ..Report::default()
    };
    out.push(Level::Ok, "config", "valid");
    let subjects = check_postgres(config, &mut out).await;
    match &config.sink.target {
        SinkTarget::Nats(nats) => {
            match NatsSink::connect(nats, config.sink.publish_timeout.min(CHECK_CONNECT)).await {
                Ok(sink) => {
                    out.push(Level::Ok, format!("nats {}", nats.redacted()), "reachable");
                    nats::check_streams(&sink, &subjects, &mut out).await;
                }
                Err(e) => out.push(
                    Level::Fail,
                    format!("nats {}", nats.redacted()),
                    format!("{e}: start the server or fix sink.nats.url"),
                ),
            }
        }
        SinkTarget::Kafka(kafka) => kafka::check_kafka(kafka, config, &subjects, &mut out).await,
        SinkTarget::Stdout => out.push(Level::Ok, "sink", "stdout needs no checks"),
    }
    check_tracing(config, &mut out).await;
    out
}

/// With trace export on: does the collector accept an (empty) OTLP/HTTP export? A WARN at
/// worst, never a failure: relaying does not depend on it.
async fn check_tracing(config: &Config, out: &mut Report) {
    let Some(url) = crate::ops::otel::traces_url(&config.tracing) else {
        return;
    };
    let target = format!("tracing {}", crate::config::redact_userinfo(&url));
    let probe = tokio::task::spawn_blocking(move || crate::ops::otel::probe_collector(&url))
        .await
        .map_err(|e| format!("the probe failed: {e}"))
        .and_then(|accepted| accepted.map_err(|e| e.to_string()));
    match probe {
        Ok(()) => out.push(Level::Ok, target, "the collector accepts OTLP/HTTP exports"),
        Err(e) => out.push(
            Level::Warn,
            target,
            format!(
                "{e}; spans are dropped until it accepts them (relaying does not depend on \
                 it): fix [tracing] otlp_endpoint or OTEL_EXPORTER_OTLP_ENDPOINT, or start \
                 the collector"
            ),
        ),
    }
}

/// Checks the database and each table; returns the subjects to look for in the broker,
/// per table.
async fn check_postgres(config: &Config, out: &mut Report) -> Vec<(String, BTreeSet<String>)> {
    let target = format!("postgres {}", config.postgres.redacted());
    let limits = SessionLimits::one_shot(&config.postgres);
    let connected = tokio::time::timeout(
        2 * crate::source::attempt_limit(&config.postgres),
        session::open(&config.postgres, limits),
    )
    .await;
    let (mut client, mode) = match connected {
        Ok(Ok((client, connection, mode))) => {
            tokio::spawn(connection);
            (client, mode)
        }
        Ok(Err(e)) => {
            out.push(Level::Fail, target, format!("cannot connect: {e}"));
            return Vec::new();
        }
        Err(_) => {
            out.push(Level::Fail, target, "connection timed out");
            return Vec::new();
        }
    };
    match client.simple_query("SHOW server_version").await {
        Ok(messages) => {
            let version = messages.iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                _ => None,
            });
            out.push(
                Level::Ok,
                target.clone(),
                format!("reachable (PostgreSQL {})", version.unwrap_or_default()),
            )
        }
        Err(e) => out.push(Level::Fail, target.clone(), describe(&e)),
    }
    if mode == SessionMode::Pooled {
        pooler_findings(config, &target, out);
    }
    let config = &patterns::resolve(&client, config, out).await;
    check_tables(&mut client, mode, limits, config, out).await
}

/// Checks every table of `config`, each kind of question asked of all of them at once
/// ([`schema::inspect_all`]): one line per problem, under its table's name. Returns the
/// subjects of those that pass: a literal topic, or those of the table's pending rows,
/// each table's read in a transaction of its own (a read that fails ends only its own).
async fn check_tables(
    client: &mut tokio_postgres::Client,
    mode: SessionMode,
    limits: SessionLimits,
    config: &Config,
    out: &mut Report,
) -> Vec<(String, BTreeSet<String>)> {
    let tables: Vec<&TableConfig> = config.tables.iter().collect();
    let inspected = in_transaction(client, mode, limits, async |tx| {
        schema::inspect_all(tx, &tables, &config.relay).await
    })
    .await;
    let inspected = match inspected {
        Ok(inspected) => inspected,
        Err(e) => {
            for table in &config.tables {
                out.push(Level::Fail, format!("table {}", table.name), e.to_string());
            }
            return Vec::new();
        }
    };
    let mut subjects = Vec::new();
    for (table, shape) in config.tables.iter().zip(inspected) {
        let subject = format!("table {}", table.name);
        let read = match shape {
            Ok(_) => subjects_of(client, mode, limits, table)
                .await
                .map_err(|e| vec![e.to_string()]),
            Err(problems) => Err(problems),
        };
        match read {
            Ok(found) => {
                out.push(Level::Ok, subject, "columns, types and privileges usable");
                subjects.push((table.name.to_string(), found));
            }
            Err(problems) => {
                for p in problems {
                    out.push(Level::Fail, subject.clone(), p);
                }
            }
        }
    }
    subjects
}

/// The subjects `table`'s rows go to: its topic if it is literal, else those of its
/// pending rows ([`row_subjects`]), read in a transaction of their own.
async fn subjects_of(
    client: &mut tokio_postgres::Client,
    mode: SessionMode,
    limits: SessionLimits,
    table: &TableConfig,
) -> Result<BTreeSet<String>, SourceError> {
    match table.topic.literal() {
        Some(literal) => Ok(BTreeSet::from([literal.to_owned()])),
        None => {
            in_transaction(client, mode, limits, async |tx| {
                Ok(row_subjects(tx, table).await)
            })
            .await
        }
    }
}

/// Runs `work` in a transaction of its own on `client`: behind a pooler in transaction mode
/// that is what keeps its reads on one server session, with the deadlines set there.
async fn in_transaction<T>(
    client: &mut tokio_postgres::Client,
    mode: SessionMode,
    limits: SessionLimits,
    work: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<T, SourceError>,
) -> Result<T, SourceError> {
    let tx = client.transaction().await?;
    if mode == SessionMode::Pooled {
        tx.batch_execute(&session::set_local(limits)).await?;
    }
    let value = work(&tx).await?;
    tx.commit().await?;
    Ok(value)
}

/// What the relay needs behind a pooler in transaction mode (PgBouncer), and whether the
/// configuration gives it.
fn pooler_findings(config: &Config, target: &str, out: &mut Report) {
    out.push(
        Level::Warn,
        target.to_owned(),
        "reached through a pooler in transaction mode (start-up options refused, as \
         PgBouncer does): session deadlines are set per transaction; `migrate` needs a \
         direct connection",
    );
    if config.postgres.prepared_statements {
        out.push(
            Level::Fail,
            target.to_owned(),
            "postgres.prepared_statements is true: a pooler in transaction mode hands each \
             transaction another server session, where a statement prepared earlier does not \
             exist (PgBouncer before 1.21, or max_prepared_statements = 0): set \
             postgres.prepared_statements = false",
        );
    }
    if config.postgres.listen.is_none() {
        out.push(
            Level::Warn,
            target.to_owned(),
            "LISTEN cannot work through the pooler: idle workers poll every \
             relay.poll_interval; set postgres.listen_url to a direct connection for NOTIFY \
             wake-ups",
        );
    }
}

/// The subjects the rows of a table whose topic is a template go to: those of up to 100
/// distinct pending rows.
async fn row_subjects(client: &impl GenericClient, table: &TableConfig) -> BTreeSet<String> {
    let columns: Vec<String> = table
        .topic
        .columns()
        .iter()
        .map(|c| format!("{}::text", c.quoted()))
        .collect();
    let sql = format!(
        "SELECT DISTINCT {} FROM (SELECT * FROM {} WHERE {} IS NULL AND {} IS NULL LIMIT 10000) s LIMIT 100",
        columns.join(", "),
        table.name.quoted(),
        table.columns.published_at.quoted(),
        table.columns.dead_at.quoted(),
    );
    let Ok(rows) = client.query(&sql, &[]).await else {
        return BTreeSet::new();
    };
    rows.iter()
        .filter_map(|row| {
            let values: Vec<Option<String>> = (0..row.len()).map(|i| row.get(i)).collect();
            table.topic.render(&values).ok().map(|t| t.to_string())
        })
        .collect()
}
