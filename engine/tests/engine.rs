//! The engine against the in-memory reference store: exact stats, retries, dead letters,
//! releases, wake-ups, leases, shutdown and crash recovery. Time is controlled through the
//! store's clock and tokio's paused clock; nothing sleeps to let work come due.

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use outbox_engine::{Backoff, Relay, RelayConfig, RelayConfigBuilder, RelayStats};
use outbox_memory::RecordingPublisher;
use outbox_traits::{Error, HeadPolicy, OutboxAdmin, PublishOutcome};
use support::*;

fn config() -> RelayConfig {
    RelayConfig::builder().batch_size(10).build().unwrap()
}

/// [`config`] polling once an hour: only a wake-up brings the next claim within a test's time.
fn polling_hourly() -> RelayConfigBuilder {
    config()
        .to_builder()
        .poll_min(Duration::from_secs(3600))
        .poll_max(Duration::from_secs(3600))
}

/// Long enough for any retry of the default back-off to come due.
const PAST_ANY_RETRY: Duration = Duration::from_secs(400);

#[tokio::test(start_paused = true)]
async fn drains_many_messages_over_several_keys_with_exact_stats() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = Arc::new(RecordingPublisher::new());
    let keys = ["a", "b", "c", "d", "e", "f", "g"];
    let mut total = 0u64;
    for n in 0..100u32 {
        let batch: Vec<_> = keys.iter().map(|k| msg(k, n)).collect();
        total += batch.len() as u64;
        store.inner.enqueue(batch).unwrap();
    }
    store
        .inner
        .enqueue((0..50).map(|n| msg("x", n).unordered()))
        .unwrap();
    total += 50;

    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config()
            .to_builder()
            .batch_size(64)
            .concurrency(3)
            .build()
            .unwrap(),
    )
    .unwrap();
    let stats = relay.run_until_idle().await.unwrap();

    assert_eq!(stats.claimed, total);
    assert_eq!(stats.published, total);
    assert_eq!(
        (stats.retried, stats.dead, stats.released, stats.lease_lost),
        (0, 0, 0, 0)
    );
    assert_eq!(stats.store_errors, 0);
    assert!(stats.batches >= total.div_ceil(64), "{stats:?}");
    // One bulk complete per batch, nothing else.
    assert_eq!(store.complete_calls.load(Ordering::SeqCst), stats.batches);
    assert_eq!(store.fail_calls.load(Ordering::SeqCst), 0);
    assert_eq!(store.release_calls.load(Ordering::SeqCst), 0);

    let mut ids = publisher.published_ids();
    assert_eq!(ids.len() as u64, total);
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len() as u64, total, "no duplicates");
    assert_key_order(&publisher);
    let counts = store.inner.counts().await.unwrap();
    assert_eq!(
        (counts.published, counts.pending, counts.leased),
        (total, 0, 0)
    );

    // Nothing left: a second run does nothing.
    assert_eq!(relay.run_until_idle().await.unwrap(), RelayStats::default());
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_is_retried_later_and_holds_its_key() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = Arc::new(RecordingPublisher::new());
    let a: Vec<_> = (0..3).map(|n| msg("a", n)).collect();
    let b: Vec<_> = (0..2).map(|n| msg("b", n)).collect();
    let a0 = a[0].id;
    store
        .inner
        .enqueue(a.iter().cloned().chain(b.iter().cloned()))
        .unwrap();
    publisher.fail_next(a0, PublishOutcome::transient("broker busy"));

    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let first = relay.run_until_idle().await.unwrap();
    assert_eq!(
        first,
        RelayStats {
            claimed: 5,
            published: 2,
            retried: 1,
            released: 2,
            batches: 1,
            ..RelayStats::default()
        }
    );
    // The failure counted an attempt; the not-attempted messages did not.
    let left = store.inner.unpublished();
    let attempts: Vec<(u64, u32)> = left.iter().map(|m| (n_of(m), m.attempts)).collect();
    assert_eq!(attempts, vec![(0, 1), (1, 0), (2, 0)]);

    // Not due yet: the key is held back as a whole (a1 and a2 do not overtake a0).
    let waiting = relay.run_until_idle().await.unwrap();
    assert_eq!(waiting.claimed, 0);

    // The back-off is at least initial * (1 - jitter) = 0.8 s.
    store.advance(Duration::from_millis(700));
    assert_eq!(relay.run_until_idle().await.unwrap().claimed, 0);
    store.advance(Duration::from_millis(600));
    let second = relay.run_until_idle().await.unwrap();
    assert_eq!((second.claimed, second.published), (3, 3));

    let order: Vec<u64> = publisher
        .published()
        .iter()
        .filter(|d| d.message.partition_key.as_deref() == Some("a"))
        .map(|d| n_of(&d.message))
        .collect();
    assert_eq!(order, vec![0, 1, 2]);
    assert_key_order(&publisher);
    let retried = publisher
        .published()
        .into_iter()
        .find(|d| d.message.id == a0)
        .unwrap();
    assert_eq!(retried.message.attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn a_permanent_failure_is_dead_at_once_and_blocks_or_skips_its_key() {
    for policy in [HeadPolicy::Block, HeadPolicy::Skip] {
        let store = TestStore::new(Wakeups::Inner);
        let publisher = Arc::new(RecordingPublisher::new());
        let k: Vec<_> = (0..2).map(|n| msg("k", n)).collect();
        store.inner.enqueue(k.clone()).unwrap();
        publisher.fail_next(k[0].id, PublishOutcome::permanent("message too large"));
        let relay = Relay::new(
            store.clone(),
            publisher.clone(),
            config().to_builder().head_policy(policy).build().unwrap(),
        )
        .unwrap();
        let stats = relay.run_until_idle().await.unwrap();
        assert_eq!((stats.dead, stats.retried, stats.released), (1, 0, 1));
        let dead = store.inner.list_dead(None, 10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].message.id, k[0].id);
        assert_eq!(dead[0].message.attempts, 1);
        assert!(
            dead[0].last_error.contains("message too large"),
            "{}",
            dead[0].last_error
        );
        match policy {
            HeadPolicy::Block => {
                assert_eq!(stats.published, 0);
                assert_eq!(store.inner.unpublished().len(), 1);
            }
            HeadPolicy::Skip => {
                assert_eq!(stats.published, 1);
                assert!(store.inner.unpublished().is_empty());
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn max_attempts_dead_letters_with_the_last_error() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = Arc::new(RecordingPublisher::new());
    publisher.set_outcome(|_| PublishOutcome::transient("broker down"));
    store.inner.enqueue([msg("k", 0)]).unwrap();
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config().to_builder().max_attempts(3).build().unwrap(),
    )
    .unwrap();
    let mut total = RelayStats::default();
    for _ in 0..5 {
        total += relay.run_until_idle().await.unwrap();
        store.advance(PAST_ANY_RETRY);
    }
    assert_eq!((total.claimed, total.retried, total.dead), (3, 2, 1));
    assert_eq!(publisher.sent().len(), 3);
    let dead = store.inner.list_dead(None, 10).await.unwrap();
    assert_eq!(dead[0].message.attempts, 3);
    assert_eq!(
        dead[0].last_error,
        "gave up after 3 attempts: transient: broker down"
    );
}

#[tokio::test(start_paused = true)]
async fn ambiguous_outcomes_are_retried_and_count_attempts() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = Arc::new(RecordingPublisher::new());
    let m = msg("k", 0);
    store.inner.enqueue([m.clone()]).unwrap();
    publisher.fail_next(
        m.id,
        PublishOutcome::Ambiguous {
            reason: "timeout after send".into(),
        },
    );
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    assert_eq!(relay.run_until_idle().await.unwrap().retried, 1);
    assert_eq!(store.inner.unpublished()[0].attempts, 1);
    store.advance(PAST_ANY_RETRY);
    assert_eq!(relay.run_until_idle().await.unwrap().published, 1);
    // Delivered twice (the ambiguous one may have arrived), same id both times.
    let deliveries: Vec<u32> = publisher.published().iter().map(|d| d.delivery).collect();
    assert_eq!(deliveries, vec![1, 2]);
}

#[tokio::test(start_paused = true)]
async fn wrong_outcome_count_retries_the_batch_and_out_of_order_acks_are_flagged() {
    let store = TestStore::new(Wakeups::Inner);
    store.inner.enqueue([msg("k", 0), msg("k", 1)]).unwrap();
    let short = Arc::new(ScriptedPublisher(|_: &[outbox_traits::Message]| {
        vec![PublishOutcome::Acked]
    }));
    let relay = Relay::new(store.clone(), short, config()).unwrap();
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!((stats.retried, stats.published), (2, 0));

    store.advance(PAST_ANY_RETRY);
    let buggy = Arc::new(ScriptedPublisher(|batch: &[outbox_traits::Message]| {
        let mut out = vec![PublishOutcome::transient("refused")];
        out.extend(batch[1..].iter().map(|_| PublishOutcome::Acked));
        out
    }));
    let relay = Relay::new(store.clone(), buggy, config()).unwrap();
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!(
        (stats.order_violations, stats.published, stats.retried),
        (1, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn batches_are_pipelined_up_to_the_concurrency() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    store
        .inner
        .enqueue((0..6).map(|n| msg(&format!("k{n}"), 0)))
        .unwrap();
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config()
            .to_builder()
            .batch_size(2)
            .concurrency(3)
            .build()
            .unwrap(),
    )
    .unwrap();
    let run = tokio::spawn(async move { relay.run_until_idle().await });
    // Three publishes are waiting at the gate at once: claims overlapped the publishes.
    until(&publisher.entered, 3).await;
    publisher.open();
    let stats = run.await.unwrap().unwrap();
    assert_eq!((stats.published, stats.batches), (6, 3));
}

#[tokio::test(start_paused = true)]
async fn transient_store_errors_are_retried_and_permanent_ones_returned() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = Arc::new(RecordingPublisher::new());
    store.inner.enqueue((0..4).map(|n| msg("k", n))).unwrap();
    store.transient_claim_errors.store(3, Ordering::SeqCst);
    store.transient_complete_errors.store(1, Ordering::SeqCst);
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!((stats.published, stats.store_errors), (4, 4));
    // The failed complete was retried within the lease, so nothing was delivered twice.
    assert_eq!(publisher.sent().len(), 4);

    store.permanent_claim_error.store(true, Ordering::SeqCst);
    let err = relay.run_until_idle().await.unwrap_err();
    assert!(!err.is_transient());
    assert!(err.to_string().contains("does not exist"));
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_is_counted_and_the_messages_are_delivered_again() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    store.inner.enqueue((0..3).map(|n| msg("k", n))).unwrap();
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let run = tokio::spawn(async move { relay.run_until_idle().await });
    until(&publisher.entered, 1).await;
    // The publish outlives the lease by the store's clock; another relay could take over.
    store.advance(Duration::from_secs(31));
    publisher.open();
    let stats = run.await.unwrap().unwrap();
    // The stale completion was refused, then the expired messages were claimed again.
    assert_eq!(stats.lease_lost, 3);
    assert_eq!(stats.claimed, 6);
    assert_eq!(stats.published, 3);
    assert!(store.inner.unpublished().is_empty());
    let deliveries: Vec<u32> = publisher
        .inner
        .published()
        .iter()
        .map(|d| d.delivery)
        .collect();
    assert_eq!(deliveries, vec![1, 1, 1, 2, 2, 2]);
    assert_key_order(&publisher.inner);
}

#[tokio::test(start_paused = true)]
async fn a_long_publish_keeps_its_lease_by_extending_it() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    store.inner.enqueue((0..3).map(|n| msg("k", n))).unwrap();
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config()
            .to_builder()
            .lease(Duration::from_secs(2))
            .build()
            .unwrap(),
    )
    .unwrap();
    let run = tokio::spawn(async move { relay.run_until_idle().await });
    until(&publisher.entered, 1).await;
    // Each extension pushes the lease end to store-now + 2 s; without them it would have
    // ended 2 s after the claim, well before the store's clock reaches +3 s.
    for round in 1..=3u64 {
        until(&store.extends, round).await;
        store.advance(Duration::from_millis(1500));
    }
    publisher.open();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(
        (stats.published, stats.lease_lost, stats.claimed),
        (3, 0, 3)
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_extension_still_tries_to_complete_and_counts_the_loss() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    store.inner.enqueue([msg("k", 0), msg("k", 1)]).unwrap();
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config()
            .to_builder()
            .lease(Duration::from_secs(2))
            .build()
            .unwrap(),
    )
    .unwrap();
    let run = tokio::spawn(async move { relay.run_until_idle().await });
    until(&publisher.entered, 1).await;
    store.advance(Duration::from_secs(3));
    until(&store.extends, 1).await;
    publisher.open();
    let stats = run.await.unwrap().unwrap();
    assert_eq!(store.complete_calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        (stats.lease_lost, stats.published, stats.claimed),
        (2, 2, 4)
    );
}

