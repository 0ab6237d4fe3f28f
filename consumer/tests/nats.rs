//! The JetStream consumer against the real NATS server (`OUTBOX_TEST_NATS_URL`), each test on
//! its own stream, fed by the project's own NATS publisher.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use common::*;
use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::servers::{free_port, installed, missing, wait_port};
use outbox_consumer::nats::{NatsConsumer, NatsConsumerConfig, NatsConsumerConfigBuilder};
use outbox_consumer::{
    handler_fn, CancellationToken, Delivery, Handled, Source, DEAD_ATTEMPTS, DEAD_REASON,
    DEAD_SOURCE,
};
use outbox_publisher_nats::{NatsConfig, NatsPublisher};
use outbox_traits::{Message, PublishOutcome, Publisher};

const VAR: &str = "OUTBOX_TEST_NATS_URL";

struct Fixture {
    url: String,
    stream: String,
    prefix: String,
    publisher: NatsPublisher,
    jetstream: jetstream::Context,
}

async fn fixture() -> Option<Fixture> {
    Some(fixture_at(service_url(VAR)?).await)
}

async fn fixture_at(url: String) -> Fixture {
    let s = suffix();
    let stream = format!("C_{s}");
    let prefix = format!("c{s}");
    let publisher = NatsPublisher::connect(
        NatsConfig::from_url(&format!(
            "{url}?subject={prefix}.{{aggregate_type}}.{{partition_key}}&stream={stream}&create_stream=true"
        ))
        .unwrap(),
    )
    .await
    .unwrap();
    let jetstream = jetstream::new(publisher.client().clone());
    Fixture {
        url,
        stream,
        prefix,
        publisher,
        jetstream,
    }
}

impl Fixture {
    fn config(&self, consumer: &str) -> NatsConsumerConfigBuilder {
        NatsConsumerConfig::builder(self.url.clone(), &self.stream, consumer)
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
        let url = format!(
            "{}?subject={}.{{aggregate_type}}.{{partition_key}}&stream={}&envelope={envelope}",
            self.url, self.prefix, self.stream
        );
        let publisher = NatsPublisher::connect(NatsConfig::from_url(&url).unwrap())
            .await
            .unwrap();
        let outcomes = publisher.publish(batch).await;
        assert!(
            outcomes.iter().all(|o| *o == PublishOutcome::Acked),
            "{outcomes:?}"
        );
    }

    /// The consumer's acknowledgement floor reaches the stream's last sequence, with nothing
    /// pending or waiting for an ack.
    async fn all_acked(&self, consumer: &str) {
        let stream = self.jetstream.get_stream(&self.stream).await.unwrap();
        eventually("every message acknowledged", || {
            let stream = stream.clone();
            async move {
                let last = stream.get_info().await.ok()?.state.last_sequence;
                let mut c: jetstream::consumer::PullConsumer =
                    stream.get_consumer(consumer).await.ok()?;
                let info = c.info().await.ok()?;
                (info.ack_floor.stream_sequence == last
                    && info.num_ack_pending == 0
                    && info.num_pending == 0)
                    .then_some(())
            }
        })
        .await;
    }

    /// The dead letters stored so far, as (headers, payload).
    async fn dead_letters(&self) -> Vec<(async_nats::HeaderMap, Vec<u8>)> {
        let dead = self
            .jetstream
            .get_stream(format!("{}_DEAD", self.stream))
            .await
            .unwrap();
        let state = dead.cached_info().state.clone();
        let mut out = Vec::new();
        if state.messages == 0 {
            return out;
        }
        for seq in state.first_sequence..=state.last_sequence {
            let m = dead.get_raw_message(seq).await.unwrap();
            out.push((m.headers, m.payload.to_vec()));
        }
        out
    }
}

