//! A table's columns against the configuration: each column the relay's statements, the
//! templates and the header mapping name, there and of a usable type.

use std::collections::HashMap;

use super::{PayloadType, TableShape, Wakeup};
use crate::config::{OnPublish, OptionalColumn, RelayConfig, TableConfig};

/// Checks every column the configuration names against the table's columns (`types`:
/// name -> type name) and returns the shape, or `None` when a problem was pushed.
pub(super) fn check_columns(
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
        wake: Wakeup::None,
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
