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
                shard: None,
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
    use std::str::FromStr;
    use std::sync::Arc;
    use std::time::Duration;

    use outbox_backend_postgres::{enqueue_batch, PostgresConfig, PostgresStore};
    use outbox_conformance_tests::env::service_url;
    use outbox_conformance_tests::{Harness, HarnessCapabilities, HarnessStore, HarnessTx, RawRow};
    use outbox_traits::chrono::{DateTime, Utc};
    use outbox_traits::{async_trait, Error, NewMessage, OutboxAdmin, OutboxStore};
    use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
    use sqlx::{Postgres, Transaction};

    use super::{random_schema, URL_VAR};

    /// Each fresh store is a new schema on the server named by `OUTBOX_TEST_POSTGRES_URL`.
    pub struct PgHarness {
        options: PgConnectOptions,
        /// Stores delete messages as they are published (`delete_published`).
        delete_published: bool,
        /// The server's clock is days away from the host's (`HarnessCapabilities::skewed_clock`).
        skewed_clock: bool,
        /// Stores serialise the writers of a key (`lock_keys`, `HarnessCapabilities::key_locks`).
        lock_keys: bool,
        /// Tables partitioned by time (`partition_interval`).
        partition_interval: Option<Duration>,
        /// Tables laid out for cursor claims (`cursor_claims(true)`), or for partial indexes
        /// (`cursor_claims(false)`, the default here: the suite's full run and the mutation
        /// score are on that layout; `cursor.rs` runs it on the other).
        cursor_claims: bool,
    }

    impl PgHarness {
        /// Stores on the server `url` names.
        pub fn new(url: &str) -> Self {
            Self {
                options: PgConnectOptions::from_str(url).expect("a Postgres URL"),
                delete_published: false,
                skewed_clock: false,
                lock_keys: false,
                partition_interval: None,
                cursor_claims: false,
            }
        }

        /// Stores over a table laid out for cursor claims (`cursor_claims(true)`).
        pub fn cursor_claims(self) -> Self {
            Self {
                cursor_claims: true,
                ..self
            }
        }

        /// Stores over a table partitioned `interval` wide.
        pub fn partitioned(self, interval: Duration) -> Self {
            Self {
                partition_interval: Some(interval),
                ..self
            }
        }

        /// Stores on the server named by `OUTBOX_TEST_POSTGRES_URL`.
        pub fn from_env() -> Option<Self> {
            service_url(URL_VAR).map(|url| Self::new(&url))
        }

        /// Stores that delete messages as they are published.
        pub fn deleting_published(self) -> Self {
            Self {
                delete_published: true,
                ..self
            }
        }

        /// Declare the server's clock skewed from the host's.
        pub fn skewed_clock(self) -> Self {
            Self {
                skewed_clock: true,
                ..self
            }
        }

        /// Stores with key locks on (`lock_keys(true)`): a second writer of a key waits for
        /// the first transaction to end.
        pub fn locking_keys(self) -> Self {
            Self {
                lock_keys: true,
                ..self
            }
        }
    }

    #[async_trait]
    impl Harness for PgHarness {
        fn name(&self) -> String {
            let mut name = String::from("postgres");
            if self.delete_published {
                name.push_str(", deleting published");
            }
            if self.skewed_clock {
                name.push_str(", database clock skewed from the host's");
            }
            if self.lock_keys {
                name.push_str(", key locks");
            }
            if let Some(interval) = self.partition_interval {
                name.push_str(&format!(", partitioned by {interval:?}"));
            }
            // The layout is always named: unnamed, a new table's would follow delete_published.
            name.push_str(if self.cursor_claims {
                ", cursor claims"
            } else {
                ", partial-index layout"
            });
            name
        }

        async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
            let config = PostgresConfig::builder()
                .schema(random_schema())
                .table("outbox")
                .delete_published(self.delete_published)
                .lock_keys(self.lock_keys)
                .partition_interval(self.partition_interval)
                .cursor_claims(self.cursor_claims)
                .build()?;
            // Business transactions, admin calls and time control share one pool; each relay gets
            // its own (see `relay`).
            let store = PostgresStore::new(pool(&self.options, 8), config);
            store.migrate().await?;
            Ok(Box::new(PgHarnessStore {
                options: self.options.clone(),
                store,
                skewed_clock: self.skewed_clock,
            }))
        }
    }

    struct PgHarnessStore {
        options: PgConnectOptions,
        store: PostgresStore,
        skewed_clock: bool,
    }

    #[async_trait]
    impl HarnessStore for PgHarnessStore {
        fn capabilities(&self) -> HarnessCapabilities {
            HarnessCapabilities::new(OutboxStore::capabilities(&self.store))
                .with_skewed_clock(self.skewed_clock)
                .with_key_locks(self.store.config().lock_keys())
                // The id column is a `uuid`: no id that is not one can be written.
                .with_raw_rows(true, true, false)
        }

        async fn insert_raw(&self, rows: &[RawRow], checked: bool) -> Result<(), Error> {
            insert_raw(&self.store, rows, checked).await
        }

        /// A store on its own connection: dropping it closes the connection and, as in a real
        /// crash, leaves its leases to expire.
        async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error> {
            Ok(Arc::new(PostgresStore::new(
                pool(&self.options, 1),
                self.store.config().clone(),
            )))
        }

        async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error> {
            Ok(Arc::new(self.store.clone()))
        }

        async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error> {
            let tx = self.store.pool().begin().await.map_err(err)?;
            Ok(Box::new(PgHarnessTx {
                tx,
                config: self.store.config().clone(),
            }))
        }

        /// Shift every stored time back by `by`: to the store, `by` has passed.
        async fn advance_time(&self, by: Duration) -> Result<(), Error> {
            advance_time(&self.store, by).await
        }

        async fn now(&self) -> Result<DateTime<Utc>, Error> {
            now(&self.store).await
        }

        async fn teardown(self: Box<Self>) -> Result<(), Error> {
            teardown(&self.store).await
        }
    }

    struct PgHarnessTx {
        tx: Transaction<'static, Postgres>,
        config: PostgresConfig,
    }

    #[async_trait]
    impl HarnessTx for PgHarnessTx {
        async fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error> {
            enqueue_batch(&mut *self.tx, &self.config, messages).await
        }

        async fn commit(self: Box<Self>) -> Result<(), Error> {
            self.tx.commit().await.map_err(err)
        }

        async fn rollback(self: Box<Self>) -> Result<(), Error> {
            self.tx.rollback().await.map_err(err)
        }
    }

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

    /// Insert `rows` as a SQL writer would: one plain `INSERT` per row of the columns given,
    /// text cast by the database, in one transaction. Unchecked, the table's headers check is
    /// dropped first (this store's own schema), as in a table made before it.
    pub async fn insert_raw(
        store: &PostgresStore,
        rows: &[RawRow],
        checked: bool,
    ) -> Result<(), Error> {
        let table = store.config().qualified_table();
        let mut tx = store.pool().begin().await.map_err(err)?;
        if !checked {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT conname::text FROM pg_constraint WHERE conrelid = $1::regclass \
                 AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%headers%'",
            )
            .bind(table)
            .fetch_all(&mut *tx)
            .await
            .map_err(err)?;
            for name in names {
                sqlx::query(&format!("ALTER TABLE {table} DROP CONSTRAINT \"{name}\""))
                    .execute(&mut *tx)
                    .await
                    .map_err(err)?;
            }
        }
        for row in rows {
            let mut columns = vec!["aggregatetype", "aggregateid", "type", "payload"];
            let mut casts = vec!["", "", "", "::jsonb"];
            let mut values = vec![
                row.aggregate_type.as_str(),
                row.aggregate_id.as_str(),
                row.event_type.as_str(),
                row.payload.as_str(),
            ];
            for (column, cast, value) in [
                ("id", "::uuid", &row.id),
                ("partition_key", "", &row.partition_key),
                ("headers", "::jsonb", &row.headers),
            ] {
                if let Some(value) = value {
                    columns.push(column);
                    casts.push(cast);
                    values.push(value);
                }
            }
            let params: Vec<String> = casts
                .iter()
                .enumerate()
                .map(|(i, cast)| format!("${}::text{cast}", i + 1))
                .collect();
            let sql = format!(
                "INSERT INTO {table} ({}) VALUES ({})",
                columns.join(", "),
                params.join(", ")
            );
            let mut query = sqlx::query(&sql);
            for value in values {
                query = query.bind(value);
            }
            query.execute(&mut *tx).await.map_err(err)?;
        }
        tx.commit().await.map_err(err)
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
