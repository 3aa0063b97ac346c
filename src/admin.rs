//! The operator's commands: `status` (backlog, oldest pending age, failing and dead rows
//! per table) and `requeue` (clear `dead_at` and `attempts` so dead rows are tried again).
//!
//! Both read the tables the way the relay does (mapped columns included) and hold no lock
//! longer than one statement. `requeue` then sends the NOTIFY that wakes idle relays.

use std::fmt;
use std::time::Duration;

use crate::config::{Config, TableName};
use crate::relay::{session_limits, try_prepare_tables, TablePlan};
use crate::source::{Source, SourceError};

/// Dead rows listed per table by `status`.
const DEAD_ROWS_SHOWN: i64 = 10;

/// One table's state, as `status` prints it.
#[derive(Debug, Clone)]
pub struct TableStatus {
    pub table: String,
    pub pending: i64,
    /// Pending rows that failed at least once (being retried).
    pub failing: i64,
    pub dead: i64,
    /// Rows kept with `published_at` set (mark mode).
    pub published: i64,
    /// Age of the oldest pending row; `None` when nothing is pending or the table has no
    /// creation-time column.
    pub oldest_pending: Option<Duration>,
    /// The oldest dead rows: id, attempts, dead since, last error.
    pub dead_rows: Vec<DeadRow>,
}

#[derive(Debug, Clone)]
pub struct DeadRow {
    pub id: i64,
    pub attempts: i64,
    pub dead_at: String,
    pub last_error: Option<String>,
}

impl fmt::Display for TableStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let oldest = match self.oldest_pending {
            Some(age) => format!(" (oldest {:.1}s old)", age.as_secs_f64()),
            None => String::new(),
        };
        write!(
            f,
            "{}: {} pending{oldest}, {} failing, {} dead, {} kept as published",
            self.table, self.pending, self.failing, self.dead, self.published
        )?;
        for row in &self.dead_rows {
            let error = row.last_error.as_deref().unwrap_or("(none)");
            // One line per row: errors from brokers can span lines.
            let error: String = error.split_whitespace().collect::<Vec<_>>().join(" ");
            write!(
                f,
                "\n  dead id {}: {} attempts, dead since {}, last error: {error}",
                row.id, row.attempts, row.dead_at
            )?;
        }
        if self.dead > self.dead_rows.len() as i64 {
            write!(
                f,
                "\n  ... and {} more dead rows",
                self.dead - self.dead_rows.len() as i64
            )?;
        }
        Ok(())
    }
}

/// A failure of `status` or `requeue`: bad arguments (exit 2) or the database (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Source(#[from] SourceError),
}

async fn connect(config: &Config) -> Result<(Source, Vec<TablePlan>), AdminError> {
    let source = Source::new(&config.postgres, session_limits(config))?;
    let tables = try_prepare_tables(&source, config).await?;
    Ok((source, tables))
}

/// Every configured table's state.
pub async fn status(config: &Config) -> Result<Vec<TableStatus>, AdminError> {
    let (source, tables) = connect(config).await?;
    let session = source.bounded(source.session()).await?;
    let mut out = Vec::new();
    for table in &tables {
        let (counts, dead) = source
            .bounded(async {
                let counts = session.query_one(&table.sql.status, &[]).await?;
                let dead = session
                    .query(&table.sql.dead_rows, &[&DEAD_ROWS_SHOWN])
                    .await?;
                Ok((counts, dead))
            })
            .await?;
        out.push(TableStatus {
            table: table.config.name.to_string(),
            pending: counts.get(0),
            failing: counts.get(1),
            dead: counts.get(2),
            published: counts.get(3),
            oldest_pending: counts
                .get::<_, Option<f64>>(4)
                .map(|s| Duration::from_secs_f64(s.max(0.0))),
            dead_rows: dead
                .iter()
                .map(|r| DeadRow {
                    id: r.get(0),
                    attempts: r.get(1),
                    dead_at: r.get(2),
                    last_error: r.get(3),
                })
                .collect(),
        });
    }
    Ok(out)
}

/// Which dead rows `requeue` clears.
#[derive(Debug, Clone)]
pub enum Requeue {
    Ids(Vec<i64>),
    All,
}

/// What `requeue` did to one table.
#[derive(Debug, Clone)]
pub struct RequeueReport {
    pub table: String,
    pub requeued: Vec<i64>,
    /// Ids asked for that were not dead-lettered (pending, published or not there).
    pub not_dead: Vec<i64>,
}

/// Clears `dead_at` and `attempts` of the chosen dead rows of `table` (or of the only
/// configured table), in one transaction, and wakes idle relays.
pub async fn requeue(
    config: &Config,
    table: Option<&str>,
    which: Requeue,
) -> Result<RequeueReport, AdminError> {
    let index = match table {
        Some(name) => {
            let wanted = TableName::parse(name)
                .map_err(|e| AdminError::Usage(format!("--table {name}: {e}")))?;
            config
                .tables
                .iter()
                .position(|t| t.name == wanted)
                .ok_or_else(|| {
                    AdminError::Usage(format!(
                        "--table {name}: not in the config; configured: {}",
                        table_list(config)
                    ))
                })?
        }
        None if config.tables.len() == 1 => 0,
        None => {
            return Err(AdminError::Usage(format!(
                "several tables are configured ({}): say which with --table",
                table_list(config)
            )))
        }
    };
    let (source, tables) = connect(config).await?;
    let table = &tables[index];
    let mut session = source.bounded(source.session()).await?;
    let requeued: Vec<i64> = source
        .bounded(async {
            let tx = session.transaction().await?;
            let rows = match &which {
                Requeue::Ids(ids) => tx.query(&table.sql.requeue_ids, &[ids]).await?,
                Requeue::All => tx.query(&table.sql.requeue_all, &[]).await?,
            };
            tx.execute(
                "SELECT pg_notify('outbox_relay', $1)",
                &[&table.config.name.to_string()],
            )
            .await?;
            tx.commit().await?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        })
        .await?;
    let not_dead = match which {
        Requeue::Ids(ids) => ids
            .into_iter()
            .filter(|id| !requeued.contains(id))
            .collect(),
        Requeue::All => Vec::new(),
    };
    let mut requeued = requeued;
    requeued.sort_unstable();
    Ok(RequeueReport {
        table: table.config.name.to_string(),
        requeued,
        not_dead,
    })
}

fn table_list(config: &Config) -> String {
    config
        .tables
        .iter()
        .map(|t| t.name.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
