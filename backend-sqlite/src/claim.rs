//! The relay's side of the store ([`OutboxStore`]): the claim, and the dispatch of the fenced
//! transitions to [`crate::lease`].
//!
//! The claim: one `BEGIN IMMEDIATE` transaction that walks the backlog in `seq` order and leases
//! what per-key order allows.

use std::borrow::Cow;
use std::collections::HashMap;

use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, Transaction, TransactionBehavior};

use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::uuid::Uuid;
use outbox_traits::{
    async_trait, Capabilities, Claim, ClaimRequest, Error, Failure, HeadPolicy, LeaseToken,
    OutboxStore,
};
use std::time::Duration;

use crate::cancel::Caller;
use crate::error::{map_err, Ctx};
use crate::lease::{self, db_now, same_change, Change};
use outbox_sql_support::limits::millis;

use crate::row::{decode, id_text, to_time};
use crate::sql::Sql;
use crate::store::SqliteStore;
use outbox_sql_support::quarantine::{held_back, Poison};

/// What the walk knows about one partition key so far.
struct KeyState {
    /// An earlier message of the key is not being handed out (leased to someone else, waiting,
    /// or dead under `Block`): every later message of the key must wait too.
    blocked: bool,
    /// `seq` of the key's first dead message, looked up only under [`HeadPolicy::Block`].
    first_dead: Option<i64>,
}

/// Lease up to `limit` messages for `lease_ms` under a new token.
///
/// Why a walk and not one `UPDATE ... WHERE seq IN (SELECT ...)`: the per-key rule ("every
/// earlier unpublished message of the key is in this claim") needs, for each candidate, the
/// state of everything before it in its key. Walking the live index (pending and leased rows
/// only, covering) once in `seq` order answers it for all keys at once: the first row of a key
/// that is not handed out marks the key blocked, and later rows of a blocked key are skipped with
/// a hash lookup. The walk stops as soon as `limit` rows are picked, so a claim over a large
/// due backlog reads about `limit` index entries; rows that are not due (leased, waiting for a
/// retry or a not-before time) in front of the due ones are read once each. Dead rows are not in
/// the live index; under `Block` one indexed probe per key seen (skipped entirely when there is
/// no dead row at all) finds the key's first dead message.
///
/// `BEGIN IMMEDIATE` takes the write lock before the walk reads anything, so no other claim can
/// interleave (exclusive leases) and the read-then-write cannot fail with `SQLITE_BUSY` past the
/// busy timeout (FM-E3).
#[async_trait]
impl OutboxStore for SqliteStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        req.validate()?;
        let lease_ms = millis("lease", req.lease)?;
        let (limit, policy) = (req.limit, req.head_policy);
        self.run(Ctx::Claim, move |conn, sql, table, caller| {
            claim(conn, sql, table, limit, lease_ms, policy, caller)
        })
        .await
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        let changes = same_change(ids, || Change::Complete);
        self.run(Ctx::Complete, move |conn, sql, table, caller| {
            lease::apply(conn, sql, table, Ctx::Complete, token, &changes, caller)
        })
        .await
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        let changes = lease::failures(failures)?;
        self.run(Ctx::Fail, move |conn, sql, table, caller| {
            lease::apply(conn, sql, table, Ctx::Fail, token, &changes, caller)
        })
        .await
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        outbox_traits::validate_lease_extension(lease)?;
        let lease_ms = millis("lease", lease)?;
        self.run(Ctx::Extend, move |conn, sql, table, caller| {
            lease::extend(conn, sql, table, token, lease_ms, caller)
        })
        .await
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        let changes = same_change(ids, || Change::Release);
        self.run(Ctx::Release, move |conn, sql, table, caller| {
            lease::apply(conn, sql, table, Ctx::Release, token, &changes, caller)
        })
        .await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .with_concurrent_claimers(true)
            .with_deletes_published(self.config().delete_published())
    }
}

