//! Benchmarks of the outbox relay and enqueue paths against the real Postgres, SQLite and
//! MariaDB.
//!
//! ```text
//! cargo run --release -p outbox-bench -- [sqlite|postgres|mysql|all] [MESSAGES] [KEYS] [BATCH] [IN_FLIGHT] [delete_published]
//! ```
//!
//! For each store: enqueue throughput with single-message transactions from 8 concurrent
//! writers, enqueue throughput in batches, then a drain of MESSAGES (default 100,000) over KEYS
//! (default 1,000) partition keys through the real engine into the recording publisher, with
//! per-key order checked afterwards. Prints one Markdown table row per figure. Postgres comes
//! from `OUTBOX_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and
//! uses a fresh schema that is dropped afterwards. MariaDB comes from `OUTBOX_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`) and uses a fresh table that is dropped
//! afterwards.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_backend_mysql::{MysqlConfig, MysqlStore};
use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_backend_sqlite::{SqliteConfig, SqliteStore};
use outbox_bench::message;
use outbox_engine::{Relay, RelayConfig};
use outbox_memory::RecordingPublisher;
use outbox_traits::{Error, OutboxAdmin, OutboxStore};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

const WRITERS: usize = 8;
const ENQUEUE_BATCH: usize = 500;
const SINGLE_TXNS_PER_WRITER: usize = 1_000;

/// Whether the stores delete messages as they are published: the sixth argument is
/// `delete_published`.
fn delete_published() -> bool {
    std::env::args()
        .nth(6)
        .is_some_and(|a| a == "delete_published")
}

/// The relay settings, from `BATCH` and `IN_FLIGHT` on the command line (defaults 500 and 2);
/// a refused value (e.g. a batch of 0) is an error naming it.
fn relay_config() -> Result<RelayConfig, outbox_traits::Error> {
    let arg = |n: usize| std::env::args().nth(n).and_then(|s| s.parse().ok());
    let defaults = RelayConfig::default();
    RelayConfig::builder()
        .batch_size(arg(4).unwrap_or(outbox_engine::DEFAULT_BATCH_SIZE))
        .concurrency(arg(5).unwrap_or(defaults.concurrency()))
        .build()
}

fn row(store: &str, what: &str, count: usize, elapsed: Duration, settings: &str) {
    let rate = count as f64 / elapsed.as_secs_f64();
    println!(
        "| {store} | {what} | {count} | {:.2} s | {:.0} msg/s | {settings} |",
        elapsed.as_secs_f64(),
        rate
    );
}

/// Drain everything through the engine into the recording publisher and check per-key order.
async fn drain(
    name: &str,
    store: Arc<dyn OutboxStore>,
    admin: &dyn OutboxAdmin,
    expected: usize,
) -> BoxResult<()> {
    let publisher = Arc::new(RecordingPublisher::new());
    let config = relay_config()?;
    let deletes = store.capabilities().deletes_published;
    let settings = format!(
        "batch {}, {} batches in flight, per-key order + fencing on{}",
        config
            .batch_size()
            .unwrap_or(outbox_engine::DEFAULT_BATCH_SIZE),
        config.concurrency(),
        if deletes {
            ", published rows deleted"
        } else {
            ""
        }
    );
    let relay = Relay::new(store, publisher.clone(), config)?;
    let started = Instant::now();
    let stats = relay.run_until_idle().await?;
    let elapsed = started.elapsed();
    row(
        name,
        "drain (claim → publish → complete)",
        expected,
        elapsed,
        &settings,
    );

    let published = publisher.published();
    let counts = admin.counts().await?;
    let stored = if deletes {
        // Nothing may be left behind; the published rows are gone.
        expected.saturating_sub((counts.pending + counts.leased + counts.dead) as usize)
    } else {
        counts.published as usize
    };
    if stats.published as usize != expected || stored != expected {
        return Err(format!(
            "{name}: drained {} (store says {stored}), expected {expected}",
            stats.published
        )
        .into());
    }
    outbox_bench::check_key_order(published.iter().map(|d| &d.message))
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(())
}

