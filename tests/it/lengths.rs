//! No function in `src/` longer than [`MOST_LINES`]: a longer one usually does two things,
//! and each wants a name. Checked on the source, with the files `layers` reads; a function
//! that grows past the limit fails here with its name, file:line and length.
//!
//! The only exemptions are the SQL text builders in [`EXEMPT`]: functions of
//! `src/source/sql/` that do nothing but assemble statement text, where one long `format!`
//! a statement reads better whole.

use super::layers::sources;

/// The most lines a function may take, from its `fn` line to its closing brace.
const MOST_LINES: usize = 80;

/// `(file, function)`: SQL text builders allowed past [`MOST_LINES`]. Each must be in
/// `src/source/sql/` and still past the limit (a stale exemption fails too).
/// None at present: the claim's statements are built one function a statement.
const EXEMPT: &[(&str, &str)] = &[];

/// A function found in a file: its name, the line of its `fn` (from 1) and how many lines
/// it takes up to its closing brace.
#[derive(Debug, PartialEq)]
struct Function {
    name: String,
    line: usize,
    lines: usize,
}

/// `text` with the contents of comments and of string, byte-string and char literals
/// blanked out (newlines kept), so that a brace or `fn` inside them is not read as code.
fn blank_literals(text: &str) -> Vec<char> {
    let c: Vec<char> = text.chars().collect();
    let ident = |i: usize| c[i].is_alphanumeric() || c[i] == '_';
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let mut out = c.clone();
    let mut blank = |from: usize, to: usize| {
        for ch in &mut out[from..to.min(c.len())] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
    };
    let mut i = 0;
    while i < c.len() {
        let start = i;
        match c[i] {
            '/' if at(i + 1) == '/' => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
                blank(start, i);
            }
            '/' if at(i + 1) == '*' => {
                let mut depth = 0;
                loop {
                    match (at(i), at(i + 1)) {
                        ('/', '*') => (depth, i) = (depth + 1, i + 2),
                        ('*', '/') => (depth, i) = (depth - 1, i + 2),
                        ('\0', _) => break,
                        _ => i += 1,
                    }
                    if depth == 0 {
                        break;
                    }
                }
                blank(start, i);
            }
            'r' if (start == 0 || !ident(start - 1) || c[start - 1] == 'b')
                && matches!(at(i + 1), '"' | '#') =>
            {
                let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
                i += 1 + hashes;
                if at(i) != '"' {
                    continue; // a raw identifier (`r#type`)
                }
                i += 1;
                let close: Vec<char> = std::iter::once('"')
                    .chain("#".repeat(hashes).chars())
                    .collect();
                while i < c.len() && !c[i..].starts_with(&close) {
                    i += 1;
                }
                blank(start + 2 + hashes, i);
                i += close.len();
            }
            '"' => {
                i += 1;
                while i < c.len() && c[i] != '"' {
                    i += if c[i] == '\\' { 2 } else { 1 };
                }
                blank(start + 1, i);
                i += 1;
            }
            '\'' if at(i + 1) == '\\' || at(i + 2) == '\'' => {
                i += if at(i + 1) == '\\' { 3 } else { 2 };
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                blank(start + 1, i);
                i += 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// Every function with a body in `text`, nested ones included.
fn functions(text: &str) -> Vec<Function> {
    let c = blank_literals(text);
    let ident = |i: usize| {
        c.get(i)
            .is_some_and(|ch| ch.is_alphanumeric() || *ch == '_')
    };
    let line_of = |i: usize| 1 + c[..i].iter().filter(|&&ch| ch == '\n').count();
    let mut found = Vec::new();
    for at in 0..c.len().saturating_sub(2) {
        let keyword = c[at] == 'f' && c[at + 1] == 'n' && c[at + 2].is_whitespace();
        if !keyword || (at > 0 && ident(at - 1)) {
            continue;
        }
        let mut i = at + 2;
        while c.get(i).is_some_and(|ch| ch.is_whitespace()) {
            i += 1;
        }
        let name: String = c[i..]
            .iter()
            .take_while(|ch| ch.is_alphanumeric() || **ch == '_')
            .collect();
        // The signature ends at its body's `{`, or at `;` for a declaration without one.
        let mut depth = 0;
        while let Some(&ch) = c.get(i) {
            match ch {
                '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                '{' | ';' if depth == 0 => break,
                _ => {}
            }
            i += 1;
        }
        if c.get(i) != Some(&'{') {
            continue;
        }
        let mut depth = 0;
        let end = (i..c.len()).find(|&j| {
            match c[j] {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            depth == 0
        });
        let line = line_of(at);
        let lines = line_of(end.unwrap_or(c.len())) - line + 1;
        found.push(Function { name, line, lines });
    }
    found
}

#[test]
fn no_function_is_longer_than_80_lines() {
    let mut long = Vec::new();
    let mut exempt_seen = Vec::new();
    for source in sources() {
        for f in functions(&source.text) {
            if f.lines <= MOST_LINES {
                continue;
            }
            if EXEMPT.contains(&(source.rel.as_str(), f.name.as_str())) {
                exempt_seen.push((source.rel.clone(), f.name.clone()));
                continue;
            }
            long.push(format!(
                "{} at {}:{} is {} lines",
                f.name, source.rel, f.line, f.lines
            ));
        }
    }
    long.sort();
    for (file, name) in EXEMPT {
        assert!(
            file.starts_with("src/source/sql/"),
            "{name} in {file}: only the SQL text builders of src/source/sql/ are exempt"
        );
        assert!(
            exempt_seen.iter().any(|(f, n)| f == file && n == name),
            "{name} in {file} is exempt but no longer past {MOST_LINES} lines (or gone): \
             take it out of EXEMPT"
        );
    }
    assert!(
        long.is_empty(),
        "functions longer than {MOST_LINES} lines (split each into steps that have a name):\n{}",
        long.join("\n")
    );
}

/// The reader: braces and `fn` inside strings, raw strings, chars and comments are not
/// code; lifetimes are not chars; a declaration without a body is not a function; nested
/// functions count on their own and inside their parent.
#[test]
fn the_length_reader_skips_literals_and_comments() {
    let text = r##"
trait T { fn declared(&self); }
fn outer<'a>(x: &'a str) -> [u8; 2] {
    let s = "} fn fake() {";
    let r = r#"}"#;
    let c = '{';
    let e = '\'';
    /* } /* nested } */ } */
    // }
    fn inner() {
        let b = b"{";
    }
    [0; 2]
}
"##;
    let found = functions(text);
    let summary: Vec<(&str, usize, usize)> = found
        .iter()
        .map(|f| (f.name.as_str(), f.line, f.lines))
        .collect();
    assert_eq!(summary, [("outer", 3, 12), ("inner", 10, 3)]);
}
