//! Which partitions can take a record now, from librdkafka's statistics: a partition is
//! *unavailable* while it has no leader, or while its leader is a broker the producer has
//! not been connected to for [`DOWN_AFTER`]. The relay holds back the keys of an
//! unavailable partition (their rows stay pending, in order) instead of queueing records
//! that would wait out `sink.publish_timeout`, so one broker's outage does not stop the
//! partitions the others lead.
//!
//! Where it comes from. librdkafka emits its statistics every `statistics.interval.ms`
//! (the relay's default: 500 ms, in `config::kafka`'s defaults) to [`HealthContext::stats_raw`]: each
//! broker's connection state and each partition's leader, as the producer itself sees
//! them. A broker counts as down only after every sample over [`DOWN_AFTER`] said it was
//! not connected (or no longer listed it while partitions still name it as their leader) (a connection being set up takes milliseconds, so a healthy broker is
//! never caught between two samples that far apart), and as up from the first sample that
//! says so.
//!
//! Why the producer keeps a connection to every broker (`enable.sparse.connections =
//! false`, a relay default). With sparse connections librdkafka connects to a broker only
//! while records are queued for it; a broker whose rows are postponed has none, so the
//! producer would stop trying to reach it and never see it come back. With a connection
//! to each broker it retries on its own (`reconnect.backoff.ms` up to
//! `reconnect.backoff.max.ms`, 1 s by the relay's default where librdkafka's grows to 10
//! s) and the statistics say when the broker is back: [`Health::available_again`] counts
//! it, and the relay makes the rows postponed for it due at once (`relay::postponed`).
//!
//! Where a key goes. The relay's partitioner is `murmur2_random` (a Java producer's
//! choice): `murmur2(key) & 0x7fffffff % partitions` ([`partition_of`]). When the operator
//! sets another `partitioner`, the relay cannot tell where a key lands and holds nothing
//! back: records to a down partition then wait out the publish timeout as before. A
//! record without a key has no order to keep: it goes to a partition that is available.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use serde::Deserialize;
use tokio::sync::watch;

/// How long every sample must say a broker is not connected before its partitions count
/// as unavailable.
pub(crate) const DOWN_AFTER: Duration = Duration::from_secs(1);

/// The producer's view of the cluster, shared between librdkafka's statistics callback
/// (writer) and the sink (reader).
pub(crate) struct Health {
    state: RwLock<State>,
    /// Counts the partitions that became available again ([`SinkService::available_again`]).
    ///
    /// [`SinkService::available_again`]: crate::sink::SinkService::available_again
    available_again: watch::Sender<u64>,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            state: RwLock::default(),
            available_again: watch::channel(0).0,
        }
    }
}

#[derive(Default)]
struct State {
    /// Broker id -> since when every sample said it is not connected.
    not_up_since: HashMap<i32, Instant>,
    /// Brokers down for at least [`DOWN_AFTER`].
    down: HashSet<i32>,
    /// Topic -> each partition's leader (`-1`: none), by partition id.
    leaders: HashMap<String, Vec<i32>>,
    /// Unavailable partitions as last logged (to log each change once), each with the
    /// sample that first found it so.
    logged: HashMap<(String, i32), Instant>,
}

/// Why a record cannot go now, for the row's `last_error` and the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unavailable {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    /// The leader broker that is down; `None`: the partition has no leader.
    pub(crate) leader: Option<i32>,
    /// The first statistics sample that found it unavailable (`None` before one has).
    since: Option<Instant>,
}

impl Unavailable {
    /// How long it has been unavailable at `now`: zero before a sample said so.
    pub(crate) fn down_for(&self, now: Instant) -> Duration {
        self.since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.leader {
            Some(b) => write!(
                f,
                "partition {} of topic {:?} is led by broker {b}, which the producer \
                 cannot reach",
                self.partition, self.topic
            ),
            None => write!(
                f,
                "partition {} of topic {:?} has no leader",
                self.partition, self.topic
            ),
        }
    }
}

