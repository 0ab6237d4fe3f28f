//! The contract of the `outbox` relay: a minimal [`OutboxStore`] + [`Publisher`] pair.
//!
//! A service writes its business rows and a [`NewMessage`] in one database transaction (through a
//! backend's `enqueue` function, which takes the caller's transaction). A relay then claims
//! committed messages from an [`OutboxStore`], publishes them through a [`Publisher`], and
//! completes or fails them. This crate holds only the contract: the traits, the message, claim
//! and error types, the capabilities, and the rules every store and publisher follows (the
//! argument checks, and [`KeyGate`], the per-key order a publisher keeps inside a batch); it has
//! no database driver or async runtime dependency. What opening a store or a publisher from a
//! URL needs (redaction, secret files, option parsing) is in `outbox-url`.
//!
//! The traits are object safe: engines hold `Arc<dyn OutboxStore>` and `Box<dyn Publisher>`
//! chosen at run time, and both traits are forwarded for `&T`, `Arc<T>` and `Box<T>`.
//!
//! # Implementing a backend
//!
//! 1. **Table.** Keep for each message its id, a store-assigned increasing `seq`, the fields of
//!    [`NewMessage`], a state (`pending`, `leased`, `published`, `dead`), an attempt counter, a due
//!    time, a lease token and lease end, and the last error. Index the unpublished rows only
//!    (a partial index), so claims stay fast as history grows.
//! 2. **Enqueue** is your own function, generic over your driver's transaction, writing a whole
//!    batch in one round trip. Call [`NewMessage::validate`] first and refuse bad input with
//!    [`Error::InvalidInput`] before writing anything. A SQL store checks every schema or table
//!    name it splices into SQL (`outbox-sql-support`'s `validate_sql_identifier` does that for
//!    the repository's stores).
//! 3. **Claim by state, never by cursor.** `seq > last_seen` loses messages whose transaction
//!    commits after a later one. Select pending, due rows (or rows whose lease expired), lease
//!    them under a fresh [`LeaseToken`] with the lease end computed from the *database's* clock,
//!    and keep per-key order as [`OutboxStore::claim`] describes. Return at most the limit.
//! 4. **Fence** every later transition (`complete`, `fail`, `extend`, `release`) on the token and
//!    an unexpired lease; report what was not held with [`Error::LeaseLost`]. Check arguments
//!    first, with the shared functions, so every store answers alike
//!    ([`ClaimRequest::validate`], [`validate_lease_extension`], [`validate_failures`],
//!    [`validate_purge_batch`]; each method's `# Errors` and `# Behavior` say what is refused
//!    and what, like an empty id list, is not).
//! 5. **Never** hold a transaction or row lock after a method returns: the relay publishes
//!    between calls, and a lock held across a broker call stalls everyone.
//! 6. Implement [`OutboxAdmin`] (dead letters, purge, counts) so operators and the conformance
//!    suite can use it.
//! 7. **Run the conformance suite** (`outbox-conformance-tests`, a dev-dependency) against your
//!    store: implement its `Harness` and `HarnessStore` traits (a fresh store per case, enqueue
//!    through your transaction in a `HarnessTx`, time control, a simulated relay crash by
//!    dropping a relay handle; for a SQL table, `insert_raw` to write rows as a SQL writer in
//!    another language would) and add one macro line to a test file:
//!
//!    ```text
//!    // tests/conformance.rs, below (or importing) your `MyHarness`
//!    outbox_conformance_tests::conformance_suite!(MyHarness::new());
//!    ```
//!
//!    It expands to one test per check plus the model and engine properties: interleaved
//!    transactions, relays, crashes and lease expiries, checked for no loss, no phantom, per-key
//!    order, fencing, exact attempts and accounting, and also:
//!    - **Claim completeness.** A claim that returns fewer than its limit must return every
//!      message the contract requires of it. A message is *eligible* when it is committed,
//!      pending and due (or leased with an expired lease) and every earlier message of its key
//!      that holds the key back (pending, leased, or dead under [`HeadPolicy::Block`]) is
//!      eligible too. Required are: every *head* (an eligible message with no earlier eligible
//!      message of its key, and every eligible unordered message), and every eligible message
//!      among the first `limit` unpublished messages in `seq` order. That is the bounded-window
//!      allowance: a store reading a bounded stretch of the backlog (at least `limit` rows)
//!      may leave out a key's later eligible messages past it, never a head. So a claim that
//!      skips claimable rows, or lets rows of a key blocked in the middle of its backlog take
//!      its limit, fails. The generator writes long one-key backlogs (their first message
//!      often delayed, so blocking) followed by other keys' and unordered messages, which then
//!      lie just past a small claim's window.
//!    - **Lease arithmetic.** [`Claim::lease_until`] (of a non-empty claim) and the lease end
//!      [`OutboxStore::extend`] returns must be the database's now + the lease, with now read
//!      through the harness's `HarnessStore::now` just before and just after the call, within
//!      one second (clock and column precision). Stored lease and retry times are checked
//!      through behaviour: completeness requires a message to be claimable again once its
//!      lease or retry delay has passed by the model's clock, and eligibility forbids it
//!      before, so a lease or retry time computed from the wrong base or unit fails. A
//!      harness whose store has its own clock must return that clock from `now`.
//!    - **Whose clock.** On one machine the database's clock and the relay host's agree, so a
//!      time taken from the host (`SystemTime::now()`, `Utc::now()`) instead of the database
//!      passes everything above. A harness whose store runs on a clock at least a day away
//!      from the host's declares `HarnessCapabilities::skewed_clock`; the suite then checks the
//!      skew is real (`HarnessStore::now` that far from the host's clock) and every lease end,
//!      retry time and age is off by days if it came from the wrong clock. The suite's
//!      `skewed` module starts a private Postgres or MariaDB under libfaketime (`FAKETIME=+3d`)
//!      and runs the whole suite against it with `skewed::run_suite`, at an eighth of the
//!      cases; the SQLite harness overrides SQLite's `unixepoch('now', 'subsec')` on its
//!      connections instead, as SQLite's clock is the host's. Do the same for your store: run
//!      it on a server with a shifted clock, or shift the one clock function it reads.
//!    - **Relays at the same moment.** Besides steps one after another, the property has
//!      steps where every relay claims, settles or extends at once, each on its own
//!      connection, so lock and isolation bugs surface (two claims leasing one row, a claim
//!      that fails instead of waiting for another's lock, as a SQLite claim that starts
//!      `DEFERRED` instead of `IMMEDIATE` does). The combined outcome must be what some order
//!      of the moves gives, each checked as above (eligibility, exclusivity, fencing, per-key
//!      order, lease arithmetic, exact attempts). Completeness is not required of a claim that
//!      ran at the same moment as another relay's call: `OutboxStore::claim` counts rows locked
//!      by a concurrent claim among what holds a key back, and which rows a database locks is
//!      its own business (a concurrent claim locks candidates it does not return; InnoDB's
//!      fenced transitions lock index records beyond the rows they change), so a claim that
//!      skips locked rows may miss rows, and heads past its window, that no order explains.
//!      Every claim made one after another is held to completeness in full.
//!    - **Concurrent writers of one key.** Open business transactions write the same keys (there
//!      are only two), and commit in either order. Per-key order is `seq` order, and the rule
//!      checked is the contract's ([`OutboxStore::claim`], [`NewMessage::partition_key`]): a
//!      claim never returns a message before an earlier (smaller `seq`) message of its key
//!      that was *committed when the claim ran* and still holds the key back, and a message is
//!      first delivered after every earlier message of its key except one that was still
//!      uncommitted when the claim whose batch delivers it ran (or is rolled back, discarded,
//!      or dead under [`HeadPolicy::Skip`]). So a later-inserted message committed first may
//!      go first, exactly while the earlier one is uncommitted; an uncommitted row holds
//!      nothing back and is not required by completeness, and once it commits no later claim
//!      may pass it. A harness whose enqueue serialises the writers of a key (key locks, like
//!      `lock_keys` of the Postgres and MariaDB stores) declares
//!      `HarnessCapabilities::key_locks`: the property then runs an enqueue that writes a key
//!      another open transaction wrote in the background, fails if it returns while that
//!      transaction is open, and awaits it once it ends, expecting its messages' `seq`s after
//!      all of the other's (also those written while it waited): insert order is commit order.
//!      A writer never writes a key held by a transaction whose enqueue waits (that would
//!      deadlock).
//!    - **Sharded claims** ([`Capabilities::sharded_claims`], optional). A store that declares
//!      them gets about a third of the property's claims with a [`ClaimShard`] (1 to 3 shards)
//!      and two example checks: invalid shards are refused before anything is leased, and
//!      shards partition the keys (each key under one shard, every message once, in order). The
//!      model does not know your shard function; it learns which shard each key is in from what
//!      claims return, and holds each sharded claim to exactly what an unsharded claim would
//!      return restricted to the keys that may be in its shard.
//!
//!    `scripts/mutants` in the repository plants realistic bugs in the three SQL backends
//!    one at a time and requires the suite to catch each. Run it with `PROPTEST_CASES=1000` as CI
//!    does. For a backend that needs a server, `conformance_suite!(optional: ...)` takes an
//!    `Option` and skips when it is `None`. The repository's `examples/custom-backend` follows
//!    these seven steps: a store written from scratch whose whole test file is that one line.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod key_order;
mod message;
mod publisher;
mod store;

