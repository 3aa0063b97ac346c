//! What an outbox table looks like in the catalog, and whether the relay can use it.

use std::collections::HashMap;
use std::future::Future;

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

use super::SourceError;
use crate::config::{Ident, OnPublish, OptionalColumn, RelayConfig, TableConfig};

/// How the payload column is turned into message bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PayloadType {
    /// Sent as stored.
    Bytea,
    /// `text`, `varchar`, `json` or `jsonb`: sent as its UTF-8 text.
    Text,
}

/// The parts of a table's catalog entry the relay's SQL depends on.
#[derive(Debug, Clone)]
pub(crate) struct TableShape {
    pub(crate) payload: PayloadType,
    /// The headers column, when the table has one.
    pub(crate) headers: Option<Ident>,
    /// The creation-time column, when the table has one.
    pub(crate) created_at: Option<Ident>,
    /// Which wake-up trigger the table has.
    pub(crate) wake: WakeTrigger,
}

/// The trigger that wakes idle relays when rows of a table commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WakeTrigger {
    /// None (`migrate --no-notify`, or disabled): relays poll the table.
    None,
    /// A previous release's `outbox_relay_notify`: every INSERT statement notifies.
    Every,
    /// `outbox_relay_wake`: an INSERT notifies while a relay is asleep on the table
    /// ([`super::sleepers`]).
    Gated,
}

/// Whether a valid unique index (not partial, not on an expression) covers exactly `$2`.
const UNIQUE_SQL: &str = "\
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_index i
    JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
    WHERE i.indrelid = to_regclass($1::text) AND i.indisunique AND i.indisvalid AND i.indnkeyatts = 1
      AND i.indpred IS NULL AND i.indexprs IS NULL AND a.attname = $2::text)";

/// Whether `column` of `table` has unique values by an index.
pub(crate) async fn order_is_unique(
    client: &impl GenericClient,
    table: &TableConfig,
) -> Result<bool, SourceError> {
    let row = client
        .query_typed_one(
            UNIQUE_SQL,
            &[
                (&table.name.quoted(), Type::TEXT),
                (&table.columns.order.as_str(), Type::TEXT),
            ],
        )
        .await?;
    Ok(row.get(0))
}

const COLUMNS_SQL: &str = "\
SELECT a.attname::text, t.typname::text
FROM pg_catalog.pg_attribute a
JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = to_regclass($1::text) AND a.attnum > 0 AND NOT a.attisdropped";

/// Whether the schema `$1` exists, and this role may use it (looked up in the catalog, so a
/// schema this role cannot use is reported, not raised as an error).
const SCHEMA_SQL: &str = "\
SELECT has_schema_privilege(n.oid, 'USAGE') FROM pg_catalog.pg_namespace n WHERE n.nspname = $1";

const PRIVILEGES_SQL: &str = "\
SELECT has_table_privilege(to_regclass($1::text), 'SELECT'),
       has_table_privilege(to_regclass($1::text), 'DELETE')";

/// Whether the index `$1` exists (NULL when it does not) and is valid.
const INDEX_VALID_SQL: &str =
    "SELECT (SELECT i.indisvalid FROM pg_catalog.pg_index i WHERE i.indexrelid = to_regclass($1::text))";

const COLUMN_PRIVILEGE_SQL: &str =
    "SELECT has_column_privilege(to_regclass($1::text), $2::text, 'UPDATE')";

