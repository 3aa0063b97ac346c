//! A claim's cost depends on the batch, not on the table's history (issue 14).
//!
//! The claim floor (`src/source/floor.rs`): claims start at a low-water mark, and still no
//! row is skipped and per-key order holds - a row committed late below ids already
//! published, an id drawn before its transaction began, rows held back by a dead row that
//! an operator deletes or re-queues. The byte budget (`relay.max_batch_bytes`): large
//! rows do not take the process's memory with them.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// One worker claiming 5 rows at a time: a few thousand rows take seconds to drain, so the
/// floor's keeper sees pending rows and raises the floor past them meanwhile.
fn slow() -> Relay {
    relay().workers(1).batch_size(5)
}

/// A test environment whose PostgreSQL counts statements, their runs and their plans
/// (`pg_stat_statements` with `track_planning`).
async fn with_statement_counts(relay: Relay) -> Env {
    let pg = testkit::Postgres::start_with(
        false,
        "shared_preload_libraries = 'pg_stat_statements'\n\
         pg_stat_statements.track_planning = on\n",
    )
    .unwrap();
    let nats = testkit::NatsServer::start().unwrap();
    let env = Env::on(pg, nats, relay).await;
    env.client()
        .await
        .batch_execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    env
}

/// Writes `relay`'s config with `n` more tables beside the outbox, `public.<prefix>_<i>`,
/// migrated (with `migrate`'s `args`) and granted to the relay's role; returns their
/// names.
async fn with_more_tables(
    env: &Env,
    relay: Relay,
    prefix: &str,
    n: usize,
    args: &[&str],
) -> Vec<String> {
    let names: Vec<String> = (0..n).map(|i| format!("public.{prefix}_{i}")).collect();
    write_tables_config(env, relay, &names);
    let out = env.migrate(args);
    assert!(out.status.success(), "{}", text(&out));
    let client = env.client().await;
    for t in &names {
        grant_relay_role(&client, t).await;
    }
    names
}

/// Writes `relay`'s config with `tables` beside the outbox.
fn write_tables_config(env: &Env, relay: Relay, tables: &[String]) {
    let more: String = tables
        .iter()
        .map(|t| format!("[[tables]]\nname = \"{t}\"\ntopic = \"{{topic}}\"\n"))
        .collect();
    env.write_config(&relay.section(&more));
}

/// Waits until a `run` relay LISTENs.
async fn wait_for_listen(client: &tokio_postgres::Client) {
    wait_until("the relay to LISTEN", Duration::from_secs(30), async || {
        count(
            client,
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN outbox_relay'",
        )
        .await
            > 0
    })
    .await;
}

/// Commits one row in `table` and waits, at most `within`, for the relay to publish it;
/// returns how long that took from the commit.
async fn one_row_published(
    client: &tokio_postgres::Client,
    table: &str,
    within: Duration,
) -> Duration {
    let id = commit_row(client, table).await;
    let committed = Instant::now();
    wait_until(
        format!("a row in {table} to be published"),
        within,
        async || {
            count(
                client,
                &format!("SELECT count(*) FROM {table} WHERE id = {id}"),
            )
            .await
                == 0
        },
    )
    .await;
    committed.elapsed()
}

/// Transactions per second PostgreSQL counts over 10 s once an idle relay has settled
/// (start-up claims every table and keeps each floor keeper busy for a moment, longer on a
/// loaded machine): waits for 3 s at most `bound` first. Backends report their counts at
/// most once a second, so the windows are long.
async fn idle_transactions_per_second(client: &tokio_postgres::Client, bound: f64) -> f64 {
    let xacts = "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database \
                 WHERE datname = current_database()";
    let rate = async |secs: u64| {
        let (before, started) = (count(client, xacts).await, Instant::now());
        tokio::time::sleep(Duration::from_secs(secs)).await;
        (count(client, xacts).await - before) as f64 / started.elapsed().as_secs_f64()
    };
    wait_until(
        format!("the idle relay to settle below {bound} transactions/s"),
        Duration::from_secs(60),
        async || rate(3).await <= bound,
    )
    .await;
    rate(10).await
}

/// `outbox-relay run` with the floor's debug lines in `log`.
fn spawn_logged(env: &Env, log: &Path) -> Child {
    env.command(&["run"])
        .env(
            "RUST_LOG",
            "info,outbox_relay::source::floor=debug,tokio_postgres=warn",
        )
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("start outbox-relay run")
}

/// Every floor value the relay logged so far.
fn floors(log: &Path) -> Vec<i64> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Claim floor moved"))
        .filter_map(|l| l.split("floor=").nth(1)?.split(' ').next()?.parse().ok())
        .collect()
}

async fn wait_for_floor_above(log: &Path, id: i64) {
    wait_until(
        &format!("the claim floor to pass id {id}"),
        Duration::from_secs(30),
        async || floors(log).iter().any(|f| *f > id),
    )
    .await;
}

async fn published(client: &tokio_postgres::Client, id: i64) -> bool {
    count(
        client,
        &format!("SELECT count(*) FROM public.outbox WHERE id = {id}"),
    )
    .await
        == 0
}

