//! The shared conformance suite (checks and model properties) against the real Postgres store,
//! keeping published rows (the default) and deleting them (`delete_published`).

mod common;

use common::harness::PgHarness;

outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env());

/// The same suite with `delete_published(true)`: completing deletes the row. Every check runs
/// in full; the two properties at a quarter of the cases (`reduced: 4`): they play the same
/// scenarios against the same claim statements, and the mutation score (README) is taken on
/// the suite above at CI's full count.
mod deleting_published {
    use super::PgHarness;

    outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env()
        .map(PgHarness::deleting_published), reduced: 4);
}
