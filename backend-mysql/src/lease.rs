//! The fenced transitions of a claimed batch: complete, fail, extend, release.
//!
//! Each is one short transaction: lock the listed rows still held under the token (the fence:
//! `lease_token` and an unexpired lease, by the database's clock), change exactly those, commit,
//! and report the ids that were not held. A transaction InnoDB rolls back as a deadlock victim
//! runs again (a few times).
//!
//! A transition never waits for rows whose lease it lost: the rows a plain read finds still
//! held are locked by primary key with `SKIP LOCKED`, and only a skipped row that a second
//! plain read shows still held (locked by a passing statement) is waited for, at most
//! [`LOCK_WAIT_SECS`](crate::sql::LOCK_WAIT_SECS); `extend` waits at most as long. A lock wait
//! timeout is transient: the relay retries while its lease lasts. And it holds no row it does
//! not hold a lease on: locking by primary key, it unlocks at once a row that fails the fence,
//! so a relay frozen inside a transition (or a claim) holds back no other relay's calls.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_sql_support::limits::truncate_error;
use outbox_traits::{Error, FailAction, Failure, LeaseToken};
use sqlx::{MySql, Row, Transaction};
use uuid::Uuid;

use crate::error::is_deadlock;
use crate::row::{decode_error, micros, text};
use crate::sql::BEGIN;
use crate::store::{MysqlStore, DEADLOCK_RETRIES};

/// [`OutboxStore::complete`](outbox_traits::OutboxStore::complete) for the store.
pub(crate) async fn complete(
    store: &MysqlStore,
    token: LeaseToken,
    ids: &[Uuid],
) -> Result<(), Error> {
    store
        .transition(
            "complete",
            token,
            ids,
            Updates {
                first: store.sql().await?.complete_first.as_deref(),
                then: &store.sql().await?.complete,
            },
            seq_list,
        )
        .await
}

/// [`OutboxStore::fail`](outbox_traits::OutboxStore::fail) for the store.
pub(crate) async fn fail(
    store: &MysqlStore,
    token: LeaseToken,
    failures: &[Failure],
) -> Result<(), Error> {
    // Refuse a bad delay before anything changes.
    outbox_traits::validate_failures(failures)?;
    for failure in failures {
        if let FailAction::Retry { delay } = &failure.action {
            micros("retry delay", *delay)?;
        }
    }
    let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
    store
        .transition(
            "fail",
            token,
            &ids,
            Updates::one(&store.sql().await?.fail),
            |held| {
                let held: Vec<String> = held.iter().map(|row| row.id.clone()).collect();
                failure_rows(failures, &held)
            },
        )
        .await
}

/// [`OutboxStore::extend`](outbox_traits::OutboxStore::extend) for the store.
pub(crate) async fn extend(
    store: &MysqlStore,
    token: LeaseToken,
    lease: Duration,
) -> Result<DateTime<Utc>, Error> {
    outbox_traits::validate_lease_extension(lease)?;
    let lease_us = micros("lease extension", lease)?;
    let mut attempt = 0;
    loop {
        match store.try_extend(token, lease_us).await {
            Err(e) if is_deadlock(&e) && attempt < DEADLOCK_RETRIES => attempt += 1,
            other => return other,
        }
    }
}

/// [`OutboxStore::release`](outbox_traits::OutboxStore::release) for the store.
pub(crate) async fn release(
    store: &MysqlStore,
    token: LeaseToken,
    ids: &[Uuid],
) -> Result<(), Error> {
    store
        .transition(
            "release",
            token,
            ids,
            Updates::one(&store.sql().await?.release),
            seq_list,
        )
        .await
}

/// The statements a transition runs on its held rows, each with the same one parameter.
#[derive(Clone, Copy)]
struct Updates<'a> {
    /// Run first, if any (a kept completion's delete of the rows' unpublished entries).
    first: Option<&'a str>,
    then: &'a str,
}

impl<'a> Updates<'a> {
    fn one(then: &'a str) -> Self {
        Self { first: None, then }
    }
}

