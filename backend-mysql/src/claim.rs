//! The relay's side of the store ([`OutboxStore`]): the claim, and the dispatch of the fenced
//! transitions to [`crate::lease`].
//!
//! The claim: one short transaction of at most ten round trips (two more when it dead-letters
//! undecodable rows), whatever the batch size.
//!
//! 1. `BEGIN` (READ COMMITTED).
//! 2. The window: the `seq` of the `4 × limit`-th pending row (none when the backlog is
//!    shorter). The claim reads no row past it, however long a blocked backlog is.
//!
//! A sharded claim ([`ClaimShard`]) does the same over its shard's rows only: the window, the
//! candidates and the look past read only rows whose key's `CRC32` (an unordered row's seq)
//! modulo the shard count is its index (`in_shard` in `sql.rs`). Every row of a key is in one
//! shard, so per-key order and the locks are unchanged, and claims of different shards never
//! find each other's candidates locked.
//! 3. Find up to `limit` claimable rows of the window in `seq` order with a plain read,
//!    skipping rows behind a pending row of their key that is not claimable (and, under
//!    `Block`, rows behind a dead one); with their keys. One more row carries the lease end,
//!    computed once by the database clock. Each key's candidates are then its first pending
//!    rows in seq order, as that read saw them.
//! 4. Lock those still claimable by primary key with `FOR UPDATE SKIP LOCKED`, reading every
//!    column the relay needs.
//! 5. Per-key order, with no further read: a key's candidates are kept up to the first one the
//!    lock did not return (locked by a concurrent claim or transition, or changed since step
//!    3: leased, completed, failed). Every kept row's earlier pending rows of its key are then
//!    in the claim, locked by it ([`keep_key_order`]).
//! 6. Fewer than `limit` kept and the window full: look past it (three queries, see
//!    `look_past`), locking claimable key heads and unordered messages.
//! 7. Lease the kept rows, by `seq`, in one `UPDATE`.
//! 8. `COMMIT`, which releases the locks of the rows that were not kept.
//!
//! The candidates stay locked from steps 4 and 6 to the commit, so the lease of step 7 finds
//! them as step 4 read them. Locking reads never wait (`SKIP LOCKED`), the other
//! reads do not lock, and step 7 updates rows this transaction already holds, so a claim cannot
//! be part of a deadlock cycle; if InnoDB reports one anyway, the claim runs again (a few
//! times) before the transient error is returned.
//!
//! Every locking read is by primary key, over seqs that plain reads found: InnoDB keeps the
//! lock of every row a locking scan of a secondary index reads, rejected rows included, until
//! the transaction ends, and among those are rows that other relays lease. A claim frozen
//! (SIGSTOP, a paused VM) after such a scan held back the other relays' completions of those
//! rows until the server ended its idle transaction. Through the primary key a rejected row is
//! unlocked at once, so a claim holds only rows it is taking, which no one else leases.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_traits::{
    async_trait, Capabilities, Claim, ClaimRequest, ClaimShard, Error, Failure, HeadPolicy,
    LeaseToken, Message, OutboxStore,
};
use sqlx::mysql::MySqlRow;
use sqlx::{MySql, Row, Transaction};
use uuid::Uuid;

use crate::error::is_deadlock;
use crate::lease;
use crate::row::{decode, decode_error, micros};
use crate::sql::{BEGIN, SENTINEL_SEQ};
use crate::store::{MysqlStore, DEADLOCK_RETRIES};
use outbox_sql_support::limits::truncate_error;
use outbox_sql_support::quarantine::{held_back, Poison};

#[async_trait]
impl OutboxStore for MysqlStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        claim(self, req).await
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        lease::complete(self, token, ids).await
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        lease::fail(self, token, failures).await
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        lease::extend(self, token, lease).await
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        lease::release(self, token, ids).await
    }

    fn capabilities(&self) -> Capabilities {
        // MariaDB has no LISTEN/NOTIFY: no wake-up source, the relay polls (adaptively).
        Capabilities::none()
            .with_concurrent_claimers(true)
            .with_deletes_published(self.config().delete_published())
            .with_sharded_claims(true)
            .with_preferred_claim_shards(PREFERRED_CLAIM_SHARDS)
    }
}

