//! Writing messages inside the caller's transaction.

use rusqlite::{params, Connection, Transaction};

use outbox_traits::{validate_batch, Error, NewMessage};

use crate::config::SqliteConfig;
use crate::error::{map_err, Ctx};
use crate::row::{from_time, id_text};
use crate::sql::insert_sql;

/// Write one message in the caller's transaction: it becomes claimable when `tx` commits and
/// never exists if `tx` rolls back.
///
/// Begin `tx` with [`rusqlite::TransactionBehavior::Immediate`]
/// (`conn.transaction_with_behavior(TransactionBehavior::Immediate)`). A default (DEFERRED)
/// transaction that reads before it writes fails with `SQLITE_BUSY` at its first write if another
/// connection wrote in between, and SQLite does *not* wait `busy_timeout` in that case; an
/// IMMEDIATE transaction takes the write lock at `BEGIN`, where the busy timeout applies.
///
/// # Errors
/// Nothing is written on error:
/// - [`Error::InvalidInput`]: the config or the message is invalid (see
///   [`NewMessage::validate`]), or its id is already in the table.
/// - [`Error::DuplicateKey`]: its dedup key is already in the table.
/// - A permanent error saying to run [`crate::migrate`] if the table is missing.
///
/// # Example
/// ```
/// use outbox_backend_sqlite::{enqueue, migrate, open_connection, SqliteConfig};
/// use outbox_traits::NewMessage;
/// use rusqlite::TransactionBehavior;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("app.db");
/// let config = SqliteConfig::default();
/// let mut conn = open_connection(&path, &config)?;
/// migrate(&conn, &config)?;
/// conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)")?;
///
/// let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
/// tx.execute("INSERT INTO orders (id, total) VALUES (?1, ?2)", ("order-42", 12))?;
/// enqueue(
///     &tx,
///     &config,
///     &NewMessage::new("order", "order-42", "order.placed", serde_json::json!({"total": 12})),
/// )?;
/// tx.commit()?; // the order and its event become visible together
/// # Ok(())
/// # }
/// ```
pub fn enqueue(
    tx: &Transaction<'_>,
    config: &SqliteConfig,
    message: &NewMessage,
) -> Result<(), Error> {
    enqueue_batch(tx, config, std::slice::from_ref(message))
}

/// Write several messages in the caller's transaction, all or nothing, in the given order (their
/// `seq` values increase in slice order, so messages of one key are published in that order).
///
/// Every message is validated before anything is written. The batch runs inside a savepoint, so
/// a duplicate dedup key in the middle leaves none of the batch in `tx` (the rest of `tx` is
/// untouched). See [`enqueue`] for the transaction mode and the errors; a dedup key or id that
/// appears twice in the batch itself is refused the same way.
pub fn enqueue_batch(
    tx: &Transaction<'_>,
    config: &SqliteConfig,
    messages: &[NewMessage],
) -> Result<(), Error> {
    #[cfg(feature = "otel")]
    let messages = &*outbox_otel::capture(messages);
    let rows = validate_all(config, messages)?;
    if rows.is_empty() {
        return Ok(());
    }
    let conn: &Connection = tx;
    if rows.len() == 1 {
        // A single statement is atomic on its own; no savepoint needed.
        return insert_rows(conn, config.table(), &rows);
    }
    conn.execute_batch("SAVEPOINT outbox_enqueue")
        .map_err(|e| map_err(e, Ctx::Enqueue, config.table()))?;
    match insert_rows(conn, config.table(), &rows) {
        Ok(()) => conn
            .execute_batch("RELEASE outbox_enqueue")
            .map_err(|e| map_err(e, Ctx::Enqueue, config.table())),
        Err(err) => {
            // Undo this batch only; the caller decides about the rest of its transaction. If the
            // undo itself fails the caller must roll back anyway, and the first error says why.
            let _ = conn.execute_batch("ROLLBACK TO outbox_enqueue; RELEASE outbox_enqueue");
            Err(err)
        }
    }
}

/// A validated message, ready to bind to [`insert_sql`]'s `?1`..`?11` (also by
/// `crate::diesel`, so both drivers write the same rows).
pub(crate) struct Prepared<'a> {
    pub(crate) message: &'a NewMessage,
    pub(crate) id: String,
    pub(crate) payload: String,
    pub(crate) headers: String,
}

/// Check every message of the batch before anything is written.
pub(crate) fn validate_all<'a>(
    config: &SqliteConfig,
    messages: &'a [NewMessage],
) -> Result<Vec<Prepared<'a>>, Error> {
    let rows = validate_batch(messages, &config.limits())?
        .into_iter()
        .map(|valid| Prepared {
            message: valid.message,
            id: id_text(valid.message.id),
            payload: valid.payload,
            headers: valid.headers,
        })
        .collect();
    Ok(rows)
}

fn insert_rows(conn: &Connection, table: &str, rows: &[Prepared<'_>]) -> Result<(), Error> {
    let mut stmt = conn
        .prepare_cached(&insert_sql(table))
        .map_err(|e| map_err(e, Ctx::Enqueue, table))?;
    for row in rows {
        let m = row.message;
        stmt.execute(params![
            row.id,
            m.aggregate_type,
            m.aggregate_id,
            m.event_type,
            row.payload,
            row.headers,
            m.partition_key,
            m.dedup_key,
            m.not_before.map(from_time),
            m.binary.as_ref().map(|b| b.data.as_slice()),
            m.binary.as_ref().map(|b| b.content_type.as_str()),
        ])
        .map_err(|e| insert_error(e, m, table))?;
    }
    Ok(())
}

/// Name the unique constraint that refused the insert; anything else is classified as usual.
fn insert_error(err: rusqlite::Error, message: &NewMessage, table: &str) -> Error {
    if err.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation) {
        if let Some(mapped) = constraint_error(&err.to_string(), message, table) {
            return mapped;
        }
    }
    map_err(err, Ctx::Enqueue, table)
}

/// The error for SQLite's constraint message `text` (`UNIQUE constraint failed: outbox.id`) on
/// inserting `message`, when it names one of the outbox table's unique columns. Shared by both
/// drivers, so they report the same errors.
pub(crate) fn constraint_error(text: &str, message: &NewMessage, table: &str) -> Option<Error> {
    if text.contains(&format!("{table}.dedup_key")) {
        if let Some(key) = &message.dedup_key {
            return Some(Error::DuplicateKey { key: key.clone() });
        }
    }
    if text.contains(&format!("{table}.id")) {
        return Some(Error::invalid_input(format!(
            "message id {} is already in the outbox; ids must be unique (leave the generated one)",
            message.id
        )));
    }
    None
}
