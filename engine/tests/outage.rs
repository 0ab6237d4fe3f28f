//! Broker outages against the in-memory reference store: a broker that is down is told apart
//! from a message it refuses, counts no attempt, stops the claims, is probed with capped
//! back-off, and delivery resumes within about a second of its return. Time is tokio's paused
//! clock: the outage's length is simulated, nothing waits for real.

mod support;

use std::sync::Arc;
use std::time::Duration;

use outbox_engine::{Relay, RelayConfig};
use outbox_memory::RecordingPublisher;
use outbox_traits::{Error, OutboxAdmin, PublishOutcome};
use support::*;
use tokio::time::Instant;

const KEYS: [&str; 3] = ["a", "b", "c"];
const PER_KEY: u32 = 10;
const TOTAL: usize = KEYS.len() * PER_KEY as usize;

fn config() -> RelayConfig {
    RelayConfig::builder()
        .batch_size(10)
        .max_attempts(2)
        .build()
        .unwrap()
}

fn enqueue(store: &TestStore) {
    for n in 0..PER_KEY {
        store.inner.enqueue(KEYS.iter().map(|k| msg(k, n))).unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_minute_long_broker_outage_counts_no_attempt_and_delivery_resumes_within_a_second() {
    let store = TestStore::new(Wakeups::Inner);
    enqueue(&store);
    let publisher = Arc::new(RecordingPublisher::new());
    publisher.set_down(true);
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let handle = relay.spawn();

    // The first batch meets the outage and is given back.
    until(&store.releases, 1).await;
    let calls_at_outage = publisher.calls();
    let checks_at_outage = publisher.checks();
    // A minute of (paused) outage: the relay probes, never publishes, never claims.
    let outage = Duration::from_secs(60);
    tokio::time::sleep(outage).await;
    assert_eq!(publisher.calls(), calls_at_outage, "no publish while down");
    let probes = publisher.checks() - checks_at_outage;
    // Probes back off from 100 ms to a cap of 1 s (± 20 %): bounded, yet about one a second.
    assert!((45..=70).contains(&probes), "{probes} probes in {outage:?}");
    let counts = store.inner.counts().await.unwrap();
    assert_eq!((counts.dead, counts.leased), (0, 0), "{counts:?}");

    publisher.set_down(false);
    let back = Instant::now();
    published(&publisher, TOTAL).await;
    let resumed_after = back.elapsed();
    assert!(
        resumed_after <= Duration::from_millis(1300),
        "resumed {resumed_after:?} after the broker came back"
    );
    let stats = handle.shutdown(Duration::from_secs(5)).await.unwrap();

    assert_eq!((stats.dead, stats.retried), (0, 0), "{stats:?}");
    assert_eq!(stats.published, TOTAL as u64);
    let counts = store.inner.counts().await.unwrap();
    assert_eq!((counts.published, counts.dead), (TOTAL as u64, 0));
    // Every message went out on its first counted attempt: the outage cost none.
    assert!(publisher
        .published()
        .iter()
        .all(|d| d.message.attempts == 0));
    assert_key_order(&publisher);
}

#[tokio::test(start_paused = true)]
async fn a_drain_meets_the_outage_releases_everything_and_fails_with_unavailable() {
    let store = TestStore::new(Wakeups::Inner);
    enqueue(&store);
    let publisher = Arc::new(RecordingPublisher::new());
    publisher.set_down(true);
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();

    for _ in 0..3 {
        let err = relay.run_until_idle().await.unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{err}");
        assert!(err.to_string().contains("the broker is down"), "{err}");
    }
    let counts = store.inner.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.dead, counts.leased),
        (TOTAL as u64, 0, 0)
    );
    assert!(store.inner.unpublished().iter().all(|m| m.attempts == 0));

    publisher.set_down(false);
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!((stats.published, stats.dead), (TOTAL as u64, 0));
}

#[tokio::test(start_paused = true)]
async fn messages_a_reachable_broker_refuses_still_count_attempts() {
    let store = TestStore::new(Wakeups::Inner);
    enqueue(&store);
    let publisher = Arc::new(RecordingPublisher::new());
    // The broker answers its check but refuses every message: not an outage.
    publisher.set_outcome(|_| PublishOutcome::transient("no responders"));
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config().to_builder().max_attempts(1).build().unwrap(),
    )
    .unwrap();

    let stats = relay.run_until_idle().await.unwrap();

    assert!(
        publisher.checks() >= 1,
        "the all-failed batch asked the broker"
    );
    // Each key's head is dead-lettered at once (one attempt allowed); the default head policy
    // blocks the rest of its key.
    assert_eq!(stats.dead, KEYS.len() as u64, "{stats:?}");
    let counts = store.inner.counts().await.unwrap();
    assert_eq!(counts.dead, KEYS.len() as u64);
}

#[tokio::test(start_paused = true)]
async fn a_store_outage_dead_letters_nothing() {
    let store = TestStore::new(Wakeups::Inner);
    enqueue(&store);
    store
        .transient_claim_errors
        .store(8, std::sync::atomic::Ordering::SeqCst);
    store
        .transient_complete_errors
        .store(3, std::sync::atomic::Ordering::SeqCst);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();

    let stats = relay.run_until_idle().await.unwrap();

    assert_eq!((stats.dead, stats.retried), (0, 0), "{stats:?}");
    assert!(stats.store_errors >= 11, "{stats:?}");
    let counts = store.inner.counts().await.unwrap();
    assert_eq!((counts.published, counts.dead), (TOTAL as u64, 0));
}
