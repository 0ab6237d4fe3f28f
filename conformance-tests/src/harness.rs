//! The harness trait: what a backend provides so the suite can drive it.
//!
//! Implement [`Harness`] (a factory of fresh stores) and [`HarnessStore`] (one isolated store
//! under test) for your backend, then add one line to your tests:
//!
//! ```text
//! outbox_conformance_tests::conformance_suite!(my_backend_tests::MyHarness::new());
//! ```
//!
//! # Rules every implementation follows
//! - **Isolation.** Each [`Harness::fresh`] returns a store that shares no messages with any
//!   other (its own schema, table or file), so cases run in parallel and never see each
//!   other's rows.
//! - **Real paths.** Enqueue goes through the backend's real transactional enqueue function
//!   inside a real database transaction; relays use the backend's real [`OutboxStore`].
//! - **Database time.** [`HarnessStore::advance_time`] moves the store's notion of "now"
//!   forward without sleeping: by shifting every stored timestamp (lease ends, due times,
//!   not-before times, created and published times) back by the same amount, or by moving a
//!   clock the store reads. The suite never sleeps to let a lease or a retry come due.
//! - **Skewed clock (optional).** A harness whose store runs on a clock days away from the
//!   host's declares [`HarnessCapabilities::skewed_clock`]; then the whole suite proves that no
//!   time is taken from the relay host's clock.
//! - **Key locks (optional).** A store whose enqueue makes a second writer of a key wait for
//!   the first transaction to end declares [`HarnessCapabilities::key_locks`]; the suite then
//!   expects such an enqueue to block, and insert order to be commit order.
//! - **Raw rows (optional).** A harness that can write a row as a SQL writer in another
//!   language would (a plain `INSERT` of text values, see [`RawRow`]) declares
//!   [`HarnessCapabilities::raw_rows`] and implements [`HarnessStore::insert_raw`]; the suite
//!   then checks that every odd but accepted value round-trips and every malformed one is
//!   quarantined on its own. A store without a SQL table leaves it off and runs the rest.
//! - **Crash = drop.** A relay crash is simulated by dropping the handle returned by
//!   [`HarnessStore::relay`] mid-step. Dropping it closes its connections but MUST NOT release
//!   its leases: they stay until they expire, as after a real crash.

use std::sync::Arc;
use std::time::Duration;

use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{async_trait, Capabilities, Error, NewMessage, OutboxAdmin, OutboxStore};

/// What a store under test supports, as far as the suite needs to know.
///
/// Build it with [`HarnessCapabilities::new`] and the `with_*` methods; fields may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HarnessCapabilities {
    /// What the store declares through [`OutboxStore::capabilities`]. With
    /// `concurrent_claimers`, the suite also runs relays that claim at the same moment.
    pub store: Capabilities,
    /// Several enqueue transactions may be open at once and commit in any order. SQLite has one
    /// writer, so it declares `false`: the suite then opens, fills and ends each transaction in
    /// one step, never interleaving it with other steps.
    pub concurrent_transactions: bool,
    /// The store's clock runs at least [`MIN_CLOCK_SKEW`] away from the host's (e.g. a private
    /// database server started under libfaketime). Every check and property then runs with
    /// "now" far from the relay host's clock, so a lease end, retry time or age taken from the
    /// host's clock instead of the database's is off by days and fails the lease-arithmetic
    /// and eligibility checks. The suite verifies the skew is real (in
    /// [`crate::checks::lease_uses_store_clock`]): [`HarnessStore::now`] must be that far from
    /// the host's clock.
    pub skewed_clock: bool,
    /// The store's enqueue serialises the writers of a partition key (key locks, e.g.
    /// `lock_keys(true)` on Postgres and MariaDB): an enqueue that writes a key another open
    /// transaction has written waits until that transaction commits or rolls back, and only
    /// then inserts, so its messages get `seq`s after all of the first transaction's (also
    /// those it wrote after the second writer began to wait) and commit order is insert order.
    /// The model then runs such an enqueue in the background, checks it has not returned while
    /// the first transaction is open, and awaits it once that transaction ends. Without it,
    /// concurrent writers of a key insert at once, and the suite checks the weaker rule of
    /// [`OutboxStore::claim`]: a message may be claimed before an earlier message of its key
    /// that was still uncommitted at that claim. Needs
    /// [`HarnessCapabilities::concurrent_transactions`].
    pub key_locks: bool,
    /// [`HarnessStore::insert_raw`] writes rows as a SQL writer would, through the database's
    /// checks (columns left out take their defaults). The suite then writes odd but accepted
    /// values (ids in upper and mixed case, Unicode keys and headers, every kind of JSON
    /// payload, large payloads, empty and long keys) and requires each to be claimed once,
    /// published exactly as written and completed.
    pub raw_rows: bool,
    /// [`HarnessStore::insert_raw`] with `checked: false` writes rows past the database's
    /// checks (as into a table made before them): headers that are not a JSON object of
    /// strings. The suite then requires each such row to be dead-lettered on its own, naming
    /// the column, under both head policies, while the others flow. Needs
    /// [`HarnessCapabilities::raw_rows`].
    pub unchecked_raw_rows: bool,
    /// The id column holds any text when unchecked (not a `uuid` type), so a row with an id
    /// that is not a UUID can be written, and must be quarantined. Needs
    /// [`HarnessCapabilities::unchecked_raw_rows`].
    pub text_ids: bool,
}

