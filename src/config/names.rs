//! Names that come from configuration and end up in SQL or in a topic: table names, column
//! names and topic templates. They are checked here once; SQL only ever sees them quoted.

use std::fmt;
use std::sync::Arc;

/// A PostgreSQL identifier as PostgreSQL itself resolves it: unquoted names fold to lower
/// case, `"Quoted"` names are kept exactly.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ident(String);

impl Ident {
    /// Parses one identifier, quoted or not.
    pub fn parse(text: &str) -> Result<Ident, String> {
        let (ident, rest) = Self::parse_prefix(text)?;
        if !rest.is_empty() {
            return Err(format!("unexpected {rest:?} after identifier"));
        }
        Ok(ident)
    }

    /// Parses an identifier at the start of `text`, returning the unparsed rest.
    fn parse_prefix(text: &str) -> Result<(Ident, &str), String> {
        let name;
        let rest;
        if let Some(quoted) = text.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            loop {
                match chars.next() {
                    None => return Err("unterminated quoted identifier".to_owned()),
                    Some((i, '"')) => {
                        if quoted[i + 1..].starts_with('"') {
                            value.push('"');
                            chars.next();
                        } else {
                            rest = &quoted[i + 1..];
                            break;
                        }
                    }
                    Some((_, c)) => value.push(c),
                }
            }
            name = value;
        } else {
            let end = text
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'))
                .unwrap_or(text.len());
            let word = &text[..end];
            if word.is_empty() || word.starts_with(|c: char| c.is_ascii_digit() || c == '$') {
                return Err(format!(
                    "{text:?} is not an identifier: start with a letter or _, or quote it"
                ));
            }
            name = word.to_ascii_lowercase();
            rest = &text[end..];
        }
        if name.is_empty() || name.contains('\0') || name.len() > 63 {
            return Err(format!(
                "{name:?} is not a usable identifier (1 to 63 bytes, no NUL)"
            ));
        }
        Ok((Ident(name), rest))
    }

    /// The name as PostgreSQL stores it in the catalog.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    /// The identifier quoted for SQL: `"name"` with inner quotes doubled.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0.replace('"', "\"\""))
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A schema-qualified table name. `outbox` alone means `public.outbox`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct TableName {
    pub(crate) schema: Ident,
    pub(crate) table: Ident,
}

impl TableName {
    pub(crate) fn parse(text: &str) -> Result<TableName, String> {
        let (first, rest) = Ident::parse_prefix(text.trim())?;
        if rest.is_empty() {
            return Ok(TableName {
                schema: Ident("public".to_owned()),
                table: first,
            });
        }
        let second = rest
            .strip_prefix('.')
            .ok_or_else(|| format!("unexpected {rest:?}: write schema.table"))?;
        Ok(TableName {
            schema: first,
            table: Ident::parse(second)?,
        })
    }

    /// A table as the catalog names it (`pg_namespace.nspname`, `pg_class.relname`): kept
    /// exactly, as a quoted name would be.
    pub(crate) fn from_catalog(schema: String, table: String) -> TableName {
        TableName {
            schema: Ident(schema),
            table: Ident(table),
        }
    }

    /// The name an entry that names a pattern carries until a table matches it (never
    /// used in SQL: only matched copies of the entry are relayed).
    pub(super) fn placeholder() -> TableName {
        TableName {
            schema: Ident("*".to_owned()),
            table: Ident("*".to_owned()),
        }
    }

    /// `"schema"."table"`, for SQL.
    pub(crate) fn quoted(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.table.quoted())
    }
}

/// `schema.table`: the form used in message ids (`public.outbox:42`) and in logs.
impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.table)
    }
}

/// A topic or subject template such as `outbox.event.{aggregatetype}`: literal text and
/// `{column}` references, `{{` and `}}` for literal braces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Template {
    parts: Vec<Part>,
    columns: Vec<Ident>,
    /// The whole topic when the template has no column references: every message of the
    /// table shares this one string.
    constant: Option<Arc<str>>,
}

/// The distinct strings rendered last (at most [`RecentTopics::CAP`]): a batch's rows mostly
/// share a few topics (and CloudEvents types and sources), and each is allocated once for
/// all of them.
#[derive(Debug, Default)]
pub(crate) struct RecentTopics(Vec<Arc<str>>);

impl RecentTopics {
    const CAP: usize = 8;

    /// The kept topic of `len` bytes that is `pieces` joined, compared without building it.
    fn find<'a, I: Iterator<Item = &'a str>>(
        &self,
        len: usize,
        pieces: impl Fn() -> I,
    ) -> Option<Arc<str>> {
        self.0
            .iter()
            .find(|topic| {
                topic.len() == len && {
                    let mut rest = &topic[..];
                    pieces().all(|piece| match rest.strip_prefix(piece) {
                        Some(after) => {
                            rest = after;
                            true
                        }
                        None => false,
                    })
                }
            })
            .cloned()
    }

