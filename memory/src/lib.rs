//! An in-memory reference [`OutboxStore`](outbox_traits::OutboxStore) and a recording
//! [`Publisher`](outbox_traits::Publisher).
//!
//! [`MemoryStore`] follows the store contract to the letter: transactions whose messages become
//! visible at commit, per-key order with both head policies, sharded claims, fencing by token and unexpired
//! lease, retries, dead letters, purge and counts, all on a manual [`Clock`] so tests control
//! time without sleeping. The conformance suite is checked against it.
//!
//! [`RecordingPublisher`] records every delivery, lets a test script outcomes per message, and
//! lets it wait for deliveries without sleeping.

mod clock;
mod defect;
mod group;
mod publisher;
mod store;

pub use clock::Clock;
#[cfg(feature = "defects")]
pub use defect::Defect;
pub use publisher::{Delivery, RecordingPublisher};
pub use store::{MemoryStore, MemoryTx};
