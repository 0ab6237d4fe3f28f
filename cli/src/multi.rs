//! Many outboxes in one `outbox-relay run`: the configuration file's `[[outbox]]` tables.
//!
//! ```toml
//! broker = "nats://127.0.0.1:4222?subject=outbox.{outbox}.{event_type}"
//! batch_size = 500                      # top-level settings: every outbox's defaults
//!
//! [[outbox]]
//! name = "billing"
//! store = "postgres://relay@db/app"
//! schema = "billing"
//!
//! [[outbox]]
//! name = "edge"
//! store = "sqlite:///var/lib/edge/outbox.db"
//! broker = "redis://127.0.0.1:6379?stream=edge"
//! poll_max = "50ms"
//!
//! [[outbox]]                            # every schema named tenant_* that has the table
//! store = "postgres://relay@db/app"
//! schemas = "tenant_*"
//! name = "{schema}"                     # the default for a pattern
//! ```
//!
//! Each outbox runs its own relay engine ([`Relay`]) in its own task, with its own bounded
//! batches: a backlog in one outbox is worked off batch by batch beside the others, never in
//! front of them (see `README.md`, "Many outboxes"). Outboxes on one Postgres URL share one
//! connection pool and one `LISTEN` connection; outboxes with one broker URL share one broker
//! connection. An outbox whose database, table or broker fails is retried on its own, with
//! back-off, while the others go on.
//!
//! `outbox-relay drain` and `status` work on the same outboxes (a pattern's schemas looked up
//! once). A drain retries nothing: an outbox that fails stops alone, the others drain on, and
//! the command fails naming it. With a metrics address, a drain serves the same endpoints as
//! `run`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use outbox::relay::{Relay, RelayConfig, RelayStats};
use outbox::store::StoreOptions;
use outbox::{redact_url, Error, HeadPolicy, OutboxAdmin, OutboxStore, Publisher};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{watch, OnceCell};
use tokio::task::JoinHandle;

use crate::secrets::pick;
use crate::settings::{mask_url, Effective, Head};
use crate::TARGET;

/// One `[[outbox]]` table of the configuration file. Keys left out take the top-level value.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxFile {
    name: Option<String>,
    store: Option<String>,
    store_file: Option<std::path::PathBuf>,
    schema: Option<String>,
    schemas: Option<String>,
    table: Option<String>,
    delete_published: Option<bool>,
    broker: Option<String>,
    broker_file: Option<std::path::PathBuf>,
    batch_size: Option<usize>,
    concurrency: Option<usize>,
    claim_shards: Option<usize>,
    lease: Option<String>,
    max_attempts: Option<u32>,
    head_policy: Option<Head>,
    poll_max: Option<String>,
    shutdown_deadline: Option<String>,
}

/// One outbox (or, with [`OutboxSpec::schemas`], a pattern of them) as resolved.
#[derive(Clone)]
pub struct OutboxSpec {
    /// Its name, the `outbox` label of its metrics; with a pattern, may hold `{schema}`.
    pub name: String,
    /// The store URL.
    pub store: String,
    /// Table, schema and published-message handling.
    pub options: StoreOptions,
    /// A Postgres schema pattern (`tenant_*`): one outbox per matching schema with the table.
    pub schemas: Option<String>,
    /// The broker URL; `{outbox}` and `{schema}` are replaced by the outbox's name and schema.
    pub broker: String,
    /// Its relay settings.
    pub relay: RelayConfig,
}

impl std::fmt::Debug for OutboxSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxSpec")
            .field("name", &self.name)
            .field("store", &mask_url(&self.store))
            .field("options", &self.options)
            .field("schemas", &self.schemas)
            .field("broker", &mask_url(&self.broker))
            .field("relay", &self.relay)
            .finish()
    }
}

impl OutboxSpec {
    /// The name of the outbox of `schema` (a pattern's match), or the name itself.
    fn name_for(&self, schema: Option<&str>) -> String {
        match schema {
            Some(schema) => self.name.replace("{schema}", schema),
            None => self.name.clone(),
        }
    }

    /// The broker URL of outbox `name` in `schema`.
    fn broker_for(&self, name: &str, schema: Option<&str>) -> String {
        let schema = schema
            .or(self.options.schema.as_deref())
            .unwrap_or("public");
        self.broker
            .replace("{outbox}", name)
            .replace("{schema}", schema)
    }

    fn is_postgres(&self) -> bool {
        is_postgres(&self.store)
    }
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres:") || url.starts_with("postgresql:")
}

/// The longest idle wait of a Postgres outbox among several when `poll_max` is left at its
/// default: wake-ups come from `LISTEN`, so a poll only catches what a lost notification or a
/// retry coming due left behind.
pub const PG_POLL_MAX: Duration = Duration::from_secs(1);

fn duration(name: &str, key: &str, text: Option<String>) -> Result<Option<Duration>, Error> {
    text.map(|text| {
        humantime::parse_duration(&text).map_err(|e| {
            Error::invalid_input(format!(
                "[[outbox]] {name}: `{key}` = {text:?} is not a duration ({e}); write e.g. \
                 \"30s\" or \"100ms\""
            ))
        })
    })
    .transpose()
}

