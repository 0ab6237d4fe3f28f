//! diesel-async on Postgres: each order row and its `order.placed` outbox message are written
//! in one diesel transaction (every fifth order is rolled back, row and message together), then
//! the relay, on the sqlx [`PostgresStore`], publishes the committed messages to a
//! `stdout://`-style publisher.
//!
//! `main.rs` runs it on standard output; `tests/run.rs` runs it into a buffer on the test server.

use std::io::Write;
use std::sync::Arc;

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::relay::{Relay, RelayConfig, RelayStats};
use outbox::{NewMessage, StdoutPublisher};

/// Any error of the example: diesel's, the outbox's or the relay's.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one run did.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Ids of the messages whose order committed, in commit order.
    pub committed: Vec<String>,
    /// Ids of the messages whose order was rolled back: they must never be published.
    pub rolled_back: Vec<String>,
    /// What the relay did.
    pub stats: RelayStats,
}

/// Place `orders` orders in the schema of `config` on the Postgres at `url` (creating the
/// outbox table and an `orders` table there), then relay their messages to `out`, one JSON
/// line each, until none is left.
pub async fn run(
    url: &str,
    config: PostgresConfig,
    orders: usize,
    out: impl Write + Send + 'static,
) -> Result<Summary, BoxError> {
    let store = PostgresStore::connect(url, config.clone()).await?;
    store.migrate().await?;

    let mut conn = AsyncPgConnection::establish(url).await?;
    let orders_table = format!("\"{}\".orders", config.schema());
    diesel::sql_query(format!(
        "CREATE TABLE IF NOT EXISTS {orders_table} (id text PRIMARY KEY, total_cents bigint NOT NULL)"
    ))
    .execute(&mut conn)
    .await?;

    let mut summary = Summary {
        committed: Vec::new(),
        rolled_back: Vec::new(),
        stats: RelayStats::default(),
    };
    for n in 0..orders {
        let order_id = format!("order-{}", n + 1);
        let total = 1_000 + 250 * n as i64;
        let event = NewMessage::new(
            "order",
            order_id.as_str(),
            "order.placed",
            serde_json::json!({ "order": order_id, "total_cents": total }),
        );
        // A business rule rejects every fifth order: its row and its message vanish together.
        let rejected = n % 5 == 4;
        let insert = format!("INSERT INTO {orders_table} (id, total_cents) VALUES ($1, $2)");
        let result = conn
            .transaction::<_, BoxError, _>(async |conn| {
                diesel::sql_query(insert)
                    .bind::<Text, _>(&order_id)
                    .bind::<BigInt, _>(total)
                    .execute(conn)
                    .await?;
                outbox::postgres::diesel::enqueue(conn, &config, &event).await?;
                if rejected {
                    return Err(diesel::result::Error::RollbackTransaction.into());
                }
                Ok(())
            })
            .await;
        match result {
            Ok(()) => summary.committed.push(event.id.to_string()),
            Err(_) if rejected => summary.rolled_back.push(event.id.to_string()),
            Err(err) => return Err(err),
        }
    }

    let relay = Relay::new(
        Arc::new(store),
        Arc::new(StdoutPublisher::to_writer(out)),
        RelayConfig::default(),
    )?;
    summary.stats = relay.run_until_idle().await?;
    Ok(summary)
}
