//! The two ways the environment reaches the configuration: `${VAR}` references inside the
//! file, and `OUTBOX_RELAY__<SECTION>__<KEY>` variables that override keys.

use toml::{Table, Value};

use super::error::{ConfigError, Override};

/// Prefix of the variables that override configuration keys.
pub(crate) const OVERRIDE_PREFIX: &str = "OUTBOX_RELAY__";

/// Replaces `${VAR}` in every string value of the parsed file (not in comments or key
/// names, and a value can never change the file's structure, whatever it contains). An
/// error names the key: `postgres.url: ${PGPASSWORD} is used but PGPASSWORD is not set`.
pub(crate) fn interpolate_values(
    table: &mut Table,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    fn walk(
        value: &mut Value,
        path: &mut Vec<String>,
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        match value {
            Value::String(s) if s.contains('$') => {
                *s = interpolate(s, lookup).map_err(|e| ConfigError::new(path.join("."), e))?;
            }
            Value::Table(t) => {
                for (k, v) in t.iter_mut() {
                    path.push(k.clone());
                    walk(v, path, lookup)?;
                    path.pop();
                }
            }
            Value::Array(items) => {
                let name = path.pop().unwrap_or_default();
                for (i, v) in items.iter_mut().enumerate() {
                    path.push(format!("{name}[{i}]"));
                    walk(v, path, lookup)?;
                    path.pop();
                }
                path.push(name);
            }
            _ => {}
        }
        Ok(())
    }
    for (k, v) in table.iter_mut() {
        walk(v, &mut vec![k.clone()], lookup)?;
    }
    Ok(())
}

