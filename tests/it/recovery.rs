//! The broker lost what it had acknowledged (issue 54): with `on_publish = "mark"` and a
//! retention, `replay --since` puts every retained row back, once, in key order, with its
//! original message id, within the table's `max_rate`, while `run` keeps relaying.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;

/// Rows published before the loss, over [`KEYS`] keys.
const ROWS: i64 = 10_000;
const KEYS: i64 = 100;
/// Rows committed after the replay, while the replayed ones are still going out.
const LIVE: i64 = 500;
/// The table's `max_rate` (rows/s, all relays together).
const MAX_RATE: i64 = 2_000;

const UNPUBLISHED: &str = "SELECT count(*) FROM public.outbox WHERE published_at IS NULL";

/// A second before now, as RFC 3339 (UTC): before every row seeded after it.
async fn a_second_ago(client: &tokio_postgres::Client) -> String {
    client
        .query_one(
            "SELECT to_char((now() - interval '1 second') AT TIME ZONE 'UTC', \
             'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Deletes the stream and creates it again, empty: the broker "lost" everything.
async fn lose_everything(env: &Env) {
    let js = async_nats::jetstream::new(env.nats.client().await.unwrap());
    js.delete_stream(STREAM).await.expect("delete the stream");
    env.nats
        .create_stream(STREAM, &["events.>"])
        .await
        .expect("create it again");
    assert_eq!(env.nats.stream_state(STREAM).await.unwrap().0, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_restores_every_retained_row_once_in_key_order_with_its_id_within_max_rate() {
    let env = Env::new(
        relay()
            .on_publish("mark")
            .retention("1h")
            .batch_size(200)
            .workers(4),
    )
    .await;
    env.table_option(&format!("max_rate = {MAX_RATE}"));
    let client = env.client().await;
    let since = a_second_ago(&client).await;
    let (mut run, log) = env.spawn_run_logged();
    seed(&client, ROWS, KEYS, 0).await;
    wait_until(
        Detailed("the first publish", log_of(&log)),
        Duration::from_secs(90),
        async || count(&client, UNPUBLISHED).await == 0,
    )
    .await;
    assert_eq!(env.nats.stream_state(STREAM).await.unwrap().0, ROWS as u64);

    lose_everything(&env).await;

    let out = env.relay(&["replay", "--since", &since, "--dry-run"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("would replay {ROWS} published rows")),
        "{}",
        text(&out)
    );
    assert_eq!(
        count(&client, UNPUBLISHED).await,
        0,
        "a dry run changes nothing"
    );
    assert_eq!(env.nats.stream_state(STREAM).await.unwrap().0, 0);

    let out = env.relay(&["replay", "--since", &since]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("replayed {ROWS} published rows")),
        "{}",
        text(&out)
    );
    // Live rows of the same keys keep coming while the replayed ones go out.
    seed(&client, LIVE, KEYS, 0).await;
    wait_until(
        Detailed(
            "the replayed and the live rows to be published",
            log_of(&log),
        ),
        Duration::from_secs(90),
        async || count(&client, UNPUBLISHED).await == 0,
    )
    .await;
    terminate_cleanly(&mut run);

    let stored = env.stored().await;
    let delivery = analyse(&stored);
    assert_eq!(delivery.duplicates(), 0, "each row once");
    assert_eq!(
        delivery.counts.len() as i64,
        ROWS + LIVE,
        "every retained row and every live row"
    );
    for id in 1..=ROWS + LIVE {
        let msg_id = format!("public.outbox:{id}");
        assert_eq!(delivery.counts.get(&msg_id), Some(&1), "{msg_id}");
    }
    // Per key: the replayed rows in id order, then the live rows committed after the replay.
    assert!(
        delivery.order_violations().is_empty(),
        "{:?}",
        delivery.order_violations()
    );
    // Within max_rate: the bucket holds one second's worth, so N rows take at least
    // (N - MAX_RATE) / MAX_RATE seconds from the first to the last.
    let first = stored.iter().map(|m| m.stored_at).min().unwrap();
    let last = stored.iter().map(|m| m.stored_at).max().unwrap();
    let took = last.duration_since(first).unwrap();
    let floor = Duration::from_secs_f64((ROWS + LIVE - MAX_RATE) as f64 / MAX_RATE as f64);
    assert!(
        took >= floor.mul_f64(0.9),
        "{} rows in {took:?}: faster than max_rate {MAX_RATE} allows (at least {floor:?})",
        ROWS + LIVE
    );
    println!(
        "replayed {ROWS} rows and relayed {LIVE} live ones in {took:?} at max_rate {MAX_RATE}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_of_rows_the_stream_still_has_adds_no_duplicate_inside_its_window() {
    let env = Env::new(relay().on_publish("mark").retention("1h")).await;
    let client = env.client().await;
    let since = a_second_ago(&client).await;
    let mut run = env.spawn_run();
    seed(&client, 300, 10, 0).await;
    wait_until("the first publish", Duration::from_secs(60), async || {
        count(&client, UNPUBLISHED).await == 0
    })
    .await;
    let out = env.relay(&["replay", "--since", &since]);
    assert!(
        text(&out).contains("replayed 300 published rows"),
        "{}",
        text(&out)
    );
    wait_until("the replay", Duration::from_secs(60), async || {
        count(&client, UNPUBLISHED).await == 0
    })
    .await;
    terminate_cleanly(&mut run);
    // The stream's 2-minute duplicate window drops the re-sent ids.
    assert_eq!(env.nats.stream_state(STREAM).await.unwrap().0, 300);
    assert_eq!(analyse(&env.stored().await).duplicates(), 0);
}

/// A row of the replay's second batch (of 1,000 rows), not the first of its key:
/// locked by the test, it stops the replay part way for as long as the test needs.
const LOCKED: i64 = 1_500;

const LIVE_PUBLISHED: &str =
    "SELECT count(*) FROM public.outbox WHERE id > 10000 AND published_at IS NOT NULL";

#[tokio::test(flavor = "multi_thread")]
async fn rows_committed_while_a_replay_runs_follow_their_keys_replayed_rows() {
    let env = Env::new(
        relay()
            .on_publish("mark")
            .retention("1h")
            .batch_size(200)
            .workers(4),
    )
    .await;
    env.table_option(&format!("max_rate = {MAX_RATE}"));
    let client = env.client().await;
    let since = a_second_ago(&client).await;
    let (mut run, log) = env.spawn_run_logged();
    seed(&client, ROWS, KEYS, 0).await;
    wait_until(
        Detailed("the first publish", log_of(&log)),
        Duration::from_secs(90),
        async || count(&client, UNPUBLISHED).await == 0,
    )
    .await;
    lose_everything(&env).await;

    let locker = env.client().await;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM public.outbox WHERE id = {LOCKED} FOR UPDATE"
        ))
        .await
        .unwrap();
    let mut replay = env.command(&["replay", "--since", &since]);
    let replay = tokio::task::spawn_blocking(move || replay.output_within(RUN_LIMIT));
    wait_until(
        "the replay to stop at the locked row",
        Duration::from_secs(30),
        async || count(&client, "SELECT count(*) FROM pg_locks WHERE NOT granted").await > 0,
    )
    .await;

    // A writer commits rows of the replayed keys from now until the replay has ended.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (client, stop) = (env.client().await, stop.clone());
        tokio::spawn(async move {
            let mut rounds = 0;
            while !stop.load(Relaxed) {
                seed(&client, KEYS, KEYS, 0).await;
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            rounds
        })
    };
    // While the replay is stopped part way, `run` publishes whatever it may of them (2 s:
    // the replay's statement gives up waiting for the lock after 5 s).
    let live_published = poll(Duration::from_secs(2), async || {
        let n = count(&client, LIVE_PUBLISHED).await;
        (n >= KEYS).then_some(n)
    })
    .await;
    println!("live rows published while the replay was stopped part way: {live_published:?}");
    locker.batch_execute("ROLLBACK").await.unwrap();
    let out = replay.await.unwrap().expect("replay exits");
    stop.store(true, Relaxed);
    let rounds = writer.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    wait_until(
        Detailed(
            "the replayed and the live rows to be published",
            log_of(&log),
        ),
        Duration::from_secs(90),
        async || count(&client, UNPUBLISHED).await == 0,
    )
    .await;
    terminate_cleanly(&mut run);

    let total = count(&client, "SELECT count(*) FROM public.outbox").await;
    assert_eq!(total, ROWS + rounds * KEYS);
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.duplicates(), 0, "each row once");
    assert_eq!(delivery.counts.len() as i64, total, "every row");
    // Per key: its replayed rows, then the rows committed while the replay ran, in id order.
    let violations: Vec<String> = delivery
        .order_violations()
        .iter()
        .take(3)
        .map(|key| {
            let ids = &delivery.by_key[key];
            let at = ids.windows(2).position(|w| w[0] >= w[1]).unwrap();
            format!(
                "{key}: ... {:?} ...",
                &ids[at.saturating_sub(1)..(at + 3).min(ids.len())]
            )
        })
        .collect();
    assert!(
        violations.is_empty(),
        "{} of {KEYS} keys out of id order, e.g. {violations:?}",
        delivery.order_violations().len()
    );
    // Only the rows kept as published when it began: `--until` is never later than the
    // replay's start, and the live rows were held back, pending, not kept as published.
    assert!(
        text(&out).contains(&format!("replayed {ROWS} published rows")),
        "{}",
        text(&out)
    );
    println!(
        "{rounds} rounds of {KEYS} live rows; the replay's stderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // And the replay said how far it had come while it was stopped.
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("replaying: "),
        "{}",
        text(&out)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_stopped_part_way_holds_its_keys_until_run_again_which_finishes_it_in_order() {
    let env = Env::new(
        relay()
            .on_publish("mark")
            .retention("1h")
            .batch_size(200)
            .workers(4),
    )
    .await;
    let client = env.client().await;
    let since = a_second_ago(&client).await;
    let mut run = env.spawn_run();
    seed(&client, ROWS, KEYS, 0).await;
    wait_until("the first publish", Duration::from_secs(90), async || {
        count(&client, UNPUBLISHED).await == 0
    })
    .await;
    lose_everything(&env).await;

    // The replay waits for the locked row longer than its 5 s lock timeout and fails after
    // its first batch.
    let locker = env.client().await;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM public.outbox WHERE id = {LOCKED} FOR UPDATE"
        ))
        .await
        .unwrap();
    let out = env.relay(&["replay", "--since", &since]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    locker.batch_execute("ROLLBACK").await.unwrap();
    seed(&client, KEYS, KEYS, 0).await;
    // Its held rows hold every replayed key back: the rows it made pending and the live
    // ones wait.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = "SELECT count(*) FROM public.outbox WHERE published_at IS NULL \
                AND next_attempt_at = '9999-12-31 00:00:00+00'";
    assert_eq!(count(&client, held).await, KEYS, "one held row per key");
    assert_eq!(
        env.nats.stream_state(STREAM).await.unwrap().0,
        0,
        "nothing of a held key published"
    );

    let out = env.relay(&["replay", "--since", &since]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    wait_until(
        "the replay to be published",
        Duration::from_secs(90),
        async || count(&client, UNPUBLISHED).await == 0,
    )
    .await;
    terminate_cleanly(&mut run);
    assert_eq!(count(&client, held).await, 0, "released");
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.duplicates(), 0, "each row once");
    assert_eq!(delivery.counts.len() as i64, ROWS + KEYS, "every row");
    assert!(
        delivery.order_violations().is_empty(),
        "{:?}",
        delivery.order_violations()
    );
}
