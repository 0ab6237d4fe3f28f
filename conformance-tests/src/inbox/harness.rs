//! The harness traits: what an inbox provides so the suite can drive it.
//!
//! # Rules every implementation follows
//! - **Isolation.** Each [`InboxHarness::fresh`] returns an inbox sharing no marks or effects
//!   with any other (its own schema, database, table or file).
//! - **Real paths.** [`InboxTx::record`] calls the inbox's real record function (its one-id
//!   form for one id, its batch form for several) inside a real database transaction, and
//!   [`InboxTx::apply_effect`] writes one effect row in that same transaction: a table without
//!   a unique constraint, so an effect applied twice shows as two rows.
//! - **Crash = drop.** Dropping an [`InboxTx`] without commit must roll it back, as a crashed
//!   consumer's transaction is (closing its connection is enough).
//! - **Time through the API.** [`InboxStore::age_marks`] makes every mark older by an amount,
//!   e.g. by moving its timestamp back; the suite never sleeps.

use std::time::Duration;

use outbox_traits::{async_trait, uuid::Uuid, Error};

/// One mark or one effect: the consumer's name and the message id.
pub type Mark = (String, Uuid);

/// What an inbox under test supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxCapabilities {
    /// Several consumer transactions may be open at once (two deliveries of one id race).
    /// SQLite has one writer, so its harness declares `false` and the races are not played.
    pub concurrent_transactions: bool,
}

impl InboxCapabilities {
    /// Concurrent transactions allowed.
    pub const fn new() -> Self {
        Self {
            concurrent_transactions: true,
        }
    }

    /// Set [`InboxCapabilities::concurrent_transactions`].
    pub const fn with_concurrent_transactions(mut self, yes: bool) -> Self {
        self.concurrent_transactions = yes;
        self
    }
}

impl Default for InboxCapabilities {
    fn default() -> Self {
        Self::new()
    }
}

/// An inbox under test: a factory of fresh, isolated inboxes. Called once per case, possibly
/// from several test threads at once.
#[async_trait]
pub trait InboxHarness: Send + Sync {
    /// A short name for failure messages, e.g. `postgres inbox`.
    fn name(&self) -> String;

    /// A new, empty inbox with its effect table, sharing nothing with any other.
    async fn fresh(&self) -> Result<Box<dyn InboxStore>, Error>;
}

/// One isolated inbox with its effect table.
#[async_trait]
pub trait InboxStore: Send + Sync {
    /// What it supports.
    fn capabilities(&self) -> InboxCapabilities;

    /// Begin a consumer transaction on a connection of its own.
    async fn begin(&self) -> Result<Box<dyn InboxTx>, Error>;

    /// Every committed mark, in any order.
    async fn marks(&self) -> Result<Vec<Mark>, Error>;

    /// Every committed effect row, in any order (an effect applied twice appears twice).
    async fn effects(&self) -> Result<Vec<Mark>, Error>;

    /// Make every committed mark older by `by` (without sleeping).
    async fn age_marks(&self, by: Duration) -> Result<(), Error>;

    /// How many transactions are waiting for a lock on this inbox's table right now, when the
    /// harness can tell (e.g. from `pg_locks` or `information_schema.innodb_trx`); `None`
    /// (the default) when it cannot. In a race the suite waits for the second transaction to
    /// be blocked (or done) before it ends the first, so that the wait itself is tested.
    async fn lock_waits(&self) -> Result<Option<u64>, Error> {
        Ok(None)
    }

    /// One call of the inbox's purge: delete at most `batch` marks older than `older_than`;
    /// returns how many it deleted.
    async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64, Error>;

    /// Free what the inbox holds. Called after a case that passed.
    async fn teardown(self: Box<Self>) -> Result<(), Error> {
        Ok(())
    }
}

/// An open consumer transaction. Dropping it without commit must roll it back.
#[async_trait]
pub trait InboxTx: Send {
    /// Record `ids` for `consumer` through the inbox's real call (the one-id form for one id,
    /// the batch form for several): one answer per id in order, `true` for new.
    async fn record(&mut self, consumer: &str, ids: &[Uuid]) -> Result<Vec<bool>, Error>;

    /// Write the effect of message `id` for `consumer` in this transaction.
    async fn apply_effect(&mut self, consumer: &str, id: Uuid) -> Result<(), Error>;

    /// Commit the marks and effects.
    async fn commit(self: Box<Self>) -> Result<(), Error>;

    /// Roll them back.
    async fn rollback(self: Box<Self>) -> Result<(), Error>;
}
