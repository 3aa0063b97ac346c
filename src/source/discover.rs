//! Tables found by pattern: which tables the `[[tables]]` entries that name a pattern
//! (`tenant_*.outbox`, see `config::pattern`) match now.
//!
//! One catalog query answers for every pattern at once ([`DISCOVER_SQL`]), whatever the
//! number of tables: the relay asks it at start, `migrate`, `check` and the operator's
//! commands ask it once, and a running relay asks it every few seconds (`relay::discovery`)
//! - never a query per table.

use std::collections::BTreeMap;

use tokio_postgres::types::Type;
use tokio_postgres::GenericClient;

use super::{Source, SourceError};
use crate::config::{Config, TableConfig, TableName};

/// The tables each pattern matches: `$1` and `$2` are the patterns' schema and table
/// parts as `LIKE` patterns (escape `\`), one element per pattern entry, in order. Returns
/// `(entry, schema, table)` with `entry` the pattern's place in the list from 0, by entry
/// then name.
///
/// - Tables and partitioned tables; not a partition (it is relayed through its parent, if
///   at all), not a view.
/// - Not the relay's own bookkeeping tables, which sit beside the outbox tables in their
///   schemas and would match `schema.*`.
/// - The catalog's names compare in the "C" collation: byte for byte, as the pattern does.
pub(crate) const DISCOVER_SQL: &str = "\
SELECT (p.i - 1)::int4, n.nspname::text, c.relname::text
  FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS p(schema_like, table_like, i)
  JOIN pg_catalog.pg_namespace n ON n.nspname LIKE p.schema_like
  JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname LIKE p.table_like
 WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
   AND c.relname NOT IN ('outbox_relay_pauses', 'outbox_relay_rates', 'outbox_relay_sleepers',
                         'outbox_relay_held')
 ORDER BY p.i, n.nspname, c.relname";

/// The tables `patterns` (entries that name a pattern) match now: a table once per
/// pattern that matches it, with that pattern's index in `patterns`.
pub(crate) async fn matching(
    client: &impl GenericClient,
    patterns: &[TableConfig],
) -> Result<Vec<(usize, TableName)>, SourceError> {
    if patterns.is_empty() {
        return Ok(Vec::new());
    }
    let (schemas, tables): (Vec<String>, Vec<String>) = patterns
        .iter()
        .map(|t| t.pattern.as_ref().expect("pattern entries only").like())
        .unzip();
    let rows = client
        .query_typed(
            DISCOVER_SQL,
            &[(&schemas, Type::TEXT_ARRAY), (&tables, Type::TEXT_ARRAY)],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let entry = r.get::<_, i32>(0) as usize;
            (entry, TableName::from_catalog(r.get(1), r.get(2)))
        })
        .collect())
}

/// `config` with the tables its patterns match now added to `tables` (after the entries
/// that name a table, by entry then name): what the relay, `migrate`, `check` and the
/// operator's commands work on. A table matched by two entries is an error naming both
/// ([`SourceError::Config`]).
pub async fn resolve(source: &Source, config: &Config) -> Result<Config, SourceError> {
    if config.patterns.is_empty() {
        return Ok(config.clone());
    }
    source
        .in_transaction(async |tx| resolve_on(tx.client(), config).await)
        .await
}

/// [`resolve`] on `client` (`migrate`'s session of its own).
pub(crate) async fn resolve_on(
    client: &impl GenericClient,
    config: &Config,
) -> Result<Config, SourceError> {
    let found = matching(client, &config.patterns).await?;
    let (config, ambiguous) = expand(config, found);
    match ambiguous.into_iter().next() {
        Some((_, problem)) => Err(SourceError::Config(problem)),
        None => Ok(config),
    }
}

