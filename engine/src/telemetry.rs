//! Metrics (through the `metrics` facade) and the matching [`RelayStats`](crate::RelayStats)
//! counters, updated together so they never disagree.

use std::sync::Arc;
use std::time::Duration;

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Label, Unit,
};
use outbox_traits::chrono::Utc;
use outbox_traits::{Message, PublishOutcome, StoreStatus};

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
/// Time from a message's creation (its transaction, by the database's clock) to the broker's
/// acknowledgement (by the relay host's clock), per acknowledged message.
pub const COMMIT_TO_ACK_SECONDS: &str = "outbox_commit_to_ack_seconds";
/// Gauge: messages waiting to be published, not leased.
pub const PENDING_MESSAGES: &str = "outbox_pending_messages";
/// Gauge: messages leased to a relay.
pub const LEASED_MESSAGES: &str = "outbox_leased_messages";
/// Gauge: dead-lettered messages.
pub const DEAD_MESSAGES: &str = "outbox_dead_messages";
/// Gauge: age of the oldest unpublished, not dead message (database clock); 0 when none.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "outbox_oldest_pending_age_seconds";
/// Gauge: partition keys held back by a dead or retrying head message.
pub const BLOCKED_KEYS: &str = "outbox_blocked_keys";
/// Gauge: 1 when the last broker check succeeded, else 0.
pub const BROKER_UP: &str = "outbox_broker_up";
/// Gauge: 1 when the last store query succeeded, else 0.
pub const STORE_UP: &str = "outbox_store_up";
/// Probes of a broker that is down ([`Publisher::check`](outbox_traits::Publisher::check)
/// calls while the relay waits for it to come back).
pub const BROKER_PROBES_TOTAL: &str = "outbox_broker_probes_total";

/// Histogram buckets (seconds) for store and broker calls ([`CLAIM_SECONDS`],
/// [`PUBLISH_SECONDS`]): 1 ms to 30 s.
pub const CALL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Histogram buckets (seconds) for [`COMMIT_TO_ACK_SECONDS`]: 5 ms to 1 h (a backlog drains
/// for minutes).
pub const COMMIT_TO_ACK_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];
/// Histogram buckets for [`BATCH_SIZE`] (messages).
pub const BATCH_SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
];

/// The histograms of the relay with the buckets fit for each, for an exporter's
/// configuration (e.g. `PrometheusBuilder::set_buckets_for_metric`).
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (CLAIM_SECONDS, CALL_BUCKETS),
    (PUBLISH_SECONDS, CALL_BUCKETS),
    (COMMIT_TO_ACK_SECONDS, COMMIT_TO_ACK_BUCKETS),
    (BATCH_SIZE, BATCH_SIZE_BUCKETS),
];

/// Set the store gauges from a [`StoreStatus`] (the `outbox-relay` program does it
/// periodically). Figures a store does not report are left as they were.
pub fn record_status(status: &StoreStatus) {
    gauge!(PENDING_MESSAGES).set(status.pending as f64);
    gauge!(LEASED_MESSAGES).set(status.leased as f64);
    gauge!(DEAD_MESSAGES).set(status.dead as f64);
    gauge!(OLDEST_PENDING_AGE_SECONDS).set(status.oldest_pending_age_seconds.unwrap_or(0.0));
    if let Some(blocked) = status.blocked_keys {
        gauge!(BLOCKED_KEYS).set(blocked as f64);
    }
}

/// Set the [`BROKER_UP`] and [`STORE_UP`] gauges.
pub fn record_up(broker_up: bool, store_up: bool) {
    gauge!(BROKER_UP).set(if broker_up { 1.0 } else { 0.0 });
    gauge!(STORE_UP).set(if store_up { 1.0 } else { 0.0 });
}

/// [`record_status`] for one outbox of several: the gauges carry [`OUTBOX_LABEL`] = `outbox`.
pub fn record_status_for(outbox: &str, status: &StoreStatus) {
    let l = [Label::new(OUTBOX_LABEL, outbox.to_owned())];
    gauge!(PENDING_MESSAGES, l.iter()).set(status.pending as f64);
    gauge!(LEASED_MESSAGES, l.iter()).set(status.leased as f64);
    gauge!(DEAD_MESSAGES, l.iter()).set(status.dead as f64);
    gauge!(OLDEST_PENDING_AGE_SECONDS, l.iter())
        .set(status.oldest_pending_age_seconds.unwrap_or(0.0));
    if let Some(blocked) = status.blocked_keys {
        gauge!(BLOCKED_KEYS, l.iter()).set(blocked as f64);
    }
}

/// [`record_up`] for one outbox of several: the gauges carry [`OUTBOX_LABEL`] = `outbox`.
pub fn record_up_for(outbox: &str, broker_up: bool, store_up: bool) {
    let l = [Label::new(OUTBOX_LABEL, outbox.to_owned())];
    gauge!(BROKER_UP, l.iter()).set(if broker_up { 1.0 } else { 0.0 });
    gauge!(STORE_UP, l.iter()).set(if store_up { 1.0 } else { 0.0 });
}

