//! The Redis Streams consumer against the real server (`OUTBOX_TEST_REDIS_URL`), each test on its
//! own stream and group, fed by the project's own Redis publisher.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use outbox_conformance_tests::env::service_url;
use outbox_consumer::redis::{RedisConsumer, RedisConsumerConfig, RedisConsumerConfigBuilder};
use outbox_consumer::{CancellationToken, Source, DEAD_ATTEMPTS, DEAD_REASON, DEAD_SOURCE};
use outbox_publisher_redis::{RedisConfig, RedisPublisher};
use outbox_traits::{Message, PublishOutcome, Publisher};
use redis::aio::MultiplexedConnection;
use redis::AsyncCommands;

const VAR: &str = "OUTBOX_TEST_REDIS_URL";

struct Fixture {
    url: String,
    stream: String,
    publisher: RedisPublisher,
    redis: MultiplexedConnection,
}

async fn fixture() -> Option<Fixture> {
    let url = service_url(VAR)?;
    let stream = format!("outbox-consumer-test:{}", suffix());
    let publisher =
        RedisPublisher::connect(RedisConfig::from_url(&format!("{url}?stream={stream}")).unwrap())
            .await
            .unwrap();
    let redis = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    Some(Fixture {
        url,
        stream,
        publisher,
        redis,
    })
}

impl Fixture {
    fn config(&self, group: &str) -> RedisConsumerConfigBuilder {
        RedisConsumerConfig::builder(self.url.clone(), &self.stream, group)
    }

    async fn publish(&self, batch: &[Message]) {
        let outcomes = self.publisher.publish(batch).await;
        assert!(
            outcomes.iter().all(|o| *o == PublishOutcome::Acked),
            "{outcomes:?}"
        );
    }

    /// Publish `batch` to the same destination with `envelope=` `envelope` (a CloudEvents mode).
    async fn publish_in(&self, envelope: &str, batch: &[Message]) {
        let url = format!("{}?stream={}&envelope={envelope}", self.url, self.stream);
        let publisher = RedisPublisher::connect(RedisConfig::from_url(&url).unwrap())
            .await
            .unwrap();
        let outcomes = publisher.publish(batch).await;
        assert!(
            outcomes.iter().all(|o| *o == PublishOutcome::Acked),
            "{outcomes:?}"
        );
    }

    /// Entries delivered to the group and not acknowledged, per consumer.
    async fn pending(&self, group: &str) -> HashMap<String, u64> {
        let reply: redis::streams::StreamPendingReply = self
            .redis
            .clone()
            .xpending(&self.stream, group)
            .await
            .unwrap();
        match reply {
            redis::streams::StreamPendingReply::Empty => HashMap::new(),
            redis::streams::StreamPendingReply::Data(data) => data
                .consumers
                .into_iter()
                .map(|c| (c.name, c.pending as u64))
                .collect(),
        }
    }

    /// Wait until the group has read every entry and acknowledged it.
    async fn all_acked(&self, group: &str, entries: usize) {
        eventually("every entry acknowledged", || async move {
            let len: usize = self.redis.clone().xlen(&self.stream).await.ok()?;
            let info: redis::streams::StreamInfoGroupsReply =
                self.redis.clone().xinfo_groups(&self.stream).await.ok()?;
            let g = info.groups.into_iter().find(|g| g.name == group)?;
            (len == entries
                && g.pending == 0
                && g.last_delivered_id != "0-0"
                && self.pending(group).await.is_empty())
            .then_some(())
        })
        .await;
    }

    async fn dead_letters(&self) -> Vec<HashMap<String, String>> {
        let reply: redis::streams::StreamRangeReply = self
            .redis
            .clone()
            .xrange_all(format!("{}:dead", self.stream))
            .await
            .unwrap();
        reply
            .ids
            .into_iter()
            .map(|e| {
                e.map
                    .into_iter()
                    .map(|(k, v)| (k, redis::from_redis_value::<String>(&v).unwrap()))
                    .collect()
            })
            .collect()
    }
}

#[tokio::test]
async fn decodes_what_the_publisher_wrote_and_acks_each_once() {
    let Some(f) = fixture().await else { return };
    let mut batch = vec![
        message(
            Some("k1"),
            1,
            serde_json::json!({"total": 12.5, "items": [1, 2]}),
        ),
        message(None, 2, serde_json::json!("text")),
        message(Some("k1"), 3, serde_json::json!({"nested": {"a": null}})),
        binary_message(Some("k3"), 4),
    ];
    batch[1].headers.clear();
    f.publish(&batch).await;
    // Binary payloads in both CloudEvents modes: the body, and data_base64.
    let ce_binary = binary_message(Some("ce"), 5);
    let ce_structured = binary_message(Some("ce"), 6);
    f.publish_in("cloudevents", std::slice::from_ref(&ce_binary))
        .await;
    f.publish_in(
        "cloudevents-structured",
        std::slice::from_ref(&ce_structured),
    )
    .await;
    batch.extend([ce_binary, ce_structured]);

    let (handler, mut calls) = Scripted::new();
    let consumer = RedisConsumer::connect(f.config("decode").build().unwrap())
        .await
        .unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let seen = calls_until(&mut calls, |c| c.len() >= batch.len()).await;
    for msg in &batch {
        let got = of(&seen, msg.id);
        assert_eq!(got.len(), 1, "{} handled once", msg.id);
        assert_decoded(got[0], msg);
        assert!(
            matches!(&got[0].source, Source::Redis { stream, .. } if *stream == f.stream),
            "{:?}",
            got[0].source
        );
    }
    let k1: Vec<_> = seen
        .iter()
        .filter(|c| c.delivery.partition_key.as_deref() == Some("k1"))
        .map(|c| c.delivery.message_id)
        .collect();
    assert_eq!(k1, vec![batch[0].id, batch[2].id], "key order");
    f.all_acked("decode", batch.len()).await;
    task.abort();
}

