//! What a destination's settings mean for a message the broker acknowledged, decided
//! without a network: the settings `check` read from a JetStream stream or a Kafka topic
//! go in; a [`Destination`] comes out, with a warning for each setting that lets an
//! acknowledged message be lost, naming the setting and the fix.
//!
//! The relay deletes (or marks) a row once the broker acknowledged it; from then on the
//! message lives only as long as the broker keeps it. An acknowledgement is durable when
//! the message is on disk on more than one machine before it is given:
//!
//! 1. JetStream: a file-backed stream (`storage: file`) with 3 replicas. A stream with 1
//!    replica is lost with its server's disk; a memory stream with a restart of its
//!    servers. nats-server syncs its files to disk every `sync_interval` (2 minutes by
//!    default, and fixed at that before 2.10): with 1 replica, a power loss of that one
//!    machine loses up to that much; with 3, only a power loss of a majority at once
//!    does, so `sync_interval` is a warning for a stream with 1 replica only.
//! 2. Kafka: `replication.factor` >= 3, `min.insync.replicas` >= 2 (with the producer's
//!    `acks=all`, a record is acknowledged once that many replicas have it) and
//!    `unclean.leader.election.enable = false` (else a replica that missed acknowledged
//!    records may become leader and truncate them).

use std::time::Duration;

use serde_json::{json, Value};

use crate::sink::kafka::TopicSettings;

/// A destination's durability: its settings as data and what is wrong with them.
#[derive(Debug, Clone)]
pub(crate) struct Destination {
    /// `nats_stream` or `kafka_topic`.
    pub(crate) kind: &'static str,
    pub(crate) name: String,
    /// The setting names as the broker spells them, with their values (`null`: unknown).
    pub(crate) settings: Vec<(&'static str, Value)>,
    pub(crate) warnings: Vec<Warning>,
}

/// A setting that lets an acknowledged message be lost, and what to do about it.
#[derive(Debug, Clone)]
pub(crate) struct Warning {
    pub(crate) setting: &'static str,
    pub(crate) message: String,
}

impl Destination {
    /// `check --format json`'s object for this destination.
    pub(crate) fn to_json(&self) -> Value {
        let settings: serde_json::Map<String, Value> = self
            .settings
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect();
        let warnings: Vec<Value> = self
            .warnings
            .iter()
            .map(|w| json!({"setting": w.setting, "message": w.message}))
            .collect();
        json!({
            "kind": self.kind,
            "name": self.name,
            "settings": settings,
            "warnings": warnings,
        })
    }

    /// The settings on one line: `replicas 3, storage file, sync_interval 2m (how known)`.
    pub(crate) fn summary(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        for (k, v) in &self.settings {
            match (k.strip_suffix("_source"), v, parts.last_mut()) {
                // Where the previous setting's value came from, beside it.
                (Some(_), Value::String(s), Some(last)) => last.push_str(&format!(" ({s})")),
                (Some(_), _, _) => {}
                (None, Value::Null, _) => parts.push(format!("{k} unknown")),
                (None, Value::String(s), _) => parts.push(format!("{k} {s}")),
                (None, other, _) => parts.push(format!("{k} {other}")),
            }
        }
        parts.join(", ")
    }
}

/// How a nats-server gets its stream files onto disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SyncPolicy {
    /// Every write is synced before it is acknowledged (`sync_interval: always`).
    Always,
    /// Synced every `interval`; `how` says how `check` knows.
    Every { interval: Duration, how: String },
    /// Not visible to this connection; `why` says so and where to look.
    Unseen { why: String },
}

/// nats-server's `sync_interval` unless configured otherwise (and always, before 2.10).
pub(crate) const NATS_DEFAULT_SYNC: Duration = Duration::from_secs(120);

/// What `check` read of a JetStream stream.
#[derive(Debug, Clone)]
pub(crate) struct StreamSettings {
    pub(crate) name: String,
    pub(crate) replicas: usize,
    /// `storage: memory` (else file).
    pub(crate) memory: bool,
    pub(crate) sync: SyncPolicy,
}

