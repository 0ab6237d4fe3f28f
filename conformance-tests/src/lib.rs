//! Conformance suite for outbox stores and publishers.
//!
//! A backend implements [`Harness`] (a fresh store per case, enqueue through its real
//! transaction, time control, a relay crash by dropping a handle) and runs every check and
//! property with one line: `outbox_conformance_tests::conformance_suite!(MyHarness::new());`
//! (see [`conformance_suite!`]).
//!
//! - [`checks`]: example-based checks, one `pub async fn` per rule, for those who pick. Among
//!   them: [`checks::argument_rules`] (every argument rule of the contract, answered alike by
//!   every store), and, for harnesses that can write rows as a SQL writer would
//!   ([`HarnessCapabilities::raw_rows`]), [`checks::raw_rows_round_trip`] (odd but accepted
//!   values round-trip exactly) and [`checks::malformed_raw_rows_quarantined`] (malformed rows
//!   are quarantined on their own under both head policies, and every admin path treats them
//!   alike).
//!   [`checks::Check::ENQUEUE`] are those that go through the enqueue path: a backend with a
//!   second one (e.g. diesel next to sqlx) runs them through it with [`enqueue_suite!`], its
//!   relays still on the backend's store.
//! - [`property::check_model`]: the state-machine property. Generated scenarios of business
//!   transactions (interleaved, committed out of order, rolled back, delayed), several relays
//!   claiming, publishing with acknowledged, transient, permanent and ambiguous outcomes,
//!   completing, failing, crashing between claim and publish and between publish and complete,
//!   leases expiring, stale relays settling late, retries coming due, dead letters requeued and
//!   discarded, purges, and relays claiming, settling and extending at the same moment on their
//!   own connections (the outcome must be what some order of their moves gives). Open
//!   transactions write the same keys (concurrent writers of a key), a SQL writer inserts rows
//!   with ids in upper and mixed case (with [`HarnessCapabilities::raw_rows`]), operators
//!   requeue and discard by id and by `seq`, and with
//!   [`HarnessCapabilities::key_locks`] a second writer's enqueue must wait for the first
//!   transaction to end. Against a store declaring sharded claims, some claims ask for one
//!   shard, and the model learns the store's shard function from what they return. After every
//!   step and at the end a reference model checks no loss, no phantom, per-key order (by the
//!   contract's rule for concurrent writers: an earlier message of a key may be passed only
//!   while it is uncommitted), duplicates only from listed causes, fencing, claim limits and
//!   eligibility, shard consistency, exact attempts, dead-letter reasons and accounting
//!   (`counts` and `status`: blocked keys with their heads, the oldest message's age). A
//!   failure prints the broken invariant and the shrunk scenario in words, step by step.
//! - [`engine::check_engine`]: the same invariants end to end through the real
//!   [`outbox_engine::Relay`], with a fault-injecting publisher and the engine aborted at random
//!   await points (before or after a store or broker call took effect), then restarted until
//!   drained.
//! - [`group::check_group`]: relay groups ([`outbox_traits::RelayGroupStore`]): shard leases
//!   exclusive at every database time, fair shares taken and given back, takeover after expiry
//!   with the stale holder fenced, leave, concurrent renewals. One line runs it against a
//!   store: [`group_suite!`]`(optional: MyGroupHarness::from_env().await)`; five deliberately
//!   broken group stores of the memory crate are each caught (`tests/group.rs`).
//! - [`property::measure_coverage`]: what generated scenarios exercise, to show they reach every
//!   situation.
//! - [`skewed`]: private Postgres and MariaDB servers whose clock runs days ahead of the host's
//!   (libfaketime), for harnesses that declare
//!   [`HarnessCapabilities::skewed_clock`]; with it every time the store takes from the relay
//!   host's clock instead of the database's is caught.
//! - `broken` (feature `broken-stores`): deliberately broken stores; the crate's meta-test
//!   requires the suite to catch each one within 200 cases.
//!
//! The number of cases comes from `PROPTEST_CASES` (256 by default); failing seeds are saved
//! beside the calling test file (`<test>.proptest-regressions`) and replayed first.

#[cfg(feature = "broken-stores")]
pub mod broken;
pub mod checks;
pub mod engine;
pub mod env;
pub mod group;
pub mod harness;
pub mod inbox;
mod macros;
pub mod memory;
mod model;
pub mod process;
pub mod property;
pub mod publisher;
mod scenario;
pub mod servers;
pub mod skewed;

pub use harness::{Harness, HarnessCapabilities, HarnessStore, HarnessTx, RawRow, MIN_CLOCK_SKEW};
pub use memory::{MemoryHarness, MemoryHarnessStore};
pub use model::{run_scenario, run_scenario_with_coverage, Coverage, Violation};
pub use scenario::{
    recorded, scenario, Advance, Move, MsgSpec, OutcomeSpec, Phase, Scenario, ShardSpec, Step,
    TxEnd,
};

#[doc(hidden)]
pub use proptest as __proptest;
#[doc(hidden)]
pub use tokio as __tokio;
