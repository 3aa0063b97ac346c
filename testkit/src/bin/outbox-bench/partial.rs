//! K: partial failures that must stay partial (issue 29). `outbox-bench --partial` runs
//! only these.
//!
//! - K. One Kafka broker down: librdkafka's mock cluster of three brokers, the benchmark's
//!   8 topics with 6 partitions each, partition `p` led by broker `p % 3 + 1`. The table
//!   is filled with [`K_ROWS`] rows over `--keys` keys and drained by the relay in this
//!   process (the mock cluster lives here), first with every broker up, then with broker 1
//!   down before the relay starts (its leaders stay there, as with replication factor 1 or
//!   a slow election). The rate of the other partitions' rows while it is down, over the
//!   middle 80% of those rows (10% to 90% delivered: the relay's start-up and the first
//!   records that wait out the publish timeout before the outage is seen are left out,
//!   and reported as the time to the first 10%), as a ratio to two rates with every broker
//!   up, over the same stretch of that run:
//!   - the rate of all rows: what the relay can do, the stricter reading;
//!   - the rate of those same partitions' rows (the issue's words: "the other partitions'
//!     keys flow at >= 0.8 of their rate with all brokers up"), counted by the mock
//!     brokers: the records their partitions stored ([`Stored`]).
//!
//!   Then, the other partitions' rows gone,
//!   what the outage costs the database while it lasts ([`OUTAGE_SECS`] more: the held
//!   rows written again a second, and transactions a second); then how long the held rows
//!   took once the broker was back.
//!
//! Delivery is followed through the relay's own counter of rows published (`/metrics`,
//! every 20 ms, the 10% and 90% marks interpolated between samples), not by counting the
//! table: a `count(*)` of 100,000 rows every 100 ms cost the database 18-24 ms each, a
//! tenth of this machine while it measured.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use outbox_relay::config;
use outbox_relay::relay::{self, Mode};
use outbox_relay::shutdown::Shutdown;
use outbox_relay::sink::kafka::partition_of;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

use crate::scale::Cpu;
use crate::{Bench, TOPICS};

/// Rows of each K drain.
const K_ROWS: i64 = 100_000;
const BROKERS: i32 = 3;
const PARTITIONS: i32 = 6;
/// The broker K takes down.
const DOWN: i32 = 1;
/// How often K reads the relay's counter of rows published.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);
/// How long the broker stays down once the other partitions' rows are gone, to measure
/// what the outage costs meanwhile.
const OUTAGE_SECS: u64 = 20;

type Mock = MockCluster<'static, DefaultProducerContext>;

/// One K run: how the relay got through the rows it could deliver.
pub(crate) struct Flow {
    /// Rows it had to deliver (all, or those of the partitions that stayed up).
    pub(crate) rows: i64,
    /// From the relay's start to 10% of them delivered.
    pub(crate) to_first_tenth: Duration,
    /// Rows per second from 10% to 90% of them delivered.
    pub(crate) rate: f64,
    /// CPU microseconds a row delivered over that stretch: this process (the relay and the
    /// mock brokers), then every PostgreSQL process.
    pub(crate) cpu_per_row: (f64, f64),
    /// Of the records the brokers stored over that stretch, the share on the partitions
    /// the down broker does not lead (with it down, 1.0: the relay's counter counts only
    /// records a broker acknowledged).
    pub(crate) up_share: f64,
}

impl Flow {
    /// Rows a second of the partitions the down broker does not lead.
    pub(crate) fn up_rate(&self) -> f64 {
        self.rate * self.up_share
    }
}

/// The records the mock brokers stored, by the partitions' high watermarks: all of them,
/// and those of the partitions the down broker does not lead. Read at the same samples as
/// the CPU, so the share is over the same stretch as the rate.
struct Stored {
    consumer: rdkafka::consumer::BaseConsumer,
}

impl Stored {
    fn new(brokers: &str) -> Result<Stored> {
        let consumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        Ok(Stored { consumer })
    }

