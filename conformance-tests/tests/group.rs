//! The memory store's relay groups pass the conformance suite's group check, on its own clock.

use std::time::Duration;

use outbox_conformance_tests::group::{check_group, GroupHarness};
use outbox_memory::MemoryStore;
use outbox_traits::{async_trait, Error, RelayGroupStore};

struct Harness(MemoryStore);

#[async_trait]
impl GroupHarness for Harness {
    fn groups(&self) -> &dyn RelayGroupStore {
        &self.0
    }

    async fn advance(&self, by: Duration) -> Result<(), Error> {
        self.0.clock().advance(by);
        Ok(())
    }
}

#[tokio::test]
async fn memory_relay_groups_conform() {
    let harness = Harness(MemoryStore::new());
    check_group(&harness, "relays").await.unwrap();
}
