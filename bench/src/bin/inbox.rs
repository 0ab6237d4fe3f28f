//! Benchmark: the inbox's cost, side by side. A consumer-side handler loop applies one effect
//! per delivery (one row inserted into an effects table) with the inbox mark in the same
//! transaction, and the same loop without the inbox, on Postgres, MariaDB and SQLite, in
//! interleaved rounds; prints messages per second (medians) and the inbox's cost as a ratio.
//!
//! ```text
//! eval "$(scripts/services)"
//! cargo run --release -p outbox-bench --bin inbox -- [rounds=3] [messages=20000] [batch=100]
//!     [stores=postgres,mysql,sqlite]
//! ```
//!
//! Each store runs two transaction shapes, each with and without the inbox:
//!
//! - `per message`: one transaction per delivery: begin, `record` (with the inbox), the effect's
//!   `INSERT`, commit;
//! - `per batch`: one transaction per BATCH deliveries: begin, `record_batch` for the batch's
//!   ids in one round trip (with the inbox), one effect `INSERT` per new message, commit.
//!
//! Every delivery is a new message (fresh UUIDv7 ids), the common case; after each run the
//! effects (and marks) are counted to check that every message was applied once. Tables are
//! emptied between runs (not timed). Within a round, the order of "with" and "without"
//! alternates from one shape to the next and from one round to the next, so a drift of the
//! machine's load does not favour one side.
//!
//! The loop calls the handler directly rather than through a broker consumer: a consumer's
//! fetch and ack are the same with and without the inbox and only add to both times, so the
//! direct loop shows the inbox's largest relative cost (behind a broker the ratio is closer
//! to 1).
//!
//! Servers come from `OUTBOX_TEST_POSTGRES_URL` and `OUTBOX_TEST_MYSQL_URL` (defaults: the
//! loopback servers of `scripts/services`); SQLite is a file in a temporary directory, opened
//! with the SQLite backend's `open_connection` (WAL, its default `synchronous`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outbox_bench::{load_average, median, thousands};
use outbox_inbox::{mysql, postgres, sqlite, InboxConfig, Receipt, MAX_BATCH};
use sqlx::{MySqlPool, PgPool};
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The inbox's table for this benchmark (not the default, so it never meets a test's marks).
const INBOX_TABLE: &str = "outbox_bench_inbox";
/// The handler's effects table.
const EFFECTS: &str = "outbox_bench_effects";
/// The consumer name the marks are recorded under.
const CONSUMER: &str = "bench-payments";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Shape {
    PerMessage,
    PerBatch,
}

impl Shape {
    fn label(self, batch: usize) -> String {
        match self {
            Self::PerMessage => "per message".to_owned(),
            Self::PerBatch => format!("per batch of {batch}"),
        }
    }
}

enum Store {
    Postgres(PgPool),
    Mysql(MySqlPool),
    Sqlite(PathBuf),
}

impl Store {
    fn name(&self) -> &'static str {
        match self {
            Self::Postgres(_) => "postgres",
            Self::Mysql(_) => "mysql",
            Self::Sqlite(_) => "sqlite",
        }
    }
}

struct Settings {
    rounds: usize,
    messages: usize,
    batch: usize,
    stores: Vec<String>,
}

fn parse_args() -> Result<Settings, String> {
    let mut s = Settings {
        rounds: 3,
        messages: 20_000,
        batch: 100,
        stores: vec!["postgres".into(), "mysql".into(), "sqlite".into()],
    };
    for arg in std::env::args().skip(1) {
        let (key, value) = arg.split_once('=').ok_or_else(|| {
            format!("argument `{arg}`: expected key=value (rounds=, messages=, batch=, stores=)")
        })?;
        let number = || {
            value
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("`{key}={value}`: expected a whole number above 0"))
        };
        match key {
            "rounds" => s.rounds = number()?,
            "messages" => s.messages = number()?,
            "batch" => s.batch = number()?,
            "stores" => {
                s.stores = value.split(',').map(|v| v.trim().to_owned()).collect();
                if let Some(bad) = s
                    .stores
                    .iter()
                    .find(|v| !["postgres", "mysql", "sqlite"].contains(&v.as_str()))
                {
                    return Err(format!(
                        "`stores=`: unknown store `{bad}` (use postgres, mysql, sqlite)"
                    ));
                }
            }
            other => {
                return Err(format!(
                    "unknown argument `{other}` (use rounds=, messages=, batch=, stores=)"
                ))
            }
        }
    }
    if s.batch > MAX_BATCH {
        return Err(format!(
            "`batch={}`: the inbox takes at most {MAX_BATCH} ids per record_batch",
            s.batch
        ));
    }
    Ok(s)
}

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// One delivery: the message id and the effect's values.
#[derive(Clone, Copy)]
struct Delivery {
    id: Uuid,
    order: i64,
}

