//! What every outbox publisher shares: where a message goes and which headers it carries.
//!
//! - [`RoutingTemplate`]: a destination name (NATS subject, Kafka topic, Redis stream key) built
//!   from a message's fields, e.g. `outbox.{aggregate_type}.{event_type}`. It is parsed and
//!   checked once, when the publisher is configured, so a typo fails at start-up with
//!   [`Error::InvalidInput`](outbox_traits::Error::InvalidInput) instead of at the first publish.
//! - [`standard_headers`]: the header set every publisher sends, so that a consumer reads the same
//!   names whichever broker carried the message.
//! - [`Envelope`]: what a message is wrapped in on the wire, chosen per broker URL with
//!   `envelope=`: the standard headers (default) or a CloudEvents 1.0 event in binary or
//!   structured content mode, by each broker's protocol binding (see the [`envelope`] module).
//!
//! The per-key order a publisher keeps inside a batch ([`KeyGate`](outbox_traits::KeyGate)) is a
//! rule of the [`Publisher`](outbox_traits::Publisher) contract and lives with it, in
//! `outbox-traits`.
//!
//! Making a rendered name valid for one broker (NATS forbids spaces and wildcards in subjects,
//! Kafka limits topic characters) is the adapter's job: it passes a sanitizer to
//! [`RoutingTemplate::render_with`].

pub mod envelope;
mod headers;
mod template;

pub use envelope::{Binding, CloudEventHeaders, Envelope, EnvelopeMode, ENVELOPE_URL_OPTIONS};
pub use headers::{
    standard_header_refs, standard_headers, HEADER_AGGREGATE_ID, HEADER_AGGREGATE_TYPE,
    HEADER_CONTENT_TYPE, HEADER_EVENT_TYPE, HEADER_MESSAGE_ID, HEADER_PARTITION_KEY,
    STANDARD_HEADER_NAMES,
};
pub use template::{Field, RoutingTemplate, PLACEHOLDERS};

#[cfg(test)]
mod tests_support {
    use outbox_traits::{chrono::Utc, uuid::Uuid, Message};

    pub(crate) fn message() -> Message {
        Message {
            id: Uuid::now_v7(),
            seq: 1,
            aggregate_type: "order".into(),
            aggregate_id: "order-42".into(),
            event_type: "order.placed".into(),
            payload: "{}".into(),
            binary: None,
            headers: Default::default(),
            partition_key: Some("key-1".into()),
            dedup_key: None,
            attempts: 0,
            created_at: Utc::now(),
        }
    }
}