/// A name fit for a metric label and a log field: letters, digits, `_`, `-`, `.`, and the
/// `{schema}` placeholder.
fn check_name(name: &str) -> Result<(), Error> {
    let bare = name.replace("{schema}", "");
    let ok = !name.is_empty()
        && name.len() <= 128
        && bare
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid_input(format!(
            "[[outbox]] name {name:?} is not valid: use 1 to 128 letters, digits, `_`, `-` or `.`"
        )))
    }
}

/// Resolve the `[[outbox]]` tables against the top-level settings (their defaults), checking
/// every one before anything is opened.
pub fn resolve(files: Vec<OutboxFile>, base: &Effective) -> Result<Vec<OutboxSpec>, Error> {
    let mut specs = Vec::with_capacity(files.len());
    let mut names = HashSet::new();
    for (index, file) in files.into_iter().enumerate() {
        let name = match (&file.name, &file.schemas) {
            (Some(name), _) => name.clone(),
            (None, Some(_)) => "{schema}".to_owned(),
            (None, None) => {
                return Err(Error::invalid_input(format!(
                    "[[outbox]] number {} has no `name`; give each outbox a name (its metrics' \
                     `outbox` label)",
                    index + 1
                )))
            }
        };
        check_name(&name)?;
        if file.schemas.is_none() && name.contains("{schema}") {
            return Err(Error::invalid_input(format!(
                "[[outbox]] {name}: `{{schema}}` in a name needs `schemas` (a schema pattern)"
            )));
        }
        if file.schemas.is_some() && !name.contains("{schema}") {
            return Err(Error::invalid_input(format!(
                "[[outbox]] {name}: with `schemas`, the name must hold `{{schema}}` (one outbox \
                 per schema), e.g. \"{{schema}}\" or \"tenants.{{schema}}\""
            )));
        }
        if !names.insert(name.clone()) {
            return Err(Error::invalid_input(format!(
                "two [[outbox]] tables are named {name:?}; names must be unique"
            )));
        }
        let store = pick(
            file.store.clone(),
            file.store_file.as_deref(),
            "store",
            "store_file",
        )?
        .or_else(|| base.store.clone())
        .ok_or_else(|| {
            Error::invalid_input(format!(
                "[[outbox]] {name} has no store: give `store` (or `store_file`) in it or at the \
                 top level"
            ))
        })?;
        let broker = pick(
            file.broker.clone(),
            file.broker_file.as_deref(),
            "broker",
            "broker_file",
        )?
        .or_else(|| base.broker.clone())
        .ok_or_else(|| {
            Error::invalid_input(format!(
                "[[outbox]] {name} has no broker: give `broker` (or `broker_file`) in it or at \
                 the top level"
            ))
        })?;
        let b = base.relay()?;
        let relay = b
            .to_builder()
            .batch_size(file.batch_size.or(b.batch_size()))
            .concurrency(file.concurrency.unwrap_or(b.concurrency()))
            .claim_shards(file.claim_shards.or(b.claim_shards()))
            .lease(duration(&name, "lease", file.lease)?.unwrap_or(b.lease()))
            .max_attempts(file.max_attempts.unwrap_or(b.max_attempts()))
            .head_policy(match file.head_policy {
                Some(Head::Block) => HeadPolicy::Block,
                Some(Head::Skip) => HeadPolicy::Skip,
                None => b.head_policy(),
            })
            .poll_max(match duration(&name, "poll_max", file.poll_max)? {
                Some(given) => given,
                // Woken by the database's LISTEN connection: polling is only the fallback, and
                // a hundred outboxes polling ten times a second would keep a database busy
                // doing nothing.
                None if is_postgres(&store)
                    && b.poll_max() == RelayConfig::default().poll_max() =>
                {
                    PG_POLL_MAX
                }
                None => b.poll_max(),
            })
            .shutdown_deadline(
                duration(&name, "shutdown_deadline", file.shutdown_deadline)?
                    .unwrap_or(b.shutdown_deadline()),
            )
            .build()
            .map_err(|e| Error::invalid_input(format!("[[outbox]] {name}: {e}")))?;
        let spec = OutboxSpec {
            name: name.clone(),
            store,
            options: StoreOptions {
                table: file.table.or_else(|| base.options.table.clone()),
                schema: file.schema.clone(),
                delete_published: file
                    .delete_published
                    .unwrap_or(base.options.delete_published),
            },
            schemas: file.schemas.clone(),
            broker,
            relay,
        };
        if let Some(pattern) = &spec.schemas {
            if file.schema.is_some() {
                return Err(Error::invalid_input(format!(
                    "[[outbox]] {name}: give `schema` (one schema) or `schemas` (a pattern), \
                     not both"
                )));
            }
            if !spec.is_postgres() {
                return Err(Error::invalid_input(format!(
                    "[[outbox]] {name}: `schemas` = {pattern:?} needs a postgres:// store; \
                     MariaDB and SQLite have no schemas"
                )));
            }
            if pattern.is_empty() {
                return Err(Error::invalid_input(format!(
                    "[[outbox]] {name}: `schemas` is empty; write a pattern such as \"tenant_*\""
                )));
            }
        }
        specs.push(spec);
    }
    Ok(specs)
}