impl Health {
    /// Where a record of `key` to `topic` would go, if that partition cannot take it now.
    /// `None` when it can, or when the topic's partitions are not known yet.
    pub(crate) fn unavailable(&self, topic: &str, key: &[u8]) -> Option<Unavailable> {
        let state = self.state.read().unwrap();
        let leaders = state.leaders.get(topic)?;
        let partition = partition_of(key, leaders.len())?;
        let mut u = state.check(topic, partition, leaders[partition as usize])?;
        u.since = state.logged.get(&(u.topic.clone(), u.partition)).copied();
        Some(u)
    }

    /// See [`Health::available_again`](field@Health::available_again).
    pub(crate) fn available_again(&self) -> watch::Receiver<u64> {
        self.available_again.subscribe()
    }

    /// A partition of `topic` that can take a record now, at random, when some of its
    /// partitions cannot (`None`: all can, or none can, or the topic is not known yet; the
    /// producer's own partitioner then decides).
    pub(crate) fn available_partition(&self, topic: &str) -> Option<i32> {
        let state = self.state.read().unwrap();
        let leaders = state.leaders.get(topic)?;
        let up: Vec<i32> = (0..leaders.len() as i32)
            .filter(|&p| state.check(topic, p, leaders[p as usize]).is_none())
            .collect();
        if up.is_empty() || up.len() == leaders.len() {
            return None;
        }
        Some(up[rand::random_range(0..up.len())])
    }

    /// Takes one statistics sample.
    fn observe(&self, stats: Stats, now: Instant) {
        let mut state = self.state.write().unwrap();
        let known: HashMap<i32, &str> = stats
            .brokers
            .values()
            .filter(|b| b.nodeid >= 0)
            .map(|b| (b.nodeid, b.state.as_str()))
            .collect();
        // A leader the producer has no broker for (gone from the cluster's metadata while
        // its partitions still name it, as a broker that went down can be) counts as not
        // connected too.
        let leaders: HashSet<i32> = stats
            .topics
            .values()
            .flat_map(|t| t.partitions.values().map(|p| p.leader))
            .filter(|&l| l >= 0)
            .collect();
        let absent = leaders.iter().filter(|l| !known.contains_key(l));
        let brokers = known
            .iter()
            .map(|(&id, &s)| (id, s))
            .chain(absent.map(|&id| (id, "ABSENT")));
        for (id, broker_state) in brokers {
            if is_up(broker_state) {
                state.not_up_since.remove(&id);
                state.down.remove(&id);
            } else if broker_state != "INIT" {
                let since = *state.not_up_since.entry(id).or_insert(now);
                if now.duration_since(since) >= DOWN_AFTER {
                    state.down.insert(id);
                }
            }
        }
        for (name, topic) in stats.topics {
            let mut leaders: Vec<(i32, i32)> = topic
                .partitions
                .values()
                .filter(|p| p.partition >= 0 && !p.unknown)
                .map(|p| (p.partition, p.leader))
                .collect();
            leaders.sort_unstable();
            // Only a contiguous 0..n is a topic's full partition list.
            if leaders.iter().enumerate().all(|(i, (p, _))| *p == i as i32) {
                state
                    .leaders
                    .insert(name, leaders.into_iter().map(|(_, l)| l).collect());
            }
        }
        if state.log_changes(now) {
            self.available_again.send_modify(|n| *n += 1);
        }
    }
}

impl State {
    fn check(&self, topic: &str, partition: i32, leader: i32) -> Option<Unavailable> {
        let unavailable = |leader| {
            Some(Unavailable {
                topic: topic.to_owned(),
                partition,
                leader,
                since: None,
            })
        };
        if leader < 0 {
            unavailable(None)
        } else if self.down.contains(&leader) {
            unavailable(Some(leader))
        } else {
            None
        }
    }

