//! The relay loop: keeps up to `concurrency` batches in flight, paces claims (adaptive polling,
//! wake-ups), backs off on store outages and shuts down gracefully.

use std::collections::HashSet;
use std::future::{pending, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use outbox_traits::{Claim, ClaimRequest, Error, LeaseToken, OutboxStore, Publisher, WakeSource};
use tokio::sync::{oneshot, watch};
use tokio::time::{sleep_until, Instant};
use tracing::{debug, error, info, info_span, warn, Instrument};
use uuid::Uuid;

use crate::batch::Batch;
use crate::config::RelayConfig;
use crate::handle::RelayHandle;
use crate::notifier::Notifier;
use crate::stats::{Counter, RelayStats, StatsCell};
use crate::telemetry::{describe_metrics, Recorder};

/// After the shutdown deadline, how long the relay waits for in-flight batches to release their
/// messages before it drops them (their leases then simply expire).
pub const RELEASE_GRACE: Duration = Duration::from_secs(5);

/// What the loop and its batches share.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn OutboxStore>,
    pub(crate) publisher: Arc<dyn Publisher>,
    pub(crate) config: RelayConfig,
    pub(crate) notifier: Notifier,
    pub(crate) publisher_name: String,
}

/// The relay engine: claims committed messages from an [`OutboxStore`], publishes them through a
/// [`Publisher`], and completes, retries, dead-letters or releases them.
///
/// Cheap to clone (clones share the store, publisher, config and [`Notifier`]). See the crate
/// docs for the guarantees.
#[derive(Clone)]
pub struct Relay {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("publisher", &self.shared.publisher_name)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

/// How the loop ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Return once a claim finds nothing while nothing is in flight.
    Drain,
    /// Run until stopped, waiting for wake-ups or polls when idle.
    Serve,
}

enum Event {
    Claimed {
        result: Result<Claim, Error>,
        started: Instant,
    },
    Settled {
        token: LeaseToken,
        fatal: Option<Error>,
    },
    Subscribed(Result<Option<Box<dyn WakeSource>>, Error>),
}

impl Relay {
    /// A relay over `store` and `publisher`. Fails with [`Error::InvalidInput`] if `config` is
    /// invalid (see [`RelayConfig::validate`]). Registers the metric descriptions.
    pub fn new(
        store: Arc<dyn OutboxStore>,
        publisher: Arc<dyn Publisher>,
        config: RelayConfig,
    ) -> Result<Self, Error> {
        config.validate()?;
        describe_metrics();
        let publisher_name = publisher.name().to_owned();
        Ok(Self {
            shared: Arc::new(Shared {
                store,
                publisher,
                config,
                notifier: Notifier::new(),
                publisher_name,
            }),
        })
    }

    /// Use `notifier` (e.g. one created before the relay and already handed to the enqueuing
    /// code) instead of the relay's own.
    pub fn with_notifier(self, notifier: Notifier) -> Self {
        let mut shared = (*self.shared).clone();
        shared.notifier = notifier;
        Self {
            shared: Arc::new(shared),
        }
    }

    /// The notifier that wakes this relay; call [`Notifier::notify`] after an enqueue commits.
    pub fn notifier(&self) -> Notifier {
        self.shared.notifier.clone()
    }

    /// The relay's settings.
    pub fn config(&self) -> &RelayConfig {
        &self.shared.config
    }

    /// Claim, publish and settle until a claim finds nothing while no batch is in flight, then
    /// return what this call did. For tests, examples, benchmarks and cron-style draining; may be
    /// called repeatedly.
    ///
    /// Messages that are waiting for a retry or a `not_before` time are not waited for.
    /// Transient store errors are retried with back-off (so this does not return during an
    /// outage); a permanent store error stops claiming, lets in-flight batches finish, and is
    /// returned.
    pub async fn run_until_idle(&self) -> Result<RelayStats, Error> {
        self.run_in(Mode::Drain, pending()).await
    }

    /// [`run_until_idle`](Self::run_until_idle), unless `shutdown` resolves first (e.g. a
    /// SIGTERM to a drain job): then it stops claiming and shuts down gracefully within
    /// [`RelayConfig::shutdown_deadline`], as [`run`](Self::run) does, and returns the stats.
    pub async fn run_until_idle_or<F>(&self, shutdown: F) -> Result<RelayStats, Error>
    where
        F: Future<Output = ()>,
    {
        self.run_in(Mode::Drain, shutdown).await
    }

