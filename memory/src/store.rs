//! The in-memory reference store.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_traits::{
    BlockedKey, Capabilities, Claim, ClaimRequest, Counts, DeadMessage, Error, FailAction, Failure,
    HeadPolicy, LeaseToken, Limits, Message, NewMessage, OutboxAdmin, OutboxStore, StoreStatus,
    WakeSource,
};
use tokio::sync::watch;
use uuid::Uuid;

use crate::clock::Clock;
use crate::defect::Defect;

/// Where a stored message stands.
#[derive(Debug, Clone, Copy, PartialEq)]
enum RowState {
    Pending,
    Leased {
        token: LeaseToken,
        until: DateTime<Utc>,
    },
    Published {
        at: DateTime<Utc>,
    },
    Dead,
}

#[derive(Debug, Clone)]
struct Row {
    message: Message,
    /// `Some(tx)` while the enqueuing transaction is open: invisible to everyone else.
    tx: Option<u64>,
    state: RowState,
    /// Earliest claim time: the not-before time, or the retry time after a failure.
    due: DateTime<Utc>,
    last_error: Option<String>,
}

impl Row {
    fn held_by(&self, token: LeaseToken, now: DateTime<Utc>) -> bool {
        self.tx.is_none()
            && matches!(self.state, RowState::Leased { token: t, until } if t == token && until > now)
    }
}

#[derive(Debug, Default)]
struct State {
    next_seq: i64,
    next_tx: u64,
    /// Rows by `seq`, so iteration is insert order.
    rows: BTreeMap<i64, Row>,
    seq_of: HashMap<Uuid, i64>,
    /// Every id ever inserted: ids are never reused, even after a purge or discard.
    used_ids: HashSet<Uuid>,
    /// Dedup keys of existing rows (committed or not), like a unique index.
    dedup: HashMap<String, i64>,
    /// Highest `seq` handed out so far; only the cursor defect reads it.
    #[cfg_attr(not(feature = "defects"), allow(dead_code))]
    cursor: i64,
}

struct Inner {
    state: Mutex<State>,
    clock: Arc<Clock>,
    limits: Limits,
    /// Bumped on every commit; [`WakeSource`]s wait for it to change.
    commits: watch::Sender<u64>,
    /// Always `None` unless built with the `defects` feature and asked for one.
    defect: Option<Defect>,
    /// Completing a message deletes it (see [`MemoryStore::deleting_published`]).
    deletes_published: bool,
    /// Claims honour [`ClaimRequest::shard`] (see [`MemoryStore::unsharded`]).
    sharded_claims: bool,
    /// Relay groups (see `group.rs`).
    groups: Mutex<crate::group::Groups>,
}

