//! The relay loop: keeps up to `concurrency` batches in flight, paces claims (adaptive polling,
//! wake-ups), backs off on store outages, stops claiming while the broker is down (probing it
//! back, see [`crate::outage`]) and shuts down gracefully.
//!
//! [`RunLoop`] holds the loop's state; each turn of [`RunLoop::run`] checks the shutdown
//! deadline, starts a subscription or a claim if one is due, then waits for the first of: an
//! event of its own futures (a claim, a batch settling, a subscription), a wake-up, the stop
//! signal, or the next timer. Each of those is handled by one named transition.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use outbox_traits::{Claim, ClaimRequest, Error, LeaseToken, WakeSource};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, info_span, warn, Instrument};
use uuid::Uuid;

use crate::batch::{Batch, BatchEnd};
use crate::outage::{broker_down, drain_error, Availability, Broker};
use crate::pacing::{earliest, Pacing};
use crate::shared::Shared;
use crate::stats::Counter;
use crate::telemetry::Recorder;
use crate::wait::sleep_until_some;
use crate::wake::Wake;

/// After the shutdown deadline, how long the relay waits for in-flight batches to release their
/// messages before it drops them (their leases then simply expire).
pub const RELEASE_GRACE: Duration = Duration::from_secs(5);

/// How the loop ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Return once a claim finds nothing while nothing is in flight.
    Drain,
    /// Run until stopped, waiting for wake-ups or polls when idle.
    Serve,
}

/// What the loop's own futures come back with.
enum Event {
    Claimed {
        result: Result<Claim, Error>,
        started: Instant,
    },
    Settled {
        token: LeaseToken,
        end: BatchEnd,
    },
    Subscribed(Result<Option<Box<dyn WakeSource>>, Error>),
    /// A probe of the broker came back: `None` if it answered, else why not.
    Probed(Option<String>),
}

/// The loop shared by every way of running a relay, until `stop` resolves with the shutdown
/// deadline. Returns a permanent error only in drain mode.
pub(crate) async fn run_loop(
    shared: &Shared,
    rec: &Recorder,
    mode: Mode,
    stop: Pin<&mut impl Future<Output = Duration>>,
) -> Result<(), Error> {
    let cfg = &shared.config;
    let request = ClaimRequest {
        limit: cfg.batch_size,
        lease: cfg.lease,
        head_policy: cfg.head_policy,
    };
    RunLoop::new(shared, rec, mode, &request).run(stop).await
}

/// The shutdown side of the loop's state.
struct Stopping {
    /// Set once the stop signal came: no more claims; past it, in-flight batches give up.
    deadline: Option<Instant>,
    /// The deadline passed and the batches were told so.
    abandoned: bool,
    abandon_tx: watch::Sender<bool>,
    abandon_rx: watch::Receiver<bool>,
}

/// The state of one running loop.
struct RunLoop<'a> {
    shared: &'a Shared,
    rec: &'a Recorder,
    request: &'a ClaimRequest,
    serve: bool,
    events: FuturesUnordered<BoxFuture<'a, Event>>,
    pacing: Pacing,
    wake: Wake,
    stopping: Stopping,
    in_flight: HashSet<LeaseToken>,
    /// Whether the broker is down (then no claims, only probes).
    broker: Broker,
    /// Whether the store is down (claims fail with transient errors).
    store: Availability,
    /// Drain mode: a permanent store error that ends the run once in-flight batches are done.
    fatal: Option<Error>,
}

impl<'a> RunLoop<'a> {
    fn new(shared: &'a Shared, rec: &'a Recorder, mode: Mode, request: &'a ClaimRequest) -> Self {
        let serve = mode == Mode::Serve;
        let (abandon_tx, abandon_rx) = watch::channel(false);
        Self {
            shared,
            rec,
            request,
            serve,
            events: FuturesUnordered::new(),
            pacing: Pacing::new(&shared.config, serve),
            wake: Wake::new(serve),
            stopping: Stopping {
                deadline: None,
                abandoned: false,
                abandon_tx,
                abandon_rx,
            },
            in_flight: HashSet::new(),
            broker: Broker::new(),
            store: Availability::new("store"),
            fatal: None,
        }
    }

