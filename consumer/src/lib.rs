//! Broker consumers for outbox messages that acknowledge only after the handler succeeded.
//!
//! The relay delivers every committed outbox message **at least once**. This crate is the other
//! end: it reads what `outbox-publisher-nats`, `outbox-publisher-redis` and
//! `outbox-publisher-kafka` write, decodes the envelope into a [`Delivery`], calls your
//! [`Handler`], and acknowledges the message to the broker only after the handler returned `Ok`,
//! that is after the handler's transaction committed. Pair it with an inbox (a table of
//! processed message ids written in the handler's own transaction) to turn the at-least-once
//! delivery into exactly-once effects: the handler returns [`Handled::Duplicate`] for an id it
//! has seen.
//!
//! # Failures
//! - A [transient](FailureKind::Transient) handler error is retried after an exponential,
//!   jittered back-off ([`RetryPolicy`]); after [`RetryPolicy::max_attempts`] the message is
//!   **dead-lettered** and acknowledged, and the consumer goes on with the next one.
//! - A [permanent](FailureKind::Permanent) error, or a handler panic, dead-letters at once.
//! - An [unavailable](FailureKind::Unavailable) error (the handler's database is down) is retried
//!   without counting an attempt (bounded by [`RetryPolicy::unavailable_budget`]).
//! - A message that cannot be decoded (not from an outbox publisher, a payload that is not JSON,
//!   a missing or malformed id) is dead-lettered at once with the reason: never acknowledged
//!   silently, never retried for ever.
//! - A broker outage costs no attempt: fetches, acknowledgements and dead-letter writes are
//!   retried (doubling pauses up to 2 s) until the broker is back or the consumer stops.
//!
//! A dead letter goes to the same broker (a NATS subject captured by a dead-letter stream, a
//! Redis stream, a Kafka topic) and carries the original payload bytes and headers plus
//! [`DEAD_REASON`], [`DEAD_ATTEMPTS`] and [`DEAD_SOURCE`]. [`dead_letters`] counts and lists them from
//! the consumer's own URL.
//!
//! # Order and concurrency
//! Each batch fetched is split into ordering lanes handled one message after the other; up to
//! [`ConsumerOptions::concurrency`] lanes run at once:
//! - **Kafka**: a lane is a partition (the publisher puts each partition key in one partition),
//!   so per-key order holds across a consumer group.
//! - **NATS JetStream**: a lane is a subject. The stream keeps order per subject; with several
//!   consumer processes bound to one durable consumer, messages of one subject may be handled by
//!   two processes at once, so run one process per durable consumer where order matters (or
//!   give each key its own subject with the publisher's `{partition_key}` template).
//! - **Redis Streams**: a lane is a partition key (the entry's `partition_key` field), in stream
//!   order within one consumer. A consumer group shares entries between its consumers without
//!   any order between them: use one consumer per group where order matters.
//!
//! A lane whose message waits between retries holds back the next batch (not the other lanes
//! of its batch). Messages the client already fetched wait meanwhile; on NATS they are
//! redelivered if that wait passes the ack deadline (a duplicate for the handler, never a loss).
//!
//! On every broker a redelivery (after a crash, an ack deadline, a taken-over pending entry) can
//! bring a message after later ones of its key: order is per delivery, not across redeliveries.
//!
//! # Metrics
//! See [`telemetry`]: processed, duplicates dropped, retried, dead-lettered, broker errors and a
//! handler latency histogram, each labelled by consumer.

// Without a broker feature only the broker-independent core is built, and nothing uses it.
#![cfg_attr(
    not(any(feature = "nats", feature = "redis", feature = "kafka")),
    allow(dead_code)
)]

mod any;
mod core;
mod dead;
mod delivery;
mod handler;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
mod options;
#[cfg(feature = "redis")]
pub mod redis;
pub mod telemetry;

pub use any::Consumer;
pub use async_trait::async_trait;
pub use dead::{dead_letters, DeadLetter, DeadLetterPosition, DeadLetters, MAX_DEAD_LETTER_LIMIT};
pub use delivery::{DecodeError, Delivery, Source};
pub use handler::{handler_fn, FailureKind, Handled, Handler, HandlerError, HandlerFn};
pub use options::{
    ConsumerOptions, RetryPolicy, COMMON_URL_OPTIONS, DEFAULT_BATCH, DEFAULT_CONCURRENCY,
};
pub use outbox_traits::Error;
pub use tokio_util::sync::CancellationToken;

/// Header (NATS, Kafka) or field (Redis) of a dead letter: why the message was dead-lettered.
pub const DEAD_REASON: &str = "dead-letter-reason";
/// Header or field of a dead letter: the handler calls made (0 for an undecodable message).
pub const DEAD_ATTEMPTS: &str = "dead-letter-attempts";
/// Header or field of a dead letter: where the original message was (stream and sequence, entry
/// id, or topic, partition and offset).
pub const DEAD_SOURCE: &str = "dead-letter-source";
/// Header or field of a dead letter: the consumer that dead-lettered it.
pub const DEAD_CONSUMER: &str = "dead-letter-consumer";
