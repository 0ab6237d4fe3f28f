//! The envelope a publisher wraps each message in: the project's own headers (the default), or a
//! [CloudEvents 1.0](https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/spec.md) event
//! in binary or structured content mode.
//!
//! Everything about CloudEvents is decided here, once: which attributes a message becomes, how
//! each protocol binding names and encodes them, the structured (JSON event format) body, and
//! how a consumer maps the attributes back. The publishers only put the resulting headers (or
//! Redis entry fields) and body on the wire.
//!
//! # The attributes
//!
//! | attribute | value |
//! |---|---|
//! | `specversion` | `1.0` |
//! | `id` | the message id (UUID, hyphenated) |
//! | `source` | the `ce_source` template rendered for the message; default [`DEFAULT_CE_SOURCE`] (`/outbox/{aggregate_type}`) |
//! | `type` | the event type |
//! | `subject` | the aggregate id (left out when empty, which CloudEvents forbids) |
//! | `time` | when the message was enqueued (the store's clock, RFC 3339 in UTC) |
//! | `datacontenttype` | `application/json`, or a binary payload's content type |
//! | `partitionkey` | the partition key, when the message has one (the Partitioning extension) |
//! | `aggregatetype` | the aggregate type (this project's extension, so that a consumer gets every field back) |
//! | any other | each user header whose name is a valid extension name (`a-z`, `0-9`, at most 20) and not one of the above, e.g. `traceparent` and `tracestate` (Distributed Tracing extension) or `tenant` |
//!
//! A user header that cannot be an extension attribute (upper case, `-`, longer than 20, or a
//! name above such as `source`) travels beside the event as a plain header under its own name
//! (Kafka, NATS), or in the entry's `headers` field (Redis). `traceparent` and `tracestate` are
//! also sent as plain headers on Kafka and NATS, where tracing instrumentation looks for them.
//! A user header named like a standard outbox header, `content-type`, or with a `ce-`/`ce_`
//! prefix is left out, as a forged `message-id` is in the default envelope.
//!
//! # Per broker
//!
//! - **Kafka** (Kafka protocol binding): binary mode puts each attribute in a `ce_` header
//!   (UTF-8, unencoded) and `datacontenttype` in `content-type`, the payload as the record's
//!   value; structured mode sends `content-type: application/cloudevents+json` and the whole
//!   event as the value. In both modes the record key stays the partition key.
//! - **NATS** (NATS protocol binding, 1.0.3): binary mode puts every attribute, including
//!   `datacontenttype`, in a `ce-` header whose value is percent-encoded as the binding says;
//!   structured mode sends `content-type: application/cloudevents+json`. `Nats-Msg-Id` (the
//!   message id, JetStream's dedup) is sent in every mode.
//! - **Redis Streams** (no official binding): the HTTP binding's header rules applied to the
//!   entry's fields, the body in a `data` field, as Dapr's Redis Streams component does. Binary
//!   mode: `ce-` fields (percent-encoded), `content-type` = `datacontenttype` (not encoded, as
//!   HTTP's `Content-Type`), `data` = the payload. Structured mode: `content-type:
//!   application/cloudevents+json` and `data` = the event. Any SDK's HTTP binding reads an
//!   entry given its fields as headers and `data` as the body.
//!
//! # Binary payloads
//!
//! A message with a binary payload ([`outbox_traits::Binary`]) is sent the same way with its
//! bytes in place of the JSON text: in the default envelope and in binary mode the body is the
//! bytes, untouched, and `content-type` (NATS binary mode: `ce-datacontenttype`) is their content
//! type. In structured mode the event carries them base64-encoded in `data_base64` (the JSON
//! event format, section 3.1) instead of `data`, with `datacontenttype` = their content type.

use std::borrow::Cow;

use base64::Engine as _;

use outbox_traits::chrono::SecondsFormat;
use outbox_traits::{Error, Message};
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};

use crate::headers::STANDARD_HEADER_NAMES;
use crate::template::RoutingTemplate;

