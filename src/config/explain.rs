//! Error messages in the words of the config file. The TOML parser and serde describe a
//! mistake in their own terms (`invalid type: string "x", expected usize`); an operator
//! needs the key, what it takes, what was written, and where in the file it is:
//!
//! - a syntax error names its line and column and quotes the line (secrets hidden);
//! - a type error says "a whole number", "true or false", "text in double quotes",
//!   "a table", "a list" instead of Rust type names;
//! - an unknown key suggests the nearest known one.
//!
//! No message echoes a value that may be a secret: URLs lose their `user:password@`, and a
//! value under a key that names a password, secret, token or URL is not shown at all.

use super::error::Override;
use super::kafka;
use super::ConfigError;

/// Fragments of the relay's own keys whose values are never shown in an error. librdkafka
/// property names (anything dotted) follow the one Kafka policy, [`kafka::is_secret`].
const SECRET_KEYS: &[&str] = &[
    "password", "passwd", "secret", "token", "url", "nkey", "creds",
];

/// `line 2, column 12: text must be in double quotes: write ordering = "key"`, followed by
/// the line itself and a caret under the column (unless the line holds a secret).
pub(crate) fn syntax_error(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return format!("not valid TOML: {}", plain_syntax(e.message(), None, None));
    };
    let (number, column, line) = locate(text, span.start);
    let shown = quotable(line);
    let message = plain_syntax(
        e.message(),
        unquoted_text(line, column),
        shown.as_deref().filter(|s| *s == line),
    );
    let mut out = format!("line {number}, column {column}: {message}");
    if let Some(shown) = shown {
        out.push_str(&format!("\n{number:>6} | {shown}"));
        if shown == line {
            let pad: String = line
                .chars()
                .take(column - 1)
                .map(|c| if c == '\t' { '\t' } else { ' ' })
                .collect();
            out.push_str(&format!("\n{:>6} | {pad}^", ""));
        }
    }
    out
}

/// The 1-based line and column (in characters) of byte offset `at`, and that line.
fn locate(text: &str, at: usize) -> (usize, usize, &str) {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let before = &text[..at];
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    let end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let number = before.matches('\n').count() + 1;
    let column = before[start..].chars().count() + 1;
    (number, column, text[start..end].trim_end_matches('\r'))
}

/// The line as it may be shown: `user:password@` removed, the value after `=` hidden when
/// the key names a secret, long lines cut. `None` for a blank line.
fn quotable(line: &str) -> Option<String> {
    if line.trim().is_empty() {
        return None;
    }
    let mut shown = super::redact_userinfo(line);
    if let Some((key, _)) = shown.split_once('=') {
        if is_secret_key(key) && !key.contains("url") {
            shown = format!("{key}= <hidden>");
        }
    }
    if shown.chars().count() > 120 {
        shown = shown.chars().take(117).collect::<String>() + "...";
    }
    Some(shown)
}

/// Whether the value under `key` (a key path, or the key part of a line) may be a secret.
fn is_secret_key(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    let in_kafka_section = ["sink.kafka.properties.", "sink.kafka.property_files."]
        .iter()
        .find_map(|section| key.strip_prefix(section));
    // On a line the section is not known: a dotted name is taken for a librdkafka one.
    let property = in_kafka_section
        .or_else(|| key.contains('.').then_some(key.as_str()))
        .map(|name| name.trim_matches(|c| c == '"' || c == '\''));
    SECRET_KEYS.iter().any(|s| key.contains(s)) || property.is_some_and(kafka::is_secret)
}

