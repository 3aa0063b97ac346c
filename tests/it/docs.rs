//! The documentation keeps up with the code: the configuration reference lists exactly the
//! keys the relay accepts, with the defaults the loader uses; the example config is
//! accepted and shows every key; every relative link in the README and docs/ leads
//! somewhere; and every command they show runs, or is marked as an example ([`commands`]).
//!
//! The accepted keys are not a list kept by hand: they are asked of the config loader
//! itself. Its raw types reject unknown keys (`deny_unknown_fields`), and the error for an
//! unknown key names the keys its section takes; a key set to a table instead of its value
//! tells a section (unknown key inside it), a list of sections (`[[tables]]`), a plain
//! value (a type error on the key itself) and a free-form table such as
//! `[sink.kafka.properties]` (any name accepted) apart.

mod commands;
mod services;
mod shown;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use outbox_relay::config::{self, ConfigError};

/// A key name no section has, nor anything near it (no "did you mean").
const PROBE: &str = "zz_no_such_key_in_any_section_zz";

/// The smallest config the loader accepts without a network: every probe starts from it.
const BASE: &str = r#"
[postgres]
url = "postgres://relay@127.0.0.1:5432/app"

[sink]
kind = "stdout"

[[tables]]
name = "public.outbox"
"#;

const REFERENCE: &str = "docs/configuration.md";

/// One step of a key's path: a key of a table, or the first entry of a list of tables.
#[derive(Clone, Debug)]
enum Step {
    Key(String),
    First,
}

/// How the loader takes a key.
#[derive(Debug, PartialEq)]
enum Kind {
    /// A `[section]` of named keys.
    Section,
    /// A list of sections, `[[tables]]`.
    List,
    /// A value: text, number, duration, boolean.
    Value,
    /// A table of names of the user's choosing (`[sink.kafka.properties]`).
    FreeTable,
}

/// `tables[0].columns`, as the loader names a key in its errors.
fn error_path(path: &[Step]) -> String {
    let mut out = String::new();
    for step in path {
        match step {
            Step::Key(k) if out.is_empty() => out.push_str(k),
            Step::Key(k) => {
                out.push('.');
                out.push_str(k);
            }
            Step::First => out.push_str("[0]"),
        }
    }
    out
}

/// `tables.columns`, as the reference writes it.
fn doc_key(path: &[Step]) -> String {
    path.iter()
        .filter_map(|s| match s {
            Step::Key(k) => Some(k.as_str()),
            Step::First => None,
        })
        .collect::<Vec<_>>()
        .join(".")
}

fn load(text: &str) -> Result<config::Config, ConfigError> {
    config::from_str(
        text,
        |_| Some("secret".to_owned()),
        Vec::<(String, String)>::new(),
    )
}

fn base() -> toml::Table {
    toml::from_str(BASE).unwrap()
}

/// The table at `path` in `root`, made on the way if missing.
fn table_at<'a>(root: &'a mut toml::Table, path: &[Step]) -> &'a mut toml::Table {
    let mut value = root;
    let mut steps = path.iter().peekable();
    while let Some(step) = steps.next() {
        let Step::Key(key) = step else {
            unreachable!("a path starts with a key and [0] follows a key")
        };
        let entry = value
            .entry(key.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        value = if matches!(steps.peek(), Some(Step::First)) {
            steps.next();
            let items = entry.as_array_mut().expect("a list");
            if items.is_empty() {
                items.push(toml::Value::Table(toml::Table::new()));
            }
            items[0].as_table_mut().expect("a list of tables")
        } else {
            entry.as_table_mut().expect("a table")
        };
    }
    value
}

/// The error the loader gives for `config`, if any.
fn error_for(config: &toml::Table) -> Option<ConfigError> {
    load(&toml::to_string(config).unwrap()).err()
}

/// The keys the section at `path` takes, from the loader's answer to an unknown key there.
fn keys_of(path: &[Step]) -> Vec<String> {
    let mut config = base();
    table_at(&mut config, path).insert(PROBE.into(), toml::Value::String("x".into()));
    let e = error_for(&config).expect("an unknown key is refused");
    let probed = if path.is_empty() {
        PROBE.to_owned()
    } else {
        format!("{}.{PROBE}", error_path(path))
    };
    assert_eq!(e.key, probed, "{e:?}");
    let list = ["takes ", "the sections are "]
        .iter()
        .find_map(|lead| e.problem.split_once(lead).map(|(_, list)| list))
        .unwrap_or_else(|| panic!("the error lists no keys: {e:?}"));
    list.split(", ").map(str::to_owned).collect()
}

