//! Sinks: where messages go. A closed set behind one contract:
//!
//! - [`Sink::check`] catches a message that is bad on its face before anything is sent;
//! - [`Sink::publish_batch`] sends a batch and returns one result per message, `Ok` only
//!   for a positive broker acknowledgement (JetStream PubAck, Kafka delivery report);
//! - [`Sink::healthcheck`] and [`Sink::close`] (flush, within a deadline).
//!
//! Implementations: [`kafka`] (idempotent rdkafka producer), [`nats`] (JetStream),
//! [`stdout`] (JSON lines, debugging) and [`memory`] (tests).
//!
//! Only rows whose message got `Ok` are ever marked or deleted.

pub mod kafka;
pub mod memory;
pub mod nats;
pub mod stdout;

use bytes::Bytes;

use crate::config::{SinkConfig, SinkTarget};
use crate::error::ErrorClass;

/// One message, ready for any sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `<table>:<id>`: Kafka header `outbox-id`, NATS `Nats-Msg-Id`.
    pub id: String,
    /// Kafka topic or NATS subject.
    pub topic: String,
    pub key: Option<String>,
    pub payload: Bytes,
    /// From the row's `headers` column, in the column's order.
    pub headers: Vec<(String, String)>,
}

/// A publish failure with its class.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SinkError {
    pub class: ErrorClass,
    pub message: String,
}

impl SinkError {
    pub fn transient(message: impl Into<String>) -> SinkError {
        SinkError {
            class: ErrorClass::Transient,
            message: message.into(),
        }
    }
    pub fn bad_row(message: impl Into<String>) -> SinkError {
        SinkError {
            class: ErrorClass::BadRow,
            message: message.into(),
        }
    }
    pub fn fatal(message: impl Into<String>) -> SinkError {
        SinkError {
            class: ErrorClass::Fatal,
            message: message.into(),
        }
    }
}

/// Every sink the relay can publish to.
pub enum Sink {
    Kafka(kafka::KafkaSink),
    Nats(Box<nats::NatsSink>),
    Stdout(stdout::StdoutSink),
    Memory(memory::MemorySink),
}

impl Sink {
    /// Connects the sink named by the configuration.
    pub async fn connect(config: &SinkConfig) -> Result<Sink, SinkError> {
        match &config.target {
            SinkTarget::Nats(nats) => Ok(Sink::Nats(Box::new(
                nats::NatsSink::connect(nats, config.publish_timeout).await?,
            ))),
            SinkTarget::Stdout => Ok(Sink::Stdout(stdout::StdoutSink::new())),
            SinkTarget::Kafka(kafka) => Ok(Sink::Kafka(kafka::KafkaSink::connect(
                kafka,
                config.publish_timeout,
            )?)),
        }
    }

    /// The name used in logs and metrics labels.
    pub fn name(&self) -> &'static str {
        match self {
            Sink::Kafka(_) => "kafka",
            Sink::Nats(_) => "nats",
            Sink::Stdout(_) => "stdout",
            Sink::Memory(_) => "memory",
        }
    }

    /// Whether messages of one key stay in order when a whole batch is in flight at once,
    /// even if one of them fails. The idempotent Kafka producer keeps a partition's records
    /// in order through its retries. JetStream gives no such promise across a reconnect, so
    /// for NATS the relay sends a key's next message only after the previous one's ack.
    pub fn keeps_order_in_flight(&self) -> bool {
        match self {
            Sink::Kafka(_) => true,
            Sink::Nats(_) => false,
            Sink::Stdout(_) => true,
            Sink::Memory(m) => m.keeps_order_in_flight(),
        }
    }

    /// Rejects a message the broker would refuse for itself (size, subject), before any
    /// message of its batch is sent.
    pub fn check(&self, message: &Message) -> Result<(), SinkError> {
        match self {
            Sink::Kafka(s) => s.check(message),
            Sink::Nats(s) => s.check(message),
            Sink::Stdout(_) => Ok(()),
            Sink::Memory(m) => m.check(message),
        }
    }

    /// Publishes `messages` and waits for every acknowledgement; the result at index i
    /// belongs to message i.
    pub async fn publish_batch(&self, messages: &[&Message]) -> Vec<Result<(), SinkError>> {
        match self {
            Sink::Kafka(s) => s.publish_batch(messages).await,
            Sink::Nats(s) => s.publish_batch(messages).await,
            Sink::Stdout(s) => s.publish_batch(messages).await,
            Sink::Memory(m) => m.publish_batch(messages).await,
        }
    }

    /// Follows the broker connection, where the client knows it (NATS): `false` from the
    /// moment it is lost until it is back. `None`: the client reconnects on its own and
    /// says nothing (Kafka), or there is no connection.
    pub fn connection(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        match self {
            Sink::Nats(s) => Some(s.connection()),
            Sink::Kafka(_) | Sink::Stdout(_) | Sink::Memory(_) => None,
        }
    }

    /// Whether the broker is reachable now.
    pub async fn healthcheck(&self) -> Result<(), SinkError> {
        match self {
            Sink::Kafka(s) => s.healthcheck().await,
            Sink::Nats(s) => s.healthcheck().await,
            Sink::Stdout(_) | Sink::Memory(_) => Ok(()),
        }
    }

    /// Flushes what is buffered, within `timeout`.
    pub async fn close(&self, timeout: std::time::Duration) -> Result<(), SinkError> {
        match self {
            Sink::Kafka(s) => s.close(timeout).await,
            Sink::Nats(s) => within(timeout, s.close()).await,
            Sink::Stdout(s) => within(timeout, s.close()).await,
            Sink::Memory(_) => Ok(()),
        }
    }
}

async fn within(
    timeout: std::time::Duration,
    fut: impl std::future::Future<Output = Result<(), SinkError>>,
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
pub fn scrub(text: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .filter(|s| !s.is_empty())
        .fold(text.to_owned(), |t, s| t.replace(s.as_str(), "<redacted>"))
}
