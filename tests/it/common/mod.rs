//! Helpers shared by the integration tests: a throwaway PostgreSQL and nats-server, a
//! migrated outbox, a config file, the built binary, and a checker that compares what the
//! table held with what the stream stored.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use testkit::{NatsServer, Postgres, StoredMessage};

mod alone;
mod config;
mod wake;
pub use alone::{alone, shared, Shared};
pub use config::{relay, Relay};
pub use wake::{commit_row, woken_at_every_idle_point};

pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
/// The least-privilege role the relay runs as in every test that uses [`Env`].
pub const ROLE_SQL: &str = include_str!("../../../migrations/outbox_relay_role.sql");

/// Creates role `outbox_relay` (once per cluster) with exactly the grants of
/// `migrations/outbox_relay_role.sql` on `table`, as the superuser behind `client`.
pub async fn grant_relay_role(client: &tokio_postgres::Client, table: &str) {
    let schema = table.rsplit_once('.').map_or("public", |(s, _)| s);
    let sql = ROLE_SQL
        .replace("public.outbox_relay_pauses", "{pauses}")
        .replace("public.outbox_relay_rates", "{rates}")
        .replace("public.outbox_relay_sleepers", "{sleepers}")
        .replace("public.outbox_relay_held", "{held}")
        .replace("public.outbox", table)
        .replace("{pauses}", &format!("{schema}.outbox_relay_pauses"))
        .replace("{rates}", &format!("{schema}.outbox_relay_rates"))
        .replace("{sleepers}", &format!("{schema}.outbox_relay_sleepers"))
        .replace("{held}", &format!("{schema}.outbox_relay_held"));
    client
        .batch_execute(&sql)
        .await
        .expect("apply migrations/outbox_relay_role.sql");
}

/// `url` (the superuser's) as the least-privilege role `outbox_relay`.
pub fn as_relay_role(url: &str) -> String {
    url.replacen("postgres://postgres@", "postgres://outbox_relay@", 1)
}
pub const STREAM: &str = "OUTBOX";

/// A database with a migrated `public.outbox`, a nats-server with stream `OUTBOX` on
/// `events.>`, and a config file pointing at both.
pub struct Env {
    pub pg: Postgres,
    pub nats: NatsServer,
    pub db_url: String,
    pub config: PathBuf,
    _dir: TempDir,
    _shared: Option<Shared>,
}

pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Env {
    /// Servers up, table migrated, config written from `relay`.
    pub async fn new(relay: Relay) -> Env {
        let pg = Postgres::start().expect("start postgres");
        let nats = NatsServer::start().expect("start nats-server");
        Env::on(pg, nats, relay).await
    }

    /// The same on servers started by the caller (e.g. [`Postgres::start_tls`],
    /// [`NatsServer::start_secure`]).
    pub async fn on(pg: Postgres, nats: NatsServer, relay: Relay) -> Env {
        let shared = shared();
        let db_url = pg.create_database("app").await.expect("create database");
        nats.create_stream(STREAM, &["events.>"])
            .await
            .expect("stream");
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-test-cfg-{}-{}",
            std::process::id(),
            testkit::free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let env = Env {
            config: dir.join("relay.toml"),
            _dir: TempDir(dir),
            _shared: shared,
            db_url,
            pg,
            nats,
        };
        env.write_config(&relay);
        let out = env.migrate(&[]);
        assert!(out.status.success(), "migrate failed: {}", text(&out));
        grant_relay_role(&env.client().await, "public.outbox").await;
        env
    }

    /// `outbox-relay migrate` as the tables' owner: the config's role may not create tables.
    pub fn migrate(&self, args: &[&str]) -> Output {
        self.command(&[&["migrate"], args].concat())
            .env("OUTBOX_RELAY__POSTGRES__URL", &self.db_url)
            .output_within(RUN_LIMIT)
            .expect("run outbox-relay migrate")
    }

    /// Rewrites the config file from `relay`.
    pub fn write_config(&self, relay: &Relay) {
        let toml = relay.to_toml(&as_relay_role(&self.db_url), &self.nats.url());
        std::fs::write(&self.config, toml).unwrap();
    }

    /// Adds `line` (e.g. `max_rate = 400`) to the written config's `[[tables]]` entry.
    pub fn table_option(&self, line: &str) {
        let config = std::fs::read_to_string(&self.config).unwrap();
        let with = config.replacen(
            "topic = \"{topic}\"\n",
            &format!("topic = \"{{topic}}\"\n{line}\n"),
            1,
        );
        assert_ne!(
            config, with,
            "no [[tables]] topic line to add {line:?} after"
        );
        std::fs::write(&self.config, with).unwrap();
    }

    /// Runs the built binary with this env's config and waits for it.
    pub fn relay(&self, args: &[&str]) -> Output {
        self.command(args)
            .output_within(RUN_LIMIT)
            .expect("run outbox-relay")
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args).arg("--config").arg(&self.config);
        cmd.env_remove("RUST_LOG");
        testkit::die_with_parent(&mut cmd);
        cmd
    }

    /// Starts `outbox-relay run` in the background, output discarded.
    pub fn spawn_run(&self) -> Child {
        self.command(&["run"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start outbox-relay run")
    }

    /// Starts `outbox-relay run` in the background with its debug log in a file of this
    /// env's directory, for a test that shows it when it fails: the child and the path.
    pub fn spawn_run_logged(&self) -> (Child, PathBuf) {
        let path = self.config.with_file_name("relay.log");
        let log = std::fs::File::create(&path).expect("create relay.log");
        let child = self
            .command(&["run"])
            .env("RUST_LOG", "outbox_relay=debug")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start outbox-relay run");
        (child, path)
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        self.pg.connect("app").await.expect("connect")
    }

    /// The relay's tables as `run` prepares them (statements included), on a source of
    /// its own, for tests that drive the claim's statements directly.
    pub async fn tables(
        &self,
    ) -> (
        outbox_relay::source::Source,
        Vec<outbox_relay::source::table::TablePlan>,
    ) {
        let config = outbox_relay::config::load(&self.config).unwrap();
        let limits = outbox_relay::source::SessionLimits::relay(
            &config.postgres,
            config.sink.publish_timeout,
        );
        let source = outbox_relay::source::Source::open(&config.postgres, limits)
            .await
            .unwrap();
        let tables = outbox_relay::source::table::prepare(&source, &config)
            .await
            .unwrap();
        (source, tables)
    }

    pub async fn stored(&self) -> Vec<StoredMessage> {
        self.nats.read_stream(STREAM).await.expect("read stream")
    }
}

pub fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Sets `postgres.statement_timeout` in `env`'s config file.
pub fn set_statement_timeout(env: &Env, timeout: &str) {
    let config = std::fs::read_to_string(&env.config).unwrap().replace(
        "pool_size = 16",
        &format!("pool_size = 16\nstatement_timeout = \"{timeout}\""),
    );
    std::fs::write(&env.config, config).unwrap();
}

/// What autovacuum leaves on an outbox that a drain emptied, refilled: `rows` rows (100
/// keys) inserted and deleted, ANALYZE (the table's pages, and statistics that count no
/// row on them, asserted), then `rows` rows again, not analyzed. A statement planned now
/// takes the table for empty.
pub async fn refill_analyzed_empty(client: &tokio_postgres::Client, rows: i64) {
    seed(client, rows, 100, 0).await;
    client
        .batch_execute("DELETE FROM public.outbox; ANALYZE public.outbox")
        .await
        .unwrap();
    let stats = client
        .query_one(
            "SELECT relpages, reltuples FROM pg_class WHERE oid = 'public.outbox'::regclass",
            &[],
        )
        .await
        .unwrap();
    let (pages, tuples): (i32, f32) = (stats.get(0), stats.get(1));
    assert!(pages > 0 && tuples == 0.0, "{pages} pages, {tuples} rows");
    seed(client, rows, 100, 0).await;
}

/// Inserts `rows` rows spread over `keys` keys (`k0`..), and, every `null_every` rows, one
/// row with a NULL key. Headers carry `n` and the key, so the checker reads the key back
/// from the stream.
pub async fn seed(client: &tokio_postgres::Client, rows: i64, keys: i64, null_every: i64) {
    client
        .execute(
            "INSERT INTO public.outbox (topic, key, payload, headers)
             SELECT topic, key, convert_to(n::text, 'UTF8'),
                    jsonb_strip_nulls(jsonb_build_object('n', n::text, 'key', key))
             FROM (SELECT n, 'events.' || (n % 3) AS topic,
                          CASE WHEN $3::bigint > 0 AND n % $3::bigint = 0 THEN NULL ELSE 'k' || (n % $2::bigint) END AS key
                   FROM generate_series(1, $1::bigint) AS n) s
             ORDER BY n",
            &[&rows, &keys, &null_every],
        )
        .await
        .expect("seed rows");
}

/// What the stream holds, checked against the ids that were in the table.
#[derive(Debug, Default)]
pub struct Delivery {
    /// Message id (`public.outbox:42`) -> how often it is stored.
    pub counts: HashMap<String, usize>,
    /// Key -> ids in stream order (first occurrences only).
    pub by_key: BTreeMap<String, Vec<i64>>,
}

pub fn analyse(stored: &[StoredMessage]) -> Delivery {
    let mut d = Delivery::default();
    for m in stored {
        let id = m
            .header("Nats-Msg-Id")
            .expect("every message has Nats-Msg-Id")
            .to_owned();
        let count = d.counts.entry(id.clone()).or_insert(0);
        *count += 1;
        if *count > 1 {
            continue;
        }
        if let Some(key) = m.header("key") {
            let n: i64 = id.rsplit(':').next().unwrap().parse().unwrap();
            d.by_key.entry(key.to_owned()).or_default().push(n);
        }
    }
    d
}

impl Delivery {
    /// Keys whose ids are not strictly increasing in stream order.
    pub fn order_violations(&self) -> Vec<String> {
        self.by_key
            .iter()
            .filter(|(_, ids)| ids.windows(2).any(|w| w[0] >= w[1]))
            .map(|(k, _)| k.clone())
            .collect()
    }

    pub fn duplicates(&self) -> usize {
        self.counts.values().map(|c| c - 1).sum()
    }
}

/// One row left in `public.outbox`: id, attempts, dead, last error.
pub type RowLeft = (i64, i32, bool, Option<String>);

/// Every row left in `public.outbox`, in id order, with its failure bookkeeping.
pub async fn rows_left(client: &tokio_postgres::Client) -> Vec<RowLeft> {
    client
        .query(
            "SELECT id, attempts, dead_at IS NOT NULL, last_error FROM public.outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

/// All ids in the table, in order.
pub async fn ids(client: &tokio_postgres::Client) -> Vec<i64> {
    column(client, "SELECT id FROM public.outbox ORDER BY id", &[]).await
}

/// What a Kafka topic holds, checked the way a consumer would.
#[derive(Debug, Default)]
pub struct KafkaDelivery {
    /// `outbox-id` -> how often it was read.
    pub counts: HashMap<String, usize>,
    /// (topic, key) -> (partition, id) of first occurrences, in offset order.
    pub by_key: BTreeMap<(String, String), Vec<(i32, i64)>>,
}

pub fn analyse_kafka(records: &[testkit::KafkaRecord]) -> KafkaDelivery {
    let mut sorted: Vec<&testkit::KafkaRecord> = records.iter().collect();
    sorted.sort_by_key(|r| (r.topic.clone(), r.partition, r.offset));
    let mut d = KafkaDelivery::default();
    for r in sorted {
        let id = r
            .header("outbox-id")
            .expect("every record has outbox-id")
            .to_owned();
        let count = d.counts.entry(id.clone()).or_insert(0);
        *count += 1;
        if *count > 1 {
            continue;
        }
        if let Some(key) = &r.key {
            let n: i64 = id.rsplit(':').next().unwrap().parse().unwrap();
            d.by_key
                .entry((r.topic.clone(), key.clone()))
                .or_default()
                .push((r.partition, n));
        }
    }
    d
}

impl KafkaDelivery {
    /// Keys spread over several partitions of one topic, or not in increasing id order
    /// there. (Rows of a key may go to several topics; a consumer sees each on its own.)
    pub fn order_violations(&self) -> Vec<(String, String)> {
        self.by_key
            .iter()
            .filter(|(_, seen)| {
                let partitions: std::collections::HashSet<i32> =
                    seen.iter().map(|(p, _)| *p).collect();
                partitions.len() > 1 || seen.windows(2).any(|w| w[0].1 >= w[1].1)
            })
            .map(|(k, _)| k.clone())
            .collect()
    }
}

/// The relay's claim transactions (holding row locks on `public.outbox`), with how long
/// each has been open, in seconds. The probe's and floor keeper's short reads hold none.
pub async fn relay_transactions(client: &tokio_postgres::Client) -> Vec<f64> {
    column(
        client,
        "SELECT extract(epoch FROM now() - a.xact_start)::float8
             FROM pg_stat_activity a JOIN pg_locks l USING (pid)
             WHERE a.application_name = 'outbox-relay' AND a.xact_start IS NOT NULL
               AND l.relation = 'public.outbox'::regclass AND l.mode = 'RowShareLock'",
        &[],
    )
    .await
}

pub use testkit::Signal;

/// Sends `signal` to process `pid` (a relay's `child.id()`, a server's backend pid); the
/// test fails when it cannot be delivered. SIGKILL is `Child::kill`.
pub fn signal(pid: u32, signal: Signal) {
    testkit::send_signal(pid, signal).unwrap_or_else(|e| panic!("send {signal:?} to {pid}: {e}"));
}

/// How long one run of a command in a test may take before it is killed and the test
/// fails (a `drain` in a test passes a shorter `--timeout` of its own).
pub const RUN_LIMIT: Duration = Duration::from_secs(180);

/// [`Command::output`] with a deadline, so that no test can hang on a child.
pub trait OutputWithin {
    /// Runs the command to completion with stdout and stderr captured; an error naming it
    /// when it did not exit within `limit` (it is killed then).
    fn output_within(&mut self, limit: Duration) -> std::io::Result<Output>;
}

impl OutputWithin for Command {
    fn output_within(&mut self, limit: Duration) -> std::io::Result<Output> {
        use std::io::Read;
        let mut child = self
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let drain = |pipe: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                if let Some(mut pipe) = pipe {
                    let _ = pipe.read_to_end(&mut bytes);
                }
                bytes
            })
        };
        let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
        let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
        let Some(status) = exit_within(&mut child, limit)? else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{self:?} did not exit within {limit:?}; killed"),
            ));
        };
        Ok(Output {
            status,
            stdout: stdout.join().unwrap_or_default(),
            stderr: stderr.join().unwrap_or_default(),
        })
    }
}