    /// (all records, records of the partitions the down broker does not lead), every
    /// broker up.
    fn now(&self) -> Result<(i64, i64)> {
        use rdkafka::consumer::Consumer;
        tokio::task::block_in_place(|| {
            let mut counts = (0, 0);
            for t in 0..TOPICS {
                let topic = format!("bench.{t}");
                for p in 0..PARTITIONS {
                    let (_, high) =
                        self.consumer
                            .fetch_watermarks(&topic, p, Duration::from_secs(5))?;
                    counts.0 += high;
                    if leader(p) != DOWN {
                        counts.1 += high;
                    }
                }
            }
            Ok(counts)
        })
    }
}

/// CPU seconds so far: this process's (the relay and the mock brokers), and PostgreSQL's.
fn cpu_now() -> Cpu {
    Cpu::now(&[std::process::id()])
}

/// What `--partial` measured.
pub(crate) struct Partial {
    pub(crate) all_up: Flow,
    pub(crate) one_down: Flow,
    /// Rows held back while the broker was down.
    pub(crate) held: i64,
    /// Over [`OUTAGE_SECS`] of the outage with only held rows left: rows updated a second
    /// (the held keys' heads written again) and transactions a second.
    pub(crate) outage_updates: f64,
    pub(crate) outage_transactions: f64,
    /// From the broker's return to the table empty.
    pub(crate) held_drained_in: Duration,
}

fn leader(p: i32) -> i32 {
    p % BROKERS + 1
}

