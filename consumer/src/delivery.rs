//! The decoded envelope of an outbox message, as the project's publishers write it: the
//! default envelope, or a CloudEvents event in binary or structured mode
//! ([`outbox_routing::envelope`]), told apart by the message itself.

use std::borrow::Cow;
use std::collections::BTreeMap;

use outbox_routing::envelope::{
    attribute_target, binary_attribute_name, decode_base64, decode_header_value,
    is_json_content_type, is_structured_content_type, AttributeTarget,
};
use outbox_routing::{
    HEADER_AGGREGATE_ID, HEADER_AGGREGATE_TYPE, HEADER_EVENT_TYPE, HEADER_MESSAGE_ID,
    HEADER_PARTITION_KEY, STANDARD_HEADER_NAMES,
};
use outbox_traits::{Binary, JSON_CONTENT_TYPE};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::handler::HandlerError;

/// One message handed to a [`Handler`](crate::Handler): the outbox envelope, decoded, plus where
/// the broker keeps it.
///
/// The fields are those `outbox-publisher-nats`, `outbox-publisher-kafka` and
/// `outbox-publisher-redis` write: the standard headers of [`outbox_routing::standard_headers`]
/// (NATS and Kafka) or the entry fields `id`, `event_type`, `aggregate_type`, `aggregate_id`,
/// `partition_key`, `payload` and `headers` (Redis); or, with `envelope=cloudevents` or
/// `envelope=cloudevents-structured` on the publisher, the CloudEvents attributes `id`, `type`,
/// `subject`, `aggregatetype`, `partitionkey`, extension attributes as headers, and `data`.
///
/// # Binary payloads
/// A message whose content type is not JSON (the `content-type` header, the Redis
/// `content_type` field, or the CloudEvent's `datacontenttype`; JSON is `application/json` or
/// any `+json` type, and a message without one is JSON) is a binary payload: [`Delivery::binary`]
/// holds its bytes, exactly as sent, and its content type, and [`Delivery::payload`] is `null`.
/// A structured CloudEvent's `data_base64` is decoded to those bytes. [`Delivery::body`] gives
/// the bytes of either kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    /// The outbox message id: stable across redeliveries and republishes. Deduplicate on it
    /// (e.g. with the `outbox-inbox` crate, in the handler's own transaction).
    pub message_id: Uuid,
    /// The event type, e.g. `order.placed`.
    pub event_type: String,
    /// The aggregate type, e.g. `order`.
    pub aggregate_type: String,
    /// The aggregate id, e.g. `order-42`.
    pub aggregate_id: String,
    /// The partition (ordering) key; `None` for an unordered message.
    pub partition_key: Option<String>,
    /// The user's headers (e.g. `traceparent`, `tenant`): every header that is not one of the
    /// standard ones above (nor NATS's own `Nats-Msg-Id`).
    pub headers: BTreeMap<String, String>,
    /// The JSON payload (`null` for a binary payload).
    pub payload: serde_json::Value,
    /// The binary payload (bytes and content type), for a message whose content type is not
    /// JSON; `None` for a JSON payload.
    pub binary: Option<Binary>,
    /// Where the broker keeps the message.
    pub source: Source,
    /// This consumer's attempt at the message, from 1: it grows by one for each handler error
    /// that counts toward [`RetryPolicy::max_attempts`](crate::RetryPolicy::max_attempts). It
    /// restarts at 1 when the broker redelivers the message to another consumer (or after a
    /// restart).
    pub attempt: u32,
}

impl Delivery {
    /// The payload deserialized as `T`. A payload of another shape, or a binary payload, gives
    /// a [permanent](crate::FailureKind::Permanent) [`HandlerError`]: retrying cannot fix it, so
    /// `?` in a handler sends the message to the dead letters.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, HandlerError> {
        if let Some(binary) = &self.binary {
            return Err(HandlerError::permanent(format!(
                "payload of message {} ({}) is binary ({}, {} bytes), not JSON; read it with \
                 Delivery::body",
                self.message_id,
                self.event_type,
                binary.content_type,
                binary.data.len()
            )));
        }
        T::deserialize(&self.payload).map_err(|e| {
            HandlerError::permanent(format!(
                "payload of message {} ({}) does not have the expected shape: {e}",
                self.message_id, self.event_type
            ))
        })
    }
}

