//! Networks that stall without closing, and slow links: a TCP proxy (`testkit::Proxy`)
//! between the relay and PostgreSQL or NATS freezes every connection (bytes stop, sockets
//! stay open) or delays every chunk.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use testkit::{Fault, Proxy};

async fn pending(client: &tokio_postgres::Client) -> i64 {
    count(client, "SELECT count(*) FROM public.outbox").await
}

/// Pending rows another session could lock now: all of them once no relay transaction
/// holds any.
async fn lockable(client: &mut tokio_postgres::Client) -> i64 {
    let tx = client.transaction().await.unwrap();
    let row = tx
        .query_one(
            "SELECT count(*) FROM (SELECT 1 FROM public.outbox FOR UPDATE SKIP LOCKED) s",
            &[],
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    row.get(0)
}

/// `cmd` with the relay's role connecting through `proxy`.
fn via_postgres_proxy(proxy: &Proxy, mut cmd: Command) -> Command {
    cmd.env(
        "OUTBOX_RELAY__POSTGRES__URL",
        format!("postgres://outbox_relay@127.0.0.1:{}/app", proxy.port()),
    );
    cmd
}

fn spawn(cmd: &mut Command) -> Child {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// A frozen PostgreSQL connection: the relay's client deadline fires and the session is
/// discarded; on the server, a frozen session's transaction ends at
/// `idle_in_transaction_session_timeout` (publish_timeout + 10 s) at the latest, so the row
/// locks it held are released within that bound; once the network is back the relay
/// finishes the table on new sessions, losing nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_database_connection_releases_its_row_locks_within_the_bound_and_loses_nothing() {
    let env = Env::new(relay().workers(2).batch_size(200)).await;
    env.write_config(
        &relay()
            .workers(2)
            .batch_size(200)
            .publish_timeout("5s")
            .drain_timeout("10s"),
    );
    let mut client = env.client().await;
    let proxy = Proxy::start(format!("127.0.0.1:{}", env.pg.port()).parse().unwrap()).unwrap();
    let mut relay = spawn(
        via_postgres_proxy(&proxy, env.command(&["run"]))
            .env("OUTBOX_RELAY__POSTGRES__STATEMENT_TIMEOUT", "2s"),
    );
    // Batches stuck publishing to a paused broker hold their row locks; then the
    // database link freezes under them, and the broker comes back.
    // Connected to both: a first row published (pausing the broker before the relay has
    // connected to it would stall its start-up instead, and no batch would hold a lock).
    seed(&client, 1, 1, 0).await;
    let mut inserted = ids(&client).await;
    wait_until(
        "the relay to publish a first row",
        Duration::from_secs(30),
        async || pending(&client).await == 0,
    )
    .await;
    env.nats.pause();
    seed(&client, 20_000, 50, 0).await;
    inserted.extend(ids(&client).await);
    wait_until(
        "a batch to hold row locks",
        Duration::from_secs(30),
        async || lockable(&mut client).await < pending(&client).await,
    )
    .await;
    proxy.set(Fault::Freeze);
    let frozen = Instant::now();
    env.nats.resume();
    // The bound: idle_in_transaction_session_timeout (5 s + 10 s), plus a margin.
    let bound = Duration::from_secs(15 + 5);
    wait_until(
        "the row locks to be released after the freeze",
        bound.saturating_sub(frozen.elapsed()),
        async || {
            let left = pending(&client).await;
            lockable(&mut client).await == left
        },
    )
    .await;
    let released = frozen.elapsed();
    eprintln!("row locks released {released:?} after the freeze");
    assert!(
        relay.try_wait().unwrap().is_none(),
        "the relay keeps running"
    );

    proxy.set(Fault::None);
    wait_for_empty_outbox(&client, "the relay to finish on new sessions", 60).await;
    terminate_cleanly(&mut relay);
    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();
}

/// 200 ms each way on the database link, then on the broker link: still every row, in
/// key order; the cost in throughput is printed beside the same drain without latency.
#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_ms_on_either_link_still_delivers_every_row_in_key_order() {
    let env = Env::new(relay().workers(4).batch_size(500)).await;
    let client = env.client().await;
    let pg = Proxy::start(format!("127.0.0.1:{}", env.pg.port()).parse().unwrap()).unwrap();
    let nats = Proxy::start(format!("127.0.0.1:{}", env.nats.port()).parse().unwrap()).unwrap();
    let rows = 1_000;
    let mut rates = Vec::new();
    for (pg_fault, nats_fault) in [
        (Fault::None, Fault::None),
        (Fault::Latency(Duration::from_millis(200)), Fault::None),
        (Fault::None, Fault::Latency(Duration::from_millis(200))),
    ] {
        pg.set(pg_fault);
        nats.set(nats_fault);
        seed(&client, rows, 100, 0).await;
        let mut cmd = via_postgres_proxy(&pg, env.command(&["drain", "--timeout", "120s"]));
        cmd.env(
            "OUTBOX_RELAY__SINK__NATS__URL",
            format!("nats://127.0.0.1:{}", nats.port()),
        );
        let started = Instant::now();
        let out = cmd.output_within(RUN_LIMIT).unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        rates.push(rows as f64 / started.elapsed().as_secs_f64());
    }
    eprintln!(
        "{rows} rows: {:.0} rows/s direct; with 200 ms each way on the database link {:.0} \
         rows/s ({:.2}), on the broker link {:.0} rows/s ({:.2})",
        rates[0],
        rates[1],
        rates[1] / rates[0],
        rates[2],
        rates[2] / rates[0]
    );
    assert_eq!(pending(&client).await, 0);
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 3 * rows as usize, "every row");
    assert_eq!(delivery.order_violations(), Vec::<String>::new());
}
