//! `outbox-relay check`: everything the relay needs, verified before it runs, one line per
//! finding, each saying what to fix. Used as systemd's `ExecStartPre`.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::config::kafka::refused_properties;
use crate::config::{Config, KafkaConfig, SinkTarget, TableConfig};
use crate::sink::kafka::{check_topic, KafkaSink};
use crate::sink::nats::{check_subject, NatsSink};
use crate::source::{describe, schema, session, SessionLimits, SessionMode, SourceError};
use tokio_postgres::GenericClient;

/// The longest `check` waits to connect to NATS (the publish timeout, if shorter): a
/// check must answer soon, and a server that is up answers well within it.
const CHECK_CONNECT: Duration = Duration::from_secs(5);
/// JetStream de-duplicates re-sent messages only inside this window; shorter windows let
/// duplicates through after a crash between publish and commit.
const MIN_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Ok,
    Warn,
    Fail,
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

#[derive(Default)]
struct Findings(Vec<Finding>);

impl Findings {
    fn push(&mut self, level: Level, subject: impl Into<String>, message: impl Into<String>) {
        self.0.push(Finding {
            level,
            subject: subject.into(),
            message: message.into(),
        });
    }
}

/// Runs every check. The configuration is already valid (it was loaded).
pub async fn check(config: &Config) -> Vec<Finding> {
    let mut out = Findings::default();
    out.push(Level::Ok, "config", "valid");
    let subjects = check_postgres(config, &mut out).await;
    match &config.sink.target {
        SinkTarget::Nats(nats) => {
            match NatsSink::connect(nats, config.sink.publish_timeout.min(CHECK_CONNECT)).await {
                Ok(sink) => {
                    out.push(Level::Ok, format!("nats {}", nats.redacted()), "reachable");
                    check_streams(&sink, &subjects, &mut out).await;
                }
                Err(e) => out.push(
                    Level::Fail,
                    format!("nats {}", nats.redacted()),
                    format!("{e}: start the server or fix sink.nats.url"),
                ),
            }
        }
        SinkTarget::Kafka(kafka) => check_kafka(kafka, config, &subjects, &mut out).await,
        SinkTarget::Stdout => out.push(Level::Ok, "sink", "stdout needs no checks"),
    }
    check_tracing(config, &mut out).await;
    out.0
}

