//! Benchmark: drain a Postgres outbox through the real relay engine into real brokers.
//!
//! ```text
//! eval "$(scripts/services)"
//! cargo run --release -p outbox-bench --bin brokers -- [nats|kafka|redis|all|none] [messages=100000]
//!     [keys=1000] [batch=N] [concurrency=N] [partitions=N] [max_in_flight=N] [kafka_props=a=b;c=d]
//!     [verify=full|count] [relays=N] [delete_published=true|false] [payload=json|bytes:N]
//! ```
//!
//! For each broker: enqueue MESSAGES messages over KEYS partition keys into a fresh Postgres
//! schema (batches of 500 per transaction, not timed), then time one relay draining them all
//! (claim → publish → complete) into a fresh NATS stream, Kafka topic or Redis stream. Prints a
//! Markdown row `| source → broker | messages | time | msg/s | settings |` per broker, then where
//! the relay spent its time: summed durations of the store calls and publish calls (calls
//! overlap when several batches are in flight, so the sums can exceed the wall time).
//!
//! `none` drains into the in-memory recording publisher instead of a broker: the store's own
//! ceiling, for telling claim/complete cost from publish cost (not part of `all`).
//!
//! It also prints the CPU time (user + system) each side used during the drain, read from
//! `/proc` (Linux only; nothing is printed elsewhere): this process (the relay), the Postgres
//! server (every `postgres` process, with the children it reaped) and the broker's server
//! (`nats-server`, `tansu` or `redis-server`), in seconds and in µs per message. Client and
//! servers share the machine's cores, so these say where a drain's time goes and let figures
//! taken on different machines be compared by cost rather than by rate.
//!
//! `payload=bytes:N` enqueues binary payloads of N bytes (`application/octet-stream`, not valid
//! UTF-8) instead of the ~200-byte JSON ones, and the row adds the payload bytes per second.
//!
//! Afterwards the broker is read back with its own client: with `verify=full` (default) every
//! message must be there, byte-equal, in per-key order; `verify=count` only counts. The schema,
//! stream, topic are deleted at the end. Servers come from `OUTBOX_TEST_POSTGRES_URL`,
//! `OUTBOX_TEST_NATS_URL`, `OUTBOX_TEST_KAFKA_BROKERS`, `OUTBOX_TEST_REDIS_URL` (defaults: the
//! loopback servers of SERVICES.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_bench::{message, CpuReading};
use outbox_e2e::{check_delivery, kafka, nats, redis, Expected, Received};
use outbox_engine::{Relay, RelayConfig};
use outbox_traits::{
    async_trait, Capabilities, Claim, ClaimRequest, Error, Failure, LeaseToken, Message,
    OutboxStore, PublishOutcome, Publisher, WakeSource,
};
use uuid::Uuid;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const ENQUEUE_BATCH: usize = 500;

/// Benchmark settings from `key=value` arguments.
#[derive(Debug, Clone)]
struct Settings {
    which: String,
    messages: usize,
    keys: usize,
    /// Relay batch size; `None` means the per-broker default below.
    batch: Option<usize>,
    concurrency: Option<usize>,
    partitions: i32,
    max_in_flight: Option<usize>,
    kafka_props: Vec<(String, String)>,
    verify_full: bool,
    /// Relays draining the same store at once.
    relays: usize,
    /// The store deletes messages as they are published instead of marking them.
    delete_published: bool,
    /// Binary payloads of this many bytes instead of JSON ones.
    bytes: Option<usize>,
}

