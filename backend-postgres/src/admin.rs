//! The operator's side of the store ([`OutboxAdmin`]): dead letters, purge, counts.

use std::time::Duration;

use outbox_sqlx_support::row::{counts, micros};
use outbox_traits::{async_trait, Counts, DeadMessage, Error, OutboxAdmin};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

use crate::row::message;
use crate::store::PostgresStore;

#[async_trait]
impl OutboxAdmin for PostgresStore {
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows: Vec<PgRow> = sqlx::query(&self.config().sql().list_dead)
            .bind(after_seq.unwrap_or(i64::MIN))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(self.err("list_dead"))?;
        let table = self.config().qualified_table();
        rows.iter()
            .map(|row| {
                Ok(DeadMessage {
                    message: message(row, table)?,
                    last_error: row.try_get("last_error").map_err(self.err("list_dead"))?,
                })
            })
            .collect()
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.config().sql().requeue)
            .bind(ids)
            .execute(self.pool())
            .await
            .map_err(self.err("requeue"))?;
        Ok(done.rows_affected())
    }

    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.config().sql().discard)
            .bind(ids)
            .execute(self.pool())
            .await
            .map_err(self.err("discard"))?;
        Ok(done.rows_affected())
    }

    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
        outbox_traits::validate_purge_batch(batch)?;
        // Nothing was published more than a century ago.
        let Ok(age_us) = micros("purge age", older_than) else {
            return Ok(0);
        };
        let done = sqlx::query(&self.config().sql().purge)
            .bind(age_us)
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(self.pool())
            .await
            .map_err(self.err("purge_published"))?;
        Ok(done.rows_affected())
    }

    async fn counts(&self) -> Result<Counts, Error> {
        let row: PgRow = sqlx::query(&self.config().sql().counts)
            .fetch_one(self.pool())
            .await
            .map_err(self.err("counts"))?;
        counts(&row, self.err("counts"))
    }

    async fn status(&self, blocked_limit: usize) -> Result<outbox_traits::StoreStatus, Error> {
        crate::status::status(self, blocked_limit).await
    }

    async fn ping(&self) -> Result<(), Error> {
        crate::status::ping(self).await
    }
}
