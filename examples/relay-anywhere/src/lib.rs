//! One outbox, any broker: sample orders and their outbox messages are written to a SQLite file
//! (one transaction each, some rolled back), then the real relay engine publishes them to the
//! broker that a URL names. Switching from NATS to Kafka to Redis (or stdout) changes only that
//! URL, which `main.rs` takes from the `OUTBOX_BROKER_URL` environment variable.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use outbox::relay::{Relay, RelayConfig, RelayStats};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{redact_url, Counts, Error, OutboxAdmin};

/// The environment variable `main` reads the broker URL from.
pub const BROKER_URL_VAR: &str = "OUTBOX_BROKER_URL";

/// The broker used when [`BROKER_URL_VAR`] is unset: JSON lines on standard output.
pub const DEFAULT_BROKER_URL: &str = "stdout://";

/// The orders are the quickstart's: same customers (the partition keys), same events, every
/// fifth order rolled back.
pub use outbox_quickstart::{write_orders, CommittedEvent, CUSTOMERS};

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
    let written = write_orders(db_path, &config, orders)?;

    let store = SqliteStore::open(db_path, config).await?;
    store.migrate().await?;
    let store = Arc::new(store);
    let relay = Relay::new(store.clone(), Arc::new(publisher), RelayConfig::default())?;
    let started = Instant::now();
    let stats = relay.run_until_idle().await?;
    let relay_millis = started.elapsed().as_millis();
    let counts = store.counts().await?;
    Ok(Summary {
        broker: redact_url(broker_url),
        committed: written.committed,
        rolled_back: written.rolled_back,
        stats,
        counts,
        relay_millis,
    })
}
