//! PostgreSQL: the connection pool, the outbox table's shape, claiming rows, marking or
//! deleting them, schema migrations and LISTEN/NOTIFY wake-ups.
//!
//! Every session the relay opens carries `statement_timeout`, `lock_timeout` and
//! `idle_in_transaction_session_timeout`, so no statement and no forgotten transaction can
//! outlive its deadline on the server, whatever happens to the client.

pub mod claim;
mod class;
pub mod discover;
pub(crate) mod floor;
mod hosts;
pub(crate) mod listen;
pub mod migrate;
pub(crate) mod operator;
pub(crate) mod pause;
pub(crate) mod poll;
pub(crate) mod rate;
pub(crate) mod retention;
pub(crate) mod schema;
pub(crate) mod session;
pub(crate) mod settle;
pub(crate) mod sleepers;
mod sql;
pub mod table;
mod tls;
pub(crate) mod vacuum;

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};
use tokio_postgres::types::Type;

use crate::config::PostgresConfig;
use crate::error::ErrorClass;
use tls::Connector as _;

pub(crate) use session::{attempt_limit, connect_timeout, session_config};
pub use session::{SessionLimits, SessionMode};

/// What a client-side deadline gives a statement beyond the server's `statement_timeout`:
/// a margin for the network, so that the server's own deadline, whose error names the
/// statement, fires first.
pub(crate) const DEADLINE_MARGIN: Duration = Duration::from_secs(2);

/// What the pool gives opening a connection beyond the last host's own attempt limit.
const CREATE_MARGIN: Duration = Duration::from_secs(1);

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
    /// A configuration problem only the catalog reveals: a table matched by two
    /// `[[tables]]` entries (exit 2).
    #[error("invalid config: {0}")]
    Config(String),
    /// TLS could not be set up (a certificate or key file unreadable since start-up).
    #[error("PostgreSQL TLS: {0}")]
    Tls(#[from] tls::TlsError),
}

impl SourceError {
    /// Whether the connection that raised this may be half-dead (a client-side timeout,
    /// an I/O error) and must be discarded rather than returned to the pool.
    pub(crate) fn connection_suspect(&self) -> bool {
        match self {
            SourceError::Timeout(_) => true,
            SourceError::Db(e) => e.code().is_none(),
            SourceError::Pool(_)
            | SourceError::Schema(_)
            | SourceError::Config(_)
            | SourceError::Tls(_) => false,
        }
    }

    /// Whether the statement named a table or schema that is not there (any more):
    /// `undefined_table` or `invalid_schema_name`.
    pub(crate) fn is_missing_relation(&self) -> bool {
        use tokio_postgres::error::SqlState;
        matches!(self, SourceError::Db(e)
            if e.code() == Some(&SqlState::UNDEFINED_TABLE)
                || e.code() == Some(&SqlState::INVALID_SCHEMA_NAME))
    }

