//! The outbox relay engine: claim → publish → complete / fail / release, over any
//! [`OutboxStore`](outbox_traits::OutboxStore) and [`Publisher`](outbox_traits::Publisher).
//!
//! Drain what is due (tests, examples, cron jobs), here with the in-memory reference store:
//!
//! ```
//! use std::sync::Arc;
//! use outbox_memory::{MemoryStore, RecordingPublisher};
//! use outbox_engine::{Relay, RelayConfig};
//! use outbox_traits::NewMessage;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), outbox_traits::Error> {
//! let store = Arc::new(MemoryStore::new());
//! let publisher = Arc::new(RecordingPublisher::new());
//! store.enqueue([NewMessage::new("order", "o-1", "order.placed", serde_json::json!({"total": 12}))])?;
//!
//! let relay = Relay::new(store, publisher.clone(), RelayConfig::default())?;
//! let stats = relay.run_until_idle().await?;
//! assert_eq!((stats.claimed, stats.published), (1, 1));
//! assert_eq!(publisher.published_ids().len(), 1);
//! # Ok(())
//! # }
//! ```
//!
//! Or serve until told to stop:
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use outbox_engine::{Relay, RelayConfig};
//! use outbox_traits::{Error, OutboxStore, Publisher};
//!
//! async fn serve(store: Arc<dyn OutboxStore>, publisher: Arc<dyn Publisher>) -> Result<(), Error> {
//!     let relay = Relay::new(store, publisher, RelayConfig::default())?;
//!     // Hand the notifier to the code that enqueues; it calls `notify()` after each commit.
//!     let notifier = relay.notifier();
//!     let handle = relay.spawn();
//!     notifier.notify();
//!     tokio::signal::ctrl_c().await.ok();
//!     let stats = handle.shutdown(Duration::from_secs(10)).await?;
//!     println!("published {} messages, {} dead", stats.published, stats.dead);
//!     Ok(())
//! }
//! ```
//!
//! # What the engine does
//!
//! - **Batches, pipelined.** It claims up to [`RelayConfig::batch_size`] messages at once and
//!   keeps up to [`RelayConfig::concurrency`] batches in flight: the next claim overlaps the
//!   current publish. Each batch is settled in bulk: one `complete` with every acknowledged id,
//!   one `fail` with every failure, one `release` with every message not attempted.
//! - **Sharded claims.** With a store that declares
//!   [`Capabilities::sharded_claims`](outbox_traits::Capabilities::sharded_claims),
//!   [`RelayConfig::claim_shards`] above 1 splits the partition keys into that many shards and
//!   runs one claim per shard at a time (each with its own polling and back-off), so a slow
//!   claim no longer holds up the others; `concurrency` stays the total in flight. Other stores
//!   get one claim at a time.
//! - **Fast by default.** Left unset, [`RelayConfig::claim_shards`] and
//!   [`RelayConfig::batch_size`] are the store's choice
//!   ([`Capabilities::preferred_claim_shards`](outbox_traits::Capabilities::preferred_claim_shards),
//!   [`preferred_batch`](outbox_traits::Capabilities::preferred_batch); Postgres: 2 shards,
//!   batches of 2,000), else 1 claim at a time and batches of 500, with no warning where the
//!   store cannot shard; an explicit setting wins. [`Relay::tuning`] says what is in effect.
//! - **Shared drains.** [`Relay::run_until_drained`] drains a backlog beside other relays: it
//!   waits for the messages they hold instead of returning at its first empty claim.
//! - **Outcomes.** `Acked` → complete. `Failed { Transient }` and `Ambiguous` → retry after a
//!   [`Backoff`] delay, or dead-letter once the attempt is the [`RelayConfig::max_attempts`]-th.
//!   `Failed { Permanent }` → dead-letter at once. `NotAttempted` → release (no attempt counted),
//!   so a key's later messages wait for the failed one and per-key order holds. A publisher that
//!   returns the wrong number of outcomes has the whole batch retried as ambiguous; one that
//!   acknowledges a message after its key's earlier message failed is logged as a bug
//!   (`outbox_order_violations_total`), and the message is still completed. `NotAttempted`
//!   without an earlier failure of the same key in the batch is a publisher bug too; it is
//!   retried as ambiguous (counting an attempt) so that it cannot loop forever.
//! - **Leases.** While a publish runs past half the lease, the lease is extended (again at each
//!   half-time). A lost lease is not an error: the store fences the later transition, the relay
//!   counts it ([`RelayStats::lease_lost`]) and carries on.
//! - **Outages.** Store errors never end a running relay: it backs off
//!   ([`RelayConfig::store_backoff`]) and tries again; a failed `complete`, `fail` or `release`
//!   is retried while the lease lasts. A batch with nothing acknowledged and nothing refused
//!   for good asks [`Publisher::check`](outbox_traits::Publisher::check); if the broker is
//!   down, the batch is released without counting an attempt, the relay stops claiming and
//!   probes the broker (back-off from 100 ms, capped at 1 s; `outbox_broker_probes_total`)
//!   and resumes when a probe succeeds. Each outage of the broker or the store is logged once at
//!   WARN when it starts and once at INFO (with its length) when it ends, and sets the
//!   `outbox_broker_up` / `outbox_store_up` gauge. A broker or store outage therefore never
//!   dead-letters a message. Only [`Relay::run_until_idle`] (and
//!   [`Relay::run_until_idle_or`]) returns an error: a permanent one, or the broker being down.
//! - **Idle polling and wake-ups.** After an empty claim the relay waits
//!   [`RelayConfig::poll_min`], doubling on each further empty claim up to
//!   [`RelayConfig::poll_max`]; after a full claim it claims again at once. A [`Notifier`] or the
//!   store's [`WakeSource`](outbox_traits::WakeSource) cuts the wait short; both are hints, and a
//!   failing wake-up source is resubscribed later while polling carries on. Once a claim made on
//!   a wake-up finds nothing, the next wake-up is served after a pause of at most 10 ms
//!   (`poll_min` if shorter), so a flood of stale hints cannot spin the loop.
//! - **Shutdown.** [`RelayHandle::shutdown`] (or the future given to [`Relay::run`] or
//!   [`Relay::run_until_idle_or`] resolving) stops claiming, lets in-flight batches publish and
//!   settle until the deadline, then releases what is still leased.
//!
//! # Delivery guarantees
//!
//! At least once, in per-key order, with the stable message id on every delivery so consumers
//! can drop duplicates. Per-key order is insert (`seq`) order among committed messages: two
//! transactions writing one key at once can commit in the other order, and then the message
//! inserted second is published first; the Postgres and MariaDB stores' key lock (`lock_keys`)
//! serialises such writers (see the README, "Per-key order and concurrent writers"). No database transaction or lock is held while publishing: every store
//! call returns before the publish starts.
//!
//! **Crash and cancel safety.** Dropping the engine, a [`Relay::run_until_idle`] future, or
//! aborting a spawned relay's task ([`RelayHandle::abort`]) at any await point loses nothing:
//! messages it had claimed stay leased until their lease ends and are then claimed again; a
//! message published but not yet completed is published again (a duplicate, never a loss).
//!
//! # Metrics
//!
//! Through the [`metrics`] facade, every metric labelled `publisher` with
//! [`Publisher::name`](outbox_traits::Publisher::name): counters
//! `outbox_claimed_total`, `outbox_published_total`, `outbox_retried_total`, `outbox_dead_total`,
//! `outbox_released_total`, `outbox_lease_lost_total`, `outbox_store_errors_total`,
//! `outbox_order_violations_total`; histograms `outbox_claim_seconds`,
//! `outbox_publish_seconds`, `outbox_batch_size`. The names are constants in [`metric_names`].
//! Each batch runs in a `tracing` span `outbox_batch` with its size, lease token and publisher.

