//! Messages: what a service enqueues ([`NewMessage`]) and what a relay claims ([`Message`]).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::Error;

/// The default upper bound on a payload's serialized size: 1 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// The longest content type a binary payload may carry, in bytes.
pub const MAX_CONTENT_TYPE_BYTES: usize = 255;

/// The content type of a JSON payload, as publishers send it.
pub const JSON_CONTENT_TYPE: &str = "application/json";

/// A binary payload: bytes sent to the broker untouched, with their content type.
///
/// Protobuf, Avro, Confluent schema-registry framed data or plain text: the store keeps the bytes
/// as they are (`bytea` / `LONGBLOB` / `BLOB`), and every publisher sends them as the message's
/// body, with the content type as a header (`content-type`).
///
/// ```
/// use outbox_traits::{Binary, NewMessage};
/// let msg = NewMessage::binary(
///     "order", "order-42", "order.placed",
///     Binary::new("application/x-protobuf", vec![0x08, 0x2a]),
/// );
/// assert_eq!(msg.binary.as_ref().map(|b| b.data.len()), Some(2));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binary {
    /// The media type of `data`, e.g. `application/x-protobuf`, `application/avro`,
    /// `application/vnd.confluent.avro` or `text/plain; charset=utf-8`. Printable ASCII,
    /// with a `/`, at most [`MAX_CONTENT_TYPE_BYTES`].
    pub content_type: String,
    /// The bytes, sent untouched.
    pub data: Vec<u8>,
}

impl Binary {
    /// Bytes with their content type.
    pub fn new(content_type: impl Into<String>, data: impl Into<Vec<u8>>) -> Self {
        Self {
            content_type: content_type.into(),
            data: data.into(),
        }
    }

    /// Check the content type and size against the rules every backend enforces.
    pub fn validate(&self, id: Uuid, limits: &Limits) -> Result<(), Error> {
        validate_content_type(&self.content_type)
            .map_err(|problem| Error::invalid_input(format!("message {id} has {problem}")))?;
        if self.data.len() > limits.max_payload_bytes {
            return Err(Error::invalid_input(format!(
                "binary payload of message {id} is {} bytes, over the limit of {} bytes; \
                 store large bodies elsewhere and enqueue a reference, or raise the limit",
                self.data.len(),
                limits.max_payload_bytes
            )));
        }
        Ok(())
    }
}

/// Check a binary payload's content type: not empty, at most [`MAX_CONTENT_TYPE_BYTES`],
/// printable ASCII (spaces allowed, for parameters), and of the form `type/subtype`. The error
/// names the problem (e.g. "a content type with a line break").
pub fn validate_content_type(content_type: &str) -> Result<(), String> {
    if content_type.trim().is_empty() {
        return Err("an empty content type; set one such as \"application/x-protobuf\"".into());
    }
    if content_type.len() > MAX_CONTENT_TYPE_BYTES {
        return Err(format!(
            "a content type of {} bytes, over the limit of {MAX_CONTENT_TYPE_BYTES}",
            content_type.len()
        ));
    }
    if let Some(c) = content_type
        .chars()
        .find(|c| !(c.is_ascii_graphic() || *c == ' '))
    {
        return Err(format!(
            "a content type with the character {c:?}; use printable ASCII such as \"application/avro\""
        ));
    }
    let media = content_type.split(';').next().unwrap_or_default().trim();
    match media.split_once('/') {
        Some((kind, sub)) if !kind.is_empty() && !sub.is_empty() && !sub.contains('/') => Ok(()),
        _ => Err(format!(
            "the content type {content_type:?}, which is not of the form type/subtype \
             (e.g. \"application/x-protobuf\")"
        )),
    }
}

