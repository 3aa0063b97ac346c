//! Turning a claimed row into a [`Message`]: topic from the template, headers from the
//! JSON column. A row that cannot become a message is a bad row, caught before sending.
//!
//! This runs once per row, so it allocates only what a message owns alone: its id, its
//! headers' values and the names read from the JSON column. A constant topic, the key and
//! the header columns' names are shared (`Arc<str>`), and the headers column is read
//! straight into the message's list, without building a JSON tree first.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use bytes::Bytes;
use serde::de::{self, Deserializer as _, MapAccess, Visitor};

use crate::config::{RecentTopics, TableConfig};
use crate::sink::{Message, SinkError};
use crate::source::claim::ClaimedRow;

/// Builds the message for `row` of `table`. Consumes the payload without copying it; a
/// topic among `topics` (the batch's so far) is shared, not copied.
pub(crate) fn to_message(
    table: &TableConfig,
    row: &mut ClaimedRow,
    topics: &mut RecentTopics,
) -> Result<Message, SinkError> {
    let topic = table
        .topic
        .render_shared(&row.topic_values, topics)
        .map_err(|e| SinkError::bad_row(e.to_string()))?;
    let mut headers = match row.headers.as_deref() {
        None => Vec::new(),
        Some(text) => parse_headers(text).map_err(|e| SinkError::bad_row(e.to_string()))?,
    };
    for ((name, _), value) in table.header_columns.iter().zip(&mut row.header_values) {
        if let Some(value) = value.take() {
            headers.push((name.clone(), value));
        }
    }
    Ok(Message {
        id: message_id(table, row),
        topic,
        key: row.key.clone(),
        payload: row.payload.take().map(Bytes::from),
        headers,
        timestamp_ms: row.created_ms,
    })
}

/// `<schema>.<table>:<id>`, the message id column's value or the order column's, in one
/// allocation.
pub(crate) fn message_id(table: &TableConfig, row: &ClaimedRow) -> String {
    let (schema, name) = (table.name.schema.as_str(), table.name.table.as_str());
    let own = row.message_id.as_deref();
    // An i64 prints in at most 20 characters.
    let mut id = String::with_capacity(schema.len() + name.len() + 2 + own.map_or(20, str::len));
    id.push_str(schema);
    id.push('.');
    id.push_str(name);
    id.push(':');
    match own {
        Some(own) => id.push_str(own),
        None => write!(id, "{}", row.id).expect("writing to a String cannot fail"),
    }
    id
}

/// Why a row's headers column cannot become message headers.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HeadersError {
    /// Not JSON at all.
    #[error("headers column is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// JSON, but not an object of strings (or null).
    #[error("headers must be a JSON object of strings{0}")]
    NotStrings(String),
}

/// Parses the headers column: a JSON object whose values are all strings, or JSON null.
/// Headers keep the object's order; a name given twice keeps its last value.
pub(crate) fn parse_headers(text: &str) -> Result<Vec<(Arc<str>, String)>, HeadersError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let headers = de
        .deserialize_any(HeadersVisitor)
        .and_then(|headers| de.end().map(|()| headers));
    match headers {
        Ok(Ok(headers)) => Ok(headers),
        Ok(Err(wrong)) => Err(HeadersError::NotStrings(wrong)),
        Err(e) => Err(HeadersError::NotJson(e)),
    }
}

/// Reads the object's entries into a list; a well-formed value of the wrong shape is
/// `Ok(Err(what's wrong))`, so only malformed JSON is a JSON error.
struct HeadersVisitor;

type Parsed = Result<Vec<(Arc<str>, String)>, String>;

