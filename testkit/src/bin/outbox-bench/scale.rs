//! S, R, I, E3 and M: the shapes of real deployments rather than one process on one
//! table. `outbox-bench --scale` runs only these (M only when named in `--scale-parts`).
//!
//! - S. Replicas and workers: `R` `outbox-relay drain` processes of `W` workers each,
//!   started at once on one table of 200,000 rows, on 2,000 keys and on 20 hot keys; the
//!   aggregate rate, timed from the first start to the last exit, as a ratio to 1 x 4.
//! - R. Replicas already running, as sidecars are: the same shapes as `outbox-relay run`
//!   processes (the wake-up installed), started on the empty table and ready
//!   (`/readyz`), then 200,000 rows committed in one transaction; the aggregate rate from
//!   that commit to the stream holding every row, as a ratio to 1 x 4. No process
//!   start-up or exit is in its timing, which S's drains pay once per relay.
//! - I. Idle tables: `outbox-relay run` watching 1, 10 and 50 quiet tables (the
//!   wake-up installed), and 50 without it (polling only), and 500 with the wake-up when
//!   `I500` is named; start-up is timed from the process's start to the stream holding the
//!   one row each table held (every table's first claim); over 15 s after that, the cores
//!   the relay and every PostgreSQL process used and the transactions per second
//!   PostgreSQL counted, and the series one `/metrics` scrape returns; then the wake-up: a
//!   row in a random table, from commit to the consumer, 20 times.
//! - E3. A held snapshot and a new process: one session holds a REPEATABLE READ snapshot,
//!   300,000 rows (10,000 keys, 200-byte payloads) are drained by one `drain` (4 workers,
//!   batches of 1,000); the table is analyzed empty, as autovacuum does after such a
//!   drain; 300,000 more are inserted and drained by a new `drain` process, behind the
//!   deleted rows VACUUM cannot remove, with no ANALYZE between the fill and the drain.
//! - M. One busy table among idle ones: a `drain` (4 workers, batches of 500) of 200,000
//!   rows over 2,000 keys, alone and with 49 (then 499) empty tables configured after it,
//!   alternated, two rounds each; then the same as R measures it (`run`, ready before the
//!   rows commit at once); the rate with them as a ratio to the rate alone.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;

use crate::cpu::{cpu_secs, postgres_cpu_secs, MachineCpu};
use crate::steady::percentile;
use crate::Bench;

/// Rows of each S drain.
const S_ROWS: i64 = 200_000;
/// (relays, workers) of S, the first being the reference.
const SHAPES: [(usize, usize); 6] = [(1, 4), (1, 16), (2, 4), (4, 4), (8, 4), (1, 1)];
/// How long I measures an idle relay.
const IDLE_SECS: u64 = 15;
/// Rows of each M drain, and its rounds.
const M_ROWS: i64 = 200_000;
const M_ROUNDS: usize = 2;
/// Rows of each E3 drain.
const E3_ROWS: i64 = 300_000;

/// S's shapes as (keys, relays, workers): every one of [`SHAPES`] on 2,000 and on 20 keys,
/// or the list in `BENCH_SCALE_SHAPES`.
fn chosen_shapes() -> Result<Vec<(i64, usize, usize)>> {
    let Ok(list) = std::env::var("BENCH_SCALE_SHAPES") else {
        return Ok([2_000, 20]
            .into_iter()
            .flat_map(|k| SHAPES.map(|(r, w)| (k, r, w)))
            .collect());
    };
    list.split(',')
        .map(|item| {
            let parsed = item.trim().split_once(':').and_then(|(k, rw)| {
                let (r, w) = rw.split_once('x')?;
                Some((k.parse().ok()?, r.parse().ok()?, w.parse().ok()?))
            });
            parsed.with_context(|| {
                format!("BENCH_SCALE_SHAPES: {item:?} is not KEYS:RELAYSxWORKERS (e.g. 2000:8x4)")
            })
        })
        .collect()
}

/// How S and R start the relays of a shape.
#[derive(Clone, Copy)]
enum Part {
    /// S: `drain` processes started at once on the filled table.
    Drains,
    /// R: `run` processes, ready on the empty table before the rows commit.
    Running,
}

impl Part {
    fn letter(self) -> &'static str {
        match self {
            Part::Drains => "S",
            Part::Running => "R",
        }
    }
}

