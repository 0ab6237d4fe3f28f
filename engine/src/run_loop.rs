//! The relay loop: keeps up to `concurrency` batches in flight, paces claims (adaptive polling,
//! wake-ups), backs off on store outages, stops claiming while the broker is down (probing it
//! back, see [`crate::outage`]) and shuts down gracefully.
//!
//! Claims run one at a time, or, when the store declares
//! [`Capabilities::sharded_claims`](outbox_traits::Capabilities::sharded_claims) and the
//! relay's [`Tuning::claim_shards`](crate::Tuning::claim_shards) is above 1, one per shard of
//! the partition keys at a time: each [`Shard`] has its own claim request and its own
//! [`Pacing`], while the wake-up subscription, the broker's and the store's availability, the
//! batches in flight and the shutdown stay the loop's.
//!
//! [`RunLoop`] holds the loop's state; each turn of [`RunLoop::run`] checks the shutdown
//! deadline, starts a subscription or the claims that are due, then waits for the first of: an
//! event of its own futures (a claim, a batch settling, a subscription), a wake-up, the stop
//! signal, or the next timer. Each of those is handled by one named transition.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use outbox_traits::{Claim, ClaimRequest, ClaimShard, Error, LeaseToken, WakeSource};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, info_span, warn, Instrument};
use uuid::Uuid;

use crate::batch::{Batch, BatchEnd};
use crate::config::MAX_CLAIM_SHARDS;
use crate::group::{changed, Membership, Ownership};
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
    /// A claim of shard `shard` (an index into [`RunLoop::shards`]) that started at `started`
    /// returned.
    Claimed {
        shard: usize,
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
    let requests = claim_requests(shared);
    let membership = join_group(shared, mode, requests.len());
    let shard_recs: Vec<Recorder> = if requests.len() > 1 {
        (0..requests.len()).map(|i| rec.for_shard(i)).collect()
    } else {
        vec![rec.clone()]
    };
    let group = membership.as_ref().map(|m| m.ownership.clone());
    let result = RunLoop::new(shared, rec, &shard_recs, mode, &requests, group)
        .run(stop)
        .await;
    if let Some(membership) = membership {
        membership.leave(RELEASE_GRACE).await;
    }
    result
}

/// Join the relay group, when serving with one configured and a store that keeps groups.
fn join_group(shared: &Shared, mode: Mode, shards: usize) -> Option<Membership> {
    let group = shared.config.group.as_ref()?;
    if mode != Mode::Serve {
        return None;
    }
    let Some(store) = &shared.group_store else {
        warn!(
            group = %group,
            "the store does not support relay groups; the relay claims every shard, as \
             without a group"
        );
        return None;
    };
    // At most MAX_CLAIM_SHARDS requests.
    let shards = u32::try_from(shards).unwrap_or(1);
    Some(Membership::join(
        store.clone(),
        group.clone(),
        shards,
        shared.config.group_lease,
    ))
}

/// The claim request of each shard: one per shard (`shard: Some(..)`) when the relay's
/// [`Tuning`](crate::Tuning) has more than one claim shard (only ever with a store that declares
/// sharded claims), else a single one over every key (`shard: None`), with a warning if shards
/// were asked explicitly of a store that cannot honour them.
fn claim_requests(shared: &Shared) -> Vec<ClaimRequest> {
    let (cfg, tuning) = (&shared.config, &shared.tuning);
    let request = |shard| ClaimRequest {
        limit: tuning.batch_size,
        lease: cfg.lease,
        head_policy: cfg.head_policy,
        shard,
    };
    if tuning.shards_ignored {
        warn!(
            claim_shards = cfg.claim_shards,
            "the store does not declare sharded claims; claim_shards is ignored and the relay \
             runs one claim at a time"
        );
    }
    if tuning.claim_shards <= 1 {
        return vec![request(None)];
    }
    // Validated when the relay was built (at most `MAX_CLAIM_SHARDS`), so it fits; each index is
    // below the count by construction.
    let count = u32::try_from(tuning.claim_shards.min(MAX_CLAIM_SHARDS)).unwrap_or(1);
    (0..count)
        .map(|index| request(Some(ClaimShard { index, count })))
        .collect()
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

/// One shard's claims: what they ask the store for, and when (a loop that does not shard has a
/// single shard over every key).
struct Shard<'a> {
    /// The shard's claim request.
    request: &'a ClaimRequest,
    /// The shard's own claim pacing: whether it is claiming, is quiet, backs off or polls.
    pacing: Pacing,
}

