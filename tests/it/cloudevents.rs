//! `envelope = "cloudevents"` on the wire: what the built binary published to a real
//! nats-server and a real Kafka-protocol broker (tansu), read back with an independent
//! implementation, the CloudEvents Rust SDK (`cloudevents-sdk`): its JSON event format
//! for structured mode, its event builder (attribute names, spec version, time parsing)
//! for binary mode.
//!
//! The SDK's own Kafka binding pins rdkafka 0.38, whose librdkafka cannot link beside
//! ours, and its NATS binding reads structured mode only; so binary mode is read here
//! with the SDK's `BinaryDeserializer` over the headers, written from the bindings'
//! text (Kafka: `ce_` + attribute, NATS: `ce-` + attribute; `content-type` is
//! `datacontenttype`), not from the relay's code.

use std::time::Duration;

use cloudevents::event::{ExtensionValue, SpecVersion};
use cloudevents::message::{
    BinaryDeserializer, BinarySerializer, Error as SdkError, MessageAttributeValue,
};
use cloudevents::{AttributesReader, Data, Event};

use crate::common::*;
use testkit::{KafkaBroker, Postgres};

/// A published message as its consumer gets it.
#[derive(Debug, Clone)]
struct Wire {
    headers: Vec<(String, String)>,
    payload: Option<Vec<u8>>,
}

impl Wire {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Binary mode per the Kafka (`ce_`) or NATS (`ce-`) binding, for the SDK to build from.
struct Binary<'a> {
    prefix: &'a str,
    wire: &'a Wire,
}

impl BinaryDeserializer for Binary<'_> {
    fn deserialize_binary<R: Sized, V: BinarySerializer<R>>(
        self,
        mut visitor: V,
    ) -> Result<R, SdkError> {
        let spec = self
            .wire
            .header(&format!("{}specversion", self.prefix))
            .ok_or(SdkError::WrongEncoding {})?;
        let spec = SpecVersion::try_from(spec)?;
        let names = spec.attribute_names();
        visitor = visitor.set_spec_version(spec)?;
        if let Some(content_type) = self.wire.header("content-type") {
            let value = MessageAttributeValue::String(content_type.to_owned());
            visitor = visitor.set_attribute("datacontenttype", value)?;
        }
        for (name, value) in &self.wire.headers {
            let Some(attribute) = name.strip_prefix(self.prefix) else {
                continue;
            };
            let value = MessageAttributeValue::String(value.clone());
            visitor = match attribute {
                "specversion" => visitor,
                a if names.contains(&a) => visitor.set_attribute(a, value)?,
                a => visitor.set_extension(a, value)?,
            };
        }
        match &self.wire.payload {
            Some(body) if !body.is_empty() => visitor.end_with_data(body.clone()),
            _ => visitor.end(),
        }
    }
}

/// The event in `wire`: structured when its content type says so, binary otherwise.
fn decode(wire: &Wire, prefix: &str) -> Event {
    match wire.header("content-type") {
        Some(ct) if ct.starts_with("application/cloudevents+json") => {
            serde_json::from_slice(wire.payload.as_deref().unwrap_or_default())
                .unwrap_or_else(|e| panic!("the SDK cannot read the structured event: {e}"))
        }
        _ => Binary { prefix, wire }
            .into_event()
            .unwrap_or_else(|e| panic!("the SDK cannot read the binary event: {e}: {wire:?}")),
    }
}