/// Header that carries a W3C trace context from the enqueuing service to the consumer.
///
/// Publishers forward every header; this name is listed so that services and publishers agree on
/// the spelling.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A message to enqueue, written in the caller's own database transaction.
///
/// Build one with [`NewMessage::new`] and the `with_*` methods. The id is a UUID v7 made here,
/// at enqueue, and never changes: every delivery attempt carries the same id so consumers can
/// drop duplicates.
///
/// ```
/// use outbox_traits::NewMessage;
/// let msg = NewMessage::new("order", "order-42", "order.placed", serde_json::json!({"total": 12}))
///     .with_header("tenant", "acme");
/// assert_eq!(msg.partition_key.as_deref(), Some("order-42"));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewMessage {
    /// Stable message id (UUID v7 unless given). Consumers deduplicate on it.
    pub id: Uuid,
    /// Kind of aggregate the event is about, e.g. `order`. Debezium's `aggregatetype`.
    pub aggregate_type: String,
    /// Id of the aggregate, e.g. `order-42`. Debezium's `aggregateid`.
    pub aggregate_id: String,
    /// Event type, e.g. `order.placed`. Must not be empty. Debezium's `type`.
    pub event_type: String,
    /// The JSON payload (`null` for a binary message).
    pub payload: serde_json::Value,
    /// A binary payload, sent instead of the JSON one ([`NewMessage::binary`]); `None` for a
    /// JSON message. A binary message's `payload` must be `null`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binary: Option<Binary>,
    /// String headers forwarded to the broker as message headers.
    pub headers: BTreeMap<String, String>,
    /// Ordering key. Messages with the same key are published in the order they were inserted
    /// (their `seq`); `None` means the message flows unordered. Defaults to the aggregate id.
    ///
    /// Precondition: a key's messages are written by one transaction at a time. Two
    /// transactions that write one key at the same time can commit in the other order, and then
    /// the message inserted second is published first (it is committed while the first is not).
    /// The Postgres and MariaDB stores offer a key lock that serialises such writers
    /// (`lock_keys` in their configs, or one SQL statement for other writers).
    pub partition_key: Option<String>,
    /// Optional idempotency key: a second message with the same key is refused by the store.
    pub dedup_key: Option<String>,
    /// Earliest time the message may be published (delayed delivery). `None` means now.
    pub not_before: Option<DateTime<Utc>>,
}

impl NewMessage {
    /// A message with a fresh UUID v7 id, no headers, and the aggregate id as partition key.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        let aggregate_id = aggregate_id.into();
        Self {
            id: Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            partition_key: Some(aggregate_id.clone()),
            aggregate_id,
            event_type: event_type.into(),
            payload,
            binary: None,
            headers: BTreeMap::new(),
            dedup_key: None,
            not_before: None,
        }
    }

    /// A message whose payload is bytes with a content type ([`Binary`]): Protobuf, Avro,
    /// schema-registry framed data, plain text. Everything else is as [`NewMessage::new`].
    pub fn binary(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: Binary,
    ) -> Self {
        let mut message = Self::new(
            aggregate_type,
            aggregate_id,
            event_type,
            serde_json::Value::Null,
        );
        message.binary = Some(payload);
        message
    }

    /// Use this id instead of the generated one (e.g. an id the caller already stored).
    pub fn with_id(mut self, id: Uuid) -> Self {
        self.id = id;
        self
    }

    /// Add (or replace) one header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Order this message by `key` instead of by its aggregate id.
    pub fn with_partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Let this message flow without any ordering relative to others.
    pub fn unordered(mut self) -> Self {
        self.partition_key = None;
        self
    }

    /// Refuse this message if another one with the same dedup key was already enqueued.
    pub fn with_dedup_key(mut self, key: impl Into<String>) -> Self {
        self.dedup_key = Some(key.into());
        self
    }

    /// Do not publish before `at` (delayed delivery). A delayed message also holds back later
    /// messages of its partition key.
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.not_before = Some(at);
        self
    }

    /// The payload as JSON text, checked against `limits` (`null` for a binary message, whose
    /// bytes are checked instead).
    ///
    /// Backends call this (or [`NewMessage::validate`]) before they write anything, so a bad
    /// message never reaches the database.
    pub fn payload_json(&self, limits: &Limits) -> Result<String, Error> {
        if let Some(binary) = &self.binary {
            if !self.payload.is_null() {
                return Err(Error::invalid_input(format!(
                    "message {} has both a binary and a JSON payload; a binary message's \
                     `payload` must be null",
                    self.id
                )));
            }
            binary.validate(self.id, limits)?;
            return Ok("null".to_owned());
        }
        let text = serde_json::to_string(&self.payload).map_err(|e| {
            Error::invalid_input(format!("payload of message {} is not JSON: {e}", self.id))
        })?;
        if text.len() > limits.max_payload_bytes {
            return Err(Error::invalid_input(format!(
                "payload of message {} is {} bytes, over the limit of {} bytes; \
                 store large bodies elsewhere and enqueue a reference, or raise the limit",
                self.id,
                text.len(),
                limits.max_payload_bytes
            )));
        }
        Ok(text)
    }

    /// Check the message against the rules every backend enforces before writing.
    ///
    /// Returns the payload as JSON text so that the caller does not serialize it twice.
    pub fn validate(&self, limits: &Limits) -> Result<String, Error> {
        if self.event_type.trim().is_empty() {
            return Err(Error::invalid_input(format!(
                "message {} has an empty event type; set one such as \"order.placed\"",
                self.id
            )));
        }
        if self.aggregate_type.trim().is_empty() {
            return Err(Error::invalid_input(format!(
                "message {} has an empty aggregate type; set one such as \"order\"",
                self.id
            )));
        }
        if matches!(self.partition_key.as_deref(), Some("")) {
            return Err(Error::invalid_input(format!(
                "message {} has an empty partition key; use `unordered()` for no ordering",
                self.id
            )));
        }
        if matches!(self.dedup_key.as_deref(), Some("")) {
            return Err(Error::invalid_input(format!(
                "message {} has an empty dedup key; leave it unset instead",
                self.id
            )));
        }
        if let Some((name, _)) = self.headers.iter().find(|(name, _)| name.is_empty()) {
            return Err(Error::invalid_input(format!(
                "message {} has a header with an empty name ({name:?})",
                self.id
            )));
        }
        self.payload_json(limits)
    }
}

