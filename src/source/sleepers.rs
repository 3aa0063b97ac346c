//! The sleepers table: which relays are asleep on which outbox table, so that the
//! application's commits send a NOTIFY only while one is (migration 0007; the trigger is
//! `migrations/notify.sql`).
//!
//! A NOTIFY makes the committing transaction take one database-wide lock and hold it until
//! its commit record is flushed, so every notifying writer commits alone, one flush each.
//! The trigger therefore notifies only when a row of `<schema>.outbox_relay_sleepers`
//! says that a relay listening on the table is asleep. A relay writes its rows from its
//! pool; a row names the backend pid of its LISTEN session, so rows of a relay that died
//! (its session gone) are recognised and removed. The table is UNLOGGED: its rows are
//! lost with a crash of PostgreSQL, and are not on a standby, which is what a relay that
//! reconnects wants (it arms again). Why this loses no wake-up, and the states a relay
//! walks through, are in `relay::sleep`.

use super::{SourceError, Tx};
use crate::config::TableName;

/// The quoted name of the sleepers table of `table`'s schema.
pub(crate) fn sleepers_of(table: &TableName) -> String {
    super::schema_table(table, "outbox_relay_sleepers")
}

/// The distinct sleepers tables of `tables`, each with the names (as NOTIFY sends them,
/// `schema.table`) of the tables in its schema among `tables`.
fn by_schema<'a>(tables: impl IntoIterator<Item = &'a TableName>) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for table in tables {
        let sleepers = sleepers_of(table);
        match out.iter_mut().find(|(s, _)| *s == sleepers) {
            Some((_, names)) => names.push(table.to_string()),
            None => out.push((sleepers, vec![table.to_string()])),
        }
    }
    out
}

/// Marks `asleep` as asleep and `awake` as awake for the LISTEN session `pid`, in one
/// transaction: a statement per schema and direction. A row already in the wanted state is
/// not written again.
pub(crate) async fn mark(
    tx: &Tx<'_>,
    pid: i32,
    asleep: &[&TableName],
    awake: &[&TableName],
) -> Result<(), SourceError> {
    for (sleepers, names) in by_schema(asleep.iter().copied()) {
        tx.execute(
            &format!(
                "INSERT INTO {sleepers} AS s (table_name, pid, asleep) \
                 SELECT t, $1::int4, true FROM unnest($2::text[]) t \
                 ON CONFLICT (table_name, pid) DO UPDATE SET asleep = true WHERE NOT s.asleep"
            ),
            &[&pid, &names],
        )
        .await?;
    }
    for (sleepers, names) in by_schema(awake.iter().copied()) {
        tx.execute(
            &format!(
                "UPDATE {sleepers} SET asleep = false \
                 WHERE pid = $1::int4 AND table_name = ANY($2::text[]) AND asleep"
            ),
            &[&pid, &names],
        )
        .await?;
    }
    Ok(())
}

/// Removes the rows of `tables`' schemas that belong to no live session (a relay that
/// died, or this one's earlier LISTEN session), and those of the session `pid` when given
/// (this relay's, at exit). A writer that still saw them notified for nothing; a relay's
/// rows never outlive its LISTEN session by more than its successor's first look.
pub(crate) async fn forget(
    tx: &Tx<'_>,
    tables: &[&TableName],
    pid: Option<i32>,
) -> Result<(), SourceError> {
    for (sleepers, _) in by_schema(tables.iter().copied()) {
        tx.execute(
            &format!(
                "DELETE FROM {sleepers} s WHERE s.pid = $1::int4 OR NOT EXISTS \
                 (SELECT FROM pg_catalog.pg_stat_activity a WHERE a.pid = s.pid)"
            ),
            &[&pid.unwrap_or(0)],
        )
        .await?;
    }
    Ok(())
}

/// The first transaction id not yet assigned, as of this statement's snapshot (an
/// `xid8`, as text-free `int8`): every transaction that could have missed a mark committed
/// before this statement has an id below it, or holds a snapshot older than it.
pub(crate) const HORIZON_SQL: &str =
    "SELECT pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())::text::int8";

/// Whether every transaction that might have missed a mark has ended, for a mark
/// followed by [`HORIZON_SQL`]'s answer `$1`: no transaction id below it is still running
/// (a writer in `READ COMMITTED` got its id before its trigger looked), and no session of
/// this database holds a snapshot older than it (a writer in `REPEATABLE READ` looks with
/// its transaction's first snapshot and may get its id later). `usesysid IS NOT NULL`
/// leaves out autovacuum and other background processes, which insert no rows; `pid` and
/// `backend_xmin` are visible to every role.
pub(crate) const SETTLED_SQL: &str = "\
(pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot()) >= $1::int8::text::xid8 \
 AND NOT EXISTS (SELECT FROM pg_catalog.pg_stat_activity a \
     WHERE a.datname = pg_catalog.current_database() AND a.usesysid IS NOT NULL \
       AND a.pid <> pg_catalog.pg_backend_pid() \
       AND pg_catalog.age(a.backend_xmin) > pg_catalog.age(pg_catalog.xid($1::int8::text::xid8))))";

/// Runs [`HORIZON_SQL`].
pub(crate) async fn horizon(tx: &Tx<'_>) -> Result<i64, SourceError> {
    Ok(tx.query_one(HORIZON_SQL, &[]).await?.get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_grouped_by_the_sleepers_table_of_their_schema() {
        let names: Vec<TableName> = ["a.x", "b.y", "a.z"]
            .iter()
            .map(|n| TableName::parse(n).unwrap())
            .collect();
        let grouped = by_schema(&names);
        assert_eq!(grouped.len(), 2);
        assert_eq!(grouped[0].0, "\"a\".\"outbox_relay_sleepers\"");
        assert_eq!(grouped[0].1, vec!["a.x".to_owned(), "a.z".to_owned()]);
        assert_eq!(grouped[1].1, vec!["b.y".to_owned()]);
    }
}
