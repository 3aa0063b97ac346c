//! The integration tests: one binary, one module per subject, the helpers in [`common`].
//!
//! One binary, not one per file: each test binary links librdkafka and OpenSSL and
//! compiled `common` again, so two dozen of them made every test build relink two dozen
//! times. A subject runs alone with `cargo test --test it faults::`, one test with
//! `cargo test --test it <test_name>`.
//!
//! The tests of all modules share one process: nothing here may change process-wide state
//! (environment variables, the working directory) — a child's environment is set on its
//! `Command`. Side by side they share the machine: a test that measures a stall and must
//! have it to itself waits for [`common::alone`].

mod common;

mod cloudevents;
mod config_errors;
mod container;
mod distant;
mod docs;
mod durability;
mod failover;
mod faults;
mod flat_cost;
mod hardening;
mod held;
mod kafka_leaders;
mod kafka_mock;
mod kafka_tansu;
mod layers;
mod lengths;
mod monitoring;
mod nats_cluster;
mod nats_relay;
mod ops;
mod ordering;
mod patterns;
mod pgbouncer;
mod pgbouncer_harness;
mod recovery;
mod replay;
mod retention;
mod scratch;
mod security;
mod stalls;
mod trace_context;
mod wakeup;
