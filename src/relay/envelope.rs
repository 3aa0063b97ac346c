//! The CloudEvents 1.0 envelope (`envelope = "cloudevents"`): a row's message made an
//! event, in binary mode (attributes as headers, the payload untouched) or structured mode
//! (the JSON event format as the body).
//!
//! 1. `id` is the message id (`outbox-id`, `Nats-Msg-Id`), so dedupe and CloudEvents agree.
//! 2. `type` and `source` come from their templates; a NULL column in them makes the row
//!    bad, naming the column. `subject` and `datacontenttype` are left out when a column of
//!    theirs is NULL.
//! 3. `time` is the row's creation time (RFC 3339, UTC, milliseconds), absent without a
//!    creation-time column; `traceparent` is the row's own, when its headers carry one.
//! 4. A NULL payload (a Kafka tombstone) gets no envelope: a tombstone deletes its key, it
//!    is not an event. An empty payload is an event without data.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;

use crate::config::cloudevents::{CeMode, CloudEvents, HeaderNames};
use crate::config::{NullColumn, RecentTopics, Template};
use crate::sink::{HeaderValue, Message, SinkError};

/// Structured mode's content type.
const STRUCTURED: &str = "application/cloudevents+json; charset=UTF-8";

/// One event's attributes, filled from the row.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Attributes {
    pub(crate) type_: HeaderValue,
    pub(crate) source: HeaderValue,
    pub(crate) subject: Option<HeaderValue>,
    pub(crate) datacontenttype: Option<HeaderValue>,
    pub(crate) time: Option<String>,
    pub(crate) traceparent: Option<HeaderValue>,
}

/// Fills the attributes from `values` (the templates' columns, in
/// [`CloudEvents::templates`] order) and the message built so far.
///
/// This runs once a row, so it copies as little as it can: a template that is one column
/// (`{key}`) takes that column's value as it is; `type`, `source` and `datacontenttype`,
/// which a batch's rows mostly share, are rendered once for all of them through `recent`
/// (the batch's topics and such); `subject`, mostly one per row, is rendered on its own.
pub(crate) fn attributes(
    ce: &CloudEvents,
    values: &mut [Option<String>],
    message: &Message,
    recent: &mut RecentTopics,
) -> Result<Attributes, SinkError> {
    let mut rest = values;
    let mut next = |t: &Template, shared: bool| {
        let n = t.columns().len().min(rest.len());
        let (mine, after) = std::mem::take(&mut rest).split_at_mut(n);
        rest = after;
        if t.is_one_column() {
            return match mine.first_mut().and_then(Option::take) {
                Some(value) => Ok(HeaderValue::Owned(value)),
                None => Err(NullColumn {
                    column: t.columns()[0].clone(),
                }),
            };
        }
        match shared {
            true => t.render_shared(mine, recent),
            false => t.render(mine),
        }
        .map(HeaderValue::Shared)
    };
    let required = |name: &str, value: Result<HeaderValue, NullColumn>| match value {
        Ok(v) if !v.is_empty() => Ok(v),
        Ok(_) => Err(SinkError::bad_row(format!(
            "the CloudEvents {name} would be empty; it must not be"
        ))),
        Err(e) => Err(SinkError::bad_row(format!(
            "column {} used in the cloudevents.{name} template is NULL",
            e.column
        ))),
    };
    let type_ = required("type", next(&ce.type_, true))?;
    let source = required("source", next(&ce.source, true))?;
    let mut optional = |t: &Option<Template>, shared: bool| {
        t.as_ref()
            .and_then(|t| next(t, shared).ok())
            .filter(|v| !v.is_empty())
    };
    let subject = optional(&ce.subject, false);
    let datacontenttype = optional(&ce.datacontenttype, true);
    let traceparent = message
        .headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("traceparent"))
        .map(|(_, v)| v.clone());
    Ok(Attributes {
        type_,
        source,
        subject,
        datacontenttype,
        time: message.timestamp_ms.map(rfc3339),
        traceparent,
    })
}

