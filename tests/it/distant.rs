//! A database in another zone: a batch's transaction shares its round trips. `BEGIN` goes
//! out with the claim's first statement, the published rows' delete with the `COMMIT`, and
//! an empty claim's `ROLLBACK` with the next transaction's `BEGIN` (see `source::Tx`).
//! Counted through `testkit::Proxy` with a latency, which counts the times a client spoke
//! again after being answered; the speed-up itself is measured by `outbox-bench --distant`.

use std::time::Duration;

use crate::common::*;
use outbox_relay::source::{SessionLimits, Source};

/// A `Source` for `env`'s database through `proxy` (its `[postgres]` gets `extra`).
async fn source_through(env: &Env, proxy: &testkit::Proxy, extra: &str) -> Source {
    let text = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace(
            &format!(":{}/", env.pg.port()),
            &format!(":{}/", proxy.port()),
        )
        .replace("pool_size = 16", &format!("pool_size = 16\n{extra}"));
    std::fs::write(&env.config, text).unwrap();
    let config = outbox_relay::config::load(&env.config).unwrap();
    let limits = SessionLimits::one_shot(&config.postgres);
    Source::open(&config.postgres, limits).await.unwrap()
}

/// A database seeded with `rows` over `keys` (see `seed`), reached through a proxy: the
/// environment, a direct client, the proxy, and a `Source` through it with
/// `prepared_statements = {prepared}`.
async fn distant(
    relay: Relay,
    rows: i64,
    keys: i64,
    prepared: &str,
) -> (Env, tokio_postgres::Client, testkit::Proxy, Source) {
    let env = Env::new(relay).await;
    let client = env.client().await;
    seed(&client, rows, keys, 0).await;
    let proxy = testkit::Proxy::start(([127, 0, 0, 1], env.pg.port()).into()).unwrap();
    let source = source_through(&env, &proxy, &format!("prepared_statements = {prepared}")).await;
    (env, client, proxy, source)
}

/// Waits until the relay's sessions have no transaction open: a `ROLLBACK` sent unwaited
/// has reached the server (so it is counted before what follows, not with it).
async fn settled(client: &tokio_postgres::Client, proxy: &testkit::Proxy) {
    wait_until("the sessions idle", Duration::from_secs(5), async || {
        count(
            client,
            "SELECT count(*) FROM pg_stat_activity \
             WHERE application_name = 'outbox-relay' AND state = 'idle in transaction'",
        )
        .await
            == 0
    })
    .await;
    // And every answer passed on: one still in the proxy would be delayed by a latency set
    // now, and the next request sent behind it would not count as a round trip.
    wait_until(
        "the answers delivered",
        Duration::from_secs(5),
        async || proxy.awaiting_answers() == 0,
    )
    .await;
}

/// One claim-shaped transaction that found rows: read them, then delete them with the
/// commit.
async fn claim_and_delete(source: &Source, ids: &[i64]) {
    let session = source.session().await.unwrap();
    let tx = source.begin(&session).await.unwrap();
    let found = tx
        .query(
            "SELECT id FROM public.outbox WHERE id = ANY($1) FOR UPDATE SKIP LOCKED",
            &[&ids],
        )
        .await
        .unwrap();
    assert_eq!(found.len(), ids.len());
    let deleted = tx
        .execute_and_commit("DELETE FROM public.outbox WHERE id = ANY($1)", &[&ids])
        .await
        .unwrap();
    assert_eq!(deleted, ids.len() as u64);
}

/// One claim-shaped transaction that found nothing.
async fn empty_claim(source: &Source) {
    let session = source.session().await.unwrap();
    let tx = source.begin(&session).await.unwrap();
    let found = tx
        .query("SELECT id FROM public.outbox WHERE id < 0", &[])
        .await
        .unwrap();
    assert!(found.is_empty());
    tx.rollback().unwrap();
}

/// Before: `BEGIN`, the claim, the delete and `COMMIT` each waited a round trip (4), and
/// two empty claims on one session cost 5 (`BEGIN`, claim, `ROLLBACK`, twice, less nothing).
/// Now: 2 for the batch; 3 sends-after-an-answer for the two empty claims (the first
/// `ROLLBACK` is sent after the claim's answer, the second transaction's `BEGIN` goes with
/// it), of which only the two claims are waited for.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_waits_two_round_trips_begin_with_the_claim_and_the_delete_with_the_commit() {
    for prepared in ["true", "false"] {
        let (_env, client, proxy, source) = distant(relay(), 4, 2, prepared).await;
        // The statements' first use prepares them (or learns their types): not counted.
        claim_and_delete(&source, &[1]).await;
        empty_claim(&source).await;
        settled(&client, &proxy).await;
        proxy.set(testkit::Fault::Latency(Duration::from_millis(20)));
        let before = proxy.round_trips();
        claim_and_delete(&source, &[2, 3]).await;
        let batch = proxy.round_trips() - before;
        let before = proxy.round_trips();
        empty_claim(&source).await;
        empty_claim(&source).await;
        settled(&client, &proxy).await;
        let empty = proxy.round_trips() - before;
        assert_eq!(
            (batch, empty),
            (2, 3),
            "round trips of a batch and of two empty claims (prepared_statements = {prepared})"
        );
        assert_eq!(
            count(&client, "SELECT count(*) FROM public.outbox").await,
            1,
            "rows 1-3 deleted, 4 left"
        );
    }
}

