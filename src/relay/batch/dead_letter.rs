//! Phase 3b: the rows a batch is about to dead-letter go to their dead-letter topic first;
//! those the topic cannot take for the broker's sake are postponed instead.

use std::sync::Arc;

use super::super::message::message_id;
use super::super::Shared;
use crate::config::{NullColumn, TableConfig};
use crate::error::ErrorClass;
use crate::sink::{Message, SinkError};
use crate::source::claim::ClaimedRow;
use crate::source::settle::Settlement;
use crate::source::table::TablePlan;

/// Phase 3b: publishes the rows this batch is about to dead-letter (their attempt reaches
/// `max_attempts`) to `template`, once, with their payload, key and message id, and headers
/// naming the error, the attempts and the original topic. A row whose dead-letter publish
/// fails for the broker's sake leaves the settlement: it stays pending, its attempt not
/// counted, and the worker backs off (`trouble`), so it is tried again, dead-letter topic
/// included, like any row the broker could not take; only its own key waits. One that
/// fails for its own sake (no such topic, a template column that is NULL) is dead-lettered
/// all the same, with an ERROR line: the table keeps it either way.
pub(super) async fn dead_letter(
    shared: &Shared,
    table: &TablePlan,
    template: &crate::config::Template,
    rows: &mut [ClaimedRow],
    messages: Vec<Result<Message, SinkError>>,
    settlement: &mut Settlement,
) {
    let max = shared.relay.max_attempts as i32;
    let letters = letters(&table.config, template, max, rows, messages, settlement);
    if letters.is_empty() {
        return;
    }
    let unsent = send_letters(shared, table, &letters).await;
    // Postponed, attempt uncounted: out of the failures, highest index first (`unsent`
    // is in the failures' order).
    let postponed = &mut settlement.postponed;
    for (f, error) in unsent.into_iter().rev() {
        postponed.ids.push(settlement.failed.ids.remove(f));
        settlement.failed.errors.remove(f);
        postponed.errors.push(format!("dead-letter topic: {error}"));
        postponed
            .waits_us
            .push(settlement.failed.waits_us.remove(f));
    }
}

/// A dead letter: the index of its row among the settlement's failures, the row's id,
/// and its message for the dead-letter topic (or why the row has no such topic).
type Letter = (usize, i64, Result<Message, NullColumn>);

/// The dead letters of the failed rows whose attempt reaches `max`: each row's message
/// with the dead-letter topic and headers naming the error, the attempts and the original
/// topic.
fn letters(
    table: &TableConfig,
    template: &crate::config::Template,
    max: i32,
    rows: &mut [ClaimedRow],
    mut messages: Vec<Result<Message, SinkError>>,
    settlement: &Settlement,
) -> Vec<Letter> {
    let by_id: std::collections::HashMap<i64, usize> =
        rows.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
    let failed = settlement.failed.ids.iter().zip(&settlement.failed.errors);
    let mut letters = Vec::new();
    for (f, (id, error)) in failed.enumerate() {
        let i = by_id[id];
        let row = &mut rows[i];
        if row.attempts + 1 < max {
            continue;
        }
        let original = match std::mem::replace(&mut messages[i], Err(SinkError::bad_row(""))) {
            Ok(m) => m,
            // The row could not become a message (its topic or headers are bad): what it
            // holds still goes, without the headers column.
            Err(_) => Message {
                id: message_id(table, row),
                topic: Arc::from(""),
                key: row.key.clone(),
                payload: row.payload.take().map(bytes::Bytes::from),
                headers: Vec::new(),
                timestamp_ms: row.created_ms,
            },
        };
        let topic = template.render(&row.dead_letter_values);
        let mut headers = original.headers;
        headers.push((Arc::from("outbox-error"), error.clone().into()));
        headers.push((
            Arc::from("outbox-attempts"),
            (row.attempts + 1).to_string().into(),
        ));
        headers.push((Arc::from("outbox-topic"), original.topic.to_string().into()));
        let letter = topic.map(|topic| Message {
            topic,
            headers,
            ..original
        });
        letters.push((f, *id, letter));
    }
    letters
}

