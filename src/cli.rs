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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StatusFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CheckFormat {
    Text,
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
        /// Leave out the wake-up that sends NOTIFY (for write-heavy databases); relays then poll
        #[arg(long)]
        no_notify: bool,
    },
    /// Validate the config, reach PostgreSQL and the broker, verify tables and streams, and
    /// report each destination's durability (exit 1 if anything failed)
    Check {
        /// text: one line per finding; json: one document with the findings and, per
        /// stream or topic, its durability settings and warnings
        #[arg(long, value_enum, default_value_t = CheckFormat::Text)]
        format: CheckFormat,
        /// A durability warning (a setting that lets the broker lose an acknowledged
        /// message) is a failure: exit 1
        #[arg(long)]
        strict: bool,
    },
    /// Per table: pending rows and the oldest one's age, failing rows, dead rows, paused
    Status {
        /// text: one line per table (and its held rows); json: one document
        /// `{"tables": [...]}` for scripts
        #[arg(long, value_enum, default_value_t = StatusFormat::Text)]
        format: StatusFormat,
    },
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
    /// Every relay of the table stops claiming it (within about a second; batches in
    /// flight finish) until `resume`; the state is kept in PostgreSQL
    Pause {
        /// The table (schema.table); without it, every configured table
        #[arg(long, value_name = "NAME")]
        table: Option<String>,
        /// Why, for `status`, the logs and whoever resumes it
        #[arg(long, value_name = "TEXT", default_value = "")]
        reason: String,
    },
    /// Every relay of the table claims it again
    Resume {
        /// The table (schema.table); without it, every configured table
        #[arg(long, value_name = "NAME")]
        table: Option<String>,
    },
    /// Mark mode: publish rows kept as published again (same message ids), in id order per key
    Replay {
        /// The table (schema.table); needed when several are configured
        #[arg(long, value_name = "NAME")]
        table: Option<String>,
        /// Ids of published rows (the order column's values), e.g. --id 17 42
        #[arg(long = "id", value_name = "N", num_args = 1.., required_unless_present = "since", conflicts_with_all = ["since", "until"])]
        ids: Vec<i64>,
        /// Rows created at or after this: an RFC 3339 time (2026-11-24T08:00:00Z) or a
        /// duration back from now (2h)
        #[arg(long, value_name = "TIME", value_parser = parse_time_arg)]
        since: Option<String>,
        /// Rows created before this (same forms; default: now and later)
        #[arg(long, value_name = "TIME", value_parser = parse_time_arg, requires = "since")]
        until: Option<String>,
        /// Count the rows that would be replayed; change nothing
        #[arg(long)]
        dry_run: bool,
    },
}

/// An RFC 3339 time (`Z` or a `+hh:mm` offset), or a duration back from now (`2h`),
/// as RFC 3339 text PostgreSQL reads as `timestamptz`.
fn parse_time_arg(text: &str) -> Result<String, String> {
    let text = text.trim();
    if let Ok(back) = crate::config::raw::parse_duration(text) {
        let at = std::time::SystemTime::now()
            .checked_sub(back)
            .ok_or_else(|| format!("{text} back from now is before 1970"))?;
        return Ok(humantime::format_rfc3339_micros(at).to_string());
    }
    // humantime reads UTC times only: check the rest of a time with an offset.
    let offset = text.len().checked_sub(6).filter(|&i| {
        text.is_char_boundary(i) && matches!(&text[i..i + 1], "+" | "-") && text[i..].contains(':')
    });
    let utc = match offset {
        Some(i) => format!("{}Z", &text[..i]),
        None => text.to_owned(),
    };
    humantime::parse_rfc3339_weak(utc.trim_end_matches(['Z', 'z']))
        .map(|_| text.to_owned())
        .map_err(|_| {
            format!(
                "{text:?} is neither an RFC 3339 time (2026-11-24T08:00:00Z, \
                 2026-11-24T09:00:00+01:00) nor a duration back from now (2h, 30m)"
            )
        })
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
    fn replay_times_are_rfc_3339_or_a_duration_back_from_now() {
        assert_eq!(
            parse_time_arg("2026-11-24T08:00:00Z").unwrap(),
            "2026-11-24T08:00:00Z"
        );
        assert_eq!(
            parse_time_arg("2026-11-24T09:00:00+01:00").unwrap(),
            "2026-11-24T09:00:00+01:00"
        );
        let back = parse_time_arg("2h").unwrap();
        let at = humantime::parse_rfc3339(&back).unwrap();
        let ago = std::time::SystemTime::now().duration_since(at).unwrap();
        assert!(ago >= Duration::from_secs(7200) && ago < Duration::from_secs(7260));
        assert!(parse_time_arg("yesterday")
            .unwrap_err()
            .contains("RFC 3339"));
        assert!(parse_time_arg("2026-13-40T00:00:00Z").is_err());
    }

    #[test]
    fn replay_takes_ids_or_a_time_range_not_both() {
        let parse = |args: &[&str]| Cli::try_parse_from(args);
        assert!(parse(&["outbox-relay", "replay", "--id", "1", "2"]).is_ok());
        assert!(parse(&["outbox-relay", "replay", "--since", "2h"]).is_ok());
        assert!(parse(&["outbox-relay", "replay"]).is_err());
        assert!(parse(&["outbox-relay", "replay", "--id", "1", "--since", "2h"]).is_err());
        assert!(parse(&["outbox-relay", "replay", "--until", "1h"]).is_err());
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