/// The delete sent with the `COMMIT` is inside the transaction: when it fails, the
/// transaction is rolled back whole (the `COMMIT` behind it answers as a rollback) and the
/// error is the statement's; when it succeeds, everything commits.
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_sent_with_the_commit_commits_or_fails_with_the_transaction() {
    for prepared in ["true", "false"] {
        let (_env, client, proxy, source) = distant(relay(), 3, 3, prepared).await;
        proxy.set(testkit::Fault::Latency(Duration::from_millis(5)));
        let failing = async |source: &Source| {
            let session = source.session().await.unwrap();
            let tx = source.begin(&session).await.unwrap();
            let deleted = tx
                .execute("DELETE FROM public.outbox WHERE id = 1", &[])
                .await
                .unwrap();
            assert_eq!(deleted, 1);
            // Division by zero for row 2, raised by the server while deleting.
            tx.execute_and_commit(
                "DELETE FROM public.outbox WHERE id = $1 AND 1 / (id - 2) = 0",
                &[&2i64],
            )
            .await
        };
        let error = failing(&source).await.unwrap_err().to_string();
        assert!(
            error.contains("division by zero"),
            "the statement's own error, got: {error}"
        );
        assert_eq!(
            column::<i64, Vec<i64>>(&client, "SELECT id FROM public.outbox ORDER BY id", &[]).await,
            vec![1, 2, 3],
            "nothing of the failed transaction committed (prepared_statements = {prepared})"
        );
        // The session is usable afterwards and the next transaction commits whole.
        claim_and_delete(&source, &[1, 2]).await;
        assert_eq!(
            column::<i64, Vec<i64>>(&client, "SELECT id FROM public.outbox ORDER BY id", &[]).await,
            vec![3]
        );
    }
}

