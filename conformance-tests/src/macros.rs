//! The one-line entry point.

/// Expand to one `#[test]` per check and property of the suite, run against the harness that
/// `$harness` evaluates to (evaluated once per test).
///
/// ```text
/// // tests/conformance.rs of a backend crate:
/// outbox_conformance_tests::conformance_suite!(my_backend::tests::MyHarness::new());
/// ```
///
/// For a backend that needs a server, give an `Option` (e.g. `None` when its URL variable is
/// unset, after [`service_url`](crate::env::service_url) printed why) with `optional:`; each
/// test then returns early when it is `None`:
///
/// ```text
/// outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env());
/// ```
///
/// Invoke it once per module (the tests have fixed names). The model and engine properties take
/// their number of cases from `PROPTEST_CASES` and save failing seeds under
/// `proptest-regressions/`. `reduced: N` runs them at `PROPTEST_CASES / N` cases (at least 16):
/// for a second configuration of a backend whose differences the checks cover, so that CI does
/// not pay the full count twice.
#[macro_export]
macro_rules! conformance_suite {
    (optional: $harness:expr) => {
        $crate::conformance_suite!(optional: $harness, reduced: 1);
    };
    (optional: $harness:expr, reduced: $divisor:expr) => {
        $crate::__conformance_tests!(@opt $harness, $divisor;
            claim_respects_limit ClaimRespectsLimit,
            no_phantoms NoPhantoms,
            late_commit_is_claimed LateCommitIsClaimed,
            per_key_head_of_line PerKeyHeadOfLine,
            concurrent_writers_of_a_key ConcurrentWritersOfAKey,
            dead_head_blocks_or_skips DeadHeadBlocksOrSkips,
            stale_token_is_fenced StaleTokenIsFenced,
            expired_lease_is_fenced ExpiredLeaseIsFenced,
            lease_uses_store_clock LeaseUsesStoreClock,
            retry_waits_and_counts RetryWaitsAndCounts,
            retry_holds_back_its_key_only RetryHoldsBackItsKeyOnly,
            dead_letters_requeue_discard DeadLettersRequeueDiscard,
            purge_is_bounded PurgeIsBounded,
            concurrent_purges_count_exactly ConcurrentPurgesCountExactly,
            not_before_delays NotBeforeDelays,
            crash_keeps_leases CrashKeepsLeases,
            extend_keeps_lease ExtendKeepsLease,
            message_round_trip MessageRoundTrip,
            enqueue_refusals EnqueueRefusals,
            concurrent_claims_are_exclusive ConcurrentClaimsAreExclusive,
            dedup_key_outlives_its_message_only_while_kept DedupKeyOutlivesItsMessageOnlyWhileKept,
            blocked_backlog_hides_no_key BlockedBacklogHidesNoKey,
            many_keys_behind_a_blocked_backlog ManyKeysBehindABlockedBacklog,
            invalid_shard_is_refused InvalidShardIsRefused,
            shards_partition_keys ShardsPartitionKeys,
            argument_rules ArgumentRules,
            raw_rows_round_trip RawRowsRoundTrip,
            malformed_raw_rows_quarantined MalformedRawRowsQuarantined,
            binary_round_trip BinaryRoundTrip,
        );
    };
    ($harness:expr, reduced: $divisor:expr) => {
        $crate::conformance_suite!(optional: ::core::option::Option::Some($harness), reduced: $divisor);
    };
    ($harness:expr) => {
        $crate::conformance_suite!(optional: ::core::option::Option::Some($harness));
    };
}

/// Expand to one `#[test]` per enqueue check ([`Check::ENQUEUE`](crate::checks::Check::ENQUEUE)),
/// for a backend's second enqueue path, e.g. another driver's: `$harness`'s
/// [`HarnessStore::begin`](crate::HarnessStore::begin) opens that driver's transaction and
/// enqueues through it, while its relays and admin are the backend's own store, so what the
/// second path writes is checked by the store's real claims.
///
/// ```text
/// // tests/diesel.rs of a backend crate:
/// outbox_conformance_tests::enqueue_suite!(optional: DieselHarness::from_env());
/// ```
///
/// Same forms as [`conformance_suite!`](crate::conformance_suite); invoke it once per module.
#[macro_export]
macro_rules! enqueue_suite {
    (optional: $harness:expr) => {
        $crate::__check_tests!(@opt $harness;
            claim_respects_limit ClaimRespectsLimit,
            no_phantoms NoPhantoms,
            late_commit_is_claimed LateCommitIsClaimed,
            per_key_head_of_line PerKeyHeadOfLine,
            not_before_delays NotBeforeDelays,
            message_round_trip MessageRoundTrip,
            enqueue_refusals EnqueueRefusals,
            dedup_key_outlives_its_message_only_while_kept DedupKeyOutlivesItsMessageOnlyWhileKept,
            binary_round_trip BinaryRoundTrip,
        );
    };
    ($harness:expr) => {
        $crate::enqueue_suite!(optional: ::core::option::Option::Some($harness));
    };
}

/// One `#[test]` per named check.
#[doc(hidden)]
#[macro_export]
macro_rules! __check_tests {
    (@opt $harness:expr; $($name:ident $check:ident,)*) => {
        $(
            #[test]
            fn $name() {
                if let ::core::option::Option::Some(harness) = $harness {
                    if let ::core::result::Result::Err(report) =
                        $crate::checks::Check::$check.run_blocking(&harness)
                    {
                        ::core::panic!("{}", report);
                    }
                }
            }
        )*
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    (@opt $harness:expr, $divisor:expr; $($name:ident $check:ident,)*) => {
        $crate::__check_tests!(@opt $harness; $($name $check,)*);

        #[test]
        fn model_property() {
            if let ::core::option::Option::Some(harness) = $harness {
                if let ::core::result::Result::Err(report) = $crate::property::check_model(
                    &harness,
                    $crate::property::reduced_cases(::core::file!(), $divisor),
                ) {
                    ::core::panic!("{}", report);
                }
            }
        }

        #[test]
        fn engine_property() {
            if let ::core::option::Option::Some(harness) = $harness {
                if let ::core::result::Result::Err(report) = $crate::engine::check_engine(
                    &harness,
                    $crate::property::reduced_cases(::core::file!(), $divisor),
                ) {
                    ::core::panic!("{}", report);
                }
            }
        }
    };
}

/// Expand to one `#[test]`, `relay_group_conforms`, that runs the relay-group check
/// ([`group::check_group`](crate::group::check_group)) in a fresh group against a store that
/// keeps relay groups ([`outbox_traits::RelayGroupStore`]).
///
/// The expression is evaluated inside an `async` block (it may `.await`, e.g. to connect) and
/// gives the [`GroupHarness`](crate::group::GroupHarness); with `optional:` it gives an
/// `Option` of one, and the test returns early on `None`:
///
/// ```text
/// // tests/group.rs of a backend crate:
/// outbox_conformance_tests::group_suite!(optional: MyGroupHarness::from_env().await);
/// ```
///
/// Invoke it once per module (the test has a fixed name).
#[macro_export]
macro_rules! group_suite {
    (optional: $harness:expr) => {
        #[test]
        fn relay_group_conforms() {
            if let ::core::result::Result::Err(report) =
                $crate::group::run_group_suite(async { $harness })
            {
                ::core::panic!("{}", report);
            }
        }
    };
    ($harness:expr) => {
        $crate::group_suite!(optional: ::core::option::Option::Some($harness));
    };
}
