//! An outbox table ready to relay: its configuration, its statements (built once, from
//! the columns the table really has) and its claim floor.

use super::claim::BucketDepth;
use super::floor::FloorCell;
use super::schema;
use super::sql::TableSql;
use super::{Source, SourceError, Tx};
use crate::config::{Config, TableConfig};

/// An outbox table, ready to relay.
pub struct TablePlan {
    pub(crate) config: TableConfig,
    pub sql: TableSql,
    /// Where claims start (see [`super::floor`]).
    pub(crate) floor: FloorCell,
    /// How many buckets a deep claim asks for at once (see [`super::claim`]).
    pub depth: BucketDepth,
    /// The table's wake-up (`migrate` without `--no-notify`).
    pub(crate) wake: schema::Wakeup,
}

/// Checks every configured table once (columns, types, indexes, privileges) and builds
/// its statements; no retries. A table that cannot be relayed is a
/// [`SourceError::Schema`] listing every problem found; of several, the first in the
/// configuration's order.
pub async fn prepare(source: &Source, config: &Config) -> Result<Vec<TablePlan>, SourceError> {
    prepare_each(source, config)
        .await?
        .into_iter()
        .map(|checked| checked.map_err(SourceError::Schema))
        .collect()
}

/// [`prepare`], each table's outcome on its own, in the configuration's order: its plan,
/// or its problems (one a line). A relay leaves out a table a pattern matched whose check
/// fails, and relays the others. An error is the check's own (the database's answer).
///
/// Every table is checked in one transaction, each kind of question asked of all of them
/// in one statement ([`schema::inspect_all`]): three round trips, whatever the number of
/// tables. (Checked one by one, four at a time, 500 tables cost about 7,000 statements.)
pub(crate) async fn prepare_each(
    source: &Source,
    config: &Config,
) -> Result<Vec<Result<TablePlan, String>>, SourceError> {
    let tables: Vec<&TableConfig> = config.tables.iter().collect();
    let shapes = source
        .in_transaction(async |tx| schema::inspect_all(tx.client(), &tables, &config.relay).await)
        .await?;
    Ok(config
        .tables
        .iter()
        .zip(shapes)
        .map(|(table, shape)| match shape {
            Ok(shape) => Ok(plan(config, table, &shape)),
            Err(problems) => Err(problems.join("\n")),
        })
        .collect())
}

/// `table`'s plan, its statements built for its `shape`.
fn plan(config: &Config, table: &TableConfig, shape: &schema::TableShape) -> TablePlan {
    TablePlan {
        sql: TableSql::new(table, shape, config.relay.ordering, config.relay.batch_size),
        config: table.clone(),
        floor: FloorCell::default(),
        depth: BucketDepth::default(),
        wake: shape.wake,
    }
}

/// Rows of a table waiting for their next attempt.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Waiting {
    /// How many.
    pub(crate) rows: i64,
    /// When the earliest is due: as PostgreSQL prints an interval from now, and in seconds.
    pub(crate) next: Option<(String, f64)>,
}

/// A table's backlog, read like a claim from the floor on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    /// Pending rows.
    pub(crate) rows: i64,
    /// The oldest pending row's age in seconds (0 when none, or without a creation-time
    /// column).
    pub(crate) oldest_seconds: f64,
}

impl TablePlan {
    /// Whether any row is left that a relay could publish now or after a wait: pending,
    /// and (key order) not held back by a dead row.
    pub(crate) async fn has_publishable(&self, tx: &Tx<'_>) -> Result<bool, SourceError> {
        Ok(tx
            .query_one(&self.sql.publishable_exists, &[])
            .await?
            .get(0))
    }

    /// The rows waiting for their next attempt.
    pub(crate) async fn waiting(&self, tx: &Tx<'_>) -> Result<Waiting, SourceError> {
        let row = tx.query_one(&self.sql.waiting, &[]).await?;
        let next = match (
            row.get::<_, Option<String>>(1),
            row.get::<_, Option<f64>>(2),
        ) {
            (Some(text), Some(seconds)) => Some((text, seconds)),
            _ => None,
        };
        Ok(Waiting {
            rows: row.get(0),
            next,
        })
    }

    /// The backlog from the floor on (and below it the stragglers and the rows with a
    /// failure history), at the cost of a claim.
    pub(crate) async fn backlog(&self, tx: &Tx<'_>) -> Result<Backlog, SourceError> {
        let view = self.floor.view();
        let stragglers: &[i64] = &view.stragglers;
        let row = tx
            .query_one(&self.sql.backlog, &[&view.lowest(), &stragglers])
            .await?;
        Ok(Backlog {
            rows: row.get(0),
            oldest_seconds: row.get(1),
        })
    }

    /// Makes the rows postponed for an unavailable destination due now: those whose last
    /// error starts with `mark`, the sink's mark of such a row. Returns how many.
    pub(crate) async fn release_postponed(
        &self,
        tx: &Tx<'_>,
        mark: &str,
    ) -> Result<u64, SourceError> {
        tx.execute(&self.sql.release_postponed, &[&mark]).await
    }
}