/// How the loader takes the key at `path`: set to a table holding an unknown key.
fn kind_of(path: &[Step]) -> Kind {
    let mut config = base();
    let (last, parent) = path.split_last().unwrap();
    let Step::Key(name) = last else {
        unreachable!()
    };
    let mut probe = toml::Table::new();
    probe.insert(PROBE.into(), toml::Value::String("x".into()));
    table_at(&mut config, parent).insert(name.clone(), toml::Value::Table(probe));
    let at = error_path(path);
    match error_for(&config) {
        Some(e) if e.key == format!("{at}.{PROBE}") && e.problem.starts_with("unknown key") => {
            Kind::Section
        }
        Some(e) if e.key == at && e.problem.contains("takes a list") => Kind::List,
        Some(e) if e.key == at => Kind::Value,
        _ => Kind::FreeTable,
    }
}

/// What the loader accepts, as the reference writes it.
struct Accepted {
    /// Every key: values and free-form tables (`relay.workers`, `sink.kafka.properties`).
    keys: BTreeSet<String>,
    /// Every section: `sink.kafka`, `tables`.
    sections: BTreeSet<String>,
    /// The keys that are free-form tables.
    free_tables: BTreeSet<String>,
}

fn accepted() -> Accepted {
    let mut found = Accepted {
        keys: BTreeSet::new(),
        sections: BTreeSet::new(),
        free_tables: BTreeSet::new(),
    };
    let mut todo: Vec<Vec<Step>> = vec![vec![]];
    while let Some(section) = todo.pop() {
        for name in keys_of(&section) {
            let mut path = section.clone();
            path.push(Step::Key(name));
            match kind_of(&path) {
                Kind::Section => {
                    found.sections.insert(doc_key(&path));
                    todo.push(path);
                }
                Kind::List => {
                    found.sections.insert(doc_key(&path));
                    path.push(Step::First);
                    todo.push(path);
                }
                Kind::Value => {
                    found.keys.insert(doc_key(&path));
                }
                Kind::FreeTable => {
                    found.keys.insert(doc_key(&path));
                    found.free_tables.insert(doc_key(&path));
                }
            }
        }
    }
    found
}

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The text of the reference's "## Every key" part.
fn every_key_part(reference: &str) -> &str {
    let part = reference
        .split_once("\n## Every key\n")
        .expect("docs/configuration.md has a \"## Every key\" section")
        .1;
    part.split("\n## ").next().unwrap()
}

/// The reference's "## Every key" part: the first cell of each table row (`` `relay.workers` ``)
/// and each `### `[section]`` heading.
fn documented(reference: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut keys, mut sections) = (BTreeSet::new(), BTreeSet::new());
    for line in every_key_part(reference).lines() {
        if let Some(cell) = line.strip_prefix("| `") {
            let key = cell.split('`').next().unwrap();
            assert!(keys.insert(key.to_owned()), "{key} is documented twice");
        } else if let Some(heading) = line.strip_prefix("### `") {
            let section = heading.split('`').next().unwrap();
            sections.insert(section.trim_matches(['[', ']']).to_owned());
        }
    }
    (keys, sections)
}

fn difference(a: &BTreeSet<String>, b: &BTreeSet<String>) -> Vec<String> {
    a.difference(b).cloned().collect()
}

#[test]
fn every_config_key_is_documented_and_every_documented_key_is_accepted() {
    let Accepted { keys, sections, .. } = accepted();
    // The derivation itself is sound: it finds keys of every kind and depth.
    for key in [
        "postgres.url",
        "relay.workers",
        "sink.kafka.properties",
        "tables.columns.order",
        "tables.header_columns",
    ] {
        assert!(keys.contains(key), "{key} not found in {keys:?}");
    }
    let (documented_keys, documented_sections) = documented(&repo_file(REFERENCE));
    let undocumented = difference(&keys, &documented_keys);
    let unknown = difference(&documented_keys, &keys);
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "{REFERENCE} is out of step with the config the relay accepts:\n  \
         accepted but not documented (add a row `| \\`section.key\\` | default | meaning |`): \
         {undocumented:?}\n  documented but not accepted (remove or rename the row): {unknown:?}"
    );
    assert_eq!(
        documented_sections, sections,
        "{REFERENCE}: one `### \\`[section]\\`` heading per section"
    );
}

