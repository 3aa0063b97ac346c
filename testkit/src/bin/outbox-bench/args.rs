//! The command line: every flag `scripts/bench` passes through, with its default.

use clap::{ArgAction, Parser};

/// The relay against this machine's own limits, on throwaway PostgreSQL, nats-server and
/// tansu; prints markdown tables. Run it through `scripts/bench`.
#[derive(Parser)]
#[command(name = "outbox-bench", args_override_self = true)]
pub(crate) struct Args {
    /// The outbox-relay binary to measure (C to H run it as a child process).
    #[arg(value_name = "PATH-TO-outbox-relay")]
    pub(crate) relay: String,
    /// Rows of each of A, B, C and E (the table is filled afresh before each).
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    pub(crate) rows: i64,
    /// Distinct keys over those rows (and the writer's rows in D, G and H).
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub(crate) keys: i64,
    /// Payload size of every row, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = 256)]
    pub(crate) payload: i64,
    /// `relay.workers` of the drains, and B's concurrent publishers.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub(crate) workers: usize,
    /// `relay.batch_size` of the drains, and B's messages per batch.
    #[arg(long, value_name = "N", default_value_t = 500)]
    pub(crate) batch: usize,
    /// Leave Kafka out: no tansu, no Kafka rows in B and C (Kafka is measured by default).
    #[arg(long = "no-kafka", action = ArgAction::SetFalse)]
    pub(crate) kafka: bool,
    /// Seconds per writer rate in D (1k, 2k, 5k and 20k rows/s); 0 skips D.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub(crate) steady_secs: u64,
    /// Rows of F's big drain, compared with one of 200,000 rows; 0 skips F.
    #[arg(long, value_name = "N", default_value_t = 5_000_000)]
    pub(crate) big_rows: i64,
    /// Seconds G holds the snapshot (in whole minutes, rounded up); 0 skips G.
    #[arg(long, value_name = "N", default_value_t = 600)]
    pub(crate) held_secs: u64,
    /// H's `relay.retention` in seconds (the writer runs for five of them); 0 skips H.
    #[arg(long, value_name = "N", default_value_t = 60)]
    pub(crate) retention_secs: u64,
    /// PostgreSQL with fsync, synchronous_commit and full_page_writes off (default: on,
    /// durable as PostgreSQL ships).
    #[arg(long)]
    pub(crate) fast: bool,
    /// Only the deployment shapes: S (relays x workers as drains started at once), R (the
    /// same shapes as relays already running), I (idle tables) and E3 (a new process
    /// behind a held snapshot); see `scale.rs`.
    #[arg(long)]
    pub(crate) scale: bool,
    /// Only the partial failures: K (one Kafka broker down); see `partial.rs`.
    #[arg(long)]
    pub(crate) partial: bool,
    /// Only the distant database: L (the NATS drain with 1, 5, 10 and 20 ms round trips to
    /// PostgreSQL); see `distant.rs`.
    #[arg(long)]
    pub(crate) distant: bool,
    /// Only the application's writers: W (pgbench's commit rate on the bare table, the
    /// migrated one, and with a relay draining it, with and without the wake-up);
    /// see `write_path.rs`.
    #[arg(long)]
    pub(crate) write_path: bool,
    /// Only the envelope's cost: V (the NATS key-ordered drain without an envelope and with
    /// `envelope = "cloudevents"` in binary mode, alternated, three rounds each).
    #[arg(long)]
    pub(crate) envelope: bool,
    /// With `--write-path`: seconds of each pgbench run.
    #[arg(long, value_name = "N", default_value_t = 12,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) write_secs: u64,
    /// With `--write-path`: rounds of every arm at every writer count (the arms run in
    /// reverse order every other round).
    #[arg(long, value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) write_rounds: u32,
    /// With `--write-path`: the `relay.ordering` of the migrated and relayed arms' config
    /// (`key`, the default, or `none`: `migrate` builds the indexes that order's claims
    /// read).
    #[arg(long, value_name = "ORDER", default_value = "key",
          value_parser = ["key", "none"])]
    pub(crate) write_ordering: String,
    /// With `--write-path`: the writer counts, pgbench clients (comma-separated).
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "1,8,32,64",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) writers: Vec<u32>,
    /// With `--scale`: only these of S, R, I, E3, M and I500 (comma-separated, e.g. `S,E3`;
    /// M, a busy table among 49 and 499 idle ones, and I500, 500 idle tables, only when
    /// named).
    #[arg(long, value_name = "PARTS", default_value = "S,R,I,E3")]
    pub(crate) scale_parts: String,
}
