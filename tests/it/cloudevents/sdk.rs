//! Reading an event with the CloudEvents SDK: structured mode with its JSON event format,
//! binary mode with its `BinaryDeserializer` over the headers (written from the bindings'
//! text), and the assertions that compare an event with its row.

use cloudevents::event::{ExtensionValue, SpecVersion};
use cloudevents::message::{
    BinaryDeserializer, BinarySerializer, Error as SdkError, MessageAttributeValue,
};
use cloudevents::{AttributesReader, Data, Event};

use super::rows::Row;

/// A published message as its consumer gets it.
#[derive(Debug, Clone)]
pub(super) struct Wire {
    pub(super) headers: Vec<(String, String)>,
    pub(super) payload: Option<Vec<u8>>,
}

impl Wire {
    pub(super) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Binary mode per the Kafka (`ce_`) or NATS (`ce-`) binding, for the SDK to build from.
pub(super) struct Binary<'a> {
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
pub(super) fn decode(wire: &Wire, prefix: &str) -> Event {
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

/// The payload as the event's data says it, JSON parsed: what binary (bytes) and
/// structured (a JSON value) mode must agree on.
pub(super) fn data_of(event: &Event) -> Option<serde_json::Value> {
    match event.data()? {
        Data::Json(v) => Some(v.clone()),
        Data::Binary(b) => {
            Some(serde_json::from_slice(b).unwrap_or_else(|_| serde_json::json!({ "bytes": b })))
        }
        Data::String(s) => Some(serde_json::json!({ "string": s })),
    }
}

/// Every attribute of `event` is the row's; `dedupe` is the broker's dedupe header value.
pub(super) fn assert_event_of(event: &Event, row: &Row, dedupe: Option<&str>) {
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
pub(super) fn assert_structured_data(body: &[u8], row: &Row) {
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