impl Settings {
    fn parse() -> BoxResult<Self> {
        let mut s = Settings {
            which: "all".into(),
            messages: 100_000,
            keys: 1_000,
            batch: None,
            concurrency: None,
            partitions: 4,
            max_in_flight: None,
            kafka_props: Vec::new(),
            verify_full: true,
            relays: 1,
            delete_published: false,
            bytes: None,
        };
        for arg in std::env::args().skip(1) {
            let Some((key, value)) = arg.split_once('=') else {
                s.which = arg;
                continue;
            };
            match key {
                "messages" => s.messages = value.parse()?,
                "keys" => s.keys = value.parse()?,
                "batch" => s.batch = Some(value.parse()?),
                "concurrency" => s.concurrency = Some(value.parse()?),
                "partitions" => s.partitions = value.parse()?,
                "max_in_flight" => s.max_in_flight = Some(value.parse()?),
                "kafka_props" => {
                    for pair in value.split(';').filter(|p| !p.is_empty()) {
                        let (k, v) = pair.split_once('=').ok_or_else(|| {
                            format!("kafka_props entry {pair:?} needs name=value")
                        })?;
                        s.kafka_props.push((k.to_owned(), v.to_owned()));
                    }
                }
                "verify" => s.verify_full = value == "full",
                "relays" => s.relays = value.parse::<usize>()?.max(1),
                "delete_published" => s.delete_published = value.parse()?,
                "payload" => {
                    s.bytes = match value.split_once(':') {
                        None if value == "json" => None,
                        Some(("bytes", n)) => Some(n.parse()?),
                        _ => return Err(format!("payload={value:?}: use json or bytes:N").into()),
                    }
                }
                _ => {
                    return Err(format!(
                        "unknown option {key:?}; use messages, keys, batch, concurrency, \
                         partitions, max_in_flight, kafka_props, verify, relays, \
                         delete_published, payload"
                    )
                    .into())
                }
            }
        }
        if !matches!(
            s.which.as_str(),
            "nats" | "kafka" | "redis" | "all" | "none"
        ) {
            return Err(format!(
                "unknown broker {:?}; use nats, kafka, redis, all, or none (store ceiling)",
                s.which
            )
            .into());
        }
        Ok(s)
    }

    /// Relay settings: batches of 500 (half the default 1,000 keys), 2 in flight, unless given
    /// on the command line.
    ///
    /// Measured: the drain is bound by the claim, which the relay runs one after another, so
    /// neither bigger batches nor more of them in flight help. A batch that covers every key
    /// (batch ≥ keys when keys interleave) even hurts with 2+ in flight: every other claim finds
    /// each key's head leased and scans the whole backlog for nothing.
    fn relay(&self) -> Result<RelayConfig, outbox_traits::Error> {
        RelayConfig::builder()
            .batch_size(self.batch.unwrap_or(500))
            .concurrency(self.concurrency.unwrap_or(2))
            .build()
    }
}

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// Summed time and count of one kind of call.
#[derive(Default)]
struct Meter {
    calls: AtomicU64,
    nanos: AtomicU64,
    items: AtomicU64,
}

impl Meter {
    fn record(&self, started: Instant, items: usize) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.items.fetch_add(items as u64, Ordering::Relaxed);
        self.nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    fn show(&self) -> String {
        let calls = self.calls.load(Ordering::Relaxed);
        let secs = self.nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let per_call = if calls == 0 {
            0.0
        } else {
            secs * 1000.0 / calls as f64
        };
        format!(
            "{calls} calls, {} msgs, {secs:.2} s ({per_call:.1} ms/call)",
            self.items.load(Ordering::Relaxed)
        )
    }
}

/// Where the relay's time went.
#[derive(Default)]
struct Profile {
    claim: Meter,
    /// Claims that found nothing claimable (e.g. every key's head already leased).
    empty_claim: Meter,
    publish: Meter,
    complete: Meter,
    other: Meter,
}

/// The Postgres store with every call timed.
struct TimedStore {
    inner: Arc<PostgresStore>,
    profile: Arc<Profile>,
}

#[async_trait]
impl OutboxStore for TimedStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        let started = Instant::now();
        let claim = self.inner.claim(req).await;
        match claim.as_ref().map(|c| c.messages.len()) {
            Ok(0) => self.profile.empty_claim.record(started, 0),
            n => self.profile.claim.record(started, n.unwrap_or(0)),
        }
        claim
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        let started = Instant::now();
        let r = self.inner.complete(token, ids).await;
        self.profile.complete.record(started, ids.len());
        r
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        let started = Instant::now();
        let r = self.inner.fail(token, failures).await;
        self.profile.other.record(started, failures.len());
        r
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        let started = Instant::now();
        let r = self.inner.extend(token, lease).await;
        self.profile.other.record(started, 0);
        r
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        let started = Instant::now();
        let r = self.inner.release(token, ids).await;
        self.profile.other.record(started, ids.len());
        r
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        self.inner.wakeups().await
    }
}

/// The broker's publisher with every publish call timed.
struct TimedPublisher {
    inner: Box<dyn Publisher>,
    profile: Arc<Profile>,
}

