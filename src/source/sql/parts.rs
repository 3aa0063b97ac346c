//! The quoted names and the SQL fragments every statement of one table is built from.

use crate::config::{Ident, Ordering, TableConfig};

use super::super::schema::{PayloadType, TableShape};
use super::{bucket_of, RowLayout, FIRST_WINDOW, HELD_LISTED};

/// Which read a hold-back test is for, and so which rows hold back their key's later
/// rows: a claim's first window (dead or waiting rows, `held`), its bucket reads (past a
/// first window, any row with a failure history too: `held_in_window`), or the floor's
/// look (dead rows and rows with a failure history: every held row of the table).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Read {
    Window,
    Buckets,
    FloorLook,
}

/// One table's names and shared fragments, each explained where it is made.
pub(super) struct Parts {
    pub(crate) t: String,
    pub(crate) id: String,
    pub(crate) key: String,
    pub(crate) published_at: String,
    pub(crate) dead_at: String,
    pub(crate) attempts: String,
    pub(crate) last_error: String,
    pub(crate) next: String,
    pub(crate) size: String,
    pub(crate) columns: String,
    pub(crate) pending: String,
    pub(crate) due: String,
    pub(crate) held: String,
    pub(crate) not_behind_dead: String,
    pub(crate) waiting: String,
    held_in_window: String,
    held_with_history: String,
    pub(crate) obucket: String,
    /// The schema's `outbox_relay_held` (migration 0008), aliased `d`, and the test that
    /// keeps this table's rows of it.
    pub(crate) held_rows: String,
    pub(crate) of_table: String,
    pub(crate) retrying: String,
    pub(crate) fresh: String,
    pub(crate) low_stragglers: String,
    pub(crate) low_retrying: String,
    pub(crate) held_back_row: String,
    pub(crate) held_back: String,
    /// The creation-time column, when the table has one.
    pub(crate) created_at: Option<Ident>,
    pub(crate) ordering: Ordering,
    pub(crate) layout: RowLayout,
    payload_type: PayloadType,
    payload_column: String,
}

impl Parts {
    pub(crate) fn new(table: &TableConfig, shape: &TableShape, ordering: Ordering) -> Parts {
        let t = table.name.quoted();
        let c = &table.columns;
        // The order column is the row's handle everywhere: it is unique (checked).
        let id = c.order.quoted();
        let key = c.key.quoted();
        let published_at = c.published_at.quoted();
        let dead_at = c.dead_at.quoted();
        let attempts = c.attempts.quoted();
        let last_error = c.last_error.quoted();
        let next = c.next_attempt_at.quoted();
        // A row's payload bytes, read before the payload itself: for bytea and text the
        // stored length (no detoasting); jsonb is rendered as text to be measured.
        let size = size_of(shape.payload, &c.payload.quoted(), "");
        let (columns, layout) = returned_columns(table, shape);
        let pending = format!("{published_at} IS NULL AND {dead_at} IS NULL");
        // Not waiting for a later attempt. `now()` is the transaction's start: one instant
        // for every statement of a claim, so its window and its locks agree.
        let due = format!("({next} IS NULL OR {next} <= now())");
        let held_rows = format!(
            "{} d",
            crate::source::schema_table(&table.name, "outbox_relay_held")
        );
        let of_table = format!(
            "d.table_name = '{}'",
            table.name.to_string().replace('\'', "''")
        );
        let names = Names {
            id: &id,
            key: &key,
            published_at: &published_at,
            dead_at: &dead_at,
            next: &next,
            last_error: &last_error,
            held_rows: &held_rows,
            of_table: &of_table,
        };
        let holds = hold_parts(&names, &pending, ordering);
        let waiting = format!("{pending} AND {next} > now()");
        let obucket = bucket_of("o.", &key, &id);
        let below = floor_parts(&names, &pending);
        Parts {
            t,
            id,
            key,
            published_at,
            dead_at,
            attempts,
            last_error,
            next,
            size,
            columns,
            pending,
            due,
            held: holds.held,
            not_behind_dead: holds.not_behind_dead,
            waiting,
            held_in_window: holds.held_in_window,
            held_with_history: holds.held_with_history,
            obucket,
            held_rows,
            of_table,
            retrying: below.retrying,
            fresh: below.fresh,
            low_stragglers: below.low_stragglers,
            low_retrying: below.low_retrying,
            held_back_row: holds.held_back_row,
            held_back: holds.held_back,
            created_at: shape.created_at.clone(),
            ordering,
            layout,
            payload_type: shape.payload,
            payload_column: c.payload.quoted(),
        }
    }

