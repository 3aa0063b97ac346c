//! `[sink.kafka]` checked with the rest of the configuration, so that `check`, `drain` and
//! `run` all stop with exit code 2 before reaching a broker:
//!
//! 1. Properties that would break a delivery promise are refused ([`refused_properties`]):
//!    the relay needs librdkafka's idempotent producer with `acks=all` (contract section 2).
//! 2. Every property name and value is offered to librdkafka's own configuration parser
//!    (no client is created, nothing touches the network): a misspelt name or an invalid
//!    value is a config error, not a failure at connect time.
//! 3. What librdkafka would otherwise refuse only when the producer is built: `linger.ms`
//!    not below the time a record may wait for its acknowledgement, an `ssl.*.location`
//!    file that cannot be read.
//!
//! No message shows the value of a secret property ([`is_secret`], the one policy).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaConfRes;

use super::raw::RawKafka;
use super::{pem, ConfigError, Secret};

/// `[sink.kafka]`, checked.
#[derive(Clone)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// `[sink.kafka.properties]`, passed to librdkafka after [`PRODUCER_DEFAULTS`].
    pub properties: BTreeMap<String, String>,
    /// `[sink.kafka.property_files]`: properties whose values came from files.
    pub secret_properties: BTreeMap<String, Secret>,
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let shown = if is_secret(k) {
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

/// Validates `[sink.kafka]`, required when `sink.kind = "kafka"`.
pub(super) fn validate(
    raw: Option<RawKafka>,
    publish_timeout: Duration,
) -> Result<KafkaConfig, ConfigError> {
    let raw = raw.ok_or_else(|| {
        ConfigError::new(
            "sink.kafka.brokers",
            "required key is missing when sink.kind = \"kafka\"",
        )
    })?;
    let mut secret_properties = BTreeMap::new();
    for (name, path) in raw.property_files {
        let key = format!("{PROPERTY_FILES}.{name}");
        if !is_secret(&name) {
            return Err(ConfigError::new(
                key,
                "only secret properties (passwords, secrets, tokens, keys) are read from \
                 files; set this one in sink.kafka.properties",
            ));
        }
        if raw.properties.contains_key(&name) {
            return Err(ConfigError::new(
                key,
                format!("{name} is set in sink.kafka.properties too: keep one"),
            ));
        }
        let value = Secret::from_file(&key, &path)?;
        secret_properties.insert(name, value);
    }
    let properties = raw.properties.into_iter().map(|(k, v)| (k, v.0)).collect();
    check(
        &raw.brokers,
        &properties,
        &secret_properties,
        publish_timeout,
    )?;
    Ok(KafkaConfig {
        brokers: raw.brokers,
        properties,
        secret_properties,
    })
}

/// A property the relay refuses, and what to write instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The property as written, e.g. `acks`.
    pub property: String,
    /// Which promise it breaks and what to write instead. Never holds a secret.
    pub reason: String,
}

/// The key of a property set in the file.
const PROPERTIES: &str = "sink.kafka.properties";
/// The key of a property read from a file.
const PROPERTY_FILES: &str = "sink.kafka.property_files";

impl Refusal {
    /// The refusal as a config error on `sink.kafka.properties.<property>`.
    pub fn to_error(&self) -> ConfigError {
        ConfigError::new(format!("{PROPERTIES}.{}", self.property), &self.reason)
    }

    /// `acks: is "1", but ...`: the refusal without the section, for `check`'s report.
    pub fn short(&self) -> String {
        format!("{}: {}", self.property, self.reason)
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PROPERTIES}.{}: {}", self.property, self.reason)
    }
}

/// One rule of the delivery policy: the property's names (librdkafka reads either), and
/// why a value (trimmed, lower case) is refused, or `None` when it is fine.
struct Rule {
    names: &'static [&'static str],
    refuse: fn(&str) -> Option<String>,
}

