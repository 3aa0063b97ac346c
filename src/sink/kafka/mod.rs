//! Kafka through librdkafka: an idempotent producer (`enable.idempotence=true`,
//! `acks=all`), the `murmur2_random` partitioner (a key lands on the partition a Java
//! producer would choose), `outbox-id: <table>:<id>` on every record, and a row counted
//! only once its delivery report says it was written.
//!
//! The idempotent producer keeps each partition's records in order through its own
//! retries, so the relay may put a whole batch in flight at once
//! ([`super::Sink::keeps_order_in_flight`]).
//!
//! A key whose partition cannot take records now (its leader broker unreachable, or no
//! leader) is not sent: [`SinkService::unavailable`] says so and the relay holds the key
//! back, so the other partitions keep flowing ([`health`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::{scrub, Message, NotNow, SinkError, SinkService};

mod durability;
mod errors;
mod health;

use crate::config::kafka::{is_secret, max_message_bytes, refused_properties, PRODUCER_DEFAULTS};
use crate::config::KafkaConfig;
pub(crate) use durability::{topic_settings, TopicSettings};
pub(crate) use errors::check_topic;
use errors::{classify_code, missing_topic, Class};
use health::{Health, HealthContext};

/// The partition Kafka's default partitioner gives a key (tests and benchmarks pick keys
/// by partition with it).
pub use health::partition_of;

/// The header that carries the message id.
pub(crate) use crate::config::headers::ID_HEADER;

/// An idempotent Kafka producer and what the brokers said about topics.
pub struct KafkaSink {
    producer: FutureProducer<HealthContext>,
    /// Which partitions can take a record now.
    health: Arc<Health>,
    /// Whether the producer's partitioner is `murmur2_random` (or `murmur2`), so the relay
    /// knows where a key lands; with another, no key is held back.
    knows_partitions: bool,
    secrets: Vec<String>,
    /// The producer's `message.max.bytes`: larger records are refused before sending.
    max_message_bytes: usize,
    /// What the brokers said of each topic a record went to.
    topics: Mutex<HashMap<String, TopicSeen>>,
}

/// The brokers' answers about one topic.
struct TopicSeen {
    /// When they were last asked.
    asked: Instant,
    /// The last answer said it exists.
    exists: bool,
    /// The first of the unbroken run of answers that said it does not.
    missing_since: Option<Instant>,
    /// How many answers in that run.
    missing_answers: u32,
}

impl TopicSeen {
    fn verdict(&self) -> Option<bool> {
        match self.missing_since {
            Some(since)
                if self.missing_answers >= 2 && since.elapsed() >= MISSING_CONFIRMED_AFTER =>
            {
                Some(false)
            }
            Some(_) => None,
            None => self.exists.then_some(true),
        }
    }
}

/// Room for a record's framing (offsets, timestamps, varints) next to key, value, headers.
const RECORD_OVERHEAD: usize = 64;

impl KafkaSink {
    /// Builds the producer. librdkafka connects lazily; [`KafkaSink::healthcheck`] and
    /// `check` reach the brokers.
    pub(crate) fn connect(
        config: &KafkaConfig,
        publish_timeout: Duration,
    ) -> Result<KafkaSink, SinkError> {
        // Already a config error (exit 2); asked again as a safeguard.
        let problems: Vec<String> = refused_properties(&config.properties)
            .iter()
            .map(|r| r.short())
            .collect();
        if !problems.is_empty() {
            return Err(SinkError::fatal(format!(
                "sink.kafka.properties would break the delivery promise: {}",
                problems.join("; ")
            )));
        }
        let secrets = secret_values(config);
        let client = client_config(config, publish_timeout);
        let health = Arc::new(Health::default());
        let context = HealthContext {
            health: health.clone(),
        };
        let producer = client.create_with_context(context).map_err(|e| {
            SinkError::fatal(format!(
                "cannot create the Kafka producer: {}",
                scrub(&e.to_string(), &secrets)
            ))
            .caused_by(e)
        })?;
        let knows_partitions = matches!(
            client.get("partitioner"),
            Some("murmur2_random" | "murmur2")
        );
        let max_message_bytes =
            max_message_bytes(&config.properties).map_err(|e| SinkError::fatal(e.to_string()))?;
        Ok(KafkaSink {
            producer,
            health,
            knows_partitions,
            secrets,
            max_message_bytes,
            topics: Mutex::default(),
        })
    }

