//! Benchmark: commit-to-receive latency of messages written by plain SQL (as a service in
//! another language writes them), relayed by the real relay engine with default settings into
//! NATS JetStream; the idle cost of the relay's polling; the cost of the key lock.
//!
//! ```text
//! eval "$(scripts/services)"
//! cargo run --release -p outbox-bench --bin sql_latency -- [stores=pg-before,pg,mariadb,sqlite]
//!     [rates=100,1000] [seconds=10] [idle_seconds=10] [writers=4] [lock_messages=4000]
//!     [poll_max_ms=N]
//! ```
//!
//! For each store (`pg-before`: Postgres without the insert trigger, as a table of an earlier
//! release whose wake-ups came only from the Rust enqueue; `pg`: Postgres as migrated now;
//! `mariadb`; `sqlite`, a file in a temporary directory), in a fresh schema, table or file:
//!
//! 1. Start one relay (`RelayConfig::default()`, in this process) publishing to a fresh
//!    JetStream stream, and leave it idle on the empty table for IDLE_SECONDS: print the
//!    claims per second it made and the CPU it used (this process; and the database server's
//!    processes, which other clients of the shared server inflate).
//! 2. For each rate: WRITERS connections insert single-row autocommit `INSERT`s (the minimal
//!    columns, no `pg_notify`) at RATE messages per second in total for SECONDS, each
//!    recording when its commit returned; a core NATS subscriber on the stream's subjects
//!    records when each message arrived. Print p50/p90/p99/max of arrival minus commit.
//!
//! Then (`lock_messages` > 0, Postgres and MariaDB): enqueue throughput through the Rust API
//! with the key lock off and on: WRITERS tasks, one message per transaction, over 1,000 keys
//! and over one key.
//!
//! Servers come from `OUTBOX_TEST_POSTGRES_URL`, `OUTBOX_TEST_MYSQL_URL` and
//! `OUTBOX_TEST_NATS_URL` (defaults: the loopback servers of SERVICES.md). Every schema, table
//! and stream it makes is removed at the end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::StreamExt;
use outbox_backend_mysql::{MysqlConfig, MysqlStore};
use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_backend_sqlite::{SqliteConfig, SqliteStore};
use outbox_bench::CpuReading;
use outbox_engine::{Relay, RelayConfig};
use outbox_traits::{
    async_trait, Capabilities, Claim, ClaimRequest, Error, Failure, LeaseToken, NewMessage,
    OutboxStore, WakeSource,
};
use uuid::Uuid;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Benchmark settings from `key=value` arguments.
#[derive(Debug, Clone)]
struct Settings {
    stores: Vec<String>,
    rates: Vec<u64>,
    seconds: u64,
    idle_seconds: u64,
    writers: usize,
    lock_messages: usize,
    /// `RelayConfig::poll_max`, when not the default.
    poll_max: Option<Duration>,
}

impl Settings {
    fn parse() -> BoxResult<Self> {
        let mut s = Settings {
            stores: ["pg-before", "pg", "mariadb", "sqlite"]
                .map(String::from)
                .to_vec(),
            rates: vec![100, 1000],
            seconds: 10,
            idle_seconds: 10,
            writers: 4,
            lock_messages: 4000,
            poll_max: None,
        };
        for arg in std::env::args().skip(1) {
            let (k, v) = arg
                .split_once('=')
                .ok_or_else(|| format!("argument {arg:?} is not key=value"))?;
            match k {
                "stores" => s.stores = v.split(',').map(String::from).collect(),
                "rates" => {
                    s.rates = v
                        .split(',')
                        .map(str::parse)
                        .collect::<Result<_, _>>()
                        .map_err(|e| format!("rates={v}: {e}"))?
                }
                "seconds" => s.seconds = v.parse()?,
                "idle_seconds" => s.idle_seconds = v.parse()?,
                "writers" => s.writers = v.parse::<usize>()?.max(1),
                "lock_messages" => s.lock_messages = v.parse()?,
                "poll_max_ms" => s.poll_max = Some(Duration::from_millis(v.parse()?)),
                _ => return Err(format!("unknown setting {k:?}").into()),
            }
        }
        Ok(s)
    }
}

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// About 200 bytes, as the other benchmarks' payloads.
fn payload(n: u64) -> String {
    serde_json::json!({
        "n": n,
        "customer": format!("customer-{}", n % 100),
        "note": "latency benchmark payload of about two hundred bytes, as in the raw SQL limits table",
    })
    .to_string()
}

