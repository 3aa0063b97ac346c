//! The command line (contract section 3).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Relays transactional-outbox rows from PostgreSQL to NATS JetStream or Kafka"
)]
pub struct Cli {
    /// Config file [default: $OUTBOX_RELAY_CONFIG, else /etc/outbox-relay/relay.toml]
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Log format on stderr; the level comes from RUST_LOG (default info)
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Pretty)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Pretty,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Relay until SIGTERM/SIGINT, then drain in-flight batches and exit
    Run,
    /// Relay until no publishable row is left, then exit (0: empty; 3: --timeout reached)
    Drain {
        /// Give up after this long, start-up included, e.g. "90s" or "5m"; "0" waits
        /// without bound. The rows left stay in the table (exit 3; 1 if PostgreSQL or the
        /// broker was never reached)
        #[arg(long, value_parser = parse_duration_arg, value_name = "DUR", default_value = "10m")]
        timeout: Duration,
    },
    /// Create or upgrade the outbox schema (idempotent)
    Migrate {
        /// Leave out the NOTIFY trigger (for write-heavy databases); relays then poll
        #[arg(long)]
        no_notify: bool,
    },
    /// Validate the config, reach PostgreSQL and the broker, verify tables and streams
    Check,
    /// Per table: pending rows and the oldest one's age, failing rows, dead rows
    Status,
    /// Clear dead_at and attempts so dead rows are tried again; --waiting: retries are due now
    Requeue {
        /// The table (schema.table); needed when several are configured
        #[arg(long, value_name = "NAME")]
        table: Option<String>,
        /// Ids of dead rows (the order column's values), e.g. --id 17 42
        #[arg(long = "id", value_name = "N", num_args = 1.., required_unless_present_any = ["all", "waiting"], conflicts_with_all = ["all", "waiting"])]
        ids: Vec<i64>,
        /// Every dead row of the table
        #[arg(long, conflicts_with = "waiting")]
        all: bool,
        /// Rows waiting for their next attempt (after a failure) are due now
        #[arg(long)]
        waiting: bool,
    },
}

/// A duration as in the config (`90s`, `5m`), or `0`.
fn parse_duration_arg(text: &str) -> Result<Duration, String> {
    if text.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    crate::config::raw::parse_duration(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain_timeout(args: &[&str]) -> Duration {
        match Cli::try_parse_from(args).unwrap().command {
            Command::Drain { timeout } => timeout,
            other => panic!("not drain: {other:?}"),
        }
    }

    #[test]
    fn drain_is_bounded_by_10_minutes_unless_told_otherwise() {
        assert_eq!(
            drain_timeout(&["outbox-relay", "drain"]),
            Duration::from_secs(600)
        );
        assert_eq!(
            drain_timeout(&["outbox-relay", "drain", "--timeout", "90s"]),
            Duration::from_secs(90)
        );
        // 0: no bound (main treats a zero timeout as none).
        assert_eq!(
            drain_timeout(&["outbox-relay", "drain", "--timeout", "0"]),
            Duration::ZERO
        );
    }
}
