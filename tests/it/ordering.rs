//! Per-key order at full parallelism, and fairness: hot keys, several relay processes,
//! `ordering = "none"`, several tables. Each test runs the built binary against a
//! throwaway PostgreSQL and nats-server.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// Position in the stream (0-based) of each message, by its `key` header.
fn positions_of(stored: &[testkit::StoredMessage], key: impl Fn(&str) -> bool) -> Vec<usize> {
    stored
        .iter()
        .enumerate()
        .filter(|(_, m)| m.header("key").is_some_and(&key))
        .map(|(i, _)| i)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hot_key_backlog_does_not_starve_other_keys() {
    let env = Env::new(relay().workers(2).batch_size(100)).await;
    let client = env.client().await;
    // 20,000 rows of one key first, then 20 rows for each of 20 other keys.
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload, headers)
             SELECT 'events.hot', 'hot', 'h', '{\"key\":\"hot\"}' FROM generate_series(1, 20000);
             INSERT INTO public.outbox (topic, key, payload, headers)
             SELECT 'events.cold', 'c' || (n % 20), 'c', jsonb_build_object('key', 'c' || (n % 20))
             FROM generate_series(1, 400) n",
        )
        .await
        .unwrap();
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    let stored = env.stored().await;
    assert_eq!(stored.len(), 20_400);
    let cold = positions_of(&stored, |k| k != "hot");
    assert_eq!(cold.len(), 400);
    // The hot key's owner sends one batch of 100 at a time; the other worker takes the
    // cold keys meanwhile, so they are done long before the hot backlog is.
    let last_cold = *cold.last().unwrap();
    eprintln!("last cold row: message {last_cold} of 20,400");
    assert!(
        last_cold < 5_000,
        "the last cold row is message {last_cold} of 20,400: the hot key starved the others"
    );
    let delivery = analyse(&stored);
    assert!(delivery.order_violations().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn three_run_processes_of_four_workers_keep_key_order_on_twenty_hot_keys() {
    let env = Env::new(relay().workers(4).batch_size(100)).await;
    let client = env.client().await;
    seed(&client, 6_000, 20, 0).await;
    let sent = watch_sends(&env.nats).await;
    let mut relays: Vec<Child> = (0..3).map(|_| spawn_quiet_run(&env)).collect();
    // More rows of the same twenty keys while the three processes run.
    for chunk in 0..12 {
        client
            .execute(
                "INSERT INTO public.outbox (topic, key, payload, headers)
                 SELECT 'events.' || (n % 3), 'k' || (n % 20), convert_to(n::text, 'UTF8'),
                        jsonb_build_object('key', 'k' || (n % 20))
                 FROM generate_series($1::bigint, $1::bigint + 499) n ORDER BY n",
                &[&(chunk * 500_i64)],
            )
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_for_empty_outbox(&client, "three relays to empty the outbox", 120).await;
    for relay in &mut relays {
        terminate_cleanly(relay);
    }

    // Row locks keep the three processes apart: each row is sent once (counted as sent;
    // the stream would hide a re-send).
    let inserted = ids_published(&env).await;
    assert_each_sent_once(&inserted, &sends_so_far(&env.nats, &sent).await);
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 12_000, "every row");
    assert_eq!(delivery.by_key.len(), 20);
    assert_eq!(
        delivery.order_violations(),
        Vec::<String>::new(),
        "per-key id order"
    );
}

/// `outbox-relay run` with its output dropped.
fn spawn_quiet_run(env: &Env) -> Child {
    env.command(&["run"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The ids of every message the stream holds (the rows were deleted as published).
async fn ids_published(env: &Env) -> Vec<i64> {
    let mut ids: Vec<i64> = analyse(&env.stored().await)
        .counts
        .keys()
        .map(|id| id.rsplit(':').next().unwrap().parse().unwrap())
        .collect();
    ids.sort_unstable();
    ids
}

/// The most transactions the relay had open at once, sampled while `relay` runs (at most
/// 90 s).
async fn peak_open_transactions(client: &tokio_postgres::Client, relay: &mut Child) -> Vec<i64> {
    let mut samples = Vec::new();
    let start = std::time::Instant::now();
    while relay.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "the drain did not exit within 90 s"
        );
        samples.push(
            count(
                client,
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = 'outbox-relay' AND xact_start IS NOT NULL",
            )
            .await,
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    samples
}

#[tokio::test(flavor = "multi_thread")]
async fn ordering_none_keeps_all_workers_busy_on_one_hot_key() {
    let env = Env::new(relay().ordering("none").workers(4).batch_size(100)).await;
    let client = env.client().await;
    // One key: in key mode only one worker at a time could hold it.
    seed(&client, 30_000, 1, 0).await;
    let mut relay = env
        .command(&["drain", "--timeout", "60s"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut samples = peak_open_transactions(&client, &mut relay).await;
    let (code, _) = wait_exit(&mut relay, Duration::from_secs(60));
    assert_eq!(code, Some(0));
    samples.sort_unstable();
    let median = samples[samples.len() / 2];
    eprintln!(
        "open relay transactions over {} samples: median {median}, max {}",
        samples.len(),
        samples.last().unwrap()
    );
    assert!(median >= 3, "median {median} of 4 workers busy");
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 30_000);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_busy_table_does_not_starve_a_quiet_one() {
    let env = Env::new(relay().workers(2).batch_size(100)).await;
    env.write_config(
        &relay()
            .workers(2)
            .batch_size(100)
            .section("[[tables]]\nname = \"public.quiet\"\ntopic = \"{topic}\""),
    );
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    let client = env.client().await;
    grant_relay_role(&client, "public.quiet").await;
    seed(&client, 20_000, 50, 0).await;
    client
        .execute(
            "INSERT INTO public.quiet (topic, key, payload, headers)
             SELECT 'events.quiet', 'q' || (n % 5), 'q', jsonb_build_object('key', 'q' || (n % 5))
             FROM generate_series(1, 300) n",
            &[],
        )
        .await
        .unwrap();
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    let stored = env.stored().await;
    assert_eq!(stored.len(), 20_300);
    let quiet: Vec<usize> = stored
        .iter()
        .enumerate()
        .filter(|(_, m)| {
            m.header("Nats-Msg-Id")
                .is_some_and(|id| id.starts_with("public.quiet:"))
        })
        .map(|(i, _)| i)
        .collect();
    assert_eq!(quiet.len(), 300);
    // Each worker takes one batch per table in turn: the quiet table's three batches are
    // among the first few of the run, not behind 20,000 busy rows.
    let last_quiet = *quiet.last().unwrap();
    eprintln!("last quiet row: message {last_quiet} of 20,300");
    assert!(last_quiet < 2_000, "last quiet row is message {last_quiet}");
    assert_eq!(count(&client, "SELECT count(*) FROM public.quiet").await, 0);
}

/// Contract section 8 (Replicas): relay processes claim a deep backlog by key bucket; one
/// killed with SIGKILL mid-stream and a new one joining lose nothing and keep per-key
/// order, and the buckets were really used (advisory locks seen while they ran).
#[tokio::test(flavor = "multi_thread")]
async fn replicas_keep_key_order_and_lose_nothing_while_one_is_killed_and_another_joins() {
    // Batches of 50: a first window holds 200 rows, far less than the backlog, so every
    // claim takes buckets.
    let env = Env::new(relay().workers(4).batch_size(50)).await;
    let client = env.client().await;
    seed(&client, 20_000, 300, 0).await;
    let sent = watch_sends(&env.nats).await;
    let mut relays: Vec<Child> = (0..3).map(|_| spawn_quiet_run(&env)).collect();
    let bucket_locks = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                        WHERE l.locktype = 'advisory' AND a.application_name = 'outbox-relay'";
    let mut seen_buckets = 0;
    wait_until(
        "bucket locks held while rows flow",
        Duration::from_secs(60),
        async || {
            seen_buckets = seen_buckets.max(count(&client, bucket_locks).await);
            seen_buckets > 0 && count(&client, "SELECT count(*) FROM public.outbox").await < 19_000
        },
    )
    .await;
    // More rows of the same keys while they run, then one relay dies mid-stream.
    for chunk in 0..4_i64 {
        client
            .execute(
                "INSERT INTO public.outbox (topic, key, payload, headers)
                 SELECT 'events.' || (n % 3), 'k' || (n % 300), convert_to(n::text, 'UTF8'),
                        jsonb_build_object('key', 'k' || (n % 300))
                 FROM generate_series($1::bigint, $1::bigint + 999) n ORDER BY n",
                &[&(chunk * 1_000)],
            )
            .await
            .unwrap();
    }
    let left_at_kill = count(&client, "SELECT count(*) FROM public.outbox").await;
    relays[0].kill().unwrap(); // SIGKILL: its transactions roll back on the server
    relays[0].wait().unwrap();
    assert!(left_at_kill > 0, "the kill came after the outbox emptied");
    relays.push(spawn_quiet_run(&env));
    wait_for_empty_outbox(&client, "the relays to empty the outbox", 120).await;
    for relay in relays.iter_mut().skip(1) {
        terminate_cleanly(relay);
    }
    eprintln!("bucket locks seen at once: {seen_buckets}; {left_at_kill} rows left at the kill");

    // Ids 1 to 20,000 from the seed, then the four chunks, all from one session.
    let inserted: Vec<i64> = (1..=24_000).collect();
    let stored = env.stored().await;
    audit(&inserted, &stored).assert_nothing_lost_in_order();
    // Re-sends come only from the killed relay's batches in flight.
    let sends = sends_so_far(&env.nats, &sent).await;
    let resent: usize = send_counts(&sends).values().map(|n| n - 1).sum();
    assert!(
        resent <= 4 * 50,
        "{resent} re-sends from one kill of 4 workers x 50 rows"
    );
}

/// Keys whose destination the sink says is unavailable (as a Kafka partition without a
/// reachable leader) are held back - their oldest row postponed, no attempt counted - while
/// the others flow; with a third of the keys flipping unavailable and back every few
/// hundred milliseconds under four workers, every row still arrives, each key's rows in id
/// order. In process, with the memory sink steered by the test.
#[tokio::test(flavor = "multi_thread")]
async fn keys_held_back_for_an_unavailable_destination_keep_their_order_and_lose_nothing() {
    use outbox_relay::sink::memory::MemorySink;
    use outbox_relay::sink::SinkError;
    use std::collections::{BTreeMap, HashSet};

    const ROWS: i64 = 50_000;
    const KEYS: i64 = 200;
    let env = Env::new(
        relay()
            .workers(8)
            .batch_size(50)
            .retry_backoff("10ms")
            .retry_backoff_max("100ms"),
    )
    .await;
    let config = outbox_relay::config::load(&env.config).unwrap();
    let client = env.client().await;
    seed(&client, ROWS, KEYS, 0).await;
    let sink = MemorySink::new(true);
    let (shutdown, run) = run_in_process(&config, &sink);
    // A third of the keys unavailable at a time, a different third every 300 ms.
    let mut held_rounds = 0;
    let started = Instant::now();
    let mut round = 0i64;
    while count(&client, "SELECT count(*) FROM public.outbox").await > 0 && round < 40 {
        for k in 0..KEYS {
            sink.set_available(&format!("k{k}"), (k + round) % 3 != 0);
        }
        // And one topic refused for the broker's sake for a moment: rows left pending with
        // no failure history, as a publish timeout leaves them.
        let topic = format!("events.{}", round % 3);
        sink.fail_topic(&topic, SinkError::transient("broker hiccup"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        sink.heal_topic(&topic);
        round += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
        held_rounds += 1;
    }
    for k in 0..KEYS {
        sink.set_available(&format!("k{k}"), true);
    }
    wait_until("every row published", Duration::from_secs(60), async || {
        count(&client, "SELECT count(*) FROM public.outbox").await == 0
    })
    .await;
    shutdown.request_stop();
    run.await.unwrap().unwrap();
    assert!(
        held_rounds >= 3,
        "the flips landed mid-stream: {held_rounds}"
    );
    // Every row once at least; each key's first occurrences in id order.
    let mut seen = HashSet::new();
    let mut by_key: BTreeMap<(std::sync::Arc<str>, std::sync::Arc<str>), Vec<i64>> =
        BTreeMap::new();
    for m in sink.published() {
        let id: i64 = m.id.rsplit(':').next().unwrap().parse().unwrap();
        if seen.insert(id) {
            let stream = (m.topic.clone(), m.key.clone().unwrap());
            by_key.entry(stream).or_default().push(id);
        }
    }
    assert_eq!(seen.len() as i64, ROWS, "every row published");
    let out_of_order: Vec<_> = by_key
        .iter()
        .filter(|(_, ids)| ids.windows(2).any(|w| w[0] >= w[1]))
        .take(3)
        .collect();
    assert!(out_of_order.is_empty(), "{out_of_order:?}");
    eprintln!(
        "{ROWS} rows over {KEYS} keys in {:?}, availability flipped {held_rounds} times",
        started.elapsed()
    );
}

/// A key whose destination stays unavailable has its head tried again after about as long
/// as the outage has lasted (at about 0, 1, 2, 4 and 8 s), not every second; when the
/// destination is back the relay makes the held rows due at once instead of leaving them
/// to their wait (here the head's last wait, 8 s, would end about 5 s after the return),
/// and the key's rows follow in order. In process, with the memory sink steered by the
/// test.
#[tokio::test(flavor = "multi_thread")]
async fn a_held_keys_head_is_tried_less_often_as_the_outage_lasts_and_its_rows_follow_once_it_is_back(
) {
    use outbox_relay::sink::memory::MemorySink;

    const OUTAGE: Duration = Duration::from_secs(11);
    /// With a fixed second, the head was tried about once a second: 11-12 times.
    const MOST_TRIES: u64 = 6;
    const FOLLOW_WITHIN: Duration = Duration::from_secs(3);
    let env = Env::new(relay().workers(4).batch_size(50)).await;
    let config = outbox_relay::config::load(&env.config).unwrap();
    let client = env.client().await;
    // 100 rows for each of k0..k9.
    seed(&client, 1_000, 10, 0).await;
    let sink = MemorySink::new(true);
    sink.set_available("k3", false);
    let down_at = Instant::now();
    let (shutdown, run) = run_in_process(&config, &sink);
    let left = "SELECT count(*) FROM public.outbox";
    let others_left = "SELECT count(*) FROM public.outbox WHERE key <> 'k3'";
    wait_until("every other key's rows published", OUTAGE, async || {
        count(&client, others_left).await == 0
    })
    .await;
    assert_eq!(count(&client, left).await, 100, "k3's rows wait");
    tokio::time::sleep_until((down_at + OUTAGE).into()).await;
    let tries = sink.turned_away("k3");
    assert!(
        (2..=MOST_TRIES).contains(&tries),
        "k3's head was tried {tries} times in an outage of {OUTAGE:?}"
    );

    sink.set_available("k3", true);
    let back = Instant::now();
    wait_until("k3's rows published", Duration::from_secs(30), async || {
        count(&client, left).await == 0
    })
    .await;
    let followed = back.elapsed();
    shutdown.request_stop();
    run.await.unwrap().unwrap();
    assert!(
        followed < FOLLOW_WITHIN,
        "k3's rows followed {followed:?} after its destination was back"
    );
    let k3: Vec<i64> = sink
        .published()
        .iter()
        .filter(|m| m.key.as_deref() == Some("k3"))
        .map(|m| m.id.rsplit(':').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(k3.len(), 100, "each of k3's rows once");
    assert!(k3.is_sorted(), "k3's rows in id order: {k3:?}");
    eprintln!("k3's head tried {tries} times in {OUTAGE:?}; its rows followed {followed:?} after");
}

/// Rows an earlier relay held back for an unavailable destination (here for an hour, as
/// a wait past what the relay gives, so the test cannot pass by their wait ending) are due
/// as soon as a relay starts: it never saw the destination come back, and its sink
/// decides afresh. In process, with the memory sink, every destination available.
#[tokio::test(flavor = "multi_thread")]
async fn rows_held_back_by_an_earlier_relay_are_tried_again_when_a_relay_starts() {
    use outbox_relay::sink::memory::MemorySink;

    let env = Env::new(relay()).await;
    let config = outbox_relay::config::load(&env.config).unwrap();
    let client = env.client().await;
    seed(&client, 100, 10, 0).await;
    // Each key's first row held back, as a relay does when the key's partition is down;
    // a row that failed for its own sake waits for its retry as before.
    client
        .batch_execute(
            "UPDATE public.outbox SET next_attempt_at = now() + interval '1 hour', \
             last_error = 'held back: partition 3 of topic \"events.0\" has no leader' \
             WHERE id <= 9; \
             UPDATE public.outbox SET next_attempt_at = now() + interval '1 hour', \
             attempts = 1, last_error = 'invalid subject' WHERE id = 10",
        )
        .await
        .unwrap();
    let sink = MemorySink::new(true);
    let (shutdown, run) = run_in_process(&config, &sink);
    wait_until(
        "every row but key k0's published",
        Duration::from_secs(20),
        async || count(&client, "SELECT count(*) FROM public.outbox").await == 10,
    )
    .await;
    shutdown.request_stop();
    run.await.unwrap().unwrap();
    let left: Vec<i64> = client
        .query("SELECT id FROM public.outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        left,
        (1..=10).map(|n| n * 10).collect::<Vec<i64>>(),
        "k0's rows wait behind the row that failed for its own sake, the others went"
    );
}

/// A claim whose lane would leave the window's first batches to lower lanes, made while
/// no lower lane claims (one worker took an idle table's look), takes the oldest rows
/// itself: claimed here directly, each lane alone, on 1,000 rows over 10 keys (every key
/// is in the first batch, so a lane that left it to lane 0 found nothing, and the rows
/// waited for lane 0's next look; for good when lane 0 never looked).
#[tokio::test(flavor = "multi_thread")]
async fn a_lone_claimer_of_any_lane_takes_the_oldest_rows() {
    let claims = DirectClaims::new(1_000, 10).await;
    for lane in 0..4 {
        // The transaction commits without touching the rows: each lane claims alone.
        let claimed = claims
            .source
            .in_transaction(async |tx| claims.claim(tx, lane).await)
            .await
            .unwrap();
        let ids: Vec<i64> = claimed.rows.iter().map(|r| r.id).collect();
        assert_eq!(
            ids,
            (1..=100).collect::<Vec<i64>>(),
            "lane {lane} alone must take the 100 oldest rows"
        );
    }
}

/// Claims made directly, without a relay: a table of `rows` rows over `keys` keys, a
/// source on it and its plan; each claim takes at most 100 rows, from no floor.
struct DirectClaims {
    _env: Env,
    source: outbox_relay::source::Source,
    plans: Vec<outbox_relay::source::table::TablePlan>,
}

impl DirectClaims {
    async fn new(rows: i64, keys: i64) -> DirectClaims {
        use outbox_relay::source::{table, SessionLimits, Source};
        let env = Env::new(relay().batch_size(100)).await;
        seed(&env.client().await, rows, keys, 0).await;
        let config = outbox_relay::config::load(&env.config).unwrap();
        let limits = SessionLimits::one_shot(&config.postgres);
        let source = Source::open(&config.postgres, limits).await.unwrap();
        let plans = table::prepare(&source, &config).await.unwrap();
        DirectClaims {
            _env: env,
            source,
            plans,
        }
    }

    /// One key-ordered claim by `lane` in `tx`.
    async fn claim(
        &self,
        tx: &outbox_relay::source::Tx<'_>,
        lane: usize,
    ) -> Result<outbox_relay::source::claim::Claimed, outbox_relay::source::SourceError> {
        use outbox_relay::source::claim::{claim_batch, Budget};
        let plan = &self.plans[0];
        let budget = Budget {
            rows: 100,
            bytes: u64::MAX,
        };
        let floor = outbox_relay::source::claim::FloorView::default();
        let ordering = outbox_relay::config::Ordering::Key;
        claim_batch(tx, &plan.sql, ordering, budget, lane, &floor, &plan.depth).await
    }
}

/// A claimer that found a deep backlog's keys all taken (contended) starts its next claims
/// with the buckets, skipping the first window: it still takes nothing another claimer
/// owns, and once the owner is gone it takes each key's oldest rows, in an unbroken run
/// from the head. Claimed here directly: claim A holds the heads of all 4 keys of 5,000
/// rows; B, in another transaction, is contended twice (once planning from the first
/// window, once trying buckets first); after A ends, B's next claim (buckets first) takes
/// for every key it got exactly that key's oldest rows.
#[tokio::test(flavor = "multi_thread")]
async fn a_surplus_claimer_trying_buckets_first_takes_only_heads_and_their_runs() {
    let claims = DirectClaims::new(5_000, 4).await;
    let source = &claims.source;
    // Lanes 0 and 4 plan from the window's start alike (4 lanes a window), with their own
    // surplus marks.
    let session_a = source.session().await.unwrap();
    let tx_a = source.begin(&session_a).await.unwrap();
    let a = claims.claim(&tx_a, 0).await.unwrap();
    let a_keys: std::collections::BTreeSet<_> = a.rows.iter().map(|r| r.key.clone()).collect();
    assert_eq!(a_keys.len(), 4, "claim A holds every key: {a_keys:?}");
    for attempt in ["planning from the first window", "trying buckets first"] {
        let b = source
            .in_transaction(async |tx| claims.claim(tx, 4).await)
            .await;
        let b = b.unwrap();
        assert!(
            b.rows.is_empty() && b.contended,
            "{attempt}: B took {} rows (contended: {}) while A holds every key",
            b.rows.len(),
            b.contended
        );
    }
    // Waited for: a dropped transaction's ROLLBACK is only sent, and B could claim first.
    tx_a.commit().await.unwrap();
    drop(session_a);
    let b = source
        .in_transaction(async |tx| claims.claim(tx, 4).await)
        .await
        .unwrap();
    assert!(
        !b.rows.is_empty() && !b.contended,
        "B takes rows once A is gone"
    );
    // Key 'k{r}' holds the ids n with n % 4 == r: its oldest pending rows are r, r+4, ...
    let mut by_key: std::collections::BTreeMap<std::sync::Arc<str>, Vec<i64>> = Default::default();
    for row in &b.rows {
        by_key
            .entry(row.key.clone().unwrap())
            .or_default()
            .push(row.id);
    }
    for (key, ids) in by_key {
        let r: i64 = key[1..].parse().unwrap();
        let first = if r == 0 { 4 } else { r };
        let oldest: Vec<i64> = (0..ids.len() as i64).map(|i| first + 4 * i).collect();
        assert_eq!(
            ids, oldest,
            "key {key}: B must take its oldest rows, in a run"
        );
    }
}
