//! What a JetStream failure means for the row: retry later, or this row is bad (see the
//! module doc of [`super`] for whose fault a failed publish is); and the subjects a message
//! may not be published to, refused before anything is sent.

use async_nats::jetstream::context::PublishErrorKind;

use crate::error::ErrorClass;
use crate::sink::SinkError;

/// JetStream API error: message larger than the stream's `max_msg_size`.
const JS_MESSAGE_SIZE_EXCEEDS: u64 = 10054;

/// The error of a row whose subject this user may not publish to.
pub(super) fn denied_error(subject: &str) -> SinkError {
    SinkError::bad_row(format!(
        "the NATS server denies this user permission to publish to {subject:?}: allow it in \
         the user's publish permissions, or fix the table's topic template"
    ))
}

/// The subject of a server error `Permissions Violation for Publish to "<subject>"`.
pub(super) fn denied_subject(error: &str) -> Option<String> {
    const MARK: &str = "permissions violation for publish to ";
    let at = error.to_ascii_lowercase().find(MARK)? + MARK.len();
    let subject = error[at..].trim().trim_matches(|c| c == '"' || c == '\'');
    (!subject.is_empty()).then(|| subject.to_owned())
}

/// The class of a JetStream publish failure: the row's own size is its fault; a missing
/// stream, a timeout, a lost connection or a broker error are the broker's (retried).
pub(crate) fn classify_publish(kind: PublishErrorKind, js_code: Option<u64>) -> ErrorClass {
    match kind {
        PublishErrorKind::MaxPayloadExceeded => ErrorClass::BadRow,
        PublishErrorKind::Other if js_code == Some(JS_MESSAGE_SIZE_EXCEEDS) => ErrorClass::BadRow,
        _ => ErrorClass::Transient,
    }
}

/// A subject a message may be published to: dot-separated tokens, none empty, no
/// wildcards, no white space.
pub(crate) fn check_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty() {
        return Err("the subject is empty".to_owned());
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("subject {subject:?} contains white space"));
    }
    for token in subject.split('.') {
        match token {
            "" => return Err(format!("subject {subject:?} has an empty token")),
            "*" | ">" => {
                return Err(format!(
                    "subject {subject:?} contains a wildcard; messages need a literal subject"
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_checked_before_sending() {
        assert!(check_subject("orders.created").is_ok());
        for bad in ["", "a..b", ".a", "a.", "a b", "a.*", "a.>", "a\tb"] {
            assert!(check_subject(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn publish_errors_map_to_classes() {
        use ErrorClass::*;
        for (kind, code, class) in [
            (PublishErrorKind::MaxPayloadExceeded, None, BadRow),
            (
                PublishErrorKind::Other,
                Some(JS_MESSAGE_SIZE_EXCEEDS),
                BadRow,
            ),
            (PublishErrorKind::Other, Some(10_077), Transient), // maximum messages exceeded
            (PublishErrorKind::StreamNotFound, None, Transient),
            (PublishErrorKind::TimedOut, None, Transient),
            (PublishErrorKind::BrokenPipe, None, Transient),
            (PublishErrorKind::WrongLastSequence, None, Transient),
        ] {
            assert_eq!(classify_publish(kind, code), class, "{kind:?} {code:?}");
        }
    }

    #[test]
    fn a_denied_publish_names_its_subject() {
        assert_eq!(
            denied_subject("Permissions Violation for Publish to \"orders.secret\""),
            Some("orders.secret".to_owned())
        );
        assert_eq!(
            denied_subject("permissions violation for publish to 'a.b'"),
            Some("a.b".to_owned())
        );
        assert_eq!(
            denied_subject("Permissions Violation for Subscription to \"x\""),
            None
        );
        assert_eq!(denied_subject("maximum payload exceeded"), None);
    }
}
