//! Benchmark: the cost of each envelope (default, CloudEvents binary, CloudEvents structured)
//! on the publish path, side by side in one run.
//!
//! ```text
//! eval "$(scripts/services)"
//! cargo run --release -p outbox-bench --bin envelopes -- [nats|kafka|redis|all] [messages=50000]
//!     [batch=500] [keys=1000] [rounds=3]
//! ```
//!
//! No store: MESSAGES messages are built in memory once, then published in batches of BATCH,
//! one `publish` call after the other, by the broker's publisher made from its URL with
//! `envelope=outbox`, `envelope=cloudevents` and `envelope=cloudevents-structured` in turn, each
//! into a fresh NATS stream, Kafka topic or Redis stream. The envelopes take turns within each of
//! ROUNDS rounds (so a machine busy for a while slows all three alike), and every message must
//! be acknowledged. Prints a Markdown row per broker and envelope: the median rate over the
//! rounds, and its ratio to the default envelope's median.

use std::time::Instant;

use outbox_traits::chrono::Utc;
use outbox_traits::uuid::Uuid;
use outbox_traits::{Message, PublishOutcome};

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const ENVELOPES: [&str; 3] = ["outbox", "cloudevents", "cloudevents-structured"];

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// The messages of one run: what a relay hands a publisher after a claim (a trace header on
/// each, as a traced service enqueues them).
fn messages(count: usize, keys: usize) -> Vec<Message> {
    (0..count)
        .map(|n| {
            let new = outbox_bench::message(n, keys).with_header(
                "traceparent",
                format!("00-{:032x}-{:016x}-01", n + 1, n + 1),
            );
            Message {
                id: new.id,
                seq: n as i64 + 1,
                aggregate_type: new.aggregate_type,
                aggregate_id: new.aggregate_id,
                event_type: new.event_type,
                payload: new.payload.to_string(),
                binary: None,
                headers: new.headers,
                partition_key: new.partition_key,
                dedup_key: None,
                attempts: 0,
                created_at: Utc::now(),
            }
        })
        .collect()
}

/// Publish every message into a fresh destination with `envelope`; msg/s.
async fn publish_all(
    broker: &str,
    envelope: &str,
    batch: &[Message],
    size: usize,
) -> BoxResult<f64> {
    let s = Uuid::new_v4().simple().to_string()[..12].to_owned();
    let nats = env_or("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let kafka = env_or("OUTBOX_TEST_KAFKA_BROKERS", "127.0.0.1:19092");
    let redis = env_or("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379");
    let (nats_stream, name) = (format!("ENV_{s}"), format!("env-{s}"));
    let url = match broker {
        "nats" => format!(
            "{nats}?subject=env{s}.{{aggregate_type}}&stream={nats_stream}&create_stream=true\
             &envelope={envelope}"
        ),
        "kafka" => {
            outbox_e2e::kafka::create_topic(&kafka, &name, 4).await?;
            format!("kafka://{kafka}?topic={name}&envelope={envelope}")
        }
        _ => format!("{redis}?stream={name}&envelope={envelope}"),
    };
    let publisher = outbox::broker::connect(&url).await?;
    let started = Instant::now();
    for chunk in batch.chunks(size) {
        let outcomes = publisher.publish(chunk).await;
        if let Some(bad) = outcomes.iter().find(|o| **o != PublishOutcome::Acked) {
            return Err(format!("{broker} {envelope}: {bad:?}").into());
        }
    }
    let secs = started.elapsed().as_secs_f64();
    drop(publisher);
    match broker {
        "nats" => outbox_e2e::nats::delete_stream(&nats, &nats_stream).await?,
        "kafka" => outbox_e2e::kafka::delete_topic(&kafka, &name).await?,
        _ => outbox_e2e::redis::delete(&redis, &name).await?,
    }
    Ok(batch.len() as f64 / secs)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    let mut which = "all".to_owned();
    let (mut count, mut size, mut keys, mut rounds) = (50_000usize, 500usize, 1_000usize, 3usize);
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("messages", v)) => count = v.parse()?,
            Some(("batch", v)) => size = v.parse::<usize>()?.max(1),
            Some(("keys", v)) => keys = v.parse::<usize>()?.max(1),
            Some(("rounds", v)) => rounds = v.parse::<usize>()?.max(1),
            Some((k, _)) => {
                return Err(
                    format!("unknown option {k:?}; use messages, batch, keys, rounds").into(),
                )
            }
            None => which = arg,
        }
    }
    let brokers: Vec<&str> = match which.as_str() {
        "all" => vec!["kafka", "nats", "redis"],
        "kafka" | "nats" | "redis" => vec![which.as_str()],
        other => {
            return Err(format!("unknown broker {other:?}; use nats, kafka, redis, all").into())
        }
    };
    let batch = messages(count, keys);
    println!("| broker | envelope | msg/s (median of {rounds}) | vs default |");
    println!("|---|---|---:|---:|");
    for broker in brokers {
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); ENVELOPES.len()];
        for _ in 0..rounds {
            for (i, envelope) in ENVELOPES.iter().enumerate() {
                rates[i].push(publish_all(broker, envelope, &batch, size).await?);
            }
        }
        let medians: Vec<f64> = rates.into_iter().map(median).collect();
        for (envelope, rate) in ENVELOPES.iter().zip(&medians) {
            println!(
                "| {broker} | {envelope} | {rate:.0} | {:.2} |",
                rate / medians[0]
            );
        }
    }
    Ok(())
}
