//! A throwaway Kafka-protocol broker ([`KafkaBroker`]): `tansu broker` with in-memory
//! storage on a free 127.0.0.1 port, its log in a scratch directory; and a reader that
//! takes every record of some topics back ([`kafka_read_all`], [`KafkaRecord`]).
//!
//! Torn down by `Drop`: the broker is killed (SIGKILL, nothing on disk to keep) and its
//! directory removed; it also gets SIGKILL if the thread that started it dies without
//! unwinding.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::process::{die_with_parent, free_port, scratch_dir, wait_for_port};

/// A record as a Kafka consumer read it.
#[derive(Debug, Clone)]
pub struct KafkaRecord {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub headers: Vec<(String, String)>,
    /// `None`: a null value (a tombstone).
    pub payload: Option<Vec<u8>>,
    /// The record's timestamp in milliseconds, with its type (`CreateTime` is the
    /// producer's, `LogAppendTime` the broker's).
    pub timestamp: rdkafka::Timestamp,
}

impl KafkaRecord {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads every record of `topics` from the beginning by assigning all their partitions
/// (no consumer group: some Kafka-protocol brokers' groups are unreliable). Stops when
/// nothing new arrived for `idle`. Blocking.
pub fn kafka_read_all(
    bootstrap: &str,
    topics: &[&str],
    idle: Duration,
) -> Result<Vec<KafkaRecord>> {
    use rdkafka::message::{Headers, Message};
    let mut out = Vec::new();
    kafka_visit_all(bootstrap, topics, idle, |m| {
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(KafkaRecord {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            headers,
            payload: m.payload().map(<[u8]>::to_vec),
            timestamp: m.timestamp(),
        });
    })?;
    Ok(out)
}

/// How many records `topics` hold, read as [`kafka_read_all`] reads them but kept in no
/// memory (the benchmark counts millions). Blocking.
pub fn kafka_count_all(bootstrap: &str, topics: &[&str], idle: Duration) -> Result<usize> {
    let mut n = 0;
    kafka_visit_all(bootstrap, topics, idle, |_| n += 1)?;
    Ok(n)
}

/// The longest any read of every record may take, however steadily records arrive.
const READ_ALL_LIMIT: Duration = Duration::from_secs(600);

fn kafka_visit_all(
    bootstrap: &str,
    topics: &[&str],
    idle: Duration,
    mut visit: impl FnMut(&rdkafka::message::BorrowedMessage<'_>),
) -> Result<()> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "outbox-relay-test-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .context("create the Kafka reader")?;
    let mut assignment = TopicPartitionList::new();
    for topic in topics {
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .with_context(|| format!("metadata for {topic}"))?;
        for t in metadata.topics() {
            for p in t.partitions() {
                assignment.add_partition_offset(t.name(), p.id(), Offset::Beginning)?;
            }
        }
    }
    consumer.assign(&assignment)?;
    let (started, mut last) = (Instant::now(), Instant::now());
    while last.elapsed() < idle {
        if started.elapsed() > READ_ALL_LIMIT {
            bail!("reading Kafka: records still arriving after {READ_ALL_LIMIT:?}");
        }
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            Some(Err(e)) => bail!("reading Kafka: {e}"),
            Some(Ok(m)) => {
                last = Instant::now();
                visit(&m);
            }
        }
    }
    Ok(())
}

/// A throwaway Kafka-protocol broker: `tansu broker` with in-memory storage.
pub struct KafkaBroker {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

/// The tansu binary: `$TANSU`, else `tansu` on `$PATH`, else `~/.cargo/bin/tansu`.
fn tansu_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("TANSU") {
        return PathBuf::from(path);
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("tansu").exists()))
        .unwrap_or(false);
    if on_path {
        return PathBuf::from("tansu");
    }
    std::env::var_os("HOME")
        .map(|h| Path::new(&h).join(".cargo/bin/tansu"))
        .unwrap_or_else(|| PathBuf::from("tansu"))
}

impl KafkaBroker {
    pub fn start() -> Result<KafkaBroker> {
        let dir = scratch_dir("tansu")?;
        let port = free_port();
        let log = dir.join("tansu.log");
        let log_file = std::fs::File::create(&log)?;
        let url = format!("tcp://127.0.0.1:{port}");
        let mut cmd = Command::new(tansu_bin());
        cmd.args([
            "broker",
            "--storage-engine",
            "memory://tansu/",
            "--listener-url",
        ])
        .arg(&url)
        .arg("--advertised-listener-url")
        .arg(&url)
        .env_remove("CLUSTER_ID")
        .env_remove("STORAGE_ENGINE")
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().with_context(|| {
            format!(
                "start {} (install it: cargo install tansu --locked --features dynostore)",
                tansu_bin().display()
            )
        })?;
        wait_for_port(port, &mut child, "tansu", &log)?;
        Ok(KafkaBroker {
            dir,
            port,
            child: Some(child),
        })
    }

    /// `host:port` for `bootstrap.servers`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates a topic (tansu does not auto-create them).
    pub fn create_topic(&self, name: &str, partitions: u32) -> Result<()> {
        self.create_topic_with_config(name, partitions, &[])
    }

    /// Creates a topic with topic configs (`min.insync.replicas`, ...), which tansu then
    /// reports in DescribeConfigs.
    pub fn create_topic_with_config(
        &self,
        name: &str,
        partitions: u32,
        config: &[(&str, &str)],
    ) -> Result<()> {
        let mut cmd = Command::new(tansu_bin());
        cmd.args([
            "topic",
            "create",
            name,
            "--partitions",
            &partitions.to_string(),
        ]);
        for (key, value) in config {
            cmd.arg("--config").arg(format!("{key}={value}"));
        }
        let out = cmd
            .arg("--broker")
            .arg(format!("tcp://127.0.0.1:{}", self.port))
            .output()
            .context("run tansu topic create")?;
        if !out.status.success() {
            bail!(
                "tansu topic create {name} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for KafkaBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