/// A row as inserted, to compare its event with.
#[derive(Debug, Clone)]
struct Row {
    id: i64,
    topic: String,
    key: Option<String>,
    payload: Option<Vec<u8>>,
    traceparent: Option<String>,
    created_ms: i64,
}

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Inserts the payload kinds: a JSON object (with a traceparent), bytes that are not
/// JSON, an empty payload; `topic` for all, keys of their own (`<topic>.k<n>`: a dead row
/// holds its key back).
async fn insert_kinds(client: &tokio_postgres::Client, topic: &str) -> Vec<Row> {
    let kinds: [(&[u8], Option<&str>); 3] = [
        (br#"{"order":42,"items":["a","b"]}"#, Some(TRACEPARENT)),
        (b"\xff\x00binary \x01", None),
        (b"", None),
    ];
    let mut rows = Vec::new();
    for (n, (payload, traceparent)) in kinds.into_iter().enumerate() {
        let headers = traceparent.map(|t| serde_json::json!({ "traceparent": t }));
        let row = client
            .query_one(
                "INSERT INTO public.outbox (topic, key, payload, headers) \
                 VALUES ($1, $2, $3, $4::text::jsonb) \
                 RETURNING id, floor(extract(epoch FROM created_at) * 1000)::int8",
                &[
                    &topic,
                    &format!("{topic}.k{n}"),
                    &payload,
                    &headers.map(|h| h.to_string()),
                ],
            )
            .await
            .unwrap();
        rows.push(Row {
            id: row.get(0),
            topic: topic.to_owned(),
            key: Some(format!("{topic}.k{n}")),
            payload: Some(payload.to_vec()),
            traceparent: traceparent.map(str::to_owned),
            created_ms: row.get(1),
        });
    }
    rows
}

/// The table option lines of the tests' envelope in `mode`.
fn envelope(mode: &str) -> String {
    format!(
        "envelope = \"cloudevents\"\n\
         [tables.cloudevents]\n\
         mode = \"{mode}\"\n\
         type = \"com.example.{{topic}}\"\n\
         source = \"/shop/{{key}}\"\n\
         subject = \"{{key}}\""
    )
}

/// The payload as the event's data says it, JSON parsed: what binary (bytes) and
/// structured (a JSON value) mode must agree on.
fn data_of(event: &Event) -> Option<serde_json::Value> {
    match event.data()? {
        Data::Json(v) => Some(v.clone()),
        Data::Binary(b) => {
            Some(serde_json::from_slice(b).unwrap_or_else(|_| serde_json::json!({ "bytes": b })))
        }
        Data::String(s) => Some(serde_json::json!({ "string": s })),
    }
}

/// Every attribute of `event` is the row's; `dedupe` is the broker's dedupe header value.
fn assert_event_of(event: &Event, row: &Row, dedupe: Option<&str>) {
    let id = format!("public.outbox:{}", row.id);
    assert_eq!(event.specversion(), SpecVersion::V10);
    assert_eq!(event.id(), id, "id is the message id");
    assert_eq!(Some(event.id()), dedupe, "id equals the dedupe id");
    assert_eq!(event.ty(), format!("com.example.{}", row.topic));
    let key = row.key.as_deref().unwrap();
    assert_eq!(event.source().to_string(), format!("/shop/{key}"));
    assert_eq!(event.subject(), Some(key));
    assert_eq!(
        event.time().map(|t| t.timestamp_millis()),
        Some(row.created_ms),
        "time is the row's creation time"
    );
    let traceparent = match event.extension("traceparent") {
        Some(ExtensionValue::String(s)) => Some(s.as_str()),
        None => None,
        Some(other) => panic!("traceparent is not a string: {other:?}"),
    };
    assert_eq!(traceparent, row.traceparent.as_deref());
    let payload = row.payload.as_deref().unwrap();
    let expected = match payload {
        [] => None,
        p => Some(serde_json::from_slice(p).unwrap_or_else(|_| serde_json::json!({ "bytes": p }))),
    };
    assert_eq!(data_of(event), expected, "data is the payload");
}

/// Structured mode: a JSON payload travels as `data`, anything else as `data_base64`, an
/// empty one as neither. Read from the body itself: the SDK reads `data_base64` that
/// decodes to JSON as JSON data when the content type is absent, so its `Data` cannot tell.
fn assert_structured_data(body: &[u8], row: &Row) {
    let event: serde_json::Value = serde_json::from_slice(body).unwrap();
    let payload = row.payload.as_deref().unwrap();
    let field = match payload {
        [] => None,
        p if serde_json::from_slice::<serde_json::Value>(p).is_ok() => Some("data"),
        _ => Some("data_base64"),
    };
    let present: Vec<&str> = ["data", "data_base64"]
        .into_iter()
        .filter(|f| event.get(f).is_some())
        .collect();
    assert_eq!(
        present,
        Vec::from_iter(field),
        "payload {payload:?}: {event}"
    );
}

/// NATS, binary then structured: each event, read by the SDK, is its row's.
#[tokio::test(flavor = "multi_thread")]
async fn nats_events_in_both_modes_decode_with_the_sdk_to_their_rows() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    let mut seen = 0;
    for mode in ["binary", "structured"] {
        env.write_config(&relay());
        env.table_option(&envelope(mode));
        let rows = insert_kinds(&client, &format!("events.{mode}")).await;
        let out = env.relay(&["drain"]);
        assert!(out.status.success(), "drain: {}", text(&out));
        let stored = env.stored().await;
        assert_eq!(
            stored.len(),
            seen + rows.len(),
            "{mode}: one message per row"
        );
        for row in &rows {
            let id = format!("public.outbox:{}", row.id);
            let m = stored[seen..]
                .iter()
                .find(|m| m.header("Nats-Msg-Id") == Some(&id))
                .unwrap_or_else(|| panic!("{mode}: no message {id}"));
            let wire = Wire {
                headers: m.headers.clone(),
                payload: Some(m.payload.clone()),
            };
            if mode == "binary" {
                assert_eq!(
                    m.payload,
                    row.payload.clone().unwrap(),
                    "the body is the payload"
                );
                assert!(wire.header("ce-id").is_some(), "NATS binding: ce- headers");
            } else {
                assert_eq!(
                    wire.header("content-type"),
                    Some("application/cloudevents+json; charset=UTF-8")
                );
            }
            let event = decode(&wire, "ce-");
            assert_event_of(&event, row, m.header("Nats-Msg-Id"));
            if mode == "structured" {
                assert_structured_data(&m.payload, row);
            }
        }
        seen = stored.len();
    }
}

