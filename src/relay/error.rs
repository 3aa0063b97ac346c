//! What ends a run with exit code 1: [`RelayError`], and [`TableFailed`], the first error
//! a worker met that no retry can fix.

use std::fmt;

use super::batch::BatchError;
use crate::ops;
use crate::sink::SinkError;
use crate::source::SourceError;

/// A failure that ends the run (exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// `[http] listen` could not be bound.
    #[error(transparent)]
    Http(#[from] ops::http::BindError),
    /// Trace export is on and its exporter could not be set up.
    #[error(transparent)]
    Tracing(#[from] ops::otel::ExporterError),
    /// The blocking task that sets up the span exporter panicked or was cancelled.
    #[error("starting the span exporter: {0}")]
    TracingTask(#[source] tokio::task::JoinError),
    /// A worker met an error that no retry can fix, and the run stopped.
    #[error(transparent)]
    Table(#[from] TableFailed),
    /// Stopped (drain --timeout, a signal) before a dependency was ever reached.
    #[error("{what} was never reached: {last_error}")]
    Unreachable { what: String, last_error: String },
}

/// The error a worker met on a table that retrying cannot fix (its class is fatal: a
/// missing privilege, a broker refusing the producer), with the table's name: the first
/// one stops the run and is what it reports.
///
/// Its text is `table <schema.table>: <the error>`; its [`source`](std::error::Error::source)
/// is the [`SourceError`] or the [`SinkError`].
#[derive(Debug)]
pub struct TableFailed {
    /// `schema.table`, as the logs name it.
    table: String,
    error: BatchError,
}

impl TableFailed {
    pub(crate) fn new(table: String, error: BatchError) -> TableFailed {
        TableFailed { table, error }
    }

    /// The table, as `schema.table`.
    pub fn table(&self) -> &str {
        &self.table
    }
}

impl fmt::Display for TableFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "table {}: {}", self.table, self.error)
    }
}

impl std::error::Error for TableFailed {
    /// The `SourceError` or `SinkError` itself (`BatchError` is only the choice between them).
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.error {
            BatchError::Source(e) => Some(e),
            BatchError::Sink(e) => Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn a_table_failure_reads_as_before_and_its_source_is_the_sink_error() {
        let refused = SinkError::fatal("Broker: Topic authorization failed");
        let failed = TableFailed::new("public.outbox".into(), BatchError::Sink(refused.clone()));
        let e = RelayError::from(failed);
        assert_eq!(
            e.to_string(),
            "table public.outbox: Broker: Topic authorization failed"
        );
        let source = e.source().and_then(|s| s.downcast_ref::<SinkError>());
        assert_eq!(source, Some(&refused));
    }

    #[tokio::test]
    async fn a_failed_exporter_task_reads_as_before() {
        let task = tokio::spawn(std::future::pending::<()>());
        task.abort();
        let joined = task.await.unwrap_err();
        let said = format!("starting the span exporter: {joined}");
        let e = RelayError::TracingTask(joined);
        assert_eq!(e.to_string(), said);
        assert!(e.source().is_some_and(|s| s.is::<tokio::task::JoinError>()));
    }
}
