//! Sharded claims (`RelayConfig::claim_shards`): with a store that declares
//! `Capabilities::sharded_claims`, the relay runs one claim per shard at a time, each asking for
//! its own shard, within `concurrency` in all; otherwise one unsharded claim at a time. Left
//! unset, the claim shards and the batch size are the store's choice
//! (`Capabilities::preferred_claim_shards`, `preferred_batch`); an explicit setting wins.
//!
//! The store here is the memory store (which honours `ClaimRequest::shard`) behind a wrapper
//! that declares the capability or not and records the claims. Each claim that starts alone
//! waits for a second one to start beside it before it reads, escaping alone after
//! [`RENDEZVOUS`] of tokio's paused clock: a relay that can run two claims at once always does
//! here, and one that cannot still finishes. A slow broker is played the same way (each
//! publish takes a fixed time of the paused clock); nothing sleeps to let work come due.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_engine::{Chosen, Relay, RelayConfig};
use outbox_memory::{MemoryStore, RecordingPublisher};
use outbox_traits::{
    async_trait, chrono, Capabilities, Claim, ClaimRequest, ClaimShard, Error, Failure, LeaseToken,
    Message, OutboxStore, PublishOutcome, Publisher,
};
use support::{assert_key_order, msg, published, GUARD};
use tokio::sync::watch;
use uuid::Uuid;

/// How long (paused tokio time) a claim that starts alone waits for a second one.
const RENDEZVOUS: Duration = Duration::from_secs(1);

/// What the store saw of the relay's claims and batches.
#[derive(Debug, Default)]
struct Track {
    /// The shards of the claims running now, and the most claims that ran at once.
    running: Vec<Option<ClaimShard>>,
    max_running: usize,
    /// The shard each claim asked for, in the order the claims started.
    shards: Vec<Option<ClaimShard>>,
    /// The limit (batch size) each claim asked for.
    limits: Vec<usize>,
    /// Each claimed batch not yet settled: its shard and its messages not yet completed, failed
    /// or released.
    open: HashMap<LeaseToken, (Option<ClaimShard>, usize)>,
    /// The most claims running plus batches open at once, in all and of one shard.
    max_load: usize,
    max_shard_load: usize,
}

impl Track {
    /// Claims running plus batches open, of `shard`.
    fn load_of(&self, shard: Option<ClaimShard>) -> usize {
        let running = self.running.iter().filter(|s| **s == shard).count();
        running + self.open.values().filter(|(s, _)| *s == shard).count()
    }
}

/// The memory store, forwarding every call, declaring sharded claims or not, and recording
/// the claims in a [`Track`].
struct ShardedStore {
    inner: MemoryStore,
    declares_sharded_claims: bool,
    /// Map every key to this shard (a valid, if lopsided, shard function) instead of using
    /// the memory store's mapping: claims of other shards find nothing.
    all_in_shard: Option<u32>,
    /// The claim shards and batch size the store declares it prefers, if any.
    prefers: Option<(usize, usize)>,
    track: watch::Sender<Track>,
}

