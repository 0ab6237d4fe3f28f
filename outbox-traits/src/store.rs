//! The store side of the contract: what a relay needs from the database that holds the outbox.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::Error;
use crate::message::Message;

/// Fencing token of one claim. Every message handed out by a claim carries the same token until
/// it is completed, failed or released; a transition presented with another token changes
/// nothing and returns [`Error::LeaseLost`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseToken(pub Uuid);

impl LeaseToken {
    /// A new random token.
    pub fn new() -> Self {
        LeaseToken(Uuid::new_v4())
    }
}

impl Default for LeaseToken {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What a relay does when the head message of a partition key is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum HeadPolicy {
    /// The key's later messages wait until an operator requeues or discards the dead one.
    #[default]
    Block,
    /// The key's later messages flow on past the dead one.
    Skip,
}

/// Arguments of [`OutboxStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// Most messages to return. Must be at least 1.
    pub limit: usize,
    /// How long the claim is held before another relay may take the messages over.
    pub lease: Duration,
    /// How dead head messages affect their key.
    pub head_policy: HeadPolicy,
    /// Claim only the messages of one shard of the partition keys (`None`: every key).
    ///
    /// Honoured by stores that declare [`Capabilities::sharded_claims`]; others ignore it, and
    /// the relay never sets it for them. See [`ClaimShard`].
    pub shard: Option<ClaimShard>,
}

/// One shard of the partition keys, for claims that run side by side without meeting.
///
/// A store that declares [`Capabilities::sharded_claims`] maps every partition key to one of
/// `count` shards by a fixed function of the key and `count` (its own, e.g. a hash), and a claim
/// with `shard: Some(ClaimShard { index, count })` returns only messages whose key maps to
/// `index`. Every message of a key maps to the same shard, so two claims of different shards
/// never hold back each other's keys: they can run at the same time, on two connections, and
/// neither finds the other's candidates locked. Unordered messages (no partition key) may map to
/// any shard, each to exactly one.
///
/// Sharding only narrows what a claim looks at: every guarantee (per-key order, fencing,
/// exclusive claims) still comes from the claim itself, so relays that shard differently, or do
/// not shard, may share one table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ClaimShard {
    /// Which shard, `0..count`.
    pub index: u32,
    /// How many shards the keys are split into; at least 1 (1: every key).
    pub count: u32,
}

impl ClaimShard {
    /// Shard `index` of `count`, or a typed error if `count` is 0 or `index` is not below it.
    ///
    /// ```
    /// use outbox_traits::ClaimShard;
    /// assert!(ClaimShard::new(1, 2).is_ok());
    /// assert!(ClaimShard::new(2, 2).is_err());
    /// assert!(ClaimShard::new(0, 0).is_err());
    /// ```
    pub fn new(index: u32, count: u32) -> Result<Self, Error> {
        let shard = Self { index, count };
        shard.validate()?;
        Ok(shard)
    }

    /// Refuse a shard no store can serve: a count of 0, or an index not below the count.
    pub fn validate(&self) -> Result<(), Error> {
        if self.count == 0 {
            return Err(Error::invalid_input(
                "claim shard count is 0; split the keys into at least 1 shard",
            ));
        }
        if self.index >= self.count {
            return Err(Error::invalid_input(format!(
                "claim shard index {} is not below the shard count {}; shards are numbered \
                 from 0",
                self.index, self.count
            )));
        }
        Ok(())
    }
}

impl ClaimRequest {
    /// Refuse a request no store can serve: a zero limit, a zero lease, a lease longer than
    /// [`MAX_DURATION`] or an invalid shard.
    ///
    /// Stores call this first in [`OutboxStore::claim`], so every backend words the error alike.
    pub fn validate(&self) -> Result<(), Error> {
        if self.limit == 0 {
            return Err(Error::invalid_input(
                "claim limit is 0; ask for at least 1 message",
            ));
        }
        if self.lease.is_zero() {
            return Err(Error::invalid_input(
                "claim lease is 0; give the relay time to publish, e.g. 30s",
            ));
        }
        validate_duration("claim lease", self.lease)?;
        if let Some(shard) = &self.shard {
            shard.validate()?;
        }
        Ok(())
    }
}

