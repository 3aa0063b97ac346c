//! The services the docs' `outbox-relay` lines run against, and running one: the rules are
//! in [`super::commands`].

use std::path::PathBuf;
use std::process::Command as Process;
use std::time::Duration;

use testkit::{NatsCluster, Postgres};

use super::commands::subcommand;
use super::shown::Command;
use crate::common::{
    as_relay_role, grant_relay_role, poll, relay, shared, signal, text, wait_exit, OutputWithin,
    Shared, Signal, TempDir, BIN,
};

/// How long one command may take before the test fails (a `drain` has little to do).
const COMMAND_LIMIT: Duration = Duration::from_secs(60);

/// A word the test cannot fill in: `<table>`, `T`, `ARGS`, `...`, `$VARIABLE`.
fn is_placeholder(word: &str) -> bool {
    word.contains(['<', '>', '$'])
        || word.contains("...")
        || (word.starts_with(|c: char| c.is_ascii_uppercase())
            && word
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
}

/// A migrated outbox in a throwaway PostgreSQL, a three-server NATS cluster whose stream
/// has three replicas (what `check --strict` passes), and a relay config (mark mode, so
/// that `replay` has rows) for the least-privilege role, as the docs set it up.
pub(super) struct Services {
    pg: Postgres,
    _cluster: NatsCluster,
    owner_url: String,
    config: PathBuf,
    _dir: TempDir,
    _shared: Option<Shared>,
}

impl Services {
    pub(super) async fn start() -> Services {
        let shared = shared();
        let pg = Postgres::start().expect("start postgres");
        let cluster = NatsCluster::start(3).expect("start a NATS cluster of three");
        cluster
            .create_stream("OUTBOX", &["events.>"], 3)
            .await
            .expect("create a stream with three replicas");
        let owner_url = pg.create_database("app").await.expect("create database");
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-docs-{}-{}",
            std::process::id(),
            testkit::free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("relay.toml");
        let toml = relay()
            .on_publish("mark")
            .to_toml(&as_relay_role(&owner_url), &cluster.urls().join(","));
        std::fs::write(&config, toml).unwrap();
        let services = Services {
            pg,
            _cluster: cluster,
            owner_url,
            config,
            _dir: TempDir(dir),
            _shared: shared,
        };
        let out = Process::new(BIN)
            .args(["migrate", "--config"])
            .arg(&services.config)
            .env("OUTBOX_RELAY__POSTGRES__URL", &services.owner_url)
            .output_within(COMMAND_LIMIT)
            .unwrap();
        assert!(out.status.success(), "migrate: {}", text(&out));
        let client = services.pg.connect("app").await.unwrap();
        grant_relay_role(&client, "public.outbox").await;
        services
    }

    /// `command` as it would run here, or the placeholder that keeps it from running.
    pub(super) fn process(&self, command: &Command) -> Result<Process, String> {
        let fill = |s: &str| {
            s.replace("${OWNER_URL}", &self.owner_url)
                .replace("$OWNER_URL", &self.owner_url)
        };
        let mut args: Vec<String> = Vec::new();
        let mut words = command.args.iter().filter(|w| !w.optional);
        while let Some(w) = words.next() {
            if w.text == "--config" {
                words.next();
                args.extend(["--config".into(), self.config.display().to_string()]);
                continue;
            }
            let filled = fill(&w.text);
            if !w.quoted && is_placeholder(&filled) {
                return Err(format!("placeholder {}", w.text));
            }
            args.push(filled);
        }
        let mut process = Process::new(BIN);
        process
            .args(&args)
            .env_remove("RUST_LOG")
            .env("OUTBOX_RELAY_CONFIG", &self.config);
        for (name, value) in &command.env {
            let value = fill(value);
            if is_placeholder(&value) {
                return Err(format!("placeholder {value}"));
            }
            process.env(name, value);
        }
        testkit::die_with_parent(&mut process);
        Ok(process)
    }

    /// Runs `process` (an `outbox-relay` command): `Ok` when it exited 0 (`run`: once it
    /// published a row and was sent SIGTERM).
    pub(super) async fn run(&self, mut process: Process, command: &Command) -> Result<(), String> {
        if subcommand(command).as_deref() != Some("run") {
            let out = process
                .output_within(COMMAND_LIMIT)
                .map_err(|e| e.to_string())?;
            return if out.status.success() {
                Ok(())
            } else {
                Err(text(&out))
            };
        }
        let log = self.config.with_file_name("run.log");
        let mut child = process
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .map_err(|e| e.to_string())?;
        let client = self.pg.connect("app").await.unwrap();
        let id: i64 = client
            .query_one(
                "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.docs', 'k', 'x') \
                 RETURNING id",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        let published = poll(Duration::from_secs(30), async || {
            let row = client
                .query_one(
                    "SELECT published_at IS NOT NULL FROM public.outbox WHERE id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            row.get::<_, bool>(0).then_some(())
        })
        .await;
        signal(child.id(), Signal::Term);
        let (code, _) = wait_exit(&mut child, Duration::from_secs(30));
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        match (published, code) {
            (Some(()), Some(0)) => Ok(()),
            (None, _) => Err(format!("row {id} not published within 30s; log:\n{log}")),
            (_, code) => Err(format!("exit {code:?} on SIGTERM; log:\n{log}")),
        }
    }
}
