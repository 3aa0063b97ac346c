//! An outbox table ready to relay: its configuration, its statements (built once, from
//! the columns the table really has) and its claim floor.

use super::claim::BucketDepth;
use super::floor::FloorCell;
use super::schema;
use super::sql::TableSql;
use super::{Source, SourceError};
use crate::config::{Config, TableConfig};

/// An outbox table, ready to relay.
pub struct TablePlan {
    pub(crate) config: TableConfig,
    pub sql: TableSql,
    /// Where claims start (see [`super::floor`]).
    pub(crate) floor: FloorCell,
    /// How many buckets a deep claim asks for at once (see [`super::claim`]).
    pub depth: BucketDepth,
    /// The table has the NOTIFY trigger (`migrate` without `--no-notify`), enabled.
    pub(crate) notify: bool,
}

/// Checks every configured table once (columns, types, indexes, privileges) and builds
/// its statements; no retries. A table that cannot be relayed is a
/// [`SourceError::Schema`] listing every problem found.
pub async fn prepare(source: &Source, config: &Config) -> Result<Vec<TablePlan>, SourceError> {
    let mut plans = Vec::new();
    for table in &config.tables {
        let shape = source
            .in_transaction(async |tx| schema::inspect(tx.client(), table, &config.relay).await)
            .await?
            .map_err(|problems| SourceError::Schema(problems.join("\n")))?;
        plans.push(TablePlan {
            sql: TableSql::new(
                table,
                &shape,
                config.relay.ordering,
                config.relay.batch_size,
            ),
            config: table.clone(),
            floor: FloorCell::default(),
            depth: BucketDepth::default(),
            notify: shape.notify,
        });
    }
    Ok(plans)
}
