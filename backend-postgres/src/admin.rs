//! The operator's side of the store ([`OutboxAdmin`]): dead letters, purge, counts.

use std::time::Duration;

use outbox_sql_support::admin::{purge_age, LenientRow};
use outbox_sql_support::limits::micros;
use outbox_sql_support::quarantine::Poison;
use outbox_sql_support::sqlx_admin::{Admin, AdminStatement, SqlxAdmin};
use outbox_traits::{async_trait, Counts, DeadMessage, Error, Message, OutboxAdmin};
use sqlx::postgres::{PgQueryResult, PgRow};
use sqlx::{Pool, Postgres, Row};
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
        self.ensure_shape().await?;
        Admin(self).list_dead(after_seq, limit).await
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        self.ensure_shape().await?;
        Admin(self).requeue(ids).await
    }

    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
        self.ensure_shape().await?;
        Admin(self).discard(ids).await
    }

    async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        self.ensure_shape().await?;
        Admin(self).requeue_seqs(seqs).await
    }

    async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        self.ensure_shape().await?;
        Admin(self).discard_seqs(seqs).await
    }

    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
        outbox_traits::validate_purge_batch(batch)?;
        // Nothing was published more than a century ago.
        let Some(age_us) = purge_age(older_than, micros) else {
            return Ok(0);
        };
        let sql = self.checked_sql().await?;
        if sql.partitioned.is_some() {
            let batch = i64::try_from(batch).unwrap_or(i64::MAX);
            return crate::partition::purge(self, age_us, batch).await;
        }
        let done = sqlx::query(&sql.purge)
            .bind(age_us)
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(self.pool())
            .await
            .map_err(self.err("purge_published"))?;
        Ok(done.rows_affected())
    }

    async fn counts(&self) -> Result<Counts, Error> {
        self.ensure_shape().await?;
        Admin(self).counts().await
    }

    async fn status(&self, blocked_limit: usize) -> Result<outbox_traits::StoreStatus, Error> {
        crate::status::status(self, blocked_limit).await
    }

    async fn backlog(&self) -> Result<outbox_traits::Backlog, Error> {
        crate::status::backlog(self).await
    }

    async fn ping(&self) -> Result<(), Error> {
        crate::status::ping(self).await
    }
}

/// Postgres's side of the shared admin flows: lists bound as arrays, ids stored as UUIDs.
impl SqlxAdmin for PostgresStore {
    type DB = Postgres;
    type Count = i64;
    type Ids = Vec<Uuid>;
    type Seqs = Vec<i64>;

    fn pool(&self) -> &Pool<Postgres> {
        self.pool()
    }

    fn table(&self) -> &str {
        self.config().qualified_table()
    }

    fn statement(&self, which: AdminStatement) -> &str {
        // Every flow of `Admin` runs behind `ensure_shape` (the `OutboxAdmin` impl above).
        let sql = self.sql();
        match which {
            AdminStatement::ListDead => &sql.list_dead,
            AdminStatement::RequeueCheck => &sql.requeue_check,
            AdminStatement::RequeueCheckSeqs => &sql.requeue_check_seqs,
            AdminStatement::Requeue => &sql.requeue,
            AdminStatement::RequeueSeqs => &sql.requeue_seqs,
            AdminStatement::Discard => &sql.discard,
            AdminStatement::DiscardSeqs => &sql.discard_seqs,
            AdminStatement::Counts => &sql.counts,
        }
    }

    fn map_err(&self, err: sqlx::Error, op: &str) -> Error {
        self.err(op)(err)
    }

    fn count(n: usize) -> i64 {
        i64::try_from(n).unwrap_or(i64::MAX)
    }

    fn ids(ids: &[Uuid]) -> Vec<Uuid> {
        ids.to_vec()
    }

    fn seqs(seqs: &[i64]) -> Vec<i64> {
        seqs.to_vec()
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }

    fn decode(&self, row: &PgRow) -> Result<Result<Message, Poison>, Error> {
        decode(row, self.config().qualified_table())
    }

    fn last_error(&self, row: &PgRow) -> Result<String, Error> {
        row.try_get("last_error").map_err(self.err("list_dead"))
    }

    fn stored_id(_: &PgRow) -> Option<String> {
        // A UUID column holds no case.
        None
    }

    fn lenient(row: &PgRow) -> impl LenientRow + '_ {
        Lenient(row)
    }
}
