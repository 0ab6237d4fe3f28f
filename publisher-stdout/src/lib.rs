//! The zero-service publisher: one JSON line per message, written to stdout or any writer.
//!
//! It is what `stdout://` selects, so the relay can run with no broker at all (the README's
//! quickstart relays a SQLite outbox this way). Each line carries the message id, so a consumer
//! reading the stream can drop duplicates just as with a real broker.
//!
//! ```
//! use outbox_publisher_stdout::StdoutPublisher;
//! use outbox_traits::Publisher;
//! let publisher = StdoutPublisher::to_writer(Vec::new());
//! assert_eq!(publisher.name(), "stdout");
//! ```

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use outbox_traits::{async_trait, attempt_in_key_order, Message, PublishOutcome, Publisher};
use serde::Serialize;
use serde_json::value::RawValue;

/// Writes each published message as one JSON line.
///
/// The line holds `id`, `seq`, `aggregate_type`, `aggregate_id`, `event_type`, `partition_key`,
/// `headers`, `attempts` and the `payload` embedded as JSON. A batch is written with one write
/// and one flush; if the writer fails, every message of the batch is a transient failure.
///
/// A message with a binary payload ([`outbox_traits::Binary`]) has `"payload": null` and two
/// more members at the end of its line: `content_type` (e.g. `"application/x-protobuf"`) and
/// `payload_base64`, its bytes in base64 (standard alphabet, padded), so the line stays JSON
/// text. A JSON message's line has neither, as before binary payloads existed:
///
/// ```text
/// {"id":"…","seq":7,…,"attempts":0,"payload":null,"content_type":"application/x-protobuf","payload_base64":"CCo="}
/// ```
pub struct StdoutPublisher {
    out: Mutex<Box<dyn Write + Send>>,
}

#[derive(Serialize)]
struct Line<'a> {
    id: outbox_traits::uuid::Uuid,
    seq: i64,
    aggregate_type: &'a str,
    aggregate_id: &'a str,
    event_type: &'a str,
    partition_key: Option<&'a str>,
    headers: &'a BTreeMap<String, String>,
    attempts: u32,
    payload: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    content_type: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_base64: Option<String>,
}

impl StdoutPublisher {
    /// A publisher writing to the process's standard output.
    pub fn new() -> Self {
        Self::to_writer(std::io::stdout())
    }

    /// A publisher writing to `out` (a file, a buffer, a pipe).
    pub fn to_writer(out: impl Write + Send + 'static) -> Self {
        Self {
            out: Mutex::new(Box::new(out)),
        }
    }

    /// A publisher writing into a shared buffer, which the caller can read back (tests, demos).
    pub fn to_buffer() -> (Self, SharedBuffer) {
        let buffer = SharedBuffer::default();
        (Self::to_writer(buffer.clone()), buffer)
    }

    fn render(batch: &[Message]) -> (Vec<u8>, Vec<PublishOutcome>) {
        let mut bytes = Vec::with_capacity(batch.len() * 256);
        let outcomes = attempt_in_key_order(batch, |message| {
            // A binary message's JSON payload is null whatever the store returned for it.
            let json = match message.binary {
                Some(_) => "null",
                None => message.payload.as_str(),
            };
            let rendered = serde_json::from_str::<&RawValue>(json).and_then(|payload| {
                serde_json::to_writer(
                    &mut bytes,
                    &Line {
                        id: message.id,
                        seq: message.seq,
                        aggregate_type: &message.aggregate_type,
                        aggregate_id: &message.aggregate_id,
                        event_type: &message.event_type,
                        partition_key: message.partition_key.as_deref(),
                        headers: &message.headers,
                        attempts: message.attempts,
                        payload,
                        content_type: message.binary.as_ref().map(|b| b.content_type.as_str()),
                        payload_base64: message.binary.as_ref().map(|b| STANDARD.encode(&b.data)),
                    },
                )
            });
            match rendered {
                Ok(()) => {
                    bytes.push(b'\n');
                    PublishOutcome::Acked
                }
                // A payload that is not JSON will never become JSON: dead-letter it, and drop
                // the partial line so the output stays one JSON document per line.
                Err(e) => {
                    if let Some(end) = bytes.iter().rposition(|b| *b == b'\n') {
                        bytes.truncate(end + 1);
                    } else {
                        bytes.clear();
                    }
                    PublishOutcome::permanent(format!(
                        "payload of message {} is not valid JSON: {e}",
                        message.id
                    ))
                }
            }
        });
        (bytes, outcomes)
    }
}

