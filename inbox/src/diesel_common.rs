//! What the diesel-async inboxes share: statements built from SQL text and bound values (cached
//! per connection by their text, so each call is one round trip after the first), and the
//! classification of diesel errors.

use std::marker::PhantomData;

use diesel::backend::Backend;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::result::{DatabaseErrorKind, Error as DieselError, QueryResult};
use diesel::serialize::ToSql;
use diesel::sql_types::HasSqlType;
use diesel::sql_types::{BigInt, Text};
use outbox_traits::Error;
use uuid::Uuid;

/// One piece of a statement.
pub(crate) enum Part {
    /// SQL text.
    Sql(String),
    /// A bound text value.
    Text(String),
    /// A bound UUID (Postgres).
    #[allow(dead_code)] // Postgres only
    Uuid(Uuid),
    /// A bound UUID array (Postgres).
    #[allow(dead_code)] // Postgres only
    Uuids(Vec<Uuid>),
    /// A bound integer.
    BigInt(i64),
}

/// A statement whose rows, if loaded, have SQL type `ST`.
pub(crate) struct Stmt<ST> {
    parts: Vec<Part>,
    row: PhantomData<ST>,
}

impl<ST> Stmt<ST> {
    pub(crate) fn new(parts: Vec<Part>) -> Self {
        Self {
            parts,
            row: PhantomData,
        }
    }
}

impl<ST> QueryId for Stmt<ST> {
    type QueryId = ();
    // Cached by its text, which depends on the config.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<ST: 'static> Query for Stmt<ST> {
    type SqlType = ST;
}

/// Write `parts` to `out`: SQL text as it is, text and integers bound; a UUID part goes to
/// `uuid`, which binds it where the database has a UUID type and refuses it elsewhere.
fn walk<'b, DB>(
    parts: &'b [Part],
    out: &mut AstPass<'_, 'b, DB>,
    mut uuid: impl FnMut(&'b Part, &mut AstPass<'_, 'b, DB>) -> QueryResult<()>,
) -> QueryResult<()>
where
    DB: Backend + HasSqlType<Text> + HasSqlType<BigInt>,
    String: ToSql<Text, DB>,
    i64: ToSql<BigInt, DB>,
{
    for part in parts {
        match part {
            Part::Sql(sql) => out.push_sql(sql),
            Part::Text(value) => out.push_bind_param::<Text, _>(value)?,
            Part::BigInt(value) => out.push_bind_param::<BigInt, _>(value)?,
            Part::Uuid(_) | Part::Uuids(_) => uuid(part, out)?,
        }
    }
    Ok(())
}

/// The refusal of a UUID part by a database that binds ids as text (`database` names it).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
fn ids_as_text(database: &str) -> DieselError {
    DieselError::QueryBuilderError(format!("{database} statements bind ids as text").into())
}

#[cfg(feature = "postgres")]
impl<ST> QueryFragment<diesel::pg::Pg> for Stmt<ST> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, diesel::pg::Pg>) -> QueryResult<()> {
        use diesel::sql_types::{Array, Uuid as SqlUuid};
        walk(&self.parts, &mut out, |part, out| match part {
            Part::Uuid(value) => out.push_bind_param::<SqlUuid, _>(value),
            Part::Uuids(values) => out.push_bind_param::<Array<SqlUuid>, _>(values),
            _ => Ok(()),
        })
    }
}

#[cfg(feature = "mysql")]
impl<ST> QueryFragment<diesel::mysql::Mysql> for Stmt<ST> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, diesel::mysql::Mysql>) -> QueryResult<()> {
        walk(&self.parts, &mut out, |_, _| Err(ids_as_text("MariaDB")))
    }
}

// diesel (sync) runs only the query types that opt in.
#[cfg(feature = "sqlite")]
impl<ST, Conn> diesel::RunQueryDsl<Conn> for Stmt<ST> {}

#[cfg(feature = "sqlite")]
impl<ST> QueryFragment<diesel::sqlite::Sqlite> for Stmt<ST> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, diesel::sqlite::Sqlite>) -> QueryResult<()> {
        walk(&self.parts, &mut out, |_, _| Err(ids_as_text("SQLite")))
    }
}

/// An insert of marks for databases that bind ids as text, in parts: `head` (up to
/// `VALUES `), one `(consumer, id)` row per id, then `tail`.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn text_rows(head: String, consumer: &str, ids: &[Uuid], tail: &str) -> Vec<Part> {
    let mut parts = vec![Part::Sql(head)];
    for (n, id) in ids.iter().enumerate() {
        parts.push(Part::Sql(if n == 0 { "(" } else { ", (" }.into()));
        parts.push(Part::Text(consumer.to_owned()));
        parts.push(Part::Sql(", ".into()));
        parts.push(Part::Text(id.hyphenated().to_string()));
        parts.push(Part::Sql(")".into()));
    }
    parts.push(Part::Sql(tail.into()));
    parts
}

