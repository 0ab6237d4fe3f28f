//! The shared conformance suite (checks and model properties) against the real Postgres store,
//! keeping published rows (the default) and deleting them (`delete_published`).

mod common;

use common::harness::PgHarness;

outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env());

/// The same suite with `delete_published(true)`: completing deletes the row.
mod deleting_published {
    use super::PgHarness;

    outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env()
        .map(PgHarness::deleting_published));
}
