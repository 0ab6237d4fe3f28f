//! `crash-relay`: the outbox relay, or a producer, as an OS process of its own, with failpoints
//! where the crash tests (`tests/crash_process.rs`) kill it with SIGKILL or stop it with SIGSTOP.
//!
//! Settings come from the environment and the output is a few fixed lines; both are described
//! in `outbox_e2e::crash`. The relay is the real engine over the real store and publisher; thin
//! wrappers around both mark the failpoints:
//!
//! | point | where |
//! |---|---|
//! | F1 | a claim returned a batch, nothing of it published yet |
//! | F2 | the broker stored the first half of the batch, the rest not sent |
//! | F3 | the broker acknowledged the whole batch, the store not told |
//! | F4a | the store's `complete` of the batch was started, not awaited: the kill lands before or after the database commits it |
//! | F4 | the store marked the batch published |
//! | F6 | the publish of the batch is held after the broker stored it, and the engine extended the lease at half-time (fires once that `extend` returned) |
//! | F7 | the store's `fail` that dead-letters the poison message ([`crash::POISON`]) returned |
//! | F9a | producer: business row and outbox rows written, COMMIT not sent |
//! | F9b | producer: COMMIT returned |
//!
//! F10 (recovery killed at its first claim) needs no point of its own: it is `F1:1` in the
//! relay that recovers after an earlier crash.
//!
//! The relay keeps one batch in flight, so at a failpoint exactly one batch is in an unfinished
//! state and the tests can say which messages may be delivered twice. Once a failpoint parks,
//! every later store or broker call of the process parks too, before it starts or before it
//! returns: nothing after the failpoint happens, not even a lease extension, until the harness
//! kills the process. The one exception is F4a's `complete`, which was started before the park
//! and runs on until it ends or the kill stops it.

use std::future::pending;
use std::io::{Read, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox::chrono::{DateTime, Utc};
use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::relay::{Relay, RelayConfig};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::uuid::Uuid;
use outbox::{
    async_trait, attempt_in_key_order, Capabilities, Claim, ClaimRequest, Error, FailAction,
    Failure, HeadPolicy, LeaseToken, Message, NewMessage, OutboxStore, PublishOutcome, Publisher,
    WakeSource,
};
use outbox_e2e::crash;
use rusqlite::TransactionBehavior;
use sqlx::postgres::PgPoolOptions;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    F1,
    F2,
    F3,
    F4a,
    F4,
    F6,
    F7,
    F9a,
    F9b,
}

impl Point {
    const ALL: [Point; 9] = [
        Point::F1,
        Point::F2,
        Point::F3,
        Point::F4a,
        Point::F4,
        Point::F6,
        Point::F7,
        Point::F9a,
        Point::F9b,
    ];

    fn name(self) -> &'static str {
        match self {
            Point::F1 => "F1",
            Point::F2 => "F2",
            Point::F3 => "F3",
            Point::F4a => "F4a",
            Point::F4 => "F4",
            Point::F6 => "F6",
            Point::F7 => "F7",
            Point::F9a => "F9a",
            Point::F9b => "F9b",
        }
    }

    fn of_producer(self) -> bool {
        matches!(self, Point::F9a | Point::F9b)
    }
}

/// What the process does once it reaches the failpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// Stop there for good; the harness kills the process.
    Park,
    /// Wait for one byte on standard input, then go on (the zombie case: the harness stops the
    /// process, lets another relay take its messages over, then resumes it).
    Wait,
}

#[derive(Debug, Clone, Copy)]
struct Armed {
    point: Point,
    /// Which pass triggers it, from 1.
    hit: u32,
    action: Action,
}

/// The configured failpoint, how often it has been passed, and whether the process is parked.
#[derive(Debug, Default)]
struct Failpoints {
    armed: Option<Armed>,
    passed: AtomicU32,
    parked: AtomicBool,
    /// F6: publishes started so far, and whether the chosen one is being held (until the
    /// extension that fires F6).
    publishes: AtomicU32,
    holding: AtomicBool,
}