fn key(n: u64) -> String {
    format!("customer-{}", n % 100)
}

/// One store under test: how to write a row by plain SQL, and how to remove what it made.
enum Target {
    Postgres {
        pool: sqlx::PgPool,
        store: PostgresStore,
    },
    Mariadb {
        pool: sqlx::MySqlPool,
        store: MysqlStore,
    },
    Sqlite {
        path: std::path::PathBuf,
        store: SqliteStore,
        _dir: tempfile::TempDir,
    },
}

impl Target {
    async fn create(name: &str, writers: usize) -> BoxResult<Self> {
        let suffix = outbox_e2e::unique_suffix();
        Ok(match name {
            "pg" | "pg-before" => {
                let url = env_or(
                    "OUTBOX_TEST_POSTGRES_URL",
                    "postgres://postgres@127.0.0.1:5432/test",
                );
                let config = PostgresConfig::builder()
                    .schema(format!("lat_{suffix}"))
                    .build()?;
                let store = PostgresStore::connect(&url, config.clone()).await?;
                store.migrate().await?;
                if name == "pg-before" {
                    // A table migrated by a release without the trigger: only the Rust enqueue
                    // sent a NOTIFY, so plain SQL inserts woke nobody.
                    sqlx::query(&format!(
                        "DROP TRIGGER \"{}\" ON {}",
                        config.notify_trigger(),
                        config.qualified_table()
                    ))
                    .execute(store.pool())
                    .await?;
                }
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(writers as u32)
                    .connect(&url)
                    .await?;
                Target::Postgres { pool, store }
            }
            "mariadb" => {
                let url = env_or("OUTBOX_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
                let config = MysqlConfig::builder()
                    .table(format!("lat_{suffix}"))
                    .build()?;
                let store = MysqlStore::connect(&url, config).await?;
                store.migrate().await?;
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(writers as u32)
                    .connect(&url)
                    .await?;
                Target::Mariadb { pool, store }
            }
            "sqlite" => {
                let dir = tempfile::tempdir()?;
                let path = dir.path().join("outbox.db");
                let store = SqliteStore::open(&path, SqliteConfig::default()).await?;
                store.migrate().await?;
                Target::Sqlite {
                    path,
                    store,
                    _dir: dir,
                }
            }
            other => return Err(format!("unknown store {other:?}").into()),
        })
    }

    fn store(&self) -> Arc<dyn OutboxStore> {
        match self {
            Target::Postgres { store, .. } => Arc::new(store.clone()),
            Target::Mariadb { store, .. } => Arc::new(store.clone()),
            Target::Sqlite { store, .. } => Arc::new(store.clone()),
        }
    }

    /// The database server's process name, for the CPU line (SQLite runs in this process).
    fn server_process(&self) -> Option<&'static str> {
        match self {
            Target::Postgres { .. } => Some("postgres"),
            Target::Mariadb { .. } => Some("mariadbd"),
            Target::Sqlite { .. } => None,
        }
    }

