//! An in-memory sink for tests: records what it acknowledged and fails the messages a
//! test tells it to, so the relay's handling of failures can be checked exactly.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{Message, NotNow, SinkError, SinkService};

/// Records what it acknowledged; fails or rejects the messages it is told to. A clone
/// shares all of it: a test keeps one to steer the sink the relay holds.
#[derive(Clone)]
pub struct MemorySink {
    published: Arc<Mutex<Vec<Message>>>,
    /// Message id -> the error its publish returns (each time).
    failures: Arc<Mutex<HashMap<String, SinkError>>>,
    /// Topic -> the error a publish to it returns (each time).
    topic_failures: Arc<Mutex<HashMap<String, SinkError>>>,
    /// Message id -> the error `check` returns.
    rejections: Arc<Mutex<HashMap<String, SinkError>>>,
    /// Keys whose destination cannot take a message now (`unavailable`), each since when.
    unavailable: Arc<Mutex<HashMap<String, Instant>>>,
    /// Counts the keys made available again (`available_again`).
    available_again: Arc<watch::Sender<u64>>,
    /// Key -> how many of its messages `unavailable` turned away.
    turned_away: Arc<Mutex<HashMap<String, u64>>>,
    keeps_order: bool,
    /// Acknowledge without recording (benchmarks: the database's limit, no broker).
    discard: bool,
}

impl Default for MemorySink {
    fn default() -> Self {
        MemorySink {
            published: Arc::default(),
            failures: Arc::default(),
            topic_failures: Arc::default(),
            rejections: Arc::default(),
            unavailable: Arc::default(),
            available_again: Arc::new(watch::channel(0).0),
            turned_away: Arc::default(),
            keeps_order: false,
            discard: false,
        }
    }
}

impl MemorySink {
    /// `keeps_order_in_flight`: whether the relay may send a key's messages all at once.
    pub fn new(keeps_order_in_flight: bool) -> MemorySink {
        MemorySink {
            keeps_order: keeps_order_in_flight,
            ..Default::default()
        }
    }

    /// A sink that acknowledges everything at once and keeps nothing: what the relay does
    /// when the broker costs nothing.
    pub fn discarding() -> MemorySink {
        MemorySink {
            keeps_order: true,
            discard: true,
            ..Default::default()
        }
    }

    /// Makes every publish of message `id` fail with `error`.
    pub fn fail(&self, id: &str, error: SinkError) {
        self.failures.lock().unwrap().insert(id.to_owned(), error);
    }

    /// Makes `check` reject message `id`, as a sink does for a message bad on its face.
    pub fn reject(&self, id: &str, error: SinkError) {
        self.rejections.lock().unwrap().insert(id.to_owned(), error);
    }

    /// Makes every publish to `topic` fail with `error`.
    pub fn fail_topic(&self, topic: &str, error: SinkError) {
        self.topic_failures
            .lock()
            .unwrap()
            .insert(topic.to_owned(), error);
    }

    /// Stops failing publishes to `topic`.
    pub fn heal_topic(&self, topic: &str) {
        self.topic_failures.lock().unwrap().remove(topic);
    }

    /// Makes the destination of `key`'s messages unavailable (`None`) or available again,
    /// as a Kafka partition whose leader is down and back.
    pub fn set_available(&self, key: &str, available: bool) {
        let mut unavailable = self.unavailable.lock().unwrap();
        if available {
            if unavailable.remove(key).is_some() {
                self.available_again.send_modify(|n| *n += 1);
            }
        } else {
            unavailable
                .entry(key.to_owned())
                .or_insert_with(Instant::now);
        }
    }

    /// How many of `key`'s messages were turned away because its destination was
    /// unavailable: each is one claim of the key's head that found it still down.
    pub fn turned_away(&self, key: &str) -> u64 {
        self.turned_away
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    /// Everything acknowledged so far, in acknowledgement order.
    pub fn published(&self) -> Vec<Message> {
        self.published.lock().unwrap().clone()
    }
}

impl SinkService for MemorySink {
    const NAME: &'static str = "memory";

    fn keeps_order_in_flight(&self) -> bool {
        self.keeps_order
    }

    fn check(&self, message: &Message) -> Result<(), SinkError> {
        match self.rejections.lock().unwrap().get(&message.id) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn unavailable(&self, message: &Message) -> Option<NotNow> {
        let key = message.key.as_ref()?;
        let since = *self.unavailable.lock().unwrap().get(&**key)?;
        *self
            .turned_away
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default() += 1;
        Some(NotNow::new(
            format_args!("the destination of key {key:?} is unavailable"),
            since.elapsed(),
        ))
    }

    fn available_again(&self) -> Option<watch::Receiver<u64>> {
        Some(self.available_again.subscribe())
    }

    async fn publish_batch(&self, messages: &[&Message]) -> Vec<Result<(), SinkError>> {
        if self.discard {
            return messages.iter().map(|_| Ok(())).collect();
        }
        let failures = self.failures.lock().unwrap().clone();
        let topic_failures = self.topic_failures.lock().unwrap().clone();
        let mut published = self.published.lock().unwrap();
        messages
            .iter()
            .map(
                |m| match topic_failures.get(&*m.topic).or(failures.get(&m.id)) {
                    Some(e) => Err(e.clone()),
                    None => {
                        published.push((*m).clone());
                        Ok(())
                    }
                },
            )
            .collect()
    }

    /// Nothing is buffered.
    async fn close(&self, _timeout: Duration) -> Result<(), SinkError> {
        Ok(())
    }
}