    /// Whether `topic` exists, from metadata no older than [`TOPIC_TTL`]; `None` when the
    /// brokers did not say for sure.
    ///
    /// librdkafka fails a record to a missing topic only after
    /// `topic.metadata.propagation.max.ms` (30 s), later than the relay's publish timeout,
    /// so the record would just time out - transient, retried forever, and its key stuck.
    /// Asking first makes a topic the brokers do not know the row's fault. But a broker
    /// that just restarted may briefly answer "unknown topic" for a real one, so "missing"
    /// needs two answers at least [`MISSING_CONFIRMED_AFTER`] apart; until then the record
    /// is sent as usual.
    async fn topic_exists(&self, topic: &str) -> Option<bool> {
        if let Some(seen) = self.topics.lock().unwrap().get(topic) {
            if seen.asked.elapsed() < TOPIC_TTL {
                return seen.verdict();
            }
        }
        let producer = self.producer.clone();
        let name = topic.to_owned();
        let answer = tokio::task::spawn_blocking(move || {
            let metadata = producer
                .client()
                .fetch_metadata(Some(&name), METADATA_LIMIT)
                .ok()?;
            let found = metadata.topics().iter().find(|t| t.name() == name)?;
            match found.error() {
                // A topic still being created has no partitions yet: not known either way.
                None => (!found.partitions().is_empty()).then_some(true),
                Some(e) => matches!(
                    RDKafkaErrorCode::from(e),
                    RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic
                )
                .then_some(false),
            }
        })
        .await
        .ok()
        .flatten();
        let mut topics = self.topics.lock().unwrap();
        let seen = topics.entry(topic.to_owned()).or_insert(TopicSeen {
            asked: Instant::now(),
            exists: false,
            missing_since: None,
            missing_answers: 0,
        });
        seen.asked = Instant::now();
        match answer {
            Some(true) => {
                seen.exists = true;
                seen.missing_since = None;
                seen.missing_answers = 0;
            }
            Some(false) => {
                seen.exists = false;
                seen.missing_since.get_or_insert_with(Instant::now);
                seen.missing_answers += 1;
            }
            None => {
                seen.exists = false;
                seen.missing_since = None;
                seen.missing_answers = 0;
            }
        }
        seen.verdict()
    }

    /// Puts one record on the producer queue; a full queue is backpressure, not an error.
    async fn enqueue(
        &self,
        message: &Message,
    ) -> Result<rdkafka::producer::DeliveryFuture, SinkError> {
        let mut headers = OwnedHeaders::new_with_capacity(message.headers.len() + 1);
        for (name, value) in &message.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        headers = headers.insert(Header {
            key: ID_HEADER,
            value: Some(message.id.as_bytes()),
        });
        let mut record = FutureRecord::<[u8], [u8]>::to(&message.topic).headers(headers);
        // No payload at all (not an empty one): a tombstone.
        if let Some(payload) = &message.payload {
            record = record.payload(payload.as_ref());
        }
        match &message.key {
            Some(key) => record = record.key(key.as_bytes()),
            // No order to keep: to a partition that can take it, while some cannot.
            None => {
                if let Some(p) = self.health.available_partition(&message.topic) {
                    record = record.partition(p);
                }
            }
        }
        if let Some(ms) = message.timestamp_ms {
            record = record.timestamp(ms);
        }
        loop {
            match self.producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((e, _)) => return Err(self.classify(&message.topic, e)),
            }
        }
    }

    /// The error of a record librdkafka refused or could not deliver, carrying `e`.
    fn classify(&self, topic: &str, e: KafkaError) -> SinkError {
        let text = scrub(&e.to_string(), &self.secrets);
        let error = match e.rdkafka_error_code().map(classify_code) {
            Some(Class::BadRow) => SinkError::bad_row(text),
            Some(Class::Fatal) => SinkError::fatal(format!(
                "{text}: the broker refuses this producer; fix its credentials or ACLs"
            )),
            // Metadata was stale when the record was queued; trust it once it is fresh.
            Some(Class::MissingTopic) => {
                self.topics.lock().unwrap().remove(topic);
                SinkError::transient(format!(
                    "topic {topic:?} is unknown to the brokers' metadata; checking again"
                ))
            }
            Some(Class::Transient) | None => SinkError::transient(text),
        };
        error.caused_by(e)
    }

    /// Topic name -> partition count, from the brokers (all topics, or just `topic`).
    pub(crate) async fn metadata(
        &self,
        topic: Option<&str>,
    ) -> Result<BTreeMap<String, usize>, SinkError> {
        let producer = self.producer.clone();
        let topic = topic.map(str::to_owned);
        let secrets = self.secrets.clone();
        tokio::task::spawn_blocking(move || {
            let metadata = producer
                .client()
                .fetch_metadata(topic.as_deref(), METADATA_LIMIT)
                .map_err(|e| {
                    SinkError::transient(format!(
                        "Kafka brokers did not answer: {}",
                        scrub(&e.to_string(), &secrets)
                    ))
                    .caused_by(e)
                })?;
            Ok(metadata
                .topics()
                .iter()
                .filter(|t| t.error().is_none())
                .map(|t| (t.name().to_owned(), t.partitions().len()))
                .collect())
        })
        .await
        .map_err(|e| SinkError::transient(format!("metadata task failed: {e}")))?
    }
}

