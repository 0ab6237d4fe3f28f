//! The same program relays the same kind of outbox to NATS, Kafka (Tansu) and Redis, changing
//! only the broker URL; each run is read back with that broker's own client.

use outbox_conformance_tests::env::service_url;
use outbox_e2e::{check_delivery, kafka, nats, redis, unique_suffix, Expected, Received};
use outbox_example_relay_anywhere::{run, Summary};

const ORDERS: usize = 60;

fn expected(summary: &Summary) -> Vec<Expected> {
    summary
        .committed
        .iter()
        .map(|e| Expected {
            id: e.id.clone(),
            key: Some(e.key.clone()),
            payload: e.payload.clone().into_bytes(),
        })
        .collect()
}

/// Every committed order arrived exactly once (by message id), byte-equal and in per-customer
/// order, and no rolled-back one did.
fn assert_delivered(summary: &Summary, received: &[Received]) {
    assert_eq!(summary.committed.len(), ORDERS - ORDERS / 5);
    assert_eq!(summary.rolled_back.len(), ORDERS / 5);
    assert_eq!(summary.stats.published as usize, summary.committed.len());
    assert_eq!(summary.counts.published as usize, summary.committed.len());
    assert_eq!(summary.counts.pending, 0);
    assert_eq!(summary.counts.dead, 0);
    for id in &summary.rolled_back {
        assert!(
            !received.iter().any(|r| &r.id == id),
            "rolled-back message {id} reached {}",
            summary.broker
        );
    }
    let delivery = check_delivery(received, &expected(summary))
        .unwrap_or_else(|e| panic!("{}: {e}", summary.broker));
    assert_eq!(delivery.distinct, summary.committed.len());
    assert_eq!(delivery.duplicates, 0, "{}", summary.broker);
}

#[tokio::test]
async fn relays_to_nats() {
    let Some(url) = service_url("OUTBOX_TEST_NATS_URL") else {
        return;
    };
    let s = unique_suffix();
    let stream = format!("RA_{s}");
    let broker = format!(
        "{url}?subject=ra{s}.{{aggregate_type}}.{{event_type}}&stream={stream}&create_stream=true"
    );
    let dir = tempfile::tempdir().unwrap();
    let summary = run(&dir.path().join("outbox.sqlite"), ORDERS, &broker)
        .await
        .unwrap();
    let received = nats::read_stream(&url, &stream).await.unwrap();
    nats::delete_stream(&url, &stream).await.unwrap();
    assert_delivered(&summary, &received);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_to_kafka() {
    let Some(brokers) = service_url("OUTBOX_TEST_KAFKA_BROKERS") else {
        return;
    };
    let topic = format!("ra-{}", unique_suffix());
    kafka::create_topic(&brokers, &topic, 3).await.unwrap();
    let broker = format!("kafka://{brokers}?topic={topic}");
    let dir = tempfile::tempdir().unwrap();
    let summary = run(&dir.path().join("outbox.sqlite"), ORDERS, &broker)
        .await
        .unwrap();
    let received = kafka::read_topic(&brokers, &topic, 3).await.unwrap();
    kafka::delete_topic(&brokers, &topic).await.unwrap();
    assert_delivered(&summary, &received);
}

#[tokio::test]
async fn relays_to_redis() {
    let Some(url) = service_url("OUTBOX_TEST_REDIS_URL") else {
        return;
    };
    let stream = format!("ra-{}", unique_suffix());
    let broker = format!("{url}?stream={stream}");
    let dir = tempfile::tempdir().unwrap();
    let summary = run(&dir.path().join("outbox.sqlite"), ORDERS, &broker)
        .await
        .unwrap();
    let received = redis::read_stream(&url, &stream).await.unwrap();
    redis::delete(&url, &stream).await.unwrap();
    assert_delivered(&summary, &received);
}

#[tokio::test]
async fn a_bad_broker_url_fails_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.sqlite");
    // Each error names the valid choices: the schemes, or the broker's options.
    for (url, choices) in [
        (
            "amqp://guest:secret@localhost",
            &["stdout://", "nats://", "kafka://", "redis://"][..],
        ),
        (
            "nats://127.0.0.1:4222?colour=red",
            &["subject", "stream", "timeout_ms"][..],
        ),
        (
            "kafka://127.0.0.1:9092?topic=t&colour=red",
            &["topic", "librdkafka"][..],
        ),
        (
            "redis://127.0.0.1:6379?stream=s&colour=red",
            &["stream", "maxlen"][..],
        ),
    ] {
        let err = run(&db, ORDERS, url).await.unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, outbox::Error::InvalidInput(_)),
            "{url}: {text}"
        );
        assert!(!text.contains("secret"), "{text}");
        for choice in choices {
            assert!(
                text.contains(choice),
                "{url}: {text} does not name {choice}"
            );
        }
    }
    assert!(!db.exists(), "nothing may be written for a bad broker URL");
}

/// The binary, run three times with the same arguments, reaches each broker when only
/// `OUTBOX_BROKER_URL` changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_switches_broker_by_the_environment_variable_alone() {
    let (Some(nats_url), Some(brokers), Some(redis_url)) = (
        service_url("OUTBOX_TEST_NATS_URL"),
        service_url("OUTBOX_TEST_KAFKA_BROKERS"),
        service_url("OUTBOX_TEST_REDIS_URL"),
    ) else {
        return;
    };
    let s = unique_suffix();
    let (stream, topic, key) = (format!("RB_{s}"), format!("rb-{s}"), format!("rb-{s}"));
    kafka::create_topic(&brokers, &topic, 3).await.unwrap();
    let urls = [
        format!("{nats_url}?subject=rb{s}.{{event_type}}&stream={stream}&create_stream=true"),
        format!("kafka://{brokers}?topic={topic}"),
        format!("{redis_url}?stream={key}"),
    ];
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.sqlite");
    for url in &urls {
        let mut command =
            std::process::Command::new(env!("CARGO_BIN_EXE_outbox-example-relay-anywhere"));
        command
            .arg(&db)
            .arg("20")
            .env(outbox_example_relay_anywhere::BROKER_URL_VAR, url);
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .unwrap()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{url}: {stderr}");
        assert!(stderr.contains("16 messages published"), "{url}: {stderr}");
    }
    let read = [
        nats::read_stream(&nats_url, &stream).await.unwrap(),
        kafka::read_topic(&brokers, &topic, 3).await.unwrap(),
        redis::read_stream(&redis_url, &key).await.unwrap(),
    ];
    nats::delete_stream(&nats_url, &stream).await.unwrap();
    kafka::delete_topic(&brokers, &topic).await.unwrap();
    redis::delete(&redis_url, &key).await.unwrap();
    for (url, received) in urls.iter().zip(read) {
        let ids: std::collections::HashSet<_> = received.iter().map(|r| r.id.clone()).collect();
        assert_eq!((received.len(), ids.len()), (16, 16), "{url}");
        for r in &received {
            let payload: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
            assert_eq!(payload["customer"].as_str(), r.key.as_deref(), "{url}");
        }
    }
}
