//! Sinks: where messages go. A closed set behind one contract:
//!
//! - [`Sink::check`] catches a message that is bad on its face before anything is sent;
//! - [`Sink::publish_batch`] sends a batch and returns one result per message, `Ok` only
//!   for a positive broker acknowledgement (JetStream PubAck, Kafka delivery report);
//! - [`Sink::healthcheck`] and [`Sink::close`] (flush, within a deadline).
//!
//! Implementations: [`kafka`] (idempotent rdkafka producer), [`nats`] (JetStream),
//! [`stdout`] (JSON lines, debugging) and `memory` (tests: unit tests and the `testing`
//! feature only; not in the shipped binary).
//!
//! Only rows whose message got `Ok` are ever marked or deleted.
//!
//! Adding a sink: a folder `sink/<name>/` implementing [`SinkService`], its config in
//! `config/<name>.rs`, a variant in [`SinkTarget`], and a variant here in [`Sink`] (with
//! its line in [`Sink::connect`] and in `dispatch!`).

pub mod kafka;
#[cfg(any(test, feature = "testing"))]
pub mod memory;
pub(crate) mod nats;
mod stdout;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::config::{SinkConfig, SinkTarget};
use crate::error::ErrorClass;

/// One message, ready for any sink. What every message of a table shares (a constant
/// topic, header names from `[tables.header_columns]`) and what a batch shares with its
/// claim (the key) are reference-counted, not copied per message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `<table>:<id>`: Kafka header `outbox-id`, NATS `Nats-Msg-Id`.
    pub id: String,
    /// Kafka topic or NATS subject.
    pub topic: Arc<str>,
    /// Ordering and partition key; `None`: no order promise.
    pub key: Option<Arc<str>>,
    /// The body, sent as bytes. `None` (a NULL payload column): a Kafka tombstone (a
    /// record with a null value, so log compaction deletes its key), an empty NATS body.
    pub payload: Option<Bytes>,
    /// From the row's `headers` column in the column's order, then the header columns,
    /// then the CloudEvents attributes (binary mode).
    pub headers: Vec<(Arc<str>, HeaderValue)>,
    /// The row's creation time in milliseconds since the Unix epoch: the Kafka record's
    /// timestamp (`None`: the producer's clock).
    pub timestamp_ms: Option<i64>,
}