/// A schema pattern (`*` any text, `?` one character) as a `LIKE` pattern.
pub fn like_pattern(glob: &str) -> String {
    let mut like = String::with_capacity(glob.len() + 4);
    for c in glob.chars() {
        match c {
            '*' => like.push('%'),
            '?' => like.push('_'),
            '%' | '_' | '\\' => {
                like.push('\\');
                like.push(c);
            }
            c => like.push(c),
        }
    }
    like
}

/// The configured outboxes as TOML tables for `outbox-relay config`, secrets masked.
pub fn masked_tables(specs: &[OutboxSpec]) -> String {
    let mut out = String::new();
    for spec in specs {
        let mut table = toml::Table::new();
        table.insert("name".into(), spec.name.clone().into());
        table.insert("store".into(), mask_url(&spec.store).into());
        if let Some(schema) = &spec.options.schema {
            table.insert("schema".into(), schema.clone().into());
        }
        if let Some(schemas) = &spec.schemas {
            table.insert("schemas".into(), schemas.clone().into());
        }
        if let Some(t) = &spec.options.table {
            table.insert("table".into(), t.clone().into());
        }
        table.insert("broker".into(), mask_url(&spec.broker).into());
        let r = &spec.relay;
        if let Some(batch) = r.batch_size() {
            table.insert(
                "batch_size".into(),
                i64::try_from(batch).unwrap_or(i64::MAX).into(),
            );
        }
        table.insert(
            "concurrency".into(),
            i64::try_from(r.concurrency()).unwrap_or(i64::MAX).into(),
        );
        table.insert(
            "poll_max".into(),
            humantime::format_duration(r.poll_max()).to_string().into(),
        );
        out += "\n[[outbox]]\n";
        out += &toml::to_string(&table).unwrap_or_default();
    }
    out
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What one outbox's relay is working with, for readiness, gauges and purges.
#[derive(Default)]
struct SlotState {
    admin: Option<Arc<dyn OutboxAdmin>>,
    publisher: Option<Arc<dyn Publisher>>,
    /// Why it is not running, while it is not.
    error: Option<String>,
}

struct Slot {
    /// Which `[[outbox]]` table it came from, and its schema for a pattern's.
    origin: usize,
    /// Its relay's stop signal and task; `None` for an outbox of a drain, whose task the drain
    /// owns.
    run: Option<(watch::Sender<bool>, JoinHandle<RelayStats>)>,
    state: Arc<Mutex<SlotState>>,
}

/// The outboxes a process serves, by name.
#[derive(Clone, Default)]
pub struct Fleet {
    slots: Arc<Mutex<BTreeMap<String, Slot>>>,
}

/// One outbox's view for a probe: its admin, publisher and error, if any.
type View = (
    String,
    Option<Arc<dyn OutboxAdmin>>,
    Option<Arc<dyn Publisher>>,
    Option<String>,
);

impl Fleet {
    fn views(&self) -> Vec<View> {
        lock(&self.slots)
            .iter()
            .map(|(name, slot)| {
                let state = lock(&slot.state);
                (
                    name.clone(),
                    state.admin.clone(),
                    state.publisher.clone(),
                    state.error.clone(),
                )
            })
            .collect()
    }

    fn contains(&self, name: &str) -> bool {
        lock(&self.slots).contains_key(name)
    }

    /// Readiness of every outbox: `(all ok, any ok, body)`.
    pub async fn ready(&self, timeout: Duration) -> (bool, bool, Value) {
        let views = self.views();
        let checks = views
            .into_iter()
            .map(|(name, admin, publisher, error)| async move {
                let missing = |what: &str| {
                    Err(error
                        .clone()
                        .unwrap_or_else(|| format!("{what} not open yet")))
                };
                let (store, broker) = match (admin, publisher) {
                    (Some(admin), Some(publisher)) => {
                        tokio::join!(
                            crate::http::bounded("store", timeout, admin.ping()),
                            crate::http::bounded("broker", timeout, publisher.check()),
                        )
                    }
                    (Some(admin), None) => (
                        crate::http::bounded("store", timeout, admin.ping()).await,
                        missing("broker"),
                    ),
                    (None, _) => (missing("store"), missing("broker")),
                };
                (name, store, broker)
            });
        let results = futures::future::join_all(checks).await;
        let show = |r: &Result<(), String>| match r {
            Ok(()) => json!("ok"),
            Err(e) => json!(e),
        };
        let mut all = !results.is_empty();
        let mut any = false;
        let mut outboxes = serde_json::Map::new();
        for (name, store, broker) in &results {
            let ok = store.is_ok() && broker.is_ok();
            all &= ok;
            any |= ok;
            outboxes.insert(
                name.clone(),
                json!({"status": if ok { "ready" } else { "not ready" },
                       "store": show(store), "broker": show(broker)}),
            );
        }
        let status = if all {
            "ready"
        } else if any {
            "degraded"
        } else {
            "not ready"
        };
        (
            all,
            any,
            json!({"status": status, "outboxes": Value::Object(outboxes)}),
        )
    }

    /// Refresh every outbox's store gauges and up gauges, all at once, each within `timeout`.
    pub async fn gauges(&self, timeout: Duration) {
        let views = self.views();
        let each = views
            .into_iter()
            .map(|(name, admin, publisher, _)| async move {
                let store_up = match &admin {
                    Some(admin) => match tokio::time::timeout(timeout * 5, admin.status(0)).await {
                        Ok(Ok(status)) => {
                            outbox::relay::record_status_for(&name, &status);
                            true
                        }
                        _ => false,
                    },
                    None => false,
                };
                let broker_up = match &publisher {
                    Some(p) => matches!(tokio::time::timeout(timeout, p.check()).await, Ok(Ok(()))),
                    None => false,
                };
                outbox::relay::record_up_for(&name, broker_up, store_up);
            });
        futures::future::join_all(each).await;
    }

    /// Purge every outbox's published messages older than `age`, one outbox after another.
    async fn purge(&self, age: Duration) {
        for (name, admin, _, _) in self.views() {
            let Some(admin) = admin else { continue };
            match crate::ops::purge_all(admin.as_ref(), age, crate::PURGE_BATCH, None).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(target: TARGET, outbox = %name, purged = n,
                                        "purged published messages"),
                Err(e) => tracing::warn!(target: TARGET, outbox = %name,
                                         error = %redact_url(&e.to_string()),
                                         "purge failed; retrying at the next interval"),
            }
        }
    }

    /// Stop the outbox `name` and wait for its relay to finish.
    async fn stop(&self, name: &str) -> Option<RelayStats> {
        let (stop, task) = lock(&self.slots).remove(name)?.run?;
        let _ = stop.send(true);
        task.await.ok()
    }

    /// Stop every outbox at once and wait for them: their stats by name.
    async fn stop_all(&self) -> BTreeMap<String, RelayStats> {
        let slots = std::mem::take(&mut *lock(&self.slots));
        let runs: Vec<(String, JoinHandle<RelayStats>)> = slots
            .into_iter()
            .filter_map(|(name, slot)| {
                let (stop, task) = slot.run?;
                let _ = stop.send(true);
                Some((name, task))
            })
            .collect();
        let mut stats = BTreeMap::new();
        for (name, task) in runs {
            stats.insert(name, task.await.unwrap_or_default());
        }
        stats
    }

    /// Track the outbox `name` of a drain, for readiness and the gauges: the state its drain
    /// task keeps up to date.
    fn track(&self, name: String) -> Arc<Mutex<SlotState>> {
        let state = Arc::new(Mutex::new(SlotState::default()));
        lock(&self.slots).insert(
            name,
            Slot {
                origin: usize::MAX,
                run: None,
                state: state.clone(),
            },
        );
        state
    }
}

