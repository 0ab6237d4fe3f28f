//! Test doubles around the memory reference store and recording publisher: counters and gates
//! to observe and pause the relay, and injected store errors.

#![allow(dead_code)] // Each test binary uses a different part of the support module.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_memory::{MemoryStore, RecordingPublisher};
use outbox_traits::{
    async_trait, chrono, Capabilities, Claim, ClaimRequest, Error, Failure, LeaseToken, Message,
    NewMessage, OutboxStore, PublishOutcome, Publisher, WakeSource,
};
use tokio::sync::watch;
use uuid::Uuid;

/// Generous guard against a hung test; never used to wait for progress.
pub const GUARD: Duration = Duration::from_secs(60);

/// A message of `key` carrying its per-key position `n` in the payload.
pub fn msg(key: &str, n: u32) -> NewMessage {
    NewMessage::new("order", key, "order.placed", serde_json::json!({ "n": n }))
}

/// The `n` of a message made by [`msg`].
pub fn n_of(m: &Message) -> u64 {
    serde_json::from_str::<serde_json::Value>(&m.payload).unwrap()["n"]
        .as_u64()
        .unwrap()
}

/// Assert that the first delivery of each key's messages came in enqueue order.
pub fn assert_key_order(publisher: &RecordingPublisher) {
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    for d in publisher.published().iter().filter(|d| d.delivery == 1) {
        let Some(key) = d.message.partition_key.clone() else {
            continue;
        };
        let n = n_of(&d.message);
        if let Some(prev) = last.insert(key.clone(), n) {
            assert!(prev < n, "key {key}: {n} published after {prev}");
        }
    }
}

/// Wait (with the guard) until the counter reaches `n`.
pub async fn until(counter: &watch::Sender<u64>, n: u64) {
    let mut rx = counter.subscribe();
    tokio::time::timeout(GUARD, rx.wait_for(|v| *v >= n))
        .await
        .expect("timed out: the relay did not get there")
        .unwrap();
}

/// Wait (with the guard) until the publisher saw `n` deliveries reach the broker.
pub async fn published(publisher: &RecordingPublisher, n: usize) {
    tokio::time::timeout(GUARD, publisher.wait_for(n))
        .await
        .expect("timed out waiting for deliveries");
}

fn bump(counter: &watch::Sender<u64>) {
    counter.send_modify(|v| *v += 1);
}

/// How [`TestStore::wakeups`] behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wakeups {
    /// The memory store's commit wake-ups.
    Inner,
    /// No wake-up source: only the notifier and polling.
    Off,
    /// Subscribing fails this many times, then the memory store's source is returned.
    FailFirst(u32),
}

/// A [`MemoryStore`] with counters, gates and injected errors.
pub struct TestStore {
    pub inner: MemoryStore,
    /// Claims that returned (any result).
    pub claims: watch::Sender<u64>,
    /// When each claim returned, by tokio's clock (paused in tests, so exact).
    pub claim_times: Mutex<Vec<tokio::time::Instant>>,
    /// Extend calls that returned.
    pub extends: watch::Sender<u64>,
    /// Subscription attempts.
    pub subscribes: watch::Sender<u64>,
    /// Release calls that returned.
    pub releases: watch::Sender<u64>,
    pub complete_calls: AtomicU64,
    pub fail_calls: AtomicU64,
    pub release_calls: AtomicU64,
    /// The next this-many claims fail with a transient error.
    pub transient_claim_errors: AtomicU32,
    /// The next this-many completes fail with a transient error (nothing is changed).
    pub transient_complete_errors: AtomicU32,
    /// Every claim fails with a permanent error.
    pub permanent_claim_error: AtomicBool,
    /// While false, a claim that has read the store waits before returning its result.
    pub claim_return_open: watch::Sender<bool>,
    /// Claims that read the store (before the return gate).
    pub claims_read: watch::Sender<u64>,
    /// While false, `complete` waits (the batch is published but not yet marked).
    pub complete_open: watch::Sender<bool>,
    /// Completes that reached the gate.
    pub completes_entered: watch::Sender<u64>,
    pub wakeups: Wakeups,
    subscribe_failures: AtomicU32,
}

