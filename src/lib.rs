//! outbox-relay moves rows from transactional outbox tables in PostgreSQL to NATS
//! JetStream (and Kafka), at least once, in per-key order, and drains cleanly on SIGTERM.
//!
//! # Module map
//!
//! - [`cli`]: the command line (clap).
//! - [`config`]: TOML + `${VAR}` + `OUTBOX_RELAY__*` overrides -> a validated [`config::Config`].
//!   The only place that checks input, and a leaf: it uses no other module of the crate.
//! - [`source`]: PostgreSQL. Pool and session deadlines, table inspection, the SQL, the
//!   key-ordered claim (its invariant is documented in [`source::claim`]), migrations,
//!   LISTEN/NOTIFY.
//! - [`sink`]: the sink contract ([`sink::SinkService`]) and one folder per implementation:
//!   Kafka, NATS JetStream, stdout, memory.
//! - [`relay`]: supervisor and workers: claim -> publish -> await acks -> mark -> commit;
//!   per-key publish order in [`relay::order`].
//! - [`shutdown`]: signals -> cancellation-token tree (`stop`, then `abort` at the deadline).
//! - [`check`]: the `check` command's findings.
//! - [`admin`]: the `status` and `requeue` commands.
//! - [`ops`]: metrics, `/healthz` `/readyz`, systemd notifications.
//! - [`error`]: the three classes every error falls into: transient, bad row, fatal.
//! - [`retry`]: the one capped exponential backoff with full jitter everyone uses.

pub mod admin;
pub mod check;
pub mod cli;
pub mod config;
pub mod error;
pub mod ops;
pub mod relay;
pub mod retry;
pub mod shutdown;
pub mod sink;
pub mod source;