/// Every problem found with one table, each a sentence saying what to fix; or, when there
/// is none, the shape the relay's statements are built for.
pub(crate) async fn inspect(
    client: &impl GenericClient,
    table: &TableConfig,
    relay: &RelayConfig,
) -> Result<Result<TableShape, Vec<String>>, SourceError> {
    if let Some(problem) = schema_problem(client, table).await? {
        return Ok(Err(vec![problem]));
    }
    let name = table.name.quoted();
    let rows = client
        .query_typed(COLUMNS_SQL, &[(&name, Type::TEXT)])
        .await?;
    if rows.is_empty() {
        return Ok(Err(vec![format!(
            "table {} does not exist (or this role cannot see it): run `outbox-relay migrate`, \
             or fix tables.name",
            table.name
        )]));
    }
    let types: HashMap<String, String> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
        .collect();
    let mut problems = Vec::new();
    let shape = check_columns(&types, table, relay, &mut problems);
    // The questions left do not depend on each other's answers: asked together, they
    // share their round trips (tokio-postgres pipelines the statements a client is asked
    // at once), one in all instead of two each, which a database in another zone pays in
    // every start-up (benchmark L). Every
    // question here is asked with its parameters' types (`query_typed`): an unnamed
    // statement parsed, bound and run in one round trip, where a prepared one waits for
    // its description first.
    let (unique, indexes, privileges, relay_tables, wake) = futures_util::try_join!(
        unique_problem(client, table, &types),
        check_indexes(client, table),
        check_privileges(client, table, relay, &types),
        check_relay_tables(client, table),
        wake_trigger(client, table),
    )?;
    let (wake, wake_problem) = wake;
    problems.extend(
        unique
            .into_iter()
            .chain(indexes)
            .chain(privileges)
            .chain(relay_tables)
            .chain(wake_problem),
    );
    match shape {
        Some(shape) if problems.is_empty() => Ok(Ok(TableShape { wake, ..shape })),
        _ => Ok(Err(problems)),
    }
}

/// The order column without unique values by an index (not reported when the column is
/// missing: that is reported already).
async fn unique_problem(
    client: &impl GenericClient,
    table: &TableConfig,
    types: &HashMap<String, String>,
) -> Result<Option<String>, SourceError> {
    if !types.contains_key(table.columns.order.as_str()) || order_is_unique(client, table).await? {
        return Ok(None);
    }
    Ok(Some(format!(
        "table {}: column {} orders the rows and identifies them, so it needs unique \
         values: run `outbox-relay migrate` (adds a unique index) or \
         CREATE UNIQUE INDEX ON {} ({})",
        table.name,
        table.columns.order,
        table.name.quoted(),
        table.columns.order.quoted()
    )))
}

/// The relay's own tables in the table's schema, there and usable by this role: the pause
/// state (migration 0005: `pause`, `resume` and the bad-row valve write it), and with
/// `max_rate` the rate buckets (migration 0006).
async fn check_relay_tables(
    client: &impl GenericClient,
    table: &TableConfig,
) -> Result<Vec<String>, SourceError> {
    let mut needed = vec![(
        "outbox_relay_pauses",
        "0005",
        "SELECT, INSERT, DELETE",
        "pause, resume and the bad-row valve keep their state there",
    )];
    if table.max_rate.is_some() {
        needed.push((
            "outbox_relay_rates",
            "0006",
            "SELECT, INSERT, UPDATE",
            "max_rate keeps its token bucket there",
        ));
    }
    let problems = needed
        .into_iter()
        .map(async |(name, migration, privileges, why)| {
            let quoted = super::schema_table(&table.name, name);
            let checks: Vec<String> = privileges
                .split(", ")
                .map(|p| format!("has_table_privilege(to_regclass($1::text), '{p}')"))
                .collect();
            let row = client
                .query_typed_one(
                    &format!(
                        "SELECT to_regclass($1::text) IS NOT NULL, COALESCE({}, false)",
                        checks.join(" AND ")
                    ),
                    &[(&quoted, Type::TEXT)],
                )
                .await?;
            let (exists, allowed): (bool, bool) = (row.get(0), row.get(1));
            Ok::<_, SourceError>(if !exists {
                Some(format!(
                    "table {}: {quoted} (migration {migration}) is missing: run `outbox-relay \
                     migrate` as the table's owner",
                    table.name
                ))
            } else if !allowed {
                Some(format!(
                    "table {}: this role cannot read and write {quoted} ({why}): GRANT \
                     {privileges} ON {quoted} TO <this role> (migrations/outbox_relay_role.sql \
                     does)",
                    table.name
                ))
            } else {
                None
            })
        });
    together(problems).await
}

