//! Injected faults, through librdkafka's built-in mock cluster (no external server): request
//! timeouts, leader changes, refused messages, brokers going down, fatal producer errors.

mod common;

use std::time::Duration;

use common::{consume, message};
use outbox_publisher_kafka::{KafkaConfig, KafkaPublisher};
use outbox_traits::{ErrorKind, Message, PublishOutcome, Publisher};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::RDKafkaApiKey;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientConfig;

const TOPIC: &str = "mocked";

fn cluster(brokers: i32, partitions: i32) -> MockCluster<'static, DefaultProducerContext> {
    let cluster = MockCluster::new(brokers).expect("mock cluster");
    cluster
        .create_topic(TOPIC, partitions, brokers)
        .expect("mock topic");
    cluster
}

fn publisher(
    cluster: &MockCluster<'static, DefaultProducerContext>,
    timeout: Duration,
    extra: &[(&str, &str)],
) -> KafkaPublisher {
    let mut config = KafkaConfig::builder(cluster.bootstrap_servers())
        .topic(TOPIC)
        .message_timeout(timeout);
    for (k, v) in extra {
        config = config.property(*k, *v);
    }
    KafkaPublisher::new(config.build().expect("config")).expect("publisher")
}

fn batch(keys: &[&str], per_key: usize) -> Vec<Message> {
    let mut out = Vec::new();
    for n in 0..per_key {
        for k in keys {
            out.push(message(
                Some(k),
                out.len() as i64,
                &format!("{{\"n\":{n}}}"),
            ));
        }
    }
    out
}

/// How many records the mock cluster holds for `TOPIC` (its watermarks are exact).
fn stored(cluster: &MockCluster<'static, DefaultProducerContext>, partitions: i32) -> i64 {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .create()
        .expect("consumer");
    (0..partitions)
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(TOPIC, p, Duration::from_secs(10))
                .expect("watermarks");
            high - low
        })
        .sum()
}

fn ids(records: &[common::Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| r.header("message-id").unwrap().to_owned())
        .collect()
}