/// A row as a SQL writer in another language writes it: text values of the table's columns
/// (README, "Writing from any language (SQL)"), `None` for a column left out of the `INSERT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRow {
    /// The `id` text (any case and form the database accepts); `None`: the database's default.
    pub id: Option<String>,
    /// `aggregatetype`.
    pub aggregate_type: String,
    /// `aggregateid`.
    pub aggregate_id: String,
    /// `type`.
    pub event_type: String,
    /// `payload`, as JSON text.
    pub payload: String,
    /// `partition_key` (`''`: unordered); `None`: left out, the aggregate id.
    pub partition_key: Option<String>,
    /// `headers`, as JSON text; `None`: left out, `{}`.
    pub headers: Option<String>,
}

impl RawRow {
    /// A row with the four required columns; every optional one left out.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: impl Into<String>,
    ) -> Self {
        Self {
            id: None,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload: payload.into(),
            partition_key: None,
            headers: None,
        }
    }
}

/// The least distance between a skewed store clock and the host's (see
/// [`HarnessCapabilities::skewed_clock`]): far beyond any lease, retry delay or purge age of
/// the suite, so a time from the wrong clock can never pass for a right one.
pub const MIN_CLOCK_SKEW: Duration = Duration::from_secs(86_400);

impl HarnessCapabilities {
    /// The store's declared capabilities, with concurrent transactions allowed and the store's
    /// clock the host's.
    pub const fn new(store: Capabilities) -> Self {
        Self {
            store,
            concurrent_transactions: true,
            skewed_clock: false,
            key_locks: false,
            raw_rows: false,
            unchecked_raw_rows: false,
            text_ids: false,
        }
    }

    /// Set [`HarnessCapabilities::raw_rows`], [`HarnessCapabilities::unchecked_raw_rows`] and
    /// [`HarnessCapabilities::text_ids`].
    pub const fn with_raw_rows(mut self, raw: bool, unchecked: bool, text_ids: bool) -> Self {
        self.raw_rows = raw;
        self.unchecked_raw_rows = unchecked;
        self.text_ids = text_ids;
        self
    }

    /// Set [`HarnessCapabilities::key_locks`].
    pub const fn with_key_locks(mut self, yes: bool) -> Self {
        self.key_locks = yes;
        self
    }

    /// Set [`HarnessCapabilities::skewed_clock`].
    pub const fn with_skewed_clock(mut self, yes: bool) -> Self {
        self.skewed_clock = yes;
        self
    }

