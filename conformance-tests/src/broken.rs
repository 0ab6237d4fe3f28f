//! Deliberately broken stores, to prove the suite fails when a store breaks the contract.
//!
//! Each wraps the memory reference store with one [`Defect`] switched on. The meta-test
//! (`tests/broken_stores.rs`) requires the model property to catch every one within 200 cases.

pub use outbox_memory::Defect;
use outbox_memory::MemoryStore;
use outbox_traits::{async_trait, Error};

use crate::harness::{Harness, HarnessStore};
use crate::memory::MemoryHarnessStore;

/// A harness whose stores all carry `defect`.
#[derive(Debug, Clone, Copy)]
pub struct BrokenHarness(pub Defect);

#[async_trait]
impl Harness for BrokenHarness {
    fn name(&self) -> String {
        format!("memory store with defect {:?}", self.0)
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        Ok(Box::new(MemoryHarnessStore::new(MemoryStore::with_defect(
            self.0,
        ))))
    }
}
