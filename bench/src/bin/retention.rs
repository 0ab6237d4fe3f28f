//! Retention by partition against row deletes (Postgres): the cost of purging a published
//! history with `purge_published`, as the relay's purge loop calls it, on a time-partitioned
//! table (`partition_interval`: whole partitions dropped) and on a plain table (row deletes).
//! Prints wall time, WAL written, and the table's size before and after (and, for the plain
//! table, after a VACUUM too). Figures go to BENCHMARKS.md, "Retention by partition".
//!
//! ```text
//! cargo run --release -p outbox-bench --bin retention -- [ROWS] [PARTITIONS] [BATCH]
//! ```
//! ROWS published rows (default 10,000,000) written by SQL (`generate_series`), their
//! `created_at` spread over PARTITIONS one-hour partitions (default 10) that ended at least an
//! hour ago; purged with `purge_published(1 hour, BATCH)` (default 1,000, the relay's) until
//! it returns less than BATCH. Uses `OUTBOX_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); each table in a schema of its own, dropped at
//! the end.

use std::time::{Duration, Instant};

use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_traits::OutboxAdmin;
use sqlx::PgPool;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const HOUR: Duration = Duration::from_secs(3600);

/// Rows written per INSERT statement.
const CHUNK: i64 = 1_000_000;

struct Figures {
    fill: Duration,
    size_before: i64,
    purge: Duration,
    purged: u64,
    calls: u64,
    wal: i64,
    size_after: i64,
    /// Plain table only: VACUUM's time, WAL and the size after it.
    vacuum: Option<(Duration, i64, i64)>,
}

/// Total size of `table` with its partitions (if any), indexes and TOAST, plus `extra` tables'.
async fn size(pool: &PgPool, table: &str, extra: &[String]) -> Result<i64, BoxError> {
    let mut total: i64 = sqlx::query_scalar(
        "SELECT coalesce((SELECT sum(pg_total_relation_size(relid))
                          FROM pg_partition_tree($1::regclass)),
                         pg_total_relation_size($1::regclass))::bigint",
    )
    .bind(table)
    .fetch_one(pool)
    .await?;
    for t in extra {
        let n: i64 = sqlx::query_scalar("SELECT pg_total_relation_size($1::regclass)")
            .bind(t)
            .fetch_one(pool)
            .await?;
        total += n;
    }
    Ok(total)
}

async fn lsn(pool: &PgPool) -> Result<String, BoxError> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?)
}

async fn wal_since(pool: &PgPool, from: &str) -> Result<i64, BoxError> {
    Ok(
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint")
            .bind(from)
            .fetch_one(pool)
            .await?,
    )
}