/// A broker connection several outboxes publish through.
type SharedPublisher = Arc<dyn Publisher>;

/// Shared connections: one Postgres pool (and `LISTEN` connection) per store URL, one broker
/// connection per broker URL. Each is made on first use, by the outbox that needs it; a failure
/// is that outbox's alone (the next one to need the URL tries again).
struct Shared {
    migrate: bool,
    #[cfg(feature = "postgres")]
    pools: Mutex<HashMap<String, Arc<OnceCell<pg::PgShared>>>>,
    brokers: Mutex<HashMap<String, Arc<OnceCell<SharedPublisher>>>>,
}

impl Shared {
    fn new(migrate: bool) -> Self {
        Self {
            migrate,
            #[cfg(feature = "postgres")]
            pools: Mutex::new(HashMap::new()),
            brokers: Mutex::new(HashMap::new()),
        }
    }

    async fn broker(&self, url: &str) -> Result<Arc<dyn Publisher>, Error> {
        let cell = lock(&self.brokers)
            .entry(url.to_owned())
            .or_default()
            .clone();
        cell.get_or_try_init(|| async {
            Ok::<_, Error>(Arc::from(outbox::broker::connect(url).await?))
        })
        .await
        .cloned()
    }

    #[cfg(feature = "postgres")]
    async fn pg(&self, url: &str) -> Result<pg::PgShared, Error> {
        let cell = lock(&self.pools).entry(url.to_owned()).or_default().clone();
        cell.get_or_try_init(|| pg::PgShared::connect(url))
            .await
            .cloned()
    }

    /// Open the outbox of `spec` (in `schema`, for a pattern's): its relay view and its admin.
    async fn open(
        &self,
        spec: &OutboxSpec,
        schema: Option<&str>,
    ) -> Result<(Arc<dyn OutboxStore>, Arc<dyn OutboxAdmin>), Error> {
        let mut options = spec.options.clone();
        if let Some(schema) = schema {
            options.schema = Some(schema.to_owned());
        }
        #[cfg(feature = "postgres")]
        if spec.is_postgres() {
            let shared = self.pg(&spec.store).await?;
            return shared.open(&options, self.migrate).await;
        }
        let opened = outbox::store::open(&spec.store, &options).await?;
        if self.migrate {
            opened.migrate().await?;
        }
        Ok((opened.store, opened.admin))
    }

    /// The schemas matching `spec`'s pattern, each with whether it has the table.
    async fn schemas(&self, spec: &OutboxSpec) -> Result<Vec<(String, bool)>, Error> {
        #[cfg(feature = "postgres")]
        {
            let shared = self.pg(&spec.store).await?;
            let pattern = spec.schemas.as_deref().unwrap_or("");
            let table = spec.options.table.as_deref().unwrap_or("outbox");
            shared.schemas(&like_pattern(pattern), table).await
        }
        #[cfg(not(feature = "postgres"))]
        {
            let _ = spec;
            Err(Error::invalid_input(
                "schema patterns need the `postgres` feature",
            ))
        }
    }
}