/// An in-memory [`OutboxStore`] + [`OutboxAdmin`] that follows the contract to the letter.
///
/// It is the reference the conformance suite is checked against, and a store for examples and
/// unit tests of code built on the relay. Cloning is cheap and shares the same messages, so one
/// clone can serve as the relay's store while the test enqueues through another.
///
/// It declares concurrent claimers, wake-ups (one per commit) and, unless built with
/// [`MemoryStore::unsharded`], sharded claims ([`Capabilities::sharded_claims`]): a claim with a
/// [`ClaimShard`](outbox_traits::ClaimShard) looks only at the rows of that shard, a partition
/// key's shard being the FNV-1a hash of its bytes modulo the shard count, and an unordered
/// message's its `seq` modulo the count.
///
/// Time comes from its own [`Clock`], which starts at the real current time and moves only when
/// the test calls [`Clock::advance`] (via [`MemoryStore::clock`]).
///
/// ```
/// # tokio_test_block_on(async {
/// use outbox_memory::MemoryStore;
/// use outbox_traits::{ClaimRequest, HeadPolicy, NewMessage, OutboxStore};
/// use std::time::Duration;
///
/// let store = MemoryStore::new();
/// store.enqueue([NewMessage::new("order", "o-1", "order.placed", serde_json::json!({}))]).unwrap();
/// let req = ClaimRequest { limit: 10, lease: Duration::from_secs(30), head_policy: HeadPolicy::Block, shard: None };
/// let claim = store.claim(&req).await.unwrap();
/// assert_eq!(claim.messages.len(), 1);
/// store.complete(claim.token, &[claim.messages[0].id]).await.unwrap();
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("now", &self.inner.clock.now())
            .finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store with its own clock (stopped at the real current time) and default limits.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(Clock::new()))
    }

    /// An empty store reading time from `clock` (share one clock between stores to move them
    /// together).
    pub fn with_clock(clock: Arc<Clock>) -> Self {
        Self::build(clock, Limits::default(), None, false, true)
    }

    /// The same store with other enqueue limits.
    pub fn with_limits(clock: Arc<Clock>, limits: Limits) -> Self {
        Self::build(clock, limits, None, false, true)
    }

    /// An empty store reading time from `clock` that deletes messages as they are published
    /// instead of keeping them ([`Capabilities::deletes_published`]), like a database store
    /// configured to delete on publish.
    pub fn deleting_published(clock: Arc<Clock>) -> Self {
        Self::build(clock, Limits::default(), None, true, true)
    }

    /// A store that breaks the contract on purpose, as `defect` says. Only for proving that a
    /// test suite catches such a store.
    #[cfg(feature = "defects")]
    pub fn with_defect(defect: Defect) -> Self {
        Self::build(
            Arc::new(Clock::new()),
            Limits::default(),
            Some(defect),
            false,
            true,
        )
    }

    /// An empty store reading time from `clock` that does not declare
    /// [`Capabilities::sharded_claims`] and ignores [`ClaimRequest::shard`], like the SQLite and
    /// MariaDB stores: every claim looks at every key.
    pub fn unsharded(clock: Arc<Clock>) -> Self {
        Self::build(clock, Limits::default(), None, false, false)
    }

    fn build(
        clock: Arc<Clock>,
        limits: Limits,
        defect: Option<Defect>,
        deletes_published: bool,
        sharded_claims: bool,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    next_seq: 1,
                    next_tx: 1,
                    ..State::default()
                }),
                clock,
                limits,
                commits: watch::Sender::new(0),
                defect,
                deletes_published,
                sharded_claims,
                groups: Mutex::default(),
            }),
        }
    }

    /// The store's clock: call `advance` on it to expire leases or make retries due.
    pub fn clock(&self) -> &Arc<Clock> {
        &self.inner.clock
    }

    /// Open a transaction. Its messages get their `seq` when enqueued, become visible when it
    /// commits, and vanish when it rolls back or is dropped.
    pub fn begin(&self) -> MemoryTx {
        let id = {
            let mut state = self.state();
            let id = state.next_tx;
            state.next_tx += 1;
            id
        };
        MemoryTx {
            store: self.clone(),
            id,
            open: true,
        }
    }

    /// Enqueue `messages` in one transaction of their own and commit it.
    pub fn enqueue(&self, messages: impl IntoIterator<Item = NewMessage>) -> Result<(), Error> {
        let mut tx = self.begin();
        tx.enqueue_batch(messages)?;
        tx.commit();
        Ok(())
    }

    /// Every committed message that is not yet published or dead, oldest first, with its
    /// attempts so far. For assertions in tests.
    pub fn unpublished(&self) -> Vec<Message> {
        self.state()
            .rows
            .values()
            .filter(|row| {
                row.tx.is_none() && matches!(row.state, RowState::Pending | RowState::Leased { .. })
            })
            .map(|row| row.message.clone())
            .collect()
    }

    /// Run `f` on the relay groups under their lock.
    pub(crate) fn with_groups<R>(&self, f: impl FnOnce(&mut crate::group::Groups) -> R) -> R {
        let mut groups = self
            .inner
            .groups
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut groups)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-applied transition: every method
        // validates before it mutates, so the data behind a poisoned lock is still consistent.
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn now(&self) -> DateTime<Utc> {
        self.inner.clock.now()
    }

    /// The ids of the dead rows among `seqs`.
    fn dead_ids(&self, seqs: &[i64]) -> Vec<Uuid> {
        let state = self.state();
        seqs.iter()
            .filter_map(|seq| state.rows.get(seq))
            .filter(|row| row.tx.is_none() && row.state == RowState::Dead)
            .map(|row| row.message.id)
            .collect()
    }

    /// The deliberate defect this store has, if any.
    pub(crate) fn defect(&self) -> Option<Defect> {
        self.inner.defect
    }

    fn has(&self, defect: Defect) -> bool {
        self.inner.defect == Some(defect)
    }

    fn insert(&self, tx: u64, messages: Vec<NewMessage>) -> Result<(), Error> {
        let mut payloads = Vec::with_capacity(messages.len());
        for message in &messages {
            payloads.push(message.validate(&self.inner.limits)?);
        }
        let mut state = self.state();
        let mut batch_ids = HashSet::new();
        let mut batch_keys = HashSet::new();
        for message in &messages {
            if state.used_ids.contains(&message.id) || !batch_ids.insert(message.id) {
                return Err(Error::invalid_input(format!(
                    "message id {} was already enqueued; ids must be unique (leave the generated one)",
                    message.id
                )));
            }
            if let Some(key) = &message.dedup_key {
                if state.dedup.contains_key(key) || !batch_keys.insert(key.clone()) {
                    return Err(Error::DuplicateKey { key: key.clone() });
                }
            }
        }
        let now = self.now();
        let binary_dropped = self.has(Defect::BinaryDropped);
        for (message, payload) in messages.into_iter().zip(payloads) {
            let seq = state.next_seq;
            state.next_seq += 1;
            state.used_ids.insert(message.id);
            state.seq_of.insert(message.id, seq);
            if let Some(key) = &message.dedup_key {
                state.dedup.insert(key.clone(), seq);
            }
            let due = message.not_before.map_or(now, |at| at.max(now));
            state.rows.insert(
                seq,
                Row {
                    message: Message {
                        id: message.id,
                        seq,
                        aggregate_type: message.aggregate_type,
                        aggregate_id: message.aggregate_id,
                        event_type: message.event_type,
                        payload,
                        binary: message.binary.filter(|_| !binary_dropped),
                        headers: message.headers,
                        partition_key: message.partition_key,
                        dedup_key: message.dedup_key,
                        attempts: 0,
                        created_at: now,
                    },
                    tx: Some(tx),
                    state: RowState::Pending,
                    due,
                    last_error: None,
                },
            );
        }
        Ok(())
    }

    fn finish(&self, tx: u64, commit: bool) {
        let mut state = self.state();
        let seqs: Vec<i64> = state
            .rows
            .iter()
            .filter(|(_, row)| row.tx == Some(tx))
            .map(|(seq, _)| *seq)
            .collect();
        if seqs.is_empty() {
            return;
        }
        for seq in seqs {
            if commit {
                if let Some(row) = state.rows.get_mut(&seq) {
                    row.tx = None;
                }
            } else {
                remove_row(&mut state, seq);
            }
        }
        drop(state);
        if commit {
            self.inner.commits.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Apply `change` to every listed message held under `token`; name the others.
    fn fenced(
        &self,
        token: LeaseToken,
        ids: &[Uuid],
        mut change: impl FnMut(&mut State, i64, DateTime<Utc>),
    ) -> Result<(), Error> {
        let now = self.now();
        let mut state = self.state();
        let mut lost = Vec::new();
        for id in ids {
            let held = state.seq_of.get(id).copied().filter(|seq| {
                state.rows.get(seq).is_some_and(|row| {
                    if self.has(Defect::NoFencingToken) {
                        row.tx.is_none() && matches!(row.state, RowState::Leased { .. })
                    } else if self.has(Defect::CompleteIgnoresExpiry) {
                        matches!(row.state, RowState::Leased { token: t, .. } if t == token)
                    } else {
                        row.held_by(token, now)
                    }
                })
            });
            match held {
                Some(seq) => change(&mut state, seq, now),
                None => lost.push(*id),
            }
        }
        if lost.is_empty() {
            Ok(())
        } else {
            Err(Error::LeaseLost { ids: lost })
        }
    }
}

fn remove_row(state: &mut State, seq: i64) {
    if let Some(row) = state.rows.remove(&seq) {
        state.seq_of.remove(&row.message.id);
        if let Some(key) = &row.message.dedup_key {
            state.dedup.remove(key);
        }
    }
}

/// The shard of `count` a row with partition key `key` and sequence number `seq` belongs to:
/// FNV-1a (64 bits) of the key's bytes modulo `count`, the same in every process and run, and
/// for an unordered row (no key) its `seq` modulo `count`. `count` is at least 1 (the claim
/// request was validated).
fn shard_of(key: Option<&str>, seq: i64, count: u32) -> u32 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let count = u64::from(count.max(1));
    let slot = match key {
        Some(key) => {
            key.bytes().fold(FNV_OFFSET, |hash, byte| {
                (hash ^ u64::from(byte)).wrapping_mul(FNV_PRIME)
            }) % count
        }
        None => seq.unsigned_abs() % count,
    };
    // Below `count`, which is a `u32`.
    u32::try_from(slot).unwrap_or(0)
}

