//! [`VecStore`]: an outbox store kept in a `Vec`, written from the contract alone.
//!
//! Each section follows one step of the "Implementing a backend" guide in `outbox_traits`, and
//! the comments name the `# Behavior` rule of the contract that each decision keeps.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use outbox_traits::chrono::{self, DateTime, Utc};
use outbox_traits::uuid::Uuid;
use outbox_traits::{
    async_trait, validate_batch, Capabilities, Claim, ClaimRequest, Counts, DeadMessage, Error,
    FailAction, Failure, HeadPolicy, LeaseToken, Limits, Message, NewMessage, OutboxAdmin,
    OutboxStore, ValidMessage,
};

// ---------------------------------------------------------------------------------------------
// Step 1: the table.

/// Where a committed row is in its life: the guide's state column, with the fields each state
/// needs carried inside it so that no row can be, say, pending with a lease.
#[derive(Debug, Clone, Copy, PartialEq)]
enum RowState {
    /// Claimable once `due` has come (its not-before time, or a retry's time).
    Pending { due: DateTime<Utc> },
    /// Held under `token` until `until`. An expired lease stays `Leased` (and is counted so)
    /// until another claim takes the row over: nothing else has happened to it yet.
    Leased {
        token: LeaseToken,
        until: DateTime<Utc>,
    },
    /// Published at `at`; purge deletes it once it is old enough.
    Published { at: DateTime<Utc> },
    /// Dead-lettered: waits for an operator to requeue or discard it.
    Dead,
}

/// One outbox row.
#[derive(Debug)]
struct Row {
    /// The message exactly as claims hand it out; `attempts` is counted in place by `fail`.
    message: Message,
    state: RowState,
    last_error: Option<String>,
    /// The transaction that inserted the row, while it is open. Like a row inserted in an open
    /// database transaction, it already holds its `seq` and dedup key, but no claim, count or
    /// listing sees it ("no phantom").
    open_tx: Option<u64>,
}

impl Row {
    fn committed(&self) -> bool {
        self.open_tx.is_none()
    }

    /// The fencing rule of complete, fail, extend and release: the token must match *and* the
    /// lease must not have ended. Without the second half, a relay that stalled past its lease
    /// could complete a message that another relay has taken over and is publishing again.
    fn held_by(&self, token: LeaseToken, now: DateTime<Utc>) -> bool {
        matches!(self.state, RowState::Leased { token: t, until } if t == token && until > now)
    }
}

/// Everything behind the store's one lock.
#[derive(Debug)]
struct State {
    /// The store's own clock, the stand-in for a database's `now()`. It moves only through
    /// [`VecStore::advance`], so tests expire leases without sleeping.
    now: DateTime<Utc>,
    /// Next `seq`. Only ever grows, so purged rows never give their `seq` away.
    next_seq: i64,
    next_tx: u64,
    limits: Limits,
    /// Every row in `seq` order: rows are only appended, with a higher `seq` than any before.
    rows: Vec<Row>,
}

/// An outbox store held in memory: a `Vec` of rows behind a mutex, with its own clock.
///
/// Clones share the same rows. Each method takes the lock once and releases it before
/// returning, which is this store's version of "one statement, no lock held afterwards"; it
/// also makes concurrent claims exclusive.
#[derive(Debug, Clone)]
pub struct VecStore {
    state: Arc<Mutex<State>>,
}

impl Default for VecStore {
    fn default() -> Self {
        Self::new()
    }
}

impl VecStore {
    /// An empty store with the default [`Limits`], its clock stopped at the real current time.
    pub fn new() -> Self {
        Self::with_limits(Limits::default())
    }

    /// An empty store that refuses messages over `limits`.
    pub fn with_limits(limits: Limits) -> Self {
        let state = State {
            now: Utc::now(),
            next_seq: 1,
            next_tx: 1,
            limits,
            rows: Vec::new(),
        };
        Self {
            state: Arc::new(Mutex::new(state)),
        }
    }

