//! The module layering ARCHITECTURE.md describes, checked on the source: which top-level
//! modules each module imports (`crate::…` outside comments and test modules). A new
//! import that breaks a layer, or closes a cycle, fails here with the file that did it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module and the modules it may import.
const ALLOWED: &[(&str, &[&str])] = &[
    ("config", &[]),
    ("error", &[]),
    ("retry", &[]),
    ("shutdown", &[]),
    ("cli", &["config"]),
    ("source", &["config", "error", "retry"]),
    ("sink", &["config", "error", "retry"]),
    ("ops", &["source", "sink", "config", "error"]),
    ("check", &["config", "source", "sink", "error", "ops"]),
    ("admin", &["config", "source", "error"]),
    (
        "relay",
        &[
            "config", "error", "retry", "shutdown", "source", "sink", "ops",
        ],
    ),
];

/// Top-level modules each file's module imports, with the files that import them.
fn imports() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut found: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap();
            let rel = rel.to_string_lossy().into_owned();
            let module = rel
                .trim_start_matches("src/")
                .trim_end_matches(".rs")
                .split('/')
                .next()
                .unwrap()
                .to_owned();
            if module == "main" || module == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for target in line.split("crate::").skip(1).flat_map(targets) {
                    if target != module {
                        let targets = found.entry(module.clone()).or_default();
                        targets.entry(target).or_default().insert(rel.clone());
                    }
                }
            }
        }
    }
    found
}

/// The modules named right after a `crate::`: one, or each of a `{a, b::c}` group.
fn targets(after: &str) -> Vec<String> {
    let name = |s: &str| -> String {
        s.trim()
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect()
    };
    let names = match after.strip_prefix('{') {
        Some(group) => group
            .split('}')
            .next()
            .unwrap()
            .split(',')
            .map(name)
            .collect(),
        None => vec![name(after)],
    };
    names.into_iter().filter(|n| !n.is_empty()).collect()
}

#[test]
fn modules_import_only_the_layers_below_them() {
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut wrong = Vec::new();
    for (module, targets) in imports() {
        let Some(may) = allowed.get(module.as_str()) else {
            wrong.push(format!(
                "module {module} is not in ALLOWED: place it in a layer"
            ));
            continue;
        };
        for (target, files) in targets {
            if !may.contains(&target.as_str()) {
                wrong.push(format!("{module} imports {target} (in {files:?})"));
            }
        }
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

#[test]
fn the_allowed_layers_have_no_cycle() {
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    fn reaches(from: &str, to: &str, allowed: &BTreeMap<&str, &[&str]>, depth: usize) -> bool {
        depth < 16
            && allowed.get(from).is_some_and(|next| {
                next.iter()
                    .any(|n| *n == to || reaches(n, to, allowed, depth + 1))
            })
    }
    for (module, _) in ALLOWED {
        assert!(
            !reaches(module, module, &allowed, 0),
            "{module} is in a cycle"
        );
    }
}
