//! The SQLite inbox on rusqlite (feature `sqlite`): record deliveries in the handler's own
//! transaction. Same calls and guarantees as [`crate::postgres`], synchronous; SQLite has one
//! writer at a time, so concurrent deliveries of one id simply run one after the other.
//!
//! ```
//! use outbox_inbox::{sqlite, InboxConfig, Outcome};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = rusqlite::Connection::open_in_memory()?;
//! conn.execute_batch("CREATE TABLE payments (message_id TEXT PRIMARY KEY)")?;
//! let config = InboxConfig::default();
//! sqlite::migrate(&conn, &config)?;
//!
//! let id = uuid::Uuid::now_v7();
//! for _delivery in 0..3 {
//!     sqlite::process(&mut conn, &config, "payments", id, |tx| {
//!         tx.execute("INSERT INTO payments VALUES (?1)", [id.to_string()])?;
//!         Ok::<_, Box<dyn std::error::Error>>(())
//!     })?;
//! }
//! let paid: i64 = conn.query_row("SELECT count(*) FROM payments", [], |r| r.get(0))?;
//! assert_eq!(paid, 1);
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "diesel")]
#[path = "sqlite_diesel.rs"]
pub mod diesel;

use std::time::Duration;

use outbox_traits::Error;
use rusqlite::{Connection, ErrorCode, Transaction, TransactionBehavior};
use uuid::Uuid;

use crate::common::{
    batch, check_consumer, check_purge, inserted, receipt, receipts, InboxConfig, Outcome, Receipt,
};

/// The statements that create the inbox table if missing: apply them with your own migration
/// tool, or call [`migrate`]. `processed_at` is in milliseconds since the Unix epoch (UTC).
///
/// ```
/// let sql = outbox_inbox::sqlite::migration_sql(&outbox_inbox::InboxConfig::default());
/// assert!(sql.contains("PRIMARY KEY (consumer, message_id)"));
/// ```
pub fn migration_sql(config: &InboxConfig) -> String {
    let t = config.qualified('"');
    let index = match config.schema() {
        Some(schema) => format!("\"{schema}\".{}", config.derived("processed_at", '"')),
        None => config.derived("processed_at", '"'),
    };
    let table = config.table();
    format!(
        r#"CREATE TABLE IF NOT EXISTS {t} (
    consumer     TEXT    NOT NULL CHECK (length(consumer) BETWEEN 1 AND 200),
    message_id   TEXT    NOT NULL CHECK (length(message_id) = 36),
    processed_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {index} ON "{table}" (processed_at);
"#
    )
}

/// Create the inbox table if it is missing ([`migration_sql`]), in one transaction.
/// Idempotent.
///
/// # Errors
/// A transient error when the database is locked longer than the busy timeout; permanent
/// otherwise (e.g. a read-only file).
pub fn migrate(conn: &Connection, config: &InboxConfig) -> Result<(), Error> {
    let table = config.qualified('"');
    conn.execute_batch(&format!(
        "BEGIN IMMEDIATE;\n{}COMMIT;",
        migration_sql(config)
    ))
    .map_err(|e| {
        // A failed statement leaves the transaction open: end it.
        let _ = conn.execute_batch("ROLLBACK");
        map_err(e, "migrate", &table)
    })
}

/// Mark message `id` as processed by `consumer` on `conn`: pass the transaction that applies
/// the message's effect (a [`Transaction`] derefs to a [`Connection`]), so that the mark and
/// the effect commit together. One statement, prepared once per connection.
///
/// [`Receipt::New`]: apply the effect in the same transaction, commit, then acknowledge;
/// [`Receipt::Duplicate`]: skip it and acknowledge. Begin the transaction with
/// [`TransactionBehavior::Immediate`] (as [`process`] does), so a concurrent writer waits for
/// the busy timeout at `BEGIN` instead of failing at the first write.
///
/// # Errors
/// [`Error::InvalidInput`] for a bad consumer name, before anything is written; a permanent
/// error saying to run [`migrate`] when the table is missing; a transient one when the database
/// stays locked.
pub fn record(
    conn: &Connection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
) -> Result<Receipt, Error> {
    check_consumer(consumer)?;
    let table = config.qualified('"');
    let sql = format!(
        "INSERT INTO {table} (consumer, message_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING"
    );
    let changed = conn
        .prepare_cached(&sql)
        .and_then(|mut stmt| stmt.execute((consumer, id.hyphenated().to_string())))
        .map_err(|e| map_err(e, "record", &table))?;
    Ok(receipt(changed as u64))
}