/// Makes `message` (built from a row of a table with `ce`) a CloudEvent; `values` are the
/// templates' columns (taken where a template is one column), `recent` the batch's shared
/// strings. A tombstone stays as it is.
pub(crate) fn wrap(
    ce: &CloudEvents,
    values: &mut [Option<String>],
    message: &mut Message,
    recent: &mut RecentTopics,
) -> Result<(), SinkError> {
    if message.payload.is_none() {
        return Ok(());
    }
    let attributes = attributes(ce, values, message, recent)?;
    let names = &ce.header_names;
    match ce.mode {
        CeMode::Binary => binary(names, attributes, message),
        CeMode::Structured => {
            let body = structured(&message.id, &attributes, message.payload.as_deref());
            message.payload = Some(Bytes::from(body));
            set_content_type(&mut message.headers, names, STRUCTURED.into());
        }
    }
    Ok(())
}

/// Binary mode: each attribute a header with the binding's prefix, `datacontenttype` as
/// `content-type`.
fn binary(names: &HeaderNames, a: Attributes, message: &mut Message) {
    let headers = &mut message.headers;
    headers.reserve(7);
    headers.push((names.specversion.clone(), "1.0".into()));
    headers.push((names.id.clone(), message.id.clone().into()));
    headers.push((names.source.clone(), a.source));
    headers.push((names.type_.clone(), a.type_));
    if let Some(time) = a.time {
        headers.push((names.time.clone(), time.into()));
    }
    if let Some(subject) = a.subject {
        headers.push((names.subject.clone(), subject));
    }
    if let Some(traceparent) = a.traceparent {
        headers.push((names.traceparent.clone(), traceparent));
    }
    if let Some(content_type) = a.datacontenttype {
        set_content_type(headers, names, content_type);
    }
}

/// Replaces any `content-type` header (whatever its case) with `value`.
fn set_content_type(
    headers: &mut Vec<(Arc<str>, HeaderValue)>,
    names: &HeaderNames,
    value: HeaderValue,
) {
    headers.retain(|(name, _)| !name.eq_ignore_ascii_case(&names.content_type));
    headers.push((names.content_type.clone(), value));
}

/// Structured mode: the JSON event format. The payload is `data` (as JSON) when it is
/// JSON and the content type says JSON or nothing; `data_base64` otherwise; no data when
/// it is empty.
pub(crate) fn structured(id: &str, a: &Attributes, payload: Option<&[u8]>) -> Vec<u8> {
    let payload = payload.unwrap_or_default();
    let mut out = Vec::with_capacity(payload.len() * 4 / 3 + 256);
    let field = |out: &mut Vec<u8>, name: &str, value: &str| {
        out.extend_from_slice(if out.is_empty() { b"{\"" } else { b",\"" });
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\":");
        serde_json::to_writer(&mut *out, value).expect("writing a string to a Vec cannot fail");
    };
    field(&mut out, "specversion", "1.0");
    field(&mut out, "id", id);
    field(&mut out, "source", &a.source);
    field(&mut out, "type", &a.type_);
    let optional = [
        ("time", a.time.as_deref()),
        ("subject", a.subject.as_deref()),
        ("datacontenttype", a.datacontenttype.as_deref()),
        ("traceparent", a.traceparent.as_deref()),
    ];
    for (name, value) in optional {
        if let Some(value) = value {
            field(&mut out, name, value);
        }
    }
    if !payload.is_empty() {
        let json_type = a.datacontenttype.as_deref().is_none_or(is_json);
        if json_type && serde_json::from_slice::<serde::de::IgnoredAny>(payload).is_ok() {
            out.extend_from_slice(b",\"data\":");
            out.extend_from_slice(payload);
        } else {
            out.extend_from_slice(b",\"data_base64\":\"");
            base64(payload, &mut out);
            out.push(b'"');
        }
    }
    out.push(b'}');
    out
}

/// A JSON media type, as the JSON event format reads it: `*/json` or `*/*+json`, with
/// parameters or not.
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    let essence = essence.to_ascii_lowercase();
    essence.ends_with("/json") || essence.ends_with("+json")
}