/// Sends `letters` in one batch and returns those the broker could not take for its own
/// sake (index among the failures, in order, and the error), to be postponed; letters
/// refused for their own sake are logged and dead-lettered in the table only.
async fn send_letters(
    shared: &Shared,
    table: &TablePlan,
    letters: &[Letter],
) -> Vec<(usize, String)> {
    let sendable: Vec<&Message> = letters
        .iter()
        .filter_map(|(_, _, m)| m.as_ref().ok())
        .collect();
    let sent = tokio::time::timeout(shared.publish_timeout, shared.sink.publish_batch(&sendable))
        .await
        .unwrap_or_else(|_| {
            vec![
                Err(SinkError::transient(
                    "the dead-letter topic did not acknowledge in time"
                ));
                sendable.len()
            ]
        });
    let mut sent = sent.into_iter();
    let mut unsent = Vec::new();
    for (f, id, message) in letters {
        let result = match message {
            Ok(_) => sent
                .next()
                .unwrap_or(Err(SinkError::transient("no answer"))),
            Err(e) => Err(SinkError::bad_row(e.to_string())),
        };
        match result {
            Ok(()) => {}
            Err(e) if e.class == ErrorClass::BadRow => tracing::error!(
                table = %table.config.name, id, error = %e,
                "Could not publish the row to its dead-letter topic; dead-lettered in the table only"
            ),
            Err(e) => {
                tracing::warn!(table = %table.config.name, id, error = %e, "Dead-letter topic unavailable; the row waits for its next attempt");
                unsent.push((*f, e.message().to_owned()));
            }
        }
    }
    unsent
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::settle;
    use super::*;
    use crate::relay::order::RowOutcome;

    /// A fixed retry wait: `n` previous attempts -> n + 1 seconds.
    fn wait(attempts: u32) -> Duration {
        Duration::from_secs(u64::from(attempts) + 1)
    }

    /// A row at its last attempt that could not become a message (here its topic column
    /// is NULL) is dead-lettered all the same, under the row's own message id: the id
    /// column when the table maps one apart from the order column, as for a row that did
    /// become a message (it used to be `<table>:<order column>` always).
    #[test]
    fn a_row_that_cannot_become_a_message_is_dead_lettered_under_its_message_id() {
        let config = crate::config::from_str(
            "[postgres]\nurl = \"postgres://db/app\"\n[sink]\nkind = \"stdout\"\n\
             [[tables]]\nname = \"public.outbox\"\ntopic = \"events.{type}\"\n\
             dead_letter_topic = \"dead\"\n\
             [tables.columns]\nid = \"event_id\"\norder = \"seq\"\n",
            |_| None,
            Vec::new(),
        )
        .unwrap();
        let table = &config.tables[0];
        let template = table.dead_letter_topic.as_ref().unwrap();
        let mut rows = vec![ClaimedRow {
            id: 7,
            message_id: Some("evt-7".to_owned()),
            key: Some(Arc::from("k")),
            payload: Some(b"{}".to_vec()),
            attempts: 2,
            ..ClaimedRow::default()
        }];
        let refused = || SinkError::bad_row("topic column type is NULL");
        let settlement = settle(&rows, &[RowOutcome::Failed(refused())], wait)
            .unwrap()
            .settlement;
        let dead = letters(
            table,
            template,
            3,
            &mut rows,
            vec![Err(refused())],
            &settlement,
        );
        assert_eq!(dead.len(), 1, "the row is at its last attempt");
        let (_, id, letter) = &dead[0];
        let letter = letter.as_ref().unwrap();
        assert_eq!(*id, 7);
        assert_eq!(letter.id, "public.outbox:evt-7");
        assert_eq!(&*letter.topic, "dead");
        assert_eq!(letter.payload.as_deref(), Some(&b"{}"[..]));
        let header = |name: &str| {
            letter
                .headers
                .iter()
                .find(|(n, _)| &**n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(header("outbox-error"), Some("topic column type is NULL"));
        assert_eq!(header("outbox-attempts"), Some("3"));
        // Below its last attempt, a row is not dead-lettered.
        rows[0].attempts = 0;
        assert!(letters(
            table,
            template,
            3,
            &mut rows,
            vec![Err(refused())],
            &settlement
        )
        .is_empty());
    }
}
