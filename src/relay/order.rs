//! Publishing a claimed batch so that a key's rows reach the broker in id order, and
//! deciding which rows count as published.
//!
//! A batch holds, per key, an unbroken run of that key's oldest pending rows (see
//! `source::claim`). The rules:
//!
//! 1. A key's row is sent only if every earlier row of that key in the batch was
//!    acknowledged or is in flight on a sink that keeps in-flight order
//!    ([`Sink::keeps_order_in_flight`]).
//! 2. Once a row of a key fails (rejected before sending, or refused by the broker), the
//!    later rows of that key are held back: not sent, or if already sent, not counted.
//!    They stay pending behind the failed row, which stays the key's head.
//! 3. A row whose destination cannot take it now ([`Sink::unavailable`]: a Kafka
//!    partition without a reachable leader) is not sent, and stops its key like a failed
//!    row ([`RowOutcome::Unavailable`]); the other keys go on.
//! 4. Only [`RowOutcome::Published`] rows are deleted or marked.
//!
//! For a sink without in-flight order (NATS) the batch is sent in *waves*: wave n holds
//! the n-th row of every key, so wave n+1 leaves only after wave n's acks are in. Keys
//! still travel in parallel; only a key's own rows wait for each other.

use std::collections::{HashMap, HashSet};

use crate::sink::{Message, NotNow, Sink, SinkError};

/// What became of one row of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RowOutcome {
    /// No answer (not sent yet, or the publish deadline passed first). Stays pending.
    Pending,
    /// Acknowledged by the broker: may be deleted or marked.
    Published,
    /// Behind a failed row of its key: not counted (not sent, or its ack ignored). Stays
    /// pending.
    BehindFailure,
    /// Failed for the given reason. Stays pending; a bad row counts an attempt.
    Failed(SinkError),
    /// Not sent: its destination cannot take it now (why, and for how long the row waits).
    /// Stays pending and holds its key back meanwhile, no attempt counted.
    Unavailable(NotNow),
}

impl RowOutcome {
    /// `Ok` for an acknowledged row, else why it was not.
    pub(crate) fn as_result(&self) -> Result<(), &str> {
        match self {
            RowOutcome::Published => Ok(()),
            RowOutcome::Pending => Err("not acknowledged within sink.publish_timeout"),
            RowOutcome::BehindFailure => Err("not counted: an earlier row of its key failed"),
            RowOutcome::Failed(e) => Err(e.message()),
            RowOutcome::Unavailable(n) => Err(&n.reason),
        }
    }
}

/// Splits rows into waves: the n-th row of each key goes into wave n; rows without a key
/// into wave 0. Within a wave, rows keep their batch (id) order.
pub(crate) fn waves(keys: &[Option<&str>]) -> Vec<Vec<usize>> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut waves: Vec<Vec<usize>> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let wave = match key {
            None => 0,
            Some(k) => {
                let n = seen.entry(k).or_insert(0);
                *n += 1;
                *n - 1
            }
        };
        if waves.len() <= wave {
            waves.resize_with(wave + 1, Vec::new);
        }
        waves[wave].push(i);
    }
    waves
}

