//! What a consumer dead-lettered: how many dead letters its dead-letter stream or topic holds,
//! and the newest ones, read from the broker without consuming them.
//!
//! [`dead_letters`] takes the URL a consumer is configured with and finds where that consumer
//! writes its dead letters: the NATS stream `<stream>_DEAD` (or the one `dead_stream=` names, or
//! the stream that captures `dead_subject=`), the Redis stream `<stream>:dead` (or
//! `dead_stream=`), the Kafka topic `<topic>.dead` (or `dead_topic=`). By default the consumers of
//! one stream or topic share that destination; each dead letter names the consumer that wrote
//! it ([`DeadLetter::consumer`]).

use std::time::SystemTime;

use outbox_routing::{HEADER_MESSAGE_ID, HEADER_PARTITION_KEY};
use outbox_traits::Error;
use outbox_url::redact_url;

use crate::{DEAD_ATTEMPTS, DEAD_CONSUMER, DEAD_REASON, DEAD_SOURCE};

/// The largest `limit` [`dead_letters`] accepts.
pub const MAX_DEAD_LETTER_LIMIT: usize = 10_000;

/// What [`dead_letters`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetters {
    /// `nats`, `redis` or `kafka`.
    pub broker: &'static str,
    /// The dead-letter stream (NATS, Redis) or topic (Kafka).
    pub destination: String,
    /// How many dead letters it holds (0 when it does not exist).
    pub count: u64,
    /// The newest dead letters, at most the `limit` asked for, newest first.
    pub letters: Vec<DeadLetter>,
}

/// One dead letter: the original message's envelope fields as far as they can be read (an
/// undecodable message may lack them), and what the consumer added.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The outbox message id (`message-id`, the CloudEvents `id`, or the Redis `id` field).
    pub message_id: Option<String>,
    /// The consumer that dead-lettered it ([`DEAD_CONSUMER`]).
    pub consumer: Option<String>,
    /// Handler calls made ([`DEAD_ATTEMPTS`]; 0 for an undecodable message).
    pub attempts: Option<u32>,
    /// Why it was dead-lettered ([`DEAD_REASON`]).
    pub reason: Option<String>,
    /// Where the original message was ([`DEAD_SOURCE`]).
    pub source: Option<String>,
    /// The partition key, if the message had one.
    pub partition_key: Option<String>,
    /// The body's content type (`content-type`), if the message names one.
    pub content_type: Option<String>,
    /// Size of the body (payload) in bytes.
    pub body_bytes: usize,
    /// Where the dead letter itself is.
    pub position: DeadLetterPosition,
    /// When the broker stored it (NATS), the entry id's time (Redis), the record's timestamp
    /// (Kafka).
    pub time: Option<SystemTime>,
}

/// Where a dead letter is in its stream or topic.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterPosition {
    /// A message of the NATS dead-letter stream.
    Nats {
        /// Its sequence.
        sequence: u64,
    },
    /// An entry of the Redis dead-letter stream.
    Redis {
        /// Its entry id.
        entry_id: String,
    },
    /// A record of the Kafka dead-letter topic.
    Kafka {
        /// Its partition.
        partition: i32,
        /// Its offset.
        offset: i64,
    },
}

impl std::fmt::Display for DeadLetterPosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Nats { sequence } => write!(f, "sequence {sequence}"),
            Self::Redis { entry_id } => write!(f, "entry {entry_id}"),
            Self::Kafka { partition, offset } => {
                write!(f, "partition {partition} offset {offset}")
            }
        }
    }
}