impl Default for StdoutPublisher {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Publisher for StdoutPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        let (bytes, mut outcomes) = Self::render(batch);
        let written = match self.out.lock() {
            Ok(mut out) => out.write_all(&bytes).and_then(|()| out.flush()),
            Err(_) => Err(std::io::Error::other("an earlier writer panicked")),
        };
        if let Err(e) = written {
            for outcome in outcomes.iter_mut().filter(|o| o.is_acked()) {
                *outcome = PublishOutcome::transient(format!("writing to the output failed: {e}"));
            }
        }
        outcomes
    }

    fn name(&self) -> &str {
        "stdout"
    }
}

/// A cloneable in-memory writer, for reading back what a [`StdoutPublisher`] wrote.
#[derive(Clone, Default)]
pub struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

impl SharedBuffer {
    /// Everything written so far, as text (lossy for invalid UTF-8, which the publisher never
    /// writes).
    pub fn contents(&self) -> String {
        match self.0.lock() {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(poisoned) => String::from_utf8_lossy(&poisoned.into_inner()).into_owned(),
        }
    }
}

impl Write for SharedBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("buffer poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::{ErrorKind, NewMessage};

    fn message(seq: i64, key: &str, payload: &str) -> Message {
        let new = NewMessage::new("order", key, "order.placed", serde_json::Value::Null);
        Message {
            id: new.id,
            seq,
            aggregate_type: new.aggregate_type,
            aggregate_id: new.aggregate_id,
            event_type: new.event_type,
            payload: payload.to_string(),
            binary: None,
            headers: BTreeMap::from([("tenant".to_string(), "acme".to_string())]),
            partition_key: new.partition_key,
            dedup_key: None,
            attempts: 0,
            created_at: outbox_traits::chrono::Utc::now(),
        }
    }

    #[tokio::test]
    async fn writes_one_json_line_per_message() {
        let (publisher, buffer) = StdoutPublisher::to_buffer();
        let batch = [message(1, "a", r#"{"n":1}"#), message(2, "b", r#"[1,2]"#)];
        let outcomes = publisher.publish(&batch).await;
        assert_eq!(outcomes, vec![PublishOutcome::Acked, PublishOutcome::Acked]);
        let lines: Vec<serde_json::Value> = buffer
            .contents()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["id"], batch[0].id.to_string());
        assert_eq!(lines[0]["payload"], serde_json::json!({"n": 1}));
        assert_eq!(lines[0]["headers"]["tenant"], "acme");
        assert_eq!(lines[1]["partition_key"], "b");
    }

    #[tokio::test]
    async fn binary_payload_as_base64_with_its_content_type() {
        let (publisher, buffer) = StdoutPublisher::to_buffer();
        let mut binary = message(1, "a", "");
        let bytes = vec![0u8, 0xff, 0xc3, 0x28, b'\n'];
        binary.binary = Some(outbox_traits::Binary::new(
            "application/x-protobuf",
            bytes.clone(),
        ));
        let json = message(2, "b", r#"{"n":1}"#);
        let outcomes = publisher.publish(&[binary, json]).await;
        assert_eq!(outcomes, vec![PublishOutcome::Acked, PublishOutcome::Acked]);
        let text = buffer.contents();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines[0]["payload"], serde_json::Value::Null);
        assert_eq!(lines[0]["content_type"], "application/x-protobuf");
        let encoded = lines[0]["payload_base64"].as_str().unwrap();
        assert_eq!(STANDARD.decode(encoded).unwrap(), bytes);
        // The JSON line is as it always was: no binary members.
        let json_line = text.lines().nth(1).unwrap();
        assert!(!json_line.contains("content_type"), "{json_line}");
        assert!(!json_line.contains("payload_base64"), "{json_line}");
        assert!(
            json_line.ends_with(r#""attempts":0,"payload":{"n":1}}"#),
            "{json_line}"
        );
    }

    #[tokio::test]
    async fn bad_payload_fails_permanently_and_holds_back_its_key() {
        let (publisher, buffer) = StdoutPublisher::to_buffer();
        let batch = [
            message(1, "a", "not json"),
            message(2, "b", "{}"),
            message(3, "a", "{}"),
        ];
        let outcomes = publisher.publish(&batch).await;
        assert!(matches!(
            outcomes[0],
            PublishOutcome::Failed {
                kind: ErrorKind::Permanent,
                ..
            }
        ));
        assert_eq!(outcomes[1], PublishOutcome::Acked);
        assert_eq!(outcomes[2], PublishOutcome::NotAttempted);
        let text = buffer.contents();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains(&batch[1].id.to_string()));
    }

    struct Broken;
    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "closed",
            ))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_failing_writer_gives_transient_failures() {
        let publisher = StdoutPublisher::to_writer(Broken);
        let outcomes = publisher.publish(&[message(1, "a", "{}")]).await;
        assert!(matches!(
            outcomes[0],
            PublishOutcome::Failed {
                kind: ErrorKind::Transient,
                ..
            }
        ));
    }
}
