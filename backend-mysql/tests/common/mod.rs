//! Test support: a fresh table per test on the server named by `OUTBOX_TEST_MYSQL_URL`.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::time::Duration;

use outbox_backend_mysql::{enqueue_batch, MysqlConfig, MysqlConfigBuilder, MysqlStore};
use outbox_conformance_tests::env::service_url;
use outbox_traits::{Claim, ClaimRequest, HeadPolicy, NewMessage, OutboxStore};
use serde_json::json;
use sqlx::MySqlPool;

pub const URL_VAR: &str = "OUTBOX_TEST_MYSQL_URL";

/// One test's table and store.
pub struct Db {
    pub url: String,
    pub store: MysqlStore,
    pub config: MysqlConfig,
}

/// A random table name, so tests run in parallel in one database without seeing each other.
pub fn random_table() -> String {
    format!("outbox_test_{:016x}", rand::random::<u64>())
}

/// A migrated store on a fresh table, or `None` (test skipped) when no server is configured.
pub async fn db() -> Option<Db> {
    db_with(|b| b).await
}

/// Like [`db`], with the config builder adjusted by `adjust`.
pub async fn db_with(adjust: impl FnOnce(MysqlConfigBuilder) -> MysqlConfigBuilder) -> Option<Db> {
    let url = service_url(URL_VAR)?;
    let config = adjust(MysqlConfig::builder().table(random_table()))
        .build()
        .unwrap();
    let store = MysqlStore::connect(&url, config.clone()).await.unwrap();
    store.migrate().await.unwrap();
    Some(Db { url, store, config })
}

impl Db {
    pub fn pool(&self) -> &MySqlPool {
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
        advance(self.pool(), self.table(), by).await.unwrap();
    }

    /// The state of message `id`: its state column, or `leased` for a pending row with a lease
    /// token (a leased row stays `pending`; `''` or NULL is no token).
    pub async fn state(&self, id: uuid::Uuid) -> String {
        sqlx::query_scalar(&format!(
            "SELECT CAST(IF(state = 'pending' AND COALESCE(lease_token, '') <> '', 'leased', state)
                         AS CHAR CHARACTER SET utf8mb4)
             FROM {} WHERE id = ?",
            self.table()
        ))
        .bind(id.to_string())
        .fetch_one(self.pool())
        .await
        .unwrap()
    }

    /// Drop the table and its key-lock table (best effort: a failed test leaves them for
    /// inspection).
    pub async fn drop(self) {
        let _ = sqlx::raw_sql(&self.config.drop_sql())
            .execute(self.store.pool())
            .await;
        self.store.pool().close().await;
    }
}