impl Delivery {
    /// The body's bytes: a binary payload's, exactly as the broker delivered them, or the JSON
    /// payload as compact JSON text (re-encoded: not necessarily the sent bytes).
    pub fn body(&self) -> Cow<'_, [u8]> {
        match &self.binary {
            Some(binary) => Cow::Borrowed(&binary.data),
            None => Cow::Owned(self.payload.to_string().into_bytes()),
        }
    }

    /// The body's content type: a binary payload's, or `application/json`.
    pub fn content_type(&self) -> &str {
        match &self.binary {
            Some(binary) => &binary.content_type,
            None => JSON_CONTENT_TYPE,
        }
    }

    /// Whether the payload is binary ([`Delivery::binary`]).
    pub fn is_binary(&self) -> bool {
        self.binary.is_some()
    }
}

/// A decoded body: JSON, or a binary payload (then `json` is `null`).
struct Body {
    json: serde_json::Value,
    binary: Option<Binary>,
}

impl Body {
    fn json(json: serde_json::Value) -> Self {
        Self { json, binary: None }
    }

    fn binary(content_type: &str, data: Vec<u8>) -> Self {
        Self {
            json: serde_json::Value::Null,
            binary: Some(Binary::new(content_type, data)),
        }
    }
}

/// Where a broker keeps a [`Delivery`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// A NATS JetStream message.
    Nats {
        /// The stream.
        stream: String,
        /// The subject it was published on.
        subject: String,
        /// Its sequence in the stream.
        stream_sequence: u64,
        /// How many times JetStream has delivered it (1 on the first delivery).
        delivered: i64,
    },
    /// A Redis Streams entry.
    Redis {
        /// The stream key.
        stream: String,
        /// The entry id, e.g. `1700000000000-0`.
        entry_id: String,
    },
    /// A Kafka record.
    Kafka {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// The offset in the partition.
        offset: i64,
    },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Nats {
                stream,
                stream_sequence,
                ..
            } => write!(f, "NATS stream {stream} sequence {stream_sequence}"),
            Source::Redis { stream, entry_id } => {
                write!(f, "Redis stream {stream} entry {entry_id}")
            }
            Source::Kafka {
                topic,
                partition,
                offset,
            } => write!(
                f,
                "Kafka topic {topic} partition {partition} offset {offset}"
            ),
        }
    }
}

/// Why a message could not be decoded into a [`Delivery`]. Such a message is dead-lettered at
/// once with this text as its reason: it is never acknowledged silently, never retried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("undecodable message at {source_text}: {problem}")]
pub struct DecodeError {
    /// Where the message is.
    pub source_text: String,
    /// What is wrong with it.
    pub problem: String,
}

const STANDARD_NAMES: [&str; 5] = [
    HEADER_MESSAGE_ID,
    HEADER_EVENT_TYPE,
    HEADER_AGGREGATE_TYPE,
    HEADER_AGGREGATE_ID,
    HEADER_PARTITION_KEY,
];

/// The envelope's fields as read from a broker message, before they are checked.
#[derive(Debug, Default)]
pub(crate) struct RawEnvelope<'a> {
    pub message_id: Option<&'a [u8]>,
    pub event_type: Option<&'a [u8]>,
    pub aggregate_type: Option<&'a [u8]>,
    pub aggregate_id: Option<&'a [u8]>,
    pub partition_key: Option<&'a [u8]>,
    /// Non-standard headers, in the order the broker gave them (a later one of the same name
    /// wins).
    pub headers: Vec<(&'a str, &'a [u8])>,
    /// How the broker names the id, event type, aggregate type, aggregate id and partition key
    /// (for error messages); `None`: the standard header names.
    pub names: Option<[&'static str; 5]>,
    /// `ce_`/`ce-` prefixed headers (CloudEvents binary mode), as given.
    pub cloudevent: Vec<(&'a str, &'a [u8])>,
    /// The `content-type` header (Redis: the `content_type` field), as given.
    pub content_type: Option<(&'a str, &'a [u8])>,
}