/// A batch's `COMMIT` carries the session's next transaction: its `BEGIN` and its first
/// statement (the next claim) go out behind the delete and the `COMMIT`, before any answer
/// is read (`Tx::execute_commit_then`). So a claim, its delete with the commit and the next
/// claim wait 2 round trips, not 3; and the next claim runs after the commit, so it sees
/// the rows deleted. When the delete fails, nothing of the batch is kept and the next
/// transaction, which ran after the rollback, is rolled back too.
#[tokio::test(flavor = "multi_thread")]
async fn the_next_claim_goes_with_the_commit_and_sees_what_it_committed() {
    use outbox_relay::source::{SourceError, Tx};
    for prepared in ["true", "false"] {
        let (_env, client, proxy, source) = distant(relay(), 8, 8, prepared).await;
        const CLAIM: &str = "SELECT id FROM public.outbox WHERE id = ANY($1) ORDER BY id \
                             FOR UPDATE SKIP LOCKED";
        const DELETE: &str =
            "DELETE FROM public.outbox WHERE id = ANY($1) AND 1 / (id - 7) IS NOT NULL";
        // One batch: claim `ids`, delete them with the commit, and claim `next` in the
        // session's next transaction; returns what the delete and the next claim got.
        let batch = async |ids: &[i64], next: &[i64]| -> Result<(u64, Vec<i64>), SourceError> {
            let session = source.session().await.unwrap();
            let tx = source.begin(&session).await.unwrap();
            let found = tx.query(CLAIM, &[&ids]).await?;
            assert_eq!(found.len(), ids.len());
            let next_claim = async |tx: Tx<'_>| {
                let rows = tx.query(CLAIM, &[&next]).await?;
                tx.commit().await?;
                Ok(rows
                    .iter()
                    .map(|r| r.get::<_, i64>(0))
                    .collect::<Vec<i64>>())
            };
            let (deleted, claimed) = tx
                .execute_commit_then(DELETE, &[&ids], Some(next_claim))
                .await?;
            Ok((deleted, claimed.expect("a next transaction was asked for")?))
        };
        // The statements' first use prepares them (or learns their types): not counted.
        assert_eq!(batch(&[1], &[8]).await.unwrap(), (1, vec![8]));
        settled(&client, &proxy).await;

        proxy.set(testkit::Fault::Latency(Duration::from_millis(20)));
        let before = proxy.round_trips();
        let session = source.session().await.unwrap();
        let tx = source.begin(&session).await.unwrap();
        let (first, then) = (vec![2i64, 3], vec![2i64, 3, 4]);
        let found = tx.query(CLAIM, &[&first]).await.unwrap();
        assert_eq!(found.len(), 2);
        // Keeps its transaction open, as the relay's next claim does.
        async fn open_claim<'a>(
            tx: Tx<'a>,
            ids: &[i64],
        ) -> Result<(Tx<'a>, Vec<tokio_postgres::Row>), SourceError> {
            let rows = tx.query(CLAIM, &[&ids]).await?;
            Ok((tx, rows))
        }
        let (deleted, next) = tx
            .execute_commit_then(DELETE, &[&first], Some(|tx| open_claim(tx, &then)))
            .await
            .unwrap();
        let waited = proxy.round_trips() - before;
        let (next_tx, rows) = next.unwrap().unwrap();
        proxy.set(testkit::Fault::None);
        assert_eq!(deleted, 2);
        assert_eq!(
            waited, 2,
            "round trips of a claim, its delete with the commit, and the next claim \
             (prepared_statements = {prepared})"
        );
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        assert_eq!(
            ids,
            [4],
            "the next claim ran after the commit: 2 and 3 are gone"
        );
        next_tx.rollback().unwrap();
        drop(session);

        // Row 7 makes the delete fail (division by zero): the batch's transaction rolls
        // back whole, and the next one, which claimed row 6 after that rollback, too.
        let error = batch(&[5, 7], &[6]).await.unwrap_err().to_string();
        assert!(
            error.contains("division by zero"),
            "the delete's error, got: {error}"
        );
        settled(&client, &proxy).await;
        assert_eq!(
            column::<i64, Vec<i64>>(&client, "SELECT id FROM public.outbox ORDER BY id", &[]).await,
            vec![4, 5, 6, 7, 8],
            "rows 1-3 deleted, 5 and 7 kept (the delete rolled back) (prepared_statements = {prepared})"
        );
        let locked = count(
            &client,
            "SELECT count(*) FROM (SELECT id FROM public.outbox WHERE id = 6 \
             FOR UPDATE SKIP LOCKED) free",
        );
        assert_eq!(
            locked.await,
            1,
            "row 6 is not left locked by the next transaction"
        );
    }
}

/// A deep key-ordered backlog: a claim of a worker above lane 0 reads and locks its
/// buckets in one statement (`pick_lock`, with `BEGIN`), and plans its heads and their
/// runs from what that statement locked, so the claim waits one round trip and its
/// transaction two, the commit included. Before: the first window, its lock round, the
/// bucket read, its lock round and the tails, 6 and more. What it took is still each key's
/// oldest rows, a prefix of its pending rows.
#[tokio::test(flavor = "multi_thread")]
async fn a_deep_claim_above_lane_0_waits_one_round_trip_and_takes_each_keys_oldest_rows() {
    use outbox_relay::source::claim::{claim_batch, Budget, FloorView};
    const KEYS: i64 = 20;
    for prepared in ["true", "false"] {
        // 20 keys: the first window (256 rows) holds every key, so a second claim that
        // meets the first's heads finds nothing left in it.
        let (env, client, proxy, source) =
            distant(relay().batch_size(100), 5_000, KEYS, prepared).await;
        let config = outbox_relay::config::load(&env.config).unwrap();
        let plans = outbox_relay::source::table::prepare(&source, &config)
            .await
            .unwrap();
        let plan = &plans[0];
        let budget = Budget {
            rows: 100,
            bytes: u64::MAX,
        };
        let floor = FloorView::default();
        let claim = async |tx: &outbox_relay::source::Tx<'_>, lane: usize| {
            let ordering = outbox_relay::config::Ordering::Key;
            claim_batch(tx, &plan.sql, ordering, budget, lane, &floor, &plan.depth)
                .await
                .unwrap()
        };
        // Not counted: two claims of lane 0 at once, so the second meets the first's
        // heads and picks buckets (the process learns the backlog is deep, and how deep
        // its buckets are); then one of lane 1, which prepares its statements.
        let (a, b) = (
            source.session().await.unwrap(),
            source.session().await.unwrap(),
        );
        let first = source.begin(&a).await.unwrap();
        assert_eq!(claim(&first, 0).await.rows.len(), 100);
        let second = source.begin(&b).await.unwrap();
        assert!(
            claim(&second, 0).await.contended,
            "every key is the first claim's"
        );
        first.rollback().unwrap();
        second.rollback().unwrap();
        drop((a, b));
        source
            .in_transaction(async |tx| Ok(claim(tx, 1).await))
            .await
            .unwrap();
        settled(&client, &proxy).await;

        proxy.set(testkit::Fault::Latency(Duration::from_millis(20)));
        let before = proxy.round_trips();
        let claimed = source
            .in_transaction(async |tx| Ok(claim(tx, 1).await))
            .await
            .unwrap();
        let waited = proxy.round_trips() - before;
        proxy.set(testkit::Fault::None);
        assert_eq!(claimed.rows.len(), 100, "a full batch");
        assert_eq!(
            waited, 2,
            "round trips of a deep claim above lane 0 and its commit (prepared_statements = {prepared})"
        );
        // Each key's rows in the claim are its oldest pending rows (nothing was deleted:
        // seed puts row n in key n % KEYS, so key k's rows are k, k + KEYS, ...).
        let mut by_key: std::collections::BTreeMap<std::sync::Arc<str>, Vec<i64>> =
            Default::default();
        for row in &claimed.rows {
            by_key
                .entry(row.key.clone().unwrap())
                .or_default()
                .push(row.id);
        }
        for (key, ids) in by_key {
            let k: i64 = key[1..].parse().unwrap();
            let first = if k == 0 { KEYS } else { k };
            let oldest: Vec<i64> = (0..ids.len() as i64).map(|i| first + KEYS * i).collect();
            assert_eq!(ids, oldest, "key {key} takes its oldest rows, in id order");
        }
        // What the pick locks, and so sends back with payloads, stays within the rows and
        // bytes it is given: rows 1-3 carry one byte each, so 3 bytes lock three heads.
        let locked = async |rows: i64, bytes: i64| {
            let read = client
                .query(
                    &plan.sql.pick_lock,
                    &[
                        &i64::MIN,
                        &1_000i64,
                        &(0..64).collect::<Vec<i32>>(),
                        &i64::MIN,
                        &Vec::<i64>::new(),
                        &plan.sql.tag,
                        &64i64,
                        &rows,
                        &bytes,
                    ],
                )
                .await
                .unwrap();
            read.iter()
                .filter(|r| r.get::<_, Option<i64>>(0).is_some())
                .count()
        };
        assert_eq!(locked(1_000, 3).await, 3, "three one-byte candidates");
        assert_eq!(locked(10, i64::MAX).await, 10, "ten candidates");
        assert_eq!(locked(0, i64::MAX).await, 0, "a pick that only reads");
    }
}

