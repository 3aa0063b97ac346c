//! What to do about a PostgreSQL error, decided from what the error *is*: its SQLSTATE
//! when the server answered, else the type of its cause. (The operator-facing sentence is
//! [`super::describe`]'s business; classification never reads text.)

use std::error::Error as StdError;

use openssl::ssl::ErrorCode;

use crate::error::ErrorClass;

/// SQLSTATE codes that no retry can fix, besides [`FATAL_CLASSES`].
const FATAL_SQLSTATES: &[&str] = &[
    "28000", // invalid_authorization_specification
    "28P01", // invalid_password
    "3D000", // invalid_catalog_name (database does not exist)
    "26000", // invalid_sql_statement_name: a prepared statement a pooler lost (PgBouncer)
    "3F000", // invalid_schema_name
];

/// SQLSTATE classes that no retry can fix: 42, syntax error or access rule violation
/// (insufficient_privilege, undefined_table, undefined_column, datatype_mismatch,
/// undefined_function, syntax_error, ...). The statement, or the schema it names, is
/// wrong, and the same statement gets the same answer: a claim statement with a syntax
/// error used to be retried every few seconds for as long as the relay ran.
const FATAL_CLASSES: &[&str] = &["42"];

/// Codes of a [`FATAL_CLASSES`] class that another attempt can fix: 42P05
/// duplicate_prepared_statement, a pooler's server session still holding a statement of
/// that name from another client (see `source::Tx::typed`); the next transaction may run
/// on another server session.
const TRANSIENT_IN_FATAL_CLASSES: &[&str] = &["42P05"];

/// Classifies a tokio-postgres error.
///
/// - The server answered with a SQLSTATE: [`classify_sqlstate`].
/// - Otherwise the client failed, and its cause says whose fault it is: see
///   [`classify_cause`].
pub(crate) fn classify(e: &tokio_postgres::Error) -> ErrorClass {
    match e.code() {
        Some(code) => classify_sqlstate(code.code()),
        None => classify_cause(e.source()),
    }
}

/// The class of a SQLSTATE: `FATAL_SQLSTATES` and the codes of `FATAL_CLASSES` (but
/// `TRANSIENT_IN_FATAL_CLASSES`) are fatal, every other code (shutdown, statement or lock
/// timeout, serialization failure, too many connections) transient.
pub(crate) fn classify_sqlstate(code: &str) -> ErrorClass {
    let fatal_class = FATAL_CLASSES.iter().any(|class| code.starts_with(class))
        && !TRANSIENT_IN_FATAL_CLASSES.contains(&code);
    if fatal_class || FATAL_SQLSTATES.contains(&code) {
        ErrorClass::Fatal
    } else {
        ErrorClass::Transient
    }
}

/// The class of a client-side failure, from its chain of causes:
///
/// 1. A TLS handshake that OpenSSL refused (`SSL` error code: the certificate failed
///    verification, the host name does not match, no common protocol) is fatal: the
///    operator must fix the certificate or `postgres.url`. Any other OpenSSL outcome (the
///    peer closed, a system call failed) is the network's: transient.
/// 2. An I/O error anywhere in the chain (refused, reset, unreachable) is transient.
/// 3. No cause at all (the connection closed, the connect timeout passed, an unexpected
///    protocol message) is transient.
/// 4. Any other cause is the client refusing what it was given (the server does not
///    offer the TLS `sslmode` requires, a password it needs is missing, a parameter that
///    does not convert): the same attempt gives the same answer, so fatal.
pub(crate) fn classify_cause(cause: Option<&(dyn StdError + 'static)>) -> ErrorClass {
    let Some(first) = cause else {
        return ErrorClass::Transient;
    };
    let mut next = Some(first);
    while let Some(e) = next {
        if let Some(ssl) = e.downcast_ref::<openssl::ssl::Error>() {
            return if ssl.code() == ErrorCode::SSL && ssl.io_error().is_none() {
                ErrorClass::Fatal
            } else {
                ErrorClass::Transient
            };
        }
        if e.is::<std::io::Error>() {
            return ErrorClass::Transient;
        }
        next = e.source();
    }
    ErrorClass::Fatal
}

#[cfg(test)]
mod tests {
    use super::*;
    use ErrorClass::*;

    #[test]
    fn fatal_sqlstates_are_well_formed() {
        for code in FATAL_SQLSTATES.iter().chain(TRANSIENT_IN_FATAL_CLASSES) {
            assert_eq!(code.len(), 5, "{code}");
        }
        for class in FATAL_CLASSES {
            assert_eq!(class.len(), 2, "{class}");
        }
    }

    #[test]
    fn sqlstates_map_to_classes() {
        for (code, class, what) in [
            ("57P01", Transient, "admin_shutdown (server restarting)"),
            ("57P03", Transient, "cannot_connect_now (starting up)"),
            ("53300", Transient, "too_many_connections"),
            ("57014", Transient, "query_canceled (statement_timeout)"),
            ("55P03", Transient, "lock_not_available (lock_timeout)"),
            ("40001", Transient, "serialization_failure"),
            ("40P01", Transient, "deadlock_detected"),
            ("25P03", Transient, "idle_in_transaction_session_timeout"),
            ("08006", Transient, "connection_failure"),
            ("28P01", Fatal, "invalid_password"),
            ("42501", Fatal, "insufficient_privilege"),
            ("42P01", Fatal, "undefined_table"),
            ("42703", Fatal, "undefined_column"),
            ("42804", Fatal, "datatype_mismatch"),
            ("42883", Fatal, "undefined_function"),
            ("42601", Fatal, "syntax_error"),
            (
                "42P05",
                Transient,
                "duplicate_prepared_statement (a pooler's)",
            ),
            ("3D000", Fatal, "database does not exist"),
            ("3F000", Fatal, "invalid_schema_name"),
            (
                "26000",
                Fatal,
                "invalid_sql_statement_name (a pooler lost it)",
            ),
        ] {
            assert_eq!(classify_sqlstate(code), class, "{code} {what}");
        }
    }

    /// An error that wraps another, as tokio-postgres and postgres-openssl wrap theirs.
    #[derive(Debug)]
    struct Wrapping(Box<dyn StdError + Send + Sync>);

    impl std::fmt::Display for Wrapping {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("wrapping")
        }
    }

    impl StdError for Wrapping {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&*self.0)
        }
    }

    #[test]
    fn client_failures_are_classified_by_the_type_of_their_cause() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let wrapped_io = Wrapping(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        let no_tls: Box<dyn StdError + Send + Sync> = "server does not support TLS".into();
        let wrapped_refusal = Wrapping("password missing".into());
        let stack = openssl::error::ErrorStack::get(); // the client's own TLS setup failed
        for (cause, class, what) in [
            (None, Transient, "closed, or timed out"),
            (
                Some(&refused as &(dyn StdError + 'static)),
                Transient,
                "I/O",
            ),
            (Some(&wrapped_io as _), Transient, "I/O under a wrapper"),
            (Some(&*no_tls as _), Fatal, "TLS required, not offered"),
            (Some(&wrapped_refusal as _), Fatal, "the client refuses"),
            (Some(&stack as _), Fatal, "TLS set-up"),
        ] {
            assert_eq!(classify_cause(cause), class, "{what}");
        }
    }
}
