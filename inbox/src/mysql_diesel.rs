//! The MariaDB inbox on diesel-async (features `mysql` and `diesel`): the same statements,
//! checks, answers and errors as the sqlx functions of [`crate::mysql`], on an
//! [`AsyncMysqlConnection`], usually inside `conn.transaction(..)`.

use std::time::Duration;

use diesel::sql_types::Binary;
use diesel_async::{AsyncMysqlConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_traits::Error;
use uuid::Uuid;

use crate::common::{batch, check_consumer, check_purge, inserted, receipt, receipts};
use crate::diesel_common::{classify, purge_parts, text_rows, Stmt};
use crate::{InboxConfig, Outcome, Receipt};

/// Re-exported so users name the same diesel-async version as this crate.
pub use diesel_async;

fn map(err: diesel::result::Error, op: &str, table: &str) -> Error {
    classify(err, op, table, "mysql", "mysql")
}

/// Create the inbox table if it is missing ([`crate::mysql::migration_sql`]). Idempotent.
///
/// # Errors
/// As [`crate::mysql::migrate`].
pub async fn migrate(conn: &mut AsyncMysqlConnection, config: &InboxConfig) -> Result<(), Error> {
    let table = config.qualified('`');
    conn.batch_execute(&crate::mysql::migration_sql(config))
        .await
        .map_err(|e| map(e, "migrate", &table))
}

/// [`crate::mysql::record`] on diesel-async: mark `id` as processed by `consumer` in the
/// connection's open transaction. One statement, one round trip once prepared.
///
/// # Errors
/// As [`crate::mysql::record`].
pub async fn record(
    conn: &mut AsyncMysqlConnection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
) -> Result<Receipt, Error> {
    check_consumer(consumer)?;
    let table = config.qualified('`');
    let head = format!("INSERT IGNORE INTO {table} (consumer, message_id) VALUES ");
    let inserted = Stmt::<Binary>::new(text_rows(head, consumer, &[id], ""))
        .execute(conn)
        .await
        .map_err(|e| map(e, "record", &table))?;
    Ok(receipt(inserted as u64))
}

/// [`crate::mysql::record_batch`] on diesel-async: one statement, one [`Receipt`] per id in
/// order (MariaDB 10.5 or later).
///
/// # Errors
/// As [`crate::mysql::record_batch`].
pub async fn record_batch(
    conn: &mut AsyncMysqlConnection,
    config: &InboxConfig,
    consumer: &str,
    ids: &[Uuid],
) -> Result<Vec<Receipt>, Error> {
    let Some(mut rows) = batch(consumer, ids)? else {
        return Ok(Vec::new());
    };
    let table = config.qualified('`');
    rows.sort_unstable();
    let head = format!("INSERT IGNORE INTO {table} (consumer, message_id) VALUES ");
    let parts = text_rows(head, consumer, &rows, " RETURNING message_id");
    let texts: Vec<Vec<u8>> = Stmt::<Binary>::new(parts)
        .load(conn)
        .await
        .map_err(|e| map(e, "record", &table))?;
    let inserted = inserted(&table, texts.iter().map(|t| Uuid::try_parse_ascii(t)))?;
    Ok(receipts(ids, &inserted))
}

/// [`crate::mysql::process`] on diesel-async: handle one delivery exactly once. Begin a
/// transaction on `conn` (a savepoint when one is open), [`record`] `id` for `consumer` and,
/// when it is new, run `handler` with the connection and commit. A duplicate rolls back
/// without calling `handler`; a handler error rolls back and is returned.
///
/// ```text
/// let outcome = outbox_inbox::mysql::diesel::process(&mut conn, &config, "payments", id, async |conn| {
///     diesel::insert_into(payments::table).values(&payment).execute(conn).await?;
///     Ok::<_, MyError>(())
/// }).await?; // then ack (Handled or Duplicate alike)
/// ```
///
/// # Errors
/// The handler's error, or the inbox's as `E::from`.
pub async fn process<T, E, F>(
    conn: &mut AsyncMysqlConnection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
    handler: F,
) -> Result<Outcome<T>, E>
where
    F: AsyncFnOnce(&mut AsyncMysqlConnection) -> Result<T, E>,
    E: From<Error>,
{
    check_consumer(consumer)?;
    crate::diesel_common::process(
        conn,
        async |conn| record(conn, config, consumer, id).await,
        handler,
        |e, op| map(e, op, "the inbox transaction"),
    )
    .await
}

/// [`crate::mysql::purge`] on diesel-async: delete at most `batch` marks older than
/// `older_than`, oldest first; returns how many.
///
/// # Errors
/// As [`crate::mysql::purge`].
pub async fn purge(
    conn: &mut AsyncMysqlConnection,
    config: &InboxConfig,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    purge_marks(conn, config, None, older_than, batch).await
}

/// [`crate::mysql::purge_consumer`] on diesel-async: [`purge`] for one consumer's marks only.
///
/// # Errors
/// As [`crate::mysql::purge_consumer`].
pub async fn purge_consumer(
    conn: &mut AsyncMysqlConnection,
    config: &InboxConfig,
    consumer: &str,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    check_consumer(consumer)?;
    purge_marks(conn, config, Some(consumer), older_than, batch).await
}

async fn purge_marks(
    conn: &mut AsyncMysqlConnection,
    config: &InboxConfig,
    consumer: Option<&str>,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let micros = check_purge(older_than, batch)?;
    let table = config.qualified('`');
    let head = format!("DELETE FROM {table} WHERE processed_at < UTC_TIMESTAMP(6) - INTERVAL ");
    let parts = purge_parts(head, micros, " MICROSECOND", consumer, batch, "");
    let deleted = Stmt::<Binary>::new(parts)
        .execute(conn)
        .await
        .map_err(|e| map(e, "purge", &table))?;
    Ok(deleted as u64)
}
