//! A throwaway PgBouncer ([`PgBouncer`]) in `pool_mode = transaction` on a free 127.0.0.1
//! port, in front of a testkit [`Postgres`]: the pooler the relay must survive as
//! operators really run it.
//!
//! The generated `pgbouncer.ini` keeps PgBouncer's defaults except where a test harness
//! must differ (a comment in the file says why beside each setting). In particular it sets no
//! `ignore_startup_parameters`, so a client whose startup packet carries `options` is
//! refused, and (1.18) there is no `max_prepared_statements`: a named prepared statement
//! lives on one server connection only.
//!
//! Authentication: `auth_type = trust` with an `auth_file` listing `postgres` and
//! `outbox_relay` (no passwords). PgBouncer logs into PostgreSQL as the client's own
//! user, which the plain testkit cluster trusts on 127.0.0.1, so each role keeps its
//! privileges behind the bouncer. `auth_type = any` would need one fixed `user=` per
//! database and would turn `outbox_relay` into that user. Not for [`Postgres::start_tls`]
//! (its `outbox_relay` needs TLS and SCRAM to the server).
//!
//! PgBouncer refuses to run as root: when we are root it runs as the user PostgreSQL runs
//! as (`postgres`), on files in a scratch directory that user owns.
//!
//! Torn down by `Drop`: a paused bouncer is resumed, then killed (SIGKILL) and its
//! directory removed; it also gets SIGKILL if the thread that started it dies without
//! unwinding. [`PgBouncer::kill`], [`PgBouncer::pause`] and [`PgBouncer::start_again`]
//! play a pooler's faults in a test.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command};

use anyhow::{bail, Context, Result};

use crate::postgres::{pg_identity, Postgres};
use crate::process::{die_with_parent, free_port, scratch_dir, wait_for_port};

/// The users the `auth_file` lists: the cluster's superuser and the relay's role
/// (`migrations/outbox_relay_role.sql`). Any other user is refused by PgBouncer.
const USERS: [&str; 2] = ["postgres", "outbox_relay"];

/// What [`PgBouncer::start_with`] may change; everything else is PgBouncer's default.
#[derive(Debug, Clone)]
pub struct PgBouncerOptions {
    /// The `[databases]` entries, each the database of the same name on the cluster.
    /// Default: `["app"]`, the database the integration tests create.
    pub databases: Vec<String>,
    /// `default_pool_size`: server connections per (database, user) pair. Default: `None`,
    /// PgBouncer's own (20).
    pub pool_size: Option<u32>,
}

impl Default for PgBouncerOptions {
    fn default() -> Self {
        PgBouncerOptions {
            databases: vec!["app".to_owned()],
            pool_size: None,
        }
    }
}

/// A throwaway PgBouncer (`/usr/sbin/pgbouncer`, or `$PGBOUNCER`) in transaction mode.
pub struct PgBouncer {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    identity: Option<(u32, u32)>,
}

impl PgBouncer {
    /// A bouncer for database `app` on `pg`, with PgBouncer's default pool size.
    pub fn start(pg: &Postgres) -> Result<PgBouncer> {
        Self::start_with(pg, &PgBouncerOptions::default())
    }

    /// A bouncer for `options.databases` on `pg`.
    pub fn start_with(pg: &Postgres, options: &PgBouncerOptions) -> Result<PgBouncer> {
        // Built first, so that its Drop removes the directory if a step below fails.
        let mut bouncer = PgBouncer {
            dir: scratch_dir("pgbouncer")?,
            port: free_port(),
            child: None,
            identity: pg_identity()?,
        };
        let (dir, port) = (&bouncer.dir, bouncer.port);
        let mut databases = String::new();
        for db in &options.databases {
            databases.push_str(&format!(
                "{db} = host=127.0.0.1 port={} dbname={db}\n",
                pg.port()
            ));
        }
        let users: String = USERS.iter().map(|u| format!("\"{u}\" \"\"\n")).collect();
        let pool_size = options
            .pool_size
            .map(|n| format!("default_pool_size = {n}\n"))
            .unwrap_or_default();
        let ini = format!(
            "[databases]\n{databases}\n\
             [pgbouncer]\n\
             ; Loopback only, on a port no other test uses.\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             ; The pooling mode the relay is meant to survive (the default is session).\n\
             pool_mode = transaction\n\
             ; No passwords: see the module doc of testkit/src/pgbouncer.rs.\n\
             auth_type = trust\n\
             auth_file = {auth}\n\
             ; No socket in /tmp to collide with or leave behind: tests use TCP.\n\
             unix_socket_dir =\n\
             {pool_size}",
            auth = dir.join("userlist.txt").display(),
        );
        std::fs::write(dir.join("userlist.txt"), users)?;
        std::fs::write(dir.join("pgbouncer.ini"), ini)?;
        if let Some((uid, gid)) = bouncer.identity {
            for path in ["", "userlist.txt", "pgbouncer.ini"] {
                std::os::unix::fs::chown(dir.join(path), Some(uid), Some(gid))?;
            }
        }
        bouncer.spawn()?;
        Ok(bouncer)
    }

    fn spawn(&mut self) -> Result<()> {
        let log = self.dir.join("pgbouncer.log");
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let binary = std::env::var_os("PGBOUNCER").unwrap_or_else(|| "/usr/sbin/pgbouncer".into());
        let mut cmd = Command::new(&binary);
        cmd.arg(self.dir.join("pgbouncer.ini"))
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        if let Some((uid, gid)) = self.identity {
            cmd.uid(uid).gid(gid);
        }
        die_with_parent(&mut cmd);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("start {binary:?} (install the pgbouncer package)"))?;
        // PgBouncer opens server connections only when a client asks, so listening is ready.
        if let Err(e) = wait_for_port(self.port, &mut child, "pgbouncer", &log) {
            // An exit is reported with the log already; a timeout is not.
            let exited = matches!(child.try_wait(), Ok(Some(_)));
            let _ = child.kill();
            let _ = child.wait();
            if exited {
                return Err(e);
            }
            bail!("{e}; its log:\n{}", self.log());
        }
        self.child = Some(child);
        Ok(())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// URL of `database` through the bouncer as `user` (no password: see the module doc).
    pub fn url(&self, user: &str, database: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{database}", self.port)
    }

    /// Connects to `database` through the bouncer as `user`.
    pub async fn connect(&self, user: &str, database: &str) -> Result<tokio_postgres::Client> {
        let (client, connection) =
            tokio_postgres::connect(&self.url(user, database), tokio_postgres::NoTls)
                .await
                .context("connect through the throwaway pgbouncer")?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// What PgBouncer logged so far (its stderr), for a failing test's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    /// Kills the bouncer (SIGKILL): every client and server connection drops at once.
    pub fn kill(&mut self) {
        crate::process::kill_child(&mut self.child);
    }

    /// Freezes the bouncer (SIGSTOP): connections stay open, nothing is answered. The
    /// shape of a pooler that stalls.
    pub fn pause(&self) {
        self.signal(crate::Signal::Stop);
    }

    /// Thaws a paused bouncer (SIGCONT).
    pub fn resume(&self) {
        self.signal(crate::Signal::Cont);
    }

    fn signal(&self, signal: crate::Signal) {
        crate::process::signal_child(&self.child, signal);
    }

    /// Starts it again on the same port and config (after [`Self::kill`]).
    pub fn start_again(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
