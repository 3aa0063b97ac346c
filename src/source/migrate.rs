//! `outbox-relay migrate`: creates or upgrades each configured outbox table.
//!
//! Migrations are the SQL files in `migrations/`, embedded in the binary. Applied versions
//! are recorded per table in `<schema>.outbox_relay_migrations`, so running `migrate` again
//! changes nothing. The transactional part of every migration for one table runs in one
//! transaction, under the statement deadline. Indexes on a table that may already be large
//! and live are built afterwards with `CREATE INDEX CONCURRENTLY`, outside any transaction
//! and without a statement deadline, so the application keeps inserting while they build;
//! an index left invalid by an interrupted build is dropped and built again. A
//! transaction-level advisory lock serializes the transactional part of concurrent
//! `migrate` runs (several sidecars starting at once); the index builds need none (see
//! [`build_concurrently`]). Nothing here drops or rewrites user data. An index the
//! configured relays do not read is not built, and one an earlier run built is dropped
//! `CONCURRENTLY`, writes going on meanwhile: the pending index is built only for
//! `on_publish = "mark"` ([`ClaimIndex::Pending`]), the bucket index only for
//! `ordering = "key"` ([`ClaimIndex::Bucket`]). So run `migrate` with the configuration
//! the relays run with.

use std::fmt;
use std::time::Duration;

use tokio_postgres::Client;

use super::schema::{self, ClaimIndex};
use super::session::{self, SessionLimits, SessionMode};
use super::SourceError;
use crate::config::{Config, Ident, PostgresConfig, RelayConfig, TableConfig};

/// A numbered migration.
pub struct Migration {
    pub(crate) version: i32,
    pub(crate) name: &'static str,
    sql: &'static str,
    /// `CREATE INDEX CONCURRENTLY IF NOT EXISTS` statements run after the transaction, on
    /// every `migrate` (each a no-op once its index is there and valid).
    concurrent_indexes: &'static [ConcurrentIndex],
}

/// Rows are claimed, marked and deleted by their order value: it must be unique. Built
/// only when no valid unique index covers the order column already (the default table's
/// primary key does).
const UNIQUE_ORDER_INDEX: ConcurrentIndex = ConcurrentIndex {
    name: "{{order_index}}",
    sql: "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {{order_index}} ON {{table}} ({{order}})",
    kept: Kept::Always,
};

/// An index built without blocking writes.
struct ConcurrentIndex {
    /// The `{{placeholder}}` its name is rendered from.
    name: &'static str,
    sql: &'static str,
    /// On which tables `migrate` keeps it.
    kept: Kept,
}

/// On which tables `migrate` keeps an index: one the relay's reads can do without is
/// dropped, `CONCURRENTLY` (see [`ClaimIndex`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
    /// On every table.
    Always,
    /// Only for relays whose claims read it: not built for the others, and dropped if an
    /// earlier release or configuration built it.
    ReadBy(ClaimIndex),
    /// On none: an earlier release built it, and something else serves its reads now
    /// (the reason).
    Retired(&'static str),
}

impl Kept {
    /// Why `migrate` drops the index for relays configured as `relay` says (how they
    /// handle published rows, which order they keep), or `None` when it keeps it.
    fn dropped_because(self, relay: &RelayConfig) -> Option<&'static str> {
        match self {
            Kept::Always => None,
            Kept::ReadBy(index) => index.unread_because(relay),
            Kept::Retired(why) => Some(why),
        }
    }
}

