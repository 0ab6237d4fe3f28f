//! Turning a batch's publish outcomes into store transitions: which ids to complete, which to
//! fail (retry or dead-letter) and which to release.

use outbox_traits::{ErrorKind, FailAction, Failure, KeyGate, Message, PublishOutcome};
use rand::Rng;
use uuid::Uuid;

use crate::backoff::Backoff;

/// The store transitions for one batch.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Settlement {
    /// Acknowledged: mark published.
    pub(crate) complete: Vec<Uuid>,
    /// Failed or ambiguous: count an attempt, then retry or dead-letter.
    pub(crate) fail: Vec<Failure>,
    /// Not attempted: give back without counting an attempt.
    pub(crate) release: Vec<Uuid>,
    /// Acknowledged after an earlier message of the same key was not: a publisher bug.
    pub(crate) order_violations: Vec<Uuid>,
    /// Reported not attempted although no earlier message of its key failed in the batch: a
    /// publisher bug, handled as ambiguous so that it counts an attempt (releasing it would let
    /// the relay claim and release it again in a tight loop).
    pub(crate) unexplained_not_attempted: Vec<Uuid>,
    /// The publisher returned this many outcomes instead of one per message (a publisher bug);
    /// every message was then treated as ambiguous.
    pub(crate) wrong_outcome_count: Option<usize>,
}

/// Rules applied to failed messages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FailPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
}

impl FailPolicy {
    /// Retry with back-off, or dead-letter once this failure is the `max_attempts`-th.
    fn action<R: Rng + ?Sized>(&self, msg: &Message, rng: &mut R) -> FailAction {
        let attempt = msg.attempts.saturating_add(1);
        if attempt >= self.max_attempts {
            FailAction::Dead
        } else {
            FailAction::Retry {
                delay: self.backoff.delay_with_rng(attempt, rng),
            }
        }
    }

    fn failure<R: Rng + ?Sized>(&self, msg: &Message, reason: String, rng: &mut R) -> Failure {
        let action = self.action(msg, rng);
        let error = match action {
            FailAction::Dead if self.max_attempts > 1 => {
                format!(
                    "gave up after {} attempts: {reason}",
                    msg.attempts.saturating_add(1)
                )
            }
            _ => reason,
        };
        Failure {
            id: msg.id,
            error,
            action,
        }
    }
}

/// Decide the transitions for `batch` given the publisher's `outcomes`.
pub(crate) fn settle<R: Rng + ?Sized>(
    batch: &[Message],
    outcomes: Vec<PublishOutcome>,
    policy: &FailPolicy,
    rng: &mut R,
) -> Settlement {
    if outcomes.len() != batch.len() {
        return Settlement::wrong_count(batch, outcomes.len(), policy, rng);
    }
    let mut out = Settlement::default();
    // Closes a key at its first message that was not acknowledged.
    let mut gate = KeyGate::new();
    for (msg, outcome) in batch.iter().zip(outcomes) {
        let key_failed_earlier = !gate.admits(msg);
        gate.record(msg, &outcome);
        out.add(msg, outcome, key_failed_earlier, policy, rng);
    }
    out
}

impl Settlement {
    /// The publisher returned `got` outcomes for the batch: every message is ambiguous.
    fn wrong_count<R: Rng + ?Sized>(
        batch: &[Message],
        got: usize,
        policy: &FailPolicy,
        rng: &mut R,
    ) -> Self {
        let reason = format!(
            "ambiguous: the publisher returned {got} outcomes for {} messages",
            batch.len()
        );
        Self {
            wrong_outcome_count: Some(got),
            fail: batch
                .iter()
                .map(|msg| policy.failure(msg, reason.clone(), rng))
                .collect(),
            ..Self::default()
        }
    }

