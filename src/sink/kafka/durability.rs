//! What the brokers say of a topic's durability, for `check`: partitions and replication
//! factor from metadata, `min.insync.replicas` and `unclean.leader.election.enable` from
//! DescribeConfigs, through an admin client with the producer's connection settings.
//!
//! A broker that does not answer DescribeConfigs (librdkafka's mock cluster does not)
//! still gives the replication factor; the two configs are then unknown, with the reason.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, OwnedResourceSpecifier, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;

use super::{client_config, scrub, secret_values, SinkError, METADATA_LIMIT};
use crate::config::KafkaConfig;

/// A topic's settings as the brokers reported them; `None`: not reported.
#[derive(Debug, Clone)]
pub(crate) struct TopicSettings {
    pub(crate) name: String,
    pub(crate) partitions: usize,
    /// The fewest replicas any of its partitions has.
    pub(crate) replication_factor: Option<usize>,
    pub(crate) min_insync_replicas: Option<i64>,
    pub(crate) unclean_leader_election: Option<bool>,
    /// Why the configs are unknown, when they are.
    pub(crate) configs_unread: Option<String>,
}

/// The settings of each of `topics` the brokers know (a topic they do not know is left
/// out: `check` reports it as missing already).
pub(crate) async fn topic_settings(
    config: &KafkaConfig,
    publish_timeout: Duration,
    topics: &[String],
) -> Result<Vec<TopicSettings>, SinkError> {
    let secrets = secret_values(config);
    let admin: AdminClient<DefaultClientContext> = client_config(config, publish_timeout)
        .create()
        .map_err(|e| {
            SinkError::fatal(format!(
                "cannot create the Kafka admin client: {}",
                scrub(&e.to_string(), &secrets)
            ))
        })?;
    let admin = Arc::new(admin);
    let mut found = replication(admin.clone(), topics.to_vec(), secrets.clone()).await?;
    let specifiers: Vec<ResourceSpecifier<'_>> = found
        .iter()
        .map(|t| ResourceSpecifier::Topic(&t.name))
        .collect();
    if specifiers.is_empty() {
        return Ok(found);
    }
    let options = AdminOptions::new().request_timeout(Some(METADATA_LIMIT));
    let described = tokio::time::timeout(
        METADATA_LIMIT + Duration::from_secs(1),
        admin.describe_configs(&specifiers, &options),
    )
    .await;
    let results = match described {
        Ok(Ok(results)) => results,
        Ok(Err(e)) => {
            let why = format!(
                "DescribeConfigs failed: {}",
                scrub(&e.to_string(), &secrets)
            );
            found
                .iter_mut()
                .for_each(|t| t.configs_unread = Some(why.clone()));
            return Ok(found);
        }
        Err(_) => {
            let why = "DescribeConfigs got no answer in time".to_owned();
            found
                .iter_mut()
                .for_each(|t| t.configs_unread = Some(why.clone()));
            return Ok(found);
        }
    };
    // One result per resource, in the order asked; an answer also names its topic.
    for (topic, result) in found.iter_mut().zip(results) {
        match result {
            Ok(resource)
                if resource.specifier != OwnedResourceSpecifier::Topic(topic.name.clone()) =>
            {
                topic.configs_unread = Some(format!(
                    "DescribeConfigs answered for {:?}",
                    resource.specifier
                ));
            }
            Ok(resource) => {
                let value = |name: &str| resource.get(name).and_then(|e| e.value.clone());
                topic.min_insync_replicas =
                    value("min.insync.replicas").and_then(|v| v.trim().parse().ok());
                topic.unclean_leader_election =
                    value("unclean.leader.election.enable").and_then(|v| v.trim().parse().ok());
                if topic.min_insync_replicas.is_none() || topic.unclean_leader_election.is_none() {
                    topic.configs_unread =
                        Some("not in the broker's DescribeConfigs answer".into());
                }
            }
            Err(code) => {
                topic.configs_unread = Some(format!("DescribeConfigs answered {code:?}"));
            }
        }
    }
    Ok(found)
}

/// Partitions and the replication factor of each topic the brokers know, from metadata.
async fn replication(
    admin: Arc<AdminClient<DefaultClientContext>>,
    topics: Vec<String>,
    secrets: Vec<String>,
) -> Result<Vec<TopicSettings>, SinkError> {
    tokio::task::spawn_blocking(move || {
        let metadata = admin
            .inner()
            .fetch_metadata(None, METADATA_LIMIT)
            .map_err(|e| {
                SinkError::transient(format!(
                    "Kafka brokers did not answer: {}",
                    scrub(&e.to_string(), &secrets)
                ))
            })?;
        Ok(topics
            .iter()
            .filter_map(|name| {
                let t = metadata
                    .topics()
                    .iter()
                    .find(|t| t.name() == name && t.error().is_none())?;
                Some(TopicSettings {
                    name: name.clone(),
                    partitions: t.partitions().len(),
                    // A broker that lists no replicas says nothing of them.
                    replication_factor: t
                        .partitions()
                        .iter()
                        .map(|p| p.replicas().len())
                        .min()
                        .filter(|&n| n > 0),
                    min_insync_replicas: None,
                    unclean_leader_election: None,
                    configs_unread: None,
                })
            })
            .collect())
    })
    .await
    .map_err(|e| SinkError::transient(format!("metadata task failed: {e}")))?
}