#[async_trait]
impl Publisher for TimedPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        let started = Instant::now();
        let outcomes = self.inner.publish(batch).await;
        self.profile.publish.record(started, batch.len());
        outcomes
    }

    fn name(&self) -> &str {
        self.inner.name()
    }
}

/// The drain's CPU line: seconds and µs per message for the relay, Postgres and the broker's
/// server, and how much of the machine's cores they left idle.
fn cpu_line(
    before: &CpuReading,
    after: &CpuReading,
    server: Option<&str>,
    messages: usize,
    wall: Duration,
) -> Option<String> {
    if after.is_empty() {
        return None;
    }
    let per_msg = |secs: f64| secs * 1e6 / messages.max(1) as f64;
    let relay = after.since(before, "self");
    let postgres = after.since(before, "postgres");
    let mut parts = vec![
        format!(
            "relay (this process) {relay:.2} s = {:.1} µs/msg",
            per_msg(relay)
        ),
        format!("Postgres {postgres:.2} s = {:.1} µs/msg", per_msg(postgres)),
    ];
    let mut total = relay + postgres;
    if let Some(server) = server {
        let secs = after.since(before, server);
        total += secs;
        parts.push(format!(
            "{server} {secs:.2} s = {:.1} µs/msg",
            per_msg(secs)
        ));
    }
    let cores = outbox_bench::cores();
    let busy = outbox_bench::core_share(total, wall);
    Some(format!(
        "CPU during the drain: {}; together {:.1} µs/msg, {:.0}% of {cores} cores",
        parts.join(", "),
        per_msg(total),
        busy * 100.0
    ))
}

/// One broker destination: where to publish, how to read it back, how to remove it.
enum Destination {
    Nats {
        url: String,
        stream: String,
    },
    Kafka {
        brokers: String,
        topic: String,
        partitions: i32,
    },
    Redis {
        url: String,
        stream: String,
    },
    /// No broker: the in-memory recording publisher, to measure the store's own ceiling.
    None,
}

impl Destination {
    async fn create(broker: &str, s: &Settings) -> BoxResult<(Self, String, String)> {
        let suffix = outbox_e2e::unique_suffix();
        Ok(match broker {
            "nats" => {
                let url = env_or("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222");
                let stream = format!("BENCH_{suffix}");
                let mut publisher_url = format!(
                    "{url}?subject=bench{suffix}.{{aggregate_type}}&stream={stream}&create_stream=true"
                );
                let mut settings = "JetStream file stream".to_owned();
                if let Some(n) = s.max_in_flight {
                    publisher_url.push_str(&format!("&max_in_flight={n}"));
                    settings.push_str(&format!(", max_in_flight {n}"));
                } else {
                    settings.push_str(", max_in_flight default (1024 keys)");
                }
                (Destination::Nats { url, stream }, publisher_url, settings)
            }
            "kafka" => {
                let brokers = env_or("OUTBOX_TEST_KAFKA_BROKERS", "127.0.0.1:19092");
                let topic = format!("bench-{suffix}");
                kafka::create_topic(&brokers, &topic, s.partitions).await?;
                let mut publisher_url = format!("kafka://{brokers}?topic={topic}");
                let mut settings = format!(
                    "Tansu (memory), {} partitions, idempotent acks=all",
                    s.partitions
                );
                if s.kafka_props.is_empty() {
                    settings.push_str(", linger.ms 1 (publisher default)");
                }
                for (k, v) in &s.kafka_props {
                    publisher_url.push_str(&format!("&{k}={v}"));
                    settings.push_str(&format!(", {k}={v}"));
                }
                let d = Destination::Kafka {
                    brokers,
                    topic,
                    partitions: s.partitions,
                };
                (d, publisher_url, settings)
            }
            "none" => (
                Destination::None,
                String::new(),
                "no broker: in-memory recording publisher (store ceiling)".to_owned(),
            ),
            _ => {
                let url = env_or("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379");
                let stream = format!("bench-{suffix}");
                let publisher_url = format!("{url}?stream={stream}");
                let settings = "one stream, pipelined XADD".to_owned();
                (Destination::Redis { url, stream }, publisher_url, settings)
            }
        })
    }

