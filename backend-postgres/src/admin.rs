//! The operator's side of the store ([`OutboxAdmin`]): dead letters, purge, counts.

use std::time::Duration;

use outbox_sql_support::admin::{dead_message, purge_age, RequeueCheck};
use outbox_sql_support::limits::micros;
use outbox_sql_support::row::counts;
use outbox_traits::{async_trait, Counts, DeadMessage, Error, OutboxAdmin};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

use crate::row::{decode, Lenient};
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
                let last_error = row.try_get("last_error").map_err(self.err("list_dead"))?;
                Ok(dead_message(decode(row, table)?, &Lenient(row), last_error))
            })
            .collect()
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let check = sqlx::query(&self.config().sql().requeue_check).bind(ids);
        self.check_requeue(check).await?;
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

    async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let check = sqlx::query(&self.config().sql().requeue_check_seqs).bind(seqs);
        self.check_requeue(check).await?;
        self.by_seq(&self.config().sql().requeue_seqs, seqs, "requeue")
            .await
    }

    async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        self.by_seq(&self.config().sql().discard_seqs, seqs, "discard")
            .await
    }

    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
        outbox_traits::validate_purge_batch(batch)?;
        // Nothing was published more than a century ago.
        let Some(age_us) = purge_age(older_than, micros) else {
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

impl PostgresStore {
    /// Refuse a requeue of dead rows that still cannot be relayed: the quarantined rows among
    /// those listed (`check` is `requeue_check` or `requeue_check_seqs` with its list bound)
    /// must decode now.
    async fn check_requeue(
        &self,
        check: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<(), Error> {
        let rows: Vec<PgRow> = check
            .fetch_all(self.pool())
            .await
            .map_err(self.err("requeue"))?;
        let table = self.config().qualified_table();
        let mut check = RequeueCheck::default();
        for row in &rows {
            check.row(decode(row, table)?, None);
        }
        check.finish(table)
    }

    /// Run `statement` on the dead rows among `seqs`.
    async fn by_seq(&self, statement: &str, seqs: &[i64], what: &str) -> Result<u64, Error> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(statement)
            .bind(seqs)
            .execute(self.pool())
            .await
            .map_err(self.err(what))?;
        Ok(done.rows_affected())
    }
}
