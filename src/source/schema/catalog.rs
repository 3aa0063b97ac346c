//! The catalog's answers for every table at once: one statement per kind of question
//! (see the parent module), each turned back into each table's problems.
//!
//! Each statement asks its question of every element of its `text[]` parameters (all of
//! one length), and answers one row per element, in their order (`q.n`), except
//! [`COLUMNS_SQL`] (a row per column). Names are quoted identifiers, looked up with
//! `to_regclass`: NULL, not an error, for a relation that does not exist.

use std::collections::HashMap;

use tokio_postgres::{GenericClient, Row};

use super::super::{ask_each, SourceError};
use super::{by_table, claim_indexes, index_name, merge, Found, Wakeup};
use crate::config::{Ident, OnPublish, RelayConfig, TableConfig};

/// Whether each schema `$1` exists (NULL when it does not) and this role may use it
/// (looked up in the catalog, so a schema this role cannot use is reported, not raised as
/// an error).
const SCHEMAS_SQL: &str = "\
SELECT has_schema_privilege(s.oid, 'USAGE')
  FROM unnest($1::text[]) WITH ORDINALITY AS q(name, n)
  LEFT JOIN pg_catalog.pg_namespace s ON s.nspname = q.name
 ORDER BY q.n";

/// The columns of each table `$1` with their types: `(n, column, type)`, `n` the table's
/// place from 1; none for a table that does not exist.
const COLUMNS_SQL: &str = "\
SELECT q.n, a.attname::text, t.typname::text
  FROM unnest($1::text[]) WITH ORDINALITY AS q(name, n)
  JOIN pg_catalog.pg_attribute a ON a.attrelid = to_regclass(q.name)
  JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
 WHERE a.attnum > 0 AND NOT a.attisdropped
 ORDER BY q.n";

/// Whether a valid unique index (not partial, not on an expression) of table `$1` covers
/// exactly column `$2`.
const UNIQUE_SQL: &str = "\
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_index i
    JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
    WHERE i.indrelid = to_regclass(q.name) AND i.indisunique AND i.indisvalid
      AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL AND a.attname = q.col)
  FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS q(name, col, n)
 ORDER BY q.n";

/// Whether each index `$1` exists (NULL when it does not) and is valid.
const INDEXES_SQL: &str = "\
SELECT (SELECT i.indisvalid FROM pg_catalog.pg_index i WHERE i.indexrelid = to_regclass(q.name))
  FROM unnest($1::text[]) WITH ORDINALITY AS q(name, n)
 ORDER BY q.n";

/// How many of the triggers that keep `outbox_relay_held` (migration 0008) each table `$1`
/// has, enabled.
const HOLD_TRIGGERS_SQL: &str = "\
SELECT (SELECT count(*) FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid = to_regclass(q.name) AND t.tgenabled <> 'D'
           AND t.tgname IN ('outbox_relay_hold', 'outbox_relay_hold_delete',
                            'outbox_relay_hold_truncate'))::int4
  FROM unnest($1::text[]) WITH ORDINALITY AS q(name, n)
 ORDER BY q.n";

/// Whether each relation `$1` exists, and which of [`TABLE_PRIVILEGES`] this role holds
/// on it (false when it does not exist).
const RELATIONS_SQL: &str = "\
SELECT r.rel IS NOT NULL,
       COALESCE(has_table_privilege(r.rel, 'SELECT'), false),
       COALESCE(has_table_privilege(r.rel, 'INSERT'), false),
       COALESCE(has_table_privilege(r.rel, 'UPDATE'), false),
       COALESCE(has_table_privilege(r.rel, 'DELETE'), false)
  FROM unnest($1::text[]) WITH ORDINALITY AS q(name, n)
 CROSS JOIN LATERAL (SELECT to_regclass(q.name) AS rel) r
 ORDER BY q.n";

/// The privileges [`RELATIONS_SQL`] answers for, in its columns' order after the first.
const TABLE_PRIVILEGES: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