/// The CloudEvents attribute names of the id, event type, aggregate type, aggregate id and
/// partition key (for error messages).
const CLOUDEVENT_NAMES: [&str; 5] = ["id", "type", "aggregatetype", "subject", "partitionkey"];

/// The Redis publisher's entry field names of the envelope.
pub(crate) const REDIS_FIELD_NAMES: [&str; 5] = [
    "id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "partition_key",
];

impl<'a> RawEnvelope<'a> {
    /// Sort one header of a header-carrying broker (NATS, Kafka) into the envelope. Names are
    /// compared ignoring ASCII case; `Nats-Msg-Id` is dropped (it repeats the message id).
    pub(crate) fn header(&mut self, name: &'a str, value: &'a [u8]) {
        if binary_attribute_name(name).is_some() {
            self.cloudevent.push((name, value));
            return;
        }
        if name.eq_ignore_ascii_case("content-type") {
            self.content_type = Some((name, value));
            return;
        }
        let slot = match STANDARD_HEADER_NAMES
            .iter()
            .find(|std| std.eq_ignore_ascii_case(name))
        {
            Some(&HEADER_MESSAGE_ID) => &mut self.message_id,
            Some(&HEADER_EVENT_TYPE) => &mut self.event_type,
            Some(&HEADER_AGGREGATE_TYPE) => &mut self.aggregate_type,
            Some(&HEADER_AGGREGATE_ID) => &mut self.aggregate_id,
            Some(&HEADER_PARTITION_KEY) => &mut self.partition_key,
            _ if name.eq_ignore_ascii_case("Nats-Msg-Id") => return,
            _ => {
                self.headers.push((name, value));
                return;
            }
        };
        if slot.is_none() {
            *slot = Some(value);
        }
    }

    /// Check every field and build the delivery: a CloudEvent when the message has no outbox
    /// id but a structured-mode `content-type` or a binary-mode `id` attribute, else the
    /// default envelope.
    pub(crate) fn decode(
        mut self,
        payload: &[u8],
        source: Source,
    ) -> Result<Delivery, DecodeError> {
        if self.message_id.is_none() {
            let structured = self
                .content_type
                .and_then(|(_, v)| std::str::from_utf8(v).ok())
                .is_some_and(is_structured_content_type);
            if structured {
                return self.structured(payload, source);
            }
            let has_id = self
                .cloudevent
                .iter()
                .any(|(n, _)| binary_attribute_name(n).is_some_and(|(a, _)| a == "id"));
            if has_id {
                return self.binary(payload, source);
            }
        }
        // Not a CloudEvent: any such headers were the user's own. The content type is the
        // body's (publishers leave out a user header of that name).
        let extra = std::mem::take(&mut self.cloudevent);
        self.headers.extend(extra);
        let content_type = self.content_type.take();
        // Without an id the message was not written by an outbox publisher: say so, rather
        // than what else is wrong with it (its payload, say).
        if self.message_id.is_none() {
            let [id_name, ..] = self.names.unwrap_or(STANDARD_NAMES);
            return Err(DecodeError {
                source_text: source.to_string(),
                problem: missing(id_name),
            });
        }
        let content_type = match content_type {
            Some((name, value)) => Some(std::str::from_utf8(value).map_err(|_| DecodeError {
                source_text: source.to_string(),
                problem: format!("{name:?} is not UTF-8 text"),
            })?),
            None => None,
        };
        let body = read_body(payload, content_type, &source)?;
        self.finish(body, source)
    }