/// Shift every stored time of `table` back by `by`: to the store, `by` has passed.
///
/// READ COMMITTED, as the store's own transactions: the update then skips rows that open
/// transactions are inserting (they are not there yet, as under Postgres's MVCC) instead of
/// waiting for those transactions to end.
pub async fn advance(pool: &MySqlPool, table: &str, by: Duration) -> Result<(), sqlx::Error> {
    let micros = i64::try_from(by.as_micros()).expect("advance: duration too long");
    let mut tx = pool
        .begin_with("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .await?;
    // Checks skipped, as for the relay's own updates: MariaDB checks every CHECK on every
    // UPDATE, and a row written past them (a raw row the relay quarantined) would fail it.
    sqlx::query(&format!(
        "SET STATEMENT check_constraint_checks = 0 FOR
         UPDATE {table} SET available_at = available_at - INTERVAL ? MICROSECOND,
                            lease_until = lease_until - INTERVAL ? MICROSECOND,
                            created_at = created_at - INTERVAL ? MICROSECOND,
                            published_at = published_at - INTERVAL ? MICROSECOND"
    ))
    .bind(micros)
    .bind(micros)
    .bind(micros)
    .bind(micros)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
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

    use outbox_backend_mysql::{enqueue_batch, MysqlConfig, MysqlStore};
    use outbox_conformance_tests::env::service_url;
    use outbox_conformance_tests::{Harness, HarnessCapabilities, HarnessStore, HarnessTx, RawRow};
    use outbox_traits::chrono::{DateTime, NaiveDateTime, Utc};
    use outbox_traits::{async_trait, Error, NewMessage, OutboxAdmin, OutboxStore};
    use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
    use sqlx::{MySql, Transaction};
    use tokio::sync::OnceCell;

    use super::{random_table, URL_VAR};

    /// Each fresh store is a new table with a random name in one database; business transactions,
    /// admin calls and time control share one pool per harness; each relay handle gets a pool of
    /// one connection of its own, so dropping it (a simulated crash) closes that connection.
    pub struct MysqlHarness {
        options: MySqlConnectOptions,
        /// Shared by every store of this test: a fresh store is a new table, not new connections.
        pool: OnceCell<MySqlPool>,
        /// Stores delete messages as they are published (`delete_published`).
        delete_published: bool,
        /// The server's clock is days away from the host's (`HarnessCapabilities::skewed_clock`).
        skewed_clock: bool,
        /// Stores serialise the writers of a key (`lock_keys`, `HarnessCapabilities::key_locks`).
        lock_keys: bool,
        /// The table layout named (`unpublished_table`); `None`: the default.
        unpublished_table: Option<bool>,
    }

    impl MysqlHarness {
        /// Stores in the database `url` names.
        pub fn new(url: &str) -> Self {
            Self {
                options: MySqlConnectOptions::from_str(url).expect("a MySQL URL"),
                pool: OnceCell::new(),
                delete_published: false,
                skewed_clock: false,
                lock_keys: false,
                unpublished_table: None,
            }
        }

        /// Stores whose tables have their own claim indexes (`unpublished_table(false)`),
        /// the layout of tables made before the unpublished table became the default.
        pub fn with_claim_indexes(self) -> Self {
            Self {
                unpublished_table: Some(false),
                ..self
            }
        }

        /// Stores in the database named by `OUTBOX_TEST_MYSQL_URL`.
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
    impl Harness for MysqlHarness {
        fn name(&self) -> String {
            let mut name = String::from("mysql");
            if self.delete_published {
                name.push_str(", deleting published");
            }
            if self.skewed_clock {
                name.push_str(", database clock skewed from the host's");
            }
            if self.lock_keys {
                name.push_str(", key locks");
            }
            if self.unpublished_table == Some(false) {
                name.push_str(", claim indexes in the outbox table");
            }
            name
        }

        async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
            let shared = self
                .pool
                .get_or_init(|| async { pool(&self.options, 8) })
                .await
                .clone();
            let mut config = MysqlConfig::builder()
                .table(random_table())
                .delete_published(self.delete_published)
                .lock_keys(self.lock_keys);
            if let Some(on) = self.unpublished_table {
                config = config.unpublished_table(on);
            }
            let config = config.build()?;
            let store = MysqlStore::new(shared, config);
            store.migrate().await?;
            if self.lock_keys {
                // The keys the suite's concurrent writers use get their key-lock rows first,
                // as in a table in use (a row stays for every key ever locked). Without its row,
                // a key's lock is a new row: if its first writer rolls back while a second
                // waits, InnoDB hands the waiter's lock on to the gap after it, and writers of
                // other new keys in that gap then wait for the waiter (at any isolation level),
                // which the model reports as writers of different keys waiting for each other.
                let sql = format!(
                    "INSERT IGNORE INTO {} (partition_key) VALUES ('k'), ('k0'), ('k1'), ('k2')",
                    store.config().key_locks_table()
                );
                sqlx::query(&sql).execute(store.pool()).await.map_err(err)?;
            }
            Ok(Box::new(MysqlHarnessStore {
                options: self.options.clone(),
                store,
                skewed_clock: self.skewed_clock,
            }))
        }
    }

    struct MysqlHarnessStore {
        options: MySqlConnectOptions,
        store: MysqlStore,
        skewed_clock: bool,
    }

    #[async_trait]
    impl HarnessStore for MysqlHarnessStore {
        fn capabilities(&self) -> HarnessCapabilities {
            HarnessCapabilities::new(OutboxStore::capabilities(&self.store))
                .with_skewed_clock(self.skewed_clock)
                .with_key_locks(self.store.config().lock_keys())
                .with_raw_rows(true, true, true)
        }

        async fn insert_raw(&self, rows: &[RawRow], checked: bool) -> Result<(), Error> {
            insert_raw(&self.store, rows, checked).await
        }

        /// A store on its own connection: dropping it closes the connection and, as in a real
        /// crash, leaves its leases to expire.
        async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error> {
            Ok(Arc::new(MysqlStore::new(
                pool(&self.options, 1),
                self.store.config().clone(),
            )))
        }

        async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error> {
            Ok(Arc::new(self.store.clone()))
        }

        async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error> {
            let tx = self.store.pool().begin().await.map_err(err)?;
            Ok(Box::new(MysqlHarnessTx {
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

    struct MysqlHarnessTx {
        tx: Transaction<'static, MySql>,
        config: MysqlConfig,
    }

    #[async_trait]
    impl HarnessTx for MysqlHarnessTx {
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
    pub fn pool(options: &MySqlConnectOptions, max: u32) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy_with(options.clone())
    }

    /// A harness statement failed.
    pub fn err(e: impl std::fmt::Display) -> Error {
        Error::transient(format!("harness: {e}"), None)
    }

    /// Insert `rows` as a SQL writer would: one plain `INSERT` per row of the columns given, in
    /// one transaction; unchecked, with `check_constraint_checks = 0` (as into a table made
    /// before the checks).
    pub async fn insert_raw(
        store: &MysqlStore,
        rows: &[RawRow],
        checked: bool,
    ) -> Result<(), Error> {
        let table = store.config().qualified_table();
        let prefix = if checked {
            ""
        } else {
            "SET STATEMENT check_constraint_checks = 0 FOR "
        };
        let mut tx = store.pool().begin().await.map_err(err)?;
        for row in rows {
            let mut columns = vec!["aggregatetype", "aggregateid", "type", "payload"];
            let mut values = vec![
                row.aggregate_type.as_str(),
                row.aggregate_id.as_str(),
                row.event_type.as_str(),
                row.payload.as_str(),
            ];
            for (column, value) in [
                ("id", &row.id),
                ("partition_key", &row.partition_key),
                ("headers", &row.headers),
            ] {
                if let Some(value) = value {
                    columns.push(column);
                    values.push(value);
                }
            }
            let sql = format!(
                "{prefix}INSERT INTO {table} ({}) VALUES ({})",
                columns.join(", "),
                vec!["?"; values.len()].join(", ")
            );
            let mut query = sqlx::query(&sql);
            for value in values {
                query = query.bind(value);
            }
            query.execute(&mut *tx).await.map_err(err)?;
        }
        tx.commit().await.map_err(err)
    }

    /// Shift every stored time of `store`'s table back by `by`: to the store, `by` has passed.
    pub async fn advance_time(store: &MysqlStore, by: Duration) -> Result<(), Error> {
        super::advance(store.pool(), store.config().qualified_table(), by)
            .await
            .map_err(err)
    }

    /// The database's clock.
    pub async fn now(store: &MysqlStore) -> Result<DateTime<Utc>, Error> {
        let now: NaiveDateTime = sqlx::query_scalar("SELECT UTC_TIMESTAMP(6)")
            .fetch_one(store.pool())
            .await
            .map_err(err)?;
        Ok(now.and_utc())
    }

    /// Drop `store`'s table, its key-lock table and its relay-group objects (its pool stays
    /// open: the conformance harness shares one).
    pub async fn teardown(store: &MysqlStore) -> Result<(), Error> {
        sqlx::raw_sql(&store.config().drop_sql())
            .execute(store.pool())
            .await
            .map_err(err)?;
        Ok(())
    }
}
