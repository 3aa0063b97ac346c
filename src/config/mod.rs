//! Configuration: the one place where input is checked.
//!
//! [`load`] reads the TOML file, replaces `${VAR}` references, applies
//! `OUTBOX_RELAY__SECTION__KEY` overrides, deserializes into the [`raw`] types (unknown keys
//! rejected) and validates the result into a [`Config`]. Every error names the key at
//! fault (a TOML syntax error its line and column) in the file's words, never serde's
//! ([`explain`]); no error ever contains a secret. Everything that can be known without
//! the network is checked here, the Kafka producer's properties included ([`kafka`]), so
//! that every such mistake exits 2.

mod env;
mod explain;
pub mod headers;
pub mod kafka;
pub mod names;
pub mod postgres;
pub mod raw;
pub mod secret;

pub use secret::Secret;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

pub use names::{Ident, TableName, Template};
pub use raw::{OnPublish, Ordering, SinkKind};

/// Where the config is read from when neither `--config` nor `OUTBOX_RELAY_CONFIG` is set.
pub const DEFAULT_PATH: &str = "/etc/outbox-relay/relay.toml";

/// A configuration problem: always the operator's to fix, always exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

/// The checked configuration. Everything in it has been validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub postgres: PostgresConfig,
    pub relay: RelayConfig,
    pub sink: SinkConfig,
    pub tables: Vec<TableConfig>,
    pub http: Option<HttpConfig>,
    pub shutdown: ShutdownConfig,
}

#[derive(Clone)]
pub struct PostgresConfig {
    /// Parsed connection settings; may hold a password, so this type's `Debug` is redacted.
    pub connection: tokio_postgres::Config,
    pub pool_size: usize,
    pub statement_timeout: Duration,
    pub connect_timeout: Duration,
    /// Keep the claim's statements prepared per session (see `source::Tx`).
    pub prepared_statements: bool,
    /// `sslmode`, `sslrootcert`, `sslcert`, `sslkey` from the URL (see `source::tls`).
    pub tls: postgres::TlsSettings,
}

impl PostgresConfig {
    /// `postgres://user@host:port/db` without the password, for logs and `check`.
    pub fn redacted(&self) -> String {
        let c = &self.connection;
        let user = c.get_user().unwrap_or("");
        let hosts: Vec<String> = c
            .get_hosts()
            .iter()
            .zip(c.get_ports().iter().chain(std::iter::repeat(&5432)))
            .map(|(h, p)| match h {
                tokio_postgres::config::Host::Tcp(h) => format!("{h}:{p}"),
                tokio_postgres::config::Host::Unix(path) => format!("{}:{p}", path.display()),
            })
            .collect();
        format!(
            "postgres://{user}@{}/{}",
            hosts.join(","),
            c.get_dbname().unwrap_or("")
        )
    }
}

impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &self.redacted())
            .field("pool_size", &self.pool_size)
            .field("statement_timeout", &self.statement_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("prepared_statements", &self.prepared_statements)
            .field("tls", &self.tls)
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub workers: usize,
    pub batch_size: usize,
    pub poll_interval: Duration,
    pub ordering: Ordering,
    pub on_publish: OnPublish,
    pub max_attempts: u32,
    /// The first retry's ceiling: a failed row's next attempt is due within
    /// `min(retry_backoff_max, retry_backoff * 2^(attempts-1))` (full jitter).
    pub retry_backoff: Duration,
    pub retry_backoff_max: Duration,
    /// Payload bytes one claim takes at most; a single larger row is claimed alone.
    pub max_batch_bytes: u64,
    /// Mark mode: published rows whose `published_at` is older than this are deleted
    /// (the source's retention task); `None` keeps them.
    pub retention: Option<Duration>,
}

#[derive(Debug, Clone)]
pub struct SinkConfig {
    pub target: SinkTarget,
    pub publish_timeout: Duration,
}

