//! The Kafka consumer against Tansu (`OUTBOX_TEST_KAFKA_BROKERS`), each test on its own topic
//! and group, fed by the project's own Kafka publisher.

mod common;
// The Kafka publisher's test helpers: topic creation and a reader that assigns partitions
// directly (no group).
#[path = "../../publisher-kafka/tests/common/mod.rs"]
mod kafka_common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use kafka_common::{consume, create_topic, unique_topic};
use outbox_conformance_tests::env::service_url;
use outbox_consumer::kafka::{KafkaConsumer, KafkaConsumerConfig, KafkaConsumerConfigBuilder};
use outbox_consumer::{CancellationToken, Source, DEAD_ATTEMPTS, DEAD_REASON, DEAD_SOURCE};
use outbox_publisher_kafka::{KafkaConfig, KafkaPublisher};
use outbox_routing::{Envelope, EnvelopeMode};
use outbox_traits::{Message, PublishOutcome, Publisher};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const VAR: &str = "OUTBOX_TEST_KAFKA_BROKERS";
const PARTITIONS: i32 = 3;

struct Fixture {
    brokers: String,
    topic: String,
    publisher: KafkaPublisher,
}

async fn fixture() -> Option<Fixture> {
    let brokers = service_url(VAR)?;
    let topic = unique_topic("consumer");
    create_topic(&brokers, &topic, PARTITIONS).await;
    let publisher = KafkaPublisher::new(
        KafkaConfig::builder(brokers.clone())
            .topic(&topic)
            .build()
            .unwrap(),
    )
    .unwrap();
    Some(Fixture {
        brokers,
        topic,
        publisher,
    })
}

impl Fixture {
    fn config(&self, group: &str) -> KafkaConsumerConfigBuilder {
        // Tansu: group joins take about half the session timeout.
        KafkaConsumerConfig::builder(self.brokers.clone(), &self.topic, group)
            .property("session.timeout.ms", "6000")
    }

    async fn publish(&self, batch: &[Message]) {
        let outcomes = self.publisher.publish(batch).await;
        assert!(
            outcomes.iter().all(|o| *o == PublishOutcome::Acked),
            "{outcomes:?}"
        );
    }

    /// Publish `batch` to the same topic in a CloudEvents envelope (`mode`).
    async fn publish_in(&self, mode: EnvelopeMode, batch: &[Message]) {
        let config = KafkaConfig::builder(self.brokers.clone())
            .topic(&self.topic)
            .envelope(Envelope::new(mode))
            .build()
            .unwrap();
        let outcomes = KafkaPublisher::new(config).unwrap().publish(batch).await;
        assert!(
            outcomes.iter().all(|o| *o == PublishOutcome::Acked),
            "{outcomes:?}"
        );
    }

    /// The group's committed offset of each partition (absent: none committed).
    fn committed(&self, group: &str) -> HashMap<i32, i64> {
        let reader: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", group)
            .create()
            .unwrap();
        let mut list = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            list.add_partition(&self.topic, p);
        }
        let committed = reader
            .committed_offsets(list, Duration::from_secs(10))
            .unwrap();
        committed
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some((e.partition(), o)),
                _ => None,
            })
            .collect()
    }

    /// Wait until the group's committed offsets are exactly `expected`.
    async fn committed_to(&self, group: &str, expected: &HashMap<i32, i64>) {
        eventually("offsets committed after the handler", || async move {
            (self.committed(group) == *expected).then_some(())
        })
        .await;
    }
}

/// The next offset of each partition after the given records.
fn after(records: impl IntoIterator<Item = (i32, i64)>) -> HashMap<i32, i64> {
    let mut next = HashMap::new();
    for (p, o) in records {
        let at = next.entry(p).or_insert(o + 1);
        *at = (*at).max(o + 1);
    }
    next
}

fn position(d: &outbox_consumer::Delivery) -> (i32, i64) {
    match d.source {
        Source::Kafka {
            partition, offset, ..
        } => (partition, offset),
        ref other => panic!("not a Kafka source: {other:?}"),
    }
}

#[tokio::test]
async fn decodes_what_the_publisher_wrote_and_commits_after_the_handler() {
    let Some(f) = fixture().await else { return };
    let mut batch: Vec<Message> = (0..6)
        .map(|i| {
            let key = ["k1", "k2", "k3"][i % 3];
            message(
                Some(key),
                i as i64,
                serde_json::json!({"i": i, "f": 1.5, "s": [key]}),
            )
        })
        .collect();
    batch[1].headers.clear();
    batch.push(message(None, 7, serde_json::json!(null)));
    batch.push(binary_message(Some("k2"), 8));
    batch.push(binary_message(None, 9));
    f.publish(&batch).await;
    // Binary payloads in both CloudEvents modes: the body, and data_base64.
    let ce_binary = binary_message(Some("ce"), 10);
    let ce_structured = binary_message(Some("ce"), 11);
    f.publish_in(EnvelopeMode::CloudEvents, std::slice::from_ref(&ce_binary))
        .await;
    f.publish_in(
        EnvelopeMode::CloudEventsStructured,
        std::slice::from_ref(&ce_structured),
    )
    .await;
    batch.extend([ce_binary, ce_structured]);

    let (handler, mut calls) = Scripted::new();
    let consumer = KafkaConsumer::connect(f.config("decode").build().unwrap())
        .await
        .unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let seen = calls_until(&mut calls, |c| c.len() >= batch.len()).await;
    for msg in &batch {
        let got = of(&seen, msg.id);
        assert_eq!(got.len(), 1, "{} handled once", msg.id);
        assert_decoded(got[0], msg);
    }
    // Per-key order: a key's messages in publishing order.
    for key in ["k1", "k2", "k3"] {
        let published: Vec<_> = batch
            .iter()
            .filter(|m| m.partition_key.as_deref() == Some(key))
            .map(|m| m.id)
            .collect();
        let handled: Vec<_> = seen
            .iter()
            .filter(|c| c.delivery.partition_key.as_deref() == Some(key))
            .map(|c| c.delivery.message_id)
            .collect();
        assert_eq!(handled, published, "order of {key}");
    }
    let expected = after(seen.iter().map(|c| position(&c.delivery)));
    f.committed_to("decode", &expected).await;
    task.abort();
}