    /// The process name of the broker's server, for the CPU line.
    fn server_process(&self) -> Option<&'static str> {
        match self {
            Destination::Nats { .. } => Some("nats-server"),
            Destination::Kafka { .. } => Some("tansu"),
            Destination::Redis { .. } => Some("redis-server"),
            Destination::None => None,
        }
    }

    async fn read(&self) -> BoxResult<Vec<Received>> {
        match self {
            Destination::Nats { url, stream } => nats::read_stream(url, stream).await,
            Destination::Kafka {
                brokers,
                topic,
                partitions,
            } => kafka::read_topic(brokers, topic, *partitions).await,
            Destination::Redis { url, stream } => redis::read_stream(url, stream).await,
            Destination::None => Ok(Vec::new()),
        }
    }

    async fn count(&self) -> BoxResult<u64> {
        match self {
            Destination::Nats { url, stream } => nats::stream_len(url, stream).await,
            Destination::Redis { url, stream } => redis::stream_len(url, stream).await,
            Destination::None => Ok(0),
            // Tansu's end offsets lag the record count, so count by reading.
            Destination::Kafka { .. } => Ok(self.read().await?.len() as u64),
        }
    }

    async fn remove(&self) -> BoxResult<()> {
        match self {
            Destination::Nats { url, stream } => nats::delete_stream(url, stream).await,
            Destination::Kafka { brokers, topic, .. } => kafka::delete_topic(brokers, topic).await,
            Destination::Redis { url, stream } => redis::delete(url, stream).await,
            Destination::None => Ok(()),
        }
    }
}

async fn bench(broker: &str, s: &Settings, pool: &sqlx::PgPool) -> BoxResult<()> {
    let schema = format!("bench_{}", outbox_e2e::unique_suffix());
    let config = PostgresConfig::builder()
        .schema(&schema)
        .notify(false)
        .delete_published(s.delete_published)
        .build()?;
    let store = Arc::new(PostgresStore::new(pool.clone(), config.clone()));
    store.migrate().await?;
    let result = bench_in(broker, s, pool, &store, &config).await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(pool)
        .await?;
    result
}

async fn bench_in(
    broker: &str,
    s: &Settings,
    pool: &sqlx::PgPool,
    store: &Arc<PostgresStore>,
    config: &PostgresConfig,
) -> BoxResult<()> {
    for chunk in (0..s.messages).collect::<Vec<_>>().chunks(ENQUEUE_BATCH) {
        let batch: Vec<_> = chunk
            .iter()
            .map(|&n| match s.bytes {
                None => message(n, s.keys),
                Some(size) => binary_message(n, s.keys, size),
            })
            .collect();
        let mut tx = pool.begin().await?;
        outbox_backend_postgres::enqueue_batch(&mut *tx, config, &batch).await?;
        tx.commit().await?;
    }
    sqlx::query(&format!("ANALYZE {}", config.qualified_table()))
        .execute(pool)
        .await?;

    let (destination, url, broker_settings) = Destination::create(broker, s).await?;
    let result = drain(
        broker,
        s,
        pool,
        store,
        config,
        &destination,
        &url,
        &broker_settings,
    )
    .await;
    let removed = destination.remove().await;
    result?;
    removed
}