mod backoff;
mod batch;
mod config;
mod drain;
mod engine;
pub mod group;
mod handle;
mod lease;
mod notifier;
mod outage;
mod outcome;
mod pacing;
mod run_loop;
mod shared;
mod stats;
mod telemetry;
#[cfg(feature = "otel")]
pub mod trace;
mod wait;
mod wake;

pub use backoff::Backoff;
pub use config::{
    Chosen, RelayConfig, RelayConfigBuilder, Tuning, DEFAULT_BATCH_SIZE, DEFAULT_CLAIM_SHARDS,
    MAX_CLAIM_SHARDS,
};
pub use drain::DRAIN_SETTLE;
pub use engine::Relay;
pub use handle::RelayHandle;
pub use notifier::Notifier;
pub use run_loop::RELEASE_GRACE;
pub use stats::RelayStats;
pub use telemetry::{describe_metrics, record_status, record_status_for, record_up, record_up_for};
#[cfg(feature = "otel")]
pub use trace::Traces;

/// Names of the metrics the relay records, and of their label.
pub mod metric_names {
    pub use crate::telemetry::{
        BATCH_SIZE, CLAIMED_TOTAL, CLAIM_SECONDS, DEAD_TOTAL, LEASE_LOST_TOTAL,
        ORDER_VIOLATIONS_TOTAL, OUTBOX_LABEL, PUBLISHED_TOTAL, PUBLISHER_LABEL, PUBLISH_SECONDS,
        RELEASED_TOTAL, RETRIED_TOTAL, STORE_ERRORS_TOTAL,
    };
    pub use crate::telemetry::{
        BATCH_SIZE_BUCKETS, BLOCKED_KEYS, BROKER_PROBES_TOTAL, BROKER_UP, CALL_BUCKETS,
        COMMIT_TO_ACK_BUCKETS, COMMIT_TO_ACK_SECONDS, DEAD_MESSAGES, HISTOGRAM_BUCKETS,
        LEASED_MESSAGES, OLDEST_PENDING_AGE_SECONDS, PENDING_MESSAGES, STORE_UP,
    };
}
