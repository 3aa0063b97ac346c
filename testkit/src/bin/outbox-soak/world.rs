//! The soak's world: the servers, the proxies between the relays and the servers, and the
//! relay processes with their supervisor.
//!
//! ```text
//!   relay 0 ──proxy──> PgBouncer (transaction mode) ──> PostgreSQL   (listen_url: direct)
//!   relay 1 ──proxy──────────────────────────────────> PostgreSQL
//!   relay 2 ──proxy──────────────────────────────────> PostgreSQL
//!   every relay ──> one proxy per NATS server ──> n0, n1, n2 (stream SOAK, 3 replicas)
//!   writer, audit ──> PostgreSQL and the NATS servers directly
//! ```
//!
//! Each relay has its own PostgreSQL proxy (a fault there hits one relay); the NATS proxies
//! are shared (a fault there hits whoever is connected through that server). The cluster
//! does not advertise its servers' own addresses, so the relays stay behind the proxies.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use testkit::{NatsCluster, PgBouncer, Postgres, Proxy, Signal};

/// The stream every good row lands in; poison rows go to subjects it does not capture.
pub(crate) const STREAM: &str = "SOAK";
pub(crate) const SUBJECTS: &str = "soak.>";
/// `shutdown.drain_timeout` of every relay; a SIGTERM'd relay must exit within it (plus
/// [`EXIT_MARGIN`]).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
const EXIT_MARGIN: Duration = Duration::from_secs(5);

pub(crate) struct World {
    pub(crate) pg: Postgres,
    pub(crate) bouncer: PgBouncer,
    pub(crate) nats: NatsCluster,
    /// One per relay, in front of PgBouncer (relay 0) or PostgreSQL.
    pub(crate) pg_proxies: Vec<Proxy>,
    /// One per NATS server, shared by the relays.
    pub(crate) nats_proxies: Vec<Proxy>,
    pub(crate) relays: Relays,
    /// The relays' configs and logs; removed at the end unless [`World::keep`] is set.
    pub(crate) dir: PathBuf,
    pub(crate) keep: bool,
}

