//! The MariaDB claim's window end (issue 31), the statement as relays before the `key_hash`
//! column ran it against the statement now, side by side on one table:
//!
//! ```text
//! cargo run --release -p outbox-bench --bin mysql_window -- [rows=100000] [keys=1000] [reps=31]
//! ```
//!
//! Needs `OUTBOX_TEST_MYSQL_URL`. Makes a fresh table by `migrate` (so with the column and the
//! widened claim index), enqueues `rows` messages over `keys` keys (one in ten unordered), then
//! for 1 (unsharded), 2 and 4 shards times each statement `reps` times, alternating the two
//! statement by statement, and prints the medians and their ratio. The window is the relay's
//! default: 4 × a batch of 500 rows of the shard. Prints figures, asserts nothing; drops the
//! table at the end.

use std::time::{Duration, Instant};

use outbox_backend_mysql::{enqueue_batch, MysqlConfig, MysqlStore};
use outbox_traits::NewMessage;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The window's offset: 4 × 500 rows (`CLAIM_WINDOW` × the default batch), minus one.
const WINDOW_OFFSET: i64 = 4 * 500 - 1;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let (mut rows, mut keys, mut reps) = (100_000usize, 1_000usize, 31usize);
    for arg in std::env::args().skip(1) {
        let (key, value) = arg
            .split_once('=')
            .ok_or_else(|| format!("expected key=value, got {arg:?}"))?;
        match key {
            "rows" => rows = value.parse()?,
            "keys" => keys = value.parse::<usize>()?.max(1),
            "reps" => reps = value.parse::<usize>()?.max(1),
            _ => return Err(format!("unknown option {key:?}; use rows, keys, reps").into()),
        }
    }
    let url = std::env::var("OUTBOX_TEST_MYSQL_URL")
        .map_err(|_| "set OUTBOX_TEST_MYSQL_URL (scripts/services prints it)")?;
    let table = format!("bench_window_{}", uuid::Uuid::new_v4().simple());
    // The claim index this program measures is the outbox table's own (`ix_claim`).
    let config = MysqlConfig::builder()
        .table(table.clone())
        .unpublished_table(false)
        .build()?;
    let store = MysqlStore::connect(&url, config.clone()).await?;
    store.migrate().await?;
    let result = measure(&store, &config, &table, rows, keys, reps).await;
    sqlx::raw_sql(&config.drop_sql())
        .execute(store.pool())
        .await?;
    result
}

async fn measure(
    store: &MysqlStore,
    config: &MysqlConfig,
    table: &str,
    rows: usize,
    keys: usize,
    reps: usize,
) -> Result<(), BoxError> {
    for start in (0..rows).step_by(5_000) {
        let batch: Vec<NewMessage> = (start..(start + 5_000).min(rows))
            .map(|n| {
                let m = NewMessage::new(
                    "bench",
                    format!("key-{}", n % keys),
                    "bench.event",
                    serde_json::json!({ "n": n, "pad": "x".repeat(100) }),
                );
                if n % 10 == 0 {
                    m.unordered()
                } else {
                    m
                }
            })
            .collect();
        let mut tx = store.pool().begin().await?;
        enqueue_batch(&mut *tx, config, &batch).await?;
        tx.commit().await?;
    }
    sqlx::query(&format!("ANALYZE TABLE `{table}`"))
        .execute(store.pool())
        .await?;
    let old = format!(
        "SELECT w.seq FROM `{table}` w FORCE INDEX (ix_claim) \
         WHERE w.state = 'pending' \
           AND MOD(IF(w.partition_key IS NULL, w.seq, CRC32(w.partition_key)), ?) = ? \
         ORDER BY w.seq LIMIT ?, 1"
    );
    let new = format!(
        "SELECT w.seq FROM `{table}` w FORCE INDEX (ix_claim) \
         WHERE w.state = 'pending' AND MOD(COALESCE(w.key_hash, w.seq), ?) = ? \
         ORDER BY w.seq LIMIT ?, 1"
    );
    let unsharded = format!(
        "SELECT w.seq FROM `{table}` w FORCE INDEX (ix_claim) \
         WHERE w.state = 'pending' ORDER BY w.seq LIMIT ?, 1"
    );
    let mut conn = store.pool().acquire().await?;
    let mut base = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let _: Option<i64> = sqlx::query_scalar(&unsharded)
            .bind(WINDOW_OFFSET)
            .fetch_optional(&mut *conn)
            .await?;
        base.push(t.elapsed());
    }
    println!(
        "{rows} rows over {keys} keys; window end of 2,000 rows; medians of {reps}, alternated"
    );
    println!(
        "unsharded (claim index alone): {:.2} ms",
        ms(median(&mut base))
    );
    println!("| shards | before: reads rows (ms) | now: claim index alone (ms) | before / now |");
    println!("|---|---|---|---|");
    for shards in [2u32, 4] {
        let (mut before, mut now) = (Vec::new(), Vec::new());
        for rep in 0..reps {
            let index = u32::try_from(rep).unwrap_or(0) % shards;
            for (sql, times) in [(&old, &mut before), (&new, &mut now)] {
                let t = Instant::now();
                let _: Option<i64> = sqlx::query_scalar(sql)
                    .bind(shards)
                    .bind(index)
                    .bind(WINDOW_OFFSET)
                    .fetch_optional(&mut *conn)
                    .await?;
                times.push(t.elapsed());
            }
        }
        let (b, n) = (ms(median(&mut before)), ms(median(&mut now)));
        println!("| {shards} | {b:.2} | {n:.2} | {:.1}x |", b / n);
    }
    Ok(())
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}
