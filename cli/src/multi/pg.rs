//! Outboxes on one Postgres database: one pool and one `LISTEN` connection for all of them.
//!
//! Each [`PostgresStore`] would open its own listening connection (a private pool of up to
//! two): fifty tenant schemas would hold a hundred connections only to wait for
//! notifications. Here one [`Hub`] per database listens on every outbox's channel and wakes
//! the outbox whose channel fired.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox::chrono::{DateTime, Utc};
use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::store::StoreOptions;
use outbox::{
    async_trait, Capabilities, Claim, ClaimRequest, Error, Failure, LeaseToken, OutboxAdmin,
    OutboxStore, WakeSource,
};
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};
use tokio::sync::{mpsc, Notify};
use uuid::Uuid;

use crate::TARGET;

/// Most connections of the pool the outboxes on one database share. sqlx's default of 10 (a
/// single store's) made a hundred outboxes queue for connections: each outbox runs its own
/// claims (two shards) and completes. One relay over 100 outboxes drained 20,000 messages at
/// 0.16× the rate of a relay process per outbox with the pool of 10, 0.29× with 32
/// (`BENCHMARKS.md`, "Many outboxes"). Connections are opened only when needed.
pub(super) const SHARED_POOL_SIZE: u32 = 32;

/// A database's shared pool and listener.
#[derive(Clone)]
pub(super) struct PgShared {
    pool: PgPool,
    hub: Hub,
}

impl PgShared {
    /// Connect (checking that the server answers), make the shared pool of up to
    /// [`SHARED_POOL_SIZE`] connections, and start the listener.
    pub(super) async fn connect(url: &str) -> Result<Self, Error> {
        let probe = PostgresStore::connect(url, PostgresConfig::builder().build()?).await?;
        let pool = PgPoolOptions::new()
            .max_connections(SHARED_POOL_SIZE)
            .acquire_timeout(probe.pool().options().get_acquire_timeout())
            .connect_lazy_with(probe.pool().connect_options().as_ref().clone());
        probe.pool().close().await;
        let hub = Hub::start(&pool);
        Ok(Self { pool, hub })
    }

    /// The outbox with `options` on this database: the relay's view (woken by the hub) and
    /// the operator's.
    pub(super) async fn open(
        &self,
        options: &StoreOptions,
        migrate: bool,
    ) -> Result<(Arc<dyn OutboxStore>, Arc<dyn OutboxAdmin>), Error> {
        let mut config = PostgresConfig::builder().delete_published(options.delete_published);
        if let Some(table) = &options.table {
            config = config.table(table.clone());
        }
        if let Some(schema) = &options.schema {
            config = config.schema(schema.clone());
        }
        let config = config.build()?;
        let store = PostgresStore::new(self.pool.clone(), config.clone());
        if migrate {
            store.migrate().await?;
        }
        let relay_view = HubStore {
            inner: store.clone(),
            hub: self.hub.clone(),
            channel: config.notify_channel().to_owned(),
            notify: config.notify(),
        };
        Ok((Arc::new(relay_view), Arc::new(store)))
    }

    /// The schemas whose name is `LIKE` `pattern`, each with whether it has `table`.
    pub(super) async fn schemas(
        &self,
        pattern: &str,
        table: &str,
    ) -> Result<Vec<(String, bool)>, Error> {
        sqlx::query_as::<_, (String, bool)>(
            "SELECT n.nspname::text, to_regclass(format('%I.%I', n.nspname, $2)) IS NOT NULL \
             FROM pg_namespace n WHERE n.nspname LIKE $1 ORDER BY 1",
        )
        .bind(pattern)
        .bind(table)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| Error::unavailable("postgres", "schema discovery failed", e))
    }
}

/// The listener of one database: subscribes to the channels asked for and wakes their
/// outboxes.
#[derive(Clone)]
pub(super) struct Hub {
    subscribe: mpsc::UnboundedSender<(String, Arc<Notify>)>,
}

