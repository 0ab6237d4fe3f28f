//! The operator side: dead letters, purge and counts.

use std::time::Duration;

use outbox_traits::{async_trait, Counts, DeadMessage, Error, OutboxAdmin};
use sqlx::mysql::{MySqlQueryResult, MySqlRow};
use sqlx::{MySql, Pool, Row};
use uuid::Uuid;

use outbox_sql_support::admin::{purge_age, LenientRow};
use outbox_sql_support::quarantine::Poison;
use outbox_sql_support::sqlx_admin::{Admin, AdminStatement, SqlxAdmin};
use outbox_traits::Message;

use crate::lease::id_list;
use crate::row::{decode, micros, text, Lenient};
use crate::store::MysqlStore;

#[async_trait]
impl OutboxAdmin for MysqlStore {
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error> {
        self.sql().await?;
        Admin(self).list_dead(after_seq, limit).await
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        self.sql().await?;
        Admin(self).requeue(ids).await
    }

    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
        self.sql().await?;
        Admin(self).discard(ids).await
    }

    async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        self.sql().await?;
        Admin(self).requeue_seqs(seqs).await
    }

    async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        self.sql().await?;
        Admin(self).discard_seqs(seqs).await
    }

    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
        outbox_traits::validate_purge_batch(batch)?;
        // The key-lock table grows by a row per key ever locked: each purge call also deletes
        // a batch of its rows (not counted: the count is of messages). Best effort: a purge
        // whose user may not touch that table (grants on the outbox table only) still purges
        // messages, and says once per process why the key locks stay.
        if let Err(e) = self.purge_key_locks(batch).await {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    error = %e,
                    "the key-lock table was not purged (messages still are); grant this user \
                     SELECT and DELETE on it to purge it"
                );
            });
        }
        // Nothing was published more than a century ago.
        let Some(age_us) = purge_age(older_than, micros) else {
            return Ok(0);
        };
        let seqs: Vec<i64> = sqlx::query_scalar(&self.sql().await?.purge_pick)
            .bind(age_us)
            .bind(u64::try_from(batch).unwrap_or(u64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(self.err("purge_published"))?;
        if seqs.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.sql().await?.purge)
            .bind(serde_json::to_string(&seqs).unwrap_or_default())
            .execute(self.pool())
            .await
            .map_err(self.err("purge_published"))?;
        Ok(done.rows_affected())
    }

    async fn counts(&self) -> Result<Counts, Error> {
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

/// Seqs as the JSON array the statements read.
fn seq_list(seqs: &[i64]) -> String {
    serde_json::to_string(seqs).unwrap_or_default()
}

impl MysqlStore {
    /// Delete up to `batch` rows of the key-lock table that no writer holds, in one short
    /// transaction; how many. A table without the key-lock table (migrated by a release
    /// before it) has none to delete.
    pub(crate) async fn purge_key_locks(&self, batch: usize) -> Result<u64, Error> {
        let sql = self.config().sql();
        let err = self.err("purge_published (key locks)");
        let mut tx = self
            .pool()
            .begin_with(crate::sql::BEGIN)
            .await
            .map_err(&err)?;
        let picked: Result<Vec<String>, sqlx::Error> =
            sqlx::query_scalar::<_, Vec<u8>>(&sql.key_locks_pick)
                .bind(u64::try_from(batch).unwrap_or(u64::MAX))
                .fetch_all(&mut *tx)
                .await
                .map(|keys| {
                    keys.into_iter()
                        .map(|k| String::from_utf8_lossy(&k).into_owned())
                        .collect()
                });
        let keys = match picked {
            Ok(keys) => keys,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42S02") => {
                return Ok(0);
            }
            Err(e) => return Err(err(e)),
        };
        if keys.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&sql.key_locks_purge)
            .bind(serde_json::to_string(&keys).unwrap_or_default())
            .execute(&mut *tx)
            .await
            .map_err(&err)?;
        tx.commit().await.map_err(&err)?;
        Ok(done.rows_affected())
    }
}

/// MariaDB's side of the shared admin flows: lists bound as JSON texts, ids stored as text.
impl SqlxAdmin for MysqlStore {
    type DB = MySql;
    type Count = u64;
    type Ids = String;
    type Seqs = String;

    fn pool(&self) -> &Pool<MySql> {
        self.pool()
    }

    fn table(&self) -> &str {
        self.config().qualified_table()
    }

    fn statement(&self, which: AdminStatement) -> &str {
        // The layout was found by the `OutboxAdmin` method that runs this flow.
        let sql = self.sql_found();
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

    fn follow_up(&self, which: AdminStatement) -> Option<&str> {
        let sql = self.sql_found();
        match which {
            AdminStatement::Requeue => sql.requeue_unpublished.as_deref(),
            AdminStatement::RequeueSeqs => sql.requeue_seqs_unpublished.as_deref(),
            _ => None,
        }
    }

    fn map_err(&self, err: sqlx::Error, op: &str) -> Error {
        self.err(op)(err)
    }

    fn count(n: usize) -> u64 {
        u64::try_from(n).unwrap_or(u64::MAX)
    }

    fn ids(ids: &[Uuid]) -> String {
        id_list(ids)
    }

    fn seqs(seqs: &[i64]) -> String {
        seq_list(seqs)
    }

    fn rows_affected(done: &MySqlQueryResult) -> u64 {
        done.rows_affected()
    }

    fn decode(&self, row: &MySqlRow) -> Result<Result<Message, Poison>, Error> {
        decode(row, self.config().qualified_table())
    }

    fn last_error(&self, row: &MySqlRow) -> Result<String, Error> {
        text(row, "last_error", self.config().qualified_table())
    }

    fn stored_id(row: &MySqlRow) -> Option<String> {
        // A row that decoded has an id that reads as text.
        row.try_get_unchecked::<String, _>("id").ok()
    }

    fn lenient(row: &MySqlRow) -> impl LenientRow + '_ {
        Lenient(row)
    }
}
