//! W: what the relay costs the application's writers. `outbox-bench --write-path` runs only
//! this.
//!
//! An outbox exists so that the application's transaction stays cheap: one more INSERT,
//! committed with the business write. W measures the writers' commit rate with pgbench
//! (`-M prepared`, `--writers` clients, `--write-secs` a run, one outbox row of topic
//! `orders`, key random in 1-1000, a transaction) on the benchmark's durable PostgreSQL,
//! in six arms, each on a table of its own schema:
//!
//! - `bare`: the columns `migrate` creates ([`BARE`]: `CREATE TABLE ... LIKE` the migrated
//!   table, `attempts` with its plain default 0), its primary key, no other index;
//! - `migrate`: the table as `outbox-relay migrate` of the binary under test leaves it
//!   (its indexes, its wake-up, its bookkeeping tables), no relay running; configured
//!   with `relay.ordering = "key"`, or as `--write-ordering` says (`none`: no bucket
//!   index);
//! - `bare + UPDATE`, `migrate + UPDATE`: the same two tables, each transaction a business
//!   UPDATE of one of 1,000 `accounts` rows before the INSERT;
//! - `no-notify + relay`, `migrate + relay`: one table switched before each run by
//!   running `migrate --no-notify` or `migrate` (no wake-up SQL lives here), with
//!   `outbox-relay run` (default relay settings, NATS sink) draining it meanwhile.
//!
//! Each run also counts PostgreSQL's CPU time per commit (every `postgres` process, the
//! writers' exited backends included): on a shared machine the commit rate follows what
//! else runs, the CPU a commit costs far less, and on a CPU-bound machine the rate
//! follows it. Its ratio, bare over migrated, is the share of the commit rate the
//! relay's table leaves the writers once the CPU is the limit.
//!
//! Every run starts equal: the arm's outbox emptied, `VACUUM ANALYZE`, `CHECKPOINT`, and
//! a first `bare` run not counted (see [`Bench::write_path`]). The arms of a writer count run one after the other, in reverse order every other round, so
//! drift spreads over both sides of each ratio. A relay run also checks that the relay
//! kept up: the rows pgbench committed are in the NATS stream, and the table is empty,
//! within [`DRAIN_WAIT`] of pgbench's end; the table shows both counts and the time, and
//! what the wake-up did: how many of the writers' commits sent a NOTIFY (a LISTEN session
//! of the benchmark's own counts them), the rows a batch of the relay (fewer rows a batch,
//! more claims a row) and the relay's CPU a row.
//!
//! pgbench runs as the benchmark's own user: it connects over TCP as role `postgres`,
//! which the throwaway server trusts, so the OS user does not matter.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::args::Args;
use crate::cpu::{cpu_secs, postgres_cpu_secs};
use crate::{pgbench, Bench};

/// The stream that captures the writers' subject while a relay runs.
const STREAM: &str = "WRITE";
/// The subject (the rows' topic) the writers' rows go to.
const SUBJECT: &str = "orders";
/// Rows of the `accounts` table the business UPDATE picks from (the keys' range too).
const ACCOUNTS: i64 = 1_000;
/// How long a relay run waits, after pgbench ends, for every row to be delivered.
const DRAIN_WAIT: Duration = Duration::from_secs(60);
/// How long a relay may take to answer `/readyz` with 200.
const READY_WAIT: Duration = Duration::from_secs(30);

/// The schema of the bare table (and its `accounts`).
const BARE: &str = "w_bare";
/// The schema of the table `migrate` leaves, with no relay (and its `accounts`).
const MIGRATED: &str = "w_migrate";
/// The schema of the table a relay drains, switched between `migrate` and `--no-notify`.
const RELAYED: &str = "w_relay";

/// One way of writing, measured at each writer count.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Arm {
    Bare,
    Migrated,
    BarePair,
    MigratedPair,
    Polled,
    Notified,
}

/// The arms in the order of odd rounds; even rounds run them backwards. Each ratio's two
/// sides are neighbours.
const ARMS: [Arm; 6] = [
    Arm::Bare,
    Arm::Migrated,
    Arm::BarePair,
    Arm::MigratedPair,
    Arm::Polled,
    Arm::Notified,
];

