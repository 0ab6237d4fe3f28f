//! The shared publisher conformance suite, run against Tansu (`OUTBOX_TEST_KAFKA_BROKERS`).

mod common;

use std::time::{Duration, Instant};

use common::{create_topic, unique_topic, CONSUME_LIMIT};
use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::publisher::{
    run_publisher_suite, BrokerReader, PublisherHarness, ReceivedMessage,
};
use outbox_publisher_kafka::{KafkaConfig, KafkaPublisher};
use outbox_routing::HEADER_MESSAGE_ID;
use outbox_traits::{async_trait, Error, Publisher};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const PARTITIONS: i32 = 3;

struct Harness {
    brokers: String,
}

/// Reads everything stored in a topic so far (assigned directly, no consumer group).
///
/// Tansu's end offsets (high watermarks) do not track the record count, so the reader cannot ask
/// where a partition ends. Instead it appends a marker record to every partition and reads each
/// partition up to its marker: a partition keeps its order, so every record stored before the
/// read precedes the marker.
struct KafkaReader {
    brokers: String,
    topic: String,
}

/// Header that tells the reader's end markers from published messages.
const MARKER_HEADER: &str = "outbox-test-end-marker";

#[async_trait]
impl BrokerReader for KafkaReader {
    async fn read_all(&self) -> Result<Vec<ReceivedMessage>, Error> {
        let marker = uuid::Uuid::new_v4().to_string();
        append_markers(&self.brokers, &self.topic, &marker).await?;
        let (brokers, topic) = (self.brokers.clone(), self.topic.clone());
        tokio::task::spawn_blocking(move || read_to_markers(&brokers, &topic, &marker))
            .await
            .map_err(|e| Error::transient(format!("reader task failed: {e}"), None))?
    }
}

fn fail(e: rdkafka::error::KafkaError) -> Error {
    Error::transient(format!("reading back: {e}"), None)
}

async fn append_markers(brokers: &str, topic: &str, marker: &str) -> Result<(), Error> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(fail)?;
    for p in 0..PARTITIONS {
        let headers = OwnedHeaders::new().insert(Header {
            key: MARKER_HEADER,
            value: Some(marker),
        });
        let record: FutureRecord<'_, str, str> = FutureRecord::to(topic)
            .partition(p)
            .payload("")
            .headers(headers);
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| fail(e))?;
    }
    Ok(())
}

fn read_to_markers(
    brokers: &str,
    topic: &str,
    marker: &str,
) -> Result<Vec<ReceivedMessage>, Error> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique_topic("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .map_err(fail)?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .map_err(fail)?;
    }
    consumer.assign(&tpl).map_err(fail)?;
    let mut done = vec![false; PARTITIONS as usize];
    let mut by_partition: Vec<Vec<ReceivedMessage>> = vec![Vec::new(); PARTITIONS as usize];
    let start = Instant::now();
    while done.iter().any(|d| !d) {
        if start.elapsed() > CONSUME_LIMIT {
            return Err(Error::transient(
                format!("end markers of {topic} did not arrive; partitions done: {done:?}"),
                None,
            ));
        }
        let Some(polled) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = polled.map_err(fail)?;
        let p = m.partition() as usize;
        let headers: Vec<(String, String)> = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        let v = String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned();
                        (h.key.to_owned(), v)
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some((_, value)) = headers.iter().find(|(n, _)| n == MARKER_HEADER) {
            // Markers of earlier reads are skipped; this read's marker ends the partition.
            if value == marker {
                done[p] = true;
            }
            continue;
        }
        if done[p] {
            continue;
        }
        let id = headers
            .iter()
            .find(|(n, _)| n == HEADER_MESSAGE_ID)
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        by_partition[p].push(ReceivedMessage {
            id,
            payload: m.payload().unwrap_or_default().to_vec(),
            headers,
            key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
        });
    }
    Ok(by_partition.into_iter().flatten().collect())
}

#[async_trait]
impl PublisherHarness for Harness {
    type Publisher = KafkaPublisher;

    async fn fresh(&self) -> (KafkaPublisher, Box<dyn BrokerReader>) {
        let topic = unique_topic("conf");
        create_topic(&self.brokers, &topic, PARTITIONS).await;
        let config = KafkaConfig::builder(&self.brokers)
            .topic(&topic)
            .message_timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let publisher = KafkaPublisher::new(config).unwrap();
        let reader = KafkaReader {
            brokers: self.brokers.clone(),
            topic,
        };
        (publisher, Box::new(reader))
    }

    fn oversized_payload(&self) -> Option<String> {
        // Over librdkafka's default message.max.bytes (1,000,000): refused before sending.
        Some(format!(r#"{{"big":"{}"}}"#, "x".repeat(2 * 1024 * 1024)))
    }

    fn broker_dedup(&self) -> bool {
        // Kafka's idempotence lasts one producer session; consumers dedup by message-id.
        false
    }

    async fn down(&self) -> (Box<dyn Publisher>, Duration) {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let timeout = Duration::from_millis(1500);
        let config = KafkaConfig::builder(format!("127.0.0.1:{port}"))
            .topic("down")
            .message_timeout(timeout)
            .build()
            .unwrap();
        (Box::new(KafkaPublisher::new(config).unwrap()), timeout)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_passes_the_publisher_conformance_suite() {
    let Some(brokers) = service_url("OUTBOX_TEST_KAFKA_BROKERS") else {
        return;
    };
    run_publisher_suite(&Harness { brokers }).await;
}