fn deliveries(n: usize) -> Vec<Delivery> {
    (0..n)
        .map(|i| Delivery {
            id: Uuid::now_v7(),
            order: i as i64,
        })
        .collect()
}

async fn prepare(store: &Store, config: &InboxConfig) -> Result<(), BoxError> {
    match store {
        Store::Postgres(pool) => {
            postgres::migrate(pool, config).await?;
            sqlx::query(&format!(
                "CREATE TABLE IF NOT EXISTS {EFFECTS} (id BIGSERIAL PRIMARY KEY, \
                 message_id UUID NOT NULL, order_no BIGINT NOT NULL, amount BIGINT NOT NULL)"
            ))
            .execute(pool)
            .await?;
        }
        Store::Mysql(pool) => {
            mysql::migrate(pool, config).await?;
            sqlx::query(&format!(
                "CREATE TABLE IF NOT EXISTS {EFFECTS} (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 message_id BINARY(16) NOT NULL, order_no BIGINT NOT NULL, \
                 amount BIGINT NOT NULL) ENGINE=InnoDB"
            ))
            .execute(pool)
            .await?;
        }
        Store::Sqlite(path) => {
            let conn = open_sqlite(path)?;
            sqlite::migrate(&conn, config)?;
            conn.execute_batch(&format!(
                "CREATE TABLE IF NOT EXISTS {EFFECTS} (id INTEGER PRIMARY KEY, \
                 message_id TEXT NOT NULL, order_no INTEGER NOT NULL, amount INTEGER NOT NULL)"
            ))?;
        }
    }
    empty(store).await
}

/// Empty the effects and the inbox (between runs, not timed).
async fn empty(store: &Store) -> Result<(), BoxError> {
    match store {
        Store::Postgres(pool) => {
            sqlx::query(&format!("TRUNCATE {EFFECTS}, {INBOX_TABLE}"))
                .execute(pool)
                .await?;
        }
        Store::Mysql(pool) => {
            for table in [EFFECTS, INBOX_TABLE] {
                sqlx::query(&format!("TRUNCATE TABLE {table}"))
                    .execute(pool)
                    .await?;
            }
        }
        Store::Sqlite(path) => {
            let conn = open_sqlite(path)?;
            conn.execute_batch(&format!(
                "DELETE FROM {EFFECTS}; DELETE FROM {INBOX_TABLE};"
            ))?;
        }
    }
    Ok(())
}

/// Rows in the effects table and in the inbox.
async fn counts(store: &Store) -> Result<(i64, i64), BoxError> {
    let effects = format!("SELECT count(*) FROM {EFFECTS}");
    let marks = format!("SELECT count(*) FROM {INBOX_TABLE}");
    Ok(match store {
        Store::Postgres(pool) => (
            sqlx::query_scalar(&effects).fetch_one(pool).await?,
            sqlx::query_scalar(&marks).fetch_one(pool).await?,
        ),
        Store::Mysql(pool) => (
            sqlx::query_scalar(&effects).fetch_one(pool).await?,
            sqlx::query_scalar(&marks).fetch_one(pool).await?,
        ),
        Store::Sqlite(path) => {
            let conn = open_sqlite(path)?;
            (
                conn.query_row(&effects, [], |r| r.get(0))?,
                conn.query_row(&marks, [], |r| r.get(0))?,
            )
        }
    })
}

fn open_sqlite(path: &Path) -> Result<rusqlite::Connection, BoxError> {
    Ok(outbox_backend_sqlite::open_connection(
        path,
        &outbox_backend_sqlite::SqliteConfig::default(),
    )?)
}

