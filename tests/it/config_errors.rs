//! Bad input: every configuration mistake exits 2 with a message naming the key, and no
//! output ever contains a password.

use std::process::{Command, Output};

use crate::common::{OutputWithin, RUN_LIMIT};

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

/// The same, with Kafka as the sink (the brokers are never reached: config errors come
/// first, and PostgreSQL is unreachable anyway).
const KAFKA: &str = r#"
[postgres]
url = "postgres://relay:Pa55-w0rd-never-shown@127.0.0.1:1/app"
connect_timeout = "1s"
[sink]
kind = "kafka"
[sink.kafka]
brokers = "127.0.0.1:1"
[sink.kafka.properties]
"compression.type" = "lz4"
"sasl.password" = "Pa55-w0rd-never-shown"
[[tables]]
name = "public.outbox"
"#;

/// Words of serde and Rust types that mean nothing to an operator.
const JARGON: &[&str] = &[
    "invalid type",
    "invalid value",
    "usize",
    "u32",
    "u64",
    "i64",
    "a sequence",
    "a map",
    "map,",
    "struct ",
    "variant",
    "expected a string",
    "expected a boolean",
];

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
    let out = cmd.output_within(RUN_LIMIT).unwrap();
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
        // The password is elsewhere (the NATS URL): never shown either.
        &format!(
            "[postgres]\npool_size = 2\n[sink]\nkind = \"nats\"\n[sink.nats]\n\
             url = \"nats://relay:{PASSWORD}@127.0.0.1:1\"\n[[tables]]\nname = \"outbox\"\n"
        ),
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
        // The password is no longer in the URL but in the NATS URL: never shown either.
        &format!(
            "{}\n[sink.nats]\nurl = \"nats://relay:{PASSWORD}@127.0.0.1:1\"\n",
            VALID.replace("Pa55-w0rd-never-shown", "${NOT_SET_ANYWHERE}")
        ),
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
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(all_output(&out).contains("OUTBOX_RELAY_CONFIG"));
}

