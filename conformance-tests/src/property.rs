//! The model property: generated scenarios played against fresh stores.

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestError, TestRunner};

use futures::future::LocalBoxFuture;

use crate::harness::{Harness, HarnessStore};
use crate::model::{run_scenario, run_scenario_with_coverage, Coverage};
use crate::scenario::scenario;

/// The proptest configuration the suite uses: cases from `PROPTEST_CASES` (256 when unset),
/// failing seeds saved under `proptest-regressions/` beside the calling crate's sources and
/// replayed first on the next run.
///
/// `source_file` is the caller's `file!()`; it names the file seeds are saved in.
pub fn config(source_file: &'static str) -> Config {
    Config {
        source_file: Some(source_file),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}

/// [`config`] with a fraction of its cases: `PROPTEST_CASES` (256 when unset) divided by
/// `divisor`, at least 16. For runs that repeat what a full run covers with one difference: a
/// private server with a skewed clock (a server of its own costs seconds to start, and every
/// time it adds comes from the database's clock), or a second configuration of one backend
/// (`conformance_suite!(optional: .., reduced: N)`).
pub fn reduced_cases(source_file: &'static str, divisor: u32) -> Config {
    let base = config(source_file);
    let cases = (base.cases / divisor.max(1)).max(16);
    Config { cases, ..base }
}

/// A runtime for the blocking entry points: multi-threaded, so checks that race relays run in
/// parallel for real.
pub fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a tokio runtime: {e}"))
}

/// Run the model property against `harness` with `config`: the scenarios that once broke a
/// backend ([`recorded`](crate::recorded)) first, then every generated scenario, each
/// played on a fresh store, must keep every invariant.
///
/// Blocking (it owns its runtime): call it from a plain `#[test]`, not from async code.
/// Returns the report of the failing (for generated ones, shrunk) scenario, in words.
pub fn check_model(harness: &dyn Harness, config: Config) -> Result<(), String> {
    run_property(
        harness,
        config,
        scenario(),
        &crate::scenario::recorded(),
        "model property",
        |store, scenario| Box::pin(run_scenario(store, scenario)),
    )
}

/// Play the `recorded` scenarios, then every scenario `strategy` generates, each on a fresh store
/// of `harness`, with `case`, and turn a failure into a report naming `what` broke and the
/// (shrunk) scenario. Shared by the model and the end-to-end properties so that both create,
/// tear down and report alike. One runtime for all: a harness may keep a pool made on it.
pub(crate) fn run_property<S>(
    harness: &dyn Harness,
    config: Config,
    strategy: S,
    recorded: &[S::Value],
    what: &str,
    case: impl for<'a> Fn(&'a dyn HarnessStore, &'a S::Value) -> LocalBoxFuture<'a, Result<(), String>>,
) -> Result<(), String>
where
    S: Strategy,
{
    let rt = runtime()?;
    for (n, scenario) in recorded.iter().enumerate() {
        rt.block_on(async {
            let store = harness
                .fresh()
                .await
                .map_err(|e| format!("harness could not make a store: {e}"))?;
            case(&*store, scenario).await.map_err(|reason| {
                format!(
                    "{} broke the {what} on recorded scenario {}.\n{reason}\nscenario:\n\
                     {scenario:?}",
                    harness.name(),
                    n + 1
                )
            })?;
            store
                .teardown()
                .await
                .map_err(|e| format!("harness teardown failed: {e}"))
        })?;
    }
    let mut runner = TestRunner::new(config);
    let result = runner.run(&strategy, |scenario| {
        rt.block_on(async {
            let store = harness
                .fresh()
                .await
                .map_err(|e| TestCaseError::fail(format!("harness could not make a store: {e}")))?;
            case(&*store, &scenario)
                .await
                .map_err(TestCaseError::fail)?;
            store
                .teardown()
                .await
                .map_err(|e| TestCaseError::fail(format!("harness teardown failed: {e}")))
        })
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, scenario)) => Err(format!(
            "{} broke the {what}.\n{reason}\nshrunk scenario:\n{scenario:?}",
            harness.name()
        )),
        Err(TestError::Abort(reason)) => {
            Err(format!("{}: {what} aborted: {reason}", harness.name()))
        }
    }
}

/// Play `cases` scenarios from a fixed seed against `harness` and sum what they exercised, to
/// show the generator reaches every situation the invariants are about (duplicates of each
/// cause, fenced transitions, late commits, dead letters, purges). Blocking.
pub fn measure_coverage(harness: &dyn Harness, cases: u32) -> Result<Coverage, String> {
    let rt = runtime()?;
    let mut runner = TestRunner::deterministic();
    let strategy = scenario();
    let mut total = Coverage::default();
    for _ in 0..cases {
        let tree = strategy
            .new_tree(&mut runner)
            .map_err(|e| format!("cannot generate a scenario: {e}"))?;
        let scenario = tree.current();
        total += rt.block_on(async {
            let store = harness
                .fresh()
                .await
                .map_err(|e| format!("harness could not make a store: {e}"))?;
            let coverage = run_scenario_with_coverage(&*store, &scenario).await?;
            store
                .teardown()
                .await
                .map_err(|e| format!("harness teardown failed: {e}"))?;
            Ok::<_, String>(coverage)
        })?;
    }
    Ok(total)
}
