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
mod kafka;
mod rows;
mod sdk;

use cloudevents::{AttributesReader, Event};

use crate::common::*;
use kafka::{wire_of, KafkaEnv};
use rows::{envelope, insert_kinds};
use sdk::{assert_event_of, assert_structured_data, data_of, decode, Wire};

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
    env.migrate();
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
