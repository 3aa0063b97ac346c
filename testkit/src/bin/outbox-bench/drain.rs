//! A, B, C, C', E and F: the database's and each broker's limit, and `outbox-relay drain`
//! as a child process timed from start to exit, with its peak RSS and CPU time.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use outbox_relay::relay::{self, Mode};
use outbox_relay::shutdown::Shutdown;
use outbox_relay::sink::memory::MemorySink;
use outbox_relay::sink::{Message, Sink};

use crate::cpu::MachineCpu;
use crate::{Bench, SMALL_ROWS, TOPICS};

/// One measured line of the table.
pub(crate) struct Row {
    pub(crate) name: String,
    pub(crate) rows: i64,
    pub(crate) secs: f64,
    /// Which limit this is compared with: "nats", "kafka" or "" (a limit itself).
    pub(crate) broker: &'static str,
    /// The ordering mode, for the database limit it is compared with.
    pub(crate) ordering: &'static str,
    pub(crate) rss_mb: Option<f64>,
    pub(crate) cpu_per_100k: Option<f64>,
    /// Cores the whole machine kept busy during the measurement (all processes).
    pub(crate) cores_busy: f64,
    /// C: messages the broker stored during the drain and rows left in the table after it,
    /// both checked (stored = the rows, left = 0 or the poison rows).
    pub(crate) stored_left: Option<(i64, i64)>,
}

impl Row {
    pub(crate) fn rate(&self) -> f64 {
        self.rows as f64 / self.secs
    }
}

impl Bench {
    /// A: the library's drain with a sink that acknowledges at once.
    pub(crate) async fn postgres_limit(&self, ordering: &'static str) -> Result<Row> {
        self.seed(0).await?;
        let config = self.config("stdout", ordering)?;
        let started = Instant::now();
        let machine = MachineCpu::now();
        let report = relay::run_with_sink(
            &config,
            Mode::Drain,
            Sink::Memory(MemorySink::discarding()),
            Shutdown::new(),
        )
        .await?;
        let secs = started.elapsed().as_secs_f64();
        if report.published != self.a.rows as u64 {
            bail!("A published {} of {} rows", report.published, self.a.rows);
        }
        Ok(Row {
            name: format!(
                "A. PostgreSQL limit, ordering = \"{ordering}\": claim + delete, no broker"
            ),
            rows: self.a.rows,
            secs,
            broker: "",
            ordering,
            rss_mb: None,
            cpu_per_100k: None,
            cores_busy: machine.busy_since(),
            stored_left: None,
        })
    }

