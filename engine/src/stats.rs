//! Exact counters of what a relay did, kept next to the metrics so that both always agree.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a relay run did, counted in messages (except `batches`, `store_errors` and
/// `order_violations`). Counters only grow; a transition the store refused with
/// [`Error::LeaseLost`](outbox_traits::Error::LeaseLost) is counted in `lease_lost`, not in
/// `published`, `retried`, `dead` or `released`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct RelayStats {
    /// Messages handed out by claims.
    pub claimed: u64,
    /// Messages acknowledged by the broker and marked published.
    pub published: u64,
    /// Failed messages scheduled for another attempt.
    pub retried: u64,
    /// Messages dead-lettered (permanent failure or attempts exhausted).
    pub dead: u64,
    /// Messages given back without counting an attempt (not attempted, or at shutdown).
    pub released: u64,
    /// Messages whose complete, fail or release was refused because the lease was lost.
    pub lease_lost: u64,
    /// Non-empty claims processed.
    pub batches: u64,
    /// Store calls (claim, complete, fail, extend, release) that returned an error other than a
    /// lost lease.
    pub store_errors: u64,
    /// Messages a publisher acknowledged after an earlier message of the same key in the same
    /// batch was not acknowledged: a publisher bug that may have broken per-key order.
    pub order_violations: u64,
}

impl std::ops::AddAssign for RelayStats {
    /// Sum the counters of several runs.
    fn add_assign(&mut self, other: Self) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.retried += other.retried;
        self.dead += other.dead;
        self.released += other.released;
        self.lease_lost += other.lease_lost;
        self.batches += other.batches;
        self.store_errors += other.store_errors;
        self.order_violations += other.order_violations;
    }
}

/// The shared, lock-free form of [`RelayStats`] updated by the loop and its batches.
#[derive(Debug, Default)]
pub(crate) struct StatsCell {
    claimed: AtomicU64,
    published: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    released: AtomicU64,
    lease_lost: AtomicU64,
    batches: AtomicU64,
    store_errors: AtomicU64,
    order_violations: AtomicU64,
}

/// Names one counter of [`StatsCell`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    Claimed,
    Published,
    Retried,
    Dead,
    Released,
    LeaseLost,
    Batches,
    StoreErrors,
    OrderViolations,
}

impl StatsCell {
    pub(crate) fn add(&self, counter: Counter, n: u64) {
        let cell = match counter {
            Counter::Claimed => &self.claimed,
            Counter::Published => &self.published,
            Counter::Retried => &self.retried,
            Counter::Dead => &self.dead,
            Counter::Released => &self.released,
            Counter::LeaseLost => &self.lease_lost,
            Counter::Batches => &self.batches,
            Counter::StoreErrors => &self.store_errors,
            Counter::OrderViolations => &self.order_violations,
        };
        cell.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> RelayStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RelayStats {
            claimed: get(&self.claimed),
            published: get(&self.published),
            retried: get(&self.retried),
            dead: get(&self.dead),
            released: get(&self.released),
            lease_lost: get(&self.lease_lost),
            batches: get(&self.batches),
            store_errors: get(&self.store_errors),
            order_violations: get(&self.order_violations),
        }
    }
}
