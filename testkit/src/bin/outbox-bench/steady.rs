//! D, G and H: `outbox-relay run` with the default relay settings, an open-loop writer
//! and a NATS consumer timing each message against its commit.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::{Bench, STEADY_RATE};

pub(crate) struct Latency {
    /// What was measured: a writer rate, a minute of a run.
    pub(crate) label: String,
    pub(crate) rows: usize,
    /// The rate the writer achieved (its nominal rate is in `label` for D).
    pub(crate) achieved_rate: f64,
    /// Rows the consumer received within 10 s of the writer's last commit; the others count
    /// as missing, and as infinitely late in the percentiles.
    pub(crate) delivered: usize,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
}

pub(crate) struct Steady {
    pub(crate) rates: Vec<Latency>,
    pub(crate) exit_code: i32,
    pub(crate) exit_ms: f64,
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
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

/// Rows committed by the writer (id and commit time) and how long the writing took.
struct Committed {
    rows: Vec<(i64, Instant)>,
    secs: f64,
}

impl Running {
    /// Latency of the rows `committed`, once they arrived (or 10 s passed).
    async fn latency(&self, label: String, committed: &Committed) -> Latency {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let all_arrived = {
                let got = self.received.lock().unwrap();
                committed.rows.iter().all(|(id, _)| got.contains_key(id))
            };
            if all_arrived {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let got = self.received.lock().unwrap();
        // A row that never arrived is a latency failure: infinitely late, not left out.
        let mut latencies: Vec<f64> = committed
            .rows
            .iter()
            .map(|(id, at)| {
                got.get(id).map_or(f64::INFINITY, |r| {
                    r.saturating_duration_since(*at).as_secs_f64() * 1000.0
                })
            })
            .collect();
        latencies.sort_by(|a, b| a.total_cmp(b));
        Latency {
            label,
            rows: committed.rows.len(),
            achieved_rate: committed.rows.len() as f64 / committed.secs,
            delivered: latencies.iter().filter(|l| l.is_finite()).count(),
            p50_ms: percentile(&latencies, 0.50),
            p99_ms: percentile(&latencies, 0.99),
            max_ms: latencies.last().copied().unwrap_or(f64::NAN),
        }
    }

    /// SIGTERM, and the time to exit.
    fn stop(mut self) -> Result<(i32, f64)> {
        let sent = Instant::now();
        let _ = testkit::send_signal(self.relay.id(), testkit::Signal::Term);
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
    /// `relay` (lines of `[relay]`), the wake-up the default migrate installs, and
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
        Ok(Committed {
            rows: committed,
            secs: start.elapsed().as_secs_f64(),
        })
    }

    /// D: the writer at rising rates.
    pub(crate) async fn steady_state(&self) -> Result<Steady> {
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
    pub(crate) async fn held_steady(&self) -> Result<Vec<(Latency, i64)>> {
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
    pub(crate) async fn retention(&self) -> Result<Vec<(Latency, i64, f64)>> {
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