/// Mark several messages as processed by `consumer` in one statement; one [`Receipt`] per id
/// in the order given, an id given twice new at most once. An empty slice runs nothing.
///
/// # Errors
/// As [`record`]; more than [`MAX_BATCH`](crate::MAX_BATCH) ids is [`Error::InvalidInput`].
pub fn record_batch(
    conn: &Connection,
    config: &InboxConfig,
    consumer: &str,
    ids: &[Uuid],
) -> Result<Vec<Receipt>, Error> {
    let Some(rows) = batch(consumer, ids)? else {
        return Ok(Vec::new());
    };
    let table = config.qualified('"');
    let rows: Vec<String> = rows.iter().map(|id| id.hyphenated().to_string()).collect();
    let values = (0..rows.len())
        .map(|n| format!("(?1, ?{})", n + 2))
        .collect::<Vec<_>>()
        .join(", ");
    let sql = format!(
        "INSERT INTO {table} (consumer, message_id) VALUES {values} \
         ON CONFLICT DO NOTHING RETURNING message_id"
    );
    let map = |e| map_err(e, "record", &table);
    let mut stmt = conn.prepare(&sql).map_err(map)?;
    let params: Vec<&dyn rusqlite::ToSql> = std::iter::once(&consumer as &dyn rusqlite::ToSql)
        .chain(rows.iter().map(|r| r as &dyn rusqlite::ToSql))
        .collect();
    let texts = stmt
        .query_map(params.as_slice(), |row| row.get::<_, String>(0))
        .and_then(|rows| rows.collect::<Result<Vec<String>, _>>())
        .map_err(map)?;
    let inserted = inserted(&table, texts.iter().map(|t| Uuid::parse_str(t)))?;
    Ok(receipts(ids, &inserted))
}

/// Handle one delivery exactly once: begin an IMMEDIATE transaction on `conn`, [`record`] `id`
/// for `consumer`, and when it is new run `handler` with the transaction and commit. A
/// duplicate rolls back without calling `handler`; a handler error rolls back and is returned.
///
/// # Errors
/// The handler's error, or the inbox's as `E::from`.
pub fn process<T, E, F>(
    conn: &mut Connection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
    handler: F,
) -> Result<Outcome<T>, E>
where
    F: FnOnce(&Transaction<'_>) -> Result<T, E>,
    E: From<Error>,
{
    let op = |op: &'static str| move |e| map_err(e, op, "the inbox transaction");
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(op("begin"))?;
    if record(&tx, config, consumer, id)? == Receipt::Duplicate {
        tx.rollback().map_err(op("rollback"))?;
        return Ok(Outcome::Duplicate);
    }
    // A handler error drops `tx`, which rolls it back.
    let value = handler(&tx)?;
    tx.commit().map_err(op("commit"))?;
    Ok(Outcome::Handled(value))
}

/// Delete at most `batch` marks processed more than `older_than` ago, oldest first, in one
/// statement; returns how many. Call again while it returns `batch`. The age is measured on
/// SQLite's clock (`unixepoch`), the one `processed_at` was written with.
///
/// # Errors
/// As [`crate::postgres::purge`].
pub fn purge(
    conn: &Connection,
    config: &InboxConfig,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    purge_marks(conn, config, None, older_than, batch)
}

/// [`purge`] for the marks of one consumer only (the others' are kept, whatever their age).
///
/// # Errors
/// As [`purge`]; a bad consumer name is [`Error::InvalidInput`].
pub fn purge_consumer(
    conn: &Connection,
    config: &InboxConfig,
    consumer: &str,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    check_consumer(consumer)?;
    purge_marks(conn, config, Some(consumer), older_than, batch)
}

fn purge_marks(
    conn: &Connection,
    config: &InboxConfig,
    consumer: Option<&str>,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let micros = check_purge(older_than, batch)?;
    let table = config.qualified('"');
    let sql = purge_sql(&table, consumer.is_some());
    let deleted = conn
        .prepare_cached(&sql)
        .and_then(|mut stmt| match consumer {
            Some(consumer) => stmt.execute((micros / 1000, batch, consumer)),
            None => stmt.execute((micros / 1000, batch)),
        })
        .map_err(|e| map_err(e, "purge", &table))?;
    Ok(deleted as u64)
}

/// The purge statement on quoted `table`: `?1` the age in milliseconds, `?2` the batch and,
/// with `one_consumer`, `?3` the consumer.
pub(crate) fn purge_sql(table: &str, one_consumer: bool) -> String {
    let only = if one_consumer {
        "AND consumer = ?3 "
    } else {
        ""
    };
    format!(
        "DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} \
         WHERE processed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1 {only}\
         ORDER BY processed_at LIMIT ?2)"
    )
}

/// Map a rusqlite error of operation `op` on `table`: a busy or locked database is transient,
/// a missing table permanent with the fix, the rest permanent.
pub(crate) fn map_err(err: rusqlite::Error, op: &str, table: &str) -> Error {
    let message = format!("inbox {op} on {table} failed: {err}");
    match &err {
        rusqlite::Error::SqliteFailure(e, _)
            if matches!(e.code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) =>
        {
            Error::transient(
                format!("{message}; retry the delivery"),
                Some(Box::new(err)),
            )
        }
        rusqlite::Error::SqliteFailure(_, Some(text)) if text.starts_with("no such table") => {
            Error::permanent(
                format!(
                    "{message}; the inbox table is missing: call `outbox_inbox::sqlite::migrate` \
                     (or apply `migration_sql`)"
                ),
                Some(Box::new(err)),
            )
        }
        _ => Error::permanent(message, Some(Box::new(err))),
    }
}