/// The URL query options of every broker URL that select and shape the envelope.
pub const ENVELOPE_URL_OPTIONS: &[&str] = &["envelope", "ce_source"];

/// The `source` attribute's template when `ce_source` is not given: the aggregate type under
/// `/outbox/`, e.g. `/outbox/order`. It names the kind of aggregate the event comes from without
/// tying consumers to a host name or service name.
pub const DEFAULT_CE_SOURCE: &str = "/outbox/{aggregate_type}";

/// The media type of a structured-mode event in the JSON event format.
pub const CLOUDEVENTS_JSON: &str = "application/cloudevents+json";

/// The `datacontenttype` of an event with a JSON payload (a binary payload's is its own
/// content type).
pub const DATA_CONTENT_TYPE: &str = "application/json";

/// The CloudEvents version sent.
pub const SPEC_VERSION: &str = "1.0";

/// The extension attribute carrying the aggregate type.
pub const ATTR_AGGREGATE_TYPE: &str = "aggregatetype";

/// The Partitioning extension's attribute carrying the partition key.
pub const ATTR_PARTITION_KEY: &str = "partitionkey";

/// Attribute names a user header cannot take as an extension: the spec's own and the two this
/// envelope sets itself.
const RESERVED_ATTRIBUTES: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
    ATTR_PARTITION_KEY,
    ATTR_AGGREGATE_TYPE,
];

/// User headers that are also sent as plain protocol headers on Kafka and NATS, for tracing
/// instrumentation that reads the W3C Trace Context headers.
const TRACE_HEADERS: &[&str] = &["traceparent", "tracestate"];

/// What NATS and HTTP-style header values percent-encode (NATS binding 3.1.3.2): space, `"`,
/// `%`, controls, and (always, by `utf8_percent_encode`) every non-ASCII character.
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// What a field value inserted into the `source` URI-reference percent-encodes: everything but
/// RFC 3986's unreserved characters.
const URI_VALUE: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'!')
    .add(b'"')
    .add(b'#')
    .add(b'$')
    .add(b'%')
    .add(b'&')
    .add(b'\'')
    .add(b'(')
    .add(b')')
    .add(b'*')
    .add(b'+')
    .add(b',')
    .add(b'/')
    .add(b':')
    .add(b';')
    .add(b'<')
    .add(b'=')
    .add(b'>')
    .add(b'?')
    .add(b'@')
    .add(b'[')
    .add(b'\\')
    .add(b']')
    .add(b'^')
    .add(b'`')
    .add(b'{')
    .add(b'|')
    .add(b'}');

/// Which envelope a publisher sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EnvelopeMode {
    /// The project's own headers ([`standard_headers`](crate::standard_headers)) and the
    /// payload as the body: `envelope=outbox`, the default.
    #[default]
    Outbox,
    /// CloudEvents binary content mode: `envelope=cloudevents`.
    CloudEvents,
    /// CloudEvents structured content mode (JSON event format): `envelope=cloudevents-structured`.
    CloudEventsStructured,
}

impl EnvelopeMode {
    /// The names accepted by `envelope=`.
    pub const NAMES: &'static [&'static str] = &["outbox", "cloudevents", "cloudevents-structured"];

    /// The mode named `name` (one of [`EnvelopeMode::NAMES`]).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the valid choices.
    pub fn parse(name: &str) -> Result<Self, Error> {
        match name {
            "outbox" => Ok(Self::Outbox),
            "cloudevents" => Ok(Self::CloudEvents),
            "cloudevents-structured" => Ok(Self::CloudEventsStructured),
            other => Err(Error::invalid_input(format!(
                "unknown envelope {other:?}; valid envelopes: {}",
                Self::NAMES.join(", ")
            ))),
        }
    }

    /// The name `envelope=` takes for this mode.
    pub fn name(self) -> &'static str {
        match self {
            Self::Outbox => "outbox",
            Self::CloudEvents => "cloudevents",
            Self::CloudEventsStructured => "cloudevents-structured",
        }
    }
}