    pub(crate) fn class(&self) -> ErrorClass {
        match self {
            SourceError::Db(e) => class::classify(e),
            SourceError::Pool(_) | SourceError::Timeout(_) => ErrorClass::Transient,
            SourceError::Schema(_) | SourceError::Config(_) | SourceError::Tls(_) => {
                ErrorClass::Fatal
            }
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
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
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
        if db.code() == &tokio_postgres::error::SqlState::INVALID_SQL_STATEMENT_NAME {
            s.push_str(
                "; behind a pooler in transaction mode (PgBouncer before 1.21) statements \
                 cannot stay prepared: set postgres.prepared_statements = false",
            );
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
/// cannot keep a prepared statement across transactions) every call runs as the unnamed
/// statement with its parameter types given, learnt once per process (see [`Tx::typed`]).
///
/// # Round trips
///
/// A database in another zone pays each round trip in full, so the transaction's own
/// statements share them: `BEGIN` goes out with the first statement ([`Tx::begin`] does not
/// wait for its answer), the last statement goes out with `COMMIT`
/// ([`Tx::execute_and_commit`]), the session's next transaction may follow the `COMMIT` in
/// the same round trip ([`Tx::execute_commit_then`]), behind a pooler the `SET LOCAL`
/// settings go with `BEGIN` and the first statement ([`Tx::in_turn`]), and a transaction
/// dropped unfinished
/// (an empty claim, a claim cancelled by `stop`) sends `ROLLBACK` without waiting for it.
/// PostgreSQL runs what one connection sends in order, so this changes when the client
/// waits, never what runs: a statement sent before `COMMIT` is inside the transaction (if
/// it fails, the transaction is aborted and the `COMMIT` that follows rolls it back), and a
/// session's next `BEGIN` comes after its `COMMIT` or `ROLLBACK`. `tokio-postgres` puts a
/// request on the wire when its future is first polled; the code below polls each
/// statement once, in order, before it waits for any.
pub struct Tx<'a> {
    client: &'a deadpool_postgres::ClientWrapper,
    /// `None`: cached mode. Else the parameter types of each SQL text, for the unnamed
    /// statement.
    typed: Option<Arc<ParamTypes>>,
    /// What the session's transactions run first ([`SessionMode::Pooled`] only), for the
    /// next transaction [`Tx::execute_commit_then`] opens.
    set_local: Option<Arc<str>>,
    /// That `SET LOCAL`, sent with `BEGIN` and not answered yet: the first statement goes
    /// out behind it, and its answer is read first ([`Tx::in_turn`]).
    settings: std::sync::Mutex<Option<Unanswered<'a>>>,
    /// `COMMIT` or `ROLLBACK` was sent.
    done: bool,
}

/// A simple query on the wire whose answer is still to be read.
type Unanswered<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'a>,
>;

/// The parameter types of each SQL text the relay runs, learnt from its first prepare in
/// the process (they depend only on the text and the table's column types).
pub(crate) type ParamTypes = std::sync::RwLock<std::collections::HashMap<String, Arc<[Type]>>>;

impl<'a> Tx<'a> {
    /// Sends `BEGIN` without waiting for its answer: the first statement follows it in the
    /// same round trip. (`BEGIN` fails only when the connection does, which that statement
    /// reports.) In [`SessionMode::Pooled`] the `SET LOCAL` settings go with it, and the
    /// first statement reads their answer before its own ([`Tx::in_turn`]): a setting the
    /// server refused is reported as itself, not as the aborted transaction the statement
    /// met.
    ///
    /// Callers open one transaction at a time on a session ([`Source::begin`]); the one
    /// exception is [`Tx::execute_commit_then`], which opens the next only after this
    /// one's `COMMIT` is on the wire.
    async fn begin(
        client: &'a deadpool_postgres::ClientWrapper,
        typed: Option<Arc<ParamTypes>>,
        set_local: Option<Arc<str>>,
    ) -> Result<Tx<'a>, SourceError> {
        use futures_util::FutureExt as _;
        let tx = Tx {
            client,
            typed,
            set_local,
            settings: std::sync::Mutex::new(None),
            done: false,
        };
        tx.send_only("BEGIN")?;
        if let Some(settings) = tx.set_local.clone() {
            let mut sent: Unanswered<'a> =
                Box::pin(async move { client.batch_execute(&settings).await });
            // The first poll puts it on the wire.
            match sent.as_mut().now_or_never() {
                Some(answer) => answer?,
                None => *tx.settings.lock().unwrap_or_else(|e| e.into_inner()) = Some(sent),
            }
        }
        Ok(tx)
    }

    /// Runs `statement` (a future that puts its request on the wire when first polled)
    /// behind the transaction's unanswered `SET LOCAL`, if any: polls it once, then reads
    /// the settings' answer, then its own. A refused setting is the error returned.
    async fn in_turn<T>(
        &self,
        statement: impl std::future::Future<Output = Result<T, SourceError>>,
    ) -> Result<T, SourceError> {
        let unanswered = self
            .settings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(settings) = unanswered else {
            return statement.await;
        };
        let mut statement = std::pin::pin!(statement);
        let first = futures_util::poll!(statement.as_mut());
        settings.await?;
        match first {
            std::task::Poll::Ready(answer) => answer,
            std::task::Poll::Pending => statement.await,
        }
    }

    /// Reads the answer of the transaction's `SET LOCAL`, if it is still unread.
    async fn settled(&self) -> Result<(), SourceError> {
        self.in_turn(async { Ok(()) }).await
    }

    /// Puts `sql` (a simple query) on the wire and lets its answer go unread.
    fn send_only(&self, sql: &str) -> Result<(), SourceError> {
        use futures_util::FutureExt as _;
        // The first poll sends the query; it can only be ready at once with an error (the
        // connection is closed).
        match self.client.batch_execute(sql).now_or_never() {
            Some(Err(e)) => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// The transaction as a plain client, for code that takes any client (catalog reads).
    pub(crate) fn client(&self) -> &tokio_postgres::Client {
        self.client
    }

    /// The session's prepared statement for `sql` (cached mode only).
    async fn cached(&self, sql: &str) -> Result<tokio_postgres::Statement, SourceError> {
        Ok(self.client.prepare_cached(sql).await?)
    }

    /// Prepares those of `sqls` the session has not prepared yet, together: one round trip
    /// where each statement's first use would take one, one after the other (what a
    /// distant database charges a session's first batch on a table: benchmark L).
    /// Nothing is sent for those the session's cache has already. Cached mode only;
    /// uncached mode learns each text's types once per process ([`Tx::typed`]).
    ///
    /// Inside the transaction, never before it: PostgreSQL runs a Parse sent outside a
    /// transaction block in an implicit transaction of its own, counted like any other.
    /// Prepared ahead of `BEGIN`, a relay of many idle tables warming its sessions ran
    /// such a transaction for every table and session, a large share of what idle tables
    /// cost over its first minute (benchmark I). A prepared statement outlives the
    /// transaction, rolled back or not.
    pub(crate) async fn prepare_together(&self, sqls: &[&str]) -> Result<(), SourceError> {
        use futures_util::FutureExt as _;
        if self.typed.is_some() {
            return Ok(());
        }
        // The first poll of each answers from the cache, or puts its Parse on the wire.
        let mut asked = Vec::new();
        for sql in sqls {
            let mut prepare = Box::pin(self.client.prepare_cached(sql));
            match prepare.as_mut().now_or_never() {
                Some(answer) => drop(answer?),
                None => asked.push(prepare),
            }
        }
        if asked.is_empty() {
            return Ok(());
        }
        self.in_turn(async { Ok(futures_util::future::try_join_all(asked).await?) })
            .await
            .map(drop)
    }

    /// `params` with their types, for the unnamed statement (uncached mode).
    ///
    /// A named statement must never stay on a pooler's server connection: a later relay
    /// process, whose statement names start again at `s0`, would collide with it
    /// ("prepared statement already exists"). So the types of `sql` are learnt once per
    /// process, from a named statement dropped at once (its Close reaches the server
    /// inside this transaction), and every later call prepares nothing. Preparing on every
    /// call left one behind whenever a claim was cancelled between its Parse and its Close
    /// (a drain's workers stopping at the end: the prepare's reply is discarded, so no
    /// Close is ever sent, and the rollback does not remove it). Rows hold only the
    /// unnamed statement, so they may outlive the transaction.
    async fn typed<'p>(
        &self,
        sql: &str,
        params: &[&'p (dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<(&'p (dyn tokio_postgres::types::ToSql + Sync), Type)>, SourceError> {
        let cache = self
            .typed
            .as_ref()
            .expect("typed is only called in uncached mode");
        let known = cache
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(sql)
            .cloned();
        let types = match known {
            Some(types) => types,
            None => {
                let types: Arc<[Type]> = self.client.prepare(sql).await?.params().into();
                cache
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(sql.to_owned(), types.clone());
                types
            }
        };
        Ok(params.iter().copied().zip(types.iter().cloned()).collect())
    }

    pub async fn query(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, SourceError> {
        self.in_turn(async {
            Ok(if self.typed.is_none() {
                self.client.query(&self.cached(sql).await?, params).await?
            } else {
                self.client
                    .query_typed(sql, &self.typed(sql, params).await?)
                    .await?
            })
        })
        .await
    }

    pub async fn query_one(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<tokio_postgres::Row, SourceError> {
        self.in_turn(async {
            Ok(if self.typed.is_none() {
                self.client
                    .query_one(&self.cached(sql).await?, params)
                    .await?
            } else {
                let typed = self.typed(sql, params).await?;
                self.client.query_typed_one(sql, &typed).await?
            })
        })
        .await
    }

    pub async fn execute(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, SourceError> {
        self.in_turn(async {
            Ok(if self.typed.is_none() {
                self.client
                    .execute(&self.cached(sql).await?, params)
                    .await?
            } else {
                let typed = self.typed(sql, params).await?;
                self.client.execute_typed(sql, &typed).await?
            })
        })
        .await
    }

    /// Runs `sql` and commits, in one round trip: the statement is sent, then `COMMIT`,
    /// then both answers are read. When the statement fails the transaction is aborted, so
    /// the `COMMIT` behind it rolls back: the statement's error is returned and nothing of
    /// the transaction took effect.
    pub async fn execute_and_commit(
        self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, SourceError> {
        let none = None::<fn(Tx<'a>) -> std::future::Ready<Result<(), SourceError>>>;
        Ok(self.execute_commit_then(sql, params, none).await?.0)
    }

    /// [`Tx::execute_and_commit`], then, with `next`, the session's next transaction:
    /// `BEGIN` and `next`'s first statement go out behind the `COMMIT`, before any answer
    /// is read, so the three share one round trip. PostgreSQL runs them in the order sent:
    /// `next` runs after this transaction ended, and sees what it committed, exactly as if
    /// it had waited for the `COMMIT`.
    ///
    /// The outer error is this transaction's: its statement or its `COMMIT` failed, nothing
    /// of it took effect, and whatever `next` returned is dropped (a transaction in it, which
    /// ran after the rollback, rolls back too). The inner result is `next`'s.
    pub async fn execute_commit_then<T, F, Fut>(
        mut self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        next: Option<F>,
    ) -> Result<(u64, Option<Result<T, SourceError>>), SourceError>
    where
        F: FnOnce(Tx<'a>) -> Fut,
        Fut: std::future::Future<Output = Result<T, SourceError>>,
    {
        // A transaction's first statement is never this one on the hot path: the settings'
        // answer, if still unread, is read first.
        self.settled().await?;
        // What may wait on the server (a statement's first prepare on the session, the
        // process's first look at its parameter types) is done before anything is sent.
        enum Ready<'p> {
            Cached(tokio_postgres::Statement),
            Typed(Vec<(&'p (dyn tokio_postgres::types::ToSql + Sync), Type)>),
        }
        let ready = match self.typed {
            None => Ready::Cached(self.cached(sql).await?),
            Some(_) => Ready::Typed(self.typed(sql, params).await?),
        };
        self.done = true;
        let client = self.client;
        let run = async {
            match &ready {
                Ready::Cached(statement) => client.execute(statement, params).await,
                Ready::Typed(typed) => client.execute_typed(sql, typed).await,
            }
        };
        let commit = client.batch_execute("COMMIT");
        let (typed, set_local) = (self.typed.take(), self.set_local.take());
        let after = async move {
            let next = next?;
            Some(async { next(Tx::begin(client, typed, set_local).await?).await }.await)
        };
        // `join3` polls each in turn, and a request goes on the wire at its future's first
        // poll: the statement, then `COMMIT`, then `BEGIN` and `next`'s first statement.
        // The statement may already be answered by then (the connection's task runs on
        // another thread); the `COMMIT` is sent all the same. A transaction dropped here
        // instead rolls back what it published, and its rows go out again (caught by
        // `nats_relay::same_key_rows_arrive_in_id_order_across_workers_and_processes`).
        let (ran, committed, after) = futures_util::future::join3(run, commit, after).await;
        // A failed statement aborted the transaction: the COMMIT rolled it back.
        let n = ran?;
        committed?;
        Ok((n, after))
    }

    pub async fn commit(mut self) -> Result<(), SourceError> {
        self.settled().await?;
        self.done = true;
        Ok(self.client.batch_execute("COMMIT").await?)
    }

    /// Ends the transaction without waiting for the server: `ROLLBACK` is sent, and the
    /// session's next statement follows it.
    pub fn rollback(mut self) -> Result<(), SourceError> {
        self.done = true;
        self.send_only("ROLLBACK")
    }
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.send_only("ROLLBACK");
        }
    }
}

/// The relay's pool of PostgreSQL sessions.
#[derive(Clone)]
pub struct Source {
    pool: Pool,
    statement_timeout: Duration,
    prepared_statements: bool,
    /// Uncached mode's parameter types, shared by every session (see [`Tx::typed`]).
    param_types: Arc<ParamTypes>,
    mode: SessionMode,
    /// What each transaction runs first in [`SessionMode::Pooled`].
    set_local: Option<Arc<str>>,
}

impl Source {
    /// Opens one connection to learn the [`SessionMode`], then builds the pool with it as
    /// the first session; the others are opened on first use.
    pub async fn open(pg: &PostgresConfig, limits: SessionLimits) -> Result<Source, SourceError> {
        let connect = session::open(pg, limits);
        // Two attempts at most: with start-up options, then (behind a pooler) without.
        let limit = 2 * attempt_limit(pg);
        let (client, connection, mode) = tokio::time::timeout(limit, connect)
            .await
            .map_err(|_| SourceError::Timeout(limit))??;
        if mode == SessionMode::Pooled {
            tracing::info!(
                "PostgreSQL is behind a pooler that refuses start-up options (PgBouncer in \
                 transaction mode?): session settings are set per transaction"
            );
        }
        Source::with_mode(pg, limits, mode, (client, connection))
    }

    /// Builds the pool for sessions in `mode`, `first` (opened in that mode) its first
    /// session; the others are opened lazily, on first use.
    fn with_mode(
        pg: &PostgresConfig,
        limits: SessionLimits,
        mode: SessionMode,
        first: (tokio_postgres::Client, session::Connection),
    ) -> Result<Source, SourceError> {
        let manager = Manager::from_connect(
            session_config(pg, limits, mode),
            hosts::EachHost {
                tls: pg.tls.connector()?,
                per_host: connect_timeout(pg),
                ready: std::sync::Mutex::new(Some(first)),
            },
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pg.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(limits.statement_timeout))
            // A margin past the last host's own limit: `EachHost` waits for it when every
            // host timed out.
            .create_timeout(Some(attempt_limit(pg) + CREATE_MARGIN))
            .recycle_timeout(Some(connect_timeout(pg)))
            .build()
            .map_err(|e| SourceError::Pool(e.to_string()))?;
        Ok(Source {
            pool,
            statement_timeout: limits.statement_timeout,
            prepared_statements: pg.prepared_statements,
            param_types: Arc::default(),
            mode,
            set_local: (mode == SessionMode::Pooled).then(|| session::set_local(limits).into()),
        })
    }

    /// How this pool's sessions get their settings.
    pub fn mode(&self) -> SessionMode {
        self.mode
    }

    /// A session from the pool.
    pub async fn session(&self) -> Result<deadpool_postgres::Object, SourceError> {
        Ok(self.pool.get().await?)
    }

    /// Makes sure the pool holds `n` sessions (at most its size), opening those it lacks
    /// all at once, while the caller does other start-up work: each is a handshake of
    /// three or four round trips, which workers starting together would otherwise wait for
    /// before their first claim. A session that cannot be opened is left for its worker
    /// to meet.
    pub(crate) async fn warm(&self, n: usize) {
        let n = n.min(self.pool.status().max_size);
        let got = futures_util::future::join_all((0..n).map(|_| self.session())).await;
        if let Some(e) = got.iter().find_map(|g| g.as_ref().err()) {
            tracing::debug!(error = %e, "Could not open every session ahead of the workers");
        }
    }

    /// Opens a transaction on `session`, with statements cached as configured. One at a
    /// time: the session's previous transaction has ended (or its `COMMIT` was sent, see
    /// [`Tx::execute_commit_then`]).
    pub async fn begin<'a>(
        &self,
        session: &'a deadpool_postgres::Object,
    ) -> Result<Tx<'a>, SourceError> {
        let typed = (!self.prepared_statements).then(|| self.param_types.clone());
        Tx::begin(session, typed, self.set_local.clone()).await
    }

    /// Runs `work` in a short transaction of its own on a pool session, under
    /// [`Source::deadline`]; commits when it succeeds. Every statement outside a claim goes
    /// through here, so it also works behind a pooler in transaction mode
    /// ([`SessionMode::Pooled`]: each transaction may be a different server session).
    pub async fn in_transaction<T>(
        &self,
        work: impl AsyncFnOnce(&Tx<'_>) -> Result<T, SourceError>,
    ) -> Result<T, SourceError> {
        self.bounded(async {
            let session = self.session().await?;
            let result = async {
                let tx = self.begin(&session).await?;
                let value = work(&tx).await?;
                tx.commit().await?;
                Ok(value)
            }
            .await;
            Source::release(session, result.as_ref().err());
            result
        })
        .await
    }

    /// Returns `session` to the pool, or discards it when `error` says the connection may
    /// be half-dead (a timed-out statement may still be running on it, or never end).
    ///
    /// A half-dead connection is rarely alone: a dead network path, a frozen server or a
    /// failed-over address leaves every connection opened before it the same way, and a
    /// pool that hands them out one by one costs a full [`Source::deadline`] each. So every
    /// idle connection goes with it (the pool opens new ones as they are needed, a few
    /// milliseconds each); those in use prove themselves or time out on their own.
    pub(crate) fn release(session: deadpool_postgres::Object, error: Option<&SourceError>) {
        if !error.is_some_and(SourceError::connection_suspect) {
            return;
        }
        let pool = deadpool_postgres::Object::pool(&session);
        drop(deadpool_postgres::Object::take(session));
        if let Some(pool) = pool {
            let idle = pool.retain(|_, _| false).removed.len();
            tracing::debug!(
                idle,
                "A connection stopped answering: discarded it and every idle one"
            );
        }
    }

    /// One round trip to the server within `limit`: reachability for `/readyz`.
    pub(crate) async fn ping(&self, limit: Duration) -> Result<(), SourceError> {
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

    /// Client-side deadline for one statement: the server's plus [`DEADLINE_MARGIN`].
    pub(crate) fn deadline(&self) -> Duration {
        self.statement_timeout + DEADLINE_MARGIN
    }

    /// Runs `fut` under [`Source::deadline`].
    pub(crate) async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, SourceError>>,
    ) -> Result<T, SourceError> {
        let limit = self.deadline();
        tokio::time::timeout(limit, fut)
            .await
            .map_err(|_| SourceError::Timeout(limit))?
    }
}

/// Asks `sql` of every element of `arrays` (its `text[]` parameters, in order, all of one
/// length) in one statement and returns its rows; none, and no statement, when there is
/// nothing to ask.
pub(crate) async fn ask_each(
    client: &impl tokio_postgres::GenericClient,
    sql: &str,
    arrays: &[&[String]],
) -> Result<Vec<tokio_postgres::Row>, SourceError> {
    if arrays.first().is_none_or(|a| a.is_empty()) {
        return Ok(Vec::new());
    }
    let params: Vec<(&(dyn tokio_postgres::types::ToSql + Sync), Type)> = arrays
        .iter()
        .map(|a| {
            (
                a as &(dyn tokio_postgres::types::ToSql + Sync),
                Type::TEXT_ARRAY,
            )
        })
        .collect();
    Ok(client.query_typed(sql, &params).await?)
}

/// The quoted name of the relay's own table `name` (`outbox_relay_pauses`,
/// `outbox_relay_rates`) in the schema of `table`: one per schema, shared by its outbox
/// tables.
pub(crate) fn schema_table(table: &crate::config::TableName, name: &str) -> String {
    format!(
        "{}.{}",
        table.schema.quoted(),
        crate::config::Ident::parse(name)
            .expect("the relay's table names are valid")
            .quoted()
    )
}

/// The quoted name `<table>_<suffix>` of an object that belongs to `table` (an index, a
/// sequence), cut to PostgreSQL's 63 bytes from the front.
pub(crate) fn name_for(table: &crate::config::TableName, suffix: &str) -> String {
    let mut base = format!("{}_{suffix}", table.table.as_str());
    // Identifiers are cut at 63 bytes; keep the suffix, which makes the name unique.
    while base.len() > 63 {
        base.remove(0);
    }
    crate::config::Ident::parse(&format!("\"{}\"", base.replace('"', "\"\"")))
        .expect("a quoted identifier of at most 63 bytes is valid")
        .quoted()
}