impl MysqlStore {
    /// Run a fenced transition: lock the listed messages still held under `token`, apply
    /// `update` to exactly those (its one parameter is `rows`' JSON for the held rows), commit,
    /// and report the ids that were not held.
    async fn transition(
        &self,
        op: &str,
        token: LeaseToken,
        ids: &[Uuid],
        update: Updates<'_>,
        rows: impl Fn(&[Held]) -> Result<String, Error>,
    ) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let list = id_list(ids);
        // The rows' seqs when this handle's claim leased them all under this token.
        let known: Option<Vec<Held>> = self.leased.recall(token, ids).map(|rows| {
            rows.into_iter()
                .map(|(id, seq)| Held {
                    id: id.hyphenated().to_string(),
                    seq,
                })
                .collect()
        });
        let mut attempt = 0;
        let held = loop {
            match self
                .try_transition(op, token, &list, known.as_deref(), update, &rows)
                .await
            {
                Err(e) if is_deadlock(&e) && attempt < DEADLOCK_RETRIES => attempt += 1,
                other => break other?,
            }
        };
        // Done with them (held or not): the next transition of these ids, if any, reads them.
        self.leased.forget(token, ids);
        let held: HashSet<Uuid> = held
            .iter()
            .map(|row| crate::row::uuid(&row.id, self.config().qualified_table()))
            .collect::<Result<_, _>>()?;
        Error::unless_held(ids, &held)
    }

    /// One attempt of [`MysqlStore::transition`]. `known`: the rows' seqs, when this handle
    /// leased every one of them under `token` (see `leased.rs`); they are then locked by seq
    /// at once, the fence checked on each, instead of first being read by id.
    async fn try_transition(
        &self,
        op: &str,
        token: LeaseToken,
        list: &str,
        known: Option<&[Held]>,
        update: Updates<'_>,
        rows: &impl Fn(&[Held]) -> Result<String, Error>,
    ) -> Result<Vec<Held>, Error> {
        let err = self.err(op);
        let sql = self.sql().await?;
        let token = token.0.hyphenated().to_string();
        let mut tx = self.pool().begin_with(BEGIN).await.map_err(&err)?;
        // The rows still held, by a plain read (or as this handle leased them); then locked by
        // primary key (see `Sql::held`). A known row no longer held fails the lock's fence and
        // is told apart below, like one skipped.
        let wanted = match known {
            Some(known) => known.to_vec(),
            None => {
                self.held_ids(&mut tx, &sql.held_unlocked, list, &token, op)
                    .await?
            }
        };
        let mut held = if wanted.is_empty() {
            Vec::new()
        } else {
            self.held_ids(&mut tx, &sql.held, &seq_list(&wanted)?, &token, op)
                .await?
        };
        if held.len() < wanted.len() {
            // Skipped rows are either no longer held (expired, taken over, finished since the
            // first read) or held but locked by another transaction. A plain read, which never
            // waits, tells them apart; only the latter are worth a (bounded) wait. A row taken
            // over by a claim that froze before committing reads as no longer held: this call
            // does not wait for that claim.
            let locked_now: HashSet<&String> = held.iter().map(|row| &row.id).collect();
            let rest: Vec<&String> = wanted
                .iter()
                .map(|row| &row.id)
                .filter(|id| !locked_now.contains(id))
                .collect();
            let rest = serde_json::to_string(&rest).unwrap_or_default();
            let locked = self
                .held_ids(&mut tx, &sql.held_unlocked, &rest, &token, op)
                .await?;
            if !locked.is_empty() {
                held.extend(
                    self.held_ids(&mut tx, &sql.held_wait, &seq_list(&locked)?, &token, op)
                        .await?,
                );
            }
        }
        held.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        if !held.is_empty() {
            // The held rows are locked until commit: no other relay or lease expiry changes
            // them in between, so they are updated without checking the fence again.
            let rows = rows(&held)?;
            for statement in update.first.into_iter().chain([update.then]) {
                sqlx::query(statement)
                    .bind(&rows)
                    .execute(&mut *tx)
                    .await
                    .map_err(&err)?;
            }
        }
        tx.commit().await.map_err(&err)?;
        Ok(held)
    }

    /// The rows of JSON id list `list` that `statement` (one of the `held*` statements) finds
    /// held under `token`, in list order.
    async fn held_ids(
        &self,
        tx: &mut Transaction<'static, MySql>,
        statement: &str,
        list: &str,
        token: &str,
        op: &str,
    ) -> Result<Vec<Held>, Error> {
        let table = self.config().qualified_table();
        sqlx::query(statement)
            .bind(list)
            .bind(token)
            .fetch_all(&mut **tx)
            .await
            .map_err(self.err(op))?
            .iter()
            .map(|row| {
                Ok(Held {
                    id: text(row, "id", table)?,
                    seq: row.try_get("seq").map_err(|e| decode_error(e, table))?,
                })
            })
            .collect()
    }
}