/// Longest lease, lease extension or retry delay a store accepts: 100 years of 365
/// days. Longer values would overflow the databases' timestamps (Postgres) or run past
/// `DATETIME`'s year 9999 (MariaDB); every store refuses them alike with
/// [`Error::InvalidInput`] ([`validate_duration`]) instead of failing in SQL or saturating.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Refuse a duration longer than [`MAX_DURATION`], naming `what` it is (e.g. `"retry delay"`).
///
/// ```
/// use std::time::Duration;
/// use outbox_traits::{validate_duration, MAX_DURATION};
/// assert!(validate_duration("retry delay", MAX_DURATION).is_ok());
/// assert!(validate_duration("retry delay", MAX_DURATION + Duration::from_secs(1)).is_err());
/// ```
pub fn validate_duration(what: &str, duration: Duration) -> Result<(), Error> {
    if duration > MAX_DURATION {
        return Err(Error::invalid_input(format!(
            "{what} of {duration:?} is longer than 100 years; use a shorter one"
        )));
    }
    Ok(())
}

/// Refuse a lease extension no store can serve: 0 (the lease would end at once, which is a
/// release in disguise) or longer than [`MAX_DURATION`].
///
/// Stores call this first in [`OutboxStore::extend`], before the token is looked up, so a bad
/// length is [`Error::InvalidInput`] whether or not the token still holds anything.
///
/// ```
/// use std::time::Duration;
/// assert!(outbox_traits::validate_lease_extension(Duration::ZERO).is_err());
/// assert!(outbox_traits::validate_lease_extension(Duration::from_secs(30)).is_ok());
/// ```
pub fn validate_lease_extension(lease: Duration) -> Result<(), Error> {
    if lease.is_zero() {
        return Err(Error::invalid_input(
            "lease extension is 0; give the relay time to publish, e.g. 30s",
        ));
    }
    validate_duration("lease extension", lease)
}

/// Refuse a [`OutboxStore::fail`] call no store can serve: a retry delay longer than
/// [`MAX_DURATION`]. (A delay of 0 is valid: due again at once.)
///
/// Stores call this first in `fail`, so a bad entry changes none of the listed messages.
pub fn validate_failures(failures: &[Failure]) -> Result<(), Error> {
    for failure in failures {
        if let FailAction::Retry { delay } = failure.action {
            validate_duration("retry delay", delay)?;
        }
    }
    Ok(())
}

/// Refuse a purge batch no store can serve: 0, which deletes nothing, so a loop calling
/// [`OutboxAdmin::purge_published`] until it returns less than its batch would never end.
///
/// Stores call this first in `purge_published`, so every backend words the error alike.
///
/// ```
/// assert!(outbox_traits::validate_purge_batch(0).is_err());
/// assert!(outbox_traits::validate_purge_batch(1000).is_ok());
/// ```
pub fn validate_purge_batch(batch: usize) -> Result<(), Error> {
    if batch == 0 {
        return Err(Error::invalid_input(
            "purge batch is 0; it must be at least 1 (a batch of 0 deletes nothing, so a \
             loop calling purge until it returns less than its batch would never end)",
        ));
    }
    Ok(())
}

/// The result of [`OutboxStore::claim`]: messages leased under one token.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    /// The fencing token to present on complete, fail, extend and release.
    pub token: LeaseToken,
    /// When the lease ends, by the database's clock.
    pub lease_until: DateTime<Utc>,
    /// The leased messages: ordered by `seq`, so a key's messages appear in their order.
    pub messages: Vec<Message>,
}

/// What to do with one failed message, decided by the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailAction {
    /// Count the attempt and make the message claimable again after `delay`
    /// (by the database's clock).
    Retry {
        /// Back-off before the next attempt.
        delay: Duration,
    },
    /// Count the attempt and dead-letter the message.
    Dead,
}

/// One entry of [`OutboxStore::fail`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The failed message.
    pub id: Uuid,
    /// The reason, stored as the message's last error.
    pub error: String,
    /// Retry or dead-letter.
    pub action: FailAction,
}