/// The dead letters of the consumer configured by `consumer_url`: how many its dead-letter
/// stream or topic holds, and the newest `limit` of them, newest first.
///
/// `consumer_url` is the URL the consumer itself takes ([`Consumer::connect`](crate::Consumer::connect)),
/// with the same options, TLS settings and `*_file` secrets; the retry options in it are
/// ignored. Nothing is written and nothing is consumed:
/// - NATS: the stream's message count, and its last messages read one by one by sequence
///   (skipping deleted ones).
/// - Redis: `XLEN` and `XREVRANGE ... COUNT limit`.
/// - Kafka: the sum of each partition's high minus low watermark, and the last `limit` records
///   of each partition, merged by timestamp (newest first; ties by partition and offset).
///
/// A dead-letter stream or topic that does not exist (nothing was dead-lettered yet) gives a
/// count of 0 and no letters. With `limit` 0 only the count is read.
///
/// # Errors
/// [`Error::InvalidInput`] for a bad URL or a `limit` above [`MAX_DEAD_LETTER_LIMIT`] (before
/// connecting), or a Redis key that is not a stream; [`Error::Unavailable`] naming the broker
/// (`nats`, `redis`, `kafka`) when it cannot be reached or does not answer in time (a Redis
/// password refused is one too, as the Redis consumer reports it); [`Error::Backend`] when NATS
/// refuses the credentials or librdkafka the properties. No message contains a password.
pub async fn dead_letters(consumer_url: &str, limit: usize) -> Result<DeadLetters, Error> {
    if limit > MAX_DEAD_LETTER_LIMIT {
        return Err(Error::invalid_input(format!(
            "a dead-letter listing is at most {MAX_DEAD_LETTER_LIMIT} entries, not {limit}; \
             the count covers them all"
        )));
    }
    let scheme = consumer_url.split_once("://").map_or("", |(s, _)| s);
    match scheme {
        #[cfg(feature = "nats")]
        "nats" | "tls" | "ws" | "wss" => {
            nats::read(
                crate::nats::NatsConsumerConfig::from_url(consumer_url)?,
                limit,
            )
            .await
        }
        #[cfg(feature = "redis")]
        "redis" | "rediss" => {
            redis::read(
                crate::redis::RedisConsumerConfig::from_url(consumer_url)?,
                limit,
            )
            .await
        }
        #[cfg(feature = "kafka")]
        "kafka" => {
            kafka::read(
                crate::kafka::KafkaConsumerConfig::from_url(consumer_url)?,
                limit,
            )
            .await
        }
        _ => Err(Error::invalid_input(format!(
            "consumer URL {:?} names no broker this build consumes; use nats://, redis:// or \
             kafka:// (features nats, redis, kafka)",
            redact_url(consumer_url)
        ))),
    }
}

/// The envelope fields and dead-letter headers of one dead letter, gathered from its headers
/// (NATS, Kafka) or fields (Redis).
#[derive(Debug, Default)]
struct Fields {
    message_id: Option<String>,
    consumer: Option<String>,
    attempts: Option<u32>,
    reason: Option<String>,
    source: Option<String>,
    partition_key: Option<String>,
    content_type: Option<String>,
}

impl Fields {
    /// Take one header or field; names are compared ignoring ASCII case, the first of a name
    /// wins.
    fn take(&mut self, name: &str, value: &[u8]) {
        let is = |wanted: &str| name.eq_ignore_ascii_case(wanted);
        let slot = if is(HEADER_MESSAGE_ID) || is("ce_id") || is("ce-id") {
            &mut self.message_id
        } else if is(HEADER_PARTITION_KEY) || is("ce_partitionkey") || is("ce-partitionkey") {
            &mut self.partition_key
        } else if is("content-type") {
            &mut self.content_type
        } else if is(DEAD_CONSUMER) {
            &mut self.consumer
        } else if is(DEAD_REASON) {
            &mut self.reason
        } else if is(DEAD_SOURCE) {
            &mut self.source
        } else if is(DEAD_ATTEMPTS) {
            if self.attempts.is_none() {
                self.attempts = std::str::from_utf8(value)
                    .ok()
                    .and_then(|t| t.trim().parse().ok());
            }
            return;
        } else {
            return;
        };
        if slot.is_none() {
            let text = String::from_utf8_lossy(value);
            // NATS and Redis CloudEvents headers are percent-encoded; decoding leaves plain
            // text as it is.
            let text = if name.starts_with("ce-") {
                outbox_url::percent_decode_lossy(&text)
            } else {
                text.into_owned()
            };
            *slot = Some(text);
        }
    }

    fn letter(
        self,
        body_bytes: usize,
        position: DeadLetterPosition,
        time: Option<SystemTime>,
    ) -> DeadLetter {
        DeadLetter {
            message_id: self.message_id,
            consumer: self.consumer,
            attempts: self.attempts,
            reason: self.reason,
            source: self.source,
            partition_key: self.partition_key,
            content_type: self.content_type,
            body_bytes,
            position,
            time,
        }
    }
}