fn to_chrono(d: Duration, what: &str) -> Result<chrono::Duration, Error> {
    chrono::Duration::from_std(d).map_err(|_| {
        Error::invalid_input(format!(
            "{what} of {d:?} is too long; use at most a few years"
        ))
    })
}

fn add(now: DateTime<Utc>, d: Duration, what: &str) -> Result<DateTime<Utc>, Error> {
    now.checked_add_signed(to_chrono(d, what)?).ok_or_else(|| {
        Error::invalid_input(format!(
            "{what} of {d:?} is too long; use at most a few years"
        ))
    })
}

#[async_trait]
impl OutboxStore for MemoryStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        req.validate()?;
        let now = self.now();
        let lease_clock = if self.has(Defect::RelayClockLeases) {
            Utc::now()
        } else {
            now
        };
        let until = add(lease_clock, req.lease, "lease")?;
        let limit = if self.has(Defect::OverClaim) {
            req.limit + 1
        } else {
            req.limit
        };
        let ordered = !self.has(Defect::NoHeadOfLine);
        let shard = req
            .shard
            .filter(|_| self.inner.sharded_claims && !self.has(Defect::ShardIgnored));
        let mut state = self.state();
        let cursor = state.cursor;
        let mut blocked: HashSet<&str> = HashSet::new();
        let mut picked = Vec::new();
        for (seq, row) in &state.rows {
            if picked.len() >= limit {
                break;
            }
            // Uncommitted rows are invisible, as in a database: they hold nothing back.
            if row.tx.is_some() {
                continue;
            }
            if self.has(Defect::CursorClaim) && *seq <= cursor {
                continue;
            }
            let key = row.message.partition_key.as_deref();
            // Another shard's rows are not looked at: every row of a key is in the key's shard,
            // so skipping them changes nothing for the keys of this one.
            if shard.is_some_and(|shard| shard_of(key, *seq, shard.count) != shard.index) {
                continue;
            }
            let claimable = match row.state {
                RowState::Published { .. } => continue,
                RowState::Dead => {
                    if req.head_policy == HeadPolicy::Skip {
                        continue;
                    }
                    false
                }
                RowState::Leased { until, .. } => until <= now && row.due <= now,
                RowState::Pending => row.due <= now,
            };
            let held_back = key.is_some_and(|k| blocked.contains(k));
            if claimable && (!held_back || !ordered) {
                picked.push(*seq);
            } else if let Some(k) = key {
                blocked.insert(k);
            }
        }
        let token = LeaseToken::new();
        let mut messages = Vec::with_capacity(picked.len());
        for seq in picked {
            if self.has(Defect::NewIdPerAttempt) {
                // Hand out a fresh id on every claim after the first attempt.
                if let Some(row) = state.rows.get(&seq) {
                    if row.message.attempts > 0 {
                        let old = row.message.id;
                        let new = Uuid::now_v7();
                        state.seq_of.remove(&old);
                        state.seq_of.insert(new, seq);
                        state.used_ids.insert(new);
                        if let Some(row) = state.rows.get_mut(&seq) {
                            row.message.id = new;
                        }
                    }
                }
            }
            let Some(row) = state.rows.get_mut(&seq) else {
                continue;
            };
            row.state = if self.has(Defect::PublishedAtClaim) {
                RowState::Published { at: now }
            } else {
                RowState::Leased { token, until }
            };
            messages.push(row.message.clone());
            state.cursor = state.cursor.max(seq);
        }
        Ok(Claim {
            token,
            lease_until: until,
            messages,
        })
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        let delete = self.inner.deletes_published;
        self.fenced(token, ids, |state, seq, now| {
            if delete {
                remove_row(state, seq);
            } else if let Some(row) = state.rows.get_mut(&seq) {
                row.state = RowState::Published { at: now };
            }
        })
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        outbox_traits::validate_failures(failures)?;
        let mut retry_at = Vec::with_capacity(failures.len());
        let now = self.now();
        for failure in failures {
            retry_at.push(match failure.action {
                FailAction::Retry { delay } => Some(add(now, delay, "retry delay")?),
                FailAction::Dead if self.has(Defect::NoDeadLettering) => Some(now),
                FailAction::Dead => None,
            });
        }
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        let by_id: HashMap<Uuid, (&Failure, Option<DateTime<Utc>>)> = failures
            .iter()
            .zip(retry_at)
            .map(|(f, at)| (f.id, (f, at)))
            .collect();
        self.fenced(token, &ids, |state, seq, _now| {
            let Some(row) = state.rows.get_mut(&seq) else {
                return;
            };
            let Some((failure, at)) = by_id.get(&row.message.id) else {
                return;
            };
            row.message.attempts = row.message.attempts.saturating_add(1);
            row.last_error = Some(failure.error.clone());
            match at {
                Some(at) => {
                    row.state = RowState::Pending;
                    row.due = *at;
                }
                None => row.state = RowState::Dead,
            }
        })
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        if !self.has(Defect::ExtendAcceptsZero) {
            outbox_traits::validate_lease_extension(lease)?;
        }
        let now = self.now();
        let until = add(now, lease, "lease")?;
        let mut state = self.state();
        let mut any = false;
        for row in state.rows.values_mut() {
            if row.held_by(token, now) {
                row.state = RowState::Leased { token, until };
                any = true;
            }
        }
        if any {
            Ok(until)
        } else {
            Err(Error::LeaseLost { ids: Vec::new() })
        }
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.fenced(token, ids, |state, seq, now| {
            if let Some(row) = state.rows.get_mut(&seq) {
                row.state = RowState::Pending;
                row.due = now;
            }
        })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .with_deletes_published(self.inner.deletes_published)
            .with_concurrent_claimers(true)
            .with_wakeups(true)
            .with_sharded_claims(self.inner.sharded_claims)
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        Ok(Some(Box::new(CommitWake {
            commits: self.inner.commits.subscribe(),
        })))
    }
}

