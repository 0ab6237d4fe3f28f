//! The conformance suite (`outbox-conformance-tests`) against the SQLite store, keeping published
//! rows (the default) and deleting them (`delete_published`). The harness is in `common`.

mod common;

use common::SqliteHarness;

outbox_conformance_tests::conformance_suite!(SqliteHarness {
    delete_published: false,
    clock_offset_ms: 0,
});

/// The same suite with `delete_published(true)`: completing deletes the row. Every check runs
/// in full; the two properties at a quarter of the cases (`reduced: 4`): they play the same
/// scenarios against the same claim statements, and the mutation score (README) is taken on
/// the suite above at CI's full count.
mod deleting_published {
    use super::SqliteHarness;

    outbox_conformance_tests::conformance_suite!(SqliteHarness {
        delete_published: true,
        clock_offset_ms: 0,
    }, reduced: 4);
}
