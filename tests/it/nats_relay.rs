//! The contract's promises, end to end: the built binary against a throwaway PostgreSQL
//! and a real `nats-server -js`.

use std::collections::HashSet;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use outbox_relay::source::migrate::MIGRATIONS;

#[tokio::test(flavor = "multi_thread")]
async fn every_row_is_delivered_once_with_its_nats_msg_id() {
    let env = Env::new(relay().workers(4).batch_size(200)).await;
    let client = env.client().await;
    seed(&client, 3_000, 50, 7).await;
    let before = ids(&client).await;
    let sent = watch_sends(&env.nats).await;

    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // Counted as sent, not as stored (the stream would hide a re-send).
    assert_each_sent_once(&before, &sends_so_far(&env.nats, &sent).await);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("drained: 3000 rows published"),
        "{}",
        text(&out)
    );

    let stored = env.stored().await;
    let delivery = analyse(&stored);
    assert_eq!(stored.len(), 3_000, "each row stored exactly once");
    let expected: HashSet<String> = before
        .iter()
        .map(|id| format!("public.outbox:{id}"))
        .collect();
    let got: HashSet<String> = delivery.counts.keys().cloned().collect();
    assert_eq!(got, expected, "Nats-Msg-Id is <table>:<id> for every row");
    for m in &stored {
        // Headers come from the column, the payload is the row's bytes.
        let n = m.header("n").expect("header from the headers column");
        assert_eq!(m.payload, n.as_bytes());
        assert!(m.subject.starts_with("events."));
    }
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        0,
        "delete mode empties the table"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn mark_mode_keeps_rows_and_sets_published_at() {
    let env = Env::new(relay().on_publish("mark")).await;
    let client = env.client().await;
    seed(&client, 1_000, 10, 0).await;
    let inserted = ids(&client).await;
    let sent = watch_sends(&env.nats).await;

    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        1_000
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM public.outbox WHERE published_at IS NULL"
        )
        .await,
        0,
        "every row marked"
    );
    assert_eq!(env.stored().await.len(), 1_000);
    assert_each_sent_once(&inserted, &sends_so_far(&env.nats, &sent).await);
    // A second drain finds nothing to do and sends nothing again.
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("drained: 0 rows published"),
        "{}",
        text(&out)
    );
    assert_each_sent_once(&inserted, &sends_so_far(&env.nats, &sent).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn same_key_rows_arrive_in_id_order_across_workers_and_processes() {
    let env = Env::new(relay().workers(6).batch_size(40)).await;
    let client = env.client().await;
    seed(&client, 6_000, 20, 11).await;
    let inserted = ids(&client).await;
    let sent = watch_sends(&env.nats).await;

    // Three processes of six workers each, all on the same table at once; one of them
    // prepares every statement afresh (postgres.prepared_statements = false, as behind an
    // old PgBouncer), the others keep them prepared.
    all_exit_0(
        3,
        |i| {
            let mut drain = env.command(&["drain", "--timeout", "60s"]);
            drain.env(
                "OUTBOX_RELAY__POSTGRES__PREPARED_STATEMENTS",
                if i == 0 { "false" } else { "true" },
            );
            drain
        },
        Duration::from_secs(120),
        String::new,
    );

    // Row locks keep the processes apart: no row is sent twice.
    assert_each_sent_once(&inserted, &sends_so_far(&env.nats, &sent).await);
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 6_000, "no row lost");
    assert_eq!(
        delivery.order_violations(),
        Vec::<String>::new(),
        "per-key id order"
    );
    assert_eq!(delivery.by_key.len(), 20);
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_committed_after_later_ids_is_still_published() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    // A long transaction takes an id first and commits last.
    let mut late = env.client().await;
    let tx = late.transaction().await.unwrap();
    let late_id: i64 = tx
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.late', NULL, 'late') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    seed(&client, 500, 5, 0).await;

    let mut relay = env
        .command(&["run"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_empty_outbox(&client, "the committed rows to be published", 30).await;
    tx.commit().await.unwrap();
    wait_for_empty_outbox(&client, "the late row to be published", 30).await;
    terminate_cleanly(&mut relay);

    let delivery = analyse(&env.stored().await);
    assert!(delivery
        .counts
        .contains_key(&format!("public.outbox:{late_id}")));
    assert_eq!(delivery.counts.len(), 501);
}

#[tokio::test(flavor = "multi_thread")]
async fn drain_exits_3_at_its_timeout_and_leaves_the_rows_intact() {
    // A row that fails waits an hour for its next attempt: the drain cannot finish.
    let env = Env::new(relay().retry_backoff("1h").retry_backoff_max("1h")).await;
    let client = env.client().await;
    seed(&client, 100, 5, 0).await;
    // Headers that are not a JSON object of strings: a bad row, retried after its wait.
    client
        .execute(
            "INSERT INTO public.outbox (topic, key, payload, headers) \
             VALUES ('events.x', 'k1', 'x', '[1]'), ('events.y', 'k1', 'y', NULL)",
            &[],
        )
        .await
        .unwrap();

    let started = Instant::now();
    let out = env.relay(&["drain", "--timeout", "2s"]);
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    // The timeout bounds the whole drain: it rolls back at once, not after drain_timeout.
    assert!(took < Duration::from_secs(4), "took {took:?}");
    assert!(
        text(&out).contains("1 waiting for a retry, the next due in "),
        "drain says what it waited for: {}",
        text(&out)
    );
    let left: Vec<(String, i32)> = client
        .query("SELECT topic, attempts FROM public.outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // The failed row stays with one attempt counted, and its key's later row waits
    // behind it, untouched: the rest went out.
    assert_eq!(
        left,
        [("events.x".to_owned(), 1), ("events.y".to_owned(), 0)],
        "{left:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_a_large_backlog_in_time_and_loses_no_row() {
    let env = Env::new(relay().workers(4)).await;
    let client = env.client().await;
    seed(&client, 200_000, 200, 13).await;
    let before: HashSet<i64> = ids(&client).await.into_iter().collect();
    let sent = watch_sends(&env.nats).await;

    // The relay's log goes to a file (a pipe nobody reads could fill and block its
    // logging), shown if publishing never starts.
    let log = relay_log(&env);
    let mut relay = env
        .command(&["run"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    wait_until(
        Detailed("publishing to start", log_of(&log)),
        Duration::from_secs(30),
        async || count(&client, "SELECT count(*) FROM public.outbox").await < 195_000,
    )
    .await;
    signal(relay.id(), Signal::Term);
    // drain_timeout is 10s in the test config.
    let (code, took) = wait_exit(&mut relay, Duration::from_secs(12));
    // The broker is healthy: the batches in flight finish well within the deadline.
    assert_eq!(code, Some(0), "exit code");
    assert!(took < Duration::from_secs(5), "took {took:?}");

    let left: HashSet<i64> = ids(&client).await.into_iter().collect();
    let delivery = analyse(&env.stored().await);
    let published: HashSet<i64> = delivery
        .counts
        .keys()
        .map(|id| id.rsplit(':').next().unwrap().parse().unwrap())
        .collect();
    assert!(left.len() < before.len(), "something was published");
    for id in &before {
        assert!(left.contains(id) || published.contains(id), "row {id} lost");
    }
    assert!(
        left.is_disjoint(&published),
        "a row both published and left in the table"
    );
    // What was sent is exactly what was published, each once.
    let sends = sends_so_far(&env.nats, &sent).await;
    let counts = send_counts(&sends);
    assert_eq!(counts.len(), published.len());
    assert_eq!(sends.len(), counts.len(), "no row sent twice");
    let idle_in_tx = count(
        &client,
        "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' AND application_name = 'outbox-relay'",
    )
    .await;
    assert_eq!(idle_in_tx, 0);
}

/// A NOTIFY wakes an idle relay within 1 s of the commit, at every point of its idle
/// cycle (`common::wake`): with the poll 30 s away and the idle look at least 1.5 s away,
/// nothing else publishes the row in time. An idle relay exits at once.
#[tokio::test(flavor = "multi_thread")]
async fn notify_wakes_an_idle_relay_at_once() {
    let env = Env::new(relay()).await;
    env.write_config(&relay().poll_interval("30s"));
    let client = env.client().await;
    // Idle and listening (the poll is 30 s away).
    let mut relay = start_connected_relay(&env).await;
    let log = relay_log(&env);
    woken_at_every_idle_point(&client, &["public.outbox"], log_of(&log)).await;
    signal(relay.id(), Signal::Term);
    let (code, took) = wait_exit(&mut relay, Duration::from_secs(5));
    assert_eq!(code, Some(0));
    assert!(
        took < Duration::from_secs(2),
        "idle relay exits at once, took {took:?}"
    );
}

/// Contract section 2 (scheduled publish): a row inserted with `next_attempt_at` in the
/// future is published no earlier than that; its key's later rows wait behind it, in
/// order; other keys do not wait.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_scheduled_with_next_attempt_at_is_published_no_earlier_and_holds_its_key() {
    let env = Env::new(relay()).await;
    env.write_config(&relay());
    let client = env.client().await;
    let mut relay = start_connected_relay(&env).await;
    let due: f64 = client
        .query_one(
            "WITH a AS (INSERT INTO public.outbox (topic, key, payload, next_attempt_at) \
             VALUES ('events.x', 'k', 'scheduled', now() + interval '3 seconds') \
             RETURNING next_attempt_at), \
             b AS (INSERT INTO public.outbox (topic, key, payload) \
             VALUES ('events.x', 'k', 'after'), ('events.x', 'other', 'now')) \
             SELECT extract(epoch FROM next_attempt_at)::float8 FROM a",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let due = std::time::UNIX_EPOCH + Duration::from_secs_f64(due);
    wait_for_empty_outbox(&client, "the scheduled row and its key's next", 15).await;
    let stored = env.stored().await;
    let at = |body: &str| {
        let m = stored.iter().find(|m| m.payload == body.as_bytes());
        m.unwrap_or_else(|| panic!("{body:?} was not published: {stored:?}"))
    };
    let (scheduled, after, other) = (at("scheduled"), at("after"), at("now"));
    assert_eq!(stored.len(), 3, "each row once: {stored:?}");
    assert!(
        scheduled.stored_at >= due,
        "published {:?} before its next_attempt_at",
        due.duration_since(scheduled.stored_at).unwrap_or_default()
    );
    assert!(
        after.sequence > scheduled.sequence,
        "the key's later row waits behind the scheduled one"
    );
    assert!(
        other.stored_at < due,
        "another key does not wait for the scheduled row"
    );
    terminate_cleanly(&mut relay);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bad_row_is_dead_lettered_and_holds_back_its_key() {
    let env = Env::new(relay().max_attempts(3).batch_size(10).retry_backoff("10ms")).await;
    let client = env.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload, headers) VALUES
               ('events.a', 'poison', '1', NULL),
               ('events.a', 'poison', '2', '{\"n\": 2}'),
               ('events.a', 'poison', '3', NULL),
               ('events.a', 'fine', '4', NULL),
               ('bad subject', NULL, '5', NULL),
               ('events.a', 'fine', '6', NULL)",
        )
        .await
        .unwrap();
    let out = env.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "held-back rows are not publishable: {}",
        text(&out)
    );
    let left: Vec<(Vec<u8>, i32, bool, Option<String>)> = client
        .query("SELECT payload, attempts, dead_at IS NOT NULL, last_error FROM public.outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(left.len(), 3, "{left:?}");
    // Row 2: headers not an object of strings -> dead after 3 attempts, error kept.
    assert_eq!(left[0].0, b"2");
    assert_eq!((left[0].1, left[0].2), (3, true));
    assert!(left[0]
        .3
        .as_deref()
        .unwrap()
        .contains("headers must be a JSON object of strings"));
    // Row 3 waits behind it, untouched.
    assert_eq!(
        (left[1].0.as_slice(), left[1].1, left[1].2),
        (&b"3"[..], 0, false)
    );
    // The key-less row with an invalid subject is dead too; its failure held back nothing.
    assert_eq!((left[2].0.as_slice(), left[2].2), (&b"5"[..], true));
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 3, "rows 1, 4 and 6 arrived");

    // `status` shows the backlog and names each dead row with its error.
    let out = env.relay(&["status"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let status = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{status}");
    assert!(
        status.starts_with("public.outbox: 1 pending (oldest "),
        "{status}"
    );
    assert!(
        status
            .contains(", 0 failing, 0 waiting for retry, 1 held back, 2 dead, 0 kept as published"),
        "{status}"
    );
    assert!(status.contains("dead id 2: dead since "), "{status}");
    assert!(
        status.contains(", 3 attempts, holds back 1 later rows of key \"poison\", last error: "),
        "{status}"
    );
    assert!(
        status.contains("headers must be a JSON object of strings"),
        "{status}"
    );

    // The operator fixes row 2 and re-queues it: rows 2 and 3 of its key go out in order.
    client
        .execute(
            "UPDATE public.outbox SET headers = '{\"n\": \"2\"}' WHERE id = 2",
            &[],
        )
        .await
        .unwrap();
    let out = env.relay(&["requeue", "--id", "2", "3"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("public.outbox: requeued 1 dead rows (ids 2)"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("not dead-lettered, left as they are: 3"));
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let ids: Vec<String> = env
        .stored()
        .await
        .iter()
        .map(|m| m.header("Nats-Msg-Id").unwrap().to_owned())
        .collect();
    assert_eq!(
        ids[3..],
        ["public.outbox:2", "public.outbox:3"],
        "after rows 1, 4 and 6"
    );
    let out = env.relay(&["requeue", "--all"]);
    assert!(
        text(&out).contains("requeued 1 dead rows (ids 5)"),
        "{}",
        text(&out)
    );
    let out = env.relay(&["requeue", "--table", "public.nope", "--all"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("--table public.nope: not in the config; configured: public.outbox")
    );
    let out = env.relay(&["requeue"]);
    assert_eq!(out.status.code(), Some(2), "--id or --all is required");
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_is_idempotent_and_no_notify_removes_the_wake_up() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("public.outbox: up to date"));
    let wake_ups = "SELECT count(*) FROM pg_attrdef \
                    WHERE adrelid = 'public.outbox'::regclass \
                      AND pg_get_expr(adbin, adrelid) LIKE '%outbox_relay_nudge(%'";
    assert_eq!(count(&client, wake_ups).await, 1);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM public.outbox_relay_migrations"
        )
        .await,
        MIGRATIONS.len() as i64
    );

    let out = env.migrate(&["--no-notify"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(count(&client, wake_ups).await, 0);
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(count(&client, wake_ups).await, 1);

    // A table dropped since: its ledger rows must not make migrate skip creating it again.
    client
        .execute("DROP TABLE public.outbox", &[])
        .await
        .unwrap();
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        0,
        "the table is back"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn check_passes_when_ready_and_names_each_problem() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    client
        .execute("INSERT INTO public.outbox (topic, key, payload) VALUES ('events.1', 'a', 'x'), ('orphan.1', 'a', 'y')", &[])
        .await
        .unwrap();
    let out = env.relay(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        stdout.contains("ok   subject events.1: stored by stream OUTBOX"),
        "{stdout}"
    );
    assert!(
        stdout.contains("FAIL subject orphan.1: no JetStream stream captures it"),
        "{stdout}"
    );

    client
        .execute("DELETE FROM public.outbox WHERE topic = 'orphan.1'", &[])
        .await
        .unwrap();
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // A stream whose duplicate window is too short for safe re-sends is a warning.
    env.nats
        .create_stream_with_window("SHORT", &["short.>"], Duration::from_secs(30))
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('short.1', 'a', 'x')",
            &[],
        )
        .await
        .unwrap();
    let out = env.relay(&["check"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "a warning is not a failure: {}",
        text(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("WARN stream SHORT: duplicate window is 30s"),
        "{}",
        text(&out)
    );

    // Each change below makes `check` fail (exit 1) naming the problem.
    let check_says = async |sql: &str, says: &str| {
        client.batch_execute(sql).await.unwrap();
        let out = env.relay(&["check"]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(says),
            "{}",
            text(&out)
        );
    };
    // The pause state table: this role must read and write it.
    check_says(
        "REVOKE INSERT ON public.outbox_relay_pauses FROM outbox_relay",
        "cannot read and write \"public\".\"outbox_relay_pauses\"",
    )
    .await;
    check_says(
        "DROP TABLE public.outbox_relay_pauses",
        "(migration 0005) is missing",
    )
    .await;
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));

    check_says(
        "ALTER TABLE public.outbox DROP COLUMN attempts",
        "column attempts (failed attempts) is missing",
    )
    .await;
    // `run` refuses the table too, with the same reason, exit 1.
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("column attempts"),
        "{}",
        text(&out)
    );
}

/// Where [`start_connected_relay`] writes the relay's log.
fn relay_log(env: &Env) -> std::path::PathBuf {
    env.config.with_file_name("relay.stderr")
}

/// Starts `run` (its log in [`relay_log`]) and waits until it is connected to both
/// services and idle: its LISTEN session is up, which the relay opens only after the
/// broker connection.
async fn start_connected_relay(env: &Env) -> Child {
    let mut relay = env
        .command(&["run"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(relay_log(env)).unwrap())
        .spawn()
        .unwrap();
    let client = env.client().await;
    wait_until("the relay to connect", Duration::from_secs(10), async || {
        count(&client, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' AND query LIKE 'LISTEN%'").await > 0
    })
    .await;
    assert!(relay.try_wait().unwrap().is_none(), "relay exited early");
    relay
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_broker_never_holds_a_transaction_past_the_publish_timeout() {
    let env = Env::new(relay()).await;
    env.write_config(&relay().publish_timeout("1s").drain_timeout("10s"));
    let client = env.client().await;
    let mut relay = start_connected_relay(&env).await;
    env.nats.pause();
    seed(&client, 2_000, 20, 0).await;
    wait_until(
        "a batch to be in flight",
        Duration::from_secs(10),
        async || !relay_transactions(&client).await.is_empty(),
    )
    .await;
    // Watch for 4 seconds: no relay transaction may stay open much past 1s.
    let mut longest: f64 = 0.0;
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(4) {
        for age in relay_transactions(&client).await {
            longest = longest.max(age);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        longest < 2.5,
        "a transaction stayed open {longest:.1}s with publish_timeout = 1s"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        2_000,
        "nothing marked without an ack"
    );

    env.nats.resume();
    wait_for_empty_outbox(&client, "the backlog to drain after the broker returns", 60).await;
    terminate_cleanly(&mut relay);
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 2_000);
    assert_eq!(delivery.order_violations(), Vec::<String>::new());
}

/// A running relay (publish_timeout 30s, the given drain_timeout) with a batch of 1,000
/// rows in flight, past its claim, waiting for acks from a frozen nats-server.
async fn relay_stuck_publishing(drain_timeout: &str) -> (Env, tokio_postgres::Client, Child) {
    let env = Env::new(relay()).await;
    env.write_config(&relay().publish_timeout("30s").drain_timeout(drain_timeout));
    let client = env.client().await;
    let relay = start_connected_relay(&env).await;
    env.nats.pause();
    seed(&client, 1_000, 10, 0).await;
    // Past its claim (which a signal may cancel), waiting for acks that cannot come.
    wait_until(
        "a batch to be publishing",
        Duration::from_secs(15),
        async || {
            relay_transactions(&client)
                .await
                .iter()
                .any(|age| *age > 0.5)
        },
    )
    .await;
    (env, client, relay)
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_with_a_stalled_broker_exits_3_at_the_deadline_and_keeps_every_row() {
    let (_env, client, mut relay) = relay_stuck_publishing("2s").await;
    signal(relay.id(), Signal::Term);
    let (code, took) = wait_exit(&mut relay, Duration::from_secs(6));
    assert_eq!(code, Some(3), "deadline reached with rows unacknowledged");
    assert!(
        took < Duration::from_secs(4),
        "exit within drain_timeout + 2s, took {took:?}"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        1_000,
        "every row kept"
    );
    wait_until(
        "the server to end the exited relay's transactions",
        Duration::from_secs(5),
        async || relay_transactions(&client).await.is_empty(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_signal_rolls_back_at_once_and_exits_3() {
    let (env, client, mut relay) = relay_stuck_publishing("60s").await;
    signal(relay.id(), Signal::Term);
    wait_until(
        "the relay to take the first signal",
        Duration::from_secs(5),
        async || {
            std::fs::read_to_string(relay_log(&env))
                .unwrap_or_default()
                .contains("Signal received; finishing in-flight batches")
        },
    )
    .await;
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the first signal waits for in-flight batches"
    );
    signal(relay.id(), Signal::Int);
    let (code, took) = wait_exit(&mut relay, Duration::from_secs(5));
    assert_eq!(code, Some(3));
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        1_000
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ordering_none_delivers_every_row_once() {
    let env = Env::new(relay().ordering("none").workers(4).batch_size(100)).await;
    let client = env.client().await;
    // Two hot keys: with no order promise they need not wait for each other's acks.
    seed(&client, 3_000, 2, 0).await;
    let inserted = ids(&client).await;
    let sent = watch_sends(&env.nats).await;
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_each_sent_once(&inserted, &sends_so_far(&env.nats, &sent).await);
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 3_000);
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_a_null_payload_is_an_empty_body_with_or_without_a_key() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES
               ('events.0', 'a', NULL), ('events.0', NULL, NULL), ('events.0', 'a', 'x')",
        )
        .await
        .unwrap();
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let mut bodies: Vec<Vec<u8>> = env.stored().await.into_iter().map(|m| m.payload).collect();
    bodies.sort();
    assert_eq!(bodies, [b"".to_vec(), b"".to_vec(), b"x".to_vec()]);
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        0
    );
}

/// Starts `run` with its log in `<name>.stderr` beside the config; the child and the path.
fn spawn_named(env: &Env, name: &str) -> (Child, std::path::PathBuf) {
    let log = env.config.with_file_name(format!("{name}.stderr"));
    let relay = env
        .command(&["run"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    (relay, log)
}

/// Contract section 4 (`pause_after_bad_rows`): when a table's destination goes away
/// (here: no stream captures its subjects), the bad-row valve pauses the table after about
/// 100 failures instead of dead-lettering it row after row, and the pause stops every
/// relay of the table (two processes here, both claiming when the rows arrive): no row is
/// dead-lettered though each may be tried five times, and nothing is tried while paused.
/// Once the stream is there, `requeue --all` and `resume` publish every row, once and in
/// key order.
#[tokio::test(flavor = "multi_thread")]
async fn the_bad_row_valve_pauses_a_table_whose_destination_is_gone_and_nothing_is_lost() {
    // 200 keys, 50 rows a batch: about 200 heads fail a round, so before the valve trips
    // (100 failures in one relay) no head nears its fifth attempt.
    let relay = relay()
        .retry_backoff("10ms")
        .retry_backoff_max("20ms")
        .batch_size(50)
        .max_attempts(5);
    let env = Env::new(relay).await;
    let client = env.client().await;
    let (mut a, log_a) = spawn_named(&env, "relay-a");
    let (mut b, log_b) = spawn_named(&env, "relay-b");
    wait_until("both relays to connect", Duration::from_secs(20), async || {
        count(&client, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' AND query LIKE 'LISTEN%'").await >= 2
    })
    .await;
    let inserted: Vec<i64> = column(
        &client,
        "INSERT INTO public.outbox (topic, key, payload) \
             SELECT 'gone.' || (n % 4), 'k' || (n % 200), 'p' FROM generate_series(1, 1000) n \
             RETURNING id",
        &[],
    )
    .await;
    let paused = "SELECT count(*) FROM public.outbox_relay_pauses";
    wait_until(
        "the valve to pause the table",
        Duration::from_secs(30),
        async || count(&client, paused).await == 1,
    )
    .await;
    let dead_sql = "SELECT count(*) FROM public.outbox WHERE dead_at IS NOT NULL";
    let attempts_sql = "SELECT COALESCE(sum(attempts), 0)::int8 FROM public.outbox";
    // Batches claimed before the pause finish (the contract: a paused table stops being
    // claimed; what is in flight settles), and the other relay reads the pause within
    // half a second: the count is read once it held still for 250 ms.
    let mut last = -1;
    wait_until(
        "the batches in flight to settle",
        Duration::from_secs(10),
        async || {
            let now = count(&client, attempts_sql).await;
            let settled = now == last;
            last = now;
            if !settled {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            settled
        },
    )
    .await;
    let (dead, attempts, most) = (
        count(&client, dead_sql).await,
        count(&client, attempts_sql).await,
        count(&client, "SELECT max(attempts)::int8 FROM public.outbox").await,
    );
    // Paused for both relays: nothing more is tried by either.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        count(&client, attempts_sql).await,
        attempts,
        "tried while paused"
    );
    eprintln!(
        "the valve paused the table after {attempts} failed attempts (at most {most} of a \
         row), {dead} rows dead"
    );
    assert_eq!(dead, 0, "rows dead-lettered before the table paused");
    // At least one relay saw 100 failures; each stops by its 150th (two batches past
    // the threshold at most) or when it reads the pause, with at most 200 heads in flight.
    assert!((100..500).contains(&attempts), "{attempts} failed attempts");
    let status = text(&env.relay(&["status"]));
    assert!(
        status.contains("by bad-row valve") && status.contains("rows failed for their own sake"),
        "{status}"
    );
    // Each relay stopped claiming: the one whose valve tripped paused the table, the
    // other read the pause (or tripped too).
    for log in [&log_a, &log_b] {
        let log = std::fs::read_to_string(log).unwrap();
        assert!(
            log.contains("Table paused by the bad-row valve")
                || log.contains("Table paused: not claiming from it"),
            "{log}"
        );
    }
    assert!(a.try_wait().unwrap().is_none() && b.try_wait().unwrap().is_none());

    env.nats.create_stream("GONE", &["gone.>"]).await.unwrap();
    assert!(env.relay(&["requeue", "--all"]).status.success());
    assert!(env.relay(&["resume"]).status.success());
    wait_for_empty_outbox(&client, "every row after the resume", 30).await;
    let stored = env.nats.read_stream("GONE").await.unwrap();
    let audit = audit(&inserted, &stored);
    audit.assert_nothing_lost_in_order();
    assert_eq!(audit.duplicates, 0);
    for relay in [&mut a, &mut b] {
        signal(relay.id(), Signal::Term);
        let (code, _) = wait_exit(relay, Duration::from_secs(10));
        assert_eq!(code, Some(0));
    }
}

/// Contract section 4 (`pause_after_bad_rows`): the valve pauses a table only when most of
/// its attempts fail. A running relay gets ten rounds of 200 rows, one in ten with no
/// stream to go to, each round settled before the next: the bad rows fail twice each, 400
/// failures in all within the window, four times the threshold, while 1,800 rows
/// publish. The table is never paused, the bad rows are dead-lettered, the others all
/// published. (Rounds, not one insert: a claim may take the bad rows of one insert
/// together, and a batch of nothing but failures, before the others publish, is most
/// of the attempts the relay has seen by then.)
#[tokio::test(flavor = "multi_thread")]
async fn the_bad_row_valve_does_not_pause_a_table_whose_rows_mostly_publish() {
    let relay = relay()
        .retry_backoff("10ms")
        .retry_backoff_max("20ms")
        .max_attempts(2);
    let env = Env::new(relay).await;
    let client = env.client().await;
    let (mut relay, log) = spawn_named(&env, "relay");
    let paused = "SELECT count(*) FROM public.outbox_relay_pauses";
    for round in 0..10 {
        client
            .batch_execute(&format!(
                "INSERT INTO public.outbox (topic, key, payload) \
                 SELECT CASE WHEN n % 10 = 0 THEN 'gone.' || n ELSE 'events.' || (n % 4) END, \
                        CASE WHEN n % 10 = 0 THEN NULL ELSE 'k' || (n % 50) END, 'p' \
                 FROM generate_series({}, {}) n",
                round * 200 + 1,
                round * 200 + 200
            ))
            .await
            .unwrap();
        wait_until(
            Detailed(&format!("round {round} to settle"), log_of(&log)),
            Duration::from_secs(30),
            async || {
                assert_eq!(
                    count(&client, paused).await,
                    0,
                    "the valve paused a table whose rows mostly publish, in round {round}: {}",
                    log_of(&log)()
                );
                count(
                    &client,
                    "SELECT count(*) FROM public.outbox WHERE dead_at IS NULL",
                )
                .await
                    == 0
            },
        )
        .await;
    }
    assert_eq!(count(&client, paused).await, 0);
    let log_text = std::fs::read_to_string(&log).unwrap();
    assert!(
        !log_text.contains("Table paused by the bad-row valve"),
        "{log_text}"
    );
    let dead = "SELECT count(*) FROM public.outbox WHERE dead_at IS NOT NULL AND attempts = 2";
    assert_eq!(count(&client, dead).await, 200, "each bad row tried twice");
    assert_eq!(env.stored().await.len(), 1_800);
    signal(relay.id(), Signal::Term);
    let (code, _) = wait_exit(&mut relay, Duration::from_secs(10));
    assert_eq!(code, Some(0));
}

/// The publish rate over the stored messages, leaving out the first second (the bucket
/// starts full: one second's worth goes at once).
fn steady_rate(stored: &[testkit::StoredMessage]) -> f64 {
    let first = stored.iter().map(|m| m.stored_at).min().unwrap();
    let from = first + Duration::from_secs(1);
    let last = stored.iter().map(|m| m.stored_at).max().unwrap();
    let after = stored.iter().filter(|m| m.stored_at > from).count();
    after as f64 / last.duration_since(from).unwrap().as_secs_f64()
}

/// The rows a `drain` says it published (`drained: N rows published ...`).
fn published_by(out: &std::process::Output) -> usize {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| {
            l.strip_prefix("drained: ")?
                .split_once(" rows published")?
                .0
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no published count in the drain's output: {}", text(out)))
}

/// Contract section 4 (`max_rate`): a table's rate limit holds for all its relays
/// together: one relay and two relays at once each publish at max_rate (within 25%), every
/// row once and in key order. With two, each drain publishes at least a quarter of the
/// rows, so the combined rate is measured while both publish (one drain idle would hide a
/// limit applied per process).
#[tokio::test(flavor = "multi_thread")]
async fn max_rate_holds_for_one_relay_and_for_two_together() {
    const RATE: f64 = 400.0;
    const ROWS: usize = 2_400;
    let env = Env::new(relay()).await;
    env.table_option(&format!("max_rate = {RATE}"));
    let client = env.client().await;
    for relays in [1, 2] {
        let before = env.stored().await.len();
        seed(&client, ROWS as i64, 30, 0).await;
        let inserted = ids(&client).await;
        let sent = watch_sends(&env.nats).await;
        // At once, each on a thread of its own, every one bounded.
        let drains: Vec<_> = (0..relays)
            .map(|_| env.command(&["drain", "--timeout", "60s"]))
            .collect();
        let outs: Vec<_> = drains
            .into_iter()
            .map(|mut d| std::thread::spawn(move || d.output_within(RUN_LIMIT).unwrap()))
            .collect();
        let mut shares = Vec::new();
        for out in outs {
            let out = out.join().unwrap();
            assert_eq!(out.status.code(), Some(0), "{}", text(&out));
            shares.push(published_by(&out));
        }
        assert_eq!(shares.iter().sum::<usize>(), ROWS, "{shares:?}");
        assert!(
            shares.iter().all(|&n| n >= ROWS / 4),
            "{relays} relay(s): a drain published less than a quarter of the rows: {shares:?}"
        );
        assert_each_sent_once(&inserted, &sends_so_far(&env.nats, &sent).await);
        let stored = env.stored().await;
        let new = &stored[before..];
        let audit = audit(&inserted, new);
        audit.assert_nothing_lost_in_order();
        assert_eq!(audit.duplicates, 0);
        let rate = steady_rate(new);
        eprintln!("{relays} relay(s) at max_rate = {RATE}: {rate:.0} rows/s, each {shares:?}");
        assert!(
            (RATE * 0.75..=RATE * 1.25).contains(&rate),
            "{relays} relay(s): {rate:.0} rows/s against max_rate {RATE}"
        );
    }
}

/// Contract section 4 (`dead_letter_topic`): a row dead-lettered is also published to the
/// dead-letter topic once, with its payload, key and message id and headers naming the
/// error, the attempts and the original topic; it stays dead in the table; other keys
/// flow. A dead-letter topic no stream captures does not keep the row from its table's
/// dead-lettering.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_row_is_published_once_to_the_dead_letter_topic() {
    let relay = relay()
        .retry_backoff("10ms")
        .retry_backoff_max("20ms")
        .max_attempts(2);
    let env = Env::new(relay.clone()).await;
    env.table_option("dead_letter_topic = \"events.dead.{topic}\"");
    let client = env.client().await;
    let ids: Vec<i64> = column(
        &client,
        "INSERT INTO public.outbox (topic, key, payload) VALUES \
             ('gone', 'a', 'first of a'), ('gone', 'a', 'second of a'), \
             ('events.ok', 'b', 'fine') RETURNING id",
        &[],
    )
    .await;
    let out = env.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stored = env.stored().await;
    let dead: Vec<_> = stored
        .iter()
        .filter(|m| m.subject == "events.dead.gone")
        .collect();
    assert_eq!(
        dead.len(),
        1,
        "once, the held-back row not at all: {stored:?}"
    );
    let m = dead[0];
    assert_eq!(m.payload, b"first of a");
    assert_eq!(
        m.header("Nats-Msg-Id"),
        Some(format!("public.outbox:{}", ids[0]).as_str())
    );
    assert_eq!(m.header("outbox-attempts"), Some("2"));
    assert_eq!(m.header("outbox-topic"), Some("gone"));
    assert!(
        m.header("outbox-error")
            .is_some_and(|e| e.contains("stream")),
        "{:?}",
        m.header("outbox-error")
    );
    assert!(stored.iter().any(|m| m.payload == b"fine"), "key b flowed");
    let dead_rows = count(
        &client,
        "SELECT count(*) FROM public.outbox WHERE dead_at IS NOT NULL",
    )
    .await;
    assert_eq!(dead_rows, 1, "it stays dead in the table");

    // A dead-letter topic no stream captures: the row is dead-lettered in the table anyway.
    let env2 = Env::new(relay).await;
    env2.table_option("dead_letter_topic = \"nowhere.{topic}\"");
    let client2 = env2.client().await;
    client2
        .execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('gone', 'a', 'x')",
            &[],
        )
        .await
        .unwrap();
    let out = env2.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("Could not publish the row to its dead-letter topic"),
        "{}",
        text(&out)
    );
    let dead_rows = count(
        &client2,
        "SELECT count(*) FROM public.outbox WHERE dead_at IS NOT NULL",
    )
    .await;
    assert_eq!(dead_rows, 1);
}

/// A publish whose ack never comes because the stream's leader stepped down with it is
/// sent again as soon as JetStream announces a new leader, not after
/// `sink.publish_timeout` (10 minutes here). The relay's sink is driven directly against
/// a plain server on which the test plays the stream: it drops the first copy of each
/// message, announces an election (`$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.<stream>`)
/// and acknowledges the copies sent again.
#[tokio::test(flavor = "multi_thread")]
async fn a_publish_a_stepped_down_leader_dropped_is_sent_again_when_a_leader_is_elected() {
    use futures_util::StreamExt;
    use outbox_relay::sink::{Message, Sink};

    let _shared = shared();
    let nats = testkit::NatsServer::start().expect("start nats-server");
    let client = nats.client().await.expect("connect");
    let mut stream = client.subscribe("fake.>").await.expect("subscribe");
    client.flush().await.expect("flush");
    let config = outbox_relay::config::from_str(
        &format!(
            "[postgres]\nurl = \"postgres://relay@127.0.0.1/app\"\n[sink]\nkind = \"nats\"\n\
             publish_timeout = \"10min\"\n[sink.nats]\nurl = \"{}\"\n\
             [[tables]]\nname = \"public.outbox\"\n",
            nats.url()
        ),
        |_| None,
        Vec::<(String, String)>::new(),
    )
    .expect("config");
    let sink = Sink::connect(&config.sink).await.expect("connect the sink");
    let messages: Vec<Message> = (1..=3)
        .map(|i| Message {
            id: format!("public.outbox:{i}"),
            topic: format!("fake.{i}").into(),
            key: Some(format!("k{i}").into()),
            payload: Some("x".into()),
            headers: Vec::new(),
            timestamp_ms: None,
        })
        .collect();
    let batch: Vec<&Message> = messages.iter().collect();
    let leader = async {
        for _ in &messages {
            stream.next().await.expect("a first copy"); // dropped
        }
        client
            .publish("$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.FAKE", "{}".into())
            .await
            .expect("announce a leader");
        let mut again = Vec::new();
        for seq in 1..=messages.len() {
            let copy = stream.next().await.expect("a copy sent again");
            let ack = format!(r#"{{"stream":"FAKE","seq":{seq}}}"#);
            client
                .publish(copy.reply.clone().expect("a reply subject"), ack.into())
                .await
                .expect("acknowledge");
            let id = copy.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id"));
            again.push(id.map(|v| v.to_string()).unwrap_or_default());
        }
        again
    };
    let (results, mut again) = tokio::time::timeout(
        Duration::from_secs(60),
        futures_util::future::join(sink.publish_batch(&batch), leader),
    )
    .await
    .expect("the batch acknowledged once the copies sent again are");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    again.sort();
    let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(again, ids, "each unacknowledged message is sent again once");
}

/// "No responders" for a publish is a stream between leaders, or no stream at all: the
/// sink asks JetStream which, and a leader elected meanwhile answers first. Here the
/// question gets no answer (the relay's user may not ask it, as when JetStream's meta leader
/// is changing too) while the test announces elections until the batch is back: the
/// election decides, the broker's fault, retried.
#[tokio::test(flavor = "multi_thread")]
async fn no_responders_during_a_leader_election_is_transient_without_the_streams_answer() {
    use outbox_relay::sink::{Message, Sink};

    let _shared = shared();
    let (nats, url) = testkit::NatsServer::start_with_denied_publish(&["$JS.API.STREAM.NAMES"])
        .expect("start nats-server");
    let client = nats.client().await.expect("connect");
    let config = outbox_relay::config::from_str(
        &format!(
            "[postgres]\nurl = \"postgres://relay@127.0.0.1/app\"\n[sink]\nkind = \"nats\"\n\
             publish_timeout = \"10min\"\n[sink.nats]\nurl = \"{url}\"\n\
             [[tables]]\nname = \"public.outbox\"\n"
        ),
        |_| None,
        Vec::<(String, String)>::new(),
    )
    .expect("config");
    let sink = Sink::connect(&config.sink).await.expect("connect the sink");
    let message = Message {
        id: "public.outbox:1".to_owned(),
        topic: "between.leaders".into(),
        key: Some("k".into()),
        payload: Some("x".into()),
        headers: Vec::new(),
        timestamp_ms: None,
    };
    let batch = [&message];
    let publish = sink.publish_batch(&batch);
    tokio::pin!(publish);
    let results = loop {
        tokio::select! {
            results = &mut publish => break results,
            _ = tokio::time::sleep(Duration::from_millis(50)) => client
                .publish("$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.S", "{}".into())
                .await
                .expect("announce a leader"),
        }
    };
    let error = results[0].as_ref().expect_err("nothing stored it");
    assert!(
        error.message().contains("elected a leader"),
        "the election, not the unanswered question, decides: {}",
        error.message()
    );
}
