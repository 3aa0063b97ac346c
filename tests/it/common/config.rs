//! The relay config a test runs with, typed: `relay().workers(4).batch_size(100)` instead
//! of TOML text. [`Env`](super::Env) writes it with `[postgres]` and `[sink.nats]` aimed at
//! its servers; [`kafka_outbox`](super::kafka_outbox) puts its `[relay]` section into a
//! Kafka config. Tests whose point is the TOML itself (config errors, the docs) keep text.

use std::fmt::Display;

/// `[relay]` keys, the HTTP endpoint, the timeouts and any raw sections of a test's config;
/// what is not set keeps the tests' defaults (`poll_interval = "50ms"`,
/// `publish_timeout = "5s"`, `drain_timeout = "10s"`).
#[derive(Clone, Debug, Default)]
pub struct Relay {
    /// `key = value` lines of `[relay]`, in the order given.
    lines: Vec<String>,
    /// `[http] listen`.
    http: Option<String>,
    /// `[sink] publish_timeout`, `"5s"` unless set.
    publish_timeout: Option<String>,
    /// `[shutdown] drain_timeout`, `"10s"` unless set.
    drain_timeout: Option<String>,
    /// Raw sections appended to the file (`[tracing]`, `[retention]`).
    sections: Vec<String>,
}

/// A config with the tests' defaults, to set keys on.
pub fn relay() -> Relay {
    Relay::default()
}

impl Relay {
    fn set(mut self, key: &str, value: impl Display) -> Relay {
        self.lines.push(format!("{key} = {value}"));
        self
    }

    fn set_str(self, key: &str, value: &str) -> Relay {
        self.set(key, format!("{value:?}"))
    }

    pub fn workers(self, n: usize) -> Relay {
        self.set("workers", n)
    }

    pub fn batch_size(self, n: usize) -> Relay {
        self.set("batch_size", n)
    }

    pub fn max_attempts(self, n: u32) -> Relay {
        self.set("max_attempts", n)
    }

    /// `"delete"` or `"mark"`.
    pub fn on_publish(self, mode: &str) -> Relay {
        self.set_str("on_publish", mode)
    }

    /// `"key"` or `"none"`.
    pub fn ordering(self, ordering: &str) -> Relay {
        self.set_str("ordering", ordering)
    }

    pub fn poll_interval(self, duration: &str) -> Relay {
        self.set_str("poll_interval", duration)
    }

    pub fn retry_backoff(self, duration: &str) -> Relay {
        self.set_str("retry_backoff", duration)
    }

    pub fn retry_backoff_max(self, duration: &str) -> Relay {
        self.set_str("retry_backoff_max", duration)
    }

    /// Mark mode: how long published rows are kept.
    pub fn retention(self, duration: &str) -> Relay {
        self.set_str("retention", duration)
    }

    /// `[http] listen = addr`: `/metrics`, `/healthz`, `/readyz`.
    pub fn http(mut self, addr: &str) -> Relay {
        self.http = Some(addr.to_owned());
        self
    }

    /// `[sink] publish_timeout`.
    pub fn publish_timeout(mut self, duration: &str) -> Relay {
        self.publish_timeout = Some(duration.to_owned());
        self
    }

    /// `[shutdown] drain_timeout`.
    pub fn drain_timeout(mut self, duration: &str) -> Relay {
        self.drain_timeout = Some(duration.to_owned());
        self
    }

    /// A whole section appended as it is (`[tracing]\notlp_endpoint = "..."`).
    pub fn section(mut self, toml: &str) -> Relay {
        self.sections.push(toml.to_owned());
        self
    }

    /// The body of `[relay]`: `poll_interval = "50ms"` unless set, then the keys set.
    pub fn relay_section(&self) -> String {
        let mut lines = Vec::new();
        if !self.lines.iter().any(|l| l.starts_with("poll_interval")) {
            lines.push("poll_interval = \"50ms\"".to_owned());
        }
        lines.extend(self.lines.iter().cloned());
        lines.join("\n")
    }

    /// The whole file for a relay of `db_url` (its role's URL) and the nats-server at
    /// `nats_url`, stream subjects `{topic}`.
    pub fn to_toml(&self, db_url: &str, nats_url: &str) -> String {
        let mut more = String::new();
        if let Some(addr) = &self.http {
            more.push_str(&format!("[http]\nlisten = \"{addr}\"\n"));
        }
        for section in &self.sections {
            more.push_str(section);
            more.push('\n');
        }
        format!(
            r#"
[postgres]
url = "{db_url}"
pool_size = 16

[relay]
{relay}

[sink]
kind = "nats"
publish_timeout = "{publish_timeout}"

[sink.nats]
url = "{nats_url}"

[[tables]]
name = "public.outbox"
topic = "{{topic}}"

[shutdown]
drain_timeout = "{drain_timeout}"
{more}
"#,
            relay = self.relay_section(),
            publish_timeout = self.publish_timeout.as_deref().unwrap_or("5s"),
            drain_timeout = self.drain_timeout.as_deref().unwrap_or("10s"),
        )
    }
}
