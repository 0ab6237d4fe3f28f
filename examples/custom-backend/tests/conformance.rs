//! Every check and property of the conformance suite, run against `VecStore`.

outbox_conformance_tests::conformance_suite!(outbox_example_custom_backend::VecHarness);
