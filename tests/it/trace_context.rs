//! Trace context across the outbox hop (contract section 8, "Trace context"): a row's W3C
//! `traceparent` is the parent of the relay's send span, exported over OTLP/HTTP to a real
//! receiver that decodes the protobuf (testkit's `OtlpReceiver`), and the message carries
//! the send span's own `traceparent` on; with export off it passes through unchanged.

use std::collections::HashMap;
use std::time::Duration;

use crate::common::*;
use testkit::otlp::{Attr, KIND_INTERNAL, KIND_PRODUCER};
use testkit::{OtlpReceiver, ReceivedSpan, StoredMessage};

const SUBJECT: &str = "events.trace";
/// A sampled parent, as the request that wrote the row left it.
const PARENT_A: (&str, &str) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
/// Another, read from a column mapped in `[tables.header_columns]`.
const PARENT_B: (&str, &str) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
/// A parent its writer did not sample.
const PARENT_C: (&str, &str) = ("5c1e2f3a4b5c6d7e8f90a1b2c3d4e5f6", "1122334455667788");
const TRACESTATE: &str = "congo=t61rcWkgMzE";

fn traceparent((trace, span): (&str, &str), sampled: bool) -> String {
    format!("00-{trace}-{span}-{}", if sampled { "01" } else { "00" })
}

/// Inserts a row on [`SUBJECT`] created `age_secs` ago; returns its id.
async fn insert(
    client: &tokio_postgres::Client,
    headers: Option<String>,
    trace_column: Option<String>,
    age_secs: f64,
) -> i64 {
    client
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload, headers, trace_parent, created_at) \
             VALUES ($1, 'k', 'x', $2::text::jsonb, $3, now() - make_interval(secs => $4)) \
             RETURNING id",
            &[&SUBJECT, &headers, &trace_column, &age_secs],
        )
        .await
        .expect("insert a row")
        .get(0)
}

/// An env whose table has a `trace_parent` column (mapped to the `traceparent` header when
/// `map_column`), with `tracing` appended to the config.
async fn env_with_trace_column(map_column: bool, tracing: &str) -> Env {
    let env = Env::new(relay()).await;
    env.client()
        .await
        .batch_execute("ALTER TABLE public.outbox ADD COLUMN trace_parent text")
        .await
        .expect("add the trace_parent column");
    let mapping = if map_column {
        "[tables.header_columns]\ntraceparent = \"trace_parent\"\n"
    } else {
        ""
    };
    env.write_config(&relay().section(mapping).section(tracing));
    env
}