    /// Set [`HarnessCapabilities::concurrent_transactions`].
    pub const fn with_concurrent_transactions(mut self, yes: bool) -> Self {
        self.concurrent_transactions = yes;
        self
    }
}

/// A backend under test: a factory of fresh, isolated stores.
///
/// Cheap to create; connect lazily in [`Harness::fresh`]. The suite calls `fresh` once per
/// check and once per generated case, possibly from several test threads at once.
#[async_trait]
pub trait Harness: Send + Sync {
    /// A short name for failure messages, e.g. `postgres`.
    fn name(&self) -> String;

    /// A new, empty store that shares nothing with any other (its own schema, table or file).
    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error>;
}

/// One isolated store under test.
#[async_trait]
pub trait HarnessStore: Send + Sync {
    /// What the store supports; selects which checks run and how steps interleave.
    fn capabilities(&self) -> HarnessCapabilities;

    /// A new relay handle: the backend's real [`OutboxStore`] on its own connection(s).
    ///
    /// The suite opens several (one per simulated relay) and simulates a relay crash by
    /// dropping one mid-step: that MUST NOT release its leases.
    async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error>;

    /// The operator side of the same store, for dead letters, purge and counts.
    async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error>;

    /// Open a business transaction on the backend's real enqueue path.
    ///
    /// With [`HarnessCapabilities::concurrent_transactions`], several may be open at once; the
    /// suite then commits them in another order than they inserted, and a message's `seq` must
    /// come from its insert, not its commit.
    async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error>;

    /// Move the store's "now" forward by `by`, without sleeping (see the module docs).
    ///
    /// After it returns, every relay handle sees the new time: leases that end within `by` have
    /// expired, retries due within `by` are due, and messages published `by` ago are that old.
    async fn advance_time(&self, by: Duration) -> Result<(), Error>;

    /// The store's current time, as its claims see it (the suite derives not-before times from
    /// it and checks lease ends against it). The default is the host's clock, right for a
    /// database on the same machine whose timestamps [`HarnessStore::advance_time`] shifts
    /// back; a store with its own clock (a database server's `now()`, and always with
    /// [`HarnessCapabilities::skewed_clock`]) returns that clock.
    async fn now(&self) -> Result<DateTime<Utc>, Error> {
        Ok(Utc::now())
    }

    /// Insert `rows` in one committed transaction as a SQL writer would: a plain `INSERT` of
    /// the given columns' text (the others left to their defaults), not through the backend's
    /// enqueue. With `checked: false`, past the database's checks of ids and headers (e.g.
    /// MariaDB's `check_constraint_checks = 0`, or with the checks dropped from the table), as
    /// into a table made before them. Only called when [`HarnessCapabilities::raw_rows`] (and,
    /// unchecked, [`HarnessCapabilities::unchecked_raw_rows`]) is declared; the default refuses.
    async fn insert_raw(&self, rows: &[RawRow], checked: bool) -> Result<(), Error> {
        let _ = (rows, checked);
        Err(Error::invalid_input(
            "this harness cannot insert raw rows; do not declare HarnessCapabilities::raw_rows",
        ))
    }

    /// Free what the store holds (drop its schema, delete its file). Called once at the end of a
    /// check or case that passed; a failing one leaves the store for inspection.
    async fn teardown(self: Box<Self>) -> Result<(), Error> {
        Ok(())
    }
}

/// An open business transaction of a [`HarnessStore`].
///
/// Dropping it without commit must roll it back.
#[async_trait]
pub trait HarnessTx: Send {
    /// Write `messages` through the backend's real enqueue function, in this transaction.
    /// Each message's `seq` is assigned here, at insert. Several open transactions may write
    /// the same partition key; with [`HarnessCapabilities::key_locks`] the call then waits until
    /// the other transaction ends (the suite runs it in the background meanwhile).
    async fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error>;

    /// Commit: the messages become visible to claims.
    async fn commit(self: Box<Self>) -> Result<(), Error>;

    /// Roll back: the messages are never seen by anyone.
    async fn rollback(self: Box<Self>) -> Result<(), Error>;
}