/// Start-up's table checks (columns, indexes, privileges, the relay's own tables, the
/// NOTIFY trigger) ask their independent questions together, each parsed, bound and run
/// in one round trip (`query_typed`): the schema's read with the `BEGIN`, the columns'
/// read, then everything else at once, and the `COMMIT`: 4 counted. Bound: 6, below the
/// 8-9 of the same questions each prepared first (a prepare, then an execute), and far
/// below the 30 of one after the other, 0.33 s of every start-up with the database 10 ms
/// away. The same for 21 tables (issue 55): each question is asked of all of them at
/// once.
#[tokio::test(flavor = "multi_thread")]
async fn start_up_checks_tables_in_a_few_round_trips_whatever_their_number() {
    for (prepared, more) in [("true", 0), ("false", 0), ("false", 20)] {
        let (env, client, proxy, source) = distant(relay(), 0, 1, prepared).await;
        if more > 0 {
            let names: Vec<String> = (0..more).map(|i| format!("public.more_{i}")).collect();
            let entries: String = names
                .iter()
                .map(|t| format!("[[tables]]\nname = \"{t}\"\ntopic = \"{{topic}}\"\n"))
                .collect();
            // (The config's URL is the database's again; `source` goes through the proxy.)
            env.write_config(&relay().section(&entries));
            let out = env.migrate(&[]);
            assert!(out.status.success(), "{}", text(&out));
            for t in &names {
                grant_relay_role(&client, t).await;
            }
        }
        let config = outbox_relay::config::load(&env.config).unwrap();
        // The session that learned the pooler mode is the pool's first: no second
        // handshake. (And connecting is not what is counted below.)
        drop(source.session().await.unwrap());
        assert_eq!(
            proxy.accepted(),
            1,
            "the pool's first session is the probe's"
        );
        proxy.set(testkit::Fault::Latency(Duration::from_millis(20)));
        let before = proxy.round_trips();
        let tables = outbox_relay::source::table::prepare(&source, &config)
            .await
            .unwrap();
        let waited = proxy.round_trips() - before;
        eprintln!(
            "{} tables, prepared_statements = {prepared}: {waited} round trips",
            more + 1
        );
        assert_eq!(tables.len(), more + 1);
        assert!(
            waited <= 6,
            "start-up's checks of {} tables waited {waited} round trips \
             (prepared_statements = {prepared})",
            more + 1
        );
    }
}