    /// The `held_keys` CTE a statement defines for [`Parts::not_held_back`]: the
    /// key and order value of the held rows of `read`'s rule, at most [`HELD_LISTED`]
    /// and one (complete when there are no more than [`HELD_LISTED`]). `MATERIALIZED`,
    /// so each statement reads the held rows once, and only if a row it reads needs it.
    pub(crate) fn held_keys(&self, read: Read) -> String {
        let Parts { held_rows, .. } = self;
        format!(
            "held_keys AS MATERIALIZED (SELECT d.key AS k, d.id AS i FROM {held_rows} \
             WHERE {} AND d.key IS NOT NULL LIMIT {})",
            self.held_for(read),
            HELD_LISTED + 1
        )
    }

    /// What a claim's read keeps: pending rows that [`Parts::not_held_back`], due, or
    /// not due and [`Parts::unmirrored`]: such a row holds back its key's later rows in
    /// the read ([`Parts::blocked_in`]), and is never taken itself.
    pub(crate) fn claim_filter(&self, read: Read, from: Option<&str>) -> String {
        let Parts {
            published_at,
            dead_at,
            next,
            ..
        } = self;
        format!(
            "o.{published_at} IS NULL AND o.{dead_at} IS NULL \
             AND (o.{next} IS NULL OR o.{next} <= now() OR {}) AND {}",
            self.unmirrored(),
            self.not_held_back(read, from)
        )
    }

    /// Whether a row `o` a claim's read keeps is due (the read's `due` column).
    pub(crate) fn odue(&self) -> String {
        let next = &self.next;
        format!("(o.{next} IS NULL OR o.{next} <= now())")
    }

    /// Whether row `o` has no row in `outbox_relay_held`. Only a row inserted with
    /// `next_attempt_at` set (a scheduled publish) can be held without one: the triggers
    /// see every UPDATE and DELETE, and no INSERT (a trigger that did would cost every
    /// INSERT of the application more than the two indexes it replaced). Such a row is
    /// always in a claim's read when it matters: from the floor on, a read is a prefix of
    /// the pending rows, and the floor never passes such a row (it counts as fresh, see
    /// `FloorParts::fresh`, and the floor's look gives it its row in the held rows).
    ///
    /// Every write of the relay that leaves a row not due sets its `last_error` (a failed
    /// attempt, a postponement) or is an UPDATE (a replay's hold), so a row with an error
    /// is known to be mirrored without the probe: with a broker down, a third of a read's
    /// rows were postponed, and probing each doubled the time of a claim.
    pub(crate) fn unmirrored(&self) -> String {
        let Parts {
            id,
            last_error,
            held_rows,
            of_table,
            ..
        } = self;
        format!(
            "(o.{last_error} IS NULL AND NOT EXISTS \
             (SELECT 1 FROM {held_rows} WHERE {of_table} AND d.id = o.{id}))"
        )
    }

    /// The CTE `blockers` of a read whose rows are CTE `rows` (columns `id, key, size,
    /// bucket, due`): the first row of each key that is not due (one without its row in
    /// `outbox_relay_held`, see [`Parts::unmirrored`]; the others were left out).
    /// `MATERIALIZED`, and usually empty: read once, where a join with the grouped rows
    /// was planned as a nested loop that grouped them again for every row read.
    pub(crate) fn blockers(rows: &str) -> String {
        format!(
            "blockers AS MATERIALIZED (SELECT b.key, min(b.id) AS first FROM {rows} b \
             WHERE NOT b.due AND b.key IS NOT NULL GROUP BY b.key)"
        )
    }

    /// The rows of CTE `rows` a claim may take: due, and not after a row of their key in
    /// [`Parts::blockers`] (defined in the same statement). With no blocker, the one-time
    /// test in front answers for every row.
    pub(crate) fn blocked_in(rows: &str) -> String {
        format!(
            "SELECT r.id, r.key, r.size, r.bucket FROM {rows} r WHERE r.due \
             AND (NOT EXISTS (SELECT 1 FROM blockers) \
             OR NOT EXISTS (SELECT 1 FROM blockers b WHERE b.key = r.key AND b.first < r.id))"
        )
    }

