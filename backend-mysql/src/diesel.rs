//! Enqueue through diesel-async (feature `diesel`): write outbox messages on an
//! [`AsyncMysqlConnection`] inside your diesel transaction, so they commit or roll back with
//! your business rows.
//!
//! ```text
//! // diesel-async 0.9: the closure is an async closure.
//! conn.transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(async |conn| {
//!     diesel::insert_into(orders::table).values(&order).execute(conn).await?;
//!     outbox_backend_mysql::diesel::enqueue(conn, &config, &event).await?;
//!     Ok(())
//! }).await?;
//! ```
//!
//! The statement, its parameters, the checks made before writing and the errors are those of
//! the sqlx functions [`crate::enqueue`] and [`crate::enqueue_batch`] (the same code builds them),
//! so the relay (which uses sqlx) reads these rows like any other. Create the table with
//! [`crate::MysqlStore::migrate`] or [`crate::MysqlConfig::migration_sql`] (e.g. in a diesel
//! migration).

use ::diesel::mysql::Mysql;
use ::diesel::result::{DatabaseErrorKind, Error as DieselError};
use ::diesel::sql_types::{Datetime, Nullable, Text};
use diesel_async::{AsyncMysqlConnection, RunQueryDsl};
use outbox_traits::{Error, NewMessage};

use crate::config::MysqlConfig;
use crate::enqueue::{duplicate_entry, insert_statement, Rows};
use crate::error::WHAT;

/// Re-exported so users name the same diesel-async version as this crate.
pub use diesel_async;

/// Write one message to the outbox on `conn`: call it inside `conn.transaction(..)` to write it
/// in the same transaction as your business rows.
///
/// Same rules and errors as [`enqueue_batch`].
pub async fn enqueue(
    conn: &mut AsyncMysqlConnection,
    config: &MysqlConfig,
    message: &NewMessage,
) -> Result<(), Error> {
    enqueue_batch(conn, config, std::slice::from_ref(message)).await
}

/// Write several messages to the outbox in one multi-row `INSERT` (one round trip) on `conn`,
/// usually inside `conn.transaction(..)`.
///
/// The messages get increasing `seq` values in slice order. An empty slice writes nothing and
/// makes no round trip.
///
/// # Errors
/// The same as [`crate::enqueue_batch`]: [`Error::InvalidInput`] or [`Error::DuplicateKey`]
/// before anything is written for a bad batch (including keys over 255 characters and batches
/// over 7,281 messages); [`Error::DuplicateKey`] (dedup key still in the table) or
/// [`Error::InvalidInput`] (id already enqueued) from the database, after which the
/// transaction is still usable (MariaDB rolls back only the failed statement). Other database
/// errors are classified from what diesel-async reports (a kind and a message, no error
/// number): a lost connection or a read-only server is `Unavailable`, a deadlock, lock wait
/// timeout or interrupted statement is transient, a missing table or column is permanent with
/// a hint to run the migration, the rest is permanent.
pub async fn enqueue_batch(
    conn: &mut AsyncMysqlConnection,
    config: &MysqlConfig,
    messages: &[NewMessage],
) -> Result<(), Error> {
    if messages.is_empty() {
        return Ok(());
    }
    let rows = Rows::validate(config, messages)?;
    // Boxed: the number of parameters depends on the batch.
    let mut query =
        ::diesel::sql_query(insert_statement(config, messages.len())).into_boxed::<Mysql>();
    for row in rows.0 {
        query = query
            .bind::<Text, _>(row.id)
            .bind::<Text, _>(row.aggregate_type)
            .bind::<Text, _>(row.aggregate_id)
            .bind::<Text, _>(row.event_type)
            .bind::<Text, _>(row.payload)
            .bind::<Text, _>(row.headers)
            .bind::<Nullable<Text>, _>(row.partition_key)
            .bind::<Nullable<Text>, _>(row.dedup_key)
            .bind::<Nullable<Datetime>, _>(row.not_before);
    }
    query
        .execute(conn)
        .await
        .map_err(|err| map_insert_error(err, config, messages))?;
    Ok(())
}

/// A duplicate on the outbox's own unique indexes becomes the sqlx path's error; the rest is
/// classified.
fn map_insert_error(err: DieselError, config: &MysqlConfig, messages: &[NewMessage]) -> Error {
    if let DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, info) = &err {
        if let Some(mapped) = duplicate_entry(info.message(), messages) {
            return mapped;
        }
    }
    classify(err, "enqueue", config.qualified_table())
}

/// Map a diesel error from operation `op` on `table` to the contract's error.
fn classify(err: DieselError, op: &str, table: &str) -> Error {
    let message = format!("{op} on {table} failed: {err}");
    let kind = match &err {
        DieselError::DatabaseError(kind, info) => Some((kind, info.message())),
        _ => None,
    };
    let unavailable = |err: DieselError, message: String| Error::Unavailable {
        what: WHAT.to_owned(),
        message,
        source: Some(Box::new(err)),
    };
    match kind {
        Some((
            DatabaseErrorKind::UnableToSendCommand
            | DatabaseErrorKind::ClosedConnection
            | DatabaseErrorKind::ReadOnlyTransaction,
            _,
        )) => unavailable(err, message),
        // diesel-async passes mysql_async's client-side errors (a lost connection) as text.
        Some((_, text))
            if text.starts_with("Input/output error") || text.starts_with("Driver error") =>
        {
            unavailable(err, message)
        }
        Some((DatabaseErrorKind::SerializationFailure, _)) => {
            Error::transient(format!("{message}; retry later"), Some(Box::new(err)))
        }
        Some((_, text))
            if text.starts_with("Deadlock found")
                || text.starts_with("Lock wait timeout exceeded")
                || text.starts_with("Query execution was interrupted") =>
        {
            Error::transient(format!("{message}; retry later"), Some(Box::new(err)))
        }
        Some((_, text))
            if (text.starts_with("Table '") && text.ends_with("doesn't exist"))
                || text.starts_with("Unknown column") =>
        {
            Error::permanent(
                format!(
                    "{message}; the outbox table is missing or outdated: run `migrate()` or \
                     apply `MysqlConfig::migration_sql()`"
                ),
                Some(Box::new(err)),
            )
        }
        _ => Error::permanent(message, Some(Box::new(err))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::ErrorKind;

    fn database_error(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn errors_are_classified() {
        for down in [
            database_error(
                DatabaseErrorKind::Unknown,
                "Driver error: `Connection to the server is closed.'",
            ),
            database_error(
                DatabaseErrorKind::Unknown,
                "Input/output error: broken pipe",
            ),
            database_error(DatabaseErrorKind::ReadOnlyTransaction, "read only"),
        ] {
            let mapped = classify(down, "enqueue", "t");
            assert!(matches!(mapped, Error::Unavailable { .. }), "{mapped}");
        }
        for transient in [
            "Deadlock found when trying to get lock; try restarting transaction",
            "Lock wait timeout exceeded; try restarting transaction",
        ] {
            let mapped = classify(
                database_error(DatabaseErrorKind::Unknown, transient),
                "enqueue",
                "t",
            );
            assert!(mapped.is_transient(), "{mapped}");
        }
        let missing = classify(
            database_error(
                DatabaseErrorKind::Unknown,
                "Table 'test.outbox' doesn't exist",
            ),
            "enqueue",
            "t",
        );
        assert_eq!(missing.kind(), ErrorKind::Permanent);
        assert!(missing.to_string().contains("run `migrate()`"), "{missing}");
        let other = classify(DieselError::NotFound, "enqueue", "t");
        assert_eq!(other.kind(), ErrorKind::Permanent);
    }
}
