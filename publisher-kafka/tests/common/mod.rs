//! Helpers shared by the Kafka publisher's integration tests.
#![allow(dead_code, missing_docs)]

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::Utc;
use outbox_traits::Message;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use uuid::Uuid;

/// The longest a test waits for records to arrive before it fails (an upper bound for a
/// failure report, not a timed assertion: passing tests return as soon as the records are in).
pub const CONSUME_LIMIT: Duration = Duration::from_secs(60);

/// A unique topic name for one test.
pub fn unique_topic(prefix: &str) -> String {
    format!("outbox-test-{prefix}-{}", Uuid::new_v4().simple())
}

/// A claimed message as a store would hand it to the relay.
pub fn message(key: Option<&str>, seq: i64, payload: &str) -> Message {
    Message {
        id: Uuid::now_v7(),
        seq,
        aggregate_type: "order".into(),
        aggregate_id: key.unwrap_or("none").into(),
        event_type: "order.placed".into(),
        payload: payload.into(),
        binary: None,
        headers: BTreeMap::new(),
        partition_key: key.map(str::to_owned),
        dedup_key: None,
        attempts: 0,
        created_at: Utc::now(),
    }
}

/// Create `topic` with `partitions` partitions and wait until the broker knows it.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create_topics request");
    for r in results {
        r.expect("topic created");
    }
}

/// A record read back from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| std::str::from_utf8(v).expect("utf-8 header"))
    }
}

/// Read `expected` records from all `partitions` of `topic` (assigned directly, no consumer
/// group), in partition offset order.
pub fn consume(brokers: &str, topic: &str, partitions: i32, expected: usize) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("outbox-test-{}", Uuid::new_v4().simple()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition offset");
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::with_capacity(expected);
    let start = std::time::Instant::now();
    while out.len() < expected {
        assert!(
            start.elapsed() < CONSUME_LIMIT,
            "only {} of {expected} records arrived in {topic}",
            out.len()
        );
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(e)) => panic!("consume error: {e}"),
            Some(Ok(m)) => {
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                            .collect()
                    })
                    .unwrap_or_default();
                out.push(Record {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(<[u8]>::to_vec),
                    payload: m.payload().unwrap_or_default().to_vec(),
                    headers,
                });
            }
        }
    }
    out
}