    /// Turn until [`RunLoop::finished`]: act on what is due, then wait for the next event,
    /// wake-up, stop signal or timer and apply its transition.
    async fn run(
        mut self,
        mut stop: Pin<&mut impl Future<Output = Duration>>,
    ) -> Result<(), Error> {
        let shared = self.shared;
        loop {
            let now = Instant::now();
            if self.finished(now) {
                break;
            }
            let listening = self.listening();
            if listening && self.wake.start_subscribing(now) {
                self.subscribe();
            }
            if listening && self.broker.probe_at().is_some_and(|at| at <= now) {
                self.probe();
            }
            let may_claim = self.may_claim();
            if may_claim && self.pacing.claim_at().is_none_or(|at| at <= now) {
                self.claim();
            }
            let timer = self.timer(may_claim, listening);
            tokio::select! {
                Some(event) = self.events.next(), if !self.events.is_empty() => self.on_event(event),
                () = shared.notifier.notified(), if listening => self.pacing.woken_up(),
                hint = self.wake.next_hint(), if listening && self.wake.has_source() => match hint {
                    Ok(()) => {
                        self.wake.hinted();
                        self.pacing.woken_up();
                    }
                    Err(e) => self.wake.failed(&e, &shared.config.store_backoff),
                },
                grace = &mut stop, if self.stopping.deadline.is_none() => self.shutdown(grace),
                () = sleep_until_some(timer), if timer.is_some() => {}
            }
        }
        self.fatal.map_or(Ok(()), Err)
    }

    /// Still taking wake-ups: serving and not shutting down.
    fn listening(&self) -> bool {
        self.serve && self.stopping.deadline.is_none()
    }

    /// Whether a claim may start (when its time comes).
    fn may_claim(&self) -> bool {
        self.stopping.deadline.is_none()
            && self.fatal.is_none()
            && !self.pacing.claiming()
            && !self.broker.is_down()
            && self.in_flight.len() < self.shared.config.concurrency
            && (self.serve || !self.pacing.quiet())
    }

    /// The next time the loop must act on its own: a claim, a subscription, or the shutdown
    /// deadline (then the end of the release grace).
    fn timer(&self, may_claim: bool, listening: bool) -> Option<Instant> {
        let stopping = &self.stopping;
        earliest([
            if may_claim && !self.pacing.claiming() {
                self.pacing.claim_at()
            } else {
                None
            },
            if listening {
                self.wake.resubscribe_at()
            } else {
                None
            },
            if listening {
                self.broker.probe_at()
            } else {
                None
            },
            stopping.deadline.map(|d| {
                if stopping.abandoned {
                    d + RELEASE_GRACE
                } else {
                    d
                }
            }),
        ])
    }

    /// Transition (shutdown): past the deadline, tell in-flight batches to give up. Says whether
    /// the loop is over: stopping with nothing left in flight (or past the release grace), or
    /// draining with nothing left to claim.
    fn finished(&mut self, now: Instant) -> bool {
        let Some(deadline) = self.stopping.deadline else {
            return !self.serve
                && !self.pacing.claiming()
                && self.in_flight.is_empty()
                && (self.pacing.quiet() || self.fatal.is_some());
        };
        if !self.stopping.abandoned && now >= deadline {
            self.stopping.abandoned = true;
            self.stopping.abandon_tx.send_replace(true);
            warn!(
                batches = self.in_flight.len(),
                "shutdown deadline passed; releasing in-flight batches"
            );
        }
        if now >= deadline + RELEASE_GRACE {
            warn!(
                batches = self.in_flight.len(),
                "in-flight batches did not release in time; their leases will expire"
            );
            return true;
        }
        !self.pacing.claiming() && self.in_flight.is_empty()
    }

    /// Transition (shutdown): the stop signal came with `grace` to finish in.
    fn shutdown(&mut self, grace: Duration) {
        info!(deadline = ?grace, batches = self.in_flight.len(), "relay shutting down");
        self.stopping.deadline = Some(Instant::now() + grace);
        self.wake.close();
    }

    /// Transition (wake): subscribe to the store's wake-ups.
    fn subscribe(&mut self) {
        let shared = self.shared;
        self.events.push(Box::pin(async move {
            Event::Subscribed(shared.store.wakeups().await)
        }));
    }

    /// Transition (claim): start a claim.
    fn claim(&mut self) {
        self.pacing.start_claim();
        let (shared, request) = (self.shared, self.request);
        self.events.push(Box::pin(async move {
            let started = Instant::now();
            let result = shared.store.claim(request).await;
            Event::Claimed { result, started }
        }));
    }

    /// Transition (outage): probe the broker that is down.
    fn probe(&mut self) {
        self.broker.probing();
        self.rec.probed();
        let shared = self.shared;
        self.events.push(Box::pin(async move {
            Event::Probed(broker_down(shared.publisher.as_ref()).await)
        }));
    }