/// What a store supports beyond the required behaviour; selects which conformance checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Capabilities {
    /// Several relays (connections, processes) may claim concurrently with exclusive results.
    pub concurrent_claimers: bool,
    /// [`OutboxStore::wakeups`] returns a source of wake-up hints.
    pub wakeups: bool,
    /// [`OutboxStore::complete`] deletes published messages instead of keeping them marked
    /// published (a store option, e.g. to keep the table small and completions cheap). Then
    /// [`OutboxAdmin::counts`] reports no published messages, [`OutboxAdmin::purge_published`]
    /// finds none to delete, and a dedup key is free again once its message is published.
    /// Nothing else changes: a deleted message was published, and fencing still holds.
    pub deletes_published: bool,
    /// [`ClaimRequest::shard`] is honoured (see [`ClaimShard`]): the relay may run one claim
    /// per shard at a time instead of one claim in all.
    pub sharded_claims: bool,
    /// How many claim shards a relay that is given none should run (with
    /// [`Capabilities::sharded_claims`]; ignored without it). `None`: the relay's default, 1.
    pub preferred_claim_shards: Option<usize>,
    /// How many messages per claim a relay that is given no batch size should ask for. `None`:
    /// the relay's default, 500.
    pub preferred_batch: Option<usize>,
}

impl Capabilities {
    /// Neither concurrent claimers nor wake-ups nor sharded claims; published messages are kept;
    /// no preferred claim shards or batch.
    pub const fn none() -> Self {
        Self {
            concurrent_claimers: false,
            wakeups: false,
            deletes_published: false,
            sharded_claims: false,
            preferred_claim_shards: None,
            preferred_batch: None,
        }
    }

    /// Set [`Capabilities::concurrent_claimers`].
    pub const fn with_concurrent_claimers(mut self, yes: bool) -> Self {
        self.concurrent_claimers = yes;
        self
    }

    /// Set [`Capabilities::wakeups`].
    pub const fn with_wakeups(mut self, yes: bool) -> Self {
        self.wakeups = yes;
        self
    }

    /// Set [`Capabilities::deletes_published`].
    pub const fn with_deletes_published(mut self, yes: bool) -> Self {
        self.deletes_published = yes;
        self
    }

    /// Set [`Capabilities::sharded_claims`].
    pub const fn with_sharded_claims(mut self, yes: bool) -> Self {
        self.sharded_claims = yes;
        self
    }

    /// Set [`Capabilities::preferred_claim_shards`].
    pub const fn with_preferred_claim_shards(mut self, shards: usize) -> Self {
        self.preferred_claim_shards = Some(shards);
        self
    }

    /// Set [`Capabilities::preferred_batch`].
    pub const fn with_preferred_batch(mut self, batch: usize) -> Self {
        self.preferred_batch = Some(batch);
        self
    }
}

/// A source of wake-up hints from the store (e.g. Postgres `LISTEN/NOTIFY`).
///
/// Hints may be lost or spurious; the engine always polls as well.
#[async_trait]
pub trait WakeSource: Send {
    /// Wait for the next hint.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the engine races it against a timer and drops it.
    async fn wait(&mut self) -> Result<(), Error>;
}

