//! Sleep marks: which relays are asleep on which outbox table, so that the application's
//! commits send a NOTIFY only while one is (migration 0007; the wake-up is
//! `migrations/notify.sql`).
//!
//! A NOTIFY makes the committing transaction take one database-wide lock and hold it until
//! its commit record is flushed, so every notifying writer commits alone, one flush each.
//! The wake-up (the attempts column's default) therefore notifies only while the table's
//! *sleep sequence* has a value: it holds 1 + the number of relays asleep on the table,
//! and reads as NULL while none is (`pg_sequence_last_value` of a sequence set with
//! `is_called` false). Its value is read without a snapshot or a query, inlined into the
//! writer's plan, so a writer pays one read a row while no relay sleeps
//! (`docs/writer-cost.md`). The marks behind it are rows of the schema's UNLOGGED
//! `outbox_relay_sleepers`, one per relay and table, naming the backend pid of the relay's
//! LISTEN session, so the marks of a relay that died are recognised and removed. Every
//! change of marks recounts the sequences of the tables it touched, under one advisory
//! lock, in the same transaction: the sequences always follow the committed marks. Why
//! this loses no wake-up, and the states a relay walks through, are in `relay::sleep`.

use super::{SourceError, Tx};
use crate::config::TableName;

/// The quoted name of the sleepers table of `table`'s schema.
pub(crate) fn sleepers_of(table: &TableName) -> String {
    super::schema_table(table, "outbox_relay_sleepers")
}

/// The quoted, schema-qualified name of `table`'s sleep sequence.
pub(crate) fn sleeping_of(table: &TableName) -> String {
    format!(
        "{}.{}",
        table.schema.quoted(),
        super::name_for(table, "sleeping")
    )
}

/// Serializes the relays' changes of marks, so each recount sees every mark committed
/// before it (a constant: "outbox sleep").
const RECOUNT_LOCK: i64 = 0x6f75_7473_6c70;

/// One schema's share of a change: its sleepers table, and the names (as NOTIFY sends
/// them, `schema.table`) and sleep sequences of the tables in it.
struct Schema {
    sleepers: String,
    names: Vec<String>,
    sequences: Vec<String>,
}

/// `tables` grouped by schema.
fn by_schema<'a>(tables: impl IntoIterator<Item = &'a TableName>) -> Vec<Schema> {
    let mut out: Vec<Schema> = Vec::new();
    for table in tables {
        let sleepers = sleepers_of(table);
        let i = match out.iter().position(|s| s.sleepers == sleepers) {
            Some(i) => i,
            None => {
                out.push(Schema {
                    sleepers,
                    names: Vec::new(),
                    sequences: Vec::new(),
                });
                out.len() - 1
            }
        };
        out[i].names.push(table.to_string());
        out[i].sequences.push(sleeping_of(table));
    }
    out
}

/// Sets the sleep sequence of each of `schema`'s tables to 1 + its marks that say asleep,
/// as committed now, and to read as NULL when there are none (the caller holds
/// [`RECOUNT_LOCK`]).
async fn recount(tx: &Tx<'_>, schema: &Schema) -> Result<(), SourceError> {
    let sleepers = &schema.sleepers;
    tx.query(
        &format!(
            "SELECT pg_catalog.setval(s.seq::regclass, 1 + n.asleep, n.asleep > 0) \
             FROM unnest($1::text[], $2::text[]) AS s(name, seq), \
             LATERAL (SELECT count(*) AS asleep FROM {sleepers} m \
                 WHERE m.table_name = s.name AND m.asleep) n"
        ),
        &[&schema.names, &schema.sequences],
    )
    .await?;
    Ok(())
}

/// Takes [`RECOUNT_LOCK`] for the transaction, and lets its commit go without waiting for
/// a flush: the marks are UNLOGGED, and a sequence lost with a crash is recounted by the
/// relay's next look (no mark survives a crash).
async fn lock(tx: &Tx<'_>) -> Result<(), SourceError> {
    tx.execute("SET LOCAL synchronous_commit = off", &[])
        .await?;
    tx.execute(
        "SELECT pg_catalog.pg_advisory_xact_lock($1::int8)",
        &[&RECOUNT_LOCK],
    )
    .await?;
    Ok(())
}

/// Marks `asleep` as asleep and `awake` as awake for the LISTEN session `pid`, and
/// recounts their sleep sequences, in one transaction. A mark already in the wanted state
/// is not written again.
pub(crate) async fn mark(
    tx: &Tx<'_>,
    pid: i32,
    asleep: &[&TableName],
    awake: &[&TableName],
) -> Result<(), SourceError> {
    lock(tx).await?;
    for schema in by_schema(asleep.iter().copied()) {
        let sleepers = &schema.sleepers;
        tx.execute(
            &format!(
                "INSERT INTO {sleepers} AS s (table_name, pid, asleep) \
                 SELECT t, $1::int4, true FROM unnest($2::text[]) t \
                 ON CONFLICT (table_name, pid) DO UPDATE SET asleep = true WHERE NOT s.asleep"
            ),
            &[&pid, &schema.names],
        )
        .await?;
        recount(tx, &schema).await?;
    }
    for schema in by_schema(awake.iter().copied()) {
        let sleepers = &schema.sleepers;
        tx.execute(
            &format!(
                "UPDATE {sleepers} SET asleep = false \
                 WHERE pid = $1::int4 AND table_name = ANY($2::text[]) AND asleep"
            ),
            &[&pid, &schema.names],
        )
        .await?;
        recount(tx, &schema).await?;
    }
    Ok(())
}

/// Removes the marks on `tables` that belong to no live session (a relay that died, or
/// this one's earlier LISTEN session), and those of the session `pid` when given (this
/// relay's, at exit), and recounts the tables' sleep sequences. A relay's marks never
/// outlive its LISTEN session by more than the next look of a relay of the schema.
pub(crate) async fn forget(
    tx: &Tx<'_>,
    tables: &[&TableName],
    pid: Option<i32>,
) -> Result<(), SourceError> {
    lock(tx).await?;
    for schema in by_schema(tables.iter().copied()) {
        let sleepers = &schema.sleepers;
        tx.execute(
            &format!(
                "DELETE FROM {sleepers} s WHERE s.pid = $1::int4 OR NOT EXISTS \
                 (SELECT FROM pg_catalog.pg_stat_activity a WHERE a.pid = s.pid)"
            ),
            &[&pid.unwrap_or(0)],
        )
        .await?;
        recount(tx, &schema).await?;
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
/// (a writer's wake-up gives it its id before it reads the sleep sequence; a prepared
/// transaction keeps its id running until it commits).
pub(crate) const SETTLED_SQL: &str =
    "(pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot()) \
     >= $1::int8::text::xid8)";

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
        assert_eq!(grouped[0].sleepers, "\"a\".\"outbox_relay_sleepers\"");
        assert_eq!(grouped[0].names, vec!["a.x".to_owned(), "a.z".to_owned()]);
        assert_eq!(
            grouped[0].sequences,
            vec![
                "\"a\".\"x_sleeping\"".to_owned(),
                "\"a\".\"z_sleeping\"".to_owned()
            ]
        );
        assert_eq!(grouped[1].names, vec!["b.y".to_owned()]);
    }
}