/// The receipts of a batch: from the inbox, or every message new without it.
fn all_new(n: usize) -> Vec<Receipt> {
    vec![Receipt::New; n]
}

/// One timed run of the handler loop over `work`.
async fn run(
    store: &Store,
    config: &InboxConfig,
    shape: Shape,
    inbox: bool,
    batch: usize,
    work: &[Delivery],
) -> Result<Duration, BoxError> {
    let size = match shape {
        Shape::PerMessage => 1,
        Shape::PerBatch => batch,
    };
    match store {
        Store::Postgres(pool) => {
            let effect =
                format!("INSERT INTO {EFFECTS} (message_id, order_no, amount) VALUES ($1, $2, $3)");
            let start = Instant::now();
            for chunk in work.chunks(size) {
                let mut tx = pool.begin().await?;
                let ids: Vec<Uuid> = chunk.iter().map(|d| d.id).collect();
                let receipts = match (inbox, shape) {
                    (false, _) => all_new(chunk.len()),
                    (true, Shape::PerMessage) => {
                        vec![postgres::record(&mut *tx, config, CONSUMER, ids[0]).await?]
                    }
                    (true, Shape::PerBatch) => {
                        postgres::record_batch(&mut *tx, config, CONSUMER, &ids).await?
                    }
                };
                for (d, receipt) in chunk.iter().zip(receipts) {
                    if receipt.is_new() {
                        sqlx::query(&effect)
                            .bind(d.id)
                            .bind(d.order)
                            .bind(1000 + d.order)
                            .execute(&mut *tx)
                            .await?;
                    }
                }
                tx.commit().await?;
            }
            Ok(start.elapsed())
        }
        Store::Mysql(pool) => {
            let effect =
                format!("INSERT INTO {EFFECTS} (message_id, order_no, amount) VALUES (?, ?, ?)");
            let start = Instant::now();
            for chunk in work.chunks(size) {
                let mut tx = pool.begin().await?;
                let ids: Vec<Uuid> = chunk.iter().map(|d| d.id).collect();
                let receipts = match (inbox, shape) {
                    (false, _) => all_new(chunk.len()),
                    (true, Shape::PerMessage) => {
                        vec![mysql::record(&mut *tx, config, CONSUMER, ids[0]).await?]
                    }
                    (true, Shape::PerBatch) => {
                        mysql::record_batch(&mut *tx, config, CONSUMER, &ids).await?
                    }
                };
                for (d, receipt) in chunk.iter().zip(receipts) {
                    if receipt.is_new() {
                        sqlx::query(&effect)
                            .bind(d.id)
                            .bind(d.order)
                            .bind(1000 + d.order)
                            .execute(&mut *tx)
                            .await?;
                    }
                }
                tx.commit().await?;
            }
            Ok(start.elapsed())
        }
        Store::Sqlite(path) => {
            let path = path.clone();
            let config = config.clone();
            let work = work.to_vec();
            tokio::task::spawn_blocking(move || {
                sqlite_run(&path, &config, shape, inbox, size, &work)
            })
            .await?
        }
    }
}

