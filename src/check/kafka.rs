//! `check` against Kafka: the producer's settings, the brokers reachable, every topic the
//! rows go to known, and each topic's durability (replication factor,
//! `min.insync.replicas`, unclean leader election).

use std::collections::{BTreeMap, BTreeSet};

use super::durability::judge_topic;
use super::{Level, Report};
use crate::config::kafka::refused_properties;
use crate::config::{Config, KafkaConfig};
use crate::sink::kafka::{check_topic, topic_settings, KafkaSink};

/// The producer's settings, the brokers reachable, every topic of every table known, and
/// the durability of those that exist.
pub(super) async fn check_kafka(
    kafka: &KafkaConfig,
    config: &Config,
    subjects: &[(String, BTreeSet<String>)],
    out: &mut Report,
) {
    if !check_properties(kafka, out) {
        return;
    }
    // The sink stays open until the durability is read, as the brokers were asked.
    let Some((_sink, topics)) = reach_brokers(kafka, config, out).await else {
        return;
    };
    let existing = find_topics(&topics, subjects, out);
    if existing.is_empty() {
        return;
    }
    check_durability(kafka, config, &topics, existing, out).await;
}

/// Whether `sink.kafka.properties` holds none the relay refuses; each refused one is a
/// failure in `out`.
fn check_properties(kafka: &KafkaConfig, out: &mut Report) -> bool {
    let problems: Vec<String> = refused_properties(&kafka.properties)
        .iter()
        .map(|r| r.short())
        .collect();
    for p in &problems {
        out.push(Level::Fail, "sink.kafka.properties", p.clone());
    }
    problems.is_empty()
}

/// A sink connected to the brokers and the topics they know, with their partition counts;
/// `None` (a failure in `out`) when the brokers cannot be reached.
async fn reach_brokers(
    kafka: &KafkaConfig,
    config: &Config,
    out: &mut Report,
) -> Option<(KafkaSink, BTreeMap<String, usize>)> {
    let target = format!("kafka {}", kafka.brokers);
    let sink = match KafkaSink::connect(kafka, config.sink.publish_timeout) {
        Ok(sink) => sink,
        Err(e) => {
            out.push(Level::Fail, target, e.to_string());
            return None;
        }
    };
    match sink.metadata(None).await {
        Ok(topics) => {
            out.push(
                Level::Ok,
                target,
                format!("reachable ({} topics)", topics.len()),
            );
            Some((sink, topics))
        }
        Err(e) => {
            out.push(
                Level::Fail,
                target,
                format!("{e}: start the brokers or fix sink.kafka.brokers"),
            );
            None
        }
    }
}

/// The tables' topics that exist among `topics`; one that does not is a warning in `out`,
/// an invalid name a failure.
fn find_topics(
    topics: &BTreeMap<String, usize>,
    subjects: &[(String, BTreeSet<String>)],
    out: &mut Report,
) -> BTreeSet<String> {
    let mut existing = BTreeSet::new();
    for (table, set) in subjects {
        if set.is_empty() {
            out.push(
                Level::Ok,
                format!("table {table}"),
                "topics depend on row data and no row is pending; nothing to look up yet \
                 (nor their durability to check)",
            );
        }
        for topic in set {
            if let Err(e) = check_topic(topic) {
                out.push(Level::Fail, format!("topic {topic:?}"), e);
                continue;
            }
            match topics.get(topic) {
                // Its partitions are reported with its durability, below.
                Some(_) => {
                    existing.insert(topic.clone());
                }
                None => out.push(
                    Level::Warn,
                    format!("topic {topic}"),
                    "does not exist; unless the brokers auto-create topics, rows for it wait \
                     (retried, never dead-lettered) until it is created",
                ),
            }
        }
    }
    existing
}

/// Each existing topic's durability; when its settings cannot be read, its partitions and
/// that the durability is unverified.
async fn check_durability(
    kafka: &KafkaConfig,
    config: &Config,
    topics: &BTreeMap<String, usize>,
    existing: BTreeSet<String>,
    out: &mut Report,
) {
    let existing: Vec<String> = existing.into_iter().collect();
    match topic_settings(kafka, config.sink.publish_timeout, &existing).await {
        Ok(settings) => {
            for t in settings {
                let subject = format!("topic {}", t.name);
                out.durability(subject, judge_topic(&t, &kafka.brokers));
            }
        }
        Err(e) => {
            for topic in &existing {
                let partitions = topics.get(topic).copied().unwrap_or_default();
                out.push(
                    Level::Ok,
                    format!("topic {topic}"),
                    format!("partitions {partitions}"),
                );
            }
            out.unverified(
                "kafka topics",
                format!("their durability settings could not be read: {e}"),
            )
        }
    }
}
