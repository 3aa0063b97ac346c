//! Trace context across the outbox hop (OpenTelemetry over OTLP/HTTP, W3C Trace Context).
//!
//! The request that wrote a row may leave a W3C `traceparent` (and `tracestate`) in the
//! row's headers, from the headers JSON or a column mapped in `[tables.header_columns]`.
//!
//! **Export on** (`[tracing] otlp_endpoint`, else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`; `OTEL_SDK_DISABLED=true` turns it off):
//! - every batch of claimed rows gets a `relay batch` span, a root, which the sampler
//!   (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`; default parent-based always-on)
//!   samples or not;
//! - a row with a valid `traceparent` gets a producer span `send <topic>` whose parent is
//!   that context (so the row's own sampled flag decides), linked to the batch span;
//! - a row without one gets a `send` span under the batch span, only when that is sampled;
//! - the message leaves with the *send span's* `traceparent` (`tracestate` passes as it
//!   was), so the consumer's span is a child of the relay's send, which carries the row's
//!   wait in the outbox (`outbox.wait.duration`, seconds since `created_at`);
//! - each send span ends when its batch's acknowledgements are in: status error for a row
//!   the broker refused or did not acknowledge in time.
//!
//! Spans go to the SDK's batch processor: a thread of its own and a bounded queue (2048
//! spans, `OTEL_BSP_MAX_QUEUE_SIZE`; spans beyond it are dropped, never buffered without
//! bound), exported every 5 s (`OTEL_BSP_SCHEDULE_DELAY`) with the headers of
//! `OTEL_EXPORTER_OTLP_HEADERS`, under `OTEL_SERVICE_NAME` (default `outbox-relay`).
//!
//! **Export off**: nothing is made, and a row's own `traceparent` passes through unchanged:
//! a message never carries the id of a span nobody exports.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, Span};
use opentelemetry_sdk::Resource;

use crate::config::TracingConfig;
use crate::sink::{HeaderValue, Message};

/// The W3C header that carries a span's identity.
pub(crate) const TRACEPARENT: &str = "traceparent";

/// Span export, on or off; cheap to ask when off.
#[derive(Default)]
pub(crate) struct Otel {
    exporting: Option<Exporting>,
}

struct Exporting {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// `messaging.system`: the sink's name.
    system: &'static str,
    propagator: TraceContextPropagator,
}

/// Where spans go: the full OTLP/HTTP traces URL, from `[tracing] otlp_endpoint`, else
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (as is), else `OTEL_EXPORTER_OTLP_ENDPOINT` (plus
/// `/v1/traces`), as the OTLP exporter specification says; `None`: export off (none set, or
/// `OTEL_SDK_DISABLED=true`).
pub(crate) fn traces_url(config: &TracingConfig) -> Option<String> {
    traces_url_from(config, |name| std::env::var(name).ok())
}

fn traces_url_from(config: &TracingConfig, env: impl Fn(&str) -> Option<String>) -> Option<String> {
    let var = |name: &str| {
        env(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return None;
    }
    config
        .otlp_traces_url
        .clone()
        .or_else(|| var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| {
            var("OTEL_EXPORTER_OTLP_ENDPOINT")
                .map(|base| format!("{}/v1/traces", base.trim_end_matches('/')))
        })
}

/// How long `check` waits for the trace collector's answer to its empty export: a
/// reachable collector answers at once, and `check` must not hang on one that does not.
const COLLECTOR_LIMIT: Duration = Duration::from_secs(5);

/// Why `check`'s empty export was not accepted by the trace collector.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CollectorError {
    #[error("cannot build an HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// No HTTP answer (refused, timed out, TLS); the message holds the whole chain, as
    /// reqwest's own message is only its top.
    #[error("no answer: {}", error_chain(.0))]
    NoAnswer(#[source] reqwest::Error),
    /// An answer, but not a success.
    #[error("answered {0}")]
    Status(reqwest::StatusCode),
}

/// The OTLP span exporter could not be set up (`Otel::start`).
#[derive(Debug, thiserror::Error)]
#[error("cannot set up the OTLP span exporter: {0}")]
pub struct ExporterError(#[from] opentelemetry_otlp::ExporterBuildError);

/// Posts an empty export (a valid, empty `ExportTraceServiceRequest`) to `url` with the
/// configured headers, as `check` does: `Ok` when the collector accepts it. Blocking.
pub(crate) fn probe_collector(url: &str) -> Result<(), CollectorError> {
    let client = reqwest::blocking::Client::builder()
        .timeout(COLLECTOR_LIMIT)
        .build()
        .map_err(CollectorError::Client)?;
    let mut request = client
        .post(url)
        .header("content-type", "application/x-protobuf")
        .body(Vec::new());
    for (name, value) in export_headers() {
        request = request.header(name, value);
    }
    let response = request.send().map_err(CollectorError::NoAnswer)?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(CollectorError::Status(response.status()))
    }
}

/// `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else `OTEL_EXPORTER_OTLP_HEADERS`: `name=value`
/// pairs, comma-separated, values percent-encoded.
fn export_headers() -> Vec<(String, String)> {
    let text = std::env::var("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_HEADERS"))
        .unwrap_or_default();
    text.split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(name, value)| {
            let value = percent_encoding::percent_decode_str(value.trim()).decode_utf8_lossy();
            (name.trim().to_owned(), value.into_owned())
        })
        .filter(|(name, _)| !name.is_empty())
        .collect()
}

