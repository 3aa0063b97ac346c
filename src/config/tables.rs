//! `[[tables]]`: which outbox tables are relayed, and which column plays which part.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::cloudevents::{self, CloudEvents};
use super::pattern::TablePattern;
use super::raw::{RawColumns, RawTable};
use super::{headers, ConfigError, Ident, SinkTarget, TableName, Template};

/// One `[[tables]]` entry.
#[derive(Debug, Clone)]
pub struct TableConfig {
    /// `name`: the schema-qualified table (for an entry that names a pattern, the matching
    /// table this copy of the entry is for: see [`TableConfig::matched`]).
    pub(crate) name: TableName,
    /// Which `[[tables]]` entry this is, counted from 0: errors name it.
    pub(crate) entry: usize,
    /// The entry's pattern, when its `name` is one (`tenant_*.outbox`).
    pub(crate) pattern: Option<Arc<TablePattern>>,
    /// `topic`: the Kafka topic or NATS subject, from literals and columns. Default
    /// `{topic}`.
    pub(crate) topic: Template,
    /// `[tables.columns]`: which column plays which part.
    pub(crate) columns: Columns,
    /// Extra headers: header name (shared by every message of the table) and the column it comes from.
    pub(crate) header_columns: Vec<(Arc<str>, Ident)>,
    /// `max_rate`: rows per second published by all relays of the table together
    /// (`None`: unlimited).
    pub(crate) max_rate: Option<f64>,
    /// `dead_letter_topic`: where a dead-lettered row is also published once.
    pub(crate) dead_letter_topic: Option<Template>,
    /// `envelope = "cloudevents"` and `[tables.cloudevents]`; `None`: the payload as is.
    pub(crate) cloudevents: Option<CloudEvents>,
}

impl TableConfig {
    /// The entry's settings for `name`, a table its pattern matches.
    pub(crate) fn matched(&self, name: TableName) -> TableConfig {
        TableConfig {
            name,
            ..self.clone()
        }
    }

    /// The entry as errors name it: `tables[2] (tenant_*.outbox)`.
    pub(crate) fn entry_name(&self) -> String {
        match &self.pattern {
            Some(p) => format!("tables[{}] ({p})", self.entry),
            None => format!("tables[{}] ({})", self.entry, self.name),
        }
    }
}

/// The columns the relay reads and writes. The default is the contract's table
/// (section 5); `[tables.columns]` maps any of them to other names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Columns {
    /// Message id: `<table>:<value>`. Any type.
    pub(crate) id: Ident,
    /// Order within a key, and the row's handle in claims, marks and deletes: an integer
    /// column with unique values. The id column unless mapped.
    pub(crate) order: Ident,
    /// Ordering and partition key; NULL = unordered.
    pub(crate) key: Ident,
    /// Message body.
    pub(crate) payload: Ident,
    /// A JSON object of strings copied to message headers.
    pub(crate) headers: OptionalColumn,
    /// Lag is measured from here.
    pub(crate) created_at: OptionalColumn,
    /// Set in mark mode.
    pub(crate) published_at: Ident,
    /// Failed publish attempts.
    pub(crate) attempts: Ident,
    /// The last publish error.
    pub(crate) last_error: Ident,
    /// Set when the row is dead-lettered.
    pub(crate) dead_at: Ident,
    /// After a failure: the row is not claimed before this time (NULL = due).
    pub(crate) next_attempt_at: Ident,
}

/// A column the relay can do without.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OptionalColumn {
    /// Not configured: used when the table has a column of the default name.
    Default(Ident),
    /// Configured: the table must have it.
    Named(Ident),
    /// Configured as `""`: not used.
    Off,
}

impl OptionalColumn {
    /// The column to look for, if any.
    pub(crate) fn name(&self) -> Option<&Ident> {
        match self {
            OptionalColumn::Default(c) | OptionalColumn::Named(c) => Some(c),
            OptionalColumn::Off => None,
        }
    }
}