/// The claim shards a relay given none runs over MariaDB
/// ([`Capabilities::preferred_claim_shards`]): at the relay's default batch of 500, two claims
/// side by side drained as fast as one on a busy 2-core machine (at batches of 2,000, 2.79×
/// faster), four were slower, and two give a relay group something to divide (`BENCHMARKS.md`,
/// issue 31).
pub const PREFERRED_CLAIM_SHARDS: usize = 2;

/// A claim's shard as the statements' two shard parameters (see `in_shard` in `sql.rs`): how
/// many shards, and which (`(1, 0)`, every row, for an unsharded claim).
#[derive(Clone, Copy)]
struct Shard {
    count: u32,
    index: u32,
}

impl Shard {
    fn of(shard: Option<ClaimShard>) -> Self {
        match shard {
            Some(s) => Self {
                count: s.count,
                index: s.index,
            },
            None => Self { count: 1, index: 0 },
        }
    }
}

async fn claim(store: &MysqlStore, req: &ClaimRequest) -> Result<Claim, Error> {
    req.validate()?;
    let lease_us = micros("claim lease", req.lease)?;
    let limit = u64::try_from(req.limit).unwrap_or(u64::MAX);
    let mut attempt = 0;
    loop {
        match try_claim(
            store,
            req.head_policy,
            Shard::of(req.shard),
            limit,
            lease_us,
        )
        .await
        {
            Err(e) if is_deadlock(&e) && attempt < DEADLOCK_RETRIES => attempt += 1,
            Ok(claim) => {
                // Its transitions then lock the rows by seq at once (see `leased.rs`).
                store.leased.remember(
                    claim.token,
                    claim.messages.iter().map(|m| (m.id, m.seq)),
                    req.lease,
                );
                return Ok(claim);
            }
            other => return other,
        }
    }
}

