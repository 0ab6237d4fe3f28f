//! The header set every outbox publisher sends with a message.

use outbox_traits::Message;

/// The message id (UUID, hyphenated). Consumers deduplicate on it. NATS additionally gets it as
/// `Nats-Msg-Id` for JetStream's own dedup.
pub const HEADER_MESSAGE_ID: &str = "message-id";
/// The event type, e.g. `order.placed`.
pub const HEADER_EVENT_TYPE: &str = "event-type";
/// The aggregate type, e.g. `order`.
pub const HEADER_AGGREGATE_TYPE: &str = "aggregate-type";
/// The aggregate id, e.g. `order-42`.
pub const HEADER_AGGREGATE_ID: &str = "aggregate-id";
/// The partition (ordering) key; absent for an unordered message.
pub const HEADER_PARTITION_KEY: &str = "partition-key";

/// The names [`standard_headers`] sets from the message's own fields.
pub const STANDARD_HEADER_NAMES: &[&str] = &[
    HEADER_MESSAGE_ID,
    HEADER_EVENT_TYPE,
    HEADER_AGGREGATE_TYPE,
    HEADER_AGGREGATE_ID,
    HEADER_PARTITION_KEY,
];

/// The headers to send with `msg`: the standard ones first ([`HEADER_MESSAGE_ID`],
/// [`HEADER_EVENT_TYPE`], [`HEADER_AGGREGATE_TYPE`], [`HEADER_AGGREGATE_ID`], and
/// [`HEADER_PARTITION_KEY`] when the message has a key), then the user's headers in name order,
/// including a W3C `traceparent` when the message carries one.
///
/// A user header whose name equals a standard one (ignoring ASCII case) is left out: the standard
/// value comes from the stored message itself, and a consumer's dedup must not be fooled by a
/// header that contradicts the real id.
///
/// ```
/// # use outbox_traits::{Message, chrono::Utc, uuid::Uuid};
/// # let msg = Message { id: Uuid::nil(), seq: 1, aggregate_type: "order".into(),
/// #   aggregate_id: "o-1".into(), event_type: "order.placed".into(), payload: "{}".into(),
/// #   headers: [("traceparent".to_string(), "00-ab-cd-01".to_string())].into(),
/// #   partition_key: None, dedup_key: None, attempts: 0, created_at: Utc::now() };
/// let headers = outbox_routing::standard_headers(&msg);
/// assert_eq!(headers[0], ("message-id".to_string(), Uuid::nil().to_string()));
/// assert!(headers.contains(&("traceparent".to_string(), "00-ab-cd-01".to_string())));
/// ```
pub fn standard_headers(msg: &Message) -> Vec<(String, String)> {
    let mut out = Vec::with_capacity(5 + msg.headers.len());
    out.push((
        HEADER_MESSAGE_ID.to_owned(),
        msg.id.hyphenated().to_string(),
    ));
    out.push((HEADER_EVENT_TYPE.to_owned(), msg.event_type.clone()));
    out.push((HEADER_AGGREGATE_TYPE.to_owned(), msg.aggregate_type.clone()));
    out.push((HEADER_AGGREGATE_ID.to_owned(), msg.aggregate_id.clone()));
    if let Some(key) = &msg.partition_key {
        out.push((HEADER_PARTITION_KEY.to_owned(), key.clone()));
    }
    for (name, value) in &msg.headers {
        let reserved = STANDARD_HEADER_NAMES
            .iter()
            .any(|std| std.eq_ignore_ascii_case(name));
        if !reserved {
            out.push((name.clone(), value.clone()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests_support::message;

    #[test]
    fn standard_then_user_headers() {
        let mut msg = message();
        msg.headers.insert("traceparent".into(), "00-1-2-01".into());
        msg.headers.insert("tenant".into(), "acme".into());
        msg.headers.insert("Message-Id".into(), "forged".into());
        let h = standard_headers(&msg);
        let names: Vec<&str> = h.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message-id",
                "event-type",
                "aggregate-type",
                "aggregate-id",
                "partition-key",
                "tenant",
                "traceparent"
            ]
        );
        assert_eq!(h[0].1, msg.id.to_string());
        assert_eq!(h[4].1, "key-1");
    }

    #[test]
    fn no_partition_key_header_for_unordered_messages() {
        let mut msg = message();
        msg.partition_key = None;
        let h = standard_headers(&msg);
        assert!(h.iter().all(|(n, _)| n != HEADER_PARTITION_KEY));
    }
}