impl SinkService for KafkaSink {
    const NAME: &'static str = "kafka";

    /// The idempotent producer keeps a partition's records in order through its retries.
    fn keeps_order_in_flight(&self) -> bool {
        true
    }

    /// A keyed record whose partition has no reachable leader now (see [`health`]).
    fn unavailable(&self, message: &Message) -> Option<NotNow> {
        let key = message.key.as_ref()?;
        if !self.knows_partitions {
            return None;
        }
        let u = self.health.unavailable(&message.topic, key.as_bytes())?;
        Some(NotNow::new(&u, u.down_for(Instant::now())))
    }

    fn available_again(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.health.available_again())
    }

    /// Rejects records Kafka would refuse for themselves, before anything of the batch is
    /// queued: an invalid topic name, a record larger than `message.max.bytes`.
    fn check(&self, message: &Message) -> Result<(), SinkError> {
        check_topic(&message.topic).map_err(SinkError::bad_row)?;
        if message.payload.is_none() && message.key.is_none() {
            return Err(SinkError::bad_row(
                "a NULL payload is sent as a tombstone, which deletes a key under log \
                 compaction: it needs a key, and this row's key is NULL",
            ));
        }
        let size = RECORD_OVERHEAD
            + message.key.as_ref().map_or(0, |k| k.len())
            + message.payload.as_ref().map_or(0, |p| p.len())
            + message.id.len()
            + ID_HEADER.len()
            + message
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len() + 8)
                .sum::<usize>();
        if size > self.max_message_bytes {
            return Err(SinkError::bad_row(format!(
                "record is about {size} bytes, too large for the producer's message.max.bytes \
                 ({}); the broker's own limit may be lower",
                self.max_message_bytes
            )));
        }
        Ok(())
    }

    /// Queues the whole batch, then awaits every delivery report. Once a record cannot
    /// be queued, the later records of its key are not queued either. A record to a topic
    /// the brokers say does not exist is not queued: it is the row's fault.
    async fn publish_batch(&self, messages: &[&Message]) -> Vec<Result<(), SinkError>> {
        let mut missing: HashMap<&str, bool> = HashMap::new();
        for message in messages {
            if !missing.contains_key(&*message.topic) {
                let exists = self.topic_exists(&message.topic).await;
                missing.insert(&message.topic, exists == Some(false));
            }
        }
        let mut pending = Vec::with_capacity(messages.len());
        let mut stopped: std::collections::HashSet<&str> = std::collections::HashSet::new();
        for message in messages {
            let key = message.key.as_deref();
            if key.is_some_and(|k| stopped.contains(k)) {
                pending.push(Err(SinkError::transient(
                    "not sent: an earlier record of its key failed",
                )));
                continue;
            }
            let enqueued = if missing[&*message.topic] {
                Err(missing_topic(&message.topic))
            } else {
                self.enqueue(message).await
            };
            if let (Err(_), Some(k)) = (&enqueued, key) {
                stopped.insert(k);
            }
            pending.push(enqueued);
        }
        let mut results = Vec::with_capacity(messages.len());
        for (enqueued, message) in pending.into_iter().zip(messages) {
            results.push(match enqueued {
                Err(e) => Err(e),
                Ok(delivery) => match delivery.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err((e, _))) => Err(self.classify(&message.topic, e)),
                    Err(_) => Err(SinkError::transient(
                        "the producer dropped a delivery report",
                    )),
                },
            });
        }
        results
    }

    /// Whether a broker answers a metadata request within 5s.
    async fn healthcheck(&self) -> Result<(), SinkError> {
        self.metadata(None).await.map(|_| ())
    }

    /// Flushes queued records, off the async runtime (librdkafka's flush blocks).
    async fn close(&self, timeout: Duration) -> Result<(), SinkError> {
        let producer = self.producer.clone();
        tokio::task::spawn_blocking(move || producer.flush(timeout))
            .await
            .map_err(|e| SinkError::transient(format!("flush task failed: {e}")))?
            .map_err(|e| SinkError::transient(format!("Kafka flush: {e}")).caused_by(e))
    }
}