impl ShardedStore {
    fn new(declares_sharded_claims: bool) -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryStore::new(),
            declares_sharded_claims,
            all_in_shard: None,
            prefers: None,
            track: watch::Sender::new(Track::default()),
        })
    }

    /// A store declaring sharded claims or not, and a preference for `shards` claim shards and
    /// batches of `batch`.
    fn preferring(declares_sharded_claims: bool, shards: usize, batch: usize) -> Arc<Self> {
        Arc::new(Self {
            prefers: Some((shards, batch)),
            ..Arc::into_inner(Self::new(declares_sharded_claims)).unwrap()
        })
    }

    /// A store declaring sharded claims that maps every key to shard `index`.
    fn all_in_shard(index: u32) -> Arc<Self> {
        Arc::new(Self {
            all_in_shard: Some(index),
            ..Arc::into_inner(Self::new(true)).unwrap()
        })
    }

    /// Forward the claim, mapping every key to [`ShardedStore::all_in_shard`] if it is set.
    async fn forward(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        let Some(only) = self.all_in_shard else {
            return self.inner.claim(req).await;
        };
        match req.shard {
            Some(shard) if shard.index != only => Ok(Claim {
                token: LeaseToken::new(),
                lease_until: self.inner.clock().now(),
                messages: Vec::new(),
            }),
            Some(_) => {
                let every_key = ClaimRequest {
                    shard: None,
                    ..req.clone()
                };
                self.inner.claim(&every_key).await
            }
            _ => self.inner.claim(req).await,
        }
    }

    /// Enqueue `per_key` messages for each key `k{i}` of `keys`, interleaved; returns how many.
    fn enqueue(&self, keys: impl Iterator<Item = usize> + Clone, per_key: u32) -> u64 {
        for n in 0..per_key {
            self.inner
                .enqueue(keys.clone().map(|key| msg(&format!("k{key}"), n)))
                .unwrap();
        }
        keys.count() as u64 * u64::from(per_key)
    }

    /// `settled` messages of the batch of `token` were completed, failed or released.
    fn settle(&self, token: LeaseToken, settled: usize) {
        self.track.send_modify(|t| {
            if let Some((_, open)) = t.open.get_mut(&token) {
                *open = open.saturating_sub(settled);
                if *open == 0 {
                    t.open.remove(&token);
                }
            }
        });
    }

    /// Wait (with the guard) until the track satisfies `f`.
    async fn until(&self, f: impl FnMut(&Track) -> bool) {
        let mut rx = self.track.subscribe();
        tokio::time::timeout(GUARD, rx.wait_for(f))
            .await
            .expect("timed out: the relay did not get there")
            .unwrap();
    }
}

#[async_trait]
impl OutboxStore for ShardedStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        let (mut arrival, mut alone) = (0, true);
        self.track.send_modify(|t| {
            t.running.push(req.shard);
            t.max_running = t.max_running.max(t.running.len());
            t.max_load = t.max_load.max(t.running.len() + t.open.len());
            t.max_shard_load = t.max_shard_load.max(t.load_of(req.shard));
            t.shards.push(req.shard);
            t.limits.push(req.limit);
            arrival = t.shards.len();
            alone = t.running.len() == 1;
        });
        if alone {
            // Give a second claim the chance to start beside this one (bounded: then alone).
            let mut rx = self.track.subscribe();
            let later = rx.wait_for(|t| t.shards.len() > arrival);
            let _ = tokio::time::timeout(RENDEZVOUS, later).await;
        }
        let result = self.forward(req).await;
        self.track.send_modify(|t| {
            let me = t.running.iter().position(|s| *s == req.shard);
            t.running.swap_remove(me.expect("this claim is running"));
            if let Ok(claim) = &result {
                if !claim.messages.is_empty() {
                    t.open
                        .insert(claim.token, (req.shard, claim.messages.len()));
                }
            }
        });
        result
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.inner.complete(token, ids).await?;
        self.settle(token, ids.len());
        Ok(())
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        self.inner.fail(token, failures).await?;
        self.settle(token, failures.len());
        Ok(())
    }

    async fn extend(
        &self,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<chrono::DateTime<chrono::Utc>, Error> {
        self.inner.extend(token, lease).await
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.inner.release(token, ids).await?;
        self.settle(token, ids.len());
        Ok(())
    }

    fn capabilities(&self) -> Capabilities {
        let caps = self
            .inner
            .capabilities()
            .with_wakeups(false)
            .with_sharded_claims(self.declares_sharded_claims);
        match self.prefers {
            Some((shards, batch)) => caps
                .with_preferred_claim_shards(shards)
                .with_preferred_batch(batch),
            None => caps,
        }
    }
}

fn config(claim_shards: usize) -> RelayConfig {
    RelayConfig::builder()
        .batch_size(5)
        .concurrency(2)
        .claim_shards(claim_shards)
        .build()
        .unwrap()
}

/// A recording publisher on a slow broker: each publish takes `latency` of tokio's (paused)
/// clock, so batches stay in flight while the relay claims.
struct SlowPublisher {
    inner: RecordingPublisher,
    latency: Duration,
}

#[async_trait]
impl Publisher for SlowPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        self.inner.publish(batch).await
    }

    fn name(&self) -> &str {
        "slow"
    }
}

/// Drain `store` with `config`; assert every message was published exactly once, in per-key
/// order, and return what the store saw.
async fn drain(store: &Arc<ShardedStore>, config: RelayConfig, total: u64) -> Track {
    drain_slowly(store, config, total, Duration::ZERO).await
}