impl Failpoints {
    fn from_env() -> Result<Self, String> {
        let Some(spec) = optional_env(crash::FAILPOINT) else {
            return Ok(Self::default());
        };
        let (name, hit) = match spec.split_once(':') {
            Some((name, hit)) => (
                name,
                hit.parse::<u32>().ok().filter(|h| *h > 0).ok_or_else(|| {
                    format!(
                        "{}={spec:?}: the hit count must be a number from 1",
                        crash::FAILPOINT
                    )
                })?,
            ),
            None => (spec.as_str(), 1),
        };
        let point = Point::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                let names: Vec<_> = Point::ALL.iter().map(|p| p.name()).collect();
                format!(
                    "{}={spec:?}: unknown failpoint; use one of {names:?}, optionally with :N for the Nth pass",
                    crash::FAILPOINT
                )
            })?;
        let action = match optional_env(crash::FAILPOINT_ACTION).as_deref() {
            None | Some("park") => Action::Park,
            Some("wait") => Action::Wait,
            Some(other) => {
                return Err(format!(
                    "{}={other:?}: use `park` or `wait`",
                    crash::FAILPOINT_ACTION
                ))
            }
        };
        if action == Action::Wait && matches!(point, Point::F4a | Point::F6) {
            return Err(format!(
                "{}=wait: {} can only park",
                crash::FAILPOINT_ACTION,
                point.name()
            ));
        }
        Ok(Self {
            armed: Some(Armed { point, hit, action }),
            ..Self::default()
        })
    }

    /// Refuse a failpoint the mode never passes: a test that asks for it would otherwise pass
    /// without ever crashing.
    fn check_mode(&self, producer: bool) -> Result<(), String> {
        match self.armed {
            Some(a) if a.point.of_producer() != producer => Err(format!(
                "failpoint {} is not passed in {} mode",
                a.point.name(),
                if producer { "produce" } else { "relay" }
            )),
            _ => Ok(()),
        }
    }

    /// Count a pass of `point`; whether this pass triggers the failpoint.
    fn triggers(&self, point: Point) -> bool {
        match self.armed {
            Some(a) if a.point == point => self.passed.fetch_add(1, Ordering::SeqCst) + 1 == a.hit,
            _ => false,
        }
    }

    /// F6: whether the publish starting now is the one to hold (the armed hit counts publishes).
    fn holds_publish(&self) -> bool {
        match self.armed {
            Some(a) if a.point == Point::F6 => {
                self.publishes.fetch_add(1, Ordering::SeqCst) + 1 == a.hit
            }
            _ => false,
        }
    }

    /// Print `details` and `reached <point>`, then park for good or wait for the harness.
    async fn reached(&self, point: Point, details: &[String]) {
        {
            let mut out = std::io::stdout().lock();
            for line in details {
                let _ = writeln!(out, "{line}");
            }
            let _ = writeln!(out, "reached {}", point.name());
            let _ = out.flush();
        }
        match self.armed.map(|a| a.action) {
            Some(Action::Wait) => {
                // End of input releases it as well: a harness that died must not leave it hanging.
                let _ = tokio::task::spawn_blocking(|| std::io::stdin().read(&mut [0u8])).await;
            }
            _ => {
                self.parked.store(true, Ordering::SeqCst);
                pending::<()>().await;
            }
        }
    }

    /// Never returns once the process is parked at a failpoint.
    async fn gate(&self) {
        if self.parked.load(Ordering::SeqCst) {
            pending::<()>().await;
        }
    }
}

fn optional_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn env(name: &str) -> Result<String, String> {
    optional_env(name).ok_or_else(|| format!("{name} is not set"))
}

fn ids_line<'a>(label: &str, ids: impl IntoIterator<Item = &'a Uuid>) -> String {
    let ids: Vec<String> = ids.into_iter().map(Uuid::to_string).collect();
    format!("{label} {}", ids.join(","))
}

/// The real store, with F1 (after a claim returned a batch), F4a (complete started, not
/// awaited), F4 (after complete returned), F6 (after an extend during a held publish returned)
/// and F7 (after a dead-lettering fail returned).
struct FailpointStore {
    inner: Arc<dyn OutboxStore>,
    points: Arc<Failpoints>,
}

#[async_trait]
impl OutboxStore for FailpointStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        self.points.gate().await;
        let claim = self.inner.claim(req).await;
        self.points.gate().await;
        if let Ok(c) = &claim {
            if !c.messages.is_empty() && self.points.triggers(Point::F1) {
                let batch = ids_line("batch", c.messages.iter().map(|m| &m.id));
                self.points.reached(Point::F1, &[batch]).await;
            }
        }
        claim
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.points.gate().await;
        if self.points.triggers(Point::F4a) {
            // The complete runs on its own task, so it goes on (or not) while this one parks:
            // whether the database commits it before the kill is up to the race.
            let inner = self.inner.clone();
            let owned = ids.to_vec();
            let started = tokio::spawn(async move { inner.complete(token, &owned).await });
            tokio::task::yield_now().await;
            self.points
                .reached(Point::F4a, &[ids_line("batch", ids)])
                .await;
            return started.await.expect("the spawned complete does not panic");
        }
        let result = self.inner.complete(token, ids).await;
        self.points.gate().await;
        if self.points.triggers(Point::F4) {
            self.points
                .reached(Point::F4, &[ids_line("batch", ids)])
                .await;
        }
        result
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        self.points.gate().await;
        let result = self.inner.fail(token, failures).await;
        self.points.gate().await;
        let dead: Vec<&Uuid> = failures
            .iter()
            .filter(|f| f.action == FailAction::Dead)
            .map(|f| &f.id)
            .collect();
        if result.is_ok() && !dead.is_empty() && self.points.triggers(Point::F7) {
            self.points
                .reached(Point::F7, &[ids_line("dead", dead)])
                .await;
        }
        result
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        self.points.gate().await;
        let result = self.inner.extend(token, lease).await;
        self.points.gate().await;
        // The armed hit chose the held publish (see `holds_publish`): F6 fires at the first
        // extension that succeeds while it is held.
        if let Ok(until) = &result {
            if self.points.holding.swap(false, Ordering::SeqCst) {
                let details = [format!("lease until {}", until.timestamp_millis())];
                self.points.reached(Point::F6, &details).await;
            }
        }
        result
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.points.gate().await;
        let result = self.inner.release(token, ids).await;
        self.points.gate().await;
        result
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        self.inner.wakeups().await
    }
}

