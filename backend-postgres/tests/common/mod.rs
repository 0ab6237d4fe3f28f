//! Test support: a fresh schema per test on the server named by `OUTBOX_TEST_POSTGRES_URL`.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::time::Duration;

use outbox_backend_postgres::{enqueue_batch, PostgresConfig, PostgresStore};
use outbox_conformance_tests::env::service_url;
use outbox_traits::{Claim, ClaimRequest, HeadPolicy, NewMessage, OutboxStore};
use serde_json::json;
use sqlx::PgPool;

pub const URL_VAR: &str = "OUTBOX_TEST_POSTGRES_URL";

/// One test's schema and store.
pub struct Db {
    pub url: String,
    pub store: PostgresStore,
    pub config: PostgresConfig,
    pub schema: String,
}

/// A random schema name, so tests run in parallel without seeing each other.
pub fn random_schema() -> String {
    format!("outbox_test_{:016x}", rand::random::<u64>())
}

/// A migrated store in a fresh schema, or `None` (test skipped) when no server is configured.
pub async fn db() -> Option<Db> {
    db_with(|b| b).await
}

/// Like [`db`], with the config builder adjusted by `adjust`.
pub async fn db_with(
    adjust: impl FnOnce(
        outbox_backend_postgres::PostgresConfigBuilder,
    ) -> outbox_backend_postgres::PostgresConfigBuilder,
) -> Option<Db> {
    let url = service_url(URL_VAR)?;
    let schema = random_schema();
    let config = adjust(PostgresConfig::builder().schema(&schema))
        .build()
        .unwrap();
    let store = PostgresStore::connect(&url, config.clone()).await.unwrap();
    store.migrate().await.unwrap();
    Some(Db {
        url,
        store,
        config,
        schema,
    })
}

impl Db {
    pub fn pool(&self) -> &PgPool {
        self.store.pool()
    }

    pub fn table(&self) -> &str {
        self.config.qualified_table()
    }

    /// Enqueue `messages` in one committed transaction.
    pub async fn enqueue(&self, messages: &[NewMessage]) {
        let mut tx = self.pool().begin().await.unwrap();
        enqueue_batch(&mut *tx, &self.config, messages)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    pub async fn claim(&self, limit: usize, head_policy: HeadPolicy) -> Claim {
        self.store
            .claim(&ClaimRequest {
                limit,
                lease: Duration::from_secs(30),
                head_policy,
            })
            .await
            .unwrap()
    }

    /// Move the database's view of time forward by `by`: shift every stored time back.
    pub async fn advance(&self, by: Duration) {
        let sql = format!(
            "UPDATE {} SET available_at = available_at - $1::bigint * interval '1 microsecond',
                           lease_until = lease_until - $1::bigint * interval '1 microsecond',
                           created_at = created_at - $1::bigint * interval '1 microsecond',
                           published_at = published_at - $1::bigint * interval '1 microsecond'",
            self.table()
        );
        sqlx::query(&sql)
            .bind(i64::try_from(by.as_micros()).unwrap())
            .execute(self.pool())
            .await
            .unwrap();
    }

    /// The state of message `id`: its state column, or `leased` for a pending row with a lease
    /// token (the store keeps a leased row `pending` so that claims are HOT updates).
    pub async fn state(&self, id: uuid::Uuid) -> String {
        sqlx::query_scalar(&format!(
            "SELECT CASE WHEN state = 'pending' AND lease_token IS NOT NULL THEN 'leased' \
                         ELSE state END
             FROM {} WHERE id = $1",
            self.table()
        ))
        .bind(id)
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// Drop the schema (best effort: a failed test leaves it for inspection).
    pub async fn drop(self) {
        let _ = sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(self.store.pool())
            .await;
        self.store.pool().close().await;
    }
}

/// A message of partition key `key` whose payload names it `name`.
pub fn msg(key: &str, name: &str) -> NewMessage {
    NewMessage::new("test", key, "test.event", json!({ "name": name }))
}

/// The payload names of a claim, in order.
pub fn names(claim: &Claim) -> Vec<String> {
    claim
        .messages
        .iter()
        .map(|m| {
            let v: serde_json::Value = serde_json::from_str(&m.payload).unwrap();
            v["name"].as_str().unwrap().to_owned()
        })
        .collect()
}

pub fn ids(claim: &Claim) -> Vec<uuid::Uuid> {
    claim.messages.iter().map(|m| m.id).collect()
}

/// The sqlx side of a conformance-suite harness store, shared by `conformance.rs` (business
/// transactions on sqlx) and `diesel.rs` (on diesel-async): pools, time control, teardown.
pub mod harness {
    use std::time::Duration;

    use outbox_backend_postgres::PostgresStore;
    use outbox_traits::chrono::{DateTime, Utc};
    use outbox_traits::Error;
    use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

    /// A lazy pool of at most `max` connections.
    pub fn pool(options: &PgConnectOptions, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy_with(options.clone())
    }

    /// A harness statement failed.
    pub fn err(e: impl std::fmt::Display) -> Error {
        Error::transient(format!("harness: {e}"), None)
    }

    /// Shift every stored time of `store`'s table back by `by`: to the store, `by` has passed.
    pub async fn advance_time(store: &PostgresStore, by: Duration) -> Result<(), Error> {
        let sql = format!(
            "UPDATE {} SET available_at = available_at - $1::bigint * interval '1 microsecond',
                           lease_until = lease_until - $1::bigint * interval '1 microsecond',
                           created_at = created_at - $1::bigint * interval '1 microsecond',
                           published_at = published_at - $1::bigint * interval '1 microsecond'",
            store.config().qualified_table()
        );
        let micros = i64::try_from(by.as_micros())
            .map_err(|_| Error::invalid_input("advance_time: duration too long"))?;
        sqlx::query(&sql)
            .bind(micros)
            .execute(store.pool())
            .await
            .map_err(err)?;
        Ok(())
    }

    /// The database's clock.
    pub async fn now(store: &PostgresStore) -> Result<DateTime<Utc>, Error> {
        sqlx::query_scalar("SELECT now()")
            .fetch_one(store.pool())
            .await
            .map_err(err)
    }

    /// Drop `store`'s schema and close its pool.
    pub async fn teardown(store: &PostgresStore) -> Result<(), Error> {
        let sql = format!("DROP SCHEMA \"{}\" CASCADE", store.config().schema());
        sqlx::query(&sql).execute(store.pool()).await.map_err(err)?;
        store.pool().close().await;
        Ok(())
    }
}