#[tokio::test(start_paused = true)]
async fn the_notifier_wakes_an_idle_relay() {
    // No store wake-ups and an hour between polls: only the notifier can wake it in time.
    let store = TestStore::new(Wakeups::Off);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        polling_hourly().build().unwrap(),
    )
    .unwrap();
    let handle = relay.spawn();
    until(&store.claims, 1).await; // the first, empty claim: now idle
    store.inner.enqueue([msg("k", 0)]).unwrap();
    handle.notifier().notify();
    published(&publisher, 1).await;
    // A notification sent while the relay is busy is not lost either.
    store.inner.enqueue([msg("k", 1)]).unwrap();
    relay.notifier().notify();
    published(&publisher, 2).await;
    let stats = handle.shutdown(Duration::from_secs(5)).await.unwrap();
    assert_eq!(stats.published, 2);
}

#[tokio::test(start_paused = true)]
async fn store_wake_ups_wake_an_idle_relay_and_are_resubscribed_after_errors() {
    let store = TestStore::new(Wakeups::FailFirst(2));
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        polling_hourly()
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                ..Backoff::default()
            })
            .build()
            .unwrap(),
    )
    .unwrap();
    let handle = relay.spawn();
    // Two failed subscriptions, then a working one.
    until(&store.subscribes, 3).await;
    until(&store.claims, 1).await;
    // The commit itself is the wake-up; nobody calls the notifier.
    store.inner.enqueue([msg("k", 0)]).unwrap();
    published(&publisher, 1).await;
    let stats = handle.shutdown(Duration::from_secs(5)).await.unwrap();
    assert_eq!(stats.published, 1);
}