/// The delivery policy, in the order problems are reported.
const RULES: &[Rule] = &[
    Rule {
        names: &["enable.idempotence"],
        refuse: |v| {
            (!matches!(v, "true" | "t" | "1")).then(|| {
                format!(
                    "is {v:?}, but the relay needs the idempotent producer: without it a \
                     retried record can be written twice or overtake an earlier record of its \
                     key, which breaks the per-key order promise; remove the key (the relay \
                     sets it to true)"
                )
            })
        },
    },
    Rule {
        names: &["acks", "request.required.acks"],
        refuse: |v| {
            (v != "all" && v != "-1").then(|| {
                format!(
                    "is {v:?}, but a row is deleted or marked as soon as Kafka acknowledges it, \
                     and with fewer than all in-sync replicas an acknowledged record can still \
                     be lost, which breaks the at-least-once promise; write \"all\" or remove \
                     the key (the relay sets acks = \"all\")"
                )
            })
        },
    },
    Rule {
        names: &["max.in.flight.requests.per.connection", "max.in.flight"],
        // A value that is not a number is left to librdkafka's own check.
        refuse: |v| {
            v.parse::<u64>().is_ok_and(|n| n > 5).then(|| {
                format!(
                    "is {v}, but the idempotent producer keeps a partition's records in order \
                     only with at most 5 requests in flight, which the per-key order promise \
                     needs; write 5 or less, or remove the key"
                )
            })
        },
    },
    Rule {
        names: &["retries", "message.send.max.retries"],
        refuse: |v| {
            (v.parse::<u64>() == Ok(0)).then(|| {
                "is 0, but the idempotent producer the relay needs does not run without \
                 retries (librdkafka refuses it); remove the key"
                    .into()
            })
        },
    },
    Rule {
        names: &["queuing.strategy"],
        refuse: |v| {
            (v != "fifo").then(|| {
                format!(
                    "is {v:?}, but records must leave in the order they were queued (the \
                     per-key order promise); remove the key"
                )
            })
        },
    },
    Rule {
        names: &["transactional.id"],
        refuse: |_| {
            Some(
                "the relay does not use Kafka transactions (the idempotent producer already \
                 writes each record once per attempt), and a transactional producer refuses \
                 records sent outside a transaction; remove the key"
                    .into(),
            )
        },
    },
    Rule {
        names: &["bootstrap.servers"],
        refuse: |_| Some(BROKERS_ELSEWHERE.into()),
    },
    Rule {
        names: &["metadata.broker.list"],
        refuse: |_| Some(BROKERS_ELSEWHERE.into()),
    },
];

const BROKERS_ELSEWHERE: &str =
    "the brokers are set by sink.kafka.brokers: move the list there and remove this key";

/// The properties that would break the at-least-once or the per-key order promise, or
/// that the relay sets itself. None of them is a secret, so their values may be shown.
pub fn refused_properties(properties: &BTreeMap<String, String>) -> Vec<Refusal> {
    RULES
        .iter()
        .filter_map(|rule| {
            let (name, value) = rule
                .names
                .iter()
                .find_map(|n| properties.get_key_value(*n))?;
            let reason = (rule.refuse)(&value.trim().to_ascii_lowercase())?;
            Some(Refusal {
                property: name.clone(),
                reason,
            })
        })
        .collect()
}

/// Properties whose value is a secret or points at key material: librdkafka's own
/// sensitive properties (`_RK_SENSITIVE` in its `rdkafka_conf.c`, which it redacts in its
/// own logs) except `sasl.username`, plus the files holding a private key. Their values
/// are never shown, are scrubbed from client errors, and may be read from files
/// (`[sink.kafka.property_files]`).
///
/// `sasl.username` is left out on purpose: it is no secret, and scrubbing a short user
/// name from every client error would mangle the messages.
pub const SECRET_PROPERTIES: &[&str] = &[
    "sasl.password",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.client.credentials.client.secret",
    "sasl.oauthbearer.assertion.private.key.file",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
    "sasl.kerberos.keytab",
    "ssl.ca.pem",
    "ssl.key.location",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl_key",
    "ssl.keystore.location",
    "ssl.keystore.password",
];

/// Words that make any other property name secret, so that a property a later librdkafka
/// adds (or a misspelt one) is hidden rather than shown.
const SECRET_WORDS: &[&str] = &["password", "passphrase", "secret", "token", "key"];

/// Whether the value of librdkafka property `name` is a secret (see [`SECRET_PROPERTIES`]):
/// the one policy for redaction in `Debug`, in config errors, in client errors, and for
/// what `[sink.kafka.property_files]` accepts.
pub fn is_secret(name: &str) -> bool {
    let name = name.trim().to_ascii_lowercase();
    SECRET_PROPERTIES.contains(&name.as_str()) || SECRET_WORDS.iter().any(|w| name.contains(w))
}

