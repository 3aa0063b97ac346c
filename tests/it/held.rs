//! The held rows (migration 0008): every outbox row that holds back its key's later rows
//! (dead, or with a failure history) is mirrored in `<schema>.outbox_relay_held`, which the
//! claims read instead of two partial indexes on the outbox that every INSERT paid for.
//! The mirror must be exact at every commit, whoever changes a row: a row missing there
//! would let a claim publish its key's later rows first.

use std::time::Duration;

use crate::common::*;

/// The held rows as the outbox says (unpublished, dead or with a next attempt) and as the
/// mirror holds them, each as `id key next_attempt_at dead_at` lines in id order.
async fn held_both_ways(client: &tokio_postgres::Client) -> (Vec<String>, Vec<String>) {
    let line = "id || ' ' || coalesce(key, '-') || ' ' || coalesce(next_attempt_at::text, '-') \
                || ' ' || coalesce(dead_at::text, '-')";
    let outbox = column(
        client,
        &format!(
            "SELECT {line} FROM public.outbox WHERE published_at IS NULL \
             AND (dead_at IS NOT NULL OR next_attempt_at IS NOT NULL) ORDER BY id"
        ),
        &[],
    )
    .await;
    let mirror = column(
        client,
        &format!(
            "SELECT {line} FROM public.outbox_relay_held WHERE table_name = 'public.outbox' \
             ORDER BY id"
        ),
        &[],
    )
    .await;
    (outbox, mirror)
}

/// Runs `sql` (as the relay's least-privilege role, which may update the outbox's
/// bookkeeping columns and only read the mirror), then checks the mirror against the
/// outbox, and that it holds `expected` rows.
async fn after(client: &tokio_postgres::Client, sql: &str, expected: usize) {
    client.batch_execute(sql).await.expect(sql);
    let (outbox, mirror) = held_both_ways(client).await;
    assert_eq!(mirror, outbox, "the mirror after {sql}");
    assert_eq!(outbox.len(), expected, "held rows after {sql}: {outbox:?}");
}