/// One S or R line.
pub(crate) struct Shape {
    pub(crate) keys: i64,
    pub(crate) relays: usize,
    pub(crate) workers: usize,
    pub(crate) drained: Drained,
}

/// What a set of drains did: the aggregate rate, and the CPU seconds per 100,000 rows of
/// the relays together and of the whole machine (PostgreSQL, nats-server and the relays:
/// a backend's own CPU time is gone from `/proc` once its relay disconnects).
#[derive(Clone, Copy)]
pub(crate) struct Drained {
    pub(crate) rate: f64,
    pub(crate) relay_cpu: f64,
    pub(crate) machine_cpu: f64,
    /// Rows per transaction PostgreSQL counted: how full the claims were.
    pub(crate) rows_per_xact: f64,
}

/// One I line.
pub(crate) struct Idle {
    pub(crate) tables: usize,
    pub(crate) notify: bool,
    pub(crate) relay_cores: f64,
    pub(crate) pg_cores: f64,
    pub(crate) xact_per_sec: f64,
    pub(crate) wake_p50_ms: f64,
    pub(crate) wake_p99_ms: f64,
    /// From the process's start to every table's first row in the stream.
    pub(crate) startup_secs: f64,
    /// Samples in one `/metrics` scrape (lines that are not comments).
    pub(crate) series: usize,
}

/// M's rates: each round's (alone, among them), for `drain` and for `run`.
pub(crate) struct Among {
    pub(crate) idle: usize,
    pub(crate) drain: Vec<(f64, f64)>,
    pub(crate) run: Vec<(f64, f64)>,
}

/// What `--scale` measured.
pub(crate) struct Scale {
    pub(crate) shapes: Vec<Shape>,
    /// R: the same shapes, running before the rows came.
    pub(crate) running: Vec<Shape>,
    pub(crate) idle: Vec<Idle>,
    /// E3: the first drain's rate, the new process's rate.
    pub(crate) history: (f64, f64),
    /// M: for 49 and 499 idle tables.
    pub(crate) among: Vec<Among>,
}

/// CPU seconds so far of some processes (summed) and of every PostgreSQL process: two
/// readings, [`Cpu::since`], give what a stretch cost each.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cpu {
    pub(crate) processes: f64,
    pub(crate) postgres: f64,
}

impl Cpu {
    pub(crate) fn now(pids: &[u32]) -> Cpu {
        Cpu {
            processes: pids.iter().copied().map(cpu_secs).sum(),
            postgres: postgres_cpu_secs(),
        }
    }

    /// The CPU seconds used from `earlier` to this reading.
    pub(crate) fn since(self, earlier: Cpu) -> Cpu {
        Cpu {
            processes: self.processes - earlier.processes,
            postgres: self.postgres - earlier.postgres,
        }
    }
}

/// Messages the benchmark's stream holds now (0 while it cannot be asked): polled by S and
/// R to see when the last row arrived.
async fn stored_so_far(js: &async_nats::jetstream::Context) -> u64 {
    match js.get_stream("BENCH").await {
        Ok(mut stream) => stream.info().await.map_or(0, |i| i.state.messages),
        Err(_) => 0,
    }
}

/// An `[http]` section on a free port, and that address: a relay run as a sidecar serves
/// its endpoints.
pub(crate) fn http_section() -> (String, String) {
    let addr = format!("127.0.0.1:{}", testkit::free_port());
    (format!("[http]\nlisten = \"{addr}\"\n"), addr)
}

impl Bench {
    /// A relay config for NATS with `workers`, `batch`, and `tables` (`[[tables]]` names).
    fn scale_config(&self, workers: usize, batch: usize, tables: &[String]) -> String {
        let mut text = format!(
            "[postgres]\nurl = \"{}\"\npool_size = {}\n[relay]\nworkers = {workers}\n\
             batch_size = {batch}\n[sink]\nkind = \"nats\"\n[sink.nats]\nurl = \"{}\"\n",
            self.db_url,
            workers + 4,
            self.nats.url()
        );
        for t in tables {
            text.push_str(&format!("[[tables]]\nname = \"{t}\"\n"));
        }
        text
    }