    /// Whether no held row of `o`'s key (by `read`'s rule) comes before `o`. `from`: the
    /// floor, for a read from the floor on, whose statement defines [`Parts::held_keys`]
    /// for the same `read`; `None` for the reads below the floor (the stragglers and the
    /// rows with a failure history: few rows, and all of held keys when there are many).
    ///
    /// It is one question, asked in the cheapest form that answers it exactly, each form
    /// true only when the probe at the end would be:
    ///
    /// 1. no held row in the table at all (uncorrelated, once per statement): the common
    ///    case, where no row pays for anything else;
    /// 2. `held_keys` is complete and the row's key is not in it: no held row of its key;
    /// 3. unless the key has a held row below `from`, so below this row (held back), the
    ///    probe itself: an index lookup in `outbox_relay_held`.
    ///
    /// 2 and 3 are `NOT IN` over the CTE, which PostgreSQL answers with a hash table
    /// built once per statement ("hashed SubPlan", in generic plans too; checked by
    /// `a_claims_reads_tell_held_keys_by_a_hash_table`), where the probe costs an index
    /// descent and a heap visit for every row read. With a third of the keys
    /// held (a Kafka broker down, benchmark K) every row a claim or a floor look read paid
    /// the probe, and the held-back rows above the floor were most of what a first window
    /// and a look read.
    pub(crate) fn not_held_back(&self, read: Read, from: Option<&str>) -> String {
        let Parts {
            id, key, held_rows, ..
        } = self;
        let held = self.held_for(read);
        let probe = format!(
            "NOT EXISTS (SELECT 1 FROM {held_rows} WHERE d.key = o.{key}::text AND {held} \
             AND (d.id + 0) < o.{id})"
        );
        let exact = match from {
            None => probe,
            Some(from) => format!(
                "((SELECT count(*) FROM held_keys) <= {HELD_LISTED} \
                 AND o.{key}::text NOT IN (SELECT k FROM held_keys)) \
                 OR (o.{key}::text NOT IN (SELECT k FROM held_keys WHERE i < {from}) \
                 AND {probe})"
            ),
        };
        format!(
            "(o.{key} IS NULL OR NOT EXISTS (SELECT 1 FROM {held_rows} WHERE {held}) \
             OR {exact})"
        )
    }

    fn held_for(&self, read: Read) -> &str {
        match read {
            Read::Window => &self.held,
            Read::Buckets => &self.held_in_window,
            Read::FloorLook => &self.held_with_history,
        }
    }

    /// A row's payload bytes, read before the payload itself (`prefix`: a table alias
    /// with its dot, or empty).
    pub(crate) fn size_of(&self, prefix: &str) -> String {
        size_of(self.payload_type, &self.payload_column, prefix)
    }

    /// Below the floor: the stragglers `ids`, by primary key.
    pub(crate) fn stragglers_part(&self, o: &str, ids: &str) -> String {
        stragglers_part(&self.id, o, ids)
    }

    /// Below the floor `floor`: rows with a failure history, found in `outbox_relay_held`.
    pub(crate) fn retry_part(&self, o: &str, floor: &str, ids: &str) -> String {
        retry_part(&self.names(), o, floor, ids)
    }

    /// The ids of this table's held rows that `condition` (on `d`, a row of
    /// `outbox_relay_held`) keeps, as an array: `id = ANY (...)` of it is a lookup by
    /// primary key for each, whatever the planner thinks of the held rows' number.
    pub(crate) fn held_ids(&self, condition: &str) -> String {
        held_ids(&self.names(), condition)
    }

    fn names(&self) -> Names<'_> {
        Names {
            id: &self.id,
            key: &self.key,
            published_at: &self.published_at,
            dead_at: &self.dead_at,
            next: &self.next,
            last_error: &self.last_error,
            held_rows: &self.held_rows,
            of_table: &self.of_table,
        }
    }
}

/// The quoted names of one table that the fragment builders below share.
struct Names<'a> {
    id: &'a str,
    key: &'a str,
    published_at: &'a str,
    dead_at: &'a str,
    next: &'a str,
    last_error: &'a str,
    held_rows: &'a str,
    of_table: &'a str,
}

/// The fragments that tell which rows hold back the later rows of their key (see
/// [`Read`]), and which rows count as held back.
struct HoldParts {
    held: String,
    held_in_window: String,
    not_behind_dead: String,
    held_with_history: String,
    held_back_row: String,
    held_back: String,
}

