//! Which real servers the tests may use, from one environment variable per server.

/// Set to `1` (as CI does) to turn a missing server into a test failure instead of a skip.
pub const REQUIRE_SERVICES_VAR: &str = "OUTBOX_REQUIRE_SERVICES";

/// The value of `var` (e.g. `OUTBOX_TEST_POSTGRES_URL`), or `None` after printing why the caller
/// skips.
///
/// # Panics
/// When `var` is unset or empty and `OUTBOX_REQUIRE_SERVICES=1`: in CI a missing server must fail
/// the run, not pass it silently. This is test-support code, where a panic is the failure report.
pub fn service_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(value) if !value.trim().is_empty() => Some(value),
        _ if services_required() => {
            panic!("{var} is not set but {REQUIRE_SERVICES_VAR}=1: start the server (scripts/test does) and set {var}")
        }
        _ => {
            eprintln!("skipped: set {var} to run this test against a real server");
            None
        }
    }
}

/// Whether `OUTBOX_REQUIRE_SERVICES=1` is set.
pub fn services_required() -> bool {
    std::env::var(REQUIRE_SERVICES_VAR).is_ok_and(|v| v == "1")
}
