//! Proof that the suite can fail: the model property must catch every deliberately broken store
//! within 200 cases, and at least one example check must catch it too.
#![cfg(feature = "broken-stores")]

use outbox_conformance_tests::broken::{BrokenHarness, Defect};
use outbox_conformance_tests::checks::Check;
use outbox_conformance_tests::property::check_model;

const CASES: u32 = 200;

fn caught(defect: Defect) {
    let harness = BrokenHarness(defect);
    let failing: Vec<Check> = Check::ALL
        .into_iter()
        .filter(|check| check.run_blocking(&harness).is_err())
        .collect();
    assert!(
        !failing.is_empty(),
        "every example check passed against a store with defect {defect:?}"
    );
    eprintln!("{defect:?}: caught by checks {failing:?}");
    let config = outbox_conformance_tests::__proptest::test_runner::Config {
        cases: CASES,
        // Shrunk seeds of a broken store are not regressions of a real one: keep none.
        failure_persistence: None,
        ..Default::default()
    };
    match check_model(&harness, config) {
        Ok(()) => panic!("the model property passed {CASES} cases against a store with defect {defect:?}: the suite misses it"),
        Err(report) => {
            let invariant = report
                .lines()
                .find(|l| l.starts_with("invariant broken"))
                .unwrap_or("?");
            eprintln!("{defect:?}: caught, {invariant}\n{report}");
        }
    }
}

macro_rules! meta {
    ($($name:ident => $defect:ident,)*) => {$(
        #[test]
        fn $name() {
            caught(Defect::$defect);
        }
    )*};
}

meta! {
    cursor_claim_is_caught => CursorClaim,
    over_claim_is_caught => OverClaim,
    no_head_of_line_is_caught => NoHeadOfLine,
    no_fencing_token_is_caught => NoFencingToken,
    complete_ignoring_expiry_is_caught => CompleteIgnoresExpiry,
    new_id_per_attempt_is_caught => NewIdPerAttempt,
    no_dead_lettering_is_caught => NoDeadLettering,
    published_at_claim_is_caught => PublishedAtClaim,
    relay_clock_leases_is_caught => RelayClockLeases,
    shard_ignored_is_caught => ShardIgnored,
}

#[test]
fn every_defect_has_a_meta_test() {
    // Adding a defect without a line above fails here.
    assert_eq!(Defect::ALL.len(), 10);
}