#[tokio::test(start_paused = true)]
async fn adaptive_polling_finds_messages_without_any_wake_up() {
    let store = TestStore::new(Wakeups::Off);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let handle = relay.spawn();
    until(&store.claims, 5).await;
    store.inner.enqueue([msg("k", 0)]).unwrap();
    published(&publisher, 1).await;
    let stats = handle.shutdown(Duration::from_secs(5)).await.unwrap();
    assert_eq!(stats.published, 1);
}

#[tokio::test(start_paused = true)]
async fn shutdown_lets_an_in_flight_batch_finish_and_stops_claiming() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    store.inner.enqueue([msg("a", 0), msg("a", 1)]).unwrap();
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config().to_builder().concurrency(1).build().unwrap(),
    )
    .unwrap();
    let handle = relay.spawn();
    until(&publisher.entered, 1).await;
    // Enqueued while the only slot is busy: must not be claimed once shutdown began.
    store.inner.enqueue([msg("b", 0)]).unwrap();
    let opener = {
        let publisher = publisher.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            publisher.open();
        })
    };
    let stats = handle.shutdown(Duration::from_secs(10)).await.unwrap();
    opener.await.unwrap();
    assert_eq!((stats.published, stats.released, stats.claimed), (2, 0, 2));
    let left = store.inner.unpublished();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].partition_key.as_deref(), Some("b"));
    assert_eq!(store.inner.counts().await.unwrap().leased, 0);
}