    /// A CloudEvents binary-mode message: attributes in `ce_` (Kafka) or percent-encoded `ce-`
    /// (NATS, Redis) headers, the payload as the body.
    fn binary(self, payload: &[u8], source: Source) -> Result<Delivery, DecodeError> {
        let mut attributes = Vec::with_capacity(self.cloudevent.len());
        for (header, value) in &self.cloudevent {
            let Some((name, encoded)) = binary_attribute_name(header) else {
                continue;
            };
            let text = std::str::from_utf8(value).map_err(|_| DecodeError {
                source_text: source.to_string(),
                problem: format!("header {header:?} is not UTF-8 text"),
            })?;
            let text = if encoded {
                decode_header_value(text).map_err(|e| DecodeError {
                    source_text: source.to_string(),
                    problem: format!("header {header:?}: {e}"),
                })?
            } else {
                text.into()
            };
            attributes.push((name, text.into_owned()));
        }
        // `datacontenttype`: a `ce-` header on NATS, `content-type` on Kafka and Redis.
        let header_type = match self.content_type {
            Some((name, value)) => Some(std::str::from_utf8(value).map_err(|_| DecodeError {
                source_text: source.to_string(),
                problem: format!("header {name:?} is not UTF-8 text"),
            })?),
            None => None,
        };
        let content_type = attributes
            .iter()
            .find(|(name, _)| name == "datacontenttype")
            .map(|(_, value)| value.as_str())
            .or(header_type);
        let body = read_body(payload, content_type, &source)?;
        self.with_attributes(&attributes, body, source)
    }

    /// A CloudEvents structured-mode message: the body is the JSON event format.
    fn structured(self, body: &[u8], source: Source) -> Result<Delivery, DecodeError> {
        let fail = |problem: String| DecodeError {
            source_text: source.to_string(),
            problem,
        };
        let event: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
            .map_err(|e| fail(format!("structured CloudEvent is not a JSON object: {e}")))?;
        let mut data = None;
        let mut data_base64 = None;
        let mut attributes = Vec::with_capacity(event.len());
        for (name, value) in event {
            match name.as_str() {
                "data" => data = Some(value),
                "data_base64" => data_base64 = Some(value),
                _ => {
                    let text = match value {
                        serde_json::Value::String(text) => text,
                        other => other.to_string(),
                    };
                    attributes.push((name, text));
                }
            }
        }
        let content_type = attributes
            .iter()
            .find(|(name, _)| name == "datacontenttype")
            .map(|(_, value)| value.as_str());
        let body =
            match (data, data_base64) {
                (Some(_), Some(_)) => return Err(fail(
                    "the CloudEvent has both data and data_base64, which the JSON event format \
                     forbids"
                        .into(),
                )),
                // Binary data (JSON event format 3.1): the bytes, of `datacontenttype` (or
                // unknown: application/octet-stream).
                (None, Some(encoded)) => {
                    let text = encoded
                        .as_str()
                        .ok_or_else(|| fail("data_base64 is not a string".into()))?;
                    let bytes = decode_base64(text).map_err(fail)?;
                    Body::binary(content_type.unwrap_or("application/octet-stream"), bytes)
                }
                // Text of a non-JSON type (e.g. text/plain) is held as a JSON string: its bytes.
                (Some(serde_json::Value::String(text)), None)
                    if content_type.is_some_and(|t| !is_json_content_type(t)) =>
                {
                    Body::binary(content_type.unwrap_or_default(), text.into_bytes())
                }
                (Some(json), None) => Body::json(json),
                (None, None) => Body::json(serde_json::Value::Null),
            };
        self.with_attributes(&attributes, body, source)
    }

    /// Sort CloudEvents attributes into the envelope's fields and build the delivery. A user
    /// header sent beside the event stays a header; an outbox field the attributes lack is
    /// taken from a plain header or the record key (the Kafka key is the partition key).
    fn with_attributes(
        self,
        attributes: &[(String, String)],
        body: Body,
        source: Source,
    ) -> Result<Delivery, DecodeError> {
        let mut raw = RawEnvelope {
            partition_key: self.partition_key,
            headers: self.headers,
            names: Some(CLOUDEVENT_NAMES),
            ..RawEnvelope::default()
        };
        for (name, value) in attributes {
            let bytes = value.as_bytes();
            let value = Some(bytes);
            match attribute_target(name) {
                AttributeTarget::MessageId => raw.message_id = value,
                AttributeTarget::EventType => raw.event_type = value,
                AttributeTarget::AggregateType => raw.aggregate_type = value,
                AttributeTarget::AggregateId => raw.aggregate_id = value,
                AttributeTarget::PartitionKey => raw.partition_key = value,
                AttributeTarget::Envelope => {}
                AttributeTarget::Header => raw.headers.push((name.as_str(), bytes)),
            }
        }
        // CloudEvents forbids an empty subject: an empty aggregate id is sent without one.
        raw.aggregate_id.get_or_insert(b"");
        raw.finish(body, source)
    }

