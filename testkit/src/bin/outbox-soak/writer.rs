//! The application side: a writer committing rows at a steady rate, and a few sessions that
//! hold transactions open for seconds before they commit (or roll back).
//!
//! Every row goes to `soak.<n>` with a key `k<n>`, except one in twenty with a NULL key
//! and one in [`POISON_EVERY`] to a `poison.<n>` subject no stream captures, under a key of
//! its own (so it holds back nothing but itself). The writer and the long transactions
//! connect to PostgreSQL directly and reconnect after a database crash; a commit whose
//! answer was lost is counted as ambiguous (the audit takes the table as the truth).
//!
//! The long transactions write keys of their own (`long-<n>`), and each first takes a
//! transaction-scoped advisory lock per key, as an application locks the aggregate a row
//! describes: same-key transactions then commit in id order, the one order a relay can
//! keep (see `src/source/claim/mod.rs`, "What the invariant cannot cover"). Their rows still
//! commit seconds after many higher ids of the steady writer were published: the relay
//! must not skip them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One row in this many is poison.
const POISON_EVERY: u64 = 5_000;
/// Sessions that hold transactions open.
const LONG_SESSIONS: u64 = 3;
/// Keys the long transactions share (`long-0` ..): few, so that they collide and queue.
const LONG_KEYS: u32 = 20;

/// What the application did, as it saw it.
#[derive(Default)]
pub(crate) struct Written {
    /// Ids of rows whose COMMIT returned success.
    pub(crate) acked: std::sync::Mutex<Vec<i64>>,
    /// Transactions whose COMMIT got no answer (the connection died): maybe committed.
    pub(crate) ambiguous: AtomicU64,
    /// Rows inserted by transactions rolled back on purpose (must never be published).
    pub(crate) rolled_back: AtomicU64,
    /// Transactions that failed before COMMIT (database down): retried, never committed.
    pub(crate) failed: AtomicU64,
    /// Long transactions committed after holding their rows for seconds.
    pub(crate) long_committed: AtomicU64,
}

pub(crate) struct Writer {
    pub(crate) written: Arc<Written>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writer {
    pub(crate) fn start(db_url: String, rate: u32, keys: u32, seed: u64) -> Writer {
        let written = Arc::new(Written::default());
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        let steady = Steady {
            url: db_url.clone(),
            per_tick: (rate as u64).div_ceil(100).max(1),
            keys,
            rng: StdRng::seed_from_u64(seed.wrapping_add(1)),
            written: written.clone(),
            stop: stop.clone(),
            seq: 0,
        };
        tasks.push(tokio::spawn(steady.run()));
        for s in 0..LONG_SESSIONS {
            let long = Long {
                url: db_url.clone(),
                rng: StdRng::seed_from_u64(seed.wrapping_add(10 + s)),
                written: written.clone(),
                stop: stop.clone(),
            };
            tasks.push(tokio::spawn(long.run()));
        }
        Writer {
            written,
            stop,
            tasks,
        }
    }

    /// Stops writing; waits for every open transaction to end (a long one commits first).
    pub(crate) async fn stop(self) -> Arc<Written> {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            let _ = task.await;
        }
        self.written
    }
}