    /// Write messages `first..first + count` by plain SQL from WRITERS connections at `rate`
    /// per second in total; `commits[n - first]` gets the commit time of message `n`.
    async fn write(
        &self,
        first: u64,
        count: u64,
        rate: u64,
        writers: usize,
        base: Instant,
        commits: Arc<Vec<AtomicU64>>,
    ) -> BoxResult<()> {
        let start = Instant::now();
        let period = Duration::from_secs_f64(1.0 / rate as f64);
        let mut tasks = Vec::new();
        for w in 0..writers as u64 {
            let commits = commits.clone();
            let due = move |i: u64| start + period.mul_f64(i as f64);
            let record = move |commits: &[AtomicU64], i: u64| {
                commits[i as usize].store(base.elapsed().as_nanos() as u64, Ordering::Relaxed);
            };
            let indexes = (w..count).step_by(writers);
            match self {
                Target::Postgres { pool, store } => {
                    let pool = pool.clone();
                    let sql = format!(
                        "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, partition_key)
                         VALUES (gen_random_uuid(), 'order', $1, 'order.placed', $2::jsonb, $1)",
                        store.config().qualified_table()
                    );
                    tasks.push(tokio::spawn(async move {
                        let mut conn = pool.acquire().await?;
                        for i in indexes {
                            tokio::time::sleep_until(due(i).into()).await;
                            let n = first + i;
                            sqlx::query(&sql)
                                .bind(key(n))
                                .bind(payload(n))
                                .execute(&mut *conn)
                                .await?;
                            record(&commits, i);
                        }
                        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
                    }));
                }
                Target::Mariadb { pool, store } => {
                    let pool = pool.clone();
                    let sql = format!(
                        "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, partition_key)
                         VALUES (UUID(), 'order', ?, 'order.placed', ?, ?)",
                        store.config().qualified_table()
                    );
                    tasks.push(tokio::spawn(async move {
                        let mut conn = pool.acquire().await?;
                        for i in indexes {
                            tokio::time::sleep_until(due(i).into()).await;
                            let n = first + i;
                            sqlx::query(&sql)
                                .bind(key(n))
                                .bind(payload(n))
                                .bind(key(n))
                                .execute(&mut *conn)
                                .await?;
                            record(&commits, i);
                        }
                        Ok(())
                    }));
                }
                Target::Sqlite { path, store, .. } => {
                    let path = path.clone();
                    let sql = format!(
                        "INSERT INTO \"{}\" (id, aggregatetype, aggregateid, type, payload, partition_key)
                         VALUES (?1, 'order', ?2, 'order.placed', ?3, ?2)",
                        store.config().table()
                    );
                    // A separate connection, as another process's would be. NORMAL: in WAL
                    // mode a commit then writes the log without waiting for the disk.
                    tasks.push(tokio::task::spawn_blocking(move || {
                        let conn = rusqlite::Connection::open(&path)?;
                        conn.busy_timeout(Duration::from_secs(5))?;
                        conn.pragma_update(None, "synchronous", "NORMAL")?;
                        let mut stmt = conn.prepare(&sql)?;
                        for i in indexes {
                            if let Some(wait) = due(i).checked_duration_since(Instant::now()) {
                                std::thread::sleep(wait);
                            }
                            let n = first + i;
                            stmt.execute((Uuid::new_v4().to_string(), key(n), payload(n)))?;
                            record(&commits, i);
                        }
                        Ok(())
                    }));
                }
            }
        }
        for task in tasks {
            task.await??;
        }
        Ok(())
    }

    async fn remove(self) -> BoxResult<()> {
        match self {
            Target::Postgres { pool, store } => {
                sqlx::query(&format!(
                    "DROP SCHEMA \"{}\" CASCADE",
                    store.config().schema()
                ))
                .execute(&pool)
                .await?;
            }
            Target::Mariadb { pool, store } => {
                sqlx::query(&format!(
                    "DROP TABLE {}, {}",
                    store.config().qualified_table(),
                    store.config().key_locks_table()
                ))
                .execute(&pool)
                .await?;
            }
            Target::Sqlite { .. } => {}
        }
        Ok(())
    }
}

/// The store with its claim calls counted (the idle cost).
struct CountingStore {
    inner: Arc<dyn OutboxStore>,
    claims: AtomicU64,
}

#[async_trait]
impl OutboxStore for CountingStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        self.claims.fetch_add(1, Ordering::Relaxed);
        self.inner.claim(req).await
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.inner.complete(token, ids).await
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        self.inner.fail(token, failures).await
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        self.inner.extend(token, lease).await
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.inner.release(token, ids).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        self.inner.wakeups().await
    }
}

/// `p`-th percentile (nearest rank) of sorted `values`.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// Messages received so far: `arrivals[n]` is when message `n` arrived (nanoseconds since the
/// run's base instant), 0 until it does.
struct Arrivals {
    at: Vec<AtomicU64>,
    count: AtomicU64,
}

async fn bench_store(name: &str, s: &Settings) -> BoxResult<()> {
    let target = Target::create(name, s.writers).await?;
    let result = bench_target(name, s, &target).await;
    let removed = target.remove().await;
    result?;
    removed
}

