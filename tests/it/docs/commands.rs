//! Every command the README and docs/ show runs, or the page marks it as an example.
//!
//! **What counts as a command.** A command of the project's own programs: `outbox-relay`
//! (any path ending in it, any subcommand), `outbox-bench`, and the executable files of
//! `scripts/`. Where a page shows one:
//! - every line of a fenced block whose info string starts with `sh`, `bash`, `shell` or
//!   `console` (there, lines starting with `$ `): a line to copy and run. Continuation
//!   lines (`\`) are joined, `#` comments dropped, a line split at `&&`, `||`, `;` and `|`,
//!   and `NAME=value` or `sudo` before the program set aside. Lines of other programs
//!   (`psql`, `cargo`, `systemctl`) are not ours to check and are only counted;
//! - an inline code span in prose that starts with a program and has more than its name
//!   (`` `outbox-relay drain` ``, `` `scripts/test` ``; `` `outbox-relay` `` alone names
//!   the program); `` `... --flag` `` continues the span before it (a table of variants).
//!
//! **What "runs" means.** Every command is *flag-checked*: its program's help (`outbox-relay
//! SUBCOMMAND --help`, `scripts/X --help`, outbox-bench's own clap definition) exits 0
//! and names every `--flag` the line uses, optional parts (`[--until 1h]`) included; a
//! script's help also names the `NAME` of each `NAME=value` set before it. A fenced
//! `outbox-relay` line is also *run*, in page order, against a throwaway PostgreSQL and a
//! three-server NATS cluster with a durable stream, and must exit 0: `--config FILE` (any
//! file) becomes the test's config, `$OWNER_URL` the database owner's URL, optional parts
//! are left out; `run` is started, publishes a row, and must exit 0 on SIGTERM. A line
//! with a placeholder the test cannot fill (`<table>`, `T`, `ARGS`, `...`, another
//! `$VARIABLE`) is flag-checked only. Scripts and outbox-bench are never run here: each
//! builds and runs for minutes.
//!
//! **The example marker.** `<!-- example: why -->` on the last non-blank line before a
//! fenced block (invisible on the rendered page) makes the block's commands examples: not
//! run, still flag-checked. Use it for commands that cannot run against the test's
//! services (a Kafka cluster, a systemd host), and say why.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command as Process;
use std::time::Duration;

use clap::CommandFactory;

use super::services::Services;
use super::shown::{shown, simple_commands, Command, Program, Shown};
use crate::common::{text, OutputWithin, BIN};

/// outbox-bench's command line, compiled here from its own source: `cargo test --test it`
/// does not build testkit's binaries, and a stale one would check old flags.
#[allow(dead_code)]
#[path = "../../../testkit/src/bin/outbox-bench/args.rs"]
mod bench_args;