async fn connect(url: &str, stop: &AtomicBool) -> Option<tokio_postgres::Client> {
    loop {
        if stop.load(Ordering::SeqCst) {
            return None;
        }
        if let Ok((client, connection)) = tokio_postgres::connect(url, tokio_postgres::NoTls).await
        {
            tokio::spawn(connection);
            return Some(client);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A row's columns.
fn row(rng: &mut StdRng, keys: u32, seq: u64) -> (String, Option<String>, String) {
    if seq > 0 && seq.is_multiple_of(POISON_EVERY) {
        return (
            format!("poison.{seq}"),
            Some(format!("poison-{seq}")),
            format!("poison {seq}"),
        );
    }
    let k = rng.random_range(0..keys);
    let key = (rng.random_range(0..20) != 0).then(|| format!("k{k}"));
    (format!("soak.{}", k % 8), key, format!("w{seq}"))
}

const INSERT: &str = "INSERT INTO public.outbox (topic, key, payload) \
                      SELECT t, k, convert_to(p, 'UTF8') \
                      FROM unnest($1::text[], $2::text[], $3::text[]) AS r(t, k, p) \
                      RETURNING id";

struct Steady {
    url: String,
    per_tick: u64,
    keys: u32,
    rng: StdRng,
    written: Arc<Written>,
    stop: Arc<AtomicBool>,
    seq: u64,
}

impl Steady {
    /// A transaction of `per_tick` rows every 10 ms (ticks missed while the database was
    /// away are skipped, not caught up).
    async fn run(mut self) {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut client = None;
        while !self.stop.load(Ordering::SeqCst) {
            tick.tick().await;
            if client.is_none() {
                client = connect(&self.url, &self.stop).await;
            }
            let Some(c) = client.as_mut() else { break };
            let (mut topics, mut keys, mut payloads) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..self.per_tick {
                self.seq += 1;
                let (t, k, p) = row(&mut self.rng, self.keys, self.seq);
                topics.push(t);
                keys.push(k);
                payloads.push(p);
            }
            match insert(c, &topics, &keys, &payloads, &self.written).await {
                Ok(ids) => self.written.acked.lock().unwrap().extend(ids),
                Err(_) => client = None,
            }
        }
    }
}

/// BEGIN, INSERT, COMMIT; the ids once COMMIT succeeded. An error at COMMIT is counted as
/// ambiguous, an earlier one as failed.
async fn insert(
    client: &mut tokio_postgres::Client,
    topics: &[String],
    keys: &[Option<String>],
    payloads: &[String],
    written: &Written,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let tx = match client.transaction().await {
        Ok(tx) => tx,
        Err(e) => {
            written.failed.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    let rows = match tx.query(INSERT, &[&topics, &keys, &payloads]).await {
        Ok(rows) => rows,
        Err(e) => {
            written.failed.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    if let Err(e) = tx.commit().await {
        written.ambiguous.fetch_add(1, Ordering::Relaxed);
        return Err(e);
    }
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A session that, every 1-5 s, locks 1-5 keys, inserts a row for each, holds the
/// transaction open for 1-8 s and then commits it (one in ten: rolls it back).
struct Long {
    url: String,
    rng: StdRng,
    written: Arc<Written>,
    stop: Arc<AtomicBool>,
}

impl Long {
    async fn run(mut self) {
        let mut client = None;
        while !self.stop.load(Ordering::SeqCst) {
            let pause = self.rng.random_range(1_000..5_000);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            if client.is_none() {
                client = connect(&self.url, &self.stop).await;
            }
            let Some(c) = client.as_mut() else { break };
            let n = self.rng.random_range(1..=5);
            let hold = Duration::from_millis(self.rng.random_range(1_000..8_000));
            let rollback = self.rng.random_range(0..10) == 0;
            let (mut topics, mut keys, mut payloads) = (Vec::new(), Vec::new(), Vec::new());
            let mut chosen: Vec<u32> = (0..n)
                .map(|_| self.rng.random_range(0..LONG_KEYS))
                .collect();
            // Locks in one order: two sessions never wait for each other in a cycle.
            chosen.sort_unstable();
            chosen.dedup();
            for k in chosen {
                topics.push(format!("soak.{}", k % 8));
                keys.push(Some(format!("long-{k}")));
                payloads.push(format!("long {k} {}", self.rng.random::<u32>()));
            }
            if self
                .hold(c, &topics, &keys, &payloads, hold, rollback)
                .await
                .is_err()
            {
                client = None;
            }
        }
    }

    async fn hold(
        &self,
        client: &mut tokio_postgres::Client,
        topics: &[String],
        keys: &[Option<String>],
        payloads: &[String],
        hold: Duration,
        rollback: bool,
    ) -> Result<(), tokio_postgres::Error> {
        let tx = client.transaction().await?;
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext(k)) FROM unnest($1::text[]) AS k ORDER BY k",
            &[&keys],
        )
        .await?;
        let rows = tx.query(INSERT, &[&topics, &keys, &payloads]).await?;
        tokio::time::sleep(hold).await;
        if rollback {
            tx.rollback().await?;
            self.written
                .rolled_back
                .fetch_add(rows.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
        if let Err(e) = tx.commit().await {
            self.written.ambiguous.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        self.written.long_committed.fetch_add(1, Ordering::Relaxed);
        self.written
            .acked
            .lock()
            .unwrap()
            .extend(rows.iter().map(|r| r.get::<_, i64>(0)));
        Ok(())
    }
}