fn is_kind(o: &PublishOutcome, want: ErrorKind) -> bool {
    matches!(o, PublishOutcome::Failed { kind, .. } if *kind == want)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeouts_disconnects_and_leader_changes_are_retried_transparently_in_order() {
    let cluster = cluster(1, 1);
    let publisher = publisher(&cluster, Duration::from_secs(20), &[]);
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
        ],
    );
    let batch = batch(&["a", "b", "c"], 20);
    let outcomes = publisher.publish(&batch).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );

    // Stored exactly once each, in batch order (one partition holds every key).
    let records = consume(&cluster.bootstrap_servers(), TOPIC, 1, batch.len());
    let want: Vec<String> = batch.iter().map(|m| m.id.to_string()).collect();
    assert_eq!(ids(&records), want);
    assert_eq!(stored(&cluster, 1), batch.len() as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_outlives_its_timeout_in_flight_is_ambiguous_then_recovers() {
    let cluster = cluster(1, 1);
    // Every request takes longer than the message timeout.
    cluster
        .broker_round_trip_time(1, Duration::from_millis(3000))
        .unwrap();
    let publisher = publisher(&cluster, Duration::from_millis(1000), &[]);
    let first = batch(&["a", "b"], 3);
    let outcomes = publisher.publish(&first).await;
    assert_eq!(outcomes.len(), first.len());
    // The head of each key carries the outcome; later messages of the key are given back.
    assert!(
        matches!(outcomes[0], PublishOutcome::Ambiguous { .. }),
        "{:?}",
        outcomes[0]
    );
    assert!(
        matches!(outcomes[1], PublishOutcome::Ambiguous { .. }),
        "{:?}",
        outcomes[1]
    );
    assert!(outcomes[2..]
        .iter()
        .all(|o| *o == PublishOutcome::NotAttempted));

    cluster
        .broker_round_trip_time(1, Duration::from_millis(0))
        .unwrap();
    let again = publish_until_acked(&publisher, &first).await;
    assert!(again.iter().all(PublishOutcome::is_acked), "{again:?}");
}

/// Publish `batch` again as a relay would after a failed round (at most a few rounds, each
/// bounded by the message timeout), until every message is acknowledged; the last outcomes.
/// Recovery right after a fault may need a round while librdkafka reconnects or drains
/// requests still in flight from before.
async fn publish_until_acked(publisher: &KafkaPublisher, batch: &[Message]) -> Vec<PublishOutcome> {
    let mut outcomes = Vec::new();
    for _round in 0..5 {
        outcomes = publisher.publish(batch).await;
        if outcomes.iter().all(PublishOutcome::is_acked) {
            break;
        }
    }
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_over_the_local_size_limit_fails_alone() {
    let cluster = cluster(1, 2);
    let publisher = publisher(
        &cluster,
        Duration::from_secs(20),
        &[("message.max.bytes", "10000")],
    );
    let big = format!("{{\"x\":\"{}\"}}", "y".repeat(20_000));
    let batch = vec![
        message(Some("a"), 1, "{}"),
        message(Some("a"), 2, &big),
        message(Some("a"), 3, "{}"),
        message(Some("b"), 4, "{}"),
        message(None, 5, "{}"),
    ];
    let outcomes = publisher.publish(&batch).await;
    assert_eq!(outcomes[0], PublishOutcome::Acked);
    assert!(
        is_kind(&outcomes[1], ErrorKind::Permanent),
        "{:?}",
        outcomes[1]
    );
    assert_eq!(outcomes[2], PublishOutcome::NotAttempted);
    assert_eq!(outcomes[3], PublishOutcome::Acked);
    assert_eq!(outcomes[4], PublishOutcome::Acked);
    assert_eq!(stored(&cluster, 2), 3);
}

/// The broker refuses a request (MSG_SIZE_TOO_LARGE): that message fails permanently, exactly
/// the acknowledged messages are stored, and with `enable.gapless.guarantee` (the default here)
/// librdkafka raises a fatal error instead of renumbering the key's later messages, so the
/// producer is replaced and the next batch goes through.
///
/// A real broker also refuses the key's later in-flight messages (their sequence numbers skip
/// the refused one), so they are not stored and come back `NotAttempted`. librdkafka's mock
/// broker checks sequences only for transactional producers and stores them; then they are
/// reported `Acked`, truthfully. Either way: acknowledged == stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_refusal_fails_that_message_and_replaces_the_producer() {
    let cluster = cluster(1, 1);
    // One message per request, so the refusal hits exactly the first message.
    let publisher = publisher(
        &cluster,
        Duration::from_secs(20),
        &[("batch.num.messages", "1"), ("linger.ms", "0")],
    );
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let batch = batch(&["a"], 5);
    let outcomes = publisher.publish(&batch).await;
    assert!(
        is_kind(&outcomes[0], ErrorKind::Permanent),
        "{:?}",
        outcomes[0]
    );
    for o in &outcomes[1..] {
        assert!(
            matches!(o, PublishOutcome::Acked | PublishOutcome::NotAttempted),
            "{outcomes:?}"
        );
    }
    let acked: Vec<&Message> = batch
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| o.is_acked())
        .map(|(m, _)| m)
        .collect();
    assert_eq!(stored(&cluster, 1), acked.len() as i64, "acked == stored");
    assert_eq!(publisher.producer_generation(), 1, "producer replaced");

    // The relay gives the not-attempted messages back; they go through after the acked ones.
    let rest: Vec<Message> = batch
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| **o == PublishOutcome::NotAttempted)
        .map(|(m, _)| m.clone())
        .collect();
    let more = [rest.clone(), vec![message(Some("a"), 99, "{}")]].concat();
    let outcomes = publisher.publish(&more).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );
    let total = acked.len() + more.len();
    let records = consume(&cluster.bootstrap_servers(), TOPIC, 1, total);
    let want: Vec<String> = acked
        .iter()
        .map(|m| m.id.to_string())
        .chain(more.iter().map(|m| m.id.to_string()))
        .collect();
    assert_eq!(ids(&records), want);
}

/// Without the gapless guarantee librdkafka bumps the epoch and stores the later messages: the
/// publisher reports them truthfully as acknowledged (this is why gapless is the default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_gapless_later_messages_are_stored_and_reported_acked() {
    let cluster = cluster(1, 1);
    let publisher = publisher(
        &cluster,
        Duration::from_secs(20),
        &[
            ("batch.num.messages", "1"),
            ("linger.ms", "0"),
            ("enable.gapless.guarantee", "false"),
        ],
    );
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let batch = batch(&["a"], 5);
    let outcomes = publisher.publish(&batch).await;
    assert!(
        is_kind(&outcomes[0], ErrorKind::Permanent),
        "{:?}",
        outcomes[0]
    );
    let acked = outcomes.iter().filter(|o| o.is_acked()).count() as i64;
    assert_eq!(stored(&cluster, 1), acked, "acked exactly what is stored");
    assert_eq!(publisher.producer_generation(), 0, "no fatal error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_down_gives_retryable_outcomes_within_the_timeout_then_recovers() {
    let cluster = cluster(1, 1);
    // Reconnect quickly once the broker is back (librdkafka backs off up to 10 s by default).
    let publisher = publisher(
        &cluster,
        Duration::from_millis(2000),
        &[
            ("reconnect.backoff.ms", "20"),
            ("reconnect.backoff.max.ms", "200"),
        ],
    );
    // Connect once while the broker is up, then take it down.
    let warm = publisher.publish(&batch(&["w"], 1)).await;
    assert!(warm[0].is_acked());
    cluster.broker_down(-1).unwrap();

    let down = batch(&["a", "b", "c"], 4);
    let outcomes = publisher.publish(&down).await;
    assert_eq!(outcomes.len(), down.len());
    for o in &outcomes[..3] {
        assert!(
            matches!(o, PublishOutcome::Ambiguous { .. }) || is_kind(o, ErrorKind::Transient),
            "{o:?}"
        );
    }
    assert!(outcomes[3..]
        .iter()
        .all(|o| *o == PublishOutcome::NotAttempted));

    cluster.broker_up(-1).unwrap();
    let outcomes = publish_until_acked(&publisher, &down).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );
}

