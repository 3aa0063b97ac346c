//! Behind PgBouncer in transaction pooling, with PgBouncer's default settings (no
//! `ignore_startup_parameters`; 1.18 keeps no prepared statement across transactions):
//! the relay's session settings travel per transaction, and every promise still holds.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;
use testkit::PgBouncer;

/// Points `cmd` at the bouncer, as the relay's role, with statements prepared afresh in
/// each transaction (what PgBouncer before 1.21 needs).
fn through(bouncer: &PgBouncer, mut cmd: Command) -> Command {
    cmd.env(
        "OUTBOX_RELAY__POSTGRES__URL",
        bouncer.url("outbox_relay", "app"),
    )
    .env("OUTBOX_RELAY__POSTGRES__PREPARED_STATEMENTS", "false");
    cmd
}

async fn pending(client: &tokio_postgres::Client) -> i64 {
    count(client, "SELECT count(*) FROM public.outbox").await
}

/// A source of the relay's config pointed at `url` (PgBouncer, or a proxy in front of it),
/// with `extra` lines in `[postgres]`. Its statements are unnamed (`prepared_statements =
/// false`), as a deployment behind PgBouncer 1.18 must run: with statements cached, a
/// transaction given another server connection by PgBouncer met "prepared statement does
/// not exist" (a test of this file failed that way now and then).
async fn pooled_source(env: &Env, url: &str, extra: &str) -> outbox_relay::source::Source {
    let settings = format!("pool_size = 16\nprepared_statements = false\n{extra}");
    let text = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace(&as_relay_role(&env.db_url), url)
        .replace("pool_size = 16", &settings);
    assert!(text.contains(&settings), "no pool_size line to add to");
    let config = outbox_relay::config::from_str(&text, |_| None, Vec::new()).unwrap();
    let limits =
        outbox_relay::source::SessionLimits::relay(&config.postgres, config.sink.publish_timeout);
    let source = outbox_relay::source::Source::open(&config.postgres, limits)
        .await
        .unwrap();
    assert_eq!(
        source.mode(),
        outbox_relay::source::SessionMode::Pooled,
        "the refused start-up options were noticed"
    );
    source
}

#[tokio::test(flavor = "multi_thread")]
async fn session_deadlines_hold_per_transaction_through_pgbouncer_and_do_not_leak() {
    let env = Env::new(relay()).await;
    let bouncer = PgBouncer::start(&env.pg).unwrap();
    let source = pooled_source(&env, &bouncer.url("outbox_relay", "app"), "").await;
    let shown = source
        .in_transaction(async |tx| {
            let mut shown = Vec::new();
            for name in [
                "statement_timeout",
                "lock_timeout",
                "idle_in_transaction_session_timeout",
                "jit",
            ] {
                let row = tx.query_one(&format!("SHOW {name}"), &[]).await?;
                shown.push(row.get::<_, String>(0));
            }
            Ok(shown)
        })
        .await
        .unwrap();
    assert_eq!(shown, ["30s", "5s", "15s", "off"]);
    // SET LOCAL ends with the transaction: the server session, which the pooler hands to
    // other clients next, keeps its defaults.
    let other = bouncer.connect("outbox_relay", "app").await.unwrap();
    for _ in 0..5 {
        let rows = other.simple_query("SHOW statement_timeout").await.unwrap();
        let value = rows.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        });
        assert_eq!(value.as_deref(), Some("0"));
    }
}