/// Properties the relay sets on the producer unless the operator sets them: the first two
/// are what the delivery promise needs ([`refused_properties`] refuses other values), the
/// partitioner puts a key where a Java producer would.
pub const PRODUCER_DEFAULTS: &[(&str, &str)] = &[
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("partitioner", "murmur2_random"),
    ("client.id", "outbox-relay"),
];

/// Everything wrong with `[sink.kafka]` that can be known without a broker, one problem
/// per key.
pub(super) fn check(
    brokers: &str,
    properties: &BTreeMap<String, String>,
    secret_properties: &BTreeMap<String, Secret>,
    publish_timeout: Duration,
) -> Result<(), ConfigError> {
    let mut problems: Vec<ConfigError> = Vec::new();
    if brokers.trim().is_empty() {
        problems.push(ConfigError::new(
            "sink.kafka.brokers",
            "is empty: write host:port[,host:port], e.g. \"127.0.0.1:9092\"",
        ));
    }
    let refused = refused_properties(properties);
    problems.extend(refused.iter().map(Refusal::to_error));
    for (name, value) in properties {
        if refused.iter().any(|r| &r.property == name) {
            continue;
        }
        if let Some(why) = librdkafka_refuses(name, value, is_secret(name)) {
            problems.push(ConfigError::new(format!("{PROPERTIES}.{name}"), why));
        }
    }
    for (name, value) in secret_properties {
        if let Some(why) = librdkafka_refuses(name, value.expose(), true) {
            problems.push(ConfigError::new(format!("{PROPERTY_FILES}.{name}"), why));
        }
    }
    problems.extend(linger_too_long(properties, publish_timeout));
    problems.extend(unreadable_files(properties));
    problems.extend(malformed_pem_files(properties, secret_properties));
    // Unless librdkafka already refused the value.
    if let Err(e) = max_message_bytes(properties) {
        if !problems.iter().any(|p| p.key == e.key) {
            problems.push(e);
        }
    }
    ConfigError::all(problems)
}

/// Joins dotted property names back together. Unquoted, `compression.type = "lz4"` is in
/// TOML a table `compression` holding `type`; librdkafka's names are dotted, so under
/// `[sink.kafka.properties]` and `[sink.kafka.property_files]` both spellings mean the
/// same property.
pub(super) fn join_dotted_names(root: &mut toml::Table) -> Result<(), ConfigError> {
    fn flatten(
        table: toml::Table,
        prefix: &str,
        section: &str,
        out: &mut toml::Table,
    ) -> Result<(), ConfigError> {
        for (key, value) in table {
            let name = if prefix.is_empty() {
                key
            } else {
                format!("{prefix}.{key}")
            };
            match value {
                toml::Value::Table(inner) => flatten(inner, &name, section, out)?,
                value => {
                    if out.insert(name.clone(), value).is_some() {
                        return Err(ConfigError::new(
                            format!("sink.kafka.{section}.{name}"),
                            "is set twice (once with quotes, once without); keep one",
                        ));
                    }
                }
            }
        }
        Ok(())
    }
    let Some(kafka) = root
        .get_mut("sink")
        .and_then(toml::Value::as_table_mut)
        .and_then(|sink| sink.get_mut("kafka"))
        .and_then(toml::Value::as_table_mut)
    else {
        return Ok(());
    };
    for section in ["properties", "property_files"] {
        if let Some(toml::Value::Table(table)) = kafka.get_mut(section) {
            let mut flat = toml::Table::new();
            flatten(std::mem::take(table), "", section, &mut flat)?;
            *table = flat;
        }
    }
    Ok(())
}

/// Offers one property to librdkafka's configuration parser (no client is created).
fn librdkafka_refuses(name: &str, value: &str, secret: bool) -> Option<String> {
    let mut config = ClientConfig::new();
    config.set(name, value);
    match config.create_native_config() {
        Ok(_) => None,
        Err(KafkaError::ClientConfig(RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN, ..)) => Some(
            "librdkafka has no such property: check the name against \
             https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md"
                .into(),
        ),
        // librdkafka's description quotes the value: fine, unless it is a secret.
        Err(KafkaError::ClientConfig(_, description, ..)) if !secret => {
            Some(format!("librdkafka refuses it: {description}"))
        }
        Err(_) => Some("librdkafka refuses this value (not shown: it is a secret)".into()),
    }
}

