//! The container image, run the way a sidecar runs it (contract section 9, issue 30):
//! `scripts/image` builds the Dockerfile around the binary under test, and podman runs it
//! with the host's network, the config mounted read-only at the default path, a read-only
//! root file system and the image's own command (`run --log-format json`), against a
//! throwaway PostgreSQL and nats-server.
//!
//! Needs podman, runc and debootstrap (`scripts/install-deps --image`, which
//! `scripts/test` runs). Without them the test says so loudly and passes, except under
//! CI (`CI` set to anything but `false` or `0`, as CI services set it), where it fails.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

/// The tag the test builds: `scripts/image`'s default, `:dev`, is the release build.
const IMAGE: &str = "localhost/outbox-relay:test";
/// `podman stop -t`: the grace before SIGKILL, above the config's 10 s drain deadline.
const GRACE: Duration = Duration::from_secs(30);
/// `scripts/image` on a fresh machine: debootstrap, then apt inside the build.
const BUILD_LIMIT: Duration = Duration::from_secs(15 * 60);
/// Any other podman command.
const PODMAN_LIMIT: Duration = Duration::from_secs(120);

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `program` found in `PATH` (or in /usr/sbin, where debootstrap lives, off a user's PATH).
fn installed(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .any(|dir| dir.join(program).is_file())
}

/// Whether `CI`'s value says the tests run under CI: set and not empty, `false` or `0`
/// (GitHub, GitLab and most services set `true`; others `1` or `yes`).
fn under_ci(value: Option<&str>) -> bool {
    value.is_some_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "false" | "0"))
}

#[test]
fn any_ci_value_but_false_or_0_counts_as_ci() {
    for value in ["true", "1", "yes", "TRUE", "on", "woodpecker"] {
        assert!(under_ci(Some(value)), "CI={value:?} must count as CI");
    }
    for value in [None, Some(""), Some("false"), Some("0"), Some("False")] {
        assert!(!under_ci(value), "CI={value:?} must not count as CI");
    }
}

/// Whether the tools `scripts/image` and this test need are installed. When they are not,
/// the test is skipped with a loud message, or fails under CI ([`under_ci`]).
fn tools_or_skip() -> bool {
    let missing: Vec<&str> = ["podman", "runc", "debootstrap"]
        .into_iter()
        .filter(|p| !installed(p))
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!(
        "{} not installed (scripts/install-deps --image installs them)",
        missing.join(", ")
    );
    let ci = std::env::var("CI").ok();
    assert!(
        !under_ci(ci.as_deref()),
        "CI={ci:?}, so the container test may not be skipped: {why}"
    );
    // Past the test harness's capture, which hides what a passing test prints.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "\n*** SKIPPED the container image test: {why} ***\n"
    );
    false
}

/// podman with the settings `scripts/image` uses: scripts/containers.conf unless
/// `CONTAINERS_CONF` is set.
fn podman(args: &[&str]) -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(args);
    if std::env::var_os("CONTAINERS_CONF").is_none() {
        cmd.env("CONTAINERS_CONF", repo().join("scripts/containers.conf"));
    }
    cmd
}

/// Runs podman; its stdout, trimmed. Fails the test if it fails.
fn podman_ok(args: &[&str]) -> String {
    let out = podman(args)
        .output_within(PODMAN_LIMIT)
        .unwrap_or_else(|e| panic!("podman {args:?}: {e}"));
    assert!(out.status.success(), "podman {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Builds [`IMAGE`] with `scripts/image` around the binary these tests run.
fn build_image() {
    let started = Instant::now();
    let out = Command::new(repo().join("scripts/image"))
        .args(["--binary", BIN, "--tag", IMAGE])
        .output_within(BUILD_LIMIT)
        .expect("run scripts/image");
    assert!(out.status.success(), "scripts/image: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.lines().last().unwrap_or_default();
    eprintln!("scripts/image took {:?}: {summary}", started.elapsed());
}

/// A container started by the test, removed (killed if need be) when dropped.
struct Container(String);

impl Container {
    /// `podman run -d` of [`IMAGE`] as a sidecar: host network, `config` mounted read-only
    /// at the image's default config path, read-only root, the image's user and command.
    fn run_sidecar(config: &Path) -> Container {
        let name = format!(
            "outbox-relay-test-{}-{}",
            std::process::id(),
            testkit::free_port()
        );
        let volume = format!("{}:/etc/outbox-relay/relay.toml:ro", config.display());
        podman_ok(&[
            "run",
            "--detach",
            "--pull=never",
            "--name",
            &name,
            "--network=host",
            "--read-only",
            // Killed by podman's monitor should the test die without removing it.
            "--timeout=300",
            "--volume",
            &volume,
            IMAGE,
        ]);
        Container(name)
    }

    fn inspect(&self, format: &str) -> String {
        podman_ok(&["inspect", "--format", format, &self.0])
    }

    /// Everything the container logged, stdout and stderr.
    fn logs(&self) -> String {
        let out = podman(&["logs", &self.0])
            .output_within(PODMAN_LIMIT)
            .expect("podman logs");
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// `/proc/<pid>/<file>` of the container's main process, as the host sees it.
    fn proc_file(&self, file: &str) -> String {
        let pid = self.inspect("{{.State.Pid}}");
        std::fs::read_to_string(format!("/proc/{pid}/{file}"))
            .unwrap_or_else(|e| panic!("/proc/{pid}/{file} of the container: {e}"))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "--force", "--time", "0", &self.0]).output_within(PODMAN_LIMIT);
    }
}

/// Waits until `/readyz` answers 200, at most `limit`, and how long it took; fails with
/// the container's logs as soon as it stops running.
async fn wait_ready(container: &Container, addr: &str, limit: Duration) -> Duration {
    wait_until(
        Detailed(&format!("/readyz to answer 200 within {limit:?}"), || {
            container.logs()
        }),
        limit,
        async || {
            if let Ok((200, _)) = http_get(addr, "/readyz") {
                return true;
            }
            let running = container.inspect("{{.State.Running}}");
            assert!(
                running == "true",
                "the container stopped before it was ready:\n{}",
                container.logs()
            );
            false
        },
    )
    .await
}

/// The `Uid:`/`Gid:`/`CapEff:` line of a `/proc/<pid>/status`, its fields after the name.
fn status_field<'a>(status: &'a str, name: &str) -> Vec<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .unwrap_or_else(|| panic!("no {name} in {status}"))
        .split_whitespace()
        .collect()
}

