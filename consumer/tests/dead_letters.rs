//! `dead_letters` against the real brokers: a consumer (built from its URL) dead-letters some
//! messages, and `dead_letters` on that same URL finds exactly them, newest first, with their
//! reasons; `limit` bounds the list, not the count.

mod common;
// The Kafka publisher's test helpers: topic creation and a reader of every record of a topic.
#[path = "../../publisher-kafka/tests/common/mod.rs"]
mod kafka_common;

use std::time::SystemTime;

use common::*;
use outbox_conformance_tests::env::service_url;
use outbox_consumer::{
    dead_letters, CancellationToken, Consumer, DeadLetter, DeadLetterPosition, DeadLetters, Error,
};
use outbox_traits::{Message, PublishOutcome, Publisher};

/// What every test's consumer does: two attempts at most, no waiting between them, one lane at
/// a time (so the dead letters are written in the order the messages were published).
const OPTIONS: &str = "max_attempts=2&backoff_ms=1&max_backoff_ms=5&concurrency=1";

async fn publish(publisher: &impl Publisher, batch: &[Message]) {
    let outcomes = publisher.publish(batch).await;
    assert!(
        outcomes.iter().all(|o| *o == PublishOutcome::Acked),
        "{outcomes:?}"
    );
}

/// Five messages of one key: poison, fine, always failing, poison, fine. The handler's plan
/// for them and the messages expected in the dead letters, oldest first.
fn scenario(handler: &Scripted) -> (Vec<Message>, Vec<Message>) {
    let batch: Vec<Message> = (1..=5)
        .map(|i| message(Some("k"), i, serde_json::json!({"n": i})))
        .collect();
    handler.plan(batch[0].id, Plan::Poison);
    handler.plan(batch[2].id, Plan::AlwaysFail);
    handler.plan(batch[3].id, Plan::Poison);
    let dead = vec![batch[0].clone(), batch[2].clone(), batch[3].clone()];
    (batch, dead)
}

/// Wait until `url`'s dead-letter destination holds `n` dead letters (polling its count, a
/// bounded read).
async fn until_dead(url: &str, n: u64) {
    eventually(&format!("{n} dead letters"), || async move {
        let found = dead_letters(url, 0).await.ok()?;
        (found.count == n).then_some(())
    })
    .await;
}

/// The reason and attempts the scripted handler causes for `msg`.
fn check_letter(letter: &DeadLetter, msg: &Message, consumer: &str) {
    let id = msg.id.to_string();
    assert_eq!(
        letter.message_id.as_deref(),
        Some(id.as_str()),
        "{letter:?}"
    );
    assert_eq!(letter.consumer.as_deref(), Some(consumer), "{letter:?}");
    assert_eq!(letter.partition_key.as_deref(), Some("k"), "{letter:?}");
    assert_eq!(
        letter.body_bytes,
        msg.payload.len(),
        "body size of {letter:?}"
    );
    let reason = letter.reason.as_deref().unwrap_or_default();
    // The scenario's one message that fails every time has n = 3.
    if msg.seq == 3 {
        assert!(reason.contains("always fails"), "{letter:?}");
        assert_eq!(letter.attempts, Some(2), "{letter:?}");
    } else {
        assert!(reason.contains("poison: cannot apply"), "{letter:?}");
        assert_eq!(letter.attempts, Some(1), "{letter:?}");
    }
    assert!(letter.source.is_some(), "{letter:?}");
    let time = letter.time.expect("a time");
    assert!(time <= SystemTime::now(), "{letter:?}");
}

/// The ids, newest first, and the bound of `limit`.
async fn check_listing(url: &str, all: &DeadLetters, dead: &[Message]) {
    let ids: Vec<Option<String>> = all.letters.iter().map(|l| l.message_id.clone()).collect();
    let expected: Vec<Option<String>> = dead.iter().rev().map(|m| Some(m.id.to_string())).collect();
    assert_eq!(ids, expected, "newest first");
    let two = dead_letters(url, 2).await.unwrap();
    assert_eq!(two.count, all.count, "the count stays the total");
    assert_eq!(two.letters, all.letters[..2], "limit 2: the newest two");
    let none = dead_letters(url, 0).await.unwrap();
    assert_eq!((none.count, none.letters.len()), (all.count, 0));
}

