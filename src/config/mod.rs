//! Configuration: the one place where input is checked, and a leaf: nothing here uses
//! another module of the crate.
//!
//! [`load`] reads the TOML file, replaces `${VAR}` references, applies
//! `OUTBOX_RELAY__SECTION__KEY` overrides, deserializes into the [`raw`] types (unknown keys
//! rejected) and validates the result into a [`Config`]. Every error is a [`ConfigError`]
//! naming the key at fault (a TOML syntax error its line and column) in the file's words,
//! never serde's ([`explain`]); no error ever contains a secret. Everything that can be
//! known without the network is checked here, the Kafka producer's properties included
//! ([`kafka`]), so that every such mistake exits 2.
//!
//! One file per section: [`postgres`] (URL, TLS parameters, pool), [`kafka`] and [`nats`]
//! (one per sink, with the Kafka property policy), [`tables`] (`[[tables]]`, columns,
//! headers, and the [`cloudevents`] envelope); `[relay]`, `[http]` and `[shutdown]` are checked below.

pub(crate) mod cloudevents;
mod env;
mod error;
mod explain;
pub(crate) mod headers;
pub(crate) mod kafka;
mod names;
mod nats;
pub(crate) mod pattern;
mod pem;
pub(crate) mod postgres;
pub(crate) mod raw;
mod secret;
mod tables;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use error::ConfigError;
pub(crate) use kafka::KafkaConfig;
#[cfg(feature = "testing")]
pub use names::adversarial_ident;
pub use names::Ident;
pub(crate) use names::{NullColumn, RecentTopics, TableName, Template};
pub(crate) use nats::{NatsAuth, NatsConfig};
pub(crate) use postgres::PostgresConfig;
pub use raw::Ordering;
pub(crate) use raw::{OnPublish, SinkKind};
pub(crate) use secret::Secret;
#[cfg(test)]
pub(crate) use tables::Columns;
pub(crate) use tables::{OptionalColumn, TableConfig};

/// Where the config is read from when neither `--config` nor `OUTBOX_RELAY_CONFIG` is set.
pub(crate) const DEFAULT_PATH: &str = "/etc/outbox-relay/relay.toml";

/// The checked configuration. Everything in it has been validated.
#[derive(Debug, Clone)]
pub struct Config {
    /// `[postgres]`.
    pub postgres: PostgresConfig,
    /// `[relay]`.
    pub(crate) relay: RelayConfig,
    /// `[sink]`.
    pub sink: SinkConfig,
    /// `[[tables]]` entries that name a table, and (once `source::discover::resolve` has
    /// read the catalog) one per table a pattern entry matches; no table twice.
    pub tables: Vec<TableConfig>,
    /// `[[tables]]` entries whose `name` is a pattern (`tenant_*.outbox`): the tables they
    /// match are found in the catalog, at start and while running.
    pub(crate) patterns: Vec<TableConfig>,
    /// `[http]`; `None`: no HTTP server.
    pub(crate) http: Option<HttpConfig>,
    /// `[shutdown]`.
    pub(crate) shutdown: ShutdownConfig,
    /// `[tracing]`.
    pub tracing: TracingConfig,
}