/// Run one outbox until `stop`: open its store and broker, run its relay; after a failure,
/// wait (1 s doubling to 1 min) and start again, logging each new error once.
async fn supervise(
    shared: Arc<Shared>,
    name: String,
    spec: Arc<OutboxSpec>,
    schema: Option<String>,
    state: Arc<Mutex<SlotState>>,
    mut stop: watch::Receiver<bool>,
) -> RelayStats {
    let mut total = RelayStats::default();
    let mut wait = Duration::from_secs(1);
    let mut last_error: Option<String> = None;
    loop {
        if *stop.borrow() {
            break;
        }
        let started = Instant::now();
        let run = async {
            let (store, admin) = shared.open(&spec, schema.as_deref()).await?;
            lock(&state).admin = Some(admin);
            let broker_url = spec.broker_for(&name, schema.as_deref());
            let publisher = shared.broker(&broker_url).await?;
            lock(&state).publisher = Some(publisher.clone());
            let relay = Relay::new(store, publisher, spec.relay.clone())?.for_outbox(name.clone());
            let tuning = relay.tuning();
            tracing::info!(
                target: TARGET,
                outbox = %name,
                broker = %mask_url(&broker_url),
                batch_size = tuning.batch_size,
                claim_shards = tuning.claim_shards,
                "outbox relay started"
            );
            lock(&state).error = None;
            let mut until = stop.clone();
            relay
                .run(async move {
                    let _ = until.wait_for(|stopped| *stopped).await;
                })
                .await
        };
        match run.await {
            Ok(stats) => {
                total += stats;
                break;
            }
            Err(e) => {
                let text = redact_url(&e.to_string());
                if started.elapsed() > Duration::from_secs(60) {
                    wait = Duration::from_secs(1);
                }
                if last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(target: TARGET, outbox = %name, error = %text,
                                   retry_in = ?wait,
                                   "outbox stopped; the other outboxes go on; retrying");
                } else {
                    tracing::debug!(target: TARGET, outbox = %name, error = %text,
                                    retry_in = ?wait, "outbox still failing");
                }
                lock(&state).error = Some(text.clone());
                last_error = Some(text);
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    _ = stop.wait_for(|stopped| *stopped) => break,
                }
                wait = (wait * 2).min(Duration::from_secs(60));
            }
        }
    }
    total
}

impl Fleet {
    fn start(
        &self,
        shared: &Arc<Shared>,
        origin: usize,
        spec: &Arc<OutboxSpec>,
        schema: Option<String>,
    ) {
        let name = spec.name_for(schema.as_deref());
        let mut slots = lock(&self.slots);
        if slots.contains_key(&name) {
            return;
        }
        let (stop, rx) = watch::channel(false);
        let state = Arc::new(Mutex::new(SlotState::default()));
        let task = tokio::spawn(supervise(
            shared.clone(),
            name.clone(),
            spec.clone(),
            schema,
            state.clone(),
            rx,
        ));
        slots.insert(
            name,
            Slot {
                origin,
                run: Some((stop, task)),
                state,
            },
        );
    }

    /// The names of the outboxes that came from `[[outbox]]` table `origin`.
    fn named_by(&self, origin: usize) -> Vec<String> {
        lock(&self.slots)
            .iter()
            .filter(|(_, slot)| slot.origin == origin)
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// Look up `spec`'s schema pattern every `every` (first at once): start an outbox for each new
/// schema with the table, stop those whose schema or table is gone; a matching schema without
/// the table is logged once and skipped.
async fn discover(
    shared: Arc<Shared>,
    fleet: Fleet,
    origin: usize,
    spec: Arc<OutboxSpec>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut skipped = HashSet::new();
    let mut clashes = HashSet::new();
    let mut last_error: Option<String> = None;
    let table = spec
        .options
        .table
        .clone()
        .unwrap_or_else(|| "outbox".into());
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        let found = match shared.schemas(&spec).await {
            Ok(found) => {
                last_error = None;
                found
            }
            Err(e) => {
                let text = redact_url(&e.to_string());
                if last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(target: TARGET, pattern = spec.schemas.as_deref().unwrap_or(""),
                                   error = %text, "schema discovery failed; retrying");
                }
                last_error = Some(text);
                continue;
            }
        };
        let mut live = HashSet::new();
        for (schema, has_table) in found {
            let name = spec.name_for(Some(&schema));
            if !has_table {
                if skipped.insert(schema.clone()) {
                    tracing::info!(target: TARGET, schema = %schema, table = %table,
                                   "schema matches but has no outbox table; skipped until it has one");
                }
                continue;
            }
            skipped.remove(&schema);
            let mine = fleet.named_by(origin).contains(&name);
            if !mine && fleet.contains(&name) {
                if clashes.insert(name.clone()) {
                    tracing::warn!(target: TARGET, outbox = %name, schema = %schema,
                                   "another outbox has this name; schema skipped");
                }
                continue;
            }
            live.insert(name);
            if !mine {
                tracing::info!(target: TARGET, schema = %schema, "new schema found");
                fleet.start(&shared, origin, &spec, Some(schema));
            }
        }
        for name in fleet.named_by(origin) {
            if !live.contains(&name) {
                tracing::info!(target: TARGET, outbox = %name,
                               "schema or table gone; stopping its relay");
                fleet.stop(&name).await;
            }
        }
    }
}

