//! `run_until_idle` must not stop on an empty claim that raced with a batch settling: the claim
//! saw the batch's leases, which were gone by the time its answer arrived.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_engine::{Relay, RelayConfig};
use outbox_memory::{MemoryStore, RecordingPublisher};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::uuid::Uuid;
use outbox_traits::{
    async_trait, Claim, ClaimRequest, Error, Failure, LeaseToken, Message, NewMessage, OutboxAdmin,
    OutboxStore, PublishOutcome, Publisher,
};
use tokio::sync::Notify;

/// Runs the second claim while the first batch is being published, but hands its (empty)
/// answer back only after the first batch was completed and settled.
struct RacingStore {
    inner: MemoryStore,
    claims: AtomicU32,
    second_claim_ran: Notify,
    completed: Notify,
}

/// Holds the first batch's publish until the second claim has looked at the store.
struct SlowFirstPublish {
    inner: RecordingPublisher,
    store: Arc<RacingStore>,
    calls: AtomicU32,
}

#[async_trait]
impl Publisher for SlowFirstPublish {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            self.store.second_claim_ran.notified().await;
        }
        self.inner.publish(batch).await
    }
    fn name(&self) -> &str {
        "slow-first"
    }
}

#[async_trait]
impl OutboxStore for RacingStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        let n = self.claims.fetch_add(1, Ordering::SeqCst);
        let claim = self.inner.claim(req).await;
        if n == 1 {
            self.second_claim_ran.notify_one();
            self.completed.notified().await;
            // Let the engine take in the settled batch before this answer arrives, as a real
            // store's network round trip would.
            for _ in 0..50 {
                tokio::task::yield_now().await;
            }
        }
        claim
    }
    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        let done = self.inner.complete(token, ids).await;
        self.completed.notify_one();
        done
    }
    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        self.inner.fail(token, failures).await
    }
    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        self.inner.extend(token, lease).await
    }
    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.inner.release(token, ids).await
    }
}

#[tokio::test]
async fn an_empty_claim_that_overlapped_a_settle_does_not_end_the_drain() {
    let store = Arc::new(RacingStore {
        inner: MemoryStore::new(),
        claims: AtomicU32::new(0),
        second_claim_ran: Notify::new(),
        completed: Notify::new(),
    });
    // One key: while the first batch (its first two messages) is leased, the key's later
    // messages are held back, so the concurrent second claim finds nothing.
    store
        .inner
        .enqueue((0..6).map(|n| {
            NewMessage::new(
                "order",
                "o-1",
                "order.placed",
                serde_json::json!({ "n": n }),
            )
        }))
        .unwrap();
    let publisher = Arc::new(SlowFirstPublish {
        inner: RecordingPublisher::new(),
        store: store.clone(),
        calls: AtomicU32::new(0),
    });
    let relay = Relay::new(
        store.clone(),
        publisher,
        RelayConfig::builder()
            .batch_size(2)
            .concurrency(2)
            .build()
            .unwrap(),
    )
    .unwrap();

    let stats = tokio::time::timeout(Duration::from_secs(30), relay.run_until_idle())
        .await
        .expect("drain hung")
        .unwrap();

    assert_eq!(stats.published, 6, "{stats:?}");
    assert_eq!(store.inner.counts().await.unwrap().published, 6);
}
