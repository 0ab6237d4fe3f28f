//! The operator's side of the store ([`OutboxAdmin`]): dead letters, purge, counts.

use rusqlite::types::Value;
use rusqlite::{params, Connection, TransactionBehavior};

use std::time::Duration;

use outbox_traits::uuid::Uuid;
use outbox_traits::{async_trait, Counts, DeadMessage, Error, OutboxAdmin};

use crate::cancel::Caller;
use crate::error::{map_err, Ctx};
use crate::lease::db_now;
use crate::row::{decode, id_text, Lenient};
use crate::sql::{Sql, MESSAGE_COLUMN_COUNT};
use crate::store::SqliteStore;
use outbox_sql_support::admin::{dead_message, purge_age, RequeueCheck};
use outbox_sql_support::limits::millis;

#[async_trait]
impl OutboxAdmin for SqliteStore {
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error> {
        self.run(Ctx::Admin, move |conn, sql, table, _| {
            list_dead(conn, sql, table, after_seq, limit)
        })
        .await
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        let ids = ids.to_vec();
        self.run(Ctx::Admin, move |conn, sql, table, caller| {
            requeue(conn, sql, table, &ids, caller)
        })
        .await
    }

    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
        let ids = ids.to_vec();
        self.run(Ctx::Admin, move |conn, sql, table, caller| {
            discard(conn, sql, table, &ids, caller)
        })
        .await
    }

    async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        let seqs = seqs.to_vec();
        self.run(Ctx::Admin, move |conn, sql, table, caller| {
            requeue_seqs(conn, sql, table, &seqs, caller)
        })
        .await
    }

    async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        let seqs = seqs.to_vec();
        self.run(Ctx::Admin, move |conn, sql, table, caller| {
            discard_seqs(conn, sql, table, &seqs, caller)
        })
        .await
    }

    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
        outbox_traits::validate_purge_batch(batch)?;
        // Nothing was published more than a century ago.
        let Some(older_than_ms) = purge_age(older_than, millis) else {
            return Ok(0);
        };
        self.run(Ctx::Admin, move |conn, sql, table, caller| {
            purge_published(conn, sql, table, older_than_ms, batch, caller)
        })
        .await
    }

    async fn counts(&self) -> Result<Counts, Error> {
        self.run(Ctx::Admin, move |conn, sql, table, _| {
            crate::status::counts(conn, sql, table)
        })
        .await
    }

    async fn status(&self, blocked_limit: usize) -> Result<outbox_traits::StoreStatus, Error> {
        let keeps_published = !self.config().delete_published();
        self.run(Ctx::Admin, move |conn, sql, table, _| {
            crate::status::status(conn, sql, table, blocked_limit, keeps_published)
        })
        .await
    }

    async fn backlog(&self) -> Result<outbox_traits::Backlog, Error> {
        self.run(Ctx::Admin, move |conn, _, table, _| {
            crate::status::backlog(conn, table)
        })
        .await
    }

    async fn ping(&self) -> Result<(), Error> {
        self.run(Ctx::Admin, move |conn, _, table, _| {
            crate::status::ping(conn, table)
        })
        .await
    }
}

fn err(table: &str) -> impl Fn(rusqlite::Error) -> Error + '_ {
    move |e| map_err(e, Ctx::Admin, table)
}

/// A row count or limit as SQLite's integer.
fn as_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

pub(crate) fn list_dead(
    conn: &Connection,
    sql: &Sql,
    table: &str,
    after_seq: Option<i64>,
    limit: usize,
) -> Result<Vec<DeadMessage>, Error> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    // A single read statement needs no write lock: in WAL mode it never blocks the relay.
    let mut stmt = conn.prepare_cached(&sql.list_dead).map_err(err(table))?;
    let rows = stmt
        .query_map(
            params![after_seq.unwrap_or(i64::MIN), as_i64(limit)],
            |row| {
                let last_error = row
                    .get::<_, Option<String>>(MESSAGE_COLUMN_COUNT)?
                    .unwrap_or_default();
                Ok(dead_message(decode(row)?, &Lenient(row), last_error))
            },
        )
        .and_then(|rows| rows.collect())
        .map_err(err(table))?;
    Ok(rows)
}

