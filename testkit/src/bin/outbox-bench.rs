//! The benchmark: the relay against this machine's own limits, measured in one run on
//! throwaway PostgreSQL, nats-server and tansu. Run it through `scripts/bench`.
//!
//! - A. PostgreSQL limit: the relay's own claim and delete statements (the library's
//!   `drain` with a sink that acknowledges at once), same workers and batch size.
//! - B. Broker limit: the same messages published through the relay's sink code, no
//!   database, same concurrency and batch size.
//! - C. `outbox-relay drain` end to end (the release binary as a child process): NATS and
//!   Kafka, `ordering = "key"` and `"none"`.
//! - C'. The NATS key-ordered drain again with 3 rows of one key to a subject no stream
//!   captures at the head of the table (`retry_backoff = "10ms"`, `max_attempts = 3` in
//!   both runs): the good rows' rate, as a ratio to the same drain without them. A
//!   row-level refusal must not slow the other keys (goal: >= 0.8).
//! - E. Peak RSS and CPU seconds per 100k rows of each drain (from `wait4`).
//!
//! Prints one markdown table; each drain also as a ratio to min(A, B) for its ordering
//! mode and broker.
//!
//! - D. Steady state: `outbox-relay run` with the default relay settings (NOTIFY trigger
//!   installed), an open-loop writer committing small transactions every 10 ms at 1k, 2k, 5k
//!   and 20k rows/s, and a consumer subscribed to the subjects: commit-to-consumer latency
//!   p50/p99/max per rate; then the time from SIGTERM to exit of the idle relay.
//!
//! - F. The table's size: the NATS key-ordered drain of 200,000 rows, then of
//!   `--big-rows` (5,000,000), each on a freshly filled table: the big drain's rate as a
//!   ratio to the small one's (goal: >= 0.9).
//! - G. A held snapshot in steady state: `outbox-relay run` (default settings), a writer at
//!   2,000 rows/s; commit-to-consumer latency for 60 s, then per minute for `--held-secs`
//!   (600) while another session holds a REPEATABLE READ snapshot, with the table's dead
//!   tuples; each minute's p99 as a ratio to the p99 before (goal: <= 2).
//! - H. Mark mode with `relay.retention = --retention-secs` (60 s): the same writer for five
//!   retentions; the table's rows and size once per retention (bounded: about the writer
//!   rate times the retention), and the latency meanwhile.
//!
//! PostgreSQL is durable (`fsync`, `synchronous_commit`, `full_page_writes` on, as
//! shipped) unless `--fast`; shared_buffers and checkpoints are sized for the data set
//! ([`PG_SETTINGS`]), and the settings used are printed with the results.
//!
//! Usage: outbox-bench PATH-TO-outbox-relay [--rows N] [--keys N] [--payload BYTES]
//!        [--workers N] [--batch N] [--no-kafka] [--steady-secs N (10; 0 skips D)]
//!        [--big-rows N (5000000; 0 skips F)] [--held-secs N (600; 0 skips G)]
//!        [--retention-secs N (60; 0 skips H)] [--fast]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use outbox_relay::config::{self, Config};
use outbox_relay::relay::{self, Mode};
use outbox_relay::shutdown::Shutdown;
use outbox_relay::sink::memory::MemorySink;
use outbox_relay::sink::{Message, Sink};
use testkit::{KafkaBroker, NatsServer, Postgres};

const TOPICS: usize = 8;

/// PostgreSQL settings for the benchmark, beyond the test harness's: memory for the data
/// set (5M rows of 256 bytes are about 2 GB with their indexes) and checkpoints spaced so
/// that a drain is not measured across a forced one every few seconds.
const PG_SETTINGS: &str = "shared_buffers = 2GB\nmax_wal_size = 16GB\n\
                           checkpoint_timeout = 15min\n";

/// The rows F compares the big drain with.
const SMALL_ROWS: i64 = 200_000;
/// The writer's rate in G and H.
const STEADY_RATE: u32 = 2_000;