impl<'de> Visitor<'de> for HeadersVisitor {
    type Value = Parsed;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object of strings, or null")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Parsed, E> {
        Ok(Ok(Vec::new()))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parsed, A::Error> {
        let mut headers: Vec<(Arc<str>, String)> = Vec::with_capacity(map.size_hint().unwrap_or(4));
        let mut wrong = None;
        while let Some(name) = map.next_key::<Name>()? {
            let value = map.next_value::<Value>()?;
            match (value, &wrong) {
                (Value::String(value), None) => {
                    match headers.iter_mut().find(|(n, _)| **n == *name.0) {
                        Some(earlier) => earlier.1 = value,
                        None => headers.push((name.0, value)),
                    }
                }
                (Value::Other(kind), None) => {
                    wrong = Some(format!("; {:?} is {kind}", &*name.0));
                }
                _ => {}
            }
        }
        Ok(wrong.map_or(Ok(headers), Err))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Parsed, E> {
        Ok(Err(", not a boolean".to_owned()))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Parsed, E> {
        Ok(Err(", not a number".to_owned()))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Parsed, E> {
        Ok(Err(", not a number".to_owned()))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Parsed, E> {
        Ok(Err(", not a number".to_owned()))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Parsed, E> {
        Ok(Err(", not a string".to_owned()))
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Parsed, A::Error> {
        while seq.next_element::<de::IgnoredAny>()?.is_some() {}
        Ok(Err(", not an array".to_owned()))
    }
}

/// A header name, allocated once as the shared string the message keeps.
struct Name(Arc<str>);

impl<'de> de::Deserialize<'de> for Name {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Name, D::Error> {
        struct NameVisitor;
        impl Visitor<'_> for NameVisitor {
            type Value = Name;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a header name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Name, E> {
                Ok(Name(Arc::from(v)))
            }
        }
        d.deserialize_str(NameVisitor)
    }
}

/// A header value: a string (taken), or the kind of whatever else it is (skipped).
enum Value {
    String(String),
    Other(&'static str),
}

impl<'de> de::Deserialize<'de> for Value {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        struct ValueVisitor;
        impl<'de> Visitor<'de> for ValueVisitor {
            type Value = Value;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a header value")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
                Ok(Value::String(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
                Ok(Value::String(v))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
                Ok(Value::Other("null"))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Value, E> {
                Ok(Value::Other("a boolean"))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Value, E> {
                Ok(Value::Other("a number"))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Value, E> {
                Ok(Value::Other("a number"))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Value, E> {
                Ok(Value::Other("a number"))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
                while seq.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(Value::Other("an array"))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
                while map
                    .next_entry::<de::IgnoredAny, de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(Value::Other("an object"))
            }
        }
        d.deserialize_any(ValueVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(headers: &[(Arc<str>, String)]) -> Vec<(&str, &str)> {
        headers.iter().map(|(n, v)| (&**n, v.as_str())).collect()
    }

    #[test]
    fn headers_must_be_an_object_of_strings() {
        assert_eq!(
            names(&parse_headers(r#"{"a":"1","b":"2"}"#).unwrap()),
            [("a", "1"), ("b", "2")]
        );
        assert!(parse_headers("null").unwrap().is_empty());
        let e = |text| parse_headers(text).unwrap_err().to_string();
        assert_eq!(
            e(r#"{"a":1}"#),
            r#"headers must be a JSON object of strings; "a" is a number"#
        );
        assert_eq!(
            e(r#"{"a":"x","b":{"c":1}}"#),
            r#"headers must be a JSON object of strings; "b" is an object"#
        );
        assert_eq!(
            e(r#"["a"]"#),
            "headers must be a JSON object of strings, not an array"
        );
        assert_eq!(
            e(r#""a""#),
            "headers must be a JSON object of strings, not a string"
        );
        assert!(e("{").starts_with("headers column is not JSON: "));
        assert!(e(r#"{"a":"1"} x"#).starts_with("headers column is not JSON: "));
        assert!(matches!(
            parse_headers("{").unwrap_err(),
            HeadersError::NotJson(_)
        ));
    }

    #[test]
    fn headers_keep_the_columns_order_and_a_repeated_name_its_last_value() {
        assert_eq!(
            names(&parse_headers(r#"{"z":"1","a":"2","m":"\u00e9\n","a":"3"}"#).unwrap()),
            [("z", "1"), ("a", "3"), ("m", "é\n")]
        );
    }
}
