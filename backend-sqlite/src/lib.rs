//! SQLite backend for the `outbox` relay: the embedded default.
//!
//! Write your business rows and an outbox message in one rusqlite transaction with [`enqueue`];
//! a relay claims committed messages from a [`SqliteStore`] (an
//! [`OutboxStore`](outbox_traits::OutboxStore) + [`OutboxAdmin`](outbox_traits::OutboxAdmin)),
//! publishes them, and completes them. SQLite needs no server: the file is the whole setup.
//!
//! # Capabilities
//!
//! | | |
//! |---|---|
//! | Enqueue in the caller's transaction | yes: [`enqueue`], [`enqueue_batch`] take a [`rusqlite::Transaction`] |
//! | Claim by state, never by cursor (FM-A1) | yes |
//! | Per-key order, dead head `Block` / `Skip` (FM-B3) | yes, in one `BEGIN IMMEDIATE` transaction |
//! | Fenced leases: token + unexpired lease (FM-B4) | yes, [`Error::LeaseLost`](outbox_traits::Error::LeaseLost) names what was not held |
//! | Times from the database clock | yes: SQLite's `julianday('now')` in milliseconds, read once per transaction |
//! | `seq` never reused after purge + reopen (FM-A3) | yes: `AUTOINCREMENT`, checked by [`migrate`] |
//! | No `SQLITE_BUSY` from read-then-write upgrades (FM-E3) | yes: every store write transaction is `BEGIN IMMEDIATE` |
//! | [`concurrent_claimers`](outbox_traits::Capabilities::concurrent_claimers) | **yes**: several handles or processes on one file stay exclusive |
//! | [`wakeups`](outbox_traits::Capabilities::wakeups) | no: SQLite has no cross-connection notification; notify the relay in-process after your commit, it also polls |
//! | Dedup key | yes: `UNIQUE`; the key is free again once its message is purged |
//! | Blocking I/O kept off the async workers | yes: Tokio's blocking pool (see [`SqliteStore`]) |
//!
//! # Use through `outbox`
//!
//! The `outbox` facade crate re-exports this crate under its `sqlite` feature:
//!
//! ```toml
//! [dependencies]
//! outbox = { version = "0.1", features = ["sqlite"] }
//! ```
//!
//! and names everything of this crate under `outbox::sqlite` (`outbox::sqlite::SqliteStore`,
//! `outbox::sqlite::enqueue`, ...), next to the relay (`outbox::relay`) and the contract types.
//!
//! # Use directly
//!
//! ```toml
//! [dependencies]
//! outbox-backend-sqlite = "0.1"
//! outbox-traits = "0.1"
//! rusqlite = "0.37"
//! ```
//!
//! ```
//! use std::time::Duration;
//! use outbox_backend_sqlite::{enqueue, open_connection, SqliteConfig, SqliteStore};
//! use outbox_traits::{ClaimRequest, HeadPolicy, NewMessage, OutboxStore};
//! use rusqlite::TransactionBehavior;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let path = dir.path().join("app.db");
//! let config = SqliteConfig::default();
//! // The relay's side; migrate creates the outbox table if needed.
//! let store = SqliteStore::open(&path, config.clone()).await?;
//! store.migrate().await?;
//!
//! // The service's side: its own connection, one transaction for the order and its event.
//! let mut conn = open_connection(&path, &config)?;
//! conn.execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)")?;
//! let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
//! tx.execute("INSERT INTO orders (id, total) VALUES ('order-42', 12)", [])?;
//! let event = NewMessage::new("order", "order-42", "order.placed", serde_json::json!({"total": 12}));
//! enqueue(&tx, &config, &event)?;
//! tx.commit()?;
//!
//! // What a relay does (the `outbox-relay` engine runs this loop for you).
//! let claim = store
//!     .claim(&ClaimRequest { limit: 100, lease: Duration::from_secs(30), head_policy: HeadPolicy::Block, shard: None })
//!     .await?;
//! assert_eq!(claim.messages.len(), 1);
//! assert_eq!(claim.messages[0].id, event.id);
//! // ... publish, then:
//! store.complete(claim.token, &[event.id]).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Transactions: use `BEGIN IMMEDIATE`
//!
//! Begin the transactions that call [`enqueue`] with
//! [`TransactionBehavior::Immediate`](rusqlite::TransactionBehavior::Immediate). SQLite admits one
//! writer at a time; a DEFERRED transaction (rusqlite's default) that reads first and writes later
//! fails with `SQLITE_BUSY` at its first write when another connection wrote in between, and
//! SQLite does not wait `busy_timeout` in that case (FM-E3). `BEGIN IMMEDIATE` waits for the lock
//! up front, where the busy timeout applies. The store uses it for every write transaction.
//! Keep write transactions short: while one is open, the relay's claims wait for it.
//!
//! # A frozen relay
//!
//! SQLite admits one writer per file at a time, and a writer's lock belongs to its connection:
//! a relay process frozen (SIGSTOP, a paused VM or container, a stalled host) while it holds
//! the write lock keeps it until it resumes. That is SQLite's design; what this store bounds is
//! when it holds the lock:
//!
//! - Only inside one store call: a claim (one `BEGIN IMMEDIATE` transaction: the walk of the
//!   backlog and the lease of what it picks), or one `complete`, `fail`, `release` or `extend`
//!   transaction. Each runs from `BEGIN` to `COMMIT` on a blocking thread without waiting for
//!   anything else, typically for a millisecond or two (a claim that walks a long blocked
//!   backlog: up to about 25 ms over 100,000 rows, see [Performance](#performance)); never
//!   across a publish, a poll or a back-off.
//! - A relay frozen anywhere else (publishing, polling, backing off: nearly all of its time)
//!   holds no lock. The messages it leased go to another relay when their lease ends, and the
//!   rest of their keys waits behind them until then, as on the server databases.
//! - A relay frozen inside a store call blocks every writer of the file until it resumes:
//!   other relays and your service's transactions that enqueue (and any other write). Each
//!   waits [`SqliteConfig::busy_timeout`] (5 s by default) and then fails with `SQLITE_BUSY`:
//!   transient for a relay, which retries with back-off, counts no attempt and dead-letters
//!   nothing, but an error for your service's write. Readers are never blocked (WAL).
//!
//! What to do: run **one relay per SQLite file**. A second relay adds no throughput (there is
//! one writer at a time) and only adds a process whose freeze can block the file; several
//! relays stay exclusive ([`concurrent_claimers`](outbox_traits::Capabilities::concurrent_claimers))
//! so that a hand-over, such as a rolling restart, is safe. A freeze of the relay's host stalls
//! the service's writes only if it lands inside a store call; if even that is not acceptable,
//! use Postgres or MariaDB, where a frozen relay holds no lock that a writer needs. The lock
//! cannot cheaply be held for less: a claim must read the backlog and lease its picks in one
//! write transaction to stay exclusive and keep per-key order, and it already holds the lock
//! for that one transaction only.
//!
//! # Malformed rows
//!
//! A row written by plain SQL that cannot become a message (an id that is not text, headers
//! that are not a JSON object of strings, a payload that is not text, ...) is dead-lettered by
//! the claim that meets it, on its own and by `seq`, with a `last_error` naming the column and
//! the value's problem; the rest of the claim flows on and, under `Block`, the row's key waits
//! behind it like behind any dead head. Tables created (or upgraded) by `migrate` also refuse
//! such ids, payloads that are not JSON or over the limit, and headers that are not a JSON
//! object of strings: see "Writing from any language (SQL)" in the workspace README, which
//! also gives the INSERT for services in other languages.
//!
//! # Durability
//!
//! The database runs in WAL mode. The default [`Synchronous::Normal`] survives process crashes
//! (including `kill -9`) but may lose the last commits on power loss or OS crash, which for an
//! outbox can mean a published message whose business transaction is gone. Choose
//! [`Synchronous::Full`] (about 5× slower commits) when that is not acceptable.
//!
//! # Clock
//!
//! Lease ends, retry times and ages are computed from SQLite's `'now'`, read once per
//! transaction. SQLite is embedded, so that is the clock of the host running it, shared by all
//! processes using the file (SQLite files must not be shared over a network file system). A wall
//! clock jump forward expires leases early (a duplicate publish, never a clobbered state thanks to
//! fencing); a jump back lengthens them.
//!
//! # Performance
//!
//! A claim walks the live index (pending and leased rows only) in `seq` order and stops once it
//! has `limit` messages, so with a due backlog it reads about `limit` index entries however long
//! the backlog or the history is. Rows in front of the claimable ones that it must skip (leased
//! to another relay, waiting for a retry or a not-before time, or behind a blocked key head)
//! cost about 0.2 µs each. Measured on the project's 2-core machine (release build, WAL,
//! `synchronous = NORMAL`, 100,000 messages over 1,000 keys):
//!
//! | | |
//! |---|---|
//! | claim (limit 100) + complete loop | ≈ 47,000–54,000 messages/s |
//! | enqueue, 1,000 messages per transaction | ≈ 100,000–130,000 messages/s |
//! | enqueue, 1 message per transaction | ≈ 10,000–15,000 transactions/s |
//! | claim when every key's head is leased elsewhere (walks the whole 105,000-row backlog) | ≈ 24 ms |
//!
//! # The SQL
//!
//! [`migrate`] (and [`SqliteStore::migrate`]) runs [`SqliteConfig::migration_sql`] for the
//! configured table (`outbox` here); in short (the CHECK expressions and trigger bodies are in
//! `migration_sql()`, and the workspace README's "Writing from any language (SQL)" says what
//! they check):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS outbox (
//!     seq           INTEGER PRIMARY KEY AUTOINCREMENT,
//!     id            TEXT    NOT NULL UNIQUE DEFAULT (/* a v4 UUID from randomblob */)
//!                   CONSTRAINT id_uuid CHECK (/* hyphenated UUID text */),
//!     aggregatetype TEXT    NOT NULL,
//!     aggregateid   TEXT    NOT NULL,
//!     type          TEXT    NOT NULL,
//!     payload       TEXT    NOT NULL
//!                   CONSTRAINT payload_json CHECK (typeof(payload) = 'text' AND json_valid(payload))
//!                   CONSTRAINT payload_size CHECK (length(CAST(payload AS BLOB)) <= 1048576),
//!     headers       TEXT    NOT NULL DEFAULT '{}'
//!                   CONSTRAINT headers_object CHECK (json_valid(headers) AND json_type(headers) = 'object'),
//!     partition_key TEXT,                             -- NULL: unordered
//!     dedup_key     TEXT    UNIQUE,
//!     state         TEXT    NOT NULL DEFAULT 'pending'
//!                   CHECK (state IN ('pending', 'leased', 'published', 'dead')),
//!     attempts      INTEGER NOT NULL DEFAULT 0,
//!     available_at  INTEGER NOT NULL DEFAULT (CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)),
//!     lease_token   TEXT,
//!     lease_until   INTEGER,
//!     last_error    TEXT,
//!     created_at    INTEGER NOT NULL DEFAULT (CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)),
//!     published_at  INTEGER
//! );
//! CREATE INDEX IF NOT EXISTS outbox_live
//!     ON outbox (seq, partition_key, state, available_at, lease_until)
//!     WHERE state IN ('pending', 'leased');
//! CREATE INDEX IF NOT EXISTS outbox_lease ON outbox (lease_token) WHERE state = 'leased';
//! CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (seq) WHERE state = 'dead';
//! CREATE INDEX IF NOT EXISTS outbox_dead_key ON outbox (partition_key, seq) WHERE state = 'dead';
//! CREATE INDEX IF NOT EXISTS outbox_published ON outbox (published_at) WHERE state = 'published';
//! -- Header values are strings (BEFORE INSERT, when headers <> '{}'); partition_key defaults
//! -- to the aggregate id and '' is stored as NULL (AFTER INSERT, when it is NULL or '').
//! CREATE TRIGGER IF NOT EXISTS outbox_headers BEFORE INSERT ON outbox ...;
//! CREATE TRIGGER IF NOT EXISTS outbox_partition_key AFTER INSERT ON outbox ...;
//! -- Ids are stored in lower case (AFTER INSERT, only when the id has an upper-case letter),
//! -- the form the relay completes by.
//! CREATE TRIGGER IF NOT EXISTS outbox_id_case AFTER INSERT ON outbox ...;
//! ```
//!
//! The schema, its defaults, checks and triggers work on SQLite 3.35 and later, so that a
//! service using its platform's SQLite can write rows. A table made by an earlier version of
//! this crate is rebuilt once by `migrate`, keeping its rows and `seq` counter; when `migrate`
//! adds the id trigger to an existing table it also lowers the ids already stored in upper or
//! mixed case, once.
//!
//! Why normalise on insert rather than match case-insensitively: claims, completions and the
//! admin calls find a row by `id = ?` on the unique index, as fast as before; a `lower(id)` or
//! `COLLATE NOCASE` comparison would need another index or a table rebuild. The trigger costs
//! a lower-case writer (the Rust enqueue, most SQL writers) one comparison per row.
//!
//! Times are integer milliseconds since the Unix epoch (`available_at` is the due time of a
//! pending message: its not-before time or its retry time).
//!
//! # Source layout
//!
//! The same files do the same jobs in the three SQL backends (`config.rs`, `store.rs`,
//! `migrate.rs`, `sql.rs`, `enqueue.rs`, `claim.rs`, `lease.rs`, `admin.rs`, `row.rs`,
//! `error.rs`), plus `connection.rs` (opening and configuring connections) and `cancel.rs`
//! (rolling back calls whose caller went away) here; the table is in the workspace README's
//! layout section.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod cancel;
mod claim;
mod config;
mod connection;
#[cfg(feature = "diesel")]
#[cfg_attr(docsrs, doc(cfg(feature = "diesel")))]
pub mod diesel;
mod enqueue;
mod error;
mod lease;
mod migrate;
mod row;
mod sql;
mod status;
mod store;
pub mod url;

pub use config::{
    SqliteConfig, SqliteConfigBuilder, Synchronous, DEFAULT_BUSY_TIMEOUT, DEFAULT_TABLE,
};
pub use connection::open_connection;
pub use enqueue::{enqueue, enqueue_batch};
pub use error::sqlite_error;
pub use migrate::migrate;
pub use store::SqliteStore;

/// Re-exported so that callers name the same rusqlite version as this crate.
pub use rusqlite;
