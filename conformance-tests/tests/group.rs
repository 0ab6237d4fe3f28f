//! The memory store's relay groups pass the conformance suite's group check, on its own clock;
//! and the check can fail: it catches every deliberately broken group store.

use std::time::Duration;

use outbox_memory::MemoryStore;
use outbox_traits::{async_trait, Error, RelayGroupStore};

struct Harness(MemoryStore);

#[async_trait]
impl outbox_conformance_tests::group::GroupHarness for Harness {
    fn groups(&self) -> &dyn RelayGroupStore {
        &self.0
    }

    async fn advance(&self, by: Duration) -> Result<(), Error> {
        self.0.clock().advance(by);
        Ok(())
    }
}

outbox_conformance_tests::group_suite!(Harness(MemoryStore::new()));

#[cfg(feature = "broken-stores")]
mod broken {
    use outbox_conformance_tests::group::run_group_suite;
    use outbox_memory::{Defect, MemoryStore};

    #[test]
    fn every_broken_group_store_is_caught() {
        for defect in Defect::GROUP {
            let result =
                run_group_suite(async { Some(super::Harness(MemoryStore::with_defect(defect))) });
            match result {
                Err(report) => eprintln!("{defect:?} caught: {report}"),
                Ok(()) => panic!("the group check passed a store with {defect:?}"),
            }
        }
    }
}