/// Publishes `messages` (one per row, in id order; `Err` for a row that could not even be
/// turned into a message) and writes each row's outcome into `outcomes` as soon as it is
/// known, so a caller that stops waiting still knows what was acknowledged.
///
/// Outcomes are written in wave order and, within a wave, in row order, so whenever this
/// future is dropped the `Published` rows of every key form a prefix of its rows.
pub(crate) async fn publish_in_order(
    sink: &Sink,
    keys: &[Option<&str>],
    messages: &[Result<Message, SinkError>],
    outcomes: &mut [RowOutcome],
) {
    let plan = if sink.keeps_order_in_flight() {
        vec![(0..messages.len()).collect()]
    } else {
        waves(keys)
    };
    let mut stopped: HashSet<&str> = HashSet::new();
    for wave in plan {
        let mut sending: Vec<usize> = Vec::with_capacity(wave.len());
        for i in wave {
            if let Some(k) = keys[i] {
                if stopped.contains(k) {
                    outcomes[i] = RowOutcome::BehindFailure;
                    continue;
                }
            }
            let checked = messages[i]
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|m| sink.check(m));
            let refused = match checked {
                Err(e) => Some(RowOutcome::Failed(e)),
                Ok(()) => messages[i]
                    .as_ref()
                    .ok()
                    .and_then(|m| sink.unavailable(m))
                    .map(RowOutcome::Unavailable),
            };
            if let Some(outcome) = refused {
                outcomes[i] = outcome;
                if let Some(k) = keys[i] {
                    stopped.insert(k);
                }
                continue;
            }
            sending.push(i);
        }
        if sending.is_empty() {
            continue;
        }
        let batch: Vec<&Message> = sending
            .iter()
            .map(|&i| messages[i].as_ref().expect("checked above"))
            .collect();
        let results = sink.publish_batch(&batch).await;
        for (&i, result) in sending.iter().zip(results) {
            let key = keys[i];
            outcomes[i] = match result {
                // Whatever became of it, a row behind a failed row of its key is not counted.
                _ if key.is_some_and(|k| stopped.contains(k)) => RowOutcome::BehindFailure,
                Ok(()) => RowOutcome::Published,
                Err(e) => {
                    if let Some(k) = key {
                        stopped.insert(k);
                    }
                    RowOutcome::Failed(e)
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorClass;
    use crate::sink::memory::MemorySink;
    use std::sync::Arc;

    fn message(id: i64, key: Option<&str>) -> Result<Message, SinkError> {
        Ok(Message {
            id: format!("t:{id}"),
            topic: "t".into(),
            key: key.map(Arc::from),
            payload: Default::default(),
            headers: vec![],
            timestamp_ms: None,
        })
    }

    #[test]
    fn waves_put_the_nth_row_of_each_key_in_wave_n() {
        let keys = [Some("a"), Some("b"), Some("a"), None, Some("a"), None];
        assert_eq!(waves(&keys), vec![vec![0, 1, 3, 5], vec![2], vec![4]]);
    }

    async fn run(sink: &Sink, keys: &[Option<&str>]) -> Vec<RowOutcome> {
        let messages: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| message(i as i64, *k))
            .collect();
        let mut outcomes = vec![RowOutcome::Pending; keys.len()];
        publish_in_order(sink, keys, &messages, &mut outcomes).await;
        outcomes
    }

    #[tokio::test]
    async fn a_failed_row_holds_back_the_later_rows_of_its_key_only() {
        for keeps_order in [false, true] {
            let memory = MemorySink::new(keeps_order);
            memory.fail("t:1", SinkError::transient("broker hiccup"));
            let sink = Sink::Memory(memory);
            let keys = [Some("a"), Some("a"), Some("b"), Some("a"), Some("b")];
            let outcomes = run(&sink, &keys).await;
            assert_eq!(outcomes[0], RowOutcome::Published);
            assert!(
                matches!(&outcomes[1], RowOutcome::Failed(e) if e.class == ErrorClass::Transient)
            );
            assert_eq!(outcomes[2], RowOutcome::Published);
            assert_eq!(
                outcomes[3],
                RowOutcome::BehindFailure,
                "keeps_order={keeps_order}"
            );
            assert_eq!(outcomes[4], RowOutcome::Published);
            let Sink::Memory(m) = &sink else {
                unreachable!()
            };
            let sent: Vec<String> = m.published().into_iter().map(|m| m.id).collect();
            // Without in-flight order the held-back row is never even sent.
            assert_eq!(sent.contains(&"t:3".to_owned()), keeps_order);
        }
    }

    #[tokio::test]
    async fn a_row_rejected_before_sending_stops_its_key_before_anything_is_sent() {
        let memory = MemorySink::new(true);
        memory.reject("t:0", SinkError::bad_row("too large"));
        let sink = Sink::Memory(memory);
        let outcomes = run(&sink, &[Some("a"), Some("a"), None]).await;
        assert!(matches!(&outcomes[0], RowOutcome::Failed(e) if e.class == ErrorClass::BadRow));
        assert_eq!(outcomes[1], RowOutcome::BehindFailure);
        assert_eq!(outcomes[2], RowOutcome::Published);
        let Sink::Memory(m) = &sink else {
            unreachable!()
        };
        assert_eq!(m.published().len(), 1);
    }

    #[tokio::test]
    async fn a_key_whose_destination_is_unavailable_is_not_sent_and_the_others_go() {
        for keeps_order in [false, true] {
            let memory = MemorySink::new(keeps_order);
            memory.set_available("a", false);
            let sink = Sink::Memory(memory.clone());
            let outcomes = run(&sink, &[Some("a"), Some("b"), Some("a"), None]).await;
            assert!(
                matches!(&outcomes[0], RowOutcome::Unavailable(r) if r.reason.contains("\"a\""))
            );
            assert_eq!(outcomes[1], RowOutcome::Published);
            assert_eq!(outcomes[2], RowOutcome::BehindFailure);
            assert_eq!(outcomes[3], RowOutcome::Published);
            let sent: Vec<String> = memory.published().into_iter().map(|m| m.id).collect();
            assert_eq!(sent, ["t:1", "t:3"], "nothing of key a was sent");
        }
    }
}