/// A protocol binding: how CloudEvents attributes become headers on one kind of broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// Kafka: `ce_` headers, unencoded UTF-8; `datacontenttype` as `content-type`.
    Kafka,
    /// NATS: `ce-` headers, percent-encoded; `datacontenttype` as `ce-datacontenttype`.
    Nats,
    /// Redis Streams entry fields, by the HTTP binding's rules: `ce-` fields, percent-encoded;
    /// `datacontenttype` as `content-type`, unencoded.
    Redis,
}

/// The envelope a publisher sends each message in, with its options. The default is
/// [`EnvelopeMode::Outbox`], today's headers.
///
/// ```
/// use outbox_routing::{Envelope, EnvelopeMode};
/// let mut envelope = Envelope::default();
/// assert!(envelope.set_url_option("envelope", "cloudevents").unwrap());
/// assert!(envelope.set_url_option("ce_source", "/orders-service").unwrap());
/// assert!(!envelope.set_url_option("topic", "x").unwrap()); // not an envelope option
/// envelope.validate().unwrap();
/// assert_eq!(envelope.mode(), EnvelopeMode::CloudEvents);
/// assert!(envelope.set_url_option("envelope", "avro").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Envelope {
    mode: EnvelopeMode,
    source: Option<RoutingTemplate>,
}

/// The headers (or Redis entry fields) of one message in a CloudEvents envelope.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CloudEventHeaders<'m> {
    /// The binding's own headers: the `ce` attributes and `content-type` (binary mode), or
    /// `content-type: application/cloudevents+json` (structured mode). Names and values are
    /// ready to send (prefixed, and percent-encoded where the binding says so).
    pub protocol: Vec<(String, String)>,
    /// User headers sent beside the event under their own names, unencoded: those that cannot
    /// be extension attributes, plus (Kafka, NATS) `traceparent` and `tracestate`.
    pub passthrough: Vec<(&'m str, &'m str)>,
}

impl Envelope {
    /// An envelope of `mode` with the default `source` template ([`DEFAULT_CE_SOURCE`]).
    pub fn new(mode: EnvelopeMode) -> Self {
        Self { mode, source: None }
    }

    /// Use `template` for the `source` attribute, e.g. `/orders-service` or
    /// `https://example.com/{aggregate_type}` (placeholders as in [`RoutingTemplate`]; values
    /// are percent-encoded into it).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a malformed template or one whose text cannot be part of a
    /// URI-reference (spaces, control characters, `"<>\^`|`).
    pub fn with_source(mut self, template: &str) -> Result<Self, Error> {
        let parsed = RoutingTemplate::parse(template)?;
        if let Some(bad) = template
            .chars()
            .find(|c| c.is_whitespace() || c.is_control() || "\"<>\\^`|".contains(*c))
        {
            return Err(Error::invalid_input(format!(
                "ce_source {template:?} has {bad:?}, which a URI-reference cannot hold; give a \
                 URI-reference such as /orders-service or https://example.com/orders"
            )));
        }
        self.source = Some(parsed);
        Ok(self)
    }

    /// The mode.
    pub fn mode(&self) -> EnvelopeMode {
        self.mode
    }

    /// Whether this is one of the CloudEvents modes.
    pub fn is_cloudevents(&self) -> bool {
        self.mode != EnvelopeMode::Outbox
    }

    /// The `source` template in use (the given one, or [`DEFAULT_CE_SOURCE`]).
    pub fn source_template(&self) -> &str {
        self.source
            .as_ref()
            .map_or(DEFAULT_CE_SOURCE, RoutingTemplate::as_str)
    }

