//! The operator's commands: `status` (backlog, oldest pending age, failing, waiting, held
//! back and dead rows per table, and whether it is paused), `requeue` (clear `dead_at` and
//! `attempts` and make dead rows due now, so they are tried again; `--waiting`: waiting
//! rows are due now), `replay`, and `pause`/`resume` (see [`crate::source::pause`]).
//!
//! Both read the tables the way the relay does (mapped columns included) and hold no lock
//! longer than one statement. `requeue` then sends the NOTIFY that wakes idle relays.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::config::{Config, TableName};
use crate::source::discover;
pub(crate) use crate::source::operator::HeldRow;
use crate::source::operator::{self, RequeueRows, StatusCounts};
use crate::source::pause::{self, Paused};
use crate::source::table::{self, TablePlan};
use crate::source::SessionLimits;
use crate::source::{Source, SourceError};

/// Held rows (dead or waiting) listed per table by `status`.
const HELD_ROWS_SHOWN: i64 = 10;

/// One table's state, as `status` prints it.
#[derive(Debug, Clone)]
pub struct TableStatus {
    pub(crate) table: String,
    /// Its rows, counted by state.
    pub(crate) counts: StatusCounts,
    /// The oldest held rows, dead or waiting.
    pub(crate) held_rows: Vec<HeldRow>,
    /// Set while the table is paused for every relay.
    pub(crate) paused: Option<Paused>,
}

impl fmt::Display for TableStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let oldest = match self.counts.oldest_pending {
            Some(age) => format!(" (oldest {:.1}s old)", age.as_secs_f64()),
            None => String::new(),
        };
        write!(
            f,
            "{}: {} pending{oldest}, {} failing, {} waiting for retry{}, {} held back, \
             {} dead, {} kept as published",
            self.table,
            self.counts.pending,
            self.counts.failing,
            self.counts.waiting,
            match &self.counts.next_attempt {
                Some(at) => format!(" (next at {at})"),
                None => String::new(),
            },
            self.counts.held_back,
            self.counts.dead,
            self.counts.published
        )?;
        if let Some(p) = &self.paused {
            write!(
                f,
                "\n  PAUSED: {p} (no relay claims from it; `outbox-relay resume --table {}`)",
                self.table
            )?;
        }
        for row in &self.held_rows {
            let error = row.last_error.as_deref().unwrap_or("(none)");
            // One line per row: errors from brokers can span lines.
            let error: String = error.split_whitespace().collect::<Vec<_>>().join(" ");
            let state = match (&row.dead_at, &row.next_attempt_at) {
                (Some(at), _) => format!("dead id {}: dead since {at}", row.id),
                (None, Some(at)) => format!("waiting id {}: next attempt at {at}", row.id),
                (None, None) => format!("id {}", row.id),
            };
            let key = match &row.key {
                Some(k) => format!(", holds back {} later rows of key {k:?}", row.holds_back),
                None => String::new(),
            };
            write!(
                f,
                "\n  {state}, {} attempts{key}, last error: {error}",
                row.attempts
            )?;
        }
        let held = self.counts.dead + self.counts.waiting;
        if held > self.held_rows.len() as i64 {
            write!(
                f,
                "\n  ... and {} more dead or waiting rows",
                held - self.held_rows.len() as i64
            )?;
        }
        Ok(())
    }
}

/// `status --format json`: one document, `{"tables": [...]}`. The field set only grows
/// (contract section 3); times are as PostgreSQL prints a `timestamptz`, ages in seconds.
pub fn status_json(tables: &[TableStatus]) -> serde_json::Value {
    let tables: Vec<serde_json::Value> = tables
        .iter()
        .map(|t| {
            let mut entry = serde_json::json!({
                "table": t.table,
                "pending": t.counts.pending,
                "oldest_pending_age_seconds": t.counts.oldest_pending.map(|d| d.as_secs_f64()),
                "failing": t.counts.failing,
                "waiting_retry": t.counts.waiting,
                "next_attempt_at": t.counts.next_attempt,
                "held_back": t.counts.held_back,
                "dead": t.counts.dead,
                "published": t.counts.published,
                "paused": t.paused.is_some(),
                "held_rows": t.held_rows.iter().map(|r| serde_json::json!({
                    "id": r.id,
                    "attempts": r.attempts,
                    "dead_at": r.dead_at,
                    "next_attempt_at": r.next_attempt_at,
                    "last_error": r.last_error,
                    "key": r.key,
                    "holds_back": r.holds_back,
                })).collect::<Vec<_>>(),
            });
            if let Some(p) = &t.paused {
                entry["paused_at"] = p.since.clone().into();
                entry["paused_by"] = p.by.clone().into();
                entry["paused_reason"] = p.reason.clone().into();
            }
            entry
        })
        .collect();
    serde_json::json!({ "tables": tables })
}