/// A JetStream stream's durability.
pub(crate) fn judge_stream(s: &StreamSettings) -> Destination {
    let name = &s.name;
    let mut warnings = Vec::new();
    if s.replicas < 2 {
        warnings.push(Warning {
            setting: "replicas",
            message: format!(
                "stream {name} has {} replica: a lost server (its disk, its machine) loses \
                 acknowledged messages: `nats stream edit {name} --replicas 3` (on a cluster \
                 of 3 or more servers)",
                s.replicas
            ),
        });
    }
    if s.memory {
        warnings.push(Warning {
            setting: "storage",
            message: format!(
                "stream {name} has memory storage: a restart of its servers loses every \
                 acknowledged message; storage cannot be edited: create a stream with \
                 `--storage file --replicas 3` for the same subjects and remove this one"
            ),
        });
    }
    if !s.memory && s.replicas < 2 {
        let what = match &s.sync {
            SyncPolicy::Always => None,
            SyncPolicy::Every { interval, how } => Some(format!(
                "the server syncs stream files to disk every {} ({how})",
                humantime::format_duration(*interval)
            )),
            SyncPolicy::Unseen { why } => Some(format!(
                "the server's sync_interval cannot be seen ({why}); unless it is `always` it \
                 syncs every {} by default",
                humantime::format_duration(NATS_DEFAULT_SYNC)
            )),
        };
        if let Some(what) = what {
            warnings.push(Warning {
                setting: "sync_interval",
                message: format!(
                    "{what}: a power loss or kernel crash of the one server that holds stream \
                     {name} loses the messages acknowledged since its last sync: set \
                     `jetstream {{ sync_interval: always }}` in the server config \
                     (nats-server 2.10+), or give the stream 3 replicas"
                ),
            });
        }
    }
    let (sync, sync_source) = match &s.sync {
        SyncPolicy::Always => (json!("always"), Value::Null),
        SyncPolicy::Every { interval, how } => (
            json!(humantime::format_duration(*interval).to_string()),
            json!(how),
        ),
        SyncPolicy::Unseen { why } => (Value::Null, json!(why)),
    };
    Destination {
        kind: "nats_stream",
        name: name.clone(),
        settings: vec![
            ("replicas", json!(s.replicas)),
            ("storage", json!(if s.memory { "memory" } else { "file" })),
            ("sync_interval", sync),
            ("sync_interval_source", sync_source),
        ],
        warnings,
    }
}