/// `outbox-relay run` over the configured outboxes, until `stop` resolves.
pub async fn run(
    effective: &Effective,
    migrate: bool,
    stop: impl Future<Output = ()>,
) -> Result<(), Error> {
    effective.check_relay()?;
    let shared = Arc::new(Shared::new(migrate));
    let fleet = Fleet::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = serve_metrics(effective, &fleet).await?;
    if let Some(age) = effective.purge_older_than {
        let fleet = fleet.clone();
        let every = effective.purge_every;
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                fleet.purge(age).await;
            }
        }));
    }
    let mut discoveries = Vec::new();
    for (origin, spec) in effective.outboxes.iter().enumerate() {
        let spec = Arc::new(spec.clone());
        if spec.schemas.is_some() {
            discoveries.push(tokio::spawn(discover(
                shared.clone(),
                fleet.clone(),
                origin,
                spec,
                effective.discover_every,
                stop_rx.clone(),
            )));
        } else {
            fleet.start(&shared, origin, &spec, None);
        }
    }
    tracing::info!(
        target: TARGET,
        outboxes = effective.outboxes.len(),
        patterns = discoveries.len(),
        "relay started over several outboxes"
    );
    stop.await;
    let _ = stop_tx.send(true);
    for task in discoveries {
        let _ = task.await;
    }
    let stats = fleet.stop_all().await;
    for task in &tasks {
        task.abort();
    }
    let mut total = RelayStats::default();
    for s in stats.values() {
        total += *s;
    }
    eprintln!("{}", json!({"outboxes": stats, "total": total}));
    Ok(())
}

/// With a metrics address: install the exporter, serve `/metrics` and the health endpoints of
/// `fleet` there, and refresh its gauges every `gauges_every`. The tasks, to abort at the end.
async fn serve_metrics(effective: &Effective, fleet: &Fleet) -> Result<Vec<JoinHandle<()>>, Error> {
    let Some(addr) = effective.metrics_addr else {
        return Ok(Vec::new());
    };
    let handle = crate::metrics_recorder()?;
    let heartbeat =
        crate::http::Heartbeat::new(effective.gauges_every * 3 + effective.ready_timeout);
    heartbeat.beat();
    let probe = crate::http::Probe {
        ready: crate::http::Ready::Many(fleet.clone()),
        timeout: effective.ready_timeout,
        metrics: handle,
        heartbeat,
    };
    let server = crate::http::serve(addr, probe.clone()).await?;
    let (every, fleet) = (effective.gauges_every, fleet.clone());
    let gauges = tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            probe.heartbeat.beat();
            probe.metrics.run_upkeep();
            fleet.gauges(probe.timeout).await;
        }
    });
    Ok(vec![server, gauges])
}

/// One outbox to work on: its name, its `[[outbox]]` table, and its schema for a pattern's.
type Target = (String, Arc<OutboxSpec>, Option<String>);

/// The configured outboxes as they are now: every plain `[[outbox]]`, and each schema a
/// pattern matches that has the table (looked up once). A pattern whose lookup failed is in
/// the errors, by its name; a schema whose outbox name another outbox already has is skipped.
async fn targets(
    shared: &Shared,
    effective: &Effective,
) -> (Vec<Target>, BTreeMap<String, String>) {
    let mut targets: Vec<Target> = Vec::new();
    let mut errors = BTreeMap::new();
    let specs: Vec<Arc<OutboxSpec>> = effective.outboxes.iter().cloned().map(Arc::new).collect();
    let mut names: HashSet<String> = specs
        .iter()
        .filter(|spec| spec.schemas.is_none())
        .map(|spec| spec.name.clone())
        .collect();
    for spec in specs {
        if spec.schemas.is_none() {
            targets.push((spec.name.clone(), spec, None));
            continue;
        }
        match shared.schemas(&spec).await {
            Ok(found) => {
                for (schema, _) in found.into_iter().filter(|(_, has_table)| *has_table) {
                    let name = spec.name_for(Some(&schema));
                    if names.insert(name.clone()) {
                        targets.push((name, spec.clone(), Some(schema)));
                    } else {
                        tracing::warn!(target: TARGET, outbox = %name, schema = %schema,
                                       "another outbox has this name; schema skipped");
                    }
                }
            }
            Err(e) => {
                let pattern = spec.schemas.as_deref().unwrap_or_default();
                errors.insert(
                    format!("{} ({pattern})", spec.name),
                    redact_url(&e.to_string()),
                );
            }
        }
    }
    (targets, errors)
}

