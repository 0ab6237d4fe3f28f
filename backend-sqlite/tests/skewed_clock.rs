//! The conformance suite with SQLite's clock three days ahead of this process's clock: every
//! lease end, retry time and age must come from SQLite's `unixepoch('now', 'subsec')`, never
//! from the relay's `SystemTime`, or the lease-arithmetic and eligibility checks fail by days.
//!
//! SQLite is embedded, so its clock is the host's; the harness moves it on every connection of
//! the test by overriding that SQL function (see `common::skew_clock` for why that is the same
//! test as a database server on a skewed clock). One test runs every check and both properties
//! at an eighth of `PROPTEST_CASES` (`conformance.rs` runs them in full).

mod common;

use common::SqliteHarness;
use outbox_conformance_tests::skewed::{reduced_cases, run_suite};

/// Three days, as the private servers' `FAKETIME` offset.
const SKEW_MS: i64 = 3 * 86_400 * 1000;

#[test]
fn suite_with_sqlite_clock_skewed_from_host() {
    let harness = || SqliteHarness {
        delete_published: false,
        clock_offset_ms: SKEW_MS,
    };
    if let Err(report) = run_suite(harness, reduced_cases(file!(), 8)) {
        panic!("{report}");
    }
}