/// A header's value: the message's own, or one that many messages share (a constant, a
/// value rendered once for a batch), which costs a reference count instead of a copy.
/// Values compare by their text, whatever holds it.
#[derive(Debug, Clone)]
pub enum HeaderValue {
    Owned(String),
    Shared(Arc<str>),
    Static(&'static str),
}

impl HeaderValue {
    pub fn as_str(&self) -> &str {
        match self {
            HeaderValue::Owned(s) => s,
            HeaderValue::Shared(s) => s,
            HeaderValue::Static(s) => s,
        }
    }
}

impl std::ops::Deref for HeaderValue {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for HeaderValue {
    fn eq(&self, other: &HeaderValue) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for HeaderValue {}

impl fmt::Display for HeaderValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<String> for HeaderValue {
    fn from(s: String) -> HeaderValue {
        HeaderValue::Owned(s)
    }
}

impl From<Arc<str>> for HeaderValue {
    fn from(s: Arc<str>) -> HeaderValue {
        HeaderValue::Shared(s)
    }
}

impl From<&'static str> for HeaderValue {
    fn from(s: &'static str) -> HeaderValue {
        HeaderValue::Static(s)
    }
}

/// A publish failure with its class.
///
/// Its text ([`SinkError::message`], also its `Display`) is the complete sentence an
/// operator reads, with the client library's own text already in it, run through
/// `scrub` so it never holds a secret. [`std::error::Error::source`] is the client
/// library's error it was made from, where there is one (an rdkafka `KafkaError`, an
/// async-nats error): for code that must inspect it (match on a Kafka error code, a NATS
/// error kind), never for printing, since the cause's own `Display` and `Debug` may echo
/// the secrets `scrub` removed from the message. For the same reason `Debug` leaves the
/// cause out.
///
/// Two errors are equal when their class and message are, whatever their causes.
#[derive(Clone)]
pub struct SinkError {
    /// Retry later, this row is bad, or stop the process.
    pub(crate) class: ErrorClass,
    /// What happened; never holds a secret.
    message: String,
    /// The client library's error, for inspection only (see the type's doc).
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl SinkError {
    /// The broker's fault: retried.
    pub fn transient(message: impl Into<String>) -> SinkError {
        SinkError::new(ErrorClass::Transient, message.into())
    }
    /// The row's fault: retried on its schedule, then dead-lettered.
    pub fn bad_row(message: impl Into<String>) -> SinkError {
        SinkError::new(ErrorClass::BadRow, message.into())
    }
    /// Stops the process: the operator must fix something.
    pub(crate) fn fatal(message: impl Into<String>) -> SinkError {
        SinkError::new(ErrorClass::Fatal, message.into())
    }

    fn new(class: ErrorClass, message: String) -> SinkError {
        SinkError {
            class,
            message,
            source: None,
        }
    }

    /// The same error, carrying `cause` (the client library's error it was made from) as
    /// its [`source`](std::error::Error::source). The message does not change: it already
    /// says what `cause` says, scrubbed.
    pub(crate) fn caused_by(
        mut self,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> SinkError {
        self.source = Some(Arc::new(cause));
        self
    }

    /// What happened, in the operator's words; never holds a secret.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for SinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Class and message only: the cause's `Debug` may hold a secret (see the type's doc).
impl fmt::Debug for SinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("SinkError");
        s.field("class", &self.class)
            .field("message", &self.message);
        if self.source.is_some() {
            s.finish_non_exhaustive()
        } else {
            s.finish()
        }
    }
}

impl std::error::Error for SinkError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // The cause itself, not the `Arc` around it, so that it downcasts to its own type.
        let cause: &(dyn std::error::Error + 'static) = self.source.as_deref()?;
        Some(cause)
    }
}

impl PartialEq for SinkError {
    fn eq(&self, other: &SinkError) -> bool {
        self.class == other.class && self.message == other.message
    }
}

impl Eq for SinkError {}

/// A message whose destination cannot take it now ([`SinkService::unavailable`]): why,
/// and how long its row waits before it is claimed again, unless the destination is back
/// first ([`SinkService::available_again`]).
///
/// The wait grows with the outage, `down_for` clamped to [`HOLD_MIN`]..[`HOLD_MAX`]: a
/// held key's head is tried again after about as long as its destination has been down,
/// so over an outage of `T` it is tried about `log2(T)` times, then every [`HOLD_MAX`].
/// With a fixed second, every held key's head was claimed, checked and written again
/// every second however long the outage, and claims kept re-reading the due heads below
/// the floor (benchmark K, docs/benchmark.md#partial-failures---partial).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NotNow {
    /// For the row's `last_error`: starts with [`POSTPONED_MARK`].
    pub(crate) reason: String,
    pub(crate) wait: Duration,
}

/// How every postponed row's `last_error` starts (stored in the table: the text stays as
/// it is): the release after an outage finds them by it (`relay::postponed`).
pub(crate) const POSTPONED_MARK: &str = "held back: ";
/// The shortest wait of a postponed row: about as long as a sink takes to notice its
/// destination is back.
pub(crate) const HOLD_MIN: Duration = Duration::from_secs(1);
/// The longest: how late a held key may follow when its destination is back and no
/// running relay process saw it come back (one that did, or one that starts, releases
/// the rows at once).
pub(crate) const HOLD_MAX: Duration = Duration::from_secs(30);

impl NotNow {
    /// `why` the destination cannot take a message, down for `down_for` so far.
    pub(crate) fn new(why: impl fmt::Display, down_for: Duration) -> NotNow {
        NotNow {
            reason: format!("{POSTPONED_MARK}{why}"),
            wait: down_for.clamp(HOLD_MIN, HOLD_MAX),
        }
    }
}

/// What every sink does. Each sink implements it in its own folder; [`Sink`] dispatches
/// to the one configured, in one place (the `dispatch!` macro).
pub(crate) trait SinkService {
    /// The name used in logs and metrics labels.
    const NAME: &'static str;

    /// [`SinkService::NAME`], from a value.
    fn name(&self) -> &'static str {
        Self::NAME
    }

    /// Whether messages of one key stay in order when a whole batch is in flight at once,
    /// even if one of them fails.
    fn keeps_order_in_flight(&self) -> bool;

    /// Rejects a message the broker would refuse for itself (size, subject), before any
    /// message of its batch is sent. Default: every message is fine.
    fn check(&self, _message: &Message) -> Result<(), SinkError> {
        Ok(())
    }

    /// Why `message` cannot be sent now for its destination's sake (a Kafka partition
    /// whose leader is unreachable), so the relay holds its key back without sending it
    /// and without counting an attempt. Default: every destination can take it.
    fn unavailable(&self, _message: &Message) -> Option<NotNow> {
        None
    }

