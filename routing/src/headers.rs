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
/// The body's media type, sent with a binary payload only (e.g. `application/x-protobuf`); a
/// message without it carries JSON, as it always did.
pub const HEADER_CONTENT_TYPE: &str = "content-type";

/// The names [`standard_headers`] sets from the message's own fields.
pub const STANDARD_HEADER_NAMES: &[&str] = &[
    HEADER_MESSAGE_ID,
    HEADER_EVENT_TYPE,
    HEADER_AGGREGATE_TYPE,
    HEADER_AGGREGATE_ID,
    HEADER_PARTITION_KEY,
    HEADER_CONTENT_TYPE,
];

/// The headers to send with `msg`: the standard ones first ([`HEADER_MESSAGE_ID`],
/// [`HEADER_EVENT_TYPE`], [`HEADER_AGGREGATE_TYPE`], [`HEADER_AGGREGATE_ID`], and
/// [`HEADER_PARTITION_KEY`] when the message has a key, [`HEADER_CONTENT_TYPE`] when its payload
/// is binary), then the user's headers in name order, including a W3C `traceparent` when the
/// message carries one. A JSON message gets no `content-type`: its headers are what they were
/// before binary payloads existed.
///
/// A user header whose name equals a standard one (ignoring ASCII case) is left out: the standard
/// value comes from the stored message itself, and a consumer's dedup must not be fooled by a
/// header that contradicts the real id. That includes `content-type`, which a consumer reads as
/// the body's type: a user's `content-type: text/plain` on a JSON message would make its body
/// look binary.
///
/// ```
/// # use outbox_traits::{Message, chrono::Utc, uuid::Uuid};
/// # let msg = Message { id: Uuid::nil(), seq: 1, aggregate_type: "order".into(),
/// #   aggregate_id: "o-1".into(), event_type: "order.placed".into(), payload: "{}".into(),
/// #   binary: None, headers: [("traceparent".to_string(), "00-ab-cd-01".to_string())].into(),
/// #   partition_key: None, dedup_key: None, attempts: 0, created_at: Utc::now() };
/// let headers = outbox_routing::standard_headers(&msg);
/// assert_eq!(headers[0], ("message-id".to_string(), Uuid::nil().to_string()));
/// assert!(headers.contains(&("traceparent".to_string(), "00-ab-cd-01".to_string())));
/// ```
pub fn standard_headers(msg: &Message) -> Vec<(String, String)> {
    let id = msg.id.hyphenated().to_string();
    standard_header_refs(msg, &id)
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
}

/// The headers of [`standard_headers`], in the same order, borrowed instead of copied: a
/// publisher that builds its own header type from them saves two allocations per header. `id`
/// is the message's id as the caller formatted it (hyphenated); a standard header's name is the
/// very `&'static str` of its constant, so a caller can tell the standard names by comparing
/// with [`STANDARD_HEADER_NAMES`].
///
/// ```
/// # use outbox_traits::{Message, chrono::Utc, uuid::Uuid};
/// # let msg = Message { id: Uuid::nil(), seq: 1, aggregate_type: "order".into(),
/// #   aggregate_id: "o-1".into(), event_type: "order.placed".into(), payload: "{}".into(),
/// #   binary: None, headers: [("tenant".to_string(), "acme".to_string())].into(),
/// #   partition_key: None, dedup_key: None, attempts: 0, created_at: Utc::now() };
/// use outbox_routing::{standard_header_refs, standard_headers};
/// let id = msg.id.hyphenated().to_string();
/// let borrowed: Vec<(String, String)> = standard_header_refs(&msg, &id)
///     .map(|(n, v)| (n.to_owned(), v.to_owned()))
///     .collect();
/// assert_eq!(borrowed, standard_headers(&msg));
/// ```
pub fn standard_header_refs<'m>(
    msg: &'m Message,
    id: &'m str,
) -> impl Iterator<Item = (&'m str, &'m str)> {
    let standard = [
        Some((HEADER_MESSAGE_ID, id)),
        Some((HEADER_EVENT_TYPE, msg.event_type.as_str())),
        Some((HEADER_AGGREGATE_TYPE, msg.aggregate_type.as_str())),
        Some((HEADER_AGGREGATE_ID, msg.aggregate_id.as_str())),
        msg.partition_key
            .as_deref()
            .map(|key| (HEADER_PARTITION_KEY, key)),
        msg.binary
            .as_ref()
            .map(|binary| (HEADER_CONTENT_TYPE, binary.content_type.as_str())),
    ];
    let user = msg
        .headers
        .iter()
        .filter(|(name, _)| {
            !STANDARD_HEADER_NAMES
                .iter()
                .any(|std| std.eq_ignore_ascii_case(name))
        })
        .map(|(name, value)| (name.as_str(), value.as_str()));
    standard.into_iter().flatten().chain(user)
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

    #[test]
    fn content_type_only_for_binary_payloads() {
        let mut msg = message();
        msg.headers
            .insert("Content-Type".into(), "text/plain".into());
        let json = standard_headers(&msg);
        assert!(json
            .iter()
            .all(|(n, _)| !n.eq_ignore_ascii_case(HEADER_CONTENT_TYPE)));
        msg.binary = Some(outbox_traits::Binary::new(
            "application/x-protobuf",
            [0u8, 0xff],
        ));
        let binary = standard_headers(&msg);
        let types: Vec<&(String, String)> = binary
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(HEADER_CONTENT_TYPE))
            .collect();
        assert_eq!(
            types,
            [&(
                "content-type".to_string(),
                "application/x-protobuf".to_string()
            )]
        );
    }
}
