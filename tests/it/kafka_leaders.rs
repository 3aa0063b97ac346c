//! Kafka leader changes (issue 16, topology 4) on librdkafka's mock cluster: three
//! brokers, every partition replicated three times, partition leaders moved and a broker
//! taken down while the relay drains tens of thousands of rows. The idempotent producer
//! keeps each partition in order through the retries, no row is lost, and the relay
//! deletes a row only once its delivery report is in.
//!
//! The relay runs in-process (the mock cluster lives in this process) against a real
//! throwaway PostgreSQL. Kept apart from `kafka_mock.rs` so these long streams do not
//! share two cores with that file's tests.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::common::*;
use outbox_relay::config;
use outbox_relay::relay::{self, Mode, Report};
use outbox_relay::shutdown::Shutdown;
use outbox_relay::sink::kafka::partition_of;
use testkit::KafkaRecord;

const TOPICS: [&str; 3] = ["events.0", "events.1", "events.2"];
const PARTITIONS: i32 = 4;
const BROKERS: i32 = 3;
/// Each test's whole stream, seeded to drained, ends within this.
const LIMIT: Duration = Duration::from_secs(60);

type Mock = MockBrokers;

/// Three brokers; partition `p` of every topic led by broker `p % 3 + 1`.
fn cluster() -> Mock {
    let mock = MockBrokers::new(BROKERS);
    for topic in TOPICS {
        mock.create_topic(topic, PARTITIONS, BROKERS).unwrap();
        for p in 0..PARTITIONS {
            mock.partition_leader(topic, p, Some(leader(p, 0))).unwrap();
        }
    }
    mock
}

/// The broker that leads partition `p` in round `round` of the moves: a different one
/// each round.
fn leader(p: i32, round: i32) -> i32 {
    (p + round) % BROKERS + 1
}

/// `relay drain` in the background, bounded by [`LIMIT`].
fn spawn_drain(config: &config::Config) -> tokio::task::JoinHandle<Report> {
    let config = config.clone();
    tokio::spawn(async move {
        tokio::time::timeout(LIMIT, relay::run(&config, Mode::Drain, Shutdown::new()))
            .await
            .expect("drain finished in time")
            .expect("drain succeeded")
    })
}

fn read_all(mock: &Mock) -> Vec<KafkaRecord> {
    testkit::kafka_read_all(&mock.bootstrap_servers(), &TOPICS, Duration::from_secs(3)).unwrap()
}

async fn left(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM public.outbox", &[])
        .await
        .unwrap()
        .get(0)
}

async fn pending_ids(client: &tokio_postgres::Client) -> BTreeSet<i64> {
    column(client, "SELECT id FROM public.outbox", &[]).await
}

/// Waits until fewer than `below` rows are left (or none), at most `limit`; returns how
/// long it took, `None` if the rows did not move in time.
async fn until_left_below(
    client: &tokio_postgres::Client,
    below: i64,
    limit: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    poll(limit, async || {
        let n = left(client).await;
        (n < below || n == 0).then(|| start.elapsed())
    })
    .await
}

/// Row id -> (topic, partition) where it was first stored.
fn placement(records: &[KafkaRecord]) -> HashMap<i64, (String, i32)> {
    let mut at = HashMap::new();
    for r in records {
        let id: i64 = r
            .header("outbox-id")
            .and_then(|h| h.rsplit(':').next())
            .and_then(|n| n.parse().ok())
            .expect("every record has outbox-id");
        at.entry(id).or_insert((r.topic.clone(), r.partition));
    }
    at
}

/// Every seeded id stored, each key on one partition in id order, the table empty.
async fn assert_all_delivered_in_key_order(m: &Mocked, records: &[KafkaRecord], rows: i64) {
    assert_eq!(left(&m.client).await, 0, "table drained");
    let delivery = analyse_kafka(records);
    let stored: HashSet<i64> = placement(records).into_keys().collect();
    let lost: Vec<i64> = (1..=rows).filter(|id| !stored.contains(id)).collect();
    assert!(
        lost.is_empty(),
        "{} rows lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(20)]
    );
    assert_eq!(
        delivery.counts.len() as i64,
        rows,
        "nothing but the seeded rows"
    );
    let violations = delivery.order_violations();
    // On failure, the first few keys' (partition, id) in stream order say what went wrong.
    let seen: Vec<_> = violations
        .iter()
        .take(3)
        .map(|k| (k, &delivery.by_key[k]))
        .collect();
    assert!(violations.is_empty(), "{violations:?}; first: {seen:?}");
}

