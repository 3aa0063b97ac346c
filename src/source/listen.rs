//! LISTEN/NOTIFY: wakes idle workers the moment new outbox rows commit.
//!
//! One dedicated connection (outside the pool) listens on channel `outbox_relay`. A
//! notification names its table; it is only a hint: tables are also looked at now and then
//! (every `relay.poll_interval` while this connection is down or a table has no wake-up),
//! so a lost notification, a dropped listener connection or `migrate --no-notify` only
//! costs latency.
//!
//! A LISTEN connection only receives, so a dead path under it (a frozen server, a
//! firewall dropping the flow without a reset) would go unnoticed and every NOTIFY with
//! it. While subscribed it asks `SELECT 1` every [`LISTEN_CHECK`]; no answer within
//! `postgres.connect_timeout` ends the connection, and the next one's subscription
//! raises every table (rows may have committed unheard).

use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use super::describe;
use super::session::{self, SessionLimits, SessionMode};
use crate::config::PostgresConfig;
use crate::retry::Backoff;

/// The channel the wake-up in `migrations/notify.sql` notifies.
pub(crate) const CHANNEL: &str = "outbox_relay";

/// How often a subscribed LISTEN connection proves it still answers: as often as a table
/// NOTIFY covers is looked at anyway (`relay::wake::IDLE_RECHECK`), so a silent
/// listener costs no more than that.
pub(crate) const LISTEN_CHECK: Duration = Duration::from_secs(5);

/// What the listener tells the relay.
pub(crate) trait Wake: Send + Sync {
    /// Rows of the table `payload` names (`schema.table`, unquoted) committed, told by
    /// `notifications` NOTIFYs (those of one burst, told at once).
    fn rows_committed(&self, payload: &str, notifications: u32);
    /// LISTEN is subscribed with the session of backend `pid` (rows may have committed
    /// unheard before), or is not (`None`).
    fn listening(&self, pid: Option<i32>);
}

/// Listens on `pg` (the relay's [`PostgresConfig::for_listen`]) until `stop` is
/// cancelled, reconnecting with a capped backoff; each burst of notifications tells
/// `wake` once per table named. Gives up, saying so once, when `pg` turns out to be a
/// pooler in transaction mode, which cannot keep a LISTEN: the workers poll.
pub(crate) async fn listen(
    pg: PostgresConfig,
    limits: SessionLimits,
    wake: Arc<dyn Wake>,
    stop: CancellationToken,
) {
    let mut backoff = Backoff::reconnect();
    while !stop.is_cancelled() {
        let pause = backoff.next_pause();
        let result = listen_once(&pg, limits, wake.as_ref(), &stop).await;
        wake.listening(None);
        match result {
            Ok(()) => return,
            Err(Stop::Pooled) => {
                tracing::warn!(
                    "PostgreSQL is reached through a pooler in transaction mode, which cannot \
                     keep a LISTEN: idle workers poll every relay.poll_interval; set \
                     postgres.listen_url to a direct connection for NOTIFY wake-ups"
                );
                return;
            }
            Err(Stop::Failed(e)) => {
                tracing::warn!(error = %e, retry_in = ?pause, "LISTEN connection lost; polling meanwhile");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// Why a LISTEN connection ended.
enum Stop {
    /// The connection goes through a pooler in transaction mode: listening cannot work.
    Pooled,
    /// It failed; another may work.
    Failed(String),
}

impl From<String> for Stop {
    fn from(e: String) -> Self {
        Stop::Failed(e)
    }
}

/// What the connection's messages are: notifications among them.
type Messages = Option<Result<AsyncMessage, tokio_postgres::Error>>;

/// A message of the connection: its notification if it is one; the connection's error or
/// end as the [`Stop`] it means.
fn notification(message: Messages) -> Result<Option<tokio_postgres::Notification>, Stop> {
    match message {
        Some(Ok(AsyncMessage::Notification(n))) => Ok(Some(n)),
        Some(Ok(_)) => Ok(None),
        Some(Err(e)) => Err(Stop::Failed(describe(&e))),
        None => Err(Stop::Failed("connection closed".to_owned())),
    }
}

/// Waits for `check`'s answer within `answer_within`, passing on the notifications that
/// arrive meanwhile: the answer comes through the connection, which only the message
/// stream polls, so both are driven. `false` when `stop` fired first.
async fn answered<T>(
    check: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    answer_within: Duration,
    messages: &mut (impl futures_util::Stream<Item = Result<AsyncMessage, tokio_postgres::Error>>
              + Unpin),
    wake: &dyn Wake,
    stop: &CancellationToken,
) -> Result<bool, Stop> {
    let check = tokio::time::timeout(answer_within, check);
    tokio::pin!(check);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(false),
            answer = &mut check => return match answer {
                Ok(Ok(_)) => Ok(true),
                Ok(Err(e)) => Err(Stop::Failed(describe(&e))),
                Err(_) => Err(Stop::Failed(format!(
                    "no answer to a check within {answer_within:?}"
                ))),
            },
            message = messages.next() => {
                if let Some(n) = notification(message)? {
                    wake.rows_committed(n.payload(), 1);
                }
            }
        }
    }
}

/// Takes `message` and every message already received after it, and wakes each table
/// they name once. Debounce: a burst of commits arrives as a burst of notifications; every
/// one already received wakes its table once, not once each, and tells how many there
/// were (the relay clears its sleep mark by their rate: counted as one, a burst read late
/// by a busy relay hid a crowd of writers, and every one of their commits notified).
fn take_burst(
    mut message: Messages,
    messages: &mut (impl futures_util::Stream<Item = Result<AsyncMessage, tokio_postgres::Error>>
              + Unpin),
    wake: &dyn Wake,
) -> Result<(), Stop> {
    let mut committed = 0usize;
    let mut tables: Vec<(String, u32)> = Vec::new();
    loop {
        if let Some(n) = notification(message)? {
            committed += 1;
            match tables.iter_mut().find(|(t, _)| t == n.payload()) {
                Some((_, count)) => *count += 1,
                None => tables.push((n.payload().to_owned(), 1)),
            }
        }
        match messages.next().now_or_never() {
            Some(next) => message = next,
            None => break,
        }
    }
    if committed > 0 {
        tracing::trace!(notifications = committed, "Outbox rows committed");
        for (table, count) in &tables {
            wake.rows_committed(table, *count);
        }
    }
    Ok(())
}

/// The backend pid in the answer to the subscription.
fn backend_pid(answer: &[tokio_postgres::SimpleQueryMessage]) -> Result<i32, Stop> {
    answer
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
            _ => None,
        })
        .ok_or_else(|| Stop::Failed("the subscription did not say its backend pid".to_owned()))
}