/// Limits a backend applies to every enqueued message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted payload, in bytes of its JSON text (or of a binary payload's data).
    /// Default: 1 MiB.
    pub max_payload_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

/// A message handed to a relay by a claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Stable id, the same on every attempt.
    pub id: Uuid,
    /// Position assigned by the store at insert. Unique and increasing in insert order within one
    /// store, but *not* in commit order: never use it as a cursor.
    pub seq: i64,
    /// Kind of aggregate.
    pub aggregate_type: String,
    /// Id of the aggregate.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// JSON payload as text, exactly as the store returned it (`null` for a binary message).
    pub payload: String,
    /// The binary payload, for a message enqueued with one; publishers send it instead of
    /// `payload` ([`Message::body`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binary: Option<Binary>,
    /// Headers given at enqueue.
    pub headers: BTreeMap<String, String>,
    /// Ordering key, if any.
    pub partition_key: Option<String>,
    /// Dedup key, if any.
    pub dedup_key: Option<String>,
    /// Failed attempts recorded before this claim.
    pub attempts: u32,
    /// When the message was enqueued (database clock).
    pub created_at: DateTime<Utc>,
}

impl Message {
    /// The bytes a publisher sends: the binary payload's data, or the JSON text.
    pub fn body(&self) -> &[u8] {
        match &self.binary {
            Some(binary) => &binary.data,
            None => self.payload.as_bytes(),
        }
    }

    /// The body's content type: the binary payload's, or [`JSON_CONTENT_TYPE`].
    pub fn content_type(&self) -> &str {
        match &self.binary {
            Some(binary) => &binary.content_type,
            None => JSON_CONTENT_TYPE,
        }
    }

    /// Whether the payload is binary (see [`Binary`]).
    pub fn is_binary(&self) -> bool {
        self.binary.is_some()
    }
}

/// A message of a batch that passed [`validate_batch`], with its payload and headers as the
/// JSON text a store writes.
#[derive(Debug)]
pub struct ValidMessage<'a> {
    /// The message as given.
    pub message: &'a NewMessage,
    /// The payload as JSON text (from [`NewMessage::validate`]; `null` for a binary message,
    /// whose bytes are `message.binary`).
    pub payload: String,
    /// The headers as a JSON object.
    pub headers: String,
}