/// Waits for `child` to exit, at most `limit`; `None` when it did not (it is killed then).
fn exit_within(
    child: &mut Child,
    limit: Duration,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to exit, at most `limit`; returns its exit code and how long it took.
pub fn wait_exit(child: &mut Child, limit: Duration) -> (Option<i32>, Duration) {
    let start = Instant::now();
    match exit_within(child, limit).unwrap() {
        Some(status) => (status.code(), start.elapsed()),
        None => panic!("relay did not exit within {limit:?}"),
    }
}

/// Starts `n` processes at once, `command(i)` for each `i` (output discarded), and waits
/// for every one to exit 0 within `limit`; `context` is added to a failure.
pub fn all_exit_0(
    n: usize,
    command: impl Fn(usize) -> Command,
    limit: Duration,
    context: impl Fn() -> String,
) {
    let children: Vec<Child> = (0..n)
        .map(|i| {
            command(i)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, mut child) in children.into_iter().enumerate() {
        let (code, _) = wait_exit(&mut child, limit);
        assert_eq!(code, Some(0), "process {i} of {n}: {}", context());
    }
}

/// Polls `probe` until it yields a value, at most `limit`: the value, `None` when `limit`
/// passed first. The one poll loop of the tests; [`wait_for`] and [`wait_until`] fail the
/// test instead of returning `None`.
///
/// A short wait is usually a measured bound (a row published within 1 s): it is polled
/// finely, every 1/500 of `limit` but at least every 50 ms and at most every 10 ms, so the
/// poll does not add to what it measures.
pub async fn poll<T>(limit: Duration, mut probe: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    let every = (limit / 500).clamp(Duration::from_millis(10), Duration::from_millis(50));
    let start = Instant::now();
    loop {
        if let Some(value) = probe().await {
            return Some(value);
        }
        if start.elapsed() >= limit {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// [`poll`], and the test fails naming `what` when `limit` passed first.
pub async fn wait_for<T>(
    what: impl std::fmt::Display,
    limit: Duration,
    probe: impl AsyncFnMut() -> Option<T>,
) -> T {
    match poll(limit, probe).await {
        Some(value) => value,
        None => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// Waits until `done` holds, at most `limit` (else the test fails naming `what`); how
/// long it took.
pub async fn wait_until(
    what: impl std::fmt::Display,
    limit: Duration,
    mut done: impl AsyncFnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    wait_for(what, limit, async || done().await.then_some(())).await;
    start.elapsed()
}

/// A wait's `what` with details read only when it is shown, i.e. when the wait timed out
/// (the relay's log as it is then: `Detailed("x", log_of(&path))`).
pub struct Detailed<'a, F: Fn() -> String>(pub &'a str, pub F);

impl<F: Fn() -> String> std::fmt::Display for Detailed<'_, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:\n{}", self.0, (self.1)())
    }
}

/// The relay log at `path` as it is when called, for [`Detailed`].
pub fn log_of(path: &Path) -> impl Fn() -> String + '_ {
    move || {
        format!(
            "the relay's log:\n{}",
            std::fs::read_to_string(path).unwrap_or_default()
        )
    }
}

pub async fn wait_for_empty_outbox(client: &tokio_postgres::Client, what: &str, seconds: u64) {
    wait_until(what, Duration::from_secs(seconds), async || {
        count(client, "SELECT count(*) FROM public.outbox").await == 0
    })
    .await;
}

/// SIGTERM, then expect exit 0 within 15s.
pub fn terminate_cleanly(relay: &mut Child) {
    signal(relay.id(), Signal::Term);
    let (code, _) = wait_exit(relay, Duration::from_secs(15));
    assert_eq!(code, Some(0));
}

/// Column 0 of every row `sql` returns, collected (a `Vec`, a set).
pub async fn column<T, C>(
    client: &tokio_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> C
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
    C: FromIterator<T>,
{
    client
        .query(sql, params)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .iter()
        .map(|r| r.get(0))
        .collect()
}

pub async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// The relay's sessions open on the database now (its `application_name`).
pub async fn relay_sessions(client: &tokio_postgres::Client) -> i64 {
    count(
        client,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay'",
    )
    .await
}

/// The independent checker: what the table held against what the stream stores.
#[derive(Debug, Default)]
pub struct Audit {
    /// Inserted ids that never arrived.
    pub lost: Vec<i64>,
    /// Stored ids that were never inserted.
    pub phantoms: Vec<String>,
    /// Messages stored more than once (beyond the first).
    pub duplicates: usize,
    /// Keys whose first occurrences are not in id order.
    pub order_violations: Vec<String>,
}

impl Audit {
    /// Every row arrived, nothing else did, and each key's first occurrences are in order.
    pub fn assert_nothing_lost_in_order(&self) {
        assert!(self.lost.is_empty(), "lost {} rows", self.lost.len());
        assert!(self.phantoms.is_empty(), "phantoms {:?}", self.phantoms);
        assert!(
            self.order_violations.is_empty(),
            "keys out of order: {:?}",
            self.order_violations
        );
    }
}

/// Compares `inserted` ids of `public.outbox` with the stream's messages.
pub fn audit(inserted: &[i64], stored: &[StoredMessage]) -> Audit {
    let delivery = analyse(stored);
    let expected: std::collections::HashSet<String> = inserted
        .iter()
        .map(|id| format!("public.outbox:{id}"))
        .collect();
    Audit {
        lost: inserted
            .iter()
            .filter(|id| !delivery.counts.contains_key(&format!("public.outbox:{id}")))
            .copied()
            .collect(),
        phantoms: delivery
            .counts
            .keys()
            .filter(|id| !expected.contains(*id))
            .cloned()
            .collect(),
        duplicates: delivery.duplicates(),
        order_violations: delivery.order_violations(),
    }
}

pub use testkit::{http_get, sample, scrape};

/// A migrated outbox for the Kafka tests, with the PostgreSQL it lives in and a relay
/// config aimed at the brokers.
pub struct Mocked {
    pub _pg: Postgres,
    pub client: tokio_postgres::Client,
    pub config: outbox_relay::config::Config,
    _shared: Option<Shared>,
}

/// A migrated outbox in a throwaway PostgreSQL and a relay config aimed at `brokers`,
/// with `relay`'s `[relay]` section.
pub async fn kafka_outbox(brokers: &str, relay: Relay) -> Mocked {
    let shared = shared();
    let pg = Postgres::start().unwrap();
    let url = pg.create_database("app").await.unwrap();
    let text = format!(
        r#"
[postgres]
url = "{url}"
[relay]
{relay}
[sink]
kind = "kafka"
publish_timeout = "3s"
[sink.kafka]
brokers = "{brokers}"
[sink.kafka.properties]
"linger.ms" = 5
[[tables]]
name = "public.outbox"
[shutdown]
drain_timeout = "10s"
"#,
        relay = relay.relay_section(),
    );
    let config = outbox_relay::config::from_str(&text, |_| None, Vec::new()).unwrap();
    let mut client = pg.connect("app").await.unwrap();
    outbox_relay::source::migrate::migrate_table(
        &mut client,
        &config,
        &config.tables[0],
        true,
        std::time::Duration::from_secs(30),
    )
    .await
    .unwrap();
    Mocked {
        _pg: pg,
        client,
        config,
        _shared: shared,
    }
}

/// The subject [`sends_so_far`] marks the end of what was sent with.
const SENTINEL: &str = "outbox-test.sentinel";

/// Every `Nats-Msg-Id` published on `events.>` as a core subscriber sees it: what the relay
/// sent, before the stream's de-duplication hides a repeat. (Also the sentinels of
/// [`sends_so_far`], as `"sentinel"`.)
pub async fn watch_sends(nats: &NatsServer) -> Arc<Mutex<Vec<String>>> {
    let client = nats.client().await.expect("connect to nats");
    let events = client.subscribe("events.>").await.expect("subscribe");
    let sentinels = client.subscribe(SENTINEL).await.expect("subscribe");
    client.flush().await.expect("flush the subscriptions");
    // Sends first: the client hands each message to its subscription's channel in the
    // order the server sent them, so when a sentinel is taken the sends before it are
    // already queued. Taken fairly, a sentinel could come before sends still queued, and
    // `sends_so_far` missed them (600 of 3,000 once, under load).
    let mut both = futures_util::stream::select_with_strategy(events, sentinels, |_: &mut ()| {
        futures_util::stream::PollNext::Left
    });
    let sent = Arc::new(Mutex::new(Vec::new()));
    let seen = sent.clone();
    tokio::spawn(async move {
        let _client = client;
        while let Some(m) = futures_util::StreamExt::next(&mut both).await {
            let id = if m.subject.as_str() == SENTINEL {
                "sentinel".to_owned()
            } else {
                m.headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default()
            };
            seen.lock().unwrap().push(id);
        }
    });
    sent
}

/// Every message id [`watch_sends`] saw, once every publish the server had processed
/// before this call has reached it: a sentinel published now arrives after them on the
/// subscriber's connection (the server keeps one order per connection). Call it after
/// the relay exited.
pub async fn sends_so_far(nats: &NatsServer, sent: &Mutex<Vec<String>>) -> Vec<String> {
    let before = sent
        .lock()
        .unwrap()
        .iter()
        .filter(|id| *id == "sentinel")
        .count();
    let client = nats.client().await.expect("connect to nats");
    client
        .publish(SENTINEL, "".into())
        .await
        .expect("publish the sentinel");
    client.flush().await.expect("flush the sentinel");
    wait_until(
        "the sentinel behind the sends",
        Duration::from_secs(10),
        async || {
            sent.lock()
                .unwrap()
                .iter()
                .filter(|id| *id == "sentinel")
                .count()
                > before
        },
    )
    .await;
    sent.lock()
        .unwrap()
        .iter()
        .filter(|id| *id != "sentinel")
        .cloned()
        .collect()
}

/// How often each message id in `sends` was sent.
pub fn send_counts(sends: &[String]) -> HashMap<&str, usize> {
    let mut counts = HashMap::new();
    for id in sends {
        *counts.entry(id.as_str()).or_insert(0) += 1;
    }
    counts
}

/// Asserts that every one of `inserted` was sent exactly once: a clean run re-sends
/// nothing.
pub fn assert_each_sent_once(inserted: &[i64], sends: &[String]) {
    let counts = send_counts(sends);
    let missing: Vec<i64> = inserted
        .iter()
        .filter(|id| !counts.contains_key(format!("public.outbox:{id}").as_str()))
        .copied()
        .collect();
    assert!(missing.is_empty(), "never sent: {missing:?}");
    let resent: Vec<(&str, usize)> = counts.into_iter().filter(|(_, n)| *n > 1).collect();
    assert!(
        resent.is_empty(),
        "{} ids sent more than once by a clean run, e.g. {:?}",
        resent.len(),
        &resent[..resent.len().min(5)]
    );
    assert_eq!(sends.len(), inserted.len(), "nothing else sent");
}

/// Runs the relay (`Mode::Run`) in this process with the memory sink `sink`, which the
/// test keeps a clone of to steer and read; returns the handle that stops it and the run.
pub fn run_in_process(
    config: &outbox_relay::config::Config,
    sink: &outbox_relay::sink::memory::MemorySink,
) -> (
    outbox_relay::shutdown::Shutdown,
    tokio::task::JoinHandle<Result<outbox_relay::relay::Report, outbox_relay::relay::RelayError>>,
) {
    use outbox_relay::relay::{self, Mode};
    use outbox_relay::sink::Sink;
    let shutdown = outbox_relay::shutdown::Shutdown::new();
    let run = {
        let (config, sink, shutdown) = (config.clone(), sink.clone(), shutdown.clone());
        tokio::spawn(async move {
            relay::run_with_sink(&config, Mode::Run, Sink::Memory(sink), shutdown).await
        })
    };
    (shutdown, run)
}

/// A librdkafka mock cluster whose brokers' ports stay out of the kernel's ephemeral
/// ports while it lives, so that a broker a test takes down can listen on its port again
/// ([`testkit::ReservedPorts`]: otherwise a connection given that port meanwhile makes
/// librdkafka abort the whole test binary).
pub struct MockBrokers {
    cluster: rdkafka::mocking::MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    _ports: testkit::ReservedPorts,
}

impl MockBrokers {
    pub fn new(brokers: i32) -> MockBrokers {
        let cluster = rdkafka::mocking::MockCluster::new(brokers).unwrap();
        let ports = testkit::ReservedPorts::of(&cluster.bootstrap_servers());
        MockBrokers {
            cluster,
            _ports: ports,
        }
    }
}

impl std::ops::Deref for MockBrokers {
    type Target = rdkafka::mocking::MockCluster<'static, rdkafka::producer::DefaultProducerContext>;

    fn deref(&self) -> &Self::Target {
        &self.cluster
    }
}
