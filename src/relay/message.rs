//! Turning a claimed row into a [`Message`]: topic from the template, headers from the
//! JSON column. A row that cannot become a message is a bad row, caught before sending.

use bytes::Bytes;

use crate::config::TableConfig;
use crate::sink::{Message, SinkError};
use crate::source::claim::ClaimedRow;

/// Builds the message for `row` of `table`. Consumes the payload without copying it.
pub(crate) fn to_message(table: &TableConfig, row: &mut ClaimedRow) -> Result<Message, SinkError> {
    let topic = table
        .topic
        .render(&row.topic_values)
        .map_err(SinkError::bad_row)?;
    let mut headers = match row.headers.as_deref() {
        None => Vec::new(),
        Some(text) => parse_headers(text).map_err(SinkError::bad_row)?,
    };
    for ((name, _), value) in table.header_columns.iter().zip(&mut row.header_values) {
        if let Some(value) = value.take() {
            headers.push((name.clone(), value));
        }
    }
    let id = match &row.message_id {
        Some(id) => format!("{}:{id}", table.name),
        None => format!("{}:{}", table.name, row.id),
    };
    Ok(Message {
        id,
        topic,
        key: row.key.clone(),
        payload: row.payload.take().map(Bytes::from),
        headers,
        timestamp_ms: row.created_ms,
    })
}

/// Parses the headers column: a JSON object whose values are all strings, or JSON null.
pub(crate) fn parse_headers(text: &str) -> Result<Vec<(String, String)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("headers column is not JSON: {e}"))?;
    match value {
        serde_json::Value::Null => Ok(Vec::new()),
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(name, value)| match value {
                serde_json::Value::String(s) => Ok((name, s)),
                other => Err(format!(
                    "headers must be a JSON object of strings; {name:?} is {}",
                    json_kind(&other)
                )),
            })
            .collect(),
        other => Err(format!(
            "headers must be a JSON object of strings, not {}",
            json_kind(&other)
        )),
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_must_be_an_object_of_strings() {
        assert_eq!(
            parse_headers(r#"{"a":"1","b":"2"}"#).unwrap(),
            vec![("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        assert!(parse_headers("null").unwrap().is_empty());
        assert!(parse_headers(r#"{"a":1}"#)
            .unwrap_err()
            .contains("\"a\" is a number"));
        assert!(parse_headers(r#"["a"]"#).unwrap_err().contains("an array"));
    }
}
