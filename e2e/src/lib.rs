//! Read what the relay delivered back from the real brokers, each with its own client, and check
//! it against what the service committed.
//!
//! The end-to-end tests in `tests/` (and the relay-anywhere example's test) use these readers so
//! that "delivered" means "a consumer of that broker can read it", not "the publisher said so".
//! Every reader returns [`Received`] records in the broker's storage order (per partition for
//! Kafka), which is the order a consumer sees; [`check_delivery`] then compares them with the
//! committed messages.
//!
//! The [`crash`] module and the `crash-relay` binary add crash tests with real processes: see
//! the crate's `README.md` for the crash matrix and what each failpoint proves. The [`private`]
//! module starts private servers (TLS-only, with passwords) for tests that need their own; the
//! [`cluster`] module starts private NATS and Redis clusters for `tests/clusters.rs`.

use std::collections::{HashMap, HashSet};

pub mod cluster;
pub mod private;

/// Errors of the readers: test support, so any error is a failure report.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One record as a consumer of the broker sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The outbox message id the record carries (`message-id` header, `id` field for Redis).
    pub id: String,
    /// The record's payload bytes, unchanged.
    pub payload: Vec<u8>,
    /// The partition key the record carries (Kafka record key, `partition-key` header, Redis
    /// `partition_key` field).
    pub key: Option<String>,
    /// The content type the record carries (`content-type` header, Redis `content_type`
    /// field): a binary payload's; none for a JSON one in the default envelope.
    pub content_type: Option<String>,
}

/// A message the service committed, as the consumer must eventually see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// Message id (UUID text).
    pub id: String,
    /// Partition key.
    pub key: Option<String>,
    /// Payload bytes as the store holds them (what the relay publishes).
    pub payload: Vec<u8>,
}

/// What [`check_delivery`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// Distinct message ids received (equals the number of committed messages on success).
    pub distinct: usize,
    /// Records received beyond the first copy of their id (redeliveries after a crash).
    pub duplicates: usize,
}

/// Check that `received` holds exactly the `expected` messages once deduplicated by id: no
/// unknown id (a rolled-back message), none missing, every copy byte-equal in payload and key to
/// the committed message, and for every partition key the first copies in committed order.
///
/// `expected` must be in commit order per key (the order the service enqueued them).
pub fn check_delivery(received: &[Received], expected: &[Expected]) -> Result<Delivery, String> {
    let by_id: HashMap<&str, &Expected> = expected.iter().map(|e| (e.id.as_str(), e)).collect();
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut first_order: HashMap<Option<&str>, Vec<&str>> = HashMap::new();
    for r in received {
        let Some(e) = by_id.get(r.id.as_str()) else {
            return Err(format!(
                "received message {:?} that was never committed (payload {:?})",
                r.id,
                String::from_utf8_lossy(&r.payload)
            ));
        };
        if r.payload != e.payload {
            return Err(format!(
                "message {} arrived with payload {:?}, committed {:?}",
                r.id,
                String::from_utf8_lossy(&r.payload),
                String::from_utf8_lossy(&e.payload)
            ));
        }
        if r.key != e.key {
            return Err(format!(
                "message {} arrived with key {:?}, committed {:?}",
                r.id, r.key, e.key
            ));
        }
        if seen.insert(r.id.as_str()) {
            first_order
                .entry(e.key.as_deref())
                .or_default()
                .push(e.id.as_str());
        } else {
            duplicates += 1;
        }
    }
    let missing: Vec<&str> = expected
        .iter()
        .map(|e| e.id.as_str())
        .filter(|id| !seen.contains(id))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{} of {} committed messages never arrived, e.g. {:?}",
            missing.len(),
            expected.len(),
            &missing[..missing.len().min(5)]
        ));
    }
    let mut committed_order: HashMap<Option<&str>, Vec<&str>> = HashMap::new();
    for e in expected {
        committed_order
            .entry(e.key.as_deref())
            .or_default()
            .push(e.id.as_str());
    }
    for (key, ids) in &committed_order {
        // Unkeyed messages carry no order promise.
        if key.is_none() {
            continue;
        }
        if first_order.get(key) != Some(ids) {
            return Err(format!(
                "key {key:?}: arrived in order {:?}, committed in order {ids:?}",
                first_order.get(key)
            ));
        }
    }
    Ok(Delivery {
        distinct: seen.len(),
        duplicates,
    })
}

/// A random suffix for per-test names (schema, file, subject, stream, topic).
pub fn unique_suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

pub mod crash;

/// NATS JetStream: read a stream back message by message.
pub mod nats {
    use async_nats::jetstream;

    use super::{BoxError, Received};

    /// The header that carries the partition key (`outbox-routing`'s `HEADER_PARTITION_KEY`).
    const PARTITION_KEY: &str = "partition-key";

