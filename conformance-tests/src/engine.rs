//! The invariants end to end: the real relay engine over the store under test, with a
//! fault-injecting publisher and the engine's task aborted at random await points, then
//! restarted, until everything is drained.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use outbox_engine::{Backoff, Relay, RelayConfig};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{
    async_trait, Capabilities, Claim, ClaimRequest, Error, Failure, HeadPolicy, LeaseToken,
    Message, NewMessage, OutboxStore, PublishOutcome, Publisher, WakeSource,
};
use proptest::prelude::*;
use proptest::test_runner::Config;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::harness::{Harness, HarnessStore};
use crate::scenario::OutcomeSpec;

const LEASE: Duration = Duration::from_secs(600);
const MAX_ATTEMPTS: u32 = 3;
/// Moves past every lease and every back-off delay the engine can choose.
const PAST_EVERYTHING: Duration = Duration::from_secs(3600);
const MAX_ROUNDS: usize = 40;
/// Store and publisher calls one engine run may make before the test calls it a livelock: a
/// correct store lets every run go idle within a few dozen.
const MAX_OPS_PER_RUN: u32 = 2000;
/// A watchdog, not a timing assertion: a run that is still going after this long is hung, and
/// the case fails with a report instead of blocking the test binary forever.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// Where the engine is stopped in one crashing run.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CrashSpec {
    /// Abort at the n-th await on the store or publisher (from 1).
    pub at_op: u8,
    /// Abort after that call took effect (true) or before it reached the store/broker (false).
    pub after: bool,
}

impl fmt::Debug for CrashSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "abort {} call #{}",
            if self.after { "after" } else { "before" },
            self.at_op
        )
    }
}

/// A generated end-to-end case.
#[derive(Clone, PartialEq, Eq)]
pub struct EngineScenario {
    /// Head policy of the engine.
    pub head_policy: HeadPolicy,
    /// Engine batch size.
    pub batch_size: usize,
    /// Business transactions: keys of their messages, and whether they commit.
    pub txs: Vec<(Vec<Option<u8>>, bool)>,
    /// A transaction opened before all others and committed after the first run, with a lower
    /// `seq` than messages already published (stores allowing concurrent transactions only).
    /// `Some(k)`: it writes one message of key `k`: 0 or 1, a key the other transactions write
    /// too (a concurrent writer of that key, whose later messages the first run may publish
    /// before it), or 2, a key of its own. A store with key locks
    /// ([`HarnessCapabilities::key_locks`](crate::HarnessCapabilities::key_locks)) gets key 2
    /// always: there the other writers of its key would wait for it, and the runs only start
    /// once every other transaction has ended.
    pub late_tx: Option<u8>,
    /// Broker answers while faults are on, cycled over every message sent.
    pub faults: Vec<OutcomeSpec>,
    /// One engine run per entry, each aborted at its crash point.
    pub crashes: Vec<CrashSpec>,
}

impl fmt::Debug for EngineScenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "head policy {:?}, batch size {}",
            self.head_policy, self.batch_size
        )?;
        for (i, (keys, commit)) in self.txs.iter().enumerate() {
            let keys: Vec<String> = keys
                .iter()
                .map(|k| k.map_or("unordered".into(), |k| format!("k{k}")))
                .collect();
            writeln!(
                f,
                "  tx{} enqueue [{}] and {}",
                i + 1,
                keys.join(", "),
                if *commit { "commit" } else { "roll back" }
            )?;
        }
        if let Some(k) = self.late_tx {
            writeln!(
                f,
                "  a late tx, begun first, writes k{k} and commits after the first engine run"
            )?;
        }
        writeln!(f, "  broker answers while faulty: {:?}", self.faults)?;
        for (i, c) in self.crashes.iter().enumerate() {
            writeln!(f, "  engine run {}: {c:?}, then clock +1h", i + 1)?;
        }
        writeln!(
            f,
            "  then faults off: engine runs until idle, dead letters requeued, until drained"
        )
    }
}

fn outcome() -> impl Strategy<Value = OutcomeSpec> {
    prop_oneof![
        4 => Just(OutcomeSpec::Ack),
        2 => (0u8..3).prop_map(OutcomeSpec::Transient),
        1 => Just(OutcomeSpec::Permanent),
        1 => (0u8..3).prop_map(OutcomeSpec::Ambiguous),
    ]
}

