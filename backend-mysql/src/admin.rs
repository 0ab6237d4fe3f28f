//! The operator side: dead letters, purge and counts.

use std::time::Duration;

use outbox_traits::{async_trait, Counts, DeadMessage, Error, OutboxAdmin};
use sqlx::mysql::MySqlRow;
use sqlx::Row;
use uuid::Uuid;

use outbox_sql_support::admin::{dead_message, purge_age, RequeueCheck};
use outbox_sql_support::row::counts;

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
                let last_error = text(row, "last_error", table)?;
                Ok(dead_message(decode(row, table)?, &Lenient(row), last_error))
            })
            .collect()
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        self.check_requeue(&self.config().sql().requeue_check, id_list(ids))
            .await?;
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

    async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        if seqs.is_empty() {
            return Ok(0);
        }
        self.check_requeue(&self.config().sql().requeue_check_seqs, seq_list(seqs))
            .await?;
        self.by_seq(&self.config().sql().requeue_seqs, seqs, "requeue")
            .await
    }

    async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        self.by_seq(&self.config().sql().discard_seqs, seqs, "discard")
            .await
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

/// Seqs as the JSON array the statements read.
fn seq_list(seqs: &[i64]) -> String {
    serde_json::to_string(seqs).unwrap_or_default()
}

impl MysqlStore {
    /// Refuse a requeue of dead rows that still cannot be relayed: the quarantined rows among
    /// those listed (`statement` is `requeue_check` or `requeue_check_seqs`, bound to `list`)
    /// must decode now, with their id in the lower case completions match.
    async fn check_requeue(&self, statement: &str, list: String) -> Result<(), Error> {
        let rows: Vec<MySqlRow> = sqlx::query(statement)
            .bind(list)
            .fetch_all(self.pool())
            .await
            .map_err(self.err("requeue"))?;
        let table = self.config().qualified_table();
        let mut check = RequeueCheck::default();
        for row in &rows {
            let decoded = decode(row, table)?;
            // The id as stored: a row that decoded has one that reads as text.
            let stored = row.try_get_unchecked::<String, _>("id").ok();
            check.row(decoded, stored.as_deref());
        }
        check.finish(table)
    }

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

    /// Run `statement` on the dead rows among `seqs` (bound as a JSON array).
    async fn by_seq(&self, statement: &str, seqs: &[i64], what: &str) -> Result<u64, Error> {
        if seqs.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(statement)
            .bind(seq_list(seqs))
            .execute(self.pool())
            .await
            .map_err(self.err(what))?;
        Ok(done.rows_affected())
    }
}
