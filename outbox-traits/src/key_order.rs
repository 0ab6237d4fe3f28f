//! Per-key order inside one publish call: once a key's message is not acknowledged, the key's
//! later messages in the batch are not attempted.
//!
//! This is the [`Publisher`](crate::Publisher) contract's ordering rule. A later message
//! sent after its key's earlier one failed would reach the broker ahead of the earlier one's
//! retry, so a publisher reports it as [`PublishOutcome::NotAttempted`] instead; the relay gives it
//! back without counting an attempt, and it goes out after the earlier one. Messages without a
//! partition key have no order to keep and are always attempted.

use std::collections::HashSet;

use crate::{Message, PublishOutcome};

/// The keys of one batch that are closed: an earlier message of theirs was not acknowledged.
///
/// Make one per `publish` call and walk the batch in order: ask [`KeyGate::admits`] before
/// sending a message, and [`KeyGate::record`] what became of it (or [`KeyGate::close`] its key
/// when it is known to have failed before its outcome is final).
///
/// ```
/// use outbox_traits::KeyGate;
/// # use outbox_traits::{chrono::Utc, uuid::Uuid, Message, PublishOutcome};
/// # let message = |key: &str| Message { id: Uuid::now_v7(), seq: 1,
/// #     aggregate_type: "order".into(), aggregate_id: "o-1".into(), event_type: "e".into(),
/// #     payload: "{}".into(), binary: None, headers: Default::default(), partition_key: Some(key.into()),
/// #     dedup_key: None, attempts: 0, created_at: Utc::now() };
/// let batch = [message("a"), message("a"), message("b")];
/// let mut gate = KeyGate::new();
/// assert!(gate.admits(&batch[0]));
/// gate.record(&batch[0], &PublishOutcome::transient("broker down"));
/// assert!(!gate.admits(&batch[1])); // report it as NotAttempted
/// assert!(gate.admits(&batch[2]));  // another key
/// ```
#[derive(Debug, Default, Clone)]
pub struct KeyGate<'a> {
    closed: HashSet<&'a str>,
}

impl<'a> KeyGate<'a> {
    /// A gate with every key open.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `message` may be attempted: `false` once an earlier message of its partition key
    /// was recorded as not acknowledged (or its key was closed). Always `true` without a key.
    pub fn admits(&self, message: &Message) -> bool {
        message
            .partition_key
            .as_deref()
            .is_none_or(|key| !self.closed.contains(key))
    }

    /// Record the outcome of an attempted `message`: anything but
    /// [`PublishOutcome::Acked`] closes its key for the rest of the batch.
    pub fn record(&mut self, message: &'a Message, outcome: &PublishOutcome) {
        if !outcome.is_acked() {
            self.close(message);
        }
    }

    /// Close `message`'s key for the rest of the batch (no effect without a key).
    pub fn close(&mut self, message: &'a Message) {
        if let Some(key) = message.partition_key.as_deref() {
            self.closed.insert(key);
        }
    }
}

/// Attempt each message of `batch` in order with `attempt`, except those whose key an earlier
/// outcome closed: they get [`PublishOutcome::NotAttempted`] and `attempt` is not called for them.
/// Returns one outcome per message, in batch order. For publishers that decide each message
/// before the next one (a writer, a test double).
pub fn attempt_in_key_order(
    batch: &[Message],
    mut attempt: impl FnMut(&Message) -> PublishOutcome,
) -> Vec<PublishOutcome> {
    let mut gate = KeyGate::new();
    batch
        .iter()
        .map(|message| {
            if !gate.admits(message) {
                return PublishOutcome::NotAttempted;
            }
            let outcome = attempt(message);
            gate.record(message, &outcome);
            outcome
        })
        .collect()
}