    /// Take the broker URL option `key=value` if it is one of [`ENVELOPE_URL_OPTIONS`]:
    /// `envelope` (one of [`EnvelopeMode::NAMES`]) or `ce_source` (see
    /// [`Envelope::with_source`]). Returns whether the key was an envelope option. Call
    /// [`Envelope::validate`] once every option is read.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an unknown envelope or a bad `ce_source`.
    pub fn set_url_option(&mut self, key: &str, value: &str) -> Result<bool, Error> {
        match key {
            "envelope" => self.mode = EnvelopeMode::parse(value)?,
            "ce_source" => *self = std::mem::take(self).with_source(value)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Check that the options fit together: `ce_source` only with a CloudEvents envelope.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] saying what to change.
    pub fn validate(&self) -> Result<(), Error> {
        if self.source.is_some() && !self.is_cloudevents() {
            return Err(Error::invalid_input(
                "ce_source is set but the envelope is not CloudEvents; add \
                 envelope=cloudevents (or envelope=cloudevents-structured), or drop ce_source",
            ));
        }
        Ok(())
    }

    /// The `source` attribute of `msg`.
    pub fn source(&self, msg: &Message) -> String {
        match &self.source {
            Some(template) => template.render_with(msg, encode_uri_value),
            None => format!("/outbox/{}", encode_uri_value(&msg.aggregate_type).as_ref()),
        }
    }

    /// The CloudEvents attributes of `msg` (names unprefixed, values unencoded), in the order
    /// they are sent: the table of the [module documentation](self), extensions from user
    /// headers in name order.
    pub fn attributes<'m>(&self, msg: &'m Message) -> Vec<(Cow<'m, str>, Cow<'m, str>)> {
        let mut attributes: Vec<(Cow<'m, str>, Cow<'m, str>)> =
            Vec::with_capacity(9 + msg.headers.len());
        let mut push = |name: &'static str, value: Cow<'m, str>| {
            attributes.push((Cow::Borrowed(name), value));
        };
        push("specversion", Cow::Borrowed(SPEC_VERSION));
        push("id", Cow::Owned(msg.id.hyphenated().to_string()));
        push("source", Cow::Owned(self.source(msg)));
        push("type", Cow::Borrowed(&msg.event_type));
        if !msg.aggregate_id.is_empty() {
            push("subject", Cow::Borrowed(&msg.aggregate_id));
        }
        push(
            "time",
            Cow::Owned(msg.created_at.to_rfc3339_opts(SecondsFormat::AutoSi, true)),
        );
        push("datacontenttype", Cow::Borrowed(msg.content_type()));
        if let Some(key) = msg.partition_key.as_deref() {
            push(ATTR_PARTITION_KEY, Cow::Borrowed(key));
        }
        push(ATTR_AGGREGATE_TYPE, Cow::Borrowed(&msg.aggregate_type));
        for (name, value) in user_headers(msg) {
            if is_extension_name(name) {
                attributes.push((Cow::Borrowed(name), Cow::Borrowed(value)));
            }
        }
        attributes
    }

