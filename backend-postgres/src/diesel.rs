//! Enqueue through diesel-async (feature `diesel`): write outbox messages on an
//! [`AsyncPgConnection`] inside your diesel transaction, so they commit or roll back with your
//! business rows.
//!
//! ```text
//! // diesel-async 0.9: the closure is an async closure.
//! conn.transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(async |conn| {
//!     diesel::insert_into(orders::table).values(&order).execute(conn).await?;
//!     outbox_backend_postgres::diesel::enqueue(conn, &config, &event).await?;
//!     Ok(())
//! }).await?;
//! ```
//!
//! The statement, its parameters, the checks made before writing and the errors are those of
//! the sqlx functions [`crate::enqueue`] and [`crate::enqueue_batch`] (the same code builds them),
//! so the relay (which uses sqlx) reads these rows like any other; the table's insert trigger
//! wakes the relays, and with key locks on the same statement locks the batch's keys. Create the table with [`crate::PostgresStore::migrate`]
//! or [`crate::PostgresConfig::migration_sql`] (e.g. in a diesel migration).

use ::diesel::pg::Pg;
use ::diesel::query_builder::{AstPass, QueryFragment, QueryId};
use ::diesel::result::{Error as DieselError, QueryResult};
use ::diesel::sql_types::{Array, Binary, Nullable, Text, Timestamptz, Uuid};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use outbox_sql_support::diesel::{classify_insert, DieselDialect};
use outbox_traits::{Error, NewMessage};

use crate::config::PostgresConfig;
use crate::enqueue::{insert_statement, unique_violation, Columns};
use crate::error::WHAT;

/// Re-exported so users name the same diesel-async version as this crate.
pub use diesel_async;

/// Write one message to the outbox on `conn`: call it inside `conn.transaction(..)` to write it
/// in the same transaction as your business rows.
///
/// Same rules and errors as [`enqueue_batch`].
pub async fn enqueue(
    conn: &mut AsyncPgConnection,
    config: &PostgresConfig,
    message: &NewMessage,
) -> Result<(), Error> {
    enqueue_batch(conn, config, std::slice::from_ref(message)).await
}

/// Write several messages to the outbox in one statement (one round trip) on `conn`, usually
/// inside `conn.transaction(..)`.
///
/// The messages get increasing `seq` values in slice order. An empty slice writes nothing and
/// makes no round trip.
///
/// # Errors
/// The same as [`crate::enqueue_batch`]: [`Error::InvalidInput`] or [`Error::DuplicateKey`]
/// before anything is written for a bad batch; [`Error::DuplicateKey`] (dedup key still in the
/// table) or [`Error::InvalidInput`] (id already enqueued) from the database, after which
/// Postgres has aborted the transaction: return the error from the transaction's closure so
/// diesel rolls it back. Other database errors are classified from what diesel-async reports (a
/// kind and a message, no SQLSTATE): a lost connection or a read-only server is
/// `Unavailable`, a serialization failure, deadlock or lock or statement timeout is transient,
/// a missing table or column is permanent with a hint to run the migration, the rest is
/// permanent.
pub async fn enqueue_batch(
    conn: &mut AsyncPgConnection,
    config: &PostgresConfig,
    messages: &[NewMessage],
) -> Result<(), Error> {
    #[cfg(feature = "otel")]
    let messages = &*outbox_otel::capture(messages);
    if messages.is_empty() {
        return Ok(());
    }
    let columns = Columns::validate(config, messages)?;
    InsertBatch {
        sql: insert_statement(config),
        columns,
    }
    .execute(conn)
    .await
    .map_err(|err| map_insert_error(err, config, messages))?;
    Ok(())
}

/// The batch insert as a diesel query: [`insert_statement`] with the eleven arrays bound.
///
/// Not `diesel::sql_query`, which diesel never caches, so every call would prepare the
/// statement first (a second round trip). This query's text is fixed per config, so
/// diesel-async prepares it once per connection and every later batch is one round trip, as on
/// sqlx. Its text is the statement's own: each `$n` is written where the statement has it.
struct InsertBatch<'a> {
    sql: &'a str,
    columns: Columns,
}

