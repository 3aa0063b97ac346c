//! Wake-up bounds that fail without the wake-up (issue 52).
//!
//! An idle relay claims from each table anyway [`IDLE_RECHECK`] after its last claim of it
//! found nothing (`src/relay/wake.rs`, rule 3), and that claim comes right after a batch
//! of the table publishes. A wake-up test whose bound is longer than what is left of that
//! cycle when its row commits passes with the wake-up removed: a 5 s bound passed one run
//! in four with every NOTIFY ignored. So each row here commits at a known point of its
//! table's cycle, [`IDLE_POINTS`] after the relay published the table's previous row, and
//! must be published within [`WAKE_BOUND`]: at every point the idle look is more than
//! the bound away, and only the wake-up under test (a NOTIFY, the poller) publishes it in
//! time. No point falls in the first 1.2 s of idleness, where a relay may still look at a
//! table that has just gone quiet on its own.

use std::time::{Duration, Instant};

/// How often an idle table is claimed from whatever wakes the relay (`IDLE_RECHECK` in
/// `src/relay/wake.rs`).
const IDLE_RECHECK: Duration = Duration::from_secs(5);

/// How long after the relay published a table's previous row the next one commits: early,
/// half-way and late in the idle cycle. The latest leaves 1.5 s to the idle look, more than
/// [`WAKE_BOUND`].
const IDLE_POINTS: [Duration; 3] = [
    Duration::from_millis(1_500),
    Duration::from_millis(2_500),
    Duration::from_millis(3_500),
];

/// The longest a wake-up may take, from a row's commit to its publication.
const WAKE_BOUND: Duration = Duration::from_secs(1);

/// How long a table's first row may take. Its publication starts the table's idle cycle;
/// with the wake-up under test broken it waits for the idle look, and the points' rows are
/// the ones that fail.
const FIRST_ROW: Duration = Duration::from_secs(10);

/// How long a point's row is waited for (see [`point`]).
const LATE_ROW: Duration = Duration::from_secs(7);

/// Shows that an idle relay is woken within [`WAKE_BOUND`] at every one of
/// [`IDLE_POINTS`]: commits a first row into each of `tables` and waits until each is
/// published, which starts its idle cycle; then commits point `i`'s row into table
/// `i % tables.len()` once that table has been idle that long. A table's points follow
/// each other (each row's publication starts its next cycle); different tables' points
/// run side by side, so three tables share one cycle's time, and a late row in one does
/// not push another's commit past its point. Fails, naming every late row and showing
/// `context()`, unless each row is published within the bound. The relay must delete
/// what it publishes.
pub async fn woken_at_every_idle_point(
    client: &tokio_postgres::Client,
    tables: &[&str],
    context: impl Fn() -> String,
) {
    let started = Instant::now();
    let mut first = Vec::new();
    for table in tables {
        first.push(commit_row(client, table).await);
    }
    let mut idle_since = vec![None; tables.len()];
    super::wait_until(
        "each table's first row to be published",
        FIRST_ROW,
        async || {
            for (t, table) in tables.iter().enumerate() {
                if idle_since[t].is_none() && gone(client, table, first[t]).await {
                    idle_since[t] = Some(Instant::now());
                }
            }
            idle_since.iter().all(Option::is_some)
        },
    )
    .await;

    let chains = tables
        .iter()
        .zip(idle_since)
        .enumerate()
        .map(|(t, (table, since))| {
            let mut idle_since = since.unwrap();
            eprintln!(
                "{table}: first row published {:?} after the first commit",
                idle_since.duration_since(started)
            );
            let idles = IDLE_POINTS.into_iter().skip(t).step_by(tables.len());
            async move {
                let mut points = Vec::new();
                for idle in idles {
                    let point = point(client, table, idle_since, idle).await;
                    eprintln!("{point}");
                    idle_since = point.published;
                    points.push(point);
                }
                points
            }
        });
    let points = futures_util::future::join_all(chains).await;
    let late: Vec<String> = points
        .iter()
        .flatten()
        .filter(|p| p.wake > WAKE_BOUND)
        .map(Point::to_string)
        .collect();
    assert!(
        late.is_empty(),
        "rows not published within {WAKE_BOUND:?} of their commits:\n{}\n{}",
        late.join("\n"),
        context()
    );
}

/// A row committed at a point of its table's idle cycle, and how soon it was published.
struct Point<'a> {
    table: &'a str,
    /// How long the table had been idle at the commit.
    idle: Duration,
    /// How long the idle look was away at the commit.
    look: Duration,
    /// From the commit to the row's publication.
    wake: Duration,
    published: Instant,
}

impl std::fmt::Display for Point<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: a row committed after {:?} idle ({:?} before the idle look) published {:?} \
             after its commit",
            self.table, self.idle, self.look, self.wake
        )
    }
}

/// Commits a row into `table` once it has been idle for `idle` since `idle_since`, and
/// waits for it past the idle look, so that a row later than [`WAKE_BOUND`] shows when it
/// was published.
async fn point<'a>(
    client: &tokio_postgres::Client,
    table: &'a str,
    idle_since: Instant,
    idle: Duration,
) -> Point<'a> {
    tokio::time::sleep_until((idle_since + idle).into()).await;
    let id = commit_row(client, table).await;
    let committed = Instant::now();
    let published = super::poll(LATE_ROW, async || {
        gone(client, table, id).await.then(Instant::now)
    })
    .await
    .unwrap_or_else(|| {
        panic!("{table}: a row committed after {idle:?} idle was not published within {LATE_ROW:?}")
    });
    Point {
        table,
        idle,
        look: (idle_since + IDLE_RECHECK).saturating_duration_since(committed),
        wake: published - committed,
        published,
    }
}

/// Commits one row into `table` (an outbox table); its id.
pub async fn commit_row(client: &tokio_postgres::Client, table: &str) -> i64 {
    client
        .query_one(
            &format!(
                "INSERT INTO {table} (topic, key, payload, headers) \
                 VALUES ('events.wake', 'w', 'x', '{{\"key\": \"w\"}}') RETURNING id"
            ),
            &[],
        )
        .await
        .unwrap_or_else(|e| panic!("insert into {table}: {e}"))
        .get(0)
}

/// Whether row `id` of `table` is gone: published by a relay that deletes.
async fn gone(client: &tokio_postgres::Client, table: &str, id: i64) -> bool {
    let sql = format!("SELECT count(*) FROM {table} WHERE id = $1");
    let n: i64 = client
        .query_one(&sql, &[&id])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0);
    n == 0
}