/// End-to-end scenarios: a few transactions over two keys, faults, up to three crashes.
pub fn engine_scenario() -> impl Strategy<Value = EngineScenario> {
    let key = prop_oneof![4 => (0u8..2).prop_map(Some), 1 => Just(None)];
    let tx = (prop::collection::vec(key, 1..=3), prop::bool::weighted(0.8));
    (
        prop_oneof![Just(HeadPolicy::Block), Just(HeadPolicy::Skip)],
        1usize..=4,
        prop::collection::vec(tx, 1..=5),
        prop_oneof![1 => Just(None), 1 => (0u8..=2).prop_map(Some)],
        prop::collection::vec(outcome(), 1..=6),
        prop::collection::vec(
            (1u8..=12, any::<bool>()).prop_map(|(at_op, after)| CrashSpec { at_op, after }),
            0..=3,
        ),
    )
        .prop_map(
            |(head_policy, batch_size, txs, late_tx, faults, crashes)| EngineScenario {
                head_policy,
                batch_size,
                txs,
                late_tx,
                faults,
                crashes,
            },
        )
}

/// What the test knows about each message, and what it saw.
#[derive(Default)]
struct World {
    label: HashMap<Uuid, String>,
    /// Insert order of each message.
    order: HashMap<Uuid, usize>,
    key: HashMap<Uuid, Option<u8>>,
    committed: HashSet<Uuid>,
    rolled_back: HashSet<Uuid>,
    /// First delivery position of each message.
    first_delivery: HashMap<Uuid, usize>,
    deliveries: usize,
    delivered: HashMap<Uuid, u32>,
    /// Duplicates each message may still have, with their causes.
    allowances: HashMap<Uuid, Vec<&'static str>>,
    attributed: HashMap<&'static str, u32>,
    /// Failed attempts the store accepted, per message (reset by requeue).
    /// A range, because a `fail` cut short by a crash may or may not have taken effect; seeing
    /// the message again pins it.
    failed: HashMap<Uuid, (u32, u32)>,
    /// The last failure reason the store accepted, per message.
    /// Every reason that may be the stored one (more than one only after a cut-short call).
    last_error: HashMap<Uuid, Vec<String>>,
    /// Delivered (acked) in the current run and not yet completed.
    uncompleted_in_run: HashSet<Uuid>,
    ever_dead: HashSet<Uuid>,
    /// The late transaction's message and how many deliveries there had been when it
    /// committed.
    late_committed: Option<(Uuid, usize)>,
    faults_on: bool,
    fault_cursor: usize,
    violations: Vec<String>,
}

impl World {
    fn name(&self, id: &Uuid) -> String {
        self.label
            .get(id)
            .cloned()
            .unwrap_or_else(|| format!("unknown id {id}"))
    }
}

/// Shared by the wrapped store and publisher of one engine run.
struct Crash {
    spec: Option<CrashSpec>,
    ops: AtomicU32,
    /// Set at the crash point: every later call of the run freezes too, so the crash stops the
    /// whole relay at once, as a dead process would.
    crashed: AtomicBool,
    fired: Notify,
}

impl Crash {
    fn new(spec: Option<CrashSpec>) -> Arc<Self> {
        Arc::new(Self {
            spec,
            ops: AtomicU32::new(0),
            crashed: AtomicBool::new(false),
            fired: Notify::new(),
        })
    }

    /// Count one await point; `Some(after)` if the crash happens here.
    fn tick(&self) -> Option<bool> {
        if self.crashed.load(Ordering::SeqCst) {
            return Some(false);
        }
        let n = self.ops.fetch_add(1, Ordering::SeqCst) + 1;
        let hit = self
            .spec
            .filter(|s| u32::from(s.at_op) == n)
            .map(|s| s.after)
            .or((n > MAX_OPS_PER_RUN).then_some(false));
        if hit.is_some() {
            self.crashed.store(true, Ordering::SeqCst);
        }
        hit
    }

    /// Freeze the caller forever and tell the test to abort the engine.
    async fn freeze(&self) -> ! {
        self.fired.notify_one();
        std::future::pending::<()>().await;
        unreachable_after_pending()
    }
}