/// `drain` with a bound, no OTEL_* variables from the test's own environment.
fn drain(env: &Env, vars: &[(&str, &str)]) {
    let mut cmd = env.command(&["drain", "--timeout", "60s"]);
    for (name, _) in std::env::vars().filter(|(n, _)| n.starts_with("OTEL_")) {
        cmd.env_remove(name);
    }
    cmd.envs(vars.iter().copied());
    let out = cmd.output_within(RUN_LIMIT).expect("run drain");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

fn by_id(stored: &[StoredMessage]) -> HashMap<String, &StoredMessage> {
    stored
        .iter()
        .map(|m| (m.header("Nats-Msg-Id").unwrap_or_default().to_owned(), m))
        .collect()
}

fn send_span_of(spans: &[ReceivedSpan], id: i64) -> &ReceivedSpan {
    let message_id = format!("public.outbox:{id}");
    let found: Vec<_> = spans
        .iter()
        .filter(|s| s.attr_str("messaging.message.id") == Some(message_id.as_str()))
        .collect();
    assert_eq!(found.len(), 1, "one send span for row {id}: {spans:#?}");
    found[0]
}

fn batch_spans(spans: &[ReceivedSpan]) -> Vec<&ReceivedSpan> {
    spans.iter().filter(|s| s.name == "relay batch").collect()
}

fn send_spans(spans: &[ReceivedSpan]) -> Vec<&ReceivedSpan> {
    spans.iter().filter(|s| s.kind == KIND_PRODUCER).collect()
}

/// The messaging attributes every send span carries.
fn assert_send_attributes(span: &ReceivedSpan, system: &str, topic: &str, id: i64) {
    assert_eq!(span.name, format!("send {topic}"));
    assert_eq!(span.kind, KIND_PRODUCER);
    assert_eq!(span.attr_str("messaging.system"), Some(system));
    assert_eq!(span.attr_str("messaging.destination.name"), Some(topic));
    assert_eq!(span.attr_str("messaging.operation.type"), Some("send"));
    assert_eq!(span.attr_str("outbox.table"), Some("public.outbox"));
    assert_eq!(span.attr("outbox.row.id"), Some(&Attr::Int(id)));
    assert_ne!(span.status_code, testkit::otlp::STATUS_ERROR, "{span:?}");
    assert!(span.end_unix_nano >= span.start_unix_nano);
}

fn wait_seconds(span: &ReceivedSpan) -> f64 {
    match span.attr("outbox.wait.duration") {
        Some(Attr::Double(d)) => *d,
        other => panic!("outbox.wait.duration is {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rows_traceparent_is_the_parent_of_its_send_span_and_the_message_carries_that_span() {
    let receiver = OtlpReceiver::start().unwrap();
    let env = env_with_trace_column(
        true,
        &format!("[tracing]\notlp_endpoint = \"{}\"\n", receiver.url()),
    )
    .await;
    let client = env.client().await;
    let from_headers = insert(
        &client,
        Some(format!(
            r#"{{"traceparent":"{}","tracestate":"{TRACESTATE}","n":"1"}}"#,
            traceparent(PARENT_A, true)
        )),
        None,
        3.0,
    )
    .await;
    let from_column = insert(&client, None, Some(traceparent(PARENT_B, true)), 0.0).await;
    let without = insert(&client, Some(r#"{"n":"3"}"#.into()), None, 0.0).await;
    let unsampled = insert(
        &client,
        Some(format!(
            r#"{{"traceparent":"{}"}}"#,
            traceparent(PARENT_C, false)
        )),
        None,
        0.0,
    )
    .await;

    drain(&env, &[]);
    let stored = env.stored().await;
    assert_eq!(stored.len(), 4);
    let messages = by_id(&stored);
    let message = |id: i64| messages[&format!("public.outbox:{id}")];
    // The relay flushes its spans before it exits: they are all there already.
    let spans = receiver
        .wait_for(Duration::from_secs(5), |s| send_spans(s).len() >= 3)
        .unwrap();
    assert!(
        receiver.requests().iter().all(|r| r.error.is_none()),
        "{:?}",
        receiver.requests()
    );
    assert!(spans.iter().all(|s| s.service_name == "outbox-relay"));
    assert_eq!(
        send_spans(&spans).len(),
        3,
        "one send span per sampled row, none for the unsampled one: {spans:#?}"
    );
    let batches = batch_spans(&spans);
    assert!(!batches.is_empty());
    for b in &batches {
        assert_eq!(b.kind, KIND_INTERNAL);
        assert!(b.parent_span_id.is_empty(), "a batch span is a root");
        assert_eq!(b.attr_str("messaging.system"), Some("nats"));
    }
    let batch_ids: Vec<(String, String)> = batches
        .iter()
        .map(|b| (b.trace_id.clone(), b.span_id.clone()))
        .collect();

    // A parent from the headers JSON: the send span is its child, linked to its batch.
    let a = send_span_of(&spans, from_headers);
    assert_send_attributes(a, "nats", SUBJECT, from_headers);
    assert_eq!(
        (a.trace_id.as_str(), a.parent_span_id.as_str()),
        PARENT_A,
        "child of the row's traceparent"
    );
    assert_eq!(a.trace_state, TRACESTATE);
    assert!(a.links.iter().any(|l| batch_ids.contains(l)), "{a:?}");
    let wait = wait_seconds(a);
    assert!(
        (3.0..60.0).contains(&wait),
        "waited {wait}s since created_at"
    );
    let m = message(from_headers);
    assert_eq!(m.header("traceparent"), Some(a.traceparent(true).as_str()));
    assert_eq!(
        m.header("tracestate"),
        Some(TRACESTATE),
        "tracestate passes on"
    );
    assert_eq!(m.header("n"), Some("1"), "other headers untouched");

    // A parent from a mapped column.
    let b = send_span_of(&spans, from_column);
    assert_send_attributes(b, "nats", SUBJECT, from_column);
    assert_eq!((b.trace_id.as_str(), b.parent_span_id.as_str()), PARENT_B);
    assert!((0.0..60.0).contains(&wait_seconds(b)));
    assert_eq!(
        message(from_column).header("traceparent"),
        Some(b.traceparent(true).as_str())
    );

    // No parent: a child of its (sampled) batch span.
    let c = send_span_of(&spans, without);
    assert_send_attributes(c, "nats", SUBJECT, without);
    assert!(
        batch_ids.contains(&(c.trace_id.clone(), c.parent_span_id.clone())),
        "child of a batch span: {c:?}"
    );
    assert_eq!(
        message(without).header("traceparent"),
        Some(c.traceparent(true).as_str())
    );

    // An unsampled parent: nothing exported in its trace; the message stays in it,
    // unsampled.
    assert!(spans.iter().all(|s| s.trace_id != PARENT_C.0));
    let tp = message(unsampled).header("traceparent").unwrap().to_owned();
    assert!(
        tp.starts_with(&format!("00-{}-", PARENT_C.0)) && tp.ends_with("-00"),
        "{tp}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn with_export_off_a_rows_traceparent_passes_through_unchanged() {
    let env = env_with_trace_column(true, "").await;
    let client = env.client().await;
    let with_headers = insert(
        &client,
        Some(format!(
            r#"{{"traceparent":"{}","tracestate":"{TRACESTATE}"}}"#,
            traceparent(PARENT_A, true)
        )),
        None,
        0.0,
    )
    .await;
    let with_column = insert(&client, None, Some(traceparent(PARENT_B, true)), 0.0).await;
    let without = insert(&client, None, None, 0.0).await;

    drain(&env, &[]);
    let stored = env.stored().await;
    let messages = by_id(&stored);
    let message = |id: i64| messages[&format!("public.outbox:{id}")];
    assert_eq!(
        message(with_headers).header("traceparent"),
        Some(traceparent(PARENT_A, true).as_str())
    );
    assert_eq!(message(with_headers).header("tracestate"), Some(TRACESTATE));
    assert_eq!(
        message(with_column).header("traceparent"),
        Some(traceparent(PARENT_B, true).as_str())
    );
    assert_eq!(message(without).header("traceparent"), None);
}

#[tokio::test(flavor = "multi_thread")]
async fn otel_environment_variables_apply_when_export_is_on() {
    let receiver = OtlpReceiver::start().unwrap();
    // No [tracing] in the file: the standard variables turn export on and shape it.
    let env = env_with_trace_column(false, "").await;
    let client = env.client().await;
    let with_parent = insert(
        &client,
        Some(format!(
            r#"{{"traceparent":"{}"}}"#,
            traceparent(PARENT_A, true)
        )),
        None,
        0.0,
    )
    .await;
    let without = insert(&client, None, None, 0.0).await;

    let url = receiver.url();
    drain(
        &env,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", url.as_str()),
            ("OTEL_SERVICE_NAME", "payments-outbox"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-token=s3cret"),
            // Batch spans are roots: never sampled, so a row without a parent gets no span.
            ("OTEL_TRACES_SAMPLER", "parentbased_always_off"),
        ],
    );
    let spans = receiver
        .wait_for(Duration::from_secs(5), |s| !s.is_empty())
        .unwrap();
    assert_eq!(
        spans.len(),
        1,
        "only the row with a sampled parent: {spans:#?}"
    );
    let span = send_span_of(&spans, with_parent);
    assert_eq!(span.service_name, "payments-outbox");
    assert_eq!(span.parent_span_id, PARENT_A.1);
    let requests = receiver.requests();
    assert!(requests.iter().all(|r| r.path == "/v1/traces"));
    assert!(requests
        .iter()
        .all(|r| r.headers.get("x-collector-token").map(String::as_str) == Some("s3cret")));

    let stored = env.stored().await;
    let messages = by_id(&stored);
    assert_eq!(
        messages[&format!("public.outbox:{with_parent}")].header("traceparent"),
        Some(span.traceparent(true).as_str())
    );
    assert_eq!(
        messages[&format!("public.outbox:{without}")].header("traceparent"),
        None,
        "no span, so no traceparent"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_record_carries_the_send_span_traceparent() {
    let receiver = OtlpReceiver::start().unwrap();
    let broker = testkit::KafkaBroker::start().unwrap();
    broker.create_topic(SUBJECT, 1).unwrap();
    let mut outbox = kafka_outbox(&broker.bootstrap(), relay()).await;
    outbox.config.tracing.otlp_traces_url = Some(format!("{}/v1/traces", receiver.url()));
    let with_parent: i64 = outbox
        .client
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload, headers, created_at) \
             VALUES ($1, 'k', 'x', $2::text::jsonb, now() - interval '2 seconds') RETURNING id",
            &[
                &SUBJECT,
                &format!(r#"{{"traceparent":"{}"}}"#, traceparent(PARENT_A, true)),
            ],
        )
        .await
        .unwrap()
        .get(0);
    let without: i64 = outbox
        .client
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ($1, 'k', 'y') RETURNING id",
            &[&SUBJECT],
        )
        .await
        .unwrap()
        .get(0);

    let report = tokio::time::timeout(
        Duration::from_secs(60),
        outbox_relay::relay::run(
            &outbox.config,
            outbox_relay::relay::Mode::Drain,
            outbox_relay::shutdown::Shutdown::new(),
        ),
    )
    .await
    .expect("drain within 60 s")
    .expect("drain");
    assert_eq!(report.published, 2);

    let spans = receiver
        .wait_for(Duration::from_secs(5), |s| send_spans(s).len() >= 2)
        .unwrap();
    let records = tokio::task::spawn_blocking(move || {
        testkit::kafka_read_all(&broker.bootstrap(), &[SUBJECT], Duration::from_secs(3))
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(records.len(), 2);
    let record = |id: i64| {
        records
            .iter()
            .find(|r| r.header("outbox-id") == Some(format!("public.outbox:{id}").as_str()))
            .expect("record")
    };
    let a = send_span_of(&spans, with_parent);
    assert_send_attributes(a, "kafka", SUBJECT, with_parent);
    assert_eq!((a.trace_id.as_str(), a.parent_span_id.as_str()), PARENT_A);
    assert!(wait_seconds(a) >= 2.0);
    assert_eq!(
        record(with_parent).header("traceparent"),
        Some(a.traceparent(true).as_str())
    );
    let b = send_span_of(&spans, without);
    assert_send_attributes(b, "kafka", SUBJECT, without);
    assert!(batch_spans(&spans)
        .iter()
        .any(|batch| batch.span_id == b.parent_span_id && batch.trace_id == b.trace_id));
    assert_eq!(
        record(without).header("traceparent"),
        Some(b.traceparent(true).as_str())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn check_says_whether_the_collector_accepts_exports() {
    let receiver = OtlpReceiver::start().unwrap();
    let env = env_with_trace_column(
        false,
        &format!("[tracing]\notlp_endpoint = \"{}\"\n", receiver.url()),
    )
    .await;
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let line = format!(
        "ok   tracing {}/v1/traces: the collector accepts OTLP/HTTP exports",
        receiver.url()
    );
    assert!(text(&out).contains(&line), "{}", text(&out));
    assert_eq!(receiver.requests().len(), 1, "one empty export");
    assert_eq!(receiver.span_count(), 0);

    // Nothing listening: a warning that says what to do; check still passes.
    let closed = format!("http://127.0.0.1:{}", testkit::free_port());
    env.write_config(&relay().section(&format!("[tracing]\notlp_endpoint = \"{closed}\"")));
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let warned = format!("WARN tracing {closed}/v1/traces: no answer");
    assert!(text(&out).contains(&warned), "{}", text(&out));
    assert!(
        text(&out).contains("relaying does not depend on it"),
        "{}",
        text(&out)
    );
}