#[tokio::test]
async fn retries_then_acks_and_dead_letters_poison_and_undecodable_ones() {
    let Some(f) = fixture().await else { return };
    let flaky = message(Some("a"), 1, serde_json::json!({"n": 1}));
    let poison = message(Some("b"), 2, serde_json::json!({"n": 2}));
    let hopeless = message(Some("c"), 3, serde_json::json!({"n": 3}));
    f.publish(&[flaky.clone(), poison.clone(), hopeless.clone()])
        .await;
    // Entries no outbox publisher wrote: no envelope at all, and an envelope whose headers
    // field is not a JSON object.
    let _: String = f
        .redis
        .clone()
        .xadd(&f.stream, "*", &[("garbage", "x")])
        .await
        .unwrap();
    let bad_headers = uuid::Uuid::now_v7().to_string();
    let _: String = f
        .redis
        .clone()
        .xadd(
            &f.stream,
            "*",
            &[
                ("id", bad_headers.as_str()),
                ("event_type", "e"),
                ("aggregate_type", "a"),
                ("aggregate_id", "1"),
                ("payload", "{}"),
                ("headers", "[1,2]"),
            ],
        )
        .await
        .unwrap();
    let after = message(Some("b"), 4, serde_json::json!({"n": 4}));
    f.publish(std::slice::from_ref(&after)).await;

    let (handler, mut calls) = Scripted::new();
    handler.plan(flaky.id, Plan::FailFirst(2));
    handler.plan(poison.id, Plan::Poison);
    handler.plan(hopeless.id, Plan::AlwaysFail);
    let consumer =
        RedisConsumer::connect(f.config("retry").options(fast_options(3)).build().unwrap())
            .await
            .unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let seen = calls_until(&mut calls, |c| {
        of(c, after.id).len() == 1 && of(c, flaky.id).len() == 3 && of(c, hopeless.id).len() == 3
    })
    .await;
    let attempts: Vec<u32> = of(&seen, flaky.id).iter().map(|d| d.attempt).collect();
    assert_eq!(attempts, vec![1, 2, 3]);
    assert_eq!(of(&seen, poison.id).len(), 1);
    f.all_acked("retry", 6).await;

    let dead = f.dead_letters().await;
    assert_eq!(
        dead.len(),
        4,
        "poison, hopeless and two undecodable: {dead:?}"
    );
    let by_id = |id: &str| {
        dead.iter()
            .find(|d| d.get("id").map(String::as_str) == Some(id))
            .unwrap_or_else(|| panic!("no dead letter for {id}"))
    };
    let d = by_id(&poison.id.to_string());
    assert_eq!(d["payload"], poison.payload);
    assert_eq!(d[DEAD_ATTEMPTS], "1");
    assert!(d[DEAD_REASON].contains("poison: cannot apply"));
    assert!(d["headers"].contains("traceparent"));
    let d = by_id(&hopeless.id.to_string());
    assert_eq!(d[DEAD_ATTEMPTS], "3");
    assert!(d[DEAD_REASON].contains("gave up after 3 attempts"));
    let d = by_id(&bad_headers);
    assert_eq!(d[DEAD_ATTEMPTS], "0");
    assert!(
        d[DEAD_REASON].contains("\"headers\" is not a JSON object"),
        "{d:?}"
    );
    let d = dead
        .iter()
        .find(|d| d.contains_key("garbage"))
        .expect("the entry without an envelope is dead-lettered");
    assert_eq!(d["garbage"], "x");
    assert!(d[DEAD_REASON].contains("no \"payload\" field"), "{d:?}");
    assert!(d[DEAD_SOURCE].contains(&f.stream));
    task.abort();
}

/// The first consumer dies while its handler runs; the entry stays pending for it.
async fn die_while_handling(f: &Fixture, group: &str, msg: &Message) {
    let (first, mut first_calls) = Scripted::new();
    first.plan(msg.id, Plan::Hang);
    let consumer = RedisConsumer::connect(f.config(group).consumer("first").build().unwrap())
        .await
        .unwrap();
    let task = tokio::spawn(consumer.run(first));
    calls_until(&mut first_calls, |c| !c.is_empty()).await;
    assert_eq!(
        f.pending(group).await.get("first"),
        Some(&1),
        "not acknowledged while the handler runs"
    );
    task.abort();
    let _ = task.await;
}