/// librdkafka refuses to build a producer whose `linger.ms` is not below the record
/// timeout: the relay's `sink.publish_timeout`, unless a property sets its own.
fn linger_too_long(
    properties: &BTreeMap<String, String>,
    publish_timeout: Duration,
) -> Option<ConfigError> {
    let millis = |names: &[&str]| {
        names.iter().find_map(|n| {
            let (name, value) = properties.get_key_value(*n)?;
            Some((name.as_str(), value.trim().parse::<f64>().ok()?))
        })
    };
    let (name, linger) = millis(&["linger.ms", "queue.buffering.max.ms"])?;
    let (limit, source) = match millis(&["message.timeout.ms", "delivery.timeout.ms"]) {
        Some((timeout, value)) => (value, format!("{PROPERTIES}.{timeout}")),
        None => (
            publish_timeout.as_secs_f64() * 1000.0,
            "sink.publish_timeout".to_owned(),
        ),
    };
    (limit > 0.0 && linger >= limit).then(|| {
        ConfigError::new(
            format!("{PROPERTIES}.{name}"),
            format!(
                "is {linger} ms, not shorter than {source} ({limit} ms), the longest a record \
                 may wait for its acknowledgement; librdkafka refuses that: lower it"
            ),
        )
    })
}

/// `ssl.ca.location`, `ssl.certificate.location`, `ssl.key.location`, ...: librdkafka
/// reads them when the producer is built; a missing one is a config error now. A CA
/// location may be a directory, or `probe` (the system's CAs).
fn unreadable_files(properties: &BTreeMap<String, String>) -> Vec<ConfigError> {
    properties
        .iter()
        .filter(|(name, _)| name.starts_with("ssl.") && name.ends_with(".location"))
        .filter(|(name, value)| !(*name == "ssl.ca.location" && value.as_str() == "probe"))
        .filter_map(|(name, value)| {
            let path = std::path::Path::new(value);
            let readable = if path.is_dir() && name.as_str() == "ssl.ca.location" {
                std::fs::read_dir(path).map(|_| ())
            } else {
                std::fs::File::open(path).map(|_| ())
            };
            readable.err().map(|e| {
                ConfigError::new(
                    format!("{PROPERTIES}.{name}"),
                    format!("cannot read {value}: {e}: give a readable file"),
                )
            })
        })
        .collect()
}

/// `ssl.ca.location`, `ssl.certificate.location` and `ssl.key.location` that can be read
/// but that librdkafka would refuse when the producer is built: PEM certificates, and a
/// PEM key (decrypted with `ssl.key.password` if set). The error shows the path, never the
/// file.
fn malformed_pem_files(
    properties: &BTreeMap<String, String>,
    secret_properties: &BTreeMap<String, Secret>,
) -> Vec<ConfigError> {
    let passphrase = properties
        .get("ssl.key.password")
        .map(String::as_str)
        .or_else(|| {
            secret_properties
                .get("ssl.key.password")
                .map(Secret::expose)
        });
    let mut problems = Vec::new();
    for (name, value) in properties {
        let path = std::path::Path::new(value);
        if !path.is_file() || std::fs::File::open(path).is_err() {
            continue; // a directory of CAs, `probe`, or reported as unreadable
        }
        let parsed = match name.as_str() {
            "ssl.ca.location" | "ssl.certificate.location" => pem::certificates(path).map(|_| ()),
            "ssl.key.location" => pem::private_key(path, passphrase).map(|_| ()),
            _ => Ok(()),
        };
        if let Err(why) = parsed {
            problems.push(ConfigError::new(
                format!("{PROPERTIES}.{name}"),
                format!("{value} {why}: give a readable PEM file"),
            ));
        }
    }
    problems
}

