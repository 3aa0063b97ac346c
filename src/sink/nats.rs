//! NATS JetStream: every message carries `Nats-Msg-Id: <table>:<id>` (JetStream drops a
//! re-send inside the stream's duplicate window) and counts only once its PubAck arrived.

use std::time::Duration;

use async_nats::jetstream::context::{ContextBuilder, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::{HeaderMap, ServerAddr};

use super::{scrub, Message, SinkError};
use crate::config::{NatsAuth, NatsConfig};
use crate::error::ErrorClass;

/// The header JetStream de-duplicates on.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// JetStream API error: message larger than the stream's `max_msg_size`.
const JS_MESSAGE_SIZE_EXCEEDS: u64 = 10054;

pub struct NatsSink {
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    /// Strings that must never reach a log line: passwords and tokens from the URLs.
    secrets: Vec<String>,
}

impl NatsSink {
    /// Connects to the servers; fails (transient) if none answers within `timeout`.
    pub async fn connect(config: &NatsConfig, timeout: Duration) -> Result<NatsSink, SinkError> {
        let (addrs, mut secrets) = parse_servers(config)?;
        let mut options = async_nats::ConnectOptions::new();
        match &config.auth {
            NatsAuth::None => {}
            NatsAuth::CredentialsFile(path) => {
                options = options.credentials_file(path).await.map_err(|e| {
                    SinkError::fatal(format!(
                        "sink.nats.credentials_file: {} is not a usable .creds file: {e}",
                        path.display()
                    ))
                })?;
            }
            NatsAuth::NKey(seed) => {
                secrets.push(seed.expose().to_owned());
                options = options.nkey(seed.expose().to_owned());
            }
        }
        if let Some(ca) = &config.tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((cert, key)) = &config.tls_client {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if config.urls.iter().any(|u| u.starts_with("tls://")) {
            options = options.require_tls(true);
        }
        let scrub = |e: &dyn std::fmt::Display| scrub(&e.to_string(), &secrets);
        let client = options
            .name("outbox-relay")
            .connection_timeout(timeout)
            .max_reconnects(None)
            .connect(addrs)
            .await
            .map_err(|e| {
                SinkError::transient(format!(
                    "cannot connect to NATS at {}: {}",
                    config.redacted(),
                    scrub(&e)
                ))
            })?;
        let js = ContextBuilder::new().timeout(timeout).build(client.clone());
        Ok(NatsSink {
            client,
            js,
            secrets,
        })
    }

    /// The JetStream context, for `check`.
    pub fn jetstream(&self) -> &async_nats::jetstream::Context {
        &self.js
    }

    /// What the server said about itself when we connected.
    pub fn server_info(&self) -> async_nats::ServerInfo {
        self.client.server_info()
    }

    pub fn check(&self, message: &Message) -> Result<(), SinkError> {
        check_subject(&message.topic).map_err(SinkError::bad_row)?;
        let mut header_bytes = "NATS/1.0\r\n\r\n".len();
        for (name, value) in message
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .chain([(MSG_ID_HEADER, message.id.as_str())])
        {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
                return Err(SinkError::bad_row(format!(
                    "header name {name:?} is not allowed in NATS (printable ASCII, no ':')"
                )));
            }
            if value.contains(['\r', '\n']) {
                return Err(SinkError::bad_row(format!(
                    "value of header {name:?} contains a line break"
                )));
            }
            header_bytes += name.len() + value.len() + 4;
        }
        let max = self.client.max_payload();
        let size = header_bytes + message.payload.len();
        if max > 0 && size > max {
            return Err(SinkError::bad_row(format!(
                "message is {size} bytes with headers; the NATS server accepts at most {max} \
                 (max_payload)"
            )));
        }
        Ok(())
    }

    pub async fn publish_batch(&self, messages: &[&Message]) -> Vec<Result<(), SinkError>> {
        let mut results: Vec<Result<(), SinkError>> = Vec::with_capacity(messages.len());
        let mut acks = Vec::with_capacity(messages.len());
        // Queue the whole batch first, then collect the acks: one round trip, not one per row.
        for message in messages {
            let mut headers = HeaderMap::new();
            for (name, value) in &message.headers {
                headers.insert(name.as_str(), value.as_str());
            }
            headers.insert(MSG_ID_HEADER, message.id.as_str());
            let publish = PublishMessage::build()
                .payload(message.payload.clone())
                .headers(headers);
            match self.js.send_publish(message.topic.clone(), publish).await {
                Ok(ack) => acks.push(Some(ack)),
                Err(e) => {
                    acks.push(None);
                    results.push(Err(self.classify(&message.topic, &e)));
                    continue;
                }
            }
            results.push(Ok(()));
        }
        for (i, ack) in acks.into_iter().enumerate() {
            if let Some(ack) = ack {
                if let Err(e) = ack.await {
                    results[i] = Err(self.classify(&messages[i].topic, &e));
                }
            }
        }
        results
    }

    fn classify(
        &self,
        subject: &str,
        e: &async_nats::jetstream::context::PublishError,
    ) -> SinkError {
        let text = scrub(&e.to_string(), &self.secrets);
        let code = std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
            .map(|js| js.error_code().0);
        match classify_publish(e.kind(), code) {
            ErrorClass::BadRow => SinkError::bad_row(text),
            ErrorClass::Fatal => SinkError::fatal(text),
            // A missing stream is an operator's to fix, not the row's fault: never let it
            // dead-letter every row; retry until a stream exists.
            ErrorClass::Transient if e.kind() == PublishErrorKind::StreamNotFound => {
                SinkError::transient(format!(
                    "no JetStream stream captures subject {subject:?}: create one \
                     (`outbox-relay check` lists what is missing)"
                ))
            }
            ErrorClass::Transient => SinkError::transient(text),
        }
    }

    /// Connected, and JetStream answers a request (`$JS.API.INFO`): a full round trip
    /// through the server, not just a socket write. The reply is not parsed: any answer
    /// means JetStream is serving (no responders, or none in time, means it is not).
    pub async fn healthcheck(&self) -> Result<(), SinkError> {
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return Err(SinkError::transient("not connected to NATS"));
        }
        let request = self.client.request("$JS.API.INFO", bytes::Bytes::new());
        match tokio::time::timeout(Duration::from_secs(2), request).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(SinkError::transient(format!(
                "JetStream did not answer: {}",
                scrub(&e.to_string(), &self.secrets)
            ))),
            Err(_) => Err(SinkError::transient("JetStream did not answer within 2s")),
        }
    }

    /// Flushes what the client still buffers.
    pub async fn close(&self) -> Result<(), SinkError> {
        match tokio::time::timeout(Duration::from_secs(2), self.client.flush()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SinkError::transient(format!(
                "NATS flush failed: {}",
                scrub(&e.to_string(), &self.secrets)
            ))),
            Err(_) => Err(SinkError::transient("NATS did not answer within 2s")),
        }
    }
}