    /// Keeps `topic`, forgetting the oldest when full, and returns it.
    fn keep(&mut self, topic: Arc<str>) -> Arc<str> {
        if self.0.len() == Self::CAP {
            self.0.remove(0);
        }
        self.0.push(topic.clone());
        topic
    }
}

/// A topic template's column was NULL in a row: the row cannot get a topic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column {column} used in the topic template is NULL")]
pub(crate) struct NullColumn {
    pub(crate) column: Ident,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    /// Index into [`Template::columns`].
    Column(usize),
}

impl Template {
    pub(crate) fn parse(text: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut columns: Vec<Ident> = Vec::new();
        let mut literal = String::new();
        let mut rest = text;
        while !rest.is_empty() {
            if let Some(after) = rest.strip_prefix("{{") {
                literal.push('{');
                rest = after;
            } else if let Some(after) = rest.strip_prefix("}}") {
                literal.push('}');
                rest = after;
            } else if let Some(after) = rest.strip_prefix('{') {
                let end = after
                    .find('}')
                    .ok_or_else(|| format!("unclosed {{ in template {text:?}"))?;
                let column = Ident::parse(&after[..end])
                    .map_err(|e| format!("bad column reference in template {text:?}: {e}"))?;
                if !literal.is_empty() {
                    parts.push(Part::Literal(std::mem::take(&mut literal)));
                }
                let index = match columns.iter().position(|c| *c == column) {
                    Some(i) => i,
                    None => {
                        columns.push(column);
                        columns.len() - 1
                    }
                };
                parts.push(Part::Column(index));
                rest = &after[end + 1..];
            } else if rest.starts_with('}') {
                return Err(format!(
                    "stray }} in template {text:?}: write }}}} for a literal brace"
                ));
            } else {
                let c = rest.chars().next().expect("rest is not empty");
                literal.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        if parts.is_empty() {
            return Err("the topic template is empty".to_owned());
        }
        let constant = match parts.as_slice() {
            [Part::Literal(s)] => Some(Arc::from(s.as_str())),
            _ => None,
        };
        Ok(Template {
            parts,
            columns,
            constant,
        })
    }

    /// The columns referenced, in the order [`Template::render`] expects their values.
    pub(crate) fn columns(&self) -> &[Ident] {
        &self.columns
    }

    /// Whether the template is one column reference and nothing else (`{key}`): its
    /// value is the column's, as it is.
    pub(crate) fn is_one_column(&self) -> bool {
        matches!(self.parts[..], [Part::Column(0)])
    }

    /// Renders the template from the values of [`Template::columns`]; a NULL value is an
    /// error naming the column.
    pub(crate) fn render(&self, values: &[Option<String>]) -> Result<Arc<str>, NullColumn> {
        self.render_shared(values, &mut RecentTopics::default())
    }

    /// [`Template::render`], sharing strings: a template without column references gives
    /// its one string, and a topic among `recent` is that string again, not a copy. A new
    /// topic is built in one allocation and joins `recent`.
    pub(crate) fn render_shared(
        &self,
        values: &[Option<String>],
        recent: &mut RecentTopics,
    ) -> Result<Arc<str>, NullColumn> {
        if let Some(topic) = &self.constant {
            return Ok(topic.clone());
        }
        let mut len = 0;
        for part in &self.parts {
            len += match part {
                Part::Literal(s) => s.len(),
                Part::Column(i) => match values.get(*i).and_then(Option::as_deref) {
                    Some(v) => v.len(),
                    None => {
                        return Err(NullColumn {
                            column: self.columns[*i].clone(),
                        })
                    }
                },
            };
        }
        let pieces = || {
            self.parts.iter().map(|part| match part {
                Part::Literal(s) => s.as_str(),
                Part::Column(i) => values[*i].as_deref().unwrap_or_default(),
            })
        };
        if let Some(topic) = recent.find(len, pieces) {
            return Ok(topic);
        }
        let mut out = String::with_capacity(len);
        pieces().for_each(|piece| out.push_str(piece));
        Ok(recent.keep(Arc::from(out)))
    }

    /// The topic when the template has no column references.
    pub(crate) fn literal(&self) -> Option<&str> {
        self.constant.as_deref()
    }
}

/// Random identifiers made to break quoting: quotes, dots, spaces, semicolons, comment
/// and dollar-quote starters, backslashes, upper case and multi-byte characters, 1 to 63
/// bytes, no NUL. Shared by the property tests here and against PostgreSQL.
#[cfg(any(test, feature = "testing"))]
pub fn adversarial_ident(rng: &mut impl rand::Rng) -> String {
    const PIECES: &[&str] = &[
        "\"",
        "\"\"",
        ".",
        " ",
        ";",
        "--",
        "/*",
        "*/",
        "$$",
        "$1",
        "\\",
        "'",
        "a",
        "Z",
        "_",
        "0",
        "é",
        "日本",
        "🦀",
        "\t",
        "\n",
        "DROP TABLE x",
        ")",
        "(",
        ",",
        "::",
        "%s",
        "{",
        "}",
    ];
    loop {
        let mut name = String::new();
        for _ in 0..rng.random_range(1..8) {
            name.push_str(PIECES[rng.random_range(0..PIECES.len())]);
        }
        if name.len() <= 63 {
            return name;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn quoting_round_trips_for_any_identifier() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..20_000 {
            let name = adversarial_ident(&mut rng);
            let ident = Ident::parse(&format!("\"{}\"", name.replace('"', "\"\""))).unwrap();
            assert_eq!(ident.as_str(), name);
            let quoted = ident.quoted();
            // One leading and one trailing quote; every quote inside comes doubled, so the
            // SQL lexer cannot leave the identifier early.
            let inner = &quoted[1..quoted.len() - 1];
            assert!(quoted.starts_with('"') && quoted.ends_with('"'));
            assert_eq!(inner.replace("\"\"", ""), name.replace('"', ""));
            assert_eq!(Ident::parse(&quoted).unwrap(), ident);
            let table = TableName::parse(&format!("{quoted}.{quoted}")).unwrap();
            assert_eq!(table.schema, ident);
            assert_eq!(table.table, ident);
            assert_eq!(TableName::parse(&table.quoted()).unwrap(), table);
        }
    }

    #[test]
    fn table_names_fold_unquoted_and_keep_quoted() {
        let t = TableName::parse("Public.Outbox").unwrap();
        assert_eq!(t.to_string(), "public.outbox");
        assert_eq!(t.quoted(), "\"public\".\"outbox\"");
        let t = TableName::parse("\"My Schema\".\"we\"\"ird\"").unwrap();
        assert_eq!(t.schema.as_str(), "My Schema");
        assert_eq!(t.quoted(), "\"My Schema\".\"we\"\"ird\"");
        assert_eq!(
            TableName::parse("outbox").unwrap().to_string(),
            "public.outbox"
        );
    }

    #[test]
    fn table_names_reject_injection_attempts() {
        for bad in [
            "public.outbox; drop table x",
            "a.b.c",
            "",
            "1abc",
            "a.\"b",
            "a b",
        ] {
            assert!(TableName::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn templates_render_columns_and_escaped_braces() {
        let t = Template::parse("outbox.{aggregatetype}.{{x}}.{type}.{aggregatetype}").unwrap();
        assert_eq!(t.columns().len(), 2);
        let out = t
            .render(&[Some("order".into()), Some("created".into())])
            .unwrap();
        assert_eq!(&*out, "outbox.order.{x}.created.order");
        assert_eq!(out.len(), "outbox.order.{x}.created.order".len());
        let null = t.render(&[None, Some("x".into())]).unwrap_err();
        assert_eq!(null.column.as_str(), "aggregatetype");
        assert!(null.to_string().contains("aggregatetype"));
        let fixed = Template::parse("fixed").unwrap();
        assert_eq!(fixed.literal(), Some("fixed"));
        // Every message of a constant topic shares one string.
        let (a, b) = (fixed.render(&[]).unwrap(), fixed.render(&[]).unwrap());
        assert!(Arc::ptr_eq(&a, &b));
    }

    #[test]
    fn rows_that_share_a_topic_share_its_string() {
        let t = Template::parse("events.{type}").unwrap();
        let mut recent = RecentTopics::default();
        let row = |v: &str| [Some(v.to_owned())];
        let a = t.render_shared(&row("a"), &mut recent).unwrap();
        let b = t.render_shared(&row("b"), &mut recent).unwrap();
        assert!(Arc::ptr_eq(
            &a,
            &t.render_shared(&row("a"), &mut recent).unwrap()
        ));
        assert!(Arc::ptr_eq(
            &b,
            &t.render_shared(&row("b"), &mut recent).unwrap()
        ));
        assert_eq!((&*a, &*b), ("events.a", "events.b"));
        // Same length, other text: not taken for a kept topic.
        assert_eq!(
            &*t.render_shared(&row("c"), &mut recent).unwrap(),
            "events.c"
        );
        // Pieces that join to the same text across other boundaries still match.
        let two = Template::parse("{x}{y}").unwrap();
        let ab = two
            .render_shared(&[Some("a".into()), Some("bc".into())], &mut recent)
            .unwrap();
        let same = two
            .render_shared(&[Some("ab".into()), Some("c".into())], &mut recent)
            .unwrap();
        assert!(Arc::ptr_eq(&ab, &same));
        // The oldest is forgotten once more than CAP distinct topics were seen.
        for i in 0..RecentTopics::CAP {
            t.render_shared(&row(&format!("n{i}")), &mut recent)
                .unwrap();
        }
        assert!(!Arc::ptr_eq(
            &a,
            &t.render_shared(&row("a"), &mut recent).unwrap()
        ));
    }

    #[test]
    fn templates_reject_malformed_input() {
        for bad in ["", "a.{", "a.}", "{1x}", "{a b}"] {
            assert!(Template::parse(bad).is_err(), "{bad} was accepted");
        }
    }
}