#[tokio::test(start_paused = true)]
async fn shutdown_past_the_deadline_releases_what_is_still_leased() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    store.inner.enqueue((0..3).map(|n| msg("a", n))).unwrap();
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let handle = relay.spawn();
    until(&publisher.entered, 1).await;
    // The publish never finishes.
    let stats = handle.shutdown(Duration::from_secs(2)).await.unwrap();
    assert_eq!((stats.claimed, stats.released, stats.published), (3, 3, 0));
    let counts = store.inner.counts().await.unwrap();
    assert_eq!((counts.pending, counts.leased), (3, 0));
    // Released without counting an attempt, and claimable at once by the next relay.
    assert!(store.inner.unpublished().iter().all(|m| m.attempts == 0));
    let next = Arc::new(RecordingPublisher::new());
    let stats = Relay::new(store.clone(), next.clone(), config())
        .unwrap()
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.published, 3);
    assert_key_order(&next);
}

#[tokio::test(start_paused = true)]
async fn aborting_mid_publish_loses_nothing() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    // 13 keys: the first claim takes 10 of them, the second the other 3.
    store
        .inner
        .enqueue((0..25).map(|n| msg(&format!("k{}", n % 13), n)))
        .unwrap();
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let handle = relay.spawn();
    until(&publisher.entered, 2).await;
    handle.abort().await;
    // Leases held by the crashed relay end; a new relay takes everything over.
    store.advance(Duration::from_secs(31));
    let next = Arc::new(RecordingPublisher::new());
    let stats = Relay::new(store.clone(), next.clone(), config())
        .unwrap()
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.published, 25);
    assert!(store.inner.unpublished().is_empty());
    assert_key_order(&next);
}

