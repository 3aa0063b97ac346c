//! NATS JetStream: every message carries `Nats-Msg-Id: <table>:<id>` (JetStream drops a
//! re-send inside the stream's duplicate window) and counts only once its PubAck arrived.
//!
//! # Whose fault is a failed publish?
//!
//! A row-level refusal must count against the row (retry schedule, then dead-letter) and
//! never look like a broker outage, or one bad row stalls every key. Two refusals are the
//! row's:
//! - *No stream captures the subject.* A JetStream publish nobody answers comes back as
//!   "no responders", which a stream leader election also produces, for every subject. So
//!   the relay asks the server which stream captures the subject (`$JS.API.STREAM.NAMES`
//!   with a subject filter, answers cached for [`CAPTURE_TTL`]): only a positive "none" makes
//!   the row bad; a stream that exists, no answer, or a stream leader elected before the
//!   answer comes (JetStream's meta leader, who answers, may be changing too) keeps the
//!   failure transient.
//! - *Publish permission denied for the subject.* The server drops the message and reports
//!   `Permissions Violation for Publish to "<subject>"` as an asynchronous error, so the
//!   PubAck never comes. The relay records those subjects from the connection's events; a
//!   timed-out publish to a recently denied subject is the row's fault, and the next
//!   publishes to it fail at once for [`DENIED_TTL`], without waiting out a timeout.
//!
//! Authorization refused at connect is fatal. Everything else (timeouts, a lost
//! connection, server errors) is the broker's: transient.
//!
//! # A stream leader change
//!
//! A stream's leader that steps down (a graceful stop, lame-duck mode, a step-down
//! request) or dies drops the publishes it had received but not yet stored: no ack ever
//! comes for them. The relay follows JetStream's advisory that a stream elected a leader
//! (`$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.<stream>`); a publish still waiting for its
//! ack when one arrives is sent again, to the new leader, instead of waiting out
//! `sink.publish_timeout`. A reconnect counts as an election: the advisories sent while
//! the connection was down are lost, and so are the publishes in flight on it. After
//! either, what is still unacknowledged is sent again every [`RESEND_EVERY`] until it is
//! acknowledged or times out, since a publish that reached a leader not yet serving, or a
//! server whose routes had not yet learnt of it, is dropped as silently as the first. A
//! copy the old leader did store comes back as a duplicate (same `Nats-Msg-Id`),
//! acknowledged and not stored twice; a key has at most one message in flight, so sending
//! it again cannot reorder the key.

