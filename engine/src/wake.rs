//! The store's wake-up source as the relay loop sees it: subscribed, being subscribed, or
//! failed and due for a retry.

use std::future::pending;
use std::time::Duration;

use outbox_traits::{Error, WakeSource};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::backoff::Backoff;

/// The wake-up side of the loop's state.
pub(crate) struct Wake {
    source: Option<Box<dyn WakeSource>>,
    subscribing: bool,
    /// When to (re)subscribe, if no source is held and no subscription is running.
    resubscribe_at: Option<Instant>,
    failures: u32,
}

impl Wake {
    /// Serve mode subscribes at once; drain mode never does.
    pub(crate) fn new(serve: bool) -> Self {
        Self {
            source: None,
            subscribing: false,
            resubscribe_at: serve.then(Instant::now),
            failures: 0,
        }
    }

    /// Whether a source is held (so its hints are awaited).
    pub(crate) fn has_source(&self) -> bool {
        self.source.is_some()
    }

    /// When the next subscription is due, if one is waiting to be made.
    pub(crate) fn resubscribe_at(&self) -> Option<Instant> {
        if self.source.is_none() && !self.subscribing {
            self.resubscribe_at
        } else {
            None
        }
    }

    /// Transition: start a subscription if one is due at `now`. Says whether it started.
    pub(crate) fn start_subscribing(&mut self, now: Instant) -> bool {
        if self.resubscribe_at().is_some_and(|at| at <= now) {
            self.resubscribe_at = None;
            self.subscribing = true;
            return true;
        }
        false
    }

    /// Transition: the subscription returned.
    pub(crate) fn subscribed(
        &mut self,
        result: Result<Option<Box<dyn WakeSource>>, Error>,
        backoff: &Backoff,
    ) {
        self.subscribing = false;
        match result {
            Ok(Some(source)) => {
                debug!("subscribed to the store's wake-ups");
                self.source = Some(source);
            }
            Ok(None) => debug!("the store offers no wake-ups; polling only"),
            Err(e) => {
                let retry = self.retry_later(backoff);
                warn!(error = %e, retry_in = ?retry, "could not subscribe to wake-ups; polling meanwhile");
            }
        }
    }

    /// The next hint of the source, or never if there is none. Cancel safe (the contract of
    /// [`WakeSource::wait`]).
    pub(crate) async fn next_hint(&mut self) -> Result<(), Error> {
        match &mut self.source {
            Some(source) => source.wait().await,
            None => pending().await,
        }
    }

    /// Transition: the source delivered a hint.
    pub(crate) fn hinted(&mut self) {
        self.failures = 0;
    }

    /// Transition: the source failed; drop it and subscribe again later.
    pub(crate) fn failed(&mut self, error: &Error, backoff: &Backoff) {
        self.source = None;
        let retry = self.retry_later(backoff);
        warn!(error = %error, retry_in = ?retry, "wake-up source failed; polling until it is back");
    }

    /// Transition: shutting down; hints no longer matter.
    pub(crate) fn close(&mut self) {
        self.source = None;
    }

    fn retry_later(&mut self, backoff: &Backoff) -> Duration {
        self.failures += 1;
        let retry = backoff.delay(self.failures);
        self.resubscribe_at = Some(Instant::now() + retry);
        retry
    }
}
