//! Keeping a batch's lease while its publish runs: extend at half-time, retry a failed
//! extension while the lease still holds, and know until when it is believed held.

use std::time::Duration;

use outbox_traits::{Error, LeaseToken};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::backoff::Backoff;
use crate::stats::Counter;
use crate::telemetry::Recorder;

/// The lease of one batch, as its publish sees it.
pub(crate) struct LeaseKeeper {
    token: LeaseToken,
    lease: Duration,
    /// The (local) time until which the lease is believed held.
    held_until: Instant,
    /// When to extend next (`None`: an extension is running, or the lease is lost or over).
    next_extend: Option<Instant>,
    extend_started: Instant,
    failures: u32,
}

impl LeaseKeeper {
    /// A lease of `lease` taken by a claim that started at `claimed_at`.
    pub(crate) fn new(token: LeaseToken, lease: Duration, claimed_at: Instant) -> Self {
        Self {
            token,
            lease,
            held_until: claimed_at + lease,
            next_extend: Some(claimed_at + lease / 2),
            extend_started: claimed_at,
            failures: 0,
        }
    }

    pub(crate) fn held_until(&self) -> Instant {
        self.held_until
    }

    pub(crate) fn next_extend(&self) -> Option<Instant> {
        self.next_extend
    }

    /// Transition: an extension starts now.
    pub(crate) fn extending(&mut self) {
        self.next_extend = None;
        self.extend_started = Instant::now();
    }

    /// Transition: the extension returned `result`.
    pub(crate) fn extended<T>(
        &mut self,
        result: Result<T, Error>,
        rec: &Recorder,
        backoff: &Backoff,
    ) {
        let token = self.token;
        match result {
            Ok(_) => {
                self.failures = 0;
                self.held_until = self.extend_started + self.lease;
                self.next_extend = Some(self.extend_started + self.lease / 2);
                debug!(token = %token, "lease extended while publishing");
            }
            Err(Error::LeaseLost { .. }) => {
                // Keep publishing: the store fences the completion, and what was sent is sent.
                // Another relay may publish these too (duplicates).
                warn!(token = %token, "lease lost while publishing; completion will be refused");
                rec.extend_lost();
            }
            Err(e) => {
                rec.add(Counter::StoreErrors, 1);
                self.failures += 1;
                let now = Instant::now();
                if now < self.held_until {
                    let pause = backoff
                        .delay(self.failures)
                        .min((self.held_until - now) / 2);
                    warn!(token = %token, error = %e, "could not extend the lease; trying again");
                    self.next_extend = Some(now + pause);
                } else {
                    warn!(token = %token, error = %e, "could not extend the lease before it ended");
                }
            }
        }
    }
}
