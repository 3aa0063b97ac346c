//! What keeps VACUUM from cleaning the outbox table: its dead tuples, and the oldest open
//! snapshot in this database (a report, `pg_dump`, a forgotten `BEGIN`, a standby's
//! `hot_standby_feedback`). Claims no longer slow down behind them (see [`super::floor`]),
//! but the table and its indexes grow until the snapshot goes: the operator should learn
//! who holds it.
//!
//! `pg_stat_activity` shows another role's `backend_xmin` only to members of
//! `pg_read_all_stats` (`pg_monitor` includes it): without the grant the relay sees its
//! own role's sessions, and says so.

use tokio_postgres::GenericClient;

use super::SourceError;

/// The session whose snapshot is the oldest.
#[derive(Debug, Clone, PartialEq)]
pub struct Holder {
    pub pid: i32,
    pub application: String,
    pub user: String,
    pub state: String,
    /// Seconds since its transaction (or, without one, its session) began.
    pub age_secs: f64,
}

/// The oldest snapshot holder visible to this role, and whether some sessions are hidden.
#[derive(Debug, Clone, PartialEq)]
pub struct Horizon {
    pub oldest: Option<Holder>,
    /// Sessions of other roles this role may not inspect.
    pub hidden: bool,
}

/// Sessions of this database (and WAL senders, whose standbys' feedback counts) with a
/// snapshot, oldest first; the relay's own session excluded.
const HORIZON_SQL: &str = "\
SELECT pid, COALESCE(application_name, ''), COALESCE(usename::text, ''), COALESCE(state, ''),
       extract(epoch FROM now() - COALESCE(xact_start, backend_start))::float8
FROM pg_catalog.pg_stat_activity
WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
  AND (datname = current_database() OR datname IS NULL)
ORDER BY age(backend_xmin) DESC LIMIT 1";

const HIDDEN_SQL: &str = "\
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity
               WHERE query = '<insufficient privilege>')";

const DEAD_TUPLES_SQL: &str = "\
SELECT COALESCE((SELECT n_dead_tup FROM pg_catalog.pg_stat_user_tables
                 WHERE relid = to_regclass($1::text)), 0)::int8";

pub async fn horizon(client: &impl GenericClient) -> Result<Horizon, SourceError> {
    let oldest = client.query_opt(HORIZON_SQL, &[]).await?.map(|r| Holder {
        pid: r.get(0),
        application: r.get(1),
        user: r.get(2),
        state: r.get(3),
        age_secs: r.get::<_, f64>(4).max(0.0),
    });
    let hidden = client.query_one(HIDDEN_SQL, &[]).await?.get(0);
    Ok(Horizon { oldest, hidden })
}

/// Dead tuples of the table named `table` (quoted), 0 before its first statistics.
pub async fn dead_tuples(client: &impl GenericClient, table: &str) -> Result<i64, SourceError> {
    Ok(client.query_one(DEAD_TUPLES_SQL, &[&table]).await?.get(0))
}

/// A snapshot open this long is named in a WARN.
pub const WARN_AFTER_SECS: f64 = 300.0;
/// The same holder is named again at most this often.
const WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(300);

/// Says who holds back VACUUM: a WARN naming the oldest snapshot's session once it is
/// [`WARN_AFTER_SECS`] old (again every 5 minutes while it stays), and once that other
/// roles' sessions are hidden from this role.
#[derive(Debug, Default)]
pub struct Watch {
    warned: Option<(i32, std::time::Instant)>,
    hidden_said: bool,
}

impl Watch {
    pub fn observe(&mut self, horizon: &Horizon, now: std::time::Instant) {
        if horizon.hidden && !std::mem::replace(&mut self.hidden_said, true) {
            tracing::info!(
                "Sessions of other roles are hidden from this role, so the oldest snapshot \
                 gauge covers only its own: GRANT pg_monitor TO <relay role> to see them all"
            );
        }
        let Some(h) = &horizon.oldest else { return };
        if h.age_secs < WARN_AFTER_SECS {
            return;
        }
        let again = match self.warned {
            Some((pid, at)) => pid != h.pid || now.duration_since(at) >= WARN_EVERY,
            None => true,
        };
        if again {
            self.warned = Some((h.pid, now));
            tracing::warn!(
                pid = h.pid,
                application_name = %h.application,
                user = %h.user,
                state = %h.state,
                open_for = ?std::time::Duration::from_secs_f64(h.age_secs),
                "A session holds a snapshot open: VACUUM cannot remove dead rows of the outbox \
                 table (or any other) while it stays; claims keep their speed, the table and \
                 its indexes grow. End that transaction (pg_terminate_backend(pid) if it is \
                 forgotten)"
            );
        }
    }
}
