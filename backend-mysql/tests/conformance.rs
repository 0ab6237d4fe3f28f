//! The shared conformance suite (checks and model properties) against the real MariaDB store,
//! keeping published rows (the default) and deleting them (`delete_published`).
//!
//! Each fresh store is a new table with a random name in the database of
//! `OUTBOX_TEST_MYSQL_URL`, dropped at teardown. Business transactions, admin calls and time
//! control share one pool per test; each relay handle gets a pool of one connection of its own,
//! so dropping it (a simulated crash) closes that connection.

mod common;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use common::harness::{self, err, pool};
use common::{random_table, URL_VAR};
use outbox_backend_mysql::{enqueue_batch, MysqlConfig, MysqlStore};
use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{async_trait, Error, NewMessage, OutboxAdmin, OutboxStore};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use sqlx::{MySql, Transaction};
use tokio::sync::OnceCell;

struct MysqlHarness {
    options: MySqlConnectOptions,
    /// Shared by every store of this test: a fresh store is a new table, not new connections.
    pool: OnceCell<MySqlPool>,
    /// Stores delete messages as they are published (`delete_published`).
    delete_published: bool,
}

impl MysqlHarness {
    fn from_env() -> Option<Self> {
        let url = service_url(URL_VAR)?;
        Some(Self {
            options: MySqlConnectOptions::from_str(&url).expect("OUTBOX_TEST_MYSQL_URL"),
            pool: OnceCell::new(),
            delete_published: false,
        })
    }

    fn deleting_published(self) -> Self {
        Self {
            delete_published: true,
            ..self
        }
    }
}

#[async_trait]
impl Harness for MysqlHarness {
    fn name(&self) -> String {
        if self.delete_published {
            "mysql, deleting published".into()
        } else {
            "mysql".into()
        }
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        let shared = self
            .pool
            .get_or_init(|| async { pool(&self.options, 8) })
            .await
            .clone();
        let config = MysqlConfig::builder()
            .table(random_table())
            .delete_published(self.delete_published)
            .build()?;
        let store = MysqlStore::new(shared, config);
        store.migrate().await?;
        Ok(Box::new(MysqlHarnessStore {
            options: self.options.clone(),
            store,
        }))
    }
}

struct MysqlHarnessStore {
    options: MySqlConnectOptions,
    store: MysqlStore,
}

#[async_trait]
impl HarnessStore for MysqlHarnessStore {
    fn capabilities(&self) -> HarnessCapabilities {
        HarnessCapabilities::new(OutboxStore::capabilities(&self.store))
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
        harness::advance_time(&self.store, by).await
    }

    async fn now(&self) -> Result<DateTime<Utc>, Error> {
        harness::now(&self.store).await
    }

    async fn teardown(self: Box<Self>) -> Result<(), Error> {
        harness::teardown(&self.store).await
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

outbox_conformance_tests::conformance_suite!(optional: MysqlHarness::from_env());

/// The same suite with `delete_published(true)`: completing deletes the row.
mod deleting_published {
    use super::MysqlHarness;

    outbox_conformance_tests::conformance_suite!(optional: MysqlHarness::from_env()
        .map(MysqlHarness::deleting_published));
}