/// The purge of the diesel inboxes, in parts: `head` up to the bound age, `age` (in the unit
/// the database subtracts), `unit` after it, the consumer condition when `consumer` is given,
/// the oldest-first order and `LIMIT batch`, then `tail`.
pub(crate) fn purge_parts(
    head: String,
    age: i64,
    unit: &str,
    consumer: Option<&str>,
    batch: u32,
    tail: &str,
) -> Vec<Part> {
    let mut parts = vec![Part::Sql(head), Part::BigInt(age)];
    if !unit.is_empty() {
        parts.push(Part::Sql(unit.into()));
    }
    if let Some(consumer) = consumer {
        parts.push(Part::Sql(" AND consumer = ".into()));
        parts.push(Part::Text(consumer.to_owned()));
    }
    parts.push(Part::Sql(" ORDER BY processed_at LIMIT ".into()));
    parts.push(Part::BigInt(i64::from(batch)));
    if !tail.is_empty() {
        parts.push(Part::Sql(tail.into()));
    }
    parts
}

/// The `process` of the diesel-async inboxes: begin a transaction (a savepoint inside one) on
/// `conn`, run `record`, and when it is new run `handler` and commit; a duplicate or an error
/// rolls back. `map` classifies the transaction's own errors.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn process<C, T, E, F>(
    conn: &mut C,
    record: impl AsyncFnOnce(&mut C) -> Result<crate::Receipt, Error>,
    handler: F,
    map: fn(DieselError, &str) -> Error,
) -> Result<crate::Outcome<T>, E>
where
    C: diesel_async::AsyncConnection,
    F: AsyncFnOnce(&mut C) -> Result<T, E>,
    E: From<Error>,
{
    use crate::{Outcome, Receipt};
    use diesel_async::TransactionManager;
    C::TransactionManager::begin_transaction(conn)
        .await
        .map_err(|e| E::from(map(e, "begin")))?;
    let result = match record(conn).await {
        Err(e) => Err(E::from(e)),
        Ok(Receipt::Duplicate) => Ok(Outcome::Duplicate),
        Ok(Receipt::New) => handler(conn).await.map(Outcome::Handled),
    };
    if let Ok(Outcome::Handled(value)) = result {
        C::TransactionManager::commit_transaction(conn)
            .await
            .map_err(|e| E::from(map(e, "commit")))?;
        return Ok(Outcome::Handled(value));
    }
    let rolled_back = C::TransactionManager::rollback_transaction(conn).await;
    match (result, rolled_back) {
        // The handler's (or the mark's) error says more than the rollback's.
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(E::from(map(e, "rollback"))),
        (Ok(outcome), Ok(())) => Ok(outcome),
    }
}

/// Map a diesel error of operation `op` on `table` (`what` names the database, `module` the
/// inbox module whose `migrate` creates the table). diesel-async gives a kind and a message, no
/// error code: a lost connection or read-only server is [`Error::Unavailable`], a
/// serialization failure, deadlock or lock wait timeout transient, a missing table permanent
/// with the fix, the rest permanent.
#[allow(dead_code)] // not with SQLite alone
pub(crate) fn classify(err: DieselError, op: &str, table: &str, what: &str, module: &str) -> Error {
    let message = format!("inbox {op} on {table} failed: {err}");
    let (kind, text) = match &err {
        DieselError::DatabaseError(kind, info) => (*kind, info.message().to_owned()),
        _ => return Error::permanent(message, Some(Box::new(err))),
    };
    if matches!(
        kind,
        DatabaseErrorKind::UnableToSendCommand
            | DatabaseErrorKind::ClosedConnection
            | DatabaseErrorKind::ReadOnlyTransaction
    ) {
        Error::unavailable(what, message, err)
    } else if kind == DatabaseErrorKind::SerializationFailure
        || text.contains("deadlock")
        || text.contains("Deadlock")
        || text.contains("Lock wait timeout")
        || text.starts_with("canceling statement due to")
    {
        Error::transient(
            format!("{message}; retry the delivery"),
            Some(Box::new(err)),
        )
    } else if text.ends_with("does not exist") || text.ends_with("doesn't exist") {
        Error::permanent(
            format!(
                "{message}; the inbox table is missing: call `outbox_inbox::{module}::diesel::migrate` \
                 (or apply `outbox_inbox::{module}::migration_sql`)"
            ),
            Some(Box::new(err)),
        )
    } else {
        Error::permanent(message, Some(Box::new(err)))
    }
}
