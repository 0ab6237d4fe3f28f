//! One outbox, any broker: sample orders and their outbox messages are written to a SQLite file
//! (one transaction each, some rolled back), then the real relay engine publishes them to the
//! broker that a URL names. Switching from NATS to Kafka to Redis (or stdout) changes only that
//! URL, which `main.rs` takes from the `OUTBOX_BROKER_URL` environment variable.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use outbox::relay::{Relay, RelayConfig, RelayStats};
use outbox::sqlite::{migrate, open_connection, SqliteConfig, SqliteStore};
use outbox::{redact_url, Counts, Error, NewMessage, OutboxAdmin};
use rusqlite::TransactionBehavior;

/// The environment variable `main` reads the broker URL from.
pub const BROKER_URL_VAR: &str = "OUTBOX_BROKER_URL";

/// The broker used when [`BROKER_URL_VAR`] is unset: JSON lines on standard output.
pub const DEFAULT_BROKER_URL: &str = "stdout://";

/// Customers whose orders the example places; each customer's events stay in order, because the
/// customer is the partition key.
pub const CUSTOMERS: [&str; 4] = ["alice", "bob", "carol", "dave"];

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

/// What one run did.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The broker, with any password hidden.
    pub broker: String,
    /// Events whose order committed, in commit order.
    pub committed: Vec<CommittedEvent>,
    /// Ids of events whose transaction was rolled back: they must never reach the broker.
    pub rolled_back: Vec<String>,
    /// What the relay did.
    pub stats: RelayStats,
    /// The store's counts after the relay went idle.
    pub counts: Counts,
    /// Wall-clock time of the relay run, in milliseconds.
    pub relay_millis: u128,
}

/// Connect to the broker `broker_url` names, write `orders` orders (every fifth one rolled
/// back) into the SQLite file at `db_path`, then relay their events until none is left.
///
/// The broker is connected first, so a bad URL or an unreachable broker fails before anything
/// is written.
///
/// # Errors
/// [`Error::InvalidInput`] for a URL the facade does not understand (the message lists the
/// choices), [`Error::Unavailable`] when the broker or the file cannot be reached, and the
/// store's errors otherwise.
pub async fn run(db_path: &Path, orders: usize, broker_url: &str) -> Result<Summary, Error> {
    let publisher = outbox::broker::connect(broker_url).await?;
    let config = SqliteConfig::default();
    let (committed, rolled_back) = write_orders(db_path, &config, orders)?;

    let store = Arc::new(SqliteStore::open(db_path, config).await?);
    let relay = Relay::new(store.clone(), Arc::new(publisher), RelayConfig::default())?;
    let started = Instant::now();
    let stats = relay.run_until_idle().await?;
    let relay_millis = started.elapsed().as_millis();
    let counts = store.counts().await?;
    Ok(Summary {
        broker: redact_url(broker_url),
        committed,
        rolled_back,
        stats,
        counts,
        relay_millis,
    })
}

/// The service side: each order row and its `order.placed` event commit (or roll back)
/// together. Returns the committed events and the rolled-back ids.
fn write_orders(
    path: &Path,
    config: &SqliteConfig,
    orders: usize,
) -> Result<(Vec<CommittedEvent>, Vec<String>), Error> {
    let sql = outbox::sqlite::sqlite_error;
    let mut conn = open_connection(path, config)?;
    migrate(&conn, config)?;
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS orders (
             id TEXT PRIMARY KEY, customer TEXT NOT NULL, total_cents INTEGER NOT NULL)",
    )
    .map_err(sql)?;
    let (mut committed, mut rolled_back) = (Vec::new(), Vec::new());
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
            rolled_back.push(event.id.to_string());
        } else {
            tx.commit().map_err(sql)?;
            committed.push(CommittedEvent {
                id: event.id.to_string(),
                key: customer.to_owned(),
                // The store keeps the payload as this JSON text and the relay publishes it as is.
                payload: event.payload.to_string(),
            });
        }
    }
    Ok((committed, rolled_back))
}