#[tokio::test(start_paused = true)]
async fn aborting_between_publish_and_complete_duplicates_but_loses_nothing() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = Arc::new(RecordingPublisher::new());
    store.inner.enqueue((0..5).map(|n| msg("k", n))).unwrap();
    store.complete_open.send_replace(false);
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let handle = relay.spawn();
    until(&store.completes_entered, 1).await;
    handle.abort().await;
    store.complete_open.send_replace(true);
    store.advance(Duration::from_secs(31));
    let stats = Relay::new(store.clone(), publisher.clone(), config())
        .unwrap()
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(stats.published, 5);
    assert!(store.inner.unpublished().is_empty());
    // At least once: each message reached the broker twice, with the same id.
    let deliveries: Vec<u32> = publisher.published().iter().map(|d| d.delivery).collect();
    assert_eq!(deliveries, vec![1, 1, 1, 1, 1, 2, 2, 2, 2, 2]);
}

/// No relay can be made with an invalid config: the builder refuses it, naming the setting.
#[test]
fn invalid_config_is_refused_before_anything_runs() {
    let err = config().to_builder().batch_size(0).build().unwrap_err();
    assert!(
        matches!(err, Error::InvalidInput(ref m) if m.contains("batch_size")),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_panicking_publisher_is_retried_not_fatal() {
    let store = TestStore::new(Wakeups::Inner);
    store.inner.enqueue([msg("k", 0), msg("k", 1)]).unwrap();
    let panicked = std::sync::atomic::AtomicBool::new(false);
    let publisher = Arc::new(ScriptedPublisher(
        move |batch: &[outbox_traits::Message]| {
            if !panicked.swap(true, Ordering::SeqCst) {
                panic!("publisher bug under test");
            }
            vec![PublishOutcome::Acked; batch.len()]
        },
    ));
    let relay = Relay::new(store.clone(), publisher, config()).unwrap();
    let first = relay.run_until_idle().await.unwrap();
    assert_eq!((first.retried, first.published), (2, 0));
    store.advance(PAST_ANY_RETRY);
    assert_eq!(relay.run_until_idle().await.unwrap().published, 2);
}

#[tokio::test(start_paused = true)]
async fn several_relays_with_mixed_outcomes_lose_nothing_and_keep_key_order() {
    use rand::{Rng, SeedableRng};
    for seed in 0..8u64 {
        let store = TestStore::new(Wakeups::Inner);
        let publisher = Arc::new(RecordingPublisher::new());
        let rng = std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(seed));
        publisher.set_outcome(move |_| {
            let roll = rng.lock().unwrap().random_range(0..100);
            match roll {
                0..=9 => PublishOutcome::transient("busy"),
                10..=14 => PublishOutcome::Ambiguous {
                    reason: "timeout".into(),
                },
                15..=16 => PublishOutcome::permanent("rejected"),
                _ => PublishOutcome::Acked,
            }
        });
        let mut total = 0u64;
        for n in 0..30u32 {
            let batch: Vec<_> = (0..6).map(|k| msg(&format!("k{k}"), n)).collect();
            total += batch.len() as u64;
            store.inner.enqueue(batch).unwrap();
        }
        let relays: Vec<Relay> = (0..3)
            .map(|i| {
                let config = config()
                    .to_builder()
                    .batch_size(5 + i * 7)
                    .concurrency(1 + i)
                    .max_attempts(4)
                    .head_policy(HeadPolicy::Skip)
                    .build()
                    .unwrap();
                Relay::new(store.clone(), publisher.clone(), config).unwrap()
            })
            .collect();
        let mut stats = RelayStats::default();
        for _ in 0..40 {
            for run in futures::future::join_all(relays.iter().map(|r| r.run_until_idle())).await {
                stats += run.unwrap();
            }
            if store.inner.unpublished().is_empty() {
                break;
            }
            store.advance(PAST_ANY_RETRY);
        }
        let counts = store.inner.counts().await.unwrap();
        assert_eq!(counts.pending + counts.leased, 0, "seed {seed}: loss");
        assert_eq!(counts.published + counts.dead, total, "seed {seed}");
        assert_eq!(
            (stats.published, stats.dead),
            (counts.published, counts.dead),
            "seed {seed}"
        );
        assert_eq!(
            stats.claimed,
            stats.published + stats.retried + stats.dead + stats.released,
            "seed {seed}: every claimed message settled once"
        );
        assert_eq!(stats.lease_lost, 0);
        assert_key_order(&publisher);
    }
}

#[tokio::test(start_paused = true)]
async fn a_notifier_made_before_the_relay_wakes_it_and_stats_are_live() {
    let store = TestStore::new(Wakeups::Off);
    let publisher = Arc::new(RecordingPublisher::new());
    let notifier = outbox_engine::Notifier::new();
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        polling_hourly().build().unwrap(),
    )
    .unwrap()
    .with_notifier(notifier.clone());
    let handle = relay.spawn();
    until(&store.claims, 1).await;
    store.inner.enqueue([msg("k", 0)]).unwrap();
    notifier.notify();
    published(&publisher, 1).await;
    // After a partial claim the next one waits for the batch to settle (or poll_min, an
    // hour): the third claim therefore comes after the completion.
    until(&store.claims, 3).await;
    assert_eq!(handle.stats().published, 1);
    assert!(!handle.is_finished());
    handle.shutdown(Duration::from_secs(1)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn run_serves_until_its_shutdown_future_resolves() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stop_rx.await;
            })
            .await
    });
    store.inner.enqueue([msg("k", 0), msg("k", 1)]).unwrap();
    published(&publisher, 2).await;
    until(&store.completes_entered, 1).await;
    stop_tx.send(()).unwrap();
    let stats = task.await.unwrap().unwrap();
    assert_eq!((stats.claimed, stats.published), (2, 2));
}

