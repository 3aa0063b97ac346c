//! Prometheus metrics (prometheus-client), served at `/metrics`.
//!
//! Labels have few values: the table (from the config) and the sink kind. Backlog and
//! oldest-pending age are gauges refreshed on an interval by one task from the pending
//! index ([`crate::ops::Health`] runs it), never computed per scrape.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TableSink {
    pub(crate) table: String,
    pub(crate) sink: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TableLabel {
    pub(crate) table: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SinkLabel {
    pub(crate) sink: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DependencyLabel {
    /// `postgres` or `broker`.
    pub(crate) dependency: String,
}

type Seconds = Family<TableSink, Histogram, fn() -> Histogram>;

/// The handles of one table's batch metrics ([`Metrics::table_meters`]): each shares its
/// value with the family's member of the same labels.
#[derive(Clone, Debug)]
pub(crate) struct TableMeters {
    pub(crate) published: Counter,
    pub(crate) failed: Counter,
    pub(crate) dead: Counter,
    pub(crate) replayed: Counter,
    pub(crate) publish_seconds: Histogram,
    pub(crate) batch_seconds: Histogram,
    pub(crate) delivery_lag: Histogram,
}

/// Every metric the relay exports.
pub(crate) struct Metrics {
    registry: Registry,
    /// Rows the broker acknowledged and the relay deleted or marked.
    pub(crate) published: Family<TableSink, Counter>,
    /// Failed publish attempts of rows at fault (each counts against `max_attempts`).
    pub(crate) failed: Family<TableSink, Counter>,
    /// Rows dead-lettered.
    pub(crate) dead: Family<TableSink, Counter>,
    /// Published rows deleted by `relay.retention` (mark mode).
    pub(crate) retention_deleted: Family<TableLabel, Counter>,
    /// Rows made pending again by `outbox-relay replay` and published again (also counted
    /// in `published`).
    pub(crate) replayed: Family<TableSink, Counter>,
    /// Rows waiting for their next attempt after a failure (refreshed on an interval).
    pub(crate) waiting_retry: Family<TableLabel, Gauge>,
    /// From the first send of a batch to its last acknowledgement.
    pub(crate) publish_seconds: Seconds,
    /// From claim to commit.
    pub(crate) batch_seconds: Seconds,
    /// From a row's creation time to the broker's acknowledgement (replayed rows left out).
    pub(crate) delivery_lag: Family<TableLabel, Histogram, fn() -> Histogram>,
    /// Pending rows (refreshed on an interval).
    pub(crate) backlog: Family<TableLabel, Gauge>,
    /// Age of the oldest pending row (refreshed on an interval; 0 when none).
    pub(crate) oldest_age_seconds: Family<TableLabel, Gauge<f64, AtomicU64>>,
    /// Dead tuples in the outbox table (`pg_stat_user_tables`, refreshed on an interval).
    pub(crate) dead_tuples: Family<TableLabel, Gauge>,
    /// 1 while the table is paused (`outbox-relay pause`, the bad-row valve), else 0.
    pub(crate) table_paused: Family<TableLabel, Gauge>,
    /// Times this process's bad-row valve paused the table.
    pub(crate) valve_paused: Family<TableLabel, Counter>,
    /// How long the oldest transaction whose snapshot holds back VACUUM has been open, in
    /// this database (refreshed on an interval; sessions this role may see).
    pub(crate) oldest_snapshot_age_seconds: Gauge<f64, AtomicU64>,
    /// Transactions between the oldest xmin that holds back VACUUM (sessions, prepared
    /// transactions, replication slots) and now.
    pub(crate) oldest_snapshot_xid_age: Gauge,
    /// Rows claimed and not yet committed.
    pub(crate) in_flight: Gauge,
    /// 1 while the circuit breaker is open (the broker looks down).
    pub(crate) circuit_open: Family<SinkLabel, Gauge>,
    /// Times the circuit opened.
    pub(crate) circuit_opened: Family<SinkLabel, Counter>,
    /// 1 while `/readyz` would answer 200.
    pub(crate) ready: Gauge,
    /// Per dependency (`postgres`, `broker`): 1 when it answered the last probe, 0 when
    /// not, or not yet reached (from the moment the configuration is valid).
    pub(crate) up: Family<DependencyLabel, Gauge>,
}

fn lag_histogram() -> Histogram {
    // 1 ms .. ~17 min (2^20 ms)
    Histogram::new(exponential_buckets(0.001, 2.0, 21))
}

fn latency_histogram() -> Histogram {
    // 1 ms .. ~16 s
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// Registers each `name, field, "help";` of the table: `metrics.field` under
/// `outbox_relay_<name>`.
macro_rules! register {
    ($registry:ident, $metrics:ident; $($name:ident, $field:ident, $help:expr;)*) => {
        $($registry.register(stringify!($name), $help, $metrics.$field.clone());)*
    };
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("outbox_relay");
        let metrics = Metrics {
            published: Family::default(),
            failed: Family::default(),
            dead: Family::default(),
            retention_deleted: Family::default(),
            replayed: Family::default(),
            waiting_retry: Family::default(),
            publish_seconds: Family::new_with_constructor(latency_histogram),
            batch_seconds: Family::new_with_constructor(latency_histogram),
            delivery_lag: Family::new_with_constructor(lag_histogram),
            backlog: Family::default(),
            oldest_age_seconds: Family::default(),
            dead_tuples: Family::default(),
            table_paused: Family::default(),
            valve_paused: Family::default(),
            oldest_snapshot_age_seconds: Gauge::default(),
            oldest_snapshot_xid_age: Gauge::default(),
            in_flight: Gauge::default(),
            circuit_open: Family::default(),
            circuit_opened: Family::default(),
            ready: Gauge::default(),
            up: Family::default(),
            registry: Registry::default(),
        };
        register_all(&mut registry, &metrics);
        for dependency in ["postgres", "broker"] {
            metrics
                .up
                .get_or_create(&DependencyLabel {
                    dependency: dependency.to_owned(),
                })
                .set(0);
        }
        Metrics {
            registry,
            ..metrics
        }
    }
}

/// Registers every metric of `metrics` in `registry`, each with its name and help.
fn register_all(registry: &mut Registry, metrics: &Metrics) {
    // Name (after the `outbox_relay_` prefix), field, help.
    register! {
        registry, metrics;
        rows_published, published,
            "Rows acknowledged by the broker and deleted or marked";
        rows_failed, failed,
            "Failed publish attempts of rows that could not be published for themselves";
        rows_dead_lettered, dead,
            "Rows dead-lettered after max_attempts";
        rows_deleted_by_retention, retention_deleted,
            "Published rows deleted because relay.retention passed (mark mode)";
        rows_replayed, replayed,
            "Rows made pending again by `outbox-relay replay` and published again (also in \
             rows_published)";
        rows_waiting_retry, waiting_retry,
            "Rows waiting for their next attempt after a failure (not dead), refreshed on an \
             interval";
        publish_duration_seconds, publish_seconds,
            "Time from a batch's first send to its last acknowledgement";
        batch_duration_seconds, batch_seconds,
            "Time from claim to commit of a batch";
        delivery_lag_seconds, delivery_lag,
            "Time from a row's creation (created_at: its transaction's start) to the broker's \
             acknowledgement; replayed rows are not observed";
        backlog_rows, backlog,
            "Pending rows, refreshed on an interval";
        oldest_pending_age_seconds, oldest_age_seconds,
            "Age of the oldest pending row, refreshed on an interval (0 when none)";
        table_dead_tuples, dead_tuples,
            "Dead tuples in the outbox table (pg_stat_user_tables), refreshed on an interval";
        table_paused, table_paused,
            "1 while the table is paused for every relay (outbox-relay pause, the bad-row \
             valve), else 0; read about twice a second";
        table_paused_by_valve, valve_paused,
            "Times this relay's bad-row valve paused the table (relay.pause_after_bad_rows)";
        oldest_snapshot_age_seconds, oldest_snapshot_age_seconds,
            "How long the oldest open snapshot that holds back VACUUM has been open, in this \
             database: sessions this role may see (grant pg_monitor to see all) and prepared \
             transactions";
        oldest_snapshot_xid_age, oldest_snapshot_xid_age,
            "Transactions since the oldest xmin that holds back VACUUM: sessions, prepared \
             transactions and replication slots (a standby's hot_standby_feedback)";
        rows_in_flight, in_flight,
            "Rows claimed and not yet committed";
        circuit_open, circuit_open,
            "1 while the broker looks down and no rows are claimed";
        circuit_opened, circuit_opened,
            "Times the circuit breaker opened";
        ready, ready,
            "1 while PostgreSQL and the broker are reachable and the relay makes progress";
        dependency_up, up,
            "1 while the dependency (postgres, broker) answers; 0 when not, or not reached yet";
    }
}

impl Metrics {
    /// The Prometheus text exposition of every metric.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// Removes every series of `table` (a table found by pattern that was dropped): a
    /// scrape no longer shows its last backlog as if it were still there. (Histograms an
    /// entry's tables share carry the pattern, not the table: they stay.)
    pub(crate) fn forget_table(&self, table: &str, sink: &str) {
        let with_sink = Self::table_sink(table, sink);
        for family in [&self.published, &self.failed, &self.dead, &self.replayed] {
            family.remove(&with_sink);
        }
        self.publish_seconds.remove(&with_sink);
        self.batch_seconds.remove(&with_sink);
        let label = TableLabel {
            table: table.to_owned(),
        };
        self.retention_deleted.remove(&label);
        self.valve_paused.remove(&label);
        self.delivery_lag.remove(&label);
        for family in [
            &self.waiting_retry,
            &self.backlog,
            &self.dead_tuples,
            &self.table_paused,
        ] {
            family.remove(&label);
        }
        self.oldest_age_seconds.remove(&label);
    }

    /// One table's batch metrics, looked up once: a batch then updates them without
    /// building label strings or searching a family. The latency histograms are labelled
    /// `histograms` (the table's name, or its `[[tables]]` entry's pattern, which the
    /// tables it matches share).
    pub(crate) fn table_meters(&self, table: &str, histograms: &str, sink: &str) -> TableMeters {
        let labels = Self::table_sink(table, sink);
        let shared = Self::table_sink(histograms, sink);
        let lag = TableLabel {
            table: histograms.to_owned(),
        };
        TableMeters {
            published: self.published.get_or_create(&labels).clone(),
            failed: self.failed.get_or_create(&labels).clone(),
            dead: self.dead.get_or_create(&labels).clone(),
            replayed: self.replayed.get_or_create(&labels).clone(),
            publish_seconds: self.publish_seconds.get_or_create(&shared).clone(),
            batch_seconds: self.batch_seconds.get_or_create(&shared).clone(),
            delivery_lag: self.delivery_lag.get_or_create(&lag).clone(),
        }
    }

    pub(crate) fn table_sink(table: &str, sink: &str) -> TableSink {
        TableSink {
            table: table.to_owned(),
            sink: sink.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_exported_with_the_prefix() {
        let m = Metrics::default();
        m.published
            .get_or_create(&Metrics::table_sink("public.outbox", "nats"))
            .inc_by(3);
        m.publish_seconds
            .get_or_create(&Metrics::table_sink("public.outbox", "nats"))
            .observe(0.004);
        let text = m.encode();
        assert!(
            text.contains(
                r#"outbox_relay_rows_published_total{table="public.outbox",sink="nats"} 3"#
            ),
            "{text}"
        );
        assert!(
            text.contains("outbox_relay_publish_duration_seconds_bucket"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE outbox_relay_rows_in_flight gauge"),
            "{text}"
        );
    }
}
