//! Waits on things that may be absent: an absent deadline or future never resolves, so it can
//! sit in a `select!` branch without a special case.

use std::future::{pending, Future};

use tokio::time::{sleep_until, Instant};

/// Sleep until `at`, or forever if there is no `at`.
pub(crate) async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => pending().await,
    }
}

/// Await the future in `slot`, or never if the slot is empty.
pub(crate) async fn poll_slot<F: Future + Unpin>(slot: &mut Option<F>) -> F::Output {
    match slot {
        Some(fut) => fut.await,
        None => pending().await,
    }
}
