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
    /// The table's wake-up trigger (`migrate` without `--no-notify`).
    pub(crate) wake: schema::WakeTrigger,
}

/// Checks every configured table once (columns, types, indexes, privileges) and builds
/// its statements; no retries. A table that cannot be relayed is a
/// [`SourceError::Schema`] listing every problem found; of several, the first in the
/// configuration's order.
///
/// Up to [`TABLES_AT_ONCE`] tables are checked at once, each on a session of its own: a
/// table's checks wait about four round trips, and a relay of 50 tables 10 ms from its
/// database would otherwise spend 2 s on them before its first claim.
pub async fn prepare(source: &Source, config: &Config) -> Result<Vec<TablePlan>, SourceError> {
    use futures_util::{StreamExt as _, TryStreamExt as _};
    let checks: Vec<_> = config
        .tables
        .iter()
        .map(|table| check(source, config, table))
        .collect();
    futures_util::stream::iter(checks)
        .buffered(TABLES_AT_ONCE)
        .try_collect()
        .await
}

/// Checks `table` on a session of its own and builds its plan.
async fn check(
    source: &Source,
    config: &Config,
    table: &TableConfig,
) -> Result<TablePlan, SourceError> {
    let shape = source
        .in_transaction(async |tx| schema::inspect(tx.client(), table, &config.relay).await)
        .await?
        .map_err(|problems| SourceError::Schema(problems.join("\n")))?;
    Ok(TablePlan {
        sql: TableSql::new(
            table,
            &shape,
            config.relay.ordering,
            config.relay.batch_size,
        ),
        config: table.clone(),
        floor: FloorCell::default(),
        depth: BucketDepth::default(),
        wake: shape.wake,
    })
}

/// How many tables [`prepare`] checks at once: a few sessions, leaving the rest of the
/// smallest pool (`pool_size` may equal `workers`) to the workers' sessions opening
/// meanwhile.
const TABLES_AT_ONCE: usize = 4;
