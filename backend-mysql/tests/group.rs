//! MariaDB relay groups pass the conformance suite's group check: the tables and the renewal
//! procedure `migrate` creates, on the database's clock (moved by shifting the stored times).

mod common;

use std::time::Duration;

use common::{db, Db};
use outbox_conformance_tests::group::GroupHarness;
use outbox_traits::{async_trait, Error, RelayGroupStore};

struct Harness {
    db: Db,
}

#[async_trait]
impl GroupHarness for Harness {
    fn groups(&self) -> &dyn RelayGroupStore {
        &self.db.store
    }

    async fn advance(&self, by: Duration) -> Result<(), Error> {
        let us = i64::try_from(by.as_micros()).map_err(|_| Error::invalid_input("too long"))?;
        let table = self.db.config.table();
        for sql in [
            format!(
                "UPDATE `{table}_group_members` SET \
                 renewed_at = renewed_at - INTERVAL ? MICROSECOND, \
                 lease_until = lease_until - INTERVAL ? MICROSECOND"
            ),
            format!(
                "UPDATE `{table}_group_shards` SET \
                 lease_until = lease_until - INTERVAL ? MICROSECOND"
            ),
        ] {
            let binds = sql.matches('?').count();
            let mut query = sqlx::query(&sql);
            for _ in 0..binds {
                query = query.bind(us);
            }
            query
                .execute(self.db.pool())
                .await
                .map_err(|e| Error::permanent(e.to_string(), None))?;
        }
        Ok(())
    }

    async fn cleanup(&self) -> Result<(), Error> {
        sqlx::raw_sql(&self.db.config.drop_sql())
            .execute(self.db.pool())
            .await
            .map(drop)
            .map_err(|e| Error::permanent(e.to_string(), None))
    }
}

outbox_conformance_tests::group_suite!(optional: db().await.map(|db| Harness { db }));