/// The default the reference gives each key whose default cell is one TOML value
/// (`` `8` ``, `` `"30s"` ``, `` `true` ``); defaults in words ("required", "none", "the id
/// column", `` `"headers"` if present``) are left out.
fn documented_defaults(reference: &str) -> Vec<(String, toml::Value)> {
    every_key_part(reference)
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.strip_prefix("| `")?.split(" | ").collect();
            let key = cells[0].split('`').next()?;
            let default = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            if default.contains('`') {
                return None;
            }
            let mut parsed: toml::Table = toml::from_str(&format!("v = {default}")).ok()?;
            Some((key.to_owned(), parsed.remove("v")?))
        })
        .collect()
}

/// `base()` with `key` (`relay.workers`, `tables.columns.id`) set to `value`; a key of
/// `[sink.nats]` with `sink.kind = "nats"`, so that its section is read, and one of
/// `[tables.cloudevents]` on a table with that envelope and its required templates.
fn with_key(key: &str, value: Option<toml::Value>) -> toml::Table {
    let mut config = base();
    if key.starts_with("sink.nats.") {
        table_at(&mut config, &[Step::Key("sink".into())])
            .insert("kind".into(), toml::Value::String("nats".into()));
    }
    if key.starts_with("tables.cloudevents.") {
        let table = table_at(&mut config, &[Step::Key("tables".into()), Step::First]);
        table.insert("envelope".into(), toml::Value::String("cloudevents".into()));
        let envelope = table_at(
            &mut config,
            &[
                Step::Key("tables".into()),
                Step::First,
                Step::Key("cloudevents".into()),
            ],
        );
        for (name, template) in [("type", "com.example.event"), ("source", "/outbox")] {
            envelope.insert(name.into(), toml::Value::String(template.into()));
        }
    }
    let Some(value) = value else {
        return config;
    };
    let mut path = Vec::new();
    for name in key.split('.') {
        path.push(Step::Key(name.to_owned()));
        if name == "tables" && path.len() == 1 {
            path.push(Step::First);
        }
    }
    let (Some(Step::Key(name)), parent) = (path.last().cloned(), &path[..path.len() - 1]) else {
        unreachable!("a key's path ends with its name")
    };
    table_at(&mut config, parent).insert(name, value);
    config
}

/// The config the loader makes of `config`, every field shown (`Debug`), or its refusal.
fn loaded(config: &toml::Table) -> String {
    match load(&toml::to_string(config).unwrap()) {
        Ok(c) => format!("{c:#?}"),
        Err(e) => format!("refused: {e}"),
    }
}

