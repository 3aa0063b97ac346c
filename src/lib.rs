//! outbox-relay moves rows from transactional outbox tables in PostgreSQL to NATS
//! JetStream (and Kafka), at least once, in per-key order, and drains cleanly on SIGTERM.
//!
//! # Module map
//!
//! ARCHITECTURE.md follows a row from claim to commit and says where each promise of the
//! contract is kept and tested; `tests/it/layers.rs` keeps the layering below.
//!
//! - [`cli`]: the command line (clap).
//! - [`config`]: a leaf. TOML + `${VAR}` + `OUTBOX_RELAY__*` overrides -> a checked
//!   [`config::Config`]; the one place input is checked (exit 2), each sink's keys in its
//!   own file.
//! - [`source`]: PostgreSQL. Session deadlines per command (`source::session`), tables
//!   ready to relay ([`source::table`]), the SQL (`source::sql`), the key-ordered claim
//!   (its invariant proved in [`source::claim`], key buckets for many claimers included),
//!   the claim floor, retention, the `migrate` command ([`source::migrate`]),
//!   LISTEN/NOTIFY and the sleep marks that gate it (`source::sleepers`), the tables a
//!   `[[tables]]` pattern matches ([`source::discover`]), and what to do about each error
//!   (`source::class`).
//! - [`sink`]: the sink contract (`sink::SinkService`) and one folder per implementation:
//!   Kafka, NATS JetStream, stdout, memory (tests: the `testing` feature).
//! - [`relay`]: `run`/`drain`: start-up, the workers, which tables are due for a claim
//!   (`relay::wake`: idle tables cost next to nothing; `relay::sleep`: the writers notify
//!   only while a relay sleeps), one batch in phases (claim ->
//!   publish -> settle -> finalize), per-key publish order (`relay::order`), tables found
//!   by pattern while running (`relay::discovery`: a generation per set of tables), the circuit
//!   breaker, the run's state and report, and the background tasks it awaits at the end.
//! - [`shutdown`]: signals -> cancellation-token tree (`stop`, then `abort` at the deadline).
//! - [`ops`]: metrics, `/healthz` `/readyz`, the probe, drain's progress line, systemd.
//! - [`check`]: the `check` command's findings, each destination's durability among them
//!   (`check::durability`: a stream's or topic's settings -> warnings naming the fix).
//! - [`admin`]: the `status`, `requeue`, `replay` and `pause`/`resume` commands.
//! - `error`: the three classes every error falls into: transient, bad row, fatal.
//! - `retry`: the one capped exponential backoff with full jitter everyone uses.
//!
//! # The public surface
//!
//! This library is the binary's, not a published API: an item is `pub(crate)` unless
//! `main.rs`, the integration tests (`tests/it/`) or testkit (its `outbox-bench` and
//! `outbox-soak` link the relay) use it, and `#![warn(unreachable_pub)]` keeps it so, so
//! that the compiler reports dead code. What is `pub`:
//!
//! - the commands: [`cli`], [`config::load`] and [`config::Config`], [`relay::run`] with
//!   its [`relay::Report`] and its [`relay::RelayError`] (with [`relay::TableFailed`], the
//!   fatal error a worker met), [`source::migrate`], [`check`], [`admin`], [`shutdown`],
//!   and `ops::progress::Stderr` (drain's progress line);
//! - for tests that drive the parts directly: [`source::Source`] and its transactions,
//!   [`source::table::prepare`], [`source::claim::claim_batch`] (with the claim's
//!   constants), [`sink::Sink`], [`sink::Message`], [`sink::SinkError`] and
//!   [`sink::kafka::partition_of`];
//! - with the `testing` feature only (testkit turns it on; the shipped binary is built
//!   without it): the memory sink (`sink::memory`), `relay::run_with_sink` and
//!   `config::adversarial_ident`.

// `pub(crate)` by default: an item is `pub` only if the binary, the integration tests or
// testkit use it (the public surface). A `pub` nothing outside can reach is flagged.
#![warn(unreachable_pub)]
// The documentation is for the engineers who own this code, not for a crate's users: the
// public items' docs link to the private ones that do the work, and `cargo doc
// --document-private-items` renders both.
#![allow(rustdoc::private_intra_doc_links)]

pub mod admin;
pub mod check;
pub mod cli;
pub mod config;
mod error;
pub mod ops;
pub mod relay;
mod retry;
pub mod shutdown;
pub mod sink;
pub mod source;
