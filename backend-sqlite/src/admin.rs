//! The operator's side of the store ([`OutboxAdmin`]): dead letters, purge, counts.

use rusqlite::types::{Value, ValueRef};
use rusqlite::{params, Connection, TransactionBehavior};

use std::time::Duration;

use outbox_traits::uuid::Uuid;
use outbox_traits::{async_trait, Counts, DeadMessage, Error, OutboxAdmin};

use crate::cancel::Caller;
use crate::error::{map_err, Ctx};
use crate::lease::db_now;
use crate::row::duration_ms;
use crate::row::{decode, id_text, to_time};
use crate::sql::Sql;
use crate::store::SqliteStore;
use outbox_sql_support::quarantine;

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
        let Ok(older_than_ms) = duration_ms(older_than, "purge age") else {
            return Ok(0);
        };
        self.run(Ctx::Admin, move |conn, sql, table, caller| {
            purge_published(conn, sql, table, older_than_ms, batch, caller)
        })
        .await
    }

    async fn counts(&self) -> Result<Counts, Error> {
        self.run(Ctx::Admin, move |conn, sql, table, _| {
            counts(conn, sql, table)
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
                let (message, raw_id) = match decode(row)? {
                    Ok(message) => (message, None),
                    // A quarantined row: shown as well as it reads.
                    Err(poison) => quarantine::lenient(
                        poison.seq,
                        |column| {
                            let i = crate::sql::MESSAGE_COLUMNS
                                .split(", ")
                                .position(|c| c == column)?;
                            match row.get_ref(i).ok()? {
                                ValueRef::Text(t) => Some(String::from_utf8_lossy(t).into_owned()),
                                ValueRef::Integer(n) => Some(n.to_string()),
                                ValueRef::Real(x) => Some(x.to_string()),
                                _ => None,
                            }
                        },
                        row.get::<_, i64>(9)
                            .ok()
                            .and_then(|n| u32::try_from(n).ok()),
                        row.get::<_, i64>(10).ok().map(to_time),
                    ),
                };
                Ok(DeadMessage {
                    message,
                    last_error: row.get::<_, Option<String>>(11)?.unwrap_or_default(),
                    raw_id,
                })
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
    let mut refused = Vec::new();
    for id in ids {
        let mut rows = stmt.query(params![id]).map_err(err(table))?;
        while let Some(row) = rows.next().map_err(err(table))? {
            match decode(row).map_err(err(table))? {
                Err(poison) => refused.push(poison),
                Ok(message) => {
                    let stored: String = row.get(0).map_err(err(table))?;
                    if stored != id_text(message.id) {
                        refused.push(quarantine::Poison {
                            seq: message.seq,
                            partition_key: message.partition_key,
                            reason: quarantine::reason(
                                "id",
                                Some(&stored),
                                "not in the lower case the relay completes by (another \
                                 message holds it in lower case); give the row an id of its own",
                            ),
                        });
                    }
                }
            }
        }
    }
    if refused.is_empty() {
        Ok(())
    } else {
        Err(quarantine::requeue_refused(table, &refused))
    }
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

pub(crate) fn counts(conn: &Connection, sql: &Sql, table: &str) -> Result<Counts, Error> {
    conn.prepare_cached(&sql.counts)
        .and_then(|mut s| {
            s.query_row([], |r| {
                let n = |i: usize| r.get::<_, i64>(i).map(|n| n.max(0) as u64);
                Ok(Counts {
                    pending: n(0)?,
                    leased: n(1)?,
                    published: n(2)?,
                    dead: n(3)?,
                })
            })
        })
        .map_err(err(table))
}