/// `[relay]`, checked.
#[derive(Debug, Clone)]
pub(crate) struct RelayConfig {
    /// Concurrent claim/publish loops, 1 to 256. Default 4.
    pub(crate) workers: usize,
    /// Rows claimed per transaction, 1 to 10000. Default 500.
    pub(crate) batch_size: usize,
    /// Idle re-check when no NOTIFY arrives, at least 1 ms. Default 100 ms.
    pub(crate) poll_interval: Duration,
    /// Which rows keep `id` order. Default `key`.
    pub(crate) ordering: Ordering,
    /// Delete or mark a published row. Default `delete`.
    pub(crate) on_publish: OnPublish,
    /// Failed attempts before a row is dead-lettered, at least 1. Default 10.
    pub(crate) max_attempts: u32,
    /// The first retry's ceiling: a failed row's next attempt is due within
    /// `min(retry_backoff_max, retry_backoff * 2^(attempts-1))` (full jitter). Default 1 s.
    pub(crate) retry_backoff: Duration,
    /// The longest wait between two attempts of a row. Default 5 min.
    pub(crate) retry_backoff_max: Duration,
    /// Payload bytes one claim takes at most; a single larger row is claimed alone.
    /// At least 1 KiB. Default 8 MiB.
    pub(crate) max_batch_bytes: u64,
    /// Mark mode: published rows whose `published_at` is older than this are deleted
    /// (the source's retention task); `None` (the default) keeps them.
    pub(crate) retention: Option<Duration>,
    /// The bad-row valve: a table whose rows fail for their own sake this many times
    /// within `bad_row_window`, most of its attempts there, pauses itself. `None`: off
    /// (`pause_after_bad_rows = 0`). Default 100 within 1 min.
    pub(crate) bad_row_valve: Option<(u32, Duration)>,
}

/// `[sink]`, checked.
#[derive(Debug, Clone)]
pub struct SinkConfig {
    /// Where messages go, with that sink's settings.
    pub target: SinkTarget,
    /// Longest wait for the broker to acknowledge a batch. Default 10 s.
    pub publish_timeout: Duration,
}

/// The sink named by `sink.kind`, with its section.
#[derive(Debug, Clone)]
pub enum SinkTarget {
    /// `[sink.nats]`: NATS JetStream.
    Nats(NatsConfig),
    /// `[sink.kafka]`: Kafka.
    Kafka(KafkaConfig),
    /// JSON lines on standard output, for debugging.
    Stdout,
}

/// `[http]`, checked.
#[derive(Debug, Clone)]
pub(crate) struct HttpConfig {
    /// Address for /metrics, /healthz and /readyz.
    pub(crate) listen: SocketAddr,
    /// Which label the per-table latency histograms carry.
    pub(crate) table_histograms: TableHistograms,
}

/// `http.table_histograms`: the latency histograms (publish, batch, delivery lag) are most
/// of a table's series; a relay of hundreds of tables found by pattern may keep one set
/// per `[[tables]]` entry instead of one per table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum TableHistograms {
    /// One set per table, labelled with its name (the default).
    #[default]
    Table,
    /// One set per `[[tables]]` entry: the tables a pattern matches share one, labelled
    /// with the pattern; a listed table keeps its own.
    Entry,
}

/// `[shutdown]`, checked.
#[derive(Debug, Clone)]
pub(crate) struct ShutdownConfig {
    /// After the first SIGTERM, how long in-flight batches may take. Default 25 s.
    pub(crate) drain_timeout: Duration,
}

/// `[tracing]`, checked.
#[derive(Debug, Clone, Default)]
pub struct TracingConfig {
    /// Where spans are exported over OTLP/HTTP: the full traces URL (`<otlp_endpoint>/v1/traces`).
    /// `None`: the standard `OTEL_EXPORTER_OTLP_*` variables decide (see [`crate::ops::otel`]).
    pub otlp_traces_url: Option<String>,
}

/// Chooses the config file: `--config`, else `OUTBOX_RELAY_CONFIG`, else [`DEFAULT_PATH`].
pub fn resolve_path(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("OUTBOX_RELAY_CONFIG").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PATH))
}

/// Reads, overrides and validates the configuration at `path` against the process
/// environment.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigError::general(format!(
            "cannot read config file {}: {e} (pass --config FILE or set OUTBOX_RELAY_CONFIG)",
            path.display()
        ))
    })?;
    from_str(&text, |name| std::env::var(name).ok(), std::env::vars())
        .map_err(|e| e.in_file(path.to_path_buf()))
}