impl World {
    pub(crate) async fn start(relay_bin: &str, relays: usize) -> Result<World> {
        let dir = std::env::temp_dir().join(format!("outbox-soak-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let pg = Postgres::start_with(true, "")?;
        pg.create_database("app").await?;
        let bouncer = PgBouncer::start(&pg)?;
        let nats = NatsCluster::start(3)?;
        nats.create_stream(STREAM, &[SUBJECTS], 3).await?;
        let mut pg_proxies = Vec::new();
        for i in 0..relays {
            let upstream = if i == 0 { bouncer.port() } else { pg.port() };
            pg_proxies.push(Proxy::start(([127, 0, 0, 1], upstream).into())?);
        }
        let mut nats_proxies = Vec::new();
        for url in nats.urls() {
            let port: u16 = url.rsplit(':').next().unwrap().parse()?;
            nats_proxies.push(Proxy::start(([127, 0, 0, 1], port).into())?);
        }
        let nats_url = nats_proxies
            .iter()
            .map(|p| format!("nats://127.0.0.1:{}", p.port()))
            .collect::<Vec<_>>()
            .join(",");
        let mut configs = Vec::new();
        for (i, proxy) in pg_proxies.iter().enumerate() {
            let path = dir.join(format!("relay{i}.toml"));
            let postgres = if i == 0 {
                format!(
                    "url = \"postgres://postgres@127.0.0.1:{}/app\"\nprepared_statements = false\n\
                     listen_url = \"{}\"\n",
                    proxy.port(),
                    pg.url("app")
                )
            } else {
                format!(
                    "url = \"postgres://postgres@127.0.0.1:{}/app\"\n",
                    proxy.port()
                )
            };
            std::fs::write(&path, relay_config(&postgres, &nats_url))?;
            configs.push(path);
        }
        let migrate = dir.join("migrate.toml");
        std::fs::write(
            &migrate,
            relay_config(&format!("url = \"{}\"\n", pg.url("app")), &nats_url),
        )?;
        let out = Command::new(relay_bin)
            .args(["migrate", "--config"])
            .arg(&migrate)
            .output()
            .with_context(|| format!("run {relay_bin} migrate"))?;
        if !out.status.success() {
            bail!("migrate: {}", String::from_utf8_lossy(&out.stderr));
        }
        let mut relays = Relays {
            bin: relay_bin.to_owned(),
            configs,
            logs: (0..relays)
                .map(|i| dir.join(format!("relay{i}.log")))
                .collect(),
            children: (0..relays).map(|_| None).collect(),
            stopped: vec![false; relays],
            unrequested_exits: Vec::new(),
            slow_exits: Vec::new(),
        };
        for i in 0..relays.children.len() {
            relays.spawn(i)?;
        }
        Ok(World {
            pg,
            bouncer,
            nats,
            pg_proxies,
            nats_proxies,
            relays,
            dir,
            keep: false,
        })
    }

    /// A direct connection to the database (the writer's and the audit's).
    pub(crate) async fn db(&self) -> Result<tokio_postgres::Client> {
        self.pg.connect("app").await
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.relays.kill_all();
        if self.keep {
            eprintln!("==> relay configs and logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Every relay's config: mark mode (the table keeps every row for the audit), small
/// batches, quick retries so poison rows are dead-lettered within seconds.
fn relay_config(postgres: &str, nats_url: &str) -> String {
    format!(
        "[postgres]\n{postgres}pool_size = 8\n\n\
         [relay]\nworkers = 4\nbatch_size = 100\npoll_interval = \"100ms\"\nordering = \"key\"\n\
         on_publish = \"mark\"\nmax_attempts = 3\nretry_backoff = \"200ms\"\n\
         retry_backoff_max = \"1s\"\n\n\
         [sink]\nkind = \"nats\"\npublish_timeout = \"5s\"\n\n\
         [sink.nats]\nurl = \"{nats_url}\"\n\n\
         [[tables]]\nname = \"public.outbox\"\ntopic = \"{{topic}}\"\n\n\
         [shutdown]\ndrain_timeout = \"{}s\"\n",
        DRAIN_TIMEOUT.as_secs()
    )
}

/// The relay processes and what happened to them.
pub(crate) struct Relays {
    bin: String,
    configs: Vec<PathBuf>,
    logs: Vec<PathBuf>,
    children: Vec<Option<Child>>,
    /// Stopped with SIGSTOP and not yet continued.
    stopped: Vec<bool>,
    /// Exits nobody asked for: (relay, exit status, the log's last lines).
    pub(crate) unrequested_exits: Vec<(usize, String, String)>,
    /// SIGTERMs not followed by an exit within the drain timeout: (relay, how long).
    pub(crate) slow_exits: Vec<(usize, Duration)>,
}

impl Relays {
    pub(crate) fn len(&self) -> usize {
        self.children.len()
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.logs[i])?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(["run", "--config"])
            .arg(&self.configs[i])
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        testkit::die_with_parent(&mut cmd);
        self.children[i] = Some(cmd.spawn().context("start outbox-relay run")?);
        self.stopped[i] = false;
        Ok(())
    }

    fn signal(&self, i: usize, signal: Signal) {
        if let Some(child) = &self.children[i] {
            let _ = testkit::send_signal(child.id(), signal);
        }
    }

    /// kill -9, then started again (as systemd's `Restart=always` would).
    pub(crate) fn kill(&mut self, i: usize) -> Result<()> {
        if let Some(mut child) = self.children[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.spawn(i)
    }

    /// SIGTERM, wait for the exit (recording a slow one), then start it again. Returns the
    /// exit code (`None`: ended by a signal).
    pub(crate) fn terminate(&mut self, i: usize) -> Result<Option<i32>> {
        let Some(mut child) = self.children[i].take() else {
            self.spawn(i)?;
            return Ok(None);
        };
        if self.stopped[i] {
            let _ = testkit::send_signal(child.id(), Signal::Cont);
        }
        let _ = testkit::send_signal(child.id(), Signal::Term);
        let start = Instant::now();
        let limit = DRAIN_TIMEOUT + EXIT_MARGIN;
        let code = loop {
            if let Some(status) = child.try_wait()? {
                break status.code();
            }
            if start.elapsed() > limit {
                self.slow_exits.push((i, start.elapsed()));
                let _ = child.kill();
                break child.wait()?.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        self.spawn(i)?;
        Ok(code)
    }

    /// SIGSTOP: the process freezes with its connections, transactions and locks open.
    pub(crate) fn pause(&mut self, i: usize) {
        self.signal(i, Signal::Stop);
        self.stopped[i] = true;
    }

    pub(crate) fn resume(&mut self, i: usize) {
        self.signal(i, Signal::Cont);
        self.stopped[i] = false;
    }

    /// Notices relays that exited on their own, records them and starts them again.
    pub(crate) fn reap(&mut self) -> Result<()> {
        for i in 0..self.children.len() {
            let exited = match &mut self.children[i] {
                Some(child) => child.try_wait()?,
                None => None,
            };
            if let Some(status) = exited {
                self.children[i] = None;
                self.unrequested_exits
                    .push((i, status.to_string(), self.log_tail(i, 5)));
                self.spawn(i)?;
            }
        }
        Ok(())
    }

    /// SIGTERM to every relay and a bounded wait for each; the exit codes.
    pub(crate) fn stop_all(&mut self) -> Vec<Option<i32>> {
        let mut codes = Vec::new();
        for i in 0..self.children.len() {
            if self.stopped[i] {
                self.resume(i);
            }
            self.signal(i, Signal::Term);
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT + EXIT_MARGIN;
        for i in 0..self.children.len() {
            let Some(mut child) = self.children[i].take() else {
                codes.push(None);
                continue;
            };
            let code = loop {
                match child.try_wait() {
                    Ok(Some(status)) => break status.code(),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        self.slow_exits.push((i, DRAIN_TIMEOUT + EXIT_MARGIN));
                        let _ = child.kill();
                        break child.wait().ok().and_then(|s| s.code());
                    }
                }
            };
            codes.push(code);
        }
        codes
    }

    fn kill_all(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub(crate) fn log_tail(&self, i: usize, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.logs[i]).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Lines of every relay's log that contain `needle`, prefixed with the relay's index.
    pub(crate) fn log_lines(&self, needle: &str) -> Vec<String> {
        let mut out = Vec::new();
        for (i, p) in self.logs.iter().enumerate() {
            let log = std::fs::read_to_string(p).unwrap_or_default();
            out.extend(
                log.lines()
                    .filter(|l| l.contains(needle))
                    .map(|l| format!("relay {i}: {l}")),
            );
        }
        out
    }
}
