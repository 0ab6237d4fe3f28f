//! The SQLite inbox on diesel (features `sqlite` and `diesel`): the same table, statements,
//! checks, answers and errors as the rusqlite functions of [`crate::sqlite`], on diesel's
//! [`SqliteConnection`] (the driver the outbox's own diesel support uses for SQLite), and on
//! diesel-async's [`SyncConnectionWrapper`] of it (the `*_async` functions, each one blocking
//! task on the wrapped connection).
//!
//! diesel's `sqlite` feature links the same SQLite library as rusqlite. As with rusqlite, begin
//! the transaction IMMEDIATE (`immediate_transaction`, as [`process`] does), so a concurrent
//! writer waits for the busy timeout at `BEGIN` instead of failing at its first write.
//!
//! ```
//! use diesel::connection::SimpleConnection;
//! use diesel::{Connection, RunQueryDsl, SqliteConnection};
//! use outbox_inbox::{sqlite, InboxConfig, Outcome};
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let mut conn = SqliteConnection::establish(":memory:")?;
//! conn.batch_execute("CREATE TABLE payments (message_id TEXT PRIMARY KEY)")?;
//! let config = InboxConfig::default();
//! sqlite::diesel::migrate(&mut conn, &config)?;
//!
//! let id = uuid::Uuid::now_v7();
//! for _delivery in 0..3 {
//!     sqlite::diesel::process(&mut conn, &config, "payments", id, |conn| {
//!         diesel::sql_query("INSERT INTO payments VALUES (?)")
//!             .bind::<diesel::sql_types::Text, _>(id.to_string())
//!             .execute(conn)?;
//!         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//!     })?;
//! }
//! let paid: i64 = diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
//!     "(SELECT count(*) FROM payments)",
//! ))
//! .get_result(&mut conn)?;
//! assert_eq!(paid, 1);
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::result::Error as DieselError;
use diesel::sql_types::Text;
use diesel::sqlite::SqliteConnection;
use diesel::RunQueryDsl;
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use outbox_traits::Error;
use uuid::Uuid;

use crate::common::{batch, check_batch, check_consumer, check_purge, inserted, receipt, receipts};
use crate::diesel_common::{purge_parts, text_rows, Stmt};
use crate::{InboxConfig, Outcome, Receipt};

/// Re-exported so users name the same diesel-async version as this crate.
pub use diesel_async;

/// Create the inbox table if it is missing ([`crate::sqlite::migration_sql`]), in one
/// IMMEDIATE transaction. Idempotent. Call it outside a transaction.
///
/// # Errors
/// As [`crate::sqlite::migrate`].
pub fn migrate(conn: &mut SqliteConnection, config: &InboxConfig) -> Result<(), Error> {
    let table = config.qualified('"');
    let sql = format!(
        "BEGIN IMMEDIATE;\n{}COMMIT;",
        crate::sqlite::migration_sql(config)
    );
    conn.batch_execute(&sql).map_err(|e| {
        // A failed statement leaves the transaction open: end it.
        let _ = conn.batch_execute("ROLLBACK");
        classify(e, "migrate", &table)
    })
}

/// [`crate::sqlite::record`] on diesel: mark `id` as processed by `consumer` in the
/// connection's open transaction. One statement, cached by the connection.
///
/// # Errors
/// As [`crate::sqlite::record`].
pub fn record(
    conn: &mut SqliteConnection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
) -> Result<Receipt, Error> {
    check_consumer(consumer)?;
    let table = config.qualified('"');
    let head = format!("INSERT INTO {table} (consumer, message_id) VALUES ");
    let inserted = Stmt::<Text>::new(text_rows(head, consumer, &[id], " ON CONFLICT DO NOTHING"))
        .execute(conn)
        .map_err(|e| classify(e, "record", &table))?;
    Ok(receipt(inserted as u64))
}