/// Every way a row becomes held, changes while held, or stops being held, each by a plain
/// statement of a role that cannot write the mirror itself: the triggers keep it exact.
#[tokio::test(flavor = "multi_thread")]
async fn held_rows_are_mirrored_exactly_whoever_changes_them() {
    let env = Env::new(relay()).await;
    let owner = env.client().await;
    seed(&owner, 8, 3, 0).await;
    let (relay_role, connection) =
        tokio_postgres::connect(&as_relay_role(&env.db_url), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let c = &relay_role;
    assert!(
        c.batch_execute("DELETE FROM public.outbox_relay_held")
            .await
            .is_err(),
        "the relay's role only reads the mirror"
    );
    after(c, "SELECT 1", 0).await;
    // A failed attempt, as the relay records it: waiting for the next one.
    after(
        c,
        "UPDATE public.outbox SET attempts = 1, last_error = 'x', \
         next_attempt_at = now() + interval '1 hour' WHERE id IN (1, 2)",
        2,
    )
    .await;
    // The last attempt failed: dead.
    after(
        c,
        "UPDATE public.outbox SET attempts = 2, dead_at = now(), next_attempt_at = NULL \
         WHERE id = 2",
        2,
    )
    .await;
    // Published on a later attempt (mark mode), and deleted (delete mode).
    after(
        c,
        "UPDATE public.outbox SET published_at = now() WHERE id = 1",
        1,
    )
    .await;
    // Requeued, as `requeue` does: due now, with its history.
    after(
        c,
        "UPDATE public.outbox SET dead_at = NULL, attempts = 0, next_attempt_at = now() \
         WHERE id = 2",
        1,
    )
    .await;
    after(c, "DELETE FROM public.outbox WHERE id = 2", 0).await;
    // A transaction rolled back leaves nothing behind.
    after(
        c,
        "BEGIN; UPDATE public.outbox SET dead_at = now() WHERE id = 3; ROLLBACK",
        0,
    )
    .await;
    // `replay`: a published row pending again, held until released.
    after(
        c,
        "UPDATE public.outbox SET published_at = NULL, next_attempt_at = 'infinity' \
         WHERE id = 1",
        1,
    )
    .await;
    // By hand, as the table's owner: a key changed while held, many rows at once, then
    // the table emptied.
    after(
        &owner,
        "UPDATE public.outbox SET key = 'moved' WHERE id = 1",
        1,
    )
    .await;
    after(
        &owner,
        "UPDATE public.outbox SET dead_at = now() WHERE id >= 5",
        5,
    )
    .await;
    // Rescheduled while held (its row in the mirror written in place), and a held row
    // given another order value.
    after(
        &owner,
        "UPDATE public.outbox SET next_attempt_at = now() + interval '2 hours' WHERE id = 1",
        5,
    )
    .await;
    after(
        &owner,
        "UPDATE public.outbox SET id = id + 100 WHERE id = 5",
        5,
    )
    .await;
    after(&owner, "TRUNCATE public.outbox", 0).await;
}

/// The state of a table migrated by the release before migration 0008: the held and retry
/// indexes, no mirror and no triggers.
const BEFORE_HELD_ROWS: &str = "
DROP TRIGGER outbox_relay_hold ON public.outbox;
DROP TRIGGER outbox_relay_hold_delete ON public.outbox;
DROP TRIGGER outbox_relay_hold_truncate ON public.outbox;
DROP TABLE public.outbox_relay_held;
DELETE FROM public.outbox_relay_migrations WHERE version = 8;
CREATE INDEX outbox_held_idx ON public.outbox (key, id)
    WHERE published_at IS NULL AND (dead_at IS NOT NULL OR next_attempt_at IS NOT NULL);
CREATE INDEX outbox_retry_idx ON public.outbox (id)
    WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at IS NOT NULL;
";

/// Upgrading a table whose rows are already held: `migrate` copies them into the mirror
/// and drops the two indexes, and the relay keeps each held key's later rows back (a dead
/// row's until it is requeued, a waiting row's until it is due), then publishes them in
/// order.
#[tokio::test(flavor = "multi_thread")]
async fn upgrading_keeps_the_rows_held_before_it_holding_their_keys() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    client.batch_execute(BEFORE_HELD_ROWS).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) \
             SELECT 'events.held', k, convert_to(n::text, 'UTF8') FROM (VALUES \
             (1, 'dead'), (2, 'dead'), (3, 'dead'), (4, 'free'), (5, 'free'), \
             (6, 'waiting'), (7, 'waiting')) AS r(n, k) ORDER BY n;
             UPDATE public.outbox SET attempts = 3, dead_at = now() WHERE id = 1;
             UPDATE public.outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour' \
             WHERE id = 6;",
        )
        .await
        .unwrap();
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    for index in ["outbox_held_idx", "outbox_retry_idx"] {
        assert!(
            text(&out).contains(&format!("{index}\" dropped concurrently")),
            "{}",
            text(&out)
        );
    }
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pg_indexes WHERE indexname IN ('outbox_held_idx', 'outbox_retry_idx')"
        )
        .await,
        0
    );
    let (outbox, mirror) = held_both_ways(&client).await;
    assert_eq!(mirror, outbox);
    assert_eq!(mirror.len(), 2, "{mirror:?}");
    // The role's grants on the new table, as the upgrade notes say.
    grant_relay_role(&client, "public.outbox").await;

    let (mut relay, _log) = env.spawn_run_logged();
    // One claim sees rows 2-7 at once: rows 4 and 5 go, and with them any row the
    // claim did not know to be held back.
    wait_until(
        "rows 4 and 5 published",
        Duration::from_secs(30),
        async || {
            count(
                &client,
                "SELECT count(*) FROM public.outbox WHERE id IN (4, 5)",
            )
            .await
                == 0
        },
    )
    .await;
    assert_eq!(
        column::<i64, Vec<i64>>(&client, "SELECT id FROM public.outbox ORDER BY id", &[]).await,
        [1, 2, 3, 6, 7],
        "the rows behind the dead row and the waiting row stay"
    );
    let published: Vec<String> = env
        .stored()
        .await
        .iter()
        .filter_map(|m| m.header("Nats-Msg-Id").map(str::to_owned))
        .collect();
    assert_eq!(published, ["public.outbox:4", "public.outbox:5"]);
    // Requeued and due: everything goes, in order.
    client
        .batch_execute(
            "UPDATE public.outbox SET dead_at = NULL, attempts = 0, next_attempt_at = now() \
             WHERE id = 1; UPDATE public.outbox SET next_attempt_at = now() WHERE id = 6",
        )
        .await
        .unwrap();
    wait_for_empty_outbox(&client, "the released rows", 30).await;
    terminate_cleanly(&mut relay);
    audit(&[1, 2, 3, 4, 5, 6, 7], &env.stored().await).assert_nothing_lost_in_order();
    let (outbox, mirror) = held_both_ways(&client).await;
    assert!(outbox.is_empty() && mirror.is_empty(), "{mirror:?}");
}