impl MysqlStore {
    async fn try_extend(&self, token: LeaseToken, lease_us: i64) -> Result<DateTime<Utc>, Error> {
        let err = self.err("extend");
        let token = token.0.hyphenated().to_string();
        // Find the token's rows with a plain read, then extend them by primary key: a locking
        // scan of the pending rows would wait for every row an open transaction is inserting.
        let rows = sqlx::query(&self.sql().await?.extend_find)
            .bind(lease_us)
            .bind(&token)
            .fetch_all(self.pool())
            .await
            .map_err(&err)?;
        let Some(first) = rows.first() else {
            return Err(Error::LeaseLost { ids: Vec::new() });
        };
        let until: NaiveDateTime = first
            .try_get("lease_until")
            .map_err(|e| decode_error(e, self.config().qualified_table()))?;
        let seqs = rows
            .iter()
            .map(|row| row.try_get::<i64, _>("seq"))
            .collect::<Result<Vec<i64>, _>>()
            .map_err(|e| decode_error(e, self.config().qualified_table()))?;
        // The fence is checked again, row by row, in the update: a lease that expired in
        // between is not revived.
        let done = sqlx::query(&self.sql().await?.extend)
            .bind(serde_json::to_string(&seqs).unwrap_or_default())
            .bind(until)
            .bind(&token)
            .execute(self.pool())
            .await
            .map_err(&err)?;
        if done.rows_affected() == 0 {
            return Err(Error::LeaseLost { ids: Vec::new() });
        }
        Ok(until.and_utc())
    }
}

/// A row a transition holds (locked, under its token).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    id: String,
    seq: i64,
}

/// The seqs of `held`, sorted, as a JSON array: the list `complete` and `release` update by
/// primary key, and the `held` statements lock.
fn seq_list(held: &[Held]) -> Result<String, Error> {
    let mut seqs: Vec<i64> = held.iter().map(|row| row.seq).collect();
    seqs.sort_unstable();
    // A list of integers always serializes.
    Ok(serde_json::to_string(&seqs).unwrap_or_default())
}

/// `ids` deduplicated and sorted, as a JSON array of strings: concurrent calls then lock the
/// rows they share in the same order and cannot deadlock on each other.
pub(crate) fn id_list(ids: &[Uuid]) -> String {
    let mut ids: Vec<String> = ids.iter().map(|id| id.hyphenated().to_string()).collect();
    ids.sort_unstable();
    ids.dedup();
    // A list of plain strings always serializes.
    serde_json::to_string(&ids).unwrap_or_default()
}

/// The JSON rows of `fail`'s update for the `held` ids: the first failure given for each.
fn failure_rows(failures: &[Failure], held: &[String]) -> Result<String, Error> {
    let mut by_id: HashMap<String, &Failure> = HashMap::with_capacity(failures.len());
    for failure in failures {
        by_id
            .entry(failure.id.hyphenated().to_string())
            .or_insert(failure);
    }
    let mut rows = Vec::with_capacity(held.len());
    for id in held {
        let Some(failure) = by_id.get(id) else {
            continue;
        };
        let (dead, delay_us) = match &failure.action {
            FailAction::Retry { delay } => (0, micros("retry delay", *delay)?),
            FailAction::Dead => (1, 0),
        };
        rows.push(serde_json::json!({
            "id": id,
            "error": truncate_error(&failure.error),
            "dead": dead,
            "delay_us": delay_us,
        }));
    }
    serde_json::to_string(&rows)
        .map_err(|e| Error::permanent(format!("fail: cannot encode the failures: {e}"), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_lists_are_sorted_and_unique() -> Result<(), serde_json::Error> {
        let (a, b) = (Uuid::from_u128(2), Uuid::from_u128(1));
        let list: Vec<String> = serde_json::from_str(&id_list(&[a, b, a]))?;
        assert_eq!(list, [b.to_string(), a.to_string()]);
        Ok(())
    }

    #[test]
    fn failure_rows_keep_the_first_failure_of_each_held_id(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let id = Uuid::now_v7();
        let failures = [
            Failure {
                id,
                error: "first".into(),
                action: FailAction::Retry {
                    delay: Duration::from_millis(1500),
                },
            },
            Failure {
                id,
                error: "second".into(),
                action: FailAction::Dead,
            },
        ];
        let rows: serde_json::Value =
            serde_json::from_str(&failure_rows(&failures, &[id.to_string()])?)?;
        assert_eq!(
            rows,
            serde_json::json!([{"id": id.to_string(), "error": "first", "dead": 0, "delay_us": 1_500_000}])
        );
        Ok(())
    }
}