/// The error of a broker that cannot be reached, with the password removed.
#[cfg(any(feature = "nats", feature = "kafka"))]
fn unavailable(broker: &str, what: String, e: &dyn std::fmt::Display) -> Error {
    let detail = redact_url(&e.to_string());
    Error::unavailable(broker, format!("{what}: {detail}"), detail)
}

#[cfg(feature = "nats")]
mod nats {
    use async_nats::jetstream::{self, context::GetStreamErrorKind};
    use futures::StreamExt;

    use super::*;
    use crate::nats::NatsConsumerConfig;

    /// Sequences read at once (each a request).
    const IN_FLIGHT: usize = 32;
    /// Deleted sequences skipped at most while looking for the last messages.
    const MAX_HOLES: u64 = 10_000;

    pub(super) async fn read(
        config: NatsConsumerConfig,
        limit: usize,
    ) -> Result<DeadLetters, Error> {
        let shown = redact_url(&config.url);
        let options = config
            .security
            .apply(async_nats::ConnectOptions::new())
            .await?;
        let client = options
            .name("outbox-dead-letters")
            .connection_timeout(config.timeout)
            .request_timeout(Some(config.timeout))
            .connect(config.url.as_str())
            .await
            // As the consumer's own connect: refused credentials are no outage.
            .map_err(|e| crate::nats::connect_error(&shown, &e))?;
        let mut context = jetstream::new(client);
        context.set_timeout(config.timeout);
        let name = match &config.dead_letter_stream {
            Some(name) => Some(name.clone()),
            None => match context
                .stream_by_subject(config.dead_letter_subject.clone())
                .await
            {
                Ok(name) => Some(name),
                Err(e) if e.kind() == jetstream::context::GetStreamByNameErrorKind::NotFound => {
                    None
                }
                Err(e) => {
                    return Err(unavailable(
                        "nats",
                        format!(
                            "cannot find the stream of subject {:?} on {shown}",
                            config.dead_letter_subject
                        ),
                        &e,
                    ))
                }
            },
        };
        let empty = |destination: String| DeadLetters {
            broker: "nats",
            destination,
            count: 0,
            letters: Vec::new(),
        };
        let Some(name) = name else {
            return Ok(empty(config.dead_letter_subject.clone()));
        };
        let stream = match context.get_stream(&name).await {
            Ok(stream) => stream,
            Err(e) => {
                if let GetStreamErrorKind::JetStream(js) = e.kind() {
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND {
                        return Ok(empty(name));
                    }
                }
                return Err(unavailable(
                    "nats",
                    format!("cannot read stream {name:?} on {shown}"),
                    &e,
                ));
            }
        };
        let state = stream.cached_info().state.clone();
        let mut letters = Vec::with_capacity(limit.min(state.messages as usize));
        if limit > 0 && state.messages > 0 && state.last_sequence >= state.first_sequence {
            let mut holes = 0u64;
            let mut reads =
                futures::stream::iter((state.first_sequence..=state.last_sequence).rev())
                    .map(|sequence| {
                        let stream = &stream;
                        async move { (sequence, stream.get_raw_message(sequence).await) }
                    })
                    .buffered(IN_FLIGHT);
            while let Some((sequence, read)) = reads.next().await {
                match read {
                    Ok(message) => {
                        let mut fields = Fields::default();
                        for (header, values) in message.headers.iter() {
                            for value in values {
                                fields.take(header.as_ref(), value.as_str().as_bytes());
                            }
                        }
                        letters.push(fields.letter(
                            message.payload.len(),
                            DeadLetterPosition::Nats {
                                sequence: message.sequence,
                            },
                            Some(SystemTime::from(message.time)),
                        ));
                        if letters.len() == limit {
                            break;
                        }
                    }
                    Err(e)
                        if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound =>
                    {
                        // Deleted (or removed by the stream's limits meanwhile).
                        holes += 1;
                        if holes > MAX_HOLES {
                            break;
                        }
                    }
                    Err(e) => {
                        return Err(unavailable(
                            "nats",
                            format!("cannot read message {sequence} of stream {name:?} on {shown}"),
                            &e,
                        ))
                    }
                }
            }
        }
        Ok(DeadLetters {
            broker: "nats",
            destination: name,
            count: state.messages,
            letters,
        })
    }
}