pub use error::{BoxError, Error, ErrorKind};
pub use key_order::{attempt_in_key_order, settle_in_key_order, KeyGate};
pub use message::{
    validate_batch, validate_content_type, Binary, Limits, Message, NewMessage, ValidMessage,
    DEFAULT_MAX_PAYLOAD_BYTES, JSON_CONTENT_TYPE, MAX_CONTENT_TYPE_BYTES, TRACEPARENT_HEADER,
};
pub use publisher::{PublishOutcome, Publisher};
pub use store::{
    fair_share, GroupMember, GroupRenewal, GroupView, RelayGroupStore, ShardLease,
    MAX_GROUP_NAME_BYTES,
};
pub use store::{
    validate_duration, validate_failures, validate_lease_extension, validate_purge_batch, Backlog,
    BlockedKey, Capabilities, Claim, ClaimRequest, ClaimShard, Counts, DeadMessage, FailAction,
    Failure, HeadPolicy, LeaseToken, OutboxAdmin, OutboxStore, StoreStatus, WakeSource,
    MAX_DURATION,
};

/// Re-exported so backends and users name the same versions.
pub use async_trait::async_trait;
/// Re-exported so backends and users name the same versions.
pub use chrono;
/// Re-exported so backends and users name the same versions.
pub use uuid;
