//! The one question every error answers: what should the relay do about it? Each module
//! maps its own errors onto [`ErrorClass`]: PostgreSQL's in `source::class`,
//! each sink's beside its client.

/// How the relay reacts to a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorClass {
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