/// Run `statement` (binding `?1` = an id or seq, `?2` = database now) for each of `rows` in
/// one transaction; returns how many rows changed. With `check` (a requeue's
/// `requeue_check`), first refuse the call if any quarantined row among them still cannot be
/// relayed, before anything is written.
fn per_row(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    (statement, check): (&str, Option<&str>),
    ids: &[Value],
    caller: &Caller,
) -> Result<u64, Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err(table))?;
    if let Some(check) = check {
        check_requeue(&tx, table, check, ids)?;
    }
    let now = db_now(&tx, sql).map_err(err(table))?;
    let mut changed = 0u64;
    {
        let mut stmt = tx.prepare_cached(statement).map_err(err(table))?;
        let binds_now = stmt.parameter_count() >= 2;
        for id in ids {
            let n = if binds_now {
                stmt.execute(params![id, now])
            } else {
                stmt.execute(params![id])
            }
            .map_err(err(table))?;
            changed += n as u64;
        }
    }
    caller.commit(tx, err(table))?;
    Ok(changed)
}

/// Refuse a requeue of dead rows that still cannot be relayed: each quarantined row among
/// `ids` (ids or seqs; `check` reads one) must decode now, with its id in the lower case
/// completions match. Runs in the requeue's transaction.
fn check_requeue(conn: &Connection, table: &str, check: &str, ids: &[Value]) -> Result<(), Error> {
    let mut stmt = conn.prepare_cached(check).map_err(err(table))?;
    let mut check = RequeueCheck::default();
    for id in ids {
        let mut rows = stmt.query(params![id]).map_err(err(table))?;
        while let Some(row) = rows.next().map_err(err(table))? {
            let decoded = decode(row).map_err(err(table))?;
            check.row(decoded, row.get::<_, String>(0).ok().as_deref());
        }
    }
    check.finish(table)
}

pub(crate) fn requeue(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    ids: &[Uuid],
    caller: &Caller,
) -> Result<u64, Error> {
    let statements = (sql.requeue.as_str(), Some(sql.requeue_check.as_str()));
    per_row(conn, sql, table, statements, &id_values(ids), caller)
}

pub(crate) fn discard(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    ids: &[Uuid],
    caller: &Caller,
) -> Result<u64, Error> {
    per_row(
        conn,
        sql,
        table,
        (&sql.discard, None),
        &id_values(ids),
        caller,
    )
}

/// Ids as the stored text.
fn id_values(ids: &[Uuid]) -> Vec<Value> {
    ids.iter().map(|id| Value::Text(id_text(*id))).collect()
}

/// Seqs as stored.
fn seq_values(seqs: &[i64]) -> Vec<Value> {
    seqs.iter().map(|seq| Value::Integer(*seq)).collect()
}

pub(crate) fn requeue_seqs(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    seqs: &[i64],
    caller: &Caller,
) -> Result<u64, Error> {
    let statements = (
        sql.requeue_seq.as_str(),
        Some(sql.requeue_check_seq.as_str()),
    );
    per_row(conn, sql, table, statements, &seq_values(seqs), caller)
}

pub(crate) fn discard_seqs(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    seqs: &[i64],
    caller: &Caller,
) -> Result<u64, Error> {
    per_row(
        conn,
        sql,
        table,
        (&sql.discard_seq, None),
        &seq_values(seqs),
        caller,
    )
}

pub(crate) fn purge_published(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    older_than_ms: i64,
    batch: usize,
    caller: &Caller,
) -> Result<u64, Error> {
    outbox_traits::validate_purge_batch(batch)?;
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err(table))?;
    let now = db_now(&tx, sql).map_err(err(table))?;
    // The statement's state = 'published' filter is what keeps unpublished and dead rows safe;
    // AUTOINCREMENT keeps the deleted seq values from being handed out again.
    let deleted = tx
        .prepare_cached(&sql.purge)
        .and_then(|mut s| s.execute(params![now.saturating_sub(older_than_ms), as_i64(batch)]))
        .map_err(err(table))?;
    caller.commit(tx, err(table))?;
    Ok(deleted as u64)
}