/// A throwaway PostgreSQL and tansu, topics `events.*` created, config written.
struct KafkaEnv {
    pg: Postgres,
    broker: KafkaBroker,
    config: std::path::PathBuf,
    url: String,
    _dir: TempDir,
}

const KAFKA_TOPICS: [&str; 3] = ["events.binary", "events.structured", "events.dead"];

impl KafkaEnv {
    async fn new() -> KafkaEnv {
        let pg = Postgres::start().unwrap();
        let broker = KafkaBroker::start().unwrap();
        for topic in KAFKA_TOPICS {
            broker.create_topic(topic, 1).unwrap();
        }
        let url = pg.create_database("app").await.unwrap();
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-ce-{}-{}",
            std::process::id(),
            testkit::free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let env = KafkaEnv {
            config: dir.join("relay.toml"),
            _dir: TempDir(dir),
            pg,
            broker,
            url,
        };
        env.write_config("", "");
        let out = env
            .command(&["migrate"])
            .env("OUTBOX_RELAY__POSTGRES__URL", &env.url)
            .output_within(RUN_LIMIT)
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        grant_relay_role(&env.client().await, "public.outbox").await;
        env
    }

    /// The config with `relay` lines added to `[relay]`, `table` lines to `[[tables]]`.
    fn write_config(&self, relay: &str, table: &str) {
        let toml = format!(
            "[postgres]\nurl = \"{}\"\n[relay]\npoll_interval = \"50ms\"\nmax_attempts = 1\n{relay}\n\
             [sink]\nkind = \"kafka\"\npublish_timeout = \"10s\"\n\
             [sink.kafka]\nbrokers = \"{}\"\n[sink.kafka.properties]\n\"linger.ms\" = 5\n\
             [[tables]]\nname = \"public.outbox\"\n{table}\n",
            as_relay_role(&self.url),
            self.broker.bootstrap()
        );
        std::fs::write(&self.config, toml).unwrap();
    }

    async fn client(&self) -> tokio_postgres::Client {
        self.pg.connect("app").await.unwrap()
    }

    fn command(&self, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new(BIN);
        cmd.args(args)
            .arg("--config")
            .arg(&self.config)
            .env_remove("RUST_LOG");
        testkit::die_with_parent(&mut cmd);
        cmd
    }

    fn drain(&self) {
        let out = self.command(&["drain"]).output_within(RUN_LIMIT).unwrap();
        assert!(out.status.success(), "drain: {}", text(&out));
    }

    fn read(&self) -> Vec<testkit::KafkaRecord> {
        testkit::kafka_read_all(
            &self.broker.bootstrap(),
            &KAFKA_TOPICS,
            Duration::from_secs(3),
        )
        .unwrap()
    }
}

