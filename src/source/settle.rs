//! The end of a batch, the claim's other half: what a batch writes back to its table
//! ([`Settlement`]) and the statements that write it and commit ([`commit_batch`]), with
//! their parameters bound here, as [`super::claim`] binds the claim's.

use std::time::Duration;

use super::sql::TableSql;
use super::{SourceError, Tx};
use crate::config::OnPublish;

/// What a batch writes back, decided from its rows' outcomes alone.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Settlement {
    /// Acknowledged by the broker: marked published or deleted.
    pub(crate) published: Vec<i64>,
    /// Refused for their own sake: each records an attempt (dead-lettered at
    /// `max_attempts`) and waits before its next one.
    pub(crate) failed: Failures,
    /// Rows not sent because their destination could not take them now, and rows at their
    /// last attempt whose dead-letter topic could not take them for the broker's sake: no
    /// attempt counted; each waits (like a retry, holding its key back) before it is tried
    /// again.
    pub(crate) postponed: Failures,
}

/// Failed rows as the failure statement takes them: three arrays, index-aligned.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Failures {
    pub(crate) ids: Vec<i64>,
    pub(crate) errors: Vec<String>,
    /// Microseconds until each row's next attempt.
    pub(crate) waits_us: Vec<i64>,
}

impl Settlement {
    /// Every row claimed was published: nothing failed, nothing waits.
    pub(crate) fn all_published(&self) -> bool {
        self.failed.ids.is_empty() && self.postponed.ids.is_empty() && !self.published.is_empty()
    }

    /// The soonest next attempt this settlement schedules, if any row failed or waits.
    pub(crate) fn retry_in(&self) -> Option<Duration> {
        self.failed
            .waits_us
            .iter()
            .chain(&self.postponed.waits_us)
            .min()
            .map(|us| Duration::from_micros((*us).max(0) as u64))
    }
}

/// Marks or deletes the published rows, records the failed rows' attempts and
/// commits; returns the rows that reached `max_attempts` (dead-lettered). With `next`, the
/// session's next transaction is opened behind the `COMMIT` and `next` runs in it
/// ([`Tx::execute_commit_then`]); its result comes back too (none when there was no
/// published row to carry it).
pub(crate) async fn commit_batch<'s, T, F, Fut>(
    tx: Tx<'s>,
    sql: &TableSql,
    on_publish: OnPublish,
    max_attempts: i32,
    settlement: &Settlement,
    next: Option<F>,
) -> Result<(Vec<i64>, Option<Result<T, SourceError>>), SourceError>
where
    F: FnOnce(Tx<'s>) -> Fut,
    Fut: std::future::Future<Output = Result<T, SourceError>>,
{
    let mut dead = Vec::new();
    let postponed = &settlement.postponed;
    if !postponed.ids.is_empty() {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&postponed.ids, &postponed.errors, &postponed.waits_us];
        tx.execute(&sql.postpone, &params).await?;
    }
    let failed = &settlement.failed;
    if !failed.ids.is_empty() {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&failed.ids, &failed.errors, &max_attempts, &failed.waits_us];
        for r in tx.query(&sql.record_failures, &params).await? {
            if r.get::<_, bool>(1) {
                dead.push(r.get::<_, i64>(0));
            }
        }
    }
    if settlement.published.is_empty() {
        tx.commit().await?;
        return Ok((dead, None));
    }
    // The published rows' delete or mark travels with the COMMIT: one round trip.
    let (_, next) = tx
        .execute_commit_then(sql.published(on_publish), &[&settlement.published], next)
        .await?;
    Ok((dead, next))
}
