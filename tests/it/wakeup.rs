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

/// The relay logging (at debug) to `log` says NOTIFY covers `public.outbox`: its last word
/// on the table's sleep is step 5 of the protocol (`relay::sleep`), not a mark set or
/// cleared since. The mark in the database is written at step 3 and stays until the
/// relay clears it, so a mark seen asleep may belong to a table a raise just woke.
fn covered(log: &std::path::Path) -> bool {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains("public.outbox"))
        .filter_map(|l| {
            ["Asleep: NOTIFY covers", "Awake:", "Sleep mark set"]
                .into_iter()
                .find(|m| l.contains(m))
        })
        .next_back()
        == Some("Asleep: NOTIFY covers")
}

/// Waits until the one relay logging to `log` sleeps on `public.outbox` with NOTIFY
/// covering it ([`covered`], and its mark in the database).
async fn wait_covered(client: &tokio_postgres::Client, log: &std::path::Path) {
    wait_until(
        Detailed("the relay to sleep on the table", log_of(log)),
        Duration::from_secs(15),
        async || covered(log) && asleep(client).await == 1,
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

/// Waits for every row to be published (at most 10 s) and asserts that the last one
/// committed at `committed` took no more than [`PROMPT`]; `what` names it in the messages.
async fn published_promptly(
    client: &tokio_postgres::Client,
    log: &std::path::Path,
    what: &str,
    committed: Instant,
) {
    wait_until(
        Detailed(what, log_of(log)),
        Duration::from_secs(10),
        async || count(client, "SELECT count(*) FROM public.outbox").await == 0,
    )
    .await;
    eprintln!(
        "{what}: published {:?} after the commit",
        committed.elapsed()
    );
    assert!(
        committed.elapsed() <= PROMPT,
        "{what}: published {:?} after the commit, more than {PROMPT:?}",
        committed.elapsed()
    );
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
        let what = format!("round {round}, idle {idle} ms");
        published_promptly(&client, &log, &what, committed).await;
        wait_asleep(&client, 2).await;
    }
    assert_eq!(env.stored().await.len(), 4, "each row published once");
    terminate_cleanly(&mut first);
    terminate_cleanly(&mut second);
}

/// The wake-up is the attempts column's default, computed for every row whatever writes
/// it: several rows in one INSERT, a COPY, an INSERT in a subtransaction each wake the
/// sleeping relay at once (a relay that heard nothing meets them at its 5 s look).
#[tokio::test(flavor = "multi_thread")]
async fn rows_of_any_insert_statement_wake_a_sleeping_relay() {
    let env = Env::new(relay().poll_interval("30s")).await;
    let client = env.client().await;
    let (mut relay, log) = env.spawn_run_logged();
    wait_asleep(&client, 1).await;
    let writes = [
        (
            "INSERT ... SELECT",
            "INSERT INTO public.outbox (topic, key, payload) \
             SELECT 'events.wake', 'k' || i, 'x' FROM generate_series(1, 3) i",
        ),
        (
            "COPY",
            "COPY public.outbox (topic, key, payload) \
             FROM PROGRAM 'printf \"events.wake\\tc1\\tx\\nevents.wake\\tc2\\tx\\n\"'",
        ),
        (
            "a subtransaction",
            "BEGIN; SAVEPOINT s; \
             INSERT INTO public.outbox (topic, key, payload) VALUES ('events.wake', 's', 'x'); \
             RELEASE SAVEPOINT s; COMMIT",
        ),
    ];
    for (what, sql) in writes {
        client.batch_execute(sql).await.unwrap();
        published_promptly(&client, &log, what, Instant::now()).await;
        wait_asleep(&client, 1).await;
    }
    assert_eq!(env.stored().await.len(), 6, "each row published once");
    terminate_cleanly(&mut relay);
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

    let (mut relay, log) = env.spawn_run_logged();
    wait_for_empty_outbox(&client, "the relay to publish the first burst", 30).await;
    wait_covered(&client, &log).await;
    // One commit into the sleeping relay's table: one NOTIFY, and the relay wakes.
    insert_one(&client, "one").await;
    let heard = || format!("{} heard; {}", notified.count(), log_of(&log)());
    wait_until(
        Detailed("the one row's NOTIFY", heard),
        Duration::from_secs(5),
        async || notified.count() == 1,
    )
    .await;
    wait_for_empty_outbox(&client, "the one row to be published", 5).await;
    wait_covered(&client, &log).await;

    // A burst: its first commits wake the relay and, notifying faster than the busy
    // limit, make it clear its mark; the commits after that pay nothing, until it sleeps
    // again.
    let before = notified.count();
    let (writers, each) = (8, 500);
    let started = Instant::now();
    burst(&env, writers, each).await;
    let took = started.elapsed();
    wait_for_empty_outbox(&client, "the burst to be published", 30).await;
    let during = notified.count() - before;
    let commits = writers * each;
    eprintln!("{commits} commits in {took:?} while the relay worked: {during} notified");
    assert!(
        during >= 1,
        "the sleeping relay was woken by the burst's first commits; {}",
        log_of(&log)()
    );
    // The commits that notify are those before the relay counts more than the busy limit
    // and clears its mark: a few dozen on a quiet machine, a few hundred with the CPU
    // taken by other work (the relay hears them late), whatever the burst's length. A relay that kept its mark while it worked would make every commit
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
        let what = format!("{isolation}: the straddling writer's row");
        published_promptly(&client, &log, &what, Instant::now()).await;
        terminate_cleanly(&mut relay);
    }
}