async fn bench_postgres(messages: usize, keys: usize) -> BoxResult<()> {
    let url = std::env::var("OUTBOX_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(WRITERS as u32 + 4)
        .connect(&url)
        .await
        .map_err(|e| outbox_url::redact_url(&e.to_string()))?;
    let schema = format!("bench_{}", uuid::Uuid::new_v4().simple());
    let config = PostgresConfig::builder()
        .schema(&schema)
        .notify(false)
        .delete_published(delete_published())
        .build()?;
    let store = Arc::new(PostgresStore::new(pool.clone(), config.clone()));
    store.migrate().await?;

    // Single-message transactions, 8 concurrent writers.
    let started = Instant::now();
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (pool, config) = (pool.clone(), config.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..SINGLE_TXNS_PER_WRITER {
                let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
                outbox_backend_postgres::enqueue(
                    &mut *tx,
                    &config,
                    &message(w * SINGLE_TXNS_PER_WRITER + i, keys),
                )
                .await
                .map_err(|e| e.to_string())?;
                tx.commit().await.map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(())
        }));
    }
    for w in writers {
        w.await??;
    }
    row(
        "postgres",
        "enqueue, 1 message per transaction",
        WRITERS * SINGLE_TXNS_PER_WRITER,
        started.elapsed(),
        "8 concurrent writers",
    );
    drain(
        "postgres",
        store.clone(),
        &*store,
        WRITERS * SINGLE_TXNS_PER_WRITER,
    )
    .await?;
    store.purge_published(Duration::ZERO, usize::MAX).await?;

    // Batches, one writer.
    let started = Instant::now();
    for chunk in (0..messages).collect::<Vec<_>>().chunks(ENQUEUE_BATCH) {
        let batch: Vec<_> = chunk.iter().map(|&n| message(n, keys)).collect();
        let mut tx = pool.begin().await?;
        outbox_backend_postgres::enqueue_batch(&mut *tx, &config, &batch).await?;
        tx.commit().await?;
    }
    row(
        "postgres",
        "enqueue, batches of 500 per transaction",
        messages,
        started.elapsed(),
        "1 writer",
    );
    sqlx::query(&format!("ANALYZE {}", config.qualified_table()))
        .execute(&pool)
        .await?;

    drain("postgres", store.clone(), &*store, messages).await?;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}

async fn bench_mysql(messages: usize, keys: usize) -> BoxResult<()> {
    let url = std::env::var("OUTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(WRITERS as u32 + 4)
        .connect(&url)
        .await
        .map_err(|e| outbox_url::redact_url(&e.to_string()))?;
    let table = format!("bench_{}", uuid::Uuid::new_v4().simple());
    let config = MysqlConfig::builder()
        .table(&table)
        .delete_published(delete_published())
        .build()?;
    let store = Arc::new(MysqlStore::new(pool.clone(), config.clone()));
    store.migrate().await?;

    // Single-message transactions, 8 concurrent writers.
    let started = Instant::now();
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (pool, config) = (pool.clone(), config.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..SINGLE_TXNS_PER_WRITER {
                let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
                outbox_backend_mysql::enqueue(
                    &mut *tx,
                    &config,
                    &message(w * SINGLE_TXNS_PER_WRITER + i, keys),
                )
                .await
                .map_err(|e| e.to_string())?;
                tx.commit().await.map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(())
        }));
    }
    for w in writers {
        w.await??;
    }
    row(
        "mysql",
        "enqueue, 1 message per transaction",
        WRITERS * SINGLE_TXNS_PER_WRITER,
        started.elapsed(),
        "8 concurrent writers",
    );
    drain(
        "mysql",
        store.clone(),
        &*store,
        WRITERS * SINGLE_TXNS_PER_WRITER,
    )
    .await?;
    store.purge_published(Duration::ZERO, usize::MAX).await?;

    // Batches, one writer.
    let started = Instant::now();
    for chunk in (0..messages).collect::<Vec<_>>().chunks(ENQUEUE_BATCH) {
        let batch: Vec<_> = chunk.iter().map(|&n| message(n, keys)).collect();
        let mut tx = pool.begin().await?;
        outbox_backend_mysql::enqueue_batch(&mut *tx, &config, &batch).await?;
        tx.commit().await?;
    }
    row(
        "mysql",
        "enqueue, batches of 500 per transaction",
        messages,
        started.elapsed(),
        "1 writer",
    );
    sqlx::raw_sql(&format!("ANALYZE TABLE {}", config.qualified_table()))
        .execute(&pool)
        .await?;

    drain("mysql", store.clone(), &*store, messages).await?;
    sqlx::raw_sql(&format!("DROP TABLE {}", config.qualified_table()))
        .execute(&pool)
        .await?;
    Ok(())
}

