//! The whole suite against the in-memory reference store.

outbox_conformance_tests::conformance_suite!(outbox_conformance_tests::MemoryHarness);
