//! The Kafka sink end to end: the built binary against a throwaway PostgreSQL and a real
//! Kafka-protocol broker process (tansu), read back by an independent consumer that
//! assigns itself every partition.

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use crate::common::*;
use testkit::{KafkaBroker, Postgres};

const TOPICS: [&str; 3] = ["events.0", "events.1", "events.2"];
const PARTITIONS: u32 = 3;

struct KafkaEnv {
    pg: Postgres,
    broker: KafkaBroker,
    config: std::path::PathBuf,
    _dir: TempDir,
}

impl KafkaEnv {
    async fn new(relay: Relay) -> KafkaEnv {
        let pg = Postgres::start().unwrap();
        let broker = KafkaBroker::start().unwrap();
        for topic in TOPICS {
            broker.create_topic(topic, PARTITIONS).unwrap();
        }
        let url = pg.create_database("app").await.unwrap();
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-kafka-{}-{}",
            std::process::id(),
            testkit::free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("relay.toml");
        std::fs::write(
            &config,
            format!(
                r#"
[postgres]
url = "{relay_url}"
[relay]
{relay}
[sink]
kind = "kafka"
publish_timeout = "10s"
[sink.kafka]
brokers = "{}"
[sink.kafka.properties]
"linger.ms" = 5
[[tables]]
name = "public.outbox"
"#,
                broker.bootstrap(),
                relay_url = as_relay_role(&url),
                relay = relay.relay_section(),
            ),
        )
        .unwrap();
        let env = KafkaEnv {
            pg,
            broker,
            config,
            _dir: TempDir(dir),
        };
        // migrate as the owner; everything else as the least-privilege role.
        let out = Command::new(BIN)
            .args(["migrate", "--config"])
            .arg(&env.config)
            .env("OUTBOX_RELAY__POSTGRES__URL", &url)
            .output_within(RUN_LIMIT)
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        grant_relay_role(&env.pg.connect("app").await.unwrap(), "public.outbox").await;
        env
    }