/// Check a batch against the rules every backend enforces before it writes anything: each
/// message passes [`NewMessage::validate`], no two messages share an id
/// ([`Error::InvalidInput`]) or a dedup key ([`Error::DuplicateKey`]), and the headers encode as
/// JSON. Returns the messages in order with their payload and headers as JSON text.
///
/// ```
/// use outbox_traits::{validate_batch, Error, Limits, NewMessage};
/// let a = NewMessage::new("order", "o-1", "order.placed", serde_json::json!({"n": 1}));
/// let ok = validate_batch(std::slice::from_ref(&a), &Limits::default())?;
/// assert_eq!(ok[0].payload, r#"{"n":1}"#);
/// let twice = [a.clone(), a];
/// assert!(matches!(validate_batch(&twice, &Limits::default()), Err(Error::InvalidInput(_))));
/// # Ok::<(), Error>(())
/// ```
pub fn validate_batch<'a>(
    messages: &'a [NewMessage],
    limits: &Limits,
) -> Result<Vec<ValidMessage<'a>>, Error> {
    let mut ids = std::collections::HashSet::with_capacity(messages.len());
    let mut dedup_keys = std::collections::HashSet::new();
    let mut valid = Vec::with_capacity(messages.len());
    for message in messages {
        let payload = message.validate(limits)?;
        if !ids.insert(message.id) {
            return Err(Error::invalid_input(format!(
                "message id {} appears twice in the batch; every message needs its own id \
                 (leave the generated one)",
                message.id
            )));
        }
        if let Some(key) = &message.dedup_key {
            if !dedup_keys.insert(key.as_str()) {
                return Err(Error::DuplicateKey { key: key.clone() });
            }
        }
        let headers = serde_json::to_string(&message.headers).map_err(|e| {
            Error::invalid_input(format!(
                "headers of message {} cannot be encoded as JSON: {e}",
                message.id
            ))
        })?;
        valid.push(ValidMessage {
            message,
            payload,
            headers,
        });
    }
    Ok(valid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize) -> Limits {
        Limits {
            max_payload_bytes: max,
        }
    }

    #[test]
    fn a_binary_payload_is_checked_and_stored_as_null_json() -> Result<(), Error> {
        let ok = NewMessage::binary(
            "order",
            "o-1",
            "placed",
            Binary::new("application/avro", [1u8, 0, 2]),
        );
        assert_eq!(ok.validate(&limits(3))?, "null");
        let too_big = NewMessage::binary(
            "order",
            "o-1",
            "placed",
            Binary::new("text/plain", [0u8; 4]),
        );
        let err = too_big
            .validate(&limits(3))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("4 bytes, over the limit of 3"), "{err}");
        let mut both = ok.clone();
        both.payload = serde_json::json!({"n": 1});
        let err = both
            .validate(&limits(3))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("both a binary and a JSON payload"), "{err}");
        Ok(())
    }

    #[test]
    fn content_types_are_checked() {
        for good in [
            "application/x-protobuf",
            "application/vnd.confluent.avro",
            "text/plain; charset=utf-8",
        ] {
            assert_eq!(validate_content_type(good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("", "empty"),
            ("   ", "empty"),
            ("protobuf", "type/subtype"),
            ("a/b/c", "type/subtype"),
            ("/x", "type/subtype"),
            ("text/plain\r\nx: y", "character"),
            ("text/plé", "character"),
        ] {
            let err = validate_content_type(bad).err().unwrap_or_default();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
        let long = format!("application/{}", "x".repeat(MAX_CONTENT_TYPE_BYTES));
        assert!(validate_content_type(&long).is_err());
    }

    #[test]
    fn a_message_s_body_is_its_bytes_or_its_json_text() {
        let mut message = Message {
            id: Uuid::nil(),
            seq: 1,
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            event_type: "placed".into(),
            payload: r#"{"n":1}"#.into(),
            binary: None,
            headers: BTreeMap::new(),
            partition_key: None,
            dedup_key: None,
            attempts: 0,
            created_at: Utc::now(),
        };
        assert_eq!(message.body(), br#"{"n":1}"#);
        assert_eq!(message.content_type(), JSON_CONTENT_TYPE);
        message.payload = "null".into();
        message.binary = Some(Binary::new("application/x-protobuf", [0u8, 0xff]));
        assert_eq!(message.body(), &[0u8, 0xff]);
        assert_eq!(message.content_type(), "application/x-protobuf");
        assert!(message.is_binary());
    }
}
