//! Publisher conformance: checks any [`Publisher`] against the broker it writes to.
//!
//! A publisher crate implements [`PublisherHarness`] (a fresh publisher and a [`BrokerReader`] per
//! check, each with its own stream or topic) and calls [`run_publisher_suite`] from one test, or
//! calls the `check_*` functions one per test. Each check panics with a message saying what broke,
//! as test code does.
//!
//! What is checked:
//! - [`check_round_trip`]: ids, payload bytes and headers (the standard set from
//!   [`outbox_routing::standard_headers`], user headers and `traceparent` included) arrive
//!   unchanged, and the broker's key is the partition key; a binary payload (bytes with `0x00`,
//!   `0xff` and invalid UTF-8) arrives byte for byte with its `content-type`;
//! - [`check_key_order`]: many keys interleaved in one batch keep their order per key;
//! - [`check_partial_failure`]: a message the broker refuses permanently fails alone, its key's
//!   later messages are `NotAttempted` and not stored, everything else is `Acked` and stored;
//! - [`check_dedup`]: when the publisher declares broker-side dedup, publishing the same message
//!   again is `Acked` and stored once;
//! - [`check_broker_down`]: against a broker that is down, every outcome is a transient failure,
//!   ambiguous, or not attempted, within a bound derived from the publisher's timeout.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use outbox_routing::standard_headers;
use outbox_traits::{
    async_trait, chrono::Utc, uuid::Uuid, Binary, Error, ErrorKind, Message, PublishOutcome,
    Publisher,
};

/// One message as the broker stored it, read back by a [`BrokerReader`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedMessage {
    /// The message id the broker carries (header or field), as text.
    pub id: String,
    /// The stored payload bytes: the JSON text, or a binary payload's bytes.
    pub payload: Vec<u8>,
    /// The stored headers (for brokers without headers, the fields that stand for them, under
    /// the names of [`outbox_routing::standard_headers`]; a binary payload's content type is
    /// the `content-type` header).
    pub headers: Vec<(String, String)>,
    /// The broker's key for the message (Kafka record key, the partition key header or field
    /// elsewhere), if any.
    pub key: Option<String>,
}

/// Reads back what the broker stored for one check's destinations.
#[async_trait]
pub trait BrokerReader: Send + Sync {
    /// Every message stored so far for this reader's stream/topic, in the broker's order per
    /// destination (partition, stream), destinations one after another.
    async fn read_all(&self) -> Result<Vec<ReceivedMessage>, Error>;
}

/// What a publisher crate provides so that [`run_publisher_suite`] can run every check.
#[async_trait]
pub trait PublisherHarness: Send + Sync {
    /// The publisher under test.
    type Publisher: Publisher;

    /// A publisher and a reader for a destination no other check uses. Every message built by
    /// [`message`] (aggregate type `conformance`, event type `conformance.event`) must be routed
    /// to a destination the reader reads.
    async fn fresh(&self) -> (Self::Publisher, Box<dyn BrokerReader>);

    /// A JSON payload this publisher refuses permanently (e.g. above the broker's size limit),
    /// or `None` when it has no such limit (the partial-failure check is then skipped).
    fn oversized_payload(&self) -> Option<String>;

    /// Whether the publisher declares broker-side dedup by message id (NATS `Nats-Msg-Id`).
    fn broker_dedup(&self) -> bool;

    /// A publisher configured against a broker that is down (e.g. an unused port, or a private
    /// server that was stopped), and its timeout.
    async fn down(&self) -> (Box<dyn Publisher>, Duration);
}

/// Run every check, each on a fresh publisher and destination.
pub async fn run_publisher_suite<H: PublisherHarness>(harness: &H) {
    let (p, r) = harness.fresh().await;
    check_round_trip(&p, r.as_ref()).await;
    let (p, r) = harness.fresh().await;
    check_key_order(&p, r.as_ref()).await;
    if let Some(oversized) = harness.oversized_payload() {
        let (p, r) = harness.fresh().await;
        check_partial_failure(&p, r.as_ref(), &oversized).await;
    }
    if harness.broker_dedup() {
        let (p, r) = harness.fresh().await;
        check_dedup(&p, r.as_ref()).await;
    }
    let (down, timeout) = harness.down().await;
    check_broker_down(down.as_ref(), timeout).await;
}

/// A message as a store would hand it to a relay: aggregate type `conformance`, event type
/// `conformance.event`, the given partition key (also the aggregate id) and payload.
pub fn message(key: Option<&str>, payload: &str) -> Message {
    Message {
        id: Uuid::now_v7(),
        seq: 0,
        aggregate_type: "conformance".into(),
        aggregate_id: key.unwrap_or("no-key").into(),
        event_type: "conformance.event".into(),
        payload: payload.into(),
        binary: None,
        headers: BTreeMap::new(),
        partition_key: key.map(String::from),
        dedup_key: None,
        attempts: 0,
        created_at: Utc::now(),
    }
}

async fn read(reader: &dyn BrokerReader) -> Vec<ReceivedMessage> {
    match reader.read_all().await {
        Ok(stored) => stored,
        Err(e) => panic!("reading the broker back failed: {e}"),
    }
}