fn header<'a>(headers: &'a async_nats::HeaderMap, name: &str) -> &'a str {
    headers.get(name).map(|v| v.as_str()).unwrap_or_default()
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
        message(Some("k2"), 2, serde_json::json!("text")),
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
    let consumer = NatsConsumer::connect(f.config("decode").build().unwrap())
        .await
        .unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let seen = calls_until(&mut calls, |c| c.len() >= batch.len()).await;
    for msg in &batch {
        let got = of(&seen, msg.id);
        assert_eq!(got.len(), 1, "{} handled once", msg.id);
        assert_decoded(got[0], msg);
        match &got[0].source {
            Source::Nats {
                stream,
                subject,
                delivered,
                ..
            } => {
                assert_eq!(stream, &f.stream);
                let key = msg.partition_key.as_deref().unwrap_or_default();
                assert_eq!(subject, &format!("{}.order.{key}", f.prefix));
                assert_eq!(*delivered, 1);
            }
            other => panic!("not a NATS source: {other:?}"),
        }
    }
    // Per-subject order: k1's messages in publishing order.
    let k1: Vec<_> = seen
        .iter()
        .filter(|c| c.delivery.partition_key.as_deref() == Some("k1"))
        .map(|c| c.delivery.message_id)
        .collect();
    assert_eq!(k1, vec![batch[0].id, batch[2].id]);
    f.all_acked("decode").await;
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
    // A message no outbox publisher wrote: no envelope headers, a payload that is not JSON.
    f.jetstream
        .publish(format!("{}.order.b", f.prefix), "not json {".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let after = message(Some("b"), 4, serde_json::json!({"n": 4}));
    f.publish(std::slice::from_ref(&after)).await;

    let (handler, mut calls) = Scripted::new();
    handler.plan(flaky.id, Plan::FailFirst(2));
    handler.plan(poison.id, Plan::Poison);
    handler.plan(hopeless.id, Plan::AlwaysFail);
    let consumer =
        NatsConsumer::connect(f.config("retry").options(fast_options(3)).build().unwrap())
            .await
            .unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let seen = calls_until(&mut calls, |c| {
        of(c, after.id).len() == 1 && of(c, flaky.id).len() == 3 && of(c, hopeless.id).len() == 3
    })
    .await;
    let attempts: Vec<u32> = of(&seen, flaky.id).iter().map(|d| d.attempt).collect();
    assert_eq!(attempts, vec![1, 2, 3]);
    // Retried in process: JetStream delivered it once.
    assert!(of(&seen, flaky.id)
        .iter()
        .all(|d| matches!(d.source, Source::Nats { delivered: 1, .. })));
    assert_eq!(of(&seen, poison.id).len(), 1);
    f.all_acked("retry").await;

    let dead = f.dead_letters().await;
    assert_eq!(dead.len(), 3, "poison, hopeless and undecodable");
    let by_id = |id: uuid::Uuid| {
        dead.iter()
            .find(|(h, _)| header(h, "message-id") == id.to_string())
            .unwrap_or_else(|| panic!("no dead letter for {id}"))
    };
    let (h, payload) = by_id(poison.id);
    assert_eq!(payload, poison.payload.as_bytes());
    assert_eq!(header(h, DEAD_ATTEMPTS), "1");
    assert!(header(h, DEAD_REASON).contains("poison: cannot apply"));
    assert_eq!(header(h, "traceparent"), poison.headers["traceparent"]);
    let (h, _) = by_id(hopeless.id);
    assert_eq!(header(h, DEAD_ATTEMPTS), "3");
    assert!(header(h, DEAD_REASON).contains("gave up after 3 attempts"));
    let (h, payload) = dead
        .iter()
        .find(|(h, _)| h.get("message-id").is_none())
        .expect("the undecodable message is dead-lettered");
    assert_eq!(payload, b"not json {");
    assert_eq!(header(h, DEAD_ATTEMPTS), "0");
    assert!(
        header(h, DEAD_REASON).contains("no \"message-id\""),
        "{}",
        header(h, DEAD_REASON)
    );
    assert!(header(h, DEAD_SOURCE).contains(&f.stream));
    task.abort();
}

#[tokio::test]
async fn a_dead_letter_stream_of_ones_own_captures_the_subject_given() {
    let Some(f) = fixture().await else { return };
    let poison = message(Some("p"), 1, serde_json::json!({"n": 1}));
    f.publish(std::slice::from_ref(&poison)).await;
    // A subject outside `dead.<stream>.>` and a stream of its own, created by `connect`: before
    // the fix that stream captured `dead.<stream>.>` and `connect` refused the subject.
    let (subject, dead_stream) = (
        format!("{}dead.poison", f.prefix),
        format!("{}_OWN", f.stream),
    );
    let (handler, mut calls) = Scripted::new();
    handler.plan(poison.id, Plan::Poison);
    let consumer = NatsConsumer::connect(
        f.config("own")
            .dead_letter_subject(subject.clone())
            .dead_letter_stream(Some(dead_stream.clone()))
            .options(fast_options(3))
            .build()
            .unwrap(),
    )
    .await
    .unwrap();
    let task = tokio::spawn(consumer.run(handler));
    calls_until(&mut calls, |c| of(c, poison.id).len() == 1).await;
    f.all_acked("own").await;
    let dead = f.jetstream.get_stream(&dead_stream).await.unwrap();
    assert_eq!(dead.cached_info().config.subjects, vec![subject.clone()]);
    let stored = dead
        .get_last_raw_message_by_subject(&subject)
        .await
        .unwrap();
    assert_eq!(header(&stored.headers, "message-id"), poison.id.to_string());
    assert!(header(&stored.headers, DEAD_REASON).contains("poison"));
    task.abort();
    let _ = f.jetstream.delete_stream(&dead_stream).await;
}

