//! L: a database in another zone (issue 29). `outbox-bench --distant` runs only this.
//!
//! The NATS key-ordered `drain` of [`L_ROWS`] rows (the release binary, the benchmark's
//! workers and batch size), first straight to PostgreSQL on loopback, then through
//! [`testkit::Proxy`] delaying every chunk each way by half of each round trip in
//! [`ROUND_TRIPS_MS`]; each rate as a ratio to the loopback one (goal at 10 ms: >= 0.7).
//! A run through the proxy with no delay is the baseline of the proxy's own cost (it
//! copies every byte on these same two cores). Round trips per batch are the proxy's count
//! ([`Proxy::round_trips`]) over the drain's batches of `--batch` rows; with no delay,
//! pipelined requests may be answered before the next is sent, so that row counts high.

use std::time::Duration;

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
}

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
            let url = match round_trip_ms {
                None => self.db_url.clone(),
                Some(ms) => {
                    proxy.set(if ms == 0 {
                        Fault::None
                    } else {
                        Fault::Latency(Duration::from_micros(ms * 500))
                    });
                    through.clone()
                }
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
            });
        }
        Ok(out)
    }
}

pub(crate) fn print(runs: &[Distant]) {
    println!(
        "| L. drain to NATS, key order, {L_ROWS} rows, database at | rows/s | vs loopback | round trips per batch | CPU s/100k |"
    );
    println!("|---|---|---|---|---|");
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
            "| {at} | {:.0} | {:.2} | {} | {:.2} |",
            r.row.rate(),
            r.row.rate() / base,
            r.per_batch.map_or("-".to_owned(), |n| format!("{n:.1}")),
            r.row.cpu_per_100k.unwrap_or(f64::NAN)
        );
    }
}