#[derive(Debug, Clone)]
pub enum SinkTarget {
    Nats(NatsConfig),
    Kafka(KafkaConfig),
    Stdout,
}

#[derive(Clone)]
pub struct NatsConfig {
    /// Server URLs; may carry `user:password@`, so `Debug` is redacted.
    pub urls: Vec<String>,
    pub auth: NatsAuth,
    /// `tls_ca_file`: verify the server against these CAs (and require TLS).
    pub tls_ca: Option<std::path::PathBuf>,
    /// `tls_cert_file` and `tls_key_file`.
    pub tls_client: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

/// How the relay authenticates to NATS beyond what the URL carries.
#[derive(Debug, Clone)]
pub enum NatsAuth {
    None,
    /// A `.creds` file, read by the client at connect time.
    CredentialsFile(std::path::PathBuf),
    /// A user nkey seed, read from `nkey_file`.
    NKey(Secret),
}

fn nats_config(urls: Vec<String>, raw: raw::RawNats) -> Result<NatsConfig, ConfigError> {
    let file = |key: &str, path: std::path::PathBuf| {
        let key = format!("sink.nats.{key}");
        secret::existing_file(&key, path).map_err(|e| err(&key, strip_key(&e)))
    };
    let auth = match (raw.credentials_file, raw.nkey_file) {
        (Some(_), Some(_)) => {
            return Err(err(
                "sink.nats.nkey_file",
                "is set and sink.nats.credentials_file too: a .creds file carries its own \
                 nkey; keep one"
                    .into(),
            ))
        }
        (Some(path), None) => NatsAuth::CredentialsFile(file("credentials_file", path)?),
        (None, Some(path)) => {
            let seed = Secret::from_file("sink.nats.nkey_file", &path)
                .map_err(|e| err("sink.nats.nkey_file", strip_key(&e)))?;
            if !seed.expose().trim().starts_with("SU") {
                return Err(err(
                    "sink.nats.nkey_file",
                    format!(
                        "{} does not hold a user nkey seed (one line starting with SU)",
                        path.display()
                    ),
                ));
            }
            NatsAuth::NKey(Secret::new(seed.expose().trim().to_owned()))
        }
        (None, None) => NatsAuth::None,
    };
    let tls_ca = raw
        .tls_ca_file
        .map(|p| file("tls_ca_file", p))
        .transpose()?;
    let tls_client = match (raw.tls_cert_file, raw.tls_key_file) {
        (Some(c), Some(k)) => Some((file("tls_cert_file", c)?, file("tls_key_file", k)?)),
        (None, None) => None,
        _ => {
            return Err(err(
                "sink.nats.tls_cert_file",
                "and sink.nats.tls_key_file go together: give both".into(),
            ))
        }
    };
    Ok(NatsConfig {
        urls,
        auth,
        tls_ca,
        tls_client,
    })
}

impl NatsConfig {
    /// The server URLs with any credentials removed.
    pub fn redacted(&self) -> String {
        self.urls
            .iter()
            .map(|u| redact_userinfo(u))
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("urls", &self.redacted())
            .finish()
    }
}

#[derive(Clone)]
pub struct KafkaConfig {
    pub brokers: String,
    pub properties: BTreeMap<String, String>,
    /// `[sink.kafka.property_files]`: properties whose values came from files.
    pub secret_properties: BTreeMap<String, Secret>,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let shown = if kafka::is_secret(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("properties", &shown)
            .field("secret_properties", &self.secret_properties)
            .finish()
    }
}

/// One `[[tables]]` entry.
#[derive(Debug, Clone)]
pub struct TableConfig {
    pub name: TableName,
    pub topic: Template,
    pub columns: Columns,
    /// Extra headers: header name and the column whose value it carries.
    pub header_columns: Vec<(String, Ident)>,
}

/// The columns the relay reads and writes. The default is the contract's table
/// (section 5); `[tables.columns]` maps any of them to other names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Columns {
    /// Message id: `<table>:<value>`. Any type.
    pub id: Ident,
    /// Order within a key, and the row's handle in claims, marks and deletes: an integer
    /// column with unique values. The id column unless mapped.
    pub order: Ident,
    pub key: Ident,
    pub payload: Ident,
    pub headers: OptionalColumn,
    pub created_at: OptionalColumn,
    pub published_at: Ident,
    pub attempts: Ident,
    pub last_error: Ident,
    pub dead_at: Ident,
    /// After a failure: the row is not claimed before this time (NULL = due).
    pub next_attempt_at: Ident,
}