    /// Transition (outage): a probe came back; claim at once if the broker is back.
    fn probed(&mut self, down: Option<String>) {
        if self.broker.probed(down) {
            self.rec.broker_up(true);
            self.pacing.woken_up();
        }
    }

    /// Transition (outage): a batch found the broker down. Serving, the loop stops claiming
    /// and probes; draining, it ends with the outage as its error.
    fn broker_went_down(&mut self, reason: &str) {
        if self.broker.went_down(reason) {
            self.rec.broker_up(false);
        }
        if !self.serve && self.fatal.is_none() {
            self.fatal = Some(drain_error(&self.shared.publisher_name, reason));
        }
    }

    /// Dispatch an event of the loop's own futures to its transition.
    fn on_event(&mut self, event: Event) {
        match event {
            Event::Claimed { result, started } => self.claimed(result, started),
            Event::Settled { token, end } => self.settled(token, end),
            Event::Probed(down) => self.probed(down),
            Event::Subscribed(result) => self
                .wake
                .subscribed(result, &self.shared.config.store_backoff),
        }
    }

    /// Transition (claim): the claim that started at `started` returned.
    fn claimed(&mut self, result: Result<Claim, Error>, started: Instant) {
        self.rec.claim_took(started.elapsed());
        let overlapped_settle = self.pacing.claim_returned();
        if result.is_ok() && self.store.came_back() {
            self.rec.store_up(true);
        }
        match result {
            Ok(claim) if claim.messages.is_empty() => self.pacing.found_nothing(overlapped_settle),
            Ok(claim) => {
                self.pacing.found(claim.messages.len(), overlapped_settle);
                self.start_batch(claim, started);
            }
            Err(e) => self.claim_failed(e),
        }
    }

    /// Transition (claim): a claim failed. Drain mode stops claiming on a permanent error;
    /// otherwise the loop backs off and claims again.
    fn claim_failed(&mut self, e: Error) {
        self.rec.add(Counter::StoreErrors, 1);
        if !self.serve && !e.is_transient() {
            error!(error = %e, "permanent error from claim; stopping");
            self.fatal = Some(e);
            return;
        }
        let pause = self.pacing.back_off(&self.shared.config.store_backoff);
        if e.is_transient() {
            if self.store.went_down(&e.to_string()) {
                self.rec.store_up(false);
            }
            debug!(error = %e, retry_in = ?pause, "claim failed; backing off");
        } else {
            error!(error = %e, retry_in = ?pause, "claim failed with a permanent error; backing off");
        }
    }

    /// Transition (claim): publish and settle a non-empty claim in its own future, or give it
    /// straight back if it arrived while stopping.
    fn start_batch(&mut self, claim: Claim, started: Instant) {
        let size = claim.messages.len();
        self.rec.add(Counter::Claimed, size as u64);
        self.rec.add(Counter::Batches, 1);
        self.rec.batch_size(size);
        let token = claim.token;
        self.in_flight.insert(token);
        let batch = Batch {
            shared: self.shared,
            rec: self.rec,
            abandon: self.stopping.abandon_rx.clone(),
        };
        let span = info_span!(
            "outbox_batch",
            size,
            token = %token,
            publisher = %self.shared.publisher_name
        );
        if self.stopping.deadline.is_some() {
            let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
            let lease_end = started + self.shared.config.lease;
            self.events.push(Box::pin(
                async move {
                    let fatal = batch.release(token, &ids, lease_end).await;
                    let end = BatchEnd {
                        fatal,
                        broker_down: None,
                    };
                    Event::Settled { token, end }
                }
                .instrument(span),
            ));
        } else {
            self.events.push(Box::pin(
                async move {
                    let end = batch.run(claim, started).await;
                    Event::Settled { token, end }
                }
                .instrument(span),
            ));
        }
    }

    /// Transition (settle): a batch finished. A broker it found down stops the claims (see
    /// [`RunLoop::broker_went_down`]); a permanent store error from it pauses claims (serve
    /// mode) or ends a drain.
    fn settled(&mut self, token: LeaseToken, end: BatchEnd) {
        self.in_flight.remove(&token);
        self.pacing.settled();
        if let Some(reason) = end.broker_down {
            self.broker_went_down(&reason);
        }
        if let Some(e) = end.fatal {
            if self.serve {
                self.pacing.back_off(&self.shared.config.store_backoff);
            } else if self.fatal.is_none() {
                self.fatal = Some(e);
            }
        }
    }
}
