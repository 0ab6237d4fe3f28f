//! One batch's life after its claim: publish (extending the lease while the publish runs), then
//! settle the outcomes with one bulk store call per kind of transition.

use std::future::pending;
use std::panic::AssertUnwindSafe;
use std::pin::pin;

use futures::future::{BoxFuture, FutureExt};
use outbox_traits::{Claim, Error, FailAction, Failure, LeaseToken, Message};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{error, warn};
use uuid::Uuid;

use crate::lease::LeaseKeeper;
use crate::outage::{broker_down, looks_down};
use crate::outcome::{settle, FailPolicy, Settlement};
use crate::shared::Shared;
use crate::stats::Counter;
use crate::telemetry::Recorder;
use crate::wait::{poll_slot, sleep_until_some};

/// Resolve once the loop asks in-flight batches to give up (shutdown deadline passed).
pub(crate) async fn abandoned(rx: &mut watch::Receiver<bool>) {
    let signalled = rx.wait_for(|stop| *stop).await.is_ok();
    if !signalled {
        // The loop is gone, so this batch is being dropped anyway.
        pending::<()>().await;
    }
}

/// How a batch ended.
pub(crate) struct BatchEnd {
    /// A permanent store error that stopped it.
    pub(crate) fatal: Option<Error>,
    /// The broker was found down (why): the batch was released without counting attempts.
    pub(crate) broker_down: Option<String>,
}

impl BatchEnd {
    fn fatal(fatal: Option<Error>) -> Self {
        Self {
            fatal,
            broker_down: None,
        }
    }
}

/// Log each dead-lettered failure at WARN with its message's id, key, attempts and reason.
fn log_dead<'f>(failures: impl Iterator<Item = &'f Failure>, messages: &[Message]) {
    for f in failures.filter(|f| f.action == FailAction::Dead) {
        let msg = messages.iter().find(|m| m.id == f.id);
        warn!(
            id = %f.id,
            key = msg.and_then(|m| m.partition_key.as_deref()).unwrap_or("(none)"),
            attempts = msg.map_or(0, |m| m.attempts.saturating_add(1)),
            reason = %f.error,
            "message dead-lettered"
        );
    }
}

/// What a store call for a batch came to.
enum CallResult {
    /// Applied to every listed message.
    Done,
    /// Applied except to these messages, whose lease was lost.
    LeaseLost(Vec<Uuid>),
    /// A transient error outlasted the lease (or shutdown): the messages stay leased until the
    /// lease ends and are then claimed again.
    GaveUp,
    /// A permanent error: retrying will not help.
    Fatal(Error),
}

pub(crate) struct Batch<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) rec: &'a Recorder,
    pub(crate) abandon: watch::Receiver<bool>,
}

