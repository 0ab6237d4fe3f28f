//! Benchmark: the cost of traces (issue 30), side by side in one run. Postgres → NATS drains
//! with the relay's producer spans off and on, and enqueue with and without a caller's span,
//! in interleaved rounds; prints messages per second (medians) and the ratio on/off.
//!
//! ```text
//! eval "$(scripts/services)"
//! cargo run --release -p outbox-bench --bin traces -- [rounds=3] [messages=20000]
//! ```
//!
//! - **Drain**: the same backlog (every message enqueued under a sampled span, so it carries
//!   a `traceparent`) drained by a relay without traces (`off`: the engine is built with its
//!   `otel` feature, and traces are not switched on: the state of every relay that does not
//!   ask for them) and with `Relay::with_traces` (`on`): a span per message and per batch,
//!   each message's `traceparent` rewritten, every span sampled and handed to the SDK's batch
//!   processor, whose exporter counts and drops them (the OTLP encoding and the network are the
//!   exporter thread's cost, not the relay's).
//! - **Enqueue**: batches of 100 into Postgres with the backend's `otel` feature, outside any
//!   span (`off`: the capture finds no span and copies nothing) and inside one (`on`: the
//!   batch is copied with the span's context in each message's headers).
//!
//! The order of off and on alternates from one round to the next. Beside the rate, each run
//! prints the CPU this process spent per message (all its threads, the exporter's included):
//! on a busy machine the rate swings with the other load, the CPU per message much less.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use opentelemetry::trace::{TraceContextExt, Tracer, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_bench::{load_average, median, message, process_cpu, thousands};
use outbox_engine::{Relay, RelayConfig, Traces};
use outbox_traits::Publisher;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const ENQUEUE_BATCH: usize = 1000;
const ENQUEUE_BATCH_TIMED: usize = 100;

/// Counts the spans the batch processor hands over and drops them.
#[derive(Debug, Default, Clone)]
struct Counting(Arc<AtomicU64>);