#[tokio::test]
async fn a_message_unacked_by_a_dead_consumer_is_redelivered() {
    let Some(f) = fixture().await else { return };
    let msg = message(Some("k"), 1, serde_json::json!({"n": 1}));
    f.publish(std::slice::from_ref(&msg)).await;
    let config = f.config("crash").ack_wait(Duration::from_millis(500));

    // The first consumer dies while its handler runs: the message was not acknowledged.
    let (first, mut first_calls) = Scripted::new();
    first.plan(msg.id, Plan::Hang);
    let consumer = NatsConsumer::connect(config.clone().build().unwrap())
        .await
        .unwrap();
    let task = tokio::spawn(consumer.run(first));
    calls_until(&mut first_calls, |c| !c.is_empty()).await;
    let stream = f.jetstream.get_stream(&f.stream).await.unwrap();
    let mut durable: jetstream::consumer::PullConsumer =
        stream.get_consumer("crash").await.unwrap();
    let info = durable.info().await.unwrap();
    assert_eq!(
        info.num_ack_pending, 1,
        "not acknowledged while the handler runs"
    );
    assert_eq!(info.ack_floor.stream_sequence, 0);
    task.abort();
    let _ = task.await;

    let (second, mut second_calls) = Scripted::new();
    let consumer = NatsConsumer::connect(config.build().unwrap())
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(consumer.run_until(second, shutdown.clone()));
    let seen = calls_until(&mut second_calls, |c| !c.is_empty()).await;
    assert_eq!(seen[0].delivery.message_id, msg.id);
    assert!(matches!(
        seen[0].delivery.source,
        Source::Nats { delivered: 2, .. }
    ));
    f.all_acked("crash").await;
    shutdown.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn a_broker_outage_costs_no_attempt() {
    let Some(mut server) = PrivateNats::start().unwrap() else {
        return;
    };
    let f = fixture_at(server.url()).await;
    let before = message(Some("k"), 1, serde_json::json!({"n": 1}));
    f.publish(std::slice::from_ref(&before)).await;
    let before_id = before.id;

    // The first call's handler (of `before`) waits until the server is down, so its
    // acknowledgement is sent during the outage. One attempt only: an outage that cost one would
    // dead-letter. Only that call waits: a server killed right after a delivery may not have
    // stored it, and then delivers `before` again as its first delivery.
    let (calls, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let gate = Arc::new(tokio::sync::Notify::new());
    let release = gate.clone();
    let gated = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = handler_fn(move |d: Delivery| {
        let calls = calls.clone();
        let gate = gate.clone();
        let gated = gated.clone();
        async move {
            let _ = calls.send(d.clone());
            if d.message_id == before_id && !gated.swap(true, std::sync::atomic::Ordering::SeqCst) {
                gate.notified().await;
            }
            Ok(Handled::Processed)
        }
    });
    let consumer = NatsConsumer::connect(
        f.config("outage")
            .ack_wait(Duration::from_millis(500))
            .options(fast_options(1))
            .build()
            .unwrap(),
    )
    .await
    .unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let first = tokio::time::timeout(WAIT, seen.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.message_id, before.id);
    server.stop();
    release.notify_one();

    server.resume();
    let after = message(Some("k"), 2, serde_json::json!({"n": 2}));
    eventually("the publisher is back", || async {
        let outcomes = f.publisher.publish(std::slice::from_ref(&after)).await;
        (outcomes == [PublishOutcome::Acked]).then_some(())
    })
    .await;
    let mut handled = vec![first];
    while !handled.iter().any(|d| d.message_id == after.id) {
        let next = tokio::time::timeout(WAIT, seen.recv()).await;
        let Ok(Some(next)) = next else {
            panic!("the message after the outage never came; handled so far: {handled:?}")
        };
        handled.push(next);
    }
    // Every call was a first attempt (a redelivery of `before` is allowed, an attempt lost to
    // the outage is not), and nothing was dead-lettered.
    assert!(handled.iter().all(|d| d.attempt == 1), "{handled:?}");
    f.all_acked("outage").await;
    assert!(f.dead_letters().await.is_empty());
    task.abort();
}

/// A private `nats-server` with JetStream, killed by its pid on [`stop`](Self::stop) and on drop;
/// [`resume`](Self::resume) starts it again on the same port and JetStream directory.
struct PrivateNats {
    program: &'static str,
    child: Option<std::process::Child>,
    dir: tempfile::TempDir,
    port: u16,
}

impl PrivateNats {
    fn start() -> Result<Option<Self>, String> {
        let Some(program) = ["/usr/sbin/nats-server", "nats-server"]
            .into_iter()
            .find(|p| installed(p))
        else {
            return missing("nats-server");
        };
        let mut server = Self {
            program,
            child: None,
            dir: tempfile::tempdir().map_err(|e| e.to_string())?,
            port: free_port()?,
        };
        server.resume();
        Ok(Some(server))
    }

    fn resume(&mut self) {
        let log = self.dir.path().join("log");
        let file = std::fs::File::create(&log).unwrap();
        let mut child = std::process::Command::new(self.program)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path().join("js"))
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        wait_port(self.port, Some(&mut child), &log).unwrap();
        self.child = Some(child);
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.stop();
    }
}
