//! The wake-up and what it costs the writers (contract section 2, "Cheap for the writer";
//! section 8, "a new row is still published within a fraction of a second"): the trigger
//! notifies only while a relay sleeps on the table (`src/relay/sleep.rs`), a sleeping
//! relay still wakes at once, and a relay that dies leaves nothing that makes writers pay.

use std::time::{Duration, Instant};

use crate::common::*;

/// The most a row committed while every relay sleeps may wait: no poll reaches it (the
/// poll interval is 30 s) and the idle look is 5 s away, so only NOTIFY can be this fast.
const PROMPT: Duration = Duration::from_secs(1);

/// Counts the notifications on the relay's channel, from a session of the test's own.
async fn count_notifications(env: &Env) -> testkit::Notifications {
    testkit::Notifications::listen(&env.db_url, "outbox_relay", None)
        .await
        .expect("listen")
}

/// The relays' marks on `public.outbox` that say asleep.
async fn asleep(client: &tokio_postgres::Client) -> i64 {
    count(
        client,
        "SELECT count(*) FROM public.outbox_relay_sleepers \
         WHERE table_name = 'public.outbox' AND asleep",
    )
    .await
}

async fn wait_asleep(client: &tokio_postgres::Client, relays: i64) {
    wait_until(
        format!("{relays} relays to sleep on the table"),
        Duration::from_secs(15),
        async || asleep(client).await == relays,
    )
    .await;
}