/// [`drain`], each publish taking `latency`.
async fn drain_slowly(
    store: &Arc<ShardedStore>,
    config: RelayConfig,
    total: u64,
    latency: Duration,
) -> Track {
    let slow = Arc::new(SlowPublisher {
        inner: RecordingPublisher::new(),
        latency,
    });
    let publisher = &slow.inner;
    let relay = Relay::new(store.clone(), slow.clone(), config).unwrap();
    let stats = tokio::time::timeout(GUARD, relay.run_until_idle())
        .await
        .expect("drain hung")
        .unwrap();
    assert_eq!(
        (stats.claimed, stats.published),
        (total, total),
        "{stats:?} {:?}",
        store.track.borrow()
    );
    let mut ids = publisher.published_ids();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len() as u64, total, "each message published once");
    assert_eq!(publisher.published().len() as u64, total, "no duplicates");
    assert_key_order(publisher);
    assert!(store.inner.unpublished().is_empty());
    store.track.send_replace(Track::default())
}

/// Every claim asked for one of `count` shards.
fn assert_only_shards_of(track: &Track, count: u32) {
    assert!(
        track
            .shards
            .iter()
            .all(|s| s.is_some_and(|s| s.count == count && s.index < count)),
        "{:?}",
        track.shards
    );
}

fn shard(index: u32, count: u32) -> Option<ClaimShard> {
    Some(ClaimShard::new(index, count).unwrap())
}

#[tokio::test(start_paused = true)]
async fn two_shards_claim_side_by_side_and_drain_every_message_once_in_key_order() {
    let store = ShardedStore::new(true);
    let total = store.enqueue(0..8, 20);

    let track = drain(&store, config(2), total).await;

    assert_only_shards_of(&track, 2);
    assert!(track.shards.contains(&shard(0, 2)) && track.shards.contains(&shard(1, 2)));
    assert_eq!(track.max_running, 2, "two claims ran at once");
    assert_eq!(
        track.max_load, 2,
        "claims running plus batches in flight stay within concurrency"
    );
    assert_eq!(
        track.max_shard_load, 1,
        "a shard has at most ceil(concurrency / shards) = 1 in flight"
    );
}

#[tokio::test(start_paused = true)]
async fn more_shards_than_concurrency_share_it_and_each_gets_its_turn() {
    let store = ShardedStore::new(true);
    let total = store.enqueue(0..9, 10);

    let track = drain(&store, config(3), total).await;

    // Each shard has a full batch's worth and more, so shards 0 and 1 could claim again at
    // once; the slot that frees first goes to shard 2 all the same.
    assert_eq!(
        track.shards[..3],
        [shard(0, 3), shard(1, 3), shard(2, 3)],
        "{:?}",
        track.shards
    );
    assert_eq!(track.max_running, 2);
    assert_eq!(
        track.max_load, 2,
        "concurrency 2 is the total over three shards (a running claim counts)"
    );
}

#[tokio::test(start_paused = true)]
async fn a_shard_has_at_most_its_share_of_concurrency_in_flight() {
    // Shard 1 finds nothing, so only the per-shard bound keeps shard 0 from taking all four
    // slots; 20 keys, so that several batches of shard 0 can be claimed side by side.
    let store = ShardedStore::all_in_shard(0);
    let total = store.enqueue(0..20, 2);
    let config = config(2).to_builder().concurrency(4).build().unwrap();

    // Publishes far slower than claims: shard 0 claims as much as it is let.
    let track = drain_slowly(&store, config, total, Duration::from_secs(5)).await;

    assert_eq!(
        track.max_shard_load, 2,
        "shard 0 has at most ceil(4 / 2) = 2 in flight"
    );
    assert!(track
        .shards
        .iter()
        .all(|s| *s == shard(0, 2) || *s == shard(1, 2)));
}

