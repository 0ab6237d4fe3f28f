//! The Postgres inbox on sqlx (feature `postgres`): record deliveries in the handler's own
//! transaction.
//!
//! ```no_run
//! use outbox_inbox::{postgres, InboxConfig, Receipt};
//! # async fn handle(pool: sqlx::PgPool, message_id: uuid::Uuid) -> Result<(), outbox_inbox::Error> {
//! let config = InboxConfig::default();
//! postgres::migrate(&pool, &config).await?;
//!
//! let mut tx = pool.begin().await.map_err(|e| outbox_inbox::Error::permanent(e.to_string(), None))?;
//! if postgres::record(&mut *tx, &config, "payments", message_id).await? == Receipt::New {
//!     // apply the message's effect with `&mut *tx` here
//! }
//! tx.commit().await.map_err(|e| outbox_inbox::Error::permanent(e.to_string(), None))?;
//! // now acknowledge the message to the broker
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "diesel")]
#[path = "postgres_diesel.rs"]
pub mod diesel;

use std::collections::HashSet;
use std::time::Duration;

use outbox_traits::{BoxError, Error};
use sqlx::{Executor, PgPool, Postgres, Row, Transaction};
use uuid::Uuid;

use crate::common::{
    batch, check_consumer, check_purge, receipt, receipts, InboxConfig, Outcome, Receipt,
};
use crate::sqlx_common::HandlerFuture;

const WHAT: &str = "postgres";

/// The statements that create the inbox table (and its schema when one is set) if missing:
/// apply them with your own migration tool, or call [`migrate`].
///
/// ```
/// let sql = outbox_inbox::postgres::migration_sql(&outbox_inbox::InboxConfig::default());
/// assert!(sql.contains("PRIMARY KEY (consumer, message_id)"));
/// ```
pub fn migration_sql(config: &InboxConfig) -> String {
    let t = config.qualified('"');
    let schema = config
        .schema()
        .map(|s| format!("CREATE SCHEMA IF NOT EXISTS \"{s}\";\n"))
        .unwrap_or_default();
    let index = config.derived("processed_at", '"');
    format!(
        r#"{schema}CREATE TABLE IF NOT EXISTS {t} (
    consumer     TEXT        NOT NULL CHECK (char_length(consumer) BETWEEN 1 AND 200),
    message_id   UUID        NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {index} ON {t} (processed_at);
"#
    )
}

/// Create the inbox table if it is missing ([`migration_sql`]), in one transaction holding an
/// advisory lock, so that consumers starting together do not race. Idempotent.
///
/// # Errors
/// [`Error::Unavailable`] when the server cannot be reached; a permanent error when the
/// statements fail (e.g. no right to create the schema or table).
pub async fn migrate(pool: &PgPool, config: &InboxConfig) -> Result<(), Error> {
    let table = config.qualified('"');
    let map = |e| map_sqlx(e, "migrate", &table);
    let mut tx = pool.begin().await.map_err(map)?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(format!("outbox_inbox migrate {table}"))
        .execute(&mut *tx)
        .await
        .map_err(map)?;
    tx.execute(migration_sql(config).as_str())
        .await
        .map_err(map)?;
    tx.commit().await.map_err(map)
}

/// Mark message `id` as processed by `consumer`, through `executor`: pass `&mut *tx`, the
/// transaction that applies the message's effect, so that the mark and the effect commit
/// together or not at all. One statement, one round trip.
///
/// Returns [`Receipt::New`] when the id was not marked (it is now, in `tx`): apply the effect,
/// commit, then acknowledge. Returns [`Receipt::Duplicate`] when a committed transaction
/// already marked it: skip the effect and acknowledge. If another open transaction is
/// recording the same id at the same moment (a concurrent redelivery), the call waits for it:
/// when it commits this is a duplicate, when it rolls back this one is new. So under any
/// interleaving one transaction at most applies the effect. (Under `REPEATABLE READ` or
/// `SERIALIZABLE` Postgres reports such a race as a serialization failure instead, a transient
/// error: roll back and retry the delivery.)
///
/// # Errors
/// [`Error::InvalidInput`] for an empty, over-long (more than
/// [`MAX_CONSUMER_CHARS`](crate::MAX_CONSUMER_CHARS)) or NUL-holding consumer name, before
/// anything is sent. From the database: a missing table is permanent and says to run
/// [`migrate`]; lost connections are [`Error::Unavailable`]; deadlocks and serialization
/// failures are transient. After a database error Postgres has aborted `tx`: roll it back.
pub async fn record<'c, E>(
    executor: E,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
) -> Result<Receipt, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    check_consumer(consumer)?;
    let table = config.qualified('"');
    let sql = format!(
        "INSERT INTO {table} (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING"
    );
    let done = sqlx::query(&sql)
        .bind(consumer)
        .bind(id)
        .execute(executor)
        .await
        .map_err(|e| map_sqlx(e, "record", &table))?;
    Ok(receipt(done.rows_affected()))
}

