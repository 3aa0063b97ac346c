//! A throwaway PostgreSQL and tansu for the Kafka tests, and a record as a [`Wire`].

use std::time::Duration;

use super::sdk::Wire;
use crate::common::*;
use testkit::{KafkaBroker, Postgres};

/// A throwaway PostgreSQL and tansu, topics `events.*` created, config written.
pub(super) struct KafkaEnv {
    pg: Postgres,
    broker: KafkaBroker,
    config: std::path::PathBuf,
    url: String,
    _dir: TempDir,
}

pub(super) const KAFKA_TOPICS: [&str; 3] = ["events.binary", "events.structured", "events.dead"];

impl KafkaEnv {
    pub(super) async fn new() -> KafkaEnv {
        let pg = Postgres::start().unwrap();
        let broker = KafkaBroker::start().unwrap();
        for topic in KAFKA_TOPICS {
            broker.create_topic(topic, 1).unwrap();
        }
        let url = pg.create_database("app").await.unwrap();
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-ce-{}-{}",
            std::process::id(),
            testkit::free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let env = KafkaEnv {
            config: dir.join("relay.toml"),
            _dir: TempDir(dir),
            pg,
            broker,
            url,
        };
        env.write_config("", "");
        env.migrate();
        grant_relay_role(&env.client().await, "public.outbox").await;
        env
    }

    /// `migrate` as the table's owner, for the config written last (mark mode needs the
    /// pending index).
    pub(super) fn migrate(&self) {
        let out = self
            .command(&["migrate"])
            .env("OUTBOX_RELAY__POSTGRES__URL", &self.url)
            .output_within(RUN_LIMIT)
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
    }

    /// The config with `relay` lines added to `[relay]`, `table` lines to `[[tables]]`.
    pub(super) fn write_config(&self, relay: &str, table: &str) {
        let toml = format!(
            "[postgres]\nurl = \"{}\"\n[relay]\npoll_interval = \"50ms\"\nmax_attempts = 1\n{relay}\n\
             [sink]\nkind = \"kafka\"\npublish_timeout = \"10s\"\n\
             [sink.kafka]\nbrokers = \"{}\"\n[sink.kafka.properties]\n\"linger.ms\" = 5\n\
             [[tables]]\nname = \"public.outbox\"\n{table}\n",
            as_relay_role(&self.url),
            self.broker.bootstrap()
        );
        std::fs::write(&self.config, toml).unwrap();
    }

    pub(super) async fn client(&self) -> tokio_postgres::Client {
        self.pg.connect("app").await.unwrap()
    }

    pub(super) fn command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new(BIN);
        cmd.args(args)
            .arg("--config")
            .arg(&self.config)
            .env_remove("RUST_LOG");
        testkit::die_with_parent(&mut cmd);
        cmd
    }

    pub(super) fn drain(&self) {
        let out = self.command(&["drain"]).output_within(RUN_LIMIT).unwrap();
        assert!(out.status.success(), "drain: {}", text(&out));
    }

    pub(super) fn read(&self) -> Vec<testkit::KafkaRecord> {
        testkit::kafka_read_all(
            &self.broker.bootstrap(),
            &KAFKA_TOPICS,
            Duration::from_secs(3),
        )
        .unwrap()
    }
}

pub(super) fn wire_of(record: &testkit::KafkaRecord) -> Wire {
    Wire {
        headers: record.headers.clone(),
        payload: record.payload.clone(),
    }
}