/// The label carrying [`Publisher::name`](outbox_traits::Publisher::name) on every metric.
pub const PUBLISHER_LABEL: &str = "publisher";
/// The label naming the outbox on every metric of a relay given a name with
/// [`Relay::for_outbox`](crate::Relay::for_outbox) (a process serving several outboxes).
pub const OUTBOX_LABEL: &str = "outbox";

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
    describe_histogram!(
        COMMIT_TO_ACK_SECONDS,
        Unit::Seconds,
        "Time from a message's creation to the broker's acknowledgement."
    );
    describe_gauge!(
        PENDING_MESSAGES,
        Unit::Count,
        "Messages waiting to be published, not leased."
    );
    describe_gauge!(LEASED_MESSAGES, Unit::Count, "Messages leased to a relay.");
    describe_gauge!(DEAD_MESSAGES, Unit::Count, "Dead-lettered messages.");
    describe_gauge!(
        OLDEST_PENDING_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest unpublished message (database clock)."
    );
    describe_gauge!(
        BLOCKED_KEYS,
        Unit::Count,
        "Partition keys held back by a dead or retrying head message."
    );
    describe_gauge!(BROKER_UP, "1 when the last broker check succeeded.");
    describe_gauge!(STORE_UP, "1 when the last store query succeeded.");
    describe_gauge!(
        crate::group::GROUP_OWNED_SHARDS,
        Unit::Count,
        "Claim shards this relay holds in its relay group."
    );
    describe_gauge!(
        crate::group::GROUP_MEMBERS,
        Unit::Count,
        "Live members of this relay's group at its last renewal."
    );
    describe_counter!(
        crate::group::GROUP_RENEWAL_ERRORS_TOTAL,
        Unit::Count,
        "Relay group renewals that failed."
    );
    describe_counter!(
        crate::group::SHARD_CLAIMED_TOTAL,
        Unit::Count,
        "Messages handed out by claims, per claim shard."
    );
    describe_counter!(
        crate::group::SHARD_PUBLISHED_TOTAL,
        Unit::Count,
        "Messages acknowledged and marked published, per claim shard."
    );
    describe_counter!(
        BROKER_PROBES_TOTAL,
        Unit::Count,
        "Checks of a broker that is down, while the relay waits for it to come back."
    );
}

/// Counts into both the run's [`StatsCell`] and the metrics facade, labelled by publisher.
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    stats: Arc<StatsCell>,
    /// `publisher`, and `outbox` when the relay has a name.
    labels: Vec<Label>,
    /// `outbox` alone (the up gauges carry no publisher label).
    outbox: Vec<Label>,
    /// The claim shard whose batches this recorder counts, when the relay runs several: claims
    /// and publications are then also counted per shard.
    shard: Option<String>,
}

impl Recorder {
    pub(crate) fn for_shared(stats: Arc<StatsCell>, shared: &crate::shared::Shared) -> Self {
        let outbox: Vec<Label> = shared
            .outbox
            .iter()
            .map(|name| Label::new(OUTBOX_LABEL, name.clone()))
            .collect();
        let mut labels = vec![Label::new(PUBLISHER_LABEL, shared.publisher_name.clone())];
        labels.extend(outbox.iter().cloned());
        Self {
            stats,
            labels,
            outbox,
            shard: None,
        }
    }

    /// The same recorder, also counting claims and publications under shard `index`.
    pub(crate) fn for_shard(&self, index: usize) -> Self {
        Self {
            shard: Some(index.to_string()),
            ..self.clone()
        }
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
        counter!(name, self.labels.iter()).increment(n);
        if let Some(shard) = &self.shard {
            let per_shard = match what {
                Counter::Claimed => crate::group::SHARD_CLAIMED_TOTAL,
                Counter::Published => crate::group::SHARD_PUBLISHED_TOTAL,
                _ => return,
            };
            let mut labels = self.labels.clone();
            labels.push(Label::new("shard", shard.clone()));
            counter!(per_shard, labels.iter()).increment(n);
        }
    }

    /// A lost lease seen by `extend`: the metric counts it, the stats do not (the refused
    /// transitions that follow are counted per message).
    pub(crate) fn extend_lost(&self) {
        counter!(LEASE_LOST_TOTAL, self.labels.iter()).increment(1);
    }

    pub(crate) fn claim_took(&self, took: Duration) {
        histogram!(CLAIM_SECONDS, self.labels.iter()).record(took.as_secs_f64());
    }

    pub(crate) fn publish_took(&self, took: Duration) {
        histogram!(PUBLISH_SECONDS, self.labels.iter()).record(took.as_secs_f64());
    }

    /// Record commit-to-acknowledgement latency of the acknowledged messages of a batch.
    pub(crate) fn acked(&self, batch: &[Message], outcomes: &[PublishOutcome]) {
        let now = Utc::now();
        let h = histogram!(COMMIT_TO_ACK_SECONDS, self.labels.iter());
        for (message, _) in batch.iter().zip(outcomes).filter(|(_, o)| o.is_acked()) {
            let took = (now - message.created_at)
                .num_microseconds()
                .unwrap_or(i64::MAX);
            // A host clock behind the database's gives a negative span: count it as 0.
            h.record(took.max(0) as f64 / 1e6);
        }
    }

    /// The relay found the broker down (`false`) or back (`true`).
    pub(crate) fn broker_up(&self, up: bool) {
        gauge!(BROKER_UP, self.outbox.iter()).set(if up { 1.0 } else { 0.0 });
    }

    /// The relay found the store down (`false`) or back (`true`).
    pub(crate) fn store_up(&self, up: bool) {
        gauge!(STORE_UP, self.outbox.iter()).set(if up { 1.0 } else { 0.0 });
    }

    /// A probe of a broker that is down.
    pub(crate) fn probed(&self) {
        counter!(BROKER_PROBES_TOTAL, self.labels.iter()).increment(1);
    }

    pub(crate) fn batch_size(&self, size: usize) {
        histogram!(BATCH_SIZE, self.labels.iter()).record(size as f64);
    }
}
