//! The module layering ARCHITECTURE.md describes, checked on the source: which modules each
//! module imports (`crate::…` and `super::…` paths outside comments and test modules). A
//! new import that breaks a layer, or closes a cycle, fails here with the file that did
//! it: between top-level modules, and between the submodules of the folders in
//! [`FOLDERS`].

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

/// The top-level modules whose submodules must not import each other in a cycle. (`sink`
/// is not here: its folders import nothing of each other, so there is nothing to check.)
const FOLDERS: &[&str] = &["source", "config", "relay", "ops"];

/// Who imports whom: importer -> imported -> the files that do it.
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// One source file as the layering reads it: its path and module path (as in [`Source`]),
/// and its code without comment lines and without what follows the first `#[cfg(test)]`.
struct File {
    rel: String,
    module: Vec<String>,
    code: String,
}

/// One file under `src/` as it is on disk: its path from the crate root, its module path
/// (`["source", "migrate"]` for `src/source/migrate.rs`, `["source"]` for
/// `src/source/mod.rs`) and its text. The other source checks (`lengths`) read these too.
pub(super) struct Source {
    pub(super) rel: String,
    pub(super) module: Vec<String>,
    pub(super) text: String,
}

/// Every file under `src/`, in no particular order.
pub(super) fn sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    let mut stack = vec![root.join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let mut module: Vec<String> = rel
                .trim_start_matches("src/")
                .trim_end_matches(".rs")
                .split('/')
                .map(str::to_owned)
                .collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            found.push(Source { rel, module, text });
        }
    }
    found
}

/// Every file under `src/` but `main.rs` and `lib.rs`.
fn files() -> Vec<File> {
    sources()
        .into_iter()
        .filter(|s| s.module != ["main"] && s.module != ["lib"])
        .map(|Source { rel, module, text }| {
            let code = text.split("#[cfg(test)]").next().unwrap();
            let code = code
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            File { rel, module, code }
        })
        .collect()
}

/// The crate-absolute paths `file` names: each `crate::a::b` and each `super::x` (as many
/// `super::` as it has, counted up from the file's module), groups `{a, b::c}` expanded.
/// An inline `mod` inside a file is not tracked: its `super::` is read as the file's.
fn paths(file: &File) -> Vec<Vec<String>> {
    let code = file.code.as_str();
    let mut found = Vec::new();
    let part_of_a_name =
        |at: usize| code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_');
    for (at, _) in code.match_indices("crate::") {
        if !part_of_a_name(at) {
            found.extend(use_tree(&code[at + "crate::".len()..]));
        }
    }
    for (at, _) in code.match_indices("super::") {
        if code[..at].ends_with("super::") || part_of_a_name(at) {
            continue; // inside a longer chain, or part of another name
        }
        let mut rest = &code[at..];
        let mut up = 0;
        while let Some(after) = rest.strip_prefix("super::") {
            up += 1;
            rest = after;
        }
        let Some(base) = file.module.len().checked_sub(up) else {
            continue;
        };
        for path in use_tree(rest) {
            found.push(file.module[..base].iter().cloned().chain(path).collect());
        }
    }
    found
}

/// The paths a use tree or expression path at the start of `text` names:
/// `a::{b, c::{d, e}}` is `[a, b]`, `[a, c, d]`, `[a, c, e]`; `self` in a group is the
/// path before it.
fn use_tree(text: &str) -> Vec<Vec<String>> {
    let text = text.trim_start();
    if let Some(group) = text.strip_prefix('{') {
        return split_group(group).into_iter().flat_map(use_tree).collect();
    }
    let name: String = text
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    if name.is_empty() || name == "self" {
        return vec![Vec::new()];
    }
    match text[name.len()..].strip_prefix("::") {
        Some(rest) => use_tree(rest)
            .into_iter()
            .map(|tail| std::iter::once(name.clone()).chain(tail).collect())
            .collect(),
        None => vec![vec![name]],
    }
}

