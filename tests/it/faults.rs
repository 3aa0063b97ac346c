//! Fault injection, end to end: the relay binary killed with SIGKILL at random moments,
//! PostgreSQL stopped in immediate mode and restarted, nats-server killed and restarted,
//! a poison row among good ones, a long transaction holding an outbox row's lock. After
//! each, an independent audit compares the rows inserted with what the stream holds.
//! (Kafka broker faults: tests/it/kafka_mock.rs.)

use std::time::{Duration, Instant};

use crate::common::*;

async fn pending(client: &tokio_postgres::Client) -> i64 {
    count(client, "SELECT count(*) FROM public.outbox").await
}

/// Rows a relay would still publish: all of them in delete mode, the unmarked ones in
/// mark mode.
async fn unpublished(client: &tokio_postgres::Client) -> i64 {
    count(
        client,
        "SELECT count(*) FROM public.outbox WHERE published_at IS NULL",
    )
    .await
}

const KILLS: usize = 5;
const WORKERS: usize = 4;
const BATCH: usize = 200;

/// kill -9 at random moments while rows flow (`relay` with workers and batch size set):
/// every kill lands
/// mid-stream (the relay published since it started, and rows are left), then a drain
/// finishes. Nothing is lost, each key stays in id order, and what the relay sent more
/// than once (counted by a core subscriber, before the stream's de-duplication) is bounded
/// by the batches in flight at the kills: at most workers x batch_size per kill.
async fn kill_9_mid_stream(relay: Relay) -> Env {
    let env = Env::new(relay.workers(WORKERS).batch_size(BATCH)).await;
    let client = env.client().await;
    let total = 60_000;
    seed(&client, total, 100, 20).await;
    let inserted = ids(&client).await;
    let sent = watch_sends(&env.nats).await;

    for kill in 1..=KILLS {
        let before = unpublished(&client).await;
        let mut relay = env.spawn_run();
        wait_until(
            "the relay to publish before the kill",
            Duration::from_secs(30),
            async || unpublished(&client).await < before,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..200))).await;
        relay.kill().unwrap(); // SIGKILL: no drain, no rollback from the client side
        relay.wait().unwrap();
        let left = unpublished(&client).await;
        eprintln!("kill {kill}: {left} rows left");
        assert!(
            0 < left && left < before,
            "kill {kill} must land mid-stream: {left} rows left of {before}"
        );
    }
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(unpublished(&client).await, 0);

    let audit = audit(&inserted, &env.stored().await);
    audit.assert_nothing_lost_in_order();
    assert_eq!(audit.duplicates, 0, "the stream's de-duplication window");
    let sends = sends_so_far(&env.nats, &sent).await;
    let counts = send_counts(&sends);
    assert_eq!(counts.len(), inserted.len(), "every row sent");
    let resent = sends.len() - counts.len();
    eprintln!("{resent} re-sends over {KILLS} kills");
    assert!(
        resent <= KILLS * WORKERS * BATCH,
        "{resent} re-sends: more than the batches in flight at {KILLS} kills"
    );
    env
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_at_random_moments_loses_nothing_and_keeps_key_order() {
    let env = kill_9_mid_stream(relay()).await;
    assert_eq!(
        count(&env.client().await, "SELECT count(*) FROM public.outbox").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_in_mark_mode_loses_nothing_keeps_key_order_and_marks_every_row() {
    let env = kill_9_mid_stream(relay().on_publish("mark")).await;
    let client = env.client().await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        60_000,
        "mark mode keeps every row"
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM public.outbox WHERE published_at IS NULL OR attempts > 0"
        )
        .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_restarted_mid_stream_the_same_process_finishes_the_table() {
    let mut env = Env::new(relay().workers(4).batch_size(100)).await;
    let client = env.client().await;
    seed(&client, 100_000, 50, 0).await;
    let inserted = ids(&client).await;

    let mut relay = env.spawn_run();
    // The outage comes once rows flow, whatever the relay's speed (no fixed sleep).
    wait_until(
        "the relay to publish",
        Duration::from_secs(30),
        async || pending(&client).await < 100_000,
    )
    .await;
    let left_at_stop = pending(&client).await;
    drop(client);
    env.pg.stop_immediate();
    tokio::time::sleep(Duration::from_secs(2)).await;
    env.pg.restart().unwrap();
    let client = env.client().await;
    let left_at_restart = pending(&client).await;
    eprintln!("rows left: {left_at_stop} just before the stop, {left_at_restart} at the restart");
    assert!(
        left_at_restart > 0,
        "the outage must come mid-stream: {left_at_stop} rows were left just before the \
         stop, {left_at_restart} at the restart"
    );
    wait_for_empty_outbox(&client, "the relay to finish after the restart", 60).await;
    terminate_cleanly(&mut relay);

    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_killed_for_six_seconds_mid_stream_the_same_process_finishes_the_table() {
    let mut env = Env::new(relay().workers(4).batch_size(100)).await;
    let metrics = format!("127.0.0.1:{}", testkit::free_port());
    env.write_config(
        &relay()
            .workers(4)
            .batch_size(100)
            .http(&metrics)
            .publish_timeout("1s")
            .drain_timeout("10s"),
    );
    let client = env.client().await;
    seed(&client, 30_000, 50, 0).await;
    let inserted = ids(&client).await;

    let mut relay = env.spawn_run();
    wait_until("the stream to start", Duration::from_secs(30), async || {
        pending(&client).await < 28_000
    })
    .await;
    env.nats.kill();
    let killed = Instant::now();
    // The first batches fail at the 1s publish timeout and open the circuit; from then
    // on no worker claims (no transaction, no row lock) until a probe reaches NATS.
    wait_until("the circuit to open", Duration::from_secs(10), async || {
        http_get(&metrics, "/metrics")
            .is_ok_and(|(_, m)| m.contains("outbox_relay_circuit_open{sink=\"nats\"} 1"))
    })
    .await;
    eprintln!("circuit open {:?} after the kill", killed.elapsed());
    let during = pending(&client).await;
    let mut claims = 0;
    let sampling = Instant::now();
    while killed.elapsed() < Duration::from_secs(6) || sampling.elapsed() < Duration::from_secs(2) {
        // A claim is a transaction holding row locks on the outbox: a FOR UPDATE takes
        // RowShareLock on the table until the transaction ends. (The probe's and the
        // floor keeper's short read transactions take AccessShareLock only.)
        claims += count(
            &client,
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
             WHERE a.application_name = 'outbox-relay'
               AND l.relation = 'public.outbox'::regclass AND l.mode = 'RowShareLock'",
        )
        .await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("relay claim transactions sampled while the circuit was open: {claims}");
    assert_eq!(claims, 0, "workers claimed while NATS was down");
    assert_eq!(
        pending(&client).await,
        during,
        "nothing is deleted while NATS is down"
    );
    assert!(during > 0, "the outage must come mid-stream");
    env.nats.start_again().unwrap();
    let back = Instant::now();
    wait_for_empty_outbox(&client, "the relay to finish after NATS is back", 90).await;
    eprintln!("table empty {:?} after NATS came back", back.elapsed());
    terminate_cleanly(&mut relay);

    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_2mb_poison_row_among_good_ones_is_dead_lettered_and_only_its_key_waits() {
    let env = Env::new(relay().workers(2).batch_size(100).max_attempts(3)).await;
    let client = env.client().await;
    seed(&client, 1_000, 20, 0).await;
    let poison: i64 = client
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload, headers)
             VALUES ('events.0', 'k5', convert_to(repeat('x', 2000000), 'UTF8'),
                     '{\"key\":\"k5\"}') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    seed(&client, 1_000, 20, 0).await; // 50 more rows of k5 after the poison row
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    let row = client
        .query_one(
            "SELECT attempts, dead_at IS NOT NULL, last_error FROM public.outbox WHERE id = $1",
            &[&poison],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 3);
    assert!(row.get::<_, bool>(1), "dead-lettered");
    let error: String = row.get(2);
    assert!(error.contains("max_payload"), "{error}");
    let waiting: Vec<i64> = column(
        &client,
        "SELECT id FROM public.outbox WHERE id > $1 AND dead_at IS NULL ORDER BY id",
        &[&poison],
    )
    .await;
    assert_eq!(waiting.len(), 50, "the later rows of k5 wait behind it");
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 2_000 - 50, "every other row arrived");
    assert!(delivery.order_violations().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_long_transaction_holding_an_outbox_row_delays_only_its_key() {
    let env = Env::new(relay().workers(2).batch_size(50)).await;
    let client = env.client().await;
    seed(&client, 2_000, 10, 0).await;
    let inserted = ids(&client).await;
    // Someone holds the lock on k3's first row (an admin session, a stuck migration).
    let mut holder = env.client().await;
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM public.outbox WHERE id = (SELECT min(id) FROM public.outbox WHERE key = 'k3') FOR UPDATE",
        &[],
    )
    .await
    .unwrap();

    let sent = watch_sends(&env.nats).await;
    let mut relay = env.spawn_run();
    wait_until(
        "the other keys to drain",
        Duration::from_secs(30),
        async || pending(&client).await == 200,
    )
    .await;
    // While the lock is held, k3 (200 rows) waits whole; nothing else does: a row of
    // another key inserted now is published past it.
    let probe: i64 = client
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.probe', 'k-probe', 'p') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    wait_until(
        "a row of another key to pass the held one",
        Duration::from_secs(30),
        async || pending(&client).await == 200,
    )
    .await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM public.outbox WHERE key = 'k3'"
        )
        .await,
        200
    );
    tx.rollback().await.unwrap();
    wait_for_empty_outbox(&client, "k3 after the lock is released", 30).await;
    terminate_cleanly(&mut relay);

    let inserted: Vec<i64> = inserted.into_iter().chain([probe]).collect();
    let audit = audit(&inserted, &env.stored().await);
    audit.assert_nothing_lost_in_order();
    assert_eq!(audit.duplicates, 0);
    // No fault here: every row was sent exactly once.
    assert_each_sent_once(&inserted, &sends_so_far(&env.nats, &sent).await);
}

/// Every connection the relay has open goes silent at once (a proxy between them stops
/// forwarding their bytes; the sockets stay open, as behind a dead network path), while
/// new connections get through: the relay gives up on the silent ones at their deadline and
/// relays on fresh connections, not handing out one silent pooled connection after
/// another.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_database_connection_is_discarded_not_reused() {
    let env = Env::new(relay().workers(2).batch_size(100)).await;
    let proxy = testkit::Proxy::start(([127, 0, 0, 1], env.pg.port()).into()).unwrap();
    let config = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace(
            &format!(":{}/", env.pg.port()),
            &format!(":{}/", proxy.port()),
        )
        .replace(
            "pool_size = 16",
            "pool_size = 16\nstatement_timeout = \"2s\"",
        );
    std::fs::write(&env.config, config).unwrap();
    let client = env.client().await;
    let (mut relay, log) = env.spawn_run_logged();
    wait_until(
        "the relay's sessions",
        Duration::from_secs(10),
        async || relay_sessions(&client).await >= 3,
    )
    .await;
    proxy.freeze_open_connections();
    let frozen = proxy.accepted();
    seed(&client, 1_000, 10, 0).await;
    let started = Instant::now();
    // The NOTIFY went to the silent listener, so the rows are found by the table's idle
    // look (`wake::IDLE_RECHECK`, 5 s), whose claim may meet one silent connection (the
    // session deadline, 4 s): ~9 s. Every later claim must get a fresh connection, or the
    // silent ones cost 4 s each (measured with the relay's backends SIGSTOPped instead,
    // before the pool was emptied on a hang: 5-31 s, once over 40 s in CI; 10-19 s with the
    // pool emptied but a failed claim not retried until the next idle look).
    let limit = Duration::from_secs(15);
    let emptied = poll(limit, async || {
        (count(&client, "SELECT count(*) FROM public.outbox").await == 0).then_some(())
    })
    .await;
    if emptied.is_none() {
        let sessions: Vec<String> = column(
            &client,
            "SELECT concat_ws(' ', pid, state, backend_xid, backend_xmin, \
             (SELECT string_agg(locktype || ':' || mode || ':' || coalesce(objid::text, \
             tuple::text, ''), ',') FROM pg_locks l WHERE l.pid = a.pid), query) \
             FROM pg_stat_activity a WHERE application_name = 'outbox-relay'",
            &[],
        )
        .await;
        panic!(
            "rows still pending {limit:?} after {frozen} connections went silent; the \
             relay's sessions:\n{}\nthe relay's log:\n{}",
            sessions.join("\n"),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    eprintln!(
        "{frozen} silent connections; rows relayed {:?} after",
        started.elapsed()
    );
    assert!(
        proxy.accepted() > frozen,
        "the relay opened no new connection"
    );
    terminate_cleanly(&mut relay);
    assert_eq!(analyse(&env.stored().await).counts.len(), 1_000);
}

/// A LISTEN connection whose path goes silent (here: its server process frozen) is found
/// out by its own check and replaced, so NOTIFY wake-ups are prompt again: a row
/// committed afterwards early, half-way or late in the idle cycle is published within
/// 1 s (`common::wake`), while a relay with a deaf listener has only its 5 s idle look
/// left, at least 1.5 s away at each of those points.
#[tokio::test(flavor = "multi_thread")]
async fn a_silent_listen_connection_is_replaced_and_wake_ups_stay_prompt() {
    let env = Env::new(relay().workers(2)).await;
    let client = env.client().await;
    let (mut relay, log) = env.spawn_run_logged();
    let listener = "SELECT pid FROM pg_stat_activity \
                    WHERE application_name = 'outbox-relay' AND query = 'LISTEN outbox_relay'";
    let mut first: Vec<i32> = Vec::new();
    wait_until(
        "the relay's LISTEN session",
        Duration::from_secs(10),
        async || {
            first = column(&client, listener, &[]).await;
            first.len() == 1
        },
    )
    .await;
    signal(first[0] as u32, Signal::Stop);
    // Its check (every 5 s, answered within `connect_timeout`, 10 s) gives up on it.
    wait_until(
        "a new LISTEN session",
        Duration::from_secs(30),
        async || {
            let now: Vec<i32> = column(&client, listener, &[]).await;
            now.iter().any(|pid| *pid != first[0])
        },
    )
    .await;
    signal(first[0] as u32, Signal::Cont);
    woken_at_every_idle_point(&client, &["public.outbox"], log_of(&log)).await;
    terminate_cleanly(&mut relay);
    assert_eq!(analyse(&env.stored().await).counts.len(), 4);
}

/// Contract section 4 (`dead_letter_topic`): when the dead-letter topic cannot take a row
/// at its last attempt for the broker's sake, the row is not dead-lettered yet and its
/// attempt is not counted: it waits and is tried again, dead-letter topic included, while
/// every other key flows; once the topic is back the row is dead-lettered and published
/// there once. In process, with the memory sink steered by the test.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_topic_that_is_down_postpones_the_row_and_never_blocks_other_keys() {
    use outbox_relay::sink::memory::MemorySink;
    use outbox_relay::sink::SinkError;

    let env = Env::new(
        relay()
            .retry_backoff("10ms")
            .retry_backoff_max("50ms")
            .max_attempts(2),
    )
    .await;
    env.table_option("dead_letter_topic = \"dead.{topic}\"");
    let config = outbox_relay::config::load(&env.config).unwrap();
    let client = env.client().await;
    let bad: i64 = client
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.a', 'a', 'x') \
             RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let sink = MemorySink::new(true);
    // The row fails for itself on its topic (by topic: the dead letter keeps its id).
    sink.fail_topic("events.a", SinkError::bad_row("refused for itself"));
    sink.fail_topic(
        "dead.events.a",
        SinkError::transient("dead-letter broker down"),
    );
    let (shutdown, run) = run_in_process(&config, &sink);
    // Other keys flow meanwhile, batch after batch.
    for round in 0..5 {
        client
            .execute(
                "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.b', 'b', convert_to($1, 'UTF8'))",
                &[&format!("b{round}")],
            )
            .await
            .unwrap();
        wait_until("key b's row", Duration::from_secs(10), async || {
            sink.published()
                .iter()
                .filter(|m| &*m.topic == "events.b")
                .count()
                > round
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let state = "SELECT attempts::int8 * 10 + (dead_at IS NOT NULL)::int::int8 FROM public.outbox \
                 WHERE id = ";
    let row = count(&client, &format!("{state}{bad}")).await;
    assert_eq!(
        row, 10,
        "one attempt counted, not dead (attempts*10 + dead): {row}"
    );
    assert!(sink
        .published()
        .iter()
        .all(|m| !m.topic.starts_with("dead.")));

    sink.heal_topic("dead.events.a");
    wait_until(
        "the row dead-lettered",
        Duration::from_secs(10),
        async || count(&client, &format!("{state}{bad}")).await == 21,
    )
    .await;
    let dead: Vec<_> = sink
        .published()
        .into_iter()
        .filter(|m| &*m.topic == "dead.events.a")
        .collect();
    assert_eq!(dead.len(), 1, "published there once");
    assert!(
        dead[0]
            .headers
            .contains(&("outbox-attempts".into(), "2".into())),
        "{:?}",
        dead[0].headers
    );
    shutdown.request_stop();
    run.await.unwrap().unwrap();
}