/// `key = some words`: a value that is neither quoted nor any other TOML value, with the
/// error inside it. The parser's message then depends on the first letter (`kind = nats`
/// gives "invalid float, expected `nan`"); the fix is always the same. Returns the key and
/// the words.
fn unquoted_text(line: &str, column: usize) -> Option<(&str, &str)> {
    let (key, value) = line.split_once('=')?;
    let value = value.split('#').next().unwrap_or(value).trim();
    let starts_value = key.chars().count() + 1;
    let quoted_or_nested = value.starts_with(['"', '\'', '[', '{']);
    let is_toml = |v: &str| toml::from_str::<toml::Table>(&format!("x = {v}")).is_ok();
    // `workers = 4 5`: the first word is a value, the rest is the mistake.
    let first_word = value.split_whitespace().next().unwrap_or(value);
    (column > starts_value && !value.is_empty() && !quoted_or_nested && !is_toml(first_word))
        .then(|| (key.trim(), value))
}

/// The TOML parser's message in plain words, for the mistakes people make. `unquoted` is a
/// bare-word value the error is in; `line` is set when the line may be shown, and lets the
/// message show the corrected line.
fn plain_syntax(message: &str, unquoted: Option<(&str, &str)>, line: Option<&str>) -> String {
    let starts = |prefix: &str| message.starts_with(prefix);
    if unquoted.is_some() || starts("string values must be quoted") {
        let from_line = || {
            let (k, v) = line?.split_once('=')?;
            Some((k.trim(), v.split('#').next().unwrap_or(v).trim()))
        };
        let fix = line
            .and(unquoted.or_else(from_line))
            .map(|(k, v)| format!(": write {k} = \"{v}\""))
            .unwrap_or_default();
        format!("text must be in double quotes{fix}")
    } else if starts("invalid basic string") || starts("invalid literal string") {
        "a quoted text is not closed on its line: add the closing quote (use \"\"\" for text \
         over several lines)"
            .into()
    } else if starts("missing escaped value") || starts("invalid escape") {
        "a backslash in double quotes starts an escape such as \\n: write \\\\ for a \
         backslash, or use single quotes ('C:\\dir') for text with backslashes"
            .into()
    } else if starts("duplicate key") {
        "this key or [section] is already set above in the file: keep one".into()
    } else if starts("key with no value") || starts("missing value") {
        "a key without a value: write key = value".into()
    } else if starts("unclosed table") {
        "a [section] header is not closed: end it with ]".into()
    } else if starts("unclosed array table") {
        "a [[section]] header is not closed: end it with ]]".into()
    } else if starts("unexpected key or value") || starts("unexpected content") {
        "unexpected text after the value: write one key = value per line (a comment starts \
         with #)"
            .into()
    } else if starts("unclosed array") {
        "a list is not closed: end it with ]".into()
    } else if starts("unclosed inline table") {
        "an inline table is not closed: end it with } on the same line".into()
    } else {
        message.to_owned()
    }
}

/// Turns serde's message into one that leads with the full key, e.g.
/// `relay.workerz: unknown key; did you mean workers?`, `postgres.url: required key is
/// missing`, `relay.workers: expected a whole number, got the text "x"`. A key set by an
/// `OUTBOX_RELAY__...` variable names the variable.
pub(crate) fn serde_error(
    e: &serde_path_to_error::Error<toml::de::Error>,
    overrides: &[Override],
) -> ConfigError {
    let path = e.path().to_string();
    let inner = e.inner().message();
    let join = |key: &str| {
        if path.ends_with(key) {
            path.clone()
        } else if path == "." || path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        }
    };
    let (key, message) = if let Some(field) = backticked(inner, "missing field `") {
        let key = join(field);
        let message = missing(&key);
        (key, message)
    } else if let Some(field) = backticked(inner, "unknown field `") {
        let key = join(field);
        let parent = key
            .strip_suffix(field)
            .unwrap_or(&key)
            .trim_end_matches('.');
        let message = unknown(field, inner, parent);
        (key, message)
    } else {
        (path.clone(), plain_type_error(inner, &path))
    };
    ConfigError::new(key, message).with_sources(overrides)
}

fn backticked<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    text.strip_prefix(prefix)?.split('`').next()
}