/// Every migration, in order. Append only: a released migration never changes.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "create_outbox",
        sql: include_str!("../../migrations/0001_create_outbox.sql"),
        concurrent_indexes: &[
            ConcurrentIndex {
                name: "{{pending_index}}",
                sql: include_str!("../../migrations/0001_pending_index.concurrent.sql"),
                kept: Kept::ReadBy(ClaimIndex::Pending),
            },
            ConcurrentIndex {
                name: "{{dead_index}}",
                sql: include_str!("../../migrations/0001_dead_index.concurrent.sql"),
                kept: Kept::Retired(HELD_ROWS_FIND_THEM),
            },
        ],
    },
    Migration {
        version: 2,
        name: "next_attempt_at",
        sql: include_str!("../../migrations/0002_next_attempt_at.sql"),
        concurrent_indexes: &[ConcurrentIndex {
            name: "{{held_index}}",
            sql: include_str!("../../migrations/0002_held_index.concurrent.sql"),
            kept: Kept::Retired(HELD_ROWS_FIND_THEM),
        }],
    },
    Migration {
        version: 3,
        name: "retry_index",
        sql: include_str!("../../migrations/0003_retry_index.sql"),
        concurrent_indexes: &[ConcurrentIndex {
            name: "{{retry_index}}",
            sql: include_str!("../../migrations/0003_retry_index.concurrent.sql"),
            kept: Kept::Retired(HELD_ROWS_FIND_THEM),
        }],
    },
    Migration {
        version: 4,
        name: "bucket_index",
        sql: include_str!("../../migrations/0004_bucket_index.sql"),
        concurrent_indexes: &[ConcurrentIndex {
            name: "{{bucket_index}}",
            sql: include_str!("../../migrations/0004_bucket_index.concurrent.sql"),
            kept: Kept::ReadBy(ClaimIndex::Bucket),
        }],
    },
    Migration {
        version: 5,
        name: "pauses",
        sql: include_str!("../../migrations/0005_pauses.sql"),
        concurrent_indexes: &[],
    },
    Migration {
        version: 6,
        name: "rates",
        sql: include_str!("../../migrations/0006_rates.sql"),
        concurrent_indexes: &[],
    },
    Migration {
        version: 7,
        name: "sleepers",
        sql: include_str!("../../migrations/0007_sleepers.sql"),
        concurrent_indexes: &[],
    },
    Migration {
        version: 8,
        name: "held_rows",
        sql: include_str!("../../migrations/0008_held_rows.sql"),
        concurrent_indexes: &[],
    },
];

/// Why the dead, held and retry indexes are dropped: migration 0008's table holds the rows
/// they held, and a new row pays for none of it.
const HELD_ROWS_FIND_THEM: &str = "outbox_relay_held finds the held rows";

/// The wake-up's function (`migrations/notify.sql`): no lock on the table.
const NOTIFY_SQL: &str = include_str!("../../migrations/notify.sql");
/// The wake-up: the attempts column's default calls the function.
const NUDGE_SQL: &str = "ALTER TABLE {{table}} ALTER COLUMN {{attempts}} SET DEFAULT \
     {{schema}}.outbox_relay_nudge({{sleeping_literal}}::pg_catalog.regclass, {{payload_literal}})";
/// No wake-up: the attempts column's plain default again.
const DROP_NUDGE_SQL: &str = "ALTER TABLE {{table}} ALTER COLUMN {{attempts}} SET DEFAULT 0";
/// The triggers earlier releases installed for the wake-up.
const DROP_TRIGGERS_SQL: &str = "DROP TRIGGER IF EXISTS outbox_relay_wake ON {{table}};\n\
                                 DROP TRIGGER IF EXISTS outbox_relay_notify ON {{table}};";

/// Serializes concurrent `migrate` runs. A constant, so it needs no hash function.
const MIGRATE_LOCK: i64 = 0x6f75_7462_6f78; // "outbox"
/// How often a `migrate` waiting for another one's index build looks again.
const BUILD_POLL: Duration = Duration::from_millis(500);

/// What `migrate` did to one table.
#[derive(Debug, Default)]
pub struct MigrateReport {
    pub(crate) table: String,
    pub(crate) applied: Vec<String>,
    pub(crate) notify: bool,
}

/// The line `migrate` prints for the table.
impl fmt::Display for MigrateReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let applied = if self.applied.is_empty() {
            "up to date".to_owned()
        } else {
            format!("applied {}", self.applied.join(", "))
        };
        let wake = if self.notify {
            "wake-up installed"
        } else {
            "no wake-up (relays poll)"
        };
        write!(f, "{}: {applied}; {wake}", self.table)
    }
}