fn wire_of(record: &testkit::KafkaRecord) -> Wire {
    Wire {
        headers: record.headers.clone(),
        payload: record.payload.clone(),
    }
}

/// Kafka, binary then structured, the same rows both ways: each event, read by the SDK,
/// is its row's, and a row's binary and structured events are the same event.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_events_in_both_modes_decode_with_the_sdk_to_the_same_event() {
    let env = KafkaEnv::new().await;
    let client = env.client().await;
    env.write_config("", &envelope("binary"));
    let rows = insert_kinds(&client, "events.binary").await;
    env.drain();
    // The same rows again (same id, time, topic), published in structured mode.
    env.write_config("", &envelope("structured"));
    for row in &rows {
        client
            .execute(
                "INSERT INTO public.outbox (id, topic, key, payload, headers, created_at) \
                 VALUES ($1, $2, $3, $4, $5::text::jsonb, to_timestamp(0) + $6::int8 * interval '1 millisecond')",
                &[
                    &row.id,
                    &row.topic,
                    &row.key,
                    &row.payload,
                    &row.traceparent.as_ref().map(|t| format!("{{\"traceparent\":\"{t}\"}}")),
                    &row.created_ms,
                ],
            )
            .await
            .unwrap();
    }
    env.drain();
    let records = env.read();
    assert_eq!(records.len(), 2 * rows.len(), "{records:?}");
    let structured = |r: &&testkit::KafkaRecord| {
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/cloudevents+json"))
    };
    for row in &rows {
        let id = format!("public.outbox:{}", row.id);
        let of_row = |r: &&testkit::KafkaRecord| r.header("outbox-id") == Some(&id);
        let b = records
            .iter()
            .filter(of_row)
            .find(|r| !structured(r))
            .unwrap();
        let s = records.iter().filter(of_row).find(structured).unwrap();
        assert_eq!(b.payload, row.payload, "binary: the body is the payload");
        assert!(b.header("ce_id").is_some(), "Kafka binding: ce_ headers");
        let b_event = decode(&wire_of(b), "ce_");
        let s_event = decode(&wire_of(s), "ce_");
        assert_event_of(&b_event, row, b.header("outbox-id"));
        assert_event_of(&s_event, row, s.header("outbox-id"));
        assert_structured_data(s.payload.as_deref().unwrap(), row);
        let (mut b_event, mut s_event) = (b_event, s_event);
        let (b_data, s_data) = (data_of(&b_event), data_of(&s_event));
        let _ = (b_event.take_data(), s_event.take_data());
        assert_eq!(b_event, s_event, "binary and structured: the same event");
        assert_eq!(b_data, s_data, "binary and structured: the same data");
    }
}

/// A tombstone (NULL payload) deletes its key: it is not an event and gets no envelope.
/// A row whose `source` template meets a NULL column is bad: dead-lettered with the column
/// named, and only that row; its dead letter is the row as it is.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_a_tombstone_has_no_envelope_and_a_null_template_column_dead_letters_only_its_row() {
    let env = KafkaEnv::new().await;
    let client = env.client().await;
    env.write_config(
        "",
        &format!(
            "dead_letter_topic = \"events.dead\"\n{}",
            envelope("binary")
        ),
    );
    let insert = "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.binary', $1, $2)";
    for (key, payload) in [
        (Some("k1"), None),
        (None, Some(b"orphan".to_vec())),
        (Some("k2"), Some(b"{}".to_vec())),
    ] {
        client.execute(insert, &[&key, &payload]).await.unwrap();
    }
    env.drain();
    let records = env.read();
    let on = |topic: &'static str| records.iter().filter(move |r| r.topic == topic);
    let published: Vec<_> = on("events.binary").collect();
    assert_eq!(published.len(), 2, "{records:?}");
    let tombstone = *published
        .iter()
        .find(|r| r.key.as_deref() == Some("k1"))
        .unwrap();
    assert_eq!(tombstone.payload, None);
    assert!(tombstone.header("outbox-id").is_some());
    assert!(
        tombstone.headers.iter().all(|(k, _)| !k.starts_with("ce_")),
        "a tombstone has no envelope: {:?}",
        tombstone.headers
    );
    let k2 = published
        .iter()
        .find(|r| r.key.as_deref() == Some("k2"))
        .unwrap();
    let event = decode(&wire_of(k2), "ce_");
    assert_eq!(event.source().to_string(), "/shop/k2");
    let dead: Vec<_> = on("events.dead").collect();
    assert_eq!(dead.len(), 1, "only the row with the NULL key: {records:?}");
    let error = dead[0].header("outbox-error").unwrap_or_default();
    assert!(
        error.contains("column key used in the cloudevents.type template")
            || error.contains("column key used in the cloudevents.source template"),
        "the error names the column: {error}"
    );
    assert_eq!(dead[0].payload.as_deref(), Some(&b"orphan"[..]));
    let dead_in_table = count(
        &client,
        "SELECT count(*) FROM public.outbox WHERE dead_at IS NOT NULL AND key IS NULL",
    )
    .await;
    assert_eq!(dead_in_table, 1);
    let last_error: String = client
        .query_one(
            "SELECT last_error FROM public.outbox WHERE key IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(last_error.contains("column key"), "{last_error}");
}