/// The store side of a relay: claim, complete, fail, extend, release.
///
/// Enqueue is deliberately *not* here: each backend exposes enqueue functions that take the
/// caller's own transaction, so the business write and the outbox write commit together.
///
/// Message states are `pending` (claimable once due), `leased` (held under a token until the
/// lease ends), `published` and `dead`. An expired lease makes a message claimable again.
///
/// All times (lease ends, retry due times, "now") come from the database's clock, never from
/// the relay host's clock.
#[async_trait]
pub trait OutboxStore: Send + Sync {
    /// Lease up to `req.limit` due messages under a new token.
    ///
    /// # Behavior
    /// - MUST return at most `req.limit` messages, and only messages that are committed, pending
    ///   (or leased with an expired lease), and due (`not_before` and retry time reached).
    /// - MUST select by state, never by a cursor such as `seq > last_seen` (a later-committing
    ///   transaction may hold a lower `seq`).
    /// - MUST be exclusive: no message is held by two unexpired leases.
    /// - MUST keep per-key order: a message with partition key `k` is returned only if every
    ///   earlier (lower `seq`) message of `k` that is not published is also returned, earlier in
    ///   the list. Earlier messages leased to someone else, waiting for a retry or not yet due,
    ///   or locked by a concurrent claim, hold back the key. Dead earlier messages hold it back
    ///   under [`HeadPolicy::Block`] and are ignored under [`HeadPolicy::Skip`]. Messages with no
    ///   partition key are not ordered. Order is `seq` order, which is insert order: a message
    ///   of `k` committed after a later-inserted one of `k` was claimed cannot be put before it
    ///   (see [`NewMessage::partition_key`](crate::NewMessage::partition_key) for the writers'
    ///   precondition). An earlier message still uncommitted when the claim runs holds nothing
    ///   back: the later one may be claimed (and published) first, and only then; once the
    ///   earlier one is committed, no claim may pass it.
    /// - MUST NOT let a blocked key's backlog, however long, hide the claimable messages behind
    ///   it: a claim still returns other keys' first messages and unordered messages (a store
    ///   that reads a bounded stretch of the backlog may return only each key's first message
    ///   past it, and so fewer than `req.limit`). A claim that returns fewer than `req.limit`
    ///   returns every claimable message no earlier message of its key holds back, and every
    ///   claimable message among the first `req.limit` unpublished rows in `seq` order (the
    ///   stretch read is at least that long); rows of a key held back anywhere in its backlog,
    ///   not only at its first row, must not take the place of such messages.
    /// - SHOULD return messages in `seq` order; MUST keep each key's messages in `seq` order.
    /// - MUST NOT count an attempt: attempts are counted by [`OutboxStore::fail`].
    /// - SHOULD cost one round trip and use an index that stays small as history grows.
    /// - MUST NOT leave a transaction or row lock open after it returns.
    /// - An empty claim returns `Ok` with no messages.
    ///
    /// # Errors
    /// [`Error::InvalidInput`], before anything is read or leased, for a request
    /// [`ClaimRequest::validate`] refuses: a limit of 0, a lease of 0 or longer than
    /// [`MAX_DURATION`], a shard whose count is 0 or whose index is not below its count.
    ///
    /// # Cancel safety
    /// If dropped before it returns, messages it may have leased stay leased until the lease
    /// ends and are then claimable again: nothing is lost.
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error>;

    /// Mark messages as published.
    ///
    /// # Behavior
    /// - MUST mark published exactly the listed messages that are leased under `token` with an
    ///   unexpired lease, in one statement or transaction.
    /// - MUST NOT change any other listed message; if there are such messages, MUST return
    ///   [`Error::LeaseLost`] naming them (after completing the others).
    /// - An empty `ids` list changes nothing and returns `Ok`, whatever the token (the same for
    ///   [`OutboxStore::fail`] and [`OutboxStore::release`]).
    ///
    /// # Cancel safety
    /// If dropped, the messages are either all marked or still leased; a still-leased message is
    /// claimed again after its lease ends (a duplicate delivery, never a loss).
    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error>;

    /// Record failed attempts: count the attempt, store the error, then schedule a retry or
    /// dead-letter, as each [`Failure`] says.
    ///
    /// # Behavior
    /// - Same fencing as [`OutboxStore::complete`]: only messages leased under `token` with an
    ///   unexpired lease change; others are named in [`Error::LeaseLost`].
    /// - `Retry { delay }`: attempts + 1, state pending, due at database now + `delay`.
    /// - `Dead`: attempts + 1, state dead, with the error kept for operators.
    /// - One round trip per call, not per message.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when a retry delay is longer than [`MAX_DURATION`]
    /// ([`validate_failures`]), before any listed message changes.
    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error>;

    /// Extend the lease of every message still held under `token` to database now + `lease`.
    ///
    /// # Behavior
    /// - Returns the new lease end.
    /// - If no message is held under `token` any more (all expired, completed or released),
    ///   returns [`Error::LeaseLost`] with an empty list and changes nothing.
    /// - An expired lease is not revived.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a `lease` of 0 or longer than [`MAX_DURATION`]
    /// ([`validate_lease_extension`]), checked before the token is looked up: nothing changes,
    /// whether or not the token still holds messages.
    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error>;

    /// Give messages back without counting an attempt: they become pending and due at once.
    ///
    /// Used for a key's later messages in a batch after an earlier one failed, and for in-flight
    /// work at shutdown.
    ///
    /// # Behavior
    /// - Same fencing as [`OutboxStore::complete`].
    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error>;

