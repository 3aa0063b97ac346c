//! PostgreSQL: the connection pool, the outbox table's shape, claiming rows, marking or
//! deleting them, schema migrations and LISTEN/NOTIFY wake-ups.
//!
//! Every session the relay opens carries `statement_timeout`, `lock_timeout` and
//! `idle_in_transaction_session_timeout`, so no statement and no forgotten transaction can
//! outlive its deadline on the server, whatever happens to the client.

pub mod claim;
pub mod class;
pub mod floor;
pub mod listen;
pub mod migrate;
pub mod retention;
pub mod schema;
pub mod session;
pub mod sql;
pub mod table;
pub mod tls;
pub mod vacuum;

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};

use crate::config::PostgresConfig;
use crate::error::ErrorClass;
use tls::Connector as _;

pub use session::{connect, connect_timeout, session_config, Connection, SessionLimits};

/// A PostgreSQL failure, with the class that says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("PostgreSQL: {}", describe(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("PostgreSQL connection pool: {0}")]
    Pool(String),
    #[error("PostgreSQL did not answer within {0:?}")]
    Timeout(Duration),
    /// The table is missing, lacks a column or has one of an unusable type.
    #[error("{0}")]
    Schema(String),
}

impl SourceError {
    /// Whether the connection that raised this may be half-dead (a client-side timeout,
    /// an I/O error) and must be discarded rather than returned to the pool.
    pub fn connection_suspect(&self) -> bool {
        match self {
            SourceError::Timeout(_) => true,
            SourceError::Db(e) => e.code().is_none(),
            SourceError::Pool(_) | SourceError::Schema(_) => false,
        }
    }

    pub fn class(&self) -> ErrorClass {
        match self {
            SourceError::Db(e) => class::classify(e),
            SourceError::Pool(_) | SourceError::Timeout(_) => ErrorClass::Transient,
            SourceError::Schema(_) => ErrorClass::Fatal,
        }
    }
}

impl From<PoolError> for SourceError {
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::Backend(e) => SourceError::Db(e),
            other => SourceError::Pool(other.to_string()),
        }
    }
}

/// Renders a tokio-postgres error with the server's message and SQLSTATE, or the I/O cause.
pub fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        );
        if let Some(hint) = db.hint() {
            s.push_str(&format!("; hint: {hint}"));
        }
        return s;
    }
    // The chain, each cause once (OpenSSL repeats its error stack at every level).
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(&format!(": {text}"));
        }
        cause = c.source();
    }
    match tls::explain(&s) {
        Some(why) => format!("{why} ({s})"),
        None => s,
    }
}

/// A claim transaction whose statements are prepared once per session and reused.
///
/// `tokio-postgres` prepares a `&str` statement on every call: one round trip to parse and
/// describe it, one to run it, and a close. Through the session's statement cache the hot
/// path's statements (claim, lock, delete/mark, record failures) cost one round trip each
/// after their first use on a session, and PostgreSQL may keep their plans. With
/// `postgres.prepared_statements = false` (PgBouncer before 1.21 in transaction mode, which
/// cannot keep a prepared statement across transactions) every call prepares afresh.
pub struct Tx<'a> {
    tx: deadpool_postgres::Transaction<'a>,
    cached: bool,
}

impl<'a> Tx<'a> {
    async fn begin(
        session: &'a mut deadpool_postgres::Object,
        cached: bool,
    ) -> Result<Tx<'a>, SourceError> {
        Ok(Tx {
            tx: session.transaction().await?,
            cached,
        })
    }

    async fn statement(&self, sql: &str) -> Result<tokio_postgres::Statement, SourceError> {
        Ok(if self.cached {
            self.tx.prepare_cached(sql).await?
        } else {
            self.tx.prepare(sql).await?
        })
    }

    pub async fn query(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, SourceError> {
        let statement = self.statement(sql).await?;
        Ok(self.tx.query(&statement, params).await?)
    }

    pub async fn execute(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, SourceError> {
        let statement = self.statement(sql).await?;
        Ok(self.tx.execute(&statement, params).await?)
    }

    pub async fn commit(self) -> Result<(), SourceError> {
        Ok(self.tx.commit().await?)
    }

    pub async fn rollback(self) -> Result<(), SourceError> {
        Ok(self.tx.rollback().await?)
    }
}

/// The relay's pool of PostgreSQL sessions.
#[derive(Clone)]
pub struct Source {
    pool: Pool,
    statement_timeout: Duration,
    prepared_statements: bool,
}

impl Source {
    /// Builds the pool. Connections are opened lazily, on first use.
    pub fn new(pg: &PostgresConfig, limits: SessionLimits) -> Result<Source, SourceError> {
        let manager = Manager::from_config(
            session_config(pg, limits),
            pg.tls.connector().map_err(SourceError::Pool)?,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pg.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(limits.statement_timeout))
            .create_timeout(Some(connect_timeout(pg)))
            .recycle_timeout(Some(connect_timeout(pg)))
            .build()
            .map_err(|e| SourceError::Pool(e.to_string()))?;
        Ok(Source {
            pool,
            statement_timeout: limits.statement_timeout,
            prepared_statements: pg.prepared_statements,
        })
    }

    /// A session from the pool.
    pub async fn session(&self) -> Result<deadpool_postgres::Object, SourceError> {
        Ok(self.pool.get().await?)
    }

    /// Opens a transaction on `session`, with statements cached as configured.
    pub async fn begin<'a>(
        &self,
        session: &'a mut deadpool_postgres::Object,
    ) -> Result<Tx<'a>, SourceError> {
        Tx::begin(session, self.prepared_statements).await
    }

    /// Returns `session` to the pool, or discards it when `error` says the connection may
    /// be half-dead (a timed-out statement may still be running on it, or never end).
    pub fn release(session: deadpool_postgres::Object, error: Option<&SourceError>) {
        if error.is_some_and(SourceError::connection_suspect) {
            drop(deadpool_postgres::Object::take(session));
        }
    }

    /// One round trip to the server within `limit`: reachability for `/readyz`.
    pub async fn ping(&self, limit: Duration) -> Result<(), SourceError> {
        let session = tokio::time::timeout(limit, self.session())
            .await
            .map_err(|_| SourceError::Timeout(limit))??;
        let result = match tokio::time::timeout(limit, session.simple_query("SELECT 1")).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(SourceError::Db(e)),
            Err(_) => Err(SourceError::Timeout(limit)),
        };
        Source::release(session, result.as_ref().err());
        result
    }

    /// Client-side deadline for one statement: the server's plus a margin for the network.
    pub fn deadline(&self) -> Duration {
        self.statement_timeout + Duration::from_secs(2)
    }

    /// Runs `fut` under [`Source::deadline`].
    pub async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, SourceError>>,
    ) -> Result<T, SourceError> {
        let limit = self.deadline();
        tokio::time::timeout(limit, fut)
            .await
            .map_err(|_| SourceError::Timeout(limit))?
    }
}