/// A transaction holds a low id open (it has written, so it has an xid) while thousands of
/// later rows are published: the floor never passes the low id, and once the transaction
/// commits its row is published at once (bound: 5 s; the NOTIFY wakes a worker).
#[tokio::test(flavor = "multi_thread")]
async fn a_row_committed_late_below_published_ids_is_published_at_once() {
    let env = Env::new(slow()).await;
    let client = env.client().await;
    let mut late = env.client().await;
    let tx = late.transaction().await.unwrap();
    let low: i64 = tx
        .query_one(
            "INSERT INTO public.outbox (topic, key, payload, headers)
             VALUES ('events.late', 'late', 'x', '{\"key\": \"late\"}') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    seed(&client, 2_000, 50, 0).await;
    let log = env.config.with_file_name("late.log");
    let mut relay = spawn_logged(&env, &log);
    wait_for_empty_outbox(&client, "the later rows to be published", 60).await;
    assert!(
        floors(&log).iter().all(|f| *f <= low),
        "the floor passed a row whose transaction was still open: {:?} (row {low})",
        floors(&log)
    );

    tx.commit().await.unwrap();
    let committed = Instant::now();
    wait_until(
        "the late row to be published",
        Duration::from_secs(5),
        async || published(&client, low).await,
    )
    .await;
    eprintln!(
        "late row published {:?} after its commit",
        committed.elapsed()
    );
    terminate_cleanly(&mut relay);
    let delivery = analyse(&env.stored().await);
    assert_eq!(delivery.counts.len(), 2_001, "every row arrived");
    assert!(delivery.order_violations().is_empty());
}

/// An id drawn with `nextval` before the inserting transaction began is the one case the
/// fence cannot see: the floor passes it while its row is not there yet. The sweep finds the row
/// once it commits, lowers the floor, and the row is published within one sweep cycle
/// (stated bound on a table VACUUM keeps clean: a few seconds; tested: 15 s).
#[tokio::test(flavor = "multi_thread")]
async fn a_row_whose_id_was_drawn_before_its_transaction_had_an_xid_is_found_by_the_sweep() {
    let env = Env::new(slow()).await;
    let client = env.client().await;
    // Drawn on its own (as an application that takes ids ahead of time does), so no
    // transaction is running for the fence to wait on.
    let low: i64 = client
        .query_one(
            "SELECT nextval(pg_get_serial_sequence('public.outbox', 'id'))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    seed(&client, 3_000, 50, 0).await;
    let log = env.config.with_file_name("sweep.log");
    let mut relay = spawn_logged(&env, &log);
    wait_for_floor_above(&log, low).await;
    wait_for_empty_outbox(&client, "the later rows to be published", 60).await;

    client
        .execute(
            "INSERT INTO public.outbox (id, topic, key, payload, headers)
             VALUES ($1, 'events.late', 'late', 'x', '{\"key\": \"late\"}')",
            &[&low],
        )
        .await
        .unwrap();
    let committed = Instant::now();
    wait_until(
        "the sweep to find the row below the floor",
        Duration::from_secs(15),
        async || published(&client, low).await,
    )
    .await;
    eprintln!(
        "row below the floor published {:?} after its commit",
        committed.elapsed()
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("The sweep found a pending row below the claim floor"),
        "{text}"
    );
    terminate_cleanly(&mut relay);
    assert_eq!(analyse(&env.stored().await).counts.len(), 3_001);
}

/// Rows held back by a dead row are stragglers the floor passes. Key `d`: its dead head is
/// deleted by an operator; key `r`: its dead head is re-queued. Either way the key's rows
/// below the floor go first, then the rows of the key written after the floor passed them:
/// per-key order holds across the floor.
#[tokio::test(flavor = "multi_thread")]
async fn rows_held_back_below_the_floor_keep_their_keys_order_when_released() {
    held_rows_released(4).await;
}

/// The same with 700 rows behind each dead head: more than the floor lists (1,000), so it
/// withholds both keys instead (`source::floor`, *Withheld keys*) and passes their rows.
/// Claims must then leave every row of a withheld key from its first hidden row on alone,
/// the rows written after the floor passed included, even once the dead head is deleted
/// or re-queued and published; a claim that took them would publish them before the
/// hidden rows below the floor.
#[tokio::test(flavor = "multi_thread")]
async fn keys_withheld_below_the_floor_keep_their_order_when_released() {
    let log = held_rows_released(700).await;
    assert!(
        log.contains("withheld_keys=2"),
        "the floor withheld both keys"
    );
}

/// Runs the scenario above with `n` rows behind each dead head; returns the relay's log.
async fn held_rows_released(n: i64) -> String {
    let env = Env::new(slow().max_attempts(1)).await;
    let client = env.client().await;
    let insert = |key: &'static str, topic: &'static str, n: i64| {
        let client = &client;
        async move {
            let rows = client
                .query(
                    "INSERT INTO public.outbox (topic, key, payload, headers)
                     SELECT $1, $2, 'x', jsonb_build_object('key', $2::text)
                     FROM generate_series(1, $3::int8) RETURNING id",
                    &[&topic, &key, &n],
                )
                .await
                .unwrap();
            let mut ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
            ids.sort_unstable();
            ids
        }
    };
    // Each head goes to a subject no stream captures: dead after one attempt.
    let d_head = insert("d", "nostream.d", 1).await[0];
    let r_head = insert("r", "nostream.r", 1).await[0];
    let mut d_rows = insert("d", "events.d", n).await;
    let mut r_rows = insert("r", "events.r", n).await;
    seed(&client, 2_000, 50, 0).await;
    let log = env.config.with_file_name("held.log");
    let mut relay = spawn_logged(&env, &log);
    let last_held = *r_rows.last().unwrap();
    wait_for_floor_above(&log, last_held).await;
    wait_until(
        "only the dead heads and their keys' rows to be left",
        Duration::from_secs(60),
        async || count(&client, "SELECT count(*) FROM public.outbox").await == 2 + 2 * n,
    )
    .await;
    // Written after the floor passed the held rows: above it.
    d_rows.extend(insert("d", "events.d", 3).await);
    r_rows.extend(insert("r", "events.r", 3).await);

    client
        .execute("DELETE FROM public.outbox WHERE id = $1", &[&d_head])
        .await
        .unwrap();
    // The head of `r` now goes to a captured subject and is re-queued.
    client
        .execute(
            "UPDATE public.outbox SET topic = 'events.r' WHERE id = $1",
            &[&r_head],
        )
        .await
        .unwrap();
    let out = env.relay(&["requeue", "--id", &r_head.to_string()]);
    assert!(out.status.success(), "{}", text(&out));
    wait_for_empty_outbox(&client, "the released keys to be published", 60).await;
    terminate_cleanly(&mut relay);

    let delivery = analyse(&env.stored().await);
    assert_eq!(
        delivery.by_key["d"], d_rows,
        "key d in id order, nothing skipped"
    );
    r_rows.insert(0, r_head);
    assert_eq!(
        delivery.by_key["r"], r_rows,
        "key r in id order, nothing skipped"
    );
    assert!(delivery.order_violations().is_empty());
    std::fs::read_to_string(&log).unwrap()
}

/// 200 rows of 900 KB (under NATS's 1 MB limit), default settings (4 workers x 500 rows):
/// without a byte budget one claim takes every row, 180 MB; with the default 8 MiB budget
/// the drain's peak RSS stays under 128 MB (a sidecar limit of 256 MB leaves room).
#[tokio::test(flavor = "multi_thread")]
async fn large_rows_drain_within_the_byte_budget_and_arrive_whole() {
    drain_large_rows(relay()).await;
}

/// The same without a key-order promise: that claim reads sizes under its row locks.
#[tokio::test(flavor = "multi_thread")]
async fn large_rows_drain_within_the_byte_budget_without_key_order() {
    drain_large_rows(relay().ordering("none")).await;
}

async fn drain_large_rows(relay: Relay) {
    let env = Env::new(relay).await;
    let client = env.client().await;
    client
        .execute(
            "INSERT INTO public.outbox (topic, key, payload, headers)
             SELECT 'events.big', 'k' || (n % 7), convert_to(rpad(n::text, 900000, 'x'), 'UTF8'),
                    jsonb_build_object('key', 'k' || (n % 7))
             FROM generate_series(1, 200) n ORDER BY n",
            &[],
        )
        .await
        .unwrap();
    // Reaped by wait4 below; the peak RSS is sampled meanwhile.
    #[allow(clippy::zombie_processes)]
    let child = env
        .command(&["drain", "--timeout", "120s"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start outbox-relay drain");
    let pid = child.id() as i32;
    let usage = tokio::time::timeout(
        Duration::from_secs(150),
        tokio::task::spawn_blocking(move || testkit::wait_with_usage(pid)),
    )
    .await
    .expect("drain exits within its --timeout")
    .unwrap()
    .unwrap();
    assert_eq!(usage.code, 0);
    let peak_mb = usage.peak_rss_mb;
    eprintln!("peak RSS draining 200 rows of 900 KB: {peak_mb:.0} MB");
    assert!(peak_mb < 128.0, "peak RSS {peak_mb:.0} MB");
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        0
    );
    // Counted by the stream (reading 180 MB back is slow): 200 messages, whole.
    let (messages, bytes) = env.nats.stream_state(STREAM).await.unwrap();
    assert_eq!(messages, 200);
    assert!(bytes >= 200 * 900_000, "{bytes} bytes stored");
}

/// Contract section 8 (the relay's cost follows its work) and issue 27 (eight `drain`s
/// started at once lose their first second to starting up): a `drain` looks at every
/// table in every round, so NOTIFY tells it nothing and it opens no LISTEN session. Its
/// sessions, counted by PostgreSQL (`pg_stat_database.sessions`), are its pool's alone:
/// one a worker and two that start-up's checks and the floor keeper use beside them (2 +
/// 2 here). A drain that listened opened one more (5: this test fails on the release
/// before).
#[tokio::test(flavor = "multi_thread")]
async fn a_drain_opens_no_listen_session() {
    const WORKERS: i64 = 2;
    let env = Env::new(relay().workers(WORKERS as usize)).await;
    let client = env.client().await;
    seed(&client, 2_000, 50, 0).await;
    let sessions = async || -> i64 {
        client
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await
            .unwrap();
        client
            .query_one(
                "SELECT sessions FROM pg_stat_database WHERE datname = current_database()",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    };
    let before = sessions().await;
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        0
    );
    // A backend's session is counted when its statistics are flushed, at its exit at
    // the latest: wait until the drain's backends are gone, then read.
    wait_until(
        "the drain's backends to exit",
        Duration::from_secs(10),
        async || relay_sessions(&client).await == 0,
    )
    .await;
    let opened = sessions().await - before;
    assert_eq!(
        opened,
        WORKERS + 2,
        "sessions a drain of {WORKERS} workers opened: its pool's, no LISTEN"
    );
}

/// Contract section 8 (Tables): a relay watching many quiet tables, with NOTIFY working,
/// costs a few transactions per second in all, not a claim and a look per table: the
/// poller asks about every table in one statement every 5 s, a quiet table's floor keeper
/// looks every 30 s, and the pause state of all of them is read twice a second. A row in
/// any of them is still published at once: within 1 s, committed early, half-way or late
/// in its table's idle cycle (`common::wake`). With every NOTIFY ignored a row waits for
/// the next poll of every table, up to 5 s: the points that fall more than 1 s before it
/// fail.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_relay_of_many_tables_costs_few_transactions_and_wakes_at_once() {
    const TABLES: usize = 100;
    let env = Env::new(relay().workers(4)).await;
    let tables = with_more_tables(&env, relay().workers(4), "idle", TABLES, &[]).await;
    let client = env.client().await;
    let mut relay = env.spawn_run();
    wait_for_listen(&client).await;
    // Stated: a few for the process (the pause state twice a second, the probe, one poll
    // of every table each 5 s), and a quiet table's floor keeper's look every 30 s; a
    // window of 10 s may hold one look of each keeper. A claim and a look per table every
    // 5 s (0.4 a second a table) would be 45 here.
    let bound = TABLES as f64 / 10.0 + 5.0;
    let per_second = idle_transactions_per_second(&client, bound).await;
    eprintln!("{TABLES} idle tables: {per_second:.1} transactions/s");
    assert!(
        per_second <= bound,
        "{per_second:.1} transactions/s for {TABLES} idle tables"
    );

    let woken = [&tables[3], &tables[51], &tables[99]].map(String::as_str);
    woken_at_every_idle_point(&client, &woken, String::new).await;
    terminate_cleanly(&mut relay);
}

/// Contract section 8 (Tables), issue 27: without NOTIFY (no trigger, or behind PgBouncer
/// without `listen_url`) a relay polls its quiet tables every `poll_interval`, and asks
/// about all of them in one statement a poll: 21 tables cost about what one poll, their
/// slow claims and their floor keepers' looks make, not a claim per table per interval
/// (benchmark I, 50 tables: 546 transactions/s that way, 35 now). Counted twice: the
/// transactions PostgreSQL commits, and the poll statement's runs (`pg_stat_statements`):
/// about one per interval, whatever the number of tables (a statement per table inside
/// one transaction per poll would make 21). A row in any of them is still published
/// within about an interval, at every point of its table's idle cycle.
#[tokio::test(flavor = "multi_thread")]
async fn a_polling_relay_asks_about_its_quiet_tables_in_one_statement_a_poll() {
    const TABLES: usize = 20;
    let polling = || relay().workers(4).poll_interval("100ms");
    let env = with_statement_counts(polling()).await;
    let tables = with_more_tables(&env, polling(), "polled", TABLES, &["--no-notify"]).await;
    let client = env.client().await;
    let mut relay = env.spawn_run();
    // `poll_interval` 100 ms (the default): 10 polls a second, and 0.4 a second for each of
    // the 21 tables (its claim and its floor keeper's look every 5 s, all in the same
    // instant: a short window may hold them twice), plus a few. Measured: about 21.
    let all = (TABLES + 1) as f64;
    let bound = 10.0 + all * 0.4 + 15.0;
    let per_second = idle_transactions_per_second(&client, bound).await;
    eprintln!("{all} polled tables: {per_second:.1} transactions/s");
    assert!(
        per_second <= bound,
        "{per_second:.1} transactions/s for {all} polled tables (a claim per table per \
         interval would be over {})",
        all * 10.0
    );
    // The poll statement (`SELECT ARRAY[<one EXISTS per table>]`) over 5 s: 10 a second
    // at 100 ms, a few more when a poll takes a while (the next starts 100 ms after the
    // last began, at once if that passed).
    let polls = "query LIKE 'SELECT ARRAY[(EXISTS%'";
    let (before, started) = (statement_calls(&client, polls).await, Instant::now());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let polled = statement_calls(&client, polls).await - before;
    let polls_per_second = polled as f64 / started.elapsed().as_secs_f64();
    eprintln!("{all} polled tables: {polls_per_second:.1} poll statements/s");
    assert!(
        (5.0..=15.0).contains(&polls_per_second),
        "{polls_per_second:.1} poll statements a second for {all} polled tables at a \
         poll_interval of 100 ms: about 10 expected (one statement per table per poll \
         would be {})",
        all * 10.0
    );
    let woken = [&tables[2], &tables[9], &tables[17]].map(String::as_str);
    woken_at_every_idle_point(&client, &woken, String::new).await;
    terminate_cleanly(&mut relay);
}

/// Issue 52: a crowd of writers that keeps a table busy is polled every `poll_interval`,
/// not after every claim that finds the table empty. While its writers notify faster than
/// the busy limit, the table stays awake and unmarked (`relay::wake`, rule 6): each poll
/// that finds rows wakes every worker, so a poll after every empty claim made more claims
/// of fewer rows each, CPU the writers share (benchmark W). Counted as the poll statements
/// over a burst of 8 writers on the default wake-up, unordered (whose claims empty the
/// table most often): the interval's 10 a second, and a few more as the crowd's time
/// ends and the table is marked again; several times that when each empty claim pokes
/// the poller.
#[tokio::test(flavor = "multi_thread")]
async fn a_crowd_of_writers_is_polled_every_interval_not_after_every_empty_claim() {
    let env = with_statement_counts(relay().workers(4).ordering("none")).await;
    let client = env.client().await;
    let mut relay = env.spawn_run();
    wait_for_listen(&client).await;
    let polls = "query LIKE 'SELECT ARRAY[(EXISTS%'";
    let (before, started) = (statement_calls(&client, polls).await, Instant::now());
    let mut writers = Vec::new();
    for w in 0..8 {
        let client = env.client().await;
        writers.push(tokio::spawn(async move {
            for i in 0..1_500 {
                let key = format!("w{w}-{}", i % 10);
                client
                    .execute(
                        "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.a', $1, 'x')",
                        &[&key],
                    )
                    .await
                    .unwrap();
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let took = started.elapsed().as_secs_f64();
    let polled = statement_calls(&client, polls).await - before;
    wait_for_empty_outbox(&client, "the burst to be published", 30).await;
    terminate_cleanly(&mut relay);
    let per_second = polled as f64 / took;
    eprintln!("12,000 commits in {took:.1} s by 8 writers: {per_second:.1} polls a second");
    assert!(
        per_second <= 30.0,
        "{polled} polls in {took:.1} s ({per_second:.1} a second) while 8 writers kept the \
         table busy, at a poll_interval of 100 ms: polled after every empty claim?"
    );
}

/// A claim's first window is planned a few times per session, not at every claim:
/// PostgreSQL makes five custom plans of a prepared statement, then keeps its generic plan
/// when it costs no more. With the window's read bound as `LIMIT $1` the generic plan
/// estimated a tenth of the table for it, and on a table of 100,000 rows every claim
/// planned the window anew (checked: 12 custom plans of 12 before the fix; in benchmark K
/// planning was 40% of the window's time). Counted by `pg_prepared_statements` on the
/// session that ran it, over windows from the table's start and from a floor, with and
/// without stragglers.
#[tokio::test(flavor = "multi_thread")]
async fn a_claims_first_window_keeps_its_generic_plan() {
    let (env, _source, tables) = analyzed_table(100_000, 2_000).await;
    let window = &tables[0].sql.window;
    // Prepared once and run again, as the relay's sessions do (`source::session`).
    let session = env.client().await;
    let statement = session.prepare(window).await.unwrap();
    let runs: [(i64, i64, Vec<i64>); 4] = [
        (256, i64::MIN, vec![]),
        (100, 50_000, vec![]),
        (256, 70_000, vec![3, 7]),
        (40, 99_000, vec![]),
    ];
    for (limit, floor, stragglers) in runs.iter().cycle().take(12) {
        let rows = session
            .query(&statement, &[limit, floor, stragglers])
            .await
            .unwrap();
        assert_eq!(rows.len() as i64, *limit, "the window holds {limit} rows");
    }
    let (generic, custom): (i64, i64) = {
        let r = session
            .query_one(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements \
                 WHERE statement = $1",
                &[window],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (generic, custom),
        (7, 5),
        "12 first windows: five custom plans, then the generic one kept"
    );
}

/// Contract section 8 (Replicas): relays sharing a table keep one floor each, and each look
/// walks the entries of the rows published lately, so the looks' cost to the database
/// must follow the work, not the number of relays. Four drains share a table held to
/// 4,000 rows/s (`max_rate`, all relays together): each claims about 25 rows a tick, so it
/// looks every 200 ms (and when a sweep step is due), not every 25 ms. Counted by
/// `pg_stat_statements`; looking every tick, the four made about 100 looks a second.
#[tokio::test(flavor = "multi_thread")]
async fn several_relays_on_one_table_look_at_its_floor_about_as_often_as_one() {
    const ROWS: i64 = 12_000;
    const RELAYS: usize = 4;
    let env = with_statement_counts(relay().workers(2).batch_size(200)).await;
    env.table_option("max_rate = 4000");
    let client = env.client().await;
    seed(&client, ROWS, 400, 0).await;
    let inserted = ids(&client).await;
    client
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .unwrap();

    let started = Instant::now();
    all_exit_0(
        RELAYS,
        |_| env.command(&["drain", "--timeout", "120s"]),
        Duration::from_secs(130),
        String::new,
    );
    let secs = started.elapsed().as_secs_f64();
    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();

    let looks = statement_calls(&client, "query LIKE 'WITH c AS MATERIALIZED%'").await;
    // Per relay: one look per 500 rows it claimed, five a second (200 ms apart), up to two
    // a second for sweep steps (a table this small is swept in two), and the first; half
    // as many again as a margin.
    let bound = 1.5 * (ROWS as f64 / 500.0 + RELAYS as f64 * (secs * 7.0 + 1.0));
    eprintln!(
        "{RELAYS} drains of {ROWS} rows in {secs:.1} s: {looks} floor looks (bound {bound:.0})"
    );
    assert!(
        (looks as f64) <= bound,
        "{looks} floor looks in {secs:.1} s by {RELAYS} relays (bound {bound:.0})"
    );
}

/// Contract section 8 (Replicas): a relay's sessions plan each statement once, not once
/// per run for their first five runs. PostgreSQL makes five custom plans of a prepared
/// statement in every session before it keeps the generic one, and every relay session is
/// new at start-up: eight drains of four workers started at once made 283 plans of the
/// bucket pick (267 ms of their backends') where 48 do (benchmark S). The relay's
/// statements hide every value a plan could use, so its sessions run with
/// `plan_cache_mode = force_generic_plan`. Counted by `pg_stat_statements` (planning
/// tracked) over one drain of two workers: the batch's delete, which each worker runs
/// once per batch it publishes, is planned at most twice per worker (once, and again if
/// autovacuum's analyze of the table invalidates it), where custom plans made six each.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_session_plans_each_statement_once() {
    const WORKERS: i64 = 2;
    let env = with_statement_counts(relay().workers(WORKERS as usize).batch_size(50)).await;
    let client = env.client().await;
    seed(&client, 3_000, 200, 0).await;
    let inserted = ids(&client).await;
    client
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .unwrap();
    all_exit_0(
        1,
        |_| env.command(&["drain", "--timeout", "60s"]),
        Duration::from_secs(70),
        String::new,
    );
    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();
    let row = client
        .query_one(
            "SELECT COALESCE(sum(calls), 0)::int8, COALESCE(sum(plans), 0)::int8 \
             FROM pg_stat_statements WHERE query LIKE 'DELETE FROM \"public\".\"outbox\"%'",
            &[],
        )
        .await
        .unwrap();
    let (calls, plans): (i64, i64) = (row.get(0), row.get(1));
    eprintln!("{calls} batch deletes by {WORKERS} workers, {plans} plans");
    assert!(
        calls >= 10 * WORKERS,
        "{calls} batch deletes: too few runs per session to tell (expected 3,000 rows in \
         batches of 50)"
    );
    assert!(
        plans <= 2 * WORKERS,
        "{plans} plans of the batch's delete in {calls} runs by {WORKERS} sessions"
    );
}

/// Contract section 8 (Tables): a relay starting on quiet tables looks at each one's
/// floor a few times, not every tick. Every table counts as active for its first two
/// seconds (rows may be waiting), and a keeper looks every tick (25 ms) until its process
/// adopts a first floor; an empty table has none to adopt, so each cost about 80 looks at
/// start-up (a relay of 50 quiet tables: 4,000 transactions in its first two seconds).
/// Counted by `pg_stat_statements` over the first seconds of `run` on eleven empty tables,
/// then a row in one of them is still published.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_starting_on_quiet_tables_looks_at_each_floor_a_few_times() {
    const QUIET: usize = 10;
    let env = with_statement_counts(relay().workers(4)).await;
    let quiet = with_more_tables(&env, relay().workers(4), "quiet", QUIET, &[]).await;
    let client = env.client().await;
    let looks = "query LIKE '%pg_snapshot_xmin(pg_current_snapshot())%'";
    let before = statement_calls(&client, looks).await;
    let mut relay = env.spawn_run();
    wait_for_listen(&client).await;
    // The two active seconds and a margin (an idle keeper looks every 5 s after them).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let looked = statement_calls(&client, looks).await - before;
    let tables = QUIET as i64 + 1;
    eprintln!("start-up on {tables} quiet tables: {looked} floor looks");
    one_row_published(&client, &quiet[4], Duration::from_secs(5)).await;
    terminate_cleanly(&mut relay);
    // At most a look every `MAX_TICK` (200 ms) while active: about 10 per table, 80 at
    // every tick.
    assert!(
        looked <= 25 * tables,
        "{looked} floor looks at the start-up of a relay on {tables} quiet tables"
    );
}

/// Contract section 8 (Tables) and issue 27 (idle cost): PostgreSQL runs a Parse sent
/// outside a transaction block in an implicit transaction of its own, and counts it like
/// any other. A relay that prepared each table's batch statements ahead of `BEGIN` made
/// four such transactions per table and session: a relay of 50 quiet tables warming its
/// eight sessions ran about 1,600 of them over its first minute (benchmark I: 52
/// transactions/s then, 23 after). Checked in the server's own log, which names each
/// line's transaction (`%v`): over a drain of four workers and a while of `run` on three
/// tables, no transaction of a relay session does nothing but prepare. (`migrate`'s
/// catalog reads are left out: one command an operator runs, not the relay's running
/// cost.)
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_session_prepares_its_statements_inside_its_transactions() {
    let pg = testkit::Postgres::start_with(
        false,
        "log_min_duration_statement = 0\nlog_line_prefix = '%v %a '\n",
    )
    .unwrap();
    let nats = testkit::NatsServer::start().unwrap();
    let env = Env::on(pg, nats, relay().workers(4).batch_size(100)).await;
    let quiet = with_more_tables(&env, relay().workers(4).batch_size(100), "quiet", 2, &[]).await;
    let client = env.client().await;
    seed(&client, 2_000, 50, 0).await;
    let inserted = ids(&client).await;
    // From here on: the relay's own sessions (`migrate`, run once by an operator, is not
    // looked at).
    let from = env.pg.log().len();
    all_exit_0(
        1,
        |_| env.command(&["drain", "--timeout", "60s"]),
        Duration::from_secs(70),
        String::new,
    );
    audit(&inserted, &env.stored().await).assert_nothing_lost_in_order();
    // `run`: a row in a quiet table, then its idle looks (every table is looked at every
    // 5 s) on sessions that have not prepared them yet.
    let mut relay = env.spawn_run();
    one_row_published(&client, &quiet[1], Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    terminate_cleanly(&mut relay);

    // Lines `<backend>/<local xid> <application> LOG:  duration: ... ms  <what>...`; a
    // local xid of 0 is outside any transaction (a COMMIT's line comes after it ended).
    let log = env.pg.log().split_off(from);
    let mut transactions: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for line in log.lines() {
        let Some((vxid, rest)) = line.split_once(" outbox-relay LOG:  duration: ") else {
            continue;
        };
        if vxid.ends_with("/0") {
            continue;
        }
        let what = rest.split_once(" ms  ").map_or(rest, |(_, what)| what);
        transactions.entry(vxid).or_default().push(what);
    }
    let prepares = transactions
        .values()
        .flatten()
        .filter(|w| w.starts_with("parse "))
        .count();
    let only_prepare: Vec<String> = transactions
        .values()
        .filter(|lines| lines.iter().all(|w| w.starts_with("parse ")))
        .map(|lines| {
            lines
                .iter()
                .map(|w| &w[..w.len().min(90)])
                .collect::<Vec<_>>()
                .join(" | ")
        })
        .collect();
    eprintln!(
        "{} transactions of relay sessions, {prepares} prepares, {} of them alone",
        transactions.len(),
        only_prepare.len()
    );
    assert!(
        prepares >= 8,
        "{prepares} prepares in the server log: the check saw too little (is \
         log_min_duration_statement on?)"
    );
    assert!(
        only_prepare.is_empty(),
        "{} transactions of relay sessions did nothing but prepare, e.g.:\n{}",
        only_prepare.len(),
        only_prepare[..only_prepare.len().min(5)].join("\n")
    );
}

/// Issue 29 (one Kafka partition stuck) and contract section 8 (History): with a third of
/// the keys held back (each one's first row waiting, as when its partition has no leader),
/// a claim's reads from the floor on tell the held keys' rows from the others by a hash
/// table PostgreSQL builds once per statement, not by a probe of the held rows for every
/// row read: benchmark K measured the probes at most of a claim's blocks, and the first
/// window reading mostly held-back rows above the floor. Checked on the relay's own
/// statements, in the generic plan PostgreSQL keeps for them: with every held row below
/// the floor, no row read is probed, and the rows returned are those a probe per row
/// returns (and, with no floor, the probes that are left give the same answer); the same
/// for the floor's look walking the held-back rows above the floor.
#[tokio::test(flavor = "multi_thread")]
async fn a_claims_reads_tell_held_keys_by_a_hash_table() {
    const KEYS: i64 = 300;
    let env = Env::new(relay()).await;
    let client = env.client().await;
    seed(&client, 30_000, KEYS, 0).await;
    // Row n has key k{n % 300}: rows 1..=300 are each key's first, and those with n % 3 = 0
    // (keys k0, k3, ...) wait an hour, holding back every later row of their key.
    client
        .batch_execute(
            "UPDATE public.outbox SET next_attempt_at = now() + interval '1 hour' \
             WHERE id <= 300 AND id % 3 = 0; ANALYZE public.outbox",
        )
        .await
        .unwrap();
    let expected = |from: i64, limit: i64| {
        (from.max(1)..)
            .filter(|n| n % KEYS % 3 != 0)
            .take(limit as usize)
            .collect::<Vec<i64>>()
    };
    let (_source, tables) = env.tables().await;
    let sql = &tables[0].sql;
    let session = env.client().await;
    session
        .batch_execute(&format!(
            "SET plan_cache_mode = force_generic_plan; \
             PREPARE w(int8, int8, int8[]) AS {}; \
             PREPARE p(int8, int8, int4[], int8, int8[], int4, int8, int8, int8) AS {}",
            sql.window, sql.pick_lock
        ))
        .await
        .unwrap();

    for floor in [301, i64::MIN] {
        let window = format!("w(256, {floor}, '{{}}')");
        let ids: Vec<i64> = rows(&session, &format!("EXECUTE {window}"))
            .await
            .iter()
            .map(|r| r[0].as_deref().unwrap().parse().unwrap())
            .collect();
        assert_eq!(ids, expected(floor, 256), "first window from {floor}");
        let probes = held_probes(&session, &window).await;
        if floor == 301 {
            assert_eq!(probes, 0, "no row of the first window from 301 is probed");
        }
    }
    // The count sees probes where there are some: without a floor, a window that reaches
    // past row 300 probes the rows behind the held keys' first rows.
    assert!(
        held_probes(&session, &format!("w(1000, {}, '{{}}')", i64::MIN)).await > 0,
        "a window from the start probes the rows behind held keys"
    );

    // Every bucket from the floor 301 on, 40 rows each, no first window before it; the
    // pick locks nothing ($8 = 0).
    let pick = format!("p({}, 40, '{{{}}}', 301, '{{}}', 7, 64, 0, 0)", i64::MIN, {
        (0..64).map(|b| b.to_string()).collect::<Vec<_>>().join(",")
    });
    let seen: Vec<(i64, String)> = rows(&session, &format!("EXECUTE {pick}"))
        .await
        .iter()
        .filter_map(|r| {
            let id = r[r.len() - 4].as_deref()?.parse().unwrap();
            Some((id, r[r.len() - 3].clone().unwrap()))
        })
        .collect();
    assert!(seen.len() > 1_000, "the pick read {} rows", seen.len());
    for (id, key) in &seen {
        let k: i64 = key[1..].parse().unwrap();
        assert!(*id >= 301 && k % 3 != 0, "row {id} of {key}: held back");
    }
    assert_eq!(
        held_probes(&session, &pick).await,
        0,
        "no row a pick reads from the floor on is probed"
    );

    // The other keys' rows up to 3,000 published: from 301 on, the floor's look walks the
    // held-back rows to its candidate, 3,001 (key k1), listing them.
    client
        .batch_execute(
            "DELETE FROM public.outbox WHERE id BETWEEN 301 AND 3000 AND id % 300 % 3 <> 0",
        )
        .await
        .unwrap();
    session
        .batch_execute(&format!(
            "PREPARE look(int8, int8[], bool) AS {}",
            sql.advance
        ))
        .await
        .unwrap();
    let look = rows(&session, "EXECUTE look(301, '{}', false)").await;
    assert_eq!(look[0][3].as_deref(), Some("3001"), "the look's candidate");
    assert_eq!(
        held_probes(&session, "look(301, '{}', false)").await,
        0,
        "no row the floor's look walks from the floor on is probed"
    );
}

/// The index of `outbox_relay_held` by key (migration 0008).
const HELD_KEY_INDEX: &str = "outbox_relay_held_key_idx";

/// How many times `EXECUTE statement` probed the held rows for one row's key (the
/// per-row `NOT EXISTS`), from its plan as run.
async fn held_probes(session: &tokio_postgres::Client, statement: &str) -> i64 {
    plan_nodes(session, statement)
        .await
        .iter()
        .filter(|node| {
            node["Index Name"] == HELD_KEY_INDEX
                && node["Index Cond"]
                    .as_str()
                    .is_some_and(|cond| cond.contains("= o"))
        })
        .map(|node| node["Actual Loops"].as_i64().unwrap_or(0))
        .sum()
}

/// Every node of the plan `EXECUTE statement` ran (`EXPLAIN ANALYZE`, JSON).
async fn plan_nodes(session: &tokio_postgres::Client, statement: &str) -> Vec<serde_json::Value> {
    fn walk(node: &serde_json::Value, nodes: &mut Vec<serde_json::Value>) {
        for child in node["Plans"].as_array().into_iter().flatten() {
            walk(child, nodes);
        }
        nodes.push(node.clone());
    }
    let explained = rows(
        session,
        &format!("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {statement}"),
    )
    .await;
    let plan: serde_json::Value =
        serde_json::from_str(explained[0][0].as_deref().unwrap()).unwrap();
    let mut nodes = Vec::new();
    walk(&plan[0]["Plan"], &mut nodes);
    nodes
}

/// Section 2 (Cheap for the writer): every index on the outbox costs each of the
/// application's INSERT statements, even a partial one its rows do not enter (PostgreSQL
/// opens it and checks its predicate), so `migrate` keeps none the relay can do without.
/// The dead, held and retry indexes of earlier releases are three: no fresh row is held,
/// and `outbox_relay_held` (migration 0008) holds every row they held. `migrate` drops
/// them, and the reads of dead rows go through that table's index: `drain`'s closing
/// look, on a table where a dead row holds back every key, probes it once for each of the
/// 19,800 rows behind them, and reads the outbox only for its own walk.
#[tokio::test(flavor = "multi_thread")]
async fn the_writer_pays_for_no_index_of_held_rows_and_they_are_found_in_their_own_table() {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    // What an earlier release's migrate built.
    client
        .batch_execute(
            "CREATE INDEX IF NOT EXISTS outbox_dead_idx ON public.outbox (key, id) \
             WHERE dead_at IS NOT NULL AND published_at IS NULL; \
             CREATE INDEX IF NOT EXISTS outbox_held_idx ON public.outbox (key, id) \
             WHERE published_at IS NULL AND (dead_at IS NOT NULL OR next_attempt_at IS NOT NULL); \
             CREATE INDEX IF NOT EXISTS outbox_retry_idx ON public.outbox (id) \
             WHERE published_at IS NULL AND dead_at IS NULL AND next_attempt_at IS NOT NULL",
        )
        .await
        .unwrap();
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    for index in ["outbox_dead_idx", "outbox_held_idx", "outbox_retry_idx"] {
        assert!(
            text(&out).contains(&format!(
                "index \"{index}\" dropped concurrently (outbox_relay_held finds the held rows)"
            )),
            "{}",
            text(&out)
        );
    }
    let indexes: Vec<String> = client
        .query(
            "SELECT indexrelid::regclass::text FROM pg_index \
             WHERE indrelid = 'public.outbox'::regclass ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        indexes,
        ["outbox_bucket_idx", "outbox_pkey"],
        "the indexes of a delete-mode table"
    );

    // 20,000 rows of 200 keys; the first row of every key dead.
    seed(&client, 20_000, 200, 0).await;
    client
        .batch_execute(
            "UPDATE public.outbox SET dead_at = now(), attempts = 10, last_error = 'x' \
             WHERE id <= 200; ANALYZE public.outbox",
        )
        .await
        .unwrap();
    let (_source, tables) = env.tables().await;
    let session = env.client().await;
    // As the relay's sessions run (`source::session::settings`).
    session
        .batch_execute(&format!(
            "SET enable_seqscan = off; SET enable_bitmapscan = off; PREPARE look AS {}",
            tables[0].sql.publishable_exists
        ))
        .await
        .unwrap();
    assert_eq!(
        rows(&session, "EXECUTE look").await[0][0].as_deref(),
        Some("f"),
        "every pending row is held back by a dead row"
    );
    let nodes = plan_nodes(&session, "look").await;
    let probes: i64 = nodes
        .iter()
        .filter(|node| node["Index Name"] == HELD_KEY_INDEX)
        .map(|node| node["Actual Loops"].as_i64().unwrap_or(0))
        .sum();
    assert!(
        probes >= 19_800,
        "the held rows' index answered {probes} probes: {nodes:#?}"
    );
    // The look's own walk over the pending rows is `o`, and the only read of the outbox;
    // every read of dead rows is in `outbox_relay_held`, through an index.
    assert!(
        nodes
            .iter()
            .filter(|node| node["Relation Name"] == "outbox")
            .all(|node| node["Alias"] == "o"),
        "{nodes:#?}"
    );
    let dead_reads: Vec<_> = nodes
        .iter()
        .filter(|node| node["Relation Name"] == "outbox_relay_held")
        .collect();
    assert!(
        dead_reads.len() >= 2
            && dead_reads
                .iter()
                .all(|node| node["Node Type"].as_str().unwrap().contains("Index")),
        "{nodes:#?}"
    );
    let out = env.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        count(&client, "SELECT count(*) FROM public.outbox").await,
        20_000,
        "nothing published: every row is a dead row or behind one"
    );
}

/// A new session's first picks read no more of a bucket than they keep. PostgreSQL plans
/// a prepared statement's first five runs in each session with its values (custom
/// plans), and a pick's per-bucket limit seen as a value once made it read each bucket
/// whole and sort it (a bitmap scan: 1,800 rows a bucket for 160), three times the cost
/// of the plan it keeps later; a relay's sessions are new at every start, and eight
/// relays of four workers open 48. Checked in a custom plan of the relay's own
/// statement, four buckets of a 100,000-row table, 160 rows each.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_sessions_first_picks_read_no_more_of_a_bucket_than_they_keep() {
    let (env, _source, tables) = analyzed_table(100_000, 2_000).await;
    let session = env.client().await;
    session
        .batch_execute(&format!(
            "SET plan_cache_mode = force_custom_plan; \
             PREPARE p(int8, int8, int4[], int8, int8[], int4, int8, int8, int8) AS {}",
            tables[0].sql.pick_lock
        ))
        .await
        .unwrap();
    let pick = format!(
        "p({0}, 160, '{{0,1,2,3}}', {0}, '{{}}', 7, 4, 0, 0)",
        i64::MIN
    );
    let nodes = plan_nodes(&session, &pick).await;
    let read: i64 = nodes
        .iter()
        .filter(|node| node["Index Name"] == "outbox_bucket_idx")
        .map(|node| {
            node["Actual Rows"].as_i64().unwrap_or(0) * node["Actual Loops"].as_i64().unwrap_or(0)
        })
        .sum();
    let kept = rows(&session, &format!("EXECUTE {pick}"))
        .await
        .iter()
        .filter(|r| r[r.len() - 4].is_some())
        .count() as i64;
    assert_eq!(kept, 4 * 160, "four buckets of 160 rows");
    assert!(
        read <= kept,
        "the bucket index gave {read} rows for the {kept} kept"
    );
}

/// The rows `statement` returns, as text (the simple query protocol).
async fn rows(session: &tokio_postgres::Client, statement: &str) -> Vec<Vec<Option<String>>> {
    session
        .simple_query(statement)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
            }
            _ => None,
        })
        .collect()
}

/// A table of `rows` rows over `keys` keys, analyzed, and the relay's statements for it.
async fn analyzed_table(
    rows: i64,
    keys: i64,
) -> (
    Env,
    outbox_relay::source::Source,
    Vec<outbox_relay::source::table::TablePlan>,
) {
    let env = Env::new(relay()).await;
    let client = env.client().await;
    seed(&client, rows, keys, 0).await;
    client.batch_execute("ANALYZE public.outbox").await.unwrap();
    let (source, tables) = env.tables().await;
    (env, source, tables)
}

/// Section 8 (History) and issue 27: the relay reads the outbox through its indexes
/// whatever the planner's statistics said when a statement was planned. Relays started
/// on an empty outbox (a new service, a drained table, statistics from autovacuum's
/// analyze of it) plan their claims and floor looks there, where every scan costs
/// nothing; planned so, a statement scans the table sequentially, and a prepared one
/// keeps that plan as its generic plan when the rows come. Benchmark R caught a floor
/// look doing it on 200,000 rows, 0.5 s a look, PostgreSQL's CPU for the burst four
/// times what it was otherwise. Counted by PostgreSQL itself: no sequential scan of the
/// outbox from start to stop, while the relay idled on it empty and while it relayed.
#[tokio::test(flavor = "multi_thread")]
async fn the_relay_reads_the_outbox_through_its_indexes_even_when_it_planned_on_an_empty_table() {
    let env = Env::new(relay().workers(4).batch_size(100)).await;
    let client = env.client().await;
    // What autovacuum leaves after a drain: statistics of an empty table.
    client.batch_execute("ANALYZE public.outbox").await.unwrap();
    let scans = async || -> (i64, i64) {
        let row = client
            .query_one(
                "SELECT seq_scan, COALESCE(idx_scan, 0) FROM pg_stat_user_tables \
                 WHERE relid = 'public.outbox'::regclass",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    client
        .execute(
            "SELECT pg_stat_reset_single_table_counters('public.outbox'::regclass)",
            &[],
        )
        .await
        .unwrap();
    let mut relay = env.spawn_run();
    // Its workers and floor keeper look at the empty table first: each has a session.
    wait_until(
        "the relay's sessions on the empty table",
        Duration::from_secs(20),
        async || relay_sessions(&client).await >= 5,
    )
    .await;
    seed(&client, 200, 4, 0).await;
    wait_until(
        "the first rows to be stored",
        Duration::from_secs(20),
        async || env.stored().await.len() == 200,
    )
    .await;
    client
        .execute(
            "INSERT INTO public.outbox (topic, key, payload) \
             SELECT 'events.' || (n % 3), 'h' || (n % 20), 'p' FROM generate_series(1, 4000) n",
            &[],
        )
        .await
        .unwrap();
    wait_until(
        "every row to be stored",
        Duration::from_secs(30),
        async || env.stored().await.len() == 4_200,
    )
    .await;
    terminate_cleanly(&mut relay);
    // A backend reports its counts when it exits.
    let (seq, idx) = wait_for(
        "the relay's scans to be counted",
        Duration::from_secs(15),
        async || Some(scans().await).filter(|&(_, idx)| idx > 0),
    )
    .await;
    assert_eq!(seq, 0, "sequential scans of the outbox ({idx} index scans)");
}

/// Section 8 (History): a claim's plan holds whatever the statistics say. Autovacuum's
/// analyze of a drained outbox leaves its pages and no row counted on them, so the
/// planner takes the table for empty. An unordered claim planned so (each new session
/// plans its statements, and the relay's keep the generic plan) joined its locked ids
/// back to the table by walking the whole primary key and working the ids out again for
/// every entry: every claim of the refilled table ran into `statement_timeout`, and a
/// drain of 600,000 rows stood still for 30 s (benchmark C, ordering = "none").
#[tokio::test(flavor = "multi_thread")]
async fn an_unordered_drain_keeps_its_pace_on_a_refilled_outbox_analyzed_empty() {
    let env = Env::new(relay().ordering("none").workers(4).batch_size(500)).await;
    set_statement_timeout(&env, "2s");
    let client = env.client().await;
    refill_analyzed_empty(&client, 50_000).await;
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        !text(&out).contains("statement timeout"),
        "claims ran into statement_timeout: {}",
        text(&out)
    );
    assert_eq!(env.stored().await.len(), 50_000);
}

/// Issue 55: the start-up checks of a relay's tables (schema, columns, unique order
/// column, claim indexes, privileges, the relay's own tables, the wake-up trigger) ask the
/// catalog a fixed number of statements, whatever the number of tables: each kind of
/// question is asked of every table at once. Asked per table they cost about 14
/// statements each: 7,000 and 0.7 s before the first claim of a relay of 500 tables.
/// Counted by `pg_stat_statements` (the relay role's statements that read the catalog)
/// over a `check` and a `drain` of 11 tables, then of 101: 8 each (one table at a time:
/// 154 and 1,414 for `check`, 158 and 1,471 for `drain`).
#[tokio::test(flavor = "multi_thread")]
async fn start_up_checks_of_many_tables_ask_a_fixed_number_of_statements() {
    let env = with_statement_counts(relay()).await;
    let tables = with_more_tables(&env, relay(), "many", 100, &[]).await;
    let client = env.client().await;
    // (Not the vacuum probe's reads of the statistics views, the tables' dead tuples and
    // the snapshots holding back VACUUM, every 5 s: a running relay's, not a check, and a
    // drain that takes longer makes more of them.)
    let catalog = "userid = 'outbox_relay'::regrole \
                   AND query ~ 'pg_catalog|to_regclass|has_[a-z]+_privilege' \
                   AND query !~ 'pg_stat_user_tables|pg_stat_activity'";
    let mut counts = Vec::new();
    for n in [10, 100] {
        write_tables_config(&env, relay(), &tables[..n]);
        for command in [&["check"][..], &["drain", "--timeout", "30s"]] {
            counted_run(&env, &client, command).await;
            let asked = statement_calls(&client, catalog).await;
            eprintln!(
                "{command:?} of {} tables: {asked} catalog statements",
                n + 1
            );
            counts.push(asked);
        }
    }
    let [check_10, drain_10, check_100, drain_100] = counts[..] else {
        unreachable!()
    };
    assert!(
        check_100 <= check_10 && drain_100 <= drain_10,
        "catalog statements for 11 tables, then 101: check {check_10} then {check_100}, \
         drain {drain_10} then {drain_100}"
    );
}

/// One row into `table`.
async fn insert_one_row(client: &tokio_postgres::Client, table: &str) {
    client
        .execute(
            &format!("INSERT INTO {table} (topic, key, payload) VALUES ('events.a', 'k', 'x')"),
            &[],
        )
        .await
        .unwrap();
}

/// How many times the statements `pg_stat_statements` counted that match `condition`
/// (on its columns) ran since the counts were last set to zero.
async fn statement_calls(client: &tokio_postgres::Client, condition: &str) -> i64 {
    count(
        client,
        &format!("SELECT COALESCE(sum(calls), 0)::int8 FROM pg_stat_statements WHERE {condition}"),
    )
    .await
}

/// The relay with `args`, from statement counts set to zero; it must succeed.
async fn counted_run(env: &Env, client: &tokio_postgres::Client, args: &[&str]) {
    client
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .unwrap();
    let out = env.relay(args);
    assert!(out.status.success(), "{args:?}: {}", text(&out));
}

/// Issue 55: a `drain` among many empty tables looks at them in a fixed number of
/// statements, and still finds the rows of the last of them. Counted as the statements
/// that ask one table whether it holds a publishable row: a drain that asked each table
/// (at its start and at its end) made two for every table.
#[tokio::test(flavor = "multi_thread")]
async fn a_drain_among_many_empty_tables_looks_at_them_in_a_fixed_number_of_statements() {
    let env = with_statement_counts(relay()).await;
    let tables = with_more_tables(&env, relay(), "quiet", 100, &[]).await;
    let client = env.client().await;
    let per_table = "userid = 'outbox_relay'::regrole \
                     AND query LIKE 'SELECT EXISTS (SELECT $1 FROM %' \
                     AND query NOT LIKE '%pg_catalog%'";
    let mut counts = Vec::new();
    for n in [10, 100] {
        write_tables_config(&env, relay(), &tables[..n]);
        let last = &tables[n - 1];
        insert_one_row(&client, last).await;
        counted_run(&env, &client, &["drain", "--timeout", "30s"]).await;
        let left = count(&client, &format!("SELECT count(*) FROM {last}")).await;
        assert_eq!(
            left,
            0,
            "the row of the last of {} tables was drained",
            n + 1
        );
        let asked = statement_calls(&client, per_table).await;
        eprintln!(
            "drain of {} tables, one row in the last: {asked} looks at one table",
            n + 1
        );
        counts.push(asked);
    }
    assert!(
        counts[1] <= counts[0],
        "looks at one table in a drain of 11 tables, then 101: {} then {}",
        counts[0],
        counts[1]
    );
}

/// Issue 55: the start-up check of a relay of many tables reads the catalogs in
/// proportion to its tables. Counted in buffers `check` reads from the catalogs (hit or
/// read) a table, with 101 tables migrated: a statement whose plan joins every table's
/// rows with every other table's (as the wake-up's did) reads about as many buffers a
/// table as the database has relayed tables, and more as it gets more of them.
#[tokio::test(flavor = "multi_thread")]
async fn start_up_checks_of_many_tables_read_the_catalogs_in_proportion_to_them() {
    const TABLES: i64 = 101;
    let env = with_statement_counts(relay()).await;
    with_more_tables(&env, relay(), "many", TABLES as usize - 1, &[]).await;
    let client = env.client().await;
    counted_run(&env, &client, &["check"]).await;
    let statements = rows(
        &client,
        "SELECT (shared_blks_hit + shared_blks_read)::text, left(query, 60) \
         FROM pg_stat_statements WHERE userid = 'outbox_relay'::regrole \
           AND query ~ 'pg_catalog|to_regclass|has_[a-z]+_privilege' \
         ORDER BY shared_blks_hit + shared_blks_read DESC",
    )
    .await;
    let worst = &statements[0];
    let buffers: i64 = worst[0].as_deref().unwrap().parse().unwrap();
    eprintln!(
        "{TABLES} tables: {buffers} catalog buffers read by {:?}",
        worst[1]
    );
    assert!(
        buffers <= TABLES * 50,
        "{buffers} catalog buffers for {TABLES} tables ({} a table) in one statement: {:?}",
        buffers / TABLES,
        worst[1]
    );
}

/// Issue 55: tables checked together each get their own problems, as a table checked
/// alone would, and the good tables among them pass. `check` lists every table's problems
/// under its name, in the order of its checks, tables in the configuration's order (a
/// problem of every kind: schema, table, column privilege, index, unique order column,
/// the relay's own tables, the sleep marks); `drain` refuses to start with the first
/// failing table's problems.
#[tokio::test(flavor = "multi_thread")]
async fn tables_checked_together_each_get_their_own_problems() {
    let env = Env::new(relay()).await;
    with_more_tables(&env, relay(), "mixed", 4, &[]).await;
    let client = env.client().await;
    client
        .batch_execute("CREATE SCHEMA side; CREATE SCHEMA hidden;")
        .await
        .unwrap();
    env.write_config(&relay().section("[[tables]]\nname = \"side.outbox\"\ntopic = \"{topic}\"\n"));
    let out = env.migrate(&[]);
    assert!(out.status.success(), "{}", text(&out));
    grant_relay_role(&client, "side.outbox").await;
    client
        .batch_execute(
            "GRANT USAGE ON SCHEMA side TO outbox_relay;
             DROP INDEX public.mixed_0_bucket_idx;
             REVOKE UPDATE (dead_at) ON public.mixed_1 FROM outbox_relay;
             REVOKE UPDATE ON public.outbox_relay_rates FROM outbox_relay;
             ALTER TABLE public.mixed_2 DROP CONSTRAINT mixed_2_pkey;
             REVOKE UPDATE ON SEQUENCE side.outbox_sleeping FROM outbox_relay;",
        )
        .await
        .unwrap();
    // Each table, an option of its entry, and the start of each of its lines.
    let expected: [(&str, &str, &[&str]); 8] = [
        ("public.outbox", "", &[]),
        (
            "public.mixed_0",
            "",
            &[
                "index \"public\".\"mixed_0_bucket_idx\" (pending rows by key bucket \
                 (migration 0004)) is missing: run `outbox-relay migrate`",
            ],
        ),
        (
            "public.missing",
            "",
            &["table public.missing does not exist (or this role cannot see it)"],
        ),
        (
            "hidden.outbox",
            "",
            &["this role lacks USAGE on schema \"hidden\""],
        ),
        (
            "public.mixed_1",
            "max_rate = 100\n",
            &[
                "this role lacks UPDATE on column dead_at: GRANT UPDATE (\"dead_at\") ON \
                 \"public\".\"mixed_1\"",
                "this role cannot read and write \"public\".\"outbox_relay_rates\" (max_rate \
                 keeps its token bucket there)",
            ],
        ),
        (
            "public.mixed_2",
            "",
            &["column id orders the rows and identifies them, so it needs unique values"],
        ),
        (
            "side.outbox",
            "",
            &["this role cannot keep its sleep marks"],
        ),
        ("public.mixed_3", "", &[]),
    ];
    let entries: String = expected[1..]
        .iter()
        .map(|(t, option, _)| {
            format!("[[tables]]\nname = \"{t}\"\ntopic = \"{{topic}}\"\n{option}")
        })
        .collect();
    env.write_config(&relay().section(&entries));
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let table_lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("ok   table ") || l.starts_with("FAIL table "))
        .collect();
    // The checks' lines first, in order (the broker's checks of the tables follow).
    let said: Vec<(String, &str)> = expected
        .iter()
        .flat_map(|(table, _, problems)| match problems {
            [] => vec![(
                format!("ok   table {table}: "),
                "columns, types and privileges usable",
            )],
            _ => problems
                .iter()
                .map(|p| (format!("FAIL table {table}: "), *p))
                .collect(),
        })
        .collect();
    assert!(table_lines.len() >= said.len(), "{stdout}");
    for (line, (start, says)) in table_lines.iter().zip(&said) {
        assert!(
            line.starts_with(start.as_str()) && line.contains(says),
            "expected {start}...{says}...\n{stdout}"
        );
    }
    let failed = stdout.lines().filter(|l| l.starts_with("FAIL")).count();
    assert_eq!(failed, 7, "{stdout}");

    let out = env.relay(&["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("mixed_0_bucket_idx"), "{stderr}");
    for (later, _, _) in &expected[2..] {
        assert!(
            !stderr.contains(later),
            "only the first failing table: {stderr}"
        );
    }
}

/// Contract section 8 (Tables), issue 55: a relay of many tables that all hold rows at
/// start claims each about once before it is settled, not once per worker: its workers
/// start spread over the tables, so they do not walk the same tables one behind the
/// other, each claiming again what the one ahead just emptied. Counted by
/// `pg_stat_statements`: the first windows read over a `drain` of 100 tables of one row
/// each, 4 workers (a first claim and its follow-on: about 2 a table; walking together,
/// about one per worker and table).
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_starting_on_many_tables_with_rows_claims_each_about_once() {
    const TABLES: usize = 100;
    let env = with_statement_counts(relay().workers(4)).await;
    let tables = with_more_tables(&env, relay().workers(4), "busy", TABLES, &[]).await;
    let client = env.client().await;
    for t in &tables {
        insert_one_row(&client, t).await;
    }
    counted_run(&env, &client, &["drain", "--timeout", "60s"]).await;
    let windows = statement_calls(
        &client,
        "userid = 'outbox_relay'::regrole AND query LIKE 'WITH % low AS MATERIALIZED%'",
    )
    .await;
    eprintln!("{TABLES} tables of one row each: {windows} first windows read");
    assert!(
        windows as usize <= TABLES * 5 / 2,
        "{windows} first windows for {TABLES} tables of one row: each table claimed by \
         every worker in turn?"
    );
}
