//! The harness for the in-memory reference store.

use std::sync::Arc;
use std::time::Duration;

use outbox_memory::{MemoryStore, MemoryTx};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{async_trait, Error, NewMessage, OutboxAdmin, OutboxStore};

use crate::harness::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};

/// Runs the suite against [`MemoryStore`]: each case gets a new store with its own clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryHarness;

#[async_trait]
impl Harness for MemoryHarness {
    fn name(&self) -> String {
        "memory".into()
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        Ok(Box::new(MemoryHarnessStore::new(MemoryStore::new())))
    }
}

/// A [`MemoryStore`] under test. Relay handles are clones sharing its state, so dropping one
/// leaves its leases in place, as a crashed relay's would be.
#[derive(Debug, Clone)]
pub struct MemoryHarnessStore {
    store: MemoryStore,
}

impl MemoryHarnessStore {
    /// Wrap `store` (e.g. one built with a defect, to test the suite itself).
    pub fn new(store: MemoryStore) -> Self {
        Self { store }
    }
}

#[async_trait]
impl HarnessStore for MemoryHarnessStore {
    fn capabilities(&self) -> HarnessCapabilities {
        HarnessCapabilities::new(OutboxStore::capabilities(&self.store))
    }

    async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error> {
        Ok(Arc::new(self.store.clone()))
    }

    async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error> {
        Ok(Arc::new(self.store.clone()))
    }

    async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error> {
        Ok(Box::new(MemoryHarnessTx(self.store.begin())))
    }

    async fn advance_time(&self, by: Duration) -> Result<(), Error> {
        self.store.clock().advance(by);
        Ok(())
    }

    async fn now(&self) -> Result<DateTime<Utc>, Error> {
        Ok(self.store.clock().now())
    }
}

struct MemoryHarnessTx(MemoryTx);

#[async_trait]
impl HarnessTx for MemoryHarnessTx {
    async fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error> {
        self.0.enqueue_batch(messages.iter().cloned())
    }

    async fn commit(self: Box<Self>) -> Result<(), Error> {
        self.0.commit();
        Ok(())
    }

    async fn rollback(self: Box<Self>) -> Result<(), Error> {
        self.0.rollback();
        Ok(())
    }
}
