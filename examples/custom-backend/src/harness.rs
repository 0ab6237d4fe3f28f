//! Step 7: the conformance harness, so the whole suite runs against [`VecStore`].
//!
//! A real backend keeps this in its tests (or behind a `testing` feature); it lives in this
//! example's library so that `tests/conformance.rs` stays one line.

use std::sync::Arc;
use std::time::Duration;

use outbox_conformance_tests::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{async_trait, Error, NewMessage, OutboxAdmin, OutboxStore};

use crate::store::{VecStore, VecTx};

/// Makes a new, empty [`VecStore`] for every check and generated case.
#[derive(Debug, Clone, Copy, Default)]
pub struct VecHarness;

#[async_trait]
impl Harness for VecHarness {
    fn name(&self) -> String {
        "vec-store".into()
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        // Isolation for free: every store has rows of its own.
        Ok(Box::new(VecStore::new()))
    }
}

#[async_trait]
impl HarnessStore for VecStore {
    fn capabilities(&self) -> HarnessCapabilities {
        // Several transactions may be open at once and commit in any order.
        HarnessCapabilities::new(OutboxStore::capabilities(self))
    }

    async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error> {
        // A clone shares the rows; dropping it (the suite's relay crash) leaves its leases.
        Ok(Arc::new(self.clone()))
    }

    async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error> {
        Ok(Arc::new(self.clone()))
    }

    async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error> {
        Ok(Box::new(VecStore::begin(self)))
    }

    async fn advance_time(&self, by: Duration) -> Result<(), Error> {
        self.advance(by)
    }

    async fn now(&self) -> Result<DateTime<Utc>, Error> {
        Ok(VecStore::now(self))
    }
}

#[async_trait]
impl HarnessTx for VecTx {
    async fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error> {
        VecTx::enqueue(self, messages)
    }

    async fn commit(self: Box<Self>) -> Result<(), Error> {
        VecTx::commit(*self);
        Ok(())
    }

    async fn rollback(self: Box<Self>) -> Result<(), Error> {
        VecTx::rollback(*self);
        Ok(())
    }
}