/// [`HoldParts`] of the table `names` names.
fn hold_parts(names: &Names, pending: &str, ordering: Ordering) -> HoldParts {
    let Names {
        id,
        key,
        held_rows,
        of_table,
        ..
    } = *names;

    // A *held* row holds back the later rows of its key: dead (until re-queued or
    // deleted), or waiting for its next attempt. Every such row is mirrored in
    // `outbox_relay_held` (migration 0008: its triggers keep it exact at every commit),
    // by key and order value, so the probes of a claim's reads are index lookups there,
    // and only the reads' last resort: see `Parts::not_held_back` (with no held row in
    // the table, the common case, the uncorrelated test in front spares every row the
    // per-key probe). The fragments below are conditions on `d`, a row of it. A probe
    // for one key's rows before a row hides the order bound from the planner (`+ 0`):
    // with the bound visible and no statistics yet on the table (a new one), PostgreSQL
    // took its primary key for the probe, a range of every held row of the table before
    // the row, where the key's index finds that key's few.
    let held = format!("{of_table} AND (d.dead_at IS NOT NULL OR d.next_attempt_at > now())");
    // In a claim's bucket reads past its first window (`$1` past it), a row with a failure history
    // (`next_attempt_at` set: waiting, or released by `requeue`, which sets it to the
    // time of the requeue) holds back its key too. A key left out of the first window
    // because its head was held must not reappear in a later one with a later row as
    // its "head" when a requeue committed between the two windows; the head itself is
    // due and is taken by the next claim's first window.
    let held_in_window = format!(
        "{of_table} AND (d.dead_at IS NOT NULL OR d.next_attempt_at > now() \
         OR ($1 > '{FIRST_WINDOW}'::bigint AND d.next_attempt_at IS NOT NULL))"
    );
    // Work left for `drain`: rows held back by a *waiting* row become publishable when
    // it is due, so only a dead row takes its key's rows out of the count.
    let dead = format!("{of_table} AND d.dead_at IS NOT NULL");
    let not_behind_dead = format!(
        "(NOT EXISTS (SELECT 1 FROM {held_rows} WHERE {dead}) \
         OR NOT EXISTS (SELECT 1 FROM {held_rows} WHERE d.key = o.{key}::text AND {dead} \
         AND (d.id + 0) < o.{id}))"
    );
    // Whether a fresh row is held back by an earlier held row of its key (dead, or with
    // a failure history): any held row of the table.
    let held_with_history = of_table.to_owned();
    let held_back_row = match ordering {
        Ordering::Key => format!(
            "(o.{key} IS NOT NULL AND EXISTS (SELECT 1 FROM {held_rows} \
             WHERE d.key = o.{key}::text AND (d.id + 0) < o.{id} AND {held_with_history}))"
        ),
        Ordering::None => "false".to_owned(),
    };
    let held_back = match ordering {
        Ordering::Key => format!(
            "count(*) FILTER (WHERE {pending} AND {key} IS NOT NULL AND EXISTS \
             (SELECT 1 FROM {held_rows} WHERE d.key = o.{key}::text AND (d.id + 0) < o.{id} \
             AND {held}))"
        ),
        Ordering::None => "0::bigint".to_owned(),
    };
    HoldParts {
        held,
        held_in_window,
        not_behind_dead,
        held_with_history,
        held_back_row,
        held_back,
    }
}

/// The floor's fragments ([`super::floor`]): rows with a failure history, fresh rows, and
/// the two parts of a read below the floor.
struct FloorParts {
    retrying: String,
    fresh: String,
    low_stragglers: String,
    low_retrying: String,
}

/// [`FloorParts`] of the table `names` names.
fn floor_parts(names: &Names, pending: &str) -> FloorParts {
    let Names {
        id,
        published_at,
        dead_at,
        next,
        last_error,
        held_rows,
        of_table,
        ..
    } = *names;
    // The floor's bookkeeping (super::floor): rows with a failure history are found
    // below the floor in `outbox_relay_held`; the others are *fresh*.
    let retrying = format!(
        "{id} = ANY ({}) AND {pending} AND {next} IS NOT NULL",
        held_ids(names, "d.dead_at IS NULL")
    );
    // A row inserted with `next_attempt_at` set counts as fresh until it has its row in
    // `outbox_relay_held` (see `Parts::unmirrored`): the floor does not pass it before.
    // (A row with a `last_error` is mirrored: the relay's UPDATE that set it fired the
    // trigger.)
    let fresh = format!(
        "o.{published_at} IS NULL AND o.{dead_at} IS NULL AND (o.{next} IS NULL \
         OR (o.{last_error} IS NULL \
         AND NOT EXISTS (SELECT 1 FROM {held_rows} WHERE {of_table} AND d.id = o.{id})))"
    );
    // Bounds on the order column are written `(SELECT $n)`: an index condition all the
    // same, but a value the planner does not see. Seen, a bound in the first bucket of
    // the column's histogram (`i64::MIN` for a claim's first window; the floor, right
    // after ANALYZE) made every custom plan ask the index for the column's actual
    // minimum, walking the entries of every row published since the last VACUUM, so
    // a large drain slowed as it went (perf: get_actual_variable_range under the
    // planner; benchmark F measures a large table against a small one).
    // Below the floor: the stragglers, by primary key (skipped outright, a one-time
    // filter, when there are none), and rows with a failure history, by their ids in
    // `outbox_relay_held`: never a range scan of the table below the floor, which holds
    // the entries of every row published since the last VACUUM (a generic plan once
    // did, and with a snapshot held the latency climbed minute after minute: benchmark G).
    let low_stragglers = stragglers_part(id, "", "$2::bigint[]");
    let low_retrying = retry_part(names, "", "$1", "$2::bigint[]");
    FloorParts {
        retrying,
        fresh,
        low_stragglers,
        low_retrying,
    }
}