fn sqlite_single_writers(path: &Path, config: &SqliteConfig, keys: usize) -> BoxResult<()> {
    let threads: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (path, config) = (path.to_path_buf(), config.clone());
            std::thread::spawn(move || -> Result<(), Error> {
                let mut conn = outbox_backend_sqlite::open_connection(&path, &config)?;
                for i in 0..SINGLE_TXNS_PER_WRITER {
                    let tx = conn
                        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                        .map_err(outbox_backend_sqlite::sqlite_error)?;
                    outbox_backend_sqlite::enqueue(
                        &tx,
                        &config,
                        &message(w * SINGLE_TXNS_PER_WRITER + i, keys),
                    )?;
                    tx.commit().map_err(outbox_backend_sqlite::sqlite_error)?;
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "writer thread panicked")??;
    }
    Ok(())
}

async fn bench_sqlite(messages: usize, keys: usize) -> BoxResult<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.sqlite");
    let config = SqliteConfig::builder()
        .delete_published(delete_published())
        .build()?;
    let store = SqliteStore::open(&path, config.clone()).await?;
    store.migrate().await?;
    let store = Arc::new(store);

    let started = Instant::now();
    {
        let (path, config) = (path.clone(), config.clone());
        tokio::task::spawn_blocking(move || {
            sqlite_single_writers(&path, &config, keys).map_err(|e| e.to_string())
        })
        .await??;
    }
    row(
        "sqlite",
        "enqueue, 1 message per transaction",
        WRITERS * SINGLE_TXNS_PER_WRITER,
        started.elapsed(),
        "8 concurrent writers, WAL, synchronous=NORMAL",
    );
    drain(
        "sqlite",
        store.clone(),
        &*store,
        WRITERS * SINGLE_TXNS_PER_WRITER,
    )
    .await?;
    store.purge_published(Duration::ZERO, usize::MAX).await?;

    let started = Instant::now();
    {
        let (path, config) = (path.clone(), config.clone());
        tokio::task::spawn_blocking(move || {
            outbox_bench::sqlite_enqueue(&path, &config, messages, keys, ENQUEUE_BATCH)
        })
        .await??;
    }
    row(
        "sqlite",
        "enqueue, batches of 500 per transaction",
        messages,
        started.elapsed(),
        "1 writer, WAL, synchronous=NORMAL",
    );
    drain("sqlite", store.clone(), &*store, messages).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "all".into());
    let messages: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(100_000);
    let keys: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1_000);
    println!("| store | what | messages | time | throughput | settings |");
    println!("|---|---|---|---|---|---|");
    if which == "sqlite" || which == "all" {
        bench_sqlite(messages, keys).await?;
    }
    if which == "postgres" || which == "all" {
        bench_postgres(messages, keys).await?;
    }
    if which == "mysql" || which == "all" {
        bench_mysql(messages, keys).await?;
    }
    Ok(())
}