/// Which wake-up trigger `table` has enabled (this release's when both are there), and
/// what keeps the relay from using it: with this release's trigger, the relay marks itself
/// asleep in the schema's `outbox_relay_sleepers` ([`super::sleepers`]).
async fn wake_trigger(
    client: &impl GenericClient,
    table: &TableConfig,
) -> Result<(WakeTrigger, Option<String>), SourceError> {
    let sleepers = super::sleepers::sleepers_of(&table.name);
    let sleeping = super::sleepers::sleeping_of(&table.name);
    let row = client
        .query_typed_one(
            "SELECT ARRAY(SELECT tgname::text FROM pg_catalog.pg_trigger \
                 WHERE tgrelid = to_regclass($1::text) \
                   AND tgname IN ('outbox_relay_wake', 'outbox_relay_notify') \
                   AND tgenabled <> 'D'), \
                 COALESCE(has_table_privilege(to_regclass($2::text), 'SELECT') \
                   AND has_table_privilege(to_regclass($2::text), 'INSERT') \
                   AND has_table_privilege(to_regclass($2::text), 'UPDATE') \
                   AND has_table_privilege(to_regclass($2::text), 'DELETE') \
                   AND has_sequence_privilege(to_regclass($3::text), 'UPDATE'), false)",
            &[
                (&table.name.quoted(), Type::TEXT),
                (&sleepers.as_str(), Type::TEXT),
                (&sleeping.as_str(), Type::TEXT),
            ],
        )
        .await?;
    let (names, allowed): (Vec<String>, bool) = (row.get(0), row.get(1));
    Ok(if names.iter().any(|n| n == "outbox_relay_wake") {
        let problem = (!allowed).then(|| {
            format!(
                "table {}: this role cannot keep its sleep marks (idle relays mark \
                 themselves asleep, so that writers notify only then): GRANT SELECT, \
                 INSERT, UPDATE, DELETE ON {sleepers} TO <this role>; GRANT UPDATE ON \
                 SEQUENCE {sleeping} TO <this role> (migrations/outbox_relay_role.sql \
                 does), or run `outbox-relay migrate --no-notify` to poll instead",
                table.name
            )
        });
        (WakeTrigger::Gated, problem)
    } else if names.is_empty() {
        (WakeTrigger::None, None)
    } else {
        (WakeTrigger::Every, None)
    })
}

/// A schema that does not exist or that this role may not use.
async fn schema_problem(
    client: &impl GenericClient,
    table: &TableConfig,
) -> Result<Option<String>, SourceError> {
    let quoted = table.name.schema.quoted();
    Ok(
        match client
            .query_typed_opt(SCHEMA_SQL, &[(&table.name.schema.as_str(), Type::NAME)])
            .await?
        {
            None => Some(format!(
                "table {}: schema {quoted} does not exist: run `outbox-relay migrate`, or fix \
                 tables.name",
                table.name,
            )),
            Some(row) if !row.get::<_, bool>(0) => Some(format!(
                "table {}: this role lacks USAGE on schema {quoted}: GRANT USAGE ON SCHEMA \
                 {quoted} TO <relay role> (see migrations/outbox_relay_role.sql)",
                table.name,
            )),
            Some(_) => None,
        },
    )
}

