//! The monitoring files in `config/`: the Prometheus alert rules pass `promtool check
//! rules` and their unit tests (`promtool test rules`), the Grafana dashboard's queries are
//! valid PromQL, and every metric either names is one the relay really serves, with the
//! type its suffix implies.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;

const RULES: &str = "config/prometheus/outbox-relay.rules.yml";
const RULE_TESTS: &str = "config/prometheus/outbox-relay.rules.test.yml";
const DASHBOARD: &str = "config/grafana/outbox-relay.dashboard.json";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Runs `promtool`, which `scripts/install-deps` installs (Debian package `prometheus`).
fn promtool(args: &[&str]) -> std::process::Output {
    Command::new("promtool")
        .args(args)
        .output_within(RUN_LIMIT)
        .unwrap_or_else(|e| {
            panic!("cannot run promtool ({e}): scripts/install-deps installs it (Debian package prometheus)")
        })
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let check = promtool(&["check", "rules", repo(RULES).to_str().unwrap()]);
    assert!(check.status.success(), "{}", text(&check));
    assert!(
        text(&check).contains("SUCCESS: 11 rules found"),
        "{}",
        text(&check)
    );
    let tests = promtool(&["test", "rules", repo(RULE_TESTS).to_str().unwrap()]);
    assert!(tests.status.success(), "{}", text(&tests));
}

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(repo(DASHBOARD)).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every query of the dashboard's panels.
fn dashboard_queries(dashboard: &serde_json::Value) -> Vec<String> {
    dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| {
            t["expr"]
                .as_str()
                .expect("a target with an expr")
                .to_owned()
        })
        .collect()
}

#[test]
fn the_dashboard_is_well_formed_and_its_queries_are_valid_promql() {
    let d = dashboard();
    let panels = d["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    for p in panels {
        assert!(
            ids.insert(p["id"].as_i64().unwrap()),
            "panel ids are unique"
        );
        let grid = &p["gridPos"];
        let (x, w) = (grid["x"].as_i64().unwrap(), grid["w"].as_i64().unwrap());
        assert!(x + w <= 24, "panel {} fits the 24-column grid", p["title"]);
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{} has a query", p["title"]);
    }
    let variables: BTreeSet<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        variables,
        BTreeSet::from(["datasource", "instance", "table"])
    );

    // promtool parses PromQL in rule files: each query as a recording rule, with
    // Grafana's variables replaced as Grafana would.
    let queries = dashboard_queries(&d);
    assert!(queries.len() >= 15, "{} queries", queries.len());
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, q) in queries.iter().enumerate() {
        for var in ["$instance", "$table"] {
            assert!(
                !q.contains(var) || variables.contains(&var[1..]),
                "{q} uses an undefined variable"
            );
        }
        let q = q
            .replace("$__rate_interval", "5m")
            .replace("$instance", ".*")
            .replace("$table", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query{i}\n        expr: '{}'\n",
            q.replace('\'', "''")
        ));
    }
    let dir = std::env::temp_dir().join(format!("outbox-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("dashboard.rules.yml");
    std::fs::write(&file, rules).unwrap();
    let check = promtool(&["check", "rules", file.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(check.status.success(), "{}", text(&check));
}

/// `outbox_relay_*` names in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("outbox_relay_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// A name as queried -> the family it belongs to and the type its suffix implies.
fn family(name: &str) -> (&str, &str) {
    for (suffix, kind) in [
        ("_total", "counter"),
        ("_bucket", "histogram"),
        ("_sum", "histogram"),
        ("_count", "histogram"),
    ] {
        if let Some(base) = name.strip_suffix(suffix) {
            return (base, kind);
        }
    }
    (name, "gauge")
}

/// `# TYPE <family> <type>` lines of a scrape. A family shows once it has a sample.
fn types(scrape: &str) -> HashMap<String, String> {
    scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_metric_the_rules_and_dashboard_use_is_served_by_the_relay() {
    let rules = std::fs::read_to_string(repo(RULES)).unwrap();
    let used: BTreeSet<String> = metric_names(&rules)
        .into_iter()
        .chain(
            dashboard_queries(&dashboard())
                .iter()
                .flat_map(|q| metric_names(q)),
        )
        .collect();
    assert!(used.len() >= 15, "{used:?}");

    // Mark mode with a retention, so that every family gets a sample: a published row
    // (counters, histograms, lag), a retention pass, the probe's gauges.
    let relay_settings = relay().on_publish("mark").retention("1s");
    let env = Env::new(relay_settings.clone()).await;
    let addr = format!("127.0.0.1:{}", testkit::free_port());
    env.write_config(&relay_settings.http(&addr));
    env.client()
        .await
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.a', 'k', 'x')",
        )
        .await
        .unwrap();
    let mut relay = env.spawn_run();
    let mut served = String::new();
    let missing = |served: &str| -> Vec<String> {
        let types = types(served);
        used.iter()
            .filter(|name| {
                let (base, kind) = family(name);
                types.get(base).map(String::as_str) != Some(kind)
            })
            .cloned()
            .collect()
    };
    // Not a failure of its own when it times out: the assertion below names what is missing.
    poll(Duration::from_secs(30), async || {
        if let Ok((200, body)) = http_get(&addr, "/metrics") {
            served = body;
        }
        missing(&served).is_empty().then_some(())
    })
    .await;
    terminate_cleanly(&mut relay);
    assert_eq!(
        missing(&served),
        Vec::<String>::new(),
        "used in config/ but not served by the relay with the type the name implies \
         (counter: _total, histogram: _bucket/_sum/_count, else gauge):\n{served}"
    );
}
