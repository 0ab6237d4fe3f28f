//! The shared conformance suite (checks and model properties) against the real MariaDB store,
//! keeping published rows (the default, on a table with an unpublished table), on a table with
//! its own claim indexes, deleting published rows (`delete_published`), and with key locks
//! (`lock_keys`).
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

/// The same suite with `lock_keys(true)`: a second writer of a key waits for the first
/// transaction to end (`HarnessCapabilities::key_locks`). The model then runs such an enqueue in
/// the background, fails if it returns while the first writer is open, and expects insert order
/// to be commit order; `concurrent_writers_of_a_key` shows the wait on one example. Every check
/// runs; the two properties at an eighth of the cases (`reduced: 8`): only the enqueue differs.
mod key_locks {
    use super::MysqlHarness;

    outbox_conformance_tests::conformance_suite!(optional: MysqlHarness::from_env()
        .map(MysqlHarness::locking_keys), reduced: 8);
}

/// The same suite on tables with their own claim indexes (`unpublished_table(false)`): tables
/// made before the unpublished table became the default for keeping published rows, which
/// their stores go on serving. (The suite above runs on the default, an unpublished table;
/// `deleting_published` on claim indexes too, a deleting configuration's new tables.) Every
/// check runs; the two properties at a quarter of the cases (`reduced: 4`).
mod claim_indexes {
    use super::MysqlHarness;

    outbox_conformance_tests::conformance_suite!(optional: MysqlHarness::from_env()
        .map(MysqlHarness::with_claim_indexes), reduced: 4);
}
