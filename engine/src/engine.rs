//! The relay's public face: [`Relay`] runs the relay loop (`run_loop`) in the caller's task or
//! in a spawned one.

use std::future::{pending, Future};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use outbox_traits::{Error, OutboxAdmin, OutboxStore, Publisher, RelayGroupStore};
use tokio::sync::oneshot;

use crate::config::{RelayConfig, Tuning};
use crate::drain::until_drained;
use crate::handle::RelayHandle;
use crate::notifier::Notifier;
use crate::run_loop::{run_loop, Mode};
use crate::shared::Shared;
use crate::stats::{RelayStats, StatsCell};
use crate::telemetry::{describe_metrics, Recorder};

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
            .field("tuning", &self.shared.tuning)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// A relay over `store` and `publisher` (`config` was checked when it was built, see
    /// [`RelayConfig::builder`]). Fails with [`Error::InvalidInput`] if the store declares a
    /// batch size or claim shards no relay can run. The batch size and claim shards left unset are chosen by the
    /// store ([`RelayConfig::tuned_for`], [`Relay::tuning`]). Registers the metric
    /// descriptions.
    pub fn new(
        store: Arc<dyn OutboxStore>,
        publisher: Arc<dyn Publisher>,
        config: RelayConfig,
    ) -> Result<Self, Error> {
        let tuning = config.tuned_for(&store.capabilities());
        tuning.validate()?;
        describe_metrics();
        let publisher_name = publisher.name().to_owned();
        Ok(Self {
            shared: Arc::new(Shared {
                store,
                publisher,
                config,
                tuning,
                notifier: Notifier::new(),
                publisher_name,
                #[cfg(feature = "otel")]
                traces: None,
                group_store: None,
                outbox: None,
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

    /// Record a producer span per published message (and per batch) with `traces`, and send
    /// each message with its span's context as `traceparent` (see [`crate::trace`]).
    #[cfg(feature = "otel")]
    pub fn with_traces(self, traces: crate::Traces) -> Self {
        let mut shared = (*self.shared).clone();
        shared.traces = Some(Arc::new(traces));
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Label every metric this relay records with `outbox = name` (see
    /// [`OUTBOX_LABEL`](crate::metric_names::OUTBOX_LABEL)), beside `publisher`: for a process
    /// that runs one relay per outbox and serves their metrics on one endpoint. The metric
    /// names stay the same; a relay without a name records no `outbox` label.
    pub fn for_outbox(self, name: impl Into<String>) -> Self {
        let mut shared = (*self.shared).clone();
        shared.outbox = Some(name.into());
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Keep this relay's group ([`RelayConfig::group`]) in `store` (usually the same database as
    /// the outbox: the Postgres, MariaDB and memory stores implement [`RelayGroupStore`]). Without it a
    /// relay given a group logs a warning and claims every shard, as without a group.
    pub fn with_group_store(self, store: Arc<dyn RelayGroupStore>) -> Self {
        let mut shared = (*self.shared).clone();
        shared.group_store = Some(store);
        Self {
            shared: Arc::new(shared),
        }
    }

    /// The `outbox` label given by [`for_outbox`](Self::for_outbox), if any.
    pub fn outbox(&self) -> Option<&str> {
        self.shared.outbox.as_deref()
    }

    /// The notifier that wakes this relay; call [`Notifier::notify`] after an enqueue commits.
    pub fn notifier(&self) -> Notifier {
        self.shared.notifier.clone()
    }

    /// The relay's settings, as given.
    pub fn config(&self) -> &RelayConfig {
        &self.shared.config
    }

    /// The batch size and claim shards the relay runs with, and who chose each: the config,
    /// or the store (see [`RelayConfig::tuned_for`]).
    pub fn tuning(&self) -> Tuning {
        self.shared.tuning
    }

    /// Claim, publish and settle until a claim finds nothing while no batch is in flight, then
    /// return what this call did. For tests, examples, benchmarks and cron-style draining; may be
    /// called repeatedly.
    ///
    /// Messages that are waiting for a retry or a `not_before` time are not waited for.
    /// Transient store errors are retried with back-off (so this does not return during an
    /// outage); a permanent store error stops claiming, lets in-flight batches finish, and is
    /// returned.
    ///
    /// Messages that other relays hold are not waited for either: beside other relays, this may
    /// return while they still work, having claimed little or nothing. To drain a shared
    /// backlog, use [`run_until_drained`](Self::run_until_drained).
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

    /// Drain a backlog that other relays may be draining too: claim, publish and settle until
    /// nothing this relay could ever claim remains, then return what this call did.
    ///
    /// Unlike [`run_until_idle`](Self::run_until_idle), which returns at the first claim that
    /// finds nothing, this asks `admin` (the same store's operator view) after each such claim
    /// and carries on while any message is leased, by this relay or another one: their
    /// messages, and their keys' later ones, are waited for until they are published, or until
    /// their lease ends and this relay claims them. It returns once the store holds no pending
    /// message and none leased, or once its rounds have seen the same pending count and nothing
    /// leased for [`DRAIN_SETTLE`](crate::DRAIN_SETTLE) (1 s): what is left then waits for a
    /// retry or a `not_before` time, or sits behind a dead head message under
    /// [`HeadPolicy::Block`](outbox_traits::HeadPolicy::Block), which a drain does not wait
    /// for. (A second is far longer than another relay's claim, whose rows read as pending
    /// until it commits.) Several relays started at once on one backlog thus
    /// all return once it is done. Messages enqueued meanwhile are drained too.
    ///
    /// Errors as [`run_until_idle`](Self::run_until_idle); a transient error of the status
    /// query is retried after a pause, a permanent one is returned.
    pub async fn run_until_drained(&self, admin: &dyn OutboxAdmin) -> Result<RelayStats, Error> {
        self.run_until_drained_or(admin, pending()).await
    }

    /// [`run_until_drained`](Self::run_until_drained), unless `shutdown` resolves first: then it
    /// stops claiming and shuts down gracefully within [`RelayConfig::shutdown_deadline`], as
    /// [`run`](Self::run) does, and returns the stats.
    pub async fn run_until_drained_or<F>(
        &self,
        admin: &dyn OutboxAdmin,
        shutdown: F,
    ) -> Result<RelayStats, Error>
    where
        F: Future<Output = ()>,
    {
        let stats = Arc::new(StatsCell::default());
        let rec = Recorder::for_shared(stats.clone(), &self.shared);
        until_drained(&self.shared, &rec, admin, shutdown).await?;
        Ok(stats.snapshot())
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
        let rec = Recorder::for_shared(stats.clone(), &self.shared);
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
        let rec = Recorder::for_shared(stats.clone(), &self.shared);
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