    fn finish(self, body: Body, source: Source) -> Result<Delivery, DecodeError> {
        let fail = |problem: String| DecodeError {
            source_text: source.to_string(),
            problem,
        };
        let text = |field: &str, value: Option<&[u8]>| -> Result<String, DecodeError> {
            let value = value.ok_or_else(|| fail(missing(field)))?;
            String::from_utf8(value.to_vec())
                .map_err(|_| fail(format!("{field:?} is not UTF-8 text")))
        };
        let [id_name, event_name, type_name, aggregate_name, key_name] =
            self.names.unwrap_or(STANDARD_NAMES);
        let id_text = text(id_name, self.message_id)?;
        let message_id = Uuid::parse_str(id_text.trim())
            .map_err(|e| fail(format!("{id_name:?} {id_text:?} is not a UUID: {e}")))?;
        let event_type = text(event_name, self.event_type)?;
        let aggregate_type = text(type_name, self.aggregate_type)?;
        let aggregate_id = text(aggregate_name, self.aggregate_id)?;
        let partition_key = match self.partition_key {
            Some(key) => Some(text(key_name, Some(key))?),
            None => None,
        };
        let mut headers = BTreeMap::new();
        for (name, value) in self.headers {
            let value = std::str::from_utf8(value)
                .map_err(|_| fail(format!("header {name:?} is not UTF-8 text")))?;
            headers.insert(name.to_owned(), value.to_owned());
        }
        Ok(Delivery {
            message_id,
            event_type,
            aggregate_type,
            aggregate_id,
            partition_key,
            headers,
            payload: body.json,
            binary: body.binary,
            source,
            attempt: 1,
        })
    }
}

/// The body as JSON when its content type is JSON or not given, else as a binary payload of
/// that type.
fn read_body(
    body: &[u8],
    content_type: Option<&str>,
    source: &Source,
) -> Result<Body, DecodeError> {
    match content_type {
        Some(content_type) if !is_json_content_type(content_type) => {
            Ok(Body::binary(content_type, body.to_vec()))
        }
        _ => serde_json::from_slice(body)
            .map(Body::json)
            .map_err(|e| DecodeError {
                source_text: source.to_string(),
                problem: format!("payload ({} bytes) is not JSON: {e}", body.len()),
            }),
    }
}

/// Decode the user headers of a Redis entry (the publisher's `headers` field: one JSON object of
/// strings).
pub(crate) fn json_headers(text: &[u8]) -> Result<Vec<(String, String)>, String> {
    let map: BTreeMap<String, String> = serde_json::from_slice(text)
        .map_err(|e| format!("field \"headers\" is not a JSON object of strings: {e}"))?;
    Ok(map.into_iter().collect())
}