/// With trace export on: does the collector accept an (empty) OTLP/HTTP export? A WARN at
/// worst, never a failure: relaying does not depend on it.
async fn check_tracing(config: &Config, out: &mut Findings) {
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
async fn check_postgres(config: &Config, out: &mut Findings) -> Vec<(String, BTreeSet<String>)> {
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
    let mut subjects = Vec::new();
    for table in &config.tables {
        let subject = format!("table {}", table.name);
        // Each table's reads in a transaction of their own: behind a pooler in transaction
        // mode that is what keeps them on one server session, with the deadlines set there.
        let inspected = async {
            let tx = client.transaction().await?;
            if mode == SessionMode::Pooled {
                tx.batch_execute(&session::set_local(limits)).await?;
            }
            let shape = schema::inspect(&tx, table, &config.relay).await?;
            let found = match shape {
                Ok(_) => Ok(table_subjects(&tx, table).await),
                Err(problems) => Err(problems),
            };
            tx.commit().await?;
            Ok::<_, SourceError>(found)
        };
        match inspected.await {
            Ok(Ok(found)) => {
                out.push(Level::Ok, subject, "columns, types and privileges usable");
                subjects.push((table.name.to_string(), found));
            }
            Ok(Err(problems)) => {
                for p in problems {
                    out.push(Level::Fail, subject.clone(), p);
                }
            }
            Err(e) => out.push(Level::Fail, subject, e.to_string()),
        }
    }
    subjects
}

/// What the relay needs behind a pooler in transaction mode (PgBouncer), and whether the
/// configuration gives it.
fn pooler_findings(config: &Config, target: &str, out: &mut Findings) {
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

/// The subjects a table's rows go to: the template itself if it is literal, else the
/// subjects of up to 100 distinct pending rows.
async fn table_subjects(client: &impl GenericClient, table: &TableConfig) -> BTreeSet<String> {
    if let Some(literal) = table.topic.literal() {
        return BTreeSet::from([literal.to_owned()]);
    }
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

async fn check_streams(
    sink: &NatsSink,
    subjects: &[(String, BTreeSet<String>)],
    out: &mut Findings,
) {
    let js = sink.jetstream();
    let info = sink.server_info();
    if !info.jetstream {
        out.push(
            Level::Fail,
            "jetstream",
            format!(
                "server {} has JetStream disabled: start it with -js (or jetstream {{}} in its config)",
                info.version
            ),
        );
        return;
    }
    out.push(
        Level::Ok,
        "jetstream",
        format!("enabled (nats-server {})", info.version),
    );
    for (table, set) in subjects {
        if set.is_empty() {
            out.push(
                Level::Ok,
                format!("table {table}"),
                "subjects depend on row data and no row is pending; nothing to match to a stream yet",
            );
        }
        let mut streams_seen = BTreeSet::new();
        for subject in set {
            if let Err(e) = check_subject(subject) {
                out.push(Level::Fail, format!("subject {subject:?}"), e);
                continue;
            }
            match js.stream_by_subject(subject.clone()).await {
                Ok(stream) => {
                    out.push(
                        Level::Ok,
                        format!("subject {subject}"),
                        format!("stored by stream {stream}"),
                    );
                    streams_seen.insert(stream);
                }
                Err(_) => out.push(
                    Level::Fail,
                    format!("subject {subject}"),
                    "no JetStream stream captures it: create one, e.g. \
                     `nats stream add OUTBOX --subjects '<subject or wildcard>' --dupe-window 2m`",
                ),
            }
        }
        for name in streams_seen {
            match js.get_stream(&name).await {
                Ok(mut stream) => match stream.info().await {
                    Ok(info) if info.config.duplicate_window < MIN_DUPLICATE_WINDOW => out.push(
                        Level::Warn,
                        format!("stream {name}"),
                        format!(
                            "duplicate window is {:?}; under 2m a re-send after a crash may not \
                             be de-duplicated: raise it (--dupe-window 2m)",
                            info.config.duplicate_window
                        ),
                    ),
                    Ok(info) => out.push(
                        Level::Ok,
                        format!("stream {name}"),
                        format!("duplicate window {:?}", info.config.duplicate_window),
                    ),
                    Err(e) => out.push(Level::Warn, format!("stream {name}"), e.to_string()),
                },
                Err(e) => out.push(Level::Warn, format!("stream {name}"), e.to_string()),
            }
        }
    }
}

async fn check_kafka(
    kafka: &KafkaConfig,
    config: &Config,
    subjects: &[(String, BTreeSet<String>)],
    out: &mut Findings,
) {
    let target = format!("kafka {}", kafka.brokers);
    let problems: Vec<String> = refused_properties(&kafka.properties)
        .iter()
        .map(|r| r.short())
        .collect();
    for p in &problems {
        out.push(Level::Fail, "sink.kafka.properties", p.clone());
    }
    if !problems.is_empty() {
        return;
    }
    let sink = match KafkaSink::connect(kafka, config.sink.publish_timeout) {
        Ok(sink) => sink,
        Err(e) => return out.push(Level::Fail, target, e.to_string()),
    };
    let topics = match sink.metadata(None).await {
        Ok(topics) => {
            out.push(
                Level::Ok,
                target,
                format!("reachable ({} topics)", topics.len()),
            );
            topics
        }
        Err(e) => {
            return out.push(
                Level::Fail,
                target,
                format!("{e}: start the brokers or fix sink.kafka.brokers"),
            )
        }
    };
    for (table, set) in subjects {
        if set.is_empty() {
            out.push(
                Level::Ok,
                format!("table {table}"),
                "topics depend on row data and no row is pending; nothing to look up yet",
            );
        }
        for topic in set {
            if let Err(e) = check_topic(topic) {
                out.push(Level::Fail, format!("topic {topic:?}"), e);
                continue;
            }
            match topics.get(topic) {
                Some(partitions) => out.push(
                    Level::Ok,
                    format!("topic {topic}"),
                    format!("{partitions} partitions"),
                ),
                None => out.push(
                    Level::Warn,
                    format!("topic {topic}"),
                    "does not exist; unless the brokers auto-create topics, rows for it wait \
                     (retried, never dead-lettered) until it is created",
                ),
            }
        }
    }
}