    /// The headers (Redis: entry fields) to send `msg` with under `binding`, in this envelope's
    /// CloudEvents mode. For the default envelope, use
    /// [`standard_headers`](crate::standard_headers) instead: this returns none.
    pub fn headers<'m>(&self, msg: &'m Message, binding: Binding) -> CloudEventHeaders<'m> {
        let mut protocol = Vec::new();
        match self.mode {
            EnvelopeMode::Outbox => return CloudEventHeaders::default(),
            EnvelopeMode::CloudEvents => {
                for (name, value) in self.attributes(msg) {
                    let header = match (binding, name.as_ref()) {
                        (Binding::Kafka | Binding::Redis, "datacontenttype") => {
                            "content-type".to_owned()
                        }
                        (Binding::Kafka, _) => format!("ce_{name}"),
                        (Binding::Nats | Binding::Redis, _) => format!("ce-{name}"),
                    };
                    // HTTP (and so Redis) maps `datacontenttype` to a plain `Content-Type`,
                    // which is not percent-encoded (a checked content type is printable ASCII).
                    let value = match (binding, name.as_ref()) {
                        (Binding::Kafka, _) | (Binding::Redis, "datacontenttype") => {
                            value.into_owned()
                        }
                        (Binding::Nats | Binding::Redis, _) => {
                            encode_header_value(&value).into_owned()
                        }
                    };
                    protocol.push((header, value));
                }
            }
            EnvelopeMode::CloudEventsStructured => {
                protocol.push(("content-type".to_owned(), CLOUDEVENTS_JSON.to_owned()));
            }
        }
        let passthrough = user_headers(msg)
            .filter(|(name, _)| {
                !is_extension_name(name)
                    || (binding != Binding::Redis && TRACE_HEADERS.contains(name))
            })
            .collect();
        CloudEventHeaders {
            protocol,
            passthrough,
        }
    }

    /// The message body: the payload itself (default envelope, binary mode: the JSON text or a
    /// binary payload's bytes, see [`Message::body`]), or the whole event in the JSON event
    /// format (structured mode), with a JSON payload embedded as `data` exactly as stored and a
    /// binary one base64-encoded as `data_base64`.
    pub fn body<'m>(&self, msg: &'m Message) -> Cow<'m, [u8]> {
        if self.mode != EnvelopeMode::CloudEventsStructured {
            return Cow::Borrowed(msg.body());
        }
        let attributes = self.attributes(msg);
        let data_len = match &msg.binary {
            Some(binary) => binary.data.len().div_ceil(3) * 4,
            None => msg.payload.len(),
        };
        let mut out = String::with_capacity(data_len + 64 * attributes.len() + 24);
        out.push('{');
        for (name, value) in &attributes {
            push_json_string(&mut out, name);
            out.push(':');
            push_json_string(&mut out, value);
            out.push(',');
        }
        match &msg.binary {
            Some(binary) => {
                // Standard alphabet with padding: the JSON event format's `Binary` type.
                out.push_str("\"data_base64\":\"");
                base64::engine::general_purpose::STANDARD.encode_string(&binary.data, &mut out);
                out.push('"');
            }
            None => {
                out.push_str("\"data\":");
                // The store holds JSON (a json/jsonb column or a checked text column): embedded
                // as is, byte for byte, as the default envelope sends it.
                out.push_str(&msg.payload);
            }
        }
        out.push('}');
        Cow::Owned(out.into_bytes())
    }
}

/// The user headers that any envelope may carry: not a standard outbox header, not
/// `content-type`, not `ce-`/`ce_` prefixed (names compared ignoring ASCII case).
fn user_headers(msg: &Message) -> impl Iterator<Item = (&str, &str)> {
    msg.headers
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .filter(|(name, _)| {
            let lower = name.to_ascii_lowercase();
            !(STANDARD_HEADER_NAMES.contains(&lower.as_str())
                || lower == "content-type"
                || lower.starts_with("ce-")
                || lower.starts_with("ce_"))
        })
}

/// Whether `name` can be an extension attribute: 1 to 20 lower-case ASCII letters or digits,
/// and not a name the spec or this envelope uses itself.
pub fn is_extension_name(name: &str) -> bool {
    (1..=20).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && !RESERVED_ATTRIBUTES.contains(&name)
}

/// Percent-encode an attribute value for a NATS (or HTTP-style) header, as the NATS binding's
/// section 3.1.3.2 says.
pub fn encode_header_value(value: &str) -> Cow<'_, str> {
    utf8_percent_encode(value, HEADER_VALUE).into()
}

/// Undo [`encode_header_value`] (any percent-encoding, upper or lower case hex).
///
/// # Errors
/// A message saying why when the decoded bytes are not UTF-8.
pub fn decode_header_value(value: &str) -> Result<Cow<'_, str>, String> {
    percent_decode_str(value)
        .decode_utf8()
        .map_err(|e| format!("percent-encoded value is not UTF-8: {e}"))
}

fn encode_uri_value(value: &str) -> Cow<'_, str> {
    utf8_percent_encode(value, URI_VALUE).into()
}