impl Arm {
    fn label(self) -> &'static str {
        match self {
            Arm::Bare => "bare",
            Arm::Migrated => "migrate",
            Arm::BarePair => "bare + UPDATE",
            Arm::MigratedPair => "migrate + UPDATE",
            Arm::Polled => "no-notify + relay",
            Arm::Notified => "migrate + relay",
        }
    }

    fn schema(self) -> &'static str {
        match self {
            Arm::Bare | Arm::BarePair => BARE,
            Arm::Migrated | Arm::MigratedPair => MIGRATED,
            Arm::Polled | Arm::Notified => RELAYED,
        }
    }

    /// The pgbench script: the INSERT, after the business UPDATE in the pair arms.
    fn script(self) -> String {
        let schema = self.schema();
        let insert = format!(
            "INSERT INTO {schema}.outbox (topic, key, payload) \
             VALUES ('{SUBJECT}', :k::text, '\\x7b7d');"
        );
        match self {
            Arm::BarePair | Arm::MigratedPair => format!(
                "\\set k random(1, {ACCOUNTS})\nBEGIN;\n\
                 UPDATE {schema}.accounts SET balance = balance + 1 WHERE id = :k;\n\
                 {insert}\nEND;\n"
            ),
            _ => format!("\\set k random(1, {ACCOUNTS})\n{insert}\n"),
        }
    }

    /// With a relay running: `Some(notify)`, the `migrate` run before (with or without its
    /// wake-up).
    fn relay(self) -> Option<bool> {
        match self {
            Arm::Polled => Some(false),
            Arm::Notified => Some(true),
            _ => None,
        }
    }
}

/// The relayed table's config, and where its relay serves `/readyz`.
struct Relayed {
    config: PathBuf,
    http: String,
}

/// What a relay run delivered.
pub(crate) struct Delivery {
    /// Rows pgbench committed (one a transaction).
    inserted: i64,
    /// Messages the stream stored.
    delivered: i64,
    /// Rows left in the table at the end of the wait.
    left: i64,
    /// From pgbench's end to the last row delivered and deleted (or the wait given up).
    drained_in: Duration,
    /// The writers' commits that sent a NOTIFY (heard by the benchmark's own LISTEN
    /// session, from pgbench's start to the end of the wait).
    notified: i64,
    /// Batches the relay committed (its `batch_duration_seconds` count) by the end of the
    /// wait.
    batches: i64,
    /// The relay process's CPU time per row pgbench committed, µs, from pgbench's start to
    /// the end of the wait.
    relay_cpu_us: f64,
}

/// One pgbench run.
pub(crate) struct Run {
    arm: Arm,
    writers: u32,
    round: u32,
    /// Transactions a second, without pgbench's connection time.
    tps: f64,
    /// PostgreSQL's CPU time per committed transaction, µs: every `postgres` process's
    /// from pgbench's start to its end (with a relay, its sessions' too), over the
    /// transactions pgbench committed. On a shared machine the rate varies with what
    /// else runs; the CPU a commit costs varies far less.
    cpu_us: f64,
    delivery: Option<Delivery>,
}

impl Bench {
    /// W, every arm at every writer count, `--write-rounds` times.
    pub(crate) async fn write_path(&self) -> Result<Vec<Run>> {
        let relayed = self.prepare_write_tables().await?;
        // A fresh cluster's first run writes WAL into new segment files, the later ones
        // into recycled ones: one run, not counted, so that the first arm pays no more.
        let most = self.a.writers.iter().copied().max().unwrap_or(1);
        let warm_up = self.write_run(Arm::Bare, most, 0, &relayed).await?;
        eprintln!(
            "    W. warm-up, {most} writers, bare: {:.0} tps",
            warm_up.tps
        );
        let mut runs = Vec::new();
        for &writers in &self.a.writers {
            for round in 1..=self.a.write_rounds {
                let mut arms = ARMS.to_vec();
                if round % 2 == 0 {
                    arms.reverse();
                }
                for arm in arms {
                    let run = self.write_run(arm, writers, round, &relayed).await?;
                    eprintln!(
                        "    W. {writers} writers, round {round}, {}: {:.0} tps, {:.1} µs of \
                         PostgreSQL CPU a commit{}",
                        arm.label(),
                        run.tps,
                        run.cpu_us,
                        run.delivery.as_ref().map_or(String::new(), |d| format!(
                            ", {} rows inserted, {} delivered, {} left after {:.2?}, \
                             {} commits notified, {:.1} rows a batch",
                            d.inserted,
                            d.delivered,
                            d.left,
                            d.drained_in,
                            d.notified,
                            d.delivered as f64 / d.batches.max(1) as f64
                        ))
                    );
                    runs.push(run);
                }
            }
        }
        Ok(runs)
    }