/// [`crate::sqlite::record_batch`] on diesel: one statement, one [`Receipt`] per id in order.
///
/// # Errors
/// As [`crate::sqlite::record_batch`].
pub fn record_batch(
    conn: &mut SqliteConnection,
    config: &InboxConfig,
    consumer: &str,
    ids: &[Uuid],
) -> Result<Vec<Receipt>, Error> {
    let Some(rows) = batch(consumer, ids)? else {
        return Ok(Vec::new());
    };
    let table = config.qualified('"');
    let head = format!("INSERT INTO {table} (consumer, message_id) VALUES ");
    let tail = " ON CONFLICT DO NOTHING RETURNING message_id";
    let parts = text_rows(head, consumer, &rows, tail);
    let texts: Vec<String> = Stmt::<Text>::new(parts)
        .load(conn)
        .map_err(|e| classify(e, "record", &table))?;
    let inserted = inserted(&table, texts.iter().map(|t| Uuid::parse_str(t)))?;
    Ok(receipts(ids, &inserted))
}

/// Handle one delivery exactly once, as [`crate::sqlite::process`]: in an IMMEDIATE
/// transaction on `conn`, [`record`] `id` for `consumer` and, when it is new, run `handler`
/// and commit. A duplicate rolls back without calling `handler`; a handler error rolls back
/// and is returned.
///
/// # Errors
/// The handler's error, or the inbox's as `E::from`.
pub fn process<T, E, F>(
    conn: &mut SqliteConnection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
    handler: F,
) -> Result<Outcome<T>, E>
where
    F: FnOnce(&mut SqliteConnection) -> Result<T, E>,
    E: From<Error>,
{
    /// A duplicate leaves the transaction by this error: diesel then rolls it back.
    enum Exit<E> {
        Duplicate,
        Failed(E),
    }
    impl<E> From<DieselError> for Exit<E>
    where
        E: From<Error>,
    {
        fn from(e: DieselError) -> Self {
            Exit::Failed(E::from(classify(e, "transaction", "the inbox transaction")))
        }
    }
    let outcome = conn.immediate_transaction::<T, Exit<E>, _>(|conn| {
        match record(conn, config, consumer, id).map_err(|e| Exit::Failed(E::from(e)))? {
            Receipt::Duplicate => Err(Exit::Duplicate),
            Receipt::New => handler(conn).map_err(Exit::Failed),
        }
    });
    match outcome {
        Ok(value) => Ok(Outcome::Handled(value)),
        Err(Exit::Duplicate) => Ok(Outcome::Duplicate),
        Err(Exit::Failed(e)) => Err(e),
    }
}

/// [`crate::sqlite::purge`] on diesel: delete at most `batch` marks older than `older_than`,
/// oldest first; returns how many.
///
/// # Errors
/// As [`crate::sqlite::purge`].
pub fn purge(
    conn: &mut SqliteConnection,
    config: &InboxConfig,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    purge_marks(conn, config, None, older_than, batch)
}

/// [`crate::sqlite::purge_consumer`] on diesel: [`purge`] for one consumer's marks only.
///
/// # Errors
/// As [`crate::sqlite::purge_consumer`].
pub fn purge_consumer(
    conn: &mut SqliteConnection,
    config: &InboxConfig,
    consumer: &str,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    check_consumer(consumer)?;
    purge_marks(conn, config, Some(consumer), older_than, batch)
}

fn purge_marks(
    conn: &mut SqliteConnection,
    config: &InboxConfig,
    consumer: Option<&str>,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let millis = check_purge(older_than, batch)? / 1000;
    let table = config.qualified('"');
    let head = format!(
        "DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} \
         WHERE processed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - "
    );
    let parts = purge_parts(head, millis, "", consumer, batch, ")");
    let deleted = Stmt::<Text>::new(parts)
        .execute(conn)
        .map_err(|e| classify(e, "purge", &table))?;
    Ok(deleted as u64)
}

/// The wrapped connection of diesel-async.
pub type AsyncSqliteConnection = SyncConnectionWrapper<SqliteConnection>;

