//! Everything wrong with `[sink.kafka]` that can be known without a broker: the delivery
//! policy ([`super::refused_properties`]), then what librdkafka itself would refuse, either
//! at once (its configuration parser, offered one property at a time) or only when the
//! producer is built (`linger.ms` against the record timeout, the `ssl.*.location` files).

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaConfRes;

use super::{is_secret, refused_properties, Refusal, PROPERTIES, PROPERTY_FILES};
use crate::config::{pem, ConfigError, Secret};

/// Everything wrong with `[sink.kafka]` that can be known without a broker, one problem
/// per key.
pub(in crate::config) fn check(
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
pub(crate) fn max_message_bytes(
    properties: &BTreeMap<String, String>,
) -> Result<usize, ConfigError> {
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
pub(crate) const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;

#[cfg(test)]
mod tests {
    use super::super::tests::props;
    use super::*;

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