#[cfg(feature = "redis")]
mod redis {
    use std::time::Duration;

    use ::redis::Value;

    use super::*;
    use crate::redis::RedisConsumerConfig;

    pub(super) async fn read(
        config: RedisConsumerConfig,
        limit: usize,
    ) -> Result<DeadLetters, Error> {
        let shown = redact_url(&config.url);
        let client = if config.tls.is_set() {
            ::redis::Client::build_with_tls(
                config.url.as_str(),
                crate::redis::certificates(&config.tls)?,
            )
        } else {
            ::redis::Client::open(config.url.as_str())
        };
        let client = client.map_err(|e| {
            Error::invalid_input(format!(
                "Redis URL {shown:?} is not valid: {}",
                redact_url(&e.to_string())
            ))
        })?;
        let fail = |e: &dyn std::fmt::Display| {
            let detail = redact_url(&e.to_string());
            let message = match crate::redis::connect_fix(&detail) {
                Some(fix) => format!("cannot read from {shown}: {detail}; {fix}"),
                None => format!("cannot read from {shown}: {detail}"),
            };
            Error::unavailable("redis", message, detail)
        };
        let within = |what: &str| format!("no answer to {what} within {:?}", config.timeout);
        let mut connection =
            tokio::time::timeout(config.timeout, client.get_multiplexed_async_connection())
                .await
                .map_err(|_| fail(&within("connecting")))?
                .map_err(|e| fail(&e))?;
        let key = &config.dead_letter_stream;
        let not_a_stream = || {
            Error::invalid_input(format!(
                "Redis key {key:?} on {shown} is not a stream; is dead_stream= right?"
            ))
        };
        let count: u64 = tokio::time::timeout(
            config.timeout,
            ::redis::cmd("XLEN").arg(key).query_async(&mut connection),
        )
        .await
        .map_err(|_| fail(&within("XLEN")))?
        .map_err(|e: ::redis::RedisError| {
            if e.code() == Some("WRONGTYPE") {
                not_a_stream()
            } else {
                fail(&e)
            }
        })?;
        let mut letters = Vec::new();
        if limit > 0 && count > 0 {
            let reply: Value = tokio::time::timeout(
                config.timeout,
                ::redis::cmd("XREVRANGE")
                    .arg(key)
                    .arg("+")
                    .arg("-")
                    .arg("COUNT")
                    .arg(limit)
                    .query_async(&mut connection),
            )
            .await
            .map_err(|_| fail(&within("XREVRANGE")))?
            .map_err(|e| fail(&e))?;
            letters = entries(reply).ok_or_else(|| {
                fail(&format!(
                    "XREVRANGE of {key:?} gave a reply that is not stream entries"
                ))
            })?;
        }
        Ok(DeadLetters {
            broker: "redis",
            destination: key.clone(),
            count,
            letters,
        })
    }

    fn bytes(value: &Value) -> Option<&[u8]> {
        match value {
            Value::BulkString(bytes) => Some(bytes),
            Value::SimpleString(text) => Some(text.as_bytes()),
            _ => None,
        }
    }

    /// Parse `[[id, [field, value, ...]], ...]`.
    fn entries(reply: Value) -> Option<Vec<DeadLetter>> {
        let Value::Array(items) = reply else {
            return None;
        };
        let mut letters = Vec::with_capacity(items.len());
        for item in &items {
            let Value::Array(pair) = item else {
                return None;
            };
            let [id, Value::Array(flat)] = pair.as_slice() else {
                return None;
            };
            let entry_id = String::from_utf8_lossy(bytes(id)?).into_owned();
            let mut fields = Fields::default();
            let mut body_bytes = 0;
            for pair in flat.chunks(2) {
                let [name, value] = pair else { continue };
                let (name, value) = (String::from_utf8_lossy(bytes(name)?), bytes(value)?);
                match name.as_ref() {
                    // The Redis publisher's envelope fields.
                    "id" => fields.take(HEADER_MESSAGE_ID, value),
                    "partition_key" => fields.take(HEADER_PARTITION_KEY, value),
                    "content_type" => fields.take("content-type", value),
                    // The default envelope's payload, a CloudEvent's data.
                    "payload" | "data" => body_bytes = value.len(),
                    other => fields.take(other, value),
                }
            }
            // An entry id is `<milliseconds>-<sequence>`.
            let time = entry_id
                .split_once('-')
                .and_then(|(ms, _)| ms.parse::<u64>().ok())
                .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
            letters.push(fields.letter(body_bytes, DeadLetterPosition::Redis { entry_id }, time));
        }
        Some(letters)
    }
}