/// A Kafka topic's durability; `brokers` goes into the commands that fix it.
pub(crate) fn judge_topic(t: &TopicSettings, brokers: &str) -> Destination {
    let name = &t.name;
    let configs = format!(
        "kafka-configs.sh --bootstrap-server {brokers} --entity-type topics --entity-name {name}"
    );
    let mut warnings = Vec::new();
    if let Some(rf) = t.replication_factor.filter(|&rf| rf < 3) {
        warnings.push(Warning {
            setting: "replication.factor",
            message: format!(
                "topic {name} has replication factor {rf}: a lost broker loses acknowledged \
                 records: raise it to 3 with kafka-reassign-partitions.sh (or recreate the \
                 topic with --replication-factor 3)"
            ),
        });
    }
    let unread = |setting: &'static str, want: &str| Warning {
        setting,
        message: format!(
            "{setting} of topic {name} could not be read ({}): see it with `{configs} \
             --describe`; it should be {want}",
            t.configs_unread
                .as_deref()
                .unwrap_or("not in the broker's answer")
        ),
    };
    match t.min_insync_replicas {
        Some(n) if n < 2 => warnings.push(Warning {
            setting: "min.insync.replicas",
            message: format!(
                "topic {name} has min.insync.replicas {n}: with acks=all a record is \
                 acknowledged by the leader alone once the others fall behind, and lost with \
                 it: `{configs} --alter --add-config min.insync.replicas=2`"
            ),
        }),
        Some(_) => {}
        None => warnings.push(unread("min.insync.replicas", "2 or more")),
    }
    match t.unclean_leader_election {
        Some(true) => warnings.push(Warning {
            setting: "unclean.leader.election.enable",
            message: format!(
                "topic {name} allows unclean leader election: a replica that missed \
                 acknowledged records may become leader and drop them: `{configs} --alter \
                 --add-config unclean.leader.election.enable=false`"
            ),
        }),
        Some(false) => {}
        None => warnings.push(unread("unclean.leader.election.enable", "false")),
    }
    Destination {
        kind: "kafka_topic",
        name: name.clone(),
        settings: vec![
            ("partitions", json!(t.partitions)),
            ("replication.factor", json!(t.replication_factor)),
            ("min.insync.replicas", json!(t.min_insync_replicas)),
            (
                "unclean.leader.election.enable",
                json!(t.unclean_leader_election),
            ),
        ],
        warnings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(replicas: usize, memory: bool, sync: SyncPolicy) -> Destination {
        judge_stream(&StreamSettings {
            name: "OUTBOX".into(),
            replicas,
            memory,
            sync,
        })
    }

    fn every_2m() -> SyncPolicy {
        SyncPolicy::Every {
            interval: NATS_DEFAULT_SYNC,
            how: "fixed before nats-server 2.10".into(),
        }
    }

    fn settings(d: &Destination) -> Vec<&str> {
        d.warnings.iter().map(|w| w.setting).collect()
    }

    #[test]
    fn a_replicated_file_stream_is_durable_whatever_its_sync_interval() {
        assert!(stream(3, false, every_2m()).warnings.is_empty());
        assert!(stream(3, false, SyncPolicy::Always).warnings.is_empty());
    }

    #[test]
    fn one_replica_names_replicas_and_the_sync_interval_with_their_fixes() {
        let d = stream(1, false, every_2m());
        assert_eq!(settings(&d), ["replicas", "sync_interval"]);
        assert!(d.warnings[0]
            .message
            .contains("nats stream edit OUTBOX --replicas 3"));
        assert!(d.warnings[1].message.contains("sync_interval: always"));
        // Synced on every write, one replica is still one disk.
        let d = stream(1, false, SyncPolicy::Always);
        assert_eq!(settings(&d), ["replicas"]);
    }

    #[test]
    fn memory_storage_warns_even_with_three_replicas() {
        assert_eq!(settings(&stream(3, true, every_2m())), ["storage"]);
        assert_eq!(
            settings(&stream(1, true, every_2m())),
            ["replicas", "storage"]
        );
    }

    fn topic(rf: usize, min_insync: Option<i64>, unclean: Option<bool>) -> Destination {
        judge_topic(
            &TopicSettings {
                name: "events".into(),
                partitions: 3,
                replication_factor: Some(rf),
                min_insync_replicas: min_insync,
                unclean_leader_election: unclean,
                configs_unread: min_insync.is_none().then(|| "unsupported".into()),
            },
            "k:9092",
        )
    }

    #[test]
    fn a_topic_with_rf_3_min_insync_2_and_clean_election_is_durable() {
        assert!(topic(3, Some(2), Some(false)).warnings.is_empty());
    }

    #[test]
    fn each_unsafe_topic_setting_is_named_with_its_fix() {
        let d = topic(1, Some(1), Some(true));
        assert_eq!(
            settings(&d),
            [
                "replication.factor",
                "min.insync.replicas",
                "unclean.leader.election.enable"
            ]
        );
        assert!(d.warnings[1]
            .message
            .contains("--add-config min.insync.replicas=2"));
        let json = d.to_json();
        assert_eq!(json["settings"]["replication.factor"], 1);
        assert_eq!(json["settings"]["unclean.leader.election.enable"], true);
    }

    #[test]
    fn settings_that_cannot_be_read_are_warnings_not_silence() {
        let d = topic(3, None, None);
        assert_eq!(
            settings(&d),
            ["min.insync.replicas", "unclean.leader.election.enable"]
        );
        assert!(d.warnings[0].message.contains("unsupported"));
        assert!(d.to_json()["settings"]["min.insync.replicas"].is_null());
    }
}
