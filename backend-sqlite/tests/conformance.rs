//! The conformance suite (`outbox-conformance-tests`) against the SQLite store, keeping published
//! rows (the default) and deleting them (`delete_published`). The harness is in `common`.

mod common;

use common::SqliteHarness;

outbox_conformance_tests::conformance_suite!(SqliteHarness {
    delete_published: false,
    clock_offset_ms: 0,
});

/// The same suite with `delete_published`: completing deletes the row.
mod deleting_published {
    use super::SqliteHarness;

    outbox_conformance_tests::conformance_suite!(SqliteHarness {
        delete_published: true,
        clock_offset_ms: 0,
    });
}
