//! What an outbox table looks like in the catalog, and whether the relay can use it.
//!
//! The checks ask about every table at once ([`inspect_all`]): each kind of question
//! (schema, columns, unique order column, claim indexes, privileges, the relay's own
//! tables, the wake-up) is one statement over arrays of the tables' names, one
//! element per table or per (table, item), unrolled by `unnest(...) WITH ORDINALITY` and
//! answered one row per element in their order. A relay of 500 tables asks the same eight
//! statements as a relay of one, where about 14 a table (7,000, 0.7 s before its first
//! claim) were asked before.
//!
//! Three round trips, as for one table: the schemas first (in a schema this role may not
//! use, `to_regclass` raises an error, so its tables are asked nothing more), then the
//! columns (the questions after them ask only about columns that exist), then the rest,
//! sent together (tokio-postgres pipelines the statements a client is asked at once).
//! Every statement is an unnamed one with its parameters' types (`query_typed`): parsed,
//! bound and run in one round trip, with no session state, so it works behind a pooler
//! in transaction mode.

use std::collections::HashMap;

use tokio_postgres::GenericClient;

use super::SourceError;
use crate::config::{Ident, OnPublish, Ordering, RelayConfig, TableConfig};

mod catalog;
mod columns;

use catalog::{
    check_hold_triggers, check_indexes, check_privileges, check_relay_tables, check_schemas,
    find_columns, unique_problems, wake_ups,
};
pub(crate) use catalog::{order_is_unique, wake_state};
use columns::check_columns;

/// How the payload column is turned into message bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PayloadType {
    /// Sent as stored.
    Bytea,
    /// `text`, `varchar`, `json` or `jsonb`: sent as its UTF-8 text.
    Text,
}

/// The parts of a table's catalog entry the relay's SQL depends on.
#[derive(Debug, Clone)]
pub(crate) struct TableShape {
    pub(crate) payload: PayloadType,
    /// The headers column, when the table has one.
    pub(crate) headers: Option<Ident>,
    /// The creation-time column, when the table has one.
    pub(crate) created_at: Option<Ident>,
    /// Which wake-up the table has.
    pub(crate) wake: Wakeup,
}

/// What wakes idle relays when rows of a table commit (`migrations/notify.sql`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wakeup {
    /// None (`migrate --no-notify`, or disabled): relays poll the table.
    None,
    /// A previous release's `outbox_relay_notify`: every INSERT statement notifies.
    Every,
    /// The attempts column's default `outbox_relay_nudge`, or the trigger
    /// `outbox_relay_wake` of the release before it: an INSERT notifies while a relay is
    /// asleep on the table ([`super::sleepers`]).
    Gated,
}

/// A table's outcome: the shape the relay's statements are built for, or every problem
/// found, each a sentence saying what to fix.
pub(crate) type Inspection = Result<TableShape, Vec<String>>;

/// Every problem found with each of `tables`, in their order (see [`Inspection`]); each
/// table's problems the same, and in the same order, as if it were asked about alone.
pub(crate) async fn inspect_all(
    client: &impl GenericClient,
    tables: &[&TableConfig],
    relay: &RelayConfig,
) -> Result<Vec<Inspection>, SourceError> {
    let usable = check_schemas(client, tables).await?;
    let found = find_columns(client, usable).await?;
    let checked = {
        let asked: Vec<&Found> = found.iter().filter_map(|f| f.as_ref().ok()).collect();
        check_found(client, &asked, relay).await?
    };
    Ok(merge(found, checked))
}

/// `earlier`, each table still `Ok` in it replaced by its outcome in `later` (one for each,
/// in order).
pub(super) fn merge<T, U>(
    earlier: Vec<Result<T, Vec<String>>>,
    later: Vec<Result<U, Vec<String>>>,
) -> Vec<Result<U, Vec<String>>> {
    let mut later = later.into_iter();
    earlier
        .into_iter()
        .map(|e| e.and_then(|_| later.next().expect("an outcome for each table asked")))
        .collect()
}

/// `problems`, each with its table's place among `n` tables, gathered by table (each
/// table's in the order given).
pub(super) fn by_table(
    n: usize,
    problems: impl IntoIterator<Item = (usize, String)>,
) -> Vec<Vec<String>> {
    let mut by = vec![Vec::new(); n];
    for (i, problem) in problems {
        by[i].push(problem);
    }
    by
}

