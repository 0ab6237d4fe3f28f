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
use ::diesel::query_builder::{AstPass, QueryFragment, QueryId};
use ::diesel::result::{Error as DieselError, QueryResult};
use ::diesel::sql_types::{Binary, Datetime, Nullable, Text};
use diesel_async::{AsyncMysqlConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_sql_support::diesel::{classify_insert, DieselDialect};
use outbox_traits::{Error, NewMessage};

use crate::config::MysqlConfig;
use crate::enqueue::{duplicate_entry, insert_statement, locked_insert, Row, Rows};
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
/// over 5,957 messages); [`Error::DuplicateKey`] (dedup key still in the table) or
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
    #[cfg(feature = "otel")]
    let messages = &*outbox_otel::capture(messages);
    if messages.is_empty() {
        return Ok(());
    }
    let rows = Rows::validate(config, messages)?;
    if let Some(text) = locked_insert(config, &rows) {
        conn.batch_execute(&text)
            .await
            .map_err(|err| map_insert_error(err, config, messages))?;
        return Ok(());
    }
    InsertRows {
        sql: insert_statement(config, messages.len()),
        rows: rows.0,
    }
    .execute(conn)
    .await
    .map_err(|err| map_insert_error(err, config, messages))?;
    Ok(())
}

/// Batches of up to this many messages keep their prepared statement on the connection (one
/// statement per batch size, so at most this many per connection and table); larger ones,
/// whose prepare costs little next to their rows, are prepared per call and closed.
const CACHED_MAX_ROWS: usize = 32;

/// The multi-row insert as a diesel query: [`insert_statement`] with each row's values bound.
///
/// Not `diesel::sql_query`, which diesel never caches, so every call would prepare the
/// statement first (a second round trip). Its text is the statement's own: each `?` is written
/// where the statement has it.
struct InsertRows<'m> {
    sql: String,
    rows: Vec<Row<'m>>,
}

impl QueryId for InsertRows<'_> {
    type QueryId = ();
    // Cached by its text, which depends on the config and the batch size.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Mysql> for InsertRows<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Mysql>) -> QueryResult<()> {
        if self.rows.len() > CACHED_MAX_ROWS {
            out.unsafe_to_cache_prepared();
        }
        let mut pieces = self.sql.split('?');
        let mut next = || {
            pieces.next().ok_or_else(|| {
                DieselError::QueryBuilderError("the insert has too few placeholders".into())
            })
        };
        for row in &self.rows {
            out.push_sql(next()?);
            out.push_bind_param::<Text, _>(&row.id)?;
            out.push_sql(next()?);
            out.push_bind_param::<Text, _>(&row.aggregate_type)?;
            out.push_sql(next()?);
            out.push_bind_param::<Text, _>(&row.aggregate_id)?;
            out.push_sql(next()?);
            out.push_bind_param::<Text, _>(&row.event_type)?;
            out.push_sql(next()?);
            out.push_bind_param::<Text, _>(&row.payload)?;
            out.push_sql(next()?);
            out.push_bind_param::<Text, _>(&row.headers)?;
            out.push_sql(next()?);
            out.push_bind_param::<Nullable<Text>, _>(&row.partition_key)?;
            out.push_sql(next()?);
            out.push_bind_param::<Nullable<Text>, _>(&row.dedup_key)?;
            out.push_sql(next()?);
            out.push_bind_param::<Nullable<Datetime>, _>(&row.not_before)?;
            out.push_sql(next()?);
            out.push_bind_param::<Nullable<Binary>, _>(&row.payload_bytes)?;
            out.push_sql(next()?);
            out.push_bind_param::<Nullable<Text>, _>(&row.content_type)?;
        }
        out.push_sql(next()?);
        if next().is_ok() {
            return Err(DieselError::QueryBuilderError(
                "the insert has more placeholders than values".into(),
            ));
        }
        Ok(())
    }
}

/// What MariaDB says in the messages diesel-async passes on (no error number).
const DIALECT: DieselDialect = DieselDialect {
    what: WHAT,
    store: "MysqlStore",
    config: "MysqlConfig",
    // diesel-async passes mysql_async's client-side errors (a lost connection) as text.
    unavailable: |text| text.starts_with("Input/output error") || text.starts_with("Driver error"),
    transient: |text| {
        text.starts_with("Deadlock found")
            || text.starts_with("Lock wait timeout exceeded")
            || text.starts_with("Query execution was interrupted")
    },
    missing: |text| {
        (text.starts_with("Table '") && text.ends_with("doesn't exist"))
            || text.starts_with("Unknown column")
    },
};

/// A duplicate on the outbox's own unique indexes becomes the sqlx path's error; the rest is
/// classified.
fn map_insert_error(err: DieselError, config: &MysqlConfig, messages: &[NewMessage]) -> Error {
    classify_insert(err, config.qualified_table(), &DIALECT, |info| {
        duplicate_entry(info.message(), messages)
    })
}

/// Map a diesel error from operation `op` on `table` to the contract's error.
#[cfg(test)]
fn classify(err: DieselError, op: &str, table: &str) -> Error {
    outbox_sql_support::diesel::classify(err, op, table, &DIALECT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::diesel::result::DatabaseErrorKind;
    use outbox_traits::ErrorKind;

    fn database_error(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn the_query_is_the_statement_and_small_batches_are_cacheable() {
        let config = MysqlConfig::default();
        for n in [1, 3, CACHED_MAX_ROWS, CACHED_MAX_ROWS + 1] {
            let messages: Vec<NewMessage> = (0..n)
                .map(|_| NewMessage::new("a", "b", "c", serde_json::json!({})))
                .collect();
            let query = InsertRows {
                sql: insert_statement(&config, n),
                rows: Rows::validate(&config, &messages).unwrap().0,
            };
            let text = ::diesel::debug_query::<Mysql, _>(&query).to_string();
            let sql = text.split(" -- binds:").next().unwrap();
            assert_eq!(sql, insert_statement(&config, n));
            assert_eq!(
                query.is_safe_to_cache_prepared(&Mysql).unwrap(),
                n <= CACHED_MAX_ROWS
            );
        }
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
        assert!(
            missing.to_string().contains("run `outbox-relay migrate`"),
            "{missing}"
        );
        let other = classify(DieselError::NotFound, "enqueue", "t");
        assert_eq!(other.kind(), ErrorKind::Permanent);
    }
}