impl Bench {
    fn k_config(&self, brokers: &str, http: &str) -> Result<config::Config> {
        let text = http.to_owned()
            + &format!(
            "[postgres]\nurl = \"{}\"\npool_size = {}\n[relay]\nworkers = {}\nbatch_size = {}\n\
             [sink]\nkind = \"kafka\"\npublish_timeout = \"3s\"\n[sink.kafka]\n\
             brokers = \"{brokers}\"\n[[tables]]\nname = \"public.outbox\"\n",
            self.db_url,
            self.a.workers + 4,
            self.a.workers,
            self.a.batch,
        );
        config::from_str(&text, |_| None, Vec::<(String, String)>::new())
            .map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// K, both runs.
    pub(crate) async fn partial(&self) -> Result<Partial> {
        let mock = Mock::new(BROKERS)?;
        for t in 0..TOPICS {
            let topic = format!("bench.{t}");
            mock.create_topic(&topic, PARTITIONS, 1)?;
            for p in 0..PARTITIONS {
                mock.partition_leader(&topic, p, Some(leader(p)))?;
            }
        }
        // Rows of key `k{n % keys}` whose partition the down broker leads.
        let keys = self.a.keys;
        let on_down = |n: i64| {
            let key = format!("k{}", n % keys);
            leader(partition_of(key.as_bytes(), PARTITIONS as usize).unwrap()) == DOWN
        };
        let held = (1..=K_ROWS).filter(|n| on_down(*n)).count() as i64;
        let brokers = mock.bootstrap_servers();

        eprintln!("==> K: {K_ROWS} rows, every broker up");
        self.seed_rows(0, K_ROWS).await?;
        let stored = Stored::new(&brokers)?;
        let (all_up, shutdown, relay, _) = self.flow(&brokers, K_ROWS, Some(&stored)).await?;
        drop(stored);
        shutdown.request_stop();
        relay.await??;

        eprintln!("==> K: {K_ROWS} rows, broker {DOWN} down ({held} rows on its partitions)");
        self.seed_rows(0, K_ROWS).await?;
        mock.broker_down(DOWN)?;
        let (one_down, shutdown, relay, metrics) = self.flow(&brokers, K_ROWS - held, None).await?;
        let client = self.pg.connect("app").await?;
        let (outage_updates, outage_transactions) = outage_cost(&client).await?;
        mock.broker_up(DOWN)?;
        let up = Instant::now();
        while published(&metrics).await < K_ROWS {
            if up.elapsed() > Duration::from_secs(120) {
                bail!("K: the held rows did not drain within 2 minutes of the broker's return");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let held_drained_in = up.elapsed();
        shutdown.request_stop();
        relay.await??;
        let left = left(&client).await?;
        if left != 0 {
            bail!("K: {left} rows left in the table after every row was published");
        }
        Ok(Partial {
            all_up,
            one_down,
            held,
            outage_updates,
            outage_transactions,
            held_drained_in,
        })
    }

    /// Starts `outbox-relay run` in this process against `brokers` and times how it
    /// delivers `rows` rows (the table may keep others: rows it cannot deliver); returns
    /// the relay still running, and the address of its `/metrics`.
    async fn flow(
        &self,
        brokers: &str,
        rows: i64,
        stored: Option<&Stored>,
    ) -> Result<(
        Flow,
        Shutdown,
        tokio::task::JoinHandle<Result<relay::Report, relay::RelayError>>,
        String,
    )> {
        let (http, metrics) = crate::scale::http_section();
        let config = &self.k_config(brokers, &http)?;
        let client = self.pg.connect("app").await?;
        let profiled = self.statements(&client, None).await?;
        let shutdown = Shutdown::new();
        let started = Instant::now();
        let relay = {
            let (config, shutdown) = (config.clone(), shutdown.clone());
            tokio::spawn(async move { relay::run(&config, Mode::Run, shutdown).await })
        };
        // The counter every SAMPLE_EVERY; when each fraction was reached is interpolated
        // between the samples around it (read every 100 ms and taken at the first sample
        // past it, a stretch of 0.6-0.9 s was measured up to a sixth too long or short).
        // CPU is read at the first samples past 10% and 90%, over the rows between them.
        let (tenth_rows, ninetieth_rows) = (rows as f64 * 0.1, rows as f64 * 0.9);
        let mut samples = vec![(started, 0)];
        let mut cpu_at_tenth = None;
        let mut stored_at_tenth = None;
        let last = loop {
            if started.elapsed() > Duration::from_secs(300) {
                bail!("K: 90% of {rows} rows not delivered within 5 minutes");
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
            let n = published(&metrics).await;
            samples.push((Instant::now(), n));
            if cpu_at_tenth.is_none() && n as f64 >= tenth_rows {
                cpu_at_tenth = Some((n, cpu_now()));
                stored_at_tenth = stored.map(Stored::now).transpose()?;
            }
            if n as f64 >= ninetieth_rows {
                break (n, cpu_now());
            }
        };
        let up_share = match (stored, stored_at_tenth) {
            (Some(stored), Some((all0, up0))) => {
                let (all1, up1) = stored.now()?;
                (up1 - up0) as f64 / (all1 - all0).max(1) as f64
            }
            _ => 1.0,
        };
        let per_row = {
            let ((n0, c0), (n1, c1)) = (cpu_at_tenth.expect("past 10% before 90%"), last);
            let (rows, used) = ((n1 - n0).max(1) as f64, c1.since(c0));
            (used.processes * 1e6 / rows, used.postgres * 1e6 / rows)
        };
        let (tenth, ninetieth) = (
            reached(&samples, tenth_rows),
            reached(&samples, ninetieth_rows),
        );
        if profiled {
            self.statements(&client, Some(true)).await?;
        }
        let flow = Flow {
            rows,
            to_first_tenth: tenth - started,
            rate: rows as f64 * 0.8 / (ninetieth - tenth).as_secs_f64(),
            cpu_per_row: per_row,
            up_share,
        };
        eprintln!(
            "    {rows} rows: 10% after {:.2?}, then {:.0} rows/s ({:.0} of the partitions \
             broker {DOWN} does not lead); CPU a row {:.1} µs here, {:.1} µs PostgreSQL",
            flow.to_first_tenth,
            flow.rate,
            flow.up_rate(),
            flow.cpu_per_row.0,
            flow.cpu_per_row.1
        );
        Ok((flow, shutdown, relay, metrics))
    }
}

/// When the counter sampled in `samples` (time, rows published; increasing, the last at
/// least `target`) reached `target`: interpolated between the samples around it.
fn reached(samples: &[(Instant, i64)], target: f64) -> Instant {
    let after = samples
        .iter()
        .position(|(_, n)| *n as f64 >= target)
        .expect("a sample reached the target");
    let Some(before) = after.checked_sub(1) else {
        return samples[after].0;
    };
    let ((t0, n0), (t1, n1)) = (samples[before], samples[after]);
    t0 + (t1 - t0).mul_f64((target - n0 as f64) / (n1 - n0) as f64)
}

/// Rows updated in the outbox and transactions committed in the database, a second, over
/// the next [`OUTAGE_SECS`] (the statistics PostgreSQL's backends report, at least every
/// second).
async fn outage_cost(client: &tokio_postgres::Client) -> Result<(f64, f64)> {
    let read = async || -> Result<(i64, i64)> {
        client
            .execute("SELECT pg_stat_clear_snapshot()", &[])
            .await?;
        let row = client
            .query_one(
                "SELECT (SELECT n_tup_upd FROM pg_stat_user_tables \
                 WHERE relid = 'public.outbox'::regclass), \
                 (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())",
                &[],
            )
            .await?;
        Ok((row.get(0), row.get(1)))
    };
    let (updates, transactions) = read().await?;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(OUTAGE_SECS)).await;
    let (updates_after, transactions_after) = read().await?;
    let secs = started.elapsed().as_secs_f64();
    let cost = (
        (updates_after - updates) as f64 / secs,
        (transactions_after - transactions) as f64 / secs,
    );
    eprintln!(
        "    {OUTAGE_SECS} s more of the outage: {:.0} rows updated/s, {:.0} transactions/s",
        cost.0, cost.1
    );
    Ok(cost)
}

/// Rows the relay serving `/metrics` at `addr` has published (0 before it serves).
async fn published(addr: &str) -> i64 {
    let addr = addr.to_owned();
    let scraped = tokio::task::spawn_blocking(move || {
        testkit::scrape(&addr, "outbox_relay_rows_published_total{")
    });
    scraped.await.ok().flatten().unwrap_or(0.0) as i64
}

async fn left(client: &tokio_postgres::Client) -> Result<i64> {
    Ok(client
        .query_one("SELECT count(*) FROM public.outbox", &[])
        .await?
        .get(0))
}

pub(crate) fn print(p: &Partial) {
    println!(
        "| K. one Kafka broker of 3 down (mock cluster) | rows | to 10% | rows/s (10-90%) | \
         of them, the other partitions' | vs all up: all rows | vs all up: the other \
         partitions' rows | CPU µs a row: relay + mock brokers, PostgreSQL |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (name, f) in [
        ("every broker up: all rows", &p.all_up),
        ("broker 1 down: the other partitions' rows", &p.one_down),
    ] {
        println!(
            "| {name} | {} | {:.2}s | {:.0} | {:.0} | {:.2} | {:.2} | {:.1}, {:.1} |",
            f.rows,
            f.to_first_tenth.as_secs_f64(),
            f.rate,
            f.up_rate(),
            f.rate / p.all_up.rate,
            f.up_rate() / p.all_up.up_rate(),
            f.cpu_per_row.0,
            f.cpu_per_row.1
        );
    }
    println!(
        "\n{} rows held back while it was down. With only they left, for {OUTAGE_SECS} s more \
         of the outage: {:.0} rows updated a second (held keys' heads tried again), {:.0} \
         transactions a second. Once it was back they drained in {:.2}s.",
        p.held,
        p.outage_updates,
        p.outage_transactions,
        p.held_drained_in.as_secs_f64()
    );
}