/// Behind a pooler each transaction sets its deadlines with `SET LOCAL`. They go out
/// with `BEGIN` and the first statement, whose answer is read after theirs: a transaction
/// of one statement and its commit waits 2 round trips (it waited 3 when the settings
/// were waited for on their own), its first statement already runs under them, and a
/// setting the server refuses is the error reported, not the aborted transaction the
/// statement met. Counted through `testkit::Proxy` in front of PgBouncer.
#[tokio::test(flavor = "multi_thread")]
async fn behind_pgbouncer_the_settings_go_with_the_first_statement_and_a_refused_one_is_reported() {
    use outbox_relay::source::Source;
    let env = Env::new(relay()).await;
    let bouncer = PgBouncer::start(&env.pg).unwrap();
    let proxy = testkit::Proxy::start(([127, 0, 0, 1], bouncer.port()).into()).unwrap();
    let through_proxy = bouncer.url("outbox_relay", "app").replace(
        &format!(":{}/", bouncer.port()),
        &format!(":{}/", proxy.port()),
    );
    let show = async |source: &Source| {
        source
            .in_transaction(async |tx| {
                let row = tx.query_one("SHOW statement_timeout", &[]).await?;
                Ok(row.get::<_, String>(0))
            })
            .await
    };
    // Unnamed statements (see `pooled_source`): with statements cached, the last `show`
    // below failed now and then, when PgBouncer gave its transaction the server connection
    // the refused source had used.
    let source = pooled_source(&env, &through_proxy, "").await;
    // The statement's first use learns its parameter types: not counted.
    assert_eq!(show(&source).await.unwrap(), "30s");
    proxy.set(testkit::Fault::Latency(Duration::from_millis(20)));
    let before = proxy.round_trips();
    let shown = show(&source).await.unwrap();
    let waited = proxy.round_trips() - before;
    proxy.set(testkit::Fault::None);
    assert_eq!(shown, "30s", "the first statement runs under the settings");
    assert_eq!(
        waited, 2,
        "round trips of BEGIN, the settings, a statement and COMMIT"
    );

    // 30 days is more than PostgreSQL's statement_timeout can hold: SET LOCAL fails.
    let refused = pooled_source(&env, &through_proxy, "statement_timeout = \"30d\"").await;
    let error = show(&refused).await.unwrap_err().to_string();
    assert!(
        error.contains("statement_timeout") && !error.contains("aborted"),
        "the refused setting is the error, got: {error}"
    );
    // The session is usable afterwards (its transaction was rolled back).
    assert_eq!(show(&source).await.unwrap(), "30s");
}

