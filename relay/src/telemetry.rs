//! Metrics (through the `metrics` facade) and the matching [`RelayStats`](crate::RelayStats)
//! counters, updated together so they never disagree.

use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_histogram, histogram, Unit};

use crate::stats::{Counter, StatsCell};

/// Messages handed out by claims.
pub const CLAIMED_TOTAL: &str = "outbox_claimed_total";
/// Messages acknowledged by the broker and marked published.
pub const PUBLISHED_TOTAL: &str = "outbox_published_total";
/// Failed messages scheduled for a retry.
pub const RETRIED_TOTAL: &str = "outbox_retried_total";
/// Messages dead-lettered.
pub const DEAD_TOTAL: &str = "outbox_dead_total";
/// Messages given back without counting an attempt.
pub const RELEASED_TOTAL: &str = "outbox_released_total";
/// Messages (or, for a failed lease extension, batches) whose lease was lost.
pub const LEASE_LOST_TOTAL: &str = "outbox_lease_lost_total";
/// Store calls that failed with an error other than a lost lease.
pub const STORE_ERRORS_TOTAL: &str = "outbox_store_errors_total";
/// Acknowledgements that broke per-key order inside a batch (publisher bugs).
pub const ORDER_VIOLATIONS_TOTAL: &str = "outbox_order_violations_total";
/// Duration of each claim call.
pub const CLAIM_SECONDS: &str = "outbox_claim_seconds";
/// Duration of each publish call.
pub const PUBLISH_SECONDS: &str = "outbox_publish_seconds";
/// Messages per non-empty claim.
pub const BATCH_SIZE: &str = "outbox_batch_size";
/// The label carrying [`Publisher::name`](outbox_traits::Publisher::name) on every metric.
pub const PUBLISHER_LABEL: &str = "publisher";

/// Register descriptions and units of the relay's metrics with the installed recorder.
///
/// [`Relay::new`](crate::Relay::new) calls it; call it yourself if you install the recorder
/// later.
pub fn describe_metrics() {
    describe_counter!(CLAIMED_TOTAL, Unit::Count, "Messages handed out by claims.");
    describe_counter!(
        PUBLISHED_TOTAL,
        Unit::Count,
        "Messages acknowledged and marked published."
    );
    describe_counter!(
        RETRIED_TOTAL,
        Unit::Count,
        "Failed messages scheduled for a retry."
    );
    describe_counter!(DEAD_TOTAL, Unit::Count, "Messages dead-lettered.");
    describe_counter!(
        RELEASED_TOTAL,
        Unit::Count,
        "Messages given back without an attempt."
    );
    describe_counter!(
        LEASE_LOST_TOTAL,
        Unit::Count,
        "Transitions refused for a lost lease."
    );
    describe_counter!(STORE_ERRORS_TOTAL, Unit::Count, "Failed store calls.");
    describe_counter!(
        ORDER_VIOLATIONS_TOTAL,
        Unit::Count,
        "Publisher acks out of key order."
    );
    describe_histogram!(CLAIM_SECONDS, Unit::Seconds, "Duration of claim calls.");
    describe_histogram!(PUBLISH_SECONDS, Unit::Seconds, "Duration of publish calls.");
    describe_histogram!(BATCH_SIZE, Unit::Count, "Messages per non-empty claim.");
}

/// Counts into both the run's [`StatsCell`] and the metrics facade, labelled by publisher.
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    stats: Arc<StatsCell>,
    publisher: String,
}

impl Recorder {
    pub(crate) fn new(stats: Arc<StatsCell>, publisher: String) -> Self {
        Self { stats, publisher }
    }

    pub(crate) fn stats(&self) -> &StatsCell {
        &self.stats
    }

    pub(crate) fn add(&self, what: Counter, n: u64) {
        if n == 0 {
            return;
        }
        self.stats.add(what, n);
        let name = match what {
            Counter::Claimed => CLAIMED_TOTAL,
            Counter::Published => PUBLISHED_TOTAL,
            Counter::Retried => RETRIED_TOTAL,
            Counter::Dead => DEAD_TOTAL,
            Counter::Released => RELEASED_TOTAL,
            Counter::LeaseLost => LEASE_LOST_TOTAL,
            Counter::StoreErrors => STORE_ERRORS_TOTAL,
            Counter::OrderViolations => ORDER_VIOLATIONS_TOTAL,
            // Batches are visible as the count of the batch-size histogram.
            Counter::Batches => return,
        };
        counter!(name, PUBLISHER_LABEL => self.publisher.clone()).increment(n);
    }

    /// A lost lease seen by `extend`: the metric counts it, the stats do not (the refused
    /// transitions that follow are counted per message).
    pub(crate) fn extend_lost(&self) {
        counter!(LEASE_LOST_TOTAL, PUBLISHER_LABEL => self.publisher.clone()).increment(1);
    }

    pub(crate) fn claim_took(&self, took: Duration) {
        histogram!(CLAIM_SECONDS, PUBLISHER_LABEL => self.publisher.clone())
            .record(took.as_secs_f64());
    }

    pub(crate) fn publish_took(&self, took: Duration) {
        histogram!(PUBLISH_SECONDS, PUBLISHER_LABEL => self.publisher.clone())
            .record(took.as_secs_f64());
    }

    pub(crate) fn batch_size(&self, size: usize) {
        histogram!(BATCH_SIZE, PUBLISHER_LABEL => self.publisher.clone()).record(size as f64);
    }
}
