//! Enqueue through diesel (feature `diesel`): write outbox messages on diesel's
//! [`SqliteConnection`] inside your diesel transaction, or on diesel-async's
//! [`SyncConnectionWrapper`] of it, so they commit or roll back with your business rows.
//!
//! ```text
//! conn.immediate_transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(|conn| {
//!     diesel::insert_into(orders::table).values(&order).execute(conn)?;
//!     outbox_backend_sqlite::diesel::enqueue(conn, &config, &event)?;
//!     Ok(())
//! })?;
//! ```
//!
//! The statement, the checks made before writing, the savepoint around a batch and the errors
//! are those of the rusqlite functions [`crate::enqueue`] and [`crate::enqueue_batch`] (the same
//! code builds them), so the relay reads these rows like any other. diesel's `sqlite` feature
//! links the same SQLite library as this crate's rusqlite. As with rusqlite, begin the
//! transaction IMMEDIATE (`immediate_transaction`), so that a concurrent writer makes it wait
//! for the busy timeout instead of failing at its first write.

use ::diesel::connection::SimpleConnection;
use ::diesel::result::{DatabaseErrorKind, Error as DieselError};
use ::diesel::sql_types::{BigInt, Binary, Nullable, Text};
use ::diesel::sqlite::SqliteConnection;
use ::diesel::RunQueryDsl;
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use outbox_traits::{Error, NewMessage};

use crate::config::SqliteConfig;
use crate::enqueue::{constraint_error, validate_all, Prepared};
use crate::error::Ctx;
use crate::row::from_time;
use crate::sql::insert_sql;

/// Re-exported so users name the same diesel-async version as this crate.
pub use diesel_async;

/// Write one message to the outbox on `conn`: call it inside `conn.immediate_transaction(..)`
/// to write it in the same transaction as your business rows.
///
/// Same rules and errors as [`enqueue_batch`].
pub fn enqueue(
    conn: &mut SqliteConnection,
    config: &SqliteConfig,
    message: &NewMessage,
) -> Result<(), Error> {
    enqueue_batch(conn, config, std::slice::from_ref(message))
}

/// Write several messages to the outbox on `conn`, all or nothing, in slice order (their `seq`
/// values increase in that order).
///
/// Every message is validated before anything is written; a batch of several runs inside a
/// savepoint, so a refused message leaves none of the batch (the rest of the caller's
/// transaction is untouched). An empty slice writes nothing.
///
/// # Errors
/// The same as [`crate::enqueue_batch`]: [`Error::InvalidInput`] for an invalid config or
/// message or an id already in the table, [`Error::DuplicateKey`] for a dedup key already in the
/// table or twice in the batch; a busy database is transient, an I/O failure `Unavailable`, a
/// missing table permanent with a hint to run [`crate::migrate`].
pub fn enqueue_batch(
    conn: &mut SqliteConnection,
    config: &SqliteConfig,
    messages: &[NewMessage],
) -> Result<(), Error> {
    #[cfg(feature = "otel")]
    let messages = &*outbox_otel::capture(messages);
    let rows = validate_all(config, messages)?;
    if rows.is_empty() {
        return Ok(());
    }
    let table = config.table();
    if rows.len() == 1 {
        // A single statement is atomic on its own; no savepoint needed.
        return insert_rows(conn, table, &rows);
    }
    conn.batch_execute("SAVEPOINT outbox_enqueue")
        .map_err(|e| classify(e, table))?;
    match insert_rows(conn, table, &rows) {
        Ok(()) => conn
            .batch_execute("RELEASE outbox_enqueue")
            .map_err(|e| classify(e, table)),
        Err(err) => {
            // Undo this batch only; if the undo fails too the caller must roll back anyway, and
            // the first error says why.
            let _ = conn.batch_execute("ROLLBACK TO outbox_enqueue; RELEASE outbox_enqueue");
            Err(err)
        }
    }
}

