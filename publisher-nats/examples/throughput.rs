//! Publish many messages to NATS JetStream through [`NatsPublisher`] and print the rate, with
//! no database in the way: the publisher's own ceiling on this machine.
//!
//! ```text
//! OUTBOX_TEST_NATS_URL=nats://127.0.0.1:4222 cargo run --release -p outbox-publisher-nats \
//!     --example throughput -- [messages=100000] [keys=1000] [batch=500] [concurrency=2]
//! ```
//!
//! Messages carry a ~200-byte JSON payload and the standard headers; each batch is one
//! `publish` call (as the relay makes), with `concurrency` calls in flight. The stream (file
//! storage) is created first and deleted at the end.

use std::sync::Arc;
use std::time::Instant;

use chrono::Utc;
use outbox_publisher_nats::{NatsConfig, NatsPublisher};
use outbox_traits::{Message, Publisher};
use uuid::Uuid;

fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("OUTBOX_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let (total, keys, batch, concurrency) = (arg(1, 100_000), arg(2, 1000), arg(3, 500), arg(4, 2));
    let suffix = Uuid::new_v4().simple().to_string();
    let stream = format!("THROUGHPUT_{suffix}");
    let config = NatsConfig::from_url(&format!(
        "{url}?subject=throughput{suffix}.{{aggregate_type}}&stream={stream}&create_stream=true"
    ))?;
    let publisher = Arc::new(NatsPublisher::connect(config).await?);
    let payload = format!(
        r#"{{"order":"o-1","total":12.5,"pad":"{}"}}"#,
        "x".repeat(160)
    );
    let messages: Vec<Message> = (0..total)
        .map(|i| Message {
            id: Uuid::now_v7(),
            seq: i as i64,
            aggregate_type: "order".into(),
            aggregate_id: format!("order-{}", i % keys),
            event_type: "order.placed".into(),
            payload: payload.clone(),
            headers: Default::default(),
            partition_key: Some(format!("order-{}", i % keys)),
            dedup_key: None,
            attempts: 0,
            created_at: Utc::now(),
        })
        .collect();
    let batches: Vec<Vec<Message>> = messages.chunks(batch).map(<[Message]>::to_vec).collect();

    let queue = Arc::new(std::sync::Mutex::new(batches.into_iter()));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (queue, publisher) = (Arc::clone(&queue), Arc::clone(&publisher));
        tasks.push(tokio::spawn(async move {
            let mut acked = 0usize;
            loop {
                let next = queue.lock().map(|mut q| q.next()).unwrap_or(None);
                let Some(b) = next else { break acked };
                acked += publisher
                    .publish(&b)
                    .await
                    .iter()
                    .filter(|o| o.is_acked())
                    .count();
            }
        }));
    }
    let mut acked = 0;
    for t in tasks {
        acked += t.await?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "nats publish: {acked}/{total} acked in {secs:.2} s = {:.0} msg/s \
         ({keys} keys, batches of {batch}, {concurrency} in flight)",
        acked as f64 / secs
    );
    let client = async_nats::connect(&url).await?;
    async_nats::jetstream::new(client)
        .delete_stream(&stream)
        .await?;
    Ok(())
}
