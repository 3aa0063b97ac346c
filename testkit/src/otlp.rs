//! A small OTLP/HTTP trace receiver: the collector the tests export to, since none can be
//! installed here. It accepts `POST /v1/traces` with an `application/x-protobuf`
//! `ExportTraceServiceRequest`, decodes it with its own copy of the OTLP schema (the
//! fields the tests read, field numbers from opentelemetry-proto's `trace.proto`), and
//! keeps every span. A request it cannot decode is answered 400 and recorded, so a test
//! sees it.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use prost::Message as _;

/// The OTLP schema, as much of it as the tests read (unknown fields are skipped).
mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ExportTraceServiceRequest {
        #[prost(message, repeated, tag = "1")]
        pub resource_spans: Vec<ResourceSpans>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResourceSpans {
        #[prost(message, optional, tag = "1")]
        pub resource: Option<Resource>,
        #[prost(message, repeated, tag = "2")]
        pub scope_spans: Vec<ScopeSpans>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Resource {
        #[prost(message, repeated, tag = "1")]
        pub attributes: Vec<KeyValue>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ScopeSpans {
        #[prost(message, optional, tag = "1")]
        pub scope: Option<Scope>,
        #[prost(message, repeated, tag = "2")]
        pub spans: Vec<Span>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Scope {
        #[prost(string, tag = "1")]
        pub name: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Span {
        #[prost(bytes = "vec", tag = "1")]
        pub trace_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub span_id: Vec<u8>,
        #[prost(string, tag = "3")]
        pub trace_state: String,
        #[prost(bytes = "vec", tag = "4")]
        pub parent_span_id: Vec<u8>,
        #[prost(string, tag = "5")]
        pub name: String,
        #[prost(int32, tag = "6")]
        pub kind: i32,
        #[prost(fixed64, tag = "7")]
        pub start_time_unix_nano: u64,
        #[prost(fixed64, tag = "8")]
        pub end_time_unix_nano: u64,
        #[prost(message, repeated, tag = "9")]
        pub attributes: Vec<KeyValue>,
        #[prost(message, repeated, tag = "13")]
        pub links: Vec<Link>,
        #[prost(message, optional, tag = "15")]
        pub status: Option<Status>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Link {
        #[prost(bytes = "vec", tag = "1")]
        pub trace_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub span_id: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Status {
        #[prost(string, tag = "2")]
        pub message: String,
        #[prost(int32, tag = "3")]
        pub code: i32,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyValue {
        #[prost(string, tag = "1")]
        pub key: String,
        #[prost(message, optional, tag = "2")]
        pub value: Option<AnyValue>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AnyValue {
        #[prost(oneof = "Value", tags = "1, 2, 3, 4")]
        pub value: Option<Value>,
    }
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(string, tag = "1")]
        String(String),
        #[prost(bool, tag = "2")]
        Bool(bool),
        #[prost(int64, tag = "3")]
        Int(i64),
        #[prost(double, tag = "4")]
        Double(f64),
    }
}

/// OTLP `SpanKind` values.
pub const KIND_INTERNAL: i32 = 1;
pub const KIND_PRODUCER: i32 = 4;
/// OTLP `StatusCode::Error`.
pub const STATUS_ERROR: i32 = 2;

/// An attribute value as exported.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    Str(String),
    Bool(bool),
    Int(i64),
    Double(f64),
    /// A kind the tests do not read (arrays, maps, bytes).
    Other,
}

/// One exported span, ids in lowercase hex (`parent_span_id` empty for a root).
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service_name: String,
    pub scope: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub trace_state: String,
    pub name: String,
    pub kind: i32,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
    pub attributes: BTreeMap<String, Attr>,
    /// `(trace_id, span_id)` of each link.
    pub links: Vec<(String, String)>,
    pub status_code: i32,
    pub status_message: String,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&Attr> {
        self.attributes.get(key)
    }

    pub fn attr_str(&self, key: &str) -> Option<&str> {
        match self.attributes.get(key) {
            Some(Attr::Str(s)) => Some(s),
            _ => None,
        }
    }

    /// The `traceparent` a consumer continuing this span receives.
    pub fn traceparent(&self, sampled: bool) -> String {
        format!(
            "00-{}-{}-{}",
            self.trace_id,
            self.span_id,
            if sampled { "01" } else { "00" }
        )
    }
}

/// One HTTP request the receiver got.
#[derive(Debug, Clone)]
pub struct ReceivedRequest {
    pub path: String,
    /// Header names in lowercase.
    pub headers: BTreeMap<String, String>,
    /// Why the body could not be decoded, if it could not.
    pub error: Option<String>,
}

#[derive(Default)]
struct Received {
    /// Count spans only, keep nothing (the benchmark's millions of spans).
    count_only: bool,
    count: usize,
    spans: Vec<ReceivedSpan>,
    requests: Vec<ReceivedRequest>,
}

/// A running receiver on 127.0.0.1, on a free port, until dropped (its threads end with
/// the test process).
pub struct OtlpReceiver {
    port: u16,
    received: Arc<Mutex<Received>>,
}

impl OtlpReceiver {
    /// Keeps every span and request.
    pub fn start() -> Result<OtlpReceiver> {
        OtlpReceiver::start_with(false)
    }

    /// Decodes every export but only counts the spans ([`OtlpReceiver::span_count`]).
    pub fn start_counting() -> Result<OtlpReceiver> {
        OtlpReceiver::start_with(true)
    }

    fn start_with(count_only: bool) -> Result<OtlpReceiver> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let received = Arc::new(Mutex::new(Received {
            count_only,
            ..Received::default()
        }));
        let keep = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let keep = keep.clone();
                std::thread::spawn(move || serve(stream, &keep));
            }
        });
        Ok(OtlpReceiver { port, received })
    }

    /// The base URL, as `otlp_endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Spans received so far (kept or only counted).
    pub fn span_count(&self) -> usize {
        self.received.lock().unwrap().count
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received.lock().unwrap().spans.clone()
    }

    pub fn requests(&self) -> Vec<ReceivedRequest> {
        self.received.lock().unwrap().requests.clone()
    }

    /// Waits up to `limit` for `done(spans)`; returns the spans then, or errs with what
    /// arrived.
    pub fn wait_for(
        &self,
        limit: Duration,
        mut done: impl FnMut(&[ReceivedSpan]) -> bool,
    ) -> Result<Vec<ReceivedSpan>> {
        let start = Instant::now();
        loop {
            let spans = self.spans();
            if done(&spans) {
                return Ok(spans);
            }
            if start.elapsed() > limit {
                let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
                anyhow::bail!(
                    "OTLP receiver: condition not met within {limit:?}; {} spans arrived: {names:?}; \
                     requests: {:?}",
                    spans.len(),
                    self.requests()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Serves one connection: HTTP/1.1 requests with a Content-Length body, kept alive.
fn serve(stream: TcpStream, received: &Mutex<Received>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut request_line = String::new();
        match reader.read_line(&mut request_line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let path = request_line
            .split_whitespace()
            .nth(1)
            .unwrap_or("")
            .to_owned();
        let mut headers = BTreeMap::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
            }
        }
        let length: usize = headers
            .get("content-length")
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let decoded = decode(&path, &headers, &body);
        let status = if decoded.is_ok() {
            "200 OK"
        } else {
            "400 Bad Request"
        };
        {
            let mut r = received.lock().unwrap();
            let error = match decoded {
                Ok(spans) => {
                    r.count += spans.len();
                    if !r.count_only {
                        r.spans.extend(spans);
                    }
                    None
                }
                Err(e) => Some(e),
            };
            if !r.count_only || error.is_some() {
                r.requests.push(ReceivedRequest {
                    path,
                    headers,
                    error,
                });
            }
        }
        let answer = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"
        );
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

fn decode(
    path: &str,
    headers: &BTreeMap<String, String>,
    body: &[u8],
) -> std::result::Result<Vec<ReceivedSpan>, String> {
    if path != "/v1/traces" {
        return Err(format!("POST to {path}, not /v1/traces"));
    }
    let content_type = headers.get("content-type").map(String::as_str);
    if content_type != Some("application/x-protobuf") {
        return Err(format!(
            "content-type {content_type:?}, not application/x-protobuf"
        ));
    }
    let request = proto::ExportTraceServiceRequest::decode(body)
        .map_err(|e| format!("not an ExportTraceServiceRequest: {e}"))?;
    let mut spans = Vec::new();
    for rs in request.resource_spans {
        let resource = rs.resource.map(|r| attributes(r.attributes));
        let service_name = match resource.as_ref().and_then(|r| r.get("service.name")) {
            Some(Attr::Str(s)) => s.clone(),
            _ => String::new(),
        };
        for ss in rs.scope_spans {
            let scope = ss.scope.map(|s| s.name).unwrap_or_default();
            for s in ss.spans {
                let status = s.status.unwrap_or_default();
                spans.push(ReceivedSpan {
                    service_name: service_name.clone(),
                    scope: scope.clone(),
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    trace_state: s.trace_state,
                    name: s.name,
                    kind: s.kind,
                    start_unix_nano: s.start_time_unix_nano,
                    end_unix_nano: s.end_time_unix_nano,
                    attributes: attributes(s.attributes),
                    links: s
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                    status_code: status.code,
                    status_message: status.message,
                });
            }
        }
    }
    Ok(spans)
}

fn attributes(kvs: Vec<proto::KeyValue>) -> BTreeMap<String, Attr> {
    kvs.into_iter()
        .map(|kv| {
            let value = match kv.value.and_then(|v| v.value) {
                Some(proto::Value::String(s)) => Attr::Str(s),
                Some(proto::Value::Bool(b)) => Attr::Bool(b),
                Some(proto::Value::Int(i)) => Attr::Int(i),
                Some(proto::Value::Double(d)) => Attr::Double(d),
                None => Attr::Other,
            };
            (kv.key, value)
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
