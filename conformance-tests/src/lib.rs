//! Conformance suite for outbox stores and publishers.
//!
//! A backend implements [`Harness`] and runs every check and property with one line:
//! `outbox_conformance_tests::conformance_suite!(MyHarness::new());` (see [`conformance_suite!`]).

pub mod env;
pub mod harness;
pub mod memory;
pub mod publisher;

pub use harness::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
pub use memory::{MemoryHarness, MemoryHarnessStore};