/// The comma-separated parts of a group whose `{` is already consumed, up to its `}`.
fn split_group(text: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                parts.push(&text[start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

/// Records that `file`, in `module`, imports `target` (a module's imports of itself are
/// not edges).
fn add_import(found: &mut Graph, module: &str, target: &str, file: &str) {
    if target != module {
        found
            .entry(module.to_owned())
            .or_default()
            .entry(target.to_owned())
            .or_default()
            .insert(file.to_owned());
    }
}

/// Top-level modules each top-level module imports, with the files that import them.
fn imports(files: &[File]) -> Graph {
    let modules: BTreeSet<&str> = files.iter().map(|f| f.module[0].as_str()).collect();
    let mut found = Graph::new();
    for file in files {
        let module = &file.module[0];
        for path in paths(file) {
            let Some(target) = path.first().filter(|t| modules.contains(t.as_str())) else {
                continue;
            };
            add_import(&mut found, module, target, &file.rel);
        }
    }
    found
}

/// Submodules of `folder` each of its submodules imports, with the files that import
/// them. A name the folder's `mod.rs` imports from a submodule (`super::ConfigError` is
/// `error`'s) counts as that submodule's; items `mod.rs` defines itself belong to no
/// submodule.
fn submodule_imports(files: &[File], folder: &str) -> Graph {
    let inside = |f: &&File| f.module[0] == folder;
    let children: BTreeSet<&str> = files
        .iter()
        .filter(inside)
        .filter_map(|f| f.module.get(1).map(String::as_str))
        .collect();
    let parent = files.iter().find(|f| f.module == [folder]).unwrap();
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for statement in parent.code.split(';') {
        let statement = statement.trim_start();
        let Some(tree) = ["use ", "pub use ", "pub(crate) use "]
            .iter()
            .find_map(|p| statement.strip_prefix(p))
        else {
            continue;
        };
        for path in use_tree(tree.trim_start_matches("self::")) {
            if let (Some(child), Some(name)) = (path.first(), path.last()) {
                if children.contains(child.as_str()) && path.len() > 1 {
                    owner.insert(name.clone(), child.clone());
                }
            }
        }
    }
    let mut found = Graph::new();
    for file in files.iter().filter(inside).filter(|f| f.module.len() > 1) {
        let module = &file.module[1];
        for path in paths(file) {
            if path.first().map(String::as_str) != Some(folder) {
                continue;
            }
            let Some(name) = path.get(1) else { continue };
            let target = match children.contains(name.as_str()) {
                true => name,
                false => match owner.get(name) {
                    Some(child) => child,
                    None => continue,
                },
            };
            add_import(&mut found, module, target, &file.rel);
        }
    }
    found
}

/// Each cycle in `graph`, as `a imports b (in [files]), b imports a (in [files])`.
fn cycles(graph: &Graph) -> Vec<String> {
    fn path_to(
        graph: &Graph,
        from: &str,
        to: &str,
        seen: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        for next in graph.get(from).into_iter().flat_map(|t| t.keys()) {
            if next == to {
                return Some(vec![from.to_owned(), next.clone()]);
            }
            if seen.insert(next.clone()) {
                if let Some(mut rest) = path_to(graph, next, to, seen) {
                    rest.insert(0, from.to_owned());
                    return Some(rest);
                }
            }
        }
        None
    }
    let mut reported = BTreeSet::new();
    let mut found = Vec::new();
    for module in graph.keys() {
        let Some(cycle) = path_to(graph, module, module, &mut BTreeSet::new()) else {
            continue;
        };
        let members: BTreeSet<&String> = cycle.iter().collect();
        if !reported.insert(format!("{members:?}")) {
            continue;
        }
        let edges: Vec<String> = cycle
            .windows(2)
            .map(|w| format!("{} imports {} (in {:?})", w[0], w[1], graph[&w[0]][&w[1]]))
            .collect();
        found.push(edges.join(", "));
    }
    found
}

#[test]
fn modules_import_only_the_layers_below_them() {
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut wrong = Vec::new();
    for (module, targets) in imports(&files()) {
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

#[test]
fn submodules_import_each_other_without_a_cycle() {
    let files = files();
    let mut found = Vec::new();
    for folder in FOLDERS {
        let graph = submodule_imports(&files, folder);
        assert!(
            !graph.is_empty(),
            "no imports found between {folder}'s submodules"
        );
        found.extend(cycles(&graph).into_iter().map(|c| format!("{folder}: {c}")));
    }
    assert!(
        found.is_empty(),
        "cycles between submodules:\n{}",
        found.join("\n")
    );
}

/// The reader itself: `super::` counted from the file's depth, groups expanded, names
/// brought in by the folder's `mod.rs` traced to their submodule, and a cycle reported
/// with the files on each side.
#[test]
fn the_reader_sees_super_paths_groups_and_re_exports() {
    let file = |rel: &str, code: &str| File {
        rel: rel.to_owned(),
        module: rel
            .trim_start_matches("src/")
            .trim_end_matches(".rs")
            .trim_end_matches("/mod")
            .split('/')
            .map(str::to_owned)
            .collect(),
        code: code.to_owned(),
    };
    let files = [
        file(
            "src/f/mod.rs",
            "mod a;\nmod b;\nmod c;\npub use c::{Error, more::Other};",
        ),
        file(
            "src/f/a.rs",
            "use super::{b::{X, Y}, Thing};\nuse crate::g::Z;",
        ),
        file("src/f/b.rs", "fn f() { super::Error::new(); }"),
        file("src/f/c/d.rs", "use super::super::a::W;\nuse super::Local;"),
        file("src/g.rs", "use crate::f::{self, a};"),
    ];
    let graph = submodule_imports(&files, "f");
    let edges: Vec<(&str, &str)> = graph
        .iter()
        .flat_map(|(m, t)| t.keys().map(move |t| (m.as_str(), t.as_str())))
        .collect();
    assert_eq!(edges, [("a", "b"), ("b", "c"), ("c", "a")]);
    assert_eq!(
        cycles(&graph),
        [
            "a imports b (in {\"src/f/a.rs\"}), b imports c (in {\"src/f/b.rs\"}), \
          c imports a (in {\"src/f/c/d.rs\"})"
        ]
    );
    let top = imports(&files);
    let top: Vec<&String> = top["f"].keys().collect();
    assert_eq!(top, ["g"]);
}