    /// Counts the times a destination [`SinkService::unavailable`] named became available
    /// again: the relay then makes the rows postponed for one due at once, instead of
    /// leaving them to their wait. Default `None`: the sink never postpones a row.
    fn available_again(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// Publishes `messages` and waits for every acknowledgement; the result at index i
    /// belongs to message i, `Ok` only for a positive acknowledgement.
    fn publish_batch(
        &self,
        messages: &[&Message],
    ) -> impl Future<Output = Vec<Result<(), SinkError>>> + Send;

    /// Follows the broker connection, where the client knows it: `false` from the moment
    /// it is lost until it is back. Default `None`: the client reconnects on its own and
    /// says nothing, or there is no connection.
    fn connection(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        None
    }

    /// Whether the broker is reachable now. Default: always.
    fn healthcheck(&self) -> impl Future<Output = Result<(), SinkError>> + Send {
        std::future::ready(Ok(()))
    }

    /// Flushes what is buffered, within `timeout`.
    fn close(&self, timeout: Duration) -> impl Future<Output = Result<(), SinkError>> + Send;
}

/// Every sink the relay can publish to: a closed set.
pub enum Sink {
    /// [`kafka`].
    Kafka(kafka::KafkaSink),
    /// [`nats`].
    Nats(Box<nats::NatsSink>),
    /// [`stdout`].
    Stdout(stdout::StdoutSink),
    /// [`memory`], for tests (the `testing` feature).
    #[cfg(any(test, feature = "testing"))]
    Memory(memory::MemorySink),
}

/// Runs `$call` on the sink inside `$sink`, whichever it is: the one place that lists the
/// variants for the [`SinkService`] methods.
macro_rules! dispatch {
    ($sink:expr, $s:ident => $call:expr) => {
        match $sink {
            Sink::Kafka($s) => $call,
            Sink::Nats($s) => $call,
            Sink::Stdout($s) => $call,
            #[cfg(any(test, feature = "testing"))]
            Sink::Memory($s) => $call,
        }
    };
}

impl Sink {
    /// Connects the sink named by the configuration.
    pub async fn connect(config: &SinkConfig) -> Result<Sink, SinkError> {
        let timeout = config.publish_timeout;
        Ok(match &config.target {
            SinkTarget::Kafka(c) => Sink::Kafka(kafka::KafkaSink::connect(c, timeout)?),
            SinkTarget::Nats(c) => Sink::Nats(Box::new(nats::NatsSink::connect(c, timeout).await?)),
            SinkTarget::Stdout => Sink::Stdout(stdout::StdoutSink::new()),
        })
    }

    /// The name used in logs and metrics labels.
    pub(crate) fn name(&self) -> &'static str {
        dispatch!(self, s => s.name())
    }

    /// See [`SinkService::keeps_order_in_flight`].
    pub(crate) fn keeps_order_in_flight(&self) -> bool {
        dispatch!(self, s => s.keeps_order_in_flight())
    }

    /// See [`SinkService::check`].
    pub(crate) fn check(&self, message: &Message) -> Result<(), SinkError> {
        dispatch!(self, s => s.check(message))
    }

    /// See [`SinkService::unavailable`].
    pub(crate) fn unavailable(&self, message: &Message) -> Option<NotNow> {
        dispatch!(self, s => s.unavailable(message))
    }

    /// See [`SinkService::available_again`].
    pub(crate) fn available_again(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        dispatch!(self, s => s.available_again())
    }

    /// See [`SinkService::publish_batch`].
    pub async fn publish_batch(&self, messages: &[&Message]) -> Vec<Result<(), SinkError>> {
        dispatch!(self, s => s.publish_batch(messages).await)
    }

    /// See [`SinkService::connection`].
    pub(crate) fn connection(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        dispatch!(self, s => s.connection())
    }

    /// See [`SinkService::healthcheck`].
    pub(crate) async fn healthcheck(&self) -> Result<(), SinkError> {
        dispatch!(self, s => s.healthcheck().await)
    }

    /// See [`SinkService::close`].
    pub async fn close(&self, timeout: Duration) -> Result<(), SinkError> {
        dispatch!(self, s => s.close(timeout).await)
    }
}

/// `fut`, or a transient error if it does not finish within `timeout`.
async fn within(
    timeout: Duration,
    fut: impl Future<Output = Result<(), SinkError>>,
) -> Result<(), SinkError> {
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or_else(|_| {
            Err(SinkError::transient(format!(
                "no answer within {timeout:?}"
            )))
        })
}

/// Replaces every occurrence of a secret in `text` with `<redacted>`: for error messages
/// from client libraries, which may echo configuration values.
pub(crate) fn scrub(text: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .filter(|s| !s.is_empty())
        .fold(text.to_owned(), |t, s| t.replace(s.as_str(), "<redacted>"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_postponed_row_waits_as_long_as_its_destination_has_been_down_within_bounds() {
        let wait = |secs| NotNow::new("down", Duration::from_secs(secs)).wait;
        assert_eq!(wait(0), HOLD_MIN);
        assert_eq!(wait(4), Duration::from_secs(4));
        assert_eq!(wait(3600), HOLD_MAX);
        assert!(NotNow::new("down", Duration::ZERO)
            .reason
            .starts_with(POSTPONED_MARK));
    }
}