/// The mount options of the mount at `target` in a `/proc/<pid>/mountinfo`.
fn mount_options<'a>(mountinfo: &'a str, target: &str) -> Vec<&'a str> {
    mountinfo
        .lines()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .rfind(|fields| fields.get(4) == Some(&target))
        .unwrap_or_else(|| panic!("no mount at {target}:\n{mountinfo}"))[5]
        .split(',')
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_image_runs_as_a_sidecar_read_only_non_root_and_drains_on_podman_stop() {
    if !tools_or_skip() {
        return;
    }
    build_image();
    let relay = relay().workers(2).batch_size(100);
    let env = Env::new(relay.clone()).await;
    let addr = format!("127.0.0.1:{}", testkit::free_port());
    env.write_config(&relay.http(&addr));
    // The container's user (65532) reads it, whatever the test's umask (it holds no secret:
    // the throwaway PostgreSQL trusts 127.0.0.1).
    std::fs::set_permissions(
        &env.config,
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    let client = env.client().await;
    seed(&client, 2_000, 20, 0).await;
    let mut inserted = ids(&client).await;
    let sent = watch_sends(&env.nats).await;

    let container = Container::run_sidecar(&env.config);
    let took = wait_ready(&container, &addr, Duration::from_secs(60)).await;
    eprintln!("/readyz 200 {took:?} after podman run");
    wait_for_empty_outbox(&client, "the container to relay the seeded rows", 60).await;
    assert_eq!(env.stored().await.len(), 2_000, "every row in the stream");

    // The image's command, as the container's main process: no shell in between, so
    // podman stop's SIGTERM reaches the relay itself.
    let cmdline = container.proc_file("cmdline").replace('\0', " ");
    assert_eq!(cmdline.trim_end(), "outbox-relay run --log-format json");
    // Non-root: real, effective, saved and file-system ids are 65532, with no capability.
    let status = container.proc_file("status");
    assert_eq!(status_field(&status, "Uid:"), ["65532"; 4], "{status}");
    assert_eq!(status_field(&status, "Gid:"), ["65532"; 4], "{status}");
    assert_eq!(status_field(&status, "CapEff:"), ["0000000000000000"]);
    // Read-only: the root file system and the config mount, as the relay sees them.
    let mountinfo = container.proc_file("mountinfo");
    assert!(
        mount_options(&mountinfo, "/").contains(&"ro"),
        "{mountinfo}"
    );
    assert!(
        mount_options(&mountinfo, "/etc/outbox-relay/relay.toml").contains(&"ro"),
        "{mountinfo}"
    );

    // podman stop while rows arrive: SIGTERM (the image's STOPSIGNAL) drains the batches
    // in flight, and the relay exits 0 well within the grace.
    let late: Vec<i64> = column(
        &client,
        "INSERT INTO public.outbox (topic, key, payload)
         SELECT 'events.late', 'late' || (n % 7), 'x' FROM generate_series(1, 5000) n
         RETURNING id",
        &[],
    )
    .await;
    inserted.extend(late);
    let stopping = Instant::now();
    let grace = GRACE.as_secs().to_string();
    podman_ok(&["stop", "--time", &grace, &container.0]);
    let stopped_in = stopping.elapsed();
    let exit_code = container.inspect("{{.State.ExitCode}}");
    eprintln!("podman stop took {stopped_in:?}, exit code {exit_code}");
    assert_eq!(exit_code, "0", "{}", container.logs());
    assert!(stopped_in < GRACE, "podman stop took {stopped_in:?}");

    // Nothing lost, nothing sent twice: every row was sent once or is still in the table
    // (a clean stop commits what it sent).
    let left: HashSet<i64> = ids(&client).await.into_iter().collect();
    let sends = sends_so_far(&env.nats, &sent).await;
    let counts = send_counts(&sends);
    let resent = counts.values().filter(|n| **n > 1).count();
    assert_eq!(resent, 0, "rows sent more than once by a clean run");
    for id in &inserted {
        let was_sent = counts.contains_key(format!("public.outbox:{id}").as_str());
        assert!(
            was_sent != left.contains(id),
            "row {id}: sent {was_sent}, still in the table {}",
            left.contains(id)
        );
    }
    eprintln!(
        "{} rows sent, {} left in the table at the stop",
        sends.len(),
        left.len()
    );

    // The logs are JSON, line by line, and show the signal reaching the relay.
    let logs = container.logs();
    let mut lines = 0;
    let mut signal_seen = false;
    for line in logs.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{line}");
        signal_seen |= v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("Signal received"));
        lines += 1;
    }
    assert!(lines >= 2, "{lines} log lines:\n{logs}");
    assert!(signal_seen, "no log of the stop signal:\n{logs}");
}