#[tokio::test(start_paused = true)]
async fn a_drain_stopped_early_finishes_its_batch_and_claims_nothing_more() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    store
        .inner
        .enqueue([msg("a", 0), msg("b", 0), msg("c", 0)])
        .unwrap();
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config()
            .to_builder()
            .batch_size(1)
            .concurrency(1)
            .build()
            .unwrap(),
    )
    .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (taken_tx, taken_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        relay
            .run_until_idle_or(async {
                let _ = stop_rx.await;
                // Resolving is the relay taking the stop: it polls this future in its loop.
                let _ = taken_tx.send(());
            })
            .await
    });
    until(&publisher.entered, 1).await;
    stop_tx.send(()).unwrap();
    // The publish is let through only once the relay has taken the stop (a failure guard on
    // the paused clock: a relay that never takes it fails here instead of hanging).
    tokio::time::timeout(Duration::from_secs(60), taken_rx)
        .await
        .expect("the drain never took the stop")
        .unwrap();
    publisher.open();
    let stats = task.await.unwrap().unwrap();
    assert_eq!((stats.claimed, stats.published, stats.released), (1, 1, 0));
    assert_eq!(
        store.inner.unpublished().len(),
        2,
        "nothing claimed after the stop"
    );
    assert_eq!(store.inner.counts().await.unwrap().leased, 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_handle_shuts_down_with_the_configured_deadline() {
    let store = TestStore::new(Wakeups::Inner);
    let publisher = GatedPublisher::closed();
    store.inner.enqueue([msg("k", 0), msg("k", 1)]).unwrap();
    let relay = Relay::new(store.clone(), publisher.clone(), config()).unwrap();
    let handle = relay.spawn();
    until(&publisher.entered, 1).await;
    drop(handle);
    // The publish never ends: past `shutdown_deadline` the relay releases the batch.
    until(&store.releases, 1).await;
    let counts = store.inner.counts().await.unwrap();
    assert_eq!((counts.pending, counts.leased), (2, 0));
}

#[tokio::test(start_paused = true)]
async fn the_idle_poll_interval_doubles_up_to_poll_max_and_resets_on_work() {
    let store = TestStore::new(Wakeups::Off);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config()
            .to_builder()
            .poll_min(Duration::from_millis(10))
            .poll_max(Duration::from_millis(80))
            .build()
            .unwrap(),
    )
    .unwrap();
    let handle = relay.spawn();
    until(&store.claims, 7).await;
    store.inner.enqueue([msg("k", 0)]).unwrap();
    published(&publisher, 1).await;
    until(&store.claims, 11).await;
    handle.shutdown(Duration::from_secs(1)).await.unwrap();

    // Tokio's clock is paused, so the gaps are exactly the relay's waits (to timer resolution).
    let times = store.claim_times.lock().unwrap().clone();
    let gaps: Vec<u128> = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    let close = |got: u128, want: u128| got >= want && got <= want + 2;
    // Six empty claims (10 → 80 ms, capped), the claim that finds the message 80 ms later, an
    // immediate claim once its batch settled, then polling from poll_min again.
    let want = [10, 20, 40, 80, 80, 80, 80, 0, 10, 20];
    assert!(gaps.len() >= want.len(), "gaps {gaps:?}");
    for (got, want) in gaps.iter().zip(want) {
        assert!(close(*got, want), "gaps {gaps:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_wake_ups_does_not_spin_the_claim_loop() {
    let store = TestStore::new(Wakeups::Off);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        store.clone(),
        publisher,
        config()
            .to_builder()
            .poll_min(Duration::from_millis(10))
            .poll_max(Duration::from_secs(3600))
            .build()
            .unwrap(),
    )
    .unwrap();
    let handle = relay.spawn();
    let notifier = handle.notifier();
    until(&store.claims, 1).await;
    let start = tokio::time::Instant::now();
    // Nothing to claim, yet a wake-up after every claim: once a claim made on a wake-up found
    // nothing, the following claims stay poll_min apart.
    for n in 2..=20 {
        notifier.notify();
        until(&store.claims, n).await;
    }
    let elapsed = start.elapsed();
    handle.shutdown(Duration::from_secs(1)).await.unwrap();
    let times = store.claim_times.lock().unwrap().clone();
    assert!(
        times[1..]
            .windows(2)
            .all(|w| w[1] - w[0] >= Duration::from_millis(10)),
        "claims closer than poll_min: {times:?}"
    );
    assert!(elapsed >= Duration::from_millis(180), "{elapsed:?}");
}

#[tokio::test(start_paused = true)]
async fn a_wake_up_during_a_claim_that_finds_nothing_is_not_lost() {
    let store = TestStore::new(Wakeups::Off);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        polling_hourly().build().unwrap(),
    )
    .unwrap();
    store.claim_return_open.send_replace(false);
    let handle = relay.spawn();
    // The first claim has read an empty store and is on its way back...
    until(&store.claims_read, 1).await;
    // ...when a message commits and the notifier fires.
    store.inner.enqueue([msg("k", 0)]).unwrap();
    handle.notifier().notify();
    // Let the relay take the wake-up while its claim is still out (one thread: yielding runs it).
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    store.claim_return_open.send_replace(true);
    published(&publisher, 1).await;
    let stats = handle.shutdown(Duration::from_secs(1)).await.unwrap();
    assert_eq!(stats.published, 1);
}

