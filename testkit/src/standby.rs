//! A streaming standby ([`Standby`]) of a testkit [`Postgres`], synchronous, so that a row
//! the primary acknowledged is on both; and [`failover_url`], the multi-host URL a client
//! uses to follow the primary role from one to the other.
//!
//! [`Standby::start`] takes `pg_basebackup -R` of a running primary (as the user
//! PostgreSQL runs as, see [`pg_identity`]) into a new scratch directory, starts it on a
//! free 127.0.0.1 port, waits until the primary's `pg_stat_replication` shows it
//! streaming, then turns on synchronous replication on the primary
//! (`synchronous_standby_names = '*'`, `synchronous_commit = on`, by `ALTER SYSTEM` and a
//! reload) and waits until the standby is `sync`. The settings are made after the base
//! backup on purpose: the standby does not inherit them, so once promoted it commits
//! without waiting for a standby it does not have.
//!
//! Replication uses the `host replication all 127.0.0.1/32 trust` line `initdb
//! --auth=trust` writes, so any plain [`Postgres`] can be a primary; the primary's
//! PostgreSQL defaults (`wal_level = replica`, `max_wal_senders = 10`) suffice. Not for
//! [`Postgres::start_tls`], whose `pg_hba.conf` has no replication line.
//!
//! Failover in a test: [`Postgres::stop_immediate`] on the primary (SIGQUIT: it dies as
//! in a crash, its clients see their connections drop), then [`Standby::promote`], which
//! returns the new primary once it accepts writes. Torn down by `Drop` as any
//! [`Postgres`].

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::postgres::{pg_bin, pg_identity, Postgres};
use crate::process::scratch_dir;

/// How long each step (streaming, sync, promotion) may take before we give up.
const STEP_LIMIT: Duration = Duration::from_secs(60);

/// A hot standby streaming synchronously from a primary.
pub struct Standby {
    pg: Postgres,
}

impl Standby {
    /// A standby of `primary`, streaming and synchronous when this returns.
    pub fn start(primary: &Postgres) -> Result<Standby> {
        let dir = scratch_dir("pg-standby")?;
        let identity = pg_identity()?;
        if let Some((uid, gid)) = identity {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let mut backup = Command::new(pg_bin("pg_basebackup"));
        backup
            .args(["-h", "127.0.0.1", "-p", &primary.port().to_string()])
            .args(["-U", "postgres", "-D"])
            .arg(dir.join("data"))
            // -R: standby.signal and primary_conninfo; fast checkpoint; WAL streamed along.
            .args([
                "-R",
                "--checkpoint=fast",
                "--wal-method=stream",
                "--no-sync",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some((uid, gid)) = identity {
            backup.uid(uid).gid(gid);
        }
        let out = backup
            .output()
            .with_context(|| format!("run {}", pg_bin("pg_basebackup").display()))?;
        if !out.status.success() {
            let _ = std::fs::remove_dir_all(&dir);
            bail!(
                "pg_basebackup failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let standby = Standby {
            pg: Postgres::start_on(dir, identity)?,
        };
        // The standby's log says why it does not stream, if it does not.
        wait_for(&standby.pg, "the standby to stream", || {
            Ok(psql(
                primary,
                &["SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"],
            )? == "1")
        })?;
        psql(
            primary,
            &[
                "ALTER SYSTEM SET synchronous_standby_names = '*'",
                "ALTER SYSTEM SET synchronous_commit = on",
                "SELECT pg_reload_conf()",
            ],
        )?;
        wait_for(primary, "the standby to be synchronous", || {
            Ok(psql(
                primary,
                &["SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"],
            )? == "1")
        })?;
        Ok(standby)
    }

    /// The standby as a server: its port, URL, read-only connections.
    pub fn postgres(&self) -> &Postgres {
        &self.pg
    }

    /// Promotes the standby (`pg_promote()`, which waits for the end of recovery) and
    /// returns it once it accepts writes (`pg_is_in_recovery()` is false).
    pub fn promote(self) -> Result<Postgres> {
        let pg = self.pg;
        psql(&pg, &["SELECT pg_promote(true, 60)"])?;
        wait_for(&pg, "the promoted standby to accept writes", || {
            Ok(psql(&pg, &["SELECT pg_is_in_recovery()"])? == "f")
        })?;
        Ok(pg)
    }
}

/// A URL of `database` as `user` naming every server in `hosts`, in order, with
/// `target_session_attrs=read-write`: a client connects to the first that accepts writes.
pub fn failover_url(user: &str, hosts: &[&Postgres], database: &str) -> String {
    let hosts: Vec<String> = hosts
        .iter()
        .map(|pg| format!("127.0.0.1:{}", pg.port()))
        .collect();
    format!(
        "postgres://{user}@{}/{database}?target_session_attrs=read-write",
        hosts.join(",")
    )
}

/// Runs `statements` (one `-c` each, so each is its own transaction) as the superuser on
/// database `postgres` of `pg`; returns the unaligned output, trimmed.
fn psql(pg: &Postgres, statements: &[&str]) -> Result<String> {
    let mut cmd = Command::new(pg_bin("psql"));
    cmd.args(["-h", "127.0.0.1", "-p", &pg.port().to_string()])
        .args([
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-XAtq",
            "-v",
            "ON_ERROR_STOP=1",
        ]);
    for sql in statements {
        cmd.args(["-c", sql]);
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("run {}", pg_bin("psql").display()))?;
    if !out.status.success() {
        bail!(
            "psql {statements:?} on port {}: {}",
            pg.port(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Polls `done` every 50 ms for at most [`STEP_LIMIT`]; the error names `what` and
/// carries `pg`'s log.
fn wait_for(pg: &Postgres, what: &str, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    loop {
        if done()? {
            return Ok(());
        }
        if start.elapsed() > STEP_LIMIT {
            bail!(
                "timed out after {STEP_LIMIT:?} waiting for {what}; log:\n{}",
                pg.log()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
