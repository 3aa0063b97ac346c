//! The `outbox-relay` binary: parse the command line, set up logging, load the config,
//! run the command, map the outcome to an exit code (contract section 3).

use std::process::ExitCode;

use clap::Parser;
use outbox_relay::cli::{CheckFormat, Cli, Command, LogFormat, StatusFormat};
use outbox_relay::config::{self, Config};
use outbox_relay::relay::{self, Mode, Report};
use outbox_relay::shutdown::Shutdown;
use outbox_relay::source::migrate;
use outbox_relay::{admin, check};

/// Exit codes, fixed by the contract.
const EXIT_OK: u8 = 0;
const EXIT_FAILURE: u8 = 1;
const EXIT_CONFIG: u8 = 2;
const EXIT_DEADLINE: u8 = 3;

/// How long the runtime waits at exit for its blocking threads (a sink's flush, a Kafka
/// metadata request). The relay already awaited its tasks, within their own deadlines:
/// what is left is not waited for beyond this; the process is done.
const RUNTIME_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(1);

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let path = config::resolve_path(cli.config.as_deref());
    let config = match config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            fail(&format!("invalid config: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            fail(&format!("cannot start the async runtime: {e}"));
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let code = runtime.block_on(execute(cli.command, config));
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
    ExitCode::from(code)
}

async fn execute(command: Command, config: Config) -> u8 {
    match command {
        Command::Run => relay_until_stopped(&config, Mode::Run, None).await,
        Command::Drain { timeout } => {
            let limit = (!timeout.is_zero()).then_some(timeout);
            relay_until_stopped(&config, Mode::Drain, limit).await
        }
        Command::Migrate { no_notify } => run_migrate(&config, !no_notify).await,
        Command::Check { format, strict } => run_check(&config, format, strict).await,
        Command::Status { format } => match admin::status(&config).await {
            Ok(tables) => {
                match format {
                    StatusFormat::Text => tables.iter().for_each(|t| say(&t.to_string())),
                    StatusFormat::Json => say(&admin::status_json(&tables).to_string()),
                }
                EXIT_OK
            }
            Err(e) => admin_error(e),
        },
        Command::Requeue {
            table,
            ids,
            all,
            waiting,
        } => {
            let which = if all {
                admin::Requeue::All
            } else if waiting {
                admin::Requeue::Waiting
            } else {
                admin::Requeue::Ids(ids)
            };
            run_requeue(&config, table.as_deref(), which).await
        }
        Command::Pause { table, reason } => {
            match admin::pause(&config, table.as_deref(), &reason).await {
                Ok(reports) => {
                    reports.iter().for_each(|r| say(&r.after_pause()));
                    EXIT_OK
                }
                Err(e) => admin_error(e),
            }
        }
        Command::Resume { table } => match admin::resume(&config, table.as_deref()).await {
            Ok(reports) => {
                reports.iter().for_each(|r| say(&r.after_resume()));
                EXIT_OK
            }
            Err(e) => admin_error(e),
        },
        Command::Replay {
            table,
            ids,
            since,
            until,
            dry_run,
        } => {
            let which = match since {
                Some(since) => admin::Replay::Created {
                    since,
                    until: until.unwrap_or_else(|| "infinity".to_owned()),
                },
                None => admin::Replay::Ids(ids),
            };
            run_replay(&config, table.as_deref(), which, dry_run).await
        }
    }
}

/// `replay`: a progress line on stderr every second while it runs, how many rows were made
/// pending again, and a warning naming ids that were not kept as published.
async fn run_replay(
    config: &Config,
    table: Option<&str>,
    which: admin::Replay,
    dry_run: bool,
) -> u8 {
    let progress = admin::ReplayProgress::default();
    let done = tokio_util::sync::CancellationToken::new();
    let what = if dry_run { "counting" } else { "replaying" };
    let (result, ()) = tokio::join!(
        async {
            let result = admin::replay(config, table, which, dry_run, &progress).await;
            done.cancel();
            result
        },
        outbox_relay::ops::progress::count_toward(what, &progress.done, &progress.total, &done)
    );
    match result {
        Ok(report) => {
            say(&report.summary());
            report.warning().inspect(|w| say_err(w));
            EXIT_OK
        }
        Err(e) => admin_error(e),
    }
}

/// `check`: one line per finding (or one JSON document); exit 1 if any failed (with
/// `--strict`, a durability warning is a failure).
async fn run_check(config: &Config, format: CheckFormat, strict: bool) -> u8 {
    let report = check::check(config, strict).await;
    match format {
        CheckFormat::Text => report.findings.iter().for_each(|f| say(&f.to_string())),
        CheckFormat::Json => say(&report.to_json().to_string()),
    }
    if report.failed() {
        EXIT_FAILURE
    } else {
        EXIT_OK
    }
}

/// `requeue`: what was made due, and a warning naming ids that were not dead.
async fn run_requeue(config: &Config, table: Option<&str>, which: admin::Requeue) -> u8 {
    match admin::requeue(config, table, which).await {
        Ok(report) => {
            say(&report.summary());
            report.warning().inspect(|w| say_err(w));
            EXIT_OK
        }
        Err(e) => admin_error(e),
    }
}

fn admin_error(e: admin::AdminError) -> u8 {
    fail(&e.to_string());
    match e {
        admin::AdminError::Usage(_)
        | admin::AdminError::Source(outbox_relay::source::SourceError::Config(_)) => EXIT_CONFIG,
        admin::AdminError::Source(_) => EXIT_FAILURE,
    }
}

async fn relay_until_stopped(
    config: &Config,
    mode: Mode,
    timeout: Option<std::time::Duration>,
) -> u8 {
    let shutdown = Shutdown::new();
    if let Err(e) = shutdown.install_signal_handlers() {
        fail(&format!("cannot install signal handlers: {e}"));
        return EXIT_FAILURE;
    }
    if let Some(limit) = timeout {
        // The timeout bounds the whole drain, start-up included: batches in flight roll
        // back at once, as at the shutdown deadline (contract section 3).
        let s = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(limit).await;
            tracing::warn!(timeout = ?limit, "Drain timeout reached; rolling back batches in flight");
            s.abort();
        });
    }
    match relay::run(config, mode, shutdown).await {
        Ok(report) => {
            if mode == Mode::Drain {
                print_summary(config, &report);
            }
            exit_code(mode, &report)
        }
        // `run` asked to stop while still waiting for a dependency: a clean stop.
        Err(relay::RelayError::Unreachable { what, .. }) if mode == Mode::Run => {
            tracing::info!(dependency = %what, "Stopped before it was reached");
            EXIT_OK
        }
        // Two [[tables]] entries match one table: a config error only the catalog shows.
        Err(e @ relay::RelayError::Source(outbox_relay::source::SourceError::Config(_))) => {
            fail(&e.to_string());
            EXIT_CONFIG
        }
        Err(e) => {
            fail(&e.to_string());
            EXIT_FAILURE
        }
    }
}