#[tokio::test(start_paused = true)]
async fn an_innocent_empty_claim_after_a_wake_up_does_not_delay_the_next_one() {
    let store = TestStore::new(Wakeups::Off);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        polling_hourly().build().unwrap(),
    )
    .unwrap();
    let handle = relay.spawn();
    let notifier = handle.notifier();
    until(&store.claims, 1).await;
    // Round 1: a second wake-up lands while the claim that takes the message is out, so the
    // relay claims once more on it and finds nothing (the message is already leased).
    store.claim_return_open.send_replace(false);
    store.inner.enqueue([msg("k", 0)]).unwrap();
    notifier.notify();
    until(&store.claims_read, 2).await;
    notifier.notify();
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    store.claim_return_open.send_replace(true);
    published(&publisher, 1).await;
    // Round 2: served promptly, not after poll_min (an hour).
    store.inner.enqueue([msg("k", 1)]).unwrap();
    notifier.notify();
    published(&publisher, 2).await;
    handle.shutdown(Duration::from_secs(1)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_publisher_that_never_attempts_cannot_spin_the_relay() {
    let store = TestStore::new(Wakeups::Inner);
    store
        .inner
        .enqueue([msg("k", 0), msg("u", 0).unordered()])
        .unwrap();
    let lazy = Arc::new(ScriptedPublisher(|batch: &[outbox_traits::Message]| {
        vec![PublishOutcome::NotAttempted; batch.len()]
    }));
    let relay = Relay::new(store.clone(), lazy, config()).unwrap();
    // Returns (rather than claiming and releasing forever), with an attempt counted for each.
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!((stats.claimed, stats.retried, stats.released), (2, 2, 0));
    assert!(store.inner.unpublished().iter().all(|m| m.attempts == 1));
}