// `pending` never resolves; this only satisfies the `!` return type without a panic macro.
fn unreachable_after_pending() -> ! {
    loop {
        std::hint::spin_loop();
    }
}

/// The store under test as seen by one engine run: counts await points, may freeze at the
/// crash point, and tells the world which transitions took effect.
struct CrashingStore {
    inner: Arc<dyn OutboxStore>,
    crash: Arc<Crash>,
    world: Arc<Mutex<World>>,
}

fn lock(world: &Mutex<World>) -> MutexGuard<'_, World> {
    world.lock().unwrap_or_else(|p| p.into_inner())
}

impl CrashingStore {
    async fn around<T>(&self, call: impl std::future::Future<Output = T>) -> T {
        match self.crash.tick() {
            Some(false) => self.crash.freeze().await,
            Some(true) => {
                let _ = call.await;
                self.crash.freeze().await
            }
            None => call.await,
        }
    }
}

fn held(ids: &[Uuid], result: &Result<(), Error>) -> Vec<Uuid> {
    match result {
        Ok(()) => ids.to_vec(),
        Err(Error::LeaseLost { ids: lost }) => ids
            .iter()
            .filter(|id| !lost.contains(id))
            .copied()
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[async_trait]
impl OutboxStore for CrashingStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        self.around(self.inner.claim(req)).await
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        let world = self.world.clone();
        let inner = self.inner.clone();
        self.around(async move {
            let result = inner.complete(token, ids).await;
            let mut w = lock(&world);
            for id in held(ids, &result) {
                w.uncompleted_in_run.remove(&id);
            }
            result
        })
        .await
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        let world = self.world.clone();
        let inner = self.inner.clone();
        self.around(async move {
            {
                // If the crash cuts this call short, it may still have taken effect.
                let mut w = lock(&world);
                for f in failures {
                    w.failed.entry(f.id).or_default().1 += 1;
                    w.last_error.entry(f.id).or_default().push(f.error.clone());
                    if matches!(f.action, outbox_traits::FailAction::Dead) {
                        w.ever_dead.insert(f.id);
                    }
                }
            }
            let result = inner.fail(token, failures).await;
            let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
            let took = held(&ids, &result);
            let mut w = lock(&world);
            for f in failures {
                let range = w.failed.entry(f.id).or_default();
                if took.contains(&f.id) {
                    range.0 += 1;
                    w.last_error.insert(f.id, vec![f.error.clone()]);
                } else {
                    range.1 -= 1;
                    if let Some(reasons) = w.last_error.get_mut(&f.id) {
                        reasons.pop();
                    }
                }
            }
            result
        })
        .await
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        self.around(self.inner.extend(token, lease)).await
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.around(self.inner.release(token, ids)).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        self.inner.wakeups().await
    }
}

/// Answers from the fault list while faults are on, records every delivery, freezes at the
/// crash point.
struct FaultyPublisher {
    crash: Arc<Crash>,
    world: Arc<Mutex<World>>,
    faults: Vec<OutcomeSpec>,
}

impl FaultyPublisher {
    fn answer(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        let mut w = lock(&self.world);
        let mut stopped = HashSet::new();
        let mut outcomes = Vec::with_capacity(batch.len());
        for m in batch {
            let name = w.name(&m.id);
            if !w.label.contains_key(&m.id) || w.rolled_back.contains(&m.id) {
                w.violations.push(format!(
                    "no phantom: the engine published {name}, which was never committed"
                ));
            }
            let (low, high) = w.failed.get(&m.id).copied().unwrap_or((0, 0));
            if m.attempts < low || m.attempts > high {
                w.violations.push(format!(
                    "exact attempts: {name} was handed to the publisher with attempts {}, but the store accepted {low} failures of it (at most {high} counting calls cut short by a crash)",
                    m.attempts
                ));
            } else {
                // The store's count resolves calls a crash cut short.
                w.failed.insert(m.id, (m.attempts, m.attempts));
            }
            let key = w.key.get(&m.id).copied().flatten();
            if key.is_some_and(|k| stopped.contains(&k)) {
                outcomes.push(PublishOutcome::NotAttempted);
                continue;
            }
            let spec = if w.faults_on && !self.faults.is_empty() {
                let s = self.faults[w.fault_cursor % self.faults.len()];
                w.fault_cursor += 1;
                s
            } else {
                OutcomeSpec::Ack
            };
            let (outcome, delivered) = match spec {
                OutcomeSpec::Ack => (PublishOutcome::Acked, true),
                OutcomeSpec::Transient(_) => {
                    (PublishOutcome::transient("broker unavailable"), false)
                }
                OutcomeSpec::Permanent => (PublishOutcome::permanent("broker rejected it"), false),
                OutcomeSpec::Ambiguous(_) => (
                    PublishOutcome::Ambiguous {
                        reason: "timed out after sending".into(),
                    },
                    true,
                ),
            };
            if !outcome.is_acked() {
                if let Some(k) = key {
                    stopped.insert(k);
                }
            }
            if delivered {
                record_delivery(&mut w, m.id, &name);
                if matches!(spec, OutcomeSpec::Ambiguous(_)) {
                    w.allowances
                        .entry(m.id)
                        .or_default()
                        .push("ambiguous publish");
                } else {
                    w.uncompleted_in_run.insert(m.id);
                }
            }
            outcomes.push(outcome);
        }
        outcomes
    }
}