#[tokio::test(start_paused = true)]
async fn a_settled_batch_lets_its_own_shard_claim_again_at_once() {
    // Every key in shard 1, which is not the first shard, so a settle credited to the wrong
    // shard shows.
    let store = ShardedStore::all_in_shard(1);
    let publisher = Arc::new(SlowPublisher {
        inner: RecordingPublisher::new(),
        latency: Duration::from_secs(5),
    });
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config(2)
            .to_builder()
            .concurrency(4)
            // Only a settle can bring shard 1's next claim within the guard.
            .poll_min(Duration::from_secs(3600))
            .poll_max(Duration::from_secs(3600))
            .build()
            .unwrap(),
    )
    .unwrap();
    // One key, more than a batch: while the first batch is in flight, shard 1's second claim
    // finds the key held back and goes idle; the first batch settling must end that idling.
    let total = store.enqueue(1..2, 7);
    let handle = relay.spawn();
    published(&publisher.inner, total as usize).await;
    handle.shutdown(Duration::from_secs(1)).await.unwrap();
    assert!(store.inner.unpublished().is_empty());
    assert_key_order(&publisher.inner);
    let track = store.track.borrow();
    // The first batch, the claim that found the key held back, the rest.
    let claims_of_shard_1 = track.shards.iter().filter(|s| **s == shard(1, 2)).count();
    assert!(claims_of_shard_1 >= 3, "{:?}", track.shards);
}

/// Several claims, all unsharded, never two at once: the relay as it was before claim shards.
fn assert_one_unsharded_claim_at_a_time(track: &Track) {
    assert!(track.shards.len() > 1, "several claims");
    assert!(
        track.shards.iter().all(Option::is_none),
        "{:?}",
        track.shards
    );
    assert_eq!(track.max_running, 1, "never two claims at once");
}

#[tokio::test(start_paused = true)]
async fn one_claim_shard_claims_unsharded_one_at_a_time() {
    let store = ShardedStore::new(true);
    let total = store.enqueue(0..8, 20);

    let track = drain(&store, config(1), total).await;

    assert_one_unsharded_claim_at_a_time(&track);
}

/// A relay over `store` given no claim shards or batch size runs `shards` and `batch`, each
/// with who chose it.
fn assert_default_tuning(
    store: &Arc<ShardedStore>,
    shards: (usize, Chosen),
    batch: (usize, Chosen),
) {
    let relay = Relay::new(
        store.clone(),
        Arc::new(RecordingPublisher::new()),
        RelayConfig::default(),
    )
    .unwrap();
    let tuning = relay.tuning();
    assert_eq!((tuning.claim_shards, tuning.claim_shards_chosen), shards);
    assert_eq!((tuning.batch_size, tuning.batch_size_chosen), batch);
}

#[tokio::test(start_paused = true)]
async fn a_store_declaring_no_preference_gets_one_claim_and_batches_of_500_by_default() {
    let store = ShardedStore::new(true);
    let total = store.enqueue(0..8, 20);
    assert_default_tuning(&store, (1, Chosen::Default), (500, Chosen::Default));

    let track = drain(
        &store,
        RelayConfig::builder().batch_size(5).build().unwrap(),
        total,
    )
    .await;

    assert_one_unsharded_claim_at_a_time(&track);
}