/// The problem of a message without `field`, which every outbox publisher sends.
fn missing(field: &str) -> String {
    format!(
        "no {field:?}; outbox publishers always send it, so this message was not written by one \
         (or was altered)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> Source {
        Source::Kafka {
            topic: "t".into(),
            partition: 0,
            offset: 7,
        }
    }

    fn full(id: &str) -> RawEnvelope<'_> {
        let mut raw = RawEnvelope::default();
        raw.header("message-id", id.as_bytes());
        raw.header("event-type", b"order.placed");
        raw.header("aggregate-type", b"order");
        raw.header("aggregate-id", b"o-1");
        raw
    }

    #[test]
    fn decodes_standard_and_user_headers() {
        let id = Uuid::now_v7().to_string();
        let mut raw = full(&id);
        raw.header("Partition-Key", b"k");
        raw.header("Nats-Msg-Id", id.as_bytes());
        raw.header("traceparent", b"00-1-2-01");
        let d = raw.decode(br#"{"n":1}"#, source()).unwrap();
        assert_eq!(d.message_id.to_string(), id);
        assert_eq!(d.partition_key.as_deref(), Some("k"));
        assert_eq!(d.headers.len(), 1);
        assert_eq!(d.headers["traceparent"], "00-1-2-01");
        assert_eq!(d.payload, serde_json::json!({"n": 1}));
        assert_eq!(d.attempt, 1);
    }

    #[test]
    fn decodes_cloudevents_binary_and_structured() {
        let id = Uuid::now_v7().to_string();
        // Kafka binary: ce_ headers unencoded, the record key as a fallback partition key.
        let mut raw = RawEnvelope::default();
        raw.header("ce_specversion", b"1.0");
        raw.header("ce_id", id.as_bytes());
        raw.header("ce_type", b"order.placed");
        raw.header("ce_subject", b"o 1");
        raw.header("ce_aggregatetype", b"order");
        raw.header("ce_traceparent", b"00-1-2-01");
        raw.header("content-type", b"application/json");
        raw.header("X-Plain", b"p");
        raw.partition_key = Some(b"k");
        let d = raw.decode(br#"{"n":1}"#, source()).unwrap();
        assert_eq!(d.message_id.to_string(), id);
        assert_eq!(
            (d.event_type.as_str(), d.aggregate_type.as_str()),
            ("order.placed", "order")
        );
        assert_eq!(d.aggregate_id, "o 1");
        assert_eq!(d.partition_key.as_deref(), Some("k"));
        assert_eq!(d.headers.len(), 2);
        assert_eq!(d.headers["traceparent"], "00-1-2-01");
        assert_eq!(d.headers["X-Plain"], "p");
        assert_eq!(d.payload, serde_json::json!({"n": 1}));

        // NATS binary: ce- headers percent-encoded.
        let mut raw = RawEnvelope::default();
        raw.header("Nats-Msg-Id", id.as_bytes());
        raw.header("ce-id", id.as_bytes());
        raw.header("ce-type", b"order.placed");
        raw.header("ce-subject", b"o%201%E2%9C%93");
        raw.header("ce-aggregatetype", b"order");
        raw.header("ce-partitionkey", b"k%25");
        let d = raw.decode(b"[]", source()).unwrap();
        assert_eq!(d.aggregate_id, "o 1\u{2713}");
        assert_eq!(d.partition_key.as_deref(), Some("k%"));
        assert!(d.headers.is_empty());

        // Structured: the body is the event; data is the payload.
        let body = format!(
            r#"{{"specversion":"1.0","id":"{id}","source":"/outbox/order","type":"t",
               "subject":"o-2","aggregatetype":"order","tenant":"acme","data":{{"a":[1]}}}}"#
        );
        let mut raw = RawEnvelope::default();
        raw.header(
            "content-type",
            b"application/cloudevents+json; charset=UTF-8",
        );
        let d = raw.decode(body.as_bytes(), source()).unwrap();
        assert_eq!(d.message_id.to_string(), id);
        assert_eq!(d.aggregate_id, "o-2");
        assert_eq!(d.partition_key, None);
        assert_eq!(d.headers["tenant"], "acme");
        assert_eq!(d.payload, serde_json::json!({"a": [1]}));

        // A CloudEvent without an id is refused, naming the attribute.
        let mut raw = RawEnvelope::default();
        raw.header("content-type", b"application/cloudevents+json");
        let err = raw.decode(br#"{"type":"t"}"#, source()).unwrap_err();
        assert!(err.to_string().contains("no \"id\""), "{err}");

        // In the default envelope, user headers named like these stay headers; content-type
        // is the body's type, a JSON one as any message without it.
        let mut raw = full(&id);
        raw.header("ce_x", b"1");
        raw.header("Content-Type", b"application/json; charset=utf-8");
        let d = raw.decode(b"{}", source()).unwrap();
        assert_eq!(d.headers.len(), 1);
        assert_eq!(d.headers["ce_x"], "1");
        assert_eq!(d.payload, serde_json::json!({}));
        assert_eq!(d.binary, None);
    }

    /// Bytes that are not UTF-8 and hold a NUL.
    const BYTES: &[u8] = &[0x00, 0xff, 0xc3, 0x28, b'{', 0x80];

    #[test]
    fn decodes_binary_payloads_in_every_envelope() {
        let id = Uuid::now_v7().to_string();
        let check = |d: &Delivery| {
            let binary = d.binary.as_ref().expect("a binary payload");
            assert_eq!(binary.content_type, "application/x-protobuf");
            assert_eq!(binary.data, BYTES);
            assert_eq!(d.body().as_ref(), BYTES);
            assert_eq!(d.content_type(), "application/x-protobuf");
            assert!(d.is_binary());
            assert_eq!(d.payload, serde_json::Value::Null);
            assert_eq!(d.headers.len(), 0, "{:?}", d.headers);
            let err = d.payload_as::<serde_json::Value>().unwrap_err();
            assert!(err.to_string().contains("binary"), "{err}");
        };
        // Default envelope: content-type header, the bytes as the body.
        let mut raw = full(&id);
        raw.header("content-type", b"application/x-protobuf");
        check(&raw.decode(BYTES, source()).unwrap());
        // Kafka binary mode: content-type is datacontenttype.
        let mut raw = RawEnvelope::default();
        raw.header("ce_id", id.as_bytes());
        raw.header("ce_type", b"t");
        raw.header("ce_aggregatetype", b"order");
        raw.header("content-type", b"application/x-protobuf");
        check(&raw.decode(BYTES, source()).unwrap());
        // NATS binary mode: ce-datacontenttype, percent-encoded.
        let mut raw = RawEnvelope::default();
        raw.header("ce-id", id.as_bytes());
        raw.header("ce-type", b"t");
        raw.header("ce-aggregatetype", b"order");
        raw.header("ce-datacontenttype", b"application%2Fx-protobuf");
        check(&raw.decode(BYTES, source()).unwrap());
        // Structured: data_base64 (padded or not).
        for encoded in ["AP/DKHuA", "AP/DKHuA=="] {
            let body = format!(
                r#"{{"specversion":"1.0","id":"{id}","type":"t","aggregatetype":"order",
                   "datacontenttype":"application/x-protobuf","data_base64":"{encoded}"}}"#
            );
            let mut raw = RawEnvelope::default();
            raw.header("content-type", b"application/cloudevents+json");
            check(&raw.decode(body.as_bytes(), source()).unwrap());
        }
        // Structured text data of a non-JSON type: its bytes.
        let body = format!(
            r#"{{"id":"{id}","type":"t","aggregatetype":"order","datacontenttype":"text/plain",
               "data":"hé"}}"#
        );
        let mut raw = RawEnvelope::default();
        raw.header("content-type", b"application/cloudevents+json");
        let d = raw.decode(body.as_bytes(), source()).unwrap();
        assert_eq!(d.body().as_ref(), "h\u{e9}".as_bytes());
        assert_eq!(d.content_type(), "text/plain");
        // Bad base64, or data beside data_base64: refused.
        for extra in [r#""data_base64":"!!""#, r#""data_base64":"AA==","data":1"#] {
            let body = format!(r#"{{"id":"{id}","type":"t","aggregatetype":"o",{extra}}}"#);
            let mut raw = RawEnvelope::default();
            raw.header("content-type", b"application/cloudevents+json");
            assert!(raw.decode(body.as_bytes(), source()).is_err());
        }
        // A JSON message's body() is its JSON text.
        let d = full(&id).decode(br#"{"n": 1}"#, source()).unwrap();
        assert_eq!(d.body().as_ref(), br#"{"n":1}"#);
        assert_eq!(d.content_type(), "application/json");
        assert!(!d.is_binary());
    }

    #[test]
    fn refuses_what_a_publisher_never_writes() {
        let cases: Vec<(RawEnvelope<'_>, &[u8], &str)> = vec![
            (full("not-a-uuid"), b"{}", "not a UUID"),
            (RawEnvelope::default(), b"{}", "no \"message-id\""),
            (
                full("0190b6e4-8f4e-7c2a-9a4e-0b8f6a1d2c3e"),
                b"{oops",
                "not JSON",
            ),
        ];
        for (raw, payload, expected) in cases {
            let err = raw.decode(payload, source()).unwrap_err();
            assert!(err.to_string().contains(expected), "{err}");
            assert!(err.to_string().contains("offset 7"), "{err}");
        }
        assert!(json_headers(b"[1]").is_err());
        assert_eq!(
            json_headers(br#"{"a":"b"}"#).unwrap(),
            vec![("a".to_string(), "b".to_string())]
        );
    }
}
