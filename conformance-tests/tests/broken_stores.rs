//! Proof that the suite can fail: the model property must catch every deliberately broken store
//! within 200 cases, and at least one example check must catch it too; except where a defect
//! lies outside what one of them exercises (an argument only the checks send, or calls made at
//! the same moment; an admin path or status figure only the model follows step by step), which
//! is then named below.
#![cfg(feature = "broken-stores")]

use outbox_conformance_tests::broken::{BrokenHarness, Defect};
use outbox_conformance_tests::checks::Check;
use outbox_conformance_tests::property::check_model;

const CASES: u32 = 200;

/// Which parts of the suite must catch a defect.
#[derive(Clone, Copy, PartialEq, Eq)]
enum By {
    /// An example check and the model property.
    Both,
    /// An example check (the model never sends the argument).
    Checks,
    /// The model property (no example check looks at it).
    Model,
}

fn caught(defect: Defect, by: By) {
    let harness = BrokenHarness(defect);
    if by != By::Model {
        let failing: Vec<Check> = Check::ALL
            .into_iter()
            .filter(|check| check.run_blocking(&harness).is_err())
            .collect();
        assert!(
            !failing.is_empty(),
            "every example check passed against a store with defect {defect:?}"
        );
        eprintln!("{defect:?}: caught by checks {failing:?}");
    }
    if by == By::Checks {
        return;
    }
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
    ($($name:ident => $defect:ident $(by $by:ident)?,)*) => {$(
        #[test]
        fn $name() {
            #[allow(unused_mut, unused_assignments)]
            let mut by = By::Both;
            $(by = By::$by;)?
            caught(Defect::$defect, by);
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
    extend_accepting_zero_is_caught => ExtendAcceptsZero by Checks,
    status_ignoring_retrying_is_caught => StatusIgnoresRetrying by Model,
    seq_admin_ignored_is_caught => SeqAdminIgnored by Model,
    binary_dropped_is_caught => BinaryDropped by Checks,
    purge_counts_picked_is_caught => PurgeCountsPicked by Checks,
}

#[test]
fn every_defect_has_a_meta_test() {
    // Adding a defect without a line above fails here.
    assert_eq!(Defect::ALL.len(), 15);
}
