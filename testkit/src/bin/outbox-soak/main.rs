//! The fault soak (issue 16): `outbox-relay run` in 2-3 processes through PgBouncer,
//! TCP proxies and a three-server NATS cluster, while a writer commits rows and seeded
//! faults fire one after another; then an independent audit of the table and the stream.
//! Run it through `scripts/soak`. Not a test: it prints a table; it exits 1 when the audit
//! finds a lost row, a phantom, a key out of order or a good row dead-lettered.
//!
//! The run:
//! 1. [`world`]: durable PostgreSQL, PgBouncer (transaction mode), three `nats-server`s
//!    with a stream of 3 replicas, a proxy per relay to the database and one per NATS
//!    server; `outbox-relay migrate`; the relays start (mark mode, key order).
//! 2. [`writer`]: a steady writer (a transaction every 10 ms), NULL keys, poison rows,
//!    and sessions that hold transactions open for seconds (some rolled back).
//! 3. [`faults`]: `--faults` faults over `--minutes`, one at a time, each healed.
//! 4. The writer stops, every fault is healed, the relays get `--settle-secs` to publish
//!    what is left, and are stopped with SIGTERM.
//! 5. [`audit`]: the table against the stream (read back from the cluster); the report.

mod args;
mod audit;
mod faults;
mod world;
mod writer;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;
use clap::Parser;

use args::Args;
use audit::{Findings, Message, TableRow};
use faults::{Fired, Schedule};
use world::{World, STREAM};

#[tokio::main]
async fn main() -> Result<ExitCode> {
    let a = Args::parse();
    eprintln!(
        "==> soak: {} min, {} faults, seed {}, {} relays, {} rows/s over {} keys",
        a.minutes, a.faults, a.seed, a.relays, a.rate, a.keys
    );
    let mut world = World::start(&a.relay, a.relays as usize).await?;
    eprintln!(
        "==> servers up, relays started; logs in {}",
        world.dir.display()
    );

    let writer = writer::Writer::start(world.pg.url("app"), a.rate, a.keys, a.seed);
    let sends = count_sends(&world).await?;
    let writing_from = SystemTime::now();
    let mut schedule = Schedule::new(a.seed, a.minutes, a.faults);
    let began = Instant::now();
    for n in 0..a.faults {
        let slot_start = began + schedule.slot * n;
        schedule.run_slot(&mut world, slot_start).await?;
        if (n + 1) % 10 == 0 || n + 1 == a.faults {
            let f = schedule.fired.last().unwrap();
            eprintln!(
                "    {:>4}/{} faults, {:>5.0} s: last {:?}{}",
                n + 1,
                a.faults,
                began.elapsed().as_secs_f64(),
                f.kind,
                f.target.map(|t| format!(" #{t}")).unwrap_or_default()
            );
        }
    }
    let writing_to = SystemTime::now();
    let written = writer.stop().await;
    eprintln!(
        "==> writer stopped; waiting up to {} s for the relays to settle",
        a.settle_secs
    );
    let settled = settle(&mut world, Duration::from_secs(a.settle_secs)).await?;
    let exit_codes = tokio::task::block_in_place(|| world.relays.stop_all());

    eprintln!("==> audit: reading the table and the stream");
    let table = read_table(&world).await?;
    let stream: Vec<Message> = world
        .nats
        .read_stream(STREAM)
        .await?
        .into_iter()
        .map(|m| Message {
            msg_id: m.header("Nats-Msg-Id").map(str::to_owned),
            subject: m.subject,
            payload: m.payload,
            stored_at: m.stored_at,
        })
        .collect();
    let acked = written.acked.lock().unwrap().clone();
    let findings = audit::audit(&table, &stream, &acked, (writing_from, writing_to));
    let sends = sends.finish().await;

    let report = Report {
        a: &a,
        fired: &schedule.fired,
        findings: &findings,
        written: &written,
        sends,
        settled,
        exit_codes,
        world: &world,
        elapsed: began.elapsed(),
    };
    report.print();
    world.keep = !findings.clean();
    Ok(if findings.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Waits until no good row is pending and every poison row is dead, restarting relays
/// that exit; returns how long that took (`None`: not within `limit`).
async fn settle(world: &mut World, limit: Duration) -> Result<Option<Duration>> {
    let start = Instant::now();
    let mut client = world.db().await?;
    loop {
        let left: Result<i64, _> = client
            .query_one(
                "SELECT count(*) FROM public.outbox WHERE published_at IS NULL AND dead_at IS NULL",
                &[],
            )
            .await
            .map(|r| r.get(0));
        match left {
            Ok(0) => return Ok(Some(start.elapsed())),
            Ok(_) => {}
            Err(_) => client = world.db().await?,
        }
        if start.elapsed() > limit {
            return Ok(None);
        }
        faults::idle_until(world, Instant::now() + Duration::from_millis(500)).await?;
    }
}

async fn read_table(world: &World) -> Result<Vec<TableRow>> {
    let client = world.db().await?;
    let rows = client
        .query(
            "SELECT id, key, topic, payload, published_at IS NOT NULL, dead_at IS NOT NULL \
             FROM public.outbox",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| TableRow {
            id: r.get(0),
            key: r.get(1),
            topic: r.get(2),
            payload: r.get(3),
            published: r.get(4),
            dead: r.get(5),
        })
        .collect())
}

/// Every publish the servers see on the stream's subjects, counted by a core NATS
/// subscriber connected to the servers directly: each relay send, before JetStream's
/// `Nats-Msg-Id` dedupe drops a repeat. A lower bound: it misses what is sent while its
/// own server is down.
struct Sends {
    task: tokio::task::JoinHandle<(u64, usize)>,
    stop: tokio::sync::oneshot::Sender<()>,
}

impl Sends {
    async fn finish(self) -> (u64, usize) {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

async fn count_sends(world: &World) -> Result<Sends> {
    use futures_util::StreamExt;
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(world.nats.urls())
        .await?;
    let mut sub = client.subscribe(world::SUBJECTS).await?;
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let _client = client;
        let (mut total, mut ids) = (0u64, std::collections::HashSet::new());
        loop {
            tokio::select! {
                m = sub.next() => match m {
                    Some(m) => {
                        total += 1;
                        if let Some(id) = m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
                            ids.insert(id.to_string());
                        }
                    }
                    None => break,
                },
                _ = &mut stopped => break,
            }
        }
        (total, ids.len())
    });
    Ok(Sends { task, stop })
}