/// `[relay]` for `relay.workerz`, `[tables.columns]` for `tables[0].columns.keys`.
fn section_of(path: &str) -> Option<String> {
    let mut name = String::new();
    let mut depth = 0;
    for c in path.chars() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ if depth == 0 => name.push(c),
            _ => {}
        }
    }
    (!name.is_empty() && name != ".").then(|| format!("[{name}]"))
}

fn missing(key: &str) -> String {
    match key {
        "postgres" | "sink" => format!("required section is missing: add [{key}]"),
        "tables" => "required key is missing: add a [[tables]] entry with \
                     name = \"schema.table\""
            .into(),
        "sink.kind" => {
            "required key is missing: write kind = \"kafka\", \"nats\" or \"stdout\"".into()
        }
        _ => "required key is missing".into(),
    }
}

/// `unknown key; did you mean workers?`, or the keys that are allowed in `section` (the
/// path of the table that holds the unknown key, empty at the top).
fn unknown(field: &str, inner: &str, section: &str) -> String {
    let known: Vec<&str> = inner
        .split_once("expected ")
        .map(|(_, list)| list.split('`').skip(1).step_by(2).collect())
        .unwrap_or_default();
    if let Some(near) = known
        .iter()
        .map(|k| (distance(field, k), *k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min()
    {
        return format!("unknown key; did you mean {}?", near.1);
    }
    if known.is_empty() {
        return "unknown key".into();
    }
    match section_of(section) {
        Some(section) => format!("unknown key; {section} takes {}", known.join(", ")),
        None => format!("unknown key; the sections are {}", known.join(", ")),
    }
}

/// Edit distance (insertions, deletions, substitutions) between two short names.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

/// `invalid type: string "x", expected usize` -> `expected a whole number, got the text
/// "x"; write the number without quotes` (when the text is a number). Messages that are
/// not serde's (ours, from custom deserializers) pass through unchanged.
fn plain_type_error(inner: &str, path: &str) -> String {
    let Some(rest) = inner
        .strip_prefix("invalid type: ")
        .or_else(|| inner.strip_prefix("invalid value: "))
    else {
        return inner.to_owned();
    };
    let Some((got, want)) = rest.rsplit_once(", expected ") else {
        return inner.to_owned();
    };
    let leaf = path.rsplit('.').next().unwrap_or(path);
    if want == "a sequence" && got == "map" {
        return format!(
            "is a single [{leaf}] table, but it takes a list: write each entry as [[{leaf}]] \
             with double brackets"
        );
    }
    let wanted = plain_expected(want);
    let text = got
        .strip_prefix("string \"")
        .and_then(|s| s.strip_suffix('"'));
    let hint = match text {
        Some(t) if wanted.starts_with("a whole number") && t.trim().parse::<i64>().is_ok() => {
            "; write the number without quotes"
        }
        Some("true" | "false") if wanted.starts_with("true or false") => {
            "; write true or false without quotes"
        }
        _ => "",
    };
    format!("expected {wanted}, got {}{hint}", plain_got(got, path))
}

fn plain_expected(want: &str) -> String {
    match want {
        "usize" | "u64" | "i64" | "i32" => "a whole number".into(),
        "u32" => "a whole number up to 4294967295".into(),
        "u16" => "a whole number up to 65535".into(),
        "u8" => "a whole number up to 255".into(),
        "f64" | "f32" => "a number".into(),
        "a boolean" => "true or false".into(),
        "a string" | "string" => "text in double quotes".into(),
        "path string" => "a file path in double quotes".into(),
        "a sequence" => "a list".into(),
        "a map" => "a table (a [section] of keys)".into(),
        _ if want.starts_with("struct ") => "a table (a [section] of keys)".into(),
        _ => want.to_owned(),
    }
}

/// What was written, in the file's words; text under a secret key is not shown.
fn plain_got(got: &str, path: &str) -> String {
    if let Some(text) = got
        .strip_prefix("string \"")
        .and_then(|s| s.strip_suffix('"'))
    {
        if is_secret_key(path) {
            return "text (not shown: this key may hold a secret)".into();
        }
        // serde quoted it with Debug escapes; show it the same way, without credentials.
        let mut shown = super::redact_userinfo(text);
        if shown.chars().count() > 60 {
            shown = shown.chars().take(57).collect::<String>() + "...";
        }
        return format!("the text \"{shown}\"");
    }
    let between = |prefix: &str| {
        got.strip_prefix(prefix)
            .map(|s| s.trim_matches('`').to_owned())
    };
    if let Some(n) = between("integer ").or_else(|| between("floating point ")) {
        return format!("the number {n}");
    }
    if let Some(b) = between("boolean ") {
        return b;
    }
    match got {
        "map" => "a table".into(),
        "sequence" => "a list".into(),
        _ => got.to_owned(),
    }
}

/// `[[relay]]` makes `relay` a list of tables, which serde would then read field by field
/// and answer with nonsense (`relay[0]: expected usize`). Only `[[tables]]` is a list.
pub(crate) fn check_lists(root: &toml::Table) -> Result<(), ConfigError> {
    fn walk(value: &toml::Value, path: &str) -> Result<(), ConfigError> {
        match value {
            toml::Value::Table(t) => t
                .iter()
                .try_for_each(|(k, v)| walk(v, &format!("{path}.{k}"))),
            toml::Value::Array(items)
                if !items.is_empty() && items.iter().all(toml::Value::is_table) =>
            {
                let section = section_of(path).unwrap_or_default();
                let section = section.trim_start_matches('[').trim_end_matches(']');
                Err(ConfigError::new(
                    path,
                    format!(
                        "is written [[{section}]], which makes a list; write [{section}] with \
                         single brackets"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
    for (key, value) in root {
        match (key.as_str(), value) {
            ("tables", toml::Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    if let toml::Value::Table(t) = item {
                        for (k, v) in t {
                            walk(v, &format!("tables[{i}].{k}"))?;
                        }
                    }
                }
            }
            _ => walk(value, key)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syntax(text: &str) -> String {
        let e = toml::from_str::<toml::Table>(text).unwrap_err();
        syntax_error(text, &e)
    }

    #[test]
    fn syntax_errors_name_line_and_column_and_quote_the_line() {
        let e = syntax("[relay]\n# workers\nordering = key\n");
        assert!(
            e.starts_with(
                "line 3, column 12: text must be in double quotes: write ordering = \"key\""
            ),
            "{e}"
        );
        assert!(
            e.contains("\n     3 | ordering = key\n       |            ^"),
            "{e}"
        );
        let e = syntax("[relay]\nworkers = 4\nworkers = 5\n");
        assert!(e.starts_with("line 3, column 1: this key"), "{e}");
        let e = syntax("[postgres]\nurl = \"C:\\dir\"\n");
        assert!(e.starts_with("line 2, column 11: a backslash"), "{e}");
        let e = syntax("[sink]\nkind = nats # the default\n");
        assert!(
            e.starts_with(
                "line 2, column 8: text must be in double quotes: write kind = \"nats\"\n"
            ),
            "{e}"
        );
        let e = syntax("[relay]\npoll_interval = 100ms\n");
        assert!(e.contains("write poll_interval = \"100ms\"\n"), "{e}");
        let e = syntax("[tables]\nname = my table\n");
        assert!(e.contains("write name = \"my table\"\n"), "{e}");
        let e = syntax("[relay\n");
        assert!(e.starts_with("line 1, column 7: a [section] header"), "{e}");
    }

    #[test]
    fn syntax_errors_never_quote_a_secret() {
        let e = syntax("[postgres]\nurl = \"postgres://u:s3cr3t@h/db\" x\n");
        assert!(e.starts_with("line 2, column 34: unexpected text"), "{e}");
        assert!(e.contains("postgres://<redacted>@h/db"), "{e}");
        assert!(!e.contains("s3cr3t"), "{e}");
        let e = syntax("[sink.kafka.properties]\n\"sasl.password\" = s3cr3t\n");
        assert!(!e.contains("s3cr3t"), "{e}");
        assert!(e.contains("\"sasl.password\" = <hidden>"), "{e}");
    }

    #[test]
    fn columns_count_characters_not_bytes() {
        assert_eq!(locate("a = \"é\" x", 9), (1, 9, "a = \"é\" x"));
        assert_eq!(locate("a\r\nb = c", 7), (2, 5, "b = c"));
    }

    #[test]
    fn serde_words_become_the_files_words() {
        let cases = [
            (
                r#"invalid type: string "x", expected usize"#,
                "expected a whole number, got the text \"x\"",
            ),
            (
                r#"invalid type: string "4", expected usize"#,
                "expected a whole number, got the text \"4\"; write the number without quotes",
            ),
            (
                "invalid value: integer `-1`, expected usize",
                "expected a whole number, got the number -1",
            ),
            (
                "invalid value: integer `5000000000`, expected u32",
                "expected a whole number up to 4294967295, got the number 5000000000",
            ),
            (
                r#"invalid type: string "yes", expected a boolean"#,
                "expected true or false, got the text \"yes\"",
            ),
            (
                "invalid type: integer `5`, expected a string",
                "expected text in double quotes, got the number 5",
            ),
            (
                "invalid type: integer `5`, expected struct RawRelay",
                "expected a table (a [section] of keys), got the number 5",
            ),
            (
                "invalid type: floating point `2.5`, expected usize",
                "expected a whole number, got the number 2.5",
            ),
            (
                "invalid type: sequence, expected a string",
                "expected text in double quotes, got a list",
            ),
        ];
        for (serde, plain) in cases {
            assert_eq!(plain_type_error(serde, "relay.workers"), plain);
        }
        assert_eq!(
            plain_type_error("invalid type: map, expected a sequence", "tables"),
            "is a single [tables] table, but it takes a list: write each entry as [[tables]] \
             with double brackets"
        );
        let hidden = plain_type_error(
            r#"invalid type: string "postgres://u:pw@h", expected struct RawPostgres"#,
            "postgres",
        );
        assert_eq!(
            hidden,
            "expected a table (a [section] of keys), got the text \"postgres://<redacted>@h\""
        );
    }

    #[test]
    fn unknown_keys_suggest_the_nearest_one() {
        let serde = "unknown field `workerz`, expected one of `workers`, `batch_size`";
        assert_eq!(
            unknown("workerz", serde, "relay"),
            "unknown key; did you mean workers?"
        );
        assert_eq!(
            unknown("xyz", serde, "relay"),
            "unknown key; [relay] takes workers, batch_size"
        );
        assert_eq!(
            unknown("xyz", serde, ""),
            "unknown key; the sections are workers, batch_size"
        );
        assert_eq!(
            unknown("xyz", serde, "tables[0].columns"),
            "unknown key; [tables.columns] takes workers, batch_size"
        );
        assert_eq!(distance("kitten", "sitting"), 3);
    }

    #[test]
    fn only_tables_is_a_list_of_tables() {
        let root: toml::Table = toml::from_str(
            "[[tables]]\nname = \"a\"\n[[tables]]\nname = \"b\"\n[relay]\nworkers = 1\n",
        )
        .unwrap();
        assert_eq!(check_lists(&root), Ok(()));
        let root: toml::Table = toml::from_str("[[relay]]\nworkers = 1\n").unwrap();
        assert_eq!(
            check_lists(&root).unwrap_err().to_string(),
            "relay: is written [[relay]], which makes a list; write [relay] with single brackets"
        );
        let root: toml::Table =
            toml::from_str("[[tables]]\nname = \"a\"\n[[tables.columns]]\nid = \"x\"\n").unwrap();
        assert!(check_lists(&root)
            .unwrap_err()
            .to_string()
            .starts_with("tables[0].columns: is written [[tables.columns]]"));
    }
}