/// Standard base64 with padding (RFC 4648), appended to `out`.
fn base64(bytes: &[u8], out: &mut Vec<u8>) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]);
            } else {
                out.push(b'=');
            }
        }
    }
}

/// Milliseconds since the epoch as RFC 3339 in UTC (`2026-11-28T05:40:00.123Z`).
fn rfc3339(ms: i64) -> String {
    let time = match u64::try_from(ms) {
        Ok(ms) => UNIX_EPOCH + Duration::from_millis(ms),
        Err(_) => UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs()),
    };
    let mut out = String::with_capacity("2026-11-28T05:40:00.123Z".len());
    write!(out, "{}", humantime::format_rfc3339_millis(time)).expect("a String takes any text");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648_test_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in cases {
            let mut out = Vec::new();
            base64(plain.as_bytes(), &mut out);
            assert_eq!(String::from_utf8(out).unwrap(), encoded, "{plain}");
        }
    }

    #[test]
    fn time_is_rfc3339_utc_with_milliseconds() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_844_400_123), "2026-11-28T05:40:00.123Z");
    }

    #[test]
    fn json_media_types_are_recognised_with_parameters() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/vnd.x+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/octet-stream"));
    }

    fn attributes(content_type: Option<&str>) -> Attributes {
        Attributes {
            type_: "com.x.created".into(),
            source: "/orders".into(),
            subject: Some("k\"1".into()),
            datacontenttype: content_type.map(|t| HeaderValue::Owned(t.to_owned())),
            time: None,
            traceparent: None,
        }
    }

    fn event(content_type: Option<&str>, payload: &[u8]) -> serde_json::Value {
        serde_json::from_slice(&structured("t:1", &attributes(content_type), Some(payload)))
            .unwrap()
    }

    #[test]
    fn structured_carries_json_as_data_and_anything_else_as_base64() {
        let e = event(None, br#"{"a":[1,2]}"#);
        assert_eq!(e["data"], serde_json::json!({"a": [1, 2]}));
        assert_eq!(e["subject"], "k\"1");
        assert_eq!(e["specversion"], "1.0");
        assert_eq!(e["id"], "t:1");
        let e = event(None, b"\xff\x00 not json");
        assert_eq!(e["data_base64"], "/wAgbm90IGpzb24=");
        assert!(e.get("data").is_none());
        let e = event(Some("text/plain"), b"123");
        assert_eq!(
            e["data_base64"], "MTIz",
            "JSON-looking text of a non-JSON type"
        );
        let e = event(None, b"");
        assert!(e.get("data").is_none() && e.get("data_base64").is_none());
    }

    fn table(sink: &str, mode: &str) -> crate::config::TableConfig {
        let sink = match sink {
            "nats" => "kind = \"nats\"\n[sink.nats]\nurl = \"nats://n:4222\"\n",
            _ => "kind = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n",
        };
        let text = format!(
            "[postgres]\nurl = \"postgres://db/app\"\n[sink]\n{sink}\
             [[tables]]\nname = \"public.outbox\"\nenvelope = \"cloudevents\"\n\
             [tables.cloudevents]\nmode = \"{mode}\"\ntype = \"com.x.{{topic}}\"\n\
             source = \"/shop/{{key}}\"\nsubject = \"{{key}}\"\n"
        );
        let config = crate::config::from_str(&text, |_| None, Vec::new()).unwrap();
        config.tables[0].clone()
    }

    fn row(key: Option<&str>) -> crate::source::claim::ClaimedRow {
        crate::source::claim::ClaimedRow {
            id: 7,
            key: key.map(Arc::from),
            payload: Some(b"{\"a\":1}".to_vec()),
            headers: Some(r#"{"traceparent":"00-1-2-01"}"#.to_owned()),
            created_ms: Some(0),
            topic_values: vec![Some("events.a".to_owned())],
            envelope_values: vec![
                Some("a".to_owned()),
                key.map(str::to_owned),
                key.map(str::to_owned),
            ],
            ..Default::default()
        }
    }

    fn message(sink: &str, mode: &str, key: Option<&str>) -> Result<Message, SinkError> {
        let table = table(sink, mode);
        let mut topics = crate::config::RecentTopics::default();
        super::super::message::to_message(&table, &mut row(key), &mut topics)
    }

    fn header<'a>(m: &'a Message, name: &str) -> Option<&'a str> {
        m.headers
            .iter()
            .find(|(n, _)| &**n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn binary_mode_uses_each_bindings_prefix_and_the_message_id() {
        for (sink, prefix) in [("kafka", "ce_"), ("nats", "ce-")] {
            let m = message(sink, "binary", Some("k")).unwrap();
            let h = |a: &str| header(&m, &format!("{prefix}{a}"));
            assert_eq!(h("specversion"), Some("1.0"));
            assert_eq!(h("id"), Some(m.id.as_str()));
            assert_eq!(m.id, "public.outbox:7");
            assert_eq!(h("type"), Some("com.x.a"));
            assert_eq!(h("source"), Some("/shop/k"));
            assert_eq!(h("subject"), Some("k"));
            assert_eq!(h("time"), Some("1970-01-01T00:00:00.000Z"));
            assert_eq!(h("traceparent"), Some("00-1-2-01"));
            assert_eq!(
                m.payload.as_deref(),
                Some(&b"{\"a\":1}"[..]),
                "payload untouched"
            );
        }
    }

    #[test]
    fn a_null_column_in_source_is_a_bad_row_naming_it_and_keeps_the_payload() {
        let table = table("kafka", "structured");
        let mut row = row(None);
        let mut topics = crate::config::RecentTopics::default();
        let e = super::super::message::to_message(&table, &mut row, &mut topics).unwrap_err();
        assert_eq!(e.class, crate::error::ErrorClass::BadRow);
        assert_eq!(
            e.message(),
            "column key used in the cloudevents.source template is NULL"
        );
        assert_eq!(row.payload.as_deref(), Some(&b"{\"a\":1}"[..]));
    }

    #[test]
    fn structured_mode_is_one_json_event_with_the_same_id() {
        let m = message("nats", "structured", Some("k")).unwrap();
        assert_eq!(
            header(&m, "content-type"),
            Some("application/cloudevents+json; charset=UTF-8")
        );
        assert!(m.headers.iter().all(|(n, _)| !n.starts_with("ce-")));
        let e: serde_json::Value = serde_json::from_slice(m.payload.as_deref().unwrap()).unwrap();
        assert_eq!(e["id"], m.id.as_str());
        assert_eq!(e["data"], serde_json::json!({"a": 1}));
        assert_eq!(e["traceparent"], "00-1-2-01");
    }

    #[test]
    fn datacontenttype_from_a_column_is_content_type_in_binary_mode_and_left_out_when_null() {
        let text = "[postgres]\nurl = \"postgres://db/app\"\n[sink]\nkind = \"stdout\"\n\
                    [[tables]]\nname = \"public.outbox\"\nenvelope = \"cloudevents\"\n\
                    [tables.cloudevents]\ntype = \"t\"\nsource = \"s\"\n\
                    datacontenttype = \"{ct}\"\n";
        let config = crate::config::from_str(text, |_| None, Vec::new()).unwrap();
        let table = &config.tables[0];
        for (ct, expected) in [(Some("text/plain"), Some("text/plain")), (None, None)] {
            let mut row = crate::source::claim::ClaimedRow {
                payload: Some(b"x".to_vec()),
                headers: Some(r#"{"Content-Type":"old"}"#.to_owned()),
                topic_values: vec![Some("events.a".to_owned())],
                envelope_values: vec![ct.map(str::to_owned)],
                ..Default::default()
            };
            let mut topics = crate::config::RecentTopics::default();
            let m = super::super::message::to_message(table, &mut row, &mut topics).unwrap();
            let content_types: Vec<&str> = m
                .headers
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case("content-type"))
                .map(|(_, v)| v.as_str())
                .collect();
            match expected {
                Some(ct) => assert_eq!(content_types, [ct], "replaces the row's own"),
                None => assert_eq!(content_types, ["old"], "left as the row had it"),
            }
            assert_eq!(header(&m, "ce_type"), Some("t"));
        }
    }
}