    /// What this store supports beyond the required behaviour.
    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
    }

    /// A source of wake-up hints, if the store has one (see [`Capabilities::wakeups`]).
    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        Ok(None)
    }
}

/// A dead-lettered message, as listed for operators.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadMessage {
    /// The message as it would be published.
    pub message: Message,
    /// The last recorded error.
    pub last_error: String,
    /// The stored id, when it is not a UUID (a row written by hand that the relay quarantined:
    /// a claimed row that does not decode is dead-lettered on its own, without publishing,
    /// with a `last_error` that starts `undecodable row: ` and names the column and what is
    /// wrong with it); `message.id` is then the nil UUID, and the message is
    /// requeued or discarded by its `seq` ([`OutboxAdmin::requeue_seqs`]). Columns of such a row
    /// that do not decode are shown empty; `last_error` says which one is wrong.
    pub raw_id: Option<String>,
}

/// How many messages a store holds in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Counts {
    /// Not yet published, not leased (due or waiting for a retry or a not-before time).
    pub pending: u64,
    /// Leased to a relay (lease possibly expired but not yet reclaimed).
    pub leased: u64,
    /// Published and not yet purged.
    pub published: u64,
    /// Dead-lettered.
    pub dead: u64,
}

/// A partition key held back by its first unfinished message (its *head*): a dead head (under
/// [`HeadPolicy::Block`]) or a head that failed and waits for its next attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedKey {
    /// The partition key.
    pub partition_key: String,
    /// The head message's id; the nil UUID when its stored id is not a UUID (a row written by
    /// hand that the relay quarantined, see [`DeadMessage::raw_id`]): `head_seq` names it.
    pub head_id: Uuid,
    /// The head message's `seq`.
    pub head_seq: i64,
    /// `dead` or `retrying`.
    pub head_state: String,
    /// Attempts counted on the head message.
    pub attempts: u32,
    /// The head message's last error, if any.
    pub last_error: Option<String>,
}

/// What an operator (and the relay's gauges) want to know about a store at a glance.
///
/// Made by [`OutboxAdmin::status`]; every figure comes from one bounded query, with ages by
/// the database's clock.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StoreStatus {
    /// Messages waiting to be published and not leased.
    pub pending: u64,
    /// Messages leased to a relay.
    pub leased: u64,
    /// Dead-lettered messages.
    pub dead: u64,
    /// Age (database clock) of the oldest unpublished, not dead message, in seconds; `None`
    /// when there is none or the store does not report it.
    pub oldest_pending_age_seconds: Option<f64>,
    /// Keys held back by a dead or retrying head message; `None` when the store does not
    /// report it.
    pub blocked_keys: Option<u64>,
    /// Up to the requested number of blocked keys with their head message, oldest first.
    pub blocked: Vec<BlockedKey>,
    /// Messages published in the last minute (database clock), when the store keeps
    /// published messages and reports it; a running relay's throughput.
    pub published_last_minute: Option<u64>,
}

/// What a drain has left to do, and the dead letters: [`OutboxAdmin::backlog`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backlog {
    /// Messages not yet published and not dead: pending or leased
    /// ([`StoreStatus::pending`] + [`StoreStatus::leased`]).
    pub unfinished: u64,
    /// Dead-lettered messages ([`StoreStatus::dead`]).
    pub dead: u64,
}

/// Operator functions: dead letters, purge and counts.
///
/// Not needed by the relay loop itself; the conformance suite, the CLI and operators use them.
#[async_trait]
pub trait OutboxAdmin: Send + Sync {
    /// List up to `limit` dead messages, oldest first, after the given `seq` (for paging).
    ///
    /// # Behavior
    /// A `limit` of 0 returns an empty list (not an error).
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error>;

    /// Make dead messages pending and due again, with their attempts reset to zero.
    ///
    /// # Behavior
    /// Returns how many were requeued; ids that are not dead are ignored, and an empty list
    /// returns 0. The same holds for [`OutboxAdmin::discard`], [`OutboxAdmin::requeue_seqs`]
    /// and [`OutboxAdmin::discard_seqs`].
    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error>;

    /// Delete dead messages for good. Under [`HeadPolicy::Block`] this unblocks their keys.
    ///
    /// # Behavior
    /// Returns how many were discarded; ids that are not dead are ignored.
    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error>;

