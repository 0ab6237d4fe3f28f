//! Publish many messages to NATS JetStream through [`NatsPublisher`] and print the rate, with
//! no database in the way: the publisher's own ceiling on this machine.
//!
//! ```text
//! OUTBOX_TEST_NATS_URL=nats://127.0.0.1:4222 cargo run --release -p outbox-bench \
//!     --bin nats_throughput -- [messages=100000] [keys=1000] [batch=500] [concurrency=2]
//! ```
//!
//! Messages carry a ~200-byte JSON payload and the standard headers; each batch is one
//! `publish` call (as the relay makes), with `concurrency` calls in flight. The stream (file
//! storage) is created first and deleted at the end.

use outbox::nats::{NatsConfig, NatsPublisher};
use outbox_bench::throughput::{arg, drive_throughput, throughput_messages};
use uuid::Uuid;

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
    let publisher = NatsPublisher::connect(config).await?;
    let messages = throughput_messages(total, keys);

    let (acked, elapsed) = drive_throughput(&publisher, &messages, batch, concurrency).await;
    let secs = elapsed.as_secs_f64();
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
