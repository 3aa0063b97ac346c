//! The operator's commands on one table (`status`, `requeue`, `replay`): their statements
//! are bound and their rows read here, so `admin` sees typed answers, not SQL.

use std::time::Duration;

use super::table::TablePlan;
use super::{SourceError, Tx};

/// A table's rows as `status` counts them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StatusCounts {
    pub(crate) pending: i64,
    /// Pending rows that failed at least once (being retried).
    pub(crate) failing: i64,
    pub(crate) dead: i64,
    /// Rows kept with `published_at` set (mark mode).
    pub(crate) published: i64,
    /// Pending rows waiting for their next attempt (`next_attempt_at` in the future).
    pub(crate) waiting: i64,
    /// The earliest next attempt among them, as PostgreSQL prints a timestamp.
    pub(crate) next_attempt: Option<String>,
    /// Pending rows held back (key order) by an earlier dead or waiting row of their key.
    pub(crate) held_back: i64,
    /// Age of the oldest pending row; `None` when nothing is pending or the table has no
    /// creation-time column.
    pub(crate) oldest_pending: Option<Duration>,
}

/// A row that holds back the later rows of its key: dead, or waiting for a retry.
#[derive(Debug, Clone)]
pub(crate) struct HeldRow {
    pub(crate) id: i64,
    pub(crate) attempts: i64,
    /// Set when dead-lettered.
    pub(crate) dead_at: Option<String>,
    /// Set while waiting for its next attempt.
    pub(crate) next_attempt_at: Option<String>,
    pub(crate) last_error: Option<String>,
    pub(crate) key: Option<String>,
    /// Later pending rows of its key.
    pub(crate) holds_back: i64,
}

/// The rows `requeue` makes due.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RequeueRows<'a> {
    /// These dead rows.
    Ids(&'a [i64]),
    /// Every dead row.
    Dead,
    /// Every row waiting for its next attempt.
    Waiting,
}

/// Wakes idle relays on `table` (the name's Display form, as NOTIFY names a table).
pub(crate) async fn notify_relays(tx: &Tx<'_>, table: &str) -> Result<(), SourceError> {
    tx.execute("SELECT pg_notify('outbox_relay', $1)", &[&table])
        .await
        .map(drop)
}

fn ids(rows: Vec<tokio_postgres::Row>) -> Vec<i64> {
    rows.iter().map(|r| r.get(0)).collect()
}

impl TablePlan {
    /// The table's counts for `status`.
    pub(crate) async fn status_counts(&self, tx: &Tx<'_>) -> Result<StatusCounts, SourceError> {
        let counts = tx.query_one(&self.sql.status, &[]).await?;
        Ok(StatusCounts {
            pending: counts.get(0),
            failing: counts.get(1),
            dead: counts.get(2),
            published: counts.get(3),
            waiting: counts.get(4),
            next_attempt: counts.get(5),
            held_back: counts.get(6),
            oldest_pending: counts
                .get::<_, Option<f64>>(7)
                .map(|s| Duration::from_secs_f64(s.max(0.0))),
        })
    }

    /// The oldest held rows (dead or waiting), at most `limit`.
    pub(crate) async fn held_rows(
        &self,
        tx: &Tx<'_>,
        limit: i64,
    ) -> Result<Vec<HeldRow>, SourceError> {
        let held = tx.query(&self.sql.held_rows, &[&limit]).await?;
        Ok(held
            .iter()
            .map(|r| HeldRow {
                id: r.get(0),
                attempts: r.get(1),
                dead_at: r.get(2),
                next_attempt_at: r.get(3),
                last_error: r.get(4),
                key: r.get(5),
                holds_back: r.get(6),
            })
            .collect())
    }

    /// Makes `which` rows due now; returns their order values.
    pub(crate) async fn requeue(
        &self,
        tx: &Tx<'_>,
        which: RequeueRows<'_>,
    ) -> Result<Vec<i64>, SourceError> {
        Ok(ids(match which {
            RequeueRows::Ids(ids) => tx.query(&self.sql.requeue_ids, &[&ids]).await?,
            RequeueRows::Dead => tx.query(&self.sql.requeue_all, &[]).await?,
            RequeueRows::Waiting => tx.query(&self.sql.requeue_waiting, &[]).await?,
        }))
    }

    /// `replay`: the rows `ids` kept as published are pending and due again (with
    /// `dry_run`, counted only); returns their order values.
    pub(crate) async fn replay_ids(
        &self,
        tx: &Tx<'_>,
        ids: &[i64],
        dry_run: bool,
    ) -> Result<Vec<i64>, SourceError> {
        let rows = tx.query(&self.sql.replay_ids, &[&ids, &dry_run]).await?;
        Ok(self::ids(rows))
    }

    /// Whether a replay holds each key's first row first (key order).
    pub(crate) fn replay_holds(&self) -> bool {
        self.sql.replay_hold_ids.is_some()
    }

    /// Whether the table can replay by creation time (it has a creation-time column).
    pub(crate) fn replays_by_time(&self) -> bool {
        self.sql.replay_range.is_some() && self.sql.replay_count.is_some()
    }

    /// `replay --since/--until`: how many rows kept as published were created in
    /// [`since`, `until`), and that end no later than now (RFC 3339 text). `None` without
    /// a creation-time column.
    pub(crate) async fn replay_count(
        &self,
        tx: &Tx<'_>,
        since: &str,
        until: &str,
    ) -> Result<Option<(i64, String)>, SourceError> {
        let Some(sql) = &self.sql.replay_count else {
            return Ok(None);
        };
        let row = tx.query_one(sql, &[&since, &until]).await?;
        Ok(Some((row.get(0), row.get(1))))
    }

    /// `replay --since/--until`: order values after `after`, at most `limit`, of rows kept
    /// as published created in [`since`, `until`), in order (none without a creation-time
    /// column).
    pub(crate) async fn replay_range(
        &self,
        tx: &Tx<'_>,
        (since, until): (&str, &str),
        after: i64,
        limit: i64,
    ) -> Result<Vec<i64>, SourceError> {
        let Some(sql) = &self.sql.replay_range else {
            return Ok(Vec::new());
        };
        let rows = tx.query(sql, &[&since, &until, &after, &limit]).await?;
        Ok(ids(rows))
    }

    /// `replay`, first: the first row of each key among `ids` is pending again but held,
    /// so its key's later rows wait behind it; returns their order values (none without
    /// key order).
    pub(crate) async fn replay_hold_ids(
        &self,
        tx: &Tx<'_>,
        ids: &[i64],
    ) -> Result<Vec<i64>, SourceError> {
        let Some(sql) = &self.sql.replay_hold_ids else {
            return Ok(Vec::new());
        };
        Ok(self::ids(tx.query(sql, &[&ids]).await?))
    }

    /// The same for the rows created in [`since`, `until`).
    pub(crate) async fn replay_hold_range(
        &self,
        tx: &Tx<'_>,
        since: &str,
        until: &str,
    ) -> Result<Vec<i64>, SourceError> {
        let Some(sql) = &self.sql.replay_hold_range else {
            return Ok(Vec::new());
        };
        Ok(ids(tx.query(sql, &[&since, &until]).await?))
    }

    /// `replay`, last: every row a replay holds is due now; whether there were any.
    pub(crate) async fn replay_release(&self, tx: &Tx<'_>) -> Result<bool, SourceError> {
        Ok(!tx.query(&self.sql.replay_release, &[]).await?.is_empty())
    }
}
