//! The relay's metrics, captured with a local debugging recorder on a single-threaded runtime.

mod support;

use std::collections::HashMap;
use std::sync::Arc;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use outbox_engine::{metric_names as m, Relay, RelayConfig};
use outbox_memory::RecordingPublisher;
use outbox_traits::PublishOutcome;
use support::*;

#[test]
fn counters_and_histograms_match_the_stats_and_carry_the_publisher_label() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let stats = metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let store = TestStore::new(Wakeups::Inner);
            let publisher = Arc::new(RecordingPublisher::new());
            let msgs: Vec<_> = (0..7).map(|n| msg("k", n)).chain([msg("p", 0)]).collect();
            publisher.fail_next(msgs[3].id, PublishOutcome::transient("busy"));
            publisher.fail_next(msgs[7].id, PublishOutcome::permanent("too big"));
            store.inner.enqueue(msgs).unwrap();
            let config = RelayConfig::builder().batch_size(5).build().unwrap();
            Relay::new(store, publisher, config)
                .unwrap()
                .run_until_idle()
                .await
                .unwrap()
        })
    });
    assert_eq!(
        (
            stats.claimed,
            stats.published,
            stats.retried,
            stats.dead,
            stats.released
        ),
        (6, 3, 1, 1, 1)
    );

    let mut counters = HashMap::new();
    let mut histograms = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let labels: Vec<_> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        assert_eq!(
            labels,
            vec![(m::PUBLISHER_LABEL.to_owned(), "recording".to_owned())]
        );
        match value {
            DebugValue::Counter(n) => {
                counters.insert(key.name().to_owned(), n);
            }
            DebugValue::Histogram(values) => {
                histograms.insert(key.name().to_owned(), values.len());
            }
            DebugValue::Gauge(_) => {}
        }
    }
    let counter = |name: &str| counters.get(name).copied().unwrap_or(0);
    assert_eq!(counter(m::CLAIMED_TOTAL), stats.claimed);
    assert_eq!(counter(m::PUBLISHED_TOTAL), stats.published);
    assert_eq!(counter(m::RETRIED_TOTAL), stats.retried);
    assert_eq!(counter(m::DEAD_TOTAL), stats.dead);
    assert_eq!(counter(m::RELEASED_TOTAL), stats.released);
    assert_eq!(counter(m::LEASE_LOST_TOTAL), 0);
    assert_eq!(
        histograms.get(m::BATCH_SIZE).copied(),
        Some(stats.batches as usize)
    );
    assert_eq!(
        histograms.get(m::PUBLISH_SECONDS).copied(),
        Some(stats.batches as usize)
    );
    // One commit-to-ack sample per acknowledged message.
    assert_eq!(
        histograms.get(m::COMMIT_TO_ACK_SECONDS).copied(),
        Some(stats.published as usize)
    );
    // Every claim is timed, the empty final one included.
    assert!(histograms.get(m::CLAIM_SECONDS).copied().unwrap_or(0) > stats.batches as usize);
}
