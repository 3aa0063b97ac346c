//! The configuration file exactly as written: serde types with `deny_unknown_fields` and a
//! documented default on every field. Nothing here is trusted; [`super::validate`] turns it
//! into a checked [`super::Config`].

use std::collections::BTreeMap;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};

pub(crate) use super::kafka::RawKafka;
pub(crate) use super::nats::RawNats;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    /// `[postgres]`, required (it holds the required `url`).
    pub(crate) postgres: RawPostgres,
    /// `[relay]`, every key defaulted.
    #[serde(default)]
    pub(crate) relay: RawRelay,
    /// `[sink]`, required (`kind` has no sensible default).
    pub(crate) sink: RawSink,
    /// `[[tables]]`, at least one.
    pub(crate) tables: Vec<RawTable>,
    /// `[http]`; no server unless `listen` is set.
    #[serde(default)]
    pub(crate) http: RawHttp,
    /// `[shutdown]`.
    #[serde(default)]
    pub(crate) shutdown: RawShutdown,
    /// `[tracing]`; no span export unless `otlp_endpoint` (or `OTEL_EXPORTER_OTLP_ENDPOINT`)
    /// is set.
    #[serde(default)]
    pub(crate) tracing: RawTracing,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPostgres {
    /// Connection URL or key=value string. Required. May hold a password: never printed.
    pub(crate) url: String,
    /// Connections in the pool. Default 8; must be at least `relay.workers`.
    #[serde(default = "defaults::pool_size")]
    pub(crate) pool_size: usize,
    /// Client and server-side deadline for one statement. Default `30s`.
    #[serde(default = "defaults::statement_timeout")]
    pub(crate) statement_timeout: DurationValue,
    /// Deadline for opening a connection. Default `10s`.
    #[serde(default = "defaults::connect_timeout")]
    pub(crate) connect_timeout: DurationValue,
    /// Keep the hot path's statements prepared on each session. Default true; false
    /// behind PgBouncer before 1.21 in transaction mode.
    #[serde(default = "defaults::yes")]
    pub(crate) prepared_statements: bool,
    /// The password, read from this file (Kubernetes secret, systemd credential) instead
    /// of the URL.
    #[serde(default)]
    pub(crate) password_file: Option<std::path::PathBuf>,
    /// A direct connection (not through a pooler in transaction mode) for LISTEN, when
    /// `url` goes through PgBouncer. Default: LISTEN on `url`.
    #[serde(default)]
    pub(crate) listen_url: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRelay {
    /// Concurrent claim/publish loops. Default 4.
    #[serde(default = "defaults::workers")]
    pub(crate) workers: usize,
    /// Rows claimed per transaction. Default 500.
    #[serde(default = "defaults::batch_size")]
    pub(crate) batch_size: usize,
    /// Idle re-check when no NOTIFY arrives: how often a table NOTIFY does not reach is
    /// looked at (tables NOTIFY reaches: every 5 s). Default `100ms`.
    #[serde(default = "defaults::poll_interval")]
    pub(crate) poll_interval: DurationValue,
    /// `key` (default): same-key rows in id order; `none`: no order promise.
    #[serde(default)]
    pub(crate) ordering: Ordering,
    /// `delete` (default) or `mark` (sets `published_at`).
    #[serde(default)]
    pub(crate) on_publish: OnPublish,
    /// Failed attempts before a row is dead-lettered. Default 10.
    #[serde(default = "defaults::max_attempts")]
    pub(crate) max_attempts: u32,
    /// A failed row waits this long before its next attempt, doubling with full jitter.
    /// Default `1s`.
    #[serde(default = "defaults::retry_backoff")]
    pub(crate) retry_backoff: DurationValue,
    /// The longest wait between two attempts of one row. Default `5m`.
    #[serde(default = "defaults::retry_backoff_max")]
    pub(crate) retry_backoff_max: DurationValue,
    /// Payload bytes claimed per transaction at most (a larger row goes alone).
    /// Default `8MiB`.
    #[serde(default = "defaults::max_batch_bytes")]
    pub(crate) max_batch_bytes: SizeValue,
    /// Mark mode: published rows older than this are deleted. Default: kept forever.
    #[serde(default)]
    pub(crate) retention: Option<DurationValue>,
    /// A table whose rows fail for their own sake this many times within
    /// `bad_row_window` (and mostly fail there) pauses itself; 0 turns this off. Default 100.
    #[serde(default = "defaults::pause_after_bad_rows")]
    pub(crate) pause_after_bad_rows: u32,
    /// The bad-row valve's window. Default `1m`.
    #[serde(default = "defaults::bad_row_window")]
    pub(crate) bad_row_window: DurationValue,
}

impl Default for RawRelay {
    fn default() -> Self {
        RawRelay {
            workers: defaults::workers(),
            batch_size: defaults::batch_size(),
            poll_interval: defaults::poll_interval(),
            ordering: Ordering::default(),
            on_publish: OnPublish::default(),
            max_attempts: defaults::max_attempts(),
            retry_backoff: defaults::retry_backoff(),
            retry_backoff_max: defaults::retry_backoff_max(),
            max_batch_bytes: defaults::max_batch_bytes(),
            retention: None,
            pause_after_bad_rows: defaults::pause_after_bad_rows(),
            bad_row_window: defaults::bad_row_window(),
        }
    }
}

/// Which rows must reach the broker in `id` order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ordering {
    /// Rows sharing a non-NULL key are published in id order.
    #[default]
    Key,
    /// No order promise: every worker claims freely.
    None,
}

