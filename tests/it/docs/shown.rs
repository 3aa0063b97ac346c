//! The commands a page shows, read the way [`super::commands`] documents: fenced shell
//! blocks line by line, inline code spans that start with one of the project's programs,
//! each split into simple commands of shell words.

use std::path::Path;

/// The info strings (their first word) of fenced blocks whose lines are commands.
const SHELL_BLOCKS: [&str; 4] = ["sh", "bash", "shell", "console"];

/// The marker, on the last non-blank line before a fenced block, that makes the block's
/// commands examples: `<!-- example: why it does not run here -->`.
const EXAMPLE_MARKER: &str = "<!-- example:";

/// A command as a page shows it.
#[derive(Clone, Debug)]
pub(super) struct Shown {
    /// `README.md:201`.
    pub(super) at: String,
    /// The text, as written (continuations joined, for a fenced line).
    pub(super) text: String,
    /// In a fenced shell block (a line to copy and run), not a code span in prose.
    pub(super) fenced: bool,
    /// The marker's reason, when the block is marked as an example.
    pub(super) example: Option<String>,
}

/// One word of a shell command, quotes removed.
#[derive(Clone, Debug)]
pub(super) struct Word {
    pub(super) text: String,
    /// Written inside quotes (in part): never a placeholder or an optional group.
    pub(super) quoted: bool,
    /// Inside `[...]`: an optional part of a synopsis (`[--until 1h]`).
    pub(super) optional: bool,
}

/// Which of the project's programs a command runs.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Program {
    /// `outbox-relay`, `target/release/outbox-relay`, ...
    Relay,
    /// `outbox-bench`, `target/release/outbox-bench`.
    Bench,
    /// `scripts/NAME`, an executable file of the repository.
    Script(String),
}

/// A simple command of one of the project's programs.
#[derive(Clone, Debug)]
pub(super) struct Command {
    /// `NAME=value` set before the program.
    pub(super) env: Vec<(String, String)>,
    pub(super) program: Program,
    /// The words after the program.
    pub(super) args: Vec<Word>,
}

/// Every command `markdown` shows: the lines of fenced shell blocks, and the inline code
/// spans outside them (a span may run over a line break, not over a blank line). `root`
/// is the repository's, where `scripts/` is.
pub(super) fn shown(root: &Path, page: &str, markdown: &str) -> Vec<Shown> {
    let mut found = Vec::new();
    let lines: Vec<&str> = markdown.lines().collect();
    let mut prose: Vec<(usize, &str)> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let Some(info) = line.trim_start().strip_prefix("```") else {
            if line.trim().is_empty() {
                found.extend(spans(root, page, &prose));
                prose.clear();
            } else {
                prose.push((i + 1, line));
            }
            i += 1;
            continue;
        };
        found.extend(spans(root, page, &prose));
        prose.clear();
        let example = lines[..i]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .and_then(|l| l.trim().strip_prefix(EXAMPLE_MARKER))
            .map(|m| m.trim_end_matches("-->").trim().to_owned());
        let kind = info.split_whitespace().next().unwrap_or("");
        let shell = SHELL_BLOCKS.contains(&kind);
        i += 1;
        let mut pending: Option<(usize, String)> = None;
        while i < lines.len() && !lines[i].trim_start().starts_with("```") {
            let text = lines[i].trim();
            let text = match kind {
                "console" => text.strip_prefix("$ ").unwrap_or(""),
                _ => text,
            };
            if shell && (pending.is_some() || !text.is_empty()) {
                let (start, mut joined) = pending.take().unwrap_or((i + 1, String::new()));
                match text.strip_suffix('\\') {
                    Some(part) => {
                        joined.push_str(part);
                        pending = Some((start, joined));
                    }
                    None => {
                        joined.push_str(text);
                        found.push(Shown {
                            at: format!("{page}:{start}"),
                            text: joined,
                            fenced: true,
                            example: example.clone(),
                        });
                    }
                }
            }
            i += 1;
        }
        i += 1;
    }
    found.extend(spans(root, page, &prose));
    found
}