    /// B: the same messages through the relay's sink, no database.
    pub(crate) async fn broker_limit(&self, sink_name: &'static str) -> Result<Row> {
        let config = self.config(sink_name, "none")?;
        let payload: Vec<u8> = std::iter::repeat_n(b'x', self.a.payload as usize).collect();
        let payload = bytes::Bytes::from(payload);
        let per_worker = self.a.rows as usize / self.a.workers;
        let stored_before = self.stored_before(sink_name).await?;
        // The same span as A and C: connecting included, to the flush at the end.
        let started = Instant::now();
        let machine = MachineCpu::now();
        let sink = Arc::new(Sink::connect(&config.sink).await?);
        let mut tasks = Vec::new();
        for w in 0..self.a.workers {
            let sink = sink.clone();
            let payload = payload.clone();
            let batch = self.a.batch;
            let keys = self.a.keys as usize;
            tasks.push(tokio::spawn(async move {
                let mut n = w * per_worker;
                let end = n + per_worker;
                while n < end {
                    let messages: Vec<Message> = (n..(n + batch).min(end))
                        .map(|i| Message {
                            id: format!("bench.limit:{i}"),
                            topic: format!("bench.{}", i % TOPICS).into(),
                            key: Some(format!("k{}", i % keys).into()),
                            payload: Some(payload.clone()),
                            headers: Vec::new(),
                            timestamp_ms: None,
                        })
                        .collect();
                    let refs: Vec<&Message> = messages.iter().collect();
                    for r in sink.publish_batch(&refs).await {
                        r.map_err(|e| anyhow::anyhow!("{}", e.message()))?;
                    }
                    n += messages.len();
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        sink.close(Duration::from_secs(5))
            .await
            .map_err(|e| anyhow::anyhow!("closing the sink: {}", e.message()))?;
        let secs = started.elapsed().as_secs_f64();
        let stored = self.stored(sink_name).await? - stored_before;
        if stored != (per_worker * self.a.workers) as i64 {
            bail!("B ({sink_name}): the broker stored {stored} of the messages it acknowledged");
        }
        Ok(Row {
            name: format!("B. {sink_name} limit: publish, acks awaited, no database"),
            rows: (per_worker * self.a.workers) as i64,
            secs,
            broker: "",
            ordering: "",
            rss_mb: None,
            cpu_per_100k: None,
            cores_busy: machine.busy_since(),
            stored_left: None,
        })
    }

    /// C + E: the release binary's drain, with its peak RSS and CPU time.
    pub(crate) async fn drain(&self, sink: &'static str, ordering: &'static str) -> Result<Row> {
        self.drain_with(sink, ordering, 0).await
    }

    /// C with `poison` rows no broker accepts at the head; counts the good rows only.
    pub(crate) async fn drain_with(
        &self,
        sink: &'static str,
        ordering: &'static str,
        poison: i64,
    ) -> Result<Row> {
        self.seed(poison).await?;
        if sink == "nats" {
            self.reset_nats().await?;
        }
        let mut row = self
            .timed_drain_with_config(sink, ordering, self.a.rows, "", poison)
            .await?;
        if poison > 0 {
            let client = self.pg.connect("app").await?;
            let dead: i64 = client
                .query_one(
                    "SELECT count(*) FROM public.outbox WHERE dead_at IS NOT NULL",
                    &[],
                )
                .await?
                .get(0);
            if dead != 1 {
                bail!("poisoned drain left {dead} dead rows; expected 1");
            }
            row.name = format!(
                "C'. drain to {sink}, ordering = \"{ordering}\", {poison} rows no stream captures at the head"
            );
        }
        Ok(row)
    }

    /// E: C (NATS, key order) while another session holds a REPEATABLE READ snapshot, so
    /// VACUUM can remove nothing: a first drain, then a second one behind the first's
    /// deleted rows.
    pub(crate) async fn held_snapshot(&self) -> Result<(Row, Row)> {
        self.seed(0).await?;
        self.reset_nats().await?;
        let holder = self.pg.connect("app").await?;
        holder
            .batch_execute(
                "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_catalog.pg_class",
            )
            .await?;
        let mut first = self.timed_drain("nats", "key").await?;
        first.name = "E1. C (nats, key) with one REPEATABLE READ snapshot held".to_owned();
        self.insert(0).await?;
        let mut second = self.timed_drain("nats", "key").await?;
        second.name = format!(
            "E2. E1 again, behind its {} deleted rows VACUUM cannot remove",
            self.a.rows
        );
        holder.batch_execute("ROLLBACK").await?;
        Ok((first, second))
    }

    /// F: the same drain on a table of 200,000 rows and of `--big-rows`.
    pub(crate) async fn table_size(&self) -> Result<Vec<Row>> {
        let mut rows = Vec::new();
        for n in [SMALL_ROWS, self.a.big_rows] {
            eprintln!("    F. filling the table with {n} rows");
            self.seed_rows(0, n).await?;
            self.reset_nats().await?;
            let mut row = self.timed_drain_of("nats", "key", n).await?;
            row.name = format!("F. C (nats, key) on a table of {n} rows");
            rows.push(row);
        }
        Ok(rows)
    }

    /// T: C (nats, key) on rows that all carry a `traceparent`, trace export off, then on
    /// to an OTLP receiver that decodes and counts; the second row names the spans that
    /// arrived (one send span per row plus one per batch when none is dropped).
    pub(crate) async fn trace_export(&self) -> Result<(Row, Row)> {
        let receiver = testkit::OtlpReceiver::start_counting()?;
        let mut rows = Vec::new();
        for export in [None, Some(receiver.url())] {
            self.seed_traced().await?;
            self.reset_nats().await?;
            let tracing = match &export {
                Some(url) => format!("[tracing]\notlp_endpoint = \"{url}\"\n"),
                None => String::new(),
            };
            rows.push(
                self.timed_drain_with_config("nats", "key", self.a.rows, &tracing, 0)
                    .await?,
            );
        }
        let (mut on, mut off) = (rows.pop().unwrap(), rows.pop().unwrap());
        // The relay exports what is queued before it exits.
        let spans = receiver.span_count();
        off.name = "T0. C (nats, key), every row with a traceparent, trace export off".into();
        on.name = format!(
            "T1. T0 with trace export on: {spans} spans received for {} rows",
            self.a.rows
        );
        Ok((off, on))
    }

    /// V: C (nats, key) without an envelope and with CloudEvents in binary mode, in turn,
    /// `rounds` times each, every drain on a freshly seeded table; the rows in run order.
    pub(crate) async fn envelope_cost(&self, rounds: usize) -> Result<Vec<Row>> {
        const CLOUDEVENTS: &str = "envelope = \"cloudevents\"\n[tables.cloudevents]\n\
             type = \"com.example.{topic}\"\nsource = \"/orders\"\nsubject = \"{key}\"\n";
        let mut rows = Vec::new();
        for round in 1..=rounds {
            for (name, extra) in [
                ("V0. no envelope", ""),
                ("V1. cloudevents, binary", CLOUDEVENTS),
            ] {
                self.seed(0).await?;
                self.reset_nats().await?;
                let mut row = self
                    .timed_drain_with_config("nats", "key", self.a.rows, extra, 0)
                    .await?;
                row.name = format!("{name}, round {round}");
                eprintln!("    {}: {:.0} rows/s", row.name, row.rate());
                rows.push(row);
            }
        }
        Ok(rows)
    }

    /// `outbox-relay drain` as a process, timed from its start to its exit (start-up and
    /// connecting included), on what the table holds now.
    async fn timed_drain(&self, sink: &'static str, ordering: &'static str) -> Result<Row> {
        self.timed_drain_of(sink, ordering, self.a.rows).await
    }

    /// [`Bench::timed_drain`] of a table that holds `rows` rows.
    async fn timed_drain_of(
        &self,
        sink: &'static str,
        ordering: &'static str,
        rows: i64,
    ) -> Result<Row> {
        self.timed_drain_with_config(sink, ordering, rows, "", 0)
            .await
    }

    /// [`Bench::timed_drain_of`] with `extra` appended to the config file; checks that the
    /// broker stored `rows` messages more and that `left` rows stay in the table.
    async fn timed_drain_with_config(
        &self,
        sink: &'static str,
        ordering: &'static str,
        rows: i64,
        extra: &str,
        left: i64,
    ) -> Result<Row> {
        let text = self.config_text(sink, ordering) + extra;
        self.timed_drain_of_config(sink, ordering, rows, &text, left)
            .await
    }

    /// L: the NATS key-ordered drain of `rows` rows with the database at `url`.
    pub(crate) async fn timed_drain_at(&self, url: &str, rows: i64) -> Result<Row> {
        let text = self.config_text("nats", "key").replace(
            &format!("url = \"{}\"", self.db_url),
            &format!("url = \"{url}\""),
        );
        self.timed_drain_of_config("nats", "key", rows, &text, 0)
            .await
    }

    /// Runs `outbox-relay drain` with the config `text`; checks that the broker stored
    /// `rows` messages more and that `left` rows stay in the table.
    async fn timed_drain_of_config(
        &self,
        sink: &'static str,
        ordering: &'static str,
        rows: i64,
        text: &str,
        left: i64,
    ) -> Result<Row> {
        let stored_before = self.stored_before(sink).await?;
        let path = self.dir.join(format!("{sink}-{ordering}.toml"));
        std::fs::write(&path, text)?;
        let started = Instant::now();
        let machine = MachineCpu::now();
        let child = Command::new(&self.a.relay)
            .args(["drain", "--config"])
            .arg(&path)
            .env("RUST_LOG", relay_log())
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("start outbox-relay")?;
        let pid = child.id() as i32;
        let usage = tokio::task::spawn_blocking(move || testkit::wait_with_usage(pid)).await??;
        let secs = started.elapsed().as_secs_f64();
        if usage.code != 0 {
            bail!("drain ({sink}, {ordering}) exited with {}", usage.code);
        }
        let stored = self.stored(sink).await? - stored_before;
        let client = self.pg.connect("app").await?;
        let left_now: i64 = client
            .query_one("SELECT count(*) FROM public.outbox", &[])
            .await?
            .get(0);
        if stored != rows || left_now != left {
            bail!(
                "drain ({sink}, {ordering}): the broker stored {stored} messages for {rows} rows \
                 and {left_now} rows are left (expected {left})"
            );
        }
        Ok(Row {
            name: format!("C. drain to {sink}, ordering = \"{ordering}\""),
            rows,
            secs,
            broker: sink,
            ordering,
            rss_mb: Some(usage.peak_rss_mb),
            cpu_per_100k: Some(usage.cpu_secs / (rows as f64 / 100_000.0)),
            cores_busy: machine.busy_since(),
            stored_left: Some((stored, left_now)),
        })
    }

    /// [`Bench::stored`] before a measurement: for Kafka, the count after the last one.
    async fn stored_before(&self, sink: &str) -> Result<i64> {
        let cached = *self.kafka_records.lock().unwrap();
        match (sink, cached) {
            ("kafka", Some(count)) => Ok(count),
            _ => self.stored(sink).await,
        }
    }

    /// Messages the broker holds for the benchmark: the NATS stream's count, or the Kafka
    /// records read back from every partition (tansu's high watermarks do not count
    /// records: 18,024 after 20,000 acknowledged).
    async fn stored(&self, sink: &str) -> Result<i64> {
        match sink {
            "nats" => Ok(self.nats.stream_state("BENCH").await?.0 as i64),
            "kafka" => {
                let bootstrap = self.kafka.as_ref().context("no Kafka broker")?.bootstrap();
                let topics: Vec<String> = (0..TOPICS).map(|t| format!("bench.{t}")).collect();
                let count = tokio::task::spawn_blocking(move || {
                    let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
                    testkit::kafka_count_all(&bootstrap, &topics, Duration::from_secs(2))
                })
                .await??;
                *self.kafka_records.lock().unwrap() = Some(count as i64);
                Ok(count as i64)
            }
            other => bail!("no stored count for sink {other}"),
        }
    }
}

/// The `RUST_LOG` of the relays a drain runs: `BENCH_RELAY_LOG` (say
/// `outbox_relay::relay::batch=debug` for each batch's claim and publish times), `warn`
/// without it.
pub(crate) fn relay_log() -> String {
    std::env::var("BENCH_RELAY_LOG").unwrap_or_else(|_| "warn".to_owned())
}
