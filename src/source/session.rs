//! The one place that decides how the relay's PostgreSQL sessions are opened: the
//! connection settings every session carries, and each command's server-side deadlines
//! ([`SessionLimits`]) with the reason for each value.

use std::time::Duration;

use super::tls::Connector as _;
use super::SourceError;
use crate::config::PostgresConfig;

/// A connection outside the pool (migrate, check, LISTEN), with the configured TLS.
pub(crate) type Connection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    postgres_openssl::TlsStream<tokio_postgres::Socket>,
>;

/// How a session's settings (its deadlines and the rest of [`settings`]) reach the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionMode {
    /// In the start-up packet (`options`): every statement of the session carries them.
    Direct,
    /// A connection pooler in transaction mode is in front (PgBouncer): it refuses
    /// `options` in the start-up packet, and each transaction may run on another server
    /// session, so a session-level `SET` would neither last nor stay ours. The settings
    /// are set `LOCAL` at the start of every transaction, and every statement runs inside
    /// an explicit transaction ([`super::Tx`]), never on its own.
    Pooled,
}

/// Host by host ([`super::hosts`]), each within [`connect_timeout`].
async fn connect_raw(
    pg: &PostgresConfig,
    config: &tokio_postgres::Config,
) -> Result<(tokio_postgres::Client, Connection), SourceError> {
    let tls = pg.tls.connector()?;
    match super::hosts::connect(config, tls, connect_timeout(pg)).await {
        Some(connected) => Ok(connected?),
        None => Err(SourceError::Timeout(attempt_limit(pg))),
    }
}

/// Opens one connection with `limits`, finding out which [`SessionMode`] the server side
/// needs: the settings go in the start-up packet, unless the server refuses the packet's
/// `options` as a protocol violation (SQLSTATE 08P01: PgBouncer's "unsupported startup
/// parameter"), in which case it connects again without them.
pub(crate) async fn open(
    pg: &PostgresConfig,
    limits: SessionLimits,
) -> Result<(tokio_postgres::Client, Connection, SessionMode), SourceError> {
    match connect_raw(pg, &session_config(pg, limits, SessionMode::Direct)).await {
        Ok((client, connection)) => Ok((client, connection, SessionMode::Direct)),
        Err(SourceError::Db(e))
            if e.code() == Some(&tokio_postgres::error::SqlState::PROTOCOL_VIOLATION) =>
        {
            let pooled = session_config(pg, limits, SessionMode::Pooled);
            let (client, connection) = connect_raw(pg, &pooled).await?;
            Ok((client, connection, SessionMode::Pooled))
        }
        Err(e) => Err(e),
    }
}

/// Server-side deadlines for a session: every session the relay opens carries them, so no
/// statement and no forgotten transaction outlives its deadline on the server, whatever
/// happens to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    pub(crate) statement_timeout: Duration,
    pub(crate) lock_timeout: Duration,
    /// Backstop for a transaction the client forgot.
    pub(crate) idle_in_transaction_timeout: Duration,
}

/// A batch's transaction idles while its rows are published; beyond the publish timeout,
/// this margin covers its mark and commit before the server ends it.
const MARK_AND_COMMIT: Duration = Duration::from_secs(10);
/// TCP keepalive after this much silence: the system default (two hours) would leave a
/// connection to a vanished server (a failover, a dropped NAT entry) unnoticed that long.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// The longest a relay session waits for a row or table lock. Claims skip locked rows, so
/// only DDL or a long `LOCK TABLE` makes one wait: better to give up and retry than to
/// queue every worker behind it.
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// How long a one-shot command (check, status, requeue, migrate) may leave a transaction
/// idle: none of them waits on anything but PostgreSQL inside one.
const ONE_SHOT_IDLE: Duration = Duration::from_secs(60);

impl SessionLimits {
    /// `run` and `drain`. A batch's transaction stays open while its rows are published,
    /// so the idle backstop is the publish timeout plus a margin for mark and commit; claim,
    /// mark and commit each take one statement deadline at most.
    pub fn relay(pg: &PostgresConfig, publish_timeout: Duration) -> SessionLimits {
        SessionLimits {
            statement_timeout: pg.statement_timeout,
            lock_timeout: LOCK_WAIT.min(pg.statement_timeout),
            idle_in_transaction_timeout: publish_timeout + MARK_AND_COMMIT,
        }
    }

    /// `check`, `status` and `requeue`: short reads and one short update; like the relay,
    /// they would rather fail than queue behind a lock.
    pub fn one_shot(pg: &PostgresConfig) -> SessionLimits {
        SessionLimits {
            statement_timeout: pg.statement_timeout,
            lock_timeout: LOCK_WAIT.min(pg.statement_timeout),
            idle_in_transaction_timeout: ONE_SHOT_IDLE,
        }
    }