/// The columns a claim returns ([`RowLayout`]), and their layout.
fn returned_columns(table: &TableConfig, shape: &TableShape) -> (String, RowLayout) {
    let c = &table.columns;
    let (id, key, attempts) = (c.order.quoted(), c.key.quoted(), c.attempts.quoted());
    let (next, last_error) = (c.next_attempt_at.quoted(), c.last_error.quoted());
    let payload = match shape.payload {
        PayloadType::Bytea => c.payload.quoted(),
        PayloadType::Text => format!("convert_to({}::text, 'UTF8')", c.payload.quoted()),
    };
    let headers = match &shape.headers {
        Some(h) => format!("{}::text", h.quoted()),
        None => "NULL::text".to_owned(),
    };
    let layout = RowLayout {
        message_id: c.id != c.order,
        topic_columns: table.topic.columns().len(),
        header_columns: table.header_columns.len(),
        dead_letter_columns: table
            .dead_letter_topic
            .as_ref()
            .map_or(0, |d| d.columns().len()),
        envelope_columns: table.cloudevents.iter().flat_map(|ce| ce.columns()).count(),
    };
    // Then the row's age when read (for the delivery-lag histogram: NULL without a
    // creation-time column) and whether `replay` made it pending again (the one writer
    // that clears `last_error` and sets `next_attempt_at` with no attempt counted).
    let age = match &shape.created_at {
        Some(c) => format!(
            "extract(epoch FROM clock_timestamp() - {})::float8",
            c.quoted()
        ),
        None => "NULL::float8".to_owned(),
    };
    // And the creation time in milliseconds since the epoch: the Kafka record's
    // timestamp (CreateTime), as Debezium's outbox router sets it.
    let created_ms = match &shape.created_at {
        Some(c) => format!("floor(extract(epoch FROM {}) * 1000)::int8", c.quoted()),
        None => "NULL::int8".to_owned(),
    };
    let mut columns = format!(
        "{id}::bigint, {key}::text, {payload}, {headers}, {attempts}::int4, {age}, \
         ({next} IS NOT NULL AND {attempts} = 0 AND {last_error} IS NULL), {created_ms}"
    );
    let extra = layout
        .message_id
        .then_some(&c.id)
        .into_iter()
        .chain(table.topic.columns())
        .chain(table.header_columns.iter().map(|(_, column)| column))
        .chain(table.dead_letter_topic.iter().flat_map(|d| d.columns()))
        .chain(table.cloudevents.iter().flat_map(|ce| ce.columns()));
    for column in extra {
        columns.push_str(&format!(", {}::text", column.quoted()));
    }
    (columns, layout)
}

/// A row's payload bytes, read before the payload itself: for bytea and text the stored
/// length (no detoasting); jsonb is rendered as text to be measured.
fn size_of(payload: PayloadType, column: &str, prefix: &str) -> String {
    match payload {
        PayloadType::Bytea => format!("COALESCE(octet_length({prefix}{column}), 0)::int8"),
        PayloadType::Text => format!("COALESCE(octet_length({prefix}{column}::text), 0)::int8"),
    }
}

/// Skipped outright, a one-time filter, when there are no stragglers.
fn stragglers_part(id: &str, o: &str, ids: &str) -> String {
    format!("cardinality({ids}) > 0 AND {o}{id} = ANY({ids})")
}

fn retry_part(names: &Names, o: &str, floor: &str, ids: &str) -> String {
    let Names { id, next, .. } = *names;
    format!(
        "{o}{id} = ANY ({}) AND {o}{next} IS NOT NULL AND {o}{id} <> ALL({ids})",
        held_ids(names, &format!("d.dead_at IS NULL AND d.id < {floor}"))
    )
}

fn held_ids(names: &Names, condition: &str) -> String {
    let Names {
        held_rows,
        of_table,
        ..
    } = *names;
    format!("ARRAY(SELECT d.id FROM {held_rows} WHERE {of_table} AND {condition})")
}
