//! The conformance suite against a private Postgres whose clock runs days ahead of this host's
//! (libfaketime): every lease end, retry time and age must come from the database's `now()`,
//! never from the relay's clock, or the lease-arithmetic and eligibility checks fail by days.
//!
//! One test starts the server (about 2 s), runs every check and both properties at an eighth of
//! `PROPTEST_CASES` (the main suite, `conformance.rs`, runs them in full on the shared server),
//! and stops it.

mod common;

use common::harness::PgHarness;
use outbox_conformance_tests::skewed::{reduced_cases, run_suite, SkewedPostgres};

#[test]
fn suite_with_database_clock_skewed_from_host() {
    let Some(server) = SkewedPostgres::start().expect("private Postgres under libfaketime") else {
        return;
    };
    let harness = || PgHarness::new(&server.url()).skewed_clock();
    if let Err(report) = run_suite(harness, reduced_cases(file!(), 8)) {
        panic!("{report}");
    }
}