    /// `migrate`: its DDL needs a table lock that a busy application holds briefly and
    /// often, so it may wait for one as long as a statement may run. (The index builds
    /// lift both deadlines for themselves, see `migrate`.)
    pub(crate) fn migrate(pg: &PostgresConfig) -> SessionLimits {
        SessionLimits {
            statement_timeout: pg.statement_timeout,
            lock_timeout: pg.statement_timeout,
            idle_in_transaction_timeout: ONE_SHOT_IDLE,
        }
    }
}

/// The settings every relay session runs with, as `(name, value)`: the deadlines of
/// `limits`, and two that suit the relay's statements.
pub(crate) fn settings(limits: SessionLimits) -> Vec<(&'static str, String)> {
    let ms = |d: Duration| d.as_millis().to_string();
    vec![
        ("statement_timeout", ms(limits.statement_timeout)),
        ("lock_timeout", ms(limits.lock_timeout)),
        (
            "idle_in_transaction_session_timeout",
            ms(limits.idle_in_transaction_timeout),
        ),
        // NOTICEs (e.g. "trigger does not exist, skipping" from migrate) are not for
        // operators.
        ("client_min_messages", "warning".to_owned()),
        // The relay's statements are short and run thousands of times a second. Their
        // generic plans (prepared statements) cannot see `LIMIT $2`, estimate a tenth of
        // the table and, on a large outbox, cross jit_above_cost: JIT compilation then
        // costs several times the scan it compiles, on every call.
        ("jit", "off".to_owned()),
        // Every statement reads a few rows in index order and stops at its LIMIT. A bitmap
        // scan reads all the rows its index condition matches before sorting them: with
        // statistics from when the table was small, the planner took one for a claim's
        // bucket window and read the whole bucket for a batch's worth of rows (a hot
        // key's whole bucket would have been read for every batch).
        ("enable_bitmapscan", "off".to_owned()),
        // Nor a sequential scan: planned while the table is empty (a relay started on a
        // drained outbox, or between bursts) every scan costs nothing, the planner picks a
        // sequential one, and a prepared statement keeps that plan as its generic plan
        // when the rows come: the floor's look then scans the whole table every time
        // (benchmark R, whose relays start on an emptied, analyzed table, met it; see
        // docs/benchmark.md, *Deployment shapes*). Off, a scan
        // the indexes can answer is answered by them whatever the statistics say; a
        // read no index can answer still runs, as a sequential scan.
        ("enable_seqscan", "off".to_owned()),
        // Each prepared statement is planned once per session (and again after the table's
        // statistics change), with the generic plan PostgreSQL would keep anyway: every
        // value a plan could lean on is hidden from the planner (`(SELECT $n)`, see
        // `sql::parts`), so the first five custom plans a session would otherwise make of
        // each statement cost the same and buy nothing but planning time, which the many
        // new sessions of relays started at once pay on a busy machine (benchmark S).
        // `MATERIALIZED` already
        // needs PostgreSQL 12, which brought this setting.
        ("plan_cache_mode", "force_generic_plan".to_owned()),
    ]
}

/// `SET LOCAL` for each of [`settings`], as one statement list: what a transaction runs
/// first in [`SessionMode::Pooled`].
pub(crate) fn set_local(limits: SessionLimits) -> String {
    settings(limits)
        .into_iter()
        .map(|(name, value)| format!("SET LOCAL {name} = '{value}'"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The connection settings for a session in `mode`: the operator's URL plus keepalives,
/// an application name and, in [`SessionMode::Direct`], [`settings`] in the start-up
/// packet.
pub(crate) fn session_config(
    pg: &PostgresConfig,
    limits: SessionLimits,
    mode: SessionMode,
) -> tokio_postgres::Config {
    let mut cfg = pg.connection.clone();
    if mode == SessionMode::Direct {
        let mut options = cfg.get_options().map(str::to_owned).unwrap_or_default();
        for (name, value) in settings(limits) {
            options.push_str(&format!(" -c {name}={value}"));
        }
        cfg.options(options.trim());
    }
    if cfg.get_application_name().is_none() {
        cfg.application_name("outbox-relay");
    }
    cfg.connect_timeout(connect_timeout(pg));
    cfg.keepalives(true);
    cfg.keepalives_idle(KEEPALIVE_IDLE);
    cfg
}

/// How long opening a connection to one host may take, start-up packet and authentication
/// included: `connect_timeout` in `postgres.url` when given, else `postgres.connect_timeout`.
pub(crate) fn connect_timeout(pg: &PostgresConfig) -> Duration {
    pg.connection
        .get_connect_timeout()
        .copied()
        .unwrap_or(pg.connect_timeout)
}

/// How long one attempt over every host of `postgres.url` may take: [`connect_timeout`]
/// per host.
pub(crate) fn attempt_limit(pg: &PostgresConfig) -> Duration {
    super::hosts::attempt_limit(&pg.connection, connect_timeout(pg))
}
