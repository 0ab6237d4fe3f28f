//! Generated inbox scenarios.

use proptest::collection::vec;
use proptest::prelude::*;

/// The consumers of a scenario (indexes of [`InboxStep`] refer to these), one with a colon and
/// one with a non-ASCII letter so that names are compared exactly.
pub const CONSUMERS: [&str; 3] = ["payments", "ledger:eu", "versand-ü"];

/// How many distinct messages a scenario delivers (indexes `0..MESSAGES`).
pub const MESSAGES: usize = 8;

/// How a delivery's handler ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryEnd {
    /// The handler commits and the consumer acknowledges: the broker stops redelivering.
    Ack,
    /// The consumer crashes before its commit (its transaction is dropped): the broker
    /// redelivers.
    CrashBeforeCommit,
    /// The handler returns an error: the consumer rolls back and the broker redelivers.
    HandlerFails,
    /// The consumer commits and crashes before the ack: the broker redelivers a message whose
    /// effect is applied.
    CrashAfterCommit,
}

/// How the first of two racing transactions ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxEnd {
    /// It commits: the second must find the id processed.
    Commit,
    /// It rolls back: the second must find the id new.
    Rollback,
}

/// One step of an inbox scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InboxStep {
    /// Deliver `messages` (indexes, maybe repeated: one delivery of a batch) to `consumer` in
    /// one transaction, applying the effect of each new one, and end as `end` says.
    Deliver {
        /// Index into [`CONSUMERS`].
        consumer: usize,
        /// Indexes of the messages, in delivery order.
        messages: Vec<usize>,
        /// How the handler ends.
        end: DeliveryEnd,
    },
    /// Two deliveries of one message to one consumer in two open transactions: the first
    /// records it (and applies it if new), the second records it while the first is open (it
    /// must wait), then the first ends as `first` says and the second applies it if new and
    /// commits. Only against an inbox with concurrent transactions.
    Race {
        /// Index into [`CONSUMERS`].
        consumer: usize,
        /// Index of the message.
        message: usize,
        /// How the first transaction ends.
        first: TxEnd,
    },
    /// Every mark gets older by `hours` hours.
    Age {
        /// Hours to add to every mark's age.
        hours: u32,
    },
    /// One purge call: marks older than `older_than_hours` hours minus half an hour, at most
    /// `batch` of them.
    Purge {
        /// The age, in hours (the call asks half an hour less, so that no mark is on the edge).
        older_than_hours: u32,
        /// The batch size.
        batch: u32,
    },
}

/// A generated scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxScenario {
    /// The steps, in order.
    pub steps: Vec<InboxStep>,
}

fn end() -> impl Strategy<Value = DeliveryEnd> {
    prop_oneof![
        3 => Just(DeliveryEnd::Ack),
        1 => Just(DeliveryEnd::CrashBeforeCommit),
        1 => Just(DeliveryEnd::HandlerFails),
        2 => Just(DeliveryEnd::CrashAfterCommit),
    ]
}

fn step() -> impl Strategy<Value = InboxStep> {
    let consumer = 0..CONSUMERS.len();
    prop_oneof![
        8 => (consumer.clone(), vec(0..MESSAGES, 1..5), end()).prop_map(
            |(consumer, messages, end)| InboxStep::Deliver { consumer, messages, end }
        ),
        2 => (consumer, 0..MESSAGES, prop_oneof![Just(TxEnd::Commit), Just(TxEnd::Rollback)])
            .prop_map(|(consumer, message, first)| InboxStep::Race { consumer, message, first }),
        1 => (1u32..48).prop_map(|hours| InboxStep::Age { hours }),
        1 => (1u32..72, 1u32..6).prop_map(|(older_than_hours, batch)| InboxStep::Purge {
            older_than_hours,
            batch
        }),
    ]
}

/// Scenarios of 1 to 40 steps.
pub fn inbox_scenario() -> impl Strategy<Value = InboxScenario> {
    vec(step(), 1..40).prop_map(|steps| InboxScenario { steps })
}