/// Whether this role may update column `$2` of table `$1` (which has it).
const COLUMN_PRIVILEGES_SQL: &str = "\
SELECT has_column_privilege(to_regclass(q.name), q.col, 'UPDATE')
  FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS q(name, col, n)
 ORDER BY q.n";

/// The column defaults (`pg_attrdef` oids) that call `outbox_relay_nudge`: the wake-up
/// `migrate` installs (`migrations/notify.sql`). Uncorrelated, so PostgreSQL computes the
/// set once a statement and hashes it; asked per table as a correlated `EXISTS`, it
/// planned a join of every table's default against every nudge default, which grew with
/// the square of the tables a relay has.
macro_rules! nudges {
    () => {
        "SELECT p.objid FROM pg_catalog.pg_depend p
           JOIN pg_catalog.pg_proc f ON f.oid = p.refobjid
          WHERE p.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass
            AND p.refclassid = 'pg_catalog.pg_proc'::pg_catalog.regclass
            AND f.proname = 'outbox_relay_nudge'"
    };
}

/// For `migrate`: whether table `$1` has a trigger of an earlier release's wake-up, and the
/// default of its column `$2` when that is the wake-up (as PostgreSQL prints it).
const WAKE_STATE_SQL: &str = concat!(
    "\
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                WHERE tgrelid = to_regclass($1::text)
                  AND tgname IN ('outbox_relay_wake', 'outbox_relay_notify')),
       (SELECT pg_catalog.pg_get_expr(d.adbin, d.adrelid)
          FROM pg_catalog.pg_attrdef d
          JOIN pg_catalog.pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
         WHERE d.adrelid = to_regclass($1::text) AND a.attname = $2 AND d.oid IN (",
    nudges!(),
    "))"
);

/// The wake-ups of table `$1` (the default, as `outbox_relay_nudge`, and the triggers of
/// earlier releases, enabled), and whether this role may keep its sleep marks in table
/// `$2` with sequence `$3`.
const WAKE_SQL: &str = concat!(
    "\
SELECT ARRAY(SELECT tgname::text FROM pg_catalog.pg_trigger
              WHERE tgrelid = to_regclass(q.name)
                AND tgname IN ('outbox_relay_wake', 'outbox_relay_notify')
                AND tgenabled <> 'D'
             UNION ALL
             SELECT 'outbox_relay_nudge'
              WHERE to_regclass(q.name) IN (SELECT d.adrelid FROM pg_catalog.pg_attrdef d
                                             WHERE d.oid IN (",
    nudges!(),
    "))),
       COALESCE(has_table_privilege(to_regclass(q.sleepers), 'SELECT')
            AND has_table_privilege(to_regclass(q.sleepers), 'INSERT')
            AND has_table_privilege(to_regclass(q.sleepers), 'UPDATE')
            AND has_table_privilege(to_regclass(q.sleepers), 'DELETE')
            AND has_sequence_privilege(to_regclass(q.sleeping), 'UPDATE'), false)
  FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS q(name, sleepers, sleeping, n)
 ORDER BY q.n"
);

/// What wakes the relays of a table now, as `migrate` needs to know it to change only what
/// differs (each change locks the table).
#[derive(Debug)]
pub(crate) struct WakeState {
    /// A trigger of an earlier release (`outbox_relay_wake`, `outbox_relay_notify`).
    pub(crate) trigger: bool,
    /// The attempts column's default when it is the wake-up, as PostgreSQL prints it.
    pub(crate) nudge: Option<String>,
}

/// The wake-up `table` has.
pub(crate) async fn wake_state(
    client: &impl GenericClient,
    table: &TableConfig,
) -> Result<WakeState, SourceError> {
    let row = client
        .query_one(
            WAKE_STATE_SQL,
            &[&table.name.quoted(), &table.columns.attempts.as_str()],
        )
        .await?;
    Ok(WakeState {
        trigger: row.get(0),
        nudge: row.get(1),
    })
}

/// Whether the order column of each of `tables` has unique values by an index.
async fn orders_unique(
    client: &impl GenericClient,
    tables: &[&TableConfig],
) -> Result<Vec<bool>, SourceError> {
    let (names, columns): (Vec<_>, Vec<_>) = tables
        .iter()
        .map(|t| (t.name.quoted(), t.columns.order.as_str().to_owned()))
        .unzip();
    let rows = ask_each(client, UNIQUE_SQL, &[&names, &columns]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Whether the order column of `table` has unique values by an index.
pub(crate) async fn order_is_unique(
    client: &impl GenericClient,
    table: &TableConfig,
) -> Result<bool, SourceError> {
    Ok(orders_unique(client, &[table]).await?[0])
}

/// Each of `tables`, or the problem with its schema: one that does not exist, or that
/// this role may not use.
pub(super) async fn check_schemas<'a>(
    client: &impl GenericClient,
    tables: &[&'a TableConfig],
) -> Result<Vec<Result<&'a TableConfig, Vec<String>>>, SourceError> {
    let schemas: Vec<String> = tables
        .iter()
        .map(|t| t.name.schema.as_str().to_owned())
        .collect();
    let rows = ask_each(client, SCHEMAS_SQL, &[&schemas]).await?;
    Ok(tables
        .iter()
        .zip(rows)
        .map(|(table, row)| {
            let quoted = table.name.schema.quoted();
            match row.get::<_, Option<bool>>(0) {
                None => Err(vec![format!(
                    "table {}: schema {quoted} does not exist: run `outbox-relay migrate`, or \
                     fix tables.name",
                    table.name,
                )]),
                Some(false) => Err(vec![format!(
                    "table {}: this role lacks USAGE on schema {quoted}: GRANT USAGE ON SCHEMA \
                     {quoted} TO <relay role> (see migrations/outbox_relay_role.sql)",
                    table.name,
                )]),
                Some(true) => Ok(*table),
            }
        })
        .collect())
}

/// Each of the tables still `Ok` in `tables` with its columns, or the problem that it
/// does not exist.
pub(super) async fn find_columns<'a>(
    client: &impl GenericClient,
    tables: Vec<Result<&'a TableConfig, Vec<String>>>,
) -> Result<Vec<Result<Found<'a>, Vec<String>>>, SourceError> {
    let asked: Vec<&TableConfig> = tables
        .iter()
        .filter_map(|t| t.as_ref().ok().copied())
        .collect();
    let names: Vec<String> = asked.iter().map(|t| t.name.quoted()).collect();
    let mut types = vec![HashMap::new(); asked.len()];
    for row in ask_each(client, COLUMNS_SQL, &[&names]).await? {
        let n: i64 = row.get(0);
        types[n as usize - 1].insert(row.get(1), row.get(2));
    }
    let found = asked
        .into_iter()
        .zip(types)
        .map(|(table, types)| {
            if types.is_empty() {
                return Err(vec![format!(
                    "table {} does not exist (or this role cannot see it): run `outbox-relay \
                     migrate`, or fix tables.name",
                    table.name
                )]);
            }
            Ok(Found { table, types })
        })
        .collect();
    Ok(merge(tables, found))
}

/// The tables `found` whose order column has no unique values by an index (not asked
/// about, nor reported, when the column is missing: that is reported already).
pub(super) async fn unique_problems(
    client: &impl GenericClient,
    found: &[&Found<'_>],
) -> Result<Vec<Vec<String>>, SourceError> {
    let asked: Vec<(usize, &TableConfig)> = found
        .iter()
        .enumerate()
        .filter(|(_, f)| f.types.contains_key(f.table.columns.order.as_str()))
        .map(|(i, f)| (i, f.table))
        .collect();
    let tables: Vec<&TableConfig> = asked.iter().map(|(_, t)| *t).collect();
    let unique = orders_unique(client, &tables).await?;
    let problems = asked.iter().zip(unique).filter(|(_, unique)| !unique);
    Ok(by_table(
        found.len(),
        problems.map(|((i, table), _)| {
            let problem = format!(
                "table {}: column {} orders the rows and identifies them, so it needs unique \
                 values: run `outbox-relay migrate` (adds a unique index) or \
                 CREATE UNIQUE INDEX ON {} ({})",
                table.name,
                table.columns.order,
                table.name.quoted(),
                table.columns.order.quoted()
            );
            (*i, problem)
        }),
    ))
}

/// The claim indexes `migrate` builds for relays configured as `relay` says, of each of
/// the tables `found`: missing or invalid ones are problems.
pub(super) async fn check_indexes(
    client: &impl GenericClient,
    found: &[&Found<'_>],
    relay: &RelayConfig,
) -> Result<Vec<Vec<String>>, SourceError> {
    let asked: Vec<(usize, &TableConfig, String, &str)> = found
        .iter()
        .enumerate()
        .flat_map(|(i, f)| {
            claim_indexes(relay).map(move |(suffix, what)| {
                let schema = f.table.name.schema.quoted();
                (
                    i,
                    f.table,
                    format!("{schema}.{}", index_name(f.table, suffix)),
                    *what,
                )
            })
        })
        .collect();
    let names: Vec<String> = asked.iter().map(|(_, _, index, _)| index.clone()).collect();
    let rows = ask_each(client, INDEXES_SQL, &[&names]).await?;
    let problems = asked
        .iter()
        .zip(rows)
        .filter_map(|((i, table, index, what), row)| {
            let valid: Option<bool> = row.get(0);
            let problem = format!(
                "table {}: index {index} ({what}) is {}: run `outbox-relay migrate`, which \
             builds it without blocking writes (claims would scan the table without it)",
                table.name,
                if valid.is_none() {
                    "missing"
                } else {
                    "invalid (an interrupted build)"
                }
            );
            (valid != Some(true)).then_some((*i, problem))
        });
    Ok(by_table(found.len(), problems))
}

/// The triggers that keep `outbox_relay_held`, on each of the tables `found`: a table
/// without them would have its failed rows missing there, and the claims would no longer
/// hold their keys' later rows back.
pub(super) async fn check_hold_triggers(
    client: &impl GenericClient,
    found: &[&Found<'_>],
) -> Result<Vec<Vec<String>>, SourceError> {
    let names: Vec<String> = found.iter().map(|f| f.table.name.quoted()).collect();
    let rows = ask_each(client, HOLD_TRIGGERS_SQL, &[&names]).await?;
    let problems = found
        .iter()
        .enumerate()
        .zip(rows)
        .filter_map(|((i, f), row)| {
            (row.get::<_, i32>(0) != 3).then(|| {
                (
                    i,
                    format!(
                        "table {}: the triggers outbox_relay_hold, outbox_relay_hold_delete and \
                     outbox_relay_hold_truncate (migration 0008), which keep the held rows in \
                     outbox_relay_held, are missing or disabled: run `outbox-relay migrate` \
                     as the table's owner",
                        f.table.name
                    ),
                )
            })
        });
    Ok(by_table(found.len(), problems))
}

/// Whether `row` of [`RELATIONS_SQL`] says this role holds each of `privileges` (a list
/// such as `SELECT, INSERT`).
fn holds(row: &Row, privileges: &str) -> bool {
    privileges.split(", ").all(|p| {
        let column = TABLE_PRIVILEGES.iter().position(|q| *q == p);
        row.get(1 + column.expect("one of TABLE_PRIVILEGES"))
    })
}

/// Exactly what the relay's statements need of each of the tables `found`
/// (migrations/outbox_relay_role.sql grants it): SELECT, DELETE in delete mode or with
/// retention, and UPDATE of the bookkeeping columns only.
pub(super) async fn check_privileges(
    client: &impl GenericClient,
    found: &[&Found<'_>],
    relay: &RelayConfig,
) -> Result<Vec<Vec<String>>, SourceError> {
    let names: Vec<String> = found.iter().map(|f| f.table.name.quoted()).collect();
    let names: [&[String]; 1] = [&names];
    let (tables, columns) = futures_util::try_join!(
        ask_each(client, RELATIONS_SQL, &names),
        check_column_privileges(client, found, relay),
    )?;
    let mut needed = vec![("SELECT", "")];
    if relay.on_publish == OnPublish::Delete {
        needed.push(("DELETE", ""));
    } else if relay.retention.is_some() {
        needed.push(("DELETE", " (relay.retention deletes old published rows)"));
    }
    let problems = found
        .iter()
        .zip(&tables)
        .enumerate()
        .flat_map(|(i, (f, row))| {
            needed
                .iter()
                .filter(|(privilege, _)| !holds(row, privilege))
                .map(move |(privilege, why)| {
                    let problem = format!(
                        "table {}: this role lacks {privilege}{why}: GRANT {privilege} ON {} TO \
                     <relay role>",
                        f.table.name,
                        f.table.name.quoted(),
                    );
                    (i, problem)
                })
        });
    Ok(by_table(found.len(), problems.chain(columns)))
}

/// The bookkeeping columns of the tables `found` this role may not update, with each
/// table's place: the problems, in the tables' order.
async fn check_column_privileges(
    client: &impl GenericClient,
    found: &[&Found<'_>],
    relay: &RelayConfig,
) -> Result<Vec<(usize, String)>, SourceError> {
    let asked: Vec<(usize, &TableConfig, &Ident)> = found
        .iter()
        .enumerate()
        .flat_map(|(i, f)| {
            let c = &f.table.columns;
            let mut updated = vec![&c.attempts, &c.last_error, &c.dead_at, &c.next_attempt_at];
            if relay.on_publish == OnPublish::Mark {
                updated.push(&c.published_at);
            }
            // A missing column is reported as missing, not asked about.
            updated.retain(|column| f.types.contains_key(column.as_str()));
            updated.into_iter().map(move |column| (i, f.table, column))
        })
        .collect();
    let (names, columns): (Vec<_>, Vec<_>) = asked
        .iter()
        .map(|(_, table, column)| (table.name.quoted(), column.as_str().to_owned()))
        .unzip();
    let rows = ask_each(client, COLUMN_PRIVILEGES_SQL, &[&names, &columns]).await?;
    Ok(asked
        .iter()
        .zip(rows)
        .filter(|(_, row)| !row.get::<_, bool>(0))
        .map(|((i, table, column), _)| {
            let problem = format!(
                "table {}: this role lacks UPDATE on column {column}: GRANT UPDATE ({}) ON \
                 {} TO <relay role>",
                table.name,
                column.quoted(),
                table.name.quoted(),
            );
            (*i, problem)
        })
        .collect())
}

/// One of the relay's own tables in an outbox table's schema: its name, the migration
/// that creates it, the privileges the relay needs on it and why.
type RelayTable = (&'static str, &'static str, &'static str, &'static str);

/// The pause state, which every table needs (migration 0005: `pause`, `resume` and the
/// bad-row valve write it).
const PAUSES: RelayTable = (
    "outbox_relay_pauses",
    "0005",
    "SELECT, INSERT, DELETE",
    "pause, resume and the bad-row valve keep their state there",
);

/// The held rows, which every table needs (migration 0008): claims read there which keys
/// are held back. Its triggers on the outbox table write it.
const HELD: RelayTable = (
    "outbox_relay_held",
    "0008",
    "SELECT",
    "claims read there which keys are held back",
);

/// The rate buckets, which a table with `max_rate` needs (migration 0006).
const RATES: RelayTable = (
    "outbox_relay_rates",
    "0006",
    "SELECT, INSERT, UPDATE",
    "max_rate keeps its token bucket there",
);

/// The relay's own tables in the schema of each of the tables `found`, there and usable
/// by this role: [`PAUSES`], [`HELD`], and with `max_rate` [`RATES`].
pub(super) async fn check_relay_tables(
    client: &impl GenericClient,
    found: &[&Found<'_>],
) -> Result<Vec<Vec<String>>, SourceError> {
    let asked: Vec<(usize, &TableConfig, RelayTable, String)> = found
        .iter()
        .enumerate()
        .flat_map(|(i, f)| {
            let rates = f.table.max_rate.is_some().then_some(RATES);
            [PAUSES, HELD].into_iter().chain(rates).map(move |needed| {
                (
                    i,
                    f.table,
                    needed,
                    super::super::schema_table(&f.table.name, needed.0),
                )
            })
        })
        .collect();
    let names: Vec<String> = asked
        .iter()
        .map(|(_, _, _, quoted)| quoted.clone())
        .collect();
    let rows = ask_each(client, RELATIONS_SQL, &[&names]).await?;
    let problems = asked
        .iter()
        .zip(rows)
        .filter_map(|((i, table, needed, quoted), row)| {
            let (_, migration, privileges, why) = needed;
            let problem = if !row.get::<_, bool>(0) {
                format!(
                    "table {}: {quoted} (migration {migration}) is missing: run `outbox-relay \
                 migrate` as the table's owner",
                    table.name
                )
            } else if !holds(&row, privileges) {
                format!(
                    "table {}: this role cannot read and write {quoted} ({why}): GRANT \
                 {privileges} ON {quoted} TO <this role> (migrations/outbox_relay_role.sql \
                 does)",
                    table.name
                )
            } else {
                return None;
            };
            Some((*i, problem))
        });
    Ok(by_table(found.len(), problems))
}

/// Which wake-up each of the tables `found` has (the gated one when an older trigger is
/// there too), and what keeps the relay from using it: with a gated wake-up, the relay
/// marks itself asleep in the schema's `outbox_relay_sleepers`
/// ([`super::super::sleepers`]).
pub(super) async fn wake_ups(
    client: &impl GenericClient,
    found: &[&Found<'_>],
) -> Result<(Vec<Wakeup>, Vec<Vec<String>>), SourceError> {
    let names: Vec<String> = found.iter().map(|f| f.table.name.quoted()).collect();
    let sleepers: Vec<String> = found
        .iter()
        .map(|f| super::super::sleepers::sleepers_of(&f.table.name))
        .collect();
    let sleeping: Vec<String> = found
        .iter()
        .map(|f| super::super::sleepers::sleeping_of(&f.table.name))
        .collect();
    let rows = ask_each(client, WAKE_SQL, &[&names, &sleepers, &sleeping]).await?;
    Ok(found
        .iter()
        .zip(rows)
        .enumerate()
        .map(|(i, (f, row))| {
            let (names, allowed): (Vec<String>, bool) = (row.get(0), row.get(1));
            if names
                .iter()
                .any(|n| n == "outbox_relay_nudge" || n == "outbox_relay_wake")
            {
                let (sleepers, sleeping) = (&sleepers[i], &sleeping[i]);
                let problem = (!allowed).then(|| {
                    format!(
                        "table {}: this role cannot keep its sleep marks (idle relays mark \
                         themselves asleep, so that writers notify only then): GRANT SELECT, \
                         INSERT, UPDATE, DELETE ON {sleepers} TO <this role>; GRANT UPDATE ON \
                         SEQUENCE {sleeping} TO <this role> (migrations/outbox_relay_role.sql \
                         does), or run `outbox-relay migrate --no-notify` to poll instead",
                        f.table.name
                    )
                });
                (Wakeup::Gated, problem.into_iter().collect())
            } else if names.is_empty() {
                (Wakeup::None, Vec::new())
            } else {
                (Wakeup::Every, Vec::new())
            }
        })
        .unzip())
}