/// Mark several messages as processed by `consumer` in one statement (one round trip), through
/// `executor` (usually `&mut *tx`). Returns one [`Receipt`] per id, in the order given: apply
/// the effects of the [`Receipt::New`] ones in the same transaction. An id given twice is new
/// at most once (its later occurrences are duplicates). An empty slice makes no round trip.
///
/// Concurrency and errors as [`record`]; more than [`MAX_BATCH`](crate::MAX_BATCH) ids is
/// [`Error::InvalidInput`].
pub async fn record_batch<'c, E>(
    executor: E,
    config: &InboxConfig,
    consumer: &str,
    ids: &[Uuid],
) -> Result<Vec<Receipt>, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    let Some(mut rows) = batch(consumer, ids)? else {
        return Ok(Vec::new());
    };
    let table = config.qualified('"');
    // Sorted ids: concurrent batches lock their keys in one order and cannot deadlock.
    rows.sort_unstable();
    let sql = format!(
        "INSERT INTO {table} (consumer, message_id) \
         SELECT $1, id FROM UNNEST($2::uuid[]) WITH ORDINALITY AS b(id, n) ORDER BY n \
         ON CONFLICT DO NOTHING RETURNING message_id"
    );
    let inserted = sqlx::query(&sql)
        .bind(consumer)
        .bind(rows)
        .fetch_all(executor)
        .await
        .map_err(|e| map_sqlx(e, "record", &table))?
        .iter()
        .map(|row| row.try_get::<Uuid, _>(0))
        .collect::<Result<HashSet<Uuid>, _>>()
        .map_err(|e| map_sqlx(e, "record", &table))?;
    Ok(receipts(ids, &inserted))
}

/// Handle one delivery exactly once, for sqlx users: begin a transaction on `pool`, [`record`]
/// `id` for `consumer`, and when it is new run `handler` with the transaction and commit (the
/// effect and the mark together); acknowledge the message after this returns `Ok`.
///
/// A duplicate rolls back without calling `handler` and returns [`Outcome::Duplicate`]. A
/// handler error rolls back (no effect, no mark: a redelivery runs the handler again) and is
/// returned as is. The handler returns a boxed `Send` future ([`HandlerFuture`], the shape of
/// sqlx's `Connection::transaction`), so the whole call can run in a spawned task; as there,
/// the future may borrow the transaction only: move what else it needs into the closure.
///
/// ```no_run
/// use outbox_inbox::{postgres, InboxConfig, Outcome};
/// # async fn run(pool: sqlx::PgPool, id: uuid::Uuid) -> Result<(), outbox_inbox::Error> {
/// let config = InboxConfig::default();
/// let outcome = postgres::process(&pool, &config, "payments", id, |tx| {
///     Box::pin(async move {
///         sqlx::query("INSERT INTO payments (message_id) VALUES ($1)")
///             .bind(id)
///             .execute(&mut **tx)
///             .await
///             .map_err(|e| outbox_inbox::Error::permanent(e.to_string(), None))?;
///         Ok::<_, outbox_inbox::Error>(())
///     })
/// })
/// .await?;
/// assert!(matches!(outcome, Outcome::Handled(()) | Outcome::Duplicate));
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// The handler's error, or the inbox's as `E::from` ([`record`]'s, or a failed begin or
/// commit: after a failed commit the outcome is unknown, and the redelivery decides it).
pub async fn process<T, E, F>(
    pool: &PgPool,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
    handler: F,
) -> Result<Outcome<T>, E>
where
    F: for<'t> FnOnce(&'t mut Transaction<'static, Postgres>) -> HandlerFuture<'t, T, E>,
    E: From<Error>,
{
    let map: fn(sqlx::Error, &str) -> Error = |e, op| map_sqlx(e, op, "the inbox transaction");
    let mut tx = pool.begin().await.map_err(|e| map(e, "begin"))?;
    let receipt = record(&mut *tx, config, consumer, id).await?;
    crate::sqlx_common::finish(tx, receipt, map, handler).await
}

