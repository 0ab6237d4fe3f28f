//! The Kafka publisher against a real Kafka-compatible broker (Tansu, started by `scripts/tansu`;
//! set `OUTBOX_TEST_KAFKA_BROKERS=127.0.0.1:PORT`).

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{consume, create_topic, message, unique_topic};
use outbox_conformance_tests::env::service_url;
use outbox_publisher_kafka::{KafkaConfig, KafkaPublisher};
use outbox_traits::{Binary, Error, PublishOutcome, Publisher};

fn brokers() -> Option<String> {
    service_url("OUTBOX_TEST_KAFKA_BROKERS")
}

fn publisher(brokers: &str, topic: &str) -> KafkaPublisher {
    let config = KafkaConfig::builder(brokers)
        .topic(topic)
        .message_timeout(Duration::from_secs(20))
        .property("linger.ms", "5")
        .build()
        .expect("config");
    KafkaPublisher::new(config).expect("publisher")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_key_and_headers_arrive_byte_equal() {
    let Some(brokers) = brokers() else { return };
    let topic = unique_topic("bytes");
    create_topic(&brokers, &topic, 1).await;
    let publisher = publisher(&brokers, &topic);

    let mut ordered = message(
        Some("order-ü-42"),
        1,
        r#"{"total":12.5,"note":"ünïcødé \"quoted\"","nested":{"a":[1,2,3]}}"#,
    );
    ordered.headers.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    ordered.headers.insert("tenant".into(), "acme".into());
    // A user header may not override the message id that consumers dedup on.
    ordered.headers.insert("message-id".into(), "forged".into());
    let unordered = message(None, 2, "[]");
    let batch = vec![ordered.clone(), unordered.clone()];

    let outcomes = publisher.publish(&batch).await;
    assert_eq!(outcomes, vec![PublishOutcome::Acked, PublishOutcome::Acked]);

    let records = consume(&brokers, &topic, 1, 2);
    let first = &records[0];
    assert_eq!(first.payload, ordered.payload.as_bytes());
    assert_eq!(first.key.as_deref(), Some("order-ü-42".as_bytes()));
    let expected: Vec<(String, Vec<u8>)> = [
        ("message-id", ordered.id.to_string()),
        ("event-type", "order.placed".into()),
        ("aggregate-type", "order".into()),
        ("aggregate-id", "order-ü-42".into()),
        ("partition-key", "order-ü-42".into()),
        ("tenant", "acme".into()),
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        ),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_owned(), v.into_bytes()))
    .collect();
    assert_eq!(first.headers, expected);

    let second = &records[1];
    assert_eq!(second.payload, b"[]");
    assert_eq!(second.key, None, "an unordered message has no Kafka key");
    assert_eq!(
        second.header("message-id"),
        Some(unordered.id.to_string().as_str())
    );
    assert_eq!(second.header("partition-key"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_payload_is_the_record_value_with_its_content_type() {
    let Some(brokers) = brokers() else { return };
    let topic = unique_topic("binary");
    create_topic(&brokers, &topic, 1).await;
    let publisher = publisher(&brokers, &topic);

    // Not UTF-8: a NUL, 0xff, a lone continuation byte, a truncated sequence.
    let bytes: Vec<u8> = vec![0x00, 0xff, 0x80, 0xc3, 0x28, b'{', 0xe2, 0x82, 0x00];
    let mut msg = message(Some("order-7"), 1, "null");
    msg.binary = Some(Binary::new("application/x-protobuf", bytes.clone()));
    msg.headers.insert("tenant".into(), "acme".into());
    // The content type is the payload's own: a user header of that name is left out.
    msg.headers
        .insert("Content-Type".into(), "text/plain".into());
    let json = message(Some("order-8"), 2, r#"{"n":1}"#);

    let outcomes = publisher.publish(&[msg.clone(), json.clone()]).await;
    assert_eq!(outcomes, vec![PublishOutcome::Acked, PublishOutcome::Acked]);
    let records = consume(&brokers, &topic, 1, 2);
    let record = &records[0];
    assert_eq!(record.payload, bytes, "the value is the bytes, untouched");
    assert_eq!(record.key.as_deref(), Some("order-7".as_bytes()));
    let expected: Vec<(String, Vec<u8>)> = [
        ("message-id", msg.id.to_string()),
        ("event-type", "order.placed".into()),
        ("aggregate-type", "order".into()),
        ("aggregate-id", "order-7".into()),
        ("partition-key", "order-7".into()),
        ("content-type", "application/x-protobuf".into()),
        ("tenant", "acme".into()),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_owned(), v.into_bytes()))
    .collect();
    assert_eq!(record.headers, expected);
    // A JSON message beside it carries no content type, as before binary payloads.
    assert_eq!(records[1].payload, br#"{"n":1}"#);
    assert_eq!(records[1].header("content-type"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_across_many_keys_and_partitions() {
    let Some(brokers) = brokers() else { return };
    let topic = unique_topic("order");
    let partitions = 4;
    create_topic(&brokers, &topic, partitions).await;
    let publisher = publisher(&brokers, &topic);

    let keys = 200;
    let per_key = 25;
    // Interleaved: k0#0, k1#0, ..., k199#0, k0#1, ...
    let mut all = Vec::new();
    for n in 0..per_key {
        for k in 0..keys {
            let key = format!("key-{k}");
            all.push(message(
                Some(&key),
                all.len() as i64,
                &format!("{{\"n\":{n}}}"),
            ));
        }
    }
    for batch in all.chunks(700) {
        let outcomes = publisher.publish(batch).await;
        assert!(
            outcomes.iter().all(PublishOutcome::is_acked),
            "{outcomes:?}"
        );
    }

    let records = consume(&brokers, &topic, partitions, all.len());
    let mut seen: HashMap<Vec<u8>, (i32, Vec<u32>)> = HashMap::new();
    for r in &records {
        let key = r.key.clone().expect("keyed");
        let n: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
        let entry = seen.entry(key).or_insert((r.partition, Vec::new()));
        assert_eq!(entry.0, r.partition, "a key must stay on one partition");
        entry.1.push(n["n"].as_u64().unwrap() as u32);
    }
    assert_eq!(seen.len(), keys);
    let used_partitions: std::collections::HashSet<i32> = seen.values().map(|(p, _)| *p).collect();
    assert!(
        used_partitions.len() > 1,
        "keys should spread over partitions"
    );
    for (key, (_, ns)) in seen {
        let expected: Vec<u32> = (0..per_key as u32).collect();
        assert_eq!(
            ns,
            expected,
            "order of key {:?}",
            String::from_utf8_lossy(&key)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_messages_in_one_pipelined_batch() {
    let Some(brokers) = brokers() else { return };
    let topic = unique_topic("bulk");
    create_topic(&brokers, &topic, 2).await;
    let publisher = publisher(&brokers, &topic);

    let batch: Vec<_> = (0..10_000)
        .map(|i| message(Some(&format!("k{}", i % 100)), i, &format!("{{\"i\":{i}}}")))
        .collect();
    let outcomes = publisher.publish(&batch).await;
    assert_eq!(outcomes.len(), batch.len());
    assert!(outcomes.iter().all(PublishOutcome::is_acked));

    let records = consume(&brokers, &topic, 2, batch.len());
    let ids: std::collections::HashSet<String> = records
        .iter()
        .map(|r| r.header("message-id").unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), batch.len(), "every message exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_template_routes_by_message_fields() {
    let Some(brokers) = brokers() else { return };
    let base = unique_topic("route");
    let (orders, users) = (format!("{base}.order"), format!("{base}.user"));
    create_topic(&brokers, &orders, 1).await;
    create_topic(&brokers, &users, 1).await;
    let publisher = publisher(&brokers, &format!("{base}.{{aggregate_type}}"));

    let mut user = message(Some("u-1"), 1, r#"{"u":1}"#);
    user.aggregate_type = "user".into();
    let order = message(Some("o-1"), 2, r#"{"o":1}"#);
    let outcomes = publisher.publish(&[user.clone(), order.clone()]).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );

    let got_user = consume(&brokers, &users, 1, 1);
    assert_eq!(got_user[0].payload, user.payload.as_bytes());
    let got_order = consume(&brokers, &orders, 1, 1);
    assert_eq!(got_order[0].payload, order.payload.as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_url_and_check_connection_against_the_broker() {
    let Some(brokers) = brokers() else { return };
    let topic = unique_topic("url");
    create_topic(&brokers, &topic, 1).await;
    let config = KafkaConfig::from_url(&format!(
        "kafka://{brokers}?topic={topic}&message.timeout.ms=15000&linger.ms=1&compression.type=lz4"
    ))
    .expect("url");
    assert_eq!(config.message_timeout(), Duration::from_secs(15));
    let publisher = KafkaPublisher::new(config).expect("publisher");
    assert_eq!(publisher.name(), "kafka");
    publisher
        .check_connection(Duration::from_secs(10))
        .await
        .expect("broker reachable");

    let msg = message(Some("k"), 1, r#"{"compressed":true}"#);
    assert_eq!(
        publisher.publish(std::slice::from_ref(&msg)).await,
        vec![PublishOutcome::Acked]
    );
    let records = consume(&brokers, &topic, 1, 1);
    assert_eq!(records[0].payload, msg.payload.as_bytes());
}

/// A broker that is not there: every outcome is a transient or ambiguous failure, returned
/// within the message timeout, and the connection check says `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_broker_gives_retryable_outcomes_without_hanging() {
    // A port on loopback with nothing listening: bind one, note it, close it.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = KafkaConfig::builder(format!("127.0.0.1:{port}"))
        .topic("nowhere")
        .message_timeout(Duration::from_millis(1500))
        .build()
        .unwrap();
    let publisher = KafkaPublisher::new(config).expect("created while the broker is down");
    let batch: Vec<_> = (0..50)
        .map(|i| message(Some(&format!("k{}", i % 5)), i, "{}"))
        .collect();
    let outcomes = publisher.publish(&batch).await;
    assert_eq!(outcomes.len(), batch.len());
    for (i, o) in outcomes.iter().enumerate() {
        match o {
            PublishOutcome::Ambiguous { .. } | PublishOutcome::NotAttempted => {}
            PublishOutcome::Failed { kind, .. } => {
                assert_eq!(*kind, outbox_traits::ErrorKind::Transient, "{i}: {o:?}")
            }
            PublishOutcome::Acked => panic!("{i}: acked with no broker"),
            other => panic!("{i}: unexpected {other:?}"),
        }
    }
    // The first message of each key carries the failure; the key's later ones are given back.
    assert!(
        matches!(outcomes[5], PublishOutcome::NotAttempted),
        "{:?}",
        outcomes[5]
    );
    let err = publisher
        .check_connection(Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_rendered_topic_is_a_permanent_failure_for_that_message_only() {
    let Some(brokers) = brokers() else { return };
    let base = unique_topic("long");
    create_topic(&brokers, &format!("{base}.order"), 1).await;
    let publisher = publisher(&brokers, &format!("{base}.{{aggregate_type}}"));
    let mut too_long = message(Some("a"), 1, "{}");
    too_long.aggregate_type = "x".repeat(300);
    let later_same_key = message(Some("a"), 2, "{}");
    let other = message(Some("b"), 3, "{}");
    let outcomes = publisher.publish(&[too_long, later_same_key, other]).await;
    assert!(
        matches!(&outcomes[0], PublishOutcome::Failed { kind: outbox_traits::ErrorKind::Permanent, reason } if reason.contains("249")),
        "{:?}",
        outcomes[0]
    );
    assert_eq!(outcomes[1], PublishOutcome::NotAttempted);
    assert_eq!(outcomes[2], PublishOutcome::Acked);
}

#[test]
fn secrets_stay_out_of_debug_output() {
    let config = KafkaConfig::from_url(
        "kafka://svc:hunter2@127.0.0.1:9092?security.protocol=sasl_plaintext&sasl.mechanism=PLAIN",
    )
    .unwrap();
    let publisher = KafkaPublisher::new(config).unwrap();
    let shown = format!("{publisher:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("svc"), "{shown}");
}