/// The advisory lock the writer of the test below waits for inside its INSERT.
const HOLD_INSERT: i64 = 0x686f_6c64; // "hold"

/// A writer's wake-up check and its row are two moments of one INSERT: PostgreSQL computes
/// the row (and its column defaults) first, and a transaction that has written nothing
/// yet gets its transaction id only when the row is written. Here a writer's INSERT, the
/// first statement of its transaction, stops between the two (a BEFORE ROW trigger waits
/// for an advisory lock the test holds) while the relay goes to sleep, then commits. A
/// check that read the sleep sequence while the writer had no transaction id lets the
/// relay sleep without waiting for that writer: it meets the row at its 5 s look. One
/// that gives the transaction its id first keeps the relay polling until the writer ends.
/// (The id sequence's `nextval` also gives the transaction its id, when it writes the
/// sequence to the WAL: once every 32 values. The test takes one value first, so that
/// the writer's does not.)
#[tokio::test(flavor = "multi_thread")]
async fn a_writer_stopped_between_its_wake_check_and_its_row_is_not_left_waiting() {
    let env = Env::new(relay().poll_interval("200ms")).await;
    let client = env.client().await;
    client
        .batch_execute(&format!(
            "CREATE FUNCTION public.test_hold() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 PERFORM pg_advisory_lock({HOLD_INSERT});
                 PERFORM pg_advisory_unlock({HOLD_INSERT});
                 RETURN NEW;
             END $$;
             CREATE TRIGGER test_hold BEFORE INSERT ON public.outbox
                 FOR EACH ROW EXECUTE FUNCTION public.test_hold();
             SELECT pg_advisory_lock({HOLD_INSERT});
             SELECT nextval(pg_get_serial_sequence('public.outbox', 'id'));"
        ))
        .await
        .unwrap();
    let writer = env.client().await;
    let insert = tokio::spawn(async move {
        writer
            .batch_execute(
                "BEGIN; \
                 INSERT INTO public.outbox (topic, key, payload) VALUES ('events.wake', 'held', 'x'); \
                 COMMIT",
            )
            .await
    });
    let waiting = format!(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND objid = {HOLD_INSERT}"
    );
    wait_until(
        "the writer to stop inside its INSERT",
        Duration::from_secs(10),
        async || count(&client, &waiting).await == 1,
    )
    .await;
    let (mut relay, log) = env.spawn_run_logged();
    wait_asleep(&client, 1).await;
    // Long enough for a relay that did not wait for the writer to confirm its sleep.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    client
        .execute(&format!("SELECT pg_advisory_unlock({HOLD_INSERT})"), &[])
        .await
        .unwrap();
    insert.await.unwrap().expect("the writer commits");
    published_promptly(&client, &log, "the stopped writer's row", Instant::now()).await;
    terminate_cleanly(&mut relay);
}

async fn insert_one_in(tx: &tokio_postgres::Transaction<'_>, key: &str) {
    tx.execute(
        "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.wake', $1, 'x')",
        &[&key],
    )
    .await
    .unwrap();
}

/// The wake-up trigger of the release before this one: NOTIFY while a relay sleeps, with
/// the check in the trigger's WHEN condition instead of the attempts column's default.
const WAKE_TRIGGER: &str = "
CREATE OR REPLACE FUNCTION public.outbox_relay_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    RETURN NULL;
END
$$;
ALTER TABLE public.outbox ALTER COLUMN attempts SET DEFAULT 0;
CREATE TRIGGER outbox_relay_wake
    AFTER INSERT ON public.outbox
    FOR EACH STATEMENT
    WHEN (pg_catalog.pg_sequence_last_value('\"public\".\"outbox_sleeping\"'::pg_catalog.regclass) IS NOT NULL)
    EXECUTE FUNCTION public.outbox_relay_wake();