impl Batch<'_> {
    /// Publish and settle one claim. Returns a permanent store error, if one stopped it, and
    /// whether the broker was found down.
    pub(crate) async fn run(
        mut self,
        #[cfg_attr(not(feature = "otel"), allow(unused_mut))] mut claim: Claim,
        claimed_at: Instant,
    ) -> BatchEnd {
        #[cfg(feature = "otel")]
        let spans = crate::trace::start(self.shared, &mut claim.messages);
        let token = claim.token;
        let Some((outcomes, lease_end)) = self.publish(&claim, claimed_at).await else {
            let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
            warn!(%token, messages = ids.len(), "shutdown deadline passed during publish; releasing the batch");
            let lease_end = Instant::now() + self.shared.config.lease;
            return BatchEnd::fatal(self.release(token, &ids, lease_end).await);
        };
        #[cfg(feature = "otel")]
        crate::trace::end(spans, &outcomes);
        if looks_down(&outcomes) {
            if let Some(reason) = broker_down(self.shared.publisher.as_ref()).await {
                // Nothing was refused: the broker could not be reached. Counting an attempt
                // would dead-letter messages over an outage, so they go back untouched.
                let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
                let fatal = self.release(token, &ids, lease_end).await;
                return BatchEnd {
                    fatal,
                    broker_down: Some(reason),
                };
            }
        }
        let policy = FailPolicy {
            max_attempts: self.shared.config.max_attempts,
            backoff: self.shared.config.backoff,
        };
        let plan = settle(&claim.messages, outcomes, &policy, &mut rand::rng());
        self.report_bugs(&plan, claim.messages.len());
        BatchEnd::fatal(self.apply(token, &plan, &claim.messages, lease_end).await)
    }

    /// Log (and count) what the settle plan says the publisher got wrong.
    fn report_bugs(&self, plan: &Settlement, expected: usize) {
        if let Some(got) = plan.wrong_outcome_count {
            error!(
                publisher = %self.shared.publisher_name,
                expected,
                got,
                "publisher bug: wrong number of outcomes; retrying the whole batch as ambiguous"
            );
        }
        if !plan.order_violations.is_empty() {
            error!(
                publisher = %self.shared.publisher_name,
                ids = ?plan.order_violations,
                "publisher bug: acknowledged a message after an earlier message of its key was \
                 not; per-key order may be broken at the broker"
            );
            self.rec
                .add(Counter::OrderViolations, plan.order_violations.len() as u64);
        }
        if !plan.unexplained_not_attempted.is_empty() {
            error!(
                publisher = %self.shared.publisher_name,
                ids = ?plan.unexplained_not_attempted,
                "publisher bug: reported messages as not attempted with no earlier failure of \
                 their key; retrying them as ambiguous"
            );
        }
    }

    /// Apply the settle plan: one bulk store call per kind of transition.
    async fn apply(
        &self,
        token: LeaseToken,
        plan: &Settlement,
        messages: &[Message],
        lease_end: Instant,
    ) -> Option<Error> {
        let mut fatal = None;
        if !plan.complete.is_empty() {
            fatal = fatal.or(self.complete(token, &plan.complete, lease_end).await);
        }
        if !plan.fail.is_empty() {
            fatal = fatal.or(self.fail(token, &plan.fail, messages, lease_end).await);
        }
        if !plan.release.is_empty() {
            fatal = fatal.or(self.release(token, &plan.release, lease_end).await);
        }
        fatal
    }

    /// Publish the batch, extending its lease at half-time while the publish runs. Returns the
    /// outcomes and the (local) time until which the lease is believed held, or `None` if the
    /// loop abandoned the batch first.
    async fn publish(
        &mut self,
        claim: &Claim,
        claimed_at: Instant,
    ) -> Option<(Vec<outbox_traits::PublishOutcome>, Instant)> {
        let shared = self.shared;
        let lease = shared.config.lease;
        let started = Instant::now();
        // A panicking publisher breaks its contract; treating the batch as ambiguous (an empty
        // outcome list) keeps the relay and every other batch alive.
        let mut publish = pin!(AssertUnwindSafe(shared.publisher.publish(&claim.messages))
            .catch_unwind()
            .map(|result| {
                result.unwrap_or_else(|_| {
                    error!("publisher bug: publish panicked; retrying the batch as ambiguous");
                    Vec::new()
                })
            }));
        let mut keeper = LeaseKeeper::new(claim.token, lease, claimed_at);
        let mut extending: Option<BoxFuture<'_, Result<_, Error>>> = None;
        let outcomes = loop {
            tokio::select! {
                biased;
                outcomes = &mut publish => break outcomes,
                () = abandoned(&mut self.abandon) => return None,
                result = poll_slot(&mut extending) => {
                    extending = None;
                    keeper.extended(result, self.rec, &shared.config.store_backoff);
                }
                () = sleep_until_some(keeper.next_extend()), if extending.is_none() && keeper.next_extend().is_some() => {
                    keeper.extending();
                    extending = Some(shared.store.extend(claim.token, lease));
                }
            }
        };
        self.rec.publish_took(started.elapsed());
        self.rec.acked(&claim.messages, &outcomes);
        Some((outcomes, keeper.held_until()))
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid], lease_end: Instant) -> Option<Error> {
        let store = &self.shared.store;
        let result = self
            .call("complete", lease_end, || store.complete(token, ids))
            .await;
        self.count(result, ids.len(), Counter::Published)
    }

    async fn fail(
        &self,
        token: LeaseToken,
        failures: &[Failure],
        messages: &[Message],
        lease_end: Instant,
    ) -> Option<Error> {
        let store = &self.shared.store;
        let result = self
            .call("fail", lease_end, || store.fail(token, failures))
            .await;
        let dead_count = |fs: &mut dyn Iterator<Item = &Failure>| {
            fs.filter(|f| f.action == FailAction::Dead).count() as u64
        };
        match result {
            CallResult::Done => {
                log_dead(failures.iter(), messages);
                let dead = dead_count(&mut failures.iter());
                self.rec.add(Counter::Dead, dead);
                self.rec.add(Counter::Retried, failures.len() as u64 - dead);
                None
            }
            CallResult::LeaseLost(lost) => {
                let held: Vec<&Failure> =
                    failures.iter().filter(|f| !lost.contains(&f.id)).collect();
                log_dead(held.iter().copied(), messages);
                let dead = dead_count(&mut held.iter().copied());
                self.rec.add(Counter::Dead, dead);
                self.rec.add(Counter::Retried, held.len() as u64 - dead);
                self.rec
                    .add(Counter::LeaseLost, (failures.len() - held.len()) as u64);
                None
            }
            CallResult::GaveUp => None,
            CallResult::Fatal(e) => Some(e),
        }
    }

    pub(crate) async fn release(
        &self,
        token: LeaseToken,
        ids: &[Uuid],
        lease_end: Instant,
    ) -> Option<Error> {
        let store = &self.shared.store;
        let result = self
            .call("release", lease_end, || store.release(token, ids))
            .await;
        self.count(result, ids.len(), Counter::Released)
    }

    /// Count a complete or release: the messages not named as lost went to `counter`.
    fn count(&self, result: CallResult, n: usize, counter: Counter) -> Option<Error> {
        match result {
            CallResult::Done => {
                self.rec.add(counter, n as u64);
                None
            }
            CallResult::LeaseLost(lost) => {
                let lost = lost.len().min(n);
                self.rec.add(counter, (n - lost) as u64);
                self.rec.add(Counter::LeaseLost, lost as u64);
                None
            }
            CallResult::GaveUp => None,
            CallResult::Fatal(e) => Some(e),
        }
    }

    /// Run one store transition, retrying transient errors while the lease is still held (a
    /// later success saves a duplicate delivery) unless the loop abandoned the batch.
    async fn call<'f, F>(&self, what: &str, lease_end: Instant, mut attempt: F) -> CallResult
    where
        F: FnMut() -> BoxFuture<'f, Result<(), Error>>,
    {
        let mut failures = 0u32;
        loop {
            let err = match attempt().await {
                Ok(()) => return CallResult::Done,
                Err(Error::LeaseLost { ids }) => {
                    warn!(
                        call = what,
                        messages = ids.len(),
                        "lease lost: another relay owns these messages now; their outcome is dropped here"
                    );
                    return CallResult::LeaseLost(ids);
                }
                Err(e) => e,
            };
            self.rec.add(Counter::StoreErrors, 1);
            if !err.is_transient() {
                error!(call = what, error = %err, "permanent store error; the batch's leases will expire");
                return CallResult::Fatal(err);
            }
            failures += 1;
            let now = Instant::now();
            let pause = self.shared.config.store_backoff.delay(failures);
            if now + pause >= lease_end || *self.abandon.borrow() {
                warn!(call = what, error = %err, "store unavailable; giving up on this batch, its messages are claimed again when the lease ends");
                return CallResult::GaveUp;
            }
            warn!(call = what, error = %err, retry_in = ?pause, "store call failed; retrying");
            tokio::time::sleep(pause).await;
        }
    }
}