/// Append `text` as a JSON string.
fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                out.push_str(&format!("\\u{:04x}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Where a consumer puts a CloudEvents attribute read back from a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttributeTarget {
    /// `id`: the message id.
    MessageId,
    /// `type`: the event type.
    EventType,
    /// `subject`: the aggregate id.
    AggregateId,
    /// `aggregatetype`: the aggregate type.
    AggregateType,
    /// `partitionkey`: the partition key.
    PartitionKey,
    /// An attribute the outbox fields do not hold (`specversion`, `source`, `time`,
    /// `datacontenttype`, `dataschema`, `data`).
    Envelope,
    /// An extension attribute: a user header of the same name.
    Header,
}

/// Where a consumer puts the attribute `name` (lower case, unprefixed).
pub fn attribute_target(name: &str) -> AttributeTarget {
    match name {
        "id" => AttributeTarget::MessageId,
        "type" => AttributeTarget::EventType,
        "subject" => AttributeTarget::AggregateId,
        ATTR_AGGREGATE_TYPE => AttributeTarget::AggregateType,
        ATTR_PARTITION_KEY => AttributeTarget::PartitionKey,
        "specversion" | "source" | "time" | "datacontenttype" | "dataschema" | "data"
        | "data_base64" => AttributeTarget::Envelope,
        _ => AttributeTarget::Header,
    }
}

/// The attribute name of a binary-mode header, and whether its value is percent-encoded: a
/// `ce_` header (Kafka: unencoded) or a `ce-` header (NATS, Redis: encoded), case ignored.
pub fn binary_attribute_name(header: &str) -> Option<(String, bool)> {
    let prefix = header.get(..3)?;
    let encoded = if prefix.eq_ignore_ascii_case("ce_") {
        false
    } else if prefix.eq_ignore_ascii_case("ce-") {
        true
    } else {
        return None;
    };
    let name = header[3..].to_ascii_lowercase();
    (!name.is_empty()).then_some((name, encoded))
}

/// Whether a content type is JSON: `application/json` or any `+json` suffix (parameters and
/// case ignored). A consumer reads such a body as JSON and any other as a binary payload.
///
/// ```
/// use outbox_routing::envelope::is_json_content_type;
/// assert!(is_json_content_type("Application/JSON; charset=utf-8"));
/// assert!(is_json_content_type("application/vnd.acme+json"));
/// assert!(!is_json_content_type("application/x-protobuf"));
/// ```
pub fn is_json_content_type(value: &str) -> bool {
    let media = value.split(';').next().unwrap_or_default().trim();
    media.eq_ignore_ascii_case("application/json")
        || media
            .len()
            .checked_sub(5)
            .and_then(|start| media.get(start..))
            .is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json"))
}

/// Decode a structured event's `data_base64` (standard alphabet; padding optional, as some
/// SDKs leave it out).
///
/// # Errors
/// A message saying why the text is not base64.
pub fn decode_base64(text: &str) -> Result<Vec<u8>, String> {
    let trimmed = text.trim_end_matches('=');
    base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(trimmed)
        .map_err(|e| format!("data_base64 is not base64: {e}"))
}

/// Whether a `content-type` value marks a structured-mode event (`application/cloudevents`,
/// any format suffix and parameters, case ignored).
pub fn is_structured_content_type(value: &str) -> bool {
    value
        .trim_start()
        .get(..23)
        .is_some_and(|p| p.eq_ignore_ascii_case("application/cloudevents"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests_support::message;

    fn envelope(mode: EnvelopeMode) -> Envelope {
        Envelope::new(mode)
    }

    #[test]
    fn options_parse_and_validate() {
        let mut e = Envelope::default();
        assert_eq!(e.mode(), EnvelopeMode::Outbox);
        assert!(e
            .set_url_option("envelope", "cloudevents-structured")
            .unwrap());
        assert_eq!(e.mode(), EnvelopeMode::CloudEventsStructured);
        let err = e.set_url_option("envelope", "cloudevent").unwrap_err();
        assert!(err.to_string().contains("cloudevents-structured"), "{err}");
        assert!(e.set_url_option("ce_source", "/a b").is_err());
        assert!(e.set_url_option("ce_source", "/x/{nope}").is_err());
        let mut plain = Envelope::default();
        plain.set_url_option("ce_source", "/svc").unwrap();
        assert!(plain.validate().is_err());
    }

    #[test]
    fn attributes_of_a_message() {
        let mut msg = message();
        msg.headers
            .insert("traceparent".into(), "00-ab-cd-01".into());
        msg.headers.insert("X-Request-Id".into(), "r1".into());
        msg.headers.insert("source".into(), "forged".into());
        msg.headers.insert("Message-Id".into(), "forged".into());
        msg.headers.insert("ce-id".into(), "forged".into());
        let e = envelope(EnvelopeMode::CloudEvents);
        let attrs: Vec<(String, String)> = e
            .attributes(&msg)
            .into_iter()
            .map(|(n, v)| (n.into_owned(), v.into_owned()))
            .collect();
        let get = |n: &str| attrs.iter().find(|(a, _)| a == n).map(|(_, v)| v.as_str());
        assert_eq!(get("id"), Some(msg.id.to_string().as_str()));
        assert_eq!(get("source"), Some("/outbox/order"));
        assert_eq!(get("type"), Some("order.placed"));
        assert_eq!(get("subject"), Some("order-42"));
        assert_eq!(get("partitionkey"), Some("key-1"));
        assert_eq!(get("aggregatetype"), Some("order"));
        assert_eq!(get("traceparent"), Some("00-ab-cd-01"));
        assert_eq!(get("x-request-id"), None);
        assert_eq!(attrs.iter().filter(|(n, _)| n == "source").count(), 1);

        let h = e.headers(&msg, Binding::Kafka);
        assert!(h.protocol.contains(&("ce_id".into(), msg.id.to_string())));
        assert!(h
            .protocol
            .contains(&("content-type".into(), "application/json".into())));
        // Plain: the headers that cannot be extensions, and the trace headers again.
        let mut passthrough = h.passthrough.clone();
        passthrough.sort_unstable();
        assert_eq!(
            passthrough,
            [
                ("X-Request-Id", "r1"),
                ("source", "forged"),
                ("traceparent", "00-ab-cd-01")
            ]
        );
        let redis = e.headers(&msg, Binding::Redis);
        assert!(!redis.passthrough.iter().any(|(n, _)| *n == "traceparent"));
        let nats = e.headers(&msg, Binding::Nats);
        assert!(nats
            .protocol
            .contains(&("ce-datacontenttype".into(), "application/json".into())));
        assert!(!nats.protocol.iter().any(|(n, _)| n == "content-type"));
    }

    #[test]
    fn nats_values_are_percent_encoded_and_decode_back() {
        let text = "Euro \u{20ac} \u{1f600} \"q\" 100%";
        let encoded = encode_header_value(text);
        assert_eq!(
            encoded,
            "Euro%20%E2%82%AC%20%F0%9F%98%80%20%22q%22%20100%25"
        );
        assert_eq!(decode_header_value(&encoded).unwrap(), text);
        assert!(decode_header_value("%C0%A0").is_err());
    }

    #[test]
    fn structured_body_is_json_with_the_payload_as_data() {
        let mut msg = message();
        msg.payload = r#"{"n":1,"s":"a\"b"}"#.into();
        msg.aggregate_type = "or der/x".into();
        msg.headers.insert("tenant".into(), "ac\"me\n".into());
        let e = envelope(EnvelopeMode::CloudEventsStructured)
            .with_source("https://example.com/{aggregate_type}")
            .unwrap();
        let body = String::from_utf8(e.body(&msg).into_owned()).unwrap();
        assert!(body.ends_with(r#""data":{"n":1,"s":"a\"b"}}"#), "{body}");
        assert!(body.contains(r#""source":"https://example.com/or%20der%2Fx""#));
        assert!(body.contains(r#""tenant":"ac\"me\n""#));
        let h = e.headers(&msg, Binding::Kafka);
        assert_eq!(
            h.protocol,
            [("content-type".to_string(), CLOUDEVENTS_JSON.to_string())]
        );
        assert_eq!(
            envelope(EnvelopeMode::CloudEvents).body(&msg).as_ref(),
            msg.payload.as_bytes()
        );
    }

    #[test]
    fn binary_payloads_in_every_mode() {
        let mut msg = message();
        msg.payload = "null".into();
        let bytes = vec![0u8, 0xff, 0xc3, 0x28, b'"', b'\n', 0x80];
        msg.binary = Some(outbox_traits::Binary::new(
            "application/x-protobuf",
            bytes.clone(),
        ));
        // Default envelope and binary mode: the bytes as they are.
        assert_eq!(envelope(EnvelopeMode::Outbox).body(&msg).as_ref(), bytes);
        let binary = envelope(EnvelopeMode::CloudEvents);
        assert_eq!(binary.body(&msg).as_ref(), bytes);
        let kafka = binary.headers(&msg, Binding::Kafka);
        assert!(kafka
            .protocol
            .contains(&("content-type".into(), "application/x-protobuf".into())));
        let nats = binary.headers(&msg, Binding::Nats);
        assert!(nats
            .protocol
            .contains(&("ce-datacontenttype".into(), "application/x-protobuf".into())));
        // Parameters: percent-encoded in a NATS ce- header, not in a Redis content-type.
        let mut text = msg.clone();
        text.binary = Some(outbox_traits::Binary::new(
            "text/plain; charset=utf-8",
            bytes.clone(),
        ));
        assert!(binary.headers(&text, Binding::Nats).protocol.contains(&(
            "ce-datacontenttype".into(),
            "text/plain;%20charset=utf-8".into()
        )));
        assert!(binary
            .headers(&text, Binding::Redis)
            .protocol
            .contains(&("content-type".into(), "text/plain; charset=utf-8".into())));
        // Structured: data_base64 and the content type, no data.
        let structured = envelope(EnvelopeMode::CloudEventsStructured).body(&msg);
        let event: std::collections::BTreeMap<String, String> =
            serde_json::from_slice(&structured).unwrap();
        assert_eq!(event["datacontenttype"], "application/x-protobuf");
        assert_eq!(decode_base64(&event["data_base64"]).unwrap(), bytes);
        assert!(!event.contains_key("data"));
        assert!(decode_base64("AP/DKCIKgA").unwrap() == bytes);
        assert!(decode_base64("not base64!").is_err());
    }

    #[test]
    fn json_content_types() {
        assert!(is_json_content_type("application/json"));
        assert!(is_json_content_type(" application/cloudevents+json "));
        assert!(!is_json_content_type("text/plain"));
        assert!(!is_json_content_type("json"));
        assert!(!is_json_content_type("application/jsonx"));
    }

    #[test]
    fn consumer_side_names() {
        assert_eq!(binary_attribute_name("ce_id"), Some(("id".into(), false)));
        assert_eq!(
            binary_attribute_name("CE-Type"),
            Some(("type".into(), true))
        );
        assert_eq!(binary_attribute_name("content-type"), None);
        assert_eq!(binary_attribute_name("ce-"), None);
        assert_eq!(attribute_target("subject"), AttributeTarget::AggregateId);
        assert_eq!(attribute_target("tenant"), AttributeTarget::Header);
        assert!(is_structured_content_type(
            "Application/CloudEvents+json; charset=UTF-8"
        ));
        assert!(!is_structured_content_type("application/json"));
        assert!(is_extension_name("traceparent"));
        assert!(!is_extension_name("partitionkey"));
        assert!(!is_extension_name("x-request-id"));
        assert!(!is_extension_name("abcdefghijklmnopqrstu"));
    }
}
