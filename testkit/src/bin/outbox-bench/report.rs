//! The tables and summary lines printed at the end of a run.

use anyhow::Result;
use testkit::Postgres;

use crate::drain::Row;
use crate::steady::{Latency, Steady};
use crate::{Bench, SMALL_ROWS, STEADY_RATE};

/// The PostgreSQL settings the run used, as `name=value` pairs.
pub(crate) async fn settings(pg: &Postgres) -> Result<String> {
    let client = pg.connect("app").await?;
    let mut shown = Vec::new();
    for name in [
        "server_version",
        "fsync",
        "synchronous_commit",
        "full_page_writes",
        "shared_buffers",
        "max_wal_size",
        "checkpoint_timeout",
        "shared_preload_libraries",
    ] {
        let value: String = client.query_one(&format!("SHOW {name}"), &[]).await?.get(0);
        shown.push(format!("{name}={value}"));
    }
    Ok(shown.join(", "))
}

/// A latency in milliseconds; an infinite one is a row that never arrived.
fn ms(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.1} ms")
    } else {
        "missing".to_owned()
    }
}

/// Prints every table, in the order the measurements ran.
pub(crate) fn print(
    bench: &Bench,
    rows: Vec<Row>,
    settings: &str,
    steady: Option<Steady>,
    held: Option<Vec<(Latency, i64)>>,
    retention: Option<Vec<(Latency, i64, f64)>>,
) {
    drains(bench, &rows, settings);
    steady_state(bench, steady);
    held_snapshot(held);
    mark_retention(bench, retention);
}

/// A, B, C, C', E and F: one row per measurement, with each drain as a ratio to min(A, B).
fn drains(bench: &Bench, rows: &[Row], settings: &str) {
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
        "| measurement | rows/s | vs min(A, B) | peak RSS | CPU s / 100k rows | machine cores busy | stored / left |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let ratio = match r.broker {
            "" => "limit".to_owned(),
            b => limit_of(b, r.ordering).map_or("-".into(), |l| format!("{:.2}", r.rate() / l)),
        };
        println!(
            "| {} | {:.0} | {} | {} | {} | {:.2} | {} |",
            r.name,
            r.rate(),
            ratio,
            r.rss_mb.map_or("-".into(), |m| format!("{m:.0} MB")),
            r.cpu_per_100k.map_or("-".into(), |c| format!("{c:.2}")),
            r.cores_busy,
            r.stored_left
                .map_or("-".into(), |(stored, left)| format!("{stored} / {left}")),
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
}

/// D: latency per writer rate, and the idle relay's exit after SIGTERM.
fn steady_state(bench: &Bench, steady: Option<Steady>) {
    if let Some(steady) = steady {
        println!(
            "\nD. steady state, `outbox-relay run` with default relay settings, NATS, \
             {}s per rate; commit-to-consumer latency\n",
            bench.a.steady_secs
        );
        println!(
            "| writer rows/s | achieved rows/s | rows | delivered | missing after 10 s | p50 | p99 | max |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
        for l in &steady.rates {
            println!(
                "| {} | {:.0} | {} | {} | {} | {} | {} | {} |",
                l.label,
                l.achieved_rate,
                l.rows,
                l.delivered,
                l.rows - l.delivered,
                ms(l.p50_ms),
                ms(l.p99_ms),
                ms(l.max_ms)
            );
        }
        println!(
            "\nA row the consumer did not get within 10 s of the writer's last commit is \
             missing and counts as infinitely late in the percentiles."
        );
        println!(
            "\nIdle relay: exit {} {:.0} ms after SIGTERM.",
            steady.exit_code, steady.exit_ms
        );
    }
}

/// G: latency per minute while a snapshot is held, against the minute before.
fn held_snapshot(held: Option<Vec<(Latency, i64)>>) {
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
                "| {} | {} | {} | {} | {} | {} | {:.2} | {} |",
                l.label,
                l.rows,
                l.delivered,
                dead,
                ms(l.p50_ms),
                ms(l.p99_ms),
                l.p99_ms / before,
                ms(l.max_ms)
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
}

/// H: the table's rows and size once per retention in mark mode.
fn mark_retention(bench: &Bench, retention: Option<Vec<(Latency, i64, f64)>>) {
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
                "| {} | {written} | {rows} | {mb:.1} MB | {} | {} | {} |",
                l.label,
                ms(l.p50_ms),
                ms(l.p99_ms),
                ms(l.max_ms)
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
}