async fn try_claim(
    store: &MysqlStore,
    head_policy: HeadPolicy,
    shard: Shard,
    limit: u64,
    lease_us: i64,
) -> Result<Claim, Error> {
    let sql = store.sql().await?;
    let table = store.config().qualified_table();
    let err = store.err("claim");
    let candidates_sql = match head_policy {
        HeadPolicy::Block => &sql.candidates_block,
        HeadPolicy::Skip => &sql.candidates_skip,
    };

    // The window: how many rows of the backlog (leased ones included) a claim reads in seq
    // order before it looks past them key by key.
    let window = limit.saturating_mul(CLAIM_WINDOW);
    let mut tx = store.pool().begin_with(BEGIN).await.map_err(&err)?;
    // The window's last row; none when the whole backlog fits in it.
    let bound_query = if shard.count > 1 {
        sqlx::query_scalar(&sql.past_bound_sharded)
            .bind(shard.count)
            .bind(shard.index)
    } else {
        sqlx::query_scalar(&sql.past_bound)
    };
    let bound: Option<i64> = bound_query
        .bind(window - 1)
        .fetch_optional(&mut *tx)
        .await
        .map_err(&err)?;
    let found: Vec<MySqlRow> = sqlx::query(candidates_sql)
        .bind(bound.unwrap_or(i64::MAX))
        .bind(shard.count)
        .bind(shard.index)
        // Again for the probe of the key's earlier rows (see `candidates_*`).
        .bind(shard.count)
        .bind(shard.index)
        .bind(limit)
        .bind(lease_us)
        .fetch_all(&mut *tx)
        .await
        .map_err(&err)?;
    let mut lease_until = None;
    // The candidates' seqs, and each one's key (none: an unordered message).
    let mut seqs = Vec::with_capacity(found.len());
    let mut keys: Vec<(i64, Option<String>)> = Vec::with_capacity(found.len());
    for row in &found {
        let get = |name: &str| -> Result<Option<NaiveDateTime>, Error> {
            row.try_get(name).map_err(|e| decode_error(e, table))
        };
        // The extra row holds only the lease end; candidate rows have none.
        match get("lease_until")? {
            Some(until) => lease_until = Some(until),
            None => {
                let seq = row
                    .try_get::<i64, _>("seq")
                    .map_err(|e| decode_error(e, table))?;
                let key = row
                    .try_get_unchecked::<Option<String>, _>("partition_key")
                    .map_err(|e| decode_error(e, table))?;
                seqs.push(seq);
                keys.push((seq, key));
            }
        }
    }
    let rows = lock(&mut tx, store, &sql.lock, &mut seqs, limit).await?;
    let mut candidates = Vec::with_capacity(rows.len());
    let mut poisoned = Vec::new();
    for row in &rows {
        match decode(row, table)? {
            Ok(message) => candidates.push(message),
            Err(poison) => poisoned.push(poison),
        }
    }
    // Rows that cannot become messages are dead-lettered on their own. They were locked, so
    // they leave no gap in their key's candidates: under `Block` their key's later rows are
    // held back below (`held_back`), under `Skip` they go.
    quarantine(&mut tx, store, &poisoned).await?;
    let lease_until = lease_until
        .ok_or_else(|| Error::permanent(format!("claim on {table} returned no lease end"), None))?;
    candidates.sort_by_key(|m| m.seq);
    if u64::try_from(candidates.len()).unwrap_or(u64::MAX) > limit {
        // The SQL makes this impossible (one LIMIT over one table); if it ever happens, refuse
        // loudly rather than hand out more than asked. Nothing was leased.
        return Err(Error::permanent(
            format!(
                "claim on {table} locked {} messages, more than the limit of {limit}; \
                 this is a bug in outbox-backend-mysql, please report it",
                candidates.len()
            ),
            None,
        ));
    }

    let mut chosen = keep_key_order(&keys, candidates, &poisoned);
    let got = u64::try_from(chosen.len()).unwrap_or(u64::MAX);
    if let (true, Some(bound)) = (got < limit, bound) {
        let more = look_past(
            &mut tx,
            store,
            head_policy,
            shard,
            limit - got,
            window,
            bound,
            &mut poisoned,
        )
        .await?;
        if !more.is_empty() {
            chosen.extend(more);
            chosen.sort_by_key(|m| m.seq);
            chosen.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        }
    }
    // Under Block a key's later rows wait behind its undecodable (now dead) row.
    chosen.retain(|m| !held_back(&poisoned, head_policy, m.seq, m.partition_key.as_deref()));
    let token = LeaseToken::new();
    let mut lease_until = lease_until;
    if !chosen.is_empty() {
        // The lease runs from now, when the rows are leased, not from the first statement:
        // the order check and the look past may have taken a while (observed up to ~220 ms
        // under load), and a lease shorter than asked lets another relay take the rows over
        // early. (The first statement's lease end still serves an empty claim.)
        lease_until = sqlx::query_scalar(&sql.lease_end)
            .bind(lease_us)
            .fetch_one(&mut *tx)
            .await
            .map_err(&err)?;
        let seqs: Vec<i64> = chosen.iter().map(|m| m.seq).collect();
        let leased = sqlx::query(&sql.lease)
            .bind(serde_json::to_string(&seqs).unwrap_or_default())
            .bind(token.0.hyphenated().to_string())
            .bind(lease_until)
            .execute(&mut *tx)
            .await
            .map_err(&err)?;
        if leased.rows_affected() != seqs.len() as u64 {
            // The rows are locked by this transaction, so this cannot happen; roll back
            // (by dropping the transaction) rather than return messages that are not leased.
            return Err(Error::permanent(
                format!(
                    "claim on {table} leased {} of {} locked messages; \
                     this is a bug in outbox-backend-mysql, please report it",
                    leased.rows_affected(),
                    seqs.len()
                ),
                None,
            ));
        }
    }
    tx.commit().await.map_err(&err)?;
    Ok(Claim {
        token,
        lease_until: lease_until.and_utc(),
        messages: chosen,
    })
}

/// A claim of `limit` rows reads at most `limit * CLAIM_WINDOW` rows of the backlog in seq
/// order; past them it takes only key heads.
const CLAIM_WINDOW: u64 = 4;