#[tokio::test]
async fn a_dead_consumers_pending_entry_is_taken_over() {
    let Some(f) = fixture().await else { return };
    let msg = message(Some("k"), 1, serde_json::json!({"n": 1}));
    f.publish(std::slice::from_ref(&msg)).await;
    die_while_handling(&f, "crash", &msg).await;

    // Another consumer of the group takes the entry over once it has been idle for claim_idle.
    let (second, mut second_calls) = Scripted::new();
    let config = f
        .config("crash")
        .consumer("second")
        .claim_idle(Duration::from_millis(200));
    let consumer = RedisConsumer::connect(config.build().unwrap())
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(consumer.run_until(second, shutdown.clone()));
    let seen = calls_until(&mut second_calls, |c| !c.is_empty()).await;
    assert_eq!(seen[0].delivery.message_id, msg.id);
    f.all_acked("crash", 1).await;
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn a_consumer_restarted_under_its_name_takes_back_its_pending_entry() {
    let Some(f) = fixture().await else { return };
    let msg = message(Some("k"), 1, serde_json::json!({"n": 1}));
    f.publish(std::slice::from_ref(&msg)).await;
    die_while_handling(&f, "restart", &msg).await;

    // Same name, claim_idle far away: the entry comes from its own pending list at start.
    let (again, mut calls) = Scripted::new();
    let consumer = RedisConsumer::connect(f.config("restart").consumer("first").build().unwrap())
        .await
        .unwrap();
    let task = tokio::spawn(consumer.run(again));
    let seen = calls_until(&mut calls, |c| !c.is_empty()).await;
    assert_eq!(seen[0].delivery.message_id, msg.id);
    f.all_acked("restart", 1).await;
    task.abort();
}

#[tokio::test]
async fn a_consumer_whose_stream_vanished_makes_its_group_again_and_goes_on() {
    let Some(f) = fixture().await else { return };
    let first = message(Some("k"), 1, serde_json::json!({"n": 1}));
    f.publish(std::slice::from_ref(&first)).await;
    let (handler, mut calls) = Scripted::new();
    // Connected by URL, as a service configured from its environment would.
    let consumer = outbox_consumer::Consumer::connect(&format!(
        "{}?stream={}&group=vanish&claim_idle_ms=30000",
        f.url, f.stream
    ))
    .await
    .unwrap();
    assert!(matches!(consumer, outbox_consumer::Consumer::Redis(_)));
    let task = tokio::spawn(consumer.run(handler));
    calls_until(&mut calls, |c| !c.is_empty()).await;
    f.all_acked("vanish", 1).await;

    // As after a restart of a server that keeps nothing on disk: stream and group are gone.
    let _: () = f.redis.clone().del(&f.stream).await.unwrap();
    let second = message(Some("k"), 2, serde_json::json!({"n": 2}));
    f.publish(std::slice::from_ref(&second)).await;
    let seen = calls_until(&mut calls, |c| !c.is_empty()).await;
    assert_eq!(seen[0].delivery.message_id, second.id);
    assert_eq!(seen[0].delivery.attempt, 1);
    f.all_acked("vanish", 1).await;
    task.abort();
}

#[tokio::test]
async fn an_entry_between_retries_is_not_taken_over_by_another_consumer() {
    let Some(f) = fixture().await else { return };
    let msg = message(Some("k"), 1, serde_json::json!({"n": 1}));
    f.publish(std::slice::from_ref(&msg)).await;
    let claim_idle = Duration::from_millis(200);
    // One retry, after a pause three times the claim idle time.
    let mut options = fast_options(2);
    options.retry.initial_backoff = claim_idle * 3;
    options.retry.max_backoff = claim_idle * 3;

    let (first, mut first_calls) = Scripted::new();
    first.plan(msg.id, Plan::FailFirst(1));
    let config = f.config("keep").claim_idle(claim_idle).options(options);
    let a = RedisConsumer::connect(config.clone().consumer("a").build().unwrap())
        .await
        .unwrap();
    let task_a = tokio::spawn(a.run(first));
    calls_until(&mut first_calls, |c| !c.is_empty()).await;

    // A second consumer of the group, claiming entries idle for 200 ms, runs through the pause.
    let (second, mut second_calls) = Scripted::new();
    let b = RedisConsumer::connect(config.consumer("b").build().unwrap())
        .await
        .unwrap();
    let task_b = tokio::spawn(b.run(second));
    let seen = calls_until(&mut first_calls, |c| !c.is_empty()).await;
    assert_eq!(seen[0].delivery.attempt, 2);
    f.all_acked("keep", 1).await;
    assert!(
        second_calls.try_recv().is_err(),
        "the other consumer took over an entry still being retried"
    );
    task_a.abort();
    task_b.abort();
}
