//! Table patterns: a `[[tables]] name` that selects every table whose schema and name
//! match, such as `tenant_*.outbox` (one outbox per tenant schema).
//!
//! # Syntax
//!
//! A name is a pattern when it holds `*` or `?` outside double quotes; any other name is
//! a plain table name, read exactly as before ([`TableName::parse`]). A pattern is
//! `schema.table` or `table` (schema `public`, as for a plain name); each part is made of
//! pieces written next to each other:
//!
//! 1. unquoted letters, digits, `_` and `$`: folded to lower case, as PostgreSQL folds an
//!    unquoted name;
//! 2. `"quoted text"`: kept exactly (`""` for a quote); `*` and `?` inside quotes are
//!    plain characters;
//! 3. `*`: any run of characters, none included; `?`: exactly one character.
//!
//! The schema part and the table part are matched separately: no wildcard reaches across
//! the `.` between them. Matching is on the names as the catalog stores them, case
//! sensitive.
//!
//! # In SQL
//!
//! [`TablePattern::like`] turns each part into a `LIKE` pattern (escape character `\`,
//! PostgreSQL's default): `*` -> `%`, `?` -> `_`, and a literal `%`, `_` or `\` escaped
//! with `\`. The patterns are bound as values, never spliced into the statement.

use std::fmt;

use super::names::TableName;

/// A `[[tables]] name` with wildcards: see the module doc for the syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TablePattern {
    schema: Glob,
    table: Glob,
    /// As written (trimmed), for messages.
    text: String,
}

/// One part of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Glob(Vec<Piece>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Piece {
    Char(char),
    /// `*`
    Any,
    /// `?`
    One,
}

impl TablePattern {
    /// Reads `text` as a pattern; `Ok(None)` when it has no wildcard outside quotes (a
    /// plain name, for [`TableName::parse`]).
    pub(crate) fn parse(text: &str) -> Result<Option<TablePattern>, String> {
        let text = text.trim();
        if !text.contains(['*', '?']) {
            return Ok(None);
        }
        let (first, rest) = Glob::parse_prefix(text)?;
        let (schema, table) = match rest.strip_prefix('.') {
            None if rest.is_empty() => (Glob::literal("public"), first),
            None => return Err(format!("unexpected {rest:?}: write schema.table")),
            Some(second) => {
                let (table, rest) = Glob::parse_prefix(second)?;
                if !rest.is_empty() {
                    return Err(format!("unexpected {rest:?} after schema.table"));
                }
                (first, table)
            }
        };
        if !schema.is_wild() && !table.is_wild() {
            return Ok(None);
        }
        Ok(Some(TablePattern {
            schema,
            table,
            text: text.to_owned(),
        }))
    }

    /// Whether `name` is one of the tables this pattern selects.
    pub(crate) fn matches(&self, name: &TableName) -> bool {
        self.schema.matches(name.schema.as_str()) && self.table.matches(name.table.as_str())
    }

    /// The schema and table parts as `LIKE` patterns (escape `\`).
    pub(crate) fn like(&self) -> (String, String) {
        (self.schema.like(), self.table.like())
    }
}

/// The pattern as written.
impl fmt::Display for TablePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Glob {
    fn literal(text: &str) -> Glob {
        Glob(text.chars().map(Piece::Char).collect())
    }

    fn is_wild(&self) -> bool {
        self.0.iter().any(|p| !matches!(p, Piece::Char(_)))
    }

