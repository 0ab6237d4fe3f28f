//! Fenced lease transitions: complete, fail, release, extend.
//!
//! Each call is one `BEGIN IMMEDIATE` transaction for the whole batch. Every row update carries
//! the fence `state = 'leased' AND lease_token = ? AND lease_until > now` (database clock), so a
//! relay whose lease expired or was taken over changes nothing (FM-B4); rows the update did not
//! touch are reported in [`Error::LeaseLost`] after the others are committed.

use std::collections::HashSet;

use rusqlite::{params, Connection, Transaction, TransactionBehavior};

use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::uuid::Uuid;
use outbox_traits::{Error, FailAction, Failure, LeaseToken};

use crate::cancel::Caller;
use crate::error::{map_err, Ctx};
use outbox_sql_support::limits::{millis, truncate_error};

use crate::row::{id_text, to_time};
use crate::sql::Sql;

/// What to do with one message, validated before the transaction starts.
pub(crate) enum Change {
    Complete,
    Release,
    Retry { error: String, delay_ms: i64 },
    Dead { error: String },
}

/// Pair each id with `change`, dropping repeated ids (the first one wins) so that a repeated id
/// is not reported as lost after its first occurrence changed it.
pub(crate) fn same_change(ids: &[Uuid], change: impl Fn() -> Change) -> Vec<(Uuid, Change)> {
    let mut seen = HashSet::with_capacity(ids.len());
    ids.iter()
        .filter(|id| seen.insert(**id))
        .map(|id| (*id, change()))
        .collect()
}

/// The changes for [`outbox_traits::OutboxStore::fail`], with delays checked.
pub(crate) fn failures(failures: &[Failure]) -> Result<Vec<(Uuid, Change)>, Error> {
    outbox_traits::validate_failures(failures)?;
    let mut seen = HashSet::with_capacity(failures.len());
    let mut out = Vec::with_capacity(failures.len());
    for failure in failures {
        let error = truncate_error(&failure.error).to_owned();
        let change = match &failure.action {
            FailAction::Retry { delay } => Change::Retry {
                error,
                delay_ms: millis("retry delay", *delay)?,
            },
            FailAction::Dead => Change::Dead { error },
        };
        if seen.insert(failure.id) {
            out.push((failure.id, change));
        }
    }
    Ok(out)
}

/// Apply `changes` under `token` in one transaction; name the messages that were not held.
pub(crate) fn apply(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    ctx: Ctx,
    token: LeaseToken,
    changes: &[(Uuid, Change)],
    caller: &Caller,
) -> Result<(), Error> {
    if changes.is_empty() {
        return Ok(());
    }
    let err = |e| map_err(e, ctx, table);
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err)?;
    let now = db_now(&tx, sql).map_err(err)?;
    let token = id_text(token.0);
    let mut lost = Vec::new();
    for (id, change) in changes {
        let id_str = id_text(*id);
        let changed = match change {
            Change::Complete => tx
                .prepare_cached(&sql.complete)
                .and_then(|mut s| s.execute(params![id_str, token, now])),
            Change::Release => tx
                .prepare_cached(&sql.release)
                .and_then(|mut s| s.execute(params![id_str, token, now])),
            Change::Retry { error, delay_ms } => {
                tx.prepare_cached(&sql.fail_retry).and_then(|mut s| {
                    s.execute(params![
                        id_str,
                        token,
                        now,
                        error,
                        now.saturating_add(*delay_ms)
                    ])
                })
            }
            Change::Dead { error } => tx
                .prepare_cached(&sql.fail_dead)
                .and_then(|mut s| s.execute(params![id_str, token, now, error])),
        }
        .map_err(err)?;
        if changed == 0 {
            lost.push(*id);
        }
    }
    caller.commit(tx, err)?;
    if lost.is_empty() {
        Ok(())
    } else {
        Err(Error::LeaseLost { ids: lost })
    }
}

/// Move the lease end of everything still held under `token` to now + `lease_ms`.
pub(crate) fn extend(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    token: LeaseToken,
    lease_ms: i64,
    caller: &Caller,
) -> Result<DateTime<Utc>, Error> {
    let err = |e| map_err(e, Ctx::Extend, table);
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err)?;
    let now = db_now(&tx, sql).map_err(err)?;
    let until = now.saturating_add(lease_ms);
    let changed = tx
        .prepare_cached(&sql.extend)
        .and_then(|mut s| s.execute(params![id_text(token.0), now, until]))
        .map_err(err)?;
    caller.commit(tx, err)?;
    if changed == 0 {
        Err(Error::LeaseLost { ids: Vec::new() })
    } else {
        Ok(to_time(until))
    }
}

/// SQLite's clock, read once so that every row of a transaction is judged at the same instant.
pub(crate) fn db_now(tx: &Transaction<'_>, sql: &Sql) -> rusqlite::Result<i64> {
    tx.prepare_cached(&sql.now)?.query_row([], |r| r.get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_ids_are_applied_once() {
        let id = Uuid::now_v7();
        assert_eq!(same_change(&[id, id], || Change::Complete).len(), 1);
    }
}