use std::collections::HashMap;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::header::{HeaderName, IntoHeaderName};
use async_nats::jetstream::context::{ContextBuilder, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::{header, HeaderMap, ServerAddr, Subject};
use futures_util::StreamExt;
use tokio::sync::watch;

use super::{scrub, within, Message, SinkError, SinkService};

mod errors;

use crate::config::{headers, NatsAuth, NatsConfig};
use crate::error::ErrorClass;
pub(crate) use errors::{check_subject, classify_publish};
use errors::{denied_error, denied_subject};

/// The header JetStream de-duplicates on.
pub(crate) use crate::config::headers::NATS_MSG_ID_HEADER as MSG_ID_HEADER;

/// How long the answer to "which stream captures this subject?" is trusted.
pub(crate) const CAPTURE_TTL: Duration = Duration::from_secs(2);
/// How long a subject the server refused to let us publish to fails without a try.
pub(crate) const DENIED_TTL: Duration = Duration::from_secs(30);
/// How long a request to the server (a stream lookup, JetStream's info, a flush) may wait
/// for its answer: a healthy server answers in milliseconds, and the relay's probe asks
/// again every 2 s anyway.
const REPLY_LIMIT: Duration = Duration::from_secs(2);
/// JetStream's advisories that a replicated stream elected a leader, one subject a stream.
const LEADER_ELECTED: &str = "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.>";
/// After a stream leader election or a reconnect, how often a batch sends again what is
/// still unacknowledged (module doc, *A stream leader change*).
const RESEND_EVERY: Duration = Duration::from_secs(1);

/// A sent publish's acknowledgement to come.
type Ack = Pin<Box<dyn Future<Output = Result<PublishAck, PublishError>> + Send>>;

/// Why [`NatsSink::stream_captures`] got no answer to "which stream captures this
/// subject?". The cause of the transient [`SinkError`] of a publish nobody answered, when
/// the lookup it prompted failed too; its `Display` is not scrubbed (see [`SinkError`]).
#[derive(Debug, thiserror::Error)]
enum LookupError {
    /// The request failed (no responders, a lost connection, an error reply).
    #[error("{0}")]
    Failed(#[source] async_nats::jetstream::context::GetStreamByNameError),
    /// No answer within [`REPLY_LIMIT`].
    #[error("no answer within {REPLY_LIMIT:?}")]
    NoAnswer,
}

/// A NATS connection and its JetStream context.
pub struct NatsSink {
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    /// Strings that must never reach a log line: passwords and tokens from the URLs.
    secrets: Vec<String>,
    /// Subjects looked up after "no responders": whether some stream captures each.
    captured: Mutex<HashMap<String, (Instant, bool)>>,
    /// Subjects the server refused a publish to, and when (from the connection's events).
    denied: Arc<Mutex<HashMap<String, Instant>>>,
    /// False from the moment the connection is lost until it is back.
    connected: tokio::sync::watch::Receiver<bool>,
    /// The stream that acknowledged the latest batch: what [`SinkService::healthcheck`]
    /// asks about once there is one.
    last_stream: Mutex<Option<String>>,
    /// Counts the stream leader elections announced since connect ([`follow_elections`]),
    /// and the reconnects ([`on_event`]).
    elections: watch::Receiver<u64>,
}

impl NatsSink {
    /// Connects to the servers; fails (transient) if none answers within `timeout`.
    pub(crate) async fn connect(
        config: &NatsConfig,
        timeout: Duration,
    ) -> Result<NatsSink, SinkError> {
        let (addrs, mut secrets) = parse_servers(config)?;
        let options = connect_options(config, &addrs, &mut secrets).await?;
        let denied: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let (connected_tx, connected) = tokio::sync::watch::channel(true);
        let (elections_tx, elections) = watch::channel(0);
        let elections_tx = Arc::new(elections_tx);
        let client = options
            .name("outbox-relay")
            .connection_timeout(timeout)
            .max_reconnects(None)
            .event_callback(on_event(denied.clone(), connected_tx, elections_tx.clone()))
            .connect(addrs)
            .await
            .map_err(|e| connect_error(config, e, &secrets))?;
        let js = ContextBuilder::new().timeout(timeout).build(client.clone());
        follow_elections(&client, elections_tx).await;
        Ok(NatsSink {
            client,
            js,
            secrets,
            captured: Mutex::default(),
            denied,
            connected,
            last_stream: Mutex::new(None),
            elections,
        })
    }

    /// Sends `message` to JetStream; the ack is awaited separately.
    async fn send(&self, names: &mut Names, message: &Message) -> Result<Ack, PublishError> {
        let mut headers = HeaderMap::new();
        for (name, value) in &message.headers {
            headers.insert(names.header(name), value.as_str());
        }
        headers.insert(header::NATS_MESSAGE_ID, message.id.as_str());
        let publish = PublishMessage::build()
            .payload(message.payload.clone().unwrap_or_default())
            .headers(headers);
        let ack = self
            .js
            .send_publish(names.subject(&message.topic), publish)
            .await?;
        Ok(ack.into_future())
    }

    /// Sends again each of `messages` still waiting for its ack (`acks`); a send that fails
    /// ends the message with its error in `results`. Returns how many were sent.
    async fn send_again(
        &self,
        messages: &[&Message],
        acks: &mut [Option<Ack>],
        results: &mut [Result<(), SinkError>],
        names: &mut Names,
        elections: &watch::Receiver<u64>,
    ) -> usize {
        let mut again = 0;
        for ((message, ack), result) in messages.iter().zip(acks).zip(results) {
            if ack.is_none() {
                continue;
            }
            *ack = match self.send(names, message).await {
                Ok(ack) => Some(ack),
                Err(e) => {
                    *result = Err(self.classify(&message.topic, e, elections).await);
                    None
                }
            };
            again += 1;
        }
        again
    }

    /// Whether the server refused a publish to `subject` within [`DENIED_TTL`].
    fn recently_denied(&self, subject: &str) -> bool {
        let mut denied = self.denied.lock().unwrap();
        denied.retain(|_, at| at.elapsed() < DENIED_TTL);
        denied.contains_key(subject)
    }

    /// Whether some stream captures `subject`: `Ok(false)` only when the server said so.
    async fn stream_captures(&self, subject: &str) -> Result<bool, LookupError> {
        if let Some((at, captured)) = self.captured.lock().unwrap().get(subject) {
            if at.elapsed() < CAPTURE_TTL {
                return Ok(*captured);
            }
        }
        use async_nats::jetstream::context::GetStreamByNameErrorKind as Kind;
        let lookup = self.js.stream_by_subject(subject);
        let captured = match tokio::time::timeout(REPLY_LIMIT, lookup).await {
            Ok(Ok(_)) => true,
            Ok(Err(e)) if e.kind() == Kind::NotFound => false,
            Ok(Err(e)) => return Err(LookupError::Failed(e)),
            Err(_) => return Err(LookupError::NoAnswer),
        };
        self.captured
            .lock()
            .unwrap()
            .insert(subject.to_owned(), (Instant::now(), captured));
        Ok(captured)
    }

    /// What the server said about itself when we connected.
    pub(crate) fn server_info(&self) -> async_nats::ServerInfo {
        self.client.server_info()
    }

    /// Flushes what the client still buffers.
    async fn flush(&self) -> Result<(), SinkError> {
        match tokio::time::timeout(REPLY_LIMIT, self.client.flush()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SinkError::transient(format!(
                "NATS flush failed: {}",
                scrub(&e.to_string(), &self.secrets)
            ))
            .caused_by(e)),
            Err(_) => Err(SinkError::transient(format!(
                "NATS did not answer within {REPLY_LIMIT:?}"
            ))),
        }
    }

    /// The JetStream context, for `check`.
    pub(crate) fn jetstream(&self) -> &async_nats::jetstream::Context {
        &self.js
    }

    /// The error of a publish or an ack that failed, carrying `e` (or, when the stream
    /// lookup it prompted failed, the lookup's error); `elections` counts the stream leader
    /// elections seen since the publish was sent.
    async fn classify(
        &self,
        subject: &str,
        e: async_nats::jetstream::context::PublishError,
        elections: &watch::Receiver<u64>,
    ) -> SinkError {
        let text = scrub(&e.to_string(), &self.secrets);
        let code = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
            .map(|js| js.error_code().0);
        let error = match classify_publish(e.kind(), code) {
            ErrorClass::BadRow => SinkError::bad_row(text),
            ErrorClass::Fatal => SinkError::fatal(text),
            ErrorClass::Transient if e.kind() == PublishErrorKind::StreamNotFound => {
                // "No responders": no stream, or a stream between leaders. A leader elected
                // since says which; else ask (whoever answers that may be changing too).
                let mut elected = elections.clone();
                let captured = tokio::select! {
                    biased;
                    Ok(()) = elected.changed() => {
                        return SinkError::transient(format!(
                            "no responders for {subject:?} while a JetStream stream elected a \
                             leader"
                        ))
                        .caused_by(e)
                    }
                    captured = self.stream_captures(subject) => captured,
                };
                match captured {
                    Ok(false) => SinkError::bad_row(format!(
                        "no JetStream stream captures subject {subject:?}: add the subject to \
                         a stream, or fix the table's topic template \
                         (`outbox-relay check` lists what is missing)"
                    )),
                    Ok(true) => SinkError::transient(format!(
                        "the stream capturing {subject:?} did not answer (no responders: a \
                         leader election?)"
                    )),
                    // The lookup's failure is what the message explains: it is the cause.
                    Err(lookup) => {
                        let said = match &lookup {
                            LookupError::Failed(l) => scrub(&l.to_string(), &self.secrets),
                            LookupError::NoAnswer => lookup.to_string(),
                        };
                        return SinkError::transient(format!(
                            "no responders for {subject:?}, and JetStream could not say which \
                             stream captures it: {said}"
                        ))
                        .caused_by(lookup);
                    }
                }
            }
            ErrorClass::Transient
                if e.kind() == PublishErrorKind::TimedOut && self.recently_denied(subject) =>
            {
                denied_error(subject)
            }
            ErrorClass::Transient => SinkError::transient(text),
        };
        error.caused_by(e)
    }
}

/// Sleeps until `at`; never ends without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What one batch makes once and shares between its messages.
///
/// - Subjects, from the messages' topics (a batch mostly has few): a subject holds the
///   topic's string itself, so making and cloning one copies nothing.
/// - Header names: a table's header columns and CloudEvents attributes name every
///   message's headers alike, so each name is checked and copied once a batch, not once
///   a message (at most [`Names::HEADERS`] kept; rarer names are made each time).
#[derive(Default)]
struct Names {
    subjects: Vec<(Arc<str>, Subject)>,
    headers: Vec<(Arc<str>, HeaderName)>,
}

impl Names {
    const HEADERS: usize = 32;

    fn subject(&mut self, topic: &Arc<str>) -> Subject {
        let known = self
            .subjects
            .iter()
            .find(|(t, _)| Arc::ptr_eq(t, topic) || t == topic);
        if let Some((_, subject)) = known {
            return subject.clone();
        }
        let bytes = bytes::Bytes::from_owner(Topic(topic.clone()));
        let subject = Subject::from_utf8(bytes).expect("a topic is a str");
        self.subjects.push((topic.clone(), subject.clone()));
        subject
    }

    /// `name` as a NATS header name; [`SinkService::check`] has refused a message with a
    /// name NATS does not allow. The messages of a batch mostly carry the very same
    /// strings as names, so those are looked for first, by address.
    fn header(&mut self, name: &Arc<str>) -> HeaderName {
        let known = (self.headers.iter().find(|(n, _)| Arc::ptr_eq(n, name)))
            .or_else(|| self.headers.iter().find(|(n, _)| n == name));
        if let Some((_, header)) = known {
            return header.clone();
        }
        let header = match STATIC_NAMES.iter().find(|s| **s == &**name) {
            Some(s) => HeaderName::from_static(s),
            None => (&**name).into_header_name(),
        };
        if self.headers.len() < Names::HEADERS {
            self.headers.push((name.clone(), header.clone()));
        }
        header
    }
}

/// Header names every message of a table with CloudEvents in binary mode carries: made
/// from static strings, a clone of one costs nothing.
const STATIC_NAMES: [&str; 9] = [
    "ce-specversion",
    "ce-id",
    "ce-source",
    "ce-type",
    "ce-time",
    "ce-subject",
    "ce-traceparent",
    "content-type",
    "traceparent",
];

/// A topic's shared string as the bytes a [`Subject`] is made of.
struct Topic(Arc<str>);

impl AsRef<[u8]> for Topic {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl SinkService for NatsSink {
    const NAME: &'static str = "nats";

    /// JetStream gives no order promise across a reconnect, so the relay sends a key's
    /// next message only after the previous one's ack.
    fn keeps_order_in_flight(&self) -> bool {
        false
    }

    fn check(&self, message: &Message) -> Result<(), SinkError> {
        check_subject(&message.topic).map_err(SinkError::bad_row)?;
        let mut header_bytes = "NATS/1.0\r\n\r\n".len();
        for (name, value) in message
            .headers
            .iter()
            .map(|(n, v)| (&**n, v.as_str()))
            .chain([(MSG_ID_HEADER, message.id.as_str())])
        {
            if !headers::is_valid_name(name) {
                return Err(SinkError::bad_row(format!(
                    "header name {name:?} is not allowed in NATS (printable ASCII, no ':')"
                )));
            }
            if value.bytes().any(|b| b == b'\r' || b == b'\n') {
                return Err(SinkError::bad_row(format!(
                    "value of header {name:?} contains a line break"
                )));
            }
            header_bytes += name.len() + value.len() + 4;
        }
        let max = self.client.max_payload();
        let size = header_bytes + message.payload.as_ref().map_or(0, |p| p.len());
        if max > 0 && size > max {
            return Err(SinkError::bad_row(format!(
                "message is {size} bytes with headers; the NATS server accepts at most {max} \
                 (max_payload)"
            )));
        }
        Ok(())
    }

    /// Sends the whole batch, then collects the acks: one round trip, not one per row. A
    /// stream leader elected meanwhile gets what is still unacknowledged again (see the
    /// module doc, *A stream leader change*).
    async fn publish_batch(&self, messages: &[&Message]) -> Vec<Result<(), SinkError>> {
        let mut results: Vec<Result<(), SinkError>> = Vec::with_capacity(messages.len());
        let mut acks: Vec<Option<Ack>> = Vec::with_capacity(messages.len());
        let mut names = Names::default();
        let mut elections = self.elections.clone();
        elections.borrow_and_update();
        for message in messages {
            if self.recently_denied(&message.topic) {
                acks.push(None);
                results.push(Err(denied_error(&message.topic)));
                continue;
            }
            match self.send(&mut names, message).await {
                Ok(ack) => {
                    acks.push(Some(ack));
                    results.push(Ok(()));
                }
                Err(e) => {
                    acks.push(None);
                    results.push(Err(self.classify(&message.topic, e, &elections).await));
                }
            }
        }
        let mut acked_by = None;
        let mut resend_at = None;
        let mut i = 0;
        while i < acks.len() {
            let Some(ack) = acks[i].as_mut() else {
                i += 1;
                continue;
            };
            tokio::select! {
                biased;
                outcome = ack => {
                    acks[i] = None;
                    match outcome {
                        Ok(ack) => acked_by = Some(ack.stream),
                        Err(e) => {
                            let topic = &messages[i].topic;
                            results[i] = Err(self.classify(topic, e, &elections).await);
                        }
                    }
                    i += 1;
                }
                // (Never again once the advisories' follower has stopped.)
                Ok(()) = elections.changed() => {
                    let again = self
                        .send_again(&messages[i..], &mut acks[i..], &mut results[i..], &mut names, &elections)
                        .await;
                    tracing::debug!(
                        again,
                        "A JetStream stream elected a leader, or the connection came back: \
                         unacknowledged messages sent again"
                    );
                    resend_at = Some(tokio::time::Instant::now() + RESEND_EVERY);
                }
                () = sleep_until_some(resend_at) => {
                    let again = self
                        .send_again(&messages[i..], &mut acks[i..], &mut results[i..], &mut names, &elections)
                        .await;
                    tracing::debug!(again, "Unacknowledged messages sent again since an election");
                    resend_at = Some(tokio::time::Instant::now() + RESEND_EVERY);
                }
            }
        }
        if let Some(stream) = acked_by {
            let mut last = self.last_stream.lock().unwrap();
            if last.as_deref() != Some(stream.as_str()) {
                *last = Some(stream);
            }
        }
        results
    }

    /// Connected, and JetStream can take a publish: a full round trip through the server,
    /// not just a socket write.
    ///
    /// Once a stream has acknowledged a batch, its leader is asked for the stream's info
    /// (`$JS.API.STREAM.INFO.<stream>`): in a cluster only the stream's leader answers, so an
    /// answer means publishes can be stored again. Before that, `$JS.API.INFO` (in a
    /// cluster, the JetStream meta leader answers: it is elected separately, and can be
    /// down while the stream's leader serves, which kept the circuit open for seconds
    /// after a server holding both died). A stream leader elected while the probe waits for
    /// its answer gets the question again.
    async fn healthcheck(&self) -> Result<(), SinkError> {
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return Err(SinkError::transient("not connected to NATS"));
        }
        let stream = self.last_stream.lock().unwrap().clone();
        let subject = match &stream {
            Some(stream) => format!("$JS.API.STREAM.INFO.{stream}"),
            None => "$JS.API.INFO".to_owned(),
        };
        let asked = match &stream {
            Some(stream) => format!("stream {stream}"),
            None => "JetStream".to_owned(),
        };
        // Asked between two leaders, the question gets no answer: asked again as soon as a
        // stream elects one, which answers at once.
        let mut elections = self.elections.clone();
        elections.borrow_and_update();
        let ask = || Box::pin(self.client.request(subject.clone(), bytes::Bytes::new()));
        let mut request = ask();
        let mut deadline = tokio::time::Instant::now() + REPLY_LIMIT;
        let reply = loop {
            tokio::select! {
                biased;
                reply = &mut request => match reply {
                    Ok(reply) => break reply,
                    Err(e) => {
                        return Err(SinkError::transient(format!(
                            "{asked} did not answer: {}",
                            scrub(&e.to_string(), &self.secrets)
                        ))
                        .caused_by(e))
                    }
                },
                Ok(()) = elections.changed() => {
                    request = ask();
                    deadline = tokio::time::Instant::now() + REPLY_LIMIT;
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(SinkError::transient(format!(
                        "{asked} did not answer within {REPLY_LIMIT:?}"
                    )))
                }
            }
        };
        // An error reply (the stream gone, no leader known) is not a serving stream.
        match serde_json::from_slice::<serde_json::Value>(&reply.payload) {
            Ok(v) if v.get("error").is_some() => Err(SinkError::transient(format!(
                "{asked} answered with an error: {}",
                v["error"]["description"].as_str().unwrap_or("unknown")
            ))),
            _ => Ok(()),
        }
    }

    /// Follows the connection: `false` from the moment it is lost until it is back.
    fn connection(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        Some(self.connected.clone())
    }

    async fn close(&self, timeout: Duration) -> Result<(), SinkError> {
        within(timeout, self.flush()).await
    }
}

/// The client's options for `config`: credentials from the URLs, the nkey or `.creds`
/// file, TLS. Secrets met on the way are added to `secrets`.
async fn connect_options(
    config: &NatsConfig,
    addrs: &[ServerAddr],
    secrets: &mut Vec<String>,
) -> Result<async_nats::ConnectOptions, SinkError> {
    let mut options = async_nats::ConnectOptions::new();
    // async-nats ignores credentials in a server URL: pass them on ourselves.
    // `nats://user:password@host` is a user, `nats://TOKEN@host` a token.
    if let Some(addr) = addrs.iter().find(|a| a.has_user_pass()) {
        match (addr.username(), addr.password()) {
            (Some(user), Some(password)) => {
                options = options.user_and_password(user.to_owned(), password.to_owned());
            }
            (Some(token), None) => options = options.token(token.to_owned()),
            _ => {}
        }
    }
    match &config.auth {
        NatsAuth::None => {}
        NatsAuth::CredentialsFile(path) => {
            options = options.credentials_file(path).await.map_err(|e| {
                SinkError::fatal(format!(
                    "sink.nats.credentials_file: {} is not a usable .creds file: {e}",
                    path.display()
                ))
                .caused_by(e)
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
    Ok(options)
}

/// Counts JetStream's stream leader elections into `count`, from their advisories
/// ([`LEADER_ELECTED`]), until every receiver is gone. A user who may not subscribe to them
/// gets none (the server refuses asynchronously): only reconnects count then, and a
/// publish the old leader dropped waits out its timeout.
async fn follow_elections(client: &async_nats::Client, count: Arc<watch::Sender<u64>>) {
    match client.subscribe(LEADER_ELECTED).await {
        Ok(mut advisories) => {
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = count.closed() => break,
                        advisory = advisories.next() => match advisory {
                            Some(advisory) => {
                                let subject = &advisory.subject;
                                tracing::debug!(%subject, "A JetStream stream elected a leader");
                                count.send_modify(|n| *n += 1);
                            }
                            None => break,
                        },
                    }
                }
            });
        }
        Err(e) => tracing::debug!(error = %e, "Not following JetStream's leader elections"),
    }
}

/// Follows the connection's events: up or down into `connected`, a reconnect into
/// `elections`, subjects the server refused a publish to into `denied`.
fn on_event(
    denied: Arc<Mutex<HashMap<String, Instant>>>,
    connected: tokio::sync::watch::Sender<bool>,
    elections: Arc<watch::Sender<u64>>,
) -> impl Fn(async_nats::Event) -> std::future::Ready<()> {
    move |event: async_nats::Event| {
        match &event {
            async_nats::Event::Connected => {
                let was_connected = connected.send_replace(true);
                if !was_connected {
                    elections.send_modify(|n| *n += 1);
                }
            }
            async_nats::Event::Disconnected | async_nats::Event::Closed => {
                connected.send_replace(false);
            }
            async_nats::Event::ServerError(async_nats::ServerError::Other(text)) => {
                if let Some(subject) = denied_subject(text) {
                    denied.lock().unwrap().insert(subject, Instant::now());
                }
            }
            _ => {}
        }
        tracing::debug!(%event, "NATS connection event");
        std::future::ready(())
    }
}

/// A failed connect: refused credentials are fatal, anything else transient.
fn connect_error(
    config: &NatsConfig,
    e: async_nats::ConnectError,
    secrets: &[String],
) -> SinkError {
    let message = format!(
        "cannot connect to NATS at {}: {}",
        config.redacted(),
        scrub(&e.to_string(), secrets)
    );
    let error = match e.kind() {
        async_nats::ConnectErrorKind::AuthorizationViolation
        | async_nats::ConnectErrorKind::Authentication => SinkError::fatal(format!(
            "{message}: the server refused these credentials; fix the user, password, token, \
             nkey or .creds in [sink.nats]"
        )),
        _ => SinkError::transient(message),
    };
    error.caused_by(e)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batchs_subjects_are_its_topics_strings_made_once() {
        let mut names = Names::default();
        let (a, b) = (Arc::<str>::from("events.a"), Arc::<str>::from("events.b"));
        let first = names.subject(&a);
        assert_eq!(first.as_str(), "events.a");
        // The subject is the topic's own string, not a copy of it.
        assert_eq!(first.as_str().as_ptr(), a.as_ptr());
        assert_eq!(names.subject(&b).as_str(), "events.b");
        // An equal topic from another string finds the subject made first.
        let again = names.subject(&Arc::from("events.a"));
        assert_eq!(again.as_str().as_ptr(), a.as_ptr());
        assert_eq!(names.subjects.len(), 2);
    }

    #[test]
    fn a_reconnect_counts_as_an_election_and_the_first_connect_does_not() {
        let (connected_tx, connected) = watch::channel(true);
        let (elections_tx, elections) = watch::channel(0);
        let on = on_event(Arc::default(), connected_tx, Arc::new(elections_tx));
        let () = on(async_nats::Event::Connected).into_inner();
        assert_eq!(*elections.borrow(), 0, "connected from the start");
        let () = on(async_nats::Event::Disconnected).into_inner();
        assert!(!*connected.borrow());
        assert_eq!(*elections.borrow(), 0);
        let () = on(async_nats::Event::Connected).into_inner();
        assert!(*connected.borrow());
        assert_eq!(
            *elections.borrow(),
            1,
            "what was in flight on the old connection is lost"
        );
    }

    #[test]
    fn the_cloudevents_header_names_on_nats_are_made_from_static_strings() {
        let text = "[postgres]\nurl = \"postgres://db/app\"\n[sink]\nkind = \"nats\"\n\
                    [sink.nats]\nurl = \"nats://n:4222\"\n[[tables]]\nname = \"public.outbox\"\n\
                    envelope = \"cloudevents\"\n[tables.cloudevents]\ntype = \"t\"\nsource = \"s\"\n";
        let config = crate::config::from_str(text, |_| None, Vec::new()).unwrap();
        let ce = config.tables[0].cloudevents.as_ref().unwrap();
        let n = &ce.header_names;
        for name in [
            &n.specversion,
            &n.id,
            &n.source,
            &n.type_,
            &n.time,
            &n.subject,
            &n.traceparent,
            &n.content_type,
        ] {
            assert!(STATIC_NAMES.contains(&&**name), "{name} is not static");
        }
    }

    #[test]
    fn a_batchs_header_names_are_made_once_and_a_crowd_of_names_is_not_kept() {
        let mut names = Names::default();
        let a = Arc::<str>::from("ce-type");
        assert_eq!(names.header(&a), names.header(&Arc::from("ce-type")));
        assert_eq!(names.headers.len(), 1);
        for i in 0..2 * Names::HEADERS {
            let name = Arc::<str>::from(format!("x-{i}"));
            assert_eq!(names.header(&name).to_string(), *name);
        }
        assert_eq!(names.headers.len(), Names::HEADERS);
    }

    #[test]
    fn refused_credentials_carry_the_connect_error_and_only_the_message_is_scrubbed() {
        let config = NatsConfig {
            urls: vec!["nats://relay:hunter2@127.0.0.1:4222".to_owned()],
            auth: NatsAuth::None,
            tls_ca: None,
            tls_client: None,
        };
        let refused = async_nats::ConnectError::with_source(
            async_nats::ConnectErrorKind::AuthorizationViolation,
            "hunter2 is not the password",
        );
        let e = connect_error(&config, refused, &["hunter2".to_owned()]);
        assert_eq!(e.class, ErrorClass::Fatal);
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let cause = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<async_nats::ConnectError>())
            .map(|c| c.kind());
        assert_eq!(
            cause,
            Some(async_nats::ConnectErrorKind::AuthorizationViolation)
        );
    }

    #[test]
    fn secrets_are_scrubbed() {
        assert_eq!(
            scrub("auth failed for s3cret", &["s3cret".to_owned()]),
            "auth failed for <redacted>"
        );
    }
}
