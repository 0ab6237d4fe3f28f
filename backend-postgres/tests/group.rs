//! Postgres relay groups pass the conformance suite's group check: the tables and the renewal
//! function `migrate` creates, on the database's clock (moved by shifting the stored times).

use std::time::Duration;

use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::group::GroupHarness;
use outbox_traits::{async_trait, Error, RelayGroupStore};

struct Harness {
    store: PostgresStore,
    schema: String,
}

#[async_trait]
impl GroupHarness for Harness {
    fn groups(&self) -> &dyn RelayGroupStore {
        &self.store
    }

    async fn advance(&self, by: Duration) -> Result<(), Error> {
        let us = i64::try_from(by.as_micros()).map_err(|_| Error::invalid_input("too long"))?;
        for sql in [
            "UPDATE \"{s}\".\"outbox_group_members\" SET \
             renewed_at = renewed_at - $1::bigint * interval '1 microsecond', \
             lease_until = lease_until - $1::bigint * interval '1 microsecond'",
            "UPDATE \"{s}\".\"outbox_group_shards\" SET \
             lease_until = lease_until - $1::bigint * interval '1 microsecond'",
        ] {
            sqlx::query(&sql.replace("{s}", &self.schema))
                .bind(us)
                .execute(self.store.pool())
                .await
                .map_err(|e| Error::permanent(e.to_string(), None))?;
        }
        Ok(())
    }

    async fn cleanup(&self) -> Result<(), Error> {
        sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(self.store.pool())
            .await
            .map(drop)
            .map_err(|e| Error::permanent(e.to_string(), None))
    }
}

impl Harness {
    /// A store on a fresh schema of the test server, migrated; `None` when its URL is unset.
    async fn from_env() -> Option<Self> {
        let url = service_url("OUTBOX_TEST_POSTGRES_URL")?;
        let schema = format!("group_{}", uuid::Uuid::new_v4().simple());
        let config = PostgresConfig::builder()
            .schema(schema.clone())
            .build()
            .unwrap();
        let store = PostgresStore::connect(&url, config).await.unwrap();
        store.migrate().await.unwrap();
        Some(Self { store, schema })
    }
}

outbox_conformance_tests::group_suite!(optional: Harness::from_env().await);
