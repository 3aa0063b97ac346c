//! pgbench as a child process: the application's writers in W (`write_path.rs`), and the
//! summary it prints.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// What pgbench printed about a run.
pub(crate) struct Summary {
    /// Transactions a second, without the time its clients took to connect.
    pub(crate) tps: f64,
    /// Transactions committed.
    pub(crate) transactions: i64,
}

/// Runs pgbench: `writers` clients on up to two threads (the machine's cores), for `secs`,
/// `script` in prepared mode, no vacuum of pgbench's own tables (there are none).
pub(crate) async fn run(url: &str, writers: u32, secs: u64, script: &Path) -> Result<Summary> {
    let threads = writers.min(2);
    let out = tokio::process::Command::new(testkit::pg_bin("pgbench"))
        .args(["-n", "-M", "prepared"])
        .args(["-c", &writers.to_string(), "-j", &threads.to_string()])
        .args(["-T", &secs.to_string(), "-f"])
        .arg(script)
        .arg(url)
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("run {}", testkit::pg_bin("pgbench").display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "pgbench exited with {}: {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse(&stdout).with_context(|| format!("pgbench's output:\n{stdout}"))
}

/// The rate and the transactions of pgbench 15's summary. A failed transaction is an
/// error: W's scripts have no conflict to retry, so one means the run measured something
/// other than the writers' commits.
fn parse(stdout: &str) -> Result<Summary> {
    let field = |prefix: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
    };
    if let Some(failed) = field("number of failed transactions: ") {
        if failed != "0" {
            bail!("{failed} failed transactions");
        }
    }
    let tps = field("tps = ")
        .filter(|_| stdout.contains("(without initial connection time)"))
        .context("no `tps = X (without initial connection time)` line")?
        .parse()?;
    let transactions = field("number of transactions actually processed: ")
        .context("no transaction count")?
        .parse()?;
    Ok(Summary { tps, transactions })
}