    /// Reads one part at the start of `text`, up to an unquoted `.` or the end; returns the
    /// rest.
    fn parse_prefix(text: &str) -> Result<(Glob, &str), String> {
        let mut pieces = Vec::new();
        let mut chars = text.char_indices().peekable();
        let mut end = text.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '.' => {
                    end = i;
                    break;
                }
                '*' => pieces.push(Piece::Any),
                '?' => pieces.push(Piece::One),
                '"' => loop {
                    match chars.next() {
                        None => return Err("unterminated quoted identifier".to_owned()),
                        Some((_, '"')) if chars.peek().is_some_and(|&(_, c)| c == '"') => {
                            chars.next();
                            pieces.push(Piece::Char('"'));
                        }
                        Some((_, '"')) => break,
                        Some((_, c)) => pieces.push(Piece::Char(c)),
                    }
                },
                c if c.is_ascii_alphanumeric() || c == '_' || c == '$' => {
                    pieces.push(Piece::Char(c.to_ascii_lowercase()));
                }
                c => {
                    return Err(format!(
                        "{c:?} cannot appear in a table name or pattern: quote the name, or \
                         use * and ? as wildcards"
                    ))
                }
            }
        }
        if pieces.is_empty() {
            return Err(format!("{text:?}: a schema or table part is empty"));
        }
        Ok((Glob(pieces), &text[end..]))
    }

    /// Glob matching over characters, `*` backtracking to the last star.
    fn matches(&self, name: &str) -> bool {
        let name: Vec<char> = name.chars().collect();
        let pieces = &self.0;
        let (mut p, mut n) = (0, 0);
        let mut star: Option<(usize, usize)> = None;
        while n < name.len() {
            match pieces.get(p) {
                Some(Piece::Any) => {
                    star = Some((p, n));
                    p += 1;
                }
                Some(Piece::One) => (p, n) = (p + 1, n + 1),
                Some(Piece::Char(c)) if *c == name[n] => (p, n) = (p + 1, n + 1),
                _ => match star {
                    Some((sp, sn)) => {
                        star = Some((sp, sn + 1));
                        (p, n) = (sp + 1, sn + 1);
                    }
                    None => return false,
                },
            }
        }
        pieces[p..].iter().all(|piece| *piece == Piece::Any)
    }

    /// The part as a `LIKE` pattern with `\` as its escape character.
    fn like(&self) -> String {
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Any => out.push('%'),
                Piece::One => out.push('_'),
                Piece::Char(c) => {
                    if matches!(c, '%' | '_' | '\\') {
                        out.push('\\');
                    }
                    out.push(*c);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(text: &str) -> TablePattern {
        TablePattern::parse(text).unwrap().expect("a pattern")
    }

    fn name(text: &str) -> TableName {
        TableName::parse(text).unwrap()
    }

    #[test]
    fn a_name_without_wildcards_outside_quotes_is_a_plain_name() {
        for plain in ["outbox", "public.outbox", "\"a*b\".\"c?d\"", " App.Outbox "] {
            assert_eq!(TablePattern::parse(plain), Ok(None), "{plain}");
        }
    }

    #[test]
    fn star_matches_any_run_and_question_mark_one_character_within_a_part() {
        let p = pattern("tenant_*.outbox");
        assert!(p.matches(&name("tenant_a.outbox")));
        assert!(p.matches(&name("tenant_.outbox")));
        assert!(p.matches(&name("tenant_acme_eu.outbox")));
        assert!(!p.matches(&name("tenant.outbox")));
        assert!(!p.matches(&name("tenant_a.outbox2")));
        assert!(!p.matches(&name("xtenant_a.outbox")));
        let q = pattern("t?.out*");
        assert!(q.matches(&name("t1.outbox")));
        assert!(q.matches(&name("t1.out")));
        assert!(!q.matches(&name("t12.outbox")));
        assert!(!q.matches(&name("t.outbox")));
        let both = pattern("*.*box*");
        assert!(both.matches(&name("a.outbox")));
        assert!(both.matches(&name("a.boxes")));
        assert!(!both.matches(&name("a.bo")));
    }

    #[test]
    fn a_pattern_without_a_schema_is_in_public() {
        let p = pattern("outbox_*");
        assert!(p.matches(&name("outbox_orders")));
        assert!(!p.matches(&name("other.outbox_orders")));
        assert_eq!(p.like(), ("public".to_owned(), "outbox\\_%".to_owned()));
    }

    #[test]
    fn unquoted_text_folds_to_lower_case_and_quoted_text_is_kept_with_its_wildcards_literal() {
        let p = pattern("\"Tenant\"*.\"Out*\"box");
        assert!(p.matches(&name("\"Tenant_A\".\"Out*box\"")));
        assert!(!p.matches(&name("tenant_a.\"Out*box\"")));
        assert!(!p.matches(&name("\"Tenant_A\".\"Outxbox\"")));
        assert_eq!(p.like(), ("Tenant%".to_owned(), "Out*box".to_owned()));
        let folded = pattern("Tenant_*.OUTBOX");
        assert!(folded.matches(&name("tenant_a.outbox")));
        let quote = pattern("\"a\"\"b\"*.outbox");
        assert!(quote.matches(&name("\"a\"\"bc\".outbox")));
        assert_eq!(quote.like().0, "a\"b%");
    }

    #[test]
    fn like_escapes_the_characters_like_treats_as_wildcards() {
        let p = pattern("\"50%_off\\\"*.?");
        assert_eq!(p.like(), ("50\\%\\_off\\\\%".to_owned(), "_".to_owned()));
        assert!(p.matches(&name("\"50%_off\\x\".t")));
        assert!(!p.matches(&name("\"50x_off\\x\".t")));
    }

    #[test]
    fn bad_patterns_say_what_is_wrong() {
        for bad in [
            "tenant_*.",
            ".outbox*",
            "a.b.c*",
            "tenant-*.outbox",
            "\"open*",
            "*.out box",
        ] {
            assert!(TablePattern::parse(bad).is_err(), "{bad}");
        }
    }

    /// The glob against a brute-force reference: every name over a small alphabet.
    #[test]
    fn matching_agrees_with_a_reference_over_small_names() {
        fn reference(p: &[Piece], n: &[char]) -> bool {
            match (p.first(), n.first()) {
                (None, _) => n.is_empty(),
                (Some(Piece::Any), _) => {
                    reference(&p[1..], n) || (!n.is_empty() && reference(p, &n[1..]))
                }
                (Some(Piece::One), Some(_)) => reference(&p[1..], &n[1..]),
                (Some(Piece::Char(c)), Some(d)) if c == d => reference(&p[1..], &n[1..]),
                _ => false,
            }
        }
        let alphabet = ['a', 'b'];
        let mut names = vec![String::new()];
        for len in 1..=4 {
            let mut more = Vec::new();
            for n in names.iter().filter(|n| n.len() == len - 1) {
                for c in alphabet {
                    more.push(format!("{n}{c}"));
                }
            }
            names.extend(more);
        }
        for p in [
            "*", "a*", "*a", "a*b", "?", "*?a*", "a?*b", "**b", "ab", "*a*b*",
        ] {
            let glob = Glob::parse_prefix(p).unwrap().0;
            for n in &names {
                let chars: Vec<char> = n.chars().collect();
                assert_eq!(glob.matches(n), reference(&glob.0, &chars), "{p} vs {n:?}");
            }
        }
    }
}