impl Default for Columns {
    fn default() -> Self {
        let c = |n: &str| Ident::parse(n).expect("default column names are valid");
        Columns {
            id: c("id"),
            order: c("id"),
            key: c("key"),
            payload: c("payload"),
            headers: OptionalColumn::Default(c("headers")),
            created_at: OptionalColumn::Default(c("created_at")),
            published_at: c("published_at"),
            attempts: c("attempts"),
            last_error: c("last_error"),
            dead_at: c("dead_at"),
            next_attempt_at: c("next_attempt_at"),
        }
    }
}

impl Columns {
    /// Whether these are the default table's column names (however they were written).
    pub(crate) fn is_default_layout(&self) -> bool {
        let d = Columns::default();
        let names = |c: &Columns| {
            [
                Some(c.id.clone()),
                Some(c.order.clone()),
                Some(c.key.clone()),
                Some(c.payload.clone()),
                c.headers.name().cloned(),
                c.created_at.name().cloned(),
                Some(c.published_at.clone()),
                Some(c.attempts.clone()),
                Some(c.last_error.clone()),
                Some(c.dead_at.clone()),
                Some(c.next_attempt_at.clone()),
            ]
        };
        names(self) == names(&d)
    }

    /// Validates `[tables.columns]`; `at` is the key prefix for errors (`tables[0].columns`).
    fn from_raw(raw: RawColumns, at: &str) -> Result<Columns, ConfigError> {
        let defaults = Columns::default();
        let ident = |value: Option<String>, role: &str, default: &Ident| match value {
            None => Ok(default.clone()),
            Some(v) => Ident::parse(&v).map_err(|e| ConfigError::new(format!("{at}.{role}"), e)),
        };
        let optional = |value: Option<String>, role: &str, default: &OptionalColumn| match value {
            None => Ok(default.clone()),
            Some(v) if v.is_empty() => Ok(OptionalColumn::Off),
            Some(v) => Ident::parse(&v)
                .map(OptionalColumn::Named)
                .map_err(|e| ConfigError::new(format!("{at}.{role}"), e)),
        };
        let id = ident(raw.id, "id", &defaults.id)?;
        let order = match raw.order {
            None => id.clone(),
            some => ident(some, "order", &defaults.order)?,
        };
        let columns = Columns {
            id,
            order,
            key: ident(raw.key, "key", &defaults.key)?,
            payload: ident(raw.payload, "payload", &defaults.payload)?,
            headers: optional(raw.headers, "headers", &defaults.headers)?,
            created_at: optional(raw.created_at, "created_at", &defaults.created_at)?,
            published_at: ident(raw.published_at, "published_at", &defaults.published_at)?,
            attempts: ident(raw.attempts, "attempts", &defaults.attempts)?,
            last_error: ident(raw.last_error, "last_error", &defaults.last_error)?,
            dead_at: ident(raw.dead_at, "dead_at", &defaults.dead_at)?,
            next_attempt_at: ident(
                raw.next_attempt_at,
                "next_attempt_at",
                &defaults.next_attempt_at,
            )?,
        };
        columns.check_distinct(at)?;
        Ok(columns)
    }