/// Why `migrate` stopped (exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The server refused start-up options, as PgBouncer in transaction mode does.
    #[error(
        "{url} is a pooler in transaction mode (it refused start-up options, as PgBouncer \
         does): migrate needs a session of its own (locks, CREATE INDEX CONCURRENTLY): run \
         it against the database directly, e.g. with OUTBOX_RELAY__POSTGRES__URL set to \
         postgres.listen_url"
    )]
    Pooled { url: String },
    #[error("cannot connect to {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: SourceError,
    },
    #[error(
        "cannot connect to {url}: no answer within {limit:?} (postgres.connect_timeout); is \
         it a PostgreSQL server, and is it up?"
    )]
    NoAnswer { url: String, limit: Duration },
    #[error("migrating {table}: {source}")]
    Table {
        table: String,
        #[source]
        source: SourceError,
    },
}

/// `outbox-relay migrate`: brings every configured table up to date, one after the other,
/// and hands each table's report to `done` as it finishes; the first failure stops it.
pub async fn migrate(
    config: &Config,
    notify: bool,
    mut done: impl FnMut(&MigrateReport),
) -> Result<(), MigrateError> {
    let mut client = open_session(&config.postgres).await?;
    let deadline = config.postgres.statement_timeout + super::DEADLINE_MARGIN;
    // Every table a pattern matches now; one created later is set up by running `migrate`
    // again (or by its own migration: docs/configuration.md, "Tables by pattern").
    let config = within(deadline, super::discover::resolve_on(&client, config))
        .await
        .map_err(|source| MigrateError::Table {
            table: "[[tables]] patterns".to_owned(),
            source,
        })?;
    for table in &config.tables {
        let report = migrate_table(&mut client, &config, table, notify, deadline)
            .await
            .map_err(|source| MigrateError::Table {
                table: table.name.to_string(),
                source,
            })?;
        done(&report);
    }
    Ok(())
}

/// A session of its own, directly to PostgreSQL: a pooler in transaction mode is refused,
/// since the advisory lock and `CREATE INDEX CONCURRENTLY` need one server connection
/// throughout. Its connection runs on a task that ends when the client is dropped.
async fn open_session(pg: &PostgresConfig) -> Result<Client, MigrateError> {
    let url = || pg.redacted();
    // The whole connect, TLS and start-up included, at most two attempts (with start-up
    // options, then without): a server that accepts TCP and never answers must not hang a
    // deploy job.
    let limit = 2 * session::attempt_limit(pg);
    let opened = tokio::time::timeout(limit, session::open(pg, SessionLimits::migrate(pg)))
        .await
        .map_err(|_| MigrateError::NoAnswer { url: url(), limit })?;
    match opened {
        Ok((client, connection, SessionMode::Direct)) => {
            tokio::spawn(connection);
            Ok(client)
        }
        Ok((_, _, SessionMode::Pooled)) => Err(MigrateError::Pooled { url: url() }),
        Err(source) => Err(MigrateError::Connect { url: url(), source }),
    }
}

/// Brings `table` (one of `config`'s) up to date for relays that handle published rows as
/// `config` says; installs the wake-up (`migrations/notify.sql`) unless `notify` is false,
/// in which case it removes one left from earlier. Every statement but the concurrent index builds runs
/// within `deadline`.
pub async fn migrate_table(
    client: &mut Client,
    config: &Config,
    table: &TableConfig,
    notify: bool,
    deadline: Duration,
) -> Result<MigrateReport, SourceError> {
    let mut report = within(deadline, migrate_in_transaction(client, table, notify)).await?;
    if !within(deadline, schema::order_is_unique(client, table)).await? {
        build_concurrently(client, table, &UNIQUE_ORDER_INDEX, deadline)
            .await
            .map_err(|e| match e {
                SourceError::Db(db)
                    if db.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) =>
                {
                    SourceError::Schema(format!(
                        "table {}: column {} orders and identifies the rows, so its values must \
                         be unique, and some repeat: {} (fix the duplicates, or map another \
                         column with [tables.columns] order; the invalid index is dropped and \
                         built again by the next migrate)",
                        table.name,
                        table.columns.order,
                        crate::source::describe(&db)
                    ))
                }
                other => other,
            })?;
        report
            .applied
            .push(format!("unique index on {}", table.columns.order));
    }
    for index in MIGRATIONS.iter().flat_map(|m| m.concurrent_indexes) {
        if let Some(why) = index.kept.dropped_because(&config.relay) {
            if drop_concurrently(client, table, index, deadline).await? {
                report.applied.push(format!(
                    "index {} dropped concurrently ({why})",
                    render(index.name, table)
                ));
            }
            continue;
        }
        if build_concurrently(client, table, index, deadline).await? {
            report.applied.push(format!(
                "index {} (built concurrently)",
                render(index.name, table)
            ));
        }
    }
    Ok(report)
}

