//! Promises from a new user's trial (issue 13): a row the broker refuses for itself is the
//! row's fault and never stalls other keys; a failed row waits for its next attempt; every
//! command has a deadline, start-up included; the endpoints answer before any dependency
//! does; a lost broker connection stops claims at once; fatal errors are JSON lines too.

use std::net::TcpListener;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

/// The 3 rows of key `bad` to a subject no stream captures go in first: they are the
/// oldest rows, at the head of every claim window.
async fn seed_with_uncaptured_head(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES
               ('nostream.orders', 'bad', 'b1'),
               ('nostream.orders', 'bad', 'b2'),
               ('nostream.orders', 'bad', 'b3')",
        )
        .await
        .unwrap();
    seed(client, 10_000, 100, 0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_subject_no_stream_captures_is_the_rows_fault_and_other_keys_flow() {
    let env = Env::new(relay().retry_backoff("10ms").max_attempts(3)).await;
    let client = env.client().await;
    seed_with_uncaptured_head(&client).await;

    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("circuit open") && !stderr.contains("Broker unavailable"),
        "a row-level refusal opened the circuit: {stderr}"
    );
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 10_000, "every good row arrived");
    assert!(delivery.order_violations().is_empty());

    let left = rows_left(&client).await;
    assert_eq!(left.len(), 3, "{left:?}");
    // The head was tried max_attempts times and dead-lettered with the reason...
    assert_eq!((left[0].0, left[0].1, left[0].2), (1, 3, true));
    assert!(
        left[0]
            .3
            .as_deref()
            .unwrap()
            .contains("no JetStream stream captures subject \"nostream.orders\""),
        "{left:?}"
    );
    // ...and its key's later rows wait behind it, never tried.
    assert_eq!(left[1..], [(2, 0, false, None), (3, 0, false, None)]);

    let out = env.relay(&["status"]);
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(status.contains("2 held back, 1 dead"), "{status}");
    assert!(
        status.contains("dead id 1: dead since ")
            && status.contains("holds back 2 later rows of key \"bad\""),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_row_waits_for_its_next_attempt() {
    // A ceiling this long: the first wait (full jitter under it) outlasts the test.
    let env = Env::new(relay().retry_backoff("1000h").retry_backoff_max("1000h")).await;
    let client = env.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload, headers) VALUES
               ('events.a', 'k', '1', '[\"not an object\"]'),
               ('events.a', 'k', '2', NULL),
               ('events.a', 'other', '3', NULL)",
        )
        .await
        .unwrap();

    let out = env.relay(&["drain", "--timeout", "3s"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        text(&out).contains("1 waiting for a retry, the next due in "),
        "{}",
        text(&out)
    );
    let row: (i32, bool, bool) = {
        let r = client
            .query_one(
                "SELECT attempts, next_attempt_at > now(), \
                 next_attempt_at <= now() + interval '1000 hours' FROM public.outbox WHERE id = 1",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(
        row,
        (1, true, true),
        "one attempt in 3 s, the next within the backoff ceiling"
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM public.outbox WHERE id = 2 AND attempts = 0"
        )
        .await,
        1,
        "its key's next row waits behind it, untried"
    );
    assert_eq!(
        analyse(&env.stored().await).counts.len(),
        1,
        "other keys flow"
    );

    let out = env.relay(&["status"]);
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(
        status.contains("1 failing, 1 waiting for retry (next at "),
        "{status}"
    );
    assert!(status.contains("1 held back"), "{status}");
    assert!(
        status.contains("waiting id 1: next attempt at ")
            && status.contains("1 attempts, holds back 1 later rows of key \"k\""),
        "{status}"
    );

    // The operator fixes the row and makes it due now: rows 1 and 2 go out in order.
    client
        .execute("UPDATE public.outbox SET headers = '{}' WHERE id = 1", &[])
        .await
        .unwrap();
    let out = env.relay(&["requeue", "--waiting"]);
    assert!(
        text(&out).contains("public.outbox: made 1 rows waiting for a retry due now (ids 1)"),
        "{}",
        text(&out)
    );
    let out = env.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 3);
    let ids: Vec<String> = env
        .stored()
        .await
        .iter()
        .map(|m| m.header("Nats-Msg-Id").unwrap().to_owned())
        .collect();
    assert_eq!(ids[1..], ["public.outbox:1", "public.outbox:2"]);
}