/// The code spans of one paragraph that start with a program's name (a span of the name
/// alone names it); `... ARGS` continues the span before it with other arguments (a table
/// of variants of one command).
fn spans(root: &Path, page: &str, paragraph: &[(usize, &str)]) -> Vec<Shown> {
    let Some(&(first, _)) = paragraph.first() else {
        return Vec::new();
    };
    let text: Vec<&str> = paragraph.iter().map(|(_, l)| *l).collect();
    let text = text.join("\n");
    let pieces: Vec<&str> = text.split('`').collect();
    let mut found = Vec::new();
    let mut line = first;
    let mut prefix: Option<String> = None;
    // Pieces alternate prose, span, prose, ...; an unmatched last backtick opens no span.
    for (n, piece) in pieces.iter().enumerate() {
        let is_span = n % 2 == 1 && n + 1 < pieces.len();
        if is_span {
            let span = piece.replace('\n', " ");
            let span = match (span.strip_prefix("... "), &prefix) {
                (Some(rest), Some(prefix)) => format!("{prefix} {rest}"),
                _ => span,
            };
            let words = span.split_whitespace().count();
            let ours = simple_commands(&span, root)
                .first()
                .is_some_and(|c| words > 1 || matches!(c.program, Program::Script(_)));
            if ours {
                prefix = Some(
                    span.split_whitespace()
                        .take_while(|w| !w.starts_with('-'))
                        .collect::<Vec<_>>()
                        .join(" "),
                );
                found.push(Shown {
                    at: format!("{page}:{line}"),
                    text: span,
                    fenced: false,
                    example: None,
                });
            }
        }
        line += piece.matches('\n').count();
    }
    found
}

/// The simple commands of one shell line that run one of the project's programs: the line
/// split at `&&`, `||`, `;` and `|` (except inside `[...]`, where `|` separates
/// alternatives), a `#` comment dropped, `NAME=value` and `sudo` before the program set
/// aside. `root` is where `scripts/` is looked for.
pub(super) fn simple_commands(line: &str, root: &Path) -> Vec<Command> {
    words_of(line)
        .into_iter()
        .filter_map(|words| {
            let mut words = words.into_iter().peekable();
            let mut env = Vec::new();
            while let Some(word) = words.next_if(|w| is_assignment(&w.text) || w.text == "sudo") {
                if let Some((name, value)) = word.text.split_once('=') {
                    env.push((name.to_owned(), value.to_owned()));
                }
            }
            let program = program(&words.next()?.text, root)?;
            Some(Command {
                env,
                program,
                args: words.collect(),
            })
        })
        .collect()
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty()
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit())
    })
}

fn program(word: &str, root: &Path) -> Option<Program> {
    let name = word.rsplit('/').next()?;
    if name == "outbox-relay" {
        return Some(Program::Relay);
    }
    if name == "outbox-bench" {
        return Some(Program::Bench);
    }
    use std::os::unix::fs::PermissionsExt;
    let script = word.strip_prefix("scripts/")?;
    let executable = root
        .join(word)
        .metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    executable.then(|| Program::Script(script.to_owned()))
}