/// `message.max.bytes`, which the sink also uses to refuse oversized records before
/// sending: a whole number of bytes.
pub fn max_message_bytes(properties: &BTreeMap<String, String>) -> Result<usize, ConfigError> {
    match properties.get("message.max.bytes") {
        None => Ok(DEFAULT_MAX_MESSAGE_BYTES),
        Some(v) => v.parse().map_err(|_| {
            ConfigError::new(
                format!("{PROPERTIES}.message.max.bytes"),
                format!("is {v:?}: write a whole number of bytes, e.g. 1000000"),
            )
        }),
    }
}

/// librdkafka's default `message.max.bytes`.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;

#[cfg(test)]
mod tests {
    use super::*;

    fn props(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn check_props(pairs: &[(&str, &str)]) -> Result<(), String> {
        check(
            "k:9092",
            &props(pairs),
            &BTreeMap::new(),
            Duration::from_secs(10),
        )
        .map_err(|e| e.to_string())
    }

    #[test]
    fn properties_that_break_a_promise_are_refused_by_name() {
        assert!(refused_properties(&props(&[
            ("compression.type", "lz4"),
            ("acks", "-1"),
            ("enable.idempotence", "true"),
            ("max.in.flight", "5"),
        ]))
        .is_empty());
        let refused = refused_properties(&props(&[
            ("enable.idempotence", "false"),
            ("request.required.acks", "1"),
            ("max.in.flight.requests.per.connection", "10"),
            ("bootstrap.servers", "k:9092"),
            ("transactional.id", "x"),
        ]));
        let named: Vec<&str> = refused.iter().map(|r| r.property.as_str()).collect();
        assert_eq!(
            named,
            [
                "enable.idempotence",
                "request.required.acks",
                "max.in.flight.requests.per.connection",
                "transactional.id",
                "bootstrap.servers"
            ]
        );
        let acks = refused[1].to_string();
        assert!(
            acks.starts_with("sink.kafka.properties.request.required.acks: is \"1\""),
            "{acks}"
        );
        assert!(acks.contains("at-least-once"), "{acks}");
        assert!(acks.contains("write \"all\""), "{acks}");
        assert!(refused[0].reason.contains("per-key order"));
    }

    #[test]
    fn one_secret_policy_covers_librdkafkas_sensitive_properties_and_key_files() {
        for name in SECRET_PROPERTIES {
            assert!(is_secret(name), "{name}");
        }
        // Every name either of the two old lists hid is still hidden.
        for name in [
            "sasl.password",
            "ssl.key.password",
            "ssl.key.pem",
            "ssl.key.location",
            "ssl.keystore.password",
            "ssl.keystore.location",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.token.endpoint.url",
            "SASL.Password",
            "some.future.secret",
        ] {
            assert!(is_secret(name), "{name}");
        }
        for name in [
            "sasl.username",
            "security.protocol",
            "sasl.mechanisms",
            "ssl.ca.location",
            "ssl.certificate.location",
            "ssl.certificate.pem",
            "compression.type",
            "acks",
            "linger.ms",
            "client.id",
        ] {
            assert!(!is_secret(name), "{name}");
        }
    }

    #[test]
    fn the_defaults_the_relay_sets_pass_its_own_policy() {
        let defaults: BTreeMap<String, String> = PRODUCER_DEFAULTS
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert!(refused_properties(&defaults).is_empty());
        assert_eq!(defaults["acks"], "all");
        assert_eq!(defaults["enable.idempotence"], "true");
    }

    #[test]
    fn files_librdkafka_would_refuse_at_build_time_are_refused_now() {
        let dir = std::env::temp_dir().join(format!("cfg-kafka-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not PEM").unwrap();
        let junk = junk.to_str().unwrap();
        for name in [
            "ssl.ca.location",
            "ssl.certificate.location",
            "ssl.key.location",
        ] {
            let e = check_props(&[(name, junk)]).unwrap_err();
            assert!(
                e.starts_with(&format!(
                    "sink.kafka.properties.{name}: {junk} cannot be used ("
                )),
                "{e}"
            );
            assert!(e.ends_with("give a readable PEM file"), "{e}");
        }
        // A directory of CAs is left to librdkafka.
        let dir_name = dir.to_str().unwrap();
        assert_eq!(check_props(&[("ssl.ca.location", dir_name)]), Ok(()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn message_max_bytes_must_be_a_number_the_sink_can_use() {
        assert_eq!(
            max_message_bytes(&props(&[])),
            Ok(DEFAULT_MAX_MESSAGE_BYTES)
        );
        assert_eq!(
            max_message_bytes(&props(&[("message.max.bytes", "2000000")])),
            Ok(2_000_000)
        );
        let e = max_message_bytes(&props(&[("message.max.bytes", " 2000000")])).unwrap_err();
        assert_eq!(e.key, "sink.kafka.properties.message.max.bytes");
        // Reported once, whoever finds it first.
        let e = check_props(&[("message.max.bytes", "lots")]).unwrap_err();
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(
            e.starts_with("sink.kafka.properties.message.max.bytes: "),
            "{e}"
        );
    }

    #[test]
    fn librdkafka_checks_names_and_values_without_a_broker() {
        assert_eq!(
            check_props(&[("compression.type", "lz4"), ("linger.ms", "5")]),
            Ok(())
        );
        let e = check_props(&[("compresion.type", "lz4")]).unwrap_err();
        assert!(
            e.starts_with("sink.kafka.properties.compresion.type: librdkafka has no such property"),
            "{e}"
        );
        let e = check_props(&[("compression.type", "lz5")]).unwrap_err();
        assert!(
            e.starts_with("sink.kafka.properties.compression.type: librdkafka refuses it:"),
            "{e}"
        );
        assert!(e.contains("lz5"), "{e}");
    }

    #[test]
    fn secret_values_are_never_shown() {
        let e = check_props(&[("acks", "0"), ("ssl.keystore.password", "s3cr3t\0x")]).unwrap_err();
        assert!(e.contains("sink.kafka.properties.acks: is \"0\""), "{e}");
        assert!(
            e.contains("sink.kafka.properties.ssl.keystore.password: librdkafka refuses"),
            "{e}"
        );
        assert!(!e.contains("s3cr3t"), "{e}");
    }

    #[test]
    fn dotted_names_mean_the_same_property_quoted_or_not() {
        let mut root: toml::Table = toml::from_str(
            "[sink.kafka.properties]\ncompression.type = \"lz4\"\n\"linger.ms\" = 5\n\
             ssl = { ca.location = \"/ca.pem\" }\n",
        )
        .unwrap();
        join_dotted_names(&mut root).unwrap();
        let properties = root["sink"]["kafka"]["properties"].as_table().unwrap();
        let names: Vec<&str> = properties.keys().map(String::as_str).collect();
        assert_eq!(names, ["compression.type", "linger.ms", "ssl.ca.location"]);
        let mut twice: toml::Table = toml::from_str(
            "[sink.kafka.properties]\ncompression.type = \"lz4\"\n\"compression.type\" = \"zstd\"\n",
        )
        .unwrap();
        assert_eq!(
            join_dotted_names(&mut twice).unwrap_err().to_string(),
            "sink.kafka.properties.compression.type: is set twice (once with quotes, once \
             without); keep one"
        );
    }

    #[test]
    fn ssl_files_must_be_readable_now() {
        let ca = std::env::temp_dir().join(format!("kafka-ca-{}.pem", std::process::id()));
        std::fs::write(&ca, pem::self_signed().0).unwrap();
        let ca = ca.to_str().unwrap();
        assert_eq!(check_props(&[("ssl.ca.location", ca)]), Ok(()));
        assert_eq!(check_props(&[("ssl.ca.location", "probe")]), Ok(()));
        let e = check_props(&[("ssl.key.location", "/nope/relay.key")]).unwrap_err();
        assert!(
            e.starts_with("sink.kafka.properties.ssl.key.location: cannot read /nope/relay.key:"),
            "{e}"
        );
        std::fs::remove_file(ca).unwrap();
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let e = check(
            " ",
            &props(&[("acks", "1"), ("linger.ms", "20000")]),
            &BTreeMap::new(),
            Duration::from_secs(10),
        )
        .unwrap_err()
        .to_string();
        let lines: Vec<&str> = e.lines().collect();
        assert_eq!(lines.len(), 3, "{e}");
        assert!(lines[0].starts_with("sink.kafka.brokers: is empty"), "{e}");
        assert!(lines[1].starts_with("sink.kafka.properties.acks:"), "{e}");
        assert!(
            lines[2].starts_with("sink.kafka.properties.linger.ms: is 20000 ms, not shorter than sink.publish_timeout"),
            "{e}"
        );
    }
}