/// Checks every column the configuration names against the table's columns (`types`:
/// name -> type name) and returns the shape, or `None` when a problem was pushed.
fn check_columns(
    types: &HashMap<String, String>,
    table: &TableConfig,
    relay: &RelayConfig,
    problems: &mut Vec<String>,
) -> Option<TableShape> {
    let before = problems.len();
    let c = &table.columns;
    let mut expect = |column: &str, role: &str, allowed: &[&str]| -> Option<String> {
        let problem = column_problem(types, table, column, role, allowed);
        let ty = problem.is_none().then(|| types[column].clone());
        problems.extend(problem);
        ty
    };
    let integers = &["int8", "int4", "int2"][..];
    let times = &["timestamptz", "timestamp"][..];
    if c.order == c.id {
        expect(c.id.as_str(), "message id and order", integers);
    } else {
        expect(c.id.as_str(), "message id", &[]);
        expect(c.order.as_str(), "order", integers);
    }
    expect(c.key.as_str(), "ordering key", &[]);
    let payload = expect(
        c.payload.as_str(),
        "message body",
        &["bytea", "text", "varchar", "json", "jsonb"],
    );
    // An optional column left at its default name is used only if the table has it.
    let mut optional = |column: &OptionalColumn, role: &str, allowed: &[&str]| match column {
        OptionalColumn::Off => None,
        OptionalColumn::Default(name) if !types.contains_key(name.as_str()) => None,
        OptionalColumn::Default(name) | OptionalColumn::Named(name) => {
            expect(name.as_str(), role, allowed).map(|_| name.clone())
        }
    };
    let headers = optional(&c.headers, "message headers", &["jsonb", "json"]);
    let created_at = optional(&c.created_at, "creation time", times);
    expect(c.attempts.as_str(), "failed attempts", integers);
    expect(c.last_error.as_str(), "last error", &["text", "varchar"]);
    expect(c.dead_at.as_str(), "dead-letter time", times);
    expect(
        c.next_attempt_at.as_str(),
        "next attempt time, added by migrate 0002",
        times,
    );
    let published_role = match relay.on_publish {
        OnPublish::Mark => "publish time, set in mark mode",
        OnPublish::Delete => "publish time",
    };
    expect(c.published_at.as_str(), published_role, times);
    check_mapped_columns(types, table, problems);
    // (A mapped creation-time column that is missing is reported above.)
    if relay.retention.is_some()
        && created_at.is_none()
        && !matches!(c.created_at, OptionalColumn::Named(_))
    {
        problems.push(format!(
            "table {}: relay.retention needs a creation-time column to tell where the old rows \
             end, and this table has none: map tables.columns.created_at to a timestamptz \
             column written at insert (e.g. `created_at timestamptz NOT NULL DEFAULT now()`), \
             or remove relay.retention",
            table.name
        ));
    }
    let payload = match payload.as_deref() {
        Some("bytea") => PayloadType::Bytea,
        _ => PayloadType::Text,
    };
    (problems.len() == before).then_some(TableShape {
        payload,
        headers,
        created_at,
        wake: WakeTrigger::None,
    })
}

/// Checks the columns the templates and the header mapping name (any type will do).
fn check_mapped_columns(
    types: &HashMap<String, String>,
    table: &TableConfig,
    problems: &mut Vec<String>,
) {
    let mut expect = |column: &str, role: &str| {
        problems.extend(column_problem(types, table, column, role, &[]));
    };
    for column in table.topic.columns() {
        expect(column.as_str(), "used in the topic template");
    }
    for (header, column) in &table.header_columns {
        expect(column.as_str(), &format!("copied to header {header}"));
    }
    for column in table.dead_letter_topic.iter().flat_map(|d| d.columns()) {
        expect(column.as_str(), "used in the dead_letter_topic template");
    }
    for column in table.cloudevents.iter().flat_map(|ce| ce.columns()) {
        expect(column.as_str(), "used in a cloudevents template");
    }
}

