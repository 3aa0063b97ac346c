//! Pausing a table for every relay (`outbox-relay pause`/`resume`, the bad-row valve).
//!
//! The state lives in PostgreSQL, in `<schema>.outbox_relay_pauses` (migration 0005): a
//! row there pauses its table, deleting it resumes the table. So a pause reaches every
//! relay of the table wherever it runs (other pods, other VMs), survives their restarts,
//! and needs no lock a pooler could break. Each relay reads the rows of its tables every
//! [`POLL`] and stops claiming from a paused table; batches already claimed finish. The
//! read is one statement for all tables (a few rows at most), so a relay pays one short
//! transaction per poll whatever number of tables it watches.

use std::time::Duration;

use super::{SourceError, Tx};
use crate::config::TableName;

/// How often a relay reads the pause state: "within about a second" (contract section 3).
pub(crate) const POLL: Duration = Duration::from_millis(500);

/// Why and since when a table is paused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paused {
    /// When, as PostgreSQL prints a `timestamptz`.
    pub(crate) since: String,
    /// Who: `outbox-relay pause` with the user and host it ran as, or the bad-row valve.
    pub(crate) by: String,
    /// The operator's `--reason`, or what the valve saw; may be empty.
    pub(crate) reason: String,
}

impl std::fmt::Display for Paused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "paused since {} by {}", self.since, self.by)?;
        if !self.reason.is_empty() {
            write!(f, ": {}", self.reason)?;
        }
        Ok(())
    }
}

/// The quoted name of the pause table of `table`'s schema.
pub(crate) fn pauses_of(table: &TableName) -> String {
    super::schema_table(table, "outbox_relay_pauses")
}

/// A pause read as `(paused_at, paused_by, reason)` from column `first` on.
fn paused_from(row: &tokio_postgres::Row, first: usize) -> Paused {
    Paused {
        since: row.get(first),
        by: row.get(first + 1),
        reason: row.get(first + 2),
    }
}

/// One statement that reads the pause rows of `tables`: `(table_name, paused_at, by,
/// reason)`, for the tables among them that are paused.
pub(crate) fn read_sql(tables: &[TableName]) -> String {
    let mut schemas: Vec<String> = tables.iter().map(pauses_of).collect();
    schemas.sort();
    schemas.dedup();
    schemas
        .iter()
        .map(|p| {
            format!(
                "SELECT table_name, date_trunc('second', paused_at)::text, paused_by, reason FROM {p} \
                 WHERE table_name = ANY($1::text[])"
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ")
}

/// A pause table that is not there yet: the database was not migrated to this release.
fn missing(e: SourceError) -> SourceError {
    match &e {
        SourceError::Db(db)
            if db.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) =>
        {
            SourceError::Schema(format!(
                "{e}: the pause state table (outbox_relay_pauses, migration 0005) is missing: \
                 run `outbox-relay migrate` as the table's owner"
            ))
        }
        _ => e,
    }
}

/// The pause state of each of `tables`, in their order, read with `sql` ([`read_sql`]).
pub(crate) async fn read(
    tx: &Tx<'_>,
    sql: &str,
    tables: &[TableName],
) -> Result<Vec<Option<Paused>>, SourceError> {
    let names: Vec<String> = tables.iter().map(ToString::to_string).collect();
    let rows = tx.query(sql, &[&names]).await.map_err(missing)?;
    Ok(names
        .iter()
        .map(|name| {
            rows.iter()
                .find(|r| r.get::<_, &str>(0) == name)
                .map(|r| paused_from(r, 1))
        })
        .collect())
}

/// Pauses `table`: `Ok(None)` when it was not paused before, else the pause already in
/// place (left as it is: its time, author and reason stay true).
pub(crate) async fn pause(
    tx: &Tx<'_>,
    table: &TableName,
    by: &str,
    reason: &str,
) -> Result<Option<Paused>, SourceError> {
    let p = pauses_of(table);
    let name = table.to_string();
    let inserted = tx
        .execute(
            &format!(
                "INSERT INTO {p} (table_name, paused_by, reason) VALUES ($1, $2, $3) \
                 ON CONFLICT (table_name) DO NOTHING"
            ),
            &[&name, &by, &reason],
        )
        .await
        .map_err(missing)?;
    if inserted == 1 {
        return Ok(None);
    }
    let row = tx
        .query_one(
            &format!("SELECT date_trunc('second', paused_at)::text, paused_by, reason FROM {p} WHERE table_name = $1"),
            &[&name],
        )
        .await?;
    Ok(Some(paused_from(&row, 0)))
}

/// Resumes `table`: the pause it ended, `None` when it was not paused. Wakes idle relays
/// (the NOTIFY the wake-up sends), so they claim at once rather than at their next look.
pub(crate) async fn resume(tx: &Tx<'_>, table: &TableName) -> Result<Option<Paused>, SourceError> {
    let name = table.to_string();
    let rows = tx
        .query(
            &format!(
                "DELETE FROM {} WHERE table_name = $1 \
                 RETURNING date_trunc('second', paused_at)::text, paused_by, reason",
                pauses_of(table)
            ),
            &[&name],
        )
        .await
        .map_err(missing)?;
    tx.execute("SELECT pg_notify('outbox_relay', $1)", &[&name])
        .await?;
    Ok(rows.first().map(|r| paused_from(r, 0)))
}

/// Who is pausing: `outbox-relay pause (user@host)`.
pub(crate) fn by_operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| user_of_process());
    format!("outbox-relay pause ({user}@{})", host())
}

/// Who is pausing when the bad-row valve does: `bad-row valve (host, pid N)`.
pub(crate) fn by_valve() -> String {
    format!("bad-row valve ({}, pid {})", host(), std::process::id())
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown host".to_owned())
}

/// The process's user name from `/etc/passwd`, else `uid N` (`kubectl exec` and
/// containers often set no `USER`).
fn user_of_process() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let Some(uid) = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
    else {
        return "unknown user".to_owned();
    };
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.get(2) == Some(&uid))
        .and_then(|f| f.first().map(|n| (*n).to_owned()))
        .unwrap_or_else(|| format!("uid {uid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_read_covers_every_schema_once() {
        let tables: Vec<TableName> = ["public.a", "public.b", "\"Other\".c"]
            .iter()
            .map(|t| TableName::parse(t).unwrap())
            .collect();
        let sql = read_sql(&tables);
        assert_eq!(sql.matches("UNION ALL").count(), 1, "{sql}");
        assert!(sql.contains("\"Other\".\"outbox_relay_pauses\""), "{sql}");
        assert!(sql.contains("\"public\".\"outbox_relay_pauses\""), "{sql}");
    }

    #[test]
    fn a_pause_reads_as_who_since_when_and_why() {
        let p = Paused {
            since: "2026-11-25 01:00:00+00".into(),
            by: "outbox-relay pause (sre@vm1)".into(),
            reason: "consumer maintenance".into(),
        };
        assert_eq!(
            p.to_string(),
            "paused since 2026-11-25 01:00:00+00 by outbox-relay pause (sre@vm1): consumer maintenance"
        );
    }
}