    /// The store's current time: every lease end, due time and publish time is taken from it.
    pub fn now(&self) -> DateTime<Utc> {
        lock(&self.state).now
    }

    /// Move the store's clock forward by `by` (tests use it to expire leases and make retries
    /// due without sleeping).
    pub fn advance(&self, by: Duration) -> Result<(), Error> {
        let mut state = lock(&self.state);
        state.now = later(state.now, by, "clock step")?;
        Ok(())
    }

    /// Open a transaction to enqueue messages in (see [`VecTx`]).
    pub fn begin(&self) -> VecTx {
        let mut state = lock(&self.state);
        let id = state.next_tx;
        state.next_tx += 1;
        VecTx {
            state: Arc::clone(&self.state),
            id,
        }
    }
}

/// Take the lock. Every change is made whole while the lock is held and nothing in this file
/// panics while holding it, so a poisoned lock still guards consistent rows: use them rather
/// than panic ("library code never panics").
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `now + by`, refused as bad input when it does not fit in a timestamp.
fn later(now: DateTime<Utc>, by: Duration, what: &str) -> Result<DateTime<Utc>, Error> {
    chrono::Duration::from_std(by)
        .ok()
        .and_then(|by| now.checked_add_signed(by))
        .ok_or_else(|| Error::invalid_input(format!("{what} of {by:?} is too long")))
}

// ---------------------------------------------------------------------------------------------
// Step 2: enqueue, in the caller's transaction.

/// An open enqueue transaction: what the caller's database transaction is for a real backend.
///
/// Rows written by [`VecTx::enqueue`] get their `seq` at once, at insert, but stay invisible
/// until [`VecTx::commit`]. Dropping the transaction without committing rolls it back.
#[derive(Debug)]
pub struct VecTx {
    state: Arc<Mutex<State>>,
    id: u64,
}

impl VecTx {
    /// Write `messages` in this transaction, all or nothing.
    ///
    /// Refuses invalid messages with [`Error::InvalidInput`] and a dedup key already held by
    /// any row (committed or in an open transaction, as a unique index would) with
    /// [`Error::DuplicateKey`]; a refused batch writes nothing.
    pub fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error> {
        let mut state = lock(&self.state);
        // The rules every backend shares (each message valid, ids and dedup keys unique within
        // the batch), then this store's own: ids and dedup keys unique across its rows.
        let valid = validate_batch(messages, &state.limits)?;
        for m in messages {
            if state.rows.iter().any(|r| r.message.id == m.id) {
                return Err(Error::invalid_input(format!(
                    "message id {} is already in the outbox; let NewMessage::new make a fresh one",
                    m.id
                )));
            }
            if let Some(key) = &m.dedup_key {
                if state
                    .rows
                    .iter()
                    .any(|r| r.message.dedup_key.as_ref() == Some(key))
                {
                    return Err(Error::DuplicateKey { key: key.clone() });
                }
            }
        }
        let now = state.now;
        for ValidMessage {
            message: m,
            payload,
            headers: _,
        } in valid
        {
            // `seq` comes from the insert, not the commit: a transaction that commits after a
            // later one keeps its lower `seq`, which is why claims never use `seq` as a cursor.
            let seq = state.next_seq;
            state.next_seq += 1;
            let message = Message {
                id: m.id,
                seq,
                aggregate_type: m.aggregate_type.clone(),
                aggregate_id: m.aggregate_id.clone(),
                event_type: m.event_type.clone(),
                // A binary message keeps its bytes and content type as given (its `payload` is
                // JSON null): claims hand them out untouched.
                payload,
                binary: m.binary.clone(),
                headers: m.headers.clone(),
                partition_key: m.partition_key.clone(),
                dedup_key: m.dedup_key.clone(),
                attempts: 0,
                created_at: now,
            };
            state.rows.push(Row {
                message,
                state: RowState::Pending {
                    due: m.not_before.unwrap_or(now),
                },
                last_error: None,
                open_tx: Some(self.id),
            });
        }
        Ok(())
    }