/// A failure of `status` or `requeue`: bad arguments (exit 2) or the database (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Source(#[from] SourceError),
}

/// Opens a session and prepares every configured table, those the patterns match now
/// included; returns the configuration with them (`tables` lists each by name).
async fn connect(config: &Config) -> Result<(Source, Config, Vec<TablePlan>), AdminError> {
    let source = Source::open(&config.postgres, SessionLimits::one_shot(&config.postgres)).await?;
    let config = discover::resolve(&source, config).await?;
    let tables = table::prepare(&source, &config).await?;
    Ok((source, config, tables))
}

/// Every configured table's state.
pub async fn status(config: &Config) -> Result<Vec<TableStatus>, AdminError> {
    let (source, _, tables) = connect(config).await?;
    let names: Vec<TableName> = tables.iter().map(|t| t.config.name.clone()).collect();
    let paused = source
        .in_transaction(async |tx| pause::read(tx, &pause::read_sql(&names), &names).await)
        .await?;
    let mut out = Vec::new();
    for (table, paused) in tables.iter().zip(paused) {
        let (counts, held_rows) = source
            .in_transaction(async |tx| {
                let counts = table.status_counts(tx).await?;
                let held = table.held_rows(tx, HELD_ROWS_SHOWN).await?;
                Ok((counts, held))
            })
            .await?;
        out.push(TableStatus {
            table: table.config.name.to_string(),
            counts,
            held_rows,
            paused,
        });
    }
    Ok(out)
}

/// Which rows `requeue` makes due again.
#[derive(Debug, Clone)]
pub enum Requeue {
    /// These dead rows.
    Ids(Vec<i64>),
    /// Every dead row.
    All,
    /// Every row waiting for its next attempt: due now.
    Waiting,
}

/// What `requeue` did to one table.
#[derive(Debug, Clone)]
pub struct RequeueReport {
    pub(crate) table: String,
    /// `requeue --waiting`: the rows were waiting for a retry, not dead.
    pub(crate) waiting: bool,
    pub(crate) requeued: Vec<i64>,
    /// Ids asked for that were not dead-lettered (pending, published or not there).
    pub(crate) not_dead: Vec<i64>,
}

impl RequeueReport {
    /// What was made due, for the operator.
    pub fn summary(&self) -> String {
        let done = if self.waiting {
            format!(
                "made {} rows waiting for a retry due now",
                self.requeued.len()
            )
        } else {
            format!("requeued {} dead rows", self.requeued.len())
        };
        let ids = if self.requeued.is_empty() {
            String::new()
        } else {
            format!(" (ids {})", id_list(&self.requeued))
        };
        format!("{}: {done}{ids}", self.table)
    }

    /// A warning naming ids that were not dead, if any.
    pub fn warning(&self) -> Option<String> {
        (!self.not_dead.is_empty()).then(|| {
            format!(
                "warning: {}: not dead-lettered, left as they are: {}",
                self.table,
                id_list(&self.not_dead)
            )
        })
    }
}