fn claim(
    conn: &mut Connection,
    sql: &Sql,
    table: &str,
    limit: usize,
    lease_ms: i64,
    policy: HeadPolicy,
    caller: &Caller,
) -> Result<Claim, Error> {
    let err = |e| map_err(e, Ctx::Claim, table);
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err)?;
    let now = db_now(&tx, sql).map_err(err)?;
    let until = now.saturating_add(lease_ms);
    let picked = pick(&tx, sql, now, limit, policy).map_err(err)?;
    let token = LeaseToken::new();
    let mut messages = Vec::with_capacity(picked.len());
    if !picked.is_empty() {
        let token_text = id_text(token.0);
        let mut stmt = tx.prepare_cached(&sql.lease).map_err(err)?;
        let mut poisoned: Vec<Poison> = Vec::new();
        for seq in picked {
            match stmt
                .query_row(params![token_text, until, seq], decode)
                .map_err(err)?
            {
                Ok(message) => {
                    if held_back(
                        &poisoned,
                        policy,
                        message.seq,
                        message.partition_key.as_deref(),
                    ) {
                        // Under Block the key waits behind its undecodable (now dead) row.
                        tx.prepare_cached(&sql.unlease)
                            .and_then(|mut s| s.execute(params![seq]))
                            .map_err(err)?;
                    } else {
                        messages.push(message);
                    }
                }
                Err(poison) => {
                    // A row that cannot become a message is dead-lettered on its own; the
                    // rest of the claim flows on.
                    tx.prepare_cached(&sql.quarantine)
                        .and_then(|mut s| s.execute(params![seq, poison.reason]))
                        .map_err(err)?;
                    poison.log(table);
                    poisoned.push(poison);
                }
            }
        }
    }
    caller.commit(tx, err)?;
    Ok(Claim {
        token,
        lease_until: to_time(until),
        messages,
    })
}

/// The `seq`s to lease, in `seq` order.
fn pick(
    tx: &Transaction<'_>,
    sql: &Sql,
    now: i64,
    limit: usize,
    policy: HeadPolicy,
) -> rusqlite::Result<Vec<i64>> {
    let check_dead = policy == HeadPolicy::Block
        && tx
            .prepare_cached(&sql.any_dead)?
            .query_row([], |r| r.get::<_, bool>(0))?;
    let mut first_dead = if check_dead {
        Some(tx.prepare_cached(&sql.first_dead_of_key)?)
    } else {
        None
    };
    let mut keys: HashMap<String, KeyState> = HashMap::new();
    let mut picked = Vec::with_capacity(limit.min(4096));
    let mut walk = tx.prepare_cached(&sql.walk)?;
    let mut rows = walk.query([now])?;
    while let Some(row) = rows.next()? {
        let seq: i64 = row.get(0)?;
        let due = row.get::<_, Option<bool>>(2)?.unwrap_or(false);
        match key_of(row.get_ref(1)?) {
            // Unordered messages flow on their own.
            None => {
                if due {
                    picked.push(seq);
                }
            }
            Some(key) => {
                if !keys.contains_key(key.as_ref()) {
                    let dead = match first_dead.as_mut() {
                        Some(stmt) => stmt.query_row([key.as_ref()], |r| r.get(0))?,
                        None => None,
                    };
                    keys.insert(
                        key.clone().into_owned(),
                        KeyState {
                            blocked: false,
                            first_dead: dead,
                        },
                    );
                }
                // Present: inserted just above if it was missing.
                let Some(state) = keys.get_mut(key.as_ref()) else {
                    continue;
                };
                if state.blocked {
                    continue;
                }
                if !due || state.first_dead.is_some_and(|dead| dead < seq) {
                    state.blocked = true;
                    continue;
                }
                picked.push(seq);
            }
        }
        if picked.len() >= limit {
            break;
        }
    }
    Ok(picked)
}

/// The partition key of a walked row. The column has TEXT affinity and this crate writes text;
/// a hand-inserted blob is read lossily rather than failing every claim.
fn key_of(value: ValueRef<'_>) -> Option<Cow<'_, str>> {
    match value {
        ValueRef::Null => None,
        ValueRef::Text(bytes) | ValueRef::Blob(bytes) => Some(String::from_utf8_lossy(bytes)),
        ValueRef::Integer(i) => Some(Cow::Owned(i.to_string())),
        ValueRef::Real(f) => Some(Cow::Owned(f.to_string())),
    }
}
