//! The MariaDB/MySQL inbox on sqlx (feature `mysql`): record deliveries in the handler's own
//! transaction. Same calls and guarantees as [`crate::postgres`]; the batch form needs
//! MariaDB 10.5 or later (`INSERT ... RETURNING`; on MySQL 8 call [`record`] per message).

#[cfg(feature = "diesel")]
#[path = "mysql_diesel.rs"]
pub mod diesel;

use std::time::Duration;

use outbox_traits::{BoxError, Error};
use sqlx::mysql::MySqlDatabaseError;
use sqlx::{Executor, MySql, MySqlPool, Row, Transaction};
use uuid::Uuid;

use crate::common::{
    batch, check_consumer, check_purge, inserted, receipt, receipts, InboxConfig, Outcome, Receipt,
};
use crate::sqlx_common::HandlerFuture;

const WHAT: &str = "mysql";

/// The statements that create the inbox table (and its database when one is set) if missing:
/// apply them with your own migration tool, or call [`migrate`].
///
/// ```
/// let sql = outbox_inbox::mysql::migration_sql(&outbox_inbox::InboxConfig::default());
/// assert!(sql.contains("PRIMARY KEY (consumer, message_id)"));
/// ```
pub fn migration_sql(config: &InboxConfig) -> String {
    let t = config.qualified('`');
    let database = config
        .schema()
        .map(|s| format!("CREATE DATABASE IF NOT EXISTS `{s}`;\n"))
        .unwrap_or_default();
    let index = config.derived("processed_at", '`');
    format!(
        r#"{database}CREATE TABLE IF NOT EXISTS {t} (
    consumer     VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL
                 CHECK (CHAR_LENGTH(consumer) >= 1),
    message_id   CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL
                 CHECK (message_id REGEXP '^[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}$'),
    processed_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, message_id),
    KEY {index} (processed_at)
) ENGINE = InnoDB;
"#
    )
}

/// Create the inbox table if it is missing ([`migration_sql`]), holding a named lock so that
/// consumers starting together do not race. Idempotent.
///
/// # Errors
/// [`Error::Unavailable`] when the server cannot be reached; a permanent error when the
/// statements fail (e.g. no right to create the database or table).
pub async fn migrate(pool: &MySqlPool, config: &InboxConfig) -> Result<(), Error> {
    let table = config.qualified('`');
    let map = |e| map_sqlx(e, "migrate", &table);
    let mut conn = pool.acquire().await.map_err(map)?;
    let lock = format!("outbox_inbox migrate {table}");
    sqlx::query("SELECT GET_LOCK(?, 60)")
        .bind(&lock)
        .execute(&mut *conn)
        .await
        .map_err(map)?;
    let result = conn
        .execute(migration_sql(config).as_str())
        .await
        .map_err(map);
    sqlx::query("SELECT RELEASE_LOCK(?)")
        .bind(&lock)
        .execute(&mut *conn)
        .await
        .map_err(map)?;
    result.map(|_| ())
}

/// Mark message `id` as processed by `consumer`, through `executor` (pass `&mut *tx`, the
/// transaction that applies the message's effect). One statement, one round trip.
///
/// [`Receipt::New`]: apply the effect in the same transaction, commit, then acknowledge;
/// [`Receipt::Duplicate`]: skip it and acknowledge. A concurrent transaction recording the
/// same id makes the call wait on InnoDB's row lock until it ends (commit: duplicate; rollback:
/// new). InnoDB may instead pick one of them as a deadlock victim: a transient error; roll back
/// and retry the delivery.
///
/// # Errors
/// As [`crate::postgres::record`]; MariaDB does not abort the transaction on a failed
/// statement, but roll back anyway: the mark may be missing.
pub async fn record<'c, E>(
    executor: E,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
) -> Result<Receipt, Error>
where
    E: Executor<'c, Database = MySql>,
{
    check_consumer(consumer)?;
    let table = config.qualified('`');
    // The inputs are checked above, so IGNORE can only skip the duplicate key.
    let sql = format!("INSERT IGNORE INTO {table} (consumer, message_id) VALUES (?, ?)");
    let done = sqlx::query(&sql)
        .bind(consumer)
        .bind(id.hyphenated().to_string())
        .execute(executor)
        .await
        .map_err(|e| map_sqlx(e, "record", &table))?;
    Ok(receipt(done.rows_affected()))
}