/// What is wrong with `column` (playing `role`), if anything: missing, or of a type not in
/// `allowed` (any type when empty).
fn column_problem(
    types: &HashMap<String, String>,
    table: &TableConfig,
    column: &str,
    role: &str,
    allowed: &[&str],
) -> Option<String> {
    let c = &table.columns;
    // `migrate` adds the bookkeeping columns; every other column is the application's.
    let bookkeeping = [
        &c.published_at,
        &c.attempts,
        &c.last_error,
        &c.dead_at,
        &c.next_attempt_at,
    ];
    match types.get(column) {
        None if bookkeeping.iter().any(|b| b.as_str() == column) => Some(format!(
            "table {}: column {column} ({role}) is missing: run `outbox-relay migrate`, \
             which adds it",
            table.name
        )),
        None => Some(format!(
            "table {}: column {column} ({role}) is missing, and only the application \
             can add it (migrate adds the relay's bookkeeping columns only): add the \
             column in the application's schema migration, or change the config to \
             name a column the table has ([[tables]] topic, [tables.columns], \
             [tables.header_columns])",
            table.name
        )),
        Some(ty) if !allowed.is_empty() && !allowed.contains(&ty.as_str()) => Some(format!(
            "table {}: column {column} ({role}) has type {ty}; use one of {}",
            table.name,
            allowed.join(", ")
        )),
        Some(_) => None,
    }
}

/// The quoted name of the table's index with `suffix` (`pending_idx`, ...): the name
/// `migrate` builds it under, and the one the start-up check looks for.
pub(crate) fn index_name(table: &TableConfig, suffix: &str) -> String {
    super::name_for(&table.name, suffix)
}

/// The indexes every claim relies on, by suffix: without one of them a claim scans the
/// table. The relay refuses to start (and `check` fails) until `migrate` built them.
pub(crate) const CLAIM_INDEXES: &[(&str, &str)] = &[
    ("pending_idx", "pending rows in order (migration 0001)"),
    ("held_idx", "rows that hold back their key (migration 0002)"),
    ("retry_idx", "rows with a failure history (migration 0003)"),
    ("bucket_idx", "pending rows by key bucket (migration 0004)"),
];

/// The claim indexes `migrate` builds: missing or invalid ones are problems.
async fn check_indexes(
    client: &impl GenericClient,
    table: &TableConfig,
) -> Result<Vec<String>, SourceError> {
    let problems = CLAIM_INDEXES.iter().map(async |(suffix, what)| {
        let index = format!(
            "{}.{}",
            table.name.schema.quoted(),
            index_name(table, suffix)
        );
        let valid: Option<bool> = client
            .query_typed_one(INDEX_VALID_SQL, &[(&index, Type::TEXT)])
            .await?
            .get(0);
        Ok::<_, SourceError>((valid != Some(true)).then(|| {
            format!(
                "table {}: index {index} ({what}) is {}: run `outbox-relay migrate`, which \
                 builds it without blocking writes (claims would scan the table without it)",
                table.name,
                if valid.is_none() {
                    "missing"
                } else {
                    "invalid (an interrupted build)"
                }
            )
        }))
    });
    together(problems).await
}

/// Exactly what the relay's statements need (migrations/outbox_relay_role.sql grants it):
/// SELECT, DELETE in delete mode or with retention, and UPDATE of the bookkeeping columns
/// only.
async fn check_privileges(
    client: &impl GenericClient,
    table: &TableConfig,
    relay: &RelayConfig,
    types: &HashMap<String, String>,
) -> Result<Vec<String>, SourceError> {
    let name = table.name.quoted();
    let c = &table.columns;
    let mut updated = vec![&c.attempts, &c.last_error, &c.dead_at, &c.next_attempt_at];
    if relay.on_publish == OnPublish::Mark {
        updated.push(&c.published_at);
    }
    // A missing column is reported as missing, not asked about.
    updated.retain(|column| types.contains_key(column.as_str()));
    let columns = updated.into_iter().map(async |column| {
        let row = client
            .query_typed_one(
                COLUMN_PRIVILEGE_SQL,
                &[(&name, Type::TEXT), (&column.as_str(), Type::TEXT)],
            )
            .await?;
        Ok::<_, SourceError>((!row.get::<_, bool>(0)).then(|| {
            format!(
                "table {}: this role lacks UPDATE on column {column}: GRANT UPDATE ({}) ON \
                 {name} TO <relay role>",
                table.name,
                column.quoted(),
            )
        }))
    });
    let (privileges, columns) = futures_util::try_join!(
        async {
            Ok(client
                .query_typed_one(PRIVILEGES_SQL, &[(&name, Type::TEXT)])
                .await?)
        },
        together(columns),
    )?;
    let mut needed = vec![(0, "SELECT", "")];
    if relay.on_publish == OnPublish::Delete {
        needed.push((1, "DELETE", ""));
    } else if relay.retention.is_some() {
        needed.push((1, "DELETE", " (relay.retention deletes old published rows)"));
    }
    let mut problems: Vec<String> = needed
        .into_iter()
        .filter(|(i, _, _)| !privileges.get::<_, bool>(*i))
        .map(|(_, privilege, why)| {
            format!(
                "table {}: this role lacks {privilege}{why}: GRANT {privilege} ON {name} TO \
                 <relay role>",
                table.name,
            )
        })
        .collect();
    problems.extend(columns);
    Ok(problems)
}

