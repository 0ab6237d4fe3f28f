//! The shared conformance suite (checks and model properties) against the real MariaDB store,
//! keeping published rows (the default) and deleting them (`delete_published`).
//!
//! Each fresh store is a new table with a random name in the database of
//! `OUTBOX_TEST_MYSQL_URL`, dropped at teardown (see `common::harness::MysqlHarness`).

mod common;

use common::harness::MysqlHarness;

outbox_conformance_tests::conformance_suite!(optional: MysqlHarness::from_env());

/// The same suite with `delete_published(true)`: completing deletes the row. Every check runs
/// in full; the two properties at a quarter of the cases (`reduced: 4`): they play the same
/// scenarios against the same claim statements, and the mutation score (README) is taken on
/// the suite above at CI's full count.
mod deleting_published {
    use super::MysqlHarness;

    outbox_conformance_tests::conformance_suite!(optional: MysqlHarness::from_env()
        .map(MysqlHarness::deleting_published), reduced: 4);
}
