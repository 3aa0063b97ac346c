//! `check` reports whether the broker keeps what it acknowledged (issue 54): a JetStream
//! stream's replicas, storage and its server's sync interval, a Kafka topic's replication
//! factor, `min.insync.replicas` and unclean leader election. Each unsafe setting is a
//! warning that names it and its fix (exit 0), a failure with `--strict` (exit 1), and the
//! same findings come as data with `--format json`.

use crate::common::*;
use rdkafka::mocking::MockCluster;
use serde_json::Value;
use testkit::NatsCluster;

/// A second stream on the lone server, in memory, for `mem.>`.
const MEMORY_STREAM: &str = "MEMO";

/// The lone server's `OUTBOX` (file, 1 replica) and a memory stream, each with a pending
/// row, so `check` finds both through the rows' subjects.
async fn single_server_with_a_memory_stream() -> Env {
    let env = Env::new(relay()).await;
    let js = async_nats::jetstream::new(env.nats.client().await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: MEMORY_STREAM.to_owned(),
        subjects: vec!["mem.>".to_owned()],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        duplicate_window: std::time::Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .unwrap();
    env.client()
        .await
        .execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.a', 'k', 'x'), ('mem.a', 'k', 'y')",
            &[],
        )
        .await
        .unwrap();
    env
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn one_replica_and_memory_storage_are_warnings_naming_the_setting_and_exit_0() {
    let env = single_server_with_a_memory_stream().await;
    let out = env.relay(&["check"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "warnings only: {all}");
    let lines = stdout(&out);
    assert!(
        lines.contains("ok   stream OUTBOX: replicas 1, storage file, sync_interval "),
        "{all}"
    );
    assert!(
        lines.contains(
            "WARN stream OUTBOX: stream OUTBOX has 1 replica: a lost server (its disk, its \
             machine) loses acknowledged messages: `nats stream edit OUTBOX --replicas 3`"
        ),
        "{all}"
    );
    // nats-server 2.9 syncs every 2 minutes and cannot be told otherwise: with one replica
    // a power loss loses up to that much.
    assert!(
        lines.contains("WARN stream OUTBOX: the server syncs stream files to disk every 2m")
            || lines.contains("WARN stream OUTBOX: the server's sync_interval cannot be seen"),
        "{all}"
    );
    assert!(lines.contains("sync_interval: always"), "{all}");
    assert!(
        lines.contains("WARN stream MEMO: stream MEMO has memory storage"),
        "{all}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn strict_check_fails_on_a_durability_warning() {
    let env = single_server_with_a_memory_stream().await;
    let out = env.relay(&["check", "--strict"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        stdout(&out).contains("FAIL stream OUTBOX: stream OUTBOX has 1 replica"),
        "{all}"
    );
    assert!(
        stdout(&out).contains("FAIL stream MEMO: stream MEMO has memory storage"),
        "{all}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn json_check_gives_each_stream_its_settings_and_warnings() {
    let env = single_server_with_a_memory_stream().await;
    let out = env.relay(&["check", "--format", "json"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    let doc: Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
    assert_eq!(doc["ok"], true, "{doc:#}");
    assert_eq!(doc["strict"], false, "{doc:#}");
    assert!(
        doc["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["level"] == "ok" && f["subject"] == "config"),
        "{doc:#}"
    );
    let stream = |name: &str| {
        doc["destinations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["kind"] == "nats_stream" && d["name"] == name)
            .unwrap_or_else(|| panic!("no destination {name}: {doc:#}"))
            .clone()
    };
    let warned = |d: &Value| -> Vec<String> {
        d["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["setting"].as_str().unwrap().to_owned())
            .collect()
    };
    let outbox = stream("OUTBOX");
    assert_eq!(outbox["settings"]["replicas"], 1, "{outbox:#}");
    assert_eq!(outbox["settings"]["storage"], "file", "{outbox:#}");
    assert!(
        outbox["settings"].get("sync_interval").is_some(),
        "{outbox:#}"
    );
    assert_eq!(warned(&outbox), ["replicas", "sync_interval"], "{outbox:#}");
    let memory = stream(MEMORY_STREAM);
    assert_eq!(memory["settings"]["storage"], "memory", "{memory:#}");
    assert!(
        warned(&memory).contains(&"storage".to_owned()),
        "{memory:#}"
    );

    let strict = env.relay(&["check", "--format", "json", "--strict"]);
    assert_eq!(strict.status.code(), Some(1), "{}", text(&strict));
    let doc: Value = serde_json::from_slice(&strict.stdout).expect("one JSON document");
    assert_eq!(doc["ok"], false, "{doc:#}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_three_replica_file_stream_on_a_cluster_passes_strict_check_without_a_warning() {
    let cluster = NatsCluster::start(3).expect("start a NATS cluster of three");
    cluster
        .create_stream(STREAM, &["events.>"], 3)
        .await
        .expect("create a stream with three replicas");
    // Env also starts a lone nats-server; `check` is pointed past it, at the cluster.
    let env = Env::new(relay()).await;
    env.client()
        .await
        .execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.a', 'k', 'x')",
            &[],
        )
        .await
        .unwrap();
    let out = env
        .command(&["check", "--strict"])
        .env("OUTBOX_RELAY__SINK__NATS__URL", cluster.urls().join(","))
        .output()
        .expect("run outbox-relay check");
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(
        stdout(&out).contains("ok   stream OUTBOX: replicas 3, storage file"),
        "{all}"
    );
    assert!(!stdout(&out).contains("WARN"), "{all}");
}

/// A migrated outbox aimed at a mock cluster of three brokers, with a pending row for
/// each topic.
async fn mock_outbox(
    mock: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    topics: &[&str],
) -> Mocked {
    let m = kafka_outbox(&mock.bootstrap_servers(), relay()).await;
    for topic in topics {
        m.client
            .execute(
                "INSERT INTO public.outbox (topic, key, payload) VALUES ($1, 'k', 'x')",
                &[topic],
            )
            .await
            .unwrap();
    }
    m
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kafka_topic_with_replication_factor_1_is_a_warning_naming_it() {
    let mock = MockCluster::new(3).unwrap();
    mock.create_topic("single", 2, 1).unwrap();
    mock.create_topic("triple", 2, 3).unwrap();
    let m = mock_outbox(&mock, &["single", "triple"]).await;
    let report = outbox_relay::check::check(&m.config, false).await;
    let lines: Vec<String> = report.findings.iter().map(|f| f.to_string()).collect();
    let all = lines.join("\n");
    assert!(!report.failed(), "{all}");
    assert!(
        all.contains("WARN topic single: topic single has replication factor 1: a lost broker loses acknowledged records"),
        "{all}"
    );
    assert!(
        !all.contains("topic triple has replication factor"),
        "three replicas are enough: {all}"
    );
    // The mock cluster does not answer DescribeConfigs: the two configs are unknown, and
    // said to be, not taken as safe.
    assert!(
        all.contains("WARN topic triple: min.insync.replicas of topic triple could not be read"),
        "{all}"
    );

    let doc = report.to_json();
    let topic = |name: &str| {
        doc["destinations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["kind"] == "kafka_topic" && d["name"] == name)
            .unwrap_or_else(|| panic!("no topic {name}: {doc:#}"))
            .clone()
    };
    let single = topic("single");
    assert_eq!(single["settings"]["partitions"], 2, "{single:#}");
    assert_eq!(single["settings"]["replication.factor"], 1, "{single:#}");
    for setting in ["min.insync.replicas", "unclean.leader.election.enable"] {
        assert!(single["settings"][setting].is_null(), "{single:#}");
    }
    assert_eq!(topic("triple")["settings"]["replication.factor"], 3);
    assert_eq!(
        single["warnings"][0]["setting"], "replication.factor",
        "{single:#}"
    );

    let strict = outbox_relay::check::check(&m.config, true).await;
    assert!(strict.failed(), "--strict makes the warnings failures");
}

#[tokio::test(flavor = "multi_thread")]
async fn tansu_reports_min_insync_replicas_and_unclean_election_and_each_unsafe_one_warns() {
    let broker = testkit::KafkaBroker::start().expect("start tansu");
    broker
        .create_topic_with_config(
            "loose",
            1,
            &[
                ("min.insync.replicas", "1"),
                ("unclean.leader.election.enable", "true"),
            ],
        )
        .unwrap();
    broker
        .create_topic_with_config(
            "careful",
            1,
            &[
                ("min.insync.replicas", "2"),
                ("unclean.leader.election.enable", "false"),
            ],
        )
        .unwrap();
    let m = kafka_outbox(&broker.bootstrap(), relay()).await;
    m.client
        .execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('loose', 'k', 'x'), ('careful', 'k', 'y')",
            &[],
        )
        .await
        .unwrap();
    let report = outbox_relay::check::check(&m.config, false).await;
    let all: String = report.findings.iter().map(|f| format!("{f}\n")).collect();
    assert!(!report.failed(), "{all}");
    assert!(
        all.contains("ok   topic loose: partitions 1, replication.factor 1, min.insync.replicas 1, unclean.leader.election.enable true"),
        "{all}"
    );
    assert!(
        all.contains("WARN topic loose: topic loose has min.insync.replicas 1: ")
            && all.contains("--alter --add-config min.insync.replicas=2"),
        "{all}"
    );
    assert!(
        all.contains("WARN topic loose: topic loose allows unclean leader election: ")
            && all.contains("--add-config unclean.leader.election.enable=false"),
        "{all}"
    );
    // One broker: replication factor 1 is the one warning a careful topic still gets.
    let careful: Vec<&str> = all
        .lines()
        .filter(|l| l.starts_with("WARN topic careful"))
        .collect();
    assert_eq!(careful.len(), 1, "{all}");
    assert!(careful[0].contains("replication factor 1"), "{all}");

    let doc = report.to_json();
    let loose = doc["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "loose")
        .unwrap_or_else(|| panic!("{doc:#}"))
        .clone();
    assert_eq!(loose["settings"]["min.insync.replicas"], 1, "{loose:#}");
    assert_eq!(
        loose["settings"]["unclean.leader.election.enable"], true,
        "{loose:#}"
    );
    let warned: Vec<&str> = loose["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["setting"].as_str().unwrap())
        .collect();
    assert_eq!(
        warned,
        [
            "replication.factor",
            "min.insync.replicas",
            "unclean.leader.election.enable"
        ],
        "{loose:#}"
    );
}