/// [`enqueue`] on diesel-async's wrapper of a [`SqliteConnection`], e.g. inside
/// `conn.transaction(async |conn| ..)`.
pub async fn enqueue_async(
    conn: &mut SyncConnectionWrapper<SqliteConnection>,
    config: &SqliteConfig,
    message: &NewMessage,
) -> Result<(), Error> {
    enqueue_batch_async(conn, config, std::slice::from_ref(message)).await
}

/// [`enqueue_batch`] on diesel-async's wrapper of a [`SqliteConnection`]: the whole batch runs
/// in one blocking task on the wrapped connection (which holds the caller's transaction).
pub async fn enqueue_batch_async(
    conn: &mut SyncConnectionWrapper<SqliteConnection>,
    config: &SqliteConfig,
    messages: &[NewMessage],
) -> Result<(), Error> {
    #[cfg(feature = "otel")]
    let messages = &*outbox_otel::capture(messages);
    if messages.is_empty() {
        return Ok(());
    }
    let (config, messages) = (config.clone(), messages.to_vec());
    let table = config.table().to_owned();
    conn.spawn_blocking(move |conn| Ok(enqueue_batch(conn, &config, &messages)))
        .await
        .map_err(|e| classify(e, &table))?
}

fn insert_rows(
    conn: &mut SqliteConnection,
    table: &str,
    rows: &[Prepared<'_>],
) -> Result<(), Error> {
    let sql = insert_sql(table);
    for row in rows {
        let m = row.message;
        ::diesel::sql_query(sql.as_str())
            .bind::<Text, _>(&row.id)
            .bind::<Text, _>(&m.aggregate_type)
            .bind::<Text, _>(&m.aggregate_id)
            .bind::<Text, _>(&m.event_type)
            .bind::<Text, _>(&row.payload)
            .bind::<Text, _>(&row.headers)
            .bind::<Nullable<Text>, _>(&m.partition_key)
            .bind::<Nullable<Text>, _>(&m.dedup_key)
            .bind::<Nullable<BigInt>, _>(m.not_before.map(from_time))
            .bind::<Nullable<Binary>, _>(m.binary.as_ref().map(|b| b.data.as_slice()))
            .bind::<Nullable<Text>, _>(m.binary.as_ref().map(|b| b.content_type.as_str()))
            .execute(conn)
            .map_err(|err| insert_error(err, m, table))?;
    }
    Ok(())
}

/// Name the unique constraint that refused the insert, as the rusqlite path does; anything
/// else is classified.
fn insert_error(err: DieselError, message: &NewMessage, table: &str) -> Error {
    if let DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, info) = &err {
        if let Some(mapped) = constraint_error(info.message(), message, table) {
            return mapped;
        }
    }
    classify(err, table)
}

/// Classify a diesel error from enqueueing into `table`, by SQLite's message (diesel reports
/// no result code).
fn classify(err: DieselError, table: &str) -> Error {
    let what = Ctx::Enqueue.what();
    let text = err.to_string();
    if text.contains("database is locked") || text.contains("database table is locked") {
        return Error::transient(
            format!(
                "sqlite: {what}: the database is locked by another connection for longer than \
                 the busy timeout ({text}); retry, or shorten other write transactions"
            ),
            Some(Box::new(err)),
        );
    }
    if text.contains("disk I/O error") || text.contains("database or disk is full") {
        return Error::unavailable("sqlite", format!("{what}: {text}"), err);
    }
    if text.contains("no such table") {
        return Error::permanent(
            format!(
                "sqlite: {what}: {text}; run `outbox-relay migrate` for table \
                 {table:?} first (or call `SqliteStore::migrate()` or `outbox_backend_sqlite::migrate()`, \
                 or apply `SqliteConfig::migration_sql()`; opening a store does not create the \
                 table)"
            ),
            Some(Box::new(err)),
        );
    }
    Error::permanent(format!("sqlite: {what}: {text}"), Some(Box::new(err)))
}
