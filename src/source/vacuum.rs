//! What keeps VACUUM from cleaning the outbox table: its dead tuples, and the oldest open
//! snapshot in this database (a report, `pg_dump`, a forgotten `BEGIN`, a forgotten
//! prepared transaction, a standby's `hot_standby_feedback` through its replication slot).
//! Claims no longer slow down behind them (see [`super::floor`]),
//! but the table and its indexes grow until the snapshot goes: the operator should learn
//! who holds it.
//!
//! `pg_stat_activity` shows another role's `backend_xmin` only to members of
//! `pg_read_all_stats` (`pg_monitor` includes it): without the grant the relay sees its
//! own role's sessions, and says so.

use tokio_postgres::GenericClient;

use super::SourceError;

/// Something whose snapshot (xmin) keeps VACUUM from removing dead rows.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Holder {
    /// `session`, `prepared transaction` or `replication slot`.
    pub(crate) kind: String,
    /// The session's pid, the prepared transaction's gid, the slot's name.
    pub(crate) name: String,
    /// What else tells it apart: application, user and state of a session, the owner
    /// of a prepared transaction, whether a slot is active.
    pub(crate) detail: String,
    /// Seconds since its transaction (a session without one: since it began; a prepared
    /// transaction: since PREPARE). `None` for a slot: PostgreSQL does not record when.
    pub(crate) age_secs: Option<f64>,
    /// Transactions between its xmin and now.
    pub(crate) xid_age: i64,
    /// A slot no standby is connected to: it holds its xmin until it is dropped.
    pub(crate) abandoned: bool,
}

/// What holds back VACUUM in this database, as far as this role can see.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Horizon {
    /// Every holder, the oldest xmin first.
    pub(crate) holders: Vec<Holder>,
    /// Sessions of other roles this role may not inspect.
    pub(crate) hidden: bool,
}

impl Horizon {
    /// The longest a holder with a known age has held its snapshot (0 when none).
    pub(crate) fn oldest_secs(&self) -> f64 {
        self.holders
            .iter()
            .filter_map(|h| h.age_secs)
            .fold(0.0, f64::max)
    }

    /// The oldest xmin's age in transactions (0 when none).
    pub(crate) fn oldest_xid_age(&self) -> i64 {
        self.holders.iter().map(|h| h.xid_age).max().unwrap_or(0)
    }
}

/// Sessions of this database (and WAL senders, whose standbys' feedback counts) with a
/// snapshot, but the relay's own and autovacuum's (the cleaner, briefly); prepared
/// transactions of this database; replication slots with an xmin (a standby's
/// `hot_standby_feedback`; a logical slot's catalog_xmin holds back only the catalogs).
const HORIZON_SQL: &str = "\
SELECT kind, name, detail, age_secs, xid_age, abandoned FROM (
  SELECT 'session' AS kind, pid::text AS name,
         format('application_name=%s user=%s state=%s', COALESCE(application_name, ''),
                COALESCE(usename::text, ''), COALESCE(state, '')) AS detail,
         extract(epoch FROM now() - COALESCE(xact_start, backend_start))::float8 AS age_secs,
         age(backend_xmin)::int8 AS xid_age, false AS abandoned
  FROM pg_catalog.pg_stat_activity
  WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
    AND backend_type IS DISTINCT FROM 'autovacuum worker'
    AND (datname = current_database() OR datname IS NULL)
  UNION ALL
  SELECT 'prepared transaction', gid, format('owner=%s', owner),
         extract(epoch FROM now() - prepared)::float8, age(transaction)::int8, false
  FROM pg_catalog.pg_prepared_xacts WHERE database = current_database()
  UNION ALL
  SELECT 'replication slot', slot_name::text,
         CASE WHEN active THEN 'active' ELSE 'inactive: no standby connected' END,
         NULL, age(xmin)::int8, NOT active
  FROM pg_catalog.pg_replication_slots WHERE xmin IS NOT NULL
) h ORDER BY xid_age DESC, age_secs DESC NULLS LAST";

const HIDDEN_SQL: &str = "\
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity
               WHERE query = '<insufficient privilege>')";

/// The dead tuples of each table of `$1` (quoted names), in their order: one statement
/// for all of a relay's tables, however many.
const DEAD_TUPLES_SQL: &str = "\
SELECT COALESCE(s.n_dead_tup, 0)::int8
FROM unnest($1::text[]) WITH ORDINALITY AS t(name, i)
LEFT JOIN pg_catalog.pg_stat_user_tables s ON s.relid = to_regclass(t.name)
ORDER BY t.i";

pub(crate) async fn horizon(client: &impl GenericClient) -> Result<Horizon, SourceError> {
    let holders = client
        .query(HORIZON_SQL, &[])
        .await?
        .iter()
        .map(|r| Holder {
            kind: r.get(0),
            name: r.get(1),
            detail: r.get(2),
            age_secs: r.get::<_, Option<f64>>(3).map(|s| s.max(0.0)),
            xid_age: r.get(4),
            abandoned: r.get(5),
        })
        .collect();
    let hidden = client.query_one(HIDDEN_SQL, &[]).await?.get(0);
    Ok(Horizon { holders, hidden })
}