fn duplicates(records: &[KafkaRecord]) -> usize {
    analyse_kafka(records).counts.values().map(|c| c - 1).sum()
}

/// Waits until every claim transaction that was open at `since` has ended (within
/// `publish_timeout` plus 10 s): the batches in flight then have settled.
async fn settled_since(client: &tokio_postgres::Client, since: Instant, publish_timeout: Duration) {
    wait_until(
        "the batches in flight at the outage to settle",
        publish_timeout + Duration::from_secs(10),
        async || {
            let open_since = since.elapsed().as_secs_f64();
            relay_transactions(client)
                .await
                .iter()
                .all(|age| *age < open_since)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_partition_leaders_moved_mid_stream_lose_nothing_and_keep_key_order() {
    const ROWS: i64 = 30_000;
    /// Rows the relay must deliver after a move before the next one.
    const STEP: i64 = 1_500;
    let mock = cluster();
    let m = kafka_outbox(
        &mock.bootstrap_servers(),
        relay().workers(4).batch_size(100),
    )
    .await;
    seed(&m.client, ROWS, 300, 0).await;
    let started = Instant::now();
    let relay = spawn_drain(&m.config);

    // Every round moves every partition's leader to another broker, then waits for the
    // relay to get STEP rows further: the moves land while records are in flight.
    let mut stalls = Vec::new();
    let mut round = 0;
    let mut at = ROWS;
    while at > STEP && started.elapsed() < LIMIT {
        round += 1;
        for topic in TOPICS {
            for p in 0..PARTITIONS {
                mock.partition_leader(topic, p, Some(leader(p, round)))
                    .unwrap();
            }
        }
        let stall = until_left_below(&m.client, at, Duration::from_secs(20))
            .await
            .unwrap_or_else(|| panic!("no row delivered within 20s of leader move {round}"));
        stalls.push(stall);
        until_left_below(&m.client, at - STEP + 1, Duration::from_secs(20))
            .await
            .unwrap_or_else(|| panic!("relay stalled after leader move {round}"));
        at = left(&m.client).await;
    }
    let report = relay.await.unwrap();
    let elapsed = started.elapsed();
    assert!(report.drained, "{report:?}");
    assert!(round >= 6, "only {round} leader moves landed mid-stream");

    let records = read_all(&mock);
    assert_all_delivered_in_key_order(&m, &records, ROWS).await;
    stalls.sort();
    eprintln!(
        "leaders moved {round} times over {} partitions; {ROWS} rows in {elapsed:?}; \
         first row deleted after a move: median {:?}, max {:?}; {} records stored, {} duplicates",
        TOPICS.len() as i32 * PARTITIONS,
        stalls[stalls.len() / 2],
        stalls.last().unwrap(),
        records.len(),
        duplicates(&records),
    );
}

/// Whether row `id` of [`seed`] (key `k{id % keys}`, topic `events.{id % 3}`; no NULL
/// keys) goes to a partition broker `broker` leads in [`cluster`]'s first placement.
fn led_by(id: i64, keys: i64, broker: i32) -> bool {
    let key = format!("k{}", id % keys);
    let p = partition_of(key.as_bytes(), PARTITIONS as usize).unwrap();
    leader(p, 0) == broker
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_one_broker_down_holds_back_its_partitions_keys_while_the_others_flow() {
    const ROWS: i64 = 20_000;
    const KEYS: i64 = 200;
    /// Broker 1 leads partitions 0 and 3 of every topic (see [`cluster`]).
    const DOWN: i32 = 1;
    /// The other partitions' rows all go within this while the broker is down. Before
    /// the hold-back, claims took the oldest rows, mostly the stuck keys', and each batch
    /// waited out the publish timeout (3 s): no row moved for up to 19 s at a time.
    const OTHERS_WITHIN: Duration = Duration::from_secs(20);
    /// How long the broker stays down at least.
    const LONG_OUTAGE: Duration = Duration::from_secs(12);
    /// From this far into the outage on, the held rows' waits are sampled.
    const WAITS_FROM: Duration = Duration::from_secs(5);
    /// The longest wait left seen from [`WAITS_FROM`] to [`LONG_OUTAGE`] is above this.
    /// With a wait as long as the outage, a key's head tried at `t` waits `t - d` (`d`: the
    /// producer's delay in seeing the broker down, under a second), so its tries are
    /// at most twice as far apart as their times; one falls between 5 and 12 s or the one
    /// before waits past 12 s, and either way a wait of more than 3 s is seen. With a
    /// fixed second, no wait left is ever above 1 s. (A single reading at 12 s was not
    /// enough: if the keys' tries fall together just before it, the wait left is short.)
    const LONGEST_WAIT_ABOVE: f64 = 2.5;
    /// The held keys' rows all go within this of the broker's return, although every
    /// one of them was told to wait an hour just before it: the producer reconnects within
    /// `reconnect.backoff.max.ms` (the relay's default: 1 s), its next statistics (every
    /// 0.5 s) say so, and the relay releases the held rows at once (measured: 1.3-1.9 s
    /// alone, more beside the rest of the suite). Without the release they wait the hour.
    const FOLLOW_WITHIN: Duration = Duration::from_secs(20);
    let publish_timeout = Duration::from_secs(3);
    let mock = cluster();
    let m = kafka_outbox(
        &mock.bootstrap_servers(),
        relay().workers(4).batch_size(100),
    )
    .await;
    seed(&m.client, ROWS, KEYS, 0).await;
    let started = Instant::now();
    let relay = spawn_drain(&m.config);
    until_left_below(&m.client, ROWS - 2_000, LIMIT)
        .await
        .expect("the relay started");

    // Leaders stay where they are: the down broker's partitions cannot take records.
    mock.broker_down(DOWN).unwrap();
    let down_at = Instant::now();
    // Every batch in flight at the outage settles (its delivery reports in, or timed out
    // after the publish timeout) and commits.
    settled_since(&m.client, down_at, publish_timeout).await;
    let at_settled = pending_ids(&m.client).await;
    let others_left = at_settled
        .iter()
        .filter(|id| !led_by(**id, KEYS, DOWN))
        .count();
    // Every row of the other partitions goes while the broker stays down.
    let others_went = async || {
        let pending = pending_ids(&m.client).await;
        pending.iter().all(|id| led_by(*id, KEYS, DOWN))
    };
    wait_until(
        "every row of the partitions the down broker does not lead to go",
        OTHERS_WITHIN,
        others_went,
    )
    .await;
    let others_took = down_at.elapsed();
    let held = pending_ids(&m.client).await;
    assert!(
        !held.is_empty(),
        "the outage held back none of its partitions' rows"
    );
    // Held back, not failed: no attempt counted, and each key's first row says why.
    let (attempts, reasons): (i64, Vec<String>) = {
        let row = m
            .client
            .query_one(
                "SELECT coalesce(sum(attempts), 0)::int8, \
                 array_agg(DISTINCT last_error) FILTER (WHERE last_error IS NOT NULL) \
                 FROM public.outbox",
                &[],
            )
            .await
            .unwrap();
        (
            row.get(0),
            row.get::<_, Option<Vec<String>>>(1).unwrap_or_default(),
        )
    };
    assert_eq!(attempts, 0, "holding a key back counts no attempt");
    assert!(
        reasons
            .iter()
            .any(|r| r.contains(&format!("led by broker {DOWN}"))),
        "the held rows say why: {reasons:?}"
    );
    // The outage lasts: a held key's head is tried again after about as long as the
    // outage has lasted, so the held rows come to wait several seconds (with a fixed second
    // each head was claimed and written again every second, however long the outage).
    tokio::time::sleep_until((down_at + WAITS_FROM).into()).await;
    let mut longest_wait = 0.0_f64;
    while down_at.elapsed() < LONG_OUTAGE {
        let left: f64 = m
            .client
            .query_one(
                "SELECT coalesce(max(extract(epoch FROM next_attempt_at - now())), 0)::float8 \
                 FROM public.outbox",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        longest_wait = longest_wait.max(left);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        longest_wait > LONGEST_WAIT_ABOVE,
        "held rows wait as long as the outage has lasted: the longest wait left seen from \
         {WAITS_FROM:?} to {LONG_OUTAGE:?} into the outage is {longest_wait:.1}s"
    );
    // Every held row is told to wait an hour: only the release on the broker's return
    // can let them go in time. A head in a claim now is held again by it first (the
    // update waits for its lock), so none escapes.
    let told_to_wait = m
        .client
        .execute(
            "UPDATE public.outbox SET next_attempt_at = now() + interval '1 hour' \
             WHERE last_error LIKE 'held back: %'",
            &[],
        )
        .await
        .unwrap();
    assert!(told_to_wait > 0, "no held row to tell to wait");
    mock.broker_up(DOWN).unwrap();
    let downtime = down_at.elapsed();
    let up_at = Instant::now();

    let report = relay.await.unwrap();
    let (elapsed, after_up) = (started.elapsed(), up_at.elapsed());
    assert!(report.drained, "{report:?}");
    // Released when the producer sees the broker back, not when their wait ends.
    assert!(
        after_up < FOLLOW_WITHIN,
        "the held keys followed {after_up:?} after the broker came back"
    );
    let records = read_all(&mock);
    assert_all_delivered_in_key_order(&m, &records, ROWS).await;
    // The relay's idea of where a key goes is where librdkafka put it.
    let placed = placement(&records);
    let misplaced = placed
        .iter()
        .filter(|(id, (_, p))| {
            let key = format!("k{}", *id % KEYS);
            partition_of(key.as_bytes(), PARTITIONS as usize) != Some(*p)
        })
        .count();
    assert_eq!(misplaced, 0, "records not on the partition murmur2 names");
    eprintln!(
        "{ROWS} rows in {elapsed:?}; broker {DOWN} down {downtime:?}; the other \
         partitions' {others_left} rows went within {others_took:?} of the outage, {} of its \
         own held, the longest wait left {longest_wait:.1}s, {told_to_wait} told to wait an \
         hour; drained {after_up:?} after it came back; {} records stored, {} duplicates",
        held.len(),
        records.len(),
        duplicates(&records),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_leaders_moved_off_a_down_broker_drain_everything_while_it_stays_down() {
    const ROWS: i64 = 20_000;
    /// Broker 1 leads partitions 0 and 3 of every topic (see [`cluster`]).
    const DOWN: i32 = 1;
    let mock = cluster();
    let m = kafka_outbox(
        &mock.bootstrap_servers(),
        relay().workers(4).batch_size(100),
    )
    .await;
    seed(&m.client, ROWS, 200, 0).await;
    let started = Instant::now();
    let relay = spawn_drain(&m.config);
    until_left_below(&m.client, ROWS - 2_000, LIMIT)
        .await
        .expect("the relay started");

    // The broker goes down with its leaderships, as a crashed Kafka broker does until
    // the controller notices; then its partitions fail over to the others.
    mock.broker_down(DOWN).unwrap();
    let down_at = Instant::now();
    // The batches in flight at the outage end: their records to it time out in the
    // producer (publish timeout 3 s), and those rows must stay pending, to go again once
    // their partitions have moved.
    settled_since(&m.client, down_at, Duration::from_secs(3)).await;
    let mut failed_over = Vec::new();
    for topic in TOPICS {
        for p in (0..PARTITIONS).filter(|p| leader(*p, 0) == DOWN) {
            // The next round's leader: never the one it had.
            let to = leader(p, 1);
            mock.partition_leader(topic, p, Some(to)).unwrap();
            failed_over.push((topic, p));
        }
    }
    let at_failover = left(&m.client).await;

    // Everything drains with the broker still down.
    let report = relay.await.unwrap();
    let elapsed = started.elapsed();
    let drained_after_down = down_at.elapsed();
    assert!(report.drained, "{report:?}");
    assert_eq!(left(&m.client).await, 0, "drained with the broker down");
    // Up again for the reader only: it bootstraps from every broker.
    mock.broker_up(DOWN).unwrap();
    let records = read_all(&mock);
    assert_all_delivered_in_key_order(&m, &records, ROWS).await;
    let on_failed_over = records
        .iter()
        .filter(|r| failed_over.contains(&(r.topic.as_str(), r.partition)))
        .count();
    assert!(
        on_failed_over > 0,
        "records reached the failed-over partitions"
    );
    mock.broker_up(DOWN).unwrap();
    eprintln!(
        "{ROWS} rows in {elapsed:?}; broker {DOWN} down and {} partitions failed over with \
         {at_failover} rows left; drained {drained_after_down:?} after it went down; \
         {} records stored, {} duplicates",
        failed_over.len(),
        records.len(),
        duplicates(&records),
    );
}
