//! A throwaway PostgreSQL cluster ([`Postgres`]): `initdb` into a scratch directory, then
//! `postgres` on a free 127.0.0.1 port (with TLS and SCRAM for one role when asked), run
//! as the `postgres` user when we are root.
//!
//! Torn down by `Drop`: an immediate shutdown (SIGQUIT) and the directory removed; the
//! server also gets SIGKILL if the thread that started it dies without unwinding.
//! [`Postgres::stop_immediate`] and [`Postgres::restart`] crash and restart it in a test.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::process::{die_with_parent, free_port, scratch_dir, wait_for_port};
use crate::tls::TestCa;

/// Where the PostgreSQL server binaries are: `$PG_BIN`, else the newest
/// `/usr/lib/postgresql/*/bin`, else `$PATH`.
pub fn pg_bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return Path::new(&dir).join(name);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, dir)) => dir.join(name),
        None => PathBuf::from(name),
    }
}

/// The uid/gid to run PostgreSQL as: ourselves, or the `postgres` user when we are root
/// (initdb and postgres refuse to run as root; so does pgbouncer).
pub(crate) fn pg_identity() -> Result<Option<(u32, u32)>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.first() == Some(&"postgres") && fields.len() > 3 {
            return Ok(Some((fields[2].parse()?, fields[3].parse()?)));
        }
    }
    bail!("running as root, but there is no `postgres` user to run PostgreSQL as: install the postgresql package")
}

/// A throwaway PostgreSQL cluster. Superuser `postgres`, trust authentication, on
/// 127.0.0.1 only.
pub struct Postgres {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    identity: Option<(u32, u32)>,
}

impl Postgres {
    /// initdb + start. Durability is relaxed (`fsync=off`) unless `durable` is set.
    pub fn start() -> Result<Postgres> {
        Self::start_with(false, "")
    }

    /// initdb + start, durable (`fsync`, `synchronous_commit`, `full_page_writes` on, as
    /// PostgreSQL ships) or not, with `settings` (postgresql.conf lines) added last.
    pub fn start_with(durable: bool, settings: &str) -> Result<Postgres> {
        Self::start_inner(durable, None, settings)
    }

    /// A cluster with `ssl = on`, serving `ca`'s server certificate (SAN: IP 127.0.0.1
    /// only). pg_hba: role `outbox_relay` must come over TLS with a SCRAM password (a plain
    /// connection is rejected); everyone else is trusted, with or without TLS.
    pub fn start_tls(ca: &TestCa) -> Result<Postgres> {
        Self::start_inner(false, Some(ca), "")
    }

    fn start_inner(durable: bool, tls: Option<&TestCa>, settings: &str) -> Result<Postgres> {
        let dir = scratch_dir("pg")?;
        let identity = pg_identity()?;
        if let Some((uid, gid)) = identity {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let data = dir.join("data");
        let mut initdb = Command::new(pg_bin("initdb"));
        initdb
            .args(["-D"])
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some((uid, gid)) = identity {
            initdb.uid(uid).gid(gid);
        }
        let out = initdb
            .output()
            .with_context(|| format!("run {}", pg_bin("initdb").display()))?;
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let mut pg = Postgres {
            dir,
            port: free_port(),
            child: None,
            identity,
        };
        let mut conf = String::from(
            "listen_addresses = '127.0.0.1'\nmax_connections = 200\nshared_buffers = 128MB\n\
             max_prepared_transactions = 10\n",
        );
        if !durable {
            conf.push_str("fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n");
        }
        if let Some(ca) = tls {
            for (from, to) in [
                (ca.server_cert(), "server.crt"),
                (ca.server_key(), "server.key"),
            ] {
                let target = data.join(to);
                std::fs::copy(&from, &target)?;
                std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600))?;
                if let Some((uid, gid)) = identity {
                    std::os::unix::fs::chown(&target, Some(uid), Some(gid))?;
                }
            }
            conf.push_str("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
            conf.push_str("password_encryption = 'scram-sha-256'\n");
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\n\
                 hostnossl all outbox_relay 127.0.0.1/32 reject\n\
                 hostssl all outbox_relay 127.0.0.1/32 scram-sha-256\n\
                 host all all 127.0.0.1/32 trust\n",
            )?;
        }
        conf.push_str(settings);
        std::fs::write(data.join("postgresql.auto.conf"), conf)?;
        pg.spawn()?;
        Ok(pg)
    }

    /// A cluster on the data directory `dir/data` another harness made (a base backup),
    /// owned by `identity`, started on a free port; removed with `dir` when dropped.
    pub(crate) fn start_on(dir: PathBuf, identity: Option<(u32, u32)>) -> Result<Postgres> {
        let mut pg = Postgres {
            dir,
            port: free_port(),
            child: None,
            identity,
        };
        pg.spawn()?;
        Ok(pg)
    }

    /// The server log (error messages; what a test's `log_*` settings make it record).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    fn spawn(&mut self) -> Result<()> {
        let log = self.dir.join("postgres.log");
        let log_file = std::fs::File::create(&log)?;
        if let Some((uid, gid)) = self.identity {
            std::os::unix::fs::chown(&log, Some(uid), Some(gid))?;
        }
        let mut cmd = Command::new(pg_bin("postgres"));
        cmd.arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        if let Some((uid, gid)) = self.identity {
            cmd.uid(uid).gid(gid);
        }
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().context("start postgres")?;
        wait_for_port(self.port, &mut child, "postgres", &log)?;
        self.child = Some(child);
        // Accepting TCP is not yet accepting queries: wait until a query succeeds.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = Command::new(pg_bin("pg_isready"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                ])
                .stdout(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("postgres did not become ready within 30s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// URL of `database` as the superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Connects to `database` as the superuser.
    pub async fn connect(&self, database: &str) -> Result<tokio_postgres::Client> {
        let (client, connection) =
            tokio_postgres::connect(&self.url(database), tokio_postgres::NoTls)
                .await
                .context("connect to the throwaway postgres")?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// Creates an empty database and returns its URL.
    pub async fn create_database(&self, name: &str) -> Result<String> {
        let admin = self.connect("postgres").await?;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await?;
        Ok(self.url(name))
    }

    /// Stops the server the hard way (SIGQUIT: immediate shutdown, crash recovery on start).
    pub fn stop_immediate(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = crate::send_signal(child.id(), crate::Signal::Quit);
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data.
    pub fn restart(&mut self) -> Result<()> {
        self.stop_immediate();
        self.spawn()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop_immediate();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