/// Run `task` on the wrapped connection in one blocking task.
async fn blocking<R: Send + 'static>(
    conn: &mut AsyncSqliteConnection,
    task: impl FnOnce(&mut SqliteConnection) -> Result<R, Error> + Send + 'static,
) -> Result<R, Error> {
    conn.spawn_blocking(move |conn| Ok(task(conn)))
        .await
        .map_err(|e| classify(e, "call", "the inbox"))?
}

/// [`migrate`] on diesel-async's wrapper of a [`SqliteConnection`].
///
/// # Errors
/// As [`migrate`].
pub async fn migrate_async(
    conn: &mut AsyncSqliteConnection,
    config: &InboxConfig,
) -> Result<(), Error> {
    let config = config.clone();
    blocking(conn, move |conn| migrate(conn, &config)).await
}

/// [`record`] on diesel-async's wrapper of a [`SqliteConnection`], e.g. inside
/// `conn.transaction(async |conn| ..)`.
///
/// # Errors
/// As [`record`].
pub async fn record_async(
    conn: &mut AsyncSqliteConnection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
) -> Result<Receipt, Error> {
    check_consumer(consumer)?;
    let (config, consumer) = (config.clone(), consumer.to_owned());
    blocking(conn, move |conn| record(conn, &config, &consumer, id)).await
}

/// [`record_batch`] on diesel-async's wrapper of a [`SqliteConnection`].
///
/// # Errors
/// As [`record_batch`].
pub async fn record_batch_async(
    conn: &mut AsyncSqliteConnection,
    config: &InboxConfig,
    consumer: &str,
    ids: &[Uuid],
) -> Result<Vec<Receipt>, Error> {
    check_batch(consumer, ids)?;
    let (config, consumer, ids) = (config.clone(), consumer.to_owned(), ids.to_vec());
    blocking(conn, move |conn| {
        record_batch(conn, &config, &consumer, &ids)
    })
    .await
}

/// [`process`] on diesel-async's wrapper of a [`SqliteConnection`]: the transaction, the mark
/// and `handler` run in one blocking task on the wrapped connection.
///
/// # Errors
/// As [`process`].
pub async fn process_async<T, E, F>(
    conn: &mut AsyncSqliteConnection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
    handler: F,
) -> Result<Outcome<T>, E>
where
    F: FnOnce(&mut SqliteConnection) -> Result<T, E> + Send + 'static,
    T: Send + 'static,
    E: From<Error> + Send + 'static,
{
    let (config, consumer) = (config.clone(), consumer.to_owned());
    conn.spawn_blocking(move |conn| Ok(process(conn, &config, &consumer, id, handler)))
        .await
        .map_err(|e| E::from(classify(e, "call", "the inbox")))?
}

/// [`purge`] on diesel-async's wrapper of a [`SqliteConnection`].
///
/// # Errors
/// As [`purge`].
pub async fn purge_async(
    conn: &mut AsyncSqliteConnection,
    config: &InboxConfig,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let config = config.clone();
    blocking(conn, move |conn| purge(conn, &config, older_than, batch)).await
}

/// Map a diesel error of operation `op` on `table` by SQLite's message (diesel reports no
/// result code), as [`crate::sqlite`] maps rusqlite's: a busy or locked database is transient,
/// a disk failure unavailable, a missing table permanent with the fix, the rest permanent.
pub(crate) fn classify(err: DieselError, op: &str, table: &str) -> Error {
    let text = err.to_string();
    let message = format!("inbox {op} on {table} failed: {text}");
    if text.contains("database is locked") || text.contains("database table is locked") {
        Error::transient(
            format!("{message}; retry the delivery"),
            Some(Box::new(err)),
        )
    } else if text.contains("disk I/O error") || text.contains("database or disk is full") {
        Error::unavailable("sqlite", message, err)
    } else if text.contains("no such table") {
        Error::permanent(
            format!(
                "{message}; the inbox table is missing: call \
                 `outbox_inbox::sqlite::diesel::migrate` (or apply \
                 `outbox_inbox::sqlite::migration_sql`)"
            ),
            Some(Box::new(err)),
        )
    } else {
        Error::permanent(message, Some(Box::new(err)))
    }
}
