//! The engine on a real SQLite database (always runs: SQLite needs no server). Time is shifted
//! through the stored due times, never slept away.

mod support;

use std::sync::Arc;
use std::time::Duration;

use outbox_backend_sqlite::{enqueue_batch, sqlite_error, SqliteConfig, SqliteStore};
use outbox_engine::{Relay, RelayConfig, RelayStats};
use outbox_memory::RecordingPublisher;
use outbox_traits::{Error, NewMessage, OutboxAdmin, PublishOutcome};
use support::*;

async fn open() -> (tempfile::TempDir, Arc<SqliteStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("outbox.db"), SqliteConfig::default())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    (dir, Arc::new(store))
}

async fn enqueue(store: &SqliteStore, messages: Vec<NewMessage>) {
    store
        .transaction(move |tx, config| enqueue_batch(tx, config, &messages))
        .await
        .unwrap();
}

/// Three relays over `store` and `publisher`, with batches of 16.
fn three_relays(store: &Arc<SqliteStore>, publisher: &Arc<RecordingPublisher>) -> Vec<Relay> {
    let config = RelayConfig::builder().batch_size(16).build().unwrap();
    (0..3)
        .map(|_| Relay::new(store.clone(), publisher.clone(), config.clone()).unwrap())
        .collect()
}

/// `per_key` messages of each of five keys, interleaved, one transaction per round; returns
/// how many.
async fn enqueue_five_keys(store: &SqliteStore, per_key: u32) -> u64 {
    let keys = ["a", "b", "c", "d", "e"];
    for n in 0..per_key {
        enqueue(store, keys.iter().map(|k| msg(k, n)).collect()).await;
    }
    u64::from(per_key) * keys.len() as u64
}

/// Make every pending message due now, as if its retry delay had passed.
async fn make_retries_due(store: &SqliteStore) {
    store
        .transaction(|tx, config| {
            tx.execute(
                &format!(
                    "UPDATE {} SET available_at = available_at - 3600000 WHERE state = 'pending'",
                    config.table()
                ),
                [],
            )
            .map_err(sqlite_error)
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_drain_sqlite_with_retries_in_key_order() {
    let (_dir, store) = open().await;
    let total = enqueue_five_keys(&store, 40).await;
    let publisher = Arc::new(RecordingPublisher::new());
    // Every 7th message fails on its first attempt.
    publisher.set_outcome(|m| {
        if m.attempts == 0 && m.seq % 7 == 0 {
            PublishOutcome::transient("broker busy")
        } else {
            PublishOutcome::Acked
        }
    });
    let relays = three_relays(&store, &publisher);
    let mut stats = RelayStats::default();
    for _ in 0..20 {
        let runs = futures::future::join_all(relays.iter().map(|r| r.run_until_idle())).await;
        for run in runs {
            stats += run.unwrap();
        }
        if store.counts().await.unwrap().published == total {
            break;
        }
        make_retries_due(&store).await;
    }
    let counts = store.counts().await.unwrap();
    assert_eq!(
        (counts.published, counts.pending, counts.leased),
        (total, 0, 0)
    );
    assert_eq!(stats.published, total);
    assert_eq!(stats.retried, total / 7);
    assert_eq!(stats.lease_lost, 0);
    // Every claimed message was settled exactly once per claim.
    assert_eq!(
        stats.claimed,
        stats.published + stats.retried + stats.released
    );
    // Exclusive claims: no message reached the broker twice.
    assert!(publisher.published().iter().all(|d| d.delivery == 1));
    assert_key_order(&publisher);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_relay_on_sqlite_is_woken_by_the_notifier_and_shuts_down() {
    let (_dir, store) = open().await;
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        RelayConfig::builder()
            // Polling alone would take an hour: the notifier must do the waking.
            .poll_min(Duration::from_secs(3600))
            .poll_max(Duration::from_secs(3600))
            .build()
            .unwrap(),
    )
    .unwrap();
    let handle = relay.spawn();
    for round in 1..=3u32 {
        enqueue(&store, vec![msg("k", round)]).await;
        handle.notifier().notify();
        published(&publisher, round as usize).await;
    }
    let stats = handle.shutdown(Duration::from_secs(10)).await.unwrap();
    assert_eq!(stats.published, 3);
    assert_key_order(&publisher);
    let dead = store.list_dead(None, 10).await.unwrap();
    assert!(dead.is_empty());
}

#[tokio::test]
async fn a_missing_table_is_a_permanent_error_from_run_until_idle() {
    let (_dir, store) = open().await;
    store
        .transaction(|tx, config| {
            tx.execute_batch(&format!("DROP TABLE {}", config.table()))
                .map_err(sqlite_error)
        })
        .await
        .unwrap();
    let relay = Relay::new(
        store.clone(),
        Arc::new(RecordingPublisher::new()),
        RelayConfig::default(),
    )
    .unwrap();
    let err: Error = relay.run_until_idle().await.unwrap_err();
    assert!(!err.is_transient(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_draining_one_sqlite_backlog_at_once_each_return_only_once_it_is_done() {
    let (_dir, store) = open().await;
    // Five keys and batches of 16: the first claim holds every key's head, so the others'
    // first claims find nothing and must wait for it.
    let total = enqueue_five_keys(&store, 60).await;
    let publisher = Arc::new(RecordingPublisher::new());
    let relays = three_relays(&store, &publisher);
    let mut drains: futures::stream::FuturesUnordered<_> = relays
        .iter()
        .map(|r| r.run_until_drained(store.as_ref()))
        .collect();
    let first = futures::StreamExt::next(&mut drains)
        .await
        .unwrap()
        .unwrap();
    let counts = store.counts().await.unwrap();
    assert_eq!(
        (counts.published, counts.pending, counts.leased),
        (total, 0, 0),
        "the backlog is done when the first drain returns ({first:?})"
    );
    let mut stats = first;
    while let Some(run) = futures::StreamExt::next(&mut drains).await {
        stats += run.unwrap();
    }
    assert_eq!(stats.published, total);
    assert!(publisher.published().iter().all(|d| d.delivery == 1));
    assert_key_order(&publisher);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_does_not_wait_for_a_key_blocked_by_a_dead_head() {
    let (_dir, store) = open().await;
    enqueue(&store, (0..3).map(|n| msg("blocked", n)).collect()).await;
    enqueue(&store, (0..3).map(|n| msg("free", n)).collect()).await;
    let publisher = Arc::new(RecordingPublisher::new());
    publisher.set_outcome(|m| {
        if m.partition_key.as_deref() == Some("blocked") {
            PublishOutcome::permanent("refused for good")
        } else {
            PublishOutcome::Acked
        }
    });
    let relay = Relay::new(store.clone(), publisher.clone(), RelayConfig::default()).unwrap();

    let stats = tokio::time::timeout(GUARD, relay.run_until_drained(store.as_ref()))
        .await
        .expect("the drain waited for the blocked key")
        .unwrap();

    assert_eq!((stats.published, stats.dead), (3, 1));
    let counts = store.counts().await.unwrap();
    assert_eq!(
        (counts.published, counts.dead, counts.pending, counts.leased),
        (3, 1, 2, 0),
        "the blocked key's later messages stay pending"
    );
}