/// Delete at most `batch` marks processed more than `older_than` ago (by the database's
/// clock), oldest first, in one statement; returns how many were deleted. Call it again while
/// it returns `batch` to purge everything that old, each call a short transaction of its own:
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), outbox_inbox::Error> {
/// let config = outbox_inbox::InboxConfig::default();
/// let week = std::time::Duration::from_secs(7 * 86_400);
/// while outbox_inbox::postgres::purge(&pool, &config, week, 1_000).await? == 1_000 {}
/// # Ok(())
/// # }
/// ```
///
/// Keep marks longer than any redelivery can arrive (the broker's redelivery window, the
/// relay's longest outage): a redelivery whose mark was purged is applied again.
/// Rows locked by a transaction still in progress are skipped, so concurrent purges do not
/// wait on each other.
///
/// # Errors
/// [`Error::InvalidInput`] for `batch` 0 or over [`MAX_BATCH`](crate::MAX_BATCH), or an age
/// over 100 years; database errors as [`record`].
pub async fn purge<'c, E>(
    executor: E,
    config: &InboxConfig,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    purge_marks(executor, config, None, older_than, batch).await
}

/// [`purge`] for the marks of one consumer only (the others' are kept, whatever their age).
///
/// # Errors
/// As [`purge`]; a bad consumer name is [`Error::InvalidInput`].
pub async fn purge_consumer<'c, E>(
    executor: E,
    config: &InboxConfig,
    consumer: &str,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    check_consumer(consumer)?;
    purge_marks(executor, config, Some(consumer), older_than, batch).await
}

async fn purge_marks<'c, E>(
    executor: E,
    config: &InboxConfig,
    consumer: Option<&str>,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    let micros = check_purge(older_than, batch)?;
    let table = config.qualified('"');
    let only = if consumer.is_some() {
        "AND consumer = $3 "
    } else {
        ""
    };
    let sql = format!(
        "DELETE FROM {table} WHERE (consumer, message_id) IN (\
         SELECT consumer, message_id FROM {table} \
         WHERE processed_at < now() - $1 * interval '1 microsecond' {only}\
         ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
    );
    let mut query = sqlx::query(&sql).bind(micros).bind(i64::from(batch));
    if let Some(consumer) = consumer {
        query = query.bind(consumer);
    }
    let done = query
        .execute(executor)
        .await
        .map_err(|e| map_sqlx(e, "purge", &table))?;
    Ok(done.rows_affected())
}

/// Map a sqlx error of operation `op` on `table`: connection and server-availability errors
/// are [`Error::Unavailable`], deadlocks, serialization failures and timeouts transient, a
/// missing table permanent with the fix, the rest permanent. No password appears.
pub(crate) fn map_sqlx(err: sqlx::Error, op: &str, table: &str) -> Error {
    outbox_sql_support::map_sqlx(err, WHAT, op, table, |err, text| {
        let code = err
            .as_database_error()
            .and_then(|db| db.code())
            .map(|c| c.into_owned())
            .unwrap_or_default();
        classify(&code, op, table, text, Box::new(err))
    })
}

fn classify(code: &str, op: &str, table: &str, text: String, source: BoxError) -> Error {
    let message = format!("inbox {op} on {table} failed: {text} (SQLSTATE {code})");
    match code {
        "42P01" | "3F000" | "42703" => Error::permanent(
            format!(
                "{message}; the inbox table is missing or outdated: call \
                 `outbox_inbox::postgres::migrate` (or apply `migration_sql`)"
            ),
            Some(source),
        ),
        "40001" | "40P01" | "55P03" | "57014" | "25P03" => {
            Error::transient(format!("{message}; retry the delivery"), Some(source))
        }
        c if c.starts_with("08")
            || c.starts_with("53")
            || matches!(c, "57P01" | "57P02" | "57P03" | "25006") =>
        {
            Error::Unavailable {
                what: WHAT.to_owned(),
                message,
                source: Some(source),
            }
        }
        _ => Error::permanent(message, Some(source)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::ErrorKind;

    #[test]
    fn sqlstates_are_classified() {
        let c = |code| classify(code, "record", "t", "x".into(), "x".into());
        assert!(c("42P01").to_string().contains("postgres::migrate"));
        assert_eq!(c("40001").kind(), ErrorKind::Transient);
        assert!(matches!(c("57P01"), Error::Unavailable { .. }));
        assert_eq!(c("23514").kind(), ErrorKind::Permanent);
    }
}
