//! Kafka publisher for the outbox relay, on librdkafka's idempotent producer.
//!
//! ```no_run
//! # async fn demo(batch: Vec<outbox_traits::Message>) -> Result<(), outbox_traits::Error> {
//! use outbox_publisher_kafka::{KafkaConfig, KafkaPublisher};
//! use outbox_traits::Publisher;
//!
//! let config = KafkaConfig::from_url(
//!     "kafka://127.0.0.1:9092?topic=outbox.{aggregate_type}&message.timeout.ms=5000&compression.type=lz4",
//! )?;
//! let publisher = KafkaPublisher::new(config)?;
//! let outcomes = publisher.publish(&batch).await; // one outcome per message
//! # Ok(()) }
//! ```
//!
//! # What goes to Kafka
//! - **Topic**: [`KafkaConfig::topic`] rendered for the message. Field values are made valid for
//!   a topic name by replacing every character other than `a-z A-Z 0-9 . _ -` with `_`.
//! - **Key**: the message's partition key, so one key stays on one partition and in order.
//!   An unordered message (no partition key) is sent without a key and spread over partitions.
//!   librdkafka's default partitioner (`consistent_random`, CRC32) differs from the Java client's
//!   murmur2; set `partitioner=murmur2_random` to place keys as Java producers do.
//! - **Value**: the payload's JSON text, byte for byte as stored; for a binary payload
//!   ([`outbox_traits::Binary`]), its bytes, untouched.
//! - **Headers** ([`outbox_routing::standard_headers`]): `message-id` (the message's UUID, the
//!   same on every attempt, for consumer dedup), `event-type`, `aggregate-type`, `aggregate-id`,
//!   `partition-key` (absent for unordered messages), `content-type` (a binary payload's content
//!   type; absent for JSON), then the user's headers in name order, including `traceparent`.
//!
//! ## CloudEvents (`envelope=cloudevents`, `envelope=cloudevents-structured`)
//! [`KafkaConfig::envelope`] (URL options `envelope=` and `ce_source=`) sends each message as a
//! CloudEvents 1.0 event by the Kafka protocol binding instead (see [`outbox_routing::envelope`]
//! for every attribute). **Binary mode** (`envelope=cloudevents`): headers `ce_specversion`,
//! `ce_id` (the message id), `ce_source` (default `/outbox/{aggregate_type}`), `ce_type` (the
//! event type), `ce_subject` (the aggregate id), `ce_time` (enqueue time, RFC 3339),
//! `ce_partitionkey`, `ce_aggregatetype`, `ce_<name>` for each user header that is a valid
//! extension name (e.g. `ce_traceparent`), `content-type: application/json` (or a binary
//! payload's content type); the value is the payload as stored (a binary payload's bytes).
//! **Structured mode**: `content-type: application/cloudevents+json` and the whole event (the
//! payload as `data`, a binary one base64-encoded as `data_base64`) as the value. In both, the key stays the partition key,
//! and user headers that cannot be extension attributes (and `traceparent`, `tracestate`) are
//! also sent as plain headers. `outbox-consumer` reads every envelope.
//!
//! # Delivery and outcomes
//! A batch is enqueued whole into librdkafka, which batches and pipelines it (up to 5 requests
//! in flight per broker, as idempotence allows); then all delivery reports are awaited together.
//! The idempotent producer (`enable.idempotence=true`, `acks=all`) retries internally without
//! duplicating or reordering. Outcomes per message:
//! - delivered: [`PublishOutcome::Acked`];
//! - refused for good (message too large, invalid or unknown topic, not authorized, invalid
//!   record): `Failed { kind: Permanent }`;
//! - delivery timed out ([`KafkaConfig::message_timeout`]) or lost with the producer:
//!   [`PublishOutcome::Ambiguous`] — it may have been stored;
//! - never handed to the broker (local queue full for the whole timeout, producer purged):
//!   `Failed { kind: Transient }`;
//! - any message whose partition key has an earlier message in the batch that was not
//!   acknowledged: [`PublishOutcome::NotAttempted`] (not sent, or sent and refused because of
//!   the earlier one; the relay gives it back without counting an attempt) unless it was
//!   acknowledged itself.
//!
//! # Order of a key when a message fails
//! Messages of a key are in flight together, so "later messages are not sent" cannot hold
//! literally; the broker's sequence check does the job instead. With idempotence, every record
//! carries a per-partition sequence number and a broker refuses a record whose predecessor it
//! did not store (`OUT_OF_ORDER_SEQUENCE_NUMBER`). What librdkafka does next depends on
//! `enable.gapless.guarantee`:
//! - `false` (librdkafka's default): it bumps the producer epoch, renumbers the key's later
//!   messages and sends them again, so they are stored *after the gap*; a requeued head message
//!   would then land behind them. (So it is not true that librdkafka fails the later messages
//!   by itself.)
//! - `true` (**this publisher's default**): it raises a fatal error instead, and the later
//!   messages are not stored. The publisher reports the refused message with its own error
//!   (e.g. permanent), the later ones as [`PublishOutcome::NotAttempted`], and builds a new
//!   producer for the next batch.
//!
//! Either way a message is reported [`PublishOutcome::Acked`] exactly when its delivery report
//! says it is stored: librdkafka's mock broker, for one, checks sequences only for transactional
//! producers and stores the later messages, and the publisher then reports them acknowledged.
//!
//! One gap remains that no setting closes (librdkafka documents it): a message that times out
//! *while in flight* may or may not be stored, while a later message of its key may be stored
//! after it; it is reported [`PublishOutcome::Ambiguous`], and a republish lands after the
//! later one. This needs the broker unreachable for longer than the message timeout, mid-request.
//!
//! # Fatal producer errors
//! After a fatal error (e.g. `OUT_OF_ORDER_SEQUENCE_NUMBER`, or the gapless guarantee above) a
//! librdkafka producer refuses all further work. The publisher notices it after the batch (or
//! before the next one), replaces the producer, and reports the batch's unacknowledged messages
//! as [`PublishOutcome::Ambiguous`] (or their own permanent failure). The next batch goes
//! through the new producer. A new producer is a new idempotence session: its retries of the
//! same messages can be stored twice; consumers drop duplicates by `message-id`.
//!
//! # Broker outages
//! When librdkafka reports that the producer lost every broker connection (`ALL_BROKERS_DOWN`)
//! and no broker then gives the cluster's metadata within 2 s (a dropped connection that comes
//! back at once changes nothing: librdkafka retries by itself), a batch waiting for its reports
//! does not wait for the message timeout: its undelivered messages are purged from the producer
//! and reported [`PublishOutcome::Ambiguous`] at once (the broker may have stored some before it
//! went away), so the relay asks
//! [`Publisher::check`](outbox_traits::Publisher::check) while the brokers are still down and
//! gives the batch back without counting an attempt. The producer is then replaced before its
//! next use (a publish or a check): a broker that restarted may have lost the producer's
//! idempotence session (Tansu and any broker replaced by an empty one answer the old producer
//! id with `UNKNOWN_PRODUCER_ID`, a fatal error), and a new producer connects at once instead
//! of after the old one's reconnect back-off. So the relay resumes as soon as a probe finds the
//! brokers back. A topic the restarted cluster no longer has is created again only by the
//! broker's auto-creation (`auto.create.topics.enable`, which librdkafka's producer requests);
//! otherwise its messages fail as an unknown topic.
//!
//! # Timeouts
//! `publish` returns within about [`KafkaConfig::message_timeout`] plus a margin whatever the
//! broker does; keep the relay's lease longer than that.

mod config;
mod log_limit;
mod publisher;

pub use config::{
    KafkaConfig, KafkaConfigBuilder, DEFAULT_MESSAGE_TIMEOUT, DEFAULT_TOPIC_TEMPLATE,
};
pub use publisher::KafkaPublisher;

#[cfg(doc)]
use outbox_traits::PublishOutcome;