    /// [`OutboxAdmin::requeue`] by `seq`: works for dead rows whose id cannot be read.
    ///
    /// # Behavior
    /// Returns how many were requeued; seqs that are not dead are ignored. The default looks
    /// the seqs up with [`OutboxAdmin::list_dead`] and requeues their ids (enough for a store
    /// whose rows always decode); SQL stores override it with one statement.
    async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        let ids = dead_ids(self, seqs).await?;
        self.requeue(&ids).await
    }

    /// [`OutboxAdmin::discard`] by `seq`: works for dead rows whose id cannot be read.
    ///
    /// # Behavior
    /// Returns how many were discarded; seqs that are not dead are ignored (default: as for
    /// [`OutboxAdmin::requeue_seqs`]).
    async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        let ids = dead_ids(self, seqs).await?;
        self.discard(&ids).await
    }

    /// Delete at most `batch` published messages published more than `older_than` ago
    /// (database clock). Returns how many were deleted; call again until it returns 0.
    ///
    /// # Behavior
    /// - MUST NOT delete unpublished or dead messages.
    /// - MUST NOT make `seq` values reusable (a later message never gets the `seq` of a purged
    ///   one). Ids stay unique among the messages the store holds; the store need not remember
    ///   purged ids, since new ids are fresh UUID v7 values.
    /// - A store that deletes messages as they are published
    ///   ([`Capabilities::deletes_published`]) has none to purge and returns 0.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `batch` is 0 (it could never make progress), before
    /// anything is read or deleted. An `older_than` longer than [`MAX_DURATION`] is not an
    /// error: nothing was published that long ago, so it deletes nothing and returns 0.
    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error>;

    /// Count messages by state. `published` counts the published messages still held: none
    /// for a store that deletes them ([`Capabilities::deletes_published`]), and none that
    /// [`OutboxAdmin::purge_published`] deleted.
    async fn counts(&self) -> Result<Counts, Error>;

    /// Pending, leased and dead counts, the oldest pending message's age, blocked keys (at most
    /// `blocked_limit` listed) and the last minute's publications.
    ///
    /// # Behavior
    /// - SHOULD cost one round trip whose cost grows with the unpublished and dead rows, never
    ///   with the published history (relays call it periodically for their gauges).
    /// - Ages and the last minute use the database's clock.
    /// - A `blocked_limit` of 0 lists no key; `blocked_keys` still counts them all.
    ///
    /// The default is built from [`OutboxAdmin::counts`] and leaves the age, the blocked keys
    /// and the throughput unreported (`None`).
    async fn status(&self, blocked_limit: usize) -> Result<StoreStatus, Error> {
        let _ = blocked_limit;
        let counts = self.counts().await?;
        Ok(StoreStatus {
            pending: counts.pending,
            leased: counts.leased,
            dead: counts.dead,
            ..StoreStatus::default()
        })
    }

    /// The unfinished (pending or leased) and dead messages: what `outbox-relay drain` measures
    /// its progress against, asked for every few seconds while it runs.
    ///
    /// # Behavior
    /// - The same figures as [`OutboxAdmin::status`]: `unfinished` is its `pending + leased`,
    ///   `dead` its `dead`.
    /// - SHOULD cost less than `status` where the store can tell unfinished rows without
    ///   reading their leases, retry times or keys (one index or table of unfinished rows).
    ///
    /// The default is built from [`OutboxAdmin::status`] with no blocked key listed.
    async fn backlog(&self) -> Result<Backlog, Error> {
        let status = self.status(0).await?;
        Ok(Backlog {
            unfinished: status.pending + status.leased,
            dead: status.dead,
        })
    }

    /// A cheap query proving the store answers (readiness probes, the `store up` gauge).
    ///
    /// The default lists at most one dead letter.
    async fn ping(&self) -> Result<(), Error> {
        self.list_dead(None, 1).await.map(|_| ())
    }
}

