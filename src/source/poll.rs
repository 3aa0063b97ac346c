//! One statement over many tables, built and bound here: the poller's (`relay::sleep`,
//! rule 3), which tables may hold a row a claim would take and whether the sleep marks up
//! to a horizon are settled ([`super::sleepers`]); and [`any_rows`], which tables hold
//! any row at all (`drain`'s looks).

use super::sleepers::SETTLED_SQL;
use super::sql::TableSql;
use super::{SourceError, Tx};

/// The poller's question over a set of tables (`relay::sleep`, rule 3), built once: which
/// of them may hold a row a claim would take ([`TableSql::claimable`]), without and with
/// whether the marks up to a horizon are settled ([`SETTLED_SQL`]).
pub(crate) struct Poll {
    plain: String,
    settle: String,
}

impl Poll {
    pub(crate) fn new<'a>(tables: impl ExactSizeIterator<Item = &'a TableSql>) -> Poll {
        let n = tables.len();
        let claimable = tables
            .enumerate()
            .map(|(t, sql)| sql.claimable(t + 1))
            .collect::<Vec<_>>()
            .join(", ");
        let settled = SETTLED_SQL.replace("$1", &format!("${}", n + 1));
        Poll {
            plain: format!("SELECT ARRAY[{claimable}]::bool[], NULL::bool"),
            settle: format!("SELECT ARRAY[{claimable}]::bool[], {settled}"),
        }
    }

    /// Asks, from each table's floor in `floors` (in the tables' order) on, which tables
    /// may hold a row a claim would take; with `horizon`, also whether every transaction
    /// that might have missed a mark made before it has ended.
    pub(crate) async fn ask(
        &self,
        tx: &Tx<'_>,
        floors: &[i64],
        horizon: Option<i64>,
    ) -> Result<(Vec<bool>, Option<bool>), SourceError> {
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = floors
            .iter()
            .map(|f| f as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        let sql = match &horizon {
            Some(x) => {
                params.push(x);
                &self.settle
            }
            None => &self.plain,
        };
        let row = tx.query_one(sql, &params).await?;
        Ok((row.get(0), row.get(1)))
    }
}

/// Which of `tables` hold any row at all ([`TableSql::any_row`]), in their order, in one
/// statement.
pub(crate) async fn any_rows<'a>(
    tx: &Tx<'_>,
    tables: impl Iterator<Item = &'a TableSql>,
) -> Result<Vec<bool>, SourceError> {
    let any = tables
        .map(|sql| sql.any_row.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let row = tx
        .query_one(&format!("SELECT ARRAY[{any}]::bool[]"), &[])
        .await?;
    Ok(row.get(0))
}