#[allow(clippy::too_many_arguments)]
async fn drain(
    broker: &str,
    s: &Settings,
    pool: &sqlx::PgPool,
    store: &Arc<PostgresStore>,
    config: &PostgresConfig,
    destination: &Destination,
    url: &str,
    broker_settings: &str,
) -> BoxResult<()> {
    let profile = Arc::new(Profile::default());
    let publisher = TimedPublisher {
        inner: match destination {
            Destination::None => Box::new(outbox_memory::RecordingPublisher::new()),
            _ => outbox::broker::connect(url).await?,
        },
        profile: profile.clone(),
    };
    let timed = Arc::new(TimedStore {
        inner: store.clone(),
        profile: profile.clone(),
    });
    let relay_config = s.relay()?;
    let relays = if s.relays == 1 {
        String::new()
    } else {
        format!("{} relays, ", s.relays)
    };
    let retention = if s.delete_published {
        "published rows deleted, "
    } else {
        ""
    };
    let settings = format!(
        "{relays}batch {}, {} batches in flight, {retention}{broker_settings}",
        relay_config.batch_size().unwrap_or(500),
        relay_config.concurrency()
    );
    let publisher: Arc<dyn Publisher> = Arc::new(publisher);
    // Several relays on one store, as several relay processes would be: their claims run
    // concurrently (SKIP LOCKED hands each a different set of keys).
    let relays = (0..s.relays)
        .map(|_| Relay::new(timed.clone(), publisher.clone(), relay_config.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    // What the broker must hold, read before the drain: a store that deletes published rows
    // has none left afterwards.
    let expected = if s.verify_full && !matches!(destination, Destination::None) {
        let rows: Vec<StoredRow> = sqlx::query_as(&format!(
            "SELECT id::text, partition_key, payload::text, payload_bytes FROM {} ORDER BY seq",
            config.qualified_table()
        ))
        .fetch_all(pool)
        .await?;
        Some(
            rows.into_iter()
                .map(|(id, key, payload, bytes)| Expected {
                    id,
                    key,
                    payload: bytes.unwrap_or_else(|| payload.into_bytes()),
                })
                .collect::<Vec<_>>(),
        )
    } else {
        None
    };
    let cpu_before = CpuReading::now();
    let started = Instant::now();
    let results =
        futures::future::join_all(relays.iter().map(|relay| relay.run_until_idle())).await;
    let elapsed = started.elapsed();
    let cpu_after = CpuReading::now();
    let mut stats = outbox_engine::RelayStats::default();
    for r in results {
        stats += r?;
    }
    let payload = match s.bytes {
        None => "JSON payloads".to_owned(),
        Some(size) => format!(
            "{size}-byte binary payloads, {:.1} MB/s",
            (size * s.messages) as f64 / 1e6 / elapsed.as_secs_f64()
        ),
    };
    println!(
        "| postgres → {broker} | {} | {:.2} s | {:.0} msg/s | {settings}, {payload} |",
        s.messages,
        elapsed.as_secs_f64(),
        s.messages as f64 / elapsed.as_secs_f64()
    );
    eprintln!(
        "  {broker}: claim {}; empty claim {}; publish {}; complete {}; fail/extend/release {}; \
         stats: {} claimed, {} published, {} retried, {} released",
        profile.claim.show(),
        profile.empty_claim.show(),
        profile.publish.show(),
        profile.complete.show(),
        profile.other.show(),
        stats.claimed,
        stats.published,
        stats.retried,
        stats.released,
    );
    if let Some(line) = cpu_line(
        &cpu_before,
        &cpu_after,
        destination.server_process(),
        s.messages,
        elapsed,
    ) {
        eprintln!("  {broker}: {line}");
    }
    if stats.published as usize != s.messages {
        return Err(format!(
            "{broker}: published {} of {} messages",
            stats.published, s.messages
        )
        .into());
    }

    if matches!(destination, Destination::None) {
        // Nothing to read back: the relay's stats above are the whole result.
    } else if let Some(expected) = expected {
        let received = destination.read().await?;
        let delivery =
            check_delivery(&received, &expected).map_err(|e| format!("{broker}: {e}"))?;
        eprintln!(
            "  {broker}: verified {} messages read back (ids, bytes, per-key order), {} duplicates",
            delivery.distinct, delivery.duplicates
        );
    } else {
        let count = destination.count().await?;
        if count < s.messages as u64 {
            return Err(format!("{broker}: broker holds {count} of {}", s.messages).into());
        }
        eprintln!("  {broker}: broker holds {count} records");
    }
    Ok(())
}

/// A stored row as the broker must hold it: id, partition key, JSON text, binary payload.
type StoredRow = (String, Option<String>, String, Option<Vec<u8>>);

/// Message `n` with a binary payload of `size` bytes: not UTF-8, different per message.
fn binary_message(n: usize, keys: usize, size: usize) -> outbox_traits::NewMessage {
    let key = format!("customer-{}", n % keys);
    let data: Vec<u8> = (0..size)
        .map(|i| (i.wrapping_mul(31) ^ n.wrapping_mul(7)) as u8 | 0x80)
        .collect();
    outbox_traits::NewMessage::binary(
        "order",
        format!("order-{n}"),
        "order.placed",
        outbox_traits::Binary::new("application/octet-stream", data),
    )
    .with_partition_key(key)
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    let s = Settings::parse()?;
    let url = env_or(
        "OUTBOX_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    );
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await
        .map_err(|e| outbox_url::redact_url(&e.to_string()))?;
    println!("| source → broker | messages | time | msg/s | settings |");
    println!("|---|---|---|---|---|");
    for broker in ["none", "nats", "kafka", "redis"] {
        if s.which == broker || (s.which == "all" && broker != "none") {
            bench(broker, &s, &pool).await?;
        }
    }
    Ok(())
}