    /// Run in the current task until `shutdown` resolves (e.g. `tokio::signal::ctrl_c()`), then
    /// shut down gracefully within [`RelayConfig::shutdown_deadline`] and return the stats.
    pub async fn run<F>(&self, shutdown: F) -> Result<RelayStats, Error>
    where
        F: Future<Output = ()>,
    {
        self.run_in(Mode::Serve, shutdown).await
    }

    async fn run_in<F>(&self, mode: Mode, shutdown: F) -> Result<RelayStats, Error>
    where
        F: Future<Output = ()>,
    {
        let deadline = self.shared.config.shutdown_deadline;
        let stats = Arc::new(StatsCell::default());
        let rec = Recorder::new(stats.clone(), self.shared.publisher_name.clone());
        let stop = async move {
            shutdown.await;
            deadline
        };
        run_loop(&self.shared, &rec, mode, pin!(stop)).await?;
        Ok(stats.snapshot())
    }

    /// Run the relay on the tokio runtime until [`RelayHandle::shutdown`] (or until the handle is
    /// dropped, which shuts down with [`RelayConfig::shutdown_deadline`] in the background).
    ///
    /// Each call starts another loop; loops of one `Relay` share its [`Notifier`], and a
    /// notification wakes one of them.
    ///
    /// # Panics
    /// Like [`tokio::spawn`], if called outside a tokio runtime.
    pub fn spawn(&self) -> RelayHandle {
        let (stop_tx, stop_rx) = oneshot::channel::<Duration>();
        let stats = Arc::new(StatsCell::default());
        let rec = Recorder::new(stats.clone(), self.shared.publisher_name.clone());
        let shared = self.shared.clone();
        let default_deadline = shared.config.shutdown_deadline;
        let task = tokio::spawn(async move {
            let stop = async move { stop_rx.await.unwrap_or(default_deadline) };
            run_loop(&shared, &rec, Mode::Serve, pin!(stop)).await?;
            Ok(rec.stats().snapshot())
        });
        RelayHandle::new(stop_tx, task, stats, self.notifier())
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => pending().await,
    }
}

/// The next hint of the wake-up source, or never if there is none. Cancel safe (the contract
/// of [`WakeSource::wait`]).
async fn next_hint(source: &mut Option<Box<dyn WakeSource>>) -> Result<(), Error> {
    match source {
        Some(source) => source.wait().await,
        None => pending().await,
    }
}

/// Longest pause [`woken`] puts between a wake-up and its claim (shorter if `poll_min` is).
pub(crate) const WAKE_PACING: Duration = Duration::from_millis(10);

/// When to claim after a wake-up: at once, unless a claim made on an earlier wake-up came back
/// empty less than `min(poll_min, WAKE_PACING)` ago. Such an empty claim is usually innocent
/// (the hint's message was taken by an earlier claim), so the pause stays short whatever
/// `poll_min` is; it only caps a flood of hints at about one claim per pause.
fn woken(spurious_at: Option<Instant>, poll_min: Duration) -> Option<Instant> {
    spurious_at
        .map(|at| at + poll_min.min(WAKE_PACING))
        .filter(|at| *at > Instant::now())
}

