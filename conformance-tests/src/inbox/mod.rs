//! Conformance suite for consumer inboxes: does an inbox turn at-least-once deliveries into
//! exactly-once effects?
//!
//! An inbox records `(consumer, message id)` in the consumer's own database transaction,
//! together with the handler's writes (its effect), and says whether the message is new. A
//! backend implements [`InboxHarness`] (a factory of fresh, isolated inboxes) and
//! [`InboxStore`]/[`InboxTx`] (its real transaction, the inbox's real record call, an effect
//! row written in the same transaction, the marks and effects read back, time control for the
//! marks' age, and the inbox's purge), then runs the suite with one line:
//!
//! ```text
//! // tests/inbox_conformance.rs of an inbox crate:
//! outbox_conformance_tests::inbox_suite!(optional: MyInboxHarness::from_env());
//! ```
//!
//! The property ([`check_inbox`]) plays generated scenarios against a reference model: any
//! message delivered to any of several consumers any number of times (also twice within one
//! batch), handlers that crash before their commit, fail, or crash after the commit and before
//! the ack (so the message comes again), two deliveries of one id racing in two open
//! transactions (the first commits or rolls back while the second waits), marks aged through
//! the harness and purged in bounded batches. After every step it checks that the inbox said
//! "new" exactly when the model has no committed mark, that every committed effect has its
//! mark and every mark its effect (a rolled-back handler leaves neither), that no effect was
//! applied twice while its mark was kept, and that a purge removed only marks older than asked,
//! at most a batch of them and as many as it said. At the end every delivery not yet
//! acknowledged is redelivered until acknowledged: each message's effect must be there exactly
//! once per consumer (more only after its mark was purged, as documented), none lost.
//!
//! [`MemoryInbox`] is the reference inbox the suite is tested with; with a [`Defect`] it is
//! broken on purpose, and the suite's own tests require every defect to be caught.
//!
//! The number of cases is `PROPTEST_CASES` (256 when unset) divided by
//! [`CASE_DIVISOR`] (at least 16), each case a long scenario on a fresh inbox, so that a run at
//! 1,000 cases costs seconds per store.

mod check;
mod harness;
mod memory;
mod scenario;

pub use check::{check_batch_receipts, check_inbox, check_refusals, CASE_DIVISOR};
pub use harness::{InboxCapabilities, InboxHarness, InboxStore, InboxTx, Mark};
pub use memory::{Defect, MemoryInbox};
pub use scenario::{
    inbox_scenario, DeliveryEnd, InboxScenario, InboxStep, TxEnd, CONSUMERS, MESSAGES,
};

/// Expand to the inbox suite's tests, run against the harness `$harness` evaluates to
/// (evaluated once per test): `inbox_property` ([`check_inbox`]), `inbox_batch_receipts`
/// ([`check_batch_receipts`]) and `inbox_refusals` ([`check_refusals`]).
///
/// ```text
/// outbox_conformance_tests::inbox_suite!(MyInboxHarness::new());
/// // or, for an inbox on a server, an Option (None when the server's variable is unset):
/// outbox_conformance_tests::inbox_suite!(optional: PgInboxHarness::from_env());
/// ```
///
/// Invoke it once per module (the tests have fixed names). `reduced: N` runs the property at
/// `1/N` of its cases (at least 16): for a second path to the same inbox (e.g. another driver)
/// whose differences the property still covers.
#[macro_export]
macro_rules! inbox_suite {
    (optional: $harness:expr) => {
        $crate::inbox_suite!(optional: $harness, reduced: 1);
    };
    (optional: $harness:expr, reduced: $divisor:expr) => {
        #[test]
        fn inbox_property() {
            if let ::core::option::Option::Some(harness) = $harness {
                if let ::core::result::Result::Err(report) = $crate::inbox::check_inbox(
                    &harness,
                    $crate::property::reduced_cases(
                        ::core::file!(),
                        $crate::inbox::CASE_DIVISOR * $divisor,
                    ),
                ) {
                    ::core::panic!("{}", report);
                }
            }
        }

        #[test]
        fn inbox_batch_receipts() {
            if let ::core::option::Option::Some(harness) = $harness {
                if let ::core::result::Result::Err(report) =
                    $crate::inbox::check_batch_receipts(&harness)
                {
                    ::core::panic!("{}", report);
                }
            }
        }

        #[test]
        fn inbox_refusals() {
            if let ::core::option::Option::Some(harness) = $harness {
                if let ::core::result::Result::Err(report) =
                    $crate::inbox::check_refusals(&harness)
                {
                    ::core::panic!("{}", report);
                }
            }
        }
    };
    ($harness:expr, reduced: $divisor:expr) => {
        $crate::inbox_suite!(optional: ::core::option::Option::Some($harness), reduced: $divisor);
    };
    ($harness:expr) => {
        $crate::inbox_suite!(optional: ::core::option::Option::Some($harness));
    };
}
