//! Message header names: the ones the relay sets itself, and the one rule for any name,
//! used by `[tables.header_columns]` at load and by the NATS sink for a row's headers.

/// The Kafka header that carries the message id (`<table>:<id>`).
pub(crate) const ID_HEADER: &str = "outbox-id";

/// The NATS header JetStream de-duplicates on; it carries the message id.
pub(crate) const NATS_MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Whether `name` may be a header name: printable ASCII, no space, no `:` (what both the
/// NATS and the HTTP header grammars allow).
pub(crate) fn is_valid_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
}

/// Whether the relay sets header `name` itself (compared without case, as NATS and HTTP
/// do), so a configured header must not take it.
pub(crate) fn is_reserved(name: &str) -> bool {
    [ID_HEADER, NATS_MSG_ID_HEADER]
        .iter()
        .any(|reserved| reserved.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relays_own_headers_are_reserved_in_any_case() {
        assert!(is_reserved("outbox-id"));
        assert!(is_reserved("Outbox-Id"));
        assert!(is_reserved("nats-msg-id"));
        assert!(is_reserved("Nats-Msg-Id"));
        assert!(!is_reserved("eventType"));
    }

    #[test]
    fn header_names_are_printable_ascii_without_colons() {
        assert!(is_valid_name("eventType"));
        assert!(is_valid_name("x-trace_id.1"));
        for bad in ["", "a b", "a:b", "ä", "a\tb"] {
            assert!(!is_valid_name(bad), "{bad:?}");
        }
    }
}