impl SpanExporter for Counting {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.fetch_add(batch.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

fn args() -> BoxResult<(usize, usize)> {
    let (mut rounds, mut messages) = (3, 20_000);
    for arg in std::env::args().skip(1) {
        let parsed = arg
            .split_once('=')
            .and_then(|(k, v)| Some((k.to_owned(), v.parse::<usize>().ok().filter(|n| *n > 0)?)));
        match parsed {
            Some((k, n)) if k == "rounds" => rounds = n,
            Some((k, n)) if k == "messages" => messages = n,
            _ => {
                return Err(
                    format!("argument `{arg}`: expected rounds=N or messages=N (N > 0)").into(),
                )
            }
        }
    }
    Ok((rounds, messages))
}

/// This process's CPU seconds so far (0 where /proc is not there).
fn cpu() -> f64 {
    process_cpu(std::process::id()).unwrap_or(0.0)
}

/// Messages per second and CPU microseconds per message of a run that began at `started`
/// with `cpu_before`.
fn figures(n: usize, started: Instant, cpu_before: f64) -> (f64, f64) {
    (
        n as f64 / started.elapsed().as_secs_f64(),
        (cpu() - cpu_before) * 1e6 / n as f64,
    )
}

/// Enqueue `n` messages in batches of `batch`, inside `cx` (attached around each call) when
/// given; returns the messages per second and CPU µs per message.
async fn enqueue(
    pool: &sqlx::PgPool,
    config: &PostgresConfig,
    n: usize,
    batch: usize,
    cx: Option<&Context>,
) -> BoxResult<(f64, f64)> {
    let msgs: Vec<Vec<_>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(batch)
        .map(|chunk| chunk.iter().map(|&i| message(i, 64)).collect())
        .collect();
    let (started, cpu_before) = (Instant::now(), cpu());
    for msgs in &msgs {
        let mut tx = pool.begin().await?;
        {
            // The capture runs at the call's first poll, on this thread (the main future of
            // `block_on` never moves): keep the context attached across it.
            let _guard = cx.map(|cx| cx.clone().attach());
            outbox_backend_postgres::enqueue_batch(&mut *tx, config, msgs).await?;
        }
        tx.commit().await?;
    }
    Ok(figures(n, started, cpu_before))
}

/// Drain the table into a new NATS stream, with or without traces; msg/s.
async fn drain(
    store: &Arc<PostgresStore>,
    nats_url: &str,
    traces: Option<Traces>,
    n: usize,
) -> BoxResult<(f64, f64)> {
    let suffix = outbox_e2e::unique_suffix();
    let stream = format!("BENCH_TRACES_{suffix}");
    let url = format!(
        "{nats_url}?subject=benchtraces{suffix}.{{aggregate_type}}&stream={stream}&create_stream=true"
    );
    let publisher: Arc<dyn Publisher> = Arc::from(outbox::broker::connect(&url).await?);
    let mut relay = Relay::new(store.clone(), publisher, RelayConfig::default())?;
    if let Some(traces) = traces {
        relay = relay.with_traces(traces);
    }
    let (started, cpu_before) = (Instant::now(), cpu());
    let stats = relay.run_until_idle().await?;
    let rate = figures(n, started, cpu_before);
    let stored = outbox_e2e::nats::stream_len(nats_url, &stream).await?;
    outbox_e2e::nats::delete_stream(nats_url, &stream).await?;
    if stats.published != n as u64 || stored != n as u64 {
        return Err(format!("published {} and stored {stored} of {n}", stats.published).into());
    }
    Ok(rate)
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    let (rounds, n) = args()?;
    let pg_url = env_or(
        "OUTBOX_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    );
    let nats_url = env_or("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&pg_url)
        .await?;
    let schema = format!("bench_traces_{}", outbox_e2e::unique_suffix());
    let config = PostgresConfig::builder()
        .schema(&schema)
        .notify(false)
        .delete_published(true)
        .build()?;
    let store = Arc::new(PostgresStore::new(pool.clone(), config.clone()));
    store.migrate().await?;

    let exported = Counting::default();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exported.clone())
        .build();
    let tracer = provider.tracer("bench");
    let service = Context::current_with_span(tracer.start("checkout"));

    println!(
        "traces: {rounds} rounds, {n} messages per run, Postgres → NATS (JetStream file stream), \
         load average {:.2}",
        load_average().unwrap_or(f64::NAN)
    );
    // [drain off, drain on, enqueue off, enqueue on]: (msg/s, CPU µs per message) per round.
    let mut results: [Vec<(f64, f64)>; 4] = Default::default();
    let show_run = |round: usize, what: &str, on: bool, (rate, cpu): (f64, f64)| {
        println!(
            "  round {round} {what} {}: {} msg/s, {cpu:.1} µs CPU/msg",
            if on { "on " } else { "off" },
            thousands(rate)
        );
    };
    for round in 0..rounds {
        let order: [bool; 2] = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for on in order {
            enqueue(&pool, &config, n, ENQUEUE_BATCH, Some(&service)).await?;
            let traces = on.then(|| {
                Traces::with_tracer(
                    opentelemetry::global::BoxedTracer::new(Box::new(
                        provider.tracer("outbox-relay"),
                    )),
                    "nats",
                )
            });
            let run = drain(&store, &nats_url, traces, n).await?;
            results[usize::from(on)].push(run);
            show_run(round + 1, "drain, traces", on, run);
        }
        for on in order {
            let run = enqueue(
                &pool,
                &config,
                n,
                ENQUEUE_BATCH_TIMED,
                on.then_some(&service),
            )
            .await?;
            results[2 + usize::from(on)].push(run);
            show_run(round + 1, "enqueue, span", on, run);
            // Not timed: empty the table for the next drain.
            let store_relay = Relay::new(
                store.clone(),
                Arc::new(outbox_memory::RecordingPublisher::new()),
                RelayConfig::default(),
            )?;
            store_relay.run_until_idle().await?;
        }
    }
    let _ = provider.force_flush();
    let show = |label: &str, off: &[(f64, f64)], on: &[(f64, f64)]| {
        let med = |runs: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| {
            median(&runs.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
        };
        let (off_rate, on_rate) = (med(off, |r| r.0), med(on, |r| r.0));
        let (off_cpu, on_cpu) = (med(off, |r| r.1), med(on, |r| r.1));
        println!(
            "{label}: off {} msg/s ({off_cpu:.1} µs CPU/msg), on {} msg/s ({on_cpu:.1} µs \
             CPU/msg); rate on/off {:.2}, CPU on/off {:.2}",
            thousands(off_rate),
            thousands(on_rate),
            on_rate / off_rate,
            on_cpu / off_cpu
        );
    };
    // What enqueue's hook costs outside any span (the state of every service that does not
    // trace): a look at the current `tracing` span and OpenTelemetry context per call.
    let batch: Vec<_> = (0..100).map(|i| message(i, 64)).collect();
    let calls = 1_000_000u32;
    let started = Instant::now();
    for _ in 0..calls {
        std::hint::black_box(outbox_otel::capture(std::hint::black_box(&batch)));
    }
    let per_call = started.elapsed().as_nanos() as f64 / f64::from(calls);
    println!("enqueue's capture outside a span: {per_call:.1} ns per call (batch of 100, nothing copied)");
    println!("medians of {rounds} rounds:");
    show("drain (Postgres → NATS)", &results[0], &results[1]);
    show("enqueue (batches of 100)", &results[2], &results[3]);
    let spans = rounds * n + rounds * n.div_ceil(2000);
    println!(
        "spans exported by the batch processor: {} of about {spans} made (the rest dropped by \
         its queue of 2,048)",
        exported.0.load(Ordering::Relaxed)
    );
    let _ = provider.shutdown();
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}