async fn run(
    pool: &PgPool,
    partitioned: bool,
    rows: i64,
    partitions: i64,
    batch: usize,
) -> Result<Figures, BoxError> {
    let schema = format!(
        "bench_retention_{}_{}",
        if partitioned { "part" } else { "plain" },
        std::process::id()
    );
    let config = PostgresConfig::builder()
        .schema(&schema)
        .partition_interval(partitioned.then_some(HOUR))
        .build()?;
    let store = PostgresStore::new(pool.clone(), config.clone());
    store.migrate().await?;
    let t = config.qualified_table().to_owned();
    // The first partition's start: PARTITIONS + 1 hours ago, on the hour; the rows end an hour
    // before the current one.
    let start: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(&format!(
        "SELECT date_trunc('hour', now()) - interval '1 hour' * {}",
        partitions + 1
    ))
    .fetch_one(pool)
    .await?;
    if let Some(premake) = config.premake_function() {
        sqlx::query(&format!("SELECT {premake}($1, $2)"))
            .bind(i32::try_from(partitions)?)
            .bind(start)
            .execute(pool)
            .await?;
    }
    let span_us = partitions * 3600 * 1_000_000;
    let filled = Instant::now();
    let mut from = 0;
    while from < rows {
        let to = (from + CHUNK).min(rows);
        sqlx::query(&format!(
            "INSERT INTO {t} (aggregatetype, aggregateid, type, payload, partition_key, state,
                              created_at, published_at)
             SELECT 'order', 'order-' || g, 'order.placed',
                    jsonb_build_object('n', g, 'total', 12),
                    'customer-' || (g % 1000), 'published',
                    $1::timestamptz + (g * ($2::bigint / $3::bigint)) * interval '1 microsecond',
                    $1::timestamptz + (g * ($2::bigint / $3::bigint)) * interval '1 microsecond'
             FROM generate_series($4::bigint, $5::bigint - 1) g"
        ))
        .bind(start)
        .bind(span_us)
        .bind(rows)
        .bind(from)
        .bind(to)
        .execute(pool)
        .await?;
        from = to;
        eprintln!(
            "  {}: {from} rows written",
            if partitioned { "partitioned" } else { "plain" }
        );
    }
    sqlx::query(&format!("VACUUM ANALYZE {t}"))
        .execute(pool)
        .await?;
    let fill = filled.elapsed();
    let side: Vec<String> = if partitioned {
        vec![format!("\"{schema}\".\"outbox_dedup\"")]
    } else {
        Vec::new()
    };
    sqlx::query("CHECKPOINT").execute(pool).await?;
    let size_before = size(pool, &t, &side).await?;
    let wal_from = lsn(pool).await?;
    let started = Instant::now();
    let mut purged = 0;
    let mut calls = 0;
    loop {
        let n = store.purge_published(HOUR, batch).await?;
        purged += n;
        calls += 1;
        if n < batch as u64 {
            break;
        }
    }
    let purge = started.elapsed();
    let wal = wal_since(pool, &wal_from).await?;
    let size_after = size(pool, &t, &side).await?;
    let vacuum = if partitioned {
        None
    } else {
        let wal_from = lsn(pool).await?;
        let started = Instant::now();
        sqlx::query(&format!("VACUUM {t}")).execute(pool).await?;
        let took = started.elapsed();
        Some((
            took,
            wal_since(pool, &wal_from).await?,
            size(pool, &t, &side).await?,
        ))
    };
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(pool)
        .await?;
    Ok(Figures {
        fill,
        size_before,
        purge,
        purged,
        calls,
        wal,
        size_after,
        vacuum,
    })
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let rows: i64 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(10_000_000);
    let partitions: i64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(10);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1000);
    if rows < 1 || partitions < 1 || batch < 1 {
        return Err("ROWS, PARTITIONS and BATCH must each be at least 1".into());
    }
    let url = std::env::var("OUTBOX_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await?;
    println!(
        "retention: {rows} published rows over {partitions} one-hour partitions, \
         purge_published(1 h, batch {batch}) until it returns less than the batch"
    );
    let mut results = Vec::new();
    for partitioned in [true, false] {
        let f = run(&pool, partitioned, rows, partitions, batch).await?;
        let name = if partitioned {
            "partitioned (drop)"
        } else {
            "plain (row deletes)"
        };
        println!(
            "{name:<20} fill {:>7.1} s | purge {:>8.2} s, {} rows, {} calls, WAL {:>9.1} MiB | \
             size {:>8.1} MiB -> {:>8.1} MiB",
            f.fill.as_secs_f64(),
            f.purge.as_secs_f64(),
            f.purged,
            f.calls,
            mib(f.wal),
            mib(f.size_before),
            mib(f.size_after),
        );
        if let Some((took, wal, after)) = f.vacuum {
            println!(
                "{:<20} then VACUUM {:>7.2} s, WAL {:>9.1} MiB | size after VACUUM {:>8.1} MiB",
                "",
                took.as_secs_f64(),
                mib(wal),
                mib(after)
            );
        }
        results.push(f);
    }
    let (p, r) = (&results[0], &results[1]);
    let plain_total = r.purge + r.vacuum.map(|v| v.0).unwrap_or_default();
    let plain_wal = r.wal + r.vacuum.map(|v| v.1).unwrap_or_default();
    println!(
        "ratio plain/partitioned: purge time {:.1}x ({:.1}x with the VACUUM), WAL {:.1}x ({:.1}x \
         with the VACUUM)",
        r.purge.as_secs_f64() / p.purge.as_secs_f64().max(1e-9),
        plain_total.as_secs_f64() / p.purge.as_secs_f64().max(1e-9),
        r.wal as f64 / (p.wal.max(1) as f64),
        plain_wal as f64 / (p.wal.max(1) as f64),
    );
    Ok(())
}