/// An error with its sources, one after the other (reqwest's own message is only the top).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

impl Otel {
    /// Export off.
    pub(crate) fn off() -> Otel {
        Otel::default()
    }

    /// Starts exporting to `url` (from [`traces_url`]). Blocking (the exporter builds its
    /// HTTP client on a thread of its own): call it where a thread may block.
    pub(crate) fn start(url: String, system: &'static str) -> Result<Otel, ExporterError> {
        use opentelemetry_otlp::WithExportConfig;
        // Headers (OTEL_EXPORTER_OTLP_HEADERS), timeout and compression come from the
        // standard variables, read by the exporter.
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .build()?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource())
            .build();
        let tracer = provider.tracer_with_scope(
            opentelemetry::InstrumentationScope::builder("outbox-relay")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
        );
        tracing::info!(endpoint = %url, "Exporting trace spans over OTLP/HTTP");
        Ok(Otel {
            exporting: Some(Exporting {
                provider,
                tracer,
                system,
                propagator: TraceContextPropagator::new(),
            }),
        })
    }

    /// Whether spans are made at all.
    pub(crate) fn is_on(&self) -> bool {
        self.exporting.is_some()
    }

    /// Opens the span of a batch of `rows` claimed from `table` since `started`; `None`
    /// when export is off.
    pub(crate) fn batch(
        &self,
        table: &dyn std::fmt::Display,
        lane: usize,
        rows: usize,
        started: SystemTime,
    ) -> Option<BatchTrace<'_>> {
        let e = self.exporting.as_ref()?;
        let span = e
            .tracer
            .span_builder("relay batch")
            .with_kind(SpanKind::Internal)
            .with_start_time(started)
            .with_attributes([
                KeyValue::new("messaging.system", e.system),
                KeyValue::new("outbox.table", table.to_string()),
                KeyValue::new("outbox.worker", lane as i64),
                KeyValue::new("messaging.batch.message_count", rows as i64),
            ])
            .start_with_context(&e.tracer, &Context::new());
        Some(BatchTrace {
            e,
            table: table.to_string(),
            batch: span,
            sends: Vec::with_capacity(rows),
        })
    }

    /// Exports what is queued and stops the exporter, within `timeout`. Blocking.
    pub(crate) fn shutdown(&self, timeout: Duration) {
        if let Some(e) = &self.exporting {
            if let Err(error) = e.provider.shutdown_with_timeout(timeout) {
                tracing::warn!(%error, "Trace spans not all exported at shutdown");
            }
        }
    }
}

/// `service.name` from `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES`, else `outbox-relay`.
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|name| !name.as_str().starts_with("unknown_service"));
    if named {
        detected
    } else {
        Resource::builder()
            .with_service_name("outbox-relay")
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build()
    }
}

/// The spans of one batch: the batch span and one send span per message (or none).
/// Spans not ended explicitly end when dropped (a batch rolled back at the deadline).
pub(crate) struct BatchTrace<'a> {
    e: &'a Exporting,
    table: String,
    batch: Span,
    sends: Vec<Option<Span>>,
}

impl BatchTrace<'_> {
    /// Opens the send span of `message` (row `row_id`, `wait` seconds after its
    /// `created_at`) and puts its `traceparent` on the message. Call once per message of
    /// the batch, in order; a message that cannot be built gets `None`.
    pub(crate) fn send(&mut self, message: Option<&mut Message>, row_id: i64, wait: Option<f64>) {
        let span = message.and_then(|m| self.start_send(m, row_id, wait));
        self.sends.push(span);
    }

    fn start_send(&self, message: &mut Message, row_id: i64, wait: Option<f64>) -> Option<Span> {
        let batch = self.batch.span_context();
        let parent = self.e.propagator.extract(&Headers(&message.headers));
        let parent_context = parent.span().span_context().clone();
        let (cx, links) = if parent_context.is_valid() {
            let links = if batch.is_sampled() {
                vec![Link::with_context(batch.clone())]
            } else {
                Vec::new()
            };
            (parent, links)
        } else if batch.is_sampled() {
            (
                Context::new().with_remote_span_context(batch.clone()),
                Vec::new(),
            )
        } else {
            return None;
        };
        let mut attributes = vec![
            KeyValue::new("messaging.system", self.e.system),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "send"),
            KeyValue::new("messaging.destination.name", message.topic.clone()),
            KeyValue::new("messaging.message.id", message.id.clone()),
            KeyValue::new("outbox.table", self.table.clone()),
            KeyValue::new("outbox.row.id", row_id),
        ];
        if let Some(wait) = wait {
            attributes.push(KeyValue::new("outbox.wait.duration", wait));
        }
        let span = self
            .e
            .tracer
            .span_builder(format!("send {}", message.topic))
            .with_kind(SpanKind::Producer)
            .with_attributes(attributes)
            .with_links(links)
            .start_with_context(&self.e.tracer, &cx);
        set_traceparent(&mut message.headers, span.span_context());
        Some(span)
    }

    /// Ends the send span of message `index`: `Err` for a row not acknowledged.
    pub(crate) fn sent(&mut self, index: usize, outcome: Result<(), &str>) {
        if let Some(mut span) = self.sends.get_mut(index).and_then(Option::take) {
            if let Err(why) = outcome {
                span.set_status(Status::error(why.to_owned()));
            }
            span.end();
        }
    }

    /// Ends the batch span once the batch is committed: `published` rows acknowledged.
    pub(crate) fn committed(mut self, published: usize) {
        self.batch
            .set_attribute(KeyValue::new("outbox.batch.published", published as i64));
        self.batch.end();
    }
}