    /// Add the transition for `msg`, whose outcome is `outcome`; `key_failed_earlier` says
    /// whether an earlier message of its key in the batch was not acknowledged.
    fn add<R: Rng + ?Sized>(
        &mut self,
        msg: &Message,
        outcome: PublishOutcome,
        key_failed_earlier: bool,
        policy: &FailPolicy,
        rng: &mut R,
    ) {
        match outcome {
            PublishOutcome::Acked => {
                if key_failed_earlier {
                    self.order_violations.push(msg.id);
                }
                // Completed even out of order: the broker has it, and a retry would only add
                // a duplicate further out of order.
                self.complete.push(msg.id);
            }
            PublishOutcome::NotAttempted if key_failed_earlier => self.release.push(msg.id),
            PublishOutcome::NotAttempted => {
                self.unexplained_not_attempted.push(msg.id);
                self.fail.push(policy.failure(
                    msg,
                    "ambiguous: the publisher did not attempt it, with no earlier failure of its key"
                        .to_owned(),
                    rng,
                ));
            }
            PublishOutcome::Failed {
                kind: ErrorKind::Permanent,
                reason,
            } => self.fail.push(Failure {
                id: msg.id,
                error: format!("permanent: {reason}"),
                action: FailAction::Dead,
            }),
            PublishOutcome::Failed {
                kind: ErrorKind::Transient,
                reason,
            } => self
                .fail
                .push(policy.failure(msg, format!("transient: {reason}"), rng)),
            PublishOutcome::Ambiguous { reason } => {
                self.fail
                    .push(policy.failure(msg, format!("ambiguous: {reason}"), rng))
            }
            // Outcomes added to the contract later: the safe reading is "maybe stored".
            other => self
                .fail
                .push(policy.failure(msg, format!("ambiguous: {other:?}"), rng)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn msg(seq: i64, key: Option<&str>, attempts: u32) -> Message {
        Message {
            id: Uuid::now_v7(),
            seq,
            aggregate_type: "t".into(),
            aggregate_id: "a".into(),
            event_type: "e".into(),
            payload: "{}".into(),
            binary: None,
            headers: Default::default(),
            partition_key: key.map(str::to_owned),
            dedup_key: None,
            attempts,
            created_at: chrono::Utc::now(),
        }
    }

    fn policy() -> FailPolicy {
        FailPolicy {
            max_attempts: 3,
            backoff: Backoff {
                jitter: 0.0,
                ..Backoff::default()
            },
        }
    }

    fn run(batch: &[Message], outcomes: Vec<PublishOutcome>) -> Settlement {
        settle(batch, outcomes, &policy(), &mut StdRng::seed_from_u64(1))
    }

    #[test]
    fn each_outcome_maps_to_its_transition() {
        let b = vec![
            msg(1, Some("a"), 0),
            msg(2, Some("b"), 0),
            msg(3, Some("c"), 1),
            msg(4, Some("d"), 0),
            msg(5, Some("b"), 0),
            msg(6, None, 0),
        ];
        let s = run(
            &b,
            vec![
                PublishOutcome::Acked,
                PublishOutcome::transient("down"),
                PublishOutcome::Ambiguous {
                    reason: "timeout".into(),
                },
                PublishOutcome::permanent("too big"),
                PublishOutcome::NotAttempted,
                PublishOutcome::Acked,
            ],
        );
        assert_eq!(s.complete, vec![b[0].id, b[5].id]);
        assert_eq!(s.release, vec![b[4].id]);
        assert_eq!(
            s.fail,
            vec![
                Failure {
                    id: b[1].id,
                    error: "transient: down".into(),
                    action: FailAction::Retry {
                        delay: Duration::from_secs(1)
                    },
                },
                Failure {
                    id: b[2].id,
                    error: "ambiguous: timeout".into(),
                    // Second attempt: the back-off has doubled.
                    action: FailAction::Retry {
                        delay: Duration::from_secs(2)
                    },
                },
                Failure {
                    id: b[3].id,
                    error: "permanent: too big".into(),
                    action: FailAction::Dead,
                },
            ]
        );
        assert!(s.order_violations.is_empty());
        assert_eq!(s.wrong_outcome_count, None);
    }

    #[test]
    fn the_last_allowed_attempt_dead_letters() {
        let b = vec![msg(1, Some("a"), 1), msg(2, Some("b"), 2), msg(3, None, 7)];
        let s = run(
            &b,
            vec![
                PublishOutcome::transient("x"),
                PublishOutcome::transient("y"),
                PublishOutcome::Ambiguous { reason: "z".into() },
            ],
        );
        let actions: Vec<_> = s.fail.iter().map(|f| f.action.clone()).collect();
        assert_eq!(
            actions,
            vec![
                FailAction::Retry {
                    delay: Duration::from_secs(2)
                },
                FailAction::Dead,
                FailAction::Dead
            ]
        );
        assert_eq!(s.fail[1].error, "gave up after 3 attempts: transient: y");
    }

    #[test]
    fn max_attempts_one_never_retries() {
        let b = vec![msg(1, None, 0)];
        let p = FailPolicy {
            max_attempts: 1,
            ..policy()
        };
        let s = settle(
            &b,
            vec![PublishOutcome::transient("x")],
            &p,
            &mut StdRng::seed_from_u64(0),
        );
        assert_eq!(s.fail[0].action, FailAction::Dead);
        assert_eq!(s.fail[0].error, "transient: x");
    }

    #[test]
    fn acks_after_a_keys_failure_are_flagged_but_completed() {
        let b = vec![
            msg(1, Some("k"), 0),
            msg(2, Some("other"), 0),
            msg(3, Some("k"), 0),
            msg(4, None, 0),
            msg(5, None, 0),
        ];
        let s = run(
            &b,
            vec![
                PublishOutcome::transient("x"),
                PublishOutcome::Acked,
                PublishOutcome::Acked,
                PublishOutcome::transient("x"),
                PublishOutcome::Acked,
            ],
        );
        assert_eq!(s.order_violations, vec![b[2].id]);
        assert_eq!(s.complete, vec![b[1].id, b[2].id, b[4].id]);
    }

    #[test]
    fn not_attempted_without_an_earlier_failure_of_its_key_counts_an_attempt() {
        let b = vec![
            msg(1, Some("a"), 0),
            msg(2, None, 0),
            msg(3, Some("b"), 0),
            msg(4, Some("b"), 0),
        ];
        let s = run(
            &b,
            vec![
                PublishOutcome::NotAttempted,
                PublishOutcome::NotAttempted,
                PublishOutcome::transient("x"),
                PublishOutcome::NotAttempted,
            ],
        );
        assert_eq!(s.unexplained_not_attempted, vec![b[0].id, b[1].id]);
        assert_eq!(s.release, vec![b[3].id]);
        let failed: Vec<Uuid> = s.fail.iter().map(|f| f.id).collect();
        assert_eq!(failed, vec![b[0].id, b[1].id, b[2].id]);
        assert!(s.fail[0].error.contains("no earlier failure of its key"));
    }

    #[test]
    fn a_wrong_outcome_count_makes_everything_ambiguous() {
        let b = vec![msg(1, Some("a"), 0), msg(2, Some("a"), 0)];
        let s = run(&b, vec![PublishOutcome::Acked]);
        assert_eq!(s.wrong_outcome_count, Some(1));
        assert!(s.complete.is_empty() && s.release.is_empty());
        assert_eq!(s.fail.len(), 2);
        assert!(s
            .fail
            .iter()
            .all(|f| matches!(f.action, FailAction::Retry { .. })
                && f.error.contains("returned 1 outcomes for 2 messages")));
    }
}