/// A line on stdout; lost, not a panic, when stdout is closed (`outbox-relay status | head`).
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{line}");
}

/// A line on stderr; lost, not a panic, when stderr is closed.
fn say_err(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

static LOG_FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// How the process reports the error that ends it: `error: ...` on stderr, or one JSON
/// log line with `--log-format json`, so log pipelines see it like any other event.
fn fail(message: &str) {
    match LOG_FORMAT.get() {
        Some(LogFormat::Json) => tracing::error!(error = %message, "Exiting on an error"),
        _ => say_err(&format!("error: {message}")),
    }
}

fn exit_code(mode: Mode, report: &Report) -> u8 {
    match mode {
        _ if report.aborted => EXIT_DEADLINE,
        Mode::Drain if !report.drained || !report.paused_left.is_empty() => EXIT_DEADLINE,
        _ => EXIT_OK,
    }
}

/// One line: rows, rate, time. On stderr when the sink itself writes to stdout.
fn print_summary(config: &Config, report: &Report) {
    let secs = report.elapsed.as_secs_f64();
    let rate = if secs > 0.0 {
        report.published as f64 / secs
    } else {
        0.0
    };
    let state = match (&report.waiting, report.drained) {
        (_, true) if !report.paused_left.is_empty() => {
            "drained every table that is not paused".to_owned()
        }
        (_, true) => "drained".to_owned(),
        (Some((n, next)), false) => format!(
            "stopped with publishable rows left ({n} waiting for a retry, the next due in {next}; \
             `outbox-relay requeue --waiting` makes them due now)"
        ),
        (None, false) => "stopped with publishable rows left".to_owned(),
    };
    let mut line = format!(
        "{state}: {} rows published in {secs:.2}s ({rate:.0} rows/s), {} failed, {} dead-lettered",
        report.published, report.failed, report.dead
    );
    for (table, paused) in &report.paused_left {
        line.push_str(&format!(
            "\n{table}: {paused}; its rows were left alone (`outbox-relay resume --table \
             {table}`, then drain again)"
        ));
    }
    if matches!(config.sink.target, config::SinkTarget::Stdout) {
        say_err(&line);
    } else {
        say(&line);
    }
}

/// `migrate`: a line per table as it is brought up to date; exit 1 at the first failure.
async fn run_migrate(config: &Config, notify: bool) -> u8 {
    match migrate::migrate(config, notify, |report| say(&report.to_string())).await {
        Ok(()) => EXIT_OK,
        Err(e) => {
            fail(&e.to_string());
            EXIT_FAILURE
        }
    }
}

fn init_tracing(format: LogFormat) {
    let _ = LOG_FORMAT.set(format);
    use std::io::IsTerminal;
    // Default `info` for the relay; the client libraries only speak up when it matters.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,async_nats=warn,tokio_postgres=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(outbox_relay::ops::progress::Stderr);
    match format {
        LogFormat::Pretty => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