struct Args {
    relay: String,
    rows: i64,
    keys: i64,
    payload: i64,
    workers: usize,
    batch: usize,
    kafka: bool,
    /// Seconds per writer rate in D; 0 skips D.
    steady_secs: u64,
    /// Rows of F's big drain; 0 skips F.
    big_rows: i64,
    /// Seconds G holds the snapshot; 0 skips G.
    held_secs: u64,
    /// H's retention in seconds; 0 skips H.
    retention_secs: u64,
    /// PostgreSQL with fsync off.
    fast: bool,
}

fn args() -> Result<Args> {
    let usage = "usage: outbox-bench PATH-TO-outbox-relay [--rows N] [--keys N] [--payload BYTES] [--workers N] [--batch N] [--no-kafka] [--steady-secs N] [--big-rows N] [--held-secs N] [--retention-secs N] [--fast]";
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        relay: it.next().context(usage)?,
        rows: 1_000_000,
        keys: 10_000,
        payload: 256,
        workers: 4,
        batch: 500,
        kafka: true,
        steady_secs: 10,
        big_rows: 5_000_000,
        held_secs: 600,
        retention_secs: 60,
        fast: false,
    };
    while let Some(arg) = it.next() {
        let mut value = || -> Result<String> { it.next().context(usage) };
        match arg.as_str() {
            "--rows" => a.rows = value()?.parse()?,
            "--keys" => a.keys = value()?.parse()?,
            "--payload" => a.payload = value()?.parse()?,
            "--workers" => a.workers = value()?.parse()?,
            "--batch" => a.batch = value()?.parse()?,
            "--no-kafka" => a.kafka = false,
            "--steady-secs" => a.steady_secs = value()?.parse()?,
            "--big-rows" => a.big_rows = value()?.parse()?,
            "--held-secs" => a.held_secs = value()?.parse()?,
            "--retention-secs" => a.retention_secs = value()?.parse()?,
            "--fast" => a.fast = true,
            other => bail!("unknown argument {other:?}; {usage}"),
        }
    }
    Ok(a)
}

/// One measured line of the table.
struct Row {
    name: String,
    rows: i64,
    secs: f64,
    /// Which limit this is compared with: "nats", "kafka" or "" (a limit itself).
    broker: &'static str,
    /// The ordering mode, for the database limit it is compared with.
    ordering: &'static str,
    rss_mb: Option<f64>,
    cpu_per_100k: Option<f64>,
    /// Cores the whole machine kept busy during the measurement (all processes).
    cores_busy: f64,
}

impl Row {
    fn rate(&self) -> f64 {
        self.rows as f64 / self.secs
    }
}

struct Bench {
    a: Args,
    pg: Postgres,
    db_url: String,
    nats: NatsServer,
    kafka: Option<KafkaBroker>,
    dir: std::path::PathBuf,
}

impl Bench {
    fn config_text(&self, sink: &str, ordering: &str) -> String {
        let sink = match sink {
            "kafka" => format!(
                "[sink]\nkind = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\n",
                self.kafka.as_ref().unwrap().bootstrap()
            ),
            "nats" => format!(
                "[sink]\nkind = \"nats\"\n[sink.nats]\nurl = \"{}\"\n",
                self.nats.url()
            ),
            _ => "[sink]\nkind = \"stdout\"\n".to_owned(),
        };
        format!(
            "[postgres]\nurl = \"{}\"\npool_size = {}\n[relay]\nworkers = {}\nbatch_size = {}\n\
             ordering = \"{ordering}\"\nretry_backoff = \"10ms\"\nmax_attempts = 3\n\
             {sink}[[tables]]\nname = \"public.outbox\"\n",
            self.db_url,
            self.a.workers + 2,
            self.a.workers,
            self.a.batch
        )
    }