/// The state of one running loop.
struct RunLoop<'a> {
    shared: &'a Shared,
    rec: &'a Recorder,
    /// One recorder per shard (counting its claims and publications), or the loop's own.
    shard_recs: &'a [Recorder],
    /// Updates of the shards this relay holds in its group (`None`: no group).
    group: Option<watch::Receiver<Ownership>>,
    /// The shards this relay holds in its group; `None` without a group: every shard.
    ownership: Option<Ownership>,
    serve: bool,
    events: FuturesUnordered<BoxFuture<'a, Event>>,
    /// The claim shards, at least one; claims run one per shard at a time.
    shards: Vec<Shard<'a>>,
    /// Most batches one shard may have in flight: `ceil(concurrency / shards)`.
    per_shard: usize,
    /// The shard to offer a claim first on the next turn (the one after the last to claim), so
    /// that no shard is starved when there are more shards than room in flight.
    next_shard: usize,
    wake: Wake,
    stopping: Stopping,
    /// The batches in flight, each with the shard whose claim it came from.
    in_flight: HashMap<LeaseToken, usize>,
    /// Whether the broker is down (then no claims, only probes).
    broker: Broker,
    /// Whether the store is down (claims fail with transient errors).
    store: Availability,
    /// Drain mode: a permanent store error that ends the run once in-flight batches are done.
    fatal: Option<Error>,
}

impl<'a> RunLoop<'a> {
    /// A loop with one shard per request of `requests` (at least one).
    fn new(
        shared: &'a Shared,
        rec: &'a Recorder,
        shard_recs: &'a [Recorder],
        mode: Mode,
        requests: &'a [ClaimRequest],
        group: Option<watch::Receiver<Ownership>>,
    ) -> Self {
        let serve = mode == Mode::Serve;
        let (abandon_tx, abandon_rx) = watch::channel(false);
        let shards: Vec<Shard<'a>> = requests
            .iter()
            .map(|request| Shard {
                request,
                pacing: Pacing::new(&shared.config, shared.tuning.batch_size, serve),
            })
            .collect();
        Self {
            shared,
            rec,
            shard_recs,
            ownership: group.as_ref().map(|g| g.borrow().clone()),
            group,
            serve,
            events: FuturesUnordered::new(),
            per_shard: shared.config.concurrency.div_ceil(shards.len().max(1)),
            shards,
            next_shard: 0,
            wake: Wake::new(serve),
            stopping: Stopping {
                deadline: None,
                abandoned: false,
                abandon_tx,
                abandon_rx,
            },
            in_flight: HashMap::new(),
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
            // From the shard after the last one to claim, so that every shard gets its turn.
            let first = self.next_shard;
            for shard in (first..self.shards.len()).chain(0..first) {
                if self.may_claim(shard)
                    && self.shards[shard]
                        .pacing
                        .claim_at()
                        .is_none_or(|at| at <= now)
                {
                    self.claim(shard);
                }
            }
            let timer = self.timer(listening);
            tokio::select! {
                Some(event) = self.events.next(), if !self.events.is_empty() => self.on_event(event),
                () = shared.notifier.notified(), if listening => self.woken_up(),
                hint = self.wake.next_hint(), if listening && self.wake.has_source() => match hint {
                    Ok(()) => {
                        self.wake.hinted();
                        self.woken_up();
                    }
                    Err(e) => self.wake.failed(&e, &shared.config.store_backoff),
                },
                grace = &mut stop, if self.stopping.deadline.is_none() => self.shutdown(grace),
                update = changed(&mut self.group), if listening => self.group_changed(update),
                () = sleep_until_some(timer), if timer.is_some() => {}
            }
        }
        self.fatal.map_or(Ok(()), Err)
    }

    /// Still taking wake-ups: serving and not shutting down.
    fn listening(&self) -> bool {
        self.serve && self.stopping.deadline.is_none()
    }

    /// Claims running, over every shard.
    fn claims_running(&self) -> usize {
        self.shards.iter().filter(|s| s.pacing.claiming()).count()
    }

    /// Batches in flight that came from a claim of `shard`.
    fn in_flight_of(&self, shard: usize) -> usize {
        self.in_flight.values().filter(|s| **s == shard).count()
    }

    /// Whether a claim of `shard` may start (when its time comes): the shard is not claiming
    /// and has room ([`RunLoop::per_shard`]), and the batches in flight plus the claims running
    /// (each of which becomes a batch) stay below `concurrency`. With a single shard this is
    /// exactly "no claim running and fewer than `concurrency` batches in flight".
    fn may_claim(&self, shard: usize) -> bool {
        let pacing = &self.shards[shard].pacing;
        self.stopping.deadline.is_none()
            && self.fatal.is_none()
            && !pacing.claiming()
            && !self.broker.is_down()
            && self.in_flight.len() + self.claims_running() < self.shared.config.concurrency
            && self.in_flight_of(shard) < self.per_shard
            && (self.serve || !pacing.quiet())
            && self
                .ownership
                .as_ref()
                .is_none_or(|o| o.holds(shard, Instant::now()))
    }

    /// Transition (group): the shards this relay holds changed; the ones it gained claim at
    /// once.
    fn group_changed(&mut self, update: Option<Ownership>) {
        let (Some(new), Some(old)) = (update, self.ownership.as_ref()) else {
            return;
        };
        let now = Instant::now();
        for (index, shard) in self.shards.iter_mut().enumerate() {
            if new.holds(index, now) && !old.holds(index, now) {
                shard.pacing.woken_up();
            }
        }
        self.ownership = Some(new);
    }