    /// Commit: the transaction's messages become visible to claims.
    pub fn commit(self) {
        for row in lock(&self.state).rows.iter_mut() {
            if row.open_tx == Some(self.id) {
                row.open_tx = None;
            }
        }
        // `drop` runs next and finds no rows of this transaction left to roll back.
    }

    /// Roll back: the transaction's messages are gone, as if never written.
    pub fn rollback(self) {}
}

impl Drop for VecTx {
    fn drop(&mut self) {
        lock(&self.state)
            .rows
            .retain(|r| r.open_tx != Some(self.id));
    }
}

// ---------------------------------------------------------------------------------------------
// Steps 3 to 5: claim by state, fence every transition.

/// Apply `change` to each listed row that `token` still holds; name every other listed id in
/// [`Error::LeaseLost`] after changing the held ones (the fencing rule of `complete`).
fn fenced(
    state: &mut State,
    token: LeaseToken,
    ids: &[Uuid],
    mut change: impl FnMut(&mut Row, DateTime<Utc>),
) -> Result<(), Error> {
    let now = state.now;
    let wanted: HashSet<&Uuid> = ids.iter().collect();
    let mut changed = HashSet::new();
    for row in state.rows.iter_mut() {
        if wanted.contains(&row.message.id) && row.held_by(token, now) {
            change(row, now);
            changed.insert(row.message.id);
        }
    }
    Error::unless_held(ids, &changed)
}

#[async_trait]
impl OutboxStore for VecStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        // A zero limit or lease is refused the same way by every store.
        req.validate()?;
        let mut state = lock(&self.state);
        let now = state.now;
        // Lease ends come from the store's clock, never the relay's: relays on hosts whose
        // clocks disagree must still agree on when a lease ends.
        let until = later(now, req.lease, "lease")?;
        let token = LeaseToken::new();
        // Keys whose earlier message is not handed out: their later messages must wait.
        let mut held_back: HashSet<String> = HashSet::new();
        let mut messages = Vec::new();
        // Walk every committed row in `seq` order, by state: a late-committing transaction's
        // low `seq` is found on the next claim, where a `seq > last_seen` cursor would skip it.
        for row in state.rows.iter_mut().filter(|r| r.committed()) {
            if messages.len() == req.limit {
                break;
            }
            let free = match row.state {
                RowState::Published { .. } => continue,
                // Skip lets a key flow past its dead message; Block holds the key behind it.
                RowState::Dead if req.head_policy == HeadPolicy::Skip => continue,
                RowState::Dead => false,
                RowState::Pending { due } => due <= now,
                // An expired lease means its relay crashed or stalled: take the row over.
                RowState::Leased { until, .. } => until <= now,
            };
            let key = row.message.partition_key.as_ref();
            if free && !key.is_some_and(|k| held_back.contains(k)) {
                row.state = RowState::Leased { token, until };
                messages.push(row.message.clone());
            } else if let Some(key) = key {
                held_back.insert(key.clone());
            }
        }
        Ok(Claim {
            token,
            lease_until: until,
            messages,
        })
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        fenced(&mut lock(&self.state), token, ids, |row, now| {
            row.state = RowState::Published { at: now };
        })
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        // A retry delay over 100 years is refused the same way by every store.
        outbox_traits::validate_failures(failures)?;
        let mut state = lock(&self.state);
        let now = state.now;
        // Work out every next state first, so a bad delay changes nothing at all.
        let mut next = HashMap::new();
        for f in failures {
            let state = match f.action {
                FailAction::Retry { delay } => RowState::Pending {
                    due: later(now, delay, "retry delay")?,
                },
                FailAction::Dead => RowState::Dead,
            };
            next.insert(f.id, (state, &f.error));
        }
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        fenced(&mut state, token, &ids, |row, _| {
            if let Some((state, error)) = next.get(&row.message.id) {
                // Only `fail` counts attempts, so the count is exact however often a message
                // was claimed, released or taken over after an expired lease.
                row.message.attempts = row.message.attempts.saturating_add(1);
                row.state = *state;
                row.last_error = Some(error.to_string());
            }
        })
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        // A zero or over-long extension is refused before the token is looked up.
        outbox_traits::validate_lease_extension(lease)?;
        let mut state = lock(&self.state);
        let now = state.now;
        let until = later(now, lease, "lease")?;
        let mut held = 0;
        // `held_by` skips expired leases: once another relay may have taken a row over, the
        // old holder must not get it back.
        for row in state.rows.iter_mut().filter(|r| r.held_by(token, now)) {
            row.state = RowState::Leased { token, until };
            held += 1;
        }
        if held == 0 {
            return Err(Error::LeaseLost { ids: Vec::new() });
        }
        Ok(until)
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        // Due at once and no attempt counted: the message did nothing wrong.
        fenced(&mut lock(&self.state), token, ids, |row, now| {
            row.state = RowState::Pending { due: now };
        })
    }

    fn capabilities(&self) -> Capabilities {
        // One lock around each claim makes concurrent claims exclusive. No wake-up hints: the
        // relay polls, which is always correct.
        Capabilities::none().with_concurrent_claimers(true)
    }
}

