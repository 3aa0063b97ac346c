//! L: a database in another zone (issue 29). `outbox-bench --distant` runs only this.
//!
//! The NATS key-ordered `drain` of [`L_ROWS`] rows (the release binary, the benchmark's
//! workers and batch size), first straight to PostgreSQL on loopback, then through
//! [`testkit::Proxy`] delaying every chunk each way by half of each round trip in
//! [`ROUND_TRIPS_MS`]; each rate as a ratio to the loopback one (goal at 10 ms: >= 0.7).
//! A run through the proxy with no delay is the baseline of the proxy's own cost (it
//! copies every byte on these same two cores).
//!
//! Each delay is calibrated ([`calibrate`]) so that a round trip through the proxy
//! measures what the row says: the proxy's timer fires on the first millisecond tick
//! after its deadline, and its task then waits for a core, so a nominal 5 ms each way
//! measured 12.4 ms a round trip. The table shows the measured round trip (`SELECT 1`,
//! median of [`PINGS`]) next to each row. `BENCH_DISTANT_NOMINAL=1` keeps the nominal
//! delays (the runs before 2026-11-27 had them). Round trips per batch are the proxy's count
//! ([`Proxy::round_trips`]) over the drain's batches of `--batch` rows; with no delay,
//! pipelined requests may be answered before the next is sent, so that row counts high.

use std::time::{Duration, Instant};

use anyhow::Result;
use testkit::{Fault, Proxy};

use crate::drain::Row;
use crate::Bench;

/// Rows of each L drain.
pub(crate) const L_ROWS: i64 = 100_000;
/// The round trips L adds, in milliseconds.
const ROUND_TRIPS_MS: [u64; 4] = [1, 5, 10, 20];

/// One L drain: the round trip the proxy added (`None`: loopback, no proxy) and its row.
pub(crate) struct Distant {
    pub(crate) round_trip_ms: Option<u64>,
    pub(crate) row: Row,
    /// Round trips through the proxy per batch of the drain (every connection of the relay
    /// counted, its background readers' included; `None` on loopback).
    pub(crate) per_batch: Option<f64>,
    /// A `SELECT 1` round trip to the database as the drain reached it, in ms (median).
    pub(crate) measured_ms: f64,
}

/// `SELECT 1`s timed for each measured round trip.
const PINGS: usize = 31;

/// The median round trip of `SELECT 1` on a session at `url`, in milliseconds.
async fn measure_round_trip(url: &str) -> Result<f64> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let mut took = Vec::with_capacity(PINGS);
    for _ in 0..PINGS {
        let started = Instant::now();
        client.simple_query("SELECT 1").await?;
        took.push(started.elapsed().as_secs_f64() * 1e3);
    }
    took.sort_by(f64::total_cmp);
    Ok(took[PINGS / 2])
}

/// Sets `proxy`'s delay so that a round trip through it to `url` measures `ms`: half of
/// `ms` each way, then less half of what a round trip measured beyond `ms` (the proxy's own
/// cost, see the module doc), measured again, up to [`CALIBRATIONS`] times, until within
/// [`WITHIN_MS`]. Returns the round trip measured last.
async fn calibrate(proxy: &Proxy, url: &str, ms: u64) -> Result<f64> {
    let nominal = Duration::from_micros(ms * 500);
    let mut each_way = nominal;
    proxy.set(Fault::Latency(each_way));
    let mut measured = measure_round_trip(url).await?;
    eprintln!("    round trip {measured:.2} ms with {each_way:?} each way");
    if std::env::var_os("BENCH_DISTANT_NOMINAL").is_some() {
        return Ok(measured);
    }
    for _ in 0..CALIBRATIONS {
        let off = measured - ms as f64;
        if off.abs() <= WITHIN_MS {
            break;
        }
        let half = Duration::from_secs_f64(off.abs() / 2e3);
        each_way = match off > 0.0 {
            true => each_way.saturating_sub(half),
            false => (each_way + half).min(nominal),
        };
        proxy.set(Fault::Latency(each_way));
        measured = measure_round_trip(url).await?;
        eprintln!("    round trip {measured:.2} ms with {each_way:?} each way");
    }
    Ok(measured)
}

/// Measurements [`calibrate`] may take after the first.
const CALIBRATIONS: usize = 3;
/// How close to the row's round trip [`calibrate`] aims, in milliseconds.
const WITHIN_MS: f64 = 0.2;

impl Bench {
    /// L: loopback, the proxy with no delay, then each round trip.
    pub(crate) async fn distant(&self) -> Result<Vec<Distant>> {
        let proxy = Proxy::start(([127, 0, 0, 1], self.pg.port()).into())?;
        let through = self.db_url.replace(
            &format!(":{}/", self.pg.port()),
            &format!(":{}/", proxy.port()),
        );
        anyhow::ensure!(
            through != self.db_url,
            "no port to replace in {}",
            self.db_url
        );
        let mut out = Vec::new();
        let runs = [None, Some(0)]
            .into_iter()
            .chain(ROUND_TRIPS_MS.into_iter().map(Some));
        for round_trip_ms in runs {
            let (url, measured_ms) = match round_trip_ms {
                None => (self.db_url.clone(), measure_round_trip(&self.db_url).await?),
                Some(0) => {
                    proxy.set(Fault::None);
                    (through.clone(), measure_round_trip(&through).await?)
                }
                Some(ms) => (through.clone(), calibrate(&proxy, &through, ms).await?),
            };
            eprintln!("==> L: {L_ROWS} rows, round trip {round_trip_ms:?} ms");
            self.seed_rows(0, L_ROWS).await?;
            self.reset_nats().await?;
            let stats = self.pg.connect("app").await?;
            let profile = self.statements(&stats, None).await?;
            let before = proxy.round_trips();
            let row = self.timed_drain_at(&url, L_ROWS).await?;
            self.statements(&stats, Some(profile)).await?;
            let batches = L_ROWS as f64 / self.a.batch as f64;
            let per_batch = round_trip_ms.map(|_| (proxy.round_trips() - before) as f64 / batches);
            eprintln!("    {:.0} rows/s", row.rate());
            out.push(Distant {
                round_trip_ms,
                row,
                per_batch,
                measured_ms,
            });
        }
        Ok(out)
    }
}

pub(crate) fn print(runs: &[Distant]) {
    println!(
        "| L. drain to NATS, key order, {L_ROWS} rows, database at | measured round trip, ms | rows/s | vs loopback | round trips per batch | CPU s/100k |"
    );
    println!("|---|---|---|---|---|---|");
    let base = runs
        .iter()
        .find(|r| r.round_trip_ms.is_none())
        .map_or(f64::NAN, |r| r.row.rate());
    for r in runs {
        let at = match r.round_trip_ms {
            None => "loopback".to_owned(),
            Some(0) => "the proxy, no delay".to_owned(),
            Some(ms) => format!("the proxy, {ms} ms round trip"),
        };
        println!(
            "| {at} | {:.2} | {:.0} | {:.2} | {} | {:.2} |",
            r.measured_ms,
            r.row.rate(),
            r.row.rate() / base,
            r.per_batch.map_or("-".to_owned(), |n| format!("{n:.1}")),
            r.row.cpu_per_100k.unwrap_or(f64::NAN)
        );
    }
}