#[tokio::test]
async fn nats_dead_letters_are_counted_and_listed_newest_first() {
    use outbox_publisher_nats::{NatsConfig, NatsPublisher};
    let Some(server) = service_url("OUTBOX_TEST_NATS_URL") else {
        return;
    };
    let s = suffix();
    let stream = format!("D_{s}");
    let publisher = NatsPublisher::connect(
        NatsConfig::from_url(&format!(
            "{server}?subject=d{s}.{{aggregate_type}}.{{partition_key}}&stream={stream}&create_stream=true"
        ))
        .unwrap(),
    )
    .await
    .unwrap();
    let url = format!("{server}?stream={stream}&consumer=dl&{OPTIONS}");

    // No dead-letter stream yet: none, not an error.
    let before = dead_letters(&url, 20).await.unwrap();
    assert_eq!((before.count, before.letters.len()), (0, 0));

    let (handler, _calls) = Scripted::new();
    let (batch, dead) = scenario(&handler);
    publish(&publisher, &batch).await;
    let consumer = Consumer::connect(&url).await.unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(consumer.run_until(handler, shutdown.clone()));
    until_dead(&url, 3).await;

    let all = dead_letters(&url, 20).await.unwrap();
    assert_eq!(all.broker, "nats");
    assert_eq!(all.destination, format!("{stream}_DEAD"));
    assert_eq!(all.count, 3);
    for (letter, msg) in all.letters.iter().zip(dead.iter().rev()) {
        check_letter(letter, msg, "dl");
        assert!(
            letter
                .source
                .as_deref()
                .is_some_and(|s| s.contains(&stream)),
            "{letter:?}"
        );
    }
    let sequences: Vec<_> = all.letters.iter().map(|l| l.position.clone()).collect();
    assert_eq!(
        sequences,
        [3, 2, 1].map(|sequence| DeadLetterPosition::Nats { sequence })
    );
    check_listing(&url, &all, &dead).await;
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn redis_dead_letters_are_counted_and_listed_newest_first() {
    use outbox_publisher_redis::{RedisConfig, RedisPublisher};
    let Some(server) = service_url("OUTBOX_TEST_REDIS_URL") else {
        return;
    };
    let stream = format!("outbox-consumer-test:{}", suffix());
    let publisher = RedisPublisher::connect(
        RedisConfig::from_url(&format!("{server}?stream={stream}")).unwrap(),
    )
    .await
    .unwrap();
    let url = format!("{server}?stream={stream}&group=dl&{OPTIONS}");

    let before = dead_letters(&url, 20).await.unwrap();
    assert_eq!((before.count, before.letters.len()), (0, 0));
    assert_eq!(before.destination, format!("{stream}:dead"));

    let (handler, _calls) = Scripted::new();
    let (batch, dead) = scenario(&handler);
    publish(&publisher, &batch).await;
    // An entry no outbox publisher wrote, after them (a lane of its own, handled after theirs):
    // dead-lettered undecoded, with no id.
    let mut redis = redis::Client::open(server.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("junk")
        .arg("1")
        .query_async(&mut redis)
        .await
        .unwrap();
    let consumer = Consumer::connect(&url).await.unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(consumer.run_until(handler, shutdown.clone()));
    until_dead(&url, 4).await;

    let all = dead_letters(&url, 20).await.unwrap();
    assert_eq!(all.broker, "redis");
    assert_eq!(all.count, 4);
    let ids: Vec<Option<String>> = all.letters.iter().map(|l| l.message_id.clone()).collect();
    let id = |m: &Message| Some(m.id.to_string());
    assert_eq!(
        ids,
        vec![None, id(&dead[2]), id(&dead[1]), id(&dead[0])],
        "newest first"
    );
    for (letter, msg) in all.letters[1..].iter().zip(dead.iter().rev()) {
        check_letter(letter, msg, "dl");
    }
    let junk = &all.letters[0];
    assert_eq!(junk.attempts, Some(0), "{junk:?}");
    assert!(
        junk.reason
            .as_deref()
            .is_some_and(|r| r.contains("undecodable")),
        "{junk:?}"
    );
    let entry_ids: Vec<String> = all
        .letters
        .iter()
        .map(|l| match &l.position {
            DeadLetterPosition::Redis { entry_id } => entry_id.clone(),
            other => panic!("not a Redis position: {other:?}"),
        })
        .collect();
    let mut sorted = entry_ids.clone();
    sorted.sort_by_key(|id| {
        let (ms, seq) = id.split_once('-').unwrap();
        (ms.parse::<u64>().unwrap(), seq.parse::<u64>().unwrap())
    });
    sorted.reverse();
    assert_eq!(entry_ids, sorted, "entry ids descending");

    let two = dead_letters(&url, 2).await.unwrap();
    assert_eq!(two.count, 4);
    assert_eq!(two.letters, all.letters[..2]);
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn kafka_dead_letters_are_counted_and_merged_newest_first_over_partitions() {
    use kafka_common::{consume, create_topic, unique_topic};
    use outbox_publisher_kafka::{KafkaConfig, KafkaPublisher};
    let Some(brokers) = service_url("OUTBOX_TEST_KAFKA_BROKERS") else {
        return;
    };
    let topic = unique_topic("dead-letters");
    create_topic(&brokers, &topic, 3).await;
    let publisher = KafkaPublisher::new(
        KafkaConfig::builder(brokers.clone())
            .topic(&topic)
            .build()
            .unwrap(),
    )
    .unwrap();
    // Tansu: group joins take about half the session timeout.
    let url = format!("kafka://{brokers}?topic={topic}&group=dl&session.timeout.ms=6000&{OPTIONS}");

    let before = dead_letters(&url, 20).await.unwrap();
    assert_eq!((before.count, before.letters.len()), (0, 0));
    assert_eq!(before.destination, format!("{topic}.dead"));
    // A dead-letter topic of three partitions (the consumer keeps an existing one), so that
    // the listing merges partitions.
    let dead_topic = format!("{topic}.dead");
    create_topic(&brokers, &dead_topic, 3).await;

    let (handler, _calls) = Scripted::new();
    // Keys spread over partitions: the dead letters keep their key, hence land apart.
    let batch: Vec<Message> = (1..=6)
        .map(|i| {
            let key = ["k1", "k2", "k3"][(i % 3) as usize];
            message(Some(key), i, serde_json::json!({"n": i}))
        })
        .collect();
    for msg in &batch[..4] {
        handler.plan(msg.id, Plan::Poison);
    }
    publish(&publisher, &batch).await;
    let consumer = Consumer::connect(&url).await.unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(consumer.run_until(handler, shutdown.clone()));
    until_dead(&url, 4).await;

    let all = dead_letters(&url, 20).await.unwrap();
    assert_eq!((all.broker, all.count), ("kafka", 4));
    // Exactly the dead ones, each where the topic holds it.
    let records = consume(&brokers, &dead_topic, 3, 4);
    let mut listed: Vec<(i32, i64, Option<String>)> = all
        .letters
        .iter()
        .map(|l| match l.position {
            DeadLetterPosition::Kafka { partition, offset } => {
                (partition, offset, l.message_id.clone())
            }
            ref other => panic!("not a Kafka position: {other:?}"),
        })
        .collect();
    listed.sort();
    let mut stored: Vec<(i32, i64, Option<String>)> = records
        .iter()
        .map(|r| {
            (
                r.partition,
                r.offset,
                r.header("message-id").map(str::to_owned),
            )
        })
        .collect();
    stored.sort();
    assert_eq!(listed, stored);
    let mut partitions: Vec<i32> = listed.iter().map(|(p, _, _)| *p).collect();
    partitions.dedup();
    assert!(partitions.len() > 1, "one partition only: {listed:?}");
    let mut ids: Vec<String> = all
        .letters
        .iter()
        .filter_map(|l| l.message_id.clone())
        .collect();
    ids.sort();
    let mut expected: Vec<String> = batch[..4].iter().map(|m| m.id.to_string()).collect();
    expected.sort();
    assert_eq!(ids, expected);
    for letter in &all.letters {
        assert!(
            letter
                .reason
                .as_deref()
                .is_some_and(|r| r.contains("poison: cannot apply")),
            "{letter:?}"
        );
        assert_eq!(letter.attempts, Some(1), "{letter:?}");
        assert_eq!(letter.consumer.as_deref(), Some("dl"), "{letter:?}");
        let msg = batch
            .iter()
            .find(|m| Some(m.id.to_string()) == letter.message_id)
            .unwrap();
        assert_eq!(letter.partition_key, msg.partition_key, "{letter:?}");
        assert_eq!(letter.body_bytes, msg.payload.len());
    }
    // Newest first: timestamps never rise; within a partition, offsets fall.
    for pair in all.letters.windows(2) {
        assert!(pair[0].time >= pair[1].time, "{pair:?}");
        if let (
            DeadLetterPosition::Kafka {
                partition: p0,
                offset: o0,
            },
            DeadLetterPosition::Kafka {
                partition: p1,
                offset: o1,
            },
        ) = (&pair[0].position, &pair[1].position)
        {
            if p0 == p1 {
                assert!(o0 > o1, "{pair:?}");
            }
        }
    }
    let two = dead_letters(&url, 2).await.unwrap();
    assert_eq!(two.count, 4);
    assert_eq!(two.letters, all.letters[..2]);
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn an_unreachable_broker_is_named_without_its_secrets() {
    for (url, broker) in [
        (
            "nats://user:s3cret@127.0.0.1:1?stream=S&consumer=c&timeout_ms=500",
            "nats",
        ),
        (
            "redis://:s3cret@127.0.0.1:1?stream=s&group=g&timeout_ms=500",
            "redis",
        ),
        (
            "kafka://user:s3cret@127.0.0.1:1?topic=t&group=g&timeout_ms=500",
            "kafka",
        ),
    ] {
        let err = dead_letters(url, 5).await.unwrap_err();
        assert!(
            matches!(&err, Error::Unavailable { what, .. } if what == broker),
            "{url}: {err:?}"
        );
        let text = format!("{err} {err:?}");
        assert!(!text.contains("s3cret"), "{text}");
    }
    let err = dead_letters("redis://127.0.0.1:1?stream=s&group=g", 10_001)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
}
