//! The operator side: dead letters, purge and counts.

use std::time::Duration;

use outbox_traits::{async_trait, Counts, DeadMessage, Error, OutboxAdmin};
use sqlx::mysql::MySqlRow;
use uuid::Uuid;

use outbox_sqlx_support::row::counts;

use crate::lease::id_list;
use crate::row::{message, micros, text};
use crate::store::MysqlStore;

#[async_trait]
impl OutboxAdmin for MysqlStore {
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows: Vec<MySqlRow> = sqlx::query(&self.config().sql().list_dead)
            .bind(after_seq.unwrap_or(i64::MIN))
            .bind(u64::try_from(limit).unwrap_or(u64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(self.err("list_dead"))?;
        let table = self.config().qualified_table();
        rows.iter()
            .map(|row| {
                Ok(DeadMessage {
                    message: message(row, table)?,
                    last_error: text(row, "last_error", table)?,
                })
            })
            .collect()
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.config().sql().requeue)
            .bind(id_list(ids))
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
            .bind(id_list(ids))
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
        let seqs: Vec<i64> = sqlx::query_scalar(&self.config().sql().purge_pick)
            .bind(age_us)
            .bind(u64::try_from(batch).unwrap_or(u64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(self.err("purge_published"))?;
        if seqs.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.config().sql().purge)
            .bind(serde_json::to_string(&seqs).unwrap_or_default())
            .execute(self.pool())
            .await
            .map_err(self.err("purge_published"))?;
        Ok(done.rows_affected())
    }

    async fn counts(&self) -> Result<Counts, Error> {
        let row: MySqlRow = sqlx::query(&self.config().sql().counts)
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