/// After a claim came back short from a full window (its last row is `bound`): lock up to
/// `rest` claimable heads (a key's first pending row, safe to take alone) and unordered messages
/// past the window, oldest first, so that a long blocked backlog hides no key. With at most
/// `window` keys in the per-key index they are found key by key (one index dive each, whatever
/// the backlog); with more, by reading the rows past the window in seq order. Either way by
/// plain reads, then locked by primary key (see [`lock`]).
#[allow(clippy::too_many_arguments)]
async fn look_past(
    tx: &mut Transaction<'static, MySql>,
    store: &MysqlStore,
    head_policy: HeadPolicy,
    shard: Shard,
    rest: u64,
    window: u64,
    bound: i64,
    poisoned: &mut Vec<Poison>,
) -> Result<Vec<Message>, Error> {
    let sql = store.sql().await?;
    let table = store.config().qualified_table();
    let err = store.err("claim");
    let walk: Vec<i64> = sqlx::query_scalar(&sql.past_keys)
        .bind(shard.count)
        .bind(shard.index)
        .bind(window.saturating_add(1))
        .fetch_all(&mut **tx)
        .await
        .map_err(&err)?;
    // The seqs of the rows to lock past the window (plain reads; `past_heads` checks each
    // again under its lock).
    let mut seqs: Vec<i64>;
    // The walk saw every key (rather than stopping at its limit).
    let walked_every_key = u64::try_from(walk.len()).unwrap_or(u64::MAX) <= window;
    if walked_every_key {
        seqs = walk.into_iter().filter(|head| *head > bound).collect();
        seqs.extend(
            sqlx::query_scalar::<_, i64>(&sql.past_unordered)
                .bind(bound)
                .bind(shard.count)
                .bind(shard.index)
                .bind(rest)
                .fetch_all(&mut **tx)
                .await
                .map_err(&err)?,
        );
    } else {
        let rows_sql = match head_policy {
            HeadPolicy::Block => &sql.past_rows_block,
            HeadPolicy::Skip => &sql.past_rows_skip,
        };
        seqs = sqlx::query_scalar(rows_sql)
            .bind(bound)
            .bind(shard.count)
            .bind(shard.index)
            .bind(rest)
            .fetch_all(&mut **tx)
            .await
            .map_err(&err)?;
    }
    let heads_sql = match head_policy {
        HeadPolicy::Block => &sql.past_heads_block,
        HeadPolicy::Skip => &sql.past_heads_skip,
    };
    let rows = lock(tx, store, heads_sql, &mut seqs, rest).await?;
    let mut messages = Vec::with_capacity(rows.len());
    let mut found = Vec::new();
    for row in &rows {
        match decode(row, table)? {
            Ok(message) => messages.push(message),
            Err(poison) => found.push(poison),
        }
    }
    quarantine(tx, store, &found).await?;
    poisoned.extend(found);
    Ok(messages)
}

/// Lock (with `statement`: [`crate::sql::Sql::lock`] or `past_heads_*`) the oldest rows among
/// `seqs` (sorted here) that the statement still finds claimable, at most `limit`, by primary
/// key, skipping rows locked elsewhere. The scans that found `seqs` were plain reads: a locking
/// scan of a secondary index keeps the lock of every row it read and rejected (rows other
/// relays lease among them) until the claim ends, which a frozen claim would make long.
async fn lock(
    tx: &mut Transaction<'static, MySql>,
    store: &MysqlStore,
    statement: &str,
    seqs: &mut Vec<i64>,
    limit: u64,
) -> Result<Vec<MySqlRow>, Error> {
    if seqs.is_empty() || limit == 0 {
        return Ok(Vec::new());
    }
    seqs.sort_unstable();
    seqs.dedup();
    let mut rows = sqlx::query(statement)
        .bind(serde_json::to_string(&seqs).unwrap_or_default())
        .bind(limit)
        .fetch_all(&mut **tx)
        .await
        .map_err(store.err("claim"))?;
    // The statement's list ends with a sentinel seq that `AUTO_INCREMENT` never gives (see
    // `sql::LOCKING_SEQ_LIST`). A row written by hand with that seq comes back for the
    // sentinel: kept once if it was asked for, dropped otherwise.
    let mut sentinel_wanted = seqs.binary_search(&SENTINEL_SEQ).is_ok();
    rows.retain(|row| match row.try_get::<i64, _>("seq") {
        Ok(seq) if seq == SENTINEL_SEQ => std::mem::take(&mut sentinel_wanted),
        _ => true,
    });
    Ok(rows)
}

/// Dead-letter a claim's undecodable rows (locked by its transaction) by `seq`, each with its
/// reason, in one statement.
async fn quarantine(
    tx: &mut Transaction<'static, MySql>,
    store: &MysqlStore,
    poisoned: &[Poison],
) -> Result<(), Error> {
    if poisoned.is_empty() {
        return Ok(());
    }
    let table = store.config().qualified_table();
    let list: Vec<serde_json::Value> = poisoned
        .iter()
        .map(|p| serde_json::json!({ "seq": p.seq, "reason": truncate_error(&p.reason) }))
        .collect();
    sqlx::query(&store.sql().await?.quarantine)
        .bind(serde_json::Value::Array(list).to_string())
        .execute(&mut **tx)
        .await
        .map_err(store.err("claim"))?;
    for poison in poisoned {
        poison.log(table);
    }
    Ok(())
}