    /// The binary with this env's config, dying with the test process.
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .arg("--config")
            .arg(&self.config)
            .env_remove("RUST_LOG");
        testkit::die_with_parent(&mut cmd);
        cmd
    }

    fn relay(&self, args: &[&str]) -> std::process::Output {
        self.command(args).output_within(RUN_LIMIT).unwrap()
    }

    /// Starts `outbox-relay run` in the background, output discarded.
    fn spawn_run(&self) -> std::process::Child {
        self.command(&["run"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start outbox-relay run")
    }

    fn read(&self) -> Vec<testkit::KafkaRecord> {
        testkit::kafka_read_all(&self.broker.bootstrap(), &TOPICS, Duration::from_secs(3)).unwrap()
    }
}

/// Kafka's Java client partitioner hash (`Utils.murmur2`), written from its definition,
/// independent of librdkafka.
fn java_murmur2(data: &[u8]) -> i32 {
    const M: i32 = 0x5bd1_e995;
    let mut h: i32 = 0x9747_b28c_u32 as i32 ^ data.len() as i32;
    let chunks = data.len() / 4;
    for i in 0..chunks {
        let b = &data[i * 4..i * 4 + 4];
        let mut k = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        k = k.wrapping_mul(M);
        k ^= ((k as u32) >> 24) as i32;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = &data[chunks * 4..];
    if tail.len() >= 3 {
        h ^= (tail[2] as i32) << 16;
    }
    if tail.len() >= 2 {
        h ^= (tail[1] as i32) << 8;
    }
    if !tail.is_empty() {
        h ^= tail[0] as i32;
        h = h.wrapping_mul(M);
    }
    h ^= ((h as u32) >> 13) as i32;
    h = h.wrapping_mul(M);
    h ^= ((h as u32) >> 15) as i32;
    h
}

#[test]
fn java_murmur2_matches_known_values() {
    // Values from Kafka's own UtilsTest.testMurmur2.
    assert_eq!(java_murmur2(b"21"), -973932308);
    assert_eq!(java_murmur2(b"foobar"), -790332482);
    assert_eq!(java_murmur2(b"a-little-bit-long-string"), -985981536);
    assert_eq!(java_murmur2(b"a-little-bit-longer-string"), -1486304829);
    assert_eq!(
        java_murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8"),
        -58897971
    );
    assert_eq!(java_murmur2(b"abc"), 479470107);
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_every_row_arrives_once_keyed_with_outbox_id_and_headers_in_key_order() {
    let env = KafkaEnv::new(relay().workers(4).batch_size(500)).await;
    let client = env.pg.connect("app").await.unwrap();
    seed(&client, 20_000, 200, 50).await;
    let ids: HashSet<i64> = ids(&client).await.into_iter().collect();

    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("drained: 20000 rows published"),
        "{}",
        text(&out)
    );

    let records = env.read();
    let delivery = analyse_kafka(&records);
    let expected: HashSet<String> = ids.iter().map(|id| format!("public.outbox:{id}")).collect();
    assert_eq!(
        delivery.counts.keys().cloned().collect::<HashSet<_>>(),
        expected,
        "every row, by outbox-id"
    );
    assert_eq!(records.len(), 20_000, "each once");
    assert!(
        delivery.order_violations().is_empty(),
        "{:?}",
        delivery.order_violations()
    );
    for r in &records {
        // The Kafka key is the key column (the seed also copies it into a header).
        assert_eq!(r.key.as_deref(), r.header("key"));
        let n = r.header("n").expect("headers from the column");
        assert_eq!(r.payload.as_deref(), Some(n.as_bytes()));
        if let Some(key) = &r.key {
            let expected = (java_murmur2(key.as_bytes()) & 0x7fff_ffff) % PARTITIONS as i32;
            assert_eq!(
                r.partition, expected,
                "key {key} on the partition a Java producer picks"
            );
        }
    }
    let left: i64 = client
        .query_one("SELECT count(*) FROM public.outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_kill_9_mid_stream_loses_nothing_and_keeps_key_order() {
    const KILLS: usize = 3;
    const WORKERS: usize = 4;
    const BATCH: usize = 200;
    let env = KafkaEnv::new(relay().workers(WORKERS).batch_size(BATCH)).await;
    let client = env.pg.connect("app").await.unwrap();
    seed(&client, 30_000, 100, 20).await;
    let inserted = ids(&client).await;
    let left = async || count(&client, "SELECT count(*) FROM public.outbox").await;

    for kill in 1..=KILLS {
        let before = left().await;
        let mut relay = env.spawn_run();
        wait_until(
            "the relay to publish before the kill",
            Duration::from_secs(30),
            async || left().await < before,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..200))).await;
        relay.kill().unwrap(); // SIGKILL: no flush, no rollback from the client side
        relay.wait().unwrap();
        let now = left().await;
        assert!(
            0 < now && now < before,
            "kill {kill} must land mid-stream: {now} rows left of {before}"
        );
    }
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(left().await, 0);

    // A new process is a new idempotent producer: what a killed one had in flight may be
    // stored again (Kafka cannot tell), at most the batches in flight at each kill.
    let records = env.read();
    let delivery = analyse_kafka(&records);
    let expected: HashSet<String> = inserted
        .iter()
        .map(|id| format!("public.outbox:{id}"))
        .collect();
    assert_eq!(
        delivery.counts.keys().cloned().collect::<HashSet<_>>(),
        expected,
        "every row, nothing else"
    );
    let resent = records.len() - delivery.counts.len();
    eprintln!("{resent} records stored again over {KILLS} kills");
    assert!(
        resent <= KILLS * WORKERS * BATCH,
        "{resent} re-sends: more than the batches in flight at {KILLS} kills"
    );
    assert!(
        delivery.order_violations().is_empty(),
        "{:?}",
        delivery.order_violations()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_check_reads_metadata_and_refuses_unsafe_properties() {
    let env = KafkaEnv::new(relay()).await;
    let client = env.pg.connect("app").await.unwrap();
    client
        .execute("INSERT INTO public.outbox (topic, key, payload) VALUES ('events.0', 'a', 'x'), ('missing.topic', 'a', 'y')", &[])
        .await
        .unwrap();
    let out = env.relay(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        stdout.contains("ok   topic events.0: partitions 3, replication.factor "),
        "{stdout}"
    );
    assert!(
        stdout.contains("WARN topic missing.topic: does not exist"),
        "{stdout}"
    );

    let unsafe_config = std::fs::read_to_string(&env.config).unwrap().replace(
        "\"linger.ms\" = 5\n",
        "\"linger.ms\" = 5\n\"enable.idempotence\" = false\n\"acks\" = \"1\"\n\"sasl.password\" = \"hunter2-secret\"\n",
    );
    std::fs::write(&env.config, unsafe_config).unwrap();
    let out = env.relay(&["check"]);
    let all = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a config error, found offline: {all}"
    );
    assert!(
        all.contains("sink.kafka.properties.enable.idempotence: is \"false\""),
        "{all}"
    );
    assert!(
        all.contains("sink.kafka.properties.acks: is \"1\""),
        "{all}"
    );
    assert!(!all.contains("hunter2-secret"), "{all}");
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "run refuses them too: {}",
        text(&out)
    );
    assert!(!text(&out).contains("hunter2-secret"));
}

/// The Debezium-style table of `config/debezium.toml`'s comment, driven by that file as it
/// is: only the database URL and the brokers come from the environment.
#[tokio::test(flavor = "multi_thread")]
async fn debezium_style_table_relays_with_the_example_config_as_is() {
    let pg = Postgres::start().unwrap();
    let broker = KafkaBroker::start().unwrap();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        broker.create_topic(topic, PARTITIONS).unwrap();
    }
    let url = pg.create_database("app").await.unwrap();
    let client = pg.connect("app").await.unwrap();
    client
        .batch_execute(
            "CREATE TABLE public.outboxevent (
                 id            uuid PRIMARY KEY,
                 aggregatetype varchar(255) NOT NULL,
                 aggregateid   varchar(255) NOT NULL,
                 type          varchar(255) NOT NULL,
                 payload       jsonb,
                 seq           bigint GENERATED ALWAYS AS IDENTITY
             );
             INSERT INTO public.outboxevent (id, aggregatetype, aggregateid, type, payload)
             SELECT gen_random_uuid(),
                    CASE WHEN n % 2 = 0 THEN 'order' ELSE 'customer' END,
                    'agg-' || (n % 30),
                    CASE WHEN n % 3 = 0 THEN 'Created' ELSE 'Updated' END,
                    jsonb_build_object('n', n)
             FROM generate_series(1, 3000) n ORDER BY n;",
        )
        .await
        .unwrap();
    // id -> (seq, aggregatetype, aggregateid, type), kept before the relay deletes rows.
    let rows: std::collections::HashMap<String, (i64, String, String, String)> = client
        .query(
            "SELECT id::text, seq, aggregatetype, aggregateid, type FROM public.outboxevent",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .collect();

    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/debezium.toml");
    // migrate as the owner, then the least-privilege role for everything else.
    let relay_url = as_relay_role(&url);
    let relay = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .args(["--config", config])
            .env(
                "OUTBOX_RELAY__POSTGRES__URL",
                if args[0] == "migrate" {
                    &url
                } else {
                    &relay_url
                },
            )
            .env("OUTBOX_RELAY__SINK__KAFKA__BROKERS", broker.bootstrap())
            .output_within(RUN_LIMIT)
            .unwrap()
    };
    let out = relay(&["migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("unique index on seq"),
        "migrate adds the relay's columns and a unique index on seq: {}",
        text(&out)
    );
    let out = relay(&["migrate"]);
    assert!(text(&out).contains("up to date"), "{}", text(&out));
    grant_relay_role(&client, "public.outboxevent").await;
    let out = relay(&["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    let records = testkit::kafka_read_all(
        &broker.bootstrap(),
        &["outbox.event.order", "outbox.event.customer"],
        Duration::from_secs(3),
    )
    .unwrap();
    assert_eq!(records.len(), 3_000, "every row once");
    // No creation-time column: the records carry the producer's clock.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for r in &records {
        let rdkafka::Timestamp::CreateTime(ms) = r.timestamp else {
            panic!("not a CreateTime: {:?}", r.timestamp);
        };
        assert!(
            (now_ms - ms).abs() < 120_000,
            "{ms} is not the producer's clock"
        );
    }
    let mut seen = HashSet::new();
    // (topic, partition, key) -> seq in offset order
    let mut by_key: std::collections::BTreeMap<(String, i32, String), Vec<(i64, i64)>> =
        Default::default();
    for r in &records {
        let id = r.header("id").expect("Debezium's id header");
        let (seq, aggregatetype, aggregateid, event_type) = &rows[id];
        assert!(seen.insert(id.to_owned()), "{id} twice");
        assert_eq!(
            r.header("outbox-id"),
            Some(format!("public.outboxevent:{id}").as_str())
        );
        assert_eq!(r.topic, format!("outbox.event.{aggregatetype}"));
        assert_eq!(r.key.as_deref(), Some(aggregateid.as_str()));
        assert_eq!(r.header("eventType"), Some(event_type.as_str()));
        let payload: serde_json::Value =
            serde_json::from_slice(r.payload.as_deref().unwrap()).unwrap();
        assert!(payload["n"].is_i64(), "payload is the jsonb column");
        by_key
            .entry((r.topic.clone(), r.partition, aggregateid.clone()))
            .or_default()
            .push((r.offset, *seq));
    }
    assert_eq!(by_key.len(), 30, "each aggregate in one partition");
    for (key, mut seqs) in by_key {
        seqs.sort();
        assert!(
            seqs.windows(2).all(|w| w[0].1 < w[1].1),
            "{key:?} not in seq order"
        );
    }
    let left: i64 = client
        .query_one("SELECT count(*) FROM public.outboxevent", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

/// A topic the broker does not know (tansu creates none on its own) is the row's fault:
/// it is retried on its schedule and dead-lettered, its key waits, and every other key
/// flows without the circuit ever opening.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_a_topic_the_brokers_do_not_know_is_the_rows_fault_and_other_keys_flow() {
    let env = KafkaEnv::new(relay().retry_backoff("10ms").max_attempts(3)).await;
    let client = env.pg.connect("app").await.unwrap();
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES
               ('no.such.topic', 'bad', 'b1'),
               ('no.such.topic', 'bad', 'b2')",
        )
        .await
        .unwrap();
    seed(&client, 2_000, 20, 0).await;

    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("circuit open"), "{stderr}");
    let delivery = analyse_kafka(&env.read());
    assert_eq!(delivery.counts.len(), 2_000, "every other row arrived");
    let left = rows_left(&client).await;
    assert_eq!(left.len(), 2, "{left:?}");
    assert_eq!((left[0].0, left[0].1, left[0].2), (1, 3, true), "{left:?}");
    assert!(
        left[0]
            .3
            .as_deref()
            .unwrap()
            .contains("topic \"no.such.topic\" does not exist on the brokers"),
        "{left:?}"
    );
    assert_eq!(left[1], (2, 0, false, None), "its key waits behind it");
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_a_null_payload_is_a_tombstone_and_a_null_key_with_it_is_a_bad_row() {
    let env = KafkaEnv::new(relay().max_attempts(1).retry_backoff("10ms")).await;
    let client = env.pg.connect("app").await.unwrap();
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES
               ('events.0', 'a', 'x'), ('events.0', 'a', NULL), ('events.0', 'b', ''),
               ('events.1', NULL, NULL)",
        )
        .await
        .unwrap();
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    let records = env.read();
    let values: Vec<(Option<&str>, Option<&[u8]>)> = records
        .iter()
        .map(|r| (r.key.as_deref(), r.payload.as_deref()))
        .collect();
    assert_eq!(records.len(), 3, "{values:?}");
    let a: Vec<Option<&[u8]>> = values
        .iter()
        .filter(|(k, _)| *k == Some("a"))
        .map(|(_, v)| *v)
        .collect();
    assert_eq!(
        a,
        [Some(&b"x"[..]), None],
        "the NULL payload is a null value"
    );
    assert!(
        values.contains(&(Some("b"), Some(&b""[..]))),
        "an empty payload stays an empty value, not a tombstone: {values:?}"
    );
    // A tombstone without a key deletes nothing: refused before sending, dead-lettered.
    let dead = client
        .query_one(
            "SELECT last_error FROM public.outbox WHERE dead_at IS NOT NULL AND key IS NULL",
            &[],
        )
        .await
        .unwrap();
    let error: String = dead.get(0);
    assert!(error.contains("tombstone"), "{error}");
}