/// The shell words of `line`, per simple command. A `<placeholder>` is one word, spaces
/// and all; a `[` opening a word and a `]` closing one mark an optional group.
fn words_of(line: &str) -> Vec<Vec<Word>> {
    let mut commands = Vec::new();
    let mut words: Vec<Word> = Vec::new();
    let mut word: Option<Word> = None;
    let mut depth = 0usize;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                let w = start(&mut word);
                w.quoted = true;
                while let Some(q) = chars.next() {
                    match q {
                        _ if q == c => break,
                        '\\' if c == '"' => {
                            if let Some(n) = chars.next() {
                                if !matches!(n, '"' | '\\' | '$' | '`') {
                                    w.text.push('\\');
                                }
                                w.text.push(n);
                            }
                        }
                        _ => w.text.push(q),
                    }
                }
            }
            '<' => {
                let w = start(&mut word);
                w.text.push('<');
                for p in chars.by_ref() {
                    w.text.push(p);
                    if p == '>' {
                        break;
                    }
                }
            }
            '\\' => {
                if let Some(n) = chars.next() {
                    start(&mut word).text.push(n);
                }
            }
            '#' if word.is_none() => break,
            '|' if depth > 0 || word.as_ref().is_some_and(|w| w.text.starts_with('[')) => {
                start(&mut word).text.push('|');
            }
            ';' | '&' | '|' => {
                end(&mut word, &mut words, &mut depth);
                chars.next_if_eq(&c);
                if !words.is_empty() {
                    commands.push(std::mem::take(&mut words));
                }
            }
            c if c.is_whitespace() => end(&mut word, &mut words, &mut depth),
            c => start(&mut word).text.push(c),
        }
    }
    end(&mut word, &mut words, &mut depth);
    if !words.is_empty() {
        commands.push(words);
    }
    commands
}

/// Ends the word being read, if any: a `[` opening it or a `]` closing it moves `depth`.
fn end(word: &mut Option<Word>, words: &mut Vec<Word>, depth: &mut usize) {
    let Some(mut w) = word.take() else { return };
    if !w.quoted && w.text.starts_with('[') {
        w.text.remove(0);
        *depth += 1;
    }
    w.optional = *depth > 0;
    if !w.quoted && w.text.ends_with(']') && *depth > 0 {
        w.text.pop();
        *depth -= 1;
    }
    words.push(w);
}

/// The word being read, started if none is.
fn start(word: &mut Option<Word>) -> &mut Word {
    word.get_or_insert_with(|| Word {
        text: String::new(),
        quoted: false,
        optional: false,
    })
}

#[test]
fn shell_lines_split_into_commands_with_optional_parts_and_placeholders() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let line = r#"X=1 outbox-relay pause --config relay.toml [--table T] --reason "a b" # c"#;
    let [c] = &simple_commands(line, root)[..] else {
        panic!("one command")
    };
    assert_eq!(c.program, Program::Relay);
    assert_eq!(c.env, [("X".to_owned(), "1".to_owned())]);
    let args: Vec<(&str, bool)> = c.args.iter().map(|w| (&*w.text, w.optional)).collect();
    assert_eq!(
        args,
        [
            ("pause", false),
            ("--config", false),
            ("relay.toml", false),
            ("--table", true),
            ("T", true),
            ("--reason", false),
            ("a b", false)
        ]
    );
    let soak = "scripts/soak --seed <today's date> [--relays 2|3] && psql -c 'x; y' | outbox-bench";
    let commands = simple_commands(soak, root);
    let texts: Vec<Vec<&str>> = commands
        .iter()
        .map(|c| c.args.iter().map(|w| &*w.text).collect())
        .collect();
    assert_eq!(
        texts,
        [vec!["--seed", "<today's date>", "--relays", "2|3"], vec![]]
    );
    assert!(simple_commands("scripts/containers.conf", root).is_empty());
    let page = "Run `outbox-relay drain\n--timeout 5m` or `outbox-relay`; `... --x`.\n\n```sh\n\
                outbox-relay a \\\n  --b\n```\n<!-- example: no -->\n```bash\nscripts/test\n```\n";
    let found: Vec<(String, String, bool, Option<String>)> = shown(root, "p.md", page)
        .into_iter()
        .map(|s| (s.at, s.text, s.fenced, s.example))
        .collect();
    let expected = [
        ("p.md:1", "outbox-relay drain --timeout 5m", false, None),
        ("p.md:2", "outbox-relay drain --x", false, None),
        ("p.md:5", "outbox-relay a --b", true, None),
        ("p.md:10", "scripts/test", true, Some("no")),
    ];
    let expected: Vec<(String, String, bool, Option<String>)> = expected
        .iter()
        .map(|(a, t, f, e)| (a.to_string(), t.to_string(), *f, e.map(str::to_owned)))
        .collect();
    assert_eq!(found, expected);
}