/// What happens to a row once the broker acknowledged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum OnPublish {
    /// Delete the row.
    #[default]
    Delete,
    /// Keep the row and set `published_at`.
    Mark,
}

/// Where messages go: `sink.kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SinkKind {
    Kafka,
    Nats,
    Stdout,
}

/// A key whose value is one of a few words (`ordering = "key"`). Written by hand rather
/// than derived so that a wrong value is answered with the list of right ones, whatever
/// was written instead (serde's derive says "unknown variant" or "expected string only").
trait Choice: Sized + Copy + 'static {
    const CHOICES: &'static [(&'static str, Self)];

    fn choose<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Word<T>(std::marker::PhantomData<T>);
        impl<T: Choice> Visitor<'_> for Word<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "one of {}", T::listed())
            }
            fn visit_str<E: de::Error>(self, word: &str) -> Result<T, E> {
                T::CHOICES
                    .iter()
                    .find(|(w, _)| *w == word)
                    .map(|(_, value)| *value)
                    .ok_or_else(|| {
                        let shown: String = word.chars().take(40).collect();
                        E::custom(format!(
                            "{shown:?} is not a valid value; write one of {}",
                            T::listed()
                        ))
                    })
            }
        }
        d.deserialize_str(Word(std::marker::PhantomData))
    }

    /// `"key", "none"`
    fn listed() -> String {
        Self::CHOICES
            .iter()
            .map(|(word, _)| format!("\"{word}\""))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Choice for Ordering {
    const CHOICES: &'static [(&'static str, Self)] =
        &[("key", Ordering::Key), ("none", Ordering::None)];
}

impl Choice for OnPublish {
    const CHOICES: &'static [(&'static str, Self)] =
        &[("delete", OnPublish::Delete), ("mark", OnPublish::Mark)];
}

impl Choice for SinkKind {
    const CHOICES: &'static [(&'static str, Self)] = &[
        ("kafka", SinkKind::Kafka),
        ("nats", SinkKind::Nats),
        ("stdout", SinkKind::Stdout),
    ];
}

impl<'de> Deserialize<'de> for Ordering {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::choose(d)
    }
}

impl<'de> Deserialize<'de> for OnPublish {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::choose(d)
    }
}

impl<'de> Deserialize<'de> for SinkKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::choose(d)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSink {
    /// `kafka`, `nats` or `stdout`. Required.
    pub(crate) kind: SinkKind,
    /// Longest wait for the broker to acknowledge a batch; rows still unacknowledged then
    /// stay in the table. Default `10s`.
    #[serde(default = "defaults::publish_timeout")]
    pub(crate) publish_timeout: DurationValue,
    pub(crate) kafka: Option<RawKafka>,
    pub(crate) nats: Option<RawNats>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTable {
    /// Schema-qualified table name, e.g. `public.outbox`. Required.
    pub(crate) name: String,
    /// Topic or subject template: literals and `{column}` references. Default `{topic}`.
    #[serde(default = "defaults::topic")]
    pub(crate) topic: String,
    /// `[tables.columns]`: which column plays which part. Default: the contract's table.
    #[serde(default)]
    pub(crate) columns: RawColumns,
    /// `[tables.header_columns]`: header name = column, copied to every message.
    #[serde(default)]
    pub(crate) header_columns: BTreeMap<String, String>,
    /// Rows per second published from this table by all its relays together. Default:
    /// unlimited.
    pub(crate) max_rate: Option<f64>,
    /// A template like `topic`: a dead-lettered row is also published there once.
    pub(crate) dead_letter_topic: Option<String>,
    /// `none` (the payload as is) or `cloudevents`. Default `none`.
    pub(crate) envelope: Option<String>,
    /// `[tables.cloudevents]`: the CloudEvents attributes, with `envelope = "cloudevents"`.
    pub(crate) cloudevents: Option<RawCloudEvents>,
}

/// `[tables.cloudevents]`: how a row becomes a CloudEvents 1.0 event.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCloudEvents {
    /// `binary` (attributes as headers) or `structured` (a JSON event body). Default
    /// `binary`.
    pub(crate) mode: Option<String>,
    /// Template for the `type` attribute. Required.
    #[serde(rename = "type")]
    pub(crate) type_: Option<String>,
    /// Template for the `source` attribute. Required.
    pub(crate) source: Option<String>,
    /// Template for the `subject` attribute. Optional.
    pub(crate) subject: Option<String>,
    /// Template for the `datacontenttype` attribute. Optional.
    pub(crate) datacontenttype: Option<String>,
}