    /// One WARN line when a partition becomes unavailable, one INFO line when it is back;
    /// whether one is back.
    fn log_changes(&mut self, sample: Instant) -> bool {
        let now: HashSet<(String, i32)> = self
            .leaders
            .iter()
            .flat_map(|(topic, leaders)| {
                leaders.iter().enumerate().filter_map(|(p, &leader)| {
                    self.check(topic, p as i32, leader)
                        .map(|u| (u.topic, u.partition))
                })
            })
            .collect();
        for (topic, partition) in now.iter().filter(|p| !self.logged.contains_key(*p)) {
            let leader = self.leaders[topic][*partition as usize];
            tracing::warn!(
                topic, partition, leader,
                "Kafka partition unavailable: its rows are postponed (they stay pending, in key order) while the other partitions flow"
            );
        }
        let mut back = false;
        for (topic, partition) in self.logged.keys().filter(|p| !now.contains(*p)) {
            tracing::info!(
                topic,
                partition,
                "Kafka partition available again: its postponed rows follow in key order"
            );
            back = true;
        }
        let logged = std::mem::take(&mut self.logged);
        self.logged = now
            .into_iter()
            .map(|p| {
                let since = logged.get(&p).copied().unwrap_or(sample);
                (p, since)
            })
            .collect();
        back
    }
}

/// Whether a librdkafka broker state means connected.
fn is_up(state: &str) -> bool {
    matches!(state, "UP" | "REAUTH")
}