#[tokio::test(flavor = "multi_thread")]
async fn three_drains_through_pgbouncer_deliver_every_row_once_in_key_order() {
    let env = Env::new(relay().workers(4).batch_size(40)).await;
    let bouncer = PgBouncer::start(&env.pg).unwrap();
    let client = env.client().await;
    seed(&client, 6_000, 20, 11).await;
    let inserted = ids(&client).await;

    all_exit_0(
        3,
        |_| through(&bouncer, env.command(&["drain", "--timeout", "120s"])),
        Duration::from_secs(130),
        || bouncer.log(),
    );
    let audit = audit(&inserted, &env.stored().await);
    audit.assert_nothing_lost_in_order();
    assert_eq!(pending(&client).await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_through_pgbouncer_loses_nothing_and_keeps_key_order() {
    let env = Env::new(relay().workers(4).batch_size(200)).await;
    let bouncer = PgBouncer::start(&env.pg).unwrap();
    let client = env.client().await;
    seed(&client, 20_000, 100, 20).await;
    let inserted = ids(&client).await;

    for _ in 0..3 {
        let before = pending(&client).await;
        let mut relay = through(&bouncer, env.command(&["run"]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Killed once rows flow, however fast the relay is (no fixed sleep).
        wait_until("rows to flow", Duration::from_secs(30), async || {
            pending(&client).await < before
        })
        .await;
        relay.kill().unwrap(); // SIGKILL: no drain, no rollback from the client side
        relay.wait().unwrap();
        let left = pending(&client).await;
        assert!(
            0 < left && left < before,
            "each kill must land mid-stream: {left} rows left of {before}"
        );
    }
    let out = through(&bouncer, env.command(&["drain", "--timeout", "60s"]))
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();
    assert_eq!(pending(&client).await, 0);
}

/// Behind PgBouncer in transaction mode, with `listen_url` a NOTIFY wakes an idle relay
/// within 1 s, long before its 30 s poll; without it the relay says once that it cannot
/// LISTEN and polls, and a row is published within 1 s at the 100 ms poll. Either way the
/// rows commit early, half-way and late in the idle cycle (`common::wake`), where the
/// relay's 5 s idle look is at least 1.5 s away: only the wake-up named publishes them in
/// time.
#[tokio::test(flavor = "multi_thread")]
async fn behind_pgbouncer_listen_url_wakes_an_idle_relay_and_without_it_the_relay_polls() {
    let env = Env::new(relay().poll_interval("30s")).await;
    let bouncer = PgBouncer::start(&env.pg).unwrap();
    let client = env.client().await;
    let log = env.config.with_file_name("relay.stderr");

    // With a direct connection for LISTEN, a commit wakes the idle relay at once, long
    // before its 30 s poll.
    let mut relay = through(&bouncer, env.command(&["run"]))
        .env(
            "OUTBOX_RELAY__POSTGRES__LISTEN_URL",
            as_relay_role(&env.db_url),
        )
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    wait_until("the LISTEN session", Duration::from_secs(10), async || {
        count(
            &client,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' AND query LIKE 'LISTEN%'",
        )
        .await
            > 0
    })
    .await;
    woken_at_every_idle_point(&client, &["public.outbox"], log_of(&log)).await;
    terminate_cleanly(&mut relay);

    // Without it the relay says, once, that it polls, and it does.
    env.write_config(&Relay::default().poll_interval("100ms"));
    let mut relay = through(&bouncer, env.command(&["run"]))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    woken_at_every_idle_point(&client, &["public.outbox"], log_of(&log)).await;
    terminate_cleanly(&mut relay);
    let log = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        log.matches("cannot keep a LISTEN").count(),
        1,
        "said once: {log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn check_through_pgbouncer_names_what_the_pooler_needs_and_migrate_refuses_it() {
    let env = Env::new(relay()).await;
    let bouncer = PgBouncer::start(&env.pg).unwrap();

    let out = through(&bouncer, env.command(&["check"]))
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("pooler in transaction mode"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("postgres.listen_url"), "{}", text(&out));

    let out = through(&bouncer, env.command(&["check"]))
        .env("OUTBOX_RELAY__POSTGRES__PREPARED_STATEMENTS", "true")
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("set postgres.prepared_statements = false"),
        "{}",
        text(&out)
    );

    let out = env
        .command(&["migrate"])
        .env(
            "OUTBOX_RELAY__POSTGRES__URL",
            bouncer.url("postgres", "app"),
        )
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("migrate needs a session of its own"),
        "{}",
        text(&out)
    );
}

/// The statements every server connection of the (app, outbox_relay) pool holds: `pool`
/// transactions opened at once through the bouncer, so each gets a server connection of
/// its own, each listing `pg_prepared_statements`.
async fn statements_left_on_servers(bouncer: &PgBouncer, pool: usize) -> Vec<String> {
    let mut clients = Vec::new();
    for _ in 0..pool {
        let client = bouncer.connect("outbox_relay", "app").await.unwrap();
        client.batch_execute("BEGIN").await.unwrap();
        clients.push(client);
    }
    let mut names = Vec::new();
    for client in &clients {
        for m in client
            .simple_query("SELECT name || ': ' || statement FROM pg_prepared_statements")
            .await
            .unwrap()
        {
            if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                names.push(r.get(0).unwrap().to_owned());
            }
        }
    }
    for client in &clients {
        client.batch_execute("COMMIT").await.unwrap();
    }
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn behind_pgbouncer_no_prepared_statement_outlives_its_transaction() {
    // A later relay process numbers its statements from s0 again: one left on a server
    // connection fails that process's batch with "prepared statement already exists".
    let env = Env::new(relay().workers(4).batch_size(50)).await;
    let pool = 4;
    let options = testkit::PgBouncerOptions {
        pool_size: Some(pool as u32),
        ..Default::default()
    };
    let bouncer = PgBouncer::start_with(&env.pg, &options).unwrap();
    let client = env.client().await;
    seed(&client, 3_000, 20, 7).await;
    let out = through(&bouncer, env.command(&["drain", "--timeout", "60s"]))
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let left = statements_left_on_servers(&bouncer, pool).await;
    assert!(
        left.is_empty(),
        "statements left on the pooler's server connections: {left:?}"
    );
}
