//! Cost of the status query behind the relay's gauges (`OutboxAdmin::status`) on Postgres, for
//! a 1,000,000-message backlog over a 5,000,000-message published history, against the plain
//! `counts` (a scan of the whole table) for comparison, and the backlog query behind
//! `outbox-relay drain`'s progress (`OutboxAdmin::backlog`). Figures go to BENCHMARKS.md.
//!
//! ```text
//! cargo run --release -p outbox-bench --bin status -- [BACKLOG] [HISTORY]
//! ```
//! Uses `OUTBOX_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`), a fresh
//! table that it drops at the end.

use std::time::{Duration, Instant};

use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_traits::OutboxAdmin;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn timed<F, T>(
    runs: usize,
    mut f: impl FnMut() -> F,
) -> Result<(Duration, Duration), BoxError>
where
    F: std::future::Future<Output = Result<T, outbox_traits::Error>>,
{
    let mut took = Vec::new();
    for _ in 0..runs {
        let started = Instant::now();
        f().await?;
        took.push(started.elapsed());
    }
    took.sort();
    Ok((took[0], took[took.len() / 2]))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let backlog: i64 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    let history: i64 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(5_000_000);
    let url = std::env::var("OUTBOX_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let table = std::env::var("BENCH_TABLE")
        .unwrap_or_else(|_| format!("bench_status_{}", std::process::id()));
    let config = PostgresConfig::builder().table(table.clone()).build()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await?;
    let store = PostgresStore::new(pool.clone(), config.clone());
    store.migrate().await?;
    let t = config.qualified_table();
    // BENCH_TABLE=name measures a table a BENCH_KEEP run left, without filling it again.
    if std::env::var_os("BENCH_TABLE").is_none() {
        // No WAL for the fill: the machine's disk is shared, and the figures are of reads.
        sqlx::query(&format!("ALTER TABLE {t} SET UNLOGGED"))
            .execute(&pool)
            .await?;
        let fill = Instant::now();
        // History: published over the last day; 1,000 keys.
        sqlx::query(&format!(
        "INSERT INTO {t} (id, aggregatetype, aggregateid, type, payload, partition_key, state, \
                          published_at, created_at)
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'order.placed', '{{\"n\": 1}}'::jsonb,
                'k-' || (g % 1000), 'published', now() - (g % 86400) * interval '1 second',
                now() - interval '1 day'
         FROM generate_series(1, $1) g"
    ))
        .bind(history)
        .execute(&pool)
        .await?;
        // Backlog: pending, 10,000 keys; 100 keys' heads dead and 100 retrying.
        sqlx::query(&format!(
            "INSERT INTO {t} (id, aggregatetype, aggregateid, type, payload, partition_key)
         SELECT gen_random_uuid(), 'order', 'o-' || g, 'order.placed', '{{\"n\": 1}}'::jsonb,
                'p-' || (g % 10000)
         FROM generate_series(1, $1) g"
        ))
        .bind(backlog)
        .execute(&pool)
        .await?;
        sqlx::query(&format!(
            "WITH heads AS (SELECT DISTINCT ON (partition_key) id, partition_key FROM {t}
                        WHERE state = 'pending' ORDER BY partition_key, seq)
         UPDATE {t} m SET state = CASE WHEN h.partition_key < 'p-2' THEN 'dead' ELSE 'pending' END,
                attempts = 3, last_error = 'bench', available_at = now() + interval '1 hour'
         FROM heads h WHERE m.id = h.id AND h.partition_key IN (
             SELECT 'p-' || g FROM generate_series(1000, 1099) g
             UNION ALL SELECT 'p-' || g FROM generate_series(5000, 5099) g)"
        ))
        .execute(&pool)
        .await?;
        sqlx::query(&format!("VACUUM ANALYZE {t}"))
            .execute(&pool)
            .await?;
        println!(
            "filled {backlog} pending + {history} published rows in {:.1}s",
            fill.elapsed().as_secs_f64()
        );
    }
    let status = store.status(20).await?;
    println!(
        "status: pending {} leased {} dead {} oldest {:?}s blocked keys {:?} last minute {:?}",
        status.pending,
        status.leased,
        status.dead,
        status.oldest_pending_age_seconds.map(|s| s.round()),
        status.blocked_keys,
        status.published_last_minute,
    );
    let (min, median) = timed(5, || store.status(20)).await?;
    println!(
        "status query (gauges): min {:.0} ms, median {:.0} ms",
        min.as_secs_f64() * 1e3,
        median.as_secs_f64() * 1e3
    );
    let (min, median) = timed(5, || store.backlog()).await?;
    println!(
        "backlog (drain):       min {:.0} ms, median {:.0} ms",
        min.as_secs_f64() * 1e3,
        median.as_secs_f64() * 1e3
    );
    let (min, median) = timed(5, || store.ping()).await?;
    println!(
        "ping (readiness):      min {:.2} ms, median {:.2} ms",
        min.as_secs_f64() * 1e3,
        median.as_secs_f64() * 1e3
    );
    let (min, median) = timed(3, || store.counts()).await?;
    println!(
        "counts (whole table):  min {:.0} ms, median {:.0} ms",
        min.as_secs_f64() * 1e3,
        median.as_secs_f64() * 1e3
    );
    if std::env::var_os("BENCH_KEEP").is_some() {
        println!("kept {t} (BENCH_KEEP)");
    } else {
        sqlx::query(&format!("DROP TABLE {t}"))
            .execute(&pool)
            .await?;
    }
    Ok(())
}