fn assert_outcome_count(batch: &[Message], outcomes: &[PublishOutcome]) {
    assert_eq!(
        outcomes.len(),
        batch.len(),
        "publish must return exactly one outcome per message"
    );
}

/// The bytes of the binary payload [`check_round_trip`] sends: a NUL, `0xff`, a lone
/// continuation byte and a truncated UTF-8 sequence (not UTF-8 text), and a JSON-looking part.
pub const BINARY_PAYLOAD: &[u8] = &[
    0x00, 0xff, 0x80, 0xc3, 0x28, b'{', b'"', b'n', b'"', b':', b'1', b'}', 0xe2, 0x82, 0x00,
    b'\n', 0xfe,
];

/// The content type of [`BINARY_PAYLOAD`].
pub const BINARY_CONTENT_TYPE: &str = "application/x-protobuf";

/// A binary message as a store would hand it to a relay: [`message`] with `binary` set and a
/// `null` JSON payload.
pub fn binary_message(key: Option<&str>, content_type: &str, data: &[u8]) -> Message {
    let mut msg = message(key, "null");
    msg.binary = Some(Binary::new(content_type, data));
    msg
}

/// Ids, payload bytes, headers and keys arrive unchanged; so does a binary payload, with its
/// content type.
pub async fn check_round_trip(publisher: &dyn Publisher, reader: &dyn BrokerReader) {
    let payloads = [
        r#"{"n":1}"#.to_string(),
        r#"{"text":"héllo \"quoted\" \\ back\nslash 😀","list":[1,2.5,null,true,{"a":{}}]}"#
            .to_string(),
        format!(r#"{{"big":"{}"}}"#, "x".repeat(64 * 1024)),
        "[]".to_string(),
    ];
    let mut batch = Vec::new();
    for (i, payload) in payloads.iter().enumerate() {
        let key = format!("rt-{i}");
        let mut msg = message(Some(&key), payload);
        msg.headers.insert(
            "traceparent".into(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        );
        msg.headers
            .insert("x-tenant".into(), format!("tenant-ü-{i}"));
        batch.push(msg);
    }
    let mut unordered = message(None, r#"{"unordered":true}"#);
    unordered.headers.insert("x-only".into(), "1".into());
    batch.push(unordered);
    let mut binary = binary_message(Some("rt-bin"), BINARY_CONTENT_TYPE, BINARY_PAYLOAD);
    binary
        .headers
        .insert("x-tenant".into(), "tenant-bin".into());
    batch.push(binary);

    let outcomes = publisher.publish(&batch).await;
    assert_outcome_count(&batch, &outcomes);
    for (msg, outcome) in batch.iter().zip(&outcomes) {
        assert_eq!(
            outcome,
            &PublishOutcome::Acked,
            "message {} not acked",
            msg.id
        );
    }
    let stored = read(reader).await;
    for msg in &batch {
        let id = msg.id.hyphenated().to_string();
        let copies: Vec<&ReceivedMessage> = stored.iter().filter(|r| r.id == id).collect();
        assert_eq!(
            copies.len(),
            1,
            "message {id} stored {} times",
            copies.len()
        );
        let got = copies[0];
        assert_eq!(
            got.payload,
            msg.body(),
            "payload of {id} changed on the way"
        );
        let content_type = got
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.as_str());
        match &msg.binary {
            Some(binary) => assert_eq!(
                content_type,
                Some(binary.content_type.as_str()),
                "content type of binary message {id}"
            ),
            // JSON messages are sent as before binary payloads existed: no content type.
            None => assert_eq!(content_type, None, "content type of JSON message {id}"),
        }
        for (name, value) in standard_headers(msg) {
            assert!(
                got.headers.iter().any(|(n, v)| n == &name && v == &value),
                "message {id}: header {name}={value:?} missing or changed; got {:?}",
                got.headers
            );
        }
        assert_eq!(got.key, msg.partition_key, "key of message {id}");
    }
}

/// Per-key order: 20 keys, 10 messages each, interleaved in one batch.
pub async fn check_key_order(publisher: &dyn Publisher, reader: &dyn BrokerReader) {
    let mut batch = Vec::new();
    for round in 0..10 {
        for key in 0..20 {
            batch.push(message(
                Some(&format!("order-{key}")),
                &format!(r#"{{"key":{key},"n":{round}}}"#),
            ));
        }
    }
    let outcomes = publisher.publish(&batch).await;
    assert_outcome_count(&batch, &outcomes);
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "all messages must be acked: {outcomes:?}"
    );
    let stored = read(reader).await;
    let position: HashMap<&str, usize> = stored
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.as_str(), i))
        .collect();
    let mut last_per_key: HashMap<&str, usize> = HashMap::new();
    for msg in &batch {
        let id = msg.id.hyphenated().to_string();
        let Some(&pos) = position.get(id.as_str()) else {
            panic!("acked message {id} is not stored");
        };
        let key = msg.partition_key.as_deref().unwrap_or_default();
        if let Some(prev) = last_per_key.insert(key, pos) {
            assert!(
                prev < pos,
                "key {key}: message {id} stored before an earlier message of its key"
            );
        }
    }
}