#[test]
fn bad_usage_exits_2() {
    let out = Command::new(BIN)
        .args(["drain", "--timeout", "soon"])
        .output_within(RUN_LIMIT)
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

fn config_error(config: &str, env: &[(&str, &str)]) -> String {
    let out = run_with(config, &["check"], env);
    let text = all_output(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(!text.contains(PASSWORD), "password leaked: {text}");
    text
}

#[test]
fn refused_kafka_property_is_a_config_error_exit_2() {
    let config = KAFKA.replace(
        "\"compression.type\" = \"lz4\"\n",
        "\"compression.type\" = \"lz4\"\nacks = \"1\"\n\"enable.idempotence\" = false\n",
    );
    let text = config_error(&config, &[]);
    assert!(
        text.contains("sink.kafka.properties.acks: is \"1\""),
        "{text}"
    );
    assert!(text.contains("at-least-once"), "{text}");
    assert!(text.contains("write \"all\""), "{text}");
    assert!(
        text.contains("sink.kafka.properties.enable.idempotence: is \"false\""),
        "{text}"
    );
    assert!(text.contains("per-key order"), "{text}");
    // Every command refuses it before reaching anything, not only `check`.
    for command in [&["drain", "--timeout", "5s"][..], &["run"]] {
        let out = run_with(&config, command, &[]);
        let all = all_output(&out);
        assert_eq!(out.status.code(), Some(2), "{command:?}: {all}");
        assert!(all.contains("sink.kafka.properties.acks:"), "{all}");
        assert!(!all.contains(PASSWORD), "{all}");
    }
    // Set from the environment, it names the variable.
    let text = config_error(
        KAFKA,
        &[("OUTBOX_RELAY__SINK__KAFKA__PROPERTIES__ACKS", "0")],
    );
    assert!(
        text.contains("sink.kafka.properties.acks: is \"0\""),
        "{text}"
    );
}

#[test]
fn unknown_kafka_property_is_a_config_error_exit_2() {
    let text = config_error(
        &KAFKA.replace("\"compression.type\"", "\"compresion.type\""),
        &[],
    );
    assert!(
        text.contains("sink.kafka.properties.compresion.type: librdkafka has no such property"),
        "{text}"
    );
    let text = config_error(&KAFKA.replace("\"lz4\"", "\"lz5\""), &[]);
    assert!(
        text.contains("sink.kafka.properties.compression.type: librdkafka refuses it"),
        "{text}"
    );
}

#[test]
fn toml_syntax_error_names_line_and_column() {
    let config = VALID.replace("kind = \"nats\"", "kind = nats");
    let text = config_error(&config, &[]);
    assert!(
        text.contains("line 6, column 8: text must be in double quotes: write kind = \"nats\""),
        "{text}"
    );
    assert!(text.contains("6 | kind = nats"), "{text}");
    // The quoted line never shows a password.
    let config = VALID.replace("app\"\n", "app\" x\n");
    let text = config_error(&config, &[]);
    assert!(text.contains("line 3, column "), "{text}");
    assert!(
        text.contains("postgres://<redacted>@127.0.0.1:1/app"),
        "{text}"
    );
}

#[test]
fn wrong_type_message_has_no_serde_jargon() {
    let cases: &[(&str, &str)] = &[
        (
            "[relay]\nworkers = \"x\"\n",
            "relay.workers: expected a whole number, got the text \"x\"",
        ),
        (
            "[relay]\nbatch_size = \"100\"\n",
            "relay.batch_size: expected a whole number, got the text \"100\"; write the number without quotes",
        ),
        (
            "[relay]\nmax_attempts = -1\n",
            "relay.max_attempts: expected a whole number up to 4294967295, got the number -1",
        ),
        (
            "[relay]\nworkers = 2.5\n",
            "relay.workers: expected a whole number, got the number 2.5",
        ),
        (
            "[postgres]\nprepared_statements = \"yes\"\n",
            "postgres.prepared_statements: expected true or false, got the text \"yes\"",
        ),
        (
            "[relay]\npoll_interval = 100\n",
            "relay.poll_interval: 100 has no unit: write a duration in double quotes, e.g. \"100ms\"",
        ),
        (
            "[http]\nlisten = 9187\n",
            "http.listen: expected text in double quotes, got the number 9187",
        ),
        (
            "[relay]\nordering = \"keys\"\n",
            "relay.ordering: \"keys\" is not a valid value; write one of \"key\", \"none\"",
        ),
        (
            "[relay]\nordering = 1\n",
            "relay.ordering: expected one of \"key\", \"none\", got the number 1",
        ),
        (
            "shutdown = \"25s\"\n",
            "shutdown: expected a table (a [section] of keys), got the text \"25s\"",
        ),
        (
            "[relay.workers]\nn = 4\n",
            "relay.workers: expected a whole number, got a table",
        ),
        (
            "[[relay]]\nworkers = 4\n",
            "relay: is written [[relay]], which makes a list; write [relay] with single brackets",
        ),
    ];
    for (more, expected) in cases {
        // [postgres] is VALID's own section and a bare key belongs before any section:
        // put those in place, append the rest.
        let config = match more.strip_prefix("[postgres]\n") {
            Some(key) => VALID.replace("[postgres]\n", &format!("[postgres]\n{key}")),
            None if !more.starts_with('[') => format!("{more}{VALID}"),
            None => format!("{VALID}\n{more}"),
        };
        let text = config_error(&config, &[]);
        assert!(text.contains(expected), "expected {expected:?} in: {text}");
        for word in JARGON {
            assert!(!text.contains(word), "{word:?} in: {text}");
        }
    }
    // [tables] where [[tables]] belongs.
    let text = config_error(&VALID.replace("[[tables]]", "[tables]"), &[]);
    assert!(
        text.contains("tables: is a single [tables] table, but it takes a list: write each entry as [[tables]]"),
        "{text}"
    );
    // A bad sink kind lists the valid ones.
    let text = config_error(&VALID.replace("\"nats\"", "\"kafak\""), &[]);
    assert!(
        text.contains("sink.kind: \"kafak\" is not a valid value; write one of \"kafka\", \"nats\", \"stdout\""),
        "{text}"
    );
}

#[test]
fn missing_sink_kind_lists_the_kinds() {
    let text = config_error(&VALID.replace("kind = \"nats\"\n", ""), &[]);
    assert!(
        text.contains(
            "sink.kind: required key is missing: write kind = \"kafka\", \"nats\" or \"stdout\""
        ),
        "{text}"
    );
}

#[test]
fn unknown_key_suggests_the_nearest_one() {
    let text = config_error(&format!("{VALID}\n[relay]\nworkerz = 2\n"), &[]);
    assert!(
        text.contains("relay.workerz: unknown key; did you mean workers?"),
        "{text}"
    );
}

#[test]
fn sink_input_refused_only_at_connect_before_is_a_config_error_exit_2() {
    // A NATS URL the client cannot parse, a TLS file that is not PEM: both used to pass the
    // configuration and fail when the sink connected.
    let text = config_error(
        &VALID.replace(
            "kind = \"nats\"",
            "kind = \"nats\"\n[sink.nats]\nurl = \"http://u:Pa55-w0rd-never-shown@h:4222\"",
        ),
        &[],
    );
    assert!(
        text.contains("sink.nats.url: http://<redacted>@h:4222 is not a NATS URL"),
        "{text}"
    );
    let dir = std::env::temp_dir().join(format!("outbox-relay-pem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let junk = dir.join("ca.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let text = config_error(
        &VALID.replace(
            "kind = \"nats\"",
            &format!(
                "kind = \"nats\"\n[sink.nats]\ntls_ca_file = \"{}\"",
                junk.display()
            ),
        ),
        &[],
    );
    assert!(text.contains("sink.nats.tls_ca_file: "), "{text}");
    assert!(text.contains("give a readable PEM file"), "{text}");
    let text = config_error(
        &KAFKA.replace(
            "\"compression.type\" = \"lz4\"\n",
            &format!("\"ssl.certificate.location\" = \"{}\"\n", junk.display()),
        ),
        &[],
    );
    assert!(
        text.contains("sink.kafka.properties.ssl.certificate.location: "),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A table named by one entry and matched by another's pattern is refused before any
/// connection, naming the table and both entries; so is a pattern that is not one.
#[test]
fn a_table_named_and_matched_by_a_pattern_is_a_config_error_naming_both_entries() {
    assert_config_error(
        &format!("{VALID}[[tables]]\nname = \"public.out*\"\n"),
        &[],
        "tables[1].name: table public.outbox is matched by two [[tables]] entries, tables[0] \
         (public.outbox) and tables[1] (public.out*)",
    );
    assert_config_error(
        &format!("{VALID}[[tables]]\nname = \"tenant-*.outbox\"\n"),
        &[],
        "tables[1].name:",
    );
}
