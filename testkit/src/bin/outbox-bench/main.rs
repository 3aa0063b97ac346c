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
//! - T. Trace export's cost: the NATS key-ordered drain of rows that each carry a
//!   `traceparent` header, with export off, then on (OTLP/HTTP to a receiver in this
//!   process that decodes every export and counts the spans).
//! - E. Peak RSS and CPU seconds per 100k rows of each drain (from `wait4`).
//!
//! Prints one markdown table; each drain also as a ratio to min(A, B) for its ordering
//! mode and broker.
//!
//! - D. Steady state: `outbox-relay run` with the default relay settings (the wake-up
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
//! `--scale` runs only S, R, I and E3 (`scale.rs`), `--partial` only K (`partial.rs`),
//! `--distant` only L (`distant.rs`: the database behind a proxy adding 1-20 ms),
//! `--envelope` only V (CloudEvents in binary mode against no envelope, `drain.rs`),
//! `--write-path` only W (`write_path.rs`: the application's commit rate under pgbench
//! writers, run by `pgbench.rs`, on a bare table, on the table `migrate` leaves, and with
//! a relay draining it with and without the wake-up; `--write-secs`,
//! `--write-rounds`, `--writers`).
//!
//! Flags and their defaults: `outbox-bench --help` ([`args::Args`]). One idea per module:
//! `args` (the command line), `drain` (A, B, C, C', E and F: the limits and the timed
//! drains), `steady` (D, G and H: `outbox-relay run` with a writer and a consumer), `cpu`
//! (machine-wide CPU time) and `report` (the tables); this file starts the servers, fills
//! the table and runs the measurements in order.

mod args;
mod cpu;
mod distant;
mod drain;
mod partial;
mod pgbench;
mod report;
mod scale;
mod steady;
mod write_path;

use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Parser;
use outbox_relay::config::{self, Config};
use testkit::{KafkaBroker, NatsServer, Postgres};

use args::Args;
use drain::Row;

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

/// What every measurement shares: the arguments, the servers and a scratch directory for
/// the relay's config files.
struct Bench {
    a: Args,
    pg: Postgres,
    db_url: String,
    nats: NatsServer,
    kafka: Option<KafkaBroker>,
    /// The Kafka records counted after the last measurement (only the benchmark writes
    /// to its topics, so it is the next measurement's count before).
    kafka_records: std::sync::Mutex<Option<i64>>,
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
        self.insert_rows(poison, rows, false).await
    }

    /// Fills the table afresh with rows that each carry a W3C `traceparent` header (a
    /// trace of its own, sampled), as rows written inside traced requests do.
    async fn seed_traced(&self) -> Result<()> {
        let client = self.pg.connect("app").await?;
        client.batch_execute("TRUNCATE public.outbox").await?;
        self.insert_rows(0, self.a.rows, true).await
    }

    /// Adds the benchmark's rows (and `poison` rows first) to what the table holds.
    async fn insert(&self, poison: i64) -> Result<()> {
        self.insert_rows(poison, self.a.rows, false).await
    }

    async fn insert_rows(&self, poison: i64, rows: i64, traced: bool) -> Result<()> {
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
                "INSERT INTO public.outbox (topic, key, payload, headers)
                 SELECT 'bench.' || (n % $4::bigint), 'k' || (n % $2::bigint),
                        convert_to(rpad(n::text, $3::int, 'x'), 'UTF8'),
                        CASE WHEN $5 THEN jsonb_build_object('traceparent',
                            '00-' || md5(n::text) || '-' || left(md5('span' || n), 16) || '-01')
                        END
                 FROM generate_series(1, $1::bigint) n ORDER BY n",
                &[
                    &rows,
                    &self.a.keys,
                    &(self.a.payload as i32),
                    &(TOPICS as i64),
                    &traced,
                ],
            )
            .await?;
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

    /// Starts PostgreSQL (durable unless `--fast`), nats-server and, unless `--no-kafka`,
    /// tansu with the benchmark's topics; creates the table with `outbox-relay migrate
    /// --no-notify`.
    async fn start(a: Args) -> Result<Bench> {
        eprintln!(
            "==> Starting throwaway PostgreSQL, nats-server{} on free 127.0.0.1 ports",
            if a.kafka { " and tansu" } else { "" }
        );
        // BENCH_PG_SETTINGS: postgresql.conf lines added for a profiling run (for example
        // `shared_preload_libraries = 'pg_stat_statements'`); printed with the results.
        let extra = std::env::var("BENCH_PG_SETTINGS").unwrap_or_default();
        let pg = Postgres::start_with(!a.fast, &format!("{PG_SETTINGS}{extra}\n"))?;
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
            kafka_records: std::sync::Mutex::new(None),
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
        Ok(bench)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    // The relays K and L run in this process: RUST_LOG shows their logs (for example
    // `RUST_LOG=outbox_relay::source::floor=debug` for the claim floor's moves).
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    let bench = Bench::start(Args::parse()).await?;
    if bench.a.partial {
        let partial = bench.partial().await?;
        let _ = std::fs::remove_dir_all(&bench.dir);
        partial::print(&partial);
        return Ok(());
    }
    if bench.a.write_path {
        let runs = bench.write_path().await?;
        let settings = report::settings(&bench.pg).await?;
        let _ = std::fs::remove_dir_all(&bench.dir);
        write_path::print(&bench.a, &runs, &settings);
        return Ok(());
    }
    if bench.a.envelope {
        let runs = bench.envelope_cost(3).await?;
        let _ = std::fs::remove_dir_all(&bench.dir);
        let mean = |prefix: &str, of: fn(&Row) -> f64| {
            let values: Vec<f64> = runs
                .iter()
                .filter(|r| r.name.starts_with(prefix))
                .map(of)
                .collect();
            values.iter().sum::<f64>() / values.len() as f64
        };
        let cpu = |r: &Row| r.cpu_per_100k.unwrap_or(f64::NAN);
        println!(
            "| V. NATS drain, key order | rows | s | rows/s | relay CPU s / 100k rows |\n\
             |---|---:|---:|---:|---:|"
        );
        for row in &runs {
            println!(
                "| {} | {} | {:.2} | {:.0} | {:.2} |",
                row.name,
                row.rows,
                row.secs,
                row.rate(),
                cpu(row)
            );
        }
        println!(
            "\nV1 / V0, means of the rounds: {:.3} of the rate; the relay's CPU a row {:.3}",
            mean("V1", Row::rate) / mean("V0", Row::rate),
            mean("V1", cpu) / mean("V0", cpu)
        );
        return Ok(());
    }
    if bench.a.distant {
        let runs = bench.distant().await?;
        let settings = report::settings(&bench.pg).await?;
        let _ = std::fs::remove_dir_all(&bench.dir);
        println!("PostgreSQL: {settings}");
        distant::print(&runs);
        return Ok(());
    }
    if bench.a.scale {
        let scale = bench.scale().await?;
        let settings = report::settings(&bench.pg).await?;
        let _ = std::fs::remove_dir_all(&bench.dir);
        println!("PostgreSQL: {settings}");
        scale::print(&scale);
        return Ok(());
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
    let (untraced, traced) = bench.trace_export().await?;
    step(Ok(untraced))?;
    step(Ok(traced))?;
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
    let settings = report::settings(&bench.pg).await?;
    let _ = std::fs::remove_dir_all(&bench.dir);
    report::print(&bench, rows, &settings, steady, held, retention);
    Ok(())
}
