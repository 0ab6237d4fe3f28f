//! Conformance suite for outbox stores and publishers.
//!
//! A backend implements [`Harness`] and runs every check and property with one line:
//! `outbox_conformance_tests::conformance_suite!(MyHarness::new());` (see [`conformance_suite!`]).
//!
//! - [`checks`]: example-based checks, one `pub async fn` per rule, for those who pick.
//! - [`property::check_model`]: the state-machine property. Generated scenarios of business
//!   transactions (interleaved, committed out of order, rolled back), several relays claiming,
//!   publishing with acknowledged, transient, permanent and ambiguous outcomes, completing,
//!   failing, crashing at every point, leases expiring, stale relays completing, retries coming
//!   due, dead letters requeued and discarded, purges; after every step and at the end a
//!   reference model checks no loss, no phantom, per-key order, duplicates only from listed
//!   causes, fencing, claim limits and eligibility, exact attempts, dead-letter reasons and
//!   accounting. A failure prints the shrunk scenario in words and the broken invariant.

#[cfg(feature = "broken-stores")]
pub mod broken;
pub mod checks;
pub mod engine;
pub mod env;
pub mod harness;
mod macros;
pub mod memory;
mod model;
pub mod property;
pub mod publisher;
mod scenario;

pub use harness::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
pub use memory::{MemoryHarness, MemoryHarnessStore};
pub use model::{run_scenario, run_scenario_with_coverage, Coverage, Violation};
pub use scenario::{scenario, Advance, MsgSpec, OutcomeSpec, Phase, Scenario, Step, TxEnd};

#[doc(hidden)]
pub use proptest as __proptest;
#[doc(hidden)]
pub use tokio as __tokio;
