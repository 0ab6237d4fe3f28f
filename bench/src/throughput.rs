//! A publisher alone, without a database: the messages of a throughput run and the loop that
//! hands them to the publisher as the relay would (`bin/nats_throughput.rs`,
//! `bin/kafka_throughput.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_traits::chrono::Utc;
use outbox_traits::uuid::Uuid;
use outbox_traits::{Message, Publisher};

/// Messages for a throughput run: `total` order events of about 200 bytes of JSON, spread
/// round-robin over `keys` partition keys (the aggregate id is the key), as a relay would hand
/// them over.
pub fn throughput_messages(total: usize, keys: usize) -> Vec<Message> {
    let payload = format!(
        r#"{{"order":"o-1","total":12.5,"pad":"{}"}}"#,
        "x".repeat(160)
    );
    let keys = keys.max(1);
    (0..total)
        .map(|i| {
            let key = format!("order-{}", i % keys);
            Message {
                id: Uuid::now_v7(),
                seq: i64::try_from(i).unwrap_or(i64::MAX),
                aggregate_type: "order".into(),
                aggregate_id: key.clone(),
                event_type: "order.placed".into(),
                payload: payload.clone(),
                binary: None,
                headers: BTreeMap::new(),
                partition_key: Some(key),
                dedup_key: None,
                attempts: 0,
                created_at: Utc::now(),
            }
        })
        .collect()
}

/// Publish `messages` in batches of `batch` with up to `concurrency` `publish` calls in
/// flight (as the relay does), and return how many were acked and how long it took. For the
/// throughput binaries, which print the rate.
pub async fn drive_throughput(
    publisher: &dyn Publisher,
    messages: &[Message],
    batch: usize,
    concurrency: usize,
) -> (usize, Duration) {
    use futures::StreamExt;
    let start = std::time::Instant::now();
    let acked = futures::stream::iter(messages.chunks(batch.max(1)))
        .map(|b| publisher.publish(b))
        .buffer_unordered(concurrency.max(1))
        .map(|outcomes| outcomes.iter().filter(|o| o.is_acked()).count())
        .fold(0, |sum, n| async move { sum + n })
        .await;
    (acked, start.elapsed())
}

/// Positional argument `n` of the program as a number, or `default` when it is missing or not
/// a number.
pub fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}