macro_rules! forward_store {
    ($($ty:ty),*) => {$(
        #[async_trait]
        impl<T: OutboxStore + ?Sized> OutboxStore for $ty {
            async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
                (**self).claim(req).await
            }
            async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
                (**self).complete(token, ids).await
            }
            async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
                (**self).fail(token, failures).await
            }
            async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
                (**self).extend(token, lease).await
            }
            async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
                (**self).release(token, ids).await
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
            async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
                (**self).wakeups().await
            }
        }

        #[async_trait]
        impl<T: OutboxAdmin + ?Sized> OutboxAdmin for $ty {
            async fn list_dead(&self, after_seq: Option<i64>, limit: usize) -> Result<Vec<DeadMessage>, Error> {
                (**self).list_dead(after_seq, limit).await
            }
            async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
                (**self).requeue(ids).await
            }
            async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
                (**self).discard(ids).await
            }
            async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
                (**self).requeue_seqs(seqs).await
            }
            async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
                (**self).discard_seqs(seqs).await
            }
            async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
                (**self).purge_published(older_than, batch).await
            }
            async fn counts(&self) -> Result<Counts, Error> {
                (**self).counts().await
            }
            async fn status(&self, blocked_limit: usize) -> Result<StoreStatus, Error> {
                (**self).status(blocked_limit).await
            }
            async fn backlog(&self) -> Result<Backlog, Error> {
                (**self).backlog().await
            }
            async fn ping(&self) -> Result<(), Error> {
                (**self).ping().await
            }
        }
    )*};
}

forward_store!(&T, Arc<T>, Box<T>);

/// The ids of the dead messages among `seqs`, read a page of dead letters at a time.
async fn dead_ids<A: OutboxAdmin + ?Sized>(admin: &A, seqs: &[i64]) -> Result<Vec<Uuid>, Error> {
    const PAGE: usize = 500;
    let Some(&last) = seqs.iter().max() else {
        return Ok(Vec::new());
    };
    let wanted: std::collections::HashSet<i64> = seqs.iter().copied().collect();
    let mut ids = Vec::new();
    let mut after = None;
    loop {
        let page = admin.list_dead(after, PAGE).await?;
        let full = page.len() == PAGE;
        for dead in &page {
            if wanted.contains(&dead.message.seq) {
                ids.push(dead.message.id);
            }
        }
        match page.last() {
            Some(d) if full && d.message.seq < last => after = Some(d.message.seq),
            _ => return Ok(ids),
        }
    }
}

/// Longest name of a relay group ([`GroupRenewal::group`]) or of a member
/// ([`GroupRenewal::member_name`]), in bytes.
pub const MAX_GROUP_NAME_BYTES: usize = 200;

/// Arguments of [`RelayGroupStore::renew_group`]: one member's heartbeat, with the shards it
/// wants to hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRenewal {
    /// The group's name: relays of one outbox that name the same group divide its shards.
    pub group: String,
    /// This member's id: random per relay process (a restarted relay is a new member).
    pub member: Uuid,
    /// A readable name for operators, e.g. `host:pid`.
    pub member_name: String,
    /// How many claim shards the group divides (the relay's claim shards), at least 1.
    pub shards: u32,
    /// How long the heartbeat and the shard leases last (by the database's clock).
    pub lease: Duration,
}

impl GroupRenewal {
    /// Refuse a renewal no store can serve: an empty or overlong group or member name, no
    /// shards, a lease of 0 or longer than [`MAX_DURATION`].
    pub fn validate(&self) -> Result<(), Error> {
        if self.group.is_empty() || self.group.len() > MAX_GROUP_NAME_BYTES {
            return Err(Error::invalid_input(format!(
                "relay group name must be 1 to {MAX_GROUP_NAME_BYTES} bytes long, got {}",
                self.group.len()
            )));
        }
        if self.member_name.len() > MAX_GROUP_NAME_BYTES {
            return Err(Error::invalid_input(format!(
                "relay group member name is longer than {MAX_GROUP_NAME_BYTES} bytes"
            )));
        }
        if self.shards == 0 {
            return Err(Error::invalid_input(
                "relay group shard count is 0; a group divides at least 1 shard",
            ));
        }
        if self.lease.is_zero() {
            return Err(Error::invalid_input(
                "relay group lease is 0; give members time to renew, e.g. 10s",
            ));
        }
        validate_duration("relay group lease", self.lease)
    }
}