/// Mark several messages as processed by `consumer` in one statement (one round trip); one
/// [`Receipt`] per id in the order given, an id given twice new at most once. An empty slice
/// makes no round trip. Needs MariaDB 10.5 or later (`INSERT ... RETURNING`).
///
/// # Errors
/// As [`record`]; more than [`MAX_BATCH`](crate::MAX_BATCH) ids is [`Error::InvalidInput`].
pub async fn record_batch<'c, E>(
    executor: E,
    config: &InboxConfig,
    consumer: &str,
    ids: &[Uuid],
) -> Result<Vec<Receipt>, Error>
where
    E: Executor<'c, Database = MySql>,
{
    let Some(mut rows) = batch(consumer, ids)? else {
        return Ok(Vec::new());
    };
    let table = config.qualified('`');
    // Sorted ids: concurrent batches lock their keys in one order.
    rows.sort_unstable();
    let values = vec!["(?, ?)"; rows.len()].join(", ");
    let sql = format!(
        "INSERT IGNORE INTO {table} (consumer, message_id) VALUES {values} RETURNING message_id"
    );
    let mut query = sqlx::query(&sql);
    for id in &rows {
        query = query.bind(consumer).bind(id.hyphenated().to_string());
    }
    let map = |e| map_sqlx(e, "record", &table);
    // `ascii_bin` text comes back as bytes.
    let texts = query
        .fetch_all(executor)
        .await
        .map_err(map)?
        .iter()
        .map(|row| row.try_get::<Vec<u8>, _>(0))
        .collect::<Result<Vec<_>, _>>()
        .map_err(map)?;
    let inserted = inserted(&table, texts.iter().map(|t| Uuid::try_parse_ascii(t)))?;
    Ok(receipts(ids, &inserted))
}

/// Handle one delivery exactly once: begin on `pool`, [`record`], run `handler` in the same
/// transaction when new, commit. As [`crate::postgres::process`].
///
/// # Errors
/// As [`crate::postgres::process`].
pub async fn process<T, E, F>(
    pool: &MySqlPool,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
    handler: F,
) -> Result<Outcome<T>, E>
where
    F: for<'t> FnOnce(&'t mut Transaction<'static, MySql>) -> HandlerFuture<'t, T, E>,
    E: From<Error>,
{
    let map: fn(sqlx::Error, &str) -> Error = |e, op| map_sqlx(e, op, "the inbox transaction");
    let mut tx = pool.begin().await.map_err(|e| map(e, "begin"))?;
    let receipt = record(&mut *tx, config, consumer, id).await?;
    crate::sqlx_common::finish(tx, receipt, map, handler).await
}

/// Delete at most `batch` marks processed more than `older_than` ago (by the database's
/// clock, UTC), oldest first, in one statement; returns how many. Call again while it returns
/// `batch`. As [`crate::postgres::purge`], except that rows a running transaction holds make
/// it wait.
///
/// # Errors
/// As [`crate::postgres::purge`].
pub async fn purge<'c, E>(
    executor: E,
    config: &InboxConfig,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error>
where
    E: Executor<'c, Database = MySql>,
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
    E: Executor<'c, Database = MySql>,
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
    E: Executor<'c, Database = MySql>,
{
    let micros = check_purge(older_than, batch)?;
    let table = config.qualified('`');
    let only = if consumer.is_some() {
        "AND consumer = ? "
    } else {
        ""
    };
    let sql = format!(
        "DELETE FROM {table} WHERE processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
         {only}ORDER BY processed_at LIMIT ?"
    );
    let mut query = sqlx::query(&sql).bind(micros);
    if let Some(consumer) = consumer {
        query = query.bind(consumer);
    }
    let done = query
        .bind(batch)
        .execute(executor)
        .await
        .map_err(|e| map_sqlx(e, "purge", &table))?;
    Ok(done.rows_affected())
}

/// Map a sqlx error of operation `op` on `table`, by MariaDB error number.
pub(crate) fn map_sqlx(err: sqlx::Error, op: &str, table: &str) -> Error {
    outbox_sql_support::map_sqlx(err, WHAT, op, table, |err, text| {
        let number = err
            .as_database_error()
            .and_then(|db| db.try_downcast_ref::<MySqlDatabaseError>())
            .map(|db| db.number())
            .unwrap_or_default();
        classify(number, op, table, text, Box::new(err))
    })
}

fn classify(number: u16, op: &str, table: &str, text: String, source: BoxError) -> Error {
    let message = format!("inbox {op} on {table} failed: {text} (error {number})");
    match number {
        // no such table, unknown database, unknown column
        1146 | 1049 | 1054 => Error::permanent(
            format!(
                "{message}; the inbox table is missing or outdated: call \
                 `outbox_inbox::mysql::migrate` (or apply `migration_sql`)"
            ),
            Some(source),
        ),
        // deadlock, lock wait timeout, statement time limit, query interrupted
        1213 | 1205 | 1969 | 3024 | 1317 => {
            Error::transient(format!("{message}; retry the delivery"), Some(source))
        }
        // too many connections, server shutting down, read-only server
        1040 | 1053 | 1290 | 1836 => Error::Unavailable {
            what: WHAT.to_owned(),
            message,
            source: Some(source),
        },
        _ => Error::permanent(message, Some(source)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::ErrorKind;

    #[test]
    fn error_numbers_are_classified() {
        let c = |n| classify(n, "record", "t", "x".into(), "x".into());
        assert!(c(1146).to_string().contains("mysql::migrate"));
        assert_eq!(c(1213).kind(), ErrorKind::Transient);
        assert!(matches!(c(1290), Error::Unavailable { .. }));
        assert_eq!(c(1062).kind(), ErrorKind::Permanent);
    }
}