/// Ids as the commands print them: `1, 2, 3`.
fn id_list(ids: &[i64]) -> String {
    ids.iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Clears `dead_at` and `attempts` of the chosen dead rows of `table` (or of the only
/// configured table) and makes them due now, or makes its waiting rows due now, in one
/// transaction, and wakes idle relays. "Due now" is `next_attempt_at` = the time of the
/// requeue, not NULL: see `sql::TableSql::window` for why.
pub async fn requeue(
    config: &Config,
    table: Option<&str>,
    which: Requeue,
) -> Result<RequeueReport, AdminError> {
    precheck(config, table, true)?;
    let (source, config, tables) = connect(config).await?;
    let table = &tables[pick_table(&config, table)?];
    let waiting = matches!(which, Requeue::Waiting);
    let requeued: Vec<i64> = source
        .in_transaction(async |tx| {
            let rows = match &which {
                Requeue::Ids(ids) => RequeueRows::Ids(ids),
                Requeue::All => RequeueRows::Dead,
                Requeue::Waiting => RequeueRows::Waiting,
            };
            let requeued = table.requeue(tx, rows).await?;
            operator::notify_relays(tx, &table.config.name.to_string()).await?;
            Ok(requeued)
        })
        .await?;
    let not_dead = match which {
        Requeue::Ids(ids) => ids
            .into_iter()
            .filter(|id| !requeued.contains(id))
            .collect(),
        Requeue::All | Requeue::Waiting => Vec::new(),
    };
    let mut requeued = requeued;
    requeued.sort_unstable();
    Ok(RequeueReport {
        table: table.config.name.to_string(),
        waiting,
        requeued,
        not_dead,
    })
}

/// What `pause` or `resume` found on one table: the pause that was there before (`None`:
/// it was not paused).
#[derive(Debug, Clone)]
pub struct PauseReport {
    pub(crate) table: String,
    pub(crate) before: Option<Paused>,
}

impl PauseReport {
    /// What `pause` did, for the operator.
    pub fn after_pause(&self) -> String {
        match &self.before {
            None => format!(
                "{}: paused; every relay stops claiming it within about a second (batches \
                 in flight finish) until `outbox-relay resume`",
                self.table
            ),
            Some(p) => format!("{}: already {p}; left as it was", self.table),
        }
    }

    /// What `resume` did, for the operator.
    pub fn after_resume(&self) -> String {
        match &self.before {
            Some(p) => format!("{}: resumed (was {p})", self.table),
            None => format!("{}: was not paused", self.table),
        }
    }
}

/// Pauses `table`, or every configured table, for every relay; a table already paused
/// keeps its pause (time, author, reason) as it is.
pub async fn pause(
    config: &Config,
    table: Option<&str>,
    reason: &str,
) -> Result<Vec<PauseReport>, AdminError> {
    precheck(config, table, false)?;
    let (source, config, tables) = connect(config).await?;
    let chosen = chosen_tables(&config, table)?;
    let by = pause::by_operator();
    let mut out = Vec::new();
    for t in chosen {
        let name = &tables[t].config.name;
        let before = source
            .in_transaction(async |tx| pause::pause(tx, name, &by, reason).await)
            .await?;
        out.push(PauseReport {
            table: name.to_string(),
            before,
        });
    }
    Ok(out)
}

/// Resumes `table`, or every configured table, and wakes idle relays.
pub async fn resume(config: &Config, table: Option<&str>) -> Result<Vec<PauseReport>, AdminError> {
    precheck(config, table, false)?;
    let (source, config, tables) = connect(config).await?;
    let chosen = chosen_tables(&config, table)?;
    let mut out = Vec::new();
    for t in chosen {
        let name = &tables[t].config.name;
        let before = source
            .in_transaction(async |tx| pause::resume(tx, name).await)
            .await?;
        out.push(PauseReport {
            table: name.to_string(),
            before,
        });
    }
    Ok(out)
}

/// `--table`'s index, or every configured table's without it.
fn chosen_tables(config: &Config, table: Option<&str>) -> Result<Vec<usize>, AdminError> {
    match table {
        Some(_) => Ok(vec![pick_table(config, table)?]),
        None => Ok((0..config.tables.len()).collect()),
    }
}

/// Before any connection: `--table` names a configured table or one a pattern entry may
/// match; without it, a command that acts on `one` table has one to act on, unless
/// patterns may match more.
fn precheck(config: &Config, table: Option<&str>, one: bool) -> Result<(), AdminError> {
    match table {
        Some(name) => {
            let wanted = TableName::parse(name)
                .map_err(|e| AdminError::Usage(format!("--table {name}: {e}")))?;
            let patterns = config.patterns.iter().filter_map(|t| t.pattern.as_ref());
            if patterns.clone().any(|p| p.matches(&wanted)) {
                return Ok(());
            }
            pick_table(config, table).map(|_| ())
        }
        None if one && config.patterns.is_empty() => pick_table(config, None).map(|_| ()),
        None => Ok(()),
    }
}

/// The index of `--table` among the configured tables (those patterns matched included,
/// once resolved), or of the only one.
fn pick_table(config: &Config, table: Option<&str>) -> Result<usize, AdminError> {
    Ok(match table {
        Some(name) => {
            let wanted = TableName::parse(name)
                .map_err(|e| AdminError::Usage(format!("--table {name}: {e}")))?;
            config
                .tables
                .iter()
                .position(|t| t.name == wanted)
                .ok_or_else(|| {
                    AdminError::Usage(format!(
                        "--table {name}: not in the config; configured: {}",
                        table_list(config)
                    ))
                })?
        }
        None if config.tables.len() == 1 => 0,
        None => {
            return Err(AdminError::Usage(format!(
                "several tables are configured ({}): say which with --table",
                table_list(config)
            )))
        }
    })
}

/// Which rows `replay` makes pending again.
#[derive(Debug, Clone)]
pub enum Replay {
    Ids(Vec<i64>),
    /// Created in [since, until): RFC 3339 times.
    Created {
        since: String,
        until: String,
    },
}

/// What `replay` did.
#[derive(Debug)]
pub struct ReplayReport {
    pub(crate) table: String,
    /// `--dry-run`: counted, nothing changed.
    pub(crate) dry_run: bool,
    /// Rows made pending again (with `--dry-run`: rows that would be).
    pub(crate) replayed: usize,
    /// Ids asked for that were not kept as published (pending, dead or not there).
    pub(crate) not_published: Vec<i64>,
}

impl ReplayReport {
    /// How many rows were (or would be) made pending again, for the operator.
    pub fn summary(&self) -> String {
        if self.dry_run {
            format!(
                "{}: would replay {} published rows (dry run: nothing changed)",
                self.table, self.replayed
            )
        } else {
            format!(
                "{}: replayed {} published rows: pending again, the relays publish them in \
                 id order per key",
                self.table, self.replayed
            )
        }
    }

    /// A warning naming ids that were not kept as published, if any.
    pub fn warning(&self) -> Option<String> {
        (!self.not_published.is_empty()).then(|| {
            format!(
                "warning: {}: not kept as published (pending, dead or not there), left as \
                 they are: {}",
                self.table,
                id_list(&self.not_published)
            )
        })
    }
}

/// The rows a replay holds first (the first of each key): among these ids, or created in
/// [since, until).
#[derive(Debug, Clone, Copy)]
enum Hold<'a> {
    Ids(&'a [i64]),
    Created(&'a str, &'a str),
}

/// Rows per replay transaction: each holds its rows' locks only this long.
const REPLAY_BATCH: i64 = 1_000;

/// How far a `replay` has come, for a progress line: rows made pending again so far, of
/// how many to replay (known once counted; rows kept as published then, so a row that
/// retention deletes meanwhile is not replayed and not counted in `done`).
#[derive(Debug, Default)]
pub struct ReplayProgress {
    pub done: AtomicU64,
    pub total: AtomicU64,
}

/// Makes rows kept as published (mark mode) pending and due again, dead rows left alone,
/// and reports how far it has come in `progress`. `dry_run`: counts only.
///
/// With key order a key's replayed rows and the rows committed while the replay runs go
/// out in id order, in three steps:
///
/// 1. One transaction makes the first row to replay of each key pending, but held
///    (`next_attempt_at` far in the future, see `sql::TableSql::replay_hold_range`):
///    from its commit on, a claim takes none of the key's later rows, neither the ones
///    replayed next nor the ones committed meanwhile, since a held row holds back every
///    later row of its key (`source::claim`).
/// 2. The rest are made pending and due, in id order, one short transaction per
///    [`REPLAY_BATCH`] rows; each waits behind its key's held row.
/// 3. One transaction makes every held row due and wakes idle relays, which publish each
///    key's rows in id order, the replayed ones first.
///
/// A replay that stops between 1 and 3 (killed, the database gone) leaves its held rows
/// holding their keys back: run it again (it finishes and releases them), or `requeue
/// --waiting` releases them.
pub async fn replay(
    config: &Config,
    table: Option<&str>,
    which: Replay,
    dry_run: bool,
    progress: &ReplayProgress,
) -> Result<ReplayReport, AdminError> {
    precheck(config, table, true)?;
    if config.relay.on_publish == crate::config::OnPublish::Delete {
        return Err(AdminError::Usage(
            "replay needs relay.on_publish = \"mark\": in delete mode no published row is kept"
                .to_owned(),
        ));
    }
    let (source, config, tables) = connect(config).await?;
    let table = &tables[pick_table(&config, table)?];
    let name = table.config.name.to_string();
    let replayer = Replayer {
        source: &source,
        table,
        name: &name,
        dry_run,
        progress,
    };
    let not_published = match which {
        Replay::Ids(ids) => replayer.ids(&ids).await?,
        Replay::Created { since, until } => {
            replayer.created(&since, &until).await?;
            Vec::new()
        }
    };
    if !dry_run {
        replayer.release().await?;
    }
    Ok(ReplayReport {
        table: name,
        dry_run,
        replayed: progress.done.load(Relaxed) as usize,
        not_published,
    })
}

/// One `replay` of one table: the steps of [`replay`], each in its own transactions.
struct Replayer<'a> {
    source: &'a Source,
    table: &'a TablePlan,
    name: &'a str,
    dry_run: bool,
    progress: &'a ReplayProgress,
}

impl Replayer<'_> {
    async fn notify(&self, tx: &crate::source::Tx<'_>) -> Result<(), SourceError> {
        operator::notify_relays(tx, self.name).await
    }

    /// Step 2 for `ids`, in one transaction: the ids made pending again (with `dry_run`,
    /// those that would be).
    async fn batch(&self, ids: &[i64]) -> Result<Vec<i64>, AdminError> {
        let ids = ids.to_vec();
        let done: Vec<i64> = self
            .source
            .in_transaction(async |tx| {
                let rows = self.table.replay_ids(tx, &ids, self.dry_run).await?;
                if !self.dry_run && !rows.is_empty() {
                    self.notify(tx).await?;
                }
                Ok(rows)
            })
            .await?;
        self.progress.done.fetch_add(done.len() as u64, Relaxed);
        Ok(done)
    }

    /// Step 1: the first row of each key among `rows` made pending but held; the ids
    /// held. Nothing with `dry_run`, or where the table has no key order to keep.
    async fn hold(&self, rows: Hold<'_>) -> Result<Vec<i64>, AdminError> {
        if self.dry_run || !self.table.replay_holds() {
            return Ok(Vec::new());
        }
        let held: Vec<i64> = self
            .source
            .in_transaction(async |tx| match rows {
                Hold::Ids(ids) => self.table.replay_hold_ids(tx, ids).await,
                Hold::Created(since, until) => self.table.replay_hold_range(tx, since, until).await,
            })
            .await?;
        self.progress.done.fetch_add(held.len() as u64, Relaxed);
        Ok(held)
    }

    /// Steps 1 and 2 for rows named by id; the ids that were not kept as published.
    async fn ids(&self, ids: &[i64]) -> Result<Vec<i64>, AdminError> {
        let mut not_published = Vec::new();
        self.progress.total.store(ids.len() as u64, Relaxed);
        let held: HashSet<i64> = self.hold(Hold::Ids(ids)).await?.into_iter().collect();
        for chunk in ids.chunks(REPLAY_BATCH as usize) {
            let done = self.batch(chunk).await?;
            not_published.extend(
                chunk
                    .iter()
                    .filter(|id| !done.contains(id) && !held.contains(id)),
            );
        }
        Ok(not_published)
    }

    /// Steps 1 and 2 for the rows created in [since, until), `until` no later than the
    /// replay's start; with `dry_run`, counted only.
    async fn created(&self, since: &str, until: &str) -> Result<(), AdminError> {
        let table = self.table;
        if !table.replays_by_time() {
            return Err(AdminError::Usage(format!(
                "{} has no creation-time column to select by: use --id, or map \
                 tables.columns.created_at",
                self.name
            )));
        }
        // From here on `until` is no later than the replay's start.
        let (total, until): (i64, String) = self
            .source
            .in_transaction(async |tx| table.replay_count(tx, since, until).await)
            .await?
            .unwrap_or_default();
        self.progress.total.store(total as u64, Relaxed);
        if self.dry_run {
            self.progress.done.store(total as u64, Relaxed);
            return Ok(());
        }
        self.hold(Hold::Created(since, &until)).await?;
        let mut after = i64::MIN;
        loop {
            let ids: Vec<i64> = self
                .source
                .in_transaction(async |tx| {
                    let range = (since, until.as_str());
                    table.replay_range(tx, range, after, REPLAY_BATCH).await
                })
                .await?;
            let Some(&last) = ids.last() else { break };
            self.batch(&ids).await?;
            after = last;
        }
        Ok(())
    }

    /// Step 3: every held row made due, and idle relays woken if there was one.
    async fn release(&self) -> Result<(), AdminError> {
        self.source
            .in_transaction(async |tx| {
                if self.table.replay_release(tx).await? {
                    self.notify(tx).await?;
                }
                Ok(())
            })
            .await?;
        Ok(())
    }
}

/// The configured tables, and the patterns, for a usage error.
fn table_list(config: &Config) -> String {
    let tables = config.tables.iter().map(|t| t.name.to_string());
    let patterns = (config.patterns.iter()).filter_map(|t| Some(t.pattern.as_ref()?.to_string()));
    tables.chain(patterns).collect::<Vec<_>>().join(", ")
}
