//! The consumer's metrics, captured with a local debugging recorder on a single-threaded
//! runtime, for a Redis consumer on the real server (`OUTBOX_TEST_REDIS_URL`).

mod common;

use std::collections::HashMap;

use common::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use outbox_conformance_tests::env::service_url;
use outbox_consumer::redis::{RedisConsumer, RedisConsumerConfig};
use outbox_consumer::telemetry as m;
use outbox_consumer::CancellationToken;
use outbox_publisher_redis::{RedisConfig, RedisPublisher};
use outbox_traits::{PublishOutcome, Publisher};
use redis::AsyncCommands;

#[test]
fn counters_and_the_latency_histogram_carry_the_consumer_label() {
    let Some(url) = service_url("OUTBOX_TEST_REDIS_URL") else {
        return;
    };
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let stream = format!("outbox-consumer-test:{}", suffix());
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let publisher = RedisPublisher::connect(
                RedisConfig::from_url(&format!("{url}?stream={stream}")).unwrap(),
            )
            .await
            .unwrap();
            let ok = message(Some("a"), 1, serde_json::json!(1));
            let dup = message(Some("b"), 2, serde_json::json!(2));
            let flaky = message(Some("c"), 3, serde_json::json!(3));
            let down = message(Some("d"), 4, serde_json::json!(4));
            let poison = message(Some("e"), 5, serde_json::json!(5));
            let batch = [
                ok.clone(),
                dup.clone(),
                flaky.clone(),
                down.clone(),
                poison.clone(),
            ];
            assert!(publisher
                .publish(&batch)
                .await
                .iter()
                .all(|o| *o == PublishOutcome::Acked));
            let mut redis = redis::Client::open(url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let _: String = redis.xadd(&stream, "*", &[("junk", "1")]).await.unwrap();

            let (handler, mut calls) = Scripted::new();
            handler.plan(dup.id, Plan::Duplicate);
            handler.plan(flaky.id, Plan::FailFirst(1));
            // More outage errors than max_attempts: counted, they would dead-letter the message.
            handler.plan(down.id, Plan::UnavailableFirst(5));
            handler.plan(poison.id, Plan::Poison);
            let consumer = RedisConsumer::connect(
                RedisConsumerConfig::builder(url.clone(), &stream, "metered")
                    .options(fast_options(3))
                    .build()
                    .unwrap(),
            )
            .await
            .unwrap();
            let shutdown = CancellationToken::new();
            let run = tokio::spawn(consumer.run_until(handler, shutdown.clone()));
            calls_until(&mut calls, |c| c.len() >= 11).await;
            eventually("all acknowledged", || {
                let mut redis = redis.clone();
                let stream = stream.clone();
                async move {
                    let info: redis::streams::StreamInfoGroupsReply =
                        redis.xinfo_groups(&stream).await.ok()?;
                    (info.groups.first()?.pending == 0).then_some(())
                }
            })
            .await;
            shutdown.cancel();
            run.await.unwrap();
        })
    });

    let mut counters: HashMap<(String, Vec<(String, String)>), u64> = HashMap::new();
    let mut histogram_samples = 0;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<(String, String)> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        labels.sort();
        assert!(
            labels.contains(&(m::CONSUMER_LABEL.to_owned(), "metered".to_owned())),
            "{} has no consumer label: {labels:?}",
            key.name()
        );
        match value {
            DebugValue::Counter(n) => {
                counters.insert((key.name().to_owned(), labels), n);
            }
            DebugValue::Histogram(samples) if key.name() == m::HANDLER_SECONDS => {
                histogram_samples += samples.len();
            }
            _ => {}
        }
    }
    let get = |name: &str, extra: &[(&str, &str)]| {
        let mut labels = vec![(m::CONSUMER_LABEL.to_owned(), "metered".to_owned())];
        labels.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        labels.sort();
        counters
            .get(&(name.to_owned(), labels))
            .copied()
            .unwrap_or(0)
    };
    // ok, flaky (after 1 retry) and down (after 5 outage errors): processed.
    assert_eq!(get(m::PROCESSED_TOTAL, &[]), 3);
    assert_eq!(get(m::DUPLICATES_TOTAL, &[]), 1);
    assert_eq!(get(m::RETRIED_TOTAL, &[("kind", "transient")]), 1);
    assert_eq!(get(m::RETRIED_TOTAL, &[("kind", "unavailable")]), 5);
    assert_eq!(get(m::DEAD_TOTAL, &[("cause", "handler")]), 1);
    assert_eq!(get(m::DEAD_TOTAL, &[("cause", "undecodable")]), 1);
    // One sample per handler call: ok, dup, flaky x2, down x6, poison.
    assert_eq!(histogram_samples, 11);
}
