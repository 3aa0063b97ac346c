//! PostgreSQL failover: the primary dies mid-stream and its synchronous standby is
//! promoted; the relay, given one URL naming both servers with
//! `target_session_attrs=read-write`, follows the primary role by itself.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;
use testkit::{failover_url, NatsServer, Postgres, Standby};

const WORKERS: i64 = 4;
const BATCH: i64 = 100;
const KEYS: i64 = 50;
/// How long the relay may take from the promotion to its first publish. Generous: the
/// workers' back-off is capped at 5 s and a connection attempt fails fast on loopback.
const FIRST_PUBLISH_LIMIT: Duration = Duration::from_secs(30);

/// Inserts `rows` rows numbered from `first`, keys `k0`.. as [`seed`] spreads them, and
/// returns their ids (the relay deletes rows as it goes, so they cannot be read back).
async fn insert_returning(client: &tokio_postgres::Client, first: i64, rows: i64) -> Vec<i64> {
    column(
        client,
        "INSERT INTO public.outbox (topic, key, payload, headers)
             SELECT 'events.' || (n % 3), 'k' || (n % $3::bigint), convert_to(n::text, 'UTF8'),
                    jsonb_build_object('n', n::text, 'key', 'k' || (n % $3::bigint))
             FROM generate_series($1::bigint, $1::bigint + $2::bigint - 1) AS n
             ORDER BY n
             RETURNING id",
        &[&first, &rows, &KEYS],
    )
    .await
}

async fn pending(client: &tokio_postgres::Client) -> i64 {
    count(client, "SELECT count(*) FROM public.outbox").await
}

async fn stored_count(nats: &NatsServer) -> u64 {
    nats.stream_state(STREAM).await.expect("stream state").0
}

