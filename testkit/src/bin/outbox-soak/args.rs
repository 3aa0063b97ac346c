//! The command line: every flag `scripts/soak` passes through, with its default.

use clap::Parser;

/// A randomized fault soak of `outbox-relay run`: throwaway PostgreSQL (durable), PgBouncer,
/// a three-server NATS cluster and TCP proxies; a writer commits rows while seeded faults
/// fire; an independent audit of the table and the stream prints one table and exits 1 if
/// any row was lost, any message is a phantom or any key is out of order.
#[derive(Parser, Debug, Clone)]
#[command(name = "outbox-soak", args_override_self = true)]
pub(crate) struct Args {
    /// The outbox-relay binary to soak (run as child processes).
    #[arg(value_name = "PATH-TO-outbox-relay")]
    pub(crate) relay: String,
    /// How long the writer writes and faults fire, in minutes (fractions allowed).
    #[arg(long, value_name = "N", default_value_t = 40.0)]
    pub(crate) minutes: f64,
    /// How many faults fire, spread evenly over `--minutes` (each at a jittered moment).
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub(crate) faults: u32,
    /// The seed of every random choice: fault kinds, targets, hold times, the writer's keys
    /// and its long transactions. The same seed gives the same schedule.
    #[arg(long, value_name = "S", default_value_t = 1)]
    pub(crate) seed: u64,
    /// `outbox-relay run` processes (2 or 3); the first goes through PgBouncer.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=3))]
    pub(crate) relays: u32,
    /// The writer's steady rate, rows per second (committed in a transaction every 10 ms).
    #[arg(long, value_name = "N", default_value_t = 300)]
    pub(crate) rate: u32,
    /// Distinct keys the writer spreads its rows over (besides NULL keys and poison rows).
    #[arg(long, value_name = "N", default_value_t = 500)]
    pub(crate) keys: u32,
    /// How long the relays get, once the writer stopped and every fault is healed, to
    /// publish what is left before the audit counts it as undelivered (seconds).
    #[arg(long, value_name = "N", default_value_t = 180)]
    pub(crate) settle_secs: u64,
}