    /// The next time the loop must act on its own: a claim (the earliest over the shards that
    /// may claim), a subscription, or the shutdown deadline (then the end of the release grace).
    fn timer(&self, listening: bool) -> Option<Instant> {
        let stopping = &self.stopping;
        earliest([
            earliest(
                (0..self.shards.len())
                    .filter(|shard| self.may_claim(*shard))
                    .map(|shard| self.shards[shard].pacing.claim_at()),
            ),
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
    /// draining with nothing left to claim (every shard quiet, or a fatal error).
    fn finished(&mut self, now: Instant) -> bool {
        let Some(deadline) = self.stopping.deadline else {
            return !self.serve
                && self.claims_running() == 0
                && self.in_flight.is_empty()
                && (self.fatal.is_some() || self.shards.iter().all(|s| s.pacing.quiet()));
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
        self.claims_running() == 0 && self.in_flight.is_empty()
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

    /// Transition (wake): a wake-up (notifier, the store's source, or the broker back up)
    /// arrived; it may concern any shard's keys, so every shard hears it.
    fn woken_up(&mut self) {
        for shard in &mut self.shards {
            shard.pacing.woken_up();
        }
    }

    /// Transition (claim): start a claim of `shard`.
    fn claim(&mut self, shard: usize) {
        self.next_shard = (shard + 1) % self.shards.len();
        let Shard { request, pacing } = &mut self.shards[shard];
        pacing.start_claim();
        let (shared, request) = (self.shared, *request);
        self.events.push(Box::pin(async move {
            let started = Instant::now();
            let result = shared.store.claim(request).await;
            Event::Claimed {
                shard,
                result,
                started,
            }
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
            self.woken_up();
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
            Event::Claimed {
                shard,
                result,
                started,
            } => self.claimed(shard, result, started),
            Event::Settled { token, end } => self.settled(token, end),
            Event::Probed(down) => self.probed(down),
            Event::Subscribed(result) => self
                .wake
                .subscribed(result, &self.shared.config.store_backoff),
        }
    }

    /// Transition (claim): the claim of `shard` that started at `started` returned.
    fn claimed(&mut self, shard: usize, result: Result<Claim, Error>, started: Instant) {
        self.rec.claim_took(started.elapsed());
        let pacing = &mut self.shards[shard].pacing;
        let overlapped_settle = pacing.claim_returned();
        if result.is_ok() && self.store.came_back() {
            self.rec.store_up(true);
        }
        match result {
            Ok(claim) if claim.messages.is_empty() => pacing.found_nothing(overlapped_settle),
            Ok(claim) => {
                pacing.found(claim.messages.len(), overlapped_settle);
                self.start_batch(shard, claim, started);
            }
            Err(e) => self.claim_failed(shard, e),
        }
    }

    /// Transition (claim): a claim of `shard` failed. Drain mode stops claiming on a permanent
    /// error; otherwise that shard backs off and claims again.
    fn claim_failed(&mut self, shard: usize, e: Error) {
        self.rec.add(Counter::StoreErrors, 1);
        if !self.serve && !e.is_transient() {
            error!(error = %e, "permanent error from claim; stopping");
            self.fatal = Some(e);
            return;
        }
        let pause = self.shards[shard]
            .pacing
            .back_off(&self.shared.config.store_backoff);
        if e.is_transient() {
            if self.store.went_down(&e.to_string()) {
                self.rec.store_up(false);
            }
            debug!(error = %e, retry_in = ?pause, "claim failed; backing off");
        } else {
            error!(error = %e, retry_in = ?pause, "claim failed with a permanent error; backing off");
        }
    }

    /// Transition (claim): publish and settle a non-empty claim of `shard` in its own future, or
    /// give it straight back if it arrived while stopping.
    fn start_batch(&mut self, shard: usize, claim: Claim, started: Instant) {
        let size = claim.messages.len();
        let rec = &self.shard_recs[shard.min(self.shard_recs.len() - 1)];
        rec.add(Counter::Claimed, size as u64);
        self.rec.add(Counter::Batches, 1);
        self.rec.batch_size(size);
        let token = claim.token;
        self.in_flight.insert(token, shard);
        let batch = Batch {
            shared: self.shared,
            rec,
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

    /// Transition (settle): a batch finished, which may free its shard's keys (only its shard's:
    /// the keys of other shards never meet it). A broker it found down stops the claims (see
    /// [`RunLoop::broker_went_down`]); a permanent store error from it pauses every shard's
    /// claims (serve mode) or ends a drain.
    fn settled(&mut self, token: LeaseToken, end: BatchEnd) {
        if let Some(shard) = self.in_flight.remove(&token) {
            self.shards[shard].pacing.settled();
        }
        if let Some(reason) = end.broker_down {
            self.broker_went_down(&reason);
        }
        if let Some(e) = end.fatal {
            if self.serve {
                for shard in &mut self.shards {
                    shard.pacing.back_off(&self.shared.config.store_backoff);
                }
            } else if self.fatal.is_none() {
                self.fatal = Some(e);
            }
        }
    }
}