impl Hub {
    fn start(pool: &PgPool) -> Self {
        let (subscribe, requests) = mpsc::unbounded_channel();
        // Its own pool, as `PostgresStore`'s own listener: a listener on the shared pool would
        // hold one of its connections for good.
        let own = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with(pool.connect_options().as_ref().clone());
        tokio::spawn(listen(own, requests));
        Self { subscribe }
    }
}

/// Wake every outbox (after a lost connection, notifications may have been missed: they poll).
fn wake_all(subs: &HashMap<String, Vec<Arc<Notify>>>) {
    for notify in subs.values().flatten() {
        notify.notify_one();
    }
}

async fn listen(pool: PgPool, mut requests: mpsc::UnboundedReceiver<(String, Arc<Notify>)>) {
    let mut subs: HashMap<String, Vec<Arc<Notify>>> = HashMap::new();
    let mut listener: Option<PgListener> = None;
    let mut wait = Duration::from_millis(100);
    loop {
        if listener.is_none() && !subs.is_empty() {
            let connected = async {
                let mut l = PgListener::connect_with(&pool).await?;
                l.listen_all(subs.keys().map(String::as_str)).await?;
                Ok::<_, sqlx::Error>(l)
            }
            .await;
            match connected {
                Ok(l) => {
                    listener = Some(l);
                    wait = Duration::from_millis(100);
                    wake_all(&subs);
                }
                Err(e) => {
                    tracing::debug!(target: TARGET, error = %outbox::redact_url(&e.to_string()),
                                    "LISTEN connection failed; outboxes poll meanwhile");
                    // Meanwhile the relays poll at their poll_max; new requests still come in.
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        request = requests.recv() => match request {
                            Some((channel, notify)) => {
                                notify.notify_one();
                                subs.entry(channel).or_default().push(notify);
                            }
                            None => return,
                        },
                    }
                    wait = (wait * 2).min(Duration::from_secs(10));
                    continue;
                }
            }
        }
        tokio::select! {
            request = requests.recv() => match request {
                Some((channel, notify)) => {
                    let new = !subs.contains_key(&channel);
                    subs.entry(channel.clone()).or_default().push(notify.clone());
                    if new {
                        if let Some(l) = listener.as_mut() {
                            if l.listen(&channel).await.is_err() {
                                listener = None;
                            }
                        }
                    }
                    // Poll once: anything committed before the subscription took effect.
                    notify.notify_one();
                }
                None => return,
            },
            received = async {
                match listener.as_mut() {
                    Some(l) => l.try_recv().await,
                    None => std::future::pending().await,
                }
            } => match received {
                Ok(Some(notification)) => {
                    if let Some(notifies) = subs.get(notification.channel()) {
                        for notify in notifies {
                            notify.notify_one();
                        }
                    }
                }
                // Reconnected by sqlx: notifications may have been missed.
                Ok(None) => wake_all(&subs),
                Err(_) => {
                    listener = None;
                    wake_all(&subs);
                }
            },
        }
    }
}

/// A wake-up source fed by the hub.
struct HubWake {
    notify: Arc<Notify>,
}

#[async_trait]
impl WakeSource for HubWake {
    async fn wait(&mut self) -> Result<(), Error> {
        self.notify.notified().await;
        Ok(())
    }
}

/// A [`PostgresStore`] whose wake-ups come from the database's [`Hub`].
struct HubStore {
    inner: PostgresStore,
    hub: Hub,
    channel: String,
    notify: bool,
}

#[async_trait]
impl OutboxStore for HubStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        self.inner.claim(req).await
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.inner.complete(token, ids).await
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        self.inner.fail(token, failures).await
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        self.inner.extend(token, lease).await
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.inner.release(token, ids).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        if !self.notify {
            return Ok(None);
        }
        let notify = Arc::new(Notify::new());
        self.hub
            .subscribe
            .send((self.channel.clone(), notify.clone()))
            .map_err(|_| Error::Unavailable {
                what: "postgres".into(),
                message: "the shared LISTEN task has stopped".into(),
                source: None,
            })?;
        Ok(Some(Box::new(HubWake { notify })))
    }
}
