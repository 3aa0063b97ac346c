//! The one question every error answers: what should the relay do about it?

/// How the relay reacts to a failure. Every module's errors map onto these three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The dependency is unwell (connection reset, timeout, broker unavailable): back off
    /// and try the same rows again later. Does not count against a row's attempts.
    Transient,
    /// This row cannot be published as it is (too large, invalid subject, bad headers):
    /// count an attempt, dead-letter it after `max_attempts`.
    BadRow,
    /// Retrying cannot help (table missing, permission denied): stop the process with a
    /// message that says what to fix.
    Fatal,
}

/// PostgreSQL SQLSTATE codes that no retry can fix.
const FATAL_SQLSTATES: &[&str] = &[
    "28000", // invalid_authorization_specification
    "28P01", // invalid_password
    "3D000", // invalid_catalog_name (database does not exist)
    "3F000", // invalid_schema_name
    "42501", // insufficient_privilege
    "42P01", // undefined_table
    "42703", // undefined_column
    "42804", // datatype_mismatch
    "42883", // undefined_function
];

/// Classifies a PostgreSQL error: SQLSTATEs in [`FATAL_SQLSTATES`] are fatal; everything
/// else (connection loss, statement timeout, serialization failure, shutdown) is transient.
pub fn classify_postgres(e: &tokio_postgres::Error) -> ErrorClass {
    match e.code() {
        Some(code) => classify_sqlstate(code.code()),
        // The server's certificate was refused, or it does not offer the TLS that was
        // asked for: waiting will not fix that, the operator must.
        None if crate::source::tls::explain(&crate::source::describe(e)).is_some() => {
            ErrorClass::Fatal
        }
        None => ErrorClass::Transient, // I/O: connection refused, reset, closed
    }
}

/// The class of a SQLSTATE: [`FATAL_SQLSTATES`] are fatal, every other code (shutdown,
/// statement or lock timeout, serialization failure, too many connections) transient.
pub fn classify_sqlstate(code: &str) -> ErrorClass {
    if FATAL_SQLSTATES.contains(&code) {
        ErrorClass::Fatal
    } else {
        ErrorClass::Transient
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatal_sqlstates_are_well_formed() {
        for code in FATAL_SQLSTATES {
            assert_eq!(code.len(), 5, "{code}");
        }
    }

    #[test]
    fn sqlstates_map_to_classes() {
        use ErrorClass::*;
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
            ("3D000", Fatal, "database does not exist"),
        ] {
            assert_eq!(classify_sqlstate(code), class, "{code} {what}");
        }
    }
}