/// Contract section 2 (Kafka record time): records carry the row's `created_at` as their
/// timestamp (CreateTime) to the millisecond, as Debezium's outbox router sets it.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_records_carry_the_rows_created_at_as_their_timestamp() {
    let env = KafkaEnv::new(relay()).await;
    let client = env.pg.connect("app").await.unwrap();
    // Creation times from the past, with sub-millisecond parts (cut, as Java's
    // toEpochMilli does), none equal to now.
    let rows = client
        .query(
            "INSERT INTO public.outbox (topic, key, payload, created_at) \
             SELECT 'events.' || (n % 3), 'k' || (n % 7), 'p', \
                    timestamptz '2026-01-02 03:04:05.678901+00' + n * interval '1.0013 s' \
             FROM generate_series(1, 200) n \
             RETURNING id, floor(extract(epoch FROM created_at) * 1000)::int8",
            &[],
        )
        .await
        .unwrap();
    let created: std::collections::HashMap<String, i64> = rows
        .iter()
        .map(|r| (format!("public.outbox:{}", r.get::<_, i64>(0)), r.get(1)))
        .collect();
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let records = env.read();
    assert_eq!(records.len(), 200, "every row once");
    for r in &records {
        let id = r.header("outbox-id").unwrap();
        assert_eq!(
            r.timestamp,
            rdkafka::Timestamp::CreateTime(created[id]),
            "{id}: the record's time is its row's created_at"
        );
    }
}

