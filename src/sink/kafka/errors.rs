//! What a Kafka failure means for the row: retry later, this record is bad, or stop the
//! process; and the topic names Kafka refuses before anything is sent.

use rdkafka::error::RDKafkaErrorCode;

use crate::sink::SinkError;

/// The error of a row whose topic the brokers do not know.
pub(super) fn missing_topic(topic: &str) -> SinkError {
    SinkError::bad_row(format!(
        "topic {topic:?} does not exist on the brokers: create it, or fix the table's topic \
         template (`outbox-relay check` lists what is missing)"
    ))
}

pub(super) enum Class {
    Transient,
    BadRow,
    Fatal,
    MissingTopic,
}

/// What a librdkafka error code means for the row: retry later, this record is bad, or
/// stop the process. Unlisted codes are transient: timeouts, transport failures, leader
/// changes and the like resolve themselves.
pub(super) fn classify_code(code: RDKafkaErrorCode) -> Class {
    use RDKafkaErrorCode as C;
    match code {
        C::MessageSizeTooLarge
        | C::InvalidMessageSize
        | C::InvalidMessage
        | C::InvalidRecord
        | C::InvalidTopic
        | C::MessageBatchTooLarge => Class::BadRow,
        C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed
        | C::SaslAuthenticationFailed
        | C::Authentication
        | C::Fatal
        | C::UnsupportedSASLMechanism
        | C::IllegalSASLState => Class::Fatal,
        C::UnknownTopicOrPartition | C::UnknownTopic => Class::MissingTopic,
        _ => Class::Transient,
    }
}

/// A topic name Kafka accepts: 1 to 249 characters of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub(crate) fn check_topic(topic: &str) -> Result<(), String> {
    if topic.is_empty() || topic.len() > 249 {
        return Err(format!("topic {topic:?} must be 1 to 249 characters"));
    }
    if topic == "." || topic == ".." {
        return Err(format!("topic {topic:?} is not allowed"));
    }
    if let Some(c) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "topic {topic:?} contains {c:?}; Kafka topics use letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_errors_are_classified() {
        use RDKafkaErrorCode as C;
        assert!(matches!(
            classify_code(C::MessageSizeTooLarge),
            Class::BadRow
        ));
        assert!(matches!(classify_code(C::InvalidTopic), Class::BadRow));
        assert!(matches!(
            classify_code(C::TopicAuthorizationFailed),
            Class::Fatal
        ));
        assert!(matches!(
            classify_code(C::MessageTimedOut),
            Class::Transient
        ));
        assert!(matches!(
            classify_code(C::NotLeaderForPartition),
            Class::Transient
        ));
        assert!(matches!(
            classify_code(C::BrokerTransportFailure),
            Class::Transient
        ));
        assert!(matches!(
            classify_code(C::UnknownTopicOrPartition),
            Class::MissingTopic
        ));
    }

    #[test]
    fn topic_names_are_checked_before_sending() {
        assert!(check_topic("orders.created-v1_x").is_ok());
        for bad in ["", ".", "..", "a b", "a/b", "ä", &"x".repeat(250)] {
            assert!(check_topic(bad).is_err(), "{bad:?} accepted");
        }
    }
}