/// A row inserted with `next_attempt_at` in the future (a scheduled publish) has no row in
/// `outbox_relay_held` at first: no trigger sees an INSERT. It holds back its key all the
/// same: a claim's read from the floor on holds it (a prefix of the pending rows), and
/// leaves out its key's later rows; then the floor's look gives it its held row, so the
/// floor may pass it and claims find it there. Checked on the relay's own statements.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_scheduled_at_insert_holds_its_key_before_and_after_it_has_its_held_row() {
    use outbox_relay::source::claim::{BUCKETS, FIRST_WINDOW};
    let env = Env::new(relay()).await;
    let client = env.client().await;
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload, next_attempt_at) VALUES
               ('events.a', 'k', '1', now() + interval '1 hour');
             INSERT INTO public.outbox (topic, key, payload) VALUES
               ('events.a', 'k', '2'), ('events.a', 'other', '3'), ('events.a', 'k', '4')",
        )
        .await
        .unwrap();
    let (_source, tables) = env.tables().await;
    let sql = &tables[0].sql;
    let all_buckets: Vec<i32> = (0..BUCKETS).collect();
    let reads = async || {
        let mut window: Vec<i64> = client
            .query(&sql.window, &[&100i64, &i64::MIN, &Vec::<i64>::new()])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        window.sort_unstable();
        let mut pick: Vec<i64> = client
            .query(
                &sql.pick_lock,
                &[
                    &FIRST_WINDOW,
                    &100i64,
                    &all_buckets,
                    &i64::MIN,
                    &Vec::<i64>::new(),
                    &sql.tag,
                    &(BUCKETS as i64),
                    &0i64,
                    &i64::MAX,
                ],
            )
            .await
            .unwrap()
            .iter()
            .filter_map(|r| r.get::<_, Option<i64>>(r.len() - 4))
            .collect();
        pick.sort_unstable();
        (window, pick)
    };
    let (outbox, mirror) = held_both_ways(&client).await;
    assert_eq!((outbox.len(), mirror.len()), (1, 0), "not mirrored yet");
    assert_eq!(
        reads().await,
        (vec![3], vec![3]),
        "the first window and a bucket read take only `other`"
    );
    // The floor's look from the start: row 1 is its candidate, and gets its held row.
    client
        .query_one(&sql.advance, &[&i64::MIN, &Vec::<i64>::new(), &false])
        .await
        .unwrap();
    let (outbox, mirror) = held_both_ways(&client).await;
    assert_eq!(mirror, outbox, "mirrored by the floor's look");
    assert_eq!(mirror.len(), 1);
    assert_eq!(reads().await, (vec![3], vec![3]), "and still held back");
}
