//! The shared conformance suite (checks and model properties) against the real Postgres store,
//! keeping published rows (the default) and deleting them (`delete_published`).

mod common;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use common::harness::{self, err, pool};
use common::{random_schema, URL_VAR};
use outbox_backend_postgres::{enqueue_batch, PostgresConfig, PostgresStore};
use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{async_trait, Error, NewMessage, OutboxAdmin, OutboxStore};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Postgres, Transaction};

/// Each fresh store is a new schema on the server named by `OUTBOX_TEST_POSTGRES_URL`.
struct PgHarness {
    options: PgConnectOptions,
    /// Stores delete messages as they are published (`delete_published`).
    delete_published: bool,
}

impl PgHarness {
    fn from_env() -> Option<Self> {
        let url = service_url(URL_VAR)?;
        Some(Self {
            options: PgConnectOptions::from_str(&url).expect("OUTBOX_TEST_POSTGRES_URL"),
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
impl Harness for PgHarness {
    fn name(&self) -> String {
        if self.delete_published {
            "postgres, deleting published".into()
        } else {
            "postgres".into()
        }
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        let config = PostgresConfig::builder()
            .schema(random_schema())
            .table("outbox")
            .delete_published(self.delete_published)
            .build()?;
        // Business transactions, admin calls and time control share one pool; each relay gets
        // its own (see `relay`).
        let store = PostgresStore::new(pool(&self.options, 8), config);
        store.migrate().await?;
        Ok(Box::new(PgHarnessStore {
            options: self.options.clone(),
            store,
        }))
    }
}

struct PgHarnessStore {
    options: PgConnectOptions,
    store: PostgresStore,
}

#[async_trait]
impl HarnessStore for PgHarnessStore {
    fn capabilities(&self) -> HarnessCapabilities {
        HarnessCapabilities::new(OutboxStore::capabilities(&self.store))
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
        harness::advance_time(&self.store, by).await
    }

    async fn now(&self) -> Result<DateTime<Utc>, Error> {
        harness::now(&self.store).await
    }

    async fn teardown(self: Box<Self>) -> Result<(), Error> {
        harness::teardown(&self.store).await
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

outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env());

/// The same suite with `delete_published(true)`: completing deletes the row.
mod deleting_published {
    use super::PgHarness;

    outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env()
        .map(PgHarness::deleting_published));
}