#[test]
fn every_documented_default_is_the_loaders_default() {
    let defaults = documented_defaults(&repo_file(REFERENCE));
    let read: BTreeSet<&str> = defaults.iter().map(|(k, _)| k.as_str()).collect();
    eprintln!("{} documented defaults compared: {read:?}", read.len());
    // The reading is sound: it finds defaults of every type and section.
    for key in [
        "postgres.pool_size",
        "postgres.prepared_statements",
        "relay.poll_interval",
        "relay.max_batch_bytes",
        "relay.ordering",
        "sink.publish_timeout",
        "sink.nats.url",
        "tables.topic",
        "tables.columns.id",
        "shutdown.drain_timeout",
    ] {
        assert!(read.contains(key), "no default read for {key}: {read:?}");
    }
    // And the comparison tells a value that is not the default.
    assert_ne!(
        loaded(&with_key("relay.workers", None)),
        loaded(&with_key("relay.workers", Some(toml::Value::Integer(5)))),
        "the loaded config does not show relay.workers"
    );
    let wrong: Vec<String> = defaults
        .iter()
        .filter_map(|(key, value)| {
            let plain = loaded(&with_key(key, None));
            let set = loaded(&with_key(key, Some(value.clone())));
            let changed: Vec<&str> = set
                .lines()
                .filter(|l| !plain.lines().any(|p| p == *l))
                .map(str::trim)
                .collect();
            (set != plain).then(|| format!("{key} = {value}: {}", changed.join(" ")))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{REFERENCE} gives defaults the loader does not use (setting the key to its documented \
         default changes the loaded config):\n  {}",
        wrong.join("\n  ")
    );
}

/// The keys `example` sets (free-form tables as one key), and the keys it shows in a
/// comment (`# retention = "7d"`, `# [sink.kafka.property_files]`).
fn example_keys(example: &str, free_tables: &BTreeSet<String>) -> BTreeSet<String> {
    fn walk(
        value: &toml::Value,
        path: &str,
        free: &BTreeSet<String>,
        found: &mut BTreeSet<String>,
    ) {
        match value {
            toml::Value::Table(t) if !free.contains(path) => {
                for (k, v) in t {
                    let key = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    walk(v, &key, free, found);
                }
            }
            toml::Value::Array(items) if items.iter().all(toml::Value::is_table) => {
                for item in items {
                    walk(item, path, free, found);
                }
            }
            _ => {
                found.insert(path.to_owned());
            }
        }
    }
    let mut found = BTreeSet::new();
    let table: toml::Value = toml::from_str(example).unwrap();
    walk(&table, "", free_tables, &mut found);
    // Shown in a comment, as the file writes them: `# [section]`, `# name = value`.
    let is_name = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '_');
    let mut section = String::new();
    for line in example.lines() {
        let text = line.trim_start_matches('#').trim();
        if let Some(header) = text.strip_prefix('[').and_then(|t| t.split(']').next()) {
            let header = header.trim_start_matches('[');
            if header.split('.').all(is_name) {
                section = header.to_owned();
                if line.starts_with('#') && free_tables.contains(&section) {
                    found.insert(section.clone());
                }
                continue;
            }
        }
        let Some(comment) = line.strip_prefix('#') else {
            continue;
        };
        let Some((name, value)) = comment.trim_start().split_once(" = ") else {
            continue;
        };
        if is_name(name) && !value.trim().is_empty() && !free_tables.contains(&section) {
            found.insert(format!("{section}.{name}"));
        }
    }
    found
}

#[test]
fn the_example_config_is_accepted_and_shows_every_key() {
    let example = repo_file("config/relay.example.toml");
    load(&example).unwrap_or_else(|e| panic!("config/relay.example.toml: {e}"));
    let Accepted {
        keys, free_tables, ..
    } = accepted();
    let shown = example_keys(&example, &free_tables);
    let unknown = difference(&shown, &keys);
    assert!(
        unknown.is_empty(),
        "config/relay.example.toml shows keys the relay does not accept: {unknown:?}"
    );
    let missing = difference(&keys, &shown);
    assert!(
        missing.is_empty(),
        "config/relay.example.toml says it shows every key, and lacks {missing:?}"
    );
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a markdown file's headings (outside code blocks).
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            let base = anchor(line.trim_start_matches('#'));
            let mut name = base.clone();
            let mut n = 0;
            while !found.insert(name.clone()) {
                n += 1;
                name = format!("{base}-{n}");
            }
        }
    }
    found
}

/// The targets of the markdown links in `markdown` (`[text](target)`), outside code
/// blocks and code spans.
fn link_targets(markdown: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop code spans: every other piece between backticks.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            targets.push(after[..end].trim().to_owned());
            rest = &after[end..];
        }
    }
    targets
}

/// The pages a user reads: README.md, then docs/*.md by name.
fn page_paths() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    std::iter::once(root.join("README.md"))
        .chain(docs)
        .collect()
}

#[test]
fn every_relative_link_in_the_readme_and_docs_resolves() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let pages = page_paths();
    let docs = &pages[1..];
    assert!(!docs.is_empty());
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, fragment) = target.split_once('#').unwrap_or((&target, ""));
            let linked = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            let shown = format!("{}: {target}", page.strip_prefix(&root).unwrap().display());
            if !linked.exists() {
                broken.push(format!("{shown} (no such file)"));
            } else if !fragment.is_empty()
                && linked.extension().is_some_and(|e| e == "md")
                && !anchors(&std::fs::read_to_string(&linked).unwrap()).contains(fragment)
            {
                broken.push(format!("{shown} (no such heading)"));
            }
        }
    }
    assert!(checked > 0, "no relative link found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    // Every page of docs/ is linked from the README.
    for doc in docs {
        let name = format!("docs/{}", doc.file_name().unwrap().to_string_lossy());
        assert!(
            link_targets(&readme)
                .iter()
                .any(|t| t.split('#').next() == Some(name.as_str())),
            "README.md does not link {name}"
        );
    }
}
