//! The fenced transitions of a claimed batch: complete, fail, extend, release. Each is one
//! statement whose `WHERE` carries the fence (`lease_token` = the claim's token and an unexpired
//! lease, by the database's clock), so a relay whose lease expired changes nothing.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_sql_support::limits::micros;
use outbox_traits::{Error, FailAction, Failure, LeaseToken};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

use crate::store::PostgresStore;

/// [`OutboxStore::complete`](outbox_traits::OutboxStore::complete) for the store.
pub(crate) async fn complete(
    store: &PostgresStore,
    token: LeaseToken,
    ids: &[Uuid],
) -> Result<(), Error> {
    fenced(
        store,
        "complete",
        &store.checked_sql().await?.complete,
        token,
        ids,
    )
    .await
}

/// [`OutboxStore::fail`](outbox_traits::OutboxStore::fail) for the store.
pub(crate) async fn fail(
    store: &PostgresStore,
    token: LeaseToken,
    failures: &[Failure],
) -> Result<(), Error> {
    outbox_traits::validate_failures(failures)?;
    if failures.is_empty() {
        return Ok(());
    }
    let mut ids = Vec::with_capacity(failures.len());
    let mut errors = Vec::with_capacity(failures.len());
    let mut dead = Vec::with_capacity(failures.len());
    let mut delays = Vec::with_capacity(failures.len());
    for failure in failures {
        ids.push(failure.id);
        errors.push(truncate_error(&failure.error));
        match &failure.action {
            FailAction::Retry { delay } => {
                dead.push(false);
                delays.push(micros("retry delay", *delay)?);
            }
            FailAction::Dead => {
                dead.push(true);
                delays.push(0);
            }
        }
    }
    let changed: HashSet<Uuid> = sqlx::query_scalar(&store.checked_sql().await?.fail)
        .bind(token.0)
        .bind(&ids)
        .bind(errors)
        .bind(dead)
        .bind(delays)
        .fetch_all(store.pool())
        .await
        .map_err(store.err("fail"))?
        .into_iter()
        .collect();
    Error::unless_held(&ids, &changed)
}

/// [`OutboxStore::extend`](outbox_traits::OutboxStore::extend) for the store.
pub(crate) async fn extend(
    store: &PostgresStore,
    token: LeaseToken,
    lease: Duration,
) -> Result<DateTime<Utc>, Error> {
    outbox_traits::validate_lease_extension(lease)?;
    let lease_us = micros("lease extension", lease)?;
    let row: PgRow = sqlx::query(&store.checked_sql().await?.extend)
        .bind(token.0)
        .bind(lease_us)
        .fetch_one(store.pool())
        .await
        .map_err(store.err("extend"))?;
    let held: i64 = row.try_get("held").map_err(store.err("extend"))?;
    if held == 0 {
        return Err(Error::LeaseLost { ids: Vec::new() });
    }
    row.try_get("lease_until").map_err(store.err("extend"))
}

/// [`OutboxStore::release`](outbox_traits::OutboxStore::release) for the store.
pub(crate) async fn release(
    store: &PostgresStore,
    token: LeaseToken,
    ids: &[Uuid],
) -> Result<(), Error> {
    let sql = &store.checked_sql().await?.release;
    fenced(store, "release", sql, token, ids).await
}

/// Run a fenced `... RETURNING id` transition and report the ids it did not change.
async fn fenced(
    store: &PostgresStore,
    op: &str,
    sql: &str,
    token: LeaseToken,
    ids: &[Uuid],
) -> Result<(), Error> {
    if ids.is_empty() {
        return Ok(());
    }
    let changed: HashSet<Uuid> = sqlx::query_scalar(sql)
        .bind(token.0)
        .bind(ids)
        .fetch_all(store.pool())
        .await
        .map_err(store.err(op))?
        .into_iter()
        .collect();
    Error::unless_held(ids, &changed)
}

/// The stored error text: cut to its longest length, and without NUL, which Postgres text
/// cannot hold.
fn truncate_error(text: &str) -> String {
    outbox_sql_support::limits::truncate_error(text).replace('\0', "\u{FFFD}")
}