/// Drain one outbox: open its store and broker (recorded in `state`, for readiness and the
/// gauges), relay until nothing is left to claim (as the single-outbox `drain` does, waiting for
/// what other relays hold) or `stop`, then purge once if asked. Its stats, or the error that
/// stopped it (also recorded in `state`).
async fn drain_one(
    shared: Arc<Shared>,
    (name, spec, schema): Target,
    purge: Option<Duration>,
    state: Arc<Mutex<SlotState>>,
    mut stop: watch::Receiver<bool>,
) -> Result<RelayStats, Error> {
    let result = async {
        let (store, admin) = shared.open(&spec, schema.as_deref()).await?;
        lock(&state).admin = Some(admin.clone());
        let broker_url = spec.broker_for(&name, schema.as_deref());
        let publisher = shared.broker(&broker_url).await?;
        lock(&state).publisher = Some(publisher.clone());
        let relay = Relay::new(store, publisher, spec.relay.clone())?.for_outbox(name.clone());
        tracing::info!(target: TARGET, outbox = %name, broker = %mask_url(&broker_url),
                       "outbox drain started");
        // As the single-outbox drain: rows a claim dead-letters because they do not decode
        // never reach the relay's counters (the backlog query: cheaper than the status).
        let start = admin.backlog().await.ok();
        let mut stats = relay
            .run_until_drained_or(admin.as_ref(), async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            })
            .await?;
        if let Some(start) = &start {
            crate::ops::count_quarantined(admin.as_ref(), start, &mut stats).await;
        }
        if let Some(age) = purge {
            let n = crate::ops::purge_all(admin.as_ref(), age, crate::PURGE_BATCH, None).await?;
            tracing::info!(target: TARGET, outbox = %name, purged = n,
                           "purged published messages");
        }
        tracing::info!(target: TARGET, outbox = %name, published = stats.published,
                       dead = stats.dead, "outbox drained");
        Ok::<_, Error>(stats)
    }
    .await;
    if let Err(e) = &result {
        lock(&state).error = Some(redact_url(&e.to_string()));
    }
    result
}

/// `outbox-relay drain` over the configured outboxes: each drained by its own relay, all at
/// once, until nothing is left that they could claim (a pattern's schemas are looked up once,
/// at the start). An outbox that fails (its database, table or broker) stops alone; the others
/// drain on. The summary, each outbox's stats, the total and the failures, goes to standard
/// error; the result is an error naming every outbox that failed.
pub async fn drain(
    effective: &Effective,
    migrate: bool,
    stop: impl Future<Output = ()>,
) -> Result<(), Error> {
    effective.check_relay()?;
    let shared = Arc::new(Shared::new(migrate));
    let fleet = Fleet::default();
    // Before the relays are made: they register their metrics' descriptions with it.
    let serving = serve_metrics(effective, &fleet).await?;
    let (targets, mut failed) = targets(&shared, effective).await;
    let (stop_tx, stop_rx) = watch::channel(false);
    let tasks: Vec<(String, JoinHandle<Result<RelayStats, Error>>)> = targets
        .into_iter()
        .map(|target| {
            let name = target.0.clone();
            let task = tokio::spawn(drain_one(
                shared.clone(),
                target,
                effective.purge_older_than,
                fleet.track(name.clone()),
                stop_rx.clone(),
            ));
            (name, task)
        })
        .collect();
    let count = tasks.len() + failed.len();
    tracing::info!(target: TARGET, outboxes = count, "draining several outboxes");
    let all = futures::future::join_all(tasks.into_iter().map(|(name, task)| async move {
        let result = task.await.unwrap_or_else(|e| {
            Err(Error::permanent(
                format!("its relay task ended abnormally: {e}"),
                None,
            ))
        });
        (name, result)
    }));
    tokio::pin!(all);
    let results = tokio::select! {
        results = &mut all => results,
        () = stop => {
            let _ = stop_tx.send(true);
            all.await
        }
    };
    for task in &serving {
        task.abort();
    }
    let mut stats = BTreeMap::new();
    let mut total = RelayStats::default();
    for (name, result) in results {
        match result {
            Ok(s) => {
                total += s;
                stats.insert(name, s);
            }
            Err(e) => {
                let text = redact_url(&e.to_string());
                tracing::warn!(target: TARGET, outbox = %name, error = %text,
                               "outbox drain failed; the other outboxes go on");
                failed.insert(name, text);
            }
        }
    }
    eprintln!(
        "{}",
        json!({"outboxes": stats, "total": total, "failed": failed})
    );
    if failed.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = failed
        .iter()
        .map(|(name, e)| format!("{name}: {e}"))
        .collect();
    Err(Error::permanent(
        format!(
            "{} of {count} outboxes failed to drain: {}",
            failed.len(),
            list.join("; ")
        ),
        None,
    ))
}