/// Wakes the relay after each commit.
struct CommitWake {
    commits: watch::Receiver<u64>,
}

#[async_trait]
impl WakeSource for CommitWake {
    async fn wait(&mut self) -> Result<(), Error> {
        // The sender lives as long as the store; if the store is gone there is nothing to wait
        // for, so never return (the engine's poll timer still runs).
        if self.commits.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

#[async_trait]
impl OutboxAdmin for MemoryStore {
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error> {
        let state = self.state();
        let start = after_seq.map_or(i64::MIN, |s| s.saturating_add(1));
        Ok(state
            .rows
            .range(start..)
            .filter(|(_, row)| row.tx.is_none() && row.state == RowState::Dead)
            .take(limit)
            .map(|(_, row)| DeadMessage {
                message: row.message.clone(),
                last_error: row.last_error.clone().unwrap_or_default(),
                raw_id: None,
            })
            .collect())
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        let now = self.now();
        let mut state = self.state();
        let mut n = 0;
        for id in ids {
            let Some(seq) = state.seq_of.get(id).copied() else {
                continue;
            };
            if let Some(row) = state.rows.get_mut(&seq) {
                if row.state == RowState::Dead {
                    row.state = RowState::Pending;
                    row.message.attempts = 0;
                    row.due = now;
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
        let mut state = self.state();
        let mut n = 0;
        for id in ids {
            let Some(seq) = state.seq_of.get(id).copied() else {
                continue;
            };
            if state
                .rows
                .get(&seq)
                .is_some_and(|row| row.state == RowState::Dead)
            {
                remove_row(&mut state, seq);
                n += 1;
            }
        }
        Ok(n)
    }

    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
        outbox_traits::validate_purge_batch(batch)?;
        if older_than > outbox_traits::MAX_DURATION {
            // Nothing was published more than a century ago.
            return Ok(0);
        }
        let now = self.now();
        let cutoff = now
            .checked_sub_signed(to_chrono(older_than, "purge age")?)
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        let pick = |state: &State| -> Vec<i64> {
            state
                .rows
                .iter()
                .filter(|(_, row)| matches!(row.state, RowState::Published { at } if at < cutoff))
                .map(|(seq, _)| *seq)
                .take(batch)
                .collect()
        };
        if self.has(Defect::PurgeCountsPicked) {
            let picked = pick(&self.state());
            // The lock is let go between the pick and the delete: another purge picks the same.
            for _ in 0..8 {
                tokio::task::yield_now().await;
            }
            let mut state = self.state();
            for seq in &picked {
                if state.rows.contains_key(seq) {
                    remove_row(&mut state, *seq);
                }
            }
            return Ok(picked.len() as u64);
        }
        let mut state = self.state();
        let old = pick(&state);
        for seq in &old {
            remove_row(&mut state, *seq);
        }
        Ok(old.len() as u64)
    }

    async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        if self.has(Defect::SeqAdminIgnored) {
            return Ok(0);
        }
        let ids = self.dead_ids(seqs);
        self.requeue(&ids).await
    }

    async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        if self.has(Defect::SeqAdminIgnored) {
            return Ok(0);
        }
        let ids = self.dead_ids(seqs);
        self.discard(&ids).await
    }

    async fn counts(&self) -> Result<Counts, Error> {
        let state = self.state();
        let mut counts = Counts::default();
        for row in state.rows.values().filter(|row| row.tx.is_none()) {
            match row.state {
                RowState::Pending => counts.pending += 1,
                RowState::Leased { .. } => counts.leased += 1,
                RowState::Published { .. } => counts.published += 1,
                RowState::Dead => counts.dead += 1,
            }
        }
        Ok(counts)
    }

    async fn status(&self, blocked_limit: usize) -> Result<StoreStatus, Error> {
        let now = self.now();
        let state = self.state();
        let mut status = StoreStatus {
            blocked_keys: Some(0),
            published_last_minute: (!self.inner.deletes_published).then_some(0),
            ..StoreStatus::default()
        };
        let mut heads: BTreeMap<&str, &Row> = BTreeMap::new();
        for row in state.rows.values().filter(|row| row.tx.is_none()) {
            match row.state {
                RowState::Pending => status.pending += 1,
                RowState::Leased { .. } => status.leased += 1,
                RowState::Published { at } => {
                    if now - at < chrono::Duration::minutes(1) {
                        if let Some(n) = status.published_last_minute.as_mut() {
                            *n += 1;
                        }
                    }
                    continue;
                }
                RowState::Dead => status.dead += 1,
            }
            if !matches!(row.state, RowState::Dead) && status.oldest_pending_age_seconds.is_none() {
                let age = (now - row.message.created_at)
                    .num_microseconds()
                    .unwrap_or(0);
                status.oldest_pending_age_seconds = Some(age.max(0) as f64 / 1e6);
            }
            if let Some(key) = row.message.partition_key.as_deref() {
                // Rows are visited in seq order: the first one of a key is its head.
                heads.entry(key).or_insert(row);
            }
        }
        let mut blocked: Vec<BlockedKey> = heads
            .into_iter()
            .filter_map(|(key, row)| {
                let head_state = match row.state {
                    RowState::Dead => "dead",
                    RowState::Pending
                        if row.message.attempts > 0
                            && row.due > now
                            && !self.has(Defect::StatusIgnoresRetrying) =>
                    {
                        "retrying"
                    }
                    _ => return None,
                };
                Some(BlockedKey {
                    partition_key: key.to_owned(),
                    head_id: row.message.id,
                    head_seq: row.message.seq,
                    head_state: head_state.to_owned(),
                    attempts: row.message.attempts,
                    last_error: row.last_error.clone(),
                })
            })
            .collect();
        blocked.sort_by_key(|b| b.head_seq);
        status.blocked_keys = Some(blocked.len() as u64);
        blocked.truncate(blocked_limit);
        status.blocked = blocked;
        Ok(status)
    }
}

/// An open enqueue transaction of a [`MemoryStore`] (see [`MemoryStore::begin`]).
///
/// Dropping it without [`MemoryTx::commit`] rolls it back.
#[derive(Debug)]
pub struct MemoryTx {
    store: MemoryStore,
    id: u64,
    open: bool,
}

impl MemoryTx {
    /// Insert one message: validated against the store's limits, given its `seq` now, visible
    /// to claims only after commit.
    ///
    /// Refuses a reused id with [`Error::InvalidInput`] and a dedup key that any other message
    /// (committed or not) holds with [`Error::DuplicateKey`]; nothing is written then.
    pub fn enqueue(&mut self, message: NewMessage) -> Result<(), Error> {
        self.enqueue_batch([message])
    }

    /// Insert several messages, all or nothing, in the given order.
    pub fn enqueue_batch(
        &mut self,
        messages: impl IntoIterator<Item = NewMessage>,
    ) -> Result<(), Error> {
        self.store.insert(self.id, messages.into_iter().collect())
    }

    /// Make the transaction's messages visible.
    pub fn commit(mut self) {
        self.open = false;
        self.store.finish(self.id, true);
    }

    /// Remove the transaction's messages, as if they were never written.
    pub fn rollback(mut self) {
        self.open = false;
        self.store.finish(self.id, false);
    }
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        if self.open {
            self.store.finish(self.id, false);
        }
    }
}
