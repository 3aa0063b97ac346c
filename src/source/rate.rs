//! `[[tables]] max_rate`: rows per second published from a table by all its relays
//! together, through one token bucket per table in PostgreSQL
//! (`<schema>.outbox_relay_rates`, migration 0006).
//!
//! Why a bucket in the database rather than a share per relay: relays do not know how
//! many of them there are (nothing registers them, and the bucket claim of
//! [`super::claim`] hands work to whoever asks), while every relay of a table already
//! reaches its database. The cost is one short statement per batch, never per row:
//! before a claim the relay takes up to a batch's worth of tokens (the bucket refills at
//! `max_rate` per second, up to one second's worth), and claims at most that many rows;
//! after it, it gives back what the claim did not use. The statement runs on its own,
//! outside the claim's transaction: inside it, the bucket's row lock would serialize every
//! claim of the table until its publish ended.

use std::time::Duration;

use super::{SourceError, Tx};
use crate::config::TableName;

/// One table's bucket: its statements and rate.
pub(crate) struct Bucket {
    name: String,
    rate: f64,
    /// Tokens the bucket holds at most: one second's worth, at least one row.
    burst: f64,
    take: String,
    give_back: String,
}

/// What a take got.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Grant {
    /// Claim at most this many rows (at least one).
    Rows(usize),
    /// No token yet: the next one is due after this long.
    Wait(Duration),
}

impl Bucket {
    pub(crate) fn new(table: &TableName, rate: f64) -> Bucket {
        let r = super::schema_table(table, "outbox_relay_rates");
        // $1 table, $2 burst, $3 rows wanted, $4 rate. `now()` is this statement's own
        // start (it runs alone): one instant for the refill and the new `at`.
        let avail =
            "LEAST($2::float8, r.tokens + $4::float8 * extract(epoch FROM now() - r.at)::float8)";
        let grant = format!("LEAST($3::float8, GREATEST(floor({avail}), 0))");
        Bucket {
            name: table.to_string(),
            rate,
            burst: rate.max(1.0),
            take: format!(
                "INSERT INTO {r} AS r (table_name, tokens, at, granted) \
                 VALUES ($1, $2::float8 - LEAST($3::float8, floor($2::float8)), now(), \
                 LEAST($3::float8, floor($2::float8))) \
                 ON CONFLICT (table_name) DO UPDATE SET granted = {grant}, \
                 tokens = {avail} - {grant}, at = now() \
                 RETURNING granted::int8, tokens"
            ),
            give_back: format!(
                "UPDATE {r} SET tokens = LEAST($2::float8, tokens + $3::float8) WHERE table_name = $1"
            ),
        }
    }

    /// Takes up to `want` rows' tokens.
    pub(crate) async fn take(&self, tx: &Tx<'_>, want: usize) -> Result<Grant, SourceError> {
        let want = want as f64;
        let row = tx
            .query_one(&self.take, &[&self.name, &self.burst, &want, &self.rate])
            .await?;
        let (granted, left): (i64, f64) = (row.get(0), row.get(1));
        Ok(if granted > 0 {
            Grant::Rows(granted as usize)
        } else {
            Grant::Wait(Duration::from_secs_f64(
                ((1.0 - left) / self.rate).max(0.001),
            ))
        })
    }

    /// Returns `n` unused rows' tokens.
    pub(crate) async fn give_back(&self, tx: &Tx<'_>, n: usize) -> Result<(), SourceError> {
        let n = n as f64;
        tx.execute(&self.give_back, &[&self.name, &self.burst, &n])
            .await?;
        Ok(())
    }
}