/// [`load`] without the file system: `lookup` serves `${VAR}`, `vars` the overrides.
pub fn from_str(
    text: &str,
    lookup: impl Fn(&str) -> Option<String>,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Config, ConfigError> {
    let mut table: toml::Table =
        toml::from_str(text).map_err(|e| ConfigError::general(explain::syntax_error(text, &e)))?;
    explain::check_lists(&table)?;
    kafka::join_dotted_names(&mut table)?;
    env::interpolate_values(&mut table, &lookup)?;
    let overrides = env::apply_overrides(&mut table, vars)?;
    let raw: raw::RawConfig = serde_path_to_error::deserialize(toml::Value::Table(table))
        .map_err(|e| explain::serde_error(&e, &overrides))?;
    validate(raw).map_err(|e| e.with_sources(&overrides))
}

/// Turns the file as written into a checked [`Config`], section by section. The first
/// problem found is the one reported (all of them, for the Kafka properties).
fn validate(raw: raw::RawConfig) -> Result<Config, ConfigError> {
    let connection = postgres::connection(&raw.postgres)?;
    let relay = relay(raw.relay)?;
    let postgres = postgres::validate(raw.postgres, connection, relay.workers)?;
    let sink = sink(raw.sink)?;
    let (tables, patterns) = tables::validate(raw.tables, &sink.target)?;
    let http = http(raw.http)?;
    let shutdown = ShutdownConfig {
        drain_timeout: positive("shutdown.drain_timeout", raw.shutdown.drain_timeout)?,
    };
    let tracing = tracing(raw.tracing)?;
    Ok(Config {
        postgres,
        relay,
        sink,
        tables,
        patterns,
        http,
        shutdown,
        tracing,
    })
}

/// Validates `[relay]`.
fn relay(raw: raw::RawRelay) -> Result<RelayConfig, ConfigError> {
    if raw.workers == 0 || raw.workers > 256 {
        return Err(ConfigError::new(
            "relay.workers",
            "must be between 1 and 256",
        ));
    }
    if raw.batch_size == 0 || raw.batch_size > 10_000 {
        return Err(ConfigError::new(
            "relay.batch_size",
            "must be between 1 and 10000",
        ));
    }
    if raw.max_attempts == 0 {
        return Err(ConfigError::new("relay.max_attempts", "must be at least 1"));
    }
    let (retry_backoff, retry_backoff_max) = backoff(&raw)?;
    if raw.max_batch_bytes.0 < 1024 {
        return Err(ConfigError::new(
            "relay.max_batch_bytes",
            format!(
                "is {} bytes; it must be at least 1KiB (a row larger than the budget is \
                 still claimed alone, so a small budget only makes batches of one row)",
                raw.max_batch_bytes.0
            ),
        ));
    }
    let retention = retention(&raw)?;
    if raw.poll_interval.0 < Duration::from_millis(1) {
        return Err(ConfigError::new(
            "relay.poll_interval",
            "must be at least 1ms",
        ));
    }
    Ok(RelayConfig {
        workers: raw.workers,
        batch_size: raw.batch_size,
        poll_interval: raw.poll_interval.0,
        ordering: raw.ordering,
        on_publish: raw.on_publish,
        max_attempts: raw.max_attempts,
        retry_backoff,
        retry_backoff_max,
        max_batch_bytes: raw.max_batch_bytes.0,
        retention,
        bad_row_valve: match raw.pause_after_bad_rows {
            0 => None,
            n => Some((n, positive("relay.bad_row_window", raw.bad_row_window)?)),
        },
    })
}

/// `relay.retry_backoff` and `relay.retry_backoff_max`: positive, the cap not below the
/// first wait.
fn backoff(raw: &raw::RawRelay) -> Result<(Duration, Duration), ConfigError> {
    let first = positive("relay.retry_backoff", raw.retry_backoff)?;
    let cap = positive("relay.retry_backoff_max", raw.retry_backoff_max)?;
    if cap < first {
        return Err(ConfigError::new(
            "relay.retry_backoff_max",
            format!(
                "is {cap:?}, shorter than relay.retry_backoff ({first:?}): the cap must be at \
                 least the first wait"
            ),
        ));
    }
    Ok((first, cap))
}

/// `relay.retention`: mark mode only.
fn retention(raw: &raw::RawRelay) -> Result<Option<Duration>, ConfigError> {
    match raw.retention {
        None => Ok(None),
        Some(_) if raw.on_publish == OnPublish::Delete => Err(ConfigError::new(
            "relay.retention",
            "applies to on_publish = \"mark\" only (in delete mode no published row is \
             kept): remove it, or set relay.on_publish = \"mark\"",
        )),
        Some(value) => positive("relay.retention", value).map(Some),
    }
}

/// Validates `[sink]` and the section of the sink it names.
fn sink(raw: raw::RawSink) -> Result<SinkConfig, ConfigError> {
    let publish_timeout = positive("sink.publish_timeout", raw.publish_timeout)?;
    let target = match raw.kind {
        SinkKind::Nats => SinkTarget::Nats(nats::validate(raw.nats)?),
        SinkKind::Kafka => SinkTarget::Kafka(kafka::validate(raw.kafka, publish_timeout)?),
        SinkKind::Stdout => SinkTarget::Stdout,
    };
    Ok(SinkConfig {
        target,
        publish_timeout,
    })
}

/// Validates `[http]`.
fn http(raw: raw::RawHttp) -> Result<Option<HttpConfig>, ConfigError> {
    let Some(listen) = raw.listen else {
        return Ok(None);
    };
    let listen = listen.parse().map_err(|_| {
        ConfigError::new(
            "http.listen",
            format!("{listen:?} is not an address: write host:port, e.g. 127.0.0.1:9187"),
        )
    })?;
    let table_histograms = match raw.table_histograms.as_deref() {
        None | Some("table") => TableHistograms::Table,
        Some("entry") => TableHistograms::Entry,
        Some(other) => {
            return Err(ConfigError::new(
                "http.table_histograms",
                format!(
                    "{other:?} is not a choice: write \"table\" (one set of latency \
                     histograms per table) or \"entry\" (one per [[tables]] entry)"
                ),
            ))
        }
    };
    Ok(Some(HttpConfig {
        listen,
        table_histograms,
    }))
}

/// Validates `[tracing]`: `otlp_endpoint` is the collector's base URL, as
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is; the traces path is added unless it is already there.
fn tracing(raw: raw::RawTracing) -> Result<TracingConfig, ConfigError> {
    let Some(url) = raw.otlp_endpoint.filter(|u| !u.trim().is_empty()) else {
        return Ok(TracingConfig::default());
    };
    let url = url.trim().trim_end_matches('/');
    let host = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .map(|rest| rest.split('/').next().unwrap_or(""));
    if host.is_none_or(|h| h.is_empty() || h.contains(char::is_whitespace)) {
        return Err(ConfigError::new(
            "tracing.otlp_endpoint",
            format!(
                "{url:?} is not an OTLP/HTTP URL: write http(s)://host:port, e.g. \
                 http://127.0.0.1:4318 (the collector's OTLP/HTTP port; spans go to /v1/traces)"
            ),
        ));
    }
    let traces = if url.ends_with("/v1/traces") {
        url.to_owned()
    } else {
        format!("{url}/v1/traces")
    };
    Ok(TracingConfig {
        otlp_traces_url: Some(traces),
    })
}

/// A duration that must not be zero.
fn positive(key: &str, value: raw::DurationValue) -> Result<Duration, ConfigError> {
    if value.0.is_zero() {
        Err(ConfigError::new(key, "must be longer than 0ms"))
    } else {
        Ok(value.0)
    }
}

/// Removes `user:password@` from a URL.
pub(crate) fn redact_userinfo(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}://<redacted>@{}", &url[..scheme_end], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        [postgres]
        url = "postgres://relay:hunter2@127.0.0.1:5432/app"
        [sink]
        kind = "nats"
        [[tables]]
        name = "public.outbox"
    "#;

    fn load(text: &str, vars: &[(&str, &str)]) -> Result<Config, String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let lookup = vars.clone();
        from_str(
            text,
            move |n| lookup.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()),
            vars,
        )
        .map_err(|e| e.to_string())
    }

    #[test]
    fn secrets_from_files_are_used_and_never_shown() {
        let dir = std::env::temp_dir().join(format!("cfg-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pw = dir.join("pw");
        std::fs::write(&pw, "file-pa55\n").unwrap();
        let text = format!(
            "[postgres]\nurl = \"postgres://relay@db/app\"\npassword_file = \"{}\"\n\
             [sink]\nkind = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n\
             [sink.kafka.properties]\n\"security.protocol\" = \"SASL_SSL\"\n\
             [sink.kafka.property_files]\n\"sasl.password\" = \"{}\"\n\
             [[tables]]\nname = \"outbox\"\n",
            pw.display(),
            pw.display()
        );
        let c = load(&text, &[]).unwrap();
        assert_eq!(
            c.postgres.connection.get_password(),
            Some(&b"file-pa55"[..])
        );
        let SinkTarget::Kafka(k) = &c.sink.target else {
            panic!("kafka")
        };
        assert_eq!(k.secret_properties["sasl.password"].expose(), "file-pa55");
        let shown = format!("{c:?}");
        assert!(!shown.contains("file-pa55"), "{shown}");
        assert!(shown.contains("SASL_SSL"), "{shown}");

        let both = text.replace("postgres://relay@db", "postgres://relay:x@db");
        let e = load(&both, &[]).unwrap_err();
        assert!(
            e.contains("postgres.password_file: is set and postgres.url has a password too"),
            "{e}"
        );
        let not_secret = text.replace("\"sasl.password\" = ", "\"acks\" = ");
        let e = load(&not_secret, &[]).unwrap_err();
        assert!(
            e.contains("sink.kafka.property_files.acks: only secret properties"),
            "{e}"
        );
        let missing = text.replace(
            &format!("password_file = \"{}\"", pw.display()),
            "password_file = \"/nope/pw\"",
        );
        let e = load(&missing, &[]).unwrap_err();
        assert!(
            e.contains("postgres.password_file: cannot read /nope/pw"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tracing_otlp_endpoint_is_a_base_url_and_a_bad_one_is_named() {
        assert_eq!(load(MINIMAL, &[]).unwrap().tracing.otlp_traces_url, None);
        let traces = |url: &str| {
            load(
                &format!("{MINIMAL}\n[tracing]\notlp_endpoint = \"{url}\"\n"),
                &[],
            )
            .map(|c| c.tracing.otlp_traces_url.unwrap())
        };
        assert_eq!(
            traces("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces("https://otel.example:4318/").unwrap(),
            "https://otel.example:4318/v1/traces"
        );
        assert_eq!(
            traces("http://c:4318/v1/traces").unwrap(),
            "http://c:4318/v1/traces"
        );
        for bad in ["127.0.0.1:4318", "grpc://c:4317", "http://"] {
            let e = traces(bad).unwrap_err();
            assert!(
                e.contains("tracing.otlp_endpoint") && e.contains("http(s)://host:port"),
                "{e}"
            );
        }
    }

    #[test]
    fn minimal_config_gets_the_documented_defaults() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.relay.workers, 4);
        assert_eq!(c.relay.batch_size, 500);
        assert_eq!(c.relay.poll_interval, Duration::from_millis(100));
        assert_eq!(c.relay.ordering, Ordering::Key);
        assert_eq!(c.relay.on_publish, OnPublish::Delete);
        assert_eq!(c.relay.max_attempts, 10);
        assert_eq!(c.postgres.pool_size, 8);
        assert_eq!(c.shutdown.drain_timeout, Duration::from_secs(25));
        assert!(c.http.is_none());
        assert_eq!(c.tables[0].name.to_string(), "public.outbox");
    }

    #[test]
    fn unknown_key_is_named() {
        let e = load(&format!("{MINIMAL}\n[relay]\nworkerz = 3\n"), &[]).unwrap_err();
        assert!(e.starts_with("relay.workerz: unknown key"), "{e}");
    }

    #[test]
    fn missing_required_key_is_named() {
        let e = load("[postgres]\n[sink]\nkind = \"nats\"\n", &[]).unwrap_err();
        assert!(
            e.starts_with("postgres.url: required key is missing"),
            "{e}"
        );
    }

    #[test]
    fn bad_duration_is_named() {
        let e = load(
            &format!("{MINIMAL}\n[shutdown]\ndrain_timeout = \"soon\"\n"),
            &[],
        )
        .unwrap_err();
        assert!(
            e.starts_with("shutdown.drain_timeout: invalid duration"),
            "{e}"
        );
    }

    #[test]
    fn bad_enum_value_is_named() {
        let e = load(&format!("{MINIMAL}\n[relay]\nordering = \"kye\"\n"), &[]).unwrap_err();
        assert!(e.starts_with("relay.ordering:"), "{e}");
        assert!(e.contains("key"), "{e}");
    }

    #[test]
    fn kafka_properties_are_checked_with_the_config() {
        let kafka = MINIMAL.replace(
            "kind = \"nats\"",
            "kind = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n\
             [sink.kafka.properties]\ncompression.type = \"lz4\"\n",
        );
        let c = load(&kafka, &[]).unwrap();
        let SinkTarget::Kafka(k) = &c.sink.target else {
            panic!("kafka")
        };
        assert_eq!(
            k.properties["compression.type"], "lz4",
            "dotted name joined"
        );
        let var = "OUTBOX_RELAY__SINK__KAFKA__PROPERTIES__ACKS";
        let e = load(&kafka, &[(var, "1")]).unwrap_err();
        assert!(
            e.starts_with("sink.kafka.properties.acks: is \"1\", but"),
            "{e}"
        );
        assert!(e.ends_with(&format!("(set by {var})")), "{e}");
    }

    #[test]
    fn environment_overrides_keys_and_is_named_in_errors() {
        let c = load(MINIMAL, &[("OUTBOX_RELAY__RELAY__WORKERS", "2")]).unwrap();
        assert_eq!(c.relay.workers, 2);
        let e = load(MINIMAL, &[("OUTBOX_RELAY__RELAY__WORKERS", "many")]).unwrap_err();
        assert!(e.contains("relay.workers"), "{e}");
        assert!(e.contains("OUTBOX_RELAY__RELAY__WORKERS"), "{e}");
        // Refused by validation rather than by type, it still names the variable.
        let e = load(MINIMAL, &[("OUTBOX_RELAY__RELAY__WORKERS", "0")]).unwrap_err();
        assert_eq!(
            e,
            "relay.workers: must be between 1 and 256 (set by OUTBOX_RELAY__RELAY__WORKERS)"
        );
        let e = load(MINIMAL, &[("OUTBOX_RELAY__TABLES__0__NAME", "a b")]).unwrap_err();
        assert!(e.starts_with("tables[0].name: "), "{e}");
        assert!(
            e.ends_with(" (set by OUTBOX_RELAY__TABLES__0__NAME)"),
            "{e}"
        );
    }

    #[test]
    fn the_example_configs_are_valid() {
        let vars = [("OUTBOX_RELAY_PG_PASSWORD", "pw")];
        let c = load(include_str!("../../config/relay.example.toml"), &vars).unwrap();
        assert_eq!(c.tables.len(), 1);
        assert_eq!(c.tables[0].columns, Columns::default());
        assert!(c.tables[0].columns.is_default_layout());
        // The relay.toml inside the Kubernetes example's ConfigMap.
        let yaml = include_str!("../../examples/kubernetes-sidecar.yaml");
        let embedded: String = yaml
            .split_once("relay.toml: |\n")
            .unwrap()
            .1
            .lines()
            .take_while(|l| !l.starts_with("---"))
            .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
            .collect();
        let c = load(&embedded, &[("PGPASSWORD", "pw")]).unwrap();
        assert_eq!(c.http.unwrap().listen.port(), 9187);
        let c = load(include_str!("../../config/debezium.toml"), &[]).unwrap();
        let t = &c.tables[0];
        assert_eq!(t.columns.order.as_str(), "seq");
        assert_eq!(t.columns.headers, OptionalColumn::Off);
        assert_eq!(&*t.header_columns[0].0, "eventType");
    }

    #[test]
    fn table_histograms_is_table_or_entry() {
        let with = |value: &str| {
            let http = format!("[http]\nlisten = \"127.0.0.1:9187\"\ntable_histograms = {value}\n");
            load(&format!("{MINIMAL}{http}"), &[])
        };
        let h = |c: Config| c.http.unwrap().table_histograms;
        assert_eq!(h(with("\"table\"").unwrap()), TableHistograms::Table);
        assert_eq!(h(with("\"entry\"").unwrap()), TableHistograms::Entry);
        let e = with("\"pattern\"").unwrap_err().to_string();
        assert!(
            e.contains("http.table_histograms")
                && e.contains("\"table\"")
                && e.contains("\"entry\""),
            "{e}"
        );
    }

    #[test]
    fn column_mappings_are_checked_and_name_the_key() {
        let with = |more: &str| load(&format!("{MINIMAL}{more}"), &[]);
        let c = with("[tables.columns]\nid = \"event_id\"\n").unwrap();
        assert_eq!(
            c.tables[0].columns.order.as_str(),
            "event_id",
            "order follows id"
        );
        let e = with("[tables.columns]\nkey = \"payload\"\n").unwrap_err();
        assert!(
            e.contains("tables[0].columns.payload: column payload is already the key column"),
            "{e}"
        );
        let e = with("[tables.columns]\nkeys = \"k\"\n").unwrap_err();
        assert!(e.contains("tables[0].columns.keys: unknown key"), "{e}");
        let e = with("[tables.columns]\norder = \"a b\"\n").unwrap_err();
        assert!(e.starts_with("tables[0].columns.order: "), "{e}");
        let e = with("[tables.header_columns]\n\"outbox-id\" = \"id\"\n").unwrap_err();
        assert!(e.contains("set by the relay itself"), "{e}");
        let e = with("[tables.header_columns]\n\"a b\" = \"id\"\n").unwrap_err();
        assert!(e.contains("tables[0].header_columns.a b"), "{e}");
    }

    #[test]
    fn interpolated_secret_is_used_but_never_shown() {
        let text = MINIMAL.replace("relay:hunter2@", "relay:${PGPASS}@");
        let c = load(&text, &[("PGPASS", "s3cr3t")]).unwrap();
        assert_eq!(c.postgres.connection.get_password(), Some(&b"s3cr3t"[..]));
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(
            shown.contains("postgres://relay@127.0.0.1:5432/app"),
            "{shown}"
        );
    }

    #[test]
    fn bad_postgres_url_does_not_echo_the_password() {
        let text = MINIMAL.replace("127.0.0.1:5432", "127.0.0.1:notaport");
        let e = load(&text, &[]).unwrap_err();
        assert!(e.starts_with("postgres.url:"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn pool_smaller_than_workers_is_rejected() {
        let e = load(&format!("{MINIMAL}\n[relay]\nworkers = 16\n"), &[]).unwrap_err();
        assert!(e.starts_with("postgres.pool_size:"), "{e}");
    }

    #[test]
    fn nats_credentials_are_redacted() {
        assert_eq!(
            redact_userinfo("nats://u:p@127.0.0.1:4222"),
            "nats://<redacted>@127.0.0.1:4222"
        );
    }
}