/// Column names per role; each defaults to the role's name in the default table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawColumns {
    /// Message id, sent as `<table>:<id>`; any type. Default `id`.
    pub(crate) id: Option<String>,
    /// Order within a key and the row's handle: an integer column with unique values.
    /// Default: the id column.
    pub(crate) order: Option<String>,
    pub(crate) key: Option<String>,
    pub(crate) payload: Option<String>,
    /// JSON object of strings. `""`: the table has none. Default `headers` if present.
    pub(crate) headers: Option<String>,
    /// Lag is measured from here. `""`: the table has none. Default `created_at` if present.
    pub(crate) created_at: Option<String>,
    pub(crate) published_at: Option<String>,
    pub(crate) attempts: Option<String>,
    pub(crate) last_error: Option<String>,
    pub(crate) dead_at: Option<String>,
    /// Not claimed before this time (set after a failure). Default `next_attempt_at`.
    pub(crate) next_attempt_at: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawHttp {
    /// Address for /metrics, /healthz, /readyz. Default: no HTTP server.
    pub(crate) listen: Option<String>,
    /// `table` (default) or `entry`: the latency histograms per table, or per `[[tables]]`
    /// entry (the tables a pattern matches share one set).
    pub(crate) table_histograms: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTracing {
    /// OTLP/HTTP collector base URL, e.g. `http://127.0.0.1:4318` (spans go to
    /// `<url>/v1/traces`). Default: none, no export.
    pub(crate) otlp_endpoint: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawShutdown {
    /// After the first SIGTERM, how long in-flight batches may take. Default `25s`.
    #[serde(default = "defaults::drain_timeout")]
    pub(crate) drain_timeout: DurationValue,
}

impl Default for RawShutdown {
    fn default() -> Self {
        RawShutdown {
            drain_timeout: defaults::drain_timeout(),
        }
    }
}

/// A duration written as `"250ms"`, `"25s"`, `"5m"` or `"1h"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DurationValue(pub(crate) Duration);

impl<'de> Deserialize<'de> for DurationValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl Visitor<'_> for Text {
            type Value = DurationValue;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration in double quotes such as \"250ms\", \"25s\" or \"5m\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<DurationValue, E> {
                parse_duration(v).map(DurationValue).map_err(E::custom)
            }
            // A bare number is the commonest slip: say which units there are.
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<DurationValue, E> {
                Err(no_unit(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<DurationValue, E> {
                Err(no_unit(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<DurationValue, E> {
                Err(E::custom(format!(
                    "{v} has no unit: write a whole number and a unit in double quotes, \
                     e.g. \"1500ms\", \"25s\" or \"5m\""
                )))
            }
        }
        fn no_unit<E: de::Error>(v: impl std::fmt::Display) -> E {
            E::custom(format!(
                "{v} has no unit: write a duration in double quotes, e.g. \"{v}ms\" or \"{v}s\""
            ))
        }
        d.deserialize_any(Text)
    }
}

/// A size in bytes, written `"8MiB"`, `"512KiB"`, `"1GB"` or a bare number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SizeValue(pub(crate) u64);

impl<'de> Deserialize<'de> for SizeValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl Visitor<'_> for Text {
            type Value = SizeValue;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a size such as \"8MiB\", \"512KiB\" or a number of bytes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SizeValue, E> {
                parse_size(v).map(SizeValue).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SizeValue, E> {
                Ok(SizeValue(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SizeValue, E> {
                u64::try_from(v)
                    .map(SizeValue)
                    .map_err(|_| E::custom(format!("{v} is negative: a size is at least 0 bytes")))
            }
        }
        d.deserialize_any(Text)
    }
}

/// Parses `"8MiB"`, `"512KiB"`, `"1GB"`, `"4096"` (bytes): binary units KiB/MiB/GiB,
/// decimal kB/KB/MB/GB, B for bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let bad = || {
        format!(
            "invalid size {text:?}: write a whole number followed by B, KiB, MiB or GiB (or \
             kB, MB, GB), e.g. \"8MiB\""
        )
    };
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: u64 = number.parse().map_err(|_| bad())?;
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return Err(bad()),
    };
    n.checked_mul(factor).ok_or_else(bad)
}

/// Parses `"250ms"`, `"25s"`, `"5m"`, `"1h"`, `"7d"`: a number and a unit, as
/// [`humantime`] reads them (which also takes `"1.5s"`, `"1h 30m"` and unit words such as
/// `"2min"` or `"3days"`). White space around the text is ignored; a bare number is not a
/// duration.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    // humantime reads a bare `M` as months: "5M" meant as five minutes would wait five
    // months. Ask for the unambiguous spelling instead.
    let units = text.split(|c: char| !c.is_ascii_alphabetic());
    if units.into_iter().any(|unit| unit == "M") {
        return Err(format!(
            "invalid duration {text:?}: \"M\" is ambiguous: write \"m\" for minutes or \
             \"months\" for months"
        ));
    }
    humantime::parse_duration(text.trim()).map_err(|why| {
        format!(
            "invalid duration {text:?} ({why}): write a number followed by ms, s, m, h or d, \
             e.g. \"250ms\", \"25s\", \"5m\", \"7d\""
        )
    })
}