impl TestStore {
    pub fn new(wakeups: Wakeups) -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryStore::new(),
            claims: watch::Sender::new(0),
            claim_times: Mutex::new(Vec::new()),
            extends: watch::Sender::new(0),
            subscribes: watch::Sender::new(0),
            releases: watch::Sender::new(0),
            complete_calls: AtomicU64::new(0),
            fail_calls: AtomicU64::new(0),
            release_calls: AtomicU64::new(0),
            transient_claim_errors: AtomicU32::new(0),
            transient_complete_errors: AtomicU32::new(0),
            permanent_claim_error: AtomicBool::new(false),
            claim_return_open: watch::Sender::new(true),
            claims_read: watch::Sender::new(0),
            complete_open: watch::Sender::new(true),
            completes_entered: watch::Sender::new(0),
            wakeups,
            subscribe_failures: AtomicU32::new(0),
        })
    }

    /// Move the store's clock forward (leases end, retries come due).
    pub fn advance(&self, by: Duration) {
        self.inner.clock().advance(by);
    }

    fn take(counter: &AtomicU32) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

#[async_trait]
impl OutboxStore for TestStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        let result = if self.permanent_claim_error.load(Ordering::SeqCst) {
            Err(Error::permanent("relation \"outbox\" does not exist", None))
        } else if Self::take(&self.transient_claim_errors) {
            Err(Error::unavailable(
                "test-db",
                "connection refused",
                "refused",
            ))
        } else {
            self.inner.claim(req).await
        };
        bump(&self.claims_read);
        let _ = self.claim_return_open.subscribe().wait_for(|o| *o).await;
        self.claim_times
            .lock()
            .unwrap()
            .push(tokio::time::Instant::now());
        bump(&self.claims);
        result
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.complete_calls.fetch_add(1, Ordering::SeqCst);
        bump(&self.completes_entered);
        let mut open = self.complete_open.subscribe();
        let _ = open.wait_for(|o| *o).await;
        if Self::take(&self.transient_complete_errors) {
            return Err(Error::unavailable("test-db", "connection reset", "reset"));
        }
        self.inner.complete(token, ids).await
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        self.fail_calls.fetch_add(1, Ordering::SeqCst);
        self.inner.fail(token, failures).await
    }

    async fn extend(
        &self,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<chrono::DateTime<chrono::Utc>, Error> {
        let result = self.inner.extend(token, lease).await;
        bump(&self.extends);
        result
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.release_calls.fetch_add(1, Ordering::SeqCst);
        let result = self.inner.release(token, ids).await;
        bump(&self.releases);
        result
    }

    fn capabilities(&self) -> Capabilities {
        self.inner
            .capabilities()
            .with_wakeups(self.wakeups != Wakeups::Off)
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        bump(&self.subscribes);
        match self.wakeups {
            Wakeups::Off => Ok(None),
            Wakeups::FailFirst(n) if self.subscribe_failures.fetch_add(1, Ordering::SeqCst) < n => {
                Err(Error::unavailable("test-db", "LISTEN failed", "refused"))
            }
            _ => self.inner.wakeups().await,
        }
    }
}

/// A recording publisher that waits at a gate before publishing.
pub struct GatedPublisher {
    pub inner: RecordingPublisher,
    /// While false, `publish` waits.
    pub open: watch::Sender<bool>,
    /// `publish` calls that reached the gate.
    pub entered: watch::Sender<u64>,
}

impl GatedPublisher {
    pub fn closed() -> Arc<Self> {
        Arc::new(Self {
            inner: RecordingPublisher::new(),
            open: watch::Sender::new(false),
            entered: watch::Sender::new(0),
        })
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }
}

#[async_trait]
impl Publisher for GatedPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        bump(&self.entered);
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|o| *o).await;
        self.inner.publish(batch).await
    }

    fn name(&self) -> &str {
        "gated"
    }
}

/// A publisher whose outcomes are computed from the whole batch (to play a buggy publisher).
pub struct ScriptedPublisher<F>(pub F);

#[async_trait]
impl<F> Publisher for ScriptedPublisher<F>
where
    F: Fn(&[Message]) -> Vec<PublishOutcome> + Send + Sync,
{
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        (self.0)(batch)
    }

    fn name(&self) -> &str {
        "scripted"
    }
}