";

/// The wake-ups of `public.outbox`: its triggers, and `nudge` for the attempts column's
/// default when it calls `outbox_relay_nudge`.
async fn wake_ups(client: &tokio_postgres::Client) -> Vec<String> {
    column::<String, _>(
        client,
        "SELECT tgname::text FROM pg_trigger WHERE tgrelid = 'public.outbox'::regclass \
         AND NOT tgisinternal AND tgname NOT LIKE 'outbox\\_relay\\_hold%' \
         UNION ALL \
         SELECT 'nudge' FROM pg_attrdef d JOIN pg_attribute a \
             ON a.attrelid = d.adrelid AND a.attnum = d.adnum \
         WHERE d.adrelid = 'public.outbox'::regclass AND a.attname = 'attempts' \
           AND pg_get_expr(d.adbin, d.adrelid) LIKE '%outbox_relay_nudge(%'",
        &[],
    )
    .await
}

/// After `migrate`: the wake-up is the attempts column's default, no trigger is left, and
/// the `pending` rows are all there.
async fn assert_upgraded(client: &tokio_postgres::Client, pending: i64) {
    assert_eq!(wake_ups(client).await, ["nudge"], "the trigger is replaced");
    assert_eq!(
        count(client, "SELECT count(*) FROM public.outbox").await,
        pending,
        "migrate left every pending row"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn upgrading_from_the_wake_trigger_moves_the_check_into_the_default() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    client.batch_execute(WAKE_TRIGGER).await.unwrap();
    assert_eq!(wake_ups(&client).await, ["outbox_relay_wake"]);
    seed(&client, 1_000, 20, 0).await;
    let mut pending: Vec<i64> = ids(&client).await;
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("wake-up installed"), "{}", text(&out));
    assert_upgraded(&client, 1_000).await;
    // Running migrate again changes nothing; `--no-notify` takes the wake-up out, and
    // gives the column its plain default back.
    assert!(env.migrate(&[]).status.success());
    assert_eq!(wake_ups(&client).await, ["nudge"]);
    let out = env.migrate(&["--no-notify"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("no wake-up (relays poll)"),
        "{}",
        text(&out)
    );
    assert!(wake_ups(&client).await.is_empty());
    assert_eq!(
        column::<String, Vec<_>>(
            &client,
            "SELECT pg_get_expr(adbin, adrelid) FROM pg_attrdef d JOIN pg_attribute a \
             ON a.attrelid = d.adrelid AND a.attnum = d.adnum \
             WHERE d.adrelid = 'public.outbox'::regclass AND a.attname = 'attempts'",
            &[],
        )
        .await,
        ["0"]
    );
    assert!(env.migrate(&[]).status.success());
    let (mut relay, log) = env.spawn_run_logged();
    wait_for_empty_outbox(&client, "the rows to be published after the upgrade", 30).await;
    wait_asleep(&client, 1).await;
    let committed = Instant::now();
    pending.push(insert_one(&client, "after").await);
    published_promptly(
        &client,
        &log,
        "a row committed after the upgrade",
        committed,
    )
    .await;
    terminate_cleanly(&mut relay);
    audit(&pending, &env.stored().await).assert_nothing_lost_in_order();
}

/// Running `migrate` again, as a deploy job does, changes nothing, so it takes no lock on
/// the outbox that waits for the application's open transactions (and holds new writes
/// behind it while it waits). Here a writer's transaction that inserted a row stays open
/// across the run, with the wake-up and with `--no-notify`.
#[tokio::test(flavor = "multi_thread")]
async fn migrate_run_again_waits_for_no_open_writer() {
    let env = Env::new(relay()).await;
    for args in [&[][..], &["--no-notify"][..]] {
        assert!(env.migrate(args).status.success());
        let mut writer = env.client().await;
        let tx = writer.transaction().await.unwrap();
        insert_one_in(&tx, "open").await;
        let started = Instant::now();
        let out = env.migrate(args);
        let took = started.elapsed();
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        assert!(
            text(&out).contains("up to date"),
            "{args:?}: {}",
            text(&out)
        );
        assert!(
            took < Duration::from_secs(5),
            "{args:?}: migrate took {took:?} with a writer's transaction open"
        );
        tx.commit().await.unwrap();
    }
}

/// The trigger and function two releases before this one installed: NOTIFY on every
/// INSERT statement.
const PREVIOUS_TRIGGER: &str = "
ALTER TABLE public.outbox ALTER COLUMN attempts SET DEFAULT 0;
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
async fn upgrading_from_the_notify_trigger_keeps_every_pending_row_and_its_order() {
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
    assert_upgraded(&client, 2_000).await;
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