async fn bench_target(name: &str, s: &Settings, target: &Target) -> BoxResult<()> {
    let nats_url = env_or("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let suffix = outbox_e2e::unique_suffix();
    let stream = format!("LAT_{suffix}");
    let subject = format!("lat{suffix}");
    let total: u64 = s.rates.iter().map(|r| r * s.seconds).sum();
    let base = Instant::now();
    let arrivals = Arc::new(Arrivals {
        at: (0..total).map(|_| AtomicU64::new(0)).collect(),
        count: AtomicU64::new(0),
    });
    let client = async_nats::connect(&nats_url).await?;
    let mut subscription = client.subscribe(format!("{subject}.>")).await?;
    client.flush().await?;
    let consumer = {
        let arrivals = arrivals.clone();
        tokio::spawn(async move {
            while let Some(message) = subscription.next().await {
                let at = base.elapsed().as_nanos() as u64;
                let n = serde_json::from_slice::<serde_json::Value>(&message.payload)
                    .ok()
                    .and_then(|v| v["n"].as_u64());
                if let Some(slot) = n.and_then(|n| arrivals.at.get(n as usize)) {
                    slot.store(at, Ordering::Relaxed);
                    arrivals.count.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };

    let publisher = outbox::broker::connect(&format!(
        "{nats_url}?subject={subject}.{{aggregate_type}}&stream={stream}&create_stream=true"
    ))
    .await?;
    let counting = Arc::new(CountingStore {
        inner: target.store(),
        claims: AtomicU64::new(0),
    });
    let defaults = RelayConfig::default();
    let relay_config = RelayConfig::builder()
        .poll_max(s.poll_max.unwrap_or(defaults.poll_max()))
        .build()?;
    let relay = Relay::new(counting.clone(), Arc::from(publisher), relay_config)?;
    let handle = relay.spawn();
    let result = measure(name, s, target, &counting, &arrivals, base).await;
    handle.shutdown(Duration::from_secs(10)).await?;
    consumer.abort();
    let js = async_nats::jetstream::new(client);
    js.delete_stream(&stream).await?;
    result
}

async fn measure(
    name: &str,
    s: &Settings,
    target: &Target,
    counting: &CountingStore,
    arrivals: &Arrivals,
    base: Instant,
) -> BoxResult<()> {
    // Idle: let the relay settle into its idle polling first. Its empty claims back off from
    // poll_min (10 ms) doubling to the ceiling: after SETTLE_CLAIMS of them it polls at the
    // ceiling. Wait for that event (the claim count), not for a guessed time.
    const SETTLE_CLAIMS: u64 = 8;
    let settle = async {
        while counting.claims.load(Ordering::Relaxed) < SETTLE_CLAIMS {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), settle)
        .await
        .map_err(|_| format!("{name}: the relay made fewer than {SETTLE_CLAIMS} claims in 60 s"))?;
    let claims_before = counting.claims.load(Ordering::Relaxed);
    let cpu_before = CpuReading::now();
    let idle_started = Instant::now();
    tokio::time::sleep(Duration::from_secs(s.idle_seconds)).await;
    let idle = idle_started.elapsed().as_secs_f64();
    let cpu_after = CpuReading::now();
    let claims = counting.claims.load(Ordering::Relaxed) - claims_before;
    let relay_cpu = cpu_after.since(&cpu_before, "self");
    let server = target
        .server_process()
        .map(|p| {
            format!(
                ", {p} {:.1} ms/s (shared server: includes other clients)",
                cpu_after.since(&cpu_before, p) * 1000.0 / idle
            )
        })
        .unwrap_or_default();
    eprintln!(
        "{name}: idle {idle:.0} s on an empty table: {:.1} claims/s, relay CPU {:.1} ms/s{server}",
        claims as f64 / idle,
        relay_cpu * 1000.0 / idle
    );

    let mut first = 0;
    for &rate in &s.rates {
        let count = rate * s.seconds;
        let commits: Arc<Vec<AtomicU64>> =
            Arc::new((0..count).map(|_| AtomicU64::new(0)).collect());
        let expected = arrivals.count.load(Ordering::Relaxed) + count;
        target
            .write(first, count, rate, s.writers, base, commits.clone())
            .await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while arrivals.count.load(Ordering::Relaxed) < expected {
            if Instant::now() > deadline {
                return Err(format!(
                    "{name} at {rate}/s: {} of {count} messages arrived within 60 s",
                    count + arrivals.count.load(Ordering::Relaxed) - expected
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut latencies: Vec<Duration> = (0..count)
            .map(|i| {
                let commit = commits[i as usize].load(Ordering::Relaxed);
                let arrived = arrivals.at[(first + i) as usize].load(Ordering::Relaxed);
                Duration::from_nanos(arrived.saturating_sub(commit))
            })
            .collect();
        latencies.sort();
        println!(
            "| {name} | {rate} msg/s | {count} | {} | {} | {} | {} |",
            ms(percentile(&latencies, 50.0)),
            ms(percentile(&latencies, 90.0)),
            ms(percentile(&latencies, 99.0)),
            ms(*latencies.last().unwrap_or(&Duration::ZERO)),
        );
        first += count;
    }
    Ok(())
}

/// Enqueue throughput through the Rust API, key lock off and on.
async fn bench_lock_cost(s: &Settings) -> BoxResult<()> {
    if s.lock_messages == 0 {
        return Ok(());
    }
    println!();
    println!("| store | keys | key lock | messages | time | msg/s |");
    println!("|---|---|---|---|---|---|");
    for name in ["pg", "mariadb"] {
        if !s.stores.iter().any(|x| x.starts_with(&name[..2])) {
            continue;
        }
        for keys in [1000u64, 1] {
            for lock in [false, true] {
                let suffix = outbox_e2e::unique_suffix();
                let n = s.lock_messages;
                let elapsed = match name {
                    "pg" => {
                        let url = env_or(
                            "OUTBOX_TEST_POSTGRES_URL",
                            "postgres://postgres@127.0.0.1:5432/test",
                        );
                        let config = PostgresConfig::builder()
                            .schema(format!("lock_{suffix}"))
                            .lock_keys(lock)
                            .build()?;
                        let store = PostgresStore::connect(&url, config.clone()).await?;
                        store.migrate().await?;
                        let pool = store.pool().clone();
                        let elapsed = timed_writers(s.writers, n, move |i| {
                            let (pool, config) = (pool.clone(), config.clone());
                            async move {
                                let mut tx = pool.begin().await?;
                                let message = lock_message(i, keys);
                                outbox_backend_postgres::enqueue(&mut *tx, &config, &message)
                                    .await?;
                                tx.commit().await?;
                                Ok(())
                            }
                        })
                        .await?;
                        sqlx::query(&format!("DROP SCHEMA \"lock_{suffix}\" CASCADE"))
                            .execute(store.pool())
                            .await?;
                        elapsed
                    }
                    _ => {
                        let url =
                            env_or("OUTBOX_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
                        let config = MysqlConfig::builder()
                            .table(format!("lock_{suffix}"))
                            .lock_keys(lock)
                            .build()?;
                        let store = MysqlStore::connect(&url, config.clone()).await?;
                        store.migrate().await?;
                        let (pool, drop) = (
                            store.pool().clone(),
                            format!(
                                "DROP TABLE {}, {}",
                                config.qualified_table(),
                                config.key_locks_table()
                            ),
                        );
                        let elapsed = timed_writers(s.writers, n, move |i| {
                            let (pool, config) = (pool.clone(), config.clone());
                            async move {
                                let mut tx = pool.begin().await?;
                                let message = lock_message(i, keys);
                                outbox_backend_mysql::enqueue(&mut *tx, &config, &message).await?;
                                tx.commit().await?;
                                Ok(())
                            }
                        })
                        .await?;
                        sqlx::query(&drop).execute(store.pool()).await?;
                        elapsed
                    }
                };
                println!(
                    "| {name} | {keys} | {} | {} | {:.2} s | {:.0} msg/s |",
                    if lock { "on" } else { "off" },
                    s.lock_messages,
                    elapsed.as_secs_f64(),
                    s.lock_messages as f64 / elapsed.as_secs_f64()
                );
            }
        }
    }
    Ok(())
}

/// Run `write(i)` for `i` in `0..n` from `writers` tasks at once; the time it took.
async fn timed_writers<F, Fut>(writers: usize, n: usize, write: F) -> BoxResult<Duration>
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = BoxResult<()>> + Send,
{
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let write = write.clone();
            tokio::spawn(async move {
                for i in (w..n).step_by(writers) {
                    write(i as u64).await?;
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(started.elapsed())
}

fn lock_message(n: u64, keys: u64) -> NewMessage {
    NewMessage::new(
        "order",
        format!("order-{n}"),
        "order.placed",
        serde_json::json!({ "n": n, "note": "key lock benchmark payload" }),
    )
    .with_partition_key(format!("customer-{}", n % keys))
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    let s = Settings::parse()?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!(
        "{} UTC, load average {}",
        Utc::now().format("%Y-%m-%d %H:%M"),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!("| store | rate | messages | p50 | p90 | p99 | max |");
    println!("|---|---|---|---|---|---|---|");
    for name in &s.stores {
        bench_store(name, &s).await?;
    }
    bench_lock_cost(&s).await?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!(
        "load average at the end {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(())
}