fn record_delivery(w: &mut World, id: Uuid, name: &str) {
    let n = w.delivered.entry(id).or_default();
    *n += 1;
    if *n == 1 {
        let pos = w.deliveries;
        w.first_delivery.insert(id, pos);
    } else {
        match w.allowances.get_mut(&id).and_then(Vec::pop) {
            Some(cause) => *w.attributed.entry(cause).or_default() += 1,
            None => w.violations.push(format!(
                "duplicates only from listed causes: {name} was delivered again with no ambiguous publish or crash after publish to explain it"
            )),
        }
    }
    w.deliveries += 1;
}

#[async_trait]
impl Publisher for FaultyPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        match self.crash.tick() {
            Some(false) => self.crash.freeze().await,
            Some(true) => {
                // Sent, then the relay dies before it hears back.
                let _ = self.answer(batch);
                self.crash.freeze().await
            }
            None => {
                tokio::task::yield_now().await;
                self.answer(batch)
            }
        }
    }

    fn name(&self) -> &str {
        "faulty"
    }
}

fn message(label: &str, key: Option<u8>) -> NewMessage {
    let m = NewMessage::new(
        "item",
        key.map_or_else(|| "none".to_string(), |k| format!("k{k}")),
        "item.changed",
        serde_json::json!({ "label": label }),
    );
    if key.is_none() {
        m.unordered()
    } else {
        m
    }
}