/// The locked candidates that keep per-key order: unordered ones, and each key's up to its first
/// candidate that was not locked.
///
/// `keys` are the candidates (seq and key) as the plain read of step 3 found them, in seq order:
/// each key's are its first pending rows, every earlier one claimable (see `candidates_*` in
/// `sql.rs`). A candidate missing from `locked` and `poisoned` was locked by a concurrent claim
/// or transition, or changed since that read (leased, completed or failed elsewhere): the key's
/// later candidates then wait. So every earlier pending row of a kept row's key is in this
/// claim, under its lock. A row of the key that no read saw (a writer's commit after the read,
/// of a seq drawn before) is not waited for, as on every store: writers that want commit order
/// to be seq order lock their keys (`lock_keys`).
fn keep_key_order(
    keys: &[(i64, Option<String>)],
    mut locked: Vec<Message>,
    poisoned: &[Poison],
) -> Vec<Message> {
    let present: HashSet<i64> = locked
        .iter()
        .map(|m| m.seq)
        .chain(poisoned.iter().map(|p| p.seq))
        .collect();
    // Each key's first candidate that is not present: none of the key's rows from it on go.
    let mut gap: HashMap<&str, i64> = HashMap::new();
    let mut key_of: HashMap<i64, &str> = HashMap::with_capacity(keys.len());
    for (seq, key) in keys {
        let Some(key) = key.as_deref() else {
            continue;
        };
        key_of.insert(*seq, key);
        if !present.contains(seq) {
            // `keys` is in seq order: the first one found is the key's lowest.
            gap.entry(key).or_insert(*seq);
        }
    }
    locked.retain(|m| match (&m.partition_key, key_of.get(&m.seq)) {
        (None, _) => true,
        (Some(_), Some(key)) => gap.get(key).is_none_or(|g| m.seq < *g),
        // Every locked row is a candidate, so this cannot happen; held back, which is safe.
        (Some(_), None) => false,
    });
    locked
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MysqlConfig;
    use outbox_traits::{ClaimRequest, HeadPolicy, OutboxStore};

    type TestResult<T> = Result<T, Box<dyn std::error::Error>>;

    /// A migrated store on a table of its own, or `None` (test skipped) without a server.
    async fn migrated_store() -> TestResult<Option<(MysqlStore, MysqlConfig)>> {
        migrated_store_laid_out(None).await
    }

    /// [`migrated_store`] in the layout named (see `MysqlConfigBuilder::unpublished_table`).
    async fn migrated_store_laid_out(
        unpublished: Option<bool>,
    ) -> TestResult<Option<(MysqlStore, MysqlConfig)>> {
        let Some(url) = outbox_conformance_tests::env::service_url("OUTBOX_TEST_MYSQL_URL") else {
            return Ok(None);
        };
        let name = format!("outbox_test_{:016x}", rand::random::<u64>());
        let mut config = MysqlConfig::builder().table(&name);
        if let Some(on) = unpublished {
            config = config.unpublished_table(on);
        }
        let config = config.build()?;
        let store = MysqlStore::connect(&url, config.clone()).await?;
        store.migrate().await?;
        Ok(Some((store, config)))
    }

    /// Drop the tables [`migrated_store`] made.
    async fn drop_tables(store: &MysqlStore, config: &MysqlConfig) -> TestResult<()> {
        sqlx::raw_sql(&config.drop_sql())
            .execute(store.pool())
            .await?;
        Ok(())
    }

    /// Insert one message per key (the key is its aggregate id, hence its partition key).
    async fn insert_keys(
        store: &MysqlStore,
        config: &MysqlConfig,
        keys: &[&str],
    ) -> TestResult<()> {
        let rows: Vec<String> = keys
            .iter()
            .map(|k| format!("('o', '{k}', 't', '{{}}')"))
            .collect();
        sqlx::query(&format!(
            "INSERT INTO {} (aggregatetype, aggregateid, type, payload) VALUES {}",
            config.qualified_table(),
            rows.join(", ")
        ))
        .execute(store.pool())
        .await?;
        Ok(())
    }

    /// The claim these tests make: up to 10 messages, a minute's lease, dead rows blocking.
    fn request() -> ClaimRequest {
        ClaimRequest {
            limit: 10,
            lease: Duration::from_secs(60),
            head_policy: HeadPolicy::Block,
            shard: None,
        }
    }

    /// A key's first pending row locked by another transaction (a relay's transition in
    /// progress, or its claim) when a claim's locking read comes: the claim skips it, and
    /// holds back the key's later rows, which it had found claimable; another key's row goes.
    #[tokio::test]
    async fn a_claim_holds_back_a_key_behind_its_row_locked_elsewhere() -> TestResult<()> {
        let Some((store, config)) = migrated_store().await? else {
            return Ok(());
        };
        let table = config.qualified_table();
        insert_keys(&store, &config, &["k", "k", "other"]).await?;
        let head: i64 = sqlx::query_scalar(&format!(
            "SELECT MIN(seq) FROM {table} WHERE partition_key = 'k'"
        ))
        .fetch_one(store.pool())
        .await?;
        // Locked by primary key: that row alone.
        let mut elsewhere = store.pool().begin_with(BEGIN).await?;
        sqlx::query(&format!("SELECT seq FROM {table} WHERE seq = ? FOR UPDATE"))
            .bind(head)
            .fetch_one(&mut *elsewhere)
            .await?;
        let claim = store.claim(&request()).await;
        elsewhere.rollback().await?;
        let after = store.claim(&request()).await;
        drop_tables(&store, &config).await?;
        let keys: Vec<Option<String>> = claim?
            .messages
            .into_iter()
            .map(|m| m.partition_key)
            .collect();
        assert_eq!(keys, [Some("other".to_owned())]);
        // Unlocked, the key's rows come in order.
        let after: Vec<i64> = after?.messages.iter().map(|m| m.seq).collect();
        assert_eq!(after, [head, head + 1]);
        Ok(())
    }

    /// A key whose rows sit in two shards: a row the migration adding `key_hash` left without
    /// one is in its seq's shard, its key's later rows in the key's. The later row's shard
    /// hands out nothing of the key while the earlier row is pending; once the other shard's
    /// claim took and completed it, the later row goes.
    #[tokio::test]
    async fn a_key_split_across_shards_waits_for_its_row_in_the_other_shard() -> TestResult<()> {
        // Only a table with its own claim indexes went through the migration that added
        // `key_hash`; an unpublished table's rows always have it.
        let Some((store, config)) = migrated_store_laid_out(Some(false)).await? else {
            return Ok(());
        };
        let table = config.qualified_table();
        insert_keys(&store, &config, &["first"]).await?;
        let first: i64 = sqlx::query_scalar(&format!("SELECT MAX(seq) FROM {table}"))
            .fetch_one(store.pool())
            .await?;
        // A key whose hash puts it in the other shard of two than the first row's seq.
        let mut key = String::new();
        for n in 0..64 {
            let candidate = format!("k{n}");
            let hash: i64 = sqlx::query_scalar("SELECT CAST(CRC32(?) % 2 AS SIGNED)")
                .bind(&candidate)
                .fetch_one(store.pool())
                .await?;
            if hash != first % 2 {
                key = candidate;
                break;
            }
        }
        assert!(!key.is_empty());
        // The first row becomes the key's, without a hash (as the migration could leave it).
        sqlx::query(&format!(
            "UPDATE {table} SET partition_key = ?, key_hash = NULL WHERE seq = ?"
        ))
        .bind(&key)
        .bind(first)
        .execute(store.pool())
        .await?;
        insert_keys(&store, &config, &[key.as_str()]).await?;
        let shard = |index: i64| ClaimRequest {
            shard: Some(outbox_traits::ClaimShard {
                count: 2,
                index: u32::try_from(index).unwrap_or(0),
            }),
            ..request()
        };
        let later_shard = 1 - first % 2;
        let early = store.claim(&shard(later_shard)).await;
        let other = store.claim(&shard(first % 2)).await;
        let completed = match &other {
            Ok(claim) => {
                let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
                store.complete(claim.token, &ids).await
            }
            Err(_) => Ok(()),
        };
        let late = store.claim(&shard(later_shard)).await;
        drop_tables(&store, &config).await?;
        let seqs = |claim: Result<Claim, Error>| -> TestResult<Vec<i64>> {
            Ok(claim?.messages.iter().map(|m| m.seq).collect())
        };
        assert_eq!(seqs(early)?, Vec::<i64>::new());
        assert_eq!(seqs(other)?, [first]);
        completed?;
        assert_eq!(seqs(late)?.len(), 1);
        Ok(())
    }

    /// A handle's transitions of the rows its claims leased go by the seqs it remembered,
    /// without reading the rows by id: here the id index they would read is gone, and the
    /// completion and the release still go through. Each forgets its rows.
    #[tokio::test]
    async fn transitions_of_a_handle_s_own_claim_read_no_row_by_id() -> TestResult<()> {
        let Some((store, config)) = migrated_store().await? else {
            return Ok(());
        };
        let table = config.qualified_table();
        insert_keys(&store, &config, &["a", "b", "c"]).await?;
        let claim = store.claim(&request()).await?;
        let remembered = store.leased.len();
        sqlx::query(&format!(
            "ALTER TABLE {table} DROP INDEX {}",
            crate::sql::ID_INDEX
        ))
        .execute(store.pool())
        .await?;
        let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
        let completed = store.complete(claim.token, &ids[..2]).await;
        let released = store.release(claim.token, &ids[2..]).await;
        let states: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT CAST(state AS CHAR) FROM {table} ORDER BY seq"
        ))
        .fetch_all(store.pool())
        .await?;
        let left = store.leased.len();
        drop_tables(&store, &config).await?;
        assert_eq!(remembered, 3);
        completed?;
        released?;
        assert_eq!(states, ["published", "published", "pending"]);
        assert_eq!(left, 0);
        Ok(())
    }

    /// A row written by hand with the sentinel's seq (-1) is claimed like any other, once, and
    /// completed.
    #[tokio::test]
    async fn a_row_with_the_sentinel_seq_is_claimed_once() -> TestResult<()> {
        let Some((store, config)) = migrated_store().await? else {
            return Ok(());
        };
        let table = config.qualified_table();
        sqlx::query(&format!(
            "INSERT INTO {table} (seq, aggregatetype, aggregateid, type, payload)
             VALUES ({SENTINEL_SEQ}, 'o', 'k1', 't', '{{}}'), (7, 'o', 'k2', 't', '{{}}')"
        ))
        .execute(store.pool())
        .await?;
        let request = request();
        let claim = store.claim(&request).await?;
        let seqs: Vec<i64> = claim.messages.iter().map(|m| m.seq).collect();
        let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
        let completed = store.complete(claim.token, &ids).await;
        let again = store.claim(&request).await;
        drop_tables(&store, &config).await?;
        assert_eq!(seqs, [SENTINEL_SEQ, 7]);
        completed?;
        assert!(again?.messages.is_empty());
        Ok(())
    }

    /// A claim's locking read over a list of seqs that another relay leased after the list was
    /// made (every row rejected) keeps none of them locked, so a relay frozen right after it
    /// holds no other relay's completion. MariaDB unlocks a rejected row when the join goes on
    /// to the next entry of the list; without the list's sentinel the last row stayed locked
    /// and this completion failed after its 2 s lock bound.
    #[tokio::test]
    async fn a_claim_frozen_after_its_locking_read_holds_no_row_another_relay_leased(
    ) -> TestResult<()> {
        let Some((store, config)) = migrated_store().await? else {
            return Ok(());
        };
        insert_keys(&store, &config, &["k1", "k2", "k3"]).await?;
        // The other relay leases the three rows.
        let claim = store.claim(&request()).await?;
        assert_eq!(claim.messages.len(), 3);
        let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
        // The frozen relay's claim read them as candidates before that lease; its locking read
        // comes after, takes none, and its transaction stays open.
        let mut seqs: Vec<i64> = claim.messages.iter().map(|m| m.seq).collect();
        let mut frozen = store.pool().begin_with(BEGIN).await?;
        let taken = lock(&mut frozen, &store, &config.sql().lock, &mut seqs, 10).await?;
        let completed = store.complete(claim.token, &ids).await;
        frozen.rollback().await?;
        drop_tables(&store, &config).await?;
        assert!(taken.is_empty());
        completed?;
        Ok(())
    }
}