fn sqlite_run(
    path: &Path,
    config: &InboxConfig,
    shape: Shape,
    inbox: bool,
    size: usize,
    work: &[Delivery],
) -> Result<Duration, BoxError> {
    let mut conn = open_sqlite(path)?;
    let effect =
        format!("INSERT INTO {EFFECTS} (message_id, order_no, amount) VALUES (?1, ?2, ?3)");
    let start = Instant::now();
    for chunk in work.chunks(size) {
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let ids: Vec<Uuid> = chunk.iter().map(|d| d.id).collect();
        let receipts = match (inbox, shape) {
            (false, _) => all_new(chunk.len()),
            (true, Shape::PerMessage) => vec![sqlite::record(&tx, config, CONSUMER, ids[0])?],
            (true, Shape::PerBatch) => sqlite::record_batch(&tx, config, CONSUMER, &ids)?,
        };
        {
            let mut stmt = tx.prepare_cached(&effect)?;
            for (d, receipt) in chunk.iter().zip(receipts) {
                if receipt.is_new() {
                    stmt.execute((d.id.hyphenated().to_string(), d.order, 1000 + d.order))?;
                }
            }
        }
        tx.commit()?;
    }
    Ok(start.elapsed())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let settings = match parse_args() {
        Ok(s) => s,
        Err(message) => {
            eprintln!("inbox bench: {message}");
            std::process::exit(2);
        }
    };
    let config = InboxConfig::builder().table(INBOX_TABLE).build()?;
    let dir = tempfile::tempdir()?;
    let mut stores = Vec::new();
    for name in &settings.stores {
        stores.push(match name.as_str() {
            "postgres" => Store::Postgres(
                PgPool::connect(&env_or(
                    "OUTBOX_TEST_POSTGRES_URL",
                    "postgres://postgres@127.0.0.1:5432/test",
                ))
                .await?,
            ),
            "mysql" => Store::Mysql(
                MySqlPool::connect(&env_or(
                    "OUTBOX_TEST_MYSQL_URL",
                    "mysql://root@127.0.0.1:3306/test",
                ))
                .await?,
            ),
            _ => Store::Sqlite(dir.path().join("inbox-bench.db")),
        });
    }
    for store in &stores {
        prepare(store, &config).await?;
    }
    let load_start = load_average();
    println!(
        "inbox bench: rounds={} messages={} batch={} stores={}; load average (1 min) at start: {}",
        settings.rounds,
        settings.messages,
        settings.batch,
        settings.stores.join(","),
        load_start.map_or("unknown".to_owned(), |l| format!("{l:.2}")),
    );
    let shapes = [Shape::PerMessage, Shape::PerBatch];
    let mut rates: HashMap<(&'static str, Shape, bool), Vec<f64>> = HashMap::new();
    for round in 0..settings.rounds {
        for store in &stores {
            for (s, &shape) in shapes.iter().enumerate() {
                let order = if (round + s) % 2 == 0 {
                    [true, false]
                } else {
                    [false, true]
                };
                for inbox in order {
                    empty(store).await?;
                    let work = deliveries(settings.messages);
                    let took = run(store, &config, shape, inbox, settings.batch, &work).await?;
                    let (effects, marks) = counts(store).await?;
                    let expected_marks = if inbox { settings.messages as i64 } else { 0 };
                    if effects != settings.messages as i64 || marks != expected_marks {
                        return Err(format!(
                            "{} {} inbox={inbox}: {effects} effects and {marks} marks after {} \
                             deliveries (expected {} and {expected_marks})",
                            store.name(),
                            shape.label(settings.batch),
                            settings.messages,
                            settings.messages
                        )
                        .into());
                    }
                    let rate = settings.messages as f64 / took.as_secs_f64();
                    println!(
                        "round {} {:<8} {:<18} {:<13} {:>8.2} s {:>9} msg/s",
                        round + 1,
                        store.name(),
                        shape.label(settings.batch),
                        if inbox { "with inbox" } else { "without" },
                        took.as_secs_f64(),
                        thousands(rate),
                    );
                    rates
                        .entry((store.name(), shape, inbox))
                        .or_default()
                        .push(rate);
                }
            }
        }
    }
    for store in &stores {
        empty(store).await?;
    }
    let load_end = load_average();
    println!();
    println!(
        "| store | transaction | without inbox (msg/s) | with inbox (msg/s) | with / without | inbox's cost |"
    );
    println!("|---|---|---|---|---|---|");
    for store in &stores {
        for shape in shapes {
            let get = |inbox| {
                rates
                    .get(&(store.name(), shape, inbox))
                    .and_then(|v| median(v))
                    .unwrap_or(f64::NAN)
            };
            let (without, with) = (get(false), get(true));
            let ratio = with / without;
            println!(
                "| {} | {} | {} | {} | {:.2} | {:.0}% |",
                store.name(),
                shape.label(settings.batch),
                thousands(without),
                thousands(with),
                ratio,
                (1.0 - ratio) * 100.0
            );
        }
    }
    println!();
    println!(
        "Medians of {} interleaved rounds of {} messages; load average (1 min) {} at start, {} at end.",
        settings.rounds,
        settings.messages,
        load_start.map_or("unknown".to_owned(), |l| format!("{l:.2}")),
        load_end.map_or("unknown".to_owned(), |l| format!("{l:.2}")),
    );
    Ok(())
}
