//! The rows the tests insert, and the envelope they configure.

/// A row as inserted, to compare its event with.
#[derive(Debug, Clone)]
pub(super) struct Row {
    pub(super) id: i64,
    pub(super) topic: String,
    pub(super) key: Option<String>,
    pub(super) payload: Option<Vec<u8>>,
    pub(super) traceparent: Option<String>,
    pub(super) created_ms: i64,
}

pub(super) const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Inserts the payload kinds: a JSON object (with a traceparent), bytes that are not
/// JSON, an empty payload; `topic` for all, keys of their own (`<topic>.k<n>`: a dead row
/// holds its key back).
pub(super) async fn insert_kinds(client: &tokio_postgres::Client, topic: &str) -> Vec<Row> {
    let kinds: [(&[u8], Option<&str>); 3] = [
        (br#"{"order":42,"items":["a","b"]}"#, Some(TRACEPARENT)),
        (b"\xff\x00binary \x01", None),
        (b"", None),
    ];
    let mut rows = Vec::new();
    for (n, (payload, traceparent)) in kinds.into_iter().enumerate() {
        let headers = traceparent.map(|t| serde_json::json!({ "traceparent": t }));
        let row = client
            .query_one(
                "INSERT INTO public.outbox (topic, key, payload, headers) \
                 VALUES ($1, $2, $3, $4::text::jsonb) \
                 RETURNING id, floor(extract(epoch FROM created_at) * 1000)::int8",
                &[
                    &topic,
                    &format!("{topic}.k{n}"),
                    &payload,
                    &headers.map(|h| h.to_string()),
                ],
            )
            .await
            .unwrap();
        rows.push(Row {
            id: row.get(0),
            topic: topic.to_owned(),
            key: Some(format!("{topic}.k{n}")),
            payload: Some(payload.to_vec()),
            traceparent: traceparent.map(str::to_owned),
            created_ms: row.get(1),
        });
    }
    rows
}

/// The table option lines of the tests' envelope in `mode`.
pub(super) fn envelope(mode: &str) -> String {
    format!(
        "envelope = \"cloudevents\"\n\
         [tables.cloudevents]\n\
         mode = \"{mode}\"\n\
         type = \"com.example.{{topic}}\"\n\
         source = \"/shop/{{key}}\"\n\
         subject = \"{{key}}\""
    )
}