/// A column the relay can do without.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionalColumn {
    /// Not configured: used when the table has a column of the default name.
    Default(Ident),
    /// Configured: the table must have it.
    Named(Ident),
    /// Configured as `""`: not used.
    Off,
}

impl OptionalColumn {
    /// The column to look for, if any.
    pub fn name(&self) -> Option<&Ident> {
        match self {
            OptionalColumn::Default(c) | OptionalColumn::Named(c) => Some(c),
            OptionalColumn::Off => None,
        }
    }
}

impl Default for Columns {
    fn default() -> Self {
        let c = |n: &str| Ident::parse(n).expect("default column names are valid");
        Columns {
            id: c("id"),
            order: c("id"),
            key: c("key"),
            payload: c("payload"),
            headers: OptionalColumn::Default(c("headers")),
            created_at: OptionalColumn::Default(c("created_at")),
            published_at: c("published_at"),
            attempts: c("attempts"),
            last_error: c("last_error"),
            dead_at: c("dead_at"),
            next_attempt_at: c("next_attempt_at"),
        }
    }
}

impl Columns {
    /// Whether these are the default table's column names (however they were written).
    pub fn is_default_layout(&self) -> bool {
        let d = Columns::default();
        let names = |c: &Columns| {
            [
                Some(c.id.clone()),
                Some(c.order.clone()),
                Some(c.key.clone()),
                Some(c.payload.clone()),
                c.headers.name().cloned(),
                c.created_at.name().cloned(),
                Some(c.published_at.clone()),
                Some(c.attempts.clone()),
                Some(c.last_error.clone()),
                Some(c.dead_at.clone()),
                Some(c.next_attempt_at.clone()),
            ]
        };
        names(self) == names(&d)
    }

    /// Validates `[tables.columns]`; `at` is the key prefix for errors (`tables[0].columns`).
    fn from_raw(raw: raw::RawColumns, at: &str) -> Result<Columns, ConfigError> {
        let defaults = Columns::default();
        let ident = |value: Option<String>, role: &str, default: &Ident| match value {
            None => Ok(default.clone()),
            Some(v) => Ident::parse(&v).map_err(|e| err(&format!("{at}.{role}"), e)),
        };
        let optional = |value: Option<String>, role: &str, default: &OptionalColumn| match value {
            None => Ok(default.clone()),
            Some(v) if v.is_empty() => Ok(OptionalColumn::Off),
            Some(v) => Ident::parse(&v)
                .map(OptionalColumn::Named)
                .map_err(|e| err(&format!("{at}.{role}"), e)),
        };
        let id = ident(raw.id, "id", &defaults.id)?;
        let order = match raw.order {
            None => id.clone(),
            some => ident(some, "order", &defaults.order)?,
        };
        let columns = Columns {
            id,
            order,
            key: ident(raw.key, "key", &defaults.key)?,
            payload: ident(raw.payload, "payload", &defaults.payload)?,
            headers: optional(raw.headers, "headers", &defaults.headers)?,
            created_at: optional(raw.created_at, "created_at", &defaults.created_at)?,
            published_at: ident(raw.published_at, "published_at", &defaults.published_at)?,
            attempts: ident(raw.attempts, "attempts", &defaults.attempts)?,
            last_error: ident(raw.last_error, "last_error", &defaults.last_error)?,
            dead_at: ident(raw.dead_at, "dead_at", &defaults.dead_at)?,
            next_attempt_at: ident(
                raw.next_attempt_at,
                "next_attempt_at",
                &defaults.next_attempt_at,
            )?,
        };
        // One column cannot play two parts the relay writes or reads differently.
        let roles = [
            ("order", Some(&columns.order)),
            ("key", Some(&columns.key)),
            ("payload", Some(&columns.payload)),
            ("headers", columns.headers.name()),
            ("published_at", Some(&columns.published_at)),
            ("attempts", Some(&columns.attempts)),
            ("last_error", Some(&columns.last_error)),
            ("dead_at", Some(&columns.dead_at)),
            ("next_attempt_at", Some(&columns.next_attempt_at)),
        ];
        for (i, (role, column)) in roles.iter().enumerate() {
            if let Some(other) = roles[..i].iter().find(|(_, c)| c.is_some() && c == column) {
                return Err(err(
                    &format!("{at}.{role}"),
                    format!(
                        "column {} is already the {} column; each part needs its own column",
                        column.expect("compared only when set"),
                        other.0
                    ),
                ));
            }
        }
        Ok(columns)
    }
}