/// A permanently refused message fails alone: its key's later messages are `NotAttempted`
/// and not stored; every other message is `Acked` and stored.
pub async fn check_partial_failure(
    publisher: &dyn Publisher,
    reader: &dyn BrokerReader,
    oversized_payload: &str,
) {
    let a1 = message(Some("pf-a"), r#"{"a":1}"#);
    let a2 = message(Some("pf-a"), oversized_payload);
    let a3 = message(Some("pf-a"), r#"{"a":3}"#);
    let b1 = message(Some("pf-b"), r#"{"b":1}"#);
    let b2 = message(Some("pf-b"), r#"{"b":2}"#);
    let c = message(None, r#"{"c":1}"#);
    let b3 = message(Some("pf-b"), r#"{"b":3}"#);
    let batch = vec![a1, a2, a3, b1, b2, c, b3];
    let outcomes = publisher.publish(&batch).await;
    assert_outcome_count(&batch, &outcomes);
    assert_eq!(outcomes[0], PublishOutcome::Acked, "first message of key a");
    assert!(
        matches!(
            outcomes[1],
            PublishOutcome::Failed {
                kind: ErrorKind::Permanent,
                ..
            }
        ),
        "the oversized message must fail permanently, got {:?}",
        outcomes[1]
    );
    assert_eq!(
        outcomes[2],
        PublishOutcome::NotAttempted,
        "a key's message after a failed one must not be sent"
    );
    for i in [3, 4, 5, 6] {
        assert_eq!(
            outcomes[i],
            PublishOutcome::Acked,
            "message {i} of other keys"
        );
    }
    let stored = read(reader).await;
    let stored_ids: Vec<&str> = stored.iter().map(|r| r.id.as_str()).collect();
    for (i, msg) in batch.iter().enumerate() {
        let id = msg.id.hyphenated().to_string();
        let count = stored_ids.iter().filter(|s| **s == id).count();
        let expected = usize::from(outcomes[i].is_acked());
        assert_eq!(count, expected, "message {i} ({id}) stored {count} times");
    }
}

/// With declared broker dedup, the same message published twice (in separate batches, as a
/// relay's retry would) is `Acked` both times and stored once.
pub async fn check_dedup(publisher: &dyn Publisher, reader: &dyn BrokerReader) {
    let first = message(Some("dedup"), r#"{"d":1}"#);
    let other = message(Some("dedup-other"), r#"{"d":2}"#);
    let outcomes = publisher.publish(std::slice::from_ref(&first)).await;
    assert_eq!(outcomes, [PublishOutcome::Acked], "first publish");
    let retry = vec![first.clone(), other.clone()];
    let outcomes = publisher.publish(&retry).await;
    assert_eq!(
        outcomes,
        [PublishOutcome::Acked, PublishOutcome::Acked],
        "a republished message must count as delivered once the broker confirms it has it"
    );
    let stored = read(reader).await;
    let id = first.id.hyphenated().to_string();
    let copies = stored.iter().filter(|r| r.id == id).count();
    assert_eq!(
        copies, 1,
        "declared dedup, yet the message is stored {copies} times"
    );
    let other_id = other.id.hyphenated().to_string();
    assert_eq!(stored.iter().filter(|r| r.id == other_id).count(), 1);
}

/// Against a broker that is down: no panic, no hang, no `Acked`; every outcome is a transient
/// failure, ambiguous, or `NotAttempted` after an earlier failure of its key.
pub async fn check_broker_down(publisher: &dyn Publisher, timeout: Duration) {
    let mut batch = Vec::new();
    for n in 0..3 {
        for key in ["down-a", "down-b", "down-c"] {
            batch.push(message(Some(key), &format!(r#"{{"n":{n}}}"#)));
        }
    }
    batch.push(message(None, "{}"));
    // A hang guard, not a performance assertion: a publisher that honours its timeout finishes
    // far sooner.
    let bound = timeout * 4 + Duration::from_secs(10);
    let outcomes = match tokio::time::timeout(bound, publisher.publish(&batch)).await {
        Ok(outcomes) => outcomes,
        Err(_) => panic!("publish against a broker that is down did not return within {bound:?}"),
    };
    assert_outcome_count(&batch, &outcomes);
    let mut seen_keys = Vec::new();
    for (msg, outcome) in batch.iter().zip(&outcomes) {
        match outcome {
            PublishOutcome::Failed {
                kind: ErrorKind::Transient,
                ..
            }
            | PublishOutcome::Ambiguous { .. } => {}
            PublishOutcome::NotAttempted => assert!(
                msg.partition_key
                    .as_ref()
                    .is_some_and(|k| seen_keys.contains(k)),
                "NotAttempted for the first message of its key {:?}",
                msg.partition_key
            ),
            other => panic!("broker down: expected transient/ambiguous, got {other:?}"),
        }
        if let Some(key) = &msg.partition_key {
            seen_keys.push(key.clone());
        }
    }
}