#[tokio::test(flavor = "multi_thread")]
async fn primary_killed_and_standby_promoted_mid_stream_loses_no_row_and_keeps_key_order() {
    let primary = Postgres::start().expect("start the primary");
    let standby = Standby::start(&primary).expect("start a synchronous standby");
    let nats = NatsServer::start().expect("start nats-server");
    let mut env = Env::on(
        primary,
        nats,
        relay().workers(WORKERS as usize).batch_size(BATCH as usize),
    )
    .await;
    let url = failover_url("outbox_relay", &[&env.pg, standby.postgres()], "app");
    let client = env.client().await;
    let mut inserted = insert_returning(&client, 1, 20_000).await;
    let sent = watch_sends(&env.nats).await;

    let log = env.config.with_file_name("relay.log");
    let mut relay = env
        .command(&["run"])
        .env("OUTBOX_RELAY__POSTGRES__URL", &url)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start outbox-relay run");
    wait_until("rows to flow", Duration::from_secs(60), async || {
        pending(&client).await < 15_000
    })
    .await;

    // The primary dies mid-stream; every commit it acknowledged is on the standby.
    env.pg.stop_immediate();
    let killed = Instant::now();
    let promoted = standby.promote().expect("promote the standby");
    let promotion = killed.elapsed();
    let promoted_at = Instant::now();
    let stored_at_promotion = stored_count(&env.nats).await;
    let new_client = promoted
        .connect("app")
        .await
        .expect("connect to the new primary");
    let left = pending(&new_client).await;
    assert!(
        left > 0,
        "the relay must be mid-stream when the primary dies"
    );
    inserted.extend(insert_returning(&new_client, 20_001, 100).await);

    // The first message stored after the promotion. Batches claimed on the old primary
    // finished publishing within milliseconds of the crash, long before the promotion
    // (about 200 ms), so this is the relay working on the new primary.
    wait_until(
        Detailed("a row published after the promotion", log_of(&log)),
        FIRST_PUBLISH_LIMIT.saturating_sub(promoted_at.elapsed()),
        async || stored_count(&env.nats).await != stored_at_promotion,
    )
    .await;
    let first_publish = promoted_at.elapsed();
    eprintln!(
        "failover: kill -> promoted {promotion:?}; promoted -> first publish {first_publish:?}; \
         {left} rows pending at promotion"
    );

    // Rows committed on the new primary while the relay works are delivered too.
    for batch in 0..4 {
        inserted.extend(insert_returning(&new_client, 20_101 + batch * 100, 100).await);
    }
    wait_for_empty_outbox(&new_client, "the new primary's outbox to empty", 120).await;
    terminate_cleanly(&mut relay);

    let audit = audit(&inserted, &env.stored().await);
    audit.assert_nothing_lost_in_order();
    // The stream de-duplicates by Nats-Msg-Id; the core subscriber sees every send.
    wait_until(
        "the subscriber to see every row",
        Duration::from_secs(10),
        async || {
            let sent = sent.lock().unwrap();
            sent.iter().collect::<std::collections::HashSet<_>>().len() >= inserted.len()
        },
    )
    .await;
    let sent = sent.lock().unwrap().clone();
    let mut times: HashMap<&str, usize> = HashMap::new();
    for id in &sent {
        *times.entry(id.as_str()).or_default() += 1;
    }
    let resent: usize = times.values().map(|n| n - 1).sum();
    eprintln!(
        "failover: {} rows, {} sends, {resent} re-sent, {} duplicates stored",
        inserted.len(),
        sent.len(),
        audit.duplicates
    );
    // Only batches in flight when the primary died are sent again: one per worker.
    assert!(
        resent as i64 <= WORKERS * BATCH,
        "{resent} rows sent twice, more than the {WORKERS} batches of {BATCH} in flight"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn hung_primary_does_not_keep_the_relay_from_the_promoted_standby() {
    // The old primary does not die: it hangs (its link frozen: TCP accepted, no byte
    // answered). Each host gets the whole handshake within connect_timeout, then the next
    // host is tried; before, every attempt started again at the hung host and the relay
    // published nothing after the promotion (150 s and counting).
    let primary = Postgres::start().expect("start the primary");
    let standby = Standby::start(&primary).expect("start a synchronous standby");
    let nats = NatsServer::start().expect("start nats-server");
    let env = Env::on(
        primary,
        nats,
        relay().workers(WORKERS as usize).batch_size(BATCH as usize),
    )
    .await;
    let proxy = testkit::Proxy::start(([127, 0, 0, 1], env.pg.port()).into()).unwrap();
    let url = format!(
        "postgres://outbox_relay@127.0.0.1:{},127.0.0.1:{}/app\
         ?target_session_attrs=read-write&connect_timeout=2",
        proxy.port(),
        standby.postgres().port()
    );
    let client = env.client().await;
    let mut inserted = insert_returning(&client, 1, 5_000).await;
    let log = env.config.with_file_name("relay.log");
    let mut relay = env
        .command(&["run"])
        .env("OUTBOX_RELAY__POSTGRES__URL", &url)
        // The client deadline that gives up on a session to the hung server.
        .env("OUTBOX_RELAY__POSTGRES__STATEMENT_TIMEOUT", "5s")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start outbox-relay run");
    wait_for_empty_outbox(&client, "the first rows to be published", 60).await;

    proxy.set(testkit::Fault::Freeze);
    let promoted = standby.promote().expect("promote the standby");
    let promoted_at = Instant::now();
    let new_client = promoted
        .connect("app")
        .await
        .expect("connect to the new primary");
    let stored_before = stored_count(&env.nats).await;
    inserted.extend(insert_returning(&new_client, 5_001, 500).await);
    wait_until(
        Detailed(
            "a row published after the promotion while the old primary hangs",
            log_of(&log),
        ),
        FIRST_PUBLISH_LIMIT.saturating_sub(promoted_at.elapsed()),
        async || stored_count(&env.nats).await != stored_before,
    )
    .await;
    eprintln!(
        "hung primary: promoted -> first publish {:?}",
        promoted_at.elapsed()
    );
    wait_for_empty_outbox(&new_client, "the new primary's outbox to empty", 60).await;
    terminate_cleanly(&mut relay);
    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();
    proxy.set(testkit::Fault::None);
}