#[tokio::test]
async fn retries_then_commits_and_dead_letters_poison_and_undecodable_ones() {
    let Some(f) = fixture().await else { return };
    // One key: every message in one partition, so the ones after a poison message prove it
    // did not stop the partition.
    let flaky = message(Some("k"), 1, serde_json::json!({"n": 1}));
    let poison = message(Some("k"), 2, serde_json::json!({"n": 2}));
    let hopeless = message(Some("k"), 3, serde_json::json!({"n": 3}));
    f.publish(&[flaky.clone(), poison.clone(), hopeless.clone()])
        .await;
    // A record no outbox publisher wrote, in the same partition (same key).
    let raw: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &f.brokers)
        .create()
        .unwrap();
    let (raw_partition, raw_offset) = raw
        .send(
            FutureRecord::to(&f.topic).key("k").payload("not json {"),
            Duration::from_secs(10),
        )
        .await
        .map(|d| (d.partition, d.offset))
        .unwrap();
    let after_all = message(Some("k"), 4, serde_json::json!({"n": 4}));
    f.publish(std::slice::from_ref(&after_all)).await;

    let (handler, mut calls) = Scripted::new();
    handler.plan(flaky.id, Plan::FailFirst(2));
    handler.plan(poison.id, Plan::Poison);
    handler.plan(hopeless.id, Plan::AlwaysFail);
    let consumer =
        KafkaConsumer::connect(f.config("retry").options(fast_options(3)).build().unwrap())
            .await
            .unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let seen = calls_until(&mut calls, |c| of(c, after_all.id).len() == 1).await;
    let attempts: Vec<u32> = of(&seen, flaky.id).iter().map(|d| d.attempt).collect();
    assert_eq!(attempts, vec![1, 2, 3]);
    assert_eq!(of(&seen, poison.id).len(), 1);
    assert_eq!(of(&seen, hopeless.id).len(), 3);
    let mut positions: Vec<(i32, i64)> = seen.iter().map(|c| position(&c.delivery)).collect();
    positions.push((raw_partition, raw_offset));
    f.committed_to("retry", &after(positions)).await;

    let dead = consume(&f.brokers, &format!("{}.dead", f.topic), 1, 3);
    let by_id = |id: uuid::Uuid| {
        dead.iter()
            .find(|r| r.header("message-id") == Some(id.to_string().as_str()))
            .unwrap_or_else(|| panic!("no dead letter for {id}"))
    };
    let r = by_id(poison.id);
    assert_eq!(r.payload, poison.payload.as_bytes());
    assert_eq!(r.key.as_deref(), Some(&b"k"[..]));
    assert_eq!(r.header(DEAD_ATTEMPTS), Some("1"));
    assert!(r
        .header(DEAD_REASON)
        .unwrap()
        .contains("poison: cannot apply"));
    assert_eq!(
        r.header("traceparent"),
        Some(poison.headers["traceparent"].as_str())
    );
    let r = by_id(hopeless.id);
    assert_eq!(r.header(DEAD_ATTEMPTS), Some("3"));
    assert!(r
        .header(DEAD_REASON)
        .unwrap()
        .contains("gave up after 3 attempts"));
    let r = dead
        .iter()
        .find(|r| r.header("message-id").is_none())
        .expect("the undecodable record is dead-lettered");
    assert_eq!(r.payload, b"not json {");
    assert_eq!(r.header(DEAD_ATTEMPTS), Some("0"));
    assert!(r.header(DEAD_REASON).unwrap().contains("no \"message-id\""));
    assert!(r
        .header(DEAD_SOURCE)
        .unwrap()
        .contains(&format!("offset {raw_offset}")));
    task.abort();
}

#[tokio::test]
async fn a_record_uncommitted_by_a_dead_consumer_goes_to_the_next_in_the_group() {
    let Some(f) = fixture().await else { return };
    let msg = message(Some("k"), 1, serde_json::json!({"n": 1}));
    f.publish(std::slice::from_ref(&msg)).await;

    let (first, mut first_calls) = Scripted::new();
    first.plan(msg.id, Plan::Hang);
    let consumer = KafkaConsumer::connect(f.config("crash").build().unwrap())
        .await
        .unwrap();
    let task = tokio::spawn(consumer.run(first));
    let seen = calls_until(&mut first_calls, |c| !c.is_empty()).await;
    let (partition, offset) = position(&seen[0].delivery);
    assert!(
        f.committed("crash").is_empty(),
        "nothing committed while the handler runs"
    );
    // Dropping the consumer closes it: it leaves the group, which hands the partition on.
    task.abort();
    let _ = task.await;

    let (second, mut second_calls) = Scripted::new();
    let consumer = KafkaConsumer::connect(f.config("crash").build().unwrap())
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(consumer.run_until(second, shutdown.clone()));
    let seen = calls_until(&mut second_calls, |c| !c.is_empty()).await;
    assert_eq!(seen[0].delivery.message_id, msg.id);
    f.committed_to("crash", &HashMap::from([(partition, offset + 1)]))
        .await;
    shutdown.cancel();
    task.await.unwrap();
}