struct Report<'a> {
    a: &'a Args,
    fired: &'a [Fired],
    findings: &'a Findings,
    written: &'a writer::Written,
    /// (sends seen, distinct ids among them)
    sends: (u64, usize),
    settled: Option<Duration>,
    exit_codes: Vec<Option<i32>>,
    world: &'a World,
    elapsed: Duration,
}

impl Report<'_> {
    /// Stalls that overlap no fault (nor begin within a second of one's end).
    fn unexplained_stalls(&self) -> usize {
        self.findings
            .stalls
            .iter()
            .filter(|(at, d)| {
                !self
                    .fired
                    .iter()
                    .any(|x| x.start <= *at + *d && x.end + Duration::from_secs(1) >= *at)
            })
            .count()
    }

    fn print(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let (a, f, w) = (self.a, self.findings, self.written);
        println!(
            "\n## Soak: {:.1} min, {} faults, seed {}, {} relays (relay 0 through PgBouncer), \
             3-server NATS cluster\n",
            self.elapsed.as_secs_f64() / 60.0,
            self.fired.len(),
            a.seed,
            a.relays
        );
        println!(
            "Command: `scripts/soak --minutes {} --faults {} --seed {}`\n",
            a.minutes, a.faults, a.seed
        );
        println!(
            "| fault | fired | seen | stalls >= {:.1} s during it | longest |\n|---|---:|---|---:|---:|",
            audit::STALL.as_secs_f64()
        );
        let mut kinds: BTreeMap<faults::Kind, (usize, BTreeMap<String, usize>)> = BTreeMap::new();
        for fired in self.fired {
            let e = kinds.entry(fired.kind).or_default();
            e.0 += 1;
            if !fired.note.is_empty() {
                *e.1.entry(fired.note.clone()).or_default() += 1;
            }
        }
        for (kind, (n, notes)) in &kinds {
            let notes: Vec<String> = notes.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            // Stalls that overlap a fault of this kind (or begin within a second of its end).
            let during: Vec<Duration> = f
                .stalls
                .iter()
                .filter(|(at, d)| {
                    self.fired.iter().any(|x| {
                        x.kind == *kind
                            && x.start <= *at + *d
                            && x.end + Duration::from_secs(1) >= *at
                    })
                })
                .map(|(_, d)| *d)
                .collect();
            let longest = during
                .iter()
                .max()
                .map(|d| format!("{:.1} s", d.as_secs_f64()))
                .unwrap_or_else(|| "-".into());
            println!(
                "| {} | {n} | {} | {} | {longest} |",
                kind.label(),
                notes.join(", "),
                during.len()
            );
        }
        // Poison rows are dead-lettered at ERROR by design; every other ERROR is shown.
        let errors: Vec<String> = self
            .world
            .relays
            .log_lines("ERROR")
            .into_iter()
            .filter(|l| !l.contains("subject \"poison."))
            .collect();
        let stall = f.longest_stall.map(|(at, d)| {
            let during: Vec<&str> = self
                .fired
                .iter()
                .filter(|x| x.start <= at + d && x.end + Duration::from_secs(1) >= at)
                .map(|x| x.kind.label())
                .collect();
            format!(
                "{:.1} s (during: {})",
                d.as_secs_f64(),
                if during.is_empty() {
                    "no fault".into()
                } else {
                    during.join("; ")
                }
            )
        });
        let rows = [
            ("rows committed (table)", f.rows.to_string()),
            ("  of them poison", f.poison_rows.to_string()),
            (
                "  commits the writer saw, missing from the table",
                f.acked_missing.len().to_string(),
            ),
            (
                "  ambiguous commits (answer lost)",
                w.ambiguous.load(Relaxed).to_string(),
            ),
            (
                "  long transactions committed late",
                w.long_committed.load(Relaxed).to_string(),
            ),
            (
                "  rows rolled back on purpose",
                w.rolled_back.load(Relaxed).to_string(),
            ),
            (
                "delivered (distinct ids in the stream)",
                f.delivered.to_string(),
            ),
            ("**lost**", f.lost().to_string()),
            (
                "  marked published, not in the stream",
                f.marked_not_stored.len().to_string(),
            ),
            (
                "  still pending at the end",
                f.undelivered.len().to_string(),
            ),
            ("**phantom**", f.phantoms.len().to_string()),
            (
                "**order violations** (keys)",
                f.order_violations.len().to_string(),
            ),
            (
                "duplicates stored (past the dedupe window)",
                f.duplicates.to_string(),
            ),
            (
                "sends seen by a core subscriber / distinct",
                format!(
                    "{} / {} (re-sends >= {})",
                    self.sends.0,
                    self.sends.1,
                    self.sends.0.saturating_sub(self.sends.1 as u64)
                ),
            ),
            (
                "dead-lettered poison / poison rows",
                format!("{} / {}", f.poison_dead, f.poison_rows),
            ),
            ("**good rows dead-lettered**", f.good_dead.len().to_string()),
            (
                "longest delivery stall while writing",
                stall.unwrap_or_else(|| "-".into()),
            ),
            (
                "stalls >= 0.5 s / of them outside any fault",
                format!("{} / {}", f.stalls.len(), self.unexplained_stalls()),
            ),
            (
                "settled after the writer stopped",
                self.settled
                    .map(|d| format!("{:.1} s", d.as_secs_f64()))
                    .unwrap_or_else(|| format!("NOT within {} s", a.settle_secs)),
            ),
            (
                "relay exits nobody asked for",
                self.world.relays.unrequested_exits.len().to_string(),
            ),
            (
                "SIGTERMs not obeyed within drain_timeout + 5 s",
                self.world.relays.slow_exits.len().to_string(),
            ),
            ("final SIGTERM exit codes", format!("{:?}", self.exit_codes)),
            (
                "relay log lines at ERROR (besides poison dead-lettered)",
                errors.len().to_string(),
            ),
        ];
        println!("\n| audit | |\n|---|---:|");
        for (k, v) in rows {
            println!("| {k} | {v} |");
        }
        let show = |what: &str, items: Vec<String>| {
            if !items.is_empty() {
                println!(
                    "\n{what} (first 10): {}",
                    items.into_iter().take(10).collect::<Vec<_>>().join(", ")
                );
            }
        };
        show(
            "lost, marked",
            f.marked_not_stored.iter().map(|i| i.to_string()).collect(),
        );
        show(
            "lost, pending",
            f.undelivered.iter().map(|i| i.to_string()).collect(),
        );
        show("phantoms", f.phantoms.clone());
        show(
            "order violations",
            f.order_violations
                .iter()
                .map(|(k, a, b)| format!("{k}: {a} before {b}"))
                .collect(),
        );
        show(
            "good rows dead",
            f.good_dead.iter().map(|i| i.to_string()).collect(),
        );
        if !errors.is_empty() {
            println!("\nrelay errors (first 10 of {}):", errors.len());
            for line in errors.iter().take(10) {
                println!("    {line}");
            }
        }
        for (i, status, tail) in &self.world.relays.unrequested_exits {
            println!("\nrelay {i} exited by itself ({status}):\n{tail}");
        }
        println!(
            "\nVerdict: {}",
            if f.clean() {
                "clean (lost 0, phantom 0, order violations 0)"
            } else {
                "FAILED"
            }
        );
    }
}
