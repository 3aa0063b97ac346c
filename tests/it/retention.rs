//! `relay.retention` in mark mode (issue 14): published rows older than the retention are
//! deleted in small chunks that never wait for a lock; young published rows, pending rows
//! and dead rows are kept.

use std::time::Duration;

use crate::common::*;

/// Mark mode, published rows kept 5 s, a failed row dead at once.
fn mark_with_retention() -> Relay {
    relay().on_publish("mark").retention("5s").max_attempts(1)
}

async fn present(client: &tokio_postgres::Client, from: i64, to: i64) -> i64 {
    count(
        client,
        &format!("SELECT count(*) FROM public.outbox WHERE id BETWEEN {from} AND {to}"),
    )
    .await
}

async fn max_id(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT COALESCE(max(id), 0) FROM public.outbox", &[])
        .await
        .unwrap()
        .get(0)
}

/// 5,000 rows are published and marked; 5 s later they are deleted, except the one row
/// another session holds locked (skipped, not waited for: the rest of its chunk goes
/// meanwhile), which goes once the lock is released. Rows published later are all still
/// there right after they are marked, then go too. A dead row, and the row of its key it
/// holds back, stay. The counter says how many rows retention deleted.
#[tokio::test(flavor = "multi_thread")]
async fn mark_mode_retention_deletes_old_published_rows_and_keeps_young_pending_and_dead_ones() {
    let env = Env::new(mark_with_retention()).await;
    let listen = format!("127.0.0.1:{}", testkit::free_port());
    env.write_config(&mark_with_retention().http(&listen));
    let client = env.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload, headers) VALUES
               ('events.a', 'poison', 'dead', '{\"n\": 2}'),
               ('events.a', 'poison', 'held back', NULL)",
        )
        .await
        .unwrap();
    seed(&client, 5_000, 50, 0).await;
    let first = max_id(&client).await;
    let mut relay = env.spawn_run();

    wait_until(
        "the first rows to be marked",
        Duration::from_secs(30),
        async || {
            count(
                &client,
                "SELECT count(*) FROM public.outbox WHERE published_at IS NOT NULL",
            )
            .await
                == 5_000
        },
    )
    .await;
    let mut locker = env.client().await;
    let lock = locker.transaction().await.unwrap();
    let locked: i64 = lock
        .query_one(
            "SELECT id FROM public.outbox WHERE id = (SELECT id FROM public.outbox \
             WHERE published_at IS NOT NULL ORDER BY id OFFSET 10 LIMIT 1) FOR UPDATE",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    wait_until(
        "old published rows but the locked one to be deleted",
        Duration::from_secs(20),
        async || present(&client, 3, first).await == 1,
    )
    .await;
    assert_eq!(
        count(
            &client,
            &format!("SELECT count(*) FROM public.outbox WHERE id = {locked}")
        )
        .await,
        1,
        "the locked row is skipped"
    );

    // Rows published now are young: all of them are there once marked (within 4 s: before
    // the first of them is 5 s old).
    seed(&client, 2_000, 50, 0).await;
    let second = max_id(&client).await;
    wait_until(
        "the later rows to be marked, none deleted yet",
        Duration::from_secs(4),
        async || {
            count(
                &client,
                &format!(
                    "SELECT count(*) FROM public.outbox WHERE id > {first} \
                     AND published_at IS NOT NULL"
                ),
            )
            .await
                == 2_000
        },
    )
    .await;

    lock.rollback().await.unwrap();
    wait_until(
        "the later rows and the unlocked row to be deleted",
        Duration::from_secs(30),
        async || present(&client, 3, second).await == 0,
    )
    .await;
    let kept = client
        .query(
            "SELECT payload, dead_at IS NOT NULL, published_at IS NOT NULL \
             FROM public.outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            (
                String::from_utf8(r.get::<_, Vec<u8>>(0)).unwrap(),
                r.get::<_, bool>(1),
                r.get::<_, bool>(2),
            )
        })
        .collect::<Vec<_>>();
    assert_eq!(
        kept,
        vec![
            ("dead".to_owned(), true, false),
            ("held back".to_owned(), false, false)
        ]
    );
    assert_eq!(
        scrape(&listen, "outbox_relay_rows_deleted_by_retention_total{"),
        Some(7_000.0)
    );
    assert_eq!(env.stored().await.len(), 7_000);
    terminate_cleanly(&mut relay);
}

/// A relay in delete mode has no published rows to keep: retention there is a mistake in
/// the config, and a table without a creation-time column cannot tell where old rows end.
#[tokio::test(flavor = "multi_thread")]
async fn retention_outside_mark_mode_or_without_created_at_is_refused_with_the_fix() {
    let env = Env::new(relay()).await;
    env.write_config(&relay().retention("7d"));
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains(
            "relay.retention: applies to on_publish = \"mark\" only (in delete mode no \
             published row is kept): remove it, or set relay.on_publish = \"mark\""
        ),
        "{}",
        text(&out)
    );

    let owner = env.client().await;
    owner
        .batch_execute("ALTER TABLE public.outbox DROP COLUMN created_at")
        .await
        .unwrap();
    env.write_config(&relay().on_publish("mark").retention("7d"));
    let out = env.relay(&["drain", "--timeout", "10s"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(
            "relay.retention needs a creation-time column to tell where the old rows end"
        ),
        "{}",
        text(&out)
    );
}

/// Section 8 (History): retention's delete keeps its plan on the statistics autovacuum
/// leaves on an outbox it analyzed empty (its pages, no row counted on them). Planned
/// there, the delete joined the rows it chose back to the table by walking the whole
/// primary key and choosing them again for every entry, and ran into `statement_timeout`
/// at every chunk: published rows were never deleted. Here 50,000 rows published an hour
/// ago go within the wait, and no statement of the relay times out.
#[tokio::test(flavor = "multi_thread")]
async fn retention_keeps_its_pace_on_a_refilled_outbox_analyzed_empty() {
    let env = Env::new(mark_with_retention()).await;
    set_statement_timeout(&env, "2s");
    let client = env.client().await;
    refill_analyzed_empty(&client, 50_000).await;
    client
        .batch_execute("UPDATE public.outbox SET published_at = now() - interval '1 hour'")
        .await
        .unwrap();
    let (mut relay, log) = env.spawn_run_logged();
    wait_until(
        "every row published an hour ago to be deleted",
        Duration::from_secs(30),
        async || count(&client, "SELECT count(*) FROM public.outbox").await == 0,
    )
    .await;
    terminate_cleanly(&mut relay);
    let log = std::fs::read_to_string(log).unwrap();
    assert!(
        !log.contains("statement timeout"),
        "a statement ran into statement_timeout:\n{log}"
    );
}