/// Parses the configured URLs, collecting any passwords or tokens they carry.
fn parse_servers(config: &NatsConfig) -> Result<(Vec<ServerAddr>, Vec<String>), SinkError> {
    let mut addrs = Vec::new();
    let mut secrets = Vec::new();
    for url in &config.urls {
        let addr: ServerAddr = url.parse().map_err(|_| {
            SinkError::fatal(format!(
                "sink.nats.url: {} is not a NATS URL (write nats://host:4222)",
                crate::config::redact_userinfo(url)
            ))
        })?;
        if let Some(password) = addr.password() {
            secrets.push(password.to_owned());
        }
        if let Some(user) = addr.username() {
            // A bare token is written as the user part: nats://TOKEN@host.
            secrets.push(user.to_owned());
        }
        addrs.push(addr);
    }
    Ok((addrs, secrets))
}

/// The class of a JetStream publish failure: the row's own size is its fault; a missing
/// stream, a timeout, a lost connection or a broker error are the broker's (retried).
pub fn classify_publish(kind: PublishErrorKind, js_code: Option<u64>) -> ErrorClass {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => ErrorClass::BadRow,
        PublishErrorKind::Other if js_code == Some(JS_MESSAGE_SIZE_EXCEEDS) => ErrorClass::BadRow,
        _ => ErrorClass::Transient,
    }
}

/// A subject a message may be published to: dot-separated tokens, none empty, no
/// wildcards, no white space.
pub fn check_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty() {
        return Err("the subject is empty".to_owned());
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("subject {subject:?} contains white space"));
    }
    for token in subject.split('.') {
        match token {
            "" => return Err(format!("subject {subject:?} has an empty token")),
            "*" | ">" => {
                return Err(format!(
                    "subject {subject:?} contains a wildcard; messages need a literal subject"
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_checked_before_sending() {
        assert!(check_subject("orders.created").is_ok());
        for bad in ["", "a..b", ".a", "a.", "a b", "a.*", "a.>", "a\tb"] {
            assert!(check_subject(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn publish_errors_map_to_classes() {
        use ErrorClass::*;
        for (kind, code, class) in [
            (PublishErrorKind::MaxPayloadExceeded, None, BadRow),
            (
                PublishErrorKind::Other,
                Some(JS_MESSAGE_SIZE_EXCEEDS),
                BadRow,
            ),
            (PublishErrorKind::Other, Some(10_077), Transient), // maximum messages exceeded
            (PublishErrorKind::StreamNotFound, None, Transient),
            (PublishErrorKind::TimedOut, None, Transient),
            (PublishErrorKind::BrokenPipe, None, Transient),
            (PublishErrorKind::WrongLastSequence, None, Transient),
        ] {
            assert_eq!(classify_publish(kind, code), class, "{kind:?} {code:?}");
        }
    }

    #[test]
    fn secrets_are_scrubbed() {
        assert_eq!(
            scrub("auth failed for s3cret", &["s3cret".to_owned()]),
            "auth failed for <redacted>"
        );
    }
}