    /// Every message stored in `stream`, in stream sequence order, ids from `Nats-Msg-Id`.
    pub async fn read_stream(url: &str, stream: &str) -> Result<Vec<Received>, BoxError> {
        read_stream_with(&jetstream::new(async_nats::connect(url).await?), stream).await
    }

    /// [`read_stream`] through an existing JetStream context (e.g. a client of a cluster).
    pub async fn read_stream_with(
        js: &jetstream::Context,
        stream: &str,
    ) -> Result<Vec<Received>, BoxError> {
        let mut stream = js.get_stream(stream).await?;
        let state = stream.info().await?.state.clone();
        let mut out = Vec::with_capacity(state.messages as usize);
        if state.messages == 0 {
            return Ok(out);
        }
        for seq in state.first_sequence..=state.last_sequence {
            let stored = stream.get_raw_message(seq).await?;
            out.push(Received {
                id: stored
                    .headers
                    .get(async_nats::header::NATS_MESSAGE_ID)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default(),
                payload: stored.payload.to_vec(),
                key: stored
                    .headers
                    .get(PARTITION_KEY)
                    .map(|v| v.as_str().to_owned()),
                content_type: stored
                    .headers
                    .get("content-type")
                    .map(|v| v.as_str().to_owned()),
            });
        }
        Ok(out)
    }

    /// How many messages `stream` holds.
    pub async fn stream_len(url: &str, stream: &str) -> Result<u64, BoxError> {
        let js = jetstream::new(async_nats::connect(url).await?);
        let mut stream = js.get_stream(stream).await?;
        Ok(stream.info().await?.state.messages)
    }

    /// Delete `stream` so the shared server does not fill up.
    pub async fn delete_stream(url: &str, stream: &str) -> Result<(), BoxError> {
        let js = jetstream::new(async_nats::connect(url).await?);
        js.delete_stream(stream).await?;
        Ok(())
    }
}

/// Kafka (Tansu): create a topic, read it back to the end, delete it.
pub mod kafka {
    use std::time::{Duration, Instant};

    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::config::FromClientConfig;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    use super::{BoxError, Received};

    /// The longest a read waits for its end markers: a failure guard, not a timed assertion
    /// (a passing read returns as soon as the markers arrive).
    pub const READ_LIMIT: Duration = Duration::from_secs(120);

    /// Header that tells the reader's end markers from published messages.
    const MARKER_HEADER: &str = "outbox-e2e-end-marker";
    const MESSAGE_ID: &str = "message-id";

    fn admin(brokers: &str) -> Result<AdminClient<DefaultClientContext>, BoxError> {
        Ok(ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?)
    }

    /// Create `topic` with `partitions` partitions.
    pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) -> Result<(), BoxError> {
        let results = admin(brokers)?
            .create_topics(
                &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await?;
        for r in results {
            r.map_err(|(t, e)| format!("creating topic {t}: {e}"))?;
        }
        Ok(())
    }

    /// Delete `topic` so the broker does not fill up.
    pub async fn delete_topic(brokers: &str, topic: &str) -> Result<(), BoxError> {
        let results = admin(brokers)?
            .delete_topics(
                &[topic],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await?;
        for r in results {
            r.map_err(|(t, e)| format!("deleting topic {t}: {e}"))?;
        }
        Ok(())
    }

    /// A consumer of `topic`'s `partitions` partitions, each assigned from its start (no group
    /// rebalance, no committed offsets): it sees every record the topic ever held.
    pub fn consumer_from_start<C>(
        brokers: &str,
        topic: &str,
        partitions: i32,
    ) -> Result<C, BoxError>
    where
        C: FromClientConfig + Consumer,
    {
        let consumer: C = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", format!("outbox-e2e-{}", uuid::Uuid::new_v4()))
            .set("enable.auto.commit", "false")
            .create()?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        Ok(consumer)
    }

    /// The value of `record`'s first header `name`, as text.
    pub fn header<M: Message>(record: &M, name: &str) -> Option<String> {
        record.headers().and_then(|h| {
            h.iter()
                .find(|h| h.key == name)
                .map(|h| String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned())
        })
    }

    /// The outbox message id a record carries (its `message-id` header).
    pub fn message_id<M: Message>(record: &M) -> Option<String> {
        header(record, MESSAGE_ID)
    }

    /// Every record of `topic` (with `partitions` partitions), partition after partition, each
    /// in offset order.
    ///
    /// Tansu's end offsets do not track the record count, so the reader cannot ask where a
    /// partition ends. It appends a marker record to every partition and reads each partition up
    /// to its marker: a partition keeps its order, so every record stored before the read
    /// precedes the marker.
    pub async fn read_topic(
        brokers: &str,
        topic: &str,
        partitions: i32,
    ) -> Result<Vec<Received>, BoxError> {
        let marker = uuid::Uuid::new_v4().to_string();
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        for p in 0..partitions {
            let headers = OwnedHeaders::new().insert(Header {
                key: MARKER_HEADER,
                value: Some(&marker),
            });
            let record: FutureRecord<'_, str, str> = FutureRecord::to(topic)
                .partition(p)
                .payload("")
                .headers(headers);
            producer
                .send(record, Duration::from_secs(30))
                .await
                .map_err(|(e, _)| e)?;
        }
        let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || read_to_markers(&brokers, &topic, partitions, &marker))
            .await?
    }

    fn read_to_markers(
        brokers: &str,
        topic: &str,
        partitions: i32,
        marker: &str,
    ) -> Result<Vec<Received>, BoxError> {
        let consumer: BaseConsumer = consumer_from_start(brokers, topic, partitions)?;
        let mut done = vec![false; partitions as usize];
        let mut by_partition: Vec<Vec<Received>> = vec![Vec::new(); partitions as usize];
        let start = Instant::now();
        while done.iter().any(|d| !d) {
            if start.elapsed() > READ_LIMIT {
                return Err(format!(
                    "end markers of {topic} did not arrive; partitions done: {done:?}"
                )
                .into());
            }
            let Some(polled) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let m = polled?;
            let p = m.partition() as usize;
            if let Some(value) = header(&m, MARKER_HEADER) {
                // Markers of earlier reads are skipped; this read's marker ends the partition.
                if value == marker {
                    done[p] = true;
                }
                continue;
            }
            if done[p] {
                continue;
            }
            by_partition[p].push(Received {
                id: message_id(&m).unwrap_or_default(),
                payload: m.payload().unwrap_or_default().to_vec(),
                key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                content_type: header(&m, "content-type"),
            });
        }
        Ok(by_partition.into_iter().flatten().collect())
    }
}