// ---------------------------------------------------------------------------------------------
// Step 6: the operator side.

#[async_trait]
impl OutboxAdmin for VecStore {
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error> {
        let state = lock(&self.state);
        Ok(state
            .rows
            .iter()
            .filter(|r| r.state == RowState::Dead && after_seq.is_none_or(|s| r.message.seq > s))
            .take(limit)
            .map(|r| DeadMessage {
                message: r.message.clone(),
                last_error: r.last_error.clone().unwrap_or_default(),
                raw_id: None,
            })
            .collect())
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        let mut state = lock(&self.state);
        let now = state.now;
        let mut n = 0;
        for row in state.rows.iter_mut() {
            if row.state == RowState::Dead && ids.contains(&row.message.id) {
                // A fresh start: the operator fixed the cause, so the retry budget is full again.
                row.state = RowState::Pending { due: now };
                row.message.attempts = 0;
                n += 1;
            }
        }
        Ok(n)
    }

    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
        let mut state = lock(&self.state);
        let before = state.rows.len();
        state
            .rows
            .retain(|r| !(r.state == RowState::Dead && ids.contains(&r.message.id)));
        Ok((before - state.rows.len()) as u64)
    }

    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
        outbox_traits::validate_purge_batch(batch)?;
        let mut state = lock(&self.state);
        let cutoff = chrono::Duration::from_std(older_than)
            .ok()
            .and_then(|age| state.now.checked_sub_signed(age));
        // An age reaching past the earliest timestamp: nothing is that old.
        let Some(cutoff) = cutoff else { return Ok(0) };
        // At most `batch` per call, so a large purge never holds the lock for long.
        let mut left = batch;
        state.rows.retain(|r| {
            let old = matches!(r.state, RowState::Published { at } if at < cutoff);
            if old && left > 0 {
                left -= 1;
                return false;
            }
            true
        });
        Ok((batch - left) as u64)
    }

    async fn counts(&self) -> Result<Counts, Error> {
        let mut counts = Counts::default();
        for row in lock(&self.state).rows.iter().filter(|r| r.committed()) {
            match row.state {
                RowState::Pending { .. } => counts.pending += 1,
                RowState::Leased { .. } => counts.leased += 1,
                RowState::Published { .. } => counts.published += 1,
                RowState::Dead => counts.dead += 1,
            }
        }
        Ok(counts)
    }
}
