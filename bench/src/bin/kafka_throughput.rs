//! Publish many messages to a Kafka broker through [`KafkaPublisher`] and print the rate.
//!
//! ```text
//! scripts/tansu start
//! OUTBOX_TEST_KAFKA_BROKERS=127.0.0.1:19092 cargo run --release -p outbox-bench \
//!     --bin kafka_throughput -- [messages=100000] [keys=1000] [batch=1000] [concurrency=4]
//! ```
//!
//! Extra librdkafka properties: `OUTBOX_KAFKA_PROPS="linger.ms=1,compression.type=lz4"`.
//!
//! Messages carry a ~200-byte JSON payload and the standard headers; each batch is one
//! `publish` call (as the relay makes), with `concurrency` calls in flight.

use outbox::kafka::{KafkaConfig, KafkaPublisher};
use outbox_bench::throughput::{arg, drive_throughput, throughput_messages};
use outbox_traits::Publisher;
use uuid::Uuid;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let brokers = std::env::var("OUTBOX_TEST_KAFKA_BROKERS")
        .map_err(|_| "set OUTBOX_TEST_KAFKA_BROKERS=host:port (scripts/tansu start prints it)")?;
    let (total, keys, batch, concurrency) =
        (arg(1, 100_000), arg(2, 1000), arg(3, 1000), arg(4, 4));
    let topic = format!("outbox-bench-{}", Uuid::new_v4().simple());
    let mut config = KafkaConfig::builder(&brokers).topic(&topic);
    // Extra librdkafka properties as OUTBOX_KAFKA_PROPS="linger.ms=1,batch.size=1000000".
    for pair in std::env::var("OUTBOX_KAFKA_PROPS")
        .unwrap_or_default()
        .split(',')
    {
        if let Some((k, v)) = pair.split_once('=') {
            config = config.property(k.trim(), v.trim());
        }
    }
    let publisher = KafkaPublisher::new(config.build()?)?;
    let messages = throughput_messages(total, keys);
    // Warm up: connect and learn the topic's metadata (auto-created on first use).
    let warm = publisher.publish(&messages[..1]).await;
    if !warm[0].is_acked() {
        return Err(format!("warm-up publish failed: {:?}", warm[0]).into());
    }

    let (acked, elapsed) = drive_throughput(&publisher, &messages, batch, concurrency).await;
    let secs = elapsed.as_secs_f64();
    println!(
        "kafka publish: {acked}/{total} acked in {secs:.2} s = {:.0} msg/s \
         ({keys} keys, batches of {batch}, {concurrency} in flight, topic {topic})",
        acked as f64 / secs
    );
    Ok(())
}