/// How a command was checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Verdict {
    /// Run against the test's services, and exited 0 (after flag-checking).
    Ran,
    /// Its subcommand and flags are in its program's help.
    FlagChecked,
    /// Marked as an example: flag-checked, not run.
    Example,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md, then docs/*.md by name ([`super::page_paths`]), each with its text.
fn pages() -> Vec<(String, String)> {
    let root = root();
    super::page_paths()
        .into_iter()
        .map(|p| {
            let name = p.strip_prefix(&root).unwrap().display().to_string();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

/// The help texts asked for so far: a program's (and subcommand's) help, or why there is
/// none.
#[derive(Default)]
struct Helps(HashMap<String, Result<String, String>>);

impl Helps {
    /// The help `command` is checked against.
    fn of(&mut self, command: &Command) -> Result<String, String> {
        let sub = match command.program {
            Program::Relay => subcommand(command),
            _ => None,
        };
        let key = match &command.program {
            Program::Relay => format!("outbox-relay {}", sub.as_deref().unwrap_or("")),
            Program::Bench => "outbox-bench".to_owned(),
            Program::Script(name) => format!("scripts/{name}"),
        };
        if let Some(help) = self.0.get(&key) {
            return help.clone();
        }
        let help = match &command.program {
            Program::Relay => help_of(Process::new(BIN).args(sub).arg("--help")),
            Program::Bench => Ok(bench_args::Args::command().render_long_help().to_string()),
            Program::Script(name) => {
                help_of(Process::new(root().join("scripts").join(name)).arg("--help"))
            }
        };
        self.0.insert(key, help.clone());
        help
    }
}

/// The output of a `--help` run that must exit 0 within 10 s.
fn help_of(command: &mut Process) -> Result<String, String> {
    let out = command
        .env_remove("RUST_LOG")
        .output_within(Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!("`{command:?}` failed: {}", text(&out)))
    }
}

/// The subcommand of an `outbox-relay` command: its first word that is neither a flag nor
/// the value of a global one (`--config FILE`, `--log-format F`).
pub(super) fn subcommand(command: &Command) -> Option<String> {
    let mut words = command.args.iter().filter(|w| !w.optional);
    while let Some(w) = words.next() {
        match w.text.as_str() {
            "--config" | "--log-format" => {
                words.next();
            }
            t if t.starts_with('-') => {}
            t => return Some(t.to_owned()),
        }
    }
    None
}

/// Whether `help` names `flag` (`--id` in "--id <N>...", not in "--idle").
fn names_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(at, _)| {
        let before = help[..at].chars().next_back();
        let after = help[at + flag.len()..].chars().next();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '-')
            && !after.is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_')
    })
}

/// What is wrong with `command`'s flags against its program's help, if anything.
fn flag_problems(command: &Command, helps: &mut Helps) -> Vec<String> {
    let help = match helps.of(command) {
        Ok(help) => help,
        Err(e) => return vec![e],
    };
    let flags = command
        .args
        .iter()
        .filter(|w| !w.quoted && w.text.starts_with("--") && w.text.len() > 2)
        .map(|w| w.text.split('=').next().unwrap().to_owned());
    let names = match command.program {
        Program::Script(_) => command.env.iter().map(|(n, _)| n.clone()).collect(),
        _ => Vec::new(),
    };
    flags
        .chain(names)
        .filter(|name| !names_flag(&help, name))
        .map(|name| format!("its help does not name {name}"))
        .collect()
}

/// Checks every command `pages` show: how each was checked, and what is wrong (`README.md:12:
/// `outbox-relay drain --x`: ...`). Runs fenced `outbox-relay` lines when `services` are
/// given.
async fn check(
    pages: &[(String, String)],
    services: Option<&Services>,
) -> (Vec<(Shown, Verdict)>, Vec<String>, usize) {
    let root = root();
    let mut helps = Helps::default();
    let (mut done, mut problems, mut others) = (Vec::new(), Vec::new(), 0);
    for (page, markdown) in pages {
        for shown in shown(&root, page, markdown) {
            let commands = simple_commands(&shown.text, &root);
            if commands.is_empty() {
                others += 1;
                continue;
            }
            let mut how = Verdict::FlagChecked;
            for command in &commands {
                let mut wrong = flag_problems(command, &mut helps);
                let runnable = wrong.is_empty()
                    && command.program == Program::Relay
                    && shown.fenced
                    && shown.example.is_none();
                if let (true, Some(services)) = (runnable, services) {
                    if let Ok(process) = services.process(command) {
                        match services.run(process, command).await {
                            Ok(()) => how = Verdict::Ran,
                            Err(e) => wrong.push(format!("did not run: {e}")),
                        }
                    }
                }
                problems.extend(
                    wrong
                        .into_iter()
                        .map(|p| format!("{}: `{}`: {p}", shown.at, shown.text)),
                );
            }
            if shown.example.is_some() {
                how = Verdict::Example;
            }
            done.push((shown, how));
        }
    }
    (done, problems, others)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_command_the_docs_show_runs_or_is_marked_an_example() {
    let services = Services::start().await;
    let started = std::time::Instant::now();
    let (done, problems, others) = check(&pages(), Some(&services)).await;
    let mut counts: HashMap<Verdict, usize> = HashMap::new();
    for (shown, how) in &done {
        *counts.entry(*how).or_default() += 1;
        eprintln!("{how:?}\t{}\t{}", shown.at, shown.text);
    }
    let count = |how| counts.get(&how).copied().unwrap_or(0);
    eprintln!(
        "{} commands shown: {} ran, {} flag-checked, {} marked example ({} lines of other \
         programs left alone), in {:?}",
        done.len(),
        count(Verdict::Ran),
        count(Verdict::FlagChecked),
        count(Verdict::Example),
        others,
        started.elapsed()
    );
    assert!(
        problems.is_empty(),
        "commands in the docs that do not run (fix the page, or mark the block with \
         `<!-- example: why -->`; see tests/it/docs/commands.rs):\n{}",
        problems.join("\n")
    );
    // The reading is sound: it found commands of each program, and ran the runnable kinds.
    let ran: Vec<Option<String>> = done
        .iter()
        .filter(|(_, how)| *how == Verdict::Ran)
        .flat_map(|(s, _)| simple_commands(&s.text, &root()))
        .map(|c| subcommand(&c))
        .collect();
    for sub in [
        "migrate", "check", "run", "drain", "status", "replay", "pause",
    ] {
        assert!(
            ran.contains(&Some(sub.to_owned())),
            "no `{sub}` ran: {ran:?}"
        );
    }
    let programs: Vec<Program> = done
        .iter()
        .flat_map(|(s, _)| simple_commands(&s.text, &root()))
        .map(|c| c.program)
        .collect();
    assert!(programs.contains(&Program::Bench));
    assert!(programs.contains(&Program::Script("test".into())));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bogus_flag_subcommand_or_script_option_fails_the_check() {
    let page = "```sh\noutbox-relay drain --config relay.toml --no-such-flag\n```\n\
                `outbox-relay no-such-command --config x`, `scripts/soak --no-such-flag`,\n\
                `... --minutes 3 --fast`, `target/release/outbox-bench x --no-such-flag`,\n\
                `SOAK_SEEDS=1 scripts/test`.\n\n<!-- example: flag-checked all the same -->\n\
                ```sh\noutbox-relay run --no-such-flag\n```\n";
    let (done, problems, _) = check(&[("page.md".into(), page.into())], None).await;
    assert_eq!(done.len(), 7, "{done:?}");
    assert_eq!(done[6].1, Verdict::Example, "{done:?}");
    let expected = [
        "page.md:2: `outbox-relay drain --config relay.toml --no-such-flag`: its help does not name --no-such-flag",
        "page.md:4: `outbox-relay no-such-command --config x`: ",
        "page.md:4: `scripts/soak --no-such-flag`: its help does not name --no-such-flag",
        "page.md:5: `scripts/soak --minutes 3 --fast`: its help does not name --fast",
        "page.md:5: `target/release/outbox-bench x --no-such-flag`: its help does not name --no-such-flag",
        "page.md:6: `SOAK_SEEDS=1 scripts/test`: its help does not name SOAK_SEEDS",
        "page.md:10: `outbox-relay run --no-such-flag`: its help does not name --no-such-flag",
    ];
    assert_eq!(problems.len(), expected.len(), "{problems:#?}");
    for (problem, start) in problems.iter().zip(expected) {
        assert!(problem.starts_with(start), "{problem}\nexpected: {start}");
    }
    assert!(
        problems[1].contains("unrecognized subcommand"),
        "{}",
        problems[1]
    );
}