/// Apply the rule after the fact, to the outcomes of a batch whose messages were all handed to
/// the broker together (pipelined): a message not acknowledged after its key's earlier one was
/// not acknowledged either becomes [`PublishOutcome::NotAttempted`] (its failure, if any, was
/// caused by the earlier one). A later message that *was* acknowledged keeps its outcome: it is
/// stored, and pretending otherwise would only duplicate it. Returns the indexes of those
/// acknowledged-out-of-order messages, for the caller to report.
///
/// `outcomes` pairs with `batch` by position; extra entries on either side are left alone.
pub fn settle_in_key_order(batch: &[Message], outcomes: &mut [PublishOutcome]) -> Vec<usize> {
    let mut gate = KeyGate::new();
    let mut acked_out_of_order = Vec::new();
    for (index, (message, outcome)) in batch.iter().zip(outcomes.iter_mut()).enumerate() {
        if gate.admits(message) {
            gate.record(message, outcome);
        } else if outcome.is_acked() {
            acked_out_of_order.push(index);
        } else {
            *outcome = PublishOutcome::NotAttempted;
        }
    }
    acked_out_of_order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(key: Option<&str>) -> Message {
        Message {
            id: uuid::Uuid::now_v7(),
            seq: 1,
            aggregate_type: "order".into(),
            aggregate_id: "order-42".into(),
            event_type: "order.placed".into(),
            payload: "{}".into(),
            binary: None,
            headers: Default::default(),
            partition_key: key.map(str::to_owned),
            dedup_key: None,
            attempts: 0,
            created_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn a_failure_closes_only_its_own_key() {
        let batch = [keyed(Some("a")), keyed(Some("a")), keyed(Some("b"))];
        let mut gate = KeyGate::new();
        assert!(gate.admits(&batch[0]));
        gate.record(&batch[0], &PublishOutcome::permanent("bad"));
        assert!(!gate.admits(&batch[1]));
        assert!(gate.admits(&batch[2]));
    }

    #[test]
    fn acked_messages_keep_the_key_open() {
        let batch = [keyed(Some("a")), keyed(Some("a"))];
        let mut gate = KeyGate::new();
        gate.record(&batch[0], &PublishOutcome::Acked);
        assert!(gate.admits(&batch[1]));
    }

    #[test]
    fn every_outcome_but_acked_closes_the_key() {
        for outcome in [
            PublishOutcome::transient("t"),
            PublishOutcome::permanent("p"),
            PublishOutcome::Ambiguous { reason: "a".into() },
            PublishOutcome::NotAttempted,
        ] {
            let batch = [keyed(Some("a")), keyed(Some("a"))];
            let mut gate = KeyGate::new();
            gate.record(&batch[0], &outcome);
            assert!(!gate.admits(&batch[1]), "{outcome:?} left the key open");
        }
    }

    #[test]
    fn messages_without_a_key_are_always_admitted() {
        let batch = [keyed(None), keyed(None)];
        let mut gate = KeyGate::new();
        gate.record(&batch[0], &PublishOutcome::transient("down"));
        gate.close(&batch[0]);
        assert!(gate.admits(&batch[1]));
    }

    #[test]
    fn close_shuts_a_key_without_an_outcome() {
        let batch = [keyed(Some("a")), keyed(Some("a"))];
        let mut gate = KeyGate::new();
        gate.close(&batch[0]);
        assert!(!gate.admits(&batch[1]));
    }

    #[test]
    fn attempt_in_key_order_skips_a_failed_keys_later_messages() {
        let batch = [
            keyed(Some("a")),
            keyed(Some("b")),
            keyed(Some("a")),
            keyed(None),
            keyed(Some("b")),
        ];
        let failing = batch[0].id;
        let mut attempted = Vec::new();
        let outcomes = attempt_in_key_order(&batch, |msg| {
            attempted.push(msg.id);
            if msg.id == failing {
                PublishOutcome::transient("down")
            } else {
                PublishOutcome::Acked
            }
        });
        assert_eq!(
            outcomes,
            [
                PublishOutcome::transient("down"),
                PublishOutcome::Acked,
                PublishOutcome::NotAttempted,
                PublishOutcome::Acked,
                PublishOutcome::Acked,
            ]
        );
        let expected: Vec<_> = [0, 1, 3, 4].iter().map(|&i| batch[i].id).collect();
        assert_eq!(
            attempted, expected,
            "the closed key's message was attempted"
        );
    }

    #[test]
    fn settle_in_key_order_rewrites_later_failures_and_reports_later_acks() {
        let batch = [
            keyed(Some("a")),
            keyed(Some("a")),
            keyed(Some("a")),
            keyed(Some("b")),
            keyed(None),
            keyed(None),
        ];
        let mut outcomes = vec![
            PublishOutcome::transient("timed out"),
            PublishOutcome::transient("timed out"),
            PublishOutcome::Acked,
            PublishOutcome::permanent("too big"),
            PublishOutcome::transient("down"),
            PublishOutcome::transient("down"),
        ];
        let out_of_order = settle_in_key_order(&batch, &mut outcomes);
        assert_eq!(out_of_order, [2]);
        assert_eq!(
            outcomes,
            [
                PublishOutcome::transient("timed out"),
                PublishOutcome::NotAttempted,
                PublishOutcome::Acked,
                PublishOutcome::permanent("too big"),
                PublishOutcome::transient("down"),
                PublishOutcome::transient("down"),
            ]
        );
    }
}