/// The warnings the relay logs while `f` runs (on this thread).
async fn warnings_during<F: std::future::Future>(f: F) -> (F::Output, String) {
    #[derive(Clone, Default)]
    struct Buffer(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buffer = Buffer::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let output = f.await;
    let logged = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
    (output, logged)
}

#[tokio::test(start_paused = true)]
async fn a_store_declaring_shards_gets_them_and_its_batch_with_no_setting() {
    let store = ShardedStore::preferring(true, 2, 4);
    let total = store.enqueue(0..8, 20);
    assert_default_tuning(&store, (2, Chosen::Store), (4, Chosen::Store));

    let track = drain(&store, RelayConfig::default(), total).await;

    assert_only_shards_of(&track, 2);
    assert_eq!(track.max_running, 2, "two claims ran at once");
    assert!(track.limits.iter().all(|l| *l == 4), "{:?}", track.limits);
}

#[tokio::test(start_paused = true)]
async fn a_store_that_cannot_shard_gets_one_claim_at_a_time_and_no_warning() {
    // It even declares a preference for shards, which is meaningless without sharded claims.
    let store = ShardedStore::preferring(false, 2, 4);
    let total = store.enqueue(0..8, 20);

    let (track, warnings) = warnings_during(drain(&store, RelayConfig::default(), total)).await;

    assert_one_unsharded_claim_at_a_time(&track);
    assert!(track.limits.iter().all(|l| *l == 4), "{:?}", track.limits);
    assert_eq!(warnings, "", "nothing was asked that the store cannot do");
}

#[tokio::test(start_paused = true)]
async fn shards_asked_explicitly_of_a_store_that_cannot_shard_are_ignored_with_a_warning() {
    let store = ShardedStore::new(false);
    let total = store.enqueue(0..8, 20);

    let (track, warnings) = warnings_during(drain(&store, config(2), total)).await;

    assert_one_unsharded_claim_at_a_time(&track);
    assert!(
        warnings.contains("the store does not declare sharded claims"),
        "{warnings:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_explicit_setting_wins_over_the_store_choice() {
    let store = ShardedStore::preferring(true, 2, 4);
    let total = store.enqueue(0..8, 20);
    let one_claim = RelayConfig::builder()
        .claim_shards(1)
        .batch_size(3)
        .build()
        .unwrap();

    let track = drain(&store, one_claim, total).await;

    assert_one_unsharded_claim_at_a_time(&track);
    assert!(track.limits.iter().all(|l| *l == 3), "{:?}", track.limits);

    // More shards than the store's choice, and its batch size kept.
    let total = store.enqueue(0..9, 10);
    let three = RelayConfig::builder().claim_shards(3).build().unwrap();
    let track = drain(&store, three, total).await;
    assert_only_shards_of(&track, 3);
    assert!(track.limits.iter().all(|l| *l == 4), "{:?}", track.limits);
}

#[test]
fn a_store_declaring_an_impossible_preference_is_refused_with_a_typed_error() {
    let publisher = Arc::new(RecordingPublisher::new());
    for (shards, batch, needle) in [
        (0, 10, "claim_shards is 0"),
        (2, 0, "batch size of 0"),
        (1000, 10, "claim_shards is 1000"),
    ] {
        let store = ShardedStore::preferring(true, shards, batch);
        match Relay::new(store, publisher.clone(), RelayConfig::default()) {
            Err(Error::InvalidInput(msg)) => {
                assert!(msg.contains(needle), "{msg}");
                assert!(msg.contains("store declares"), "{msg}");
            }
            other => panic!("expected InvalidInput, got {other:?}"),
        }
        // An explicit setting needs nothing from the store.
        let store = ShardedStore::preferring(true, shards, batch);
        let explicit = RelayConfig::builder()
            .claim_shards(2)
            .batch_size(10)
            .build()
            .unwrap();
        Relay::new(store, publisher.clone(), explicit).unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_store_without_sharded_claims_gets_one_unsharded_claim_at_a_time() {
    let store = ShardedStore::new(false);
    let total = store.enqueue(0..8, 20);

    let track = drain(&store, config(2), total).await;

    assert_one_unsharded_claim_at_a_time(&track);
}

#[tokio::test(start_paused = true)]
async fn a_wake_up_reaches_every_shard() {
    let store = ShardedStore::new(true);
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        store.clone(),
        publisher.clone(),
        config(2)
            .to_builder()
            // Only a wake-up can bring the next claims within the guard.
            .poll_min(Duration::from_secs(3600))
            .poll_max(Duration::from_secs(3600))
            .build()
            .unwrap(),
    )
    .unwrap();
    let handle = relay.spawn();
    // Both shards made their first (empty) claim and now wait for the next poll.
    store
        .until(|t| t.shards.len() >= 2 && t.running.is_empty())
        .await;
    let total = store.enqueue(0..2, 1);
    handle.notifier().notify();
    published(&publisher, total as usize).await;
    handle.shutdown(Duration::from_secs(1)).await.unwrap();
    assert!(store.inner.unpublished().is_empty());
    let track = store.track.borrow();
    assert!(track.shards.iter().filter(|s| **s == shard(0, 2)).count() >= 2);
    assert!(track.shards.iter().filter(|s| **s == shard(1, 2)).count() >= 2);
}

#[test]
fn zero_claim_shards_is_refused() {
    let config = RelayConfig::builder()
        .batch_size(5)
        .concurrency(2)
        .claim_shards(0)
        .build();
    match config {
        Err(Error::InvalidInput(msg)) => assert!(msg.contains("claim_shards is 0"), "{msg}"),
        other => panic!("expected InvalidInput, got {other:?}"),
    }
}