    fn spawn_relay(&self, command: &str, config: &std::path::Path) -> Result<Child> {
        Command::new(&self.a.relay)
            .args([command, "--config"])
            .arg(config)
            .env(
                "RUST_LOG",
                std::env::var("BENCH_RELAY_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("start outbox-relay")
    }

    /// Fills `public.outbox` afresh with `rows` rows over `keys` keys, no ANALYZE (an
    /// application does not analyze its outbox before a burst).
    async fn fill(&self, rows: i64, keys: i64, payload: i32) -> Result<()> {
        let client = self.pg.connect("app").await?;
        client.batch_execute("TRUNCATE public.outbox").await?;
        self.append(rows, keys, payload).await
    }

    async fn append(&self, rows: i64, keys: i64, payload: i32) -> Result<()> {
        let client = self.pg.connect("app").await?;
        client
            .execute(
                "INSERT INTO public.outbox (topic, key, payload)
                 SELECT 'bench.' || (n % 8), 'k' || (n % $2::bigint),
                        convert_to(rpad(n::text, $3::int, 'x'), 'UTF8')
                 FROM generate_series(1, $1::bigint) n ORDER BY n",
                &[&rows, &keys, &payload],
            )
            .await?;
        Ok(())
    }

    /// `relays` drains of `workers` workers at once on what the table holds; the aggregate
    /// rate, checked against what the stream stored and the rows left.
    async fn drains_at_once(
        &self,
        relays: usize,
        workers: usize,
        batch: usize,
        rows: i64,
    ) -> Result<Drained> {
        self.drains_among(relays, workers, batch, rows, &[]).await
    }

    /// [`Bench::drains_at_once`] with the empty tables `idle` configured after
    /// `public.outbox`.
    async fn drains_among(
        &self,
        relays: usize,
        workers: usize,
        batch: usize,
        rows: i64,
        idle: &[String],
    ) -> Result<Drained> {
        self.reset_nats().await?;
        let path = self
            .dir
            .join(format!("scale-{relays}x{workers}-{}.toml", idle.len()));
        let mut tables = vec!["public.outbox".to_owned()];
        tables.extend_from_slice(idle);
        std::fs::write(&path, self.scale_config(workers, batch, &tables))?;
        let stats = self.pg.connect("app").await?;
        let profile = self.statements(&stats, None).await?;
        let xacts0 = Self::xacts(&stats).await?;
        let (started, machine) = (Instant::now(), MachineCpu::now());
        let mut pids = Vec::new();
        for _ in 0..relays {
            pids.push(self.spawn_relay("drain", &path)?.id() as i32);
        }
        // When the stream held every row (the last publish), polled beside the waits: the
        // drains' exits after it are the tail (each relay noticing the table is empty).
        let last_stored = {
            let js = async_nats::jetstream::new(self.nats.client().await?);
            tokio::spawn(async move {
                loop {
                    if stored_so_far(&js).await as i64 >= rows {
                        return started.elapsed().as_secs_f64();
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        };
        let waits: Vec<_> = pids
            .into_iter()
            .map(|pid| {
                tokio::task::spawn_blocking(move || {
                    testkit::wait_with_usage(pid).map(|u| (u, started.elapsed().as_secs_f64()))
                })
            })
            .collect();
        let mut relay_cpu = 0.0;
        let mut exits = Vec::new();
        for wait in waits {
            let (usage, at) = wait.await??;
            if usage.code != 0 {
                bail!("a drain of {relays} x {workers} exited with {}", usage.code);
            }
            relay_cpu += usage.cpu_secs;
            exits.push(at);
        }
        let secs = started.elapsed().as_secs_f64();
        let mut last_stored = last_stored;
        let stored_at = tokio::time::timeout(Duration::from_secs(1), &mut last_stored).await;
        last_stored.abort();
        let last_stored = stored_at.ok().and_then(Result::ok);
        exits.sort_by(f64::total_cmp);
        if let Some(stored_at) = last_stored {
            eprintln!(
                "    {relays} x {workers}: every row stored at {stored_at:.2} s; exits {:.2} s to {:.2} s",
                exits[0],
                exits[exits.len() - 1]
            );
        }
        let machine_cpu = machine.busy_since() * secs;
        let stored = self.nats.stream_state("BENCH").await?.0 as i64;
        let left: i64 = self
            .pg
            .connect("app")
            .await?
            .query_one("SELECT count(*) FROM public.outbox", &[])
            .await?
            .get(0);
        if stored < rows || left != 0 {
            bail!("{relays} x {workers}: the stream stored {stored} of {rows} rows, {left} left");
        }
        let per_100k = rows as f64 / 100_000.0;
        // A backend reports its counts as it exits, a moment after its relay disconnected.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let xacts = Self::xacts(&stats).await? - xacts0;
        self.statements(&stats, Some(profile)).await?;
        Ok(Drained {
            rows_per_xact: rows as f64 / xacts.max(1) as f64,
            rate: rows as f64 / secs,
            relay_cpu: relay_cpu / per_100k,
            machine_cpu: machine_cpu / per_100k,
        })
    }

    /// With `pg_stat_statements` loaded (`BENCH_PG_SETTINGS`), a profile of one drain:
    /// `None` resets the counts and says whether the module is there; `Some(true)` then
    /// prints the statements that took the most time since, to stderr.
    pub(crate) async fn statements(
        &self,
        client: &tokio_postgres::Client,
        print: Option<bool>,
    ) -> Result<bool> {
        let loaded: String = client
            .query_one("SHOW shared_preload_libraries", &[])
            .await?
            .get(0);
        if !loaded.contains("pg_stat_statements") {
            return Ok(false);
        }
        if print.is_none() {
            client
                .batch_execute(
                    "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; \
                     SELECT pg_stat_statements_reset()",
                )
                .await?;
            return Ok(true);
        }
        let rows = client
            .query(
                "SELECT calls, total_exec_time::float8, shared_blks_hit + shared_blks_read, \
                 left(regexp_replace(query, '\\s+', ' ', 'g'), 100), plans, \
                 total_plan_time::float8 FROM pg_stat_statements \
                 WHERE calls > 1 ORDER BY total_exec_time DESC LIMIT 12",
                &[],
            )
            .await?;
        for r in rows {
            let (calls, ms, blocks, query): (i64, f64, i64, String) =
                (r.get(0), r.get(1), r.get(2), r.get(3));
            // Plans are counted with `pg_stat_statements.track_planning = on` only.
            let (plans, plan_ms): (i64, f64) = (r.get(4), r.get(5));
            eprintln!(
                "      {calls:>7} calls {ms:>8.0} ms {blocks:>9} blocks {plans:>7} plans \
                 {plan_ms:>6.0} ms  {query}"
            );
        }
        Ok(true)
    }

    /// S or R: every shape on 2,000 keys and on 20, or those `BENCH_SCALE_SHAPES` names
    /// (`KEYS:RxW` items, comma-separated, e.g. `2000:1x4,2000:8x4`: for profiling one
    /// shape against its reference).
    ///
    /// S starts them as drains at once on the filled table; R as running replicas.
    async fn shapes(&self, part: Part) -> Result<Vec<Shape>> {
        let mut out = Vec::new();
        for (keys, relays, workers) in chosen_shapes()? {
            let drained = match part {
                Part::Drains => {
                    self.fill(S_ROWS, keys, self.a.payload as i32).await?;
                    self.drains_at_once(relays, workers, 500, S_ROWS).await?
                }
                Part::Running => {
                    self.running_replicas(relays, workers, 500, S_ROWS, keys, &[])
                        .await?
                }
            };
            eprintln!(
                "    {}. {keys} keys, {relays} x {workers}: {:.0} rows/s",
                part.letter(),
                drained.rate
            );
            out.push(Shape {
                keys,
                relays,
                workers,
                drained,
            });
        }
        Ok(out)
    }

    /// Transactions PostgreSQL has counted in database `app` (commits and rollbacks).
    async fn xacts(client: &tokio_postgres::Client) -> Result<i64> {
        Ok(client
            .query_one(
                "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database \
                 WHERE datname = 'app'",
                &[],
            )
            .await?
            .get(0))
    }

    /// `outbox-relay migrate` with the config at `path`: with the wake-up, or
    /// without it (`--no-notify` removes it).
    pub(crate) fn migrate(&self, path: &std::path::Path, notify: bool) -> Result<()> {
        let mut migrate = Command::new(&self.a.relay);
        migrate.args(["migrate", "--config"]).arg(path);
        if !notify {
            migrate.arg("--no-notify");
        }
        let out = migrate.output()?;
        if !out.status.success() {
            bail!("migrate: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// R: `relays` `run` processes of `workers` workers, up and ready on the empty table
    /// before `rows` rows over `keys` keys commit at once; the aggregate rate from that
    /// commit to the stream holding every row, checked as S's is.
    async fn running_replicas(
        &self,
        relays: usize,
        workers: usize,
        batch: usize,
        rows: i64,
        keys: i64,
        idle: &[String],
    ) -> Result<Drained> {
        self.reset_nats().await?;
        let stats = self.pg.connect("app").await?;
        // Empty and analyzed so: what autovacuum leaves after the last burst was drained,
        // and what the relays plan their statements on while they wait for the next.
        stats
            .batch_execute("TRUNCATE public.outbox; ANALYZE public.outbox")
            .await?;
        let mut tables = vec!["public.outbox".to_owned()];
        tables.extend_from_slice(idle);
        let mut configs = Vec::new();
        for i in 0..relays {
            let (http, addr) = http_section();
            let path = self.dir.join(format!(
                "running-{relays}x{workers}-{i}-{}.toml",
                idle.len()
            ));
            std::fs::write(&path, self.scale_config(workers, batch, &tables) + &http)?;
            configs.push((path, addr));
        }
        // Sidecars next to an application that writes its outbox: NOTIFY wakes them.
        self.migrate(&configs[0].0, true)?;
        let mut children = Vec::new();
        for (path, _) in &configs {
            children.push(self.spawn_relay("run", path)?);
        }
        let result = self.burst_to_running(&children, &configs, rows, keys).await;
        for child in &children {
            let _ = testkit::send_signal(child.id(), testkit::Signal::Term);
        }
        for mut child in children {
            let status = tokio::task::spawn_blocking(move || child.wait()).await??;
            if result.is_ok() && !status.success() {
                bail!("a run of {relays} x {workers} exited with {status} on SIGTERM");
            }
        }
        self.migrate(&configs[0].0, false)?;
        result
    }

    /// R's measured part: waits for every relay's `/readyz`, commits the rows, and times
    /// them to the stream.
    async fn burst_to_running(
        &self,
        children: &[Child],
        configs: &[(std::path::PathBuf, String)],
        rows: i64,
        keys: i64,
    ) -> Result<Drained> {
        let deadline = Instant::now() + Duration::from_secs(60);
        for (_, addr) in configs {
            loop {
                let a = addr.clone();
                let ready = tokio::task::spawn_blocking(move || testkit::http_get(&a, "/readyz"))
                    .await?
                    .is_ok_and(|(status, _)| status == 200);
                if ready {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("a relay at {addr} was not ready within 60 s");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // Every worker's first claims of the empty table, before the burst; a sidecar
        // idles longer, its statements planned on the empty table (`BENCH_R_IDLE_SECS`).
        let idle = std::env::var("BENCH_R_IDLE_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2);
        tokio::time::sleep(Duration::from_secs(idle)).await;
        let stats = self.pg.connect("app").await?;
        let pids: Vec<u32> = children.iter().map(Child::id).collect();
        // The relays' backends live through the burst, so their CPU is still in `/proc`.
        let cpu0 = Cpu::now(&pids);
        let profile = self.statements(&stats, None).await?;
        self.append(rows, keys, self.a.payload as i32).await?;
        let (committed, machine) = (Instant::now(), MachineCpu::now());
        let xacts0 = Self::xacts(&stats).await?;
        let js = async_nats::jetstream::new(self.nats.client().await?);
        // BENCH_PROGRESS: the rows stored every 250 ms, to stderr (where a burst slows),
        // and what the relays' backends were doing, sampled every 50 ms.
        let progress = std::env::var_os("BENCH_PROGRESS").is_some();
        let (stop_sampling, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let sampling = if progress {
            Some(self.pg.connect("app").await?)
        } else {
            None
        };
        let sampler = sampling.map(|client| {
            tokio::spawn(async move {
                let mut seen: std::collections::BTreeMap<String, u32> = Default::default();
                loop {
                    let rows = client
                        .query(
                            "SELECT COALESCE(wait_event_type || ':' || wait_event, 'CPU') \
                             || ' ' || left(regexp_replace(query, '\\s+', ' ', 'g'), 40) || ' .. ' || right(regexp_replace(query, '\\s+', ' ', 'g'), 50) \
                             FROM pg_stat_activity \
                             WHERE application_name = 'outbox-relay' AND state = 'active'",
                            &[],
                        )
                        .await?;
                    for r in rows {
                        *seen.entry(r.get(0)).or_default() += 1;
                    }
                    tokio::select! {
                        _ = &mut stopped => break,
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    }
                }
                anyhow::Ok(seen)
            })
        });
        let mut shown = Duration::ZERO;
        loop {
            let stored = stored_so_far(&js).await;
            if progress && committed.elapsed() >= shown {
                eprintln!(
                    "      {:>6.2} s {stored:>7} stored",
                    committed.elapsed().as_secs_f64()
                );
                shown += Duration::from_millis(250);
            }
            if stored as i64 >= rows {
                break;
            }
            if committed.elapsed() > Duration::from_secs(300) {
                bail!("the stream held {stored} of {rows} rows 300 s after the commit");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let secs = committed.elapsed().as_secs_f64();
        let machine_cpu = machine.busy_since() * secs;
        let used = Cpu::now(&pids).since(cpu0);
        let (relay_cpu, pg_cpu) = (used.processes, used.postgres);
        let _ = stop_sampling.send(());
        if let Some(sampler) = sampler {
            let mut seen: Vec<(String, u32)> = sampler.await??.into_iter().collect();
            seen.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
            for (what, n) in seen.iter().take(10) {
                eprintln!("      {n:>6} samples  {what}");
            }
        }
        eprintln!(
            "      {secs:.2} s; CPU s: machine {machine_cpu:.2}, relays {relay_cpu:.2}, \
             PostgreSQL {pg_cpu:.2}, the rest (nats-server, this benchmark) {:.2}",
            machine_cpu - relay_cpu - pg_cpu
        );
        let settled = Instant::now() + Duration::from_secs(10);
        loop {
            let left: i64 = stats
                .query_one("SELECT count(*) FROM public.outbox", &[])
                .await?
                .get(0);
            if left == 0 {
                break;
            }
            if Instant::now() > settled {
                bail!("{left} rows left 10 s after the stream held every row");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let stored = self.nats.stream_state("BENCH").await?.0 as i64;
        if stored != rows {
            bail!("the stream stored {stored} messages for {rows} rows");
        }
        // Statistics reach pg_stat_database when a backend reports (at most every 1 s).
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let xacts = Self::xacts(&stats).await? - xacts0;
        self.statements(&stats, Some(profile)).await?;
        let per_100k = rows as f64 / 100_000.0;
        Ok(Drained {
            rows_per_xact: rows as f64 / xacts.max(1) as f64,
            rate: rows as f64 / secs,
            relay_cpu: relay_cpu / per_100k,
            machine_cpu: machine_cpu / per_100k,
        })
    }

    /// I: `outbox-relay run` on `n` tables, each holding one row at start, then quiet.
    async fn idle(&self, n: usize, notify: bool) -> Result<Idle> {
        let client = self.pg.connect("app").await?;
        let tables: Vec<String> = (0..n).map(|i| format!("public.idle_{i}")).collect();
        let path = self.dir.join(format!("idle-{n}.toml"));
        // A long-running relay serves its metrics, as a sidecar or unit does: the gauges it
        // reads for them are part of its idle cost.
        let (http, addr) = http_section();
        std::fs::write(&path, self.scale_config(4, 500, &tables) + &http)?;
        self.migrate(&path, notify)?;
        for t in &tables {
            client
                .execute(
                    &format!(
                        "INSERT INTO {t} (topic, key, payload) VALUES ('bench.start', 's', 'x')"
                    ),
                    &[],
                )
                .await?;
        }
        self.reset_nats().await?;
        let nc = async_nats::connect(self.nats.url()).await?;
        let mut sub = nc.subscribe("bench.wake").await?;
        let js = async_nats::jetstream::new(self.nats.client().await?);
        let started = Instant::now();
        let mut relay = self.spawn_relay("run", &path)?;
        // Start-up: connections, schema checks, every table's first claim.
        while (stored_so_far(&js).await as usize) < n {
            if started.elapsed() > Duration::from_secs(120) {
                bail!("{n} tables: their first rows were not all in the stream within 120 s");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let startup_secs = started.elapsed().as_secs_f64();
        // The tables that just published count as active for a moment; then all are quiet.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (cpu0, x0) = (Cpu::now(&[relay.id()]), Self::xacts(&client).await?);
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(IDLE_SECS)).await;
        let secs = t0.elapsed().as_secs_f64();
        // Statistics reach pg_stat_database when a backend reports (at most every 1 s).
        let used = Cpu::now(&[relay.id()]).since(cpu0);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let x1 = Self::xacts(&client).await?;
        let scrape = tokio::task::spawn_blocking(move || testkit::http_get(&addr, "/metrics"))
            .await??
            .1;
        let series = scrape
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .count();
        let mut wakes = Vec::new();
        for i in 0..20u64 {
            let t = &tables[(i as usize * 7 + 3) % n];
            client
                .execute(
                    &format!(
                        "INSERT INTO {t} (topic, key, payload) VALUES ('bench.wake', 'w', 'x')"
                    ),
                    &[],
                )
                .await?;
            let committed = Instant::now();
            tokio::time::timeout(Duration::from_secs(10), sub.next())
                .await
                .context("a row in an idle table was not published within 10 s")?;
            wakes.push(committed.elapsed().as_secs_f64() * 1000.0);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let _ = testkit::send_signal(relay.id(), testkit::Signal::Term);
        relay.wait()?;
        for t in &tables {
            client.batch_execute(&format!("DROP TABLE {t}")).await?;
        }
        wakes.sort_by(f64::total_cmp);
        Ok(Idle {
            tables: n,
            notify,
            relay_cores: used.processes / secs,
            pg_cores: used.postgres / secs,
            xact_per_sec: (x1 - x0) as f64 / secs,
            wake_p50_ms: percentile(&wakes, 0.5),
            wake_p99_ms: percentile(&wakes, 0.99),
            startup_secs,
            series,
        })
    }

    /// M: one drain of 1 x 4 on [`M_ROWS`] rows over 2,000 keys, alone and with `n` empty
    /// tables configured after it, alternated, [`M_ROUNDS`] rounds; then as many rounds of
    /// one `run` of 1 x 4, ready before the rows commit at once (as R), alone and among them.
    async fn busy_among_idle(&self, n: usize) -> Result<Among> {
        let idle: Vec<String> = (0..n).map(|i| format!("public.idle_{i}")).collect();
        let path = self.dir.join(format!("among-{n}.toml"));
        std::fs::write(&path, self.scale_config(4, 500, &idle))?;
        self.migrate(&path, true)?;
        let mut among = Among {
            idle: n,
            drain: Vec::new(),
            run: Vec::new(),
        };
        for _ in 0..M_ROUNDS {
            self.fill(M_ROWS, 2_000, 200).await?;
            let alone = self.drains_among(1, 4, 500, M_ROWS, &[]).await?.rate;
            self.fill(M_ROWS, 2_000, 200).await?;
            let with = self.drains_among(1, 4, 500, M_ROWS, &idle).await?.rate;
            eprintln!(
                "    M. drain, {n} idle tables: {alone:.0} rows/s alone, {with:.0} among them"
            );
            among.drain.push((alone, with));
        }
        for _ in 0..M_ROUNDS {
            let run = |idle| self.running_replicas(1, 4, 500, M_ROWS, 2_000, idle);
            let alone = run(&[]).await?.rate;
            let with = run(&idle).await?.rate;
            eprintln!("    M. run, {n} idle tables: {alone:.0} rows/s alone, {with:.0} among them");
            among.run.push((alone, with));
        }
        let client = self.pg.connect("app").await?;
        for t in &idle {
            client.batch_execute(&format!("DROP TABLE {t}")).await?;
        }
        Ok(among)
    }

    /// E3: a first drain, then a new process's drain behind the first's deleted rows with
    /// a snapshot held, no ANALYZE.
    async fn history(&self) -> Result<(f64, f64)> {
        self.fill(E3_ROWS, 10_000, 200).await?;
        let holder = self.pg.connect("app").await?;
        holder
            .batch_execute(
                "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_catalog.pg_class",
            )
            .await?;
        let first = self.drains_at_once(1, 4, 1000, E3_ROWS).await?.rate;
        // What autovacuum does within a minute of the first drain's deletes: statistics
        // that say the table is empty, for the burst that comes next.
        self.pg
            .connect("app")
            .await?
            .batch_execute("ANALYZE public.outbox")
            .await?;
        self.append(E3_ROWS, 10_000, 200).await?;
        let second = self.drains_at_once(1, 4, 1000, E3_ROWS).await?.rate;
        holder.batch_execute("ROLLBACK").await?;
        eprintln!("    E3. {first:.0} then {second:.0} rows/s");
        Ok((first, second))
    }

    /// S, R, I and E3.
    pub(crate) async fn scale(&self) -> Result<Scale> {
        let part = |p: &str| {
            self.a
                .scale_parts
                .split(',')
                .any(|x| x.trim().eq_ignore_ascii_case(p))
        };
        let shapes = if part("S") {
            self.shapes(Part::Drains).await?
        } else {
            Vec::new()
        };
        let running = if part("R") {
            self.shapes(Part::Running).await?
        } else {
            Vec::new()
        };
        let mut idle = Vec::new();
        let mut idle_shapes: Vec<(usize, bool)> = if part("I") {
            vec![(1, true), (10, true), (50, true), (50, false)]
        } else {
            Vec::new()
        };
        if part("I500") {
            idle_shapes.push((500, true));
        }
        for (n, notify) in idle_shapes {
            let row = self.idle(n, notify).await?;
            eprintln!(
                "    I. {n} tables (notify {notify}): started in {:.2} s; relay {:.3} + \
                 PostgreSQL {:.3} cores, {:.0} transactions/s",
                row.startup_secs, row.relay_cores, row.pg_cores, row.xact_per_sec
            );
            idle.push(row);
        }
        let history = if part("E3") {
            self.history().await?
        } else {
            (f64::NAN, f64::NAN)
        };
        let mut among = Vec::new();
        if part("M") {
            for n in [49, 499] {
                among.push(self.busy_among_idle(n).await?);
            }
        }
        Ok(Scale {
            shapes,
            running,
            idle,
            history,
            among,
        })
    }
}

/// Prints S, R, I and E3 as markdown tables.
pub(crate) fn print(scale: &Scale) {
    print_shapes(
        "S. Replicas and workers: drains started at once on one table, 200,000 rows, NATS, key order",
        &scale.shapes,
    );
    print_shapes(
        "R. Replicas and workers already running (`run`, NOTIFY): 200,000 rows committed at once, NATS, key order",
        &scale.running,
    );
    println!("\n### I. Idle tables: `outbox-relay run`, nothing written, {IDLE_SECS} s\n");
    println!("| tables | NOTIFY | start-up | relay (cores) | PostgreSQL (cores) | transactions/s | wake-up p50 | p99 | metrics series |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for i in &scale.idle {
        println!(
            "| {} | {} | {:.2} s | {:.3} | {:.3} | {:.0} | {:.1} ms | {:.1} ms | {} |",
            i.tables,
            if i.notify { "yes" } else { "no (polling)" },
            i.startup_secs,
            i.relay_cores,
            i.pg_cores,
            i.xact_per_sec,
            i.wake_p50_ms,
            i.wake_p99_ms,
            i.series
        );
    }
    if !scale.among.is_empty() {
        println!(
            "\n### M. One busy table among idle ones: 1 x 4, {M_ROWS} rows over 2,000 keys, NATS, key order\n"
        );
        println!("| idle tables | mode | round | alone (rows/s) | among them (rows/s) | ratio |");
        println!("|---:|---|---:|---:|---:|---:|");
        for among in &scale.among {
            for (mode, rounds) in [("drain", &among.drain), ("run", &among.run)] {
                for (i, (alone, with)) in rounds.iter().enumerate() {
                    println!(
                        "| {} | {mode} | {} | {alone:.0} | {with:.0} | {:.2} |",
                        among.idle,
                        i + 1,
                        with / alone
                    );
                }
            }
        }
    }
    let (first, second) = scale.history;
    println!("\n### E3. A held snapshot, a new process, statistics from the empty table\n");
    println!("| first drain | new process behind it | ratio |");
    println!("|---:|---:|---:|");
    println!(
        "| {first:.0} rows/s | {second:.0} rows/s | {:.2} |",
        second / first
    );
}

/// One table of S or R: each shape's rate as a ratio to 1 x 4 on the same keys.
fn print_shapes(title: &str, shapes: &[Shape]) {
    if shapes.is_empty() {
        return;
    }
    println!("\n### {title}\n");
    println!(
        "| keys | relays x workers | rows/s | vs 1 x 4 | relay CPU s / 100k rows | machine CPU s / 100k rows | rows per transaction |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for s in shapes {
        let base = shapes
            .iter()
            .find(|b| b.keys == s.keys && b.relays == 1 && b.workers == 4)
            .map_or(f64::NAN, |b| b.drained.rate);
        let d = s.drained;
        println!(
            "| {} | {} x {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.0} |",
            s.keys,
            s.relays,
            s.workers,
            d.rate,
            d.rate / base,
            d.relay_cpu,
            d.machine_cpu,
            d.rows_per_xact
        );
    }
}