/// An error on `key`: the message leads with the key at fault.
fn err(key: &str, msg: String) -> ConfigError {
    ConfigError(format!("{key}: {msg}"))
}

fn header_columns(
    raw: BTreeMap<String, String>,
    at: &str,
) -> Result<Vec<(String, Ident)>, ConfigError> {
    raw.into_iter()
        .map(|(name, column)| {
            let key = format!("{at}.{name}");
            if !headers::is_valid_name(&name) {
                return Err(err(
                    &key,
                    "a header name is printable ASCII without spaces or ':'".into(),
                ));
            }
            if headers::is_reserved(&name) {
                return Err(err(&key, format!("{name} is set by the relay itself")));
            }
            let column = Ident::parse(&column).map_err(|e| err(&key, e))?;
            Ok((name, column))
        })
        .collect()
}

#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub listen: SocketAddr,
}

#[derive(Debug, Clone)]
pub struct ShutdownConfig {
    pub drain_timeout: Duration,
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
        ConfigError(format!(
            "cannot read config file {}: {e} (pass --config FILE or set OUTBOX_RELAY_CONFIG)",
            path.display()
        ))
    })?;
    from_str(&text, |name| std::env::var(name).ok(), std::env::vars())
        .map_err(|ConfigError(msg)| ConfigError(format!("{}: {msg}", path.display())))
}

