//! The Postgres inbox on diesel-async (features `postgres` and `diesel`): the same statements,
//! checks, answers and errors as the sqlx functions of [`crate::postgres`], on an
//! [`AsyncPgConnection`], usually inside `conn.transaction(..)`.
//!
//! ```text
//! conn.transaction::<_, outbox_inbox::Error, _>(async |conn| {
//!     if outbox_inbox::postgres::diesel::record(conn, &config, "payments", id).await?.is_new() {
//!         diesel::insert_into(payments::table).values(&payment).execute(conn).await?;
//!     }
//!     Ok(())
//! }).await?; // then ack
//! ```

use std::collections::HashSet;
use std::time::Duration;

use diesel::sql_types::Uuid as SqlUuid;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_traits::Error;
use uuid::Uuid;

use crate::common::{batch, check_consumer, check_purge, receipt, receipts};
use crate::diesel_common::{classify, purge_parts, Part, Stmt};
use crate::{InboxConfig, Outcome, Receipt};

/// Re-exported so users name the same diesel-async version as this crate.
pub use diesel_async;

fn map(err: diesel::result::Error, op: &str, table: &str) -> Error {
    classify(err, op, table, "postgres", "postgres")
}

/// Create the inbox table if it is missing ([`crate::postgres::migration_sql`]), in one
/// transaction holding an advisory lock. Idempotent. Call it outside a transaction.
///
/// # Errors
/// As [`crate::postgres::migrate`].
pub async fn migrate(conn: &mut AsyncPgConnection, config: &InboxConfig) -> Result<(), Error> {
    let table = config.qualified('"');
    let sql = format!(
        "BEGIN;\nSELECT pg_advisory_xact_lock(hashtext('outbox_inbox migrate {table}'));\n{}COMMIT;",
        crate::postgres::migration_sql(config)
    );
    conn.batch_execute(&sql)
        .await
        .map_err(|e| map(e, "migrate", &table))
}

/// [`crate::postgres::record`] on diesel-async: mark `id` as processed by `consumer` in the
/// connection's open transaction. One statement, one round trip once prepared.
///
/// # Errors
/// As [`crate::postgres::record`].
pub async fn record(
    conn: &mut AsyncPgConnection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
) -> Result<Receipt, Error> {
    check_consumer(consumer)?;
    let table = config.qualified('"');
    let inserted = Stmt::<SqlUuid>::new(vec![
        Part::Sql(format!(
            "INSERT INTO {table} (consumer, message_id) VALUES ("
        )),
        Part::Text(consumer.to_owned()),
        Part::Sql(", ".into()),
        Part::Uuid(id),
        Part::Sql(") ON CONFLICT DO NOTHING".into()),
    ])
    .execute(conn)
    .await
    .map_err(|e| map(e, "record", &table))?;
    Ok(receipt(inserted as u64))
}

/// [`crate::postgres::record_batch`] on diesel-async: one statement, one [`Receipt`] per id in
/// order.
///
/// # Errors
/// As [`crate::postgres::record_batch`].
pub async fn record_batch(
    conn: &mut AsyncPgConnection,
    config: &InboxConfig,
    consumer: &str,
    ids: &[Uuid],
) -> Result<Vec<Receipt>, Error> {
    let Some(mut rows) = batch(consumer, ids)? else {
        return Ok(Vec::new());
    };
    let table = config.qualified('"');
    rows.sort_unstable();
    let inserted: Vec<Uuid> = Stmt::<SqlUuid>::new(vec![
        Part::Sql(format!(
            "INSERT INTO {table} (consumer, message_id) SELECT "
        )),
        Part::Text(consumer.to_owned()),
        Part::Sql(", id FROM UNNEST(".into()),
        Part::Uuids(rows),
        Part::Sql(
            "::uuid[]) WITH ORDINALITY AS b(id, n) ORDER BY n \
             ON CONFLICT DO NOTHING RETURNING message_id"
                .into(),
        ),
    ])
    .load(conn)
    .await
    .map_err(|e| map(e, "record", &table))?;
    let inserted: HashSet<Uuid> = inserted.into_iter().collect();
    Ok(receipts(ids, &inserted))
}

/// [`crate::postgres::process`] on diesel-async: handle one delivery exactly once. Begin a
/// transaction on `conn` (a savepoint when one is open), [`record`] `id` for `consumer` and,
/// when it is new, run `handler` with the connection and commit. A duplicate rolls back
/// without calling `handler`; a handler error rolls back and is returned.
///
/// ```text
/// let outcome = outbox_inbox::postgres::diesel::process(&mut conn, &config, "payments", id, async |conn| {
///     diesel::insert_into(payments::table).values(&payment).execute(conn).await?;
///     Ok::<_, MyError>(())
/// }).await?; // then ack (Handled or Duplicate alike)
/// ```
///
/// # Errors
/// The handler's error, or the inbox's as `E::from`.
pub async fn process<T, E, F>(
    conn: &mut AsyncPgConnection,
    config: &InboxConfig,
    consumer: &str,
    id: Uuid,
    handler: F,
) -> Result<Outcome<T>, E>
where
    F: AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, E>,
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

/// [`crate::postgres::purge`] on diesel-async: delete at most `batch` marks older than
/// `older_than`, oldest first; returns how many.
///
/// # Errors
/// As [`crate::postgres::purge`].
pub async fn purge(
    conn: &mut AsyncPgConnection,
    config: &InboxConfig,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    purge_marks(conn, config, None, older_than, batch).await
}

/// [`crate::postgres::purge_consumer`] on diesel-async: [`purge`] for one consumer's marks only.
///
/// # Errors
/// As [`crate::postgres::purge_consumer`].
pub async fn purge_consumer(
    conn: &mut AsyncPgConnection,
    config: &InboxConfig,
    consumer: &str,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    check_consumer(consumer)?;
    purge_marks(conn, config, Some(consumer), older_than, batch).await
}

async fn purge_marks(
    conn: &mut AsyncPgConnection,
    config: &InboxConfig,
    consumer: Option<&str>,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    let micros = check_purge(older_than, batch)?;
    let table = config.qualified('"');
    let head = format!(
        "DELETE FROM {table} WHERE (consumer, message_id) IN (\
         SELECT consumer, message_id FROM {table} WHERE processed_at < now() - "
    );
    let unit = " * interval '1 microsecond'";
    let parts = purge_parts(
        head,
        micros,
        unit,
        consumer,
        batch,
        " FOR UPDATE SKIP LOCKED)",
    );
    let deleted = Stmt::<SqlUuid>::new(parts)
        .execute(conn)
        .await
        .map_err(|e| map(e, "purge", &table))?;
    Ok(deleted as u64)
}
