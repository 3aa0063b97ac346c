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
//!    file that cannot be read or is not PEM, a `message.max.bytes` that is no number.
//!
//! 2 and 3 live in `kafka/check.rs`; this file holds the config type and the policy: what
//! the relay refuses, what it sets itself, and which properties are secrets.
//!
//! No message shows the value of a secret property ([`is_secret`], the one policy).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};

use super::{ConfigError, Secret};

mod check;

use check::check;
pub(crate) use check::max_message_bytes;

/// `[sink.kafka]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawKafka {
    /// `bootstrap.servers`. Required when `sink.kind = "kafka"`.
    pub(crate) brokers: String,
    /// Passed through to librdkafka.
    #[serde(default)]
    pub(crate) properties: BTreeMap<String, PropertyValue>,
    /// librdkafka properties whose values are read from files (e.g. `sasl.password`).
    #[serde(default)]
    pub(crate) property_files: BTreeMap<String, std::path::PathBuf>,
}

/// A librdkafka property: written as a string, number or boolean, passed on as a string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PropertyValue(pub(crate) String);

impl<'de> Deserialize<'de> for PropertyValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Scalar;
        impl Visitor<'_> for Scalar {
            type Value = PropertyValue;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("text in double quotes, a number or true/false")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PropertyValue, E> {
                Ok(PropertyValue(v.to_owned()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PropertyValue, E> {
                Ok(PropertyValue(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PropertyValue, E> {
                Ok(PropertyValue(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<PropertyValue, E> {
                Ok(PropertyValue(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<PropertyValue, E> {
                Ok(PropertyValue(v.to_string()))
            }
        }
        d.deserialize_any(Scalar)
    }
}

/// `[sink.kafka]`, checked.
#[derive(Clone)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub(crate) brokers: String,
    /// `[sink.kafka.properties]`, passed to librdkafka after [`PRODUCER_DEFAULTS`].
    pub(crate) properties: BTreeMap<String, String>,
    /// `[sink.kafka.property_files]`: properties whose values came from files.
    pub(crate) secret_properties: BTreeMap<String, Secret>,
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
pub(crate) struct Refusal {
    /// The property as written, e.g. `acks`.
    pub(crate) property: String,
    /// Which promise it breaks and what to write instead. Never holds a secret.
    pub(crate) reason: String,
}

/// The key of a property set in the file.
const PROPERTIES: &str = "sink.kafka.properties";
/// The key of a property read from a file.
const PROPERTY_FILES: &str = "sink.kafka.property_files";

impl Refusal {
    /// The refusal as a config error on `sink.kafka.properties.<property>`.
    pub(crate) fn to_error(&self) -> ConfigError {
        ConfigError::new(format!("{PROPERTIES}.{}", self.property), &self.reason)
    }

    /// `acks: is "1", but ...`: the refusal without the section, for `check`'s report.
    pub(crate) fn short(&self) -> String {
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
pub(crate) fn refused_properties(properties: &BTreeMap<String, String>) -> Vec<Refusal> {
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
pub(crate) const SECRET_PROPERTIES: &[&str] = &[
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
pub(crate) fn is_secret(name: &str) -> bool {
    let name = name.trim().to_ascii_lowercase();
    SECRET_PROPERTIES.contains(&name.as_str()) || SECRET_WORDS.iter().any(|w| name.contains(w))
}

/// Properties the relay sets on the producer unless the operator sets them: the first two
/// are what the delivery promise needs ([`refused_properties`] refuses other values), the
/// partitioner puts a key where a Java producer would, and the last three let the relay see
/// which partitions can take records now: statistics twice a second, and a connection to
/// every broker, tried again at least every second while it is down (librdkafka's own
/// backoff grows to 10 s), so a broker that went down is seen coming back within about a
/// second and its partitions' held keys follow (see `sink::kafka::health`).
pub(crate) const PRODUCER_DEFAULTS: &[(&str, &str)] = &[
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("partitioner", "murmur2_random"),
    ("client.id", "outbox-relay"),
    ("statistics.interval.ms", "500"),
    ("enable.sparse.connections", "false"),
    ("reconnect.backoff.max.ms", "1000"),
];

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

#[cfg(test)]
mod tests {
    use super::*;

    /// A property map from pairs (shared with `check`'s tests).
    pub(super) fn props(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
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
}
