//! What operators see: `/metrics`, `/healthz`, `/readyz`, JSON logs, systemd readiness
//! and watchdog notifications, and the systemd unit itself.

use std::os::unix::net::UnixDatagram;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

/// An Env whose relay serves HTTP on a free port; returns the address.
async fn env_with_http(relay: Relay) -> (Env, String) {
    let env = Env::new(relay.clone()).await;
    let addr = format!("127.0.0.1:{}", testkit::free_port());
    env.write_config(&relay.http(&addr));
    (env, addr)
}

/// Waits until `path` answers `want`, at most `limit`; how long it took.
async fn wait_http(addr: &str, path: &str, want: u16, limit: Duration) -> Duration {
    wait_until(
        format!("{path} to answer {want}"),
        limit,
        async || matches!(http_get(addr, path), Ok((status, _)) if status == want),
    )
    .await
}

/// Section 9: `/metrics` has every family, and they move: nothing published before the
/// rows arrive; after them 3,000 published, the bad row's failures and its dead-lettering,
/// an empty backlog, and the database gauges refreshed.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_families_are_present_and_move() {
    let (env, addr) = env_with_http(relay().workers(2).batch_size(100).retry_backoff("10ms")).await;
    let client = env.client().await;
    // A session of the relay's own role (the only sessions it may see without
    // pg_monitor) holding a snapshot.
    let (holder, connection) =
        tokio_postgres::connect(&as_relay_role(&env.db_url), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    holder
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .await
        .unwrap();
    let mut relay = env.spawn_run();
    wait_http(&addr, "/readyz", 200, Duration::from_secs(20)).await;
    let (status, before) = http_get(&addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    let published = r#"outbox_relay_rows_published_total{table="public.outbox",sink="nats"}"#;
    assert_eq!(sample(&before, published), None, "nothing published yet");

    seed(&client, 3_000, 30, 0).await;
    client
        .execute(
            "INSERT INTO public.outbox (topic, key, payload, headers) VALUES ('events.x', 'bad', 'p', '[1]')",
            &[],
        )
        .await
        .unwrap();
    wait_until("the outbox to drain", Duration::from_secs(30), async || {
        count(
            &client,
            "SELECT count(*) FROM public.outbox WHERE dead_at IS NULL",
        )
        .await
            == 0
    })
    .await;
    // The database gauges refresh every 5 s: wait for a refresh after the drain. The
    // snapshot held by `holder` (opened before the relay) ages, so the snapshot-age gauge
    // changes at every refresh.
    let snapshot_age = || scrape(&addr, "outbox_relay_oldest_snapshot_age_seconds");
    let drained_at = snapshot_age();
    wait_until(
        "a gauge refresh after the drain",
        Duration::from_secs(20),
        async || snapshot_age() != drained_at,
    )
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    let (_, after) = http_get(&addr, "/metrics").unwrap();
    assert_eq!(sample(&after, published), Some(3_000.0), "{after}");
    for family in [
        r#"outbox_relay_rows_failed_total{table="public.outbox",sink="nats"} 10"#,
        r#"outbox_relay_rows_dead_lettered_total{table="public.outbox",sink="nats"} 1"#,
        r#"outbox_relay_backlog_rows{table="public.outbox"} 0"#,
        r#"outbox_relay_oldest_pending_age_seconds{table="public.outbox"} 0"#,
        "outbox_relay_rows_in_flight 0",
        r#"outbox_relay_circuit_open{sink="nats"} 0"#,
        "outbox_relay_ready 1",
        "# TYPE outbox_relay_publish_duration_seconds histogram",
        "# TYPE outbox_relay_batch_duration_seconds histogram",
    ] {
        assert!(after.contains(family), "missing {family:?}:\n{after}");
    }
    let batches = sample(
        &after,
        r#"outbox_relay_batch_duration_seconds_count{table="public.outbox",sink="nats"}"#,
    )
    .unwrap();
    assert!(batches >= 30.0, "{batches} batches for 3,000 rows of 100");
    terminate_cleanly(&mut relay);
}

/// Section 8 (replicas): a gauge that counts the backlog is read for a scrape, not on a
/// clock. Every sidecar of a table would otherwise count the same backlog every 5 s
/// whether anyone looks or not (benchmark R: 68 ms of a backend per relay at 200,000
/// rows). Until `/metrics` is asked, the backlog is never counted; once asked, the next
/// scrapes show it.
#[tokio::test(flavor = "multi_thread")]
async fn backlog_gauges_are_counted_for_scrapes_not_on_a_clock() {
    let (env, addr) = env_with_http(relay().workers(2)).await;
    seed(&env.client().await, 40, 4, 0).await;
    // Paused: the 40 rows stay the backlog the gauge should show.
    let out = env.relay(&["pause", "--reason", "the backlog gauge test"]);
    assert!(out.status.success(), "{out:?}");
    let mut relay = env.spawn_run();
    wait_http(&addr, "/readyz", 200, Duration::from_secs(20)).await;
    // Two gauge intervals (5 s each) with nothing scraping: a relay that reads the
    // backlog on a clock has read it by now, at its first look and again 5 s later.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let backlog = r#"outbox_relay_backlog_rows{table="public.outbox"}"#;
    let (_, first) = http_get(&addr, "/metrics").unwrap();
    assert!(
        first.contains("outbox_relay_table_dead_tuples"),
        "the other database gauges are read all the same:\n{first}"
    );
    assert_eq!(
        sample(&first, backlog),
        None,
        "counted for nobody:\n{first}"
    );
    // The first scrape asked for it: a later one shows it.
    wait_until(
        "a scrape to show the backlog",
        Duration::from_secs(15),
        async || scrape(&addr, backlog) == Some(40.0),
    )
    .await;
    terminate_cleanly(&mut relay);
}

#[tokio::test(flavor = "multi_thread")]
async fn readyz_flips_to_503_when_nats_stops_and_back_to_200_when_it_returns() {
    let (mut env, addr) = env_with_http(relay().workers(2)).await;
    let mut relay = env.spawn_run();
    let took = wait_http(&addr, "/readyz", 200, Duration::from_secs(20)).await;
    eprintln!("ready {took:?} after start");
    assert_eq!(http_get(&addr, "/healthz").unwrap().0, 200);

    env.nats.kill();
    let took = wait_http(&addr, "/readyz", 503, Duration::from_secs(15)).await;
    eprintln!("/readyz 503 {took:?} after nats-server was killed");
    let (_, reason) = http_get(&addr, "/readyz").unwrap();
    assert!(reason.contains("broker not reachable"), "{reason}");
    assert_eq!(
        http_get(&addr, "/healthz").unwrap().0,
        200,
        "alive all the same"
    );

    env.nats.start_again().unwrap();
    let took = wait_http(&addr, "/readyz", 200, Duration::from_secs(20)).await;
    eprintln!("/readyz 200 {took:?} after nats-server came back");
    terminate_cleanly(&mut relay);
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_parse_and_carry_the_batch_span_without_payloads() {
    let env = Env::new(relay().workers(2).batch_size(50)).await;
    let client = env.client().await;
    client
        .execute(
            "INSERT INTO public.outbox (topic, key, payload, headers)
             SELECT 'events.j', 'k' || (n % 3), convert_to('PAYLOAD-MARKER-' || n, 'UTF8'), NULL
             FROM generate_series(1, 200) n",
            &[],
        )
        .await
        .unwrap();
    let out = env
        .command(&["drain", "--timeout", "60s", "--log-format", "json"])
        .env("RUST_LOG", "outbox_relay=debug")
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stderr = String::from_utf8(out.stderr).unwrap();
    let mut in_batch_span = 0;
    for line in stderr.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{line}");
        if v["span"]["name"] == "batch" {
            assert_eq!(v["span"]["table"], "public.outbox", "{line}");
            in_batch_span += 1;
        }
    }
    assert!(
        in_batch_span >= 4,
        "events inside the batch span: {in_batch_span}"
    );
    assert!(
        !stderr.contains("PAYLOAD-MARKER"),
        "a payload reached the log"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn systemd_hears_ready_watchdog_and_stopping() {
    let env = Env::new(relay().workers(1)).await;
    let dir = std::env::temp_dir().join(format!("outbox-relay-notify-{}", testkit::free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    let socket_path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut relay = env
        .command(&["run"])
        .env("NOTIFY_SOCKET", &socket_path)
        .env("WATCHDOG_USEC", "1000000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 256];
    // Each receive waits at most 20 s, and the whole exchange at most 30 s (watchdog
    // pings keep coming, so a missing STOPPING would otherwise loop for ever).
    let started = std::time::Instant::now();
    let mut next = || {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the expected notification did not come within 30 s"
        );
        let n = socket.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let mut seen = Vec::new();
    while !seen.iter().any(|m: &String| m.contains("WATCHDOG=1")) {
        seen.push(next());
    }
    assert!(seen[0].contains("READY=1"), "{seen:?}");
    signal(relay.id(), Signal::Term);
    while !seen.iter().any(|m: &String| m.contains("STOPPING=1")) {
        seen.push(next());
    }
    let (code, _) = wait_exit(&mut relay, Duration::from_secs(15));
    assert_eq!(code, Some(0));
}

const UNIT: &str = include_str!("../../systemd/outbox-relay.service");
const TEMPLATE: &str = include_str!("../../systemd/outbox-relay@.service");

/// What the contract asks of a unit (section 9): `Type=notify` with a watchdog, `check`
/// before start, hardening, and a stop timeout above the default drain_timeout of 25s.
fn assert_hardened_notify_unit(name: &str, unit: &str) {
    for directive in [
        "Type=notify",
        "ExecStartPre=/usr/bin/outbox-relay check",
        "WatchdogSec=",
        "DynamicUser=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "RestrictAddressFamilies=",
        "SystemCallFilter=@system-service",
    ] {
        assert!(unit.contains(directive), "{name}: missing {directive}");
    }
    let stop: u64 = unit
        .lines()
        .find_map(|l| l.strip_prefix("TimeoutStopSec="))
        .unwrap()
        .parse()
        .unwrap();
    assert!(stop > 25, "{name}: TimeoutStopSec={stop}");
}

/// `systemd-analyze verify` on `verified` (a unit, or an instance of a template), with
/// `file_name` holding `unit` in an otherwise empty directory; it must pass without a
/// word. systemd-analyze checks that the binary paths exist: they point at the built one.
fn assert_systemd_analyze_verifies(file_name: &str, unit: &str, verified: &str) {
    let dir = std::env::temp_dir().join(format!(
        "outbox-relay-unit-{}-{}",
        std::process::id(),
        file_name.replace('@', "-at-")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    std::fs::write(
        dir.join(file_name),
        unit.replace("/usr/bin/outbox-relay", BIN),
    )
    .unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(dir.join(verified))
        .output_within(RUN_LIMIT)
        .expect("systemd-analyze (package systemd; scripts/install-deps installs it)");
    assert!(out.status.success(), "{verified}: {}", text(&out));
    assert!(out.stderr.is_empty(), "{verified}: {}", text(&out));
}

/// The lines systemd reads: no comments, no blank lines.
fn directives(unit: &str) -> Vec<&str> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

#[test]
fn the_systemd_unit_verifies() {
    assert_hardened_notify_unit("outbox-relay.service", UNIT);
    assert_systemd_analyze_verifies("outbox-relay.service", UNIT, "outbox-relay.service");
}

/// Several databases on one VM: instance NAME of `outbox-relay@.service` reads
/// `/etc/outbox-relay/NAME.toml` (contract section 9), and is otherwise the single unit,
/// directive for directive, so the template can never fall behind on hardening.
#[test]
fn the_template_unit_runs_one_relay_per_config_with_the_units_hardening() {
    assert_hardened_notify_unit("outbox-relay@.service", TEMPLATE);
    let per_instance = [
        (
            "Description=outbox-relay: ",
            "Description=outbox-relay %i: ",
        ),
        (
            "Environment=OUTBOX_RELAY_CONFIG=/etc/outbox-relay/relay.toml",
            "Environment=OUTBOX_RELAY_CONFIG=/etc/outbox-relay/%i.toml",
        ),
        (
            "EnvironmentFile=-/etc/outbox-relay/relay.env",
            "EnvironmentFile=-/etc/outbox-relay/%i.env",
        ),
    ];
    let mut expected = UNIT.to_owned();
    for (single, instance) in per_instance {
        assert!(UNIT.contains(single), "outbox-relay.service lacks {single}");
        assert!(TEMPLATE.contains(instance), "the template lacks {instance}");
        expected = expected.replace(single, instance);
    }
    assert_eq!(
        directives(TEMPLATE),
        directives(&expected),
        "outbox-relay@.service must be outbox-relay.service but for the instance's config"
    );
    // Verified as systemd loads it: an instance, with %i expanded.
    assert_systemd_analyze_verifies(
        "outbox-relay@.service",
        TEMPLATE,
        "outbox-relay@payments.service",
    );
}

#[test]
fn the_container_image_runs_the_relay_as_a_numeric_non_root_user() {
    let dockerfile = include_str!("../../Dockerfile");
    let last_stage = dockerfile.rsplit("\nFROM ").next().unwrap();
    for line in [
        "USER 65532:65532",
        "STOPSIGNAL SIGTERM",
        r#"ENTRYPOINT ["outbox-relay"]"#,
        r#"CMD ["run", "--log-format", "json"]"#,
    ] {
        assert!(last_stage.contains(line), "runtime stage lacks {line}");
    }
    assert!(dockerfile.contains(" AS build"), "multi-stage build");
    // The sidecar example gives the relay more than its drain deadline to stop.
    let k8s = include_str!("../../examples/kubernetes-sidecar.yaml");
    assert!(k8s.contains("restartPolicy: Always"), "native sidecar");
    // Liveness only: a readiness gate on the sidecar would pull the application out of
    // its Service whenever the broker is down, the very outage an outbox absorbs.
    assert!(k8s.contains("livenessProbe:") && k8s.contains("path: /healthz"));
    assert!(
        !k8s.lines()
            .any(|l| l.trim_start().starts_with("readinessProbe:")),
        "no readiness gate on the sidecar"
    );
    let grace: u64 = k8s
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(grace > 25);
}

/// Kubernetes versions the examples are validated against: 1.29, the first with native
/// sidecars on by default (an init container's `restartPolicy: Always`, which the schema
/// of 1.27 refuses), and the newest the pinned kubernetes-validate bundles.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.29.0", "1.37.0"];

/// kubernetes-validate (PyPI), as `scripts/install-deps --kubernetes-validate` installs it:
/// `$KUBERNETES_VALIDATE`, else its venv under ~/.cache, else the one on PATH.
fn kubernetes_validate() -> std::process::Command {
    let program = std::env::var_os("KUBERNETES_VALIDATE")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            let home = std::env::var_os("HOME")?;
            let venv = std::path::Path::new(&home)
                .join(".cache/outbox-relay/kubernetes-validate/bin/kubernetes-validate");
            venv.exists().then_some(venv)
        })
        .unwrap_or_else(|| "kubernetes-validate".into());
    std::process::Command::new(program)
}

/// Runs kubernetes-validate in strict mode (an unknown field is an error) on `file`.
fn validate_manifest(file: &std::path::Path, version: &str) -> std::process::Output {
    kubernetes_validate()
        .args(["--strict", "--quiet", "--kubernetes-version", version])
        .arg(file)
        .output_within(RUN_LIMIT)
        .expect("kubernetes-validate (scripts/install-deps --kubernetes-validate installs it)")
}

/// Every manifest in examples/ is valid against the Kubernetes schema (strict: a misspelt
/// field fails), offline, with the schemas kubernetes-validate bundles.
#[test]
fn the_kubernetes_examples_validate_against_the_kubernetes_schema() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut manifests: Vec<_> = std::fs::read_dir(&examples)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    manifests.sort();
    assert!(
        !manifests.is_empty(),
        "no manifest in {}",
        examples.display()
    );
    for manifest in &manifests {
        for version in KUBERNETES_VERSIONS {
            let out = validate_manifest(manifest, version);
            assert!(
                out.status.success(),
                "{} against Kubernetes {version}: {}",
                manifest.display(),
                text(&out)
            );
        }
    }
    // The check can fail: the sidecar example with one field misspelt does.
    let dir = std::env::temp_dir().join(format!("outbox-relay-k8s-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    let broken = dir.join("misspelt.yaml");
    let sidecar = std::fs::read_to_string(examples.join("kubernetes-sidecar.yaml")).unwrap();
    let misspelt = sidecar.replace(
        "terminationGracePeriodSeconds:",
        "terminationGracePeriodSecond:",
    );
    assert_ne!(misspelt, sidecar);
    std::fs::write(&broken, misspelt).unwrap();
    let out = validate_manifest(&broken, KUBERNETES_VERSIONS[0]);
    assert!(
        !out.status.success(),
        "a misspelt field passed: {}",
        text(&out)
    );
    assert!(
        text(&out).contains("terminationGracePeriodSecond"),
        "{}",
        text(&out)
    );
}

/// A relay whose stderr was closed (its log reader went away) loses log lines, nothing
/// else: it still relays, and still stops on SIGTERM. A failed log write used to panic the
/// thread that logged, the signal thread included, and SIGTERM then did nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_whose_stderr_is_closed_still_relays_and_stops_on_sigterm() {
    let (env, addr) = env_with_http(relay()).await;
    let client = env.client().await;
    let mut relay = env
        .command(&["run"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start outbox-relay run");
    drop(relay.stderr.take()); // the reader goes away
    wait_http(&addr, "/readyz", 200, Duration::from_secs(30)).await;
    seed(&client, 50, 5, 0).await;
    wait_for_empty_outbox(&client, "the relay to publish with its stderr closed", 30).await;
    terminate_cleanly(&mut relay);
}

/// The outbox table's dead tuples and the age of the oldest snapshot that holds back
/// VACUUM are gauges. A report's snapshot, opened by another role, is seen once the relay's
/// role has pg_monitor (migrations/outbox_relay_role.sql says so).
#[tokio::test(flavor = "multi_thread")]
async fn the_oldest_snapshot_and_the_tables_dead_tuples_are_gauges() {
    let (env, addr) = env_with_http(relay()).await;
    let owner = env.client().await;
    owner
        .batch_execute("GRANT pg_monitor TO outbox_relay")
        .await
        .unwrap();
    seed(&owner, 200, 5, 0).await;
    let report = env.client().await;
    report
        .batch_execute(
            "SET application_name = 'nightly-report';
             BEGIN ISOLATION LEVEL REPEATABLE READ;
             SELECT count(*) FROM public.outbox",
        )
        .await
        .unwrap();
    let mut relay = env.spawn_run();
    wait_for_empty_outbox(&owner, "the rows to be published", 30).await;
    let gauges = async || {
        let Ok((200, body)) = http_get(&addr, "/metrics") else {
            return false;
        };
        let age = sample(&body, "outbox_relay_oldest_snapshot_age_seconds ").unwrap_or(0.0);
        let dead = sample(
            &body,
            r#"outbox_relay_table_dead_tuples{table="public.outbox"}"#,
        )
        .unwrap_or(0.0);
        age >= 2.0 && dead >= 200.0
    };
    wait_until(
        "the snapshot age and dead tuples gauges",
        Duration::from_secs(30),
        gauges,
    )
    .await;
    report.batch_execute("ROLLBACK").await.unwrap();
    let released = async || scrape(&addr, "outbox_relay_oldest_snapshot_age_seconds ") == Some(0.0);
    wait_until(
        "the gauge to see the report's snapshot gone",
        Duration::from_secs(30),
        released,
    )
    .await;

    // A prepared transaction outlives its session and holds back VACUUM too: both gauges
    // see it, the age counted from PREPARE, the xmin's age in transactions.
    let prepared = env.client().await;
    prepared
        .batch_execute("BEGIN; SELECT txid_current(); PREPARE TRANSACTION 'forgotten'")
        .await
        .unwrap();
    drop(prepared);
    owner
        .batch_execute("SELECT txid_current(); SELECT txid_current()")
        .await
        .unwrap();
    let seen = async || {
        let age = scrape(&addr, "outbox_relay_oldest_snapshot_age_seconds ").unwrap_or(0.0);
        let xids = scrape(&addr, "outbox_relay_oldest_snapshot_xid_age ").unwrap_or(0.0);
        age >= 2.0 && xids >= 2.0
    };
    wait_until(
        "the gauges to see the prepared transaction",
        Duration::from_secs(30),
        seen,
    )
    .await;
    owner
        .batch_execute("ROLLBACK PREPARED 'forgotten'")
        .await
        .unwrap();
    terminate_cleanly(&mut relay);
}

/// Cumulative counts of the delivery-lag histogram: (le, count) in the order printed.
fn lag_buckets(addr: &str) -> Vec<(f64, f64)> {
    let Ok((200, body)) = http_get(addr, "/metrics") else {
        return Vec::new();
    };
    body.lines()
        .filter(|l| l.starts_with("outbox_relay_delivery_lag_seconds_bucket{"))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// Rows counted in buckets up to `le` (the largest bucket bound not above it).
fn lag_at_most(buckets: &[(f64, f64)], le: f64) -> f64 {
    buckets
        .iter()
        .filter(|(bound, _)| *bound <= le)
        .map(|(_, n)| *n)
        .fold(0.0, f64::max)
}

#[tokio::test(flavor = "multi_thread")]
async fn delivery_lag_is_observed_from_created_at_to_the_ack_once_per_row_not_for_replays() {
    let (env, addr) = env_with_http(relay().on_publish("mark")).await;
    let client = env.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload, created_at)
             SELECT 'events.0', 'k' || (n % 3), 'x',
                    CASE WHEN n <= 10 THEN now() - interval '90 seconds' ELSE now() END
             FROM generate_series(1, 20) n",
        )
        .await
        .unwrap();
    let mut relay = env.spawn_run();
    wait_until("every row observed", Duration::from_secs(30), async || {
        scrape(&addr, "outbox_relay_delivery_lag_seconds_count") == Some(20.0)
    })
    .await;
    let buckets = lag_buckets(&addr);
    // Fresh rows within a few seconds; the 90-second-old ones above 65 s, below 132 s.
    assert_eq!(lag_at_most(&buckets, 8.2), 10.0, "{buckets:?}");
    assert_eq!(lag_at_most(&buckets, 65.6), 10.0, "{buckets:?}");
    assert_eq!(lag_at_most(&buckets, 131.1), 20.0, "{buckets:?}");

    // Replayed rows are published again but are no delivery lag.
    let out = env.relay(&["replay", "--since", "1h"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("replayed 20"), "{}", text(&out));
    wait_until(
        "the replayed rows published",
        Duration::from_secs(30),
        async || {
            count(
                &client,
                "SELECT count(*) FROM public.outbox WHERE published_at IS NULL",
            )
            .await
                == 0
                && scrape(&addr, "outbox_relay_rows_published_total") == Some(40.0)
        },
    )
    .await;
    assert_eq!(
        scrape(&addr, "outbox_relay_delivery_lag_seconds_count"),
        Some(20.0)
    );
    // They are counted as replayed instead, each once.
    assert_eq!(
        scrape(&addr, "outbox_relay_rows_replayed_total"),
        Some(20.0)
    );
    terminate_cleanly(&mut relay);
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_waiting_to_retry_are_a_gauge_that_follows_the_table() {
    let (env, addr) = env_with_http(relay().retry_backoff("1h").retry_backoff_max("1h")).await;
    let client = env.client().await;
    let waiting = r#"outbox_relay_rows_waiting_retry{table="public.outbox"}"#;
    // Two rows at fault (headers that are not an object), one good row.
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload, headers) VALUES \
             ('events.x', 'bad1', 'p', '[1]'), ('events.x', 'bad2', 'p', '[2]'), \
             ('events.x', 'good', 'p', NULL)",
        )
        .await
        .unwrap();
    let mut relay = env.spawn_run();
    wait_until(
        "both failed rows counted as waiting",
        Duration::from_secs(30),
        async || scrape(&addr, waiting) == Some(2.0),
    )
    .await;
    assert_eq!(scrape(&addr, "outbox_relay_rows_failed_total"), Some(2.0));
    assert_eq!(
        scrape(&addr, "outbox_relay_rows_published_total"),
        Some(1.0)
    );
    assert_eq!(
        scrape(&addr, "outbox_relay_rows_replayed_total"),
        Some(0.0),
        "nothing replayed"
    );

    client
        .batch_execute("DELETE FROM public.outbox WHERE key = 'bad1'")
        .await
        .unwrap();
    wait_until(
        "the gauge to follow a deleted row",
        Duration::from_secs(30),
        async || scrape(&addr, waiting) == Some(1.0),
    )
    .await;
    terminate_cleanly(&mut relay);
}

/// SIGTERM, then expect exit 0 within 15 s; the relay's log in the message otherwise.
fn stop_logged(relay: &mut std::process::Child, log: &std::path::Path) {
    signal(relay.id(), Signal::Term);
    let (code, _) = wait_exit(relay, Duration::from_secs(15));
    let log = std::fs::read_to_string(log).unwrap_or_default();
    assert_eq!(code, Some(0), "{log}");
}

/// Inserts one row every 10 ms over 10 keys until `stop`; returns the ids inserted.
fn spawn_writer(
    client: tokio_postgres::Client,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Vec<i64>> {
    tokio::spawn(async move {
        let mut ids = Vec::new();
        let mut n = 0;
        while !stop.is_cancelled() {
            let row = client
                .query_one(
                    "INSERT INTO public.outbox (topic, key, payload) \
                     VALUES ('events.w', 'k' || ($1::int % 10), 'w') RETURNING id",
                    &[&n],
                )
                .await
                .unwrap();
            ids.push(row.get(0));
            n += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ids
    })
}

/// Contract sections 3 and 9: `pause` stops every relay of the table within about a
/// second (two processes here, one restarted while paused), shows in `status`, the
/// `outbox_relay_table_paused` gauge and an INFO line; `resume` brings every row, once and
/// in key order.
#[tokio::test(flavor = "multi_thread")]
async fn pause_stops_every_relay_of_the_table_within_a_second_until_resume() {
    let (env, addr) = env_with_http(relay()).await;
    let log = env.config.with_file_name("relay-a.stderr");
    let spawn = |http: Option<u16>, log: &std::path::Path| {
        let mut command = env.command(&["run"]);
        if let Some(port) = http {
            command.env("OUTBOX_RELAY__HTTP__LISTEN", format!("127.0.0.1:{port}"));
        }
        command
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap()
    };
    let mut a = spawn(None, &log);
    let other_log = env.config.with_file_name("relay-b.stderr");
    let b_port = testkit::free_port();
    let mut b = spawn(Some(b_port), &other_log);
    wait_http(&addr, "/readyz", 200, Duration::from_secs(20)).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = spawn_writer(env.client().await, stop.clone());
    wait_until("rows flowing", Duration::from_secs(10), async || {
        env.stored().await.len() > 20
    })
    .await;

    let paused_at = std::time::SystemTime::now();
    let out = env.relay(&["pause", "--reason", "consumer maintenance"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("public.outbox: paused"),
        "{}",
        text(&out)
    );
    // Rows keep coming; after a second and a half none is published any more.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let settled = env.stored().await;
    let last = settled.iter().map(|m| m.stored_at).max().unwrap();
    let after_pause = last.duration_since(paused_at).unwrap_or_default();
    eprintln!("the last row was published {after_pause:?} after `pause` started");
    assert!(
        after_pause < Duration::from_millis(1200),
        "a row was published {after_pause:?} after the pause"
    );
    // A relay restarted while the table is paused does not claim it either: once it is
    // ready (its workers started after it read the pause state), it publishes nothing
    // for 2.5 s, while the writer keeps adding rows.
    stop_logged(&mut b, &other_log);
    let mut b = spawn(Some(b_port), &other_log);
    let b_addr = format!("127.0.0.1:{b_port}");
    wait_http(&b_addr, "/readyz", 200, Duration::from_secs(20)).await;
    let pending_then = count(&env.client().await, "SELECT count(*) FROM public.outbox").await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        env.stored().await.len(),
        settled.len(),
        "published while paused, by the relay restarted while paused: {}",
        std::fs::read_to_string(&other_log).unwrap_or_default()
    );
    assert!(
        count(&env.client().await, "SELECT count(*) FROM public.outbox").await > pending_then,
        "the writer kept writing while relay b watched"
    );
    let gauge = r#"outbox_relay_table_paused{table="public.outbox"}"#;
    assert_eq!(scrape(&addr, gauge), Some(1.0));
    let status = text(&env.relay(&["status"]));
    assert!(
        status.contains("PAUSED: paused since") && status.contains(": consumer maintenance"),
        "{status}"
    );

    let out = env.relay(&["resume"]);
    assert!(
        text(&out).contains("public.outbox: resumed (was paused since"),
        "{}",
        text(&out)
    );
    stop.cancel();
    let inserted = writer.await.unwrap();
    wait_until(
        "every row after the resume",
        Duration::from_secs(20),
        async || env.stored().await.len() >= inserted.len(),
    )
    .await;
    let audit = audit(&inserted, &env.stored().await);
    audit.assert_nothing_lost_in_order();
    assert_eq!(audit.duplicates, 0);
    wait_until("the gauge to fall", Duration::from_secs(5), async || {
        scrape(&addr, gauge) == Some(0.0)
    })
    .await;
    stop_logged(&mut a, &log);
    stop_logged(&mut b, &other_log);
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("Table paused") && log.contains("consumer maintenance"),
        "{log}"
    );
    assert!(log.contains("Table resumed"), "{log}");
}

/// Contract section 3: `drain` does not wait for a paused table; it names it and exits 3
/// while its rows remain, 0 once none are left; the rows stay untouched.
#[tokio::test(flavor = "multi_thread")]
async fn drain_does_not_wait_for_a_paused_table_and_exits_3_while_its_rows_remain() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    assert!(env.relay(&["pause"]).status.success());
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "nothing left: {}", text(&out));

    seed(&client, 50, 5, 0).await;
    let started = Instant::now();
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "drain waited {:?} for a paused table",
        started.elapsed()
    );
    assert!(
        text(&out).contains("public.outbox: paused since"),
        "{}",
        text(&out)
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        50
    );
    assert!(env.stored().await.is_empty(), "published while paused");

    assert!(env.relay(&["resume"]).status.success());
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(env.stored().await.len(), 50);
}

/// Contract section 3: `status --format json` prints one JSON document `{"tables": [...]}`
/// with the contract's fields, each counted apart: a table seeded with 7 pending rows (3
/// of them failing, 2 of those waiting for a retry), 4 held back, 1 dead, 5 kept as
/// published and its oldest pending row an hour old shows exactly these numbers and the
/// held rows, oldest first; the pause fields appear while paused.
#[tokio::test(flavor = "multi_thread")]
async fn status_as_json_is_one_document_with_the_contract_fields() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    // Key a: a dead row holding back two; key b: a row waiting an hour for its retry,
    // holding back two; key c: one waiting two hours, holding back none; key d: a failed
    // row due again (failing, not waiting); five published rows.
    let seeded: Vec<i64> = column(
        &client,
        "INSERT INTO public.outbox \
           (topic, key, payload, created_at, attempts, last_error, dead_at, next_attempt_at, \
            published_at) VALUES \
           ('events.a', 'a', 'x', now() - interval '2 hours', 5, 'dead a', \
            now() - interval '10 minutes', NULL, NULL), \
           ('events.a', 'a', 'x', now() - interval '1 hour', 0, NULL, NULL, NULL, NULL), \
           ('events.a', 'a', 'x', now(), 0, NULL, NULL, NULL, NULL), \
           ('events.b', 'b', 'x', now(), 2, 'timeout b', NULL, now() + interval '1 hour', NULL), \
           ('events.b', 'b', 'x', now(), 0, NULL, NULL, NULL, NULL), \
           ('events.b', 'b', 'x', now(), 0, NULL, NULL, NULL, NULL), \
           ('events.c', 'c', 'x', now(), 1, 'timeout c', NULL, now() + interval '2 hours', NULL), \
           ('events.d', 'd', 'x', now(), 3, 'timeout d', NULL, now() - interval '1 minute', NULL) \
         RETURNING id",
        &[],
    )
    .await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload, published_at) \
             SELECT 'events.p', NULL, 'x', now() FROM generate_series(1, 5); \
             UPDATE public.outbox SET dead_at = dead_at, next_attempt_at = next_attempt_at \
             WHERE dead_at IS NOT NULL OR next_attempt_at IS NOT NULL",
        )
        .await
        .unwrap();
    // The failed rows above are written as a relay writes them, by UPDATE (the last
    // statement), which gives each its row in outbox_relay_held.
    assert!(env
        .relay(&["pause", "--reason", "broker upgrade"])
        .status
        .success());
    let parse = |out: std::process::Output| -> serde_json::Value {
        assert!(out.status.success(), "{}", text(&out));
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert_eq!(stdout.lines().count(), 1, "one document: {stdout}");
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    };
    let doc = parse(env.relay(&["status", "--format", "json"]));
    let t = &doc["tables"][0];
    assert_eq!(t["table"], "public.outbox", "{doc}");
    for (field, value) in [
        ("pending", 7),
        ("failing", 3),
        ("waiting_retry", 2),
        ("held_back", 4),
        ("dead", 1),
        ("published", 5),
    ] {
        assert_eq!(t[field], value, "{field}: {doc}");
    }
    let age = t["oldest_pending_age_seconds"].as_f64().unwrap();
    assert!(
        (3_600.0..3_660.0).contains(&age),
        "oldest pending age {age}: {doc}"
    );
    let held = t["held_rows"].as_array().unwrap();
    let shown: Vec<_> = held
        .iter()
        .map(|r| {
            (
                r["id"].as_i64().unwrap(),
                r["attempts"].as_i64().unwrap(),
                r["key"].as_str().unwrap(),
                r["holds_back"].as_i64().unwrap(),
                r["last_error"].as_str().unwrap(),
                r["dead_at"].is_string(),
                r["next_attempt_at"].is_string(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            (seeded[0], 5, "a", 2, "dead a", true, false),
            (seeded[3], 2, "b", 2, "timeout b", false, true),
            (seeded[6], 1, "c", 0, "timeout c", false, true),
        ],
        "held rows: {doc}"
    );
    // The next attempt due is key b's, an hour away.
    assert_eq!(t["next_attempt_at"], held[1]["next_attempt_at"], "{doc}");
    assert_eq!(t["paused"], true, "{doc}");
    assert_eq!(t["paused_reason"], "broker upgrade", "{doc}");
    assert!(t["paused_at"].as_str().unwrap().starts_with("20"), "{doc}");

    assert!(env.relay(&["resume"]).status.success());
    let doc = parse(env.relay(&["status", "--format", "json"]));
    let t = &doc["tables"][0];
    assert_eq!(t["paused"], false, "{doc}");
    assert!(t.get("paused_reason").is_none(), "{doc}");
    let out = env.relay(&["status", "--format", "yaml"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}
