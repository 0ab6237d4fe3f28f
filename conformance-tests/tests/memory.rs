//! The whole suite against the in-memory reference store, keeping published messages (the
//! default), deleting them as they are published, and not sharding claims.

outbox_conformance_tests::conformance_suite!(outbox_conformance_tests::MemoryHarness);

/// The suite against a store that deletes on publish ([`Capabilities::deletes_published`]):
/// counts and purges follow that choice, everything else is unchanged.
///
/// [`Capabilities::deletes_published`]: outbox_traits::Capabilities::deletes_published
mod deleting {
    use std::sync::Arc;

    use outbox_conformance_tests::memory::MemoryHarnessStore;
    use outbox_conformance_tests::{Harness, HarnessStore};
    use outbox_memory::{Clock, MemoryStore};
    use outbox_traits::{async_trait, Error};

    struct DeletingHarness;

    #[async_trait]
    impl Harness for DeletingHarness {
        fn name(&self) -> String {
            "memory, deleting published".into()
        }

        async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
            let store = MemoryStore::deleting_published(Arc::new(Clock::new()));
            Ok(Box::new(MemoryHarnessStore::new(store)))
        }
    }

    outbox_conformance_tests::conformance_suite!(DeletingHarness);
}

/// The suite against a store that does not declare sharded claims (like SQLite and MariaDB):
/// the sharding checks skip, and the model property sends no shard.
mod unsharded {
    use std::sync::Arc;

    use outbox_conformance_tests::memory::MemoryHarnessStore;
    use outbox_conformance_tests::{Harness, HarnessStore};
    use outbox_memory::{Clock, MemoryStore};
    use outbox_traits::{async_trait, Error};

    struct UnshardedHarness;

    #[async_trait]
    impl Harness for UnshardedHarness {
        fn name(&self) -> String {
            "memory, unsharded".into()
        }

        async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
            let store = MemoryStore::unsharded(Arc::new(Clock::new()));
            Ok(Box::new(MemoryHarnessStore::new(store)))
        }
    }

    outbox_conformance_tests::conformance_suite!(UnshardedHarness);
}