    fn config(&self, sink: &str, ordering: &str) -> Result<Config> {
        config::from_str(
            &self.config_text(sink, ordering),
            |_| None,
            Vec::<(String, String)>::new(),
        )
        .map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// Fills the table; `poison` rows of key `poison` to a subject no stream captures
    /// come first, at the head of every claim window.
    async fn seed(&self, poison: i64) -> Result<()> {
        self.seed_rows(poison, self.a.rows).await
    }

    async fn seed_rows(&self, poison: i64, rows: i64) -> Result<()> {
        let client = self.pg.connect("app").await?;
        client.batch_execute("TRUNCATE public.outbox").await?;
        self.insert_rows(poison, rows).await
    }

    /// Adds the benchmark's rows (and `poison` rows first) to what the table holds.
    async fn insert(&self, poison: i64) -> Result<()> {
        self.insert_rows(poison, self.a.rows).await
    }

    async fn insert_rows(&self, poison: i64, rows: i64) -> Result<()> {
        let client = self.pg.connect("app").await?;
        client
            .execute(
                "INSERT INTO public.outbox (topic, key, payload) \
                 SELECT 'nostream.orders', 'poison', 'x' FROM generate_series(1, $1::bigint)",
                &[&poison],
            )
            .await?;
        client
            .execute(
                "INSERT INTO public.outbox (topic, key, payload)
                 SELECT 'bench.' || (n % $4::bigint), 'k' || (n % $2::bigint),
                        convert_to(rpad(n::text, $3::int, 'x'), 'UTF8')
                 FROM generate_series(1, $1::bigint) n ORDER BY n",
                &[
                    &rows,
                    &self.a.keys,
                    &(self.a.payload as i32),
                    &(TOPICS as i64),
                ],
            )
            .await?;
        client.batch_execute("VACUUM ANALYZE public.outbox").await?;
        Ok(())
    }

    async fn reset_nats(&self) -> Result<()> {
        let client = async_nats::connect(self.nats.url()).await?;
        let js = async_nats::jetstream::new(client);
        let _ = js.delete_stream("BENCH").await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "BENCH".to_owned(),
            subjects: vec!["bench.>".to_owned()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("create stream: {e}"))?;
        Ok(())
    }

    /// A: the library's drain with a sink that acknowledges at once.
    async fn postgres_limit(&self, ordering: &'static str) -> Result<Row> {
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
        })
    }

    /// B: the same messages through the relay's sink, no database.
    async fn broker_limit(&self, sink_name: &'static str) -> Result<Row> {
        let config = self.config(sink_name, "none")?;
        let sink = Arc::new(Sink::connect(&config.sink).await?);
        let payload: Vec<u8> = std::iter::repeat_n(b'x', self.a.payload as usize).collect();
        let payload = bytes::Bytes::from(payload);
        let per_worker = self.a.rows as usize / self.a.workers;
        let started = Instant::now();
        let machine = MachineCpu::now();
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
                            topic: format!("bench.{}", i % TOPICS),
                            key: Some(format!("k{}", i % keys)),
                            payload: payload.clone(),
                            headers: Vec::new(),
                        })
                        .collect();
                    let refs: Vec<&Message> = messages.iter().collect();
                    for r in sink.publish_batch(&refs).await {
                        r.map_err(|e| anyhow::anyhow!("{}", e.message))?;
                    }
                    n += messages.len();
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        let secs = started.elapsed().as_secs_f64();
        let _ = sink.close(Duration::from_secs(5)).await;
        Ok(Row {
            name: format!("B. {sink_name} limit: publish, acks awaited, no database"),
            rows: (per_worker * self.a.workers) as i64,
            secs,
            broker: "",
            ordering: "",
            rss_mb: None,
            cpu_per_100k: None,
            cores_busy: machine.busy_since(),
        })
    }

    /// C + E: the release binary's drain, with its peak RSS and CPU time.
    async fn drain(&self, sink: &'static str, ordering: &'static str) -> Result<Row> {
        self.drain_with(sink, ordering, 0).await
    }

    /// C with `poison` rows no broker accepts at the head; counts the good rows only.
    async fn drain_with(
        &self,
        sink: &'static str,
        ordering: &'static str,
        poison: i64,
    ) -> Result<Row> {
        self.seed(poison).await?;
        if sink == "nats" {
            self.reset_nats().await?;
        }
        let mut row = self.timed_drain(sink, ordering).await?;
        if poison > 0 {
            let client = self.pg.connect("app").await?;
            let counts = client
                .query_one(
                    "SELECT count(*) FILTER (WHERE dead_at IS NOT NULL), count(*) FROM public.outbox",
                    &[],
                )
                .await?;
            let (dead, left): (i64, i64) = (counts.get(0), counts.get(1));
            if dead != 1 || left != poison {
                bail!("poisoned drain left {left} rows ({dead} dead); expected {poison} (1 dead)");
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
    async fn held_snapshot(&self) -> Result<(Row, Row)> {
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
    async fn table_size(&self) -> Result<Vec<Row>> {
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
        let path = self.dir.join(format!("{sink}-{ordering}.toml"));
        std::fs::write(&path, self.config_text(sink, ordering))?;
        let started = Instant::now();
        let machine = MachineCpu::now();
        let child = Command::new(&self.a.relay)
            .args(["drain", "--config"])
            .arg(&path)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("start outbox-relay")?;
        let (status, usage) = testkit::wait_with_usage(child.id() as i32)?;
        let secs = started.elapsed().as_secs_f64();
        if status != 0 {
            bail!("drain ({sink}, {ordering}) exited with {status}");
        }
        let cpu = usage.ru_utime.tv_sec as f64
            + usage.ru_utime.tv_usec as f64 / 1e6
            + usage.ru_stime.tv_sec as f64
            + usage.ru_stime.tv_usec as f64 / 1e6;
        Ok(Row {
            name: format!("C. drain to {sink}, ordering = \"{ordering}\""),
            rows,
            secs,
            broker: sink,
            ordering,
            rss_mb: Some(usage.ru_maxrss as f64 / 1024.0),
            cpu_per_100k: Some(cpu / (rows as f64 / 100_000.0)),
            cores_busy: machine.busy_since(),
        })
    }
}

/// Machine-wide CPU time from `/proc/stat`: how many cores every process together kept
/// busy. On a machine shared by PostgreSQL, the broker and the relay this shows whether a
/// limit is the CPU itself.
struct MachineCpu {
    busy: u64,
    total: u64,
}

impl MachineCpu {
    fn now() -> MachineCpu {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        let total: u64 = ticks.iter().take(8).sum();
        // user nice system idle iowait irq softirq steal: idle and iowait are not busy.
        let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
        MachineCpu {
            busy: total - idle,
            total,
        }
    }

    /// Cores busy on average since `self` was read.
    fn busy_since(&self) -> f64 {
        let now = MachineCpu::now();
        let total = now.total.saturating_sub(self.total);
        if total == 0 {
            return 0.0;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        cores * now.busy.saturating_sub(self.busy) as f64 / total as f64
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    eprintln!(
        "==> Starting throwaway PostgreSQL, nats-server{} on free 127.0.0.1 ports",
        if a.kafka { " and tansu" } else { "" }
    );
    let pg = Postgres::start_with(!a.fast, PG_SETTINGS)?;
    let db_url = pg.create_database("app").await?;
    let nats = NatsServer::start()?;
    let kafka = if a.kafka {
        let broker = KafkaBroker::start()?;
        for t in 0..TOPICS {
            broker.create_topic(&format!("bench.{t}"), 3)?;
        }
        Some(broker)
    } else {
        None
    };
    let dir = std::env::temp_dir().join(format!("outbox-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let bench = Bench {
        a,
        pg,
        db_url,
        nats,
        kafka,
        dir,
    };
    let out = Command::new(&bench.a.relay)
        .args(["migrate", "--no-notify", "--config"])
        .arg({
            let p = bench.dir.join("migrate.toml");
            std::fs::write(&p, bench.config_text("stdout", "key"))?;
            p
        })
        .output()?;
    if !out.status.success() {
        bail!("migrate: {}", String::from_utf8_lossy(&out.stderr));
    }

    let mut rows = Vec::new();
    let mut step = |row: Result<Row>| -> Result<()> {
        let row = row?;
        eprintln!(
            "    {}: {} rows in {:.2}s = {:.0} rows/s",
            row.name,
            row.rows,
            row.secs,
            row.rate()
        );
        rows.push(row);
        Ok(())
    };
    eprintln!(
        "==> {} rows, {} keys, {}-byte payloads, {} workers, batches of {}",
        bench.a.rows, bench.a.keys, bench.a.payload, bench.a.workers, bench.a.batch
    );
    step(bench.postgres_limit("key").await)?;
    step(bench.postgres_limit("none").await)?;
    bench.reset_nats().await?;
    step(bench.broker_limit("nats").await)?;
    if bench.kafka.is_some() {
        step(bench.broker_limit("kafka").await)?;
    }
    step(bench.drain("nats", "key").await)?;
    step(bench.drain_with("nats", "key", 3).await)?;
    step(bench.drain("nats", "none").await)?;
    let (held_first, held_second) = bench.held_snapshot().await?;
    step(Ok(held_first))?;
    step(Ok(held_second))?;
    if bench.kafka.is_some() {
        step(bench.drain("kafka", "key").await)?;
        step(bench.drain("kafka", "none").await)?;
    }
    if bench.a.big_rows > 0 {
        for row in bench.table_size().await? {
            step(Ok(row))?;
        }
    }
    let steady = if bench.a.steady_secs > 0 {
        Some(bench.steady_state().await?)
    } else {
        None
    };
    let held = if bench.a.held_secs > 0 {
        Some(bench.held_steady().await?)
    } else {
        None
    };
    let retention = if bench.a.retention_secs > 0 {
        Some(bench.retention().await?)
    } else {
        None
    };
    let settings = {
        let client = bench.pg.connect("app").await?;
        let mut shown = Vec::new();
        for name in [
            "server_version",
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "shared_buffers",
            "max_wal_size",
            "checkpoint_timeout",
        ] {
            let value: String = client.query_one(&format!("SHOW {name}"), &[]).await?.get(0);
            shown.push(format!("{name}={value}"));
        }
        shown.join(", ")
    };
    let _ = std::fs::remove_dir_all(&bench.dir);

    let limit_of = |broker: &str, ordering: &str| -> Option<f64> {
        let a = rows
            .iter()
            .find(|r| r.name.starts_with("A.") && r.ordering == ordering)?
            .rate();
        let b = rows
            .iter()
            .find(|r| r.name.starts_with(&format!("B. {broker} ")))?
            .rate();
        Some(a.min(b))
    };
    println!(
        "\n{} rows, {} keys, {}-byte payloads, {} workers, batch {}; {} cores\n",
        bench.a.rows,
        bench.a.keys,
        bench.a.payload,
        bench.a.workers,
        bench.a.batch,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("PostgreSQL: {settings}\n");
    println!(
        "| measurement | rows/s | vs min(A, B) | peak RSS | CPU s / 100k rows | machine cores busy |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        let ratio = match r.broker {
            "" => "limit".to_owned(),
            b => limit_of(b, r.ordering).map_or("-".into(), |l| format!("{:.2}", r.rate() / l)),
        };
        println!(
            "| {} | {:.0} | {} | {} | {} | {:.2} |",
            r.name,
            r.rate(),
            ratio,
            r.rss_mb.map_or("-".into(), |m| format!("{m:.0} MB")),
            r.cpu_per_100k.map_or("-".into(), |c| format!("{c:.2}")),
            r.cores_busy,
        );
    }
    let rate_of = |prefix: &str| {
        rows.iter()
            .find(|r| r.name.starts_with(prefix))
            .map(Row::rate)
    };
    if let (Some(clean), Some(poisoned)) = (
        rate_of("C. drain to nats, ordering = \"key\""),
        rate_of("C'. drain to nats"),
    ) {
        println!(
            "\nC' good rows behind 3 rows no stream captures: {poisoned:.0} rows/s, {:.2} of the \
             same drain without them ({clean:.0} rows/s)",
            poisoned / clean
        );
    }
    if let (Some(clean), Some(first), Some(second)) = (
        rate_of("C. drain to nats, ordering = \"key\""),
        rate_of("E1."),
        rate_of("E2."),
    ) {
        println!(
            "\nE held snapshot: first drain {first:.0} rows/s = {:.2} of C without it; second \
             drain {second:.0} rows/s = {:.2} of the first",
            first / clean,
            second / first
        );
    }
    if let (Some(small), Some(big)) = (
        rows.iter()
            .find(|r| r.name.starts_with("F.") && r.rows == SMALL_ROWS),
        rows.iter()
            .find(|r| r.name.starts_with("F.") && r.rows != SMALL_ROWS),
    ) {
        println!(
            "\nF table size: {} rows drained at {:.0} rows/s = {:.2} of {} rows ({:.0} rows/s)",
            big.rows,
            big.rate(),
            big.rate() / small.rate(),
            small.rows,
            small.rate()
        );
    }
    if let Some(steady) = steady {
        println!(
            "\nD. steady state, `outbox-relay run` with default relay settings, NATS, \
             {}s per rate; commit-to-consumer latency\n",
            bench.a.steady_secs
        );
        println!("| writer rows/s | rows | delivered | p50 | p99 | max |");
        println!("|---:|---:|---:|---:|---:|---:|");
        for l in &steady.rates {
            println!(
                "| {} | {} | {} | {:.1} ms | {:.1} ms | {:.1} ms |",
                l.label, l.rows, l.delivered, l.p50_ms, l.p99_ms, l.max_ms
            );
        }
        println!(
            "\nIdle relay: exit {} {:.0} ms after SIGTERM.",
            steady.exit_code, steady.exit_ms
        );
    }
    if let Some(windows) = held {
        println!(
            "\nG. held snapshot in steady state: `outbox-relay run`, default settings, NATS, \
             writer at {STEADY_RATE} rows/s; commit-to-consumer latency per minute\n"
        );
        println!(
            "| minute | rows | delivered | dead tuples after | p50 | p99 | p99 / before | max |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        let before = windows[0].0.p99_ms;
        for (l, dead) in &windows {
            println!(
                "| {} | {} | {} | {} | {:.1} ms | {:.1} ms | {:.2} | {:.1} ms |",
                l.label,
                l.rows,
                l.delivered,
                dead,
                l.p50_ms,
                l.p99_ms,
                l.p99_ms / before,
                l.max_ms
            );
        }
        let worst = windows[1..]
            .iter()
            .map(|(l, _)| l.p99_ms)
            .fold(0.0, f64::max);
        println!(
            "\nG worst held minute: p99 {worst:.1} ms = {:.2} of the p99 before ({before:.1} ms)",
            worst / before
        );
    }
    if let Some(samples) = retention {
        let r = bench.a.retention_secs;
        println!(
            "\nH. mark mode, relay.retention = \"{r}s\": writer at {STEADY_RATE} rows/s; the \
             table after each {r} s\n"
        );
        println!(
            "| after | rows written | rows in the table | table + indexes | p50 | p99 | max |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|");
        let mut written = 0;
        for (l, rows, mb) in &samples {
            written += l.rows;
            println!(
                "| {} | {written} | {rows} | {mb:.1} MB | {:.1} ms | {:.1} ms | {:.1} ms |",
                l.label, l.p50_ms, l.p99_ms, l.max_ms
            );
        }
        println!(
            "\nH table after {} s: {} rows ({:.1} MB); the writer's rate x the retention is {} rows",
            5 * r,
            samples.last().map_or(0, |s| s.1),
            samples.last().map_or(0.0, |s| s.2),
            u64::from(STEADY_RATE) * r
        );
    }
    Ok(())
}

struct Latency {
    /// What was measured: a writer rate, a minute of a run.
    label: String,
    rows: usize,
    delivered: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

struct Steady {
    rates: Vec<Latency>,
    exit_code: i32,
    exit_ms: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Ids the consumer received, with when.
type Received = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<i64, Instant>>>;

/// `outbox-relay run` with a consumer timing each message, for D, G and H.
struct Running {
    client: tokio_postgres::Client,
    received: Received,
    consumer: tokio::task::JoinHandle<()>,
    relay: std::process::Child,
}

/// Rows committed by the writer: id and commit time.
type Committed = Vec<(i64, Instant)>;

impl Running {
    /// Latency of the rows `committed`, once they arrived (or 10 s passed).
    async fn latency(&self, label: String, committed: &[(i64, Instant)]) -> Latency {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let all_arrived = {
                let got = self.received.lock().unwrap();
                committed.iter().all(|(id, _)| got.contains_key(id))
            };
            if all_arrived {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let got = self.received.lock().unwrap();
        let mut latencies: Vec<f64> = committed
            .iter()
            .filter_map(|(id, at)| {
                got.get(id)
                    .map(|r| r.saturating_duration_since(*at).as_secs_f64() * 1000.0)
            })
            .collect();
        latencies.sort_by(|a, b| a.total_cmp(b));
        Latency {
            label,
            rows: committed.len(),
            delivered: latencies.len(),
            p50_ms: percentile(&latencies, 0.50),
            p99_ms: percentile(&latencies, 0.99),
            max_ms: latencies.last().copied().unwrap_or(f64::NAN),
        }
    }

    /// SIGTERM, and the time to exit.
    fn stop(mut self) -> Result<(i32, f64)> {
        let sent = Instant::now();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.relay.id() as i32, libc::SIGTERM) };
        let status = self.relay.wait()?;
        self.consumer.abort();
        Ok((
            status.code().unwrap_or(-1),
            sent.elapsed().as_secs_f64() * 1000.0,
        ))
    }
}

impl Bench {
    /// An empty table and stream, `outbox-relay run` with the default relay settings plus
    /// `relay` (lines of `[relay]`), the NOTIFY trigger the default migrate installs, and
    /// a consumer subscribed to the subjects.
    async fn start_running(&self, name: &str, relay: &str) -> Result<Running> {
        use futures_util::StreamExt;

        let client = self.pg.connect("app").await?;
        client.batch_execute("TRUNCATE public.outbox").await?;
        self.reset_nats().await?;
        let path = self.dir.join(format!("{name}.toml"));
        std::fs::write(
            &path,
            format!(
                "[postgres]\nurl = \"{}\"\n[relay]\n{relay}\n[sink]\nkind = \"nats\"\n\
                 [sink.nats]\nurl = \"{}\"\n[[tables]]\nname = \"public.outbox\"\n",
                self.db_url,
                self.nats.url()
            ),
        )?;
        let out = Command::new(&self.a.relay)
            .args(["migrate", "--config"])
            .arg(&path)
            .output()?;
        if !out.status.success() {
            bail!("migrate: {}", String::from_utf8_lossy(&out.stderr));
        }
        let received: Received = Arc::default();
        let nc = async_nats::connect(self.nats.url()).await?;
        let mut sub = nc.subscribe("bench.>").await?;
        let sink = received.clone();
        let consumer = tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                let now = Instant::now();
                let id = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .and_then(|v| v.as_str().rsplit(':').next()?.parse::<i64>().ok());
                if let Some(id) = id {
                    sink.lock().unwrap().entry(id).or_insert(now);
                }
            }
        });
        let relay = Command::new(&self.a.relay)
            .args(["run", "--config"])
            .arg(&path)
            .env("RUST_LOG", "warn")
            .spawn()?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok(Running {
            client,
            received,
            consumer,
            relay,
        })
    }

    /// An open-loop writer: a transaction every 10 ms at its scheduled time, however late
    /// the last, `rate` rows/s for `secs`.
    async fn write(
        &self,
        client: &tokio_postgres::Client,
        rate: u32,
        secs: u64,
    ) -> Result<Committed> {
        let payload = "x".repeat(self.a.payload as usize);
        let per_tick = (rate / 100).max(1) as i64;
        let mut committed = Vec::new();
        let start = Instant::now();
        for tick in 0..secs * 100 {
            let due = start + Duration::from_millis(tick * 10);
            tokio::time::sleep_until(due.into()).await;
            let ids: Vec<i64> = client
                .query(
                    "INSERT INTO public.outbox (topic, key, payload)
                     SELECT 'bench.' || (n % 8), 'k' || (n % $3::bigint), convert_to($2, 'UTF8')
                     FROM generate_series(1, $1::bigint) n RETURNING id",
                    &[&per_tick, &payload, &self.a.keys],
                )
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let at = Instant::now(); // autocommit: the INSERT has committed
            committed.extend(ids.into_iter().map(|id| (id, at)));
        }
        Ok(committed)
    }

    /// D: the writer at rising rates.
    async fn steady_state(&self) -> Result<Steady> {
        let run = self.start_running("steady", "").await?;
        let mut rates = Vec::new();
        for rate in [1_000u32, 2_000, 5_000, 20_000] {
            eprintln!("    D. writer at {rate} rows/s for {}s", self.a.steady_secs);
            let committed = self.write(&run.client, rate, self.a.steady_secs).await?;
            rates.push(run.latency(rate.to_string(), &committed).await);
        }
        // The relay is idle now: how fast does it leave on SIGTERM?
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (exit_code, exit_ms) = run.stop()?;
        Ok(Steady {
            rates,
            exit_code,
            exit_ms,
        })
    }

    /// The table's dead tuples (statistics, as autovacuum sees them), live rows and size.
    async fn table_state(client: &tokio_postgres::Client) -> Result<(i64, i64, f64)> {
        let row = client
            .query_one(
                "SELECT COALESCE((SELECT n_dead_tup FROM pg_stat_user_tables \
                 WHERE relid = 'public.outbox'::regclass), 0), \
                 (SELECT count(*) FROM public.outbox), \
                 pg_total_relation_size('public.outbox')::float8 / 1048576",
                &[],
            )
            .await?;
        Ok((row.get(0), row.get(1), row.get(2)))
    }

    /// G: the writer at [`STEADY_RATE`] for a minute, then for `--held-secs` while another
    /// session holds a REPEATABLE READ snapshot; latency per minute and the dead tuples.
    async fn held_steady(&self) -> Result<Vec<(Latency, i64)>> {
        let run = self.start_running("held", "").await?;
        let mut windows = Vec::new();
        eprintln!("    G. writer at {STEADY_RATE} rows/s: 60 s before the snapshot");
        let committed = self.write(&run.client, STEADY_RATE, 60).await?;
        let before = run.latency("before".to_owned(), &committed).await;
        windows.push((before, Self::table_state(&run.client).await?.0));
        let holder = self.pg.connect("app").await?;
        holder
            .batch_execute(
                "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_catalog.pg_class",
            )
            .await?;
        let minutes = self.a.held_secs.div_ceil(60);
        for minute in 1..=minutes {
            eprintln!("    G. snapshot held: minute {minute} of {minutes}");
            let committed = self.write(&run.client, STEADY_RATE, 60).await?;
            let latency = run
                .latency(format!("held, minute {minute}"), &committed)
                .await;
            windows.push((latency, Self::table_state(&run.client).await?.0));
        }
        holder.batch_execute("ROLLBACK").await?;
        run.stop()?;
        Ok(windows)
    }

    /// H: mark mode with retention; the writer for five retentions, the table sampled once
    /// per retention.
    async fn retention(&self) -> Result<Vec<(Latency, i64, f64)>> {
        let r = self.a.retention_secs;
        let run = self
            .start_running(
                "retention",
                &format!("on_publish = \"mark\"\nretention = \"{r}s\""),
            )
            .await?;
        let mut samples = Vec::new();
        for i in 1..=5 {
            eprintln!("    H. mark mode, retention {r}s: {} s of 5 x {r} s", i * r);
            let committed = self.write(&run.client, STEADY_RATE, r).await?;
            let latency = run.latency(format!("{} s", i * r), &committed).await;
            let (_, rows, mb) = Self::table_state(&run.client).await?;
            samples.push((latency, rows, mb));
        }
        run.stop()?;
        Ok(samples)
    }
}