/// A row the broker refuses for its own sake (a subject no stream captures) is dead-lettered
/// with the event it was first published as: binary headers or the structured body, the
/// same id and attributes, plus `outbox-error`.
#[tokio::test(flavor = "multi_thread")]
async fn nats_a_dead_letter_carries_the_first_publishs_envelope_in_both_modes() {
    let env = Env::new(relay().max_attempts(1)).await;
    let client = env.client().await;
    for mode in ["binary", "structured"] {
        env.write_config(&relay().max_attempts(1));
        env.table_option(&format!(
            "dead_letter_topic = \"events.dead\"\n{}",
            envelope(mode)
        ));
        let rows = insert_kinds(&client, &format!("nowhere.{mode}")).await;
        let out = env.relay(&["drain"]);
        assert!(out.status.success(), "drain: {}", text(&out));
        let stored = env.stored().await;
        for row in &rows {
            let id = format!("public.outbox:{}", row.id);
            let m = stored
                .iter()
                .find(|m| m.header("Nats-Msg-Id") == Some(&id))
                .unwrap_or_else(|| panic!("{mode}: no dead letter {id}: {stored:?}"));
            assert_eq!(m.subject, "events.dead");
            assert!(m.header("outbox-error").is_some());
            let wire = Wire {
                headers: m.headers.clone(),
                payload: Some(m.payload.clone()),
            };
            if mode == "structured" {
                assert_structured_data(&m.payload, row);
            } else {
                assert_eq!(m.payload, row.payload.clone().unwrap());
            }
            assert_event_of(&decode(&wire, "ce-"), row, m.header("Nats-Msg-Id"));
        }
    }
}

/// `replay` publishes a kept row again as the same event, `id` included (Kafka: no
/// broker-side dedupe, so both copies arrive).
#[tokio::test(flavor = "multi_thread")]
async fn kafka_a_replayed_row_is_the_same_event() {
    let env = KafkaEnv::new().await;
    let client = env.client().await;
    env.write_config("on_publish = \"mark\"", &envelope("structured"));
    let rows = insert_kinds(&client, "events.structured").await;
    env.drain();
    let ids: Vec<String> = rows.iter().map(|r| r.id.to_string()).collect();
    let mut args = vec!["replay"];
    for id in &ids {
        args.extend(["--id", id]);
    }
    let out = env.command(&args).output_within(RUN_LIMIT).unwrap();
    assert!(out.status.success(), "replay: {}", text(&out));
    env.drain();
    let records = env.read();
    assert_eq!(records.len(), 2 * rows.len(), "{records:?}");
    for row in &rows {
        let id = format!("public.outbox:{}", row.id);
        let copies: Vec<Event> = records
            .iter()
            .filter(|r| r.header("outbox-id") == Some(&id))
            .map(|r| decode(&wire_of(r), "ce_"))
            .collect();
        assert_eq!(copies.len(), 2, "{id}");
        assert_event_of(&copies[0], row, Some(&id));
        assert_eq!(copies[0], copies[1], "the replay is the same event");
    }
}
