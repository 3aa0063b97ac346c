//! Fault injection for the Kafka sink with librdkafka's mock cluster: produce errors, a
//! broker outage, added latency, a record too large. The relay runs in-process (the mock
//! cluster lives in this process), against a real throwaway PostgreSQL.

use std::time::Duration;

use crate::common::*;
use outbox_relay::config;
use outbox_relay::relay::{self, Mode, Report};
use outbox_relay::shutdown::Shutdown;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

const TOPICS: [&str; 3] = ["events.0", "events.1", "events.2"];

fn cluster() -> MockBrokers {
    let mock = MockBrokers::new(3);
    for topic in TOPICS {
        mock.create_topic(topic, 4, 3).unwrap();
    }
    mock
}

async fn drain(config: &config::Config) -> Report {
    tokio::time::timeout(
        Duration::from_secs(120),
        relay::run(config, Mode::Drain, Shutdown::new()),
    )
    .await
    .expect("drain finished")
    .expect("drain succeeded")
}

fn read(mock: &MockBrokers) -> KafkaDelivery {
    let records =
        testkit::kafka_read_all(&mock.bootstrap_servers(), &TOPICS, Duration::from_secs(3))
            .unwrap();
    analyse_kafka(&records)
}

async fn left(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM public.outbox", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_produce_errors_lose_nothing_and_keep_key_order() {
    let mock = cluster();
    let m = kafka_outbox(
        &mock.bootstrap_servers(),
        relay().workers(4).batch_size(100),
    )
    .await;
    seed(&m.client, 5_000, 50, 9).await;
    // Retriable errors on the next produce requests: the idempotent producer retries them.
    let mut errors = Vec::new();
    for _ in 0..8 {
        errors.push(RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION);
        errors.push(RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT);
        errors.push(RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS);
    }
    mock.request_errors(RDKafkaApiKey::Produce, &errors);

    let report = drain(&m.config).await;
    assert!(report.drained, "{report:?}");
    assert_eq!(left(&m.client).await, 0);
    let delivery = read(&mock);
    assert_eq!(delivery.counts.len(), 5_000, "no row lost");
    assert!(
        delivery.order_violations().is_empty(),
        "{:?}",
        delivery.order_violations()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_broker_outage_mid_stream_loses_nothing() {
    let mock = cluster();
    let m = kafka_outbox(&mock.bootstrap_servers(), relay().workers(4).batch_size(50)).await;
    seed(&m.client, 20_000, 100, 0).await;
    for broker in 1..=3 {
        mock.broker_round_trip_time(broker, Duration::from_millis(20))
            .unwrap();
    }
    let config = m.config.clone();
    let relay = tokio::spawn(async move { drain(&config).await });
    wait_until("rows to flow", Duration::from_secs(30), async || {
        left(&m.client).await <= 18_000
    })
    .await;
    for broker in 1..=3 {
        mock.broker_down(broker).unwrap();
    }
    // The batches in flight settle (acknowledged before the outage, or timed out and
    // rolled back); from then on, while the brokers stay down, no row may go.
    wait_until(
        "the batches in flight to settle",
        Duration::from_secs(20),
        async || relay_transactions(&m.client).await.is_empty(),
    )
    .await;
    let during = ids(&m.client).await;
    assert!(!during.is_empty(), "the outage came mid-stream");
    // An observation window, not a synchronisation: the relay keeps trying meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        ids(&m.client).await,
        during,
        "rows stay while the brokers are down"
    );
    for broker in 1..=3 {
        mock.broker_up(broker).unwrap();
    }
    let report = relay.await.unwrap();
    assert!(report.drained, "{report:?}");
    assert_eq!(left(&m.client).await, 0);
    let delivery = read(&mock);
    assert_eq!(delivery.counts.len(), 20_000, "no row lost");
    assert!(
        delivery.order_violations().is_empty(),
        "{:?}",
        delivery.order_violations()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_added_latency_still_delivers_every_row_in_key_order() {
    let mock = cluster();
    for broker in 1..=3 {
        mock.broker_round_trip_time(broker, Duration::from_millis(100))
            .unwrap();
    }
    let m = kafka_outbox(&mock.bootstrap_servers(), relay().workers(2)).await;
    seed(&m.client, 3_000, 30, 7).await;
    let report = drain(&m.config).await;
    assert!(report.drained);
    let delivery = read(&mock);
    assert_eq!(delivery.counts.len(), 3_000);
    assert!(
        delivery.order_violations().is_empty(),
        "{:?}",
        delivery.order_violations()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_record_too_large_is_dead_lettered_and_holds_back_its_key() {
    let mock = cluster();
    let m = kafka_outbox(&mock.bootstrap_servers(), relay().max_attempts(2)).await;
    m.client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES
               ('events.0', 'big', 'first'),
               ('events.0', 'big', convert_to(repeat('x', 2000000), 'UTF8')),
               ('events.0', 'big', 'after the big one'),
               ('events.1', 'small', 'fine'),
               ('bad topic!', NULL, 'invalid topic')",
        )
        .await
        .unwrap();
    let report = drain(&m.config).await;
    assert!(report.drained, "{report:?}");
    assert_eq!(report.dead, 2, "{report:?}");
    let rows: Vec<(i32, bool, Option<String>)> = m
        .client
        .query(
            "SELECT attempts, dead_at IS NOT NULL, last_error FROM public.outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!((rows[0].0, rows[0].1), (2, true));
    assert!(
        rows[0].2.as_deref().unwrap().contains("too large"),
        "{rows:?}"
    );
    assert_eq!((rows[1].0, rows[1].1), (0, false), "held back, untouched");
    assert_eq!((rows[2].0, rows[2].1), (2, true));
    let delivery = read(&mock);
    assert_eq!(
        delivery.counts.len(),
        2,
        "the first 'big' row and the 'small' one"
    );
}