/// Contract section 4 (`dead_letter_topic`) against a real Kafka API: the dead-lettered
/// row is also written to the dead-letter topic once, keyed, with its payload, `outbox-id`
/// and the error, attempts and original topic in headers; it stays dead in the table.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_a_dead_lettered_row_is_written_once_to_the_dead_letter_topic() {
    let env = KafkaEnv::new(relay().retry_backoff("10ms").max_attempts(2)).await;
    let mut config = std::fs::read_to_string(&env.config).unwrap();
    config.push_str("dead_letter_topic = \"events.2\"\n");
    std::fs::write(&env.config, config).unwrap();
    let client = env.pg.connect("app").await.unwrap();
    let id: i64 = client
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload) VALUES \
             ('no.such.topic', 'bad', 'b1') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.0', 'good', 'g1')",
        )
        .await
        .unwrap();
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let records = env.read();
    let dead: Vec<_> = records.iter().filter(|r| r.topic == "events.2").collect();
    assert_eq!(dead.len(), 1, "{records:?}");
    let r = dead[0];
    assert_eq!(r.key.as_deref(), Some("bad"));
    assert_eq!(r.payload.as_deref(), Some(&b"b1"[..]));
    assert_eq!(
        r.header("outbox-id"),
        Some(format!("public.outbox:{id}").as_str())
    );
    assert_eq!(r.header("outbox-attempts"), Some("2"));
    assert_eq!(r.header("outbox-topic"), Some("no.such.topic"));
    assert!(
        r.header("outbox-error")
            .is_some_and(|e| e.contains("does not exist on the brokers")),
        "{r:?}"
    );
    assert!(records.iter().any(|r| r.key.as_deref() == Some("good")));
    let left = rows_left(&client).await;
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].2, "it stays dead in the table: {left:?}");
}