/// `fut` within `deadline`, or a timeout error.
async fn within<T>(
    deadline: Duration,
    fut: impl std::future::Future<Output = Result<T, SourceError>>,
) -> Result<T, SourceError> {
    tokio::time::timeout(deadline, fut)
        .await
        .map_err(|_| SourceError::Timeout(deadline))?
}

/// The state of an index: absent, valid, invalid, or being built by another session.
#[derive(Debug, PartialEq, Eq)]
enum IndexState {
    Absent,
    Valid,
    Invalid,
    Building,
}

async fn index_state(client: &Client, qualified: &str) -> Result<IndexState, SourceError> {
    let row = client
        .query_one(
            "SELECT (SELECT i.indisvalid FROM pg_catalog.pg_index i \
                     WHERE i.indexrelid = to_regclass($1::text)), \
                    EXISTS (SELECT 1 FROM pg_catalog.pg_stat_progress_create_index p \
                            WHERE p.index_relid = to_regclass($1::text))",
            &[&qualified],
        )
        .await?;
    Ok(
        match (row.get::<_, Option<bool>>(0), row.get::<_, bool>(1)) {
            (_, true) => IndexState::Building,
            (None, false) => IndexState::Absent,
            (Some(true), false) => IndexState::Valid,
            (Some(false), false) => IndexState::Invalid,
        },
    )
}

/// Builds `index` unless it exists and is valid; returns whether it built. An invalid
/// one (a build interrupted earlier) is dropped first; one another `migrate` is building
/// right now is waited for, not dropped. No advisory lock: it would not survive PgBouncer
/// in transaction mode, and `IF NOT EXISTS` plus the state check make two concurrent runs
/// safe. The build has neither a statement nor a lock deadline: CONCURRENTLY waits for
/// every older transaction, and on a large table it takes as long as it takes, without
/// blocking writes.
async fn build_concurrently(
    client: &Client,
    table: &TableConfig,
    index: &ConcurrentIndex,
    deadline: Duration,
) -> Result<bool, SourceError> {
    let qualified = qualified(table, index);
    let mut waiting = false;
    loop {
        match within(deadline, index_state(client, &qualified)).await? {
            IndexState::Valid => return Ok(false),
            IndexState::Building => {
                if !std::mem::replace(&mut waiting, true) {
                    tracing::info!(index = %qualified, "Another session is building this index; waiting");
                }
                tokio::time::sleep(BUILD_POLL).await;
            }
            IndexState::Invalid => {
                tracing::warn!(index = %qualified, "Dropping an index left invalid by an interrupted build");
                drop_index(client, &qualified, deadline).await?;
            }
            IndexState::Absent => break,
        }
    }
    tracing::info!(index = %qualified, "Building index concurrently (writes continue meanwhile)");
    without_deadlines(client, &render(index.sql, table), deadline).await?;
    Ok(true)
}

/// Drops `index` if it is there, valid or not, without blocking writes; returns whether
/// it dropped one. A build another `migrate` runs right now (one configured for mark mode,
/// or of an earlier release) is left to finish: the index is dropped by this table's next
/// `migrate` that does not keep it.
async fn drop_concurrently(
    client: &Client,
    table: &TableConfig,
    index: &ConcurrentIndex,
    deadline: Duration,
) -> Result<bool, SourceError> {
    let qualified = qualified(table, index);
    match within(deadline, index_state(client, &qualified)).await? {
        IndexState::Absent | IndexState::Building => Ok(false),
        IndexState::Valid | IndexState::Invalid => {
            tracing::info!(index = %qualified, "Dropping an index the relay does not need (writes continue meanwhile)");
            drop_index(client, &qualified, deadline).await?;
            Ok(true)
        }
    }
}