/// Issue 27: with a message timeout far longer than the outage, a batch sent to brokers that
/// went away does not sit in librdkafka's queue until the timeout: once every broker
/// connection is lost and no broker answers, its messages are purged and reported ambiguous
/// (so the relay checks the broker while it is still down), `check` says down, and the
/// producer is replaced before its next use; once the broker is back the batch goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_brokers_end_the_batch_before_the_message_timeout_and_replace_the_producer() {
    let cluster = cluster(1, 1);
    // Ten minutes: a batch that waited for it would hang the test far past its guard.
    let publisher = publisher(&cluster, Duration::from_secs(600), &[]);
    let warm = publisher.publish(&batch(&["w"], 1)).await;
    assert!(warm[0].is_acked());
    let generation = publisher.producer_generation();
    cluster.broker_down(-1).unwrap();

    let down = batch(&["a", "b"], 2);
    let outcomes = tokio::time::timeout(Duration::from_secs(120), publisher.publish(&down))
        .await
        .expect("publish ended by the outage, not by the message timeout");
    // The head of each key carries the outcome; later messages of the key are given back.
    for o in &outcomes[..2] {
        match o {
            PublishOutcome::Ambiguous { reason } => {
                assert!(
                    reason.contains("every broker connection was lost"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(outcomes[2..]
        .iter()
        .all(|o| *o == PublishOutcome::NotAttempted));
    assert!(
        publisher.check().await.is_err(),
        "check passed with the broker down"
    );
    assert!(publisher.producer_generation() > generation);

    cluster.broker_up(-1).unwrap();
    let outcomes = publish_until_acked(&publisher, &down).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );
}

/// batch's messages become ambiguous, the producer is replaced, the next batch succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fatal_error_replaces_the_producer() {
    let cluster = cluster(1, 1);
    let publisher = publisher(&cluster, Duration::from_secs(20), &[]);
    let warm = publisher.publish(&batch(&["w"], 1)).await;
    assert!(warm[0].is_acked());
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER],
    );
    let first = batch(&["a", "b"], 3);
    let outcomes = publisher.publish(&first).await;
    assert!(
        !outcomes.iter().any(PublishOutcome::is_acked),
        "{outcomes:?}"
    );
    assert!(
        matches!(outcomes[0], PublishOutcome::Ambiguous { .. }),
        "{:?}",
        outcomes[0]
    );
    assert_eq!(publisher.producer_generation(), 1);

    let outcomes = publisher.publish(&first).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );
    assert_eq!(publisher.producer_generation(), 1);
}

/// A local queue smaller than the batch: the publisher waits for its own earlier deliveries to
/// make room instead of failing, and the order holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_local_queue_is_waited_out_not_failed() {
    let cluster = cluster(1, 1);
    let publisher = publisher(
        &cluster,
        Duration::from_secs(20),
        &[("queue.buffering.max.messages", "5")],
    );
    let batch = batch(&["a", "b"], 100);
    let outcomes = publisher.publish(&batch).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );
    let records = consume(&cluster.bootstrap_servers(), TOPIC, 1, batch.len());
    let want: Vec<String> = batch.iter().map(|m| m.id.to_string()).collect();
    assert_eq!(ids(&records), want);
}

/// A topic the client is not authorized to write: a permanent failure for its messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_failure_is_permanent() {
    let cluster = cluster(1, 1);
    let publisher = publisher(&cluster, Duration::from_secs(20), &[]);
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED],
    );
    let outcomes = publisher.publish(&batch(&["a"], 1)).await;
    assert!(is_kind(&outcomes[0], ErrorKind::Permanent), "{outcomes:?}");
    assert_eq!(stored(&cluster, 1), 0);
}

/// A topic that does not exist (and is not created automatically): a permanent failure that
/// says to create it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_topic_is_permanent() {
    let cluster = cluster(1, 1);
    let config = KafkaConfig::builder(cluster.bootstrap_servers())
        .topic("missing")
        .message_timeout(Duration::from_secs(20))
        .property("topic.metadata.propagation.max.ms", "100")
        .build()
        .unwrap();
    cluster
        .topic_error(
            "missing",
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
        )
        .unwrap();
    let publisher = KafkaPublisher::new(config).unwrap();
    let outcomes = publisher.publish(&batch(&["a", "b"], 2)).await;
    match &outcomes[0] {
        PublishOutcome::Failed {
            kind: ErrorKind::Permanent,
            reason,
        } => assert!(reason.contains("create the topic"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(outcomes[2], PublishOutcome::NotAttempted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_batch_has_no_outcomes() {
    let cluster = cluster(1, 1);
    let publisher = publisher(&cluster, Duration::from_secs(5), &[]);
    assert!(publisher.publish(&[]).await.is_empty());
    assert_eq!(stored(&cluster, 1), 0);
}