/// One shard held by a member of a relay group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardLease {
    /// The shard's index, `0..shards`.
    pub shard: u32,
    /// Fencing number of this ownership: bumped each time the shard changes hands, never by a
    /// renewal, so a holder can tell a renewal from a takeover.
    pub fence: i64,
    /// When the ownership ends unless renewed, by the database's clock.
    pub lease_until: DateTime<Utc>,
}

/// What [`RelayGroupStore::renew_group`] returns: the shards the member holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupView {
    /// The database's time of the renewal.
    pub now: DateTime<Utc>,
    /// Live members of the group (unexpired heartbeats), this one included.
    pub members: u32,
    /// The shards this member holds after the renewal, by index.
    pub owned: Vec<ShardLease>,
}

/// One member of a relay group, as [`RelayGroupStore::group_status`] lists it for operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMember {
    /// The member's id.
    pub member: Uuid,
    /// Its readable name (e.g. `host:pid`).
    pub member_name: String,
    /// When it last renewed (database clock).
    pub renewed_at: DateTime<Utc>,
    /// When its heartbeat ends unless renewed (database clock).
    pub lease_until: DateTime<Utc>,
    /// Whether the heartbeat is still unexpired at the status query's database time.
    pub alive: bool,
    /// The shards it holds under an unexpired lease.
    pub shards: Vec<u32>,
}

/// A relay group's membership and shard leases, for stores that let replicas of a relay divide
/// the claim shards ([`ClaimShard`]) between them instead of all claiming every shard.
///
/// Optional: a store that does not implement it simply runs relays without groups (every
/// replica claims every shard, which stays correct, only slower). Implemented by the Postgres,
/// MariaDB and memory stores.
///
/// # Behavior
/// - Every time comes from the database's clock.
/// - A member is *live* while its heartbeat (renewed by [`RelayGroupStore::renew_group`]) is
///   unexpired. A shard is *held* by at most one member at any database time: its lease is
///   unexpired and names that member.
/// - A renewal renews the member's heartbeat and the leases of the shards it still holds, gives
///   back held shards beyond its fair share `ceil(shards / live members)` (highest indexes
///   first), and takes free shards (never held, given back, or whose lease expired) up to that
///   share. An expired lease is never revived by its old holder: the shard is taken anew, with
///   a new fence, by whoever renews first.
/// - Exclusive shards only narrow what each replica claims; per-key order, fencing and
///   exclusive claims still come from each claim, so a stale holder costs speed, never
///   correctness.
#[async_trait]
pub trait RelayGroupStore: Send + Sync {
    /// Renew `req.member`'s heartbeat and shard leases, rebalance toward its fair share, and
    /// return what it holds now. One round trip.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a request [`GroupRenewal::validate`] refuses, before anything
    /// changes.
    async fn renew_group(&self, req: &GroupRenewal) -> Result<GroupView, Error>;

    /// Leave the group: drop `member`'s heartbeat and give back its shards at once, so the
    /// other members take them at their next renewal. Leaving twice, or a group never joined,
    /// is not an error.
    async fn leave_group(&self, group: &str, member: Uuid) -> Result<(), Error>;

    /// The members of `group` (live ones, and expired ones not yet forgotten), oldest first.
    async fn group_status(&self, group: &str) -> Result<Vec<GroupMember>, Error>;
}

/// The fair share of one member of a relay group: `ceil(shards / members)` (all of them when
/// `members` is 0).
///
/// ```
/// assert_eq!(outbox_traits::fair_share(2, 3), 1);
/// assert_eq!(outbox_traits::fair_share(6, 4), 2);
/// ```
pub fn fair_share(shards: u32, members: u32) -> u32 {
    shards.div_ceil(members.max(1))
}

macro_rules! forward_group {
    ($($ty:ty),*) => {$(
        #[async_trait]
        impl<T: RelayGroupStore + ?Sized> RelayGroupStore for $ty {
            async fn renew_group(&self, req: &GroupRenewal) -> Result<GroupView, Error> {
                (**self).renew_group(req).await
            }
            async fn leave_group(&self, group: &str, member: Uuid) -> Result<(), Error> {
                (**self).leave_group(group, member).await
            }
            async fn group_status(&self, group: &str) -> Result<Vec<GroupMember>, Error> {
                (**self).group_status(group).await
            }
        }
    )*};
}

forward_group!(&T, Arc<T>, Box<T>);