/// A table that exists, with its columns' types (name -> type name).
pub(super) struct Found<'a> {
    pub(super) table: &'a TableConfig,
    pub(super) types: HashMap<String, String>,
}

/// Checks the columns of each of the tables `found`, then asks the questions left, which
/// do not depend on each other's answers: sent together, they share a round trip.
async fn check_found(
    client: &impl GenericClient,
    found: &[&Found<'_>],
    relay: &RelayConfig,
) -> Result<Vec<Inspection>, SourceError> {
    let (shapes, mut problems): (Vec<_>, Vec<_>) = found
        .iter()
        .map(|f| {
            let mut problems = Vec::new();
            let shape = check_columns(&f.types, f.table, relay, &mut problems);
            (shape, problems)
        })
        .unzip();
    let (unique, indexes, holds, privileges, relay_tables, (wakes, wake_problems)) = futures_util::try_join!(
        unique_problems(client, found),
        check_indexes(client, found, relay),
        check_hold_triggers(client, found),
        check_privileges(client, found, relay),
        check_relay_tables(client, found),
        wake_ups(client, found),
    )?;
    for more in [
        unique,
        indexes,
        holds,
        privileges,
        relay_tables,
        wake_problems,
    ] {
        for (problems, more) in problems.iter_mut().zip(more) {
            problems.extend(more);
        }
    }
    Ok(shapes
        .into_iter()
        .zip(problems)
        .zip(wakes)
        .map(|((shape, problems), wake)| match shape {
            Some(shape) if problems.is_empty() => Ok(TableShape { wake, ..shape }),
            _ => Err(problems),
        })
        .collect())
}

/// The quoted name of the table's index with `suffix` (`pending_idx`, ...): the name
/// `migrate` builds it under, and the one the start-up check looks for.
pub(crate) fn index_name(table: &TableConfig, suffix: &str) -> String {
    super::name_for(&table.name, suffix)
}

/// An index the claims read under some configurations only. Every index costs each of the
/// application's INSERT statements (`docs/writer-cost.md`), so `migrate` builds one only
/// for relays that read it, and drops it otherwise; the start-up check and `check`
/// require it only of those relays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimIndex {
    /// The pending index (migration 0001), which `on_publish = "mark"` needs: published
    /// rows stay in the table until retention deletes them, and a claim's read from the
    /// floor would pass every one published out of order. In delete mode the primary key
    /// holds only pending, dead and waiting rows, so the claims read it instead.
    Pending,
    /// The bucket index (migration 0004), which `ordering = "key"` needs: its claims of a
    /// deep backlog read the pending rows bucket by bucket (`source::claim`, *Buckets*).
    /// Unordered claims read the primary key alone (the pending index in mark mode).
    Bucket,
}

impl ClaimIndex {
    const ALL: [ClaimIndex; 2] = [ClaimIndex::Pending, ClaimIndex::Bucket];

    /// Its name's suffix, and what it holds.
    pub(crate) fn index(self) -> &'static (&'static str, &'static str) {
        match self {
            ClaimIndex::Pending => &("pending_idx", "pending rows in order (migration 0001)"),
            ClaimIndex::Bucket => &("bucket_idx", "pending rows by key bucket (migration 0004)"),
        }
    }

    /// Why the claims of relays configured as `relay` says never read it, or `None` when
    /// they rely on it.
    pub(crate) fn unread_because(self, relay: &RelayConfig) -> Option<&'static str> {
        match self {
            ClaimIndex::Pending if relay.on_publish == OnPublish::Mark => None,
            ClaimIndex::Pending => Some("on_publish = \"delete\" claims through the primary key"),
            ClaimIndex::Bucket if relay.ordering == Ordering::Key => None,
            ClaimIndex::Bucket => Some("ordering = \"none\" reads no key buckets"),
        }
    }
}

/// The indexes the claims of relays configured as `relay` says rely on, by suffix:
/// without one of them a claim scans the table. The relay refuses to start (and `check`
/// fails) until `migrate` built them.
pub(crate) fn claim_indexes(
    relay: &RelayConfig,
) -> impl Iterator<Item = &'static (&'static str, &'static str)> + '_ {
    (ClaimIndex::ALL.into_iter())
        .filter(|i| i.unread_because(relay).is_none())
        .map(ClaimIndex::index)
}