/// One connection's life: returns `Ok` when stopped, `Err` when the connection failed.
async fn listen_once(
    pg: &PostgresConfig,
    limits: SessionLimits,
    wake: &dyn Wake,
    stop: &CancellationToken,
) -> Result<(), Stop> {
    let open = tokio::time::timeout(2 * super::attempt_limit(pg), session::open(pg, limits));
    let (client, mut connection) = match open.await {
        Ok(Ok((client, connection, SessionMode::Direct))) => (client, connection),
        Ok(Ok((_, _, SessionMode::Pooled))) => return Err(Stop::Pooled),
        Ok(Err(e)) => return Err(Stop::Failed(e.to_string())),
        Err(_) => return Err(Stop::Failed("connection timed out".to_owned())),
    };
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    // The session's pid names it in the sleepers table (`crate::source::sleepers`).
    let statement = format!("LISTEN {CHANNEL}");
    let subscribe = async {
        let pid = client.simple_query("SELECT pg_backend_pid()").await?;
        client.batch_execute(&statement).await.map(|()| pid)
    };
    tokio::pin!(subscribe);
    let mut subscribed = false;
    // As long as a new connection may take to open: a server that cannot answer
    // `SELECT 1` in that time is not hearing NOTIFY either.
    let answer_within = session::connect_timeout(pg);
    let mut next_check = tokio::time::Instant::now() + LISTEN_CHECK;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            result = &mut subscribe, if !subscribed => {
                let pid = backend_pid(&result.map_err(|e| describe(&e))?)?;
                subscribed = true;
                tracing::debug!(channel = CHANNEL, pid, "Listening for new outbox rows");
                // Rows may have committed while we were not listening.
                wake.listening(Some(pid));
            }
            _ = tokio::time::sleep_until(next_check), if subscribed => {
                let check = client.simple_query("SELECT 1");
                if !answered(check, answer_within, &mut messages, wake, stop).await? {
                    return Ok(());
                }
                next_check = tokio::time::Instant::now() + LISTEN_CHECK;
            }
            message = messages.next() => take_burst(message, &mut messages, wake)?,
        }
    }
}
