//! Turning a claimed row into a [`Message`]: topic from the template, headers from the
//! JSON column, the CloudEvents envelope where the table has one. A row that cannot become a message is a bad row, caught before sending.
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
use crate::sink::{HeaderValue, Message, SinkError};
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
            headers.push((name.clone(), value.into()));
        }
    }
    let mut message = Message {
        id: message_id(table, row),
        topic,
        key: row.key.clone(),
        payload: row.payload.take().map(Bytes::from),
        headers,
        timestamp_ms: row.created_ms,
    };
    if let Some(ce) = &table.cloudevents {
        if let Err(e) = super::envelope::wrap(ce, &mut row.envelope_values, &mut message, topics) {
            // The row is bad: its payload goes back, for the dead-letter topic.
            row.payload = message.payload.take().map(Vec::from);
            return Err(e);
        }
    }
    Ok(message)
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
pub(crate) fn parse_headers(text: &str) -> Result<Vec<(Arc<str>, HeaderValue)>, HeadersError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let column = de
        .deserialize_any(ValueVisitor { column: true })
        .and_then(|value| de.end().map(|()| value));
    match column {
        Ok(Value::Headers(Ok(headers))) => Ok(headers),
        Ok(Value::Headers(Err(wrong))) => Err(HeadersError::NotStrings(wrong)),
        Ok(Value::String(_)) => Err(HeadersError::NotStrings(", not a string".to_owned())),
        Ok(Value::Other(kind)) => Err(HeadersError::NotStrings(format!(", not {kind}"))),
        Err(e) => Err(HeadersError::NotJson(e)),
    }
}

/// The headers column read in one pass, or one of its values: a well-formed value of the
/// wrong shape is a `Value` saying what is wrong, so only malformed JSON is a JSON error.
enum Value {
    /// The column itself, an object (or null): its entries, in order, or what is wrong
    /// with them (the first value that is not a string).
    Headers(Result<Vec<(Arc<str>, HeaderValue)>, String>),
    /// A string (taken).
    String(String),
    /// Anything else: its kind (skipped).
    Other(&'static str),
}

/// Reads the column (`column`: an object is read as headers, null is no headers) or one
/// of its values (an object or null is just another wrong kind).
struct ValueVisitor {
    column: bool,
}

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self.column {
            true => "a JSON object of strings, or null",
            false => "a header value",
        })
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(match self.column {
            true => Value::Headers(Ok(Vec::new())),
            false => Value::Other("null"),
        })
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
        if !self.column {
            while map
                .next_entry::<de::IgnoredAny, de::IgnoredAny>()?
                .is_some()
            {}
            return Ok(Value::Other("an object"));
        }
        let mut headers: Vec<(Arc<str>, HeaderValue)> =
            Vec::with_capacity(map.size_hint().unwrap_or(4));
        let mut wrong = None;
        while let Some(name) = map.next_key::<Name>()? {
            let value = map.next_value::<Value>()?;
            match (value, &wrong) {
                (Value::String(value), None) => {
                    match headers.iter_mut().find(|(n, _)| **n == *name.0) {
                        Some(earlier) => earlier.1 = value.into(),
                        None => headers.push((name.0, value.into())),
                    }
                }
                (Value::Other(kind), None) => {
                    wrong = Some(format!("; {:?} is {kind}", &*name.0));
                }
                _ => {}
            }
        }
        Ok(Value::Headers(wrong.map_or(Ok(headers), Err)))
    }
}

/// A header's value.
impl<'de> de::Deserialize<'de> for Value {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        d.deserialize_any(ValueVisitor { column: false })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn names(headers: &[(Arc<str>, HeaderValue)]) -> Vec<(&str, &str)> {
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
        assert_eq!(
            e("true"),
            "headers must be a JSON object of strings, not a boolean"
        );
        assert_eq!(
            e("1.5"),
            "headers must be a JSON object of strings, not a number"
        );
        assert_eq!(
            e(r#"{"a":null}"#),
            r#"headers must be a JSON object of strings; "a" is null"#
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