/// A TCP server that accepts connections and never says a word.
fn silent_server() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accept = listener.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in accept.incoming().flatten() {
            held.push(stream); // kept open, never answered
        }
    });
    (listener, addr)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_command_has_a_deadline_against_a_server_that_never_answers() {
    let env = Env::new(relay()).await;
    let (_server, addr) = silent_server();
    let url = format!("postgres://app@{addr}/app?connect_timeout=1");
    for (args, limit) in [
        (&["migrate"][..], 5),
        (&["status"][..], 10),
        (&["check"][..], 15),
        (&["drain", "--timeout", "3s"][..], 8),
    ] {
        let started = Instant::now();
        let out = env
            .command(args)
            .env("OUTBOX_RELAY__POSTGRES__URL", &url)
            .output_within(RUN_LIMIT)
            .unwrap();
        let took = started.elapsed();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(
            took < Duration::from_secs(limit),
            "{args:?} took {took:?}: {}",
            text(&out)
        );
        if args[0] == "drain" {
            assert!(
                text(&out).contains("PostgreSQL was never reached"),
                "{}",
                text(&out)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn drain_exits_1_naming_the_dependency_it_never_reached() {
    let env = Env::new(relay()).await;
    let closed = format!("127.0.0.1:{}", testkit::free_port());
    for (var, value, names) in [
        (
            "OUTBOX_RELAY__SINK__NATS__URL",
            format!("nats://{closed}"),
            "Broker was never reached",
        ),
        (
            "OUTBOX_RELAY__POSTGRES__URL",
            format!("postgres://app@{closed}/app"),
            "PostgreSQL was never reached",
        ),
    ] {
        let started = Instant::now();
        let out = env
            .command(&["drain", "--timeout", "2s"])
            .env(var, &value)
            .output_within(RUN_LIMIT)
            .unwrap();
        let took = started.elapsed();
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(text(&out).contains(names), "{}", text(&out));
        assert!(took < Duration::from_secs(4), "{names}: took {took:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn endpoints_answer_before_any_dependency_is_reachable() {
    let env = Env::new(relay()).await;
    let addr = format!("127.0.0.1:{}", testkit::free_port());
    env.write_config(&relay().http(&addr));
    let closed = format!("127.0.0.1:{}", testkit::free_port());
    let mut relay = env
        .command(&["run"])
        .env(
            "OUTBOX_RELAY__POSTGRES__URL",
            format!("postgres://app@{closed}/app"),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let limit = Duration::from_secs(10);
    let healthz = wait_for("/healthz to answer", limit, async || {
        http_get(&addr, "/healthz").ok()
    })
    .await;
    assert_eq!(healthz.0, 200, "{healthz:?}");
    // Wait until the broker answered (it is up) while PostgreSQL still does not.
    let (ready, metrics) = wait_for(
        "the broker to be up",
        limit.saturating_sub(started.elapsed()),
        async || {
            let ready = http_get(&addr, "/readyz").unwrap();
            let metrics = http_get(&addr, "/metrics").unwrap().1;
            metrics
                .contains("outbox_relay_dependency_up{dependency=\"broker\"} 1")
                .then_some((ready, metrics))
        },
    )
    .await;
    assert_eq!(ready.0, 503, "{ready:?}");
    assert!(ready.1.contains("PostgreSQL"), "{ready:?}");
    assert!(
        metrics.contains("outbox_relay_dependency_up{dependency=\"postgres\"} 0"),
        "{metrics}"
    );
    signal(relay.id(), Signal::Term);
    let (code, took) = wait_exit(&mut relay, Duration::from_secs(5));
    assert_eq!(code, Some(0), "a run stopped during start-up stops cleanly");
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_broker_connection_stops_claims_at_once() {
    let mut env = Env::new(relay().workers(4).batch_size(500)).await;
    // Acks could take this long: without the connection watch, a batch in flight would
    // hold its row locks for 30 s after the broker vanished.
    env.write_config(
        &relay()
            .workers(4)
            .batch_size(500)
            .publish_timeout("30s")
            .drain_timeout("10s"),
    );
    let client = env.client().await;
    seed(&client, 200_000, 200, 0).await;
    let inserted = ids(&client).await;
    let mut relay = env.spawn_run();
    wait_until("publishing to start", Duration::from_secs(30), async || {
        count(&client, "SELECT count(*) FROM public.outbox").await < 190_000
    })
    .await;
    env.nats.kill();
    let lost = Instant::now();
    // Transactions of the relay's role that hold row locks (FOR UPDATE assigns an xid).
    let locking = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                   WHERE a.usename = 'outbox_relay' AND l.locktype = 'transactionid'";
    // Claims that had begun before the loss may still finish theirs: wait until none
    // has been seen for 100 ms.
    let mut clear_since: Option<Instant> = None;
    wait_until(
        "the relay to let go of its row locks after the broker vanished",
        Duration::from_secs(5).saturating_sub(lost.elapsed()),
        async || {
            if count(&client, locking).await == 0 {
                clear_since.get_or_insert_with(Instant::now);
            } else {
                clear_since = None;
            }
            clear_since.is_some_and(|t| t.elapsed() >= Duration::from_millis(100))
        },
    )
    .await;
    let released = lost.elapsed();
    assert!(released < Duration::from_secs(3), "took {released:?}");
    // And it does not claim again while the broker is gone.
    let sampling = Instant::now();
    let mut samples = 0;
    while sampling.elapsed() < Duration::from_secs(2) {
        assert_eq!(
            count(&client, locking).await,
            0,
            "claimed while the broker is gone"
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(samples > 20);
    env.nats.start_again().unwrap();
    wait_for_empty_outbox(&client, "the backlog after the broker came back", 120).await;
    terminate_cleanly(&mut relay);
    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fatal_error_is_a_json_line_with_log_format_json() {
    let env = Env::new(relay()).await;
    let closed = format!("127.0.0.1:{}", testkit::free_port());
    let out = env
        .command(&["--log-format", "json", "drain", "--timeout", "1s"])
        .env(
            "OUTBOX_RELAY__POSTGRES__URL",
            format!("postgres://app@{closed}/app"),
        )
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for line in stderr.lines() {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"));
        assert!(event.get("level").is_some(), "{line}");
    }
    let last: serde_json::Value = serde_json::from_str(stderr.lines().last().unwrap()).unwrap();
    assert_eq!(last["level"], "ERROR", "{last}");
    assert!(
        last["error"]
            .as_str()
            .unwrap()
            .contains("PostgreSQL was never reached"),
        "{last}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_upgrades_a_live_table_without_a_rewrite_and_check_asks_for_the_new_grant() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    seed(&client, 1_000, 10, 0).await;
    // Back to the table as migration 0001 left it.
    client
        .batch_execute(
            "DROP TRIGGER outbox_relay_hold ON public.outbox;
             DROP TRIGGER outbox_relay_hold_delete ON public.outbox;
             ALTER TABLE public.outbox DROP COLUMN next_attempt_at;
             DELETE FROM public.outbox_relay_migrations WHERE version IN (2, 8);",
        )
        .await
        .unwrap();
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("column next_attempt_at (next attempt time, added by migrate 0002) is missing: run `outbox-relay migrate`"),
        "{}",
        text(&out)
    );
    let file = "SELECT pg_relation_filenode('public.outbox')::bigint";
    let before = count(&client, file).await;
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("applied 0002_next_attempt_at, 0008_held_rows;"),
        "{stdout}"
    );
    assert_eq!(
        count(&client, file).await,
        before,
        "the table was not rewritten"
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.outbox'::regclass \
             AND tgname LIKE 'outbox_relay_hold%'"
        )
        .await,
        3,
        "the triggers that keep the held rows"
    );
    // The relay's role needs UPDATE on the new column; check names the GRANT.
    client
        .batch_execute("REVOKE UPDATE (next_attempt_at) ON public.outbox FROM outbox_relay")
        .await
        .unwrap();
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("lacks UPDATE on column next_attempt_at"),
        "{}",
        text(&out)
    );
    grant_relay_role(&client, "public.outbox").await;
    let out = env.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// Whether the index `public.<name>` is there and valid.
async fn valid_index(client: &tokio_postgres::Client, name: &str) -> bool {
    let row = client
        .query_one(
            "SELECT count(*) FROM pg_index \
             WHERE indexrelid = to_regclass('public.' || $1) AND indisvalid",
            &[&name],
        )
        .await
        .unwrap();
    row.get::<_, i64>(0) == 1
}

/// Whether `public.outbox_pending_idx` is there and valid.
async fn pending_index(client: &tokio_postgres::Client) -> bool {
    valid_index(client, "outbox_pending_idx").await
}

/// `check` fails naming the missing index `name` (`what` it holds) and says to run
/// `migrate`; `migrate` then builds it.
async fn check_wants_index_until_migrate_builds_it(env: &Env, name: &str, what: &str) {
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let missing = format!("{name}\" ({what}) is missing: run `outbox-relay migrate`");
    assert!(text(&out).contains(&missing), "{}", text(&out));
    migrate_says(env, &format!("index \"{name}\" (built concurrently)"));
    assert!(valid_index(&env.client().await, name).await, "{name} built");
}

/// `migrate` succeeds and its report says `what`.
fn migrate_says(env: &Env, what: &str) {
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(what), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn mark_mode_needs_the_pending_index_and_delete_mode_goes_without_it() {
    // Mark mode keeps published rows: its claims need the pending index, and migrate
    // builds it for a mark-mode config.
    let env = Env::new(relay().on_publish("mark")).await;
    let client = env.client().await;
    assert!(pending_index(&client).await, "built for mark mode");
    client
        .batch_execute("DROP INDEX public.outbox_pending_idx")
        .await
        .unwrap();
    check_wants_index_until_migrate_builds_it(
        &env,
        "outbox_pending_idx",
        "pending rows in order (migration 0001)",
    )
    .await;
    // Delete mode claims through the primary key: migrate drops the index, and the relay
    // starts and drains without it.
    env.write_config(&relay());
    migrate_says(&env, "index \"outbox_pending_idx\" dropped concurrently");
    assert!(!pending_index(&client).await, "dropped for delete mode");
    seed(&client, 1_000, 10, 0).await;
    let out = env.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        0
    );
    assert_eq!(env.stored().await.len(), 1_000, "every row published");
}

/// Unordered claims read the primary key alone: for `ordering = "none"`, `migrate` leaves
/// the bucket index out (and drops one built for key order), so the application's INSERT
/// enters one B-tree fewer; key order needs it, and says so until `migrate` builds it.
#[tokio::test(flavor = "multi_thread")]
async fn unordered_relays_go_without_the_bucket_index_and_key_order_needs_it() {
    let env = Env::new(relay().ordering("none")).await;
    let client = env.client().await;
    let indexes = "SELECT count(*) FROM pg_index WHERE indrelid = 'public.outbox'::regclass";
    assert_eq!(count(&client, indexes).await, 1, "the primary key alone");
    seed(&client, 3_000, 30, 0).await;
    let out = env.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(env.stored().await.len(), 3_000, "every row published");

    // A key-ordered relay refuses the table until migrate built the index.
    env.write_config(&relay());
    check_wants_index_until_migrate_builds_it(
        &env,
        "outbox_bucket_idx",
        "pending rows by key bucket (migration 0004)",
    )
    .await;
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // Back to no order: migrate drops it again.
    env.write_config(&relay().ordering("none"));
    migrate_says(
        &env,
        "index \"outbox_bucket_idx\" dropped concurrently (ordering = \"none\" reads no key buckets)",
    );
    assert_eq!(
        count(&client, indexes).await,
        1,
        "the primary key alone again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_subject_the_user_may_not_publish_to_is_the_rows_fault() {
    let pg = testkit::Postgres::start().unwrap();
    let (nats, relay_url) =
        testkit::NatsServer::start_with_denied_publish(&["events.secret.>"]).unwrap();
    let env = Env::on(pg, nats, relay().retry_backoff("10ms").max_attempts(3)).await;
    env.write_config(
        &relay()
            .retry_backoff("10ms")
            .max_attempts(3)
            .publish_timeout("2s")
            .drain_timeout("10s"),
    );
    let client = env.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES
               ('events.secret.x', 'k', '1'),
               ('events.a', 'k', '2'),
               ('events.a', 'other', '3')",
        )
        .await
        .unwrap();
    let out = env
        .command(&["drain", "--timeout", "60s"])
        .env("OUTBOX_RELAY__SINK__NATS__URL", &relay_url)
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(!text(&out).contains("relay:relay"), "password shown");
    let left = rows_left(&client).await;
    assert_eq!(left.len(), 2, "{left:?}");
    assert_eq!((left[0].0, left[0].1, left[0].2), (1, 3, true), "{left:?}");
    assert!(
        left[0]
            .3
            .as_deref()
            .unwrap()
            .contains("denies this user permission to publish to \"events.secret.x\""),
        "{left:?}"
    );
    assert_eq!(left[1], (2, 0, false, None), "its key waits behind it");
    assert_eq!(
        analyse(&env.stored().await).counts.len(),
        1,
        "the other key flowed"
    );

    // Authorization refused at connect is fatal at once, not retried until the timeout.
    let wrong = relay_url.replace("relay:relay@", "relay:wrong-password@");
    let started = Instant::now();
    let out = env
        .command(&["drain", "--timeout", "60s"])
        .env("OUTBOX_RELAY__SINK__NATS__URL", &wrong)
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(
        text(&out).contains("the server refused these credentials"),
        "{}",
        text(&out)
    );
    assert!(!text(&out).contains("wrong-password"), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_template_column_the_table_lacks_names_the_real_fix() {
    let env = Env::new(relay()).await;
    let config = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("topic = \"{topic}\"", "topic = \"events.{aggregate_type}\"");
    std::fs::write(&env.config, config).unwrap();
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let all = text(&out);
    assert!(
        all.contains("column aggregate_type (used in the topic template) is missing, and only the application can add it"),
        "{all}"
    );
    assert!(
        !all.contains(
            "aggregate_type (used in the topic template) is missing: run `outbox-relay migrate`"
        ),
        "{all}"
    );
}

/// A claim's bucket reads past its first window: a row released by `requeue` between the
/// two still holds back its key there, so its key's next row is never taken as a head
/// before it (the first window of the next claim takes the released row itself). A bucket
/// read that is a claim's first look (a surplus claim's) takes the released row as the head.
#[tokio::test(flavor = "multi_thread")]
async fn a_released_row_holds_back_its_key_in_a_claims_later_windows() {
    use outbox_relay::source::claim::{BUCKETS, FIRST_WINDOW};
    let env = Env::new(relay()).await;
    let client = env.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES
               ('events.a', 'k', '1'), ('events.a', 'k', '2'), ('events.a', 'other', '3'),
               ('events.a', 'w', '4'), ('events.a', 'w', '5');
             UPDATE public.outbox SET next_attempt_at = now() - interval '1 second' WHERE id = 1;
             UPDATE public.outbox SET next_attempt_at = now() + interval '1 hour' WHERE id = 4;",
        )
        .await
        .unwrap();
    let (_source, tables) = env.tables().await;
    let sql = &tables[0].sql;
    // The order values of a first window's rows (column 0), or of a bucket read's
    // (its own four columns come last, after the locked row's).
    let ids_at = |rows: Vec<tokio_postgres::Row>, last: bool| {
        let mut ids: Vec<i64> = rows
            .iter()
            .filter_map(|r| r.get::<_, Option<i64>>(if last { r.len() - 4 } else { 0 }))
            .collect();
        ids.sort_unstable();
        ids
    };
    let ids = |rows| ids_at(rows, false);
    let first = client
        .query(&sql.window, &[&100i64, &i64::MIN, &Vec::<i64>::new()])
        .await
        .unwrap();
    let all_buckets: Vec<i32> = (0..BUCKETS).collect();
    let buckets = |after: i64| {
        let client = &client;
        let all_buckets = &all_buckets;
        async move {
            let read = client
                .query(
                    &sql.pick_lock,
                    &[
                        &after,
                        &100i64,
                        all_buckets,
                        &i64::MIN,
                        &Vec::<i64>::new(),
                        &sql.tag,
                        &(BUCKETS as i64),
                        &100i64,
                        &i64::MAX,
                    ],
                )
                .await
                .unwrap();
            ids_at(read, true)
        }
    };
    // First window: the released row 1 is due and is its key's head, row 2 follows it;
    // the waiting row 4 and row 5 behind it are left out.
    assert_eq!(ids(first), [1, 2, 3]);
    // A bucket read past the first window of the same claim: row 2 must not pass for the
    // head of `k`.
    assert_eq!(buckets(0).await, [1, 3]);
    // A bucket read that is the claim's first look reads like a first window.
    assert_eq!(buckets(FIRST_WINDOW).await, [1, 2, 3]);
}