    /// Creates the arms' schemas: the migrated table, the bare one like it, `accounts` in
    /// both, and the relayed table's config (migrated by each relay run).
    async fn prepare_write_tables(&self) -> Result<Relayed> {
        let client = self.pg.connect("app").await?;
        for schema in [BARE, MIGRATED, RELAYED] {
            client
                .batch_execute(&format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
                ))
                .await?;
        }
        let migrated = self.write_config(MIGRATED, None)?;
        self.migrate(&migrated, true)?;
        // LIKE copies the columns, their NOT NULLs, defaults and identity, and no index or
        // trigger: the same row as the migrated table's, whatever the release adds. The
        // attempts column's default is the wake-up (migrations/notify.sql): the contract's
        // plain 0 instead.
        client
            .batch_execute(&format!(
                "CREATE TABLE {BARE}.outbox (LIKE {MIGRATED}.outbox \
                 INCLUDING DEFAULTS INCLUDING IDENTITY); \
                 ALTER TABLE {BARE}.outbox ADD PRIMARY KEY (id); \
                 ALTER TABLE {BARE}.outbox ALTER COLUMN attempts SET DEFAULT 0"
            ))
            .await?;
        for schema in [BARE, MIGRATED] {
            client
                .batch_execute(&format!(
                    "CREATE TABLE {schema}.accounts (id int PRIMARY KEY, balance bigint NOT NULL); \
                     INSERT INTO {schema}.accounts SELECT n, 0 FROM generate_series(1, {ACCOUNTS}) n"
                ))
                .await?;
        }
        let (section, http) = crate::scale::http_section();
        let config = self.write_config(RELAYED, Some(&section))?;
        Ok(Relayed { config, http })
    }

    /// A config for `schema.outbox`: the NATS sink and default relay settings but
    /// `--write-ordering`, `http` (an `[http]` section) when given.
    fn write_config(&self, schema: &str, http: Option<&str>) -> Result<PathBuf> {
        let path = self.dir.join(format!("{schema}.toml"));
        std::fs::write(
            &path,
            format!(
                "{}[postgres]\nurl = \"{}\"\n[relay]\nordering = \"{}\"\n[sink]\n\
                 kind = \"nats\"\n[sink.nats]\nurl = \"{}\"\n[[tables]]\n\
                 name = \"{schema}.outbox\"\n",
                http.unwrap_or_default(),
                self.db_url,
                self.a.write_ordering,
                self.nats.url()
            ),
        )?;
        Ok(path)
    }

    /// One run of `arm` with `writers` clients, from an emptied, vacuumed table after a
    /// checkpoint.
    async fn write_run(
        &self,
        arm: Arm,
        writers: u32,
        round: u32,
        relayed: &Relayed,
    ) -> Result<Run> {
        if let Some(notify) = arm.relay() {
            self.migrate(&relayed.config, notify)?;
        }
        let schema = arm.schema();
        let client = self.pg.connect("app").await?;
        client
            .batch_execute(&format!("TRUNCATE {schema}.outbox"))
            .await?;
        let accounts = match schema {
            RELAYED => String::new(),
            _ => format!(", {schema}.accounts"),
        };
        client
            .batch_execute(&format!("VACUUM ANALYZE {schema}.outbox{accounts}"))
            .await?;
        client.batch_execute("CHECKPOINT").await?;
        let script = self
            .dir
            .join(format!("write-{}.sql", arm.label().replace(' ', "")));
        std::fs::write(&script, arm.script())?;

        let cpu_us = |before: f64, transactions: i64| {
            (postgres_cpu_secs() - before) * 1e6 / transactions.max(1) as f64
        };
        if arm.relay().is_none() {
            let before = postgres_cpu_secs();
            let bench = pgbench::run(&self.db_url, writers, self.a.write_secs, &script).await?;
            return Ok(Run {
                arm,
                writers,
                round,
                tps: bench.tps,
                cpu_us: cpu_us(before, bench.transactions),
                delivery: None,
            });
        }
        self.nats_stream().await?;
        let mut relay = self.start_write_relay(relayed).await?;
        let relay_pid = relay.id().unwrap_or(0);
        // The writers' commits that notify, heard by a LISTEN session of the bench's own.
        let payload = format!("{RELAYED}.outbox");
        let notified =
            testkit::Notifications::listen(&self.db_url, "outbox_relay", Some(&payload)).await?;
        let (before, relay_before) = (postgres_cpu_secs(), cpu_secs(relay_pid));
        let bench = pgbench::run(&self.db_url, writers, self.a.write_secs, &script).await;
        let cpu_us = bench
            .as_ref()
            .map_or(0.0, |b| cpu_us(before, b.transactions));
        let delivery = match &bench {
            Ok(bench) => {
                let delivery = self.delivered(&client, bench.transactions).await;
                let relay_cpu_us =
                    (cpu_secs(relay_pid) - relay_before) * 1e6 / bench.transactions.max(1) as f64;
                let http = relayed.http.clone();
                let batches = tokio::task::spawn_blocking(move || {
                    testkit::scrape(&http, "outbox_relay_batch_duration_seconds_count{")
                })
                .await?
                .unwrap_or(0.0) as i64;
                Some(delivery.map(|d| Delivery {
                    notified: notified.count() as i64,
                    batches,
                    relay_cpu_us,
                    ..d
                }))
            }
            Err(_) => None,
        };
        // No id: it has exited already, and is reaped below.
        if let Some(pid) = relay.id() {
            let _ = testkit::send_signal(pid, testkit::Signal::Term);
        }
        relay.wait().await?;
        let bench = bench?;
        Ok(Run {
            arm,
            writers,
            round,
            tps: bench.tps,
            cpu_us,
            delivery: delivery.transpose()?,
        })
    }

    /// An empty stream capturing the writers' subject.
    async fn nats_stream(&self) -> Result<()> {
        let js = async_nats::jetstream::new(self.nats.client().await?);
        let _ = js.delete_stream(STREAM).await;
        self.nats.create_stream(STREAM, &[SUBJECT]).await
    }

    /// `outbox-relay run` against the relayed table, once its `/readyz` says 200.
    async fn start_write_relay(&self, relayed: &Relayed) -> Result<tokio::process::Child> {
        let mut cmd = Command::new(&self.a.relay);
        cmd.args(["run", "--config"])
            .arg(&relayed.config)
            .env("RUST_LOG", crate::drain::relay_log());
        testkit::die_with_parent(&mut cmd);
        let mut relay = tokio::process::Command::from(cmd).spawn()?;
        let started = Instant::now();
        loop {
            let probe = relayed.http.clone();
            let ready = tokio::task::spawn_blocking(move || testkit::http_get(&probe, "/readyz"))
                .await?
                .is_ok_and(|(status, _)| status == 200);
            if ready {
                return Ok(relay);
            }
            if let Some(status) = relay.try_wait()? {
                bail!("W: the relay exited with {status} before it was ready");
            }
            if started.elapsed() > READY_WAIT {
                let _ = relay.kill().await;
                bail!("W: the relay was not ready within {READY_WAIT:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits up to [`DRAIN_WAIT`] for `inserted` messages in the stream and an empty
    /// table; what it found then.
    async fn delivered(&self, client: &tokio_postgres::Client, inserted: i64) -> Result<Delivery> {
        let ended = Instant::now();
        loop {
            let delivered = self.nats.stream_state(STREAM).await?.0 as i64;
            let left: i64 = client
                .query_one(&format!("SELECT count(*) FROM {RELAYED}.outbox"), &[])
                .await?
                .get(0);
            let drained_in = ended.elapsed();
            if (delivered >= inserted && left == 0) || drained_in > DRAIN_WAIT {
                return Ok(Delivery {
                    inserted,
                    delivered,
                    left,
                    drained_in,
                    notified: 0,
                    batches: 0,
                    relay_cpu_us: 0.0,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The mean of `value` over `arm`'s runs at `writers`.
fn mean(runs: &[Run], arm: Arm, writers: u32, value: impl Fn(&Run) -> f64) -> f64 {
    let values: Vec<f64> = of(runs, arm, writers).map(value).collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

fn of(runs: &[Run], arm: Arm, writers: u32) -> impl Iterator<Item = &Run> {
    runs.iter()
        .filter(move |r| r.arm == arm && r.writers == writers)
}

/// One table: each writer count, `base` and `arm`'s rates per round, the ratio of their
/// means and the ratio of each round's pair.
fn ratio_table(title: &str, a: &Args, runs: &[Run], base: Arm, arm: Arm) {
    println!(
        "\n| {title} | {}: tps per round | {}: tps per round | {} / {}: means | per round |",
        base.label(),
        arm.label(),
        arm.label(),
        base.label()
    );
    println!("|---:|---|---|---:|---|");
    let list = |arm: Arm, writers: u32| {
        of(runs, arm, writers)
            .map(|r| format!("{:.0}", r.tps))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for &writers in &a.writers {
        let per_round: Vec<String> = of(runs, base, writers)
            .zip(of(runs, arm, writers))
            .map(|(b, r)| format!("{:.3}", r.tps / b.tps))
            .collect();
        println!(
            "| {writers} | {} | {} | {:.3} | {} |",
            list(base, writers),
            list(arm, writers),
            mean(runs, arm, writers, |r| r.tps) / mean(runs, base, writers, |r| r.tps),
            per_round.join(", ")
        );
    }
}

/// PostgreSQL's CPU per commit of each pair of arms, and the ratio of their means: what
/// the relay's table costs each commit, where the rates mostly show the machine.
fn cpu_table(a: &Args, runs: &[Run]) {
    let pairs = [
        (Arm::Bare, Arm::Migrated),
        (Arm::BarePair, Arm::MigratedPair),
        (Arm::Polled, Arm::Notified),
    ];
    print!("\n| W. PostgreSQL CPU a commit, µs (means): writers |");
    for (base, arm) in pairs {
        let (b, r) = (base.label(), arm.label());
        print!(" {b} | {r} | {b} / {r} |");
    }
    println!("\n|---:|{}", "---:|".repeat(3 * pairs.len()));
    for &writers in &a.writers {
        print!("| {writers} |");
        for (base, arm) in pairs {
            let cpu = |arm| mean(runs, arm, writers, |r: &Run| r.cpu_us);
            let (b, r) = (cpu(base), cpu(arm));
            print!(" {b:.1} | {r:.1} | {:.3} |", b / r);
        }
        println!();
    }
}

/// The command line, W's three tables and the relay runs' deliveries.
pub(crate) fn print(a: &Args, runs: &[Run], settings: &str) {
    let command: Vec<String> = std::env::args().collect();
    println!("`{}`\n", command.join(" "));
    println!("PostgreSQL: {settings}");
    println!(
        "\npgbench -M prepared, {} s a run, {} round{} (arms in reverse order every other \
         round)",
        a.write_secs,
        a.write_rounds,
        if a.write_rounds == 1 { "" } else { "s" }
    );
    ratio_table(
        "W. writers: one INSERT, no relay",
        a,
        runs,
        Arm::Bare,
        Arm::Migrated,
    );
    ratio_table(
        "W. writers: UPDATE + INSERT, no relay",
        a,
        runs,
        Arm::BarePair,
        Arm::MigratedPair,
    );
    ratio_table(
        "W. writers: one INSERT, a relay draining",
        a,
        runs,
        Arm::Polled,
        Arm::Notified,
    );
    cpu_table(a, runs);
    println!(
        "\n| W. relay runs: writers | round | arm | tps | rows inserted | delivered | left | \
         drained after pgbench | commits that notified | rows a batch | relay CPU a row, µs |"
    );
    println!("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        if let Some(d) = &r.delivery {
            println!(
                "| {} | {} | {} | {:.0} | {} | {} | {} | {:.2}s | {} | {:.1} | {:.1} |",
                r.writers,
                r.round,
                r.arm.label(),
                r.tps,
                d.inserted,
                d.delivered,
                d.left,
                d.drained_in.as_secs_f64(),
                d.notified,
                d.delivered as f64 / d.batches.max(1) as f64,
                d.relay_cpu_us
            );
        }
    }
}