/// The problems `checks` find, in their order, asked together: their statements share
/// round trips.
async fn together(
    checks: impl IntoIterator<Item = impl Future<Output = Result<Option<String>, SourceError>>>,
) -> Result<Vec<String>, SourceError> {
    Ok(futures_util::future::try_join_all(checks)
        .await?
        .into_iter()
        .flatten()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> crate::config::Config {
        let text = format!(
            "[postgres]\nurl = \"postgres://db/app\"\n[sink]\nkind = \"stdout\"\n{extra}\n\
             [[tables]]\nname = \"public.outbox\"\n"
        );
        crate::config::from_str(&text, |_| None, Vec::new()).unwrap()
    }

    /// The columns `migrate` creates, with their types.
    fn migrated() -> HashMap<String, String> {
        [
            ("id", "int8"),
            ("topic", "text"),
            ("key", "text"),
            ("payload", "jsonb"),
            ("headers", "jsonb"),
            ("created_at", "timestamptz"),
            ("published_at", "timestamptz"),
            ("attempts", "int4"),
            ("last_error", "text"),
            ("dead_at", "timestamptz"),
            ("next_attempt_at", "timestamptz"),
        ]
        .into_iter()
        .map(|(c, t)| (c.to_owned(), t.to_owned()))
        .collect()
    }

    #[test]
    fn a_migrated_table_has_the_shape_the_statements_need() {
        let config = config("");
        let mut problems = Vec::new();
        let shape = check_columns(&migrated(), &config.tables[0], &config.relay, &mut problems)
            .expect("no problem");
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(shape.payload, PayloadType::Text);
        assert_eq!(shape.headers.unwrap().as_str(), "headers");
    }

    #[test]
    fn each_column_problem_says_who_can_fix_it() {
        let config = config("");
        let mut types = migrated();
        types.remove("next_attempt_at"); // the relay's: migrate adds it
        types.remove("key"); // the application's
        types.insert("attempts".into(), "text".into());
        let mut problems = Vec::new();
        let shape = check_columns(&types, &config.tables[0], &config.relay, &mut problems);
        assert!(shape.is_none());
        assert_eq!(problems.len(), 3, "{problems:#?}");
        assert!(problems[0]
            .contains("column key (ordering key) is missing, and only the application can add it"));
        assert!(problems[1].contains(
            "column attempts (failed attempts) has type text; use one of int8, int4, int2"
        ));
        assert!(problems[2].contains("column next_attempt_at (next attempt time, added by migrate 0002) is missing: run `outbox-relay migrate`"));
    }

    #[test]
    fn retention_needs_a_creation_time_column() {
        let config = config("[relay]\non_publish = \"mark\"\nretention = \"7d\"");
        let mut types = migrated();
        types.remove("created_at");
        let mut problems = Vec::new();
        check_columns(&types, &config.tables[0], &config.relay, &mut problems);
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(problems[0].contains("relay.retention needs a creation-time column"));
    }
}
