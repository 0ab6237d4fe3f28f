//! The quickstart: sample orders and their outbox messages written to a SQLite file in one
//! transaction each, then relayed to a `stdout://`-style publisher by the real engine.
//!
//! `main.rs` runs it on standard output; the tests run it into a buffer and check every line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use outbox::relay::{Relay, RelayConfig, RelayStats};
use outbox::sqlite::{migrate, open_connection, SqliteConfig, SqliteStore};
use outbox::{Counts, Error, NewMessage, OutboxAdmin, StdoutPublisher};
use rusqlite::TransactionBehavior;

/// Customers whose orders the quickstart places; each customer's events stay in order.
pub const CUSTOMERS: [&str; 4] = ["alice", "bob", "carol", "dave"];

/// What one run did.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Orders committed together with their event.
    pub committed: usize,
    /// Orders whose transaction was rolled back: their events must never appear.
    pub rolled_back: usize,
    /// What the relay did.
    pub stats: RelayStats,
    /// The store's counts after the relay went idle.
    pub counts: Counts,
    /// Wall-clock time of the relay run, in milliseconds.
    pub relay_millis: u128,
}

/// Write `orders` orders (and every fifth one rolled back) into the SQLite file at `path`, then
/// relay their events to `out`, one JSON line each.
pub async fn run(
    path: &Path,
    orders: usize,
    out: impl Write + Send + 'static,
) -> Result<Summary, Error> {
    let config = SqliteConfig::default();
    let written = write_orders(path, &config, orders)?;

    let store = SqliteStore::open(path, config).await?;
    store.migrate().await?;
    let store = Arc::new(store);
    let relay = Relay::new(
        store.clone(),
        Arc::new(StdoutPublisher::to_writer(out)),
        RelayConfig::default(),
    )?;
    let started = Instant::now();
    let stats = relay.run_until_idle().await?;
    let relay_millis = started.elapsed().as_millis();
    let counts = store.counts().await?;
    Ok(Summary {
        committed: written.committed.len(),
        rolled_back: written.rolled_back.len(),
        stats,
        counts,
        relay_millis,
    })
}

/// Read `[FILE [ORDERS]]` from the command line (defaults: `default_file`, 20 orders) and
/// remove FILE and its WAL files, so that a run's summary describes that run only.
///
/// # Errors
/// A message for the user when ORDERS is not a whole number.
pub fn fresh_file_from_args(default_file: &str) -> Result<(PathBuf, usize), String> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().unwrap_or_else(|| default_file.into()));
    let orders = match args.next() {
        None => 20,
        Some(n) => n
            .parse::<usize>()
            .map_err(|e| format!("ORDERS must be a whole number: {e}"))?,
    };
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        // Absent is fine: there is nothing to start over from.
        let _ = std::fs::remove_file(file);
    }
    Ok((path, orders))
}

/// One `order.placed` event whose transaction committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedEvent {
    /// The outbox message id (consumers deduplicate on it).
    pub id: String,
    /// The partition key (the customer).
    pub key: String,
    /// The payload JSON text exactly as stored and published.
    pub payload: String,
}

/// What [`write_orders`] wrote.
#[derive(Debug, Clone, Default)]
pub struct Orders {
    /// Events whose order committed, in commit order.
    pub committed: Vec<CommittedEvent>,
    /// Ids of events whose transaction was rolled back: they must never be published.
    pub rolled_back: Vec<String>,
}

/// The service side: each order row and its `order.placed` event commit (or roll back)
/// together, in the SQLite file at `path`; every fifth order is rolled back.
pub fn write_orders(path: &Path, config: &SqliteConfig, orders: usize) -> Result<Orders, Error> {
    let sql = outbox::sqlite::sqlite_error;
    let mut conn = open_connection(path, config)?;
    migrate(&conn, config)?;
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS orders (
             id TEXT PRIMARY KEY, customer TEXT NOT NULL, total_cents INTEGER NOT NULL)",
    )
    .map_err(sql)?;
    let mut written = Orders::default();
    for n in 0..orders {
        let customer = CUSTOMERS[n % CUSTOMERS.len()];
        let order_id = format!("order-{}", n + 1);
        let total = 1_000 + 250 * n as i64;
        // IMMEDIATE: take the write lock up front, so a concurrent writer makes us wait
        // (busy_timeout) instead of failing half-way.
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql)?;
        tx.execute(
            "INSERT INTO orders (id, customer, total_cents) VALUES (?1, ?2, ?3)",
            (&order_id, customer, total),
        )
        .map_err(sql)?;
        let event = NewMessage::new(
            "order",
            order_id.as_str(),
            "order.placed",
            serde_json::json!({ "order": order_id, "customer": customer, "total_cents": total }),
        )
        .with_partition_key(customer);
        outbox::sqlite::enqueue(&tx, config, &event)?;
        if n % 5 == 4 {
            // A business rule rejects the order: the row and its event vanish together.
            tx.rollback().map_err(sql)?;
            written.rolled_back.push(event.id.to_string());
        } else {
            tx.commit().map_err(sql)?;
            written.committed.push(CommittedEvent {
                id: event.id.to_string(),
                key: customer.to_owned(),
                // The store keeps the payload as this JSON text and the relay publishes it as is.
                payload: event.payload.to_string(),
            });
        }
    }
    Ok(written)
}