/// Replaces (or adds) the message's `traceparent` with `span`'s.
fn set_traceparent(headers: &mut Vec<(Arc<str>, HeaderValue)>, span: &SpanContext) {
    let value = format!(
        "00-{}-{}-{:02x}",
        span.trace_id(),
        span.span_id(),
        span.trace_flags().to_u8()
    );
    match headers
        .iter_mut()
        .find(|(name, _)| name.eq_ignore_ascii_case(TRACEPARENT))
    {
        Some((_, old)) => *old = value.into(),
        None => headers.push((Arc::from(TRACEPARENT), value.into())),
    }
}

/// A message's headers as the propagator reads them (names without regard to case).
struct Headers<'a>(&'a [(Arc<str>, HeaderValue)]);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(key))
            .map(|(_, value)| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| &**name).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> Vec<(Arc<str>, HeaderValue)> {
        pairs
            .iter()
            .map(|(n, v)| (Arc::from(*n), v.to_string().into()))
            .collect()
    }

    fn context(trace: &str, span: &str, flags: u8) -> SpanContext {
        SpanContext::new(
            opentelemetry::trace::TraceId::from_hex(trace).unwrap(),
            opentelemetry::trace::SpanId::from_hex(span).unwrap(),
            opentelemetry::trace::TraceFlags::new(flags),
            false,
            Default::default(),
        )
    }

    #[test]
    fn the_traces_url_comes_from_the_config_then_the_standard_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let off = TracingConfig::default();
        let on = TracingConfig {
            otlp_traces_url: Some("http://file:4318/v1/traces".into()),
        };
        assert_eq!(traces_url_from(&off, env(&[])), None);
        assert_eq!(
            traces_url_from(
                &on,
                env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318")])
            ),
            Some("http://file:4318/v1/traces".into()),
            "the config file wins"
        );
        assert_eq!(
            traces_url_from(
                &off,
                env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318/")])
            ),
            Some("http://env:4318/v1/traces".into())
        );
        assert_eq!(
            traces_url_from(
                &off,
                env(&[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
                    (
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                        "http://traces:9999/custom"
                    ),
                ])
            ),
            Some("http://traces:9999/custom".into()),
            "the traces endpoint is taken as it is"
        );
        assert_eq!(
            traces_url_from(
                &on,
                env(&[
                    ("OTEL_SDK_DISABLED", "TRUE"),
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://e")
                ])
            ),
            None
        );
        assert_eq!(
            traces_url_from(&off, env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "  ")])),
            None
        );
    }

    #[test]
    fn set_traceparent_replaces_the_rows_own_and_keeps_the_rest() {
        let span = context("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1);
        let mut h = headers(&[
            (
                "TraceParent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("tracestate", "congo=t61rcWkgMzE"),
        ]);
        set_traceparent(&mut h, &span);
        assert_eq!(
            h,
            headers(&[
                (
                    "TraceParent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                ),
                ("tracestate", "congo=t61rcWkgMzE"),
            ])
        );
        let mut none = headers(&[("a", "1")]);
        set_traceparent(
            &mut none,
            &context("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 0),
        );
        assert_eq!(
            none[1],
            (
                Arc::from("traceparent"),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00".into()
            )
        );
    }

    #[test]
    fn a_rows_traceparent_is_read_without_regard_to_case_and_checked() {
        let p = TraceContextPropagator::new();
        let read = |h: &[(&str, &str)]| {
            let h = headers(h);
            p.extract(&Headers(&h)).span().span_context().clone()
        };
        let sc = read(&[(
            "Traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )]);
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.span_id().to_string(), "b7ad6b7169203331");
        // Malformed, all-zero ids, or absent: no parent.
        for bad in [
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "not a traceparent",
        ] {
            assert!(!read(&[("traceparent", bad)]).is_valid(), "{bad}");
        }
        assert!(!read(&[]).is_valid());
    }
}