/// `outbox-relay status` over the configured outboxes: one row each (patterns looked up once)
/// and the total.
pub async fn status(effective: &Effective, as_json: bool) -> Result<(), Error> {
    let shared = Arc::new(Shared::new(false));
    let (targets, mut errors) = targets(&shared, effective).await;
    let each = targets.into_iter().map(|(name, spec, schema)| {
        let shared = shared.clone();
        async move {
            let status = async {
                let (_, admin) = shared.open(&spec, schema.as_deref()).await?;
                admin.status(0).await
            }
            .await;
            (name, status)
        }
    });
    let results = futures::future::join_all(each).await;
    let mut total = outbox::StoreStatus::default();
    let mut rows = Vec::new();
    let mut outboxes = serde_json::Map::new();
    for (name, status) in results {
        match status {
            Ok(s) => {
                total.pending += s.pending;
                total.leased += s.leased;
                total.dead += s.dead;
                total.oldest_pending_age_seconds = match (
                    total.oldest_pending_age_seconds,
                    s.oldest_pending_age_seconds,
                ) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
                if let Some(n) = s.published_last_minute {
                    total.published_last_minute =
                        Some(total.published_last_minute.unwrap_or(0) + n);
                }
                rows.push(vec![
                    name.clone(),
                    s.pending.to_string(),
                    s.leased.to_string(),
                    s.dead.to_string(),
                    s.published_last_minute
                        .map(|n| format!("{:.1}", n as f64 / 60.0))
                        .unwrap_or_else(|| "-".into()),
                    String::new(),
                ]);
                outboxes.insert(name, json!(s));
            }
            Err(e) => {
                errors.insert(name, redact_url(&e.to_string()));
            }
        }
    }
    for (name, error) in &errors {
        rows.push(vec![
            name.clone(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            error.clone(),
        ]);
        outboxes.insert(name.clone(), json!({"error": error}));
    }
    if as_json {
        crate::ops::print(&json!({"outboxes": Value::Object(outboxes), "total": total,
                                  "unreachable": errors.len()}));
    } else {
        rows.push(vec![
            "TOTAL".into(),
            total.pending.to_string(),
            total.leased.to_string(),
            total.dead.to_string(),
            total
                .published_last_minute
                .map(|n| format!("{:.1}", n as f64 / 60.0))
                .unwrap_or_else(|| "-".into()),
            if errors.is_empty() {
                String::new()
            } else {
                format!("{} unreachable", errors.len())
            },
        ]);
        crate::ops::table(
            &["OUTBOX", "PENDING", "LEASED", "DEAD", "MSG/S", "ERROR"],
            &rows,
        );
    }
    Ok(())
}

#[cfg(feature = "postgres")]
mod pg;

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration example of the README's "Many outboxes" section is one this program
    /// accepts, and means what the section says.
    #[test]
    fn the_readme_example_configuration_parses() -> Result<(), Box<dyn std::error::Error>> {
        let readme = include_str!("../../README.md");
        let section = readme
            .split("### Many outboxes")
            .nth(1)
            .ok_or("no Many outboxes section")?;
        let example = section
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .ok_or("no toml example")?;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, example)?;
        let effective = crate::settings::SettingsArgs {
            config: Some(path),
            ..Default::default()
        }
        .resolve()?;
        let names: Vec<&str> = effective.outboxes.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["billing", "{schema}", "edge"]);
        let [billing, tenants, edge] = &effective.outboxes[..] else {
            return Err("three outboxes".into());
        };
        assert_eq!(billing.relay.batch_size(), Some(500), "top-level default");
        assert_eq!(billing.options.schema.as_deref(), Some("billing"));
        assert_eq!(billing.relay.poll_max(), PG_POLL_MAX);
        assert!(billing.broker.contains("{outbox}"));
        assert_eq!(tenants.schemas.as_deref(), Some("tenant_*"));
        assert_eq!(
            tenants.broker_for("tenant_acme", Some("tenant_acme")),
            "nats://127.0.0.1:4222?subject=tenants.tenant_acme.{event_type}&stream=TENANTS"
        );
        assert_eq!(edge.relay.concurrency(), 1);
        assert_eq!(edge.relay.poll_max(), Duration::from_millis(50));
        assert!(edge.broker.starts_with("redis://"));
        Ok(())
    }

    #[test]
    fn bad_outbox_tables_are_refused_before_anything_opens(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        for (text, expected) in [
            ("[[outbox]]\nstore = \"sqlite://a.db\"\nbroker = \"stdout://\"\n", "no `name`"),
            (
                "broker = \"stdout://\"\n[[outbox]]\nname = \"a\"\nstore = \"sqlite://a.db\"\n\
                 [[outbox]]\nname = \"a\"\nstore = \"sqlite://b.db\"\n",
                "unique",
            ),
            (
                "[[outbox]]\nstore = \"sqlite://a.db\"\nschemas = \"t_*\"\nbroker = \"stdout://\"\n",
                "needs a postgres",
            ),
            ("[[outbox]]\nname = \"a\"\nstore = \"sqlite://a.db\"\n", "no broker"),
            (
                "[[outbox]]\nname = \"a b\"\nstore = \"sqlite://a.db\"\nbroker = \"stdout://\"\n",
                "not valid",
            ),
            (
                "[[outbox]]\nname = \"a\"\nstore = \"sqlite://a.db\"\nbroker = \"stdout://\"\nlease = \"soon\"\n",
                "not a duration",
            ),
        ] {
            let path = dir.path().join("bad.toml");
            std::fs::write(&path, text)?;
            let err = crate::settings::SettingsArgs {
                config: Some(path),
                ..Default::default()
            }
            .resolve()
            .err()
            .ok_or(format!("accepted: {text}"))?;
            assert!(err.to_string().contains(expected), "{text}: {err}");
        }
        Ok(())
    }

    #[test]
    fn schema_patterns_become_like_patterns() {
        assert_eq!(like_pattern("tenant_*"), "tenant\\_%");
        assert_eq!(like_pattern("t?%"), "t_\\%");
    }
}