/// The real publisher, with F2 (the broker stored a prefix of the batch), F3 (the broker
/// acknowledged the batch, before the relay tells the store) and F6's held publish; it rejects
/// the poison message, if any, permanently.
struct FailpointPublisher {
    inner: Box<dyn Publisher>,
    points: Arc<Failpoints>,
    /// Aggregate id of the poison message ([`crash::POISON`]).
    poison: Option<String>,
}

impl FailpointPublisher {
    /// Publish `batch` through the real publisher, except the poison message, which fails
    /// permanently, and the later messages of its key in the batch, which are not attempted
    /// (what a real publisher does after a failure, so that the key keeps its order).
    async fn send(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        let Some(poison) = &self.poison else {
            return self.inner.publish(batch).await;
        };
        // The contract's per-key rule decides which messages go out: the poison message fails
        // and its key's later messages are not attempted; each other message is marked `Acked`
        // here only to say "send it", and gets the real publisher's outcome below.
        let decided = attempt_in_key_order(batch, |m| {
            if &m.aggregate_id == poison {
                PublishOutcome::permanent("the crash test's poison message")
            } else {
                PublishOutcome::Acked
            }
        });
        let sent: Vec<Message> = batch
            .iter()
            .zip(&decided)
            .filter(|(_, decided)| decided.is_acked())
            .map(|(m, _)| m.clone())
            .collect();
        let mut results = if sent.is_empty() {
            Vec::new()
        } else {
            self.inner.publish(&sent).await
        }
        .into_iter();
        decided
            .into_iter()
            .map(|decided| {
                if !decided.is_acked() {
                    return decided;
                }
                results.next().unwrap_or_else(|| PublishOutcome::Ambiguous {
                    reason: "the publisher returned too few outcomes".into(),
                })
            })
            .collect()
    }
}

#[async_trait]
impl Publisher for FailpointPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        self.points.gate().await;
        if self.points.holds_publish() {
            // F6: the broker stores the batch, but the publish does not return; the engine
            // extends the lease at half-time and F6 fires in that extend.
            let _ = self.send(batch).await;
            println!("{}", ids_line("batch", batch.iter().map(|m| &m.id)));
            self.points.holding.store(true, Ordering::SeqCst);
            pending::<()>().await;
        }
        if self.points.triggers(Point::F2) {
            let (sent, rest) = batch.split_at(batch.len() / 2);
            let mut outcomes = self.send(sent).await;
            let details = [
                ids_line("batch", batch.iter().map(|m| &m.id)),
                format!("prefix {}", sent.len()),
            ];
            self.points.reached(Point::F2, &details).await;
            // Released (FAILPOINT_ACTION=wait): the rest goes out as if it had been delayed.
            outcomes.extend(self.send(rest).await);
            self.points.gate().await;
            return outcomes;
        }
        let outcomes = self.send(batch).await;
        self.points.gate().await;
        if self.points.triggers(Point::F3) {
            let batch = ids_line("batch", batch.iter().map(|m| &m.id));
            self.points.reached(Point::F3, &[batch]).await;
        }
        outcomes
    }

    fn name(&self) -> &str {
        self.inner.name()
    }
}

/// Where the outbox lives.
enum Source {
    Postgres { url: String, schema: String },
    Sqlite { path: String },
}

impl Source {
    fn from_env() -> Result<Self, String> {
        match env(crash::SOURCE)?.as_str() {
            "postgres" => Ok(Source::Postgres {
                url: env(crash::POSTGRES_URL)?,
                schema: env(crash::POSTGRES_SCHEMA)?,
            }),
            "sqlite" => Ok(Source::Sqlite {
                path: env(crash::SQLITE_PATH)?,
            }),
            other => Err(format!(
                "{}={other:?}: use `postgres` or `sqlite`",
                crash::SOURCE
            )),
        }
    }
}

fn postgres_config(schema: &str) -> Result<PostgresConfig, Error> {
    PostgresConfig::builder()
        .schema(schema)
        .notify(false)
        .build()
}