/// `index`'s schema-qualified, quoted name on `table`.
fn qualified(table: &TableConfig, index: &ConcurrentIndex) -> String {
    format!(
        "{}.{}",
        table.name.schema.quoted(),
        render(index.name, table)
    )
}

/// `DROP INDEX CONCURRENTLY` of the index `qualified`, without deadlines (it waits for
/// every transaction using the table, as a concurrent build does).
async fn drop_index(
    client: &Client,
    qualified: &str,
    deadline: Duration,
) -> Result<(), SourceError> {
    without_deadlines(
        client,
        &format!("DROP INDEX CONCURRENTLY IF EXISTS {qualified}"),
        deadline,
    )
    .await
}

/// Runs one statement with `statement_timeout` and `lock_timeout` lifted, and restores
/// them whatever happens. One statement per call: a multi-statement string is an
/// implicit transaction block, where CONCURRENTLY is refused.
async fn without_deadlines(
    client: &Client,
    sql: &str,
    deadline: Duration,
) -> Result<(), SourceError> {
    let set = |sql: &'static str| {
        within(
            deadline,
            async move { Ok(client.batch_execute(sql).await?) },
        )
    };
    set("SET statement_timeout = 0").await?;
    set("SET lock_timeout = 0").await?;
    let result = client.batch_execute(sql).await;
    set("RESET lock_timeout").await?;
    set("RESET statement_timeout").await?;
    Ok(result?)
}

