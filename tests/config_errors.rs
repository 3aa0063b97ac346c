//! Bad input: every configuration mistake exits 2 with a message naming the key, and no
//! output ever contains a password.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
const PASSWORD: &str = "Pa55-w0rd-never-shown";

const VALID: &str = r#"
[postgres]
url = "postgres://relay:Pa55-w0rd-never-shown@127.0.0.1:1/app"
connect_timeout = "1s"
[sink]
kind = "nats"
[[tables]]
name = "public.outbox"
"#;

fn run_with(config: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = std::env::temp_dir().join(format!(
        "outbox-relay-cfg-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("relay.toml");
    std::fs::write(&path, config).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(args).arg("--config").arg(&path);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn all_output(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn assert_config_error(config: &str, env: &[(&str, &str)], names: &str) {
    let out = run_with(config, &["check"], env);
    let text = all_output(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains(names), "expected {names:?} in: {text}");
    assert!(!text.contains(PASSWORD), "password leaked: {text}");
}

#[test]
fn unknown_key_exits_2_naming_the_key() {
    assert_config_error(
        &format!("{VALID}\n[relay]\nworkerz = 2\n"),
        &[],
        "relay.workerz: unknown key",
    );
}

#[test]
fn bad_duration_exits_2_naming_the_key() {
    assert_config_error(
        &format!("{VALID}\n[relay]\npoll_interval = \"fast\"\n"),
        &[],
        "relay.poll_interval: invalid duration",
    );
}

#[test]
fn bad_enum_value_exits_2_naming_the_key() {
    assert_config_error(
        &format!("{VALID}\n[relay]\non_publish = \"archive\"\n"),
        &[],
        "relay.on_publish:",
    );
}

#[test]
fn missing_required_key_exits_2_naming_the_key() {
    assert_config_error(
        "[postgres]\npool_size = 2\n[sink]\nkind = \"nats\"\n[[tables]]\nname = \"outbox\"\n",
        &[],
        "postgres.url: required key is missing",
    );
}

#[test]
fn bad_environment_override_exits_2_naming_the_variable() {
    assert_config_error(
        VALID,
        &[("OUTBOX_RELAY__RELAY__BATCH_SIZE", "lots")],
        "OUTBOX_RELAY__RELAY__BATCH_SIZE",
    );
}

#[test]
fn unset_interpolated_variable_exits_2_naming_it() {
    assert_config_error(
        &VALID.replace("Pa55-w0rd-never-shown", "${NOT_SET_ANYWHERE}"),
        &[],
        "NOT_SET_ANYWHERE is not set",
    );
}

#[test]
fn invalid_postgres_url_exits_2_without_echoing_the_password() {
    assert_config_error(
        &VALID.replace("127.0.0.1:1", "127.0.0.1:port"),
        &[],
        "postgres.url:",
    );
}

#[test]
fn unreadable_config_file_exits_2_saying_how_to_point_at_one() {
    let out = Command::new(BIN)
        .args(["check", "--config", "/nonexistent/relay.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(all_output(&out).contains("OUTBOX_RELAY_CONFIG"));
}

#[test]
fn bad_usage_exits_2() {
    let out = Command::new(BIN)
        .args(["drain", "--timeout", "soon"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_connection_failure_never_shows_the_password() {
    // Valid config, unreachable database: exit 1, and the password appears nowhere.
    let out = run_with(VALID, &["check"], &[]);
    let text = all_output(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("postgres://relay@127.0.0.1:1/app"), "{text}");
    assert!(!text.contains(PASSWORD), "{text}");
    let out = run_with(VALID, &["drain", "--timeout", "1s"], &[]);
    let text = all_output(&out);
    assert!(!text.contains(PASSWORD), "{text}");
}