/// `config` with a copy of its pattern entry for each table `found` (pattern index,
/// table), but those matched by two entries: they are left out, each returned with a
/// sentence naming the table and both entries.
pub(crate) fn expand(
    config: &Config,
    found: Vec<(usize, TableName)>,
) -> (Config, Vec<(TableName, String)>) {
    let mut by_table: BTreeMap<TableName, Vec<&TableConfig>> = BTreeMap::new();
    for (entry, name) in found {
        by_table
            .entry(name)
            .or_default()
            .push(&config.patterns[entry]);
    }
    let mut ambiguous = Vec::new();
    let mut tables = config.tables.clone();
    for (name, entries) in by_table {
        let plain = config.tables.iter().find(|t| t.name == name);
        let mut all = plain.into_iter().chain(entries.iter().copied());
        let first = all.next().expect("found at least once");
        match all.next() {
            Some(second) => {
                let problem = format!(
                    "table {name} is matched by two [[tables]] entries, {} and {}: a table is \
                     relayed by one entry (narrow a pattern or remove one)",
                    first.entry_name(),
                    second.entry_name()
                );
                ambiguous.push((name, problem));
            }
            None => tables.push(first.matched(name)),
        }
    }
    // By entry, then name (`by_table` went by name).
    tables[config.tables.len()..].sort_by(|a, b| (a.entry, &a.name).cmp(&(b.entry, &b.name)));
    (
        Config {
            tables,
            ..config.clone()
        },
        ambiguous,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(names: &[&str]) -> Config {
        let mut text =
            String::from("[postgres]\nurl = \"postgres://u@h/db\"\n[sink]\nkind = \"stdout\"\n");
        for name in names {
            text.push_str(&format!("[[tables]]\nname = '{name}'\n"));
        }
        crate::config::from_str(&text, |_| None, Vec::new()).unwrap()
    }

    fn name(text: &str) -> TableName {
        TableName::parse(text).unwrap()
    }

    #[test]
    fn each_match_is_a_table_of_its_own_after_the_named_tables() {
        let c = config(&["tenant_*.outbox", "public.outbox"]);
        let found = vec![(0, name("tenant_a.outbox")), (0, name("tenant_b.outbox"))];
        let (expanded, ambiguous) = expand(&c, found);
        assert!(ambiguous.is_empty());
        let names: Vec<String> = expanded.tables.iter().map(|t| t.name.to_string()).collect();
        assert_eq!(
            names,
            ["public.outbox", "tenant_a.outbox", "tenant_b.outbox"]
        );
        assert_eq!(expanded.tables[1].entry, 0);
        assert!(expanded.tables[1].pattern.is_some());
    }

    #[test]
    fn a_table_two_patterns_match_is_left_out_naming_both_entries_once() {
        let c = config(&["tenant_*.outbox", "*_a.outbox"]);
        let found = vec![
            (0, name("tenant_a.outbox")),
            (0, name("tenant_b.outbox")),
            (1, name("tenant_a.outbox")),
        ];
        let (expanded, ambiguous) = expand(&c, found);
        let names: Vec<String> = expanded.tables.iter().map(|t| t.name.to_string()).collect();
        assert_eq!(names, ["tenant_b.outbox"]);
        let problems: Vec<&str> = ambiguous.iter().map(|(_, p)| p.as_str()).collect();
        assert_eq!(ambiguous[0].0, name("tenant_a.outbox"));
        assert_eq!(
            problems,
            [
                "table tenant_a.outbox is matched by two [[tables]] entries, tables[0] \
              (tenant_*.outbox) and tables[1] (*_a.outbox): a table is relayed by one entry \
              (narrow a pattern or remove one)"
            ]
        );
    }

    /// The statement's text is fixed: the patterns only ever travel as bound values.
    #[test]
    fn the_patterns_are_bound_not_spliced() {
        assert!(DISCOVER_SQL.contains("$1::text[]") && DISCOVER_SQL.contains("$2::text[]"));
        assert!(!DISCOVER_SQL.contains("tenant"));
    }
}