impl QueryId for InsertBatch<'_> {
    type QueryId = ();
    // Cached by its text, which depends on the config.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for InsertBatch<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let c = &self.columns;
        let mut rest = self.sql;
        for n in 1..=11 {
            let mark = format!("${n}");
            let at = rest.find(&mark).ok_or_else(|| {
                DieselError::QueryBuilderError(format!("the insert has no {mark}").into())
            })?;
            out.push_sql(&rest[..at]);
            match n {
                1 => out.push_bind_param::<Array<Uuid>, _>(&c.ids)?,
                2 => out.push_bind_param::<Array<Text>, _>(&c.aggregate_types)?,
                3 => out.push_bind_param::<Array<Text>, _>(&c.aggregate_ids)?,
                4 => out.push_bind_param::<Array<Text>, _>(&c.event_types)?,
                5 => out.push_bind_param::<Array<Text>, _>(&c.payloads)?,
                6 => out.push_bind_param::<Array<Text>, _>(&c.headers)?,
                7 => out.push_bind_param::<Array<Nullable<Text>>, _>(&c.partition_keys)?,
                8 => out.push_bind_param::<Array<Nullable<Text>>, _>(&c.dedup_keys)?,
                9 => out.push_bind_param::<Array<Nullable<Timestamptz>>, _>(&c.not_before)?,
                10 => out.push_bind_param::<Array<Nullable<Binary>>, _>(&c.payload_bytes)?,
                _ => out.push_bind_param::<Array<Nullable<Text>>, _>(&c.content_types)?,
            }
            rest = &rest[at + mark.len()..];
        }
        out.push_sql(rest);
        Ok(())
    }
}

/// What Postgres says in the messages diesel-async passes on (no SQLSTATE).
const DIALECT: DieselDialect = DieselDialect {
    what: WHAT,
    store: "PostgresStore",
    config: "PostgresConfig",
    // diesel-async reports a lost connection as `UnableToSendCommand`, which is classified
    // without reading the message.
    unavailable: |_| false,
    transient: |text| {
        text.contains("deadlock detected") || text.starts_with("canceling statement due to")
    },
    missing: |text| text.ends_with("does not exist"),
};

/// A unique violation of the outbox's own constraints becomes the sqlx path's error; the rest
/// is classified.
fn map_insert_error(err: DieselError, config: &PostgresConfig, messages: &[NewMessage]) -> Error {
    classify_insert(err, config.qualified_table(), &DIALECT, |info| {
        unique_violation(config, messages, info.constraint_name(), info.details())
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
    fn the_query_is_the_statement_and_cacheable() -> Result<(), Box<dyn std::error::Error>> {
        for lock_keys in [false, true] {
            let config = PostgresConfig::builder().lock_keys(lock_keys).build()?;
            let query = InsertBatch {
                sql: insert_statement(&config),
                columns: Columns::validate(
                    &config,
                    &[NewMessage::new("a", "b", "c", serde_json::json!({}))],
                )?,
            };
            let text = ::diesel::debug_query::<Pg, _>(&query).to_string();
            let sql = text.split(" -- binds:").next().ok_or("empty debug query")?;
            assert_eq!(sql, insert_statement(&config));
            assert!(query.is_safe_to_cache_prepared(&Pg)?);
        }
        Ok(())
    }

    #[test]
    fn errors_are_classified() {
        let lost = classify(
            database_error(DatabaseErrorKind::UnableToSendCommand, "connection closed"),
            "enqueue",
            "t",
        );
        assert!(matches!(lost, Error::Unavailable { .. }), "{lost}");
        for transient in [
            database_error(
                DatabaseErrorKind::SerializationFailure,
                "could not serialize",
            ),
            database_error(DatabaseErrorKind::Unknown, "deadlock detected"),
            database_error(
                DatabaseErrorKind::Unknown,
                "canceling statement due to lock timeout",
            ),
        ] {
            let mapped = classify(transient, "enqueue", "t");
            assert!(mapped.is_transient(), "{mapped}");
        }
        let missing = classify(
            database_error(
                DatabaseErrorKind::Unknown,
                "relation \"public.outbox\" does not exist",
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