/// The partition `murmur2_random` (and a Java producer) puts `key` on, among `partitions`.
pub fn partition_of(key: &[u8], partitions: usize) -> Option<i32> {
    (partitions > 0).then(|| ((murmur2(key) & 0x7fff_ffff) as usize % partitions) as i32)
}

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`), seed `0x9747b28c`.
pub(crate) fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// The producer's client context: hands each statistics sample to [`Health`]. Log lines
/// and errors go where the default context sends them.
pub(crate) struct HealthContext {
    pub(crate) health: Arc<Health>,
}

impl ClientContext for HealthContext {
    fn stats_raw(&self, statistics: &[u8]) {
        match serde_json::from_slice::<Stats>(statistics) {
            Ok(stats) => self.health.observe(stats, Instant::now()),
            Err(e) => tracing::debug!(error = %e, "Unreadable librdkafka statistics"),
        }
    }
}

/// The part of librdkafka's statistics JSON the relay reads.
#[derive(Deserialize)]
struct Stats {
    #[serde(default)]
    brokers: HashMap<String, BrokerStats>,
    #[serde(default)]
    topics: HashMap<String, TopicStats>,
}

#[derive(Deserialize)]
struct BrokerStats {
    nodeid: i32,
    state: String,
}

#[derive(Deserialize)]
struct TopicStats {
    #[serde(default)]
    partitions: HashMap<String, PartitionStats>,
}

#[derive(Deserialize)]
struct PartitionStats {
    partition: i32,
    leader: i32,
    #[serde(default)]
    unknown: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_kafkas_own_test_vectors() {
        // org.apache.kafka.common.utils.UtilsTest#testMurmur2
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ];
        for (data, expected) in cases {
            assert_eq!(
                murmur2(data) as i32,
                expected,
                "{:?}",
                std::str::from_utf8(data)
            );
        }
    }

    fn sample(broker_state: &str, leader: i32) -> Stats {
        serde_json::from_value(serde_json::json!({
            "brokers": {
                "127.0.0.1:9092/1": {"nodeid": 1, "state": "UP"},
                "127.0.0.1:9093/2": {"nodeid": 2, "state": broker_state},
                "127.0.0.1:9092/bootstrap": {"nodeid": -1, "state": "DOWN"},
            },
            "topics": {"t": {"partitions": {
                "0": {"partition": 0, "leader": 1},
                "1": {"partition": 1, "leader": leader},
                "-1": {"partition": -1, "leader": -1},
            }}},
        }))
        .unwrap()
    }

    /// A key that `murmur2_random` puts on partition `p` of 2.
    fn key_on(p: i32) -> Vec<u8> {
        (0..)
            .map(|i: u32| format!("k{i}").into_bytes())
            .find(|k| partition_of(k, 2) == Some(p))
            .unwrap()
    }

    #[test]
    fn a_partitions_outage_is_timed_from_the_sample_that_found_it_and_its_end_is_counted() {
        let health = Health::default();
        let mut back = health.available_again();
        let t0 = Instant::now();
        health.observe(sample("DOWN", 2), t0);
        health.observe(sample("DOWN", 2), t0 + DOWN_AFTER);
        let held = health.unavailable("t", &key_on(1)).unwrap();
        assert_eq!(held.down_for(t0 + DOWN_AFTER), Duration::ZERO);
        // Later samples that find it still down do not restart the clock.
        health.observe(sample("DOWN", 2), t0 + DOWN_AFTER * 3);
        let held = health.unavailable("t", &key_on(1)).unwrap();
        assert_eq!(held.down_for(t0 + DOWN_AFTER * 5), DOWN_AFTER * 4);
        assert!(!back.has_changed().unwrap(), "nothing is back yet");
        health.observe(sample("UP", 2), t0 + DOWN_AFTER * 6);
        assert!(back.has_changed().unwrap(), "partition 1 is back");
        assert_eq!(*back.borrow_and_update(), 1);
        health.observe(sample("UP", 2), t0 + DOWN_AFTER * 7);
        assert!(!back.has_changed().unwrap(), "counted once");
    }

    #[test]
    fn a_broker_is_down_only_after_every_sample_over_down_after_said_so() {
        let health = Health::default();
        let t0 = Instant::now();
        health.observe(sample("CONNECT", 2), t0);
        assert_eq!(
            health.unavailable("t", &key_on(1)),
            None,
            "one sample is not enough"
        );
        health.observe(sample("DOWN", 2), t0 + DOWN_AFTER / 2);
        assert_eq!(health.unavailable("t", &key_on(1)), None);
        health.observe(sample("TRY_CONNECT", 2), t0 + DOWN_AFTER);
        let held = health
            .unavailable("t", &key_on(1))
            .expect("down after DOWN_AFTER");
        assert_eq!((held.partition, held.leader), (1, Some(2)));
        assert_eq!(health.unavailable("t", &key_on(0)), None, "broker 1 is up");
        assert_eq!(health.available_partition("t"), Some(0));
        // Up again from the first sample that says so.
        health.observe(sample("UP", 2), t0 + DOWN_AFTER * 2);
        assert_eq!(health.unavailable("t", &key_on(1)), None);
        assert_eq!(
            health.available_partition("t"),
            None,
            "every partition is up"
        );
    }

    #[test]
    fn a_partition_without_a_leader_is_unavailable_at_once() {
        let health = Health::default();
        health.observe(sample("UP", -1), Instant::now());
        let held = health.unavailable("t", &key_on(1)).unwrap();
        assert_eq!(held.leader, None);
        assert_eq!(health.unavailable("t", &key_on(0)), None);
    }

    #[test]
    fn a_leader_gone_from_the_broker_list_is_down_after_down_after() {
        let health = Health::default();
        let t0 = Instant::now();
        let mut gone = sample("UP", 2);
        gone.brokers.retain(|_, b| b.nodeid != 2);
        health.observe(gone, t0);
        assert_eq!(health.unavailable("t", &key_on(1)), None);
        let mut gone = sample("UP", 2);
        gone.brokers.retain(|_, b| b.nodeid != 2);
        health.observe(gone, t0 + DOWN_AFTER);
        assert_eq!(
            health.unavailable("t", &key_on(1)).map(|u| u.leader),
            Some(Some(2))
        );
    }

    #[test]
    fn a_broker_never_connected_yet_is_not_down() {
        let health = Health::default();
        let t0 = Instant::now();
        health.observe(sample("INIT", 2), t0);
        health.observe(sample("INIT", 2), t0 + DOWN_AFTER * 3);
        assert_eq!(health.unavailable("t", &key_on(1)), None);
    }

    #[test]
    fn an_unknown_topic_holds_nothing_back() {
        let health = Health::default();
        assert_eq!(health.unavailable("t", b"k"), None);
        assert_eq!(health.available_partition("t"), None);
    }
}
