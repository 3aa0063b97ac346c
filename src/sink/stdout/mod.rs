//! `stdout`: one JSON line per message, for local debugging. A message counts as published
//! once its line was written and flushed.

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use super::{within, Message, SinkError, SinkService};

/// JSON lines on standard output.
pub struct StdoutSink {
    out: Mutex<tokio::io::Stdout>,
}

impl Default for StdoutSink {
    fn default() -> Self {
        Self::new()
    }
}

impl StdoutSink {
    /// A sink writing to the process's standard output.
    pub(crate) fn new() -> StdoutSink {
        StdoutSink {
            out: Mutex::new(tokio::io::stdout()),
        }
    }

    /// Flushes standard output.
    async fn flush(&self) -> Result<(), SinkError> {
        self.out
            .lock()
            .await
            .flush()
            .await
            .map_err(|e| SinkError::transient(format!("stdout: {e}")))
    }
}

impl SinkService for StdoutSink {
    const NAME: &'static str = "stdout";

    /// Lines are written in order.
    fn keeps_order_in_flight(&self) -> bool {
        true
    }

    async fn publish_batch(&self, messages: &[&Message]) -> Vec<Result<(), SinkError>> {
        let mut buf = Vec::new();
        for m in messages {
            serde_json::to_writer(&mut buf, &line(m)).expect("JSON values always serialize");
            buf.push(b'\n');
        }
        let mut out = self.out.lock().await;
        let written = async {
            out.write_all(&buf).await?;
            out.flush().await
        }
        .await;
        let result = written.map_err(|e| SinkError::transient(format!("stdout: {e}")));
        messages.iter().map(|_| result.clone()).collect()
    }

    async fn close(&self, timeout: Duration) -> Result<(), SinkError> {
        within(timeout, self.flush()).await
    }
}

fn line(m: &Message) -> serde_json::Value {
    let headers: serde_json::Map<String, serde_json::Value> = m
        .headers
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::String(v.to_string())))
        .collect();
    // Payloads that are not UTF-8 are shown as a list of bytes rather than mangled; a NULL
    // payload as null.
    let payload = match m.payload.as_deref() {
        None => serde_json::Value::Null,
        Some(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) => serde_json::Value::String(text.to_owned()),
            Err(_) => serde_json::Value::from(bytes.to_vec()),
        },
    };
    serde_json::json!({
        "id": m.id,
        "topic": &*m.topic,
        "key": m.key.as_deref(),
        "headers": headers,
        "payload": payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: Option<&[u8]>) -> Message {
        Message {
            id: "t:1".into(),
            topic: "t".into(),
            key: Some("k".into()),
            payload: payload.map(bytes::Bytes::copy_from_slice),
            headers: vec![],
            timestamp_ms: None,
        }
    }

    #[test]
    fn a_null_payload_is_printed_as_null_and_an_empty_one_as_an_empty_string() {
        assert_eq!(line(&message(None))["payload"], serde_json::Value::Null);
        assert_eq!(line(&message(Some(b"")))["payload"], "");
        assert_eq!(
            line(&message(Some(&[0xff])))["payload"],
            serde_json::json!([255])
        );
    }
}
