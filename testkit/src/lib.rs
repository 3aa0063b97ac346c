//! Throwaway servers for tests, the demo and benchmarks: a PostgreSQL cluster made with
//! `initdb`, a PgBouncer in front of it, a `nats-server -js` (alone or three in a cluster)
//! and a Kafka-protocol broker (tansu), each on a free 127.0.0.1 port in its own temp dir.
//!
//! Every server is a child process that dies with its owner: dropping the handle kills it
//! and removes its directory, and `PR_SET_PDEATHSIG` kills it even if the owning thread
//! dies without unwinding (a test killed by a timeout, `kill -9` of the demo). The
//! directories of an owner that died so are removed by the next server started.
//!
//! One module per harness; everything public is re-exported here, so users write
//! `testkit::Postgres`, never the module path:
//!
//! - `postgres`: [`Postgres`] (`initdb` + `postgres`, optionally durable or with TLS) and
//!   [`pg_bin`], where the server binaries are.
//! - `standby`: [`Standby`], a synchronous streaming standby of a [`Postgres`] (taken
//!   with `pg_basebackup -R`) that a test promotes, and [`failover_url`], one URL naming
//!   both servers with `target_session_attrs=read-write`.
//! - `pgbouncer`: [`PgBouncer`] (`pgbouncer` in transaction mode, defaults otherwise: no
//!   `ignore_startup_parameters`) in front of a [`Postgres`], with [`PgBouncerOptions`].
//! - `nats`: [`NatsServer`] (`nats-server -js`, open, with password users or TLS + nkey),
//!   streams, and [`StoredMessage`] as JetStream stored it.
//! - `nats_cluster`: [`NatsCluster`] (`n` routed `nats-server`s with JetStream), replicated
//!   streams, their leader, which server holds a named client, killing and restarting one.
//! - `kafka`: [`KafkaBroker`] (`tansu broker`, in memory), topics, and [`kafka_read_all`]
//!   returning [`KafkaRecord`]s.
//! - `otlp`: [`OtlpReceiver`], an OTLP/HTTP trace receiver that decodes the protobuf
//!   export into [`ReceivedSpan`]s (the collector the tracing tests export to).
//! - `proxy`: [`Proxy`], a TCP proxy that freezes, drops or delays connections ([`Fault`]).
//! - `tls`: [`TestCa`], a throwaway certificate authority made with `openssl`.
//! - `ports`: [`ReservedPorts`], ports the kernel must not give to new connections (a
//!   mock Kafka broker's, while a test takes it down and up again).
//! - `process`: what they share: [`free_port`], [`die_with_parent`], scratch directories,
//!   waiting for a port, [`wait_with_usage`] for timing a relay child ([`ChildUsage`]:
//!   peak RSS, CPU), and [`http_get`] for the relay's and nats-server's endpoints
//!   ([`scrape`] and [`sample`] for one value of the relay's `/metrics`).

mod kafka;
mod nats;
mod nats_cluster;
mod notifications;
pub mod otlp;
mod pgbouncer;
mod ports;
mod postgres;
mod process;
mod proxy;
mod standby;
mod tls;

pub use kafka::{kafka_count_all, kafka_read_all, KafkaBroker, KafkaRecord};
pub use nats::{NatsServer, StoredMessage};
pub use nats_cluster::NatsCluster;
pub use notifications::Notifications;
pub use otlp::{OtlpReceiver, ReceivedSpan};
pub use pgbouncer::{PgBouncer, PgBouncerOptions};
pub use ports::ReservedPorts;
pub use postgres::{pg_bin, Postgres};
pub use process::{
    die_with_parent, free_port, http_get, sample, scrape, send_signal, wait_with_usage, ChildUsage,
    Signal,
};
pub use proxy::{Fault, Proxy};
pub use standby::{failover_url, Standby};
pub use tls::TestCa;