/// Play one end-to-end scenario against `store`; `Err` carries what broke, in words.
pub async fn run_engine_scenario(
    store: &dyn HarnessStore,
    scenario: &EngineScenario,
) -> Result<(), String> {
    let e = |what: &'static str| move |err: Error| format!("{what} failed: {err}");
    let world = Arc::new(Mutex::new(World::default()));
    let admin = store.admin().await.map_err(e("admin handle"))?;
    let concurrent = store.capabilities().concurrent_transactions;
    let mut per_key = [0u32; 3];
    let mut unordered = 0;
    let mut next_label = |key: Option<u8>| match key {
        Some(k) => {
            per_key[usize::from(k)] += 1;
            format!("k{k}#{}", per_key[usize::from(k)])
        }
        None => {
            unordered += 1;
            format!("u#{unordered}")
        }
    };
    let add = |w: &mut World, m: &NewMessage, label: String, key: Option<u8>| {
        let n = w.order.len();
        w.order.insert(m.id, n);
        w.label.insert(m.id, label);
        w.key.insert(m.id, key);
    };

    // The late transaction inserts first (lowest seq) and commits after the first run.
    let mut late = None;
    if let Some(key) = scenario.late_tx.filter(|_| concurrent) {
        let key = if store.capabilities().key_locks {
            2
        } else {
            key
        };
        let m = message("late#1", Some(key));
        add(&mut lock(&world), &m, "late#1".into(), Some(key));
        let mut tx = store.begin().await.map_err(e("begin"))?;
        tx.enqueue(std::slice::from_ref(&m))
            .await
            .map_err(e("enqueue"))?;
        late = Some((tx, m.id));
    }
    for (keys, commit) in &scenario.txs {
        let mut batch = Vec::new();
        for key in keys {
            let label = next_label(*key);
            let m = message(&label, *key);
            add(&mut lock(&world), &m, label, *key);
            batch.push(m);
        }
        let mut tx = store.begin().await.map_err(e("begin"))?;
        tx.enqueue(&batch).await.map_err(e("enqueue"))?;
        if *commit {
            tx.commit().await.map_err(e("commit"))?;
            lock(&world).committed.extend(batch.iter().map(|m| m.id));
        } else {
            tx.rollback().await.map_err(e("rollback"))?;
            lock(&world).rolled_back.extend(batch.iter().map(|m| m.id));
        }
    }

    let config = RelayConfig::builder()
        .batch_size(scenario.batch_size)
        .lease(LEASE)
        .max_attempts(MAX_ATTEMPTS)
        .backoff(Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
            ..Backoff::default()
        })
        .store_backoff(Backoff {
            initial: Duration::from_millis(1),
            max: Duration::from_millis(10),
            ..Backoff::default()
        })
        .concurrency(2)
        .head_policy(scenario.head_policy)
        .poll_min(Duration::from_millis(1))
        .poll_max(Duration::from_millis(10))
        .build()
        .map_err(e("relay config"))?;

    let mut log = Vec::new();
    let mut faulty_runs = scenario.crashes.len() + 1;
    let mut run = 0;
    let mut drained = false;
    while run < MAX_ROUNDS {
        run += 1;
        let crash_spec = scenario.crashes.get(run - 1).copied();
        let faults_on = faulty_runs > 0;
        faulty_runs = faulty_runs.saturating_sub(1);
        {
            let mut w = lock(&world);
            w.faults_on = faults_on;
            w.uncompleted_in_run.clear();
        }
        let crash = Crash::new(crash_spec);
        let handle = store.relay().await.map_err(e("relay handle"))?;
        let wrapped: Arc<dyn OutboxStore> = Arc::new(CrashingStore {
            inner: handle,
            crash: crash.clone(),
            world: world.clone(),
        });
        let publisher = Arc::new(FaultyPublisher {
            crash: crash.clone(),
            world: world.clone(),
            faults: scenario.faults.clone(),
        });
        let relay = Relay::new(wrapped, publisher, config.clone()).map_err(e("Relay::new"))?;
        let mut task = tokio::spawn(async move { relay.run_until_idle().await });
        let crashed = tokio::select! {
            result = &mut task => {
                match result {
                    Ok(Ok(_stats)) => false,
                    Ok(Err(err)) => return Err(format!("engine run {run} failed: {err}")),
                    Err(join) => return Err(format!("engine run {run} panicked: {join}")),
                }
            }
            () = crash.fired.notified() => {
                // Wait until the task is really gone: no call of this run may land after the
                // next run started.
                task.abort();
                let _ = task.await;
                true
            }
            () = tokio::time::sleep(HANG_GUARD) => {
                task.abort();
                return Err(format!(
                    "engine run {run} did not go idle within {HANG_GUARD:?} of real time (hung on a store or publisher call?)\nengine runs:\n  {}",
                    log.join("\n  ")
                ));
            }
        };
        if crashed && crash.ops.load(Ordering::SeqCst) > MAX_OPS_PER_RUN {
            return Err(format!(
                "no loss: engine run {run} made {MAX_OPS_PER_RUN} store and publisher calls without going idle (a message retried or handed out forever?)\nengine runs:\n  {}",
                log.join("\n  ")
            ));
        }
        if crashed {
            let mut w = lock(&world);
            let pending: Vec<Uuid> = w.uncompleted_in_run.drain().collect();
            for id in pending {
                w.allowances
                    .entry(id)
                    .or_default()
                    .push("crash after publish before complete");
            }
            log.push(format!(
                "run {run}: aborted at {:?} (faults {})",
                crash_spec,
                if faults_on { "on" } else { "off" }
            ));
        } else {
            log.push(format!(
                "run {run}: ran until idle (faults {})",
                if faults_on { "on" } else { "off" }
            ));
        }
        if let Some((tx, id)) = late.take() {
            tx.commit().await.map_err(e("commit of the late tx"))?;
            let mut w = lock(&world);
            w.committed.insert(id);
            w.late_committed = Some((id, w.deliveries));
            log.push(format!("late tx committed after run {run}"));
        }
        store
            .advance_time(PAST_EVERYTHING)
            .await
            .map_err(e("advance_time"))?;
        let counts = admin.counts().await.map_err(e("counts"))?;
        let (committed, delivered) = {
            let w = lock(&world);
            let delivered = w
                .committed
                .iter()
                .filter(|id| w.delivered.contains_key(*id))
                .count() as u64;
            (w.committed.len() as u64, delivered)
        };
        let total = counts.pending + counts.leased + counts.published + counts.dead;
        // A store that deletes on publish holds only the unpublished: it may hold fewer than
        // were committed, but only by messages that were published.
        let consistent = if store.capabilities().store.deletes_published {
            total <= committed && committed - total <= delivered
        } else {
            total == committed
        };
        if !consistent {
            return Err(format!(
                "accounting: after run {run}, counts() = {counts:?} sums to {total}, but {committed} messages were committed ({delivered} of them published)\n{}",
                log.join("\n")
            ));
        }
        if !faults_on && counts.pending == 0 && counts.leased == 0 && counts.dead == 0 {
            drained = true;
            break;
        }
        if !faults_on && counts.dead > 0 {
            let dead = admin
                .list_dead(None, 10_000)
                .await
                .map_err(e("list_dead"))?;
            let ids: Vec<Uuid> = {
                let mut w = lock(&world);
                for d in &dead {
                    let want = w.last_error.get(&d.message.id).cloned().unwrap_or_default();
                    if !want.contains(&d.last_error) {
                        let name = w.name(&d.message.id);
                        w.violations.push(format!(
                            "every dead message has its reason: {name} is dead with {:?}, the engine failed it with {want:?}",
                            d.last_error
                        ));
                    }
                }
                let ids: Vec<Uuid> = dead.iter().map(|d| d.message.id).collect();
                for id in &ids {
                    w.failed.insert(*id, (0, 0));
                }
                ids
            };
            let n = admin.requeue(&ids).await.map_err(e("requeue"))?;
            log.push(format!("operator requeued {n} dead messages"));
        }
    }

    let w = lock(&world);
    let mut problems = w.violations.clone();
    if !drained {
        problems.push(format!(
            "no loss: the outbox did not drain within {MAX_ROUNDS} engine runs with faults off"
        ));
    }
    let mut by_order: Vec<&Uuid> = w.committed.iter().collect();
    by_order.sort_by_key(|id| w.order[*id]);
    for id in &by_order {
        if !w.delivered.contains_key(*id) {
            problems.push(format!(
                "no loss: {} was committed but never published",
                w.name(id)
            ));
        }
    }
    // Per-key order of first deliveries, in insert order, except that a message first
    // delivered before the late transaction committed may precede the late message of its key:
    // that delivery's claim ran while the late message was uncommitted (the contract's
    // allowance for concurrent writers of a key; the other transactions commit in insert
    // order).
    for (i, a) in by_order.iter().enumerate() {
        for b in &by_order[i + 1..] {
            let (ka, kb) = (w.key[*a], w.key[*b]);
            if ka.is_none() || ka != kb {
                continue;
            }
            if scenario.head_policy == HeadPolicy::Skip && w.ever_dead.contains(*a) {
                continue;
            }
            if let (Some(fa), Some(fb)) = (w.first_delivery.get(*a), w.first_delivery.get(*b)) {
                let passed_late = w
                    .late_committed
                    .is_some_and(|(late, at)| late == **a && *fb < at);
                if fa > fb && !passed_late {
                    problems.push(format!(
                        "per-key order: {} was first delivered after the later {}",
                        w.name(a),
                        w.name(b)
                    ));
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{}\nengine runs:\n  {}\nduplicates by cause: {:?}",
            problems.join("\n"),
            log.join("\n  "),
            w.attributed
        ))
    }
}

/// Run the end-to-end property against `harness`: every generated scenario runs the real
/// engine, with faults and crashes, over a fresh store until drained. Blocking.
pub fn check_engine(harness: &dyn Harness, config: Config) -> Result<(), String> {
    crate::property::run_property(
        harness,
        config,
        engine_scenario(),
        &[],
        "end-to-end property",
        |store, scenario| Box::pin(run_engine_scenario(store, scenario)),
    )
}