fn later(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

fn earliest(times: impl IntoIterator<Item = Option<Instant>>) -> Option<Instant> {
    times.into_iter().flatten().min()
}

/// The loop shared by every way of running a relay. Returns a permanent error only in drain mode.
async fn run_loop(
    shared: &Shared,
    rec: &Recorder,
    mode: Mode,
    mut stop: Pin<&mut impl Future<Output = Duration>>,
) -> Result<(), Error> {
    let cfg = &shared.config;
    let serve = mode == Mode::Serve;
    let request = ClaimRequest {
        limit: cfg.batch_size,
        lease: cfg.lease,
        head_policy: cfg.head_policy,
    };
    let request = &request;
    let (abandon_tx, abandon_rx) = watch::channel(false);
    let mut events: FuturesUnordered<BoxFuture<'_, Event>> = FuturesUnordered::new();

    let mut claiming = false;
    let mut in_flight: HashSet<LeaseToken> = HashSet::new();
    // Drain mode: the last claim found no (or only a partial) batch, and no batch has settled
    // since, so claiming again now would find nothing new.
    let mut quiet = false;
    // Batches settled so far, and how many had settled when the running claim started: a claim
    // that overlapped a settle may have been held back by leases that are gone now, so its
    // empty (or partial) answer says nothing about the backlog.
    let mut settles = 0u64;
    let mut settles_at_claim = 0u64;
    // Earliest next claim, from adaptive polling.
    let mut next_claim: Option<Instant> = None;
    // Earliest next claim, from back-off after store errors.
    let mut paused_until: Option<Instant> = None;
    let mut idle_wait = cfg.poll_min;
    // A wake-up arrived since the last claim started / the running claim followed one.
    let mut hinted = false;
    let mut claim_hinted = false;
    // When a claim made on a wake-up came back empty: the next wake-up waits a short pause
    // from then (see `woken`), so a burst of stale hints (or a source that is always ready)
    // cannot spin the claim loop.
    let mut spurious_at: Option<Instant> = None;
    let mut store_failures = 0u32;
    let mut fatal: Option<Error> = None;

    let mut wake: Option<Box<dyn WakeSource>> = None;
    let mut subscribing = false;
    let mut resubscribe_at = serve.then(Instant::now);
    let mut wake_failures = 0u32;

    let mut deadline: Option<Instant> = None;
    let mut abandoned = false;

    loop {
        let now = Instant::now();
        if let Some(deadline) = deadline {
            if !abandoned && now >= deadline {
                abandoned = true;
                abandon_tx.send_replace(true);
                warn!(
                    batches = in_flight.len(),
                    "shutdown deadline passed; releasing in-flight batches"
                );
            }
            if now >= deadline + RELEASE_GRACE {
                warn!(
                    batches = in_flight.len(),
                    "in-flight batches did not release in time; their leases will expire"
                );
                break;
            }
            if !claiming && in_flight.is_empty() {
                break;
            }
        } else if !serve && !claiming && in_flight.is_empty() && (quiet || fatal.is_some()) {
            break;
        }

        let listening = serve && deadline.is_none();
        if listening && wake.is_none() && !subscribing && resubscribe_at.is_some_and(|at| at <= now)
        {
            resubscribe_at = None;
            subscribing = true;
            events.push(Box::pin(async move {
                Event::Subscribed(shared.store.wakeups().await)
            }));
        }

        let may_claim = deadline.is_none()
            && fatal.is_none()
            && !claiming
            && in_flight.len() < cfg.concurrency
            && !(mode == Mode::Drain && quiet);
        let claim_at = later(next_claim, paused_until);
        if may_claim && claim_at.is_none_or(|at| at <= now) {
            claiming = true;
            settles_at_claim = settles;
            claim_hinted = std::mem::take(&mut hinted);
            next_claim = None;
            paused_until = None;
            events.push(Box::pin(async move {
                let started = Instant::now();
                let result = shared.store.claim(request).await;
                Event::Claimed { result, started }
            }));
        }

        let timer = earliest([
            if may_claim && !claiming {
                claim_at
            } else {
                None
            },
            if listening && wake.is_none() && !subscribing {
                resubscribe_at
            } else {
                None
            },
            deadline.map(|d| if abandoned { d + RELEASE_GRACE } else { d }),
        ]);

        tokio::select! {
            Some(event) = events.next(), if !events.is_empty() => match event {
                Event::Claimed { result, started } => {
                    claiming = false;
                    rec.claim_took(started.elapsed());
                    let overlapped_settle = settles != settles_at_claim;
                    match result {
                        Ok(claim) if claim.messages.is_empty() && overlapped_settle => {
                            // Claim again at once: see `settles_at_claim`.
                            store_failures = 0;
                            next_claim = None;
                        }
                        Ok(claim) if claim.messages.is_empty() => {
                            store_failures = 0;
                            quiet = true;
                            if claim_hinted {
                                spurious_at = Some(Instant::now());
                            }
                            if serve && hinted {
                                // A wake-up arrived while this claim ran; it may have missed
                                // what the wake-up announced.
                                next_claim = woken(spurious_at, cfg.poll_min);
                            } else if serve {
                                next_claim = Some(Instant::now() + idle_wait);
                                idle_wait = (idle_wait * 2).min(cfg.poll_max);
                            }
                        }
                        Ok(claim) => {
                            store_failures = 0;
                            spurious_at = None;
                            idle_wait = cfg.poll_min;
                            let size = claim.messages.len();
                            rec.add(Counter::Claimed, size as u64);
                            rec.add(Counter::Batches, 1);
                            rec.batch_size(size);
                            if size < cfg.batch_size && !overlapped_settle {
                                // Partial: the backlog is drained for now; claim again soon
                                // rather than at once, so that small batches do not spin.
                                quiet = true;
                                if serve && !hinted {
                                    next_claim = Some(Instant::now() + cfg.poll_min);
                                }
                            }
                            in_flight.insert(claim.token);
                            let batch = Batch { shared, rec, abandon: abandon_rx.clone() };
                            let token = claim.token;
                            let span = info_span!(
                                "outbox_batch",
                                size,
                                token = %token,
                                publisher = %shared.publisher_name
                            );
                            if deadline.is_some() {
                                // Claimed while stopping: give it straight back.
                                let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
                                events.push(Box::pin(async move {
                                    let fatal = batch.release(token, &ids, started + cfg.lease).await;
                                    Event::Settled { token, fatal }
                                }.instrument(span)));
                            } else {
                                events.push(Box::pin(async move {
                                    let fatal = batch.run(claim, started).await;
                                    Event::Settled { token, fatal }
                                }.instrument(span)));
                            }
                        }
                        Err(e) => {
                            rec.add(Counter::StoreErrors, 1);
                            if !serve && !e.is_transient() {
                                error!(error = %e, "permanent error from claim; stopping");
                                fatal = Some(e);
                            } else {
                                store_failures += 1;
                                let pause = cfg.store_backoff.delay(store_failures);
                                if e.is_transient() {
                                    warn!(error = %e, retry_in = ?pause, "claim failed; backing off");
                                } else {
                                    error!(error = %e, retry_in = ?pause, "claim failed with a permanent error; backing off");
                                }
                                paused_until = Some(Instant::now() + pause);
                            }
                        }
                    }
                }
                Event::Settled { token, fatal: batch_fatal } => {
                    in_flight.remove(&token);
                    settles += 1;
                    // Settling may have released messages or unblocked keys.
                    quiet = false;
                    next_claim = None;
                    if let Some(e) = batch_fatal {
                        if serve {
                            store_failures += 1;
                            paused_until = Some(Instant::now() + cfg.store_backoff.delay(store_failures));
                        } else if fatal.is_none() {
                            fatal = Some(e);
                        }
                    }
                }
                Event::Subscribed(result) => {
                    subscribing = false;
                    match result {
                        Ok(Some(source)) => {
                            debug!("subscribed to the store's wake-ups");
                            wake = Some(source);
                        }
                        Ok(None) => debug!("the store offers no wake-ups; polling only"),
                        Err(e) => {
                            wake_failures += 1;
                            let retry = cfg.store_backoff.delay(wake_failures);
                            warn!(error = %e, retry_in = ?retry, "could not subscribe to wake-ups; polling meanwhile");
                            resubscribe_at = Some(Instant::now() + retry);
                        }
                    }
                }
            },
            () = shared.notifier.notified(), if listening => {
                hinted = true;
                next_claim = woken(spurious_at, cfg.poll_min);
                idle_wait = cfg.poll_min;
            }
            hint = next_hint(&mut wake), if listening && wake.is_some() => match hint {
                Ok(()) => {
                    wake_failures = 0;
                    hinted = true;
                    next_claim = woken(spurious_at, cfg.poll_min);
                    idle_wait = cfg.poll_min;
                }
                Err(e) => {
                    wake = None;
                    wake_failures += 1;
                    let retry = cfg.store_backoff.delay(wake_failures);
                    warn!(error = %e, retry_in = ?retry, "wake-up source failed; polling until it is back");
                    resubscribe_at = Some(Instant::now() + retry);
                }
            },
            grace = &mut stop, if deadline.is_none() => {
                info!(deadline = ?grace, batches = in_flight.len(), "relay shutting down");
                deadline = Some(Instant::now() + grace);
                wake = None;
            }
            () = sleep_until_some(timer), if timer.is_some() => {}
        }
    }
    match fatal {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