/// [`load`] without the file system: `lookup` serves `${VAR}`, `vars` the overrides.
pub fn from_str(
    text: &str,
    lookup: impl Fn(&str) -> Option<String>,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Config, ConfigError> {
    let mut table: toml::Table =
        toml::from_str(text).map_err(|e| ConfigError(explain::syntax_error(text, &e)))?;
    explain::check_lists(&table).map_err(ConfigError)?;
    kafka::join_dotted_names(&mut table).map_err(ConfigError)?;
    env::interpolate_values(&mut table, &lookup).map_err(ConfigError)?;
    let overrides = env::apply_overrides(&mut table, vars).map_err(ConfigError)?;
    let raw: raw::RawConfig = serde_path_to_error::deserialize(toml::Value::Table(table))
        .map_err(|e| ConfigError(explain::serde_error(&e, &overrides)))?;
    validate(raw).map_err(|ConfigError(e)| ConfigError(explain::name_sources(&e, &overrides)))
}

/// `key: message` -> `message`, for errors built by helpers that name their key.
fn strip_key(e: &str) -> String {
    e.split_once(": ").map_or(e, |(_, rest)| rest).to_owned()
}

fn validate(raw: raw::RawConfig) -> Result<Config, ConfigError> {
    let (url, tls) =
        postgres::split_tls_params(&raw.postgres.url).map_err(|e| err("postgres.url", e))?;
    // Certificate files are read now: a missing one is a config error, not a runtime one.
    tls.check_files().map_err(|e| err("postgres.url", e))?;
    let mut connection = tokio_postgres::Config::from_str(&url).map_err(|e| {
        // tokio-postgres names the option at fault without echoing values.
        err(
            "postgres.url",
            format!("not a valid PostgreSQL connection URL ({e})"),
        )
    })?;
    connection.ssl_mode(tls.ssl_mode());
    if let Some(path) = raw.postgres.password_file {
        if connection.get_password().is_some() {
            return Err(err(
                "postgres.password_file",
                "is set and postgres.url has a password too: keep one".into(),
            ));
        }
        let password = Secret::from_file("postgres.password_file", &path)
            .map_err(|e| err("postgres.password_file", strip_key(&e)))?;
        connection.password(password.expose());
    }
    if connection.get_hosts().is_empty() {
        return Err(err(
            "postgres.url",
            "names no host: write postgres://user@host:5432/db".into(),
        ));
    }
    let relay = raw.relay;
    if relay.workers == 0 || relay.workers > 256 {
        return Err(err("relay.workers", "must be between 1 and 256".into()));
    }
    if relay.batch_size == 0 || relay.batch_size > 10_000 {
        return Err(err(
            "relay.batch_size",
            "must be between 1 and 10000".into(),
        ));
    }
    if relay.max_attempts == 0 {
        return Err(err("relay.max_attempts", "must be at least 1".into()));
    }
    let retry_backoff = positive("relay.retry_backoff", relay.retry_backoff)?;
    let retry_backoff_max = positive("relay.retry_backoff_max", relay.retry_backoff_max)?;
    if retry_backoff_max < retry_backoff {
        return Err(err(
            "relay.retry_backoff_max",
            format!(
                "is {retry_backoff_max:?}, shorter than relay.retry_backoff ({retry_backoff:?}): \
                 the cap must be at least the first wait"
            ),
        ));
    }
    if relay.max_batch_bytes.0 < 1024 {
        return Err(err(
            "relay.max_batch_bytes",
            format!(
                "is {} bytes; it must be at least 1KiB (a row larger than the budget is \
                 still claimed alone, so a small budget only makes batches of one row)",
                relay.max_batch_bytes.0
            ),
        ));
    }
    let retention = match relay.retention {
        None => None,
        Some(_) if relay.on_publish == OnPublish::Delete => {
            return Err(err(
                "relay.retention",
                "applies to on_publish = \"mark\" only (in delete mode no published row is \
                 kept): remove it, or set relay.on_publish = \"mark\""
                    .into(),
            ))
        }
        Some(value) => Some(positive("relay.retention", value)?),
    };
    if relay.poll_interval.0 < Duration::from_millis(1) {
        return Err(err("relay.poll_interval", "must be at least 1ms".into()));
    }
    if raw.postgres.pool_size < relay.workers {
        return Err(err(
            "postgres.pool_size",
            format!(
                "is {} but must be at least relay.workers ({}): each worker holds a connection",
                raw.postgres.pool_size, relay.workers
            ),
        ));
    }
    let postgres = PostgresConfig {
        connection,
        pool_size: raw.postgres.pool_size,
        statement_timeout: positive("postgres.statement_timeout", raw.postgres.statement_timeout)?,
        connect_timeout: positive("postgres.connect_timeout", raw.postgres.connect_timeout)?,
        prepared_statements: raw.postgres.prepared_statements,
        tls,
    };

    let publish_timeout = positive("sink.publish_timeout", raw.sink.publish_timeout)?;
    let target = match raw.sink.kind {
        SinkKind::Nats => {
            let nats = raw.sink.nats.unwrap_or(raw::RawNats {
                url: "nats://127.0.0.1:4222".into(),
                credentials_file: None,
                nkey_file: None,
                tls_ca_file: None,
                tls_cert_file: None,
                tls_key_file: None,
            });
            let urls: Vec<String> = nats.url.split(',').map(|u| u.trim().to_owned()).collect();
            if urls.iter().any(String::is_empty) {
                return Err(err("sink.nats.url", "contains an empty server URL".into()));
            }
            SinkTarget::Nats(nats_config(urls, nats)?)
        }
        SinkKind::Kafka => {
            let kafka = raw.sink.kafka.ok_or_else(|| {
                err(
                    "sink.kafka.brokers",
                    "required key is missing when sink.kind = \"kafka\"".into(),
                )
            })?;
            let mut secret_properties = BTreeMap::new();
            for (name, path) in kafka.property_files {
                let key = format!("sink.kafka.property_files.{name}");
                if !self::kafka::is_secret(&name) {
                    return Err(err(
                        &key,
                        "only secret properties (passwords, secrets, tokens, keys) are read \
                         from files; set this one in sink.kafka.properties"
                            .into(),
                    ));
                }
                if kafka.properties.contains_key(&name) {
                    return Err(err(
                        &key,
                        format!("{name} is set in sink.kafka.properties too: keep one"),
                    ));
                }
                let value = Secret::from_file(&key, &path).map_err(|e| err(&key, strip_key(&e)))?;
                secret_properties.insert(name, value);
            }
            let properties = kafka
                .properties
                .into_iter()
                .map(|(k, v)| (k, v.0))
                .collect();
            self::kafka::check(
                &kafka.brokers,
                &properties,
                &secret_properties,
                publish_timeout,
            )?;
            SinkTarget::Kafka(KafkaConfig {
                brokers: kafka.brokers,
                properties,
                secret_properties,
            })
        }
        SinkKind::Stdout => SinkTarget::Stdout,
    };
    let sink = SinkConfig {
        target,
        publish_timeout,
    };

    if raw.tables.is_empty() {
        return Err(err(
            "tables",
            "at least one [[tables]] entry is required".into(),
        ));
    }
    let mut tables: Vec<TableConfig> = Vec::new();
    for (i, t) in raw.tables.into_iter().enumerate() {
        let name = TableName::parse(&t.name).map_err(|e| err(&format!("tables[{i}].name"), e))?;
        if tables.iter().any(|other| other.name == name) {
            return Err(err(
                &format!("tables[{i}].name"),
                format!("{name} is listed twice"),
            ));
        }
        let topic = Template::parse(&t.topic).map_err(|e| err(&format!("tables[{i}].topic"), e))?;
        tables.push(TableConfig {
            name,
            topic,
            columns: Columns::from_raw(t.columns, &format!("tables[{i}].columns"))?,
            header_columns: header_columns(
                t.header_columns,
                &format!("tables[{i}].header_columns"),
            )?,
        });
    }

    let http = match raw.http.listen {
        None => None,
        Some(listen) => Some(HttpConfig {
            listen: listen.parse().map_err(|_| {
                err(
                    "http.listen",
                    format!("{listen:?} is not an address: write host:port, e.g. 127.0.0.1:9187"),
                )
            })?,
        }),
    };

    let shutdown = ShutdownConfig {
        drain_timeout: positive("shutdown.drain_timeout", raw.shutdown.drain_timeout)?,
    };

    Ok(Config {
        postgres,
        relay: RelayConfig {
            workers: relay.workers,
            batch_size: relay.batch_size,
            poll_interval: relay.poll_interval.0,
            ordering: relay.ordering,
            on_publish: relay.on_publish,
            max_attempts: relay.max_attempts,
            retry_backoff,
            retry_backoff_max,
            max_batch_bytes: relay.max_batch_bytes.0,
            retention,
        },
        sink,
        tables,
        http,
        shutdown,
    })
}

fn positive(key: &str, value: raw::DurationValue) -> Result<Duration, ConfigError> {
    if value.0.is_zero() {
        Err(ConfigError(format!("{key}: must be longer than 0ms")))
    } else {
        Ok(value.0)
    }
}

/// Removes `user:password@` from a URL.
pub fn redact_userinfo(url: &str) -> String {
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
        assert_eq!(t.header_columns[0].0, "eventType");
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