    /// One column cannot play two parts the relay writes or reads differently.
    fn check_distinct(&self, at: &str) -> Result<(), ConfigError> {
        let roles = [
            ("order", Some(&self.order)),
            ("key", Some(&self.key)),
            ("payload", Some(&self.payload)),
            ("headers", self.headers.name()),
            ("published_at", Some(&self.published_at)),
            ("attempts", Some(&self.attempts)),
            ("last_error", Some(&self.last_error)),
            ("dead_at", Some(&self.dead_at)),
            ("next_attempt_at", Some(&self.next_attempt_at)),
        ];
        for (i, (role, column)) in roles.iter().enumerate() {
            if let Some(other) = roles[..i].iter().find(|(_, c)| c.is_some() && c == column) {
                return Err(ConfigError::new(
                    format!("{at}.{role}"),
                    format!(
                        "column {} is already the {} column; each part needs its own column",
                        column.expect("compared only when set"),
                        other.0
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Validates every `[[tables]]` entry: at least one, none listed twice, no table named by
/// one entry and matched by another's pattern. Returns the entries that name a table, and
/// those that name a pattern (their `name` is a placeholder until a table matches).
pub(super) fn validate(
    raw: Vec<RawTable>,
    sink: &SinkTarget,
) -> Result<(Vec<TableConfig>, Vec<TableConfig>), ConfigError> {
    if raw.is_empty() {
        return Err(ConfigError::new(
            "tables",
            "at least one [[tables]] entry is required",
        ));
    }
    let mut tables: Vec<TableConfig> = Vec::new();
    for (i, t) in raw.into_iter().enumerate() {
        let at = |key: &str| format!("tables[{i}].{key}");
        let pattern = TablePattern::parse(&t.name).map_err(|e| ConfigError::new(at("name"), e))?;
        let name = match &pattern {
            Some(_) => TableName::placeholder(),
            None => TableName::parse(&t.name).map_err(|e| ConfigError::new(at("name"), e))?,
        };
        if pattern.is_none()
            && tables
                .iter()
                .any(|other| other.pattern.is_none() && other.name == name)
        {
            return Err(ConfigError::new(
                at("name"),
                format!("{name} is listed twice"),
            ));
        }
        let topic = Template::parse(&t.topic).map_err(|e| ConfigError::new(at("topic"), e))?;
        let max_rate = match t.max_rate {
            Some(rate) if !(rate.is_finite() && rate > 0.0) => {
                return Err(ConfigError::new(
                    at("max_rate"),
                    format!(
                        "is {rate}; it is rows per second and must be above 0 (leave it out \
                         for no limit)"
                    ),
                ))
            }
            rate => rate,
        };
        tables.push(TableConfig {
            name,
            entry: i,
            pattern: pattern.map(Arc::new),
            topic,
            columns: Columns::from_raw(t.columns, &at("columns"))?,
            header_columns: header_columns(t.header_columns, &at("header_columns"))?,
            max_rate,
            dead_letter_topic: t
                .dead_letter_topic
                .map(|d| Template::parse(&d))
                .transpose()
                .map_err(|e| ConfigError::new(at("dead_letter_topic"), e))?,
            cloudevents: cloudevents::validate(t.envelope, t.cloudevents, sink, &at)?,
        });
    }
    check_overlap(&tables)?;
    Ok(tables.into_iter().partition(|t| t.pattern.is_none()))
}

/// A table named by one entry and matched by another's pattern would be relayed twice
/// over: refused, naming both entries. (Two patterns that both match a table are found
/// when the catalog is read: `source::discover`.)
fn check_overlap(tables: &[TableConfig]) -> Result<(), ConfigError> {
    for plain in tables.iter().filter(|t| t.pattern.is_none()) {
        let by = tables
            .iter()
            .find(|t| t.pattern.as_ref().is_some_and(|p| p.matches(&plain.name)));
        if let Some(by) = by {
            let (first, second) = if by.entry < plain.entry {
                (by, plain)
            } else {
                (plain, by)
            };
            return Err(ConfigError::new(
                format!("tables[{}].name", second.entry),
                format!(
                    "table {} is matched by two [[tables]] entries, {} and {}: a table is \
                     relayed by one entry (narrow the pattern or remove one)",
                    plain.name,
                    first.entry_name(),
                    second.entry_name()
                ),
            ));
        }
    }
    Ok(())
}

/// Validates `[tables.header_columns]`; `at` is the key prefix for errors.
fn header_columns(
    raw: BTreeMap<String, String>,
    at: &str,
) -> Result<Vec<(Arc<str>, Ident)>, ConfigError> {
    raw.into_iter()
        .map(|(name, column)| {
            let key = format!("{at}.{name}");
            if !headers::is_valid_name(&name) {
                return Err(ConfigError::new(
                    key,
                    "a header name is printable ASCII without spaces or ':'",
                ));
            }
            if headers::is_reserved(&name) {
                return Err(ConfigError::new(
                    key,
                    format!("{name} is set by the relay itself"),
                ));
            }
            let column = Ident::parse(&column).map_err(|e| ConfigError::new(key, e))?;
            Ok((Arc::from(name), column))
        })
        .collect()
}