/// Commits one row of key `key`; its id.
async fn insert_one(client: &tokio_postgres::Client, key: &str) -> i64 {
    client
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.wake', $1, 'x') \
             RETURNING id",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

/// Commits `per_writer` one-row transactions from each of `writers` sessions at once.
async fn burst(env: &Env, writers: usize, per_writer: usize) {
    let mut tasks = Vec::new();
    for w in 0..writers {
        let client = env.client().await;
        tasks.push(tokio::spawn(async move {
            for i in 0..per_writer {
                insert_one(&client, &format!("w{w}-{}", i % 10)).await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_committed_while_every_relay_sleeps_is_published_promptly() {
    let env = Env::new(relay().poll_interval("30s")).await;
    let client = env.client().await;
    let (mut first, log) = env.spawn_run_logged();
    let mut second = env.spawn_run();
    wait_asleep(&client, 2).await;
    // At several points of the idle cycle: at once, and later into the 5 s look.
    for (round, idle) in [0u64, 700, 2_300, 3_900].into_iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(idle)).await;
        assert_eq!(
            asleep(&client).await,
            2,
            "both relays asleep before round {round}"
        );
        let committed = Instant::now();
        insert_one(&client, &format!("r{round}")).await;
        let waited = wait_until(
            Detailed("the row to be published", log_of(&log)),
            Duration::from_secs(10),
            async || count(&client, "SELECT count(*) FROM public.outbox").await == 0,
        )
        .await;
        eprintln!("round {round}, idle {idle} ms: published {waited:?} after the commit");
        assert!(
            committed.elapsed() <= PROMPT,
            "round {round}: published {:?} after the commit, more than {PROMPT:?}",
            committed.elapsed()
        );
        wait_asleep(&client, 2).await;
    }
    assert_eq!(env.stored().await.len(), 4, "each row published once");
    terminate_cleanly(&mut first);
    terminate_cleanly(&mut second);
}

#[tokio::test(flavor = "multi_thread")]
async fn writers_notify_only_while_a_relay_sleeps() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    let notified = count_notifications(&env).await;
    // No relay: nobody sleeps, nobody pays for a NOTIFY.
    burst(&env, 4, 50).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(notified.count(), 0, "no relay, no NOTIFY");

    let mut relay = env.spawn_run();
    wait_for_empty_outbox(&client, "the relay to publish the first burst", 30).await;
    wait_asleep(&client, 1).await;
    // One commit into the sleeping relay's table: one NOTIFY, and the relay wakes.
    insert_one(&client, "one").await;
    wait_until("the one row's NOTIFY", Duration::from_secs(5), async || {
        notified.count() == 1
    })
    .await;
    wait_for_empty_outbox(&client, "the one row to be published", 5).await;
    wait_asleep(&client, 1).await;

    // A burst: its first commits wake the relay and, notifying faster than the busy
    // limit, make it clear its mark; the commits after that pay nothing, until it sleeps
    // again.
    let before = notified.count();
    let (writers, each) = (8, 250);
    let started = Instant::now();
    burst(&env, writers, each).await;
    let took = started.elapsed();
    wait_for_empty_outbox(&client, "the burst to be published", 30).await;
    let during = notified.count() - before;
    let commits = writers * each;
    eprintln!("{commits} commits in {took:?} while the relay worked: {during} notified");
    assert!(
        during >= 1,
        "the sleeping relay was woken by the burst's first commits"
    );
    // The commits that notify are those before the relay counts more than the busy limit
    // and clears its mark: a few dozen, on a quiet machine and with the CPU taken by
    // other work. A relay that kept its mark while it worked would make every commit
    // notify; one that counted a burst of NOTIFYs read at once as one (a relay short of
    // CPU reads them late, in bursts) made a tenth to all of them notify.
    assert!(
        during * 10 <= commits,
        "{during} of {commits} commits notified: the relay did not stay awake while it worked"
    );
    terminate_cleanly(&mut relay);
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox_relay_sleepers").await,
        0,
        "a relay that stops removes its marks"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_relay_killed_while_asleep_leaves_no_mark_that_makes_writers_pay() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    let mut killed = env.spawn_run();
    wait_asleep(&client, 1).await;
    killed.kill().unwrap(); // SIGKILL
    killed.wait().unwrap();
    // Its mark outlives it (its LISTEN session ends with it), so writers still notify...
    let notified = count_notifications(&env).await;
    insert_one(&client, "after-kill").await;
    wait_until(
        "the stale mark's NOTIFY",
        Duration::from_secs(5),
        async || notified.count() == 1,
    )
    .await;
    // ...until the next relay's first look removes it, and marks itself.
    let mut next = env.spawn_run();
    wait_until(
        "the dead relay's mark to be removed",
        Duration::from_secs(15),
        async || {
            count(
                &client,
                "SELECT count(*) FROM public.outbox_relay_sleepers s WHERE NOT EXISTS \
                 (SELECT FROM pg_stat_activity a WHERE a.pid = s.pid)",
            )
            .await
                == 0
        },
    )
    .await;
    wait_for_empty_outbox(&client, "the row to be published", 10).await;
    terminate_cleanly(&mut next);
    let before = notified.count();
    insert_one(&client, "no-relay").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(notified.count(), before, "no relay left, no NOTIFY");
}

/// Counts the rows the relays write to their sleep marks, from a trigger of the test's.
const COUNT_MARK_WRITES: &str = "
CREATE TABLE public.mark_writes (n bigint NOT NULL);
INSERT INTO public.mark_writes VALUES (0);
CREATE FUNCTION public.count_mark_write() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog AS $$
BEGIN
    UPDATE public.mark_writes SET n = n + 1;
    RETURN NULL;
END
$$;
CREATE TRIGGER count_mark_write AFTER INSERT OR UPDATE OR DELETE
    ON public.outbox_relay_sleepers FOR EACH ROW EXECUTE FUNCTION public.count_mark_write();
";

/// A steady writer (one commit every 20 ms: 50 a second, well under the busy limit)
/// wakes the relay with each commit. The relay keeps its one mark through the whole run:
/// every row is still published within a fraction of a second, and the relay writes no
/// mark and no clearing for each gap between commits (a relay that did would write two
/// rows a commit, about 200 here).
#[tokio::test(flavor = "multi_thread")]
async fn a_steady_writer_wakes_a_relay_that_keeps_its_sleep_mark() {
    let env = Env::new(relay().poll_interval("100ms")).await;
    let client = env.client().await;
    client.batch_execute(COUNT_MARK_WRITES).await.unwrap();
    let notified = count_notifications(&env).await;
    let (mut relay, log) = env.spawn_run_logged();
    wait_asleep(&client, 1).await;
    let writes_before = count(&client, "SELECT n FROM public.mark_writes").await;
    let commits = 100;
    let mut slowest = Duration::ZERO;
    for i in 0..commits {
        let id = insert_one(&client, &format!("k{}", i % 5)).await;
        let committed = Instant::now();
        wait_until(
            Detailed(&format!("row {id} to be published"), log_of(&log)),
            Duration::from_secs(5),
            async || {
                count(
                    &client,
                    &format!("SELECT count(*) FROM public.outbox WHERE id = {id}"),
                )
                .await
                    == 0
            },
        )
        .await;
        slowest = slowest.max(committed.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let writes = count(&client, "SELECT n FROM public.mark_writes").await - writes_before;
    let notifies = notified.count();
    eprintln!(
        "{commits} commits: {notifies} notified, {writes} mark rows written, slowest row {slowest:?}"
    );
    assert!(
        notifies * 2 >= commits,
        "{notifies} of {commits} commits notified: the relay did not stay asleep between them"
    );
    assert!(
        writes <= 10,
        "{writes} mark rows written for {commits} commits: the relay marked and cleared \
         its sleep for the gaps between commits"
    );
    assert!(
        slowest <= PROMPT,
        "a row took {slowest:?} to be published, more than {PROMPT:?}"
    );
    assert_eq!(env.stored().await.len(), commits, "each row published once");
    terminate_cleanly(&mut relay);
}

/// The sleep protocol's race (`src/relay/sleep.rs`): a writer whose trigger looked before
/// the relay's mark was committed does not notify; the relay must not sleep until that
/// writer has ended. Here the writer's transaction is open across the relay's start, once
/// in `READ COMMITTED` (its INSERT, and so its look, before the mark) and once in
/// `REPEATABLE READ` (its snapshot before the mark, its INSERT after). A relay that slept
/// at once would meet the row at its 5 s look; one that keeps polling while the writer
/// runs publishes it within a poll interval of the commit.
#[tokio::test(flavor = "multi_thread")]
async fn a_writer_that_looked_before_the_relay_slept_is_not_left_waiting() {
    let env = Env::new(relay().poll_interval("200ms")).await;
    let client = env.client().await;
    for isolation in ["READ COMMITTED", "REPEATABLE READ"] {
        let mut writer = env.client().await;
        let tx = writer
            .build_transaction()
            .isolation_level(match isolation {
                "READ COMMITTED" => tokio_postgres::IsolationLevel::ReadCommitted,
                _ => tokio_postgres::IsolationLevel::RepeatableRead,
            })
            .start()
            .await
            .unwrap();
        if isolation == "READ COMMITTED" {
            insert_one_in(&tx, "straddler").await;
        } else {
            tx.query_one("SELECT count(*) FROM public.outbox", &[])
                .await
                .unwrap();
        }
        let (mut relay, log) = env.spawn_run_logged();
        wait_asleep(&client, 1).await;
        // Long enough for a relay that skipped the wait to confirm its sleep.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        if isolation == "REPEATABLE READ" {
            insert_one_in(&tx, "straddler").await;
        }
        tx.commit().await.unwrap();
        let committed = Instant::now();
        wait_until(
            Detailed("the straddling writer's row", log_of(&log)),
            Duration::from_secs(10),
            async || count(&client, "SELECT count(*) FROM public.outbox").await == 0,
        )
        .await;
        eprintln!(
            "{isolation}: published {:?} after the commit",
            committed.elapsed()
        );
        assert!(
            committed.elapsed() <= PROMPT,
            "{isolation}: published {:?} after the commit, more than {PROMPT:?}",
            committed.elapsed()
        );
        terminate_cleanly(&mut relay);
    }
}

async fn insert_one_in(tx: &tokio_postgres::Transaction<'_>, key: &str) {
    tx.execute(
        "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.wake', $1, 'x')",
        &[&key],
    )
    .await
    .unwrap();
}

/// The trigger and function the releases before this one installed: NOTIFY on every
/// INSERT statement.
const PREVIOUS_TRIGGER: &str = "
CREATE OR REPLACE FUNCTION public.outbox_relay_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS outbox_relay_wake ON public.outbox;
CREATE TRIGGER outbox_relay_notify AFTER INSERT ON public.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION public.outbox_relay_notify();
DROP TABLE public.outbox_relay_sleepers;
DELETE FROM public.outbox_relay_migrations WHERE version = 7;
CREATE INDEX outbox_pending_idx ON public.outbox (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
";

#[tokio::test(flavor = "multi_thread")]
async fn upgrading_from_the_previous_release_keeps_every_pending_row_and_its_order() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    client.batch_execute(PREVIOUS_TRIGGER).await.unwrap();
    seed(&client, 2_000, 20, 0).await;
    let pending: Vec<i64> = ids(&client).await;
    // A relay of this release on the table as the previous release left it: the old
    // trigger notifies on every commit, and the relay needs no marks for it.
    let mut relay = env.spawn_run();
    wait_for_empty_outbox(&client, "the rows to be published before the upgrade", 30).await;
    terminate_cleanly(&mut relay);
    seed(&client, 2_000, 20, 0).await;
    let mut pending: Vec<i64> = pending.into_iter().chain(ids(&client).await).collect();

    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("0007_sleepers"), "{}", text(&out));
    // In delete mode the claims read the primary key: the previous release's pending
    // index goes, and the application's rows stop paying for it.
    assert!(
        text(&out).contains("index \"outbox_pending_idx\" dropped concurrently"),
        "{}",
        text(&out)
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pg_indexes WHERE indexname = 'outbox_pending_idx'"
        )
        .await,
        0
    );
    let triggers: Vec<String> = column(
        &client,
        "SELECT tgname::text FROM pg_trigger WHERE tgrelid = 'public.outbox'::regclass \
         AND NOT tgisinternal",
        &[],
    )
    .await;
    assert_eq!(triggers, vec!["outbox_relay_wake".to_owned()]);
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        2_000,
        "migrate left every pending row"
    );
    // The relay's role needs the new table: `check` says so, and the grant file gives it.
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("outbox_relay_sleepers") && text(&out).contains("GRANT"),
        "{}",
        text(&out)
    );
    grant_relay_role(&client, "public.outbox").await;
    // The relay marks itself asleep, and wakes on NOTIFY.
    let mut relay = env.spawn_run();
    wait_for_empty_outbox(&client, "the rows to be published after the upgrade", 30).await;
    wait_asleep(&client, 1).await;
    pending.push(insert_one(&client, "after").await);
    wait_for_empty_outbox(&client, "a row committed after the upgrade", 5).await;
    terminate_cleanly(&mut relay);
    let stored = env.stored().await;
    let audit = audit(&pending, &stored);
    audit.assert_nothing_lost_in_order();
}
