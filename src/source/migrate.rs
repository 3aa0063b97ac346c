//! `outbox-relay migrate`: creates or upgrades each configured outbox table.
//!
//! Migrations are the SQL files in `migrations/`, embedded in the binary. Applied versions
//! are recorded per table in `<schema>.outbox_relay_migrations`, so running `migrate` again
//! changes nothing. Everything for one table runs in one transaction under a
//! transaction-level advisory lock, so concurrent `migrate` runs (several sidecars
//! starting at once) apply each migration exactly once. Nothing here drops or rewrites
//! user data.

use tokio_postgres::Client;

use super::{schema, SourceError};
use crate::config::{Ident, TableConfig};

/// A numbered migration.
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    sql: &'static str,
}

/// Every migration, in order. Append only: a released migration never changes.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "create_outbox",
    sql: include_str!("../../migrations/0001_create_outbox.sql"),
}];

const NOTIFY_SQL: &str = include_str!("../../migrations/notify.sql");
const DROP_NOTIFY_SQL: &str = "DROP TRIGGER IF EXISTS outbox_relay_notify ON {{table}};";

/// Serializes concurrent `migrate` runs. A constant, so it needs no hash function.
const MIGRATE_LOCK: i64 = 0x6f75_7462_6f78; // "outbox"

/// What `migrate` did to one table.
#[derive(Debug, Default)]
pub struct MigrateReport {
    pub table: String,
    pub applied: Vec<String>,
    pub notify: bool,
}

/// Brings `table` up to date; installs the NOTIFY trigger unless `notify` is false, in
/// which case it removes one left from earlier.
pub async fn migrate_table(
    client: &mut Client,
    table: &TableConfig,
    notify: bool,
) -> Result<MigrateReport, SourceError> {
    let name = &table.name;
    let ledger = format!(
        "{}.{}",
        name.schema.quoted(),
        Ident::parse("outbox_relay_migrations")
            .expect("valid")
            .quoted()
    );
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATE_LOCK])
        .await?;
    let exists: bool = tx
        .query_one(
            "SELECT to_regclass($1::text) IS NOT NULL",
            &[&name.quoted()],
        )
        .await?
        .get(0);
    if !exists && !table.columns.is_default_layout() {
        return Err(SourceError::Schema(format!(
            "table {name} does not exist, and migrate creates only the default outbox \
             layout while this table's [tables.columns] maps other names: create the table \
             (see config/debezium.toml for an example), then run migrate again to add the \
             relay's columns and indexes"
        )));
    }
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {ledger} (
             table_name text NOT NULL,
             version integer NOT NULL,
             name text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now(),
             PRIMARY KEY (table_name, version))"
    ))
    .await?;
    let table_key = name.to_string();
    let applied: Vec<i32> = tx
        .query(
            &format!("SELECT version FROM {ledger} WHERE table_name = $1"),
            &[&table_key],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut report = MigrateReport {
        table: table_key.clone(),
        notify,
        ..Default::default()
    };
    for m in MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)) {
        tx.batch_execute(&render(m.sql, table)).await?;
        tx.execute(
            &format!("INSERT INTO {ledger} (table_name, version, name) VALUES ($1, $2, $3)"),
            &[&table_key, &m.version, &m.name],
        )
        .await?;
        report.applied.push(format!("{:04}_{}", m.version, m.name));
    }
    if !schema::order_is_unique(&tx, table).await? {
        // Rows are claimed, marked and deleted by their order value: it must be unique.
        tx.batch_execute(&render(
            "CREATE UNIQUE INDEX {{order_index}} ON {{table}} ({{order}})",
            table,
        ))
        .await?;
        report
            .applied
            .push(format!("unique index on {}", table.columns.order));
    }
    let trigger_sql = if notify { NOTIFY_SQL } else { DROP_NOTIFY_SQL };
    tx.batch_execute(&render(trigger_sql, table)).await?;
    tx.commit().await?;
    Ok(report)
}

/// Fills the `{{placeholders}}` of a migration with quoted identifiers.
fn render(sql: &str, table: &TableConfig) -> String {
    let index = |suffix: &str| {
        let mut base = format!("{}_{suffix}", table.name.table.as_str());
        // Identifiers are cut at 63 bytes; keep the suffix, which makes the name unique.
        while base.len() > 63 {
            base.remove(0);
        }
        Ident::parse(&format!("\"{}\"", base.replace('"', "\"\"")))
            .expect("a quoted identifier of at most 63 bytes is valid")
            .quoted()
    };
    let c = &table.columns;
    sql.replace("{{table}}", &table.name.quoted())
        .replace("{{schema}}", &table.name.schema.quoted())
        .replace("{{pending_index}}", &index("pending_idx"))
        .replace("{{dead_index}}", &index("dead_idx"))
        .replace("{{order_index}}", &index("order_key"))
        .replace("{{order}}", &c.order.quoted())
        .replace("{{key}}", &c.key.quoted())
        .replace("{{published_at}}", &c.published_at.quoted())
        .replace("{{attempts}}", &c.attempts.quoted())
        .replace("{{last_error}}", &c.last_error.quoted())
        .replace("{{dead_at}}", &c.dead_at.quoted())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Columns, TableName, Template};

    #[test]
    fn placeholders_are_all_replaced_with_quoted_names() {
        let table = TableConfig {
            name: TableName::parse("app.\"Out\"\"box\"").unwrap(),
            topic: Template::parse("{topic}").unwrap(),
            columns: Columns::default(),
            header_columns: Vec::new(),
        };
        for sql in MIGRATIONS
            .iter()
            .map(|m| m.sql)
            .chain([NOTIFY_SQL, DROP_NOTIFY_SQL])
        {
            let out = render(sql, &table);
            assert!(!out.contains("{{"), "{out}");
        }
        let out = render(MIGRATIONS[0].sql, &table);
        assert!(out.contains("\"app\".\"Out\"\"box\""), "{out}");
        assert!(out.contains("\"Out\"\"box_pending_idx\""), "{out}");
    }
}