async fn relay(points: Arc<Failpoints>) -> Result<(), BoxError> {
    points.check_mode(false)?;
    let store: Arc<dyn OutboxStore> = match Source::from_env()? {
        Source::Postgres { url, schema } => {
            Arc::new(PostgresStore::connect(&url, postgres_config(&schema)?).await?)
        }
        Source::Sqlite { path } => {
            Arc::new(SqliteStore::open(path, SqliteConfig::default()).await?)
        }
    };
    let publisher = outbox::broker::connect(&env(crash::BROKER_URL)?).await?;
    let batch_size = match optional_env(crash::BATCH) {
        Some(n) => n
            .parse()
            .map_err(|_| format!("{}={n:?} is not a number", crash::BATCH))?,
        None => crash::DEFAULT_BATCH,
    };
    let poison = match optional_env(crash::POISON) {
        Some(n) => Some(
            n.parse::<usize>()
                .map_err(|_| format!("{}={n:?} is not a number", crash::POISON))?,
        ),
        None => None,
    };
    let mut config = RelayConfig::builder()
        .batch_size(batch_size)
        // One batch in flight: at a failpoint exactly one batch is unfinished.
        .concurrency(1)
        // One claim over every key, not the store's choice (Postgres shards): the tests count
        // failpoint hits in batches of consecutive seqs.
        .claim_shards(1);
    if let Some(ms) = optional_env(crash::LEASE_MS) {
        let ms: u64 = ms
            .parse()
            .map_err(|_| format!("{}={ms:?} is not a number", crash::LEASE_MS))?;
        config = config.lease(Duration::from_millis(ms));
    }
    if poison.is_some() {
        // The poison message's key goes on past it once it is dead.
        config = config.head_policy(HeadPolicy::Skip);
    }
    let config = config.build()?;
    let store = FailpointStore {
        inner: store,
        points: points.clone(),
    };
    let publisher = FailpointPublisher {
        inner: publisher,
        points,
        poison: poison.map(crash::aggregate_id),
    };
    let relay = Relay::new(Arc::new(store), Arc::new(publisher), config)?;
    let stats = relay.run_until_idle().await?;
    if stats.lease_lost > 0 {
        println!("lease lost {}", stats.lease_lost);
    }
    println!("drained {}", stats.published);
    Ok(())
}

async fn produce(points: &Failpoints) -> Result<(), BoxError> {
    points.check_mode(true)?;
    let number = |name: &str| -> Result<usize, String> {
        let text = env(name)?;
        text.parse()
            .map_err(|_| format!("{name}={text:?} is not a number"))
    };
    let first = number(crash::PRODUCE_FIRST)?;
    let count = number(crash::PRODUCE_COUNT)?;
    let tag = env(crash::PRODUCE_TAG)?;
    let messages: Vec<NewMessage> = (first..first + count)
        .map(|n| crash::message(n, &tag))
        .collect();
    println!("{}", ids_line("ids", messages.iter().map(|m| &m.id)));
    let business = crash::business_row(first);
    match Source::from_env()? {
        Source::Postgres { url, schema } => {
            let config = postgres_config(&schema)?;
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect(&url)
                .await?;
            let mut tx = pool.begin().await?;
            sqlx::query(&format!(
                "INSERT INTO {schema}.{} (id, tag) VALUES ($1, $2)",
                crash::BUSINESS_TABLE
            ))
            .bind(&business)
            .bind(&tag)
            .execute(&mut *tx)
            .await?;
            outbox::postgres::enqueue_batch(&mut *tx, &config, &messages).await?;
            if points.triggers(Point::F9a) {
                points.reached(Point::F9a, &[]).await;
            }
            tx.commit().await?;
        }
        Source::Sqlite { path } => {
            let config = SqliteConfig::default();
            let mut conn = outbox::sqlite::open_connection(&path, &config)?;
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.execute(
                &format!(
                    "INSERT INTO {} (id, tag) VALUES (?1, ?2)",
                    crash::BUSINESS_TABLE
                ),
                (&business, &tag),
            )?;
            outbox::sqlite::enqueue_batch(&tx, &config, &messages)?;
            if points.triggers(Point::F9a) {
                points.reached(Point::F9a, &[]).await;
            }
            tx.commit()?;
        }
    }
    if points.triggers(Point::F9b) {
        points.reached(Point::F9b, &[]).await;
    }
    println!("committed {count}");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let result = async {
        let points = Arc::new(Failpoints::from_env()?);
        match mode.as_str() {
            "relay" => relay(points).await,
            "produce" => produce(&points).await,
            other => Err(format!("unknown mode {other:?}: use `relay` or `produce`").into()),
        }
    }
    .await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crash-relay: {e}");
            ExitCode::FAILURE
        }
    }
}