/// The versions the ledger `ledger` records as applied to `table_key`, creating the ledger
/// first; a table that no longer `exists` has its rows forgotten.
async fn applied_versions(
    tx: &tokio_postgres::Transaction<'_>,
    ledger: &str,
    table_key: &str,
    exists: bool,
) -> Result<Vec<i32>, SourceError> {
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {ledger} (
             table_name text NOT NULL,
             version integer NOT NULL,
             name text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now(),
             PRIMARY KEY (table_name, version))"
    ))
    .await?;
    if !exists {
        // The table was dropped since an earlier migrate: its ledger rows describe a table
        // that is gone, and would make this run skip creating it.
        tx.execute(
            &format!("DELETE FROM {ledger} WHERE table_name = $1"),
            &[&table_key],
        )
        .await?;
    }
    Ok(tx
        .query(
            &format!("SELECT version FROM {ledger} WHERE table_name = $1"),
            &[&table_key],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Every pending migration's transactional part, and the wake-up, in one transaction.
async fn migrate_in_transaction(
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
    let table_key = name.to_string();
    let applied = applied_versions(&tx, &ledger, &table_key, exists).await?;
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
    // Each change below locks the table against the application's writers (and waits for
    // them): only what differs is changed, so a run that finds it all in place takes no
    // such lock.
    let wake = schema::wake_state(&tx, table).await?;
    if wake.trigger {
        tx.batch_execute(&render(DROP_TRIGGERS_SQL, table)).await?;
    }
    if notify {
        tx.batch_execute(&render(NOTIFY_SQL, table)).await?;
        // The default names the table and its sleep sequence: a renamed table's is set anew.
        let payload = literal(&table.name.to_string());
        if !wake.nudge.is_some_and(|d| d.contains(&payload)) {
            tx.batch_execute(&render(NUDGE_SQL, table)).await?;
        }
    } else if wake.nudge.is_some() {
        // Only the relay's own default goes: a mapped column may have one of its owner's.
        tx.batch_execute(&render(DROP_NUDGE_SQL, table)).await?;
    }
    tx.commit().await?;
    Ok(report)
}

/// Fills the `{{placeholders}}` of a migration with quoted identifiers.
fn render(sql: &str, table: &TableConfig) -> String {
    let index = |suffix: &str| schema::index_name(table, suffix);
    let c = &table.columns;
    let sleeping = crate::source::sleepers::sleeping_of(&table.name);
    let raw = |column: &crate::config::Ident| literal(column.as_str());
    let hold_arguments = [
        literal(&table.name.to_string()),
        raw(&c.order),
        raw(&c.key),
        raw(&c.published_at),
        raw(&c.dead_at),
        raw(&c.next_attempt_at),
    ]
    .join(", ");
    sql.replace("{{sleeping_literal}}", &literal(&sleeping))
        .replace("{{hold_arguments}}", &hold_arguments)
        .replace("{{table_literal}}", &literal(&table.name.to_string()))
        .replace("{{payload_literal}}", &literal(&table.name.to_string()))
        .replace("{{sleeping}}", &sleeping)
        .replace("{{table}}", &table.name.quoted())
        .replace("{{schema}}", &table.name.schema.quoted())
        .replace("{{pending_index}}", &index("pending_idx"))
        .replace("{{dead_index}}", &index("dead_idx"))
        .replace("{{held_index}}", &index("held_idx"))
        .replace("{{retry_index}}", &index("retry_idx"))
        .replace("{{bucket_index}}", &index("bucket_idx"))
        .replace("{{order_index}}", &index("order_key"))
        .replace("{{order}}", &c.order.quoted())
        .replace("{{key}}", &c.key.quoted())
        .replace("{{published_at}}", &c.published_at.quoted())
        .replace("{{attempts}}", &c.attempts.quoted())
        .replace("{{last_error}}", &c.last_error.quoted())
        .replace("{{dead_at}}", &c.dead_at.quoted())
        .replace("{{next_attempt_at}}", &c.next_attempt_at.quoted())
}

/// `text` as an SQL string literal.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Columns, TableName, Template};

    /// A fresh row of a delete-mode table enters the primary key and, for key order, the
    /// bucket index: no index more. Mark mode adds the pending index.
    #[test]
    fn migrate_keeps_only_the_indexes_the_relay_reads() {
        let kept = |on_publish: &str, ordering: &str| -> Vec<&str> {
            let text = format!(
                "[postgres]\nurl = \"postgres://db/app\"\n[sink]\nkind = \"stdout\"\n\
                 [relay]\non_publish = \"{on_publish}\"\nordering = \"{ordering}\"\n\
                 [[tables]]\nname = \"public.outbox\"\n"
            );
            let relay = crate::config::from_str(&text, |_| None, Vec::new())
                .unwrap()
                .relay;
            MIGRATIONS
                .iter()
                .flat_map(|m| m.concurrent_indexes)
                .filter(|i| i.kept.dropped_because(&relay).is_none())
                .map(|i| i.name)
                .collect()
        };
        assert_eq!(kept("delete", "key"), ["{{bucket_index}}"]);
        assert_eq!(
            kept("mark", "key"),
            ["{{pending_index}}", "{{bucket_index}}"]
        );
        assert!(kept("delete", "none").is_empty());
        assert_eq!(kept("mark", "none"), ["{{pending_index}}"]);
    }

    #[test]
    fn placeholders_are_all_replaced_with_quoted_names() {
        let table = TableConfig {
            name: TableName::parse("app.\"Out\"\"box\"").unwrap(),
            entry: 0,
            pattern: None,
            topic: Template::parse("{topic}").unwrap(),
            columns: Columns::default(),
            header_columns: Vec::new(),
            max_rate: None,
            dead_letter_topic: None,
            cloudevents: None,
        };
        for sql in MIGRATIONS
            .iter()
            .flat_map(|m| std::iter::once(m.sql).chain(m.concurrent_indexes.iter().map(|i| i.sql)))
            .chain([UNIQUE_ORDER_INDEX.sql])
            .chain([NOTIFY_SQL, NUDGE_SQL, DROP_NUDGE_SQL, DROP_TRIGGERS_SQL])
        {
            let out = render(sql, &table);
            assert!(!out.contains("{{"), "{out}");
        }
        let out = render(MIGRATIONS[0].concurrent_indexes[0].sql, &table);
        assert!(out.contains("\"app\".\"Out\"\"box\""), "{out}");
        assert!(out.contains("\"Out\"\"box_pending_idx\""), "{out}");
    }
}