/// Redis Streams: read a stream key back with XRANGE, delete it.
pub mod redis {
    use super::{BoxError, Received};

    /// One stream entry: its id and its (field, value) pairs.
    type Entry = (String, Vec<(String, Vec<u8>)>);

    async fn connection(url: &str) -> Result<::redis::aio::MultiplexedConnection, BoxError> {
        Ok(::redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?)
    }

    /// Every entry of the stream at `key`, oldest first.
    pub async fn read_stream(url: &str, key: &str) -> Result<Vec<Received>, BoxError> {
        read_stream_with(&mut connection(url).await?, key).await
    }

    /// [`read_stream`] through an existing connection (e.g. a Redis Cluster client).
    pub async fn read_stream_with<C>(con: &mut C, key: &str) -> Result<Vec<Received>, BoxError>
    where
        C: ::redis::aio::ConnectionLike + Send,
    {
        let entries: Vec<Entry> = ::redis::cmd("XRANGE")
            .arg(key)
            .arg("-")
            .arg("+")
            .query_async(con)
            .await?;
        Ok(entries
            .into_iter()
            .map(|(_, fields)| {
                let field = |name: &str| {
                    fields
                        .iter()
                        .find(|(n, _)| n == name)
                        .map(|(_, v)| v.clone())
                };
                let text =
                    |name: &str| field(name).map(|v| String::from_utf8_lossy(&v).into_owned());
                Received {
                    id: text("id").unwrap_or_default(),
                    payload: field("payload").unwrap_or_default(),
                    key: text("partition_key"),
                    content_type: text("content_type"),
                }
            })
            .collect())
    }

    /// Wait up to `block` for entries of the stream at `key` after entry `last` (`0` for the
    /// first), and return their message ids; `last` moves to the newest entry read. An empty
    /// list means nothing arrived in time.
    pub async fn ids_after(
        url: &str,
        key: &str,
        last: &mut String,
        block: std::time::Duration,
    ) -> Result<Vec<String>, BoxError> {
        let mut con = connection(url).await?;
        let reply: Option<Vec<(String, Vec<Entry>)>> = ::redis::cmd("XREAD")
            .arg("BLOCK")
            // 0 would block forever.
            .arg(u64::try_from(block.as_millis().max(1)).unwrap_or(u64::MAX))
            .arg("STREAMS")
            .arg(key)
            .arg(last.as_str())
            .query_async(&mut con)
            .await?;
        let mut ids = Vec::new();
        for (_, entries) in reply.unwrap_or_default() {
            for (entry_id, fields) in entries {
                if let Some((_, id)) = fields.iter().find(|(n, _)| n == "id") {
                    ids.push(String::from_utf8_lossy(id).into_owned());
                }
                *last = entry_id;
            }
        }
        Ok(ids)
    }

    /// How many entries the stream at `key` holds.
    pub async fn stream_len(url: &str, key: &str) -> Result<u64, BoxError> {
        let mut con = connection(url).await?;
        Ok(::redis::cmd("XLEN").arg(key).query_async(&mut con).await?)
    }

    /// Delete `key` so the shared server does not fill up.
    pub async fn delete(url: &str, key: &str) -> Result<(), BoxError> {
        let mut con = connection(url).await?;
        let _: i64 = ::redis::cmd("DEL").arg(key).query_async(&mut con).await?;
        Ok(())
    }
}