/// Dead tuples of each table named in `tables` (quoted), in their order; 0 before a
/// table's first statistics.
pub(crate) async fn dead_tuples(
    client: &impl GenericClient,
    tables: &[String],
) -> Result<Vec<i64>, SourceError> {
    let rows = super::ask_each(client, DEAD_TUPLES_SQL, &[tables]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A snapshot open this long is named in a WARN.
pub(crate) const WARN_AFTER_SECS: f64 = 300.0;
/// The same holder is named again at most this often.
const WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(300);

/// Says who holds back VACUUM: a WARN naming the holder with the oldest xmin among those
/// open for [`WARN_AFTER_SECS`] and abandoned replication slots (again every 5 minutes
/// while it stays), and once that other roles' sessions are hidden from this role.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    warned: Option<(String, std::time::Instant)>,
    hidden_said: bool,
}

impl Watch {
    /// The holder to name now, if any (and remembers it was named).
    pub(crate) fn culprit<'h>(
        &mut self,
        horizon: &'h Horizon,
        now: std::time::Instant,
    ) -> Option<&'h Holder> {
        let h = horizon
            .holders
            .iter()
            .find(|h| h.abandoned || h.age_secs.is_some_and(|s| s >= WARN_AFTER_SECS))?;
        let id = format!("{} {}", h.kind, h.name);
        let again = match &self.warned {
            Some((named, at)) => *named != id || now.duration_since(*at) >= WARN_EVERY,
            None => true,
        };
        again.then(|| {
            self.warned = Some((id, now));
            h
        })
    }

    pub(crate) fn observe(&mut self, horizon: &Horizon, now: std::time::Instant) {
        if horizon.hidden && !std::mem::replace(&mut self.hidden_said, true) {
            tracing::info!(
                "Sessions of other roles are hidden from this role, so the oldest snapshot \
                 gauge covers only its own: GRANT pg_monitor TO <relay role> to see them all"
            );
        }
        if let Some(h) = self.culprit(horizon, now) {
            tracing::warn!(
                holder = %h.kind,
                name = %h.name,
                detail = %h.detail,
                open_for = %h
                    .age_secs
                    .map_or("unknown (a slot records no time)".to_owned(), |s| format!("{s:.0}s")),
                xmin_age_transactions = h.xid_age,
                "VACUUM cannot remove dead rows of the outbox table (or any other) while this \
                 holds its snapshot; claims keep their speed, the table and its indexes grow. \
                 End it: a forgotten session with pg_terminate_backend(pid), a prepared \
                 transaction with COMMIT PREPARED or ROLLBACK PREPARED 'gid', a slot no \
                 standby uses any more with pg_drop_replication_slot('name')"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn holder(kind: &str, name: &str, age_secs: Option<f64>, abandoned: bool) -> Holder {
        Holder {
            kind: kind.into(),
            name: name.into(),
            detail: String::new(),
            age_secs,
            xid_age: 0,
            abandoned,
        }
    }

    #[test]
    fn a_young_snapshot_or_an_active_slot_is_not_named() {
        let horizon = Horizon {
            holders: vec![
                holder("replication slot", "standby", None, false),
                holder("session", "42", Some(299.0), false),
            ],
            hidden: false,
        };
        assert_eq!(Watch::default().culprit(&horizon, Instant::now()), None);
    }

    #[test]
    fn the_oldest_named_holder_is_named_again_every_five_minutes_or_when_it_changes() {
        let t0 = Instant::now();
        let mut watch = Watch::default();
        let mut horizon = Horizon {
            holders: vec![
                holder("replication slot", "gone", None, true),
                holder("prepared transaction", "tx1", Some(900.0), false),
            ],
            hidden: false,
        };
        assert_eq!(watch.culprit(&horizon, t0).unwrap().name, "gone");
        assert_eq!(watch.culprit(&horizon, t0 + Duration::from_secs(299)), None);
        assert_eq!(
            watch
                .culprit(&horizon, t0 + Duration::from_secs(300))
                .unwrap()
                .name,
            "gone"
        );
        horizon.holders.remove(0);
        assert_eq!(
            watch
                .culprit(&horizon, t0 + Duration::from_secs(301))
                .unwrap()
                .name,
            "tx1"
        );
    }

    #[test]
    fn gauges_take_the_longest_known_age_and_the_oldest_xmin() {
        let mut slot = holder("replication slot", "s", None, false);
        slot.xid_age = 900;
        let mut session = holder("session", "7", Some(12.5), false);
        session.xid_age = 10;
        let horizon = Horizon {
            holders: vec![slot, session],
            hidden: false,
        };
        assert_eq!(horizon.oldest_secs(), 12.5);
        assert_eq!(horizon.oldest_xid_age(), 900);
        assert_eq!(Horizon::default().oldest_secs(), 0.0);
    }
}