/// Replaces every `${VAR}` in `text` with the variable's value; `$${` stands for a literal
/// `${`. A reference to an unset variable is an error naming it.
pub(crate) fn interpolate(
    text: &str,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("$${") {
            out.push_str("${");
            rest = after;
        } else if let Some(after) = tail.strip_prefix("${") {
            let end = after.find('}').ok_or_else(|| {
                "unterminated ${: close it with }, or write $${ for a literal ${".to_owned()
            })?;
            let name = &after[..end];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!(
                    "${{{name}}} is not a valid environment variable name"
                ));
            }
            let value = lookup(name).ok_or_else(|| {
                format!("${{{name}}} is used but {name} is not set in the environment")
            })?;
            out.push_str(&value);
            rest = &after[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Applies `OUTBOX_RELAY__A__B=value` as key `a.b` = value. Numbers and booleans become
/// TOML numbers and booleans, everything else a string. A numeric path segment indexes an
/// array (`OUTBOX_RELAY__TABLES__0__TOPIC`). Below `sink.kafka.properties` (and
/// `property_files`) the rest of the path is one dotted librdkafka name.
pub(crate) fn apply_overrides(
    root: &mut Table,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Vec<Override>, ConfigError> {
    let mut applied = Vec::new();
    let mut vars: Vec<_> = vars
        .into_iter()
        .filter(|(k, _)| k.starts_with(OVERRIDE_PREFIX))
        .collect();
    vars.sort();
    for (variable, raw) in vars {
        let mut path: Vec<String> = variable[OVERRIDE_PREFIX.len()..]
            .split("__")
            .map(str::to_lowercase)
            .collect();
        if path.iter().any(String::is_empty) {
            return Err(ConfigError::new(
                variable,
                "malformed override, write OUTBOX_RELAY__<SECTION>__<KEY>",
            ));
        }
        // librdkafka's names are dotted and a variable name cannot hold a dot:
        // OUTBOX_RELAY__SINK__KAFKA__PROPERTIES__COMPRESSION__TYPE is `compression.type`.
        if path.len() > 4
            && path[..2] == ["sink", "kafka"]
            && matches!(path[2].as_str(), "properties" | "property_files")
        {
            let name = path.split_off(3).join(".");
            path.push(name);
        }
        if let Err(e) = set_path(root, &path, scalar(&raw)) {
            return Err(ConfigError::new(variable, e));
        }
        applied.push(Override { variable, path });
    }
    Ok(applied)
}

fn scalar(raw: &str) -> Value {
    if let Ok(i) = raw.parse::<i64>() {
        return Value::Integer(i);
    }
    match raw {
        "true" => Value::Boolean(true),
        "false" => Value::Boolean(false),
        _ => Value::String(raw.to_owned()),
    }
}

fn set_path(table: &mut Table, path: &[String], value: Value) -> Result<(), String> {
    let (first, rest) = path.split_first().expect("path is never empty");
    if rest.is_empty() {
        table.insert(first.clone(), value);
        return Ok(());
    }
    let child = table
        .entry(first.clone())
        .or_insert_with(|| Value::Table(Table::new()));
    set_in_value(child, rest, value)
}

fn set_in_value(node: &mut Value, path: &[String], value: Value) -> Result<(), String> {
    match node {
        Value::Table(t) => set_path(t, path, value),
        Value::Array(items) => {
            let (index, rest) = path.split_first().expect("path is never empty");
            let i: usize = index
                .parse()
                .map_err(|_| format!("`{index}` must be an array index here"))?;
            let len = items.len();
            let item = items
                .get_mut(i)
                .ok_or_else(|| format!("index {i} is past the {len} entries in the file"))?;
            if rest.is_empty() {
                *item = value;
                Ok(())
            } else {
                set_in_value(item, rest, value)
            }
        }
        _ => Err(format!("`{}` is not a section", path[0])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            owned
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn interpolation_replaces_variables_and_keeps_escapes() {
        let out = interpolate("a=${A} b=$${B} c=$5", env(&[("A", "x")])).unwrap();
        assert_eq!(out, "a=x b=${B} c=$5");
    }

    #[test]
    fn interpolation_names_the_missing_variable() {
        let err = interpolate("url = \"${PG_URL}\"", env(&[])).unwrap_err();
        assert!(err.contains("PG_URL is not set"), "{err}");
    }

    #[test]
    fn interpolation_touches_values_only_and_names_the_key() {
        let mut root: Table = toml::from_str(
            "# ${IN_A_COMMENT} is ignored\n[postgres]\nurl = \"postgres://u:${PW}@h/db\"\n\
             [[tables]]\nname = \"a.b\"\n[[tables]]\nname = \"${MISSING}\"\n",
        )
        .unwrap();
        // A value with quotes and newlines cannot change the file's structure.
        let lookup = env(&[("PW", "p\"w\n[x]")]);
        let err = interpolate_values(&mut root, &lookup)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("tables[1].name: ${MISSING}"), "{err}");
        assert_eq!(
            root["postgres"]["url"].as_str(),
            Some("postgres://u:p\"w\n[x]@h/db")
        );
    }

    #[test]
    fn overrides_set_nested_keys_with_types() {
        let mut root: Table =
            toml::from_str("[relay]\nworkers = 1\n[[tables]]\nname = \"a.b\"").unwrap();
        apply_overrides(
            &mut root,
            vec![
                ("OUTBOX_RELAY__RELAY__WORKERS".into(), "8".into()),
                ("OUTBOX_RELAY__POSTGRES__URL".into(), "postgres://x".into()),
                ("OUTBOX_RELAY__TABLES__0__TOPIC".into(), "t.{key}".into()),
                (
                    "OUTBOX_RELAY__SINK__KAFKA__PROPERTIES__COMPRESSION__TYPE".into(),
                    "zstd".into(),
                ),
                ("UNRELATED".into(), "1".into()),
            ],
        )
        .unwrap();
        assert_eq!(root["relay"]["workers"].as_integer(), Some(8));
        assert_eq!(root["postgres"]["url"].as_str(), Some("postgres://x"));
        assert_eq!(root["tables"][0]["topic"].as_str(), Some("t.{key}"));
        assert_eq!(
            root["sink"]["kafka"]["properties"]["compression.type"].as_str(),
            Some("zstd"),
            "a librdkafka property keeps its dots"
        );
    }
}