mod defaults {
    use super::DurationValue;
    use std::time::Duration;

    pub(crate) fn pool_size() -> usize {
        8
    }
    pub(crate) fn yes() -> bool {
        true
    }

    pub(crate) fn statement_timeout() -> DurationValue {
        DurationValue(Duration::from_secs(30))
    }
    pub(crate) fn connect_timeout() -> DurationValue {
        DurationValue(Duration::from_secs(10))
    }
    pub(crate) fn workers() -> usize {
        4
    }
    pub(crate) fn batch_size() -> usize {
        500
    }
    pub(crate) fn poll_interval() -> DurationValue {
        DurationValue(Duration::from_millis(100))
    }
    pub(crate) fn retry_backoff() -> DurationValue {
        DurationValue(Duration::from_secs(1))
    }
    pub(crate) fn retry_backoff_max() -> DurationValue {
        DurationValue(Duration::from_secs(300))
    }
    pub(crate) fn max_batch_bytes() -> super::SizeValue {
        super::SizeValue(8 << 20)
    }
    pub(crate) fn max_attempts() -> u32 {
        10
    }
    pub(crate) fn pause_after_bad_rows() -> u32 {
        100
    }
    pub(crate) fn bad_row_window() -> DurationValue {
        DurationValue(Duration::from_secs(60))
    }
    pub(crate) fn publish_timeout() -> DurationValue {
        DurationValue(Duration::from_secs(10))
    }
    pub(crate) fn topic() -> String {
        "{topic}".to_owned()
    }
    pub(crate) fn drain_timeout() -> DurationValue {
        DurationValue(Duration::from_secs(25))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_every_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("25s"), Ok(Duration::from_secs(25)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("0ms"), Ok(Duration::ZERO));
    }

    #[test]
    fn every_form_accepted_before_humantime_still_is() {
        // The old parser: optional white space around, and between number and unit.
        for (text, secs) in [
            (" 25s ", 25),
            ("5 m", 300),
            ("\t1h", 3600),
            ("2d\n", 172_800),
        ] {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_secs(secs)),
                "{text:?}"
            );
        }
        // And what humantime adds.
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2min"), Ok(Duration::from_secs(120)));
    }

    #[test]
    fn bad_durations_say_how_to_write_one() {
        for bad in ["", "10", "ms", "10x", "-1s", "99999999999999999999h"] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.contains("e.g. \"250ms\""), "{bad}: {err}");
        }
    }

    #[test]
    fn a_capital_m_is_refused_rather_than_read_as_months() {
        for text in ["5M", "1h 5M"] {
            let err = parse_duration(text).unwrap_err();
            assert!(err.contains("\"m\" for minutes"), "{text}: {err}");
        }
        // humantime's month is 30.44 days.
        assert_eq!(
            parse_duration("2months"),
            Ok(Duration::from_secs(5_260_032))
        );
    }
}