#[cfg(feature = "kafka")]
mod kafka {
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::error::RDKafkaErrorCode;
    use rdkafka::message::{Headers, Message};
    use rdkafka::{Offset, TopicPartitionList};

    use super::*;
    use crate::kafka::KafkaConsumerConfig;

    pub(super) async fn read(
        config: KafkaConsumerConfig,
        limit: usize,
    ) -> Result<DeadLetters, Error> {
        // librdkafka's calls block: run them off the async threads.
        tokio::task::spawn_blocking(move || read_blocking(&config, limit))
            .await
            .map_err(|e| Error::transient(format!("Kafka dead-letter reader failed: {e}"), None))?
    }

    fn read_blocking(config: &KafkaConsumerConfig, limit: usize) -> Result<DeadLetters, Error> {
        let topic = config.dead_letter_topic.as_str();
        let brokers = &config.brokers;
        let mut client = config.base_config();
        client
            // Partitions are assigned directly: the group is never joined, nothing committed.
            .set("group.id", format!("{}.dead-letter-reader", config.group))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("allow.auto.create.topics", "false");
        let consumer: BaseConsumer = client.create().map_err(|e| {
            let detail = redact_url(&e.to_string());
            Error::permanent(
                format!("Kafka dead-letter reader not created: {detail}"),
                Some(detail.into()),
            )
        })?;
        let timeout = config.timeout;
        let metadata = consumer.fetch_metadata(Some(topic), timeout).map_err(|e| {
            unavailable("kafka", format!("cannot read metadata from {brokers}"), &e)
        })?;
        let empty = DeadLetters {
            broker: "kafka",
            destination: topic.to_owned(),
            count: 0,
            letters: Vec::new(),
        };
        let Some(meta) = metadata.topics().iter().find(|t| t.name() == topic) else {
            return Ok(empty);
        };
        match meta.error() {
            None => {}
            Some(code)
                if RDKafkaErrorCode::from(code) == RDKafkaErrorCode::UnknownTopicOrPartition =>
            {
                return Ok(empty)
            }
            Some(code) => {
                return Err(unavailable(
                    "kafka",
                    format!("cannot read topic {topic:?} on {brokers}"),
                    &RDKafkaErrorCode::from(code),
                ))
            }
        }
        let mut count = 0u64;
        // Per partition: the first offset to read and the high watermark.
        let mut ranges = HashMap::new();
        for partition in meta.partitions() {
            let id = partition.id();
            let (low, high) = consumer.fetch_watermarks(topic, id, timeout).map_err(|e| {
                unavailable(
                    "kafka",
                    format!("cannot read the offsets of {topic:?} partition {id} on {brokers}"),
                    &e,
                )
            })?;
            count += u64::try_from(high - low).unwrap_or(0);
            let from = low.max(high - i64::try_from(limit).unwrap_or(i64::MAX));
            if limit > 0 && high > from {
                ranges.insert(id, (from, high));
            }
        }
        let mut letters = Vec::new();
        if !ranges.is_empty() {
            let mut assignment = TopicPartitionList::new();
            for (&partition, &(from, _)) in &ranges {
                assignment
                    .add_partition_offset(topic, partition, Offset::Offset(from))
                    .map_err(|e| unavailable("kafka", format!("cannot assign {topic:?}"), &e))?;
            }
            consumer
                .assign(&assignment)
                .map_err(|e| unavailable("kafka", format!("cannot assign {topic:?}"), &e))?;
            let deadline = Instant::now() + timeout;
            // Partitions not yet read up to their high watermark.
            let mut open: HashMap<i32, i64> = ranges.iter().map(|(&p, &(_, h))| (p, h)).collect();
            while !open.is_empty() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::unavailable(
                        "kafka",
                        format!(
                            "the last records of {topic:?} on {brokers} were not all read within \
                             {timeout:?} (timeout_ms= sets it)"
                        ),
                        "read timed out",
                    ));
                }
                match consumer.poll(left.min(Duration::from_millis(200))) {
                    Some(Ok(record)) => {
                        let (partition, offset) = (record.partition(), record.offset());
                        let Some(&high) = open.get(&partition) else {
                            continue;
                        };
                        if offset < high {
                            letters.push(letter(&record));
                        }
                        if offset + 1 >= high {
                            open.remove(&partition);
                        }
                    }
                    Some(Err(e)) => {
                        return Err(unavailable(
                            "kafka",
                            format!("cannot read {topic:?} on {brokers}"),
                            &e,
                        ))
                    }
                    None => {}
                }
                // Records that are not messages (transaction markers) end a partition too:
                // its position reaches the high watermark.
                if let Ok(positions) = consumer.position() {
                    for element in positions.elements() {
                        if let Offset::Offset(at) = element.offset() {
                            if open.get(&element.partition()).is_some_and(|&h| at >= h) {
                                open.remove(&element.partition());
                            }
                        }
                    }
                }
            }
        }
        letters.sort_by(|a, b| {
            let key = |l: &DeadLetter| match l.position {
                DeadLetterPosition::Kafka { partition, offset } => (partition, offset),
                _ => (0, 0),
            };
            b.time
                .cmp(&a.time)
                .then_with(|| key(a).0.cmp(&key(b).0))
                .then_with(|| key(b).1.cmp(&key(a).1))
        });
        letters.truncate(limit);
        Ok(DeadLetters {
            broker: "kafka",
            destination: topic.to_owned(),
            count,
            letters,
        })
    }

    fn letter(record: &rdkafka::message::BorrowedMessage<'_>) -> DeadLetter {
        let mut fields = Fields::default();
        if let Some(headers) = record.headers() {
            for header in headers.iter() {
                fields.take(header.key, header.value.unwrap_or_default());
            }
        }
        if fields.partition_key.is_none() {
            if let Some(key) = record.key() {
                fields.partition_key = Some(String::from_utf8_lossy(key).into_owned());
            }
        }
        let time = record
            .timestamp()
            .to_millis()
            .and_then(|ms| u64::try_from(ms).ok())
            .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
        fields.letter(
            record.payload().map_or(0, <[u8]>::len),
            DeadLetterPosition::Kafka {
                partition: record.partition(),
                offset: record.offset(),
            },
            time,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_come_from_standard_and_cloudevents_headers() {
        let mut fields = Fields::default();
        fields.take("Message-Id", b"id-1");
        fields.take("message-id", b"id-2");
        fields.take("partition-key", b"k");
        fields.take(DEAD_ATTEMPTS, b" 3 ");
        fields.take(DEAD_REASON, b"why");
        fields.take("traceparent", b"00-1-2-01");
        let letter = fields.letter(5, DeadLetterPosition::Nats { sequence: 9 }, None);
        assert_eq!(letter.message_id.as_deref(), Some("id-1"), "the first wins");
        assert_eq!(letter.partition_key.as_deref(), Some("k"));
        assert_eq!(
            (letter.attempts, letter.reason.as_deref()),
            (Some(3), Some("why"))
        );
        assert_eq!(
            (letter.body_bytes, letter.position.to_string()),
            (5, "sequence 9".into())
        );

        // CloudEvents: `ce-` (NATS, Redis) percent-encoded, `ce_` (Kafka) as is.
        let mut fields = Fields::default();
        fields.take("ce-id", b"a%20b");
        fields.take("ce-partitionkey", b"k%25");
        fields.take("content-type", b"application/cloudevents+json");
        fields.take(DEAD_ATTEMPTS, b"many");
        let letter = fields.letter(
            0,
            DeadLetterPosition::Redis {
                entry_id: "1-0".into(),
            },
            None,
        );
        assert_eq!(letter.message_id.as_deref(), Some("a b"));
        assert_eq!(letter.partition_key.as_deref(), Some("k%"));
        assert_eq!(
            letter.content_type.as_deref(),
            Some("application/cloudevents+json")
        );
        assert_eq!(letter.attempts, None, "not a number");
        let mut fields = Fields::default();
        fields.take("ce_id", b"a%20b");
        assert_eq!(fields.message_id.as_deref(), Some("a%20b"));
    }
}