/// The values of every secret property, to scrub from the client's errors.
fn secret_values(config: &KafkaConfig) -> Vec<String> {
    config
        .properties
        .iter()
        .filter(|(k, _)| is_secret(k))
        .map(|(_, v)| v.clone())
        .chain(
            config
                .secret_properties
                .values()
                .map(|s| s.expose().to_owned()),
        )
        .collect()
}

/// The producer's configuration: the brokers, the record timeout, the relay's defaults,
/// then the operator's properties.
fn client_config(config: &KafkaConfig, publish_timeout: Duration) -> ClientConfig {
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", &config.brokers);
    // librdkafka gives up on a record when the relay stops waiting for it.
    client.set(
        "message.timeout.ms",
        publish_timeout.as_millis().to_string(),
    );
    for (name, value) in PRODUCER_DEFAULTS {
        client.set(*name, *value);
    }
    for (name, value) in &config.properties {
        client.set(name, value);
    }
    for (name, value) in &config.secret_properties {
        client.set(name, value.expose());
    }
    client
}

/// How long a topic's existence, read from metadata, is trusted.
const TOPIC_TTL: Duration = Duration::from_secs(5);
/// A topic is missing only when answers this far apart both said so.
const MISSING_CONFIRMED_AFTER: Duration = Duration::from_secs(2);
/// How long a metadata request (which topics, how many partitions) may wait for the
/// brokers. It blocks a thread of its own (`spawn_blocking`), so it holds up only its
/// caller; no answer in time is "not known" or a transient failure.
const METADATA_LIMIT: Duration = Duration::from_secs(5);
/// How long a record waits when librdkafka's queue is full before it is offered again:
/// room frees as earlier records are acknowledged, so a short pause keeps the queue full
/// without spinning on it.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(5);

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    fn config(properties: &[(&str, &str)]) -> KafkaConfig {
        KafkaConfig {
            brokers: "127.0.0.1:1".to_owned(),
            properties: properties
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            secret_properties: BTreeMap::new(),
        }
    }

    #[test]
    fn a_refused_producer_carries_the_kafka_error_and_only_the_message_is_scrubbed() {
        let refused = config(&[("sasl.password", "hunter2"), ("linger.ms", "hunter2")]);
        let Err(e) = KafkaSink::connect(&refused, Duration::from_secs(5)) else {
            panic!("a producer with linger.ms = \"hunter2\" was created");
        };
        assert_eq!(e.class, crate::error::ErrorClass::Fatal);
        assert!(e
            .message()
            .starts_with("cannot create the Kafka producer: "));
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let cause = e.source().and_then(|s| s.downcast_ref::<KafkaError>());
        assert!(
            matches!(cause, Some(KafkaError::ClientConfig(_, _, key, _)) if key == "linger.ms"),
            "{cause:?}"
        );
    }

    #[test]
    fn a_delivery_error_exposes_its_kafka_error_code() {
        let sink = KafkaSink::connect(&config(&[]), Duration::from_secs(5)).unwrap();
        let too_large = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        let e = sink.classify("orders", too_large.clone());
        assert_eq!(e.class, crate::error::ErrorClass::BadRow);
        assert_eq!(e.message(), too_large.to_string());
        let code = e
            .source()
            .and_then(|s| s.downcast_ref::<KafkaError>())
            .and_then(KafkaError::rdkafka_error_code);
        assert_eq!(code, Some(RDKafkaErrorCode::MessageSizeTooLarge));
    }
}
