//! The reference model and the runner that plays a [`Scenario`] against a store under test,
//! checking every invariant after every step.
//!
//! # Per-key order with concurrent writers of one key
//!
//! Open business transactions may write the same partition key. Per-key order follows `seq`,
//! the insert order, and the rule the model checks is the contract's
//! ([`OutboxStore::claim`], README "Per-key order and concurrent writers"):
//!
//! - **Claims.** A claim never returns a message unless every earlier (smaller `seq`) message
//!   of its key that was *committed when the claim ran* and still holds the key back (pending,
//!   leased, or dead under [`HeadPolicy::Block`]) is returned before it in the same claim. An
//!   earlier message still uncommitted at the claim neither holds the key back nor counts for
//!   completeness: the later one may be claimed first.
//! - **Deliveries.** A message's first delivery comes after the first delivery of every
//!   earlier message of its key, except those rolled back or discarded, those dead under
//!   [`HeadPolicy::Skip`], and those that were still uncommitted when the claim whose batch
//!   delivers it ran. That allowance is exactly what a commit in the other order than the
//!   inserts makes possible, and nothing more: once the earlier message is committed, no
//!   later claim may pass it.
//! - **Key locks.** With [`HarnessCapabilities::key_locks`], an enqueue writing a key that
//!   another open transaction wrote must wait until that transaction ends: the model runs it in
//!   the background, fails the case if it returns while the other is still open, awaits it when
//!   the other ends, and enters its messages into insert order only then (after everything the
//!   other wrote, also after the waiter began). Insert order is then commit order, and the
//!   allowance above never applies; `seq`s that do not follow that order fail "seq follows
//!   insert order".
//!
//! # Sharded claims
//!
//! Against a store that declares
//! [`Capabilities::sharded_claims`](outbox_traits::Capabilities::sharded_claims), some claims
//! ask for one shard ([`ShardSpec`]). The shard function is the store's own, so the model
//! learns it: for every partition key (all of whose messages share a shard) and every
//! unordered message, and every shard count, it keeps the shards it may still be in.
//!
//! - A sharded claim is checked like any other (eligibility, exclusivity, per-key order,
//!   attempts, payload, `seq`), and each message it returns pins its key (or itself) to the
//!   claim's shard: returned earlier by a claim of another shard of the same count, or ruled
//!   out of this one, is a broken "shard consistency".
//! - Completeness is the unsharded rule restricted to the shard: a sharded claim that returns
//!   fewer than its limit must return what an unsharded claim would if only the keys (and
//!   unordered messages) of its shard were stored, the window counting only their rows. Where
//!   the model does not know yet whether a key is in the shard, a claimable message the claim
//!   had to return if it were rules that shard out for the key (counting every message that may
//!   be in the shard towards the window, so the inference is sound); where it knows (pinned by
//!   an earlier claim, or every other shard ruled out), leaving it out breaks "claim
//!   completeness". A shard count of 1 is every key, so such a claim is held to the full rule.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use outbox_traits::chrono::{self, DateTime, Utc};
use outbox_traits::{
    Claim, ClaimRequest, ClaimShard, Error, FailAction, Failure, HeadPolicy, LeaseToken, Message,
    NewMessage, OutboxAdmin, OutboxStore,
};
use uuid::Uuid;

use crate::harness::{HarnessCapabilities, HarnessStore, HarnessTx, RawRow};
use crate::scenario::{
    relay_name, Advance, Move, MsgSpec, OutcomeSpec, Phase, Scenario, ShardSpec, Step, TxEnd, KEYS,
    LEASE, MAX_ATTEMPTS, NOT_BEFORE, PURGE_AGE, RELAYS, TX_SLOTS,
};

/// A broken invariant: which one, and what was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The invariant's name, e.g. `no loss` or `fencing`.
    pub invariant: &'static str,
    /// What the store did and what the model expected.
    pub detail: String,
}

fn violation(invariant: &'static str, detail: impl Into<String>) -> Violation {
    Violation {
        invariant,
        detail: detail.into(),
    }
}

fn store_error(what: &str, e: &Error) -> Violation {
    violation("store error", format!("{what} failed: {e}"))
}

/// What a passing scenario exercised, summed over cases to show the generator reaches every
/// situation the invariants are about.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Coverage {
    /// Messages committed.
    pub committed: u64,
    /// Messages rolled back.
    pub rolled_back: u64,
    /// Messages committed after a message with a higher `seq` was already claimed.
    pub late_commits: u64,
    /// Deliveries to the simulated broker, duplicates included.
    pub deliveries: u64,
    /// Duplicates after an ambiguous publish.
    pub dup_ambiguous: u64,
    /// Duplicates after a crash between publish and complete.
    pub dup_crash: u64,
    /// Duplicates after a lease expired.
    pub dup_expiry: u64,
    /// Messages a transition named in `LeaseLost`, as the model expected.
    pub lease_lost: u64,
    /// Messages dead-lettered.
    pub dead: u64,
    /// Dead messages requeued by an operator step.
    pub requeued: u64,
    /// Dead messages discarded.
    pub discarded: u64,
    /// Published messages purged.
    pub purged: u64,
    /// Relays that crashed while holding a batch.
    pub crashes_holding: u64,
    /// Claims that held back a key's message behind an earlier one.
    pub held_back: u64,
    /// Steps in which two or more relays' calls ran against the store at the same moment.
    pub together: u64,
    /// Enqueues that wrote a partition key another open transaction had written: concurrent
    /// writers of one key.
    pub same_key_writers: u64,
    /// Messages claimed while an earlier message of their key was still uncommitted (the
    /// contract lets the later one go first then).
    pub overtaken: u64,
    /// Enqueues that waited for a key lock until the key's other writer ended (stores with
    /// [`HarnessCapabilities::key_locks`] only).
    pub waited: u64,
    /// Claims of one shard that returned messages (stores declaring
    /// [`Capabilities::sharded_claims`](outbox_traits::Capabilities::sharded_claims) only).
    pub sharded: u64,
    /// Claimable messages a claim of one shard, returning fewer than its limit, left out: the
    /// model learned that their key (or they, unordered) is in another shard.
    pub shard_ruled_out: u64,
    /// Claims of one shard that returned messages while another relay held live leases from
    /// a claim of another shard of the same count: relays dividing the keys between them, as
    /// the replicas of a relay group do.
    pub disjoint_shards: u64,
    /// Dead messages requeued or discarded by `seq`.
    pub by_seq: u64,
    /// Messages a SQL writer inserted with a plain `INSERT` (harnesses with raw rows only).
    pub raw: u64,
    /// Status checks that found a key blocked by a head waiting for a retry.
    pub blocked_retrying: u64,
    /// Status checks that found a key blocked by a dead head.
    pub blocked_dead: u64,
}

impl std::ops::AddAssign for Coverage {
    fn add_assign(&mut self, o: Self) {
        self.committed += o.committed;
        self.rolled_back += o.rolled_back;
        self.late_commits += o.late_commits;
        self.deliveries += o.deliveries;
        self.dup_ambiguous += o.dup_ambiguous;
        self.dup_crash += o.dup_crash;
        self.dup_expiry += o.dup_expiry;
        self.lease_lost += o.lease_lost;
        self.dead += o.dead;
        self.requeued += o.requeued;
        self.discarded += o.discarded;
        self.purged += o.purged;
        self.crashes_holding += o.crashes_holding;
        self.held_back += o.held_back;
        self.together += o.together;
        self.same_key_writers += o.same_key_writers;
        self.overtaken += o.overtaken;
        self.waited += o.waited;
        self.sharded += o.sharded;
        self.shard_ruled_out += o.shard_ruled_out;
        self.disjoint_shards += o.disjoint_shards;
        self.by_seq += o.by_seq;
        self.raw += o.raw;
        self.blocked_retrying += o.blocked_retrying;
        self.blocked_dead += o.blocked_dead;
    }
}

/// Causes a duplicate delivery may have; any other duplicate is a violation.
const CAUSE_AMBIGUOUS: &str = "ambiguous publish";
const CAUSE_CRASH: &str = "crash after publish before complete";
const CAUSE_EXPIRY: &str = "lease expiry";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Status {
    /// In open transaction slot `n`.
    Open(u8),
    RolledBack,
    Pending,
    Leased {
        claim: u64,
        until: u64,
    },
    Published,
    Dead,
    Discarded,
}

#[derive(Debug, Clone)]
struct Msg {
    id: Uuid,
    label: String,
    key: Option<u8>,
    /// Insert order; `seq` must follow it.
    order: usize,
    status: Status,
    attempts: u32,
    /// Model time (seconds) from which it is claimable.
    due: u64,
    last_error: Option<String>,
    seq: Option<i64>,
    delivered: u32,
    /// Causes that allow one more duplicate delivery each.
    causes: Vec<&'static str>,
    ever_dead: bool,
    published_at: Option<u64>,
    /// Model time before which it is not due (0 when not delayed).
    not_before: u64,
    /// Delayed and still uncommitted when the clock moved: a harness that shifts stored
    /// timestamps cannot shift an uncommitted row's, one with a movable clock moves it, so when
    /// it is due is unknown. Completeness then neither requires it nor anything behind it.
    due_unknown: bool,
    /// Model time of its enqueue: its age is `now - created` plus the real time the case took
    /// since (at most).
    created: u64,
    /// Uncommitted (or waiting for a key lock) when the clock moved: its stored creation time
    /// may not have moved with the others, so its age may be less than `now - created`.
    created_unsure: bool,
}

#[derive(Debug, Clone)]
enum Resolved {
    Ack,
    Retry { delay: Duration, reason: String },
    Dead { reason: String },
    NotAttempted,
}

#[derive(Clone)]
struct Batch {
    claim: u64,
    token: LeaseToken,
    ids: Vec<Uuid>,
    outcomes: Option<Vec<Resolved>>,
    /// Messages this relay's publish put on the broker (acked or ambiguous).
    delivered: Vec<Uuid>,
    /// Messages that were uncommitted when this batch was claimed and are earlier in their
    /// key than one of its messages: the batch may deliver its messages before them.
    passed: HashSet<Uuid>,
    /// The shard its claim asked for, if any.
    shard: Option<ShardSpec>,
}

/// An enqueue that waits for a key lock ([`HarnessCapabilities::key_locks`]): it runs in the
/// background until every transaction holding one of its keys has ended.
struct Waiter {
    /// The enqueue, running on the waiting transaction, which it hands back when it returns.
    task: tokio::task::JoinHandle<(Box<dyn HarnessTx>, Result<(), Error>)>,
    /// Its messages, entered into the model (and so into insert order) when it returns.
    msgs: Vec<Msg>,
    /// The transaction slots it waits for.
    holders: BTreeSet<u8>,
    /// How the step that enqueued ends the transaction once the enqueue returns.
    then: TxEnd,
}

/// A blocked key as `status` lists it: key, head id, head state, attempts, last error.
type BlockedHead<'a> = (String, Uuid, &'a str, u32, Option<&'a String>);

/// How many blocked keys the model's `status` calls ask to list: more than there are keys.
const STATUS_LIST: usize = 10;

/// With key locks, how long an enqueue may take to return once no other open transaction holds
/// its keys (after the transactions it waited for ended, or at once when none held them). A
/// watchdog, not a timing assertion: a correct store returns within milliseconds, and a store
/// whose enqueue waits for nothing the model knows of (e.g. a writer of another key) fails the
/// case with a report instead of hanging.
const KEY_LOCK_GUARD: Duration = Duration::from_secs(30);

/// What settling a batch sends, decided from the model before the calls.
struct SettlePlan {
    claim: u64,
    token: LeaseToken,
    acked: Vec<Uuid>,
    failures: Vec<Failure>,
    released: Vec<Uuid>,
}

/// The store's answers to a settle's calls; `None` where there was nothing to send.
struct SettleAnswers {
    complete: Option<Result<(), Error>>,
    fail: Option<Result<(), Error>>,
    release: Option<Result<(), Error>>,
}

/// A claim of `limit` with the property's lease, of one shard if `shard` says so.
async fn claim_call(
    handle: &dyn OutboxStore,
    limit: usize,
    head_policy: HeadPolicy,
    shard: Option<ShardSpec>,
) -> Result<Claim, Error> {
    let req = ClaimRequest {
        limit,
        lease: LEASE,
        head_policy,
        shard: shard.map(|s| ClaimShard {
            index: u32::from(s.index),
            count: u32::from(s.count),
        }),
    };
    handle.claim(&req).await
}

/// What shares a shard: a partition key (every message of it) or one unordered message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ShardUnit {
    Key(u8),
    Unordered(Uuid),
}

/// What the model has learned of the store's shard function (see the module docs): per unit
/// and shard count, the shards the unit may still be in (a bit per shard; no entry: any), and
/// the claims that narrowed it, for reports.
#[derive(Debug, Clone, Default)]
struct ShardMap {
    learned: HashMap<(ShardUnit, u8), (u8, Vec<String>)>,
}

impl ShardMap {
    fn mask(&self, unit: ShardUnit, count: u8) -> u8 {
        self.learned
            .get(&(unit, count))
            .map_or((1u8 << count) - 1, |(mask, _)| *mask)
    }

    /// `unit` may be in `shard`.
    fn may_be_in(&self, unit: ShardUnit, shard: ShardSpec) -> bool {
        self.mask(unit, shard.count) & (1 << shard.index) != 0
    }

    /// `unit` is in `shard`: pinned there, or every other shard ruled out.
    fn is_in(&self, unit: ShardUnit, shard: ShardSpec) -> bool {
        self.mask(unit, shard.count) == 1 << shard.index
    }

    /// How the model learned where `unit` is, for a report.
    fn why(&self, unit: ShardUnit, count: u8) -> String {
        self.learned
            .get(&(unit, count))
            .map_or_else(|| "nothing learned".to_string(), |(_, why)| why.join("; "))
    }

    /// `unit` is in `shard` (a claim of it returned one of its messages); `Err` if it cannot be.
    fn pin(&mut self, unit: ShardUnit, shard: ShardSpec, why: String) -> Result<(), ()> {
        let bit = 1 << shard.index;
        let mask = self.mask(unit, shard.count);
        if mask & bit == 0 {
            return Err(());
        }
        if mask != bit {
            let entry = self
                .learned
                .entry((unit, shard.count))
                .or_insert((mask, Vec::new()));
            entry.0 = bit;
            entry.1.push(why);
        }
        Ok(())
    }

    /// `unit` is not in `shard` (a complete claim of it left out a message it had to return if
    /// it were); the caller has checked that it may be elsewhere.
    fn rule_out(&mut self, unit: ShardUnit, shard: ShardSpec, why: String) {
        let bit = 1 << shard.index;
        let mask = self.mask(unit, shard.count);
        if mask & bit != 0 {
            let entry = self
                .learned
                .entry((unit, shard.count))
                .or_insert((mask, Vec::new()));
            entry.0 = mask & !bit;
            entry.1.push(why);
        }
    }
}

/// Send what `plan` says, in the engine's order: complete, fail, release.
async fn settle_calls(handle: &dyn OutboxStore, plan: &SettlePlan) -> SettleAnswers {
    let mut answers = SettleAnswers {
        complete: None,
        fail: None,
        release: None,
    };
    if !plan.acked.is_empty() {
        answers.complete = Some(handle.complete(plan.token, &plan.acked).await);
    }
    if !plan.failures.is_empty() {
        answers.fail = Some(handle.fail(plan.token, &plan.failures).await);
    }
    if !plan.released.is_empty() {
        answers.release = Some(handle.release(plan.token, &plan.released).await);
    }
    answers
}

/// One relay's part of a [`Step::Together`], planned from the model before the calls.
enum Planned {
    Claim(usize, Option<ShardSpec>),
    Settle(SettlePlan),
    Extend(LeaseToken),
    Skip(&'static str),
}

/// The store's answer to one [`Planned`] move.
enum Answer {
    Claim(Result<Claim, Error>),
    Settle(SettleAnswers),
    Extend(Result<DateTime<Utc>, Error>),
    Skipped,
}

/// How many of `planned` call the store.
fn running_moves(planned: &[Planned]) -> usize {
    planned
        .iter()
        .filter(|p| !matches!(p, Planned::Skip(_)))
        .count()
}

/// Every order of `0..n` (n is at most the number of relays, so a handful).
fn orders(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for rest in orders(n - 1) {
        for at in 0..=rest.len() {
            let mut order = rest.clone();
            order.insert(at, n - 1);
            out.push(order);
        }
    }
    out
}

/// The part of the model a move changes, kept to try the moves of a [`Step::Together`] in
/// another order.
struct Snapshot {
    msgs: Vec<Msg>,
    batches: Vec<Option<Batch>>,
    next_claim: u64,
    attributed: BTreeMap<&'static str, u32>,
    coverage: Coverage,
    shards: ShardMap,
    last_log: Option<String>,
}

#[derive(Default)]
struct RelaySim {
    handle: Option<Arc<dyn OutboxStore>>,
    batch: Option<Batch>,
}

/// Plays scenarios against one fresh store, keeping the reference model beside it.
pub struct Runner<'a> {
    store: &'a dyn HarnessStore,
    caps: HarnessCapabilities,
    admin: Arc<dyn OutboxAdmin>,
    policy: HeadPolicy,
    now: u64,
    msgs: Vec<Msg>,
    by_id: HashMap<Uuid, usize>,
    txs: Vec<Option<Box<dyn HarnessTx>>>,
    /// Per transaction slot, its enqueue that waits for a key lock, if any.
    waiters: Vec<Option<Waiter>>,
    relays: Vec<RelaySim>,
    next_claim: u64,
    purged: u64,
    per_key: [u32; KEYS as usize],
    unordered: u32,
    log: Vec<String>,
    attributed: BTreeMap<&'static str, u32>,
    coverage: Coverage,
    /// The claim being checked ran at the same moment as another relay's call
    /// ([`Step::Together`]): completeness is not required of it (see [`Runner::together`]).
    concurrent_claim: bool,
    /// What sharded claims taught the model about the store's shard function.
    shards: ShardMap,
    /// When the case began (real time): ages the store reports may exceed the model's by the
    /// real time the case took.
    started: std::time::Instant,
}

/// Play `scenario` against `store` and then drain it; on a broken invariant, return a report in
/// words: the invariant, what was seen, and every step as it ran.
pub async fn run_scenario(store: &dyn HarnessStore, scenario: &Scenario) -> Result<(), String> {
    run_scenario_with_coverage(store, scenario)
        .await
        .map(|_| ())
}

/// [`run_scenario`], returning what the scenario exercised when it passes.
pub async fn run_scenario_with_coverage(
    store: &dyn HarnessStore,
    scenario: &Scenario,
) -> Result<Coverage, String> {
    let mut runner = match Runner::new(store, scenario.head_policy).await {
        Ok(runner) => runner,
        Err(v) => return Err(format!("{}: {}", v.invariant, v.detail)),
    };
    let result = runner.play(&scenario.steps).await;
    match result {
        Ok(()) => {
            let mut c = runner.coverage;
            c.dup_ambiguous =
                u64::from(runner.attributed.get(CAUSE_AMBIGUOUS).copied().unwrap_or(0));
            c.dup_crash = u64::from(runner.attributed.get(CAUSE_CRASH).copied().unwrap_or(0));
            c.dup_expiry = u64::from(runner.attributed.get(CAUSE_EXPIRY).copied().unwrap_or(0));
            c.purged = runner.purged;
            Ok(c)
        }
        Err(v) => Err(runner.report(&v)),
    }
}

impl<'a> Runner<'a> {
    async fn new(store: &'a dyn HarnessStore, policy: HeadPolicy) -> Result<Self, Violation> {
        let admin = store
            .admin()
            .await
            .map_err(|e| store_error("opening the admin handle", &e))?;
        Ok(Self {
            caps: store.capabilities(),
            store,
            admin,
            policy,
            now: 0,
            msgs: Vec::new(),
            by_id: HashMap::new(),
            txs: (0..TX_SLOTS).map(|_| None).collect(),
            waiters: (0..TX_SLOTS).map(|_| None).collect(),
            relays: (0..=RELAYS).map(|_| RelaySim::default()).collect(),
            next_claim: 1,
            purged: 0,
            per_key: [0; KEYS as usize],
            unordered: 0,
            log: Vec::new(),
            attributed: BTreeMap::new(),
            coverage: Coverage::default(),
            concurrent_claim: false,
            shards: ShardMap::default(),
            started: std::time::Instant::now(),
        })
    }

    async fn play(&mut self, steps: &[Step]) -> Result<(), Violation> {
        for step in steps {
            self.log.push(format!("{step:?}"));
            self.step(step).await?;
            self.check_counts().await?;
            self.check_status().await?;
        }
        self.log.push(format!("final drain: faults off, every relay crashed, open transactions commit, clock +1 day, dead letters requeued, relay {} drains", relay_name(RELAYS)));
        self.drain().await
    }

    fn report(&self, v: &Violation) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "invariant broken: {}", v.invariant);
        let _ = writeln!(out, "  {}", v.detail);
        let _ = writeln!(out, "head policy {:?}; steps as run:", self.policy);
        for (i, line) in self.log.iter().enumerate() {
            let marker = if i + 1 == self.log.len() {
                "  <-- broke here"
            } else {
                ""
            };
            let _ = writeln!(out, "  {:>2}. {line}{marker}", i + 1);
        }
        if !self.attributed.is_empty() {
            let _ = writeln!(out, "duplicates so far, by cause: {:?}", self.attributed);
        }
        out
    }

    fn note(&mut self, text: impl AsRef<str>) {
        if let Some(last) = self.log.last_mut() {
            last.push_str(" -> ");
            last.push_str(text.as_ref());
        }
    }

    fn label(&self, id: &Uuid) -> String {
        self.by_id.get(id).map_or_else(
            || format!("unknown id {id}"),
            |&i| self.msgs[i].label.clone(),
        )
    }

    fn labels(&self, ids: &[Uuid]) -> String {
        let names: Vec<String> = ids.iter().map(|id| self.label(id)).collect();
        format!("[{}]", names.join(", "))
    }

    fn held_by(&self, i: usize, claim: u64) -> bool {
        matches!(self.msgs[i].status, Status::Leased { claim: c, until } if c == claim && until > self.now)
    }

    async fn handle(&mut self, relay: usize) -> Result<Arc<dyn OutboxStore>, Violation> {
        if let Some(h) = &self.relays[relay].handle {
            return Ok(h.clone());
        }
        let h = self
            .store
            .relay()
            .await
            .map_err(|e| store_error("opening a relay handle", &e))?;
        self.relays[relay].handle = Some(h.clone());
        Ok(h)
    }

    async fn step(&mut self, step: &Step) -> Result<(), Violation> {
        match step {
            Step::Enqueue { tx, messages, end } => {
                let waits = self.enqueue(*tx, messages, *end).await?;
                match end {
                    TxEnd::Open => Ok(()),
                    // A single-writer store has already committed inside `enqueue`; a waiting
                    // enqueue ends its transaction when it returns.
                    _ if !self.caps.concurrent_transactions || waits => Ok(()),
                    TxEnd::Commit => self.end_tx(*tx, true).await,
                    TxEnd::Rollback => self.end_tx(*tx, false).await,
                }
            }
            Step::Writers { key } => {
                let spec = [MsgSpec {
                    key: Some(*key),
                    delayed: false,
                }];
                for slot in 0..TX_SLOTS {
                    self.note(format!("tx{}:", slot + 1));
                    self.enqueue(slot, &spec, TxEnd::Open).await?;
                }
                Ok(())
            }
            Step::Commit { tx } => self.end_tx(*tx, true).await,
            Step::Rollback { tx } => self.end_tx(*tx, false).await,
            Step::Claim {
                relay,
                limit,
                shard,
            } => {
                let relay = usize::from(*relay);
                if self.relays[relay].batch.is_some() {
                    self.note("skipped: it still holds a batch");
                    return Ok(());
                }
                let shard = self.shard_for(*shard);
                self.claim(relay, usize::from(*limit), shard)
                    .await
                    .map(|_| ())
            }
            Step::Cycle {
                relay,
                limit,
                shard,
                outcomes,
                until,
            } => {
                let relay = usize::from(*relay);
                if self.relays[relay].batch.is_some() {
                    self.note("skipped: it still holds a batch");
                    return Ok(());
                }
                let shard = self.shard_for(*shard);
                self.claim(relay, usize::from(*limit), shard).await?;
                if *until == Phase::Claimed {
                    return Ok(());
                }
                self.publish(relay, outcomes)?;
                if *until == Phase::Published {
                    return Ok(());
                }
                self.settle(relay).await
            }
            Step::Stale {
                relay,
                outcomes,
                takeover,
            } => {
                let relay = usize::from(*relay);
                if self.relays[relay].batch.is_some() {
                    self.note("skipped: it still holds a batch");
                    return Ok(());
                }
                if self.claim(relay, 4, None).await? == 0 {
                    self.relays[relay].batch = None;
                    return Ok(());
                }
                self.publish(relay, outcomes)?;
                self.advance(Advance::PastLease).await?;
                let other = (relay + 1) % usize::from(RELAYS);
                if *takeover {
                    if self.relays[other].batch.is_some() {
                        self.note(format!(
                            "relay {} still holds a batch: no takeover",
                            relay_name(other as u8)
                        ));
                    } else {
                        self.claim(other, 4, None).await?;
                    }
                }
                self.settle(relay).await
            }
            Step::Publish { relay, outcomes } => self.publish(usize::from(*relay), outcomes),
            Step::Settle { relay } => self.settle(usize::from(*relay)).await,
            Step::Together { moves } => self.together(moves).await,
            Step::Extend { relay } => self.extend(usize::from(*relay)).await,
            Step::Crash { relay } => {
                self.crash(usize::from(*relay));
                Ok(())
            }
            Step::Advance(a) => self.advance(*a).await,
            Step::Requeue { pick } => self.operator(*pick, true, false).await,
            Step::Discard { pick } => self.operator(*pick, false, false).await,
            Step::Raw { key, form } => self.raw(*key, *form).await,
            Step::RequeueBySeq { pick } => self.operator(*pick, true, true).await,
            Step::DiscardBySeq { pick } => self.operator(*pick, false, true).await,
            Step::Purge { batch } => self.purge(usize::from(*batch)).await,
        }
    }

    /// The shard a generated claim asks for, if the store shards claims; otherwise the claim
    /// goes unsharded (noted), as a relay would send it.
    fn shard_for(&mut self, spec: Option<ShardSpec>) -> Option<ShardSpec> {
        if spec.is_some() && !self.caps.store.sharded_claims {
            self.note("the store does not declare sharded claims: claims unsharded");
            return None;
        }
        spec
    }

    /// A new message of `spec` for transaction slot `slot`, and its model entry (not yet in
    /// the model: see [`Runner::insert_msg`]).
    async fn new_message(
        &mut self,
        spec: MsgSpec,
        slot: u8,
    ) -> Result<(NewMessage, Msg), Violation> {
        let key = spec.key;
        let label = match key {
            Some(k) => {
                self.per_key[usize::from(k)] += 1;
                format!("k{k}#{}", self.per_key[usize::from(k)])
            }
            None => {
                self.unordered += 1;
                format!("u#{}", self.unordered)
            }
        };
        let aggregate = key.map_or_else(|| "none".to_string(), |k| format!("k{k}"));
        let mut message = NewMessage::new(
            "item",
            aggregate,
            "item.changed",
            serde_json::json!({ "label": label }),
        );
        if key.is_none() {
            message = message.unordered();
        }
        let mut not_before = 0;
        if spec.delayed {
            let store_now = self.store.now().await.map_err(|e| store_error("now", &e))?;
            let delay = outbox_traits::chrono::Duration::from_std(NOT_BEFORE)
                .map_err(|e| violation("test setup", e.to_string()))?;
            message = message.not_before(store_now + delay);
            not_before = self.now + NOT_BEFORE.as_secs();
        }
        let msg = Msg {
            id: message.id,
            label,
            key,
            order: 0,
            status: Status::Open(slot),
            attempts: 0,
            due: 0,
            last_error: None,
            seq: None,
            delivered: 0,
            causes: Vec::new(),
            ever_dead: false,
            published_at: None,
            not_before,
            due_unknown: false,
            created: self.now,
            created_unsure: false,
        };
        Ok((message, msg))
    }

    /// A SQL writer's plain `INSERT` of one message of `key`, committed at once (see
    /// [`Step::Raw`]). Skipped when the harness cannot write raw rows, and when an open
    /// transaction wrote `key`: a SQL writer takes no key lock, so with key locks it would
    /// pass the lock's holder, which the model does not allow for.
    async fn raw(&mut self, key: Option<u8>, form: u8) -> Result<(), Violation> {
        if !self.caps.raw_rows {
            self.note("skipped: the harness cannot write raw rows");
            return Ok(());
        }
        let open_writer = |m: &Msg| m.key.is_some() && m.key == key;
        if key.is_some()
            && (self
                .msgs
                .iter()
                .any(|m| open_writer(m) && matches!(m.status, Status::Open(_)))
                || self
                    .waiters
                    .iter()
                    .flatten()
                    .any(|w| w.msgs.iter().any(open_writer)))
        {
            self.note("skipped: an open transaction wrote the key");
            return Ok(());
        }
        let (message, mut msg) = self
            .new_message(
                MsgSpec {
                    key,
                    delayed: false,
                },
                0,
            )
            .await?;
        let lower = msg.id.to_string();
        let id = match form % 3 {
            0 => lower.to_uppercase(),
            1 => lower
                .chars()
                .enumerate()
                .map(|(i, c)| {
                    if i % 3 == 0 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    }
                })
                .collect(),
            _ => lower,
        };
        let row = RawRow {
            id: Some(id.clone()),
            payload: format!("{{ \"label\" :\t{:?} }}", msg.label),
            // Left out, the key is the aggregate id; '' is unordered.
            partition_key: match (key, form % 3) {
                (None, _) => Some(String::new()),
                (Some(_), 2) => None,
                (Some(k), _) => Some(format!("k{k}")),
            },
            ..RawRow::new(
                message.aggregate_type.clone(),
                message.aggregate_id.clone(),
                message.event_type.clone(),
                "{}",
            )
        };
        self.store
            .insert_raw(&[row], true)
            .await
            .map_err(|e| store_error("insert_raw", &e))?;
        msg.status = Status::Pending;
        msg.due = self.now;
        self.coverage.committed += 1;
        self.coverage.raw += 1;
        self.note(format!("inserted {} as id {id}", msg.label));
        self.insert_msg(msg);
        Ok(())
    }

    /// Enter `m` into the model as inserted now: its insert order is after every message
    /// entered so far.
    fn insert_msg(&mut self, mut m: Msg) {
        m.order = self.msgs.len();
        self.by_id.insert(m.id, m.order);
        self.msgs.push(m);
    }

    /// Enqueue into slot `slot`; a single-writer store ends the transaction at once, committing
    /// it unless `end` is a rollback. Returns whether the enqueue waits for a key lock (or the
    /// slot's earlier enqueue still does): then the transaction is not ended here, and `end`
    /// applies once the enqueue returns.
    ///
    /// Open transactions may write the same key. Without key locks both insert at once, and
    /// the later-inserted message may be claimed (and published) while the earlier one is
    /// uncommitted: the invariants check the contract's rule for that (see
    /// [`Runner::check_claim`]). With [`HarnessCapabilities::key_locks`], an enqueue writing a
    /// key another open transaction wrote waits for it (see [`Runner::wake_waiters`]), while
    /// the holder may go on writing the key. A key that a transaction whose enqueue waits
    /// holds or waits for is not written by any other that does not hold it already (skipped
    /// and noted), as that writer would wait for the waiter and the waiter for it: a deadlock
    /// the database breaks by failing one of them, which is not what the property is about.
    async fn enqueue(
        &mut self,
        slot: u8,
        specs: &[MsgSpec],
        end: TxEnd,
    ) -> Result<bool, Violation> {
        let concurrent = self.caps.concurrent_transactions;
        let key_locks = concurrent && self.caps.key_locks;
        let slot_ix = usize::from(slot);
        if self.waiters[slot_ix].is_some() {
            self.note(format!(
                "skipped: tx{}'s earlier enqueue still waits for a key lock",
                slot + 1
            ));
            return Ok(true);
        }
        // The other open transactions that wrote each key, or wait to write it.
        let mut holders: BTreeMap<u8, BTreeSet<u8>> = BTreeMap::new();
        for m in &self.msgs {
            if let (Status::Open(s), Some(k)) = (m.status, m.key) {
                if s != slot {
                    holders.entry(k).or_default().insert(s);
                }
            }
        }
        let mut waiting = BTreeSet::new();
        for (s, w) in self.waiters.iter().enumerate() {
            if let Some(w) = w {
                let s = s as u8;
                waiting.insert(s);
                for k in w.msgs.iter().filter_map(|m| m.key) {
                    holders.entry(k).or_default().insert(s);
                }
            }
        }
        let mut batch = Vec::new();
        let mut msgs = Vec::new();
        let mut skipped = Vec::new();
        let mut wait_for = BTreeSet::new();
        let mut shared = BTreeSet::new();
        // Keys this transaction already wrote: with key locks it holds them, so writing them
        // again never waits (others of them can only be waiting for it).
        let own: BTreeSet<u8> = self
            .msgs
            .iter()
            .filter(|m| m.status == Status::Open(slot))
            .filter_map(|m| m.key)
            .collect();
        for spec in specs {
            if let Some(k) = spec.key {
                if let Some(hs) = holders.get(&k) {
                    let holds = key_locks && own.contains(&k);
                    if !holds && hs.iter().any(|h| waiting.contains(h)) {
                        skipped.push(format!("k{k}"));
                        continue;
                    }
                    shared.insert(k);
                    if key_locks && !holds {
                        wait_for.extend(hs.iter().copied());
                    }
                }
            }
            let (message, msg) = self.new_message(*spec, slot).await?;
            batch.push(message);
            msgs.push(msg);
        }
        let labels: Vec<&str> = msgs.iter().map(|m| m.label.as_str()).collect();
        let mut text = format!("wrote [{}]", labels.join(", "));
        if !shared.is_empty() {
            self.coverage.same_key_writers += 1;
            let keys: Vec<String> = shared.iter().map(|k| format!("k{k}")).collect();
            let _ = write!(
                text,
                " (key {} also written by another open tx)",
                keys.join(", ")
            );
        }
        if !skipped.is_empty() {
            let _ = write!(
                text,
                " (skipped {}: held by a tx whose enqueue waits for a key lock)",
                skipped.join(", ")
            );
        }
        if batch.is_empty() {
            self.note(text);
            return Ok(false);
        }
        let mut tx = match self.txs[slot_ix].take() {
            Some(tx) => tx,
            None => self
                .store
                .begin()
                .await
                .map_err(|e| store_error("begin", &e))?,
        };
        if !wait_for.is_empty() {
            // The store's enqueue blocks until the holders end, which later steps decide: run
            // it in the background on its transaction.
            let names: Vec<String> = wait_for.iter().map(|h| format!("tx{}", h + 1)).collect();
            let _ = write!(
                text,
                ": waits for {} (key lock), in the background",
                names.join(", ")
            );
            self.note(text);
            self.coverage.waited += 1;
            let task = tokio::spawn(async move {
                let result = tx.enqueue(&batch).await;
                (tx, result)
            });
            self.waiters[slot_ix] = Some(Waiter {
                task,
                msgs,
                holders: wait_for,
                then: end,
            });
            return Ok(true);
        }
        for m in msgs {
            self.insert_msg(m);
        }
        // With key locks, an enqueue whose keys no other open transaction holds must not wait:
        // bounded, so that one that does fails the case with a report instead of hanging.
        let result = if key_locks {
            match tokio::time::timeout(KEY_LOCK_GUARD, tx.enqueue(&batch)).await {
                Ok(result) => result,
                Err(_) => {
                    self.note(text);
                    return Err(violation(
                        "key locks",
                        format!(
                            "tx{}'s enqueue had not returned after {KEY_LOCK_GUARD:?}, although no other open transaction wrote any of its keys: key locks must not make writers of different keys wait for each other",
                            slot + 1
                        ),
                    ));
                }
            }
        } else {
            tx.enqueue(&batch).await
        };
        self.txs[slot_ix] = Some(tx);
        result.map_err(|e| store_error("enqueue", &e))?;
        if !concurrent {
            // One writer: the transaction opens, writes and ends within this step.
            text.push_str(" (store allows one open transaction: ends at once)");
            self.note(text);
            self.end_tx(slot, end != TxEnd::Rollback).await?;
            return Ok(false);
        }
        self.note(text);
        Ok(false)
    }

    /// End transaction `slot` (commit or roll back), then let the enqueues that waited for it
    /// return. A transaction whose enqueue still waits is not ended (skipped and noted).
    async fn end_tx(&mut self, slot: u8, commit: bool) -> Result<(), Violation> {
        if self.waiters[usize::from(slot)].is_some() {
            self.note("skipped: its enqueue still waits for a key lock");
            return Ok(());
        }
        self.check_still_waiting(slot).await?;
        self.end_tx_now(slot, commit).await?;
        self.wake_waiters().await
    }

    /// Key locks: no enqueue that waits for `slot` has returned while `slot` is still open.
    async fn check_still_waiting(&mut self, slot: u8) -> Result<(), Violation> {
        if self.txs[usize::from(slot)].is_none() {
            return Ok(());
        }
        for w in 0..self.waiters.len() {
            let returned = self.waiters[w]
                .as_ref()
                .is_some_and(|x| x.holders.contains(&slot) && x.task.is_finished());
            if !returned {
                continue;
            }
            let Some(waiter) = self.waiters[w].take() else {
                continue;
            };
            let labels: Vec<&str> = waiter.msgs.iter().map(|m| m.label.as_str()).collect();
            let how = match waiter.task.await {
                Ok((_, Ok(()))) => "returned".to_string(),
                Ok((_, Err(e))) => format!("failed ({e})"),
                Err(e) => format!("panicked ({e})"),
            };
            return Err(violation(
                "key locks",
                format!(
                    "tx{}'s enqueue of [{}] {how} while tx{}, which wrote one of its keys, was still open: with key locks it must wait until tx{} ends",
                    w + 1,
                    labels.join(", "),
                    slot + 1,
                    slot + 1
                ),
            ));
        }
        Ok(())
    }

    /// Await every waiting enqueue whose holders have all ended: its messages are inserted
    /// now, after everything the holders wrote, and the step that enqueued ends the
    /// transaction as it said. Repeats while that ends further holders.
    async fn wake_waiters(&mut self) -> Result<(), Violation> {
        loop {
            let ready = (0..self.waiters.len()).find(|&w| {
                self.waiters[w].as_ref().is_some_and(|x| {
                    x.holders.iter().all(|&h| {
                        self.txs[usize::from(h)].is_none() && self.waiters[usize::from(h)].is_none()
                    })
                })
            });
            let Some(w) = ready else {
                return Ok(());
            };
            let Some(waiter) = self.waiters[w].take() else {
                return Ok(());
            };
            let labels: Vec<String> = waiter.msgs.iter().map(|m| m.label.clone()).collect();
            let held: Vec<String> = waiter
                .holders
                .iter()
                .map(|h| format!("tx{}", h + 1))
                .collect();
            let (tx, result) = match tokio::time::timeout(KEY_LOCK_GUARD, waiter.task).await {
                Ok(Ok(done)) => done,
                Ok(Err(e)) => {
                    return Err(violation(
                        "store error",
                        format!("the waiting enqueue of tx{} panicked: {e}", w + 1),
                    ))
                }
                Err(_) => {
                    return Err(violation(
                        "key locks",
                        format!(
                            "tx{}'s enqueue of [{}] had not returned {KEY_LOCK_GUARD:?} after {}, which held its keys, ended",
                            w + 1,
                            labels.join(", "),
                            held.join(", ")
                        ),
                    ))
                }
            };
            self.txs[w] = Some(tx);
            result.map_err(|e| store_error("enqueue (after waiting for a key lock)", &e))?;
            for m in waiter.msgs {
                self.insert_msg(m);
            }
            self.note(format!(
                "tx{}'s enqueue returned once {} ended: wrote [{}]",
                w + 1,
                held.join(", "),
                labels.join(", ")
            ));
            let slot = w as u8;
            if waiter.then != TxEnd::Open {
                self.check_still_waiting(slot).await?;
                self.end_tx_now(slot, waiter.then == TxEnd::Commit).await?;
            }
        }
    }

    async fn end_tx_now(&mut self, slot: u8, commit: bool) -> Result<(), Violation> {
        let Some(tx) = self.txs[usize::from(slot)].take() else {
            self.note("skipped: no open transaction");
            return Ok(());
        };
        if commit {
            tx.commit().await.map_err(|e| store_error("commit", &e))?;
        } else {
            tx.rollback()
                .await
                .map_err(|e| store_error("rollback", &e))?;
        }
        let now = self.now;
        let mut ids = Vec::new();
        let highest_claimed = self
            .msgs
            .iter()
            .filter(|m| m.seq.is_some())
            .map(|m| m.order)
            .max();
        for m in &mut self.msgs {
            if m.status == Status::Open(slot) {
                if commit {
                    self.coverage.committed += 1;
                    if highest_claimed.is_some_and(|h| h > m.order) {
                        self.coverage.late_commits += 1;
                    }
                } else {
                    self.coverage.rolled_back += 1;
                }
                m.status = if commit {
                    Status::Pending
                } else {
                    Status::RolledBack
                };
                m.due = now.max(m.not_before);
                ids.push(m.id);
            }
        }
        let labels = self.labels(&ids);
        self.note(if commit {
            format!("committed {labels}")
        } else {
            format!("rolled back {labels}")
        });
        Ok(())
    }

    /// Claim for `relay` (of one shard, if `shard` says so) and check the claim against the
    /// model; returns the claimed count.
    async fn claim(
        &mut self,
        relay: usize,
        limit: usize,
        shard: Option<ShardSpec>,
    ) -> Result<usize, Violation> {
        let handle = self.handle(relay).await?;
        let before = self.store_now().await?;
        let claim = claim_call(&*handle, limit, self.policy, shard).await;
        let after = self.store_now().await?;
        self.apply_claim(relay, limit, shard, &claim, before, after)
    }

    /// Check what a claim of `limit` (of `shard`, if any) by `relay` returned against the model
    /// and record it; `before` and `after` are the store's clock just before and just after
    /// the call.
    fn apply_claim(
        &mut self,
        relay: usize,
        limit: usize,
        shard: Option<ShardSpec>,
        claim: &Result<Claim, Error>,
        before: DateTime<Utc>,
        after: DateTime<Utc>,
    ) -> Result<usize, Violation> {
        let claim = claim.as_ref().map_err(|e| store_error("claim", e))?;
        let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
        self.note(format!("got {}", self.labels(&ids)));
        self.check_claim(claim, limit)?;
        if let Some(shard) = shard {
            self.check_shard(&ids, shard)?;
            if !ids.is_empty() {
                self.coverage.sharded += 1;
            }
        }
        self.check_complete(&ids, limit, shard)?;
        if !ids.is_empty() {
            check_lease_end(
                "claim",
                "Claim::lease_until",
                claim.lease_until,
                before,
                after,
            )?;
        }
        self.coverage.held_back += self.held_back_count(&ids) as u64;
        // Earlier messages of the claimed messages' keys that are still uncommitted: the
        // contract lets this claim, and the deliveries of its batch, pass them.
        let mut passed = HashSet::new();
        for id in &ids {
            let i = self.by_id[id];
            let Some(k) = self.msgs[i].key else {
                continue;
            };
            let open: Vec<Uuid> = self.msgs[..i]
                .iter()
                .filter(|p| p.key == Some(k) && matches!(p.status, Status::Open(_)))
                .map(|p| p.id)
                .collect();
            if !open.is_empty() {
                self.coverage.overtaken += 1;
                passed.extend(open);
            }
        }
        let serial = self.next_claim;
        self.next_claim += 1;
        let until = self.now + LEASE.as_secs();
        for id in &ids {
            let i = self.by_id[id];
            if let Status::Leased { claim: old, .. } = self.msgs[i].status {
                // Taken over after expiry: if the old holder already published it, this
                // relay will publish it again.
                let old_delivered = self.relays.iter().any(|r| {
                    r.batch
                        .as_ref()
                        .is_some_and(|b| b.claim == old && b.delivered.contains(id))
                });
                if old_delivered {
                    self.msgs[i].causes.push(CAUSE_EXPIRY);
                }
            }
            self.msgs[i].status = Status::Leased {
                claim: serial,
                until,
            };
            // From here on its due time comes from committed, shifted timestamps.
            self.msgs[i].due_unknown = false;
        }
        let n = ids.len();
        if n == 0 {
            // Nothing claimed: the relay holds nothing (a token with no messages is moot).
            return Ok(0);
        }
        if let Some(shard) = shard {
            if self.another_shard_held(relay, shard) {
                self.coverage.disjoint_shards += 1;
            }
        }
        self.relays[relay].batch = Some(Batch {
            claim: serial,
            token: claim.token,
            ids,
            outcomes: None,
            delivered: Vec::new(),
            passed,
            shard,
        });
        Ok(n)
    }

    /// Whether a relay other than `relay` holds a live lease on a message it claimed as another
    /// shard of `shard`'s count.
    fn another_shard_held(&self, relay: usize, shard: ShardSpec) -> bool {
        self.relays.iter().enumerate().any(|(r, sim)| {
            r != relay
                && sim.batch.as_ref().is_some_and(|b| {
                    b.shard
                    .is_some_and(|s| s.count == shard.count && s.index != shard.index)
                    && b.ids.iter().any(|id| {
                        matches!(
                            self.msgs[self.by_id[id]].status,
                            Status::Leased { claim, until } if claim == b.claim && until > self.now
                        )
                    })
                })
        })
    }

    /// The store's clock ([`HarnessStore::now`]).
    async fn store_now(&self) -> Result<DateTime<Utc>, Violation> {
        self.store.now().await.map_err(|e| store_error("now", &e))
    }

    /// The unit whose shard message `i` is in: its key, or itself when unordered.
    fn unit_of(&self, i: usize) -> ShardUnit {
        match self.msgs[i].key {
            Some(k) => ShardUnit::Key(k),
            None => ShardUnit::Unordered(self.msgs[i].id),
        }
    }

    fn unit_name(&self, unit: ShardUnit) -> String {
        match unit {
            ShardUnit::Key(k) => format!("key k{k}"),
            ShardUnit::Unordered(id) => format!("the unordered {}", self.label(&id)),
        }
    }

    /// Shard consistency: every message a claim of `shard` returned may be in that shard by
    /// what the model learned so far, and is then known to be there.
    fn check_shard(&mut self, claimed: &[Uuid], shard: ShardSpec) -> Result<(), Violation> {
        for id in claimed {
            let i = self.by_id[id];
            let unit = self.unit_of(i);
            let label = self.msgs[i].label.clone();
            let why = format!("a claim of {shard:?} returned {label}");
            if self.shards.pin(unit, shard, why).is_err() {
                return Err(violation(
                    "shard consistency",
                    format!(
                        "a claim of {shard:?} returned {label}, but {} is not in that shard ({}): every message of a key must be in one shard, and each unordered message in one",
                        self.unit_name(unit),
                        self.shards.why(unit, shard.count)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Completeness: a claim that came back with fewer than `limit` messages returned every
    /// message the contract requires of it (see [`required_by_claim`](Self::required_by_claim)).
    /// For a claim of one shard, a required message whose key (or itself) may be in another
    /// shard rules this one out for it instead (see the module docs).
    fn check_complete(
        &mut self,
        claimed: &[Uuid],
        limit: usize,
        shard: Option<ShardSpec>,
    ) -> Result<(), Violation> {
        if claimed.len() >= limit || self.concurrent_claim {
            return Ok(());
        }
        let mut missing: Vec<Uuid> = self
            .required_by_claim(limit, shard)
            .into_iter()
            .map(|i| self.msgs[i].id)
            .filter(|id| !claimed.contains(id))
            .collect();
        let mut in_shard = String::new();
        if let Some(shard) = shard {
            let mut sure = Vec::new();
            for id in missing {
                let i = self.by_id[&id];
                let unit = self.unit_of(i);
                if self.shards.is_in(unit, shard) {
                    if sure.is_empty() {
                        in_shard = format!(
                            "; {} is in {shard:?} ({})",
                            self.unit_name(unit),
                            self.shards.why(unit, shard.count)
                        );
                    }
                    sure.push(id);
                } else {
                    let why = format!(
                        "a claim of {shard:?} with limit {limit} returned {} message(s) without the claimable {}",
                        claimed.len(),
                        self.msgs[i].label
                    );
                    self.shards.rule_out(unit, shard, why);
                    self.coverage.shard_ruled_out += 1;
                }
            }
            missing = sure;
        }
        if missing.is_empty() {
            return Ok(());
        }
        let i = self.by_id[&missing[0]];
        let key_note = match self.msgs[i].key {
            Some(k) => format!("nothing earlier of key k{k} holds it back"),
            None => "it is unordered".to_string(),
        };
        let of = shard.map_or_else(String::new, |s| format!(" of {s:?}"));
        Err(violation(
            "claim completeness",
            format!(
                "claim{of} with limit {limit} returned {} message(s) but left out {}, which it had to return: {} is {} and {key_note}{in_shard}",
                claimed.len(),
                self.labels(&missing),
                self.msgs[i].label,
                describe(self.msgs[i].status, self.now),
            ),
        ))
    }

    /// The messages a claim of `limit` must return when it returns fewer than `limit`, by the
    /// model's knowledge of what is claimable (the completeness invariant of the guide):
    ///
    /// - a message is *eligible* when it is committed, pending and due (or leased with an
    ///   expired lease), and every earlier message of its key that holds the key back
    ///   (pending, leased, or dead under [`HeadPolicy::Block`]) is eligible too;
    /// - a *head* is an eligible message with no earlier eligible message of its key, or an
    ///   eligible unordered message;
    /// - the *minimal window* is the first `limit` committed unpublished messages (pending,
    ///   leased or dead) in `seq` order.
    ///
    /// Required: every head, and every eligible message within the minimal window. A store that
    /// reads a bounded stretch of the backlog may leave out a key's later eligible messages
    /// past its window, but not heads, and its window is at least `limit` rows long.
    ///
    /// For a claim of one shard, only messages that may be in the shard count, for the window
    /// too: each message returned is required if its key (or it, unordered) is in the shard.
    fn required_by_claim(&self, limit: usize, shard: Option<ShardSpec>) -> Vec<usize> {
        let now = self.now;
        let claimable = |m: &Msg| match m.status {
            Status::Pending => m.due <= now && !m.due_unknown,
            Status::Leased { until, .. } => until <= now,
            _ => false,
        };
        let holds_back = |m: &Msg| match m.status {
            Status::Pending | Status::Leased { .. } => true,
            Status::Dead => self.policy == HeadPolicy::Block,
            _ => false,
        };
        let mut blocked = [false; KEYS as usize];
        let mut seen_eligible = [false; KEYS as usize];
        let mut window_left = limit;
        let mut required = Vec::new();
        for (i, m) in self.msgs.iter().enumerate() {
            if shard.is_some_and(|s| !self.shards.may_be_in(self.unit_of(i), s)) {
                continue;
            }
            let in_window = window_left > 0
                && matches!(
                    m.status,
                    Status::Pending | Status::Leased { .. } | Status::Dead
                );
            if in_window {
                window_left -= 1;
            }
            match m.key {
                None => {
                    if claimable(m) {
                        required.push(i);
                    }
                }
                Some(k) => {
                    let k = usize::from(k);
                    if blocked[k] {
                        continue;
                    }
                    if claimable(m) {
                        if !seen_eligible[k] || in_window {
                            required.push(i);
                        }
                        seen_eligible[k] = true;
                    } else if holds_back(m) {
                        blocked[k] = true;
                    }
                }
            }
        }
        required
    }

    /// Due messages a claim did not return because an earlier message of their key holds them
    /// back (for coverage only).
    fn held_back_count(&self, claimed: &[Uuid]) -> usize {
        let now = self.now;
        let blocks = |q: &Msg| match q.status {
            Status::Leased { until, .. } => until > now,
            Status::Pending => q.due > now,
            Status::Dead => self.policy == HeadPolicy::Block,
            _ => false,
        };
        self.msgs
            .iter()
            .filter(|p| p.status == Status::Pending && p.due <= now && !claimed.contains(&p.id))
            .filter(|p| {
                p.key.is_some()
                    && self.msgs[..p.order]
                        .iter()
                        .any(|q| q.key == p.key && !claimed.contains(&q.id) && blocks(q))
            })
            .count()
    }

    fn check_claim(&mut self, claim: &Claim, limit: usize) -> Result<(), Violation> {
        if claim.messages.len() > limit {
            return Err(violation(
                "claim limit",
                format!(
                    "claim with limit {limit} returned {} messages",
                    claim.messages.len()
                ),
            ));
        }
        let mut seen = HashSet::new();
        for (pos, m) in claim.messages.iter().enumerate() {
            let Some(&i) = self.by_id.get(&m.id) else {
                return Err(violation(
                    "no phantom",
                    format!(
                        "claim returned message id {} that was never enqueued (a phantom, or an id that changed between attempts)",
                        m.id
                    ),
                ));
            };
            let label = self.msgs[i].label.clone();
            if !seen.insert(m.id) {
                return Err(violation(
                    "claim exclusivity",
                    format!("claim returned {label} twice"),
                ));
            }
            let now = self.now;
            let msg = &self.msgs[i];
            let refused = match msg.status {
                Status::Open(slot) => Some((
                    "no phantom",
                    format!("{label} is in transaction tx{}, not committed", slot + 1),
                )),
                Status::RolledBack => Some(("no phantom", format!("{label} was rolled back"))),
                Status::Discarded => Some(("no phantom", format!("{label} was discarded"))),
                Status::Published => {
                    Some(("claim eligibility", format!("{label} is already published")))
                }
                Status::Dead => Some(("claim eligibility", format!("{label} is dead"))),
                Status::Leased { until, .. } if until > now => Some((
                    "claim exclusivity",
                    format!(
                        "{label} is leased to another claim for {} more seconds",
                        until - now
                    ),
                )),
                Status::Pending if msg.due > now => Some((
                    "claim eligibility",
                    format!("{label} is not due for {} more seconds", msg.due - now),
                )),
                _ => None,
            };
            if let Some((invariant, detail)) = refused {
                return Err(violation(invariant, format!("claim returned {detail}")));
            }
            if m.attempts != msg.attempts {
                return Err(violation(
                    "exact attempts",
                    format!(
                        "claim returned {label} with attempts {}, expected {}",
                        m.attempts, msg.attempts
                    ),
                ));
            }
            self.check_payload(i, m)?;
            self.check_seq(i, m.seq)?;
            // Per-key order: every earlier committed unpublished message of the key (pending,
            // leased, or dead under Block) is in this claim, before this one. An earlier message
            // still uncommitted (`Open`) does not hold the key back: it may be passed (see the
            // module docs).
            if let Some(k) = self.msgs[i].key {
                let earlier_in_claim: HashSet<Uuid> =
                    claim.messages[..pos].iter().map(|m| m.id).collect();
                for p in &self.msgs[..self.msgs[i].order] {
                    let holds_back = p.key == Some(k)
                        && match p.status {
                            Status::Pending | Status::Leased { .. } => true,
                            Status::Dead => self.policy == HeadPolicy::Block,
                            _ => false,
                        };
                    if holds_back && !earlier_in_claim.contains(&p.id) {
                        return Err(violation(
                            "per-key order",
                            format!(
                                "claim returned {label} while the earlier {} of key k{k} ({}) was not returned before it",
                                p.label,
                                describe(p.status, self.now)
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn check_payload(&self, i: usize, m: &Message) -> Result<(), Violation> {
        let label = &self.msgs[i].label;
        let got: Option<serde_json::Value> = serde_json::from_str(&m.payload).ok();
        let want = serde_json::json!({ "label": label });
        if got.as_ref() != Some(&want) {
            return Err(violation(
                "message integrity",
                format!("{label} came back with payload {:?}", m.payload),
            ));
        }
        Ok(())
    }

    fn check_seq(&mut self, i: usize, seq: i64) -> Result<(), Violation> {
        if let Some(old) = self.msgs[i].seq {
            if old != seq {
                return Err(violation(
                    "stable seq",
                    format!("{} changed seq from {old} to {seq}", self.msgs[i].label),
                ));
            }
            return Ok(());
        }
        for other in &self.msgs {
            if let Some(s) = other.seq {
                if (other.order < i) != (s < seq) {
                    return Err(violation(
                        "seq follows insert order",
                        format!(
                            "{} (inserted {}) has seq {seq}, {} (inserted {}) has seq {s}",
                            self.msgs[i].label,
                            if other.order < i { "later" } else { "earlier" },
                            other.label,
                            if other.order < i { "earlier" } else { "later" },
                        ),
                    ));
                }
            }
        }
        self.msgs[i].seq = Some(seq);
        Ok(())
    }

    fn publish(&mut self, relay: usize, specs: &[OutcomeSpec]) -> Result<(), Violation> {
        let Some(batch) = self.relays[relay].batch.as_ref() else {
            self.note("skipped: nothing claimed");
            return Ok(());
        };
        if batch.outcomes.is_some() {
            self.note("skipped: already published");
            return Ok(());
        }
        let ids = batch.ids.clone();
        let claim = batch.claim;
        let passed = batch.passed.clone();
        let mut stopped = HashSet::new();
        let mut resolved = Vec::with_capacity(ids.len());
        let mut words = Vec::new();
        let mut delivered_ids = Vec::new();
        for (n, id) in ids.iter().enumerate() {
            let i = self.by_id[id];
            let key = self.msgs[i].key;
            let spec = specs
                .get(n % specs.len().max(1))
                .copied()
                .unwrap_or(OutcomeSpec::Ack);
            if key.is_some_and(|k| stopped.contains(&k)) {
                resolved.push(Resolved::NotAttempted);
                words.push(format!("{} not attempted", self.msgs[i].label));
                continue;
            }
            let (outcome, delivered) = match spec {
                OutcomeSpec::Ack => (Resolved::Ack, true),
                OutcomeSpec::Transient(_) => (
                    Resolved::Retry {
                        delay: spec.delay(),
                        reason: "transient: broker unavailable".into(),
                    },
                    false,
                ),
                OutcomeSpec::Ambiguous(_) => (
                    Resolved::Retry {
                        delay: spec.delay(),
                        reason: "ambiguous: timed out after sending".into(),
                    },
                    true,
                ),
                OutcomeSpec::Permanent => (
                    Resolved::Dead {
                        reason: "permanent: broker rejected the message".into(),
                    },
                    false,
                ),
            };
            if !matches!(outcome, Resolved::Ack) {
                if let Some(k) = key {
                    stopped.insert(k);
                }
            }
            words.push(format!("{} {spec:?}", self.msgs[i].label));
            if delivered {
                delivered_ids.push(*id);
                let stale = !self.held_by(i, claim);
                self.deliver(i, stale, &passed)?;
                if matches!(spec, OutcomeSpec::Ambiguous(_)) {
                    self.msgs[i].causes.push(CAUSE_AMBIGUOUS);
                }
            }
            resolved.push(outcome);
        }
        self.note(words.join(", "));
        if let Some(batch) = self.relays[relay].batch.as_mut() {
            batch.outcomes = Some(resolved);
            batch.delivered = delivered_ids;
        }
        Ok(())
    }

    /// Record one delivery of message `i` to the broker and check order and duplicates.
    ///
    /// Per-key order of deliveries: a message's first delivery comes after the first delivery
    /// of every earlier message of its key, except one rolled back or discarded, one dead under
    /// [`HeadPolicy::Skip`], and one in `passed`: still uncommitted when the batch delivering
    /// it was claimed (the contract's allowance for concurrent writers of a key).
    fn deliver(&mut self, i: usize, stale: bool, passed: &HashSet<Uuid>) -> Result<(), Violation> {
        let label = self.msgs[i].label.clone();
        if self.msgs[i].delivered == 0 {
            if let Some(k) = self.msgs[i].key {
                for p in &self.msgs[..self.msgs[i].order] {
                    if p.key != Some(k)
                        || matches!(p.status, Status::RolledBack | Status::Discarded)
                        || p.delivered > 0
                        || (self.policy == HeadPolicy::Skip && p.ever_dead)
                        || passed.contains(&p.id)
                    {
                        continue;
                    }
                    return Err(violation(
                        "per-key order",
                        format!(
                            "{label} was delivered for the first time before the earlier {} of key k{k} ({})",
                            p.label,
                            describe(p.status, self.now)
                        ),
                    ));
                }
            }
        } else if stale {
            *self.attributed.entry(CAUSE_EXPIRY).or_default() += 1;
        } else if let Some(cause) = self.msgs[i].causes.pop() {
            *self.attributed.entry(cause).or_default() += 1;
        } else {
            return Err(violation(
                "duplicates only from listed causes",
                format!(
                    "{label} was delivered again (delivery {}) with no ambiguous publish, crash after publish or lease expiry to explain it",
                    self.msgs[i].delivered + 1
                ),
            ));
        }
        if stale {
            // The relay that holds it now will deliver it again.
            self.msgs[i].causes.push(CAUSE_EXPIRY);
        }
        self.msgs[i].delivered += 1;
        self.coverage.deliveries += 1;
        Ok(())
    }

    fn expect_fenced(
        &self,
        what: &str,
        result: &Result<(), Error>,
        lost: &[Uuid],
    ) -> Result<(), Violation> {
        match result {
            Ok(()) if lost.is_empty() => Ok(()),
            Ok(()) => Err(violation(
                "fencing",
                format!(
                    "{what} succeeded, but the lease on {} was no longer held (expired or taken over): it must return LeaseLost and change nothing",
                    self.labels(lost)
                ),
            )),
            Err(Error::LeaseLost { ids }) => {
                let got: HashSet<Uuid> = ids.iter().copied().collect();
                let want: HashSet<Uuid> = lost.iter().copied().collect();
                if got == want {
                    Ok(())
                } else {
                    Err(violation(
                        "fencing",
                        format!(
                            "{what} returned LeaseLost for {}, expected it for exactly {}",
                            self.labels(ids),
                            self.labels(lost)
                        ),
                    ))
                }
            }
            Err(e) => Err(store_error(what, e)),
        }
    }

    async fn settle(&mut self, relay: usize) -> Result<(), Violation> {
        let Some(plan) = self.settle_plan(relay) else {
            self.note("skipped: nothing claimed");
            return Ok(());
        };
        let handle = self.handle(relay).await?;
        let answers = settle_calls(&*handle, &plan).await;
        self.apply_settle(&plan, &answers)
    }

    /// Take `relay`'s batch and decide what settling it sends: complete the acknowledged,
    /// fail the failed (dead on the last attempt), release those not attempted.
    fn settle_plan(&mut self, relay: usize) -> Option<SettlePlan> {
        let batch = self.relays[relay].batch.take()?;
        let outcomes = batch
            .outcomes
            .clone()
            .unwrap_or_else(|| vec![Resolved::NotAttempted; batch.ids.len()]);
        let mut plan = SettlePlan {
            claim: batch.claim,
            token: batch.token,
            acked: Vec::new(),
            failures: Vec::new(),
            released: Vec::new(),
        };
        for (id, outcome) in batch.ids.iter().zip(&outcomes) {
            let i = self.by_id[id];
            match outcome {
                Resolved::Ack => plan.acked.push(*id),
                Resolved::NotAttempted => plan.released.push(*id),
                Resolved::Retry { delay, reason } => {
                    let action = if self.msgs[i].attempts + 1 >= MAX_ATTEMPTS {
                        FailAction::Dead
                    } else {
                        FailAction::Retry { delay: *delay }
                    };
                    plan.failures.push(Failure {
                        id: *id,
                        error: reason.clone(),
                        action,
                    });
                }
                Resolved::Dead { reason } => plan.failures.push(Failure {
                    id: *id,
                    error: reason.clone(),
                    action: FailAction::Dead,
                }),
            }
        }
        Some(plan)
    }

    /// Check the store's answers to a settle against the model (fencing: exactly the leases
    /// no longer held are refused) and record the transitions.
    fn apply_settle(
        &mut self,
        plan: &SettlePlan,
        answers: &SettleAnswers,
    ) -> Result<(), Violation> {
        let lost_of = |this: &Self, ids: &[Uuid]| -> Vec<Uuid> {
            ids.iter()
                .copied()
                .filter(|id| !this.held_by(this.by_id[id], plan.claim))
                .collect()
        };
        let mut words = Vec::new();
        if let Some(result) = &answers.complete {
            let acked = &plan.acked;
            let lost = lost_of(self, acked);
            self.coverage.lease_lost += lost.len() as u64;
            self.expect_fenced("complete", result, &lost)?;
            for id in acked {
                let i = self.by_id[id];
                if lost.contains(id) {
                    // Published but not marked: the message will be published again.
                    self.msgs[i].causes.push(CAUSE_EXPIRY);
                } else {
                    self.msgs[i].status = Status::Published;
                    self.msgs[i].published_at = Some(self.now);
                }
            }
            words.push(format!(
                "complete {} (lease lost on {})",
                self.labels(acked),
                self.labels(&lost)
            ));
        }
        if let Some(result) = &answers.fail {
            let failures = &plan.failures;
            let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
            let lost = lost_of(self, &ids);
            self.coverage.lease_lost += lost.len() as u64;
            self.expect_fenced("fail", result, &lost)?;
            let mut parts = Vec::new();
            for f in failures {
                let i = self.by_id[&f.id];
                let action = match f.action {
                    FailAction::Retry { delay } => format!("retry in {delay:?}"),
                    FailAction::Dead => "dead".to_string(),
                };
                parts.push(format!("{} {action}", self.msgs[i].label));
                if lost.contains(&f.id) {
                    continue;
                }
                let m = &mut self.msgs[i];
                m.attempts += 1;
                m.last_error = Some(f.error.clone());
                match f.action {
                    FailAction::Retry { delay } => {
                        m.status = Status::Pending;
                        m.due = self.now + delay.as_secs();
                    }
                    FailAction::Dead => {
                        m.status = Status::Dead;
                        m.ever_dead = true;
                        self.coverage.dead += 1;
                    }
                }
            }
            words.push(format!(
                "fail [{}] (lease lost on {})",
                parts.join(", "),
                self.labels(&lost)
            ));
        }
        if let Some(result) = &answers.release {
            let released = &plan.released;
            let lost = lost_of(self, released);
            self.coverage.lease_lost += lost.len() as u64;
            self.expect_fenced("release", result, &lost)?;
            for id in released {
                if !lost.contains(id) {
                    let i = self.by_id[id];
                    self.msgs[i].status = Status::Pending;
                    self.msgs[i].due = self.now;
                }
            }
            words.push(format!(
                "release {} (lease lost on {})",
                self.labels(released),
                self.labels(&lost)
            ));
        }
        self.note(words.join("; "));
        Ok(())
    }

    /// Every relay's move at the same moment: plan each from the model, run the calls
    /// concurrently (each relay on its own connection), then accept the outcome if some order
    /// of the moves explains it, checked move by move against the model: eligibility,
    /// exclusivity, per-key order, fencing, lease arithmetic, exact attempts.
    ///
    /// Completeness is not required of a claim that ran at the same moment as another call.
    /// The contract counts rows locked by a concurrent claim among what holds a key back, and a
    /// store may skip locked rows; which rows are locked is the database's business: a
    /// concurrent claim locks candidates it then does not return, and InnoDB's fenced
    /// transitions lock index records beyond the rows they change (an expired lease's row they
    /// do not update, next-key locks), so a claim skipping them can miss rows, and heads past
    /// its window, that no order of the moves explains. Every claim one after another is held
    /// to completeness in full.
    async fn together(&mut self, moves: &[Move]) -> Result<(), Violation> {
        let mut planned = Vec::with_capacity(moves.len());
        let mut handles = Vec::with_capacity(moves.len());
        for (relay, m) in moves.iter().enumerate() {
            let holds = self.relays[relay].batch.as_ref().map(|b| b.token);
            planned.push(match (m, holds) {
                (Move::Claim { limit, shard }, None) => {
                    Planned::Claim(usize::from(*limit), self.shard_for(*shard))
                }
                (Move::Claim { .. }, Some(_)) => Planned::Skip("it still holds a batch"),
                (Move::Settle, Some(_)) => match self.settle_plan(relay) {
                    Some(plan) => Planned::Settle(plan),
                    None => Planned::Skip("nothing claimed"),
                },
                (Move::Extend, Some(token)) => Planned::Extend(token),
                (Move::Settle | Move::Extend, None) => Planned::Skip("nothing claimed"),
            });
            handles.push(self.handle(relay).await?);
        }
        let running = running_moves(&planned);
        if running >= 2 {
            self.coverage.together += 1;
        }
        let policy = self.policy;
        let before = self.store_now().await?;
        let answers: Vec<Answer> =
            futures::future::join_all(planned.iter().zip(&handles).map(|(p, h)| async move {
                match p {
                    Planned::Claim(limit, shard) => {
                        Answer::Claim(claim_call(&**h, *limit, policy, *shard).await)
                    }
                    Planned::Settle(plan) => Answer::Settle(settle_calls(&**h, plan).await),
                    Planned::Extend(token) => Answer::Extend(h.extend(*token, LEASE).await),
                    Planned::Skip(_) => Answer::Skipped,
                }
            }))
            .await;
        let after = self.store_now().await?;
        let snapshot = self.snapshot();
        let mut as_listed = None;
        for order in orders(planned.len()) {
            self.restore(&snapshot);
            let result = self.apply_together(&order, &planned, &answers, before, after);
            self.concurrent_claim = false;
            match result {
                Ok(()) => return Ok(()),
                Err(v) if order.windows(2).all(|w| w[0] < w[1]) => as_listed = Some(v),
                Err(_) => {}
            }
        }
        // Leave the model and the log as the order listed left them, for the report.
        self.restore(&snapshot);
        let listed: Vec<usize> = (0..planned.len()).collect();
        let _ = self.apply_together(&listed, &planned, &answers, before, after);
        self.concurrent_claim = false;
        let v = as_listed.unwrap_or_else(|| violation("test setup", "no order was tried"));
        Err(Violation {
            invariant: v.invariant,
            detail: format!(
                "no order of the relays' concurrent moves explains what the store did; taken in the order listed: {}",
                v.detail
            ),
        })
    }

    /// Apply the answers of a [`Step::Together`] to the model in `order`.
    fn apply_together(
        &mut self,
        order: &[usize],
        planned: &[Planned],
        answers: &[Answer],
        before: DateTime<Utc>,
        after: DateTime<Utc>,
    ) -> Result<(), Violation> {
        let running = running_moves(planned);
        let names: Vec<String> = order
            .iter()
            .map(|&r| relay_name(r as u8).to_string())
            .collect();
        self.note(format!("in the order {}:", names.join(" then ")));
        for &relay in order {
            self.note(format!("relay {}", relay_name(relay as u8)));
            match (&planned[relay], &answers[relay]) {
                (Planned::Claim(limit, shard), Answer::Claim(claim)) => {
                    self.concurrent_claim = running > 1;
                    self.apply_claim(relay, *limit, *shard, claim, before, after)?;
                    self.concurrent_claim = false;
                }
                (Planned::Settle(plan), Answer::Settle(settled)) => {
                    self.apply_settle(plan, settled)?;
                }
                (Planned::Extend(_), Answer::Extend(end)) => {
                    self.apply_extend(relay, end, before, after)?;
                }
                (Planned::Skip(why), _) => self.note(format!("skipped: {why}")),
                _ => return Err(violation("test setup", "a move and its answer differ")),
            }
        }
        Ok(())
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            msgs: self.msgs.clone(),
            batches: self.relays.iter().map(|r| r.batch.clone()).collect(),
            next_claim: self.next_claim,
            attributed: self.attributed.clone(),
            coverage: self.coverage,
            shards: self.shards.clone(),
            last_log: self.log.last().cloned(),
        }
    }

    fn restore(&mut self, s: &Snapshot) {
        self.msgs.clone_from(&s.msgs);
        for (r, b) in self.relays.iter_mut().zip(&s.batches) {
            r.batch.clone_from(b);
        }
        self.next_claim = s.next_claim;
        self.attributed.clone_from(&s.attributed);
        self.coverage = s.coverage;
        self.shards.clone_from(&s.shards);
        if let (Some(last), Some(saved)) = (self.log.last_mut(), &s.last_log) {
            last.clone_from(saved);
        }
    }

    async fn extend(&mut self, relay: usize) -> Result<(), Violation> {
        let Some(token) = self.relays[relay].batch.as_ref().map(|b| b.token) else {
            self.note("skipped: nothing claimed");
            return Ok(());
        };
        let handle = self.handle(relay).await?;
        let before = self.store_now().await?;
        let result = handle.extend(token, LEASE).await;
        let after = self.store_now().await?;
        self.apply_extend(relay, &result, before, after)
    }

    /// Check what `relay`'s extend returned against the model and record it.
    fn apply_extend(
        &mut self,
        relay: usize,
        result: &Result<DateTime<Utc>, Error>,
        before: DateTime<Utc>,
        after: DateTime<Utc>,
    ) -> Result<(), Violation> {
        let Some((claim, ids)) = self.relays[relay]
            .batch
            .as_ref()
            .map(|b| (b.claim, b.ids.clone()))
        else {
            self.note("skipped: nothing claimed");
            return Ok(());
        };
        let held: Vec<usize> = ids
            .iter()
            .map(|id| self.by_id[id])
            .filter(|&i| self.held_by(i, claim))
            .collect();
        match (result, held.is_empty()) {
            (Ok(end), false) => {
                check_lease_end("extend", "the lease end extend returned", *end, before, after)?;
                let until = self.now + LEASE.as_secs();
                for i in held {
                    self.msgs[i].status = Status::Leased { claim, until };
                }
                self.note("extended");
                Ok(())
            }
            (Err(Error::LeaseLost { .. }), true) => {
                self.note("LeaseLost, as nothing is held any more");
                Ok(())
            }
            (Ok(_), true) => Err(violation(
                "fencing",
                "extend succeeded although every lease of the claim had expired or been taken over (an expired lease must not be revived)",
            )),
            (Err(Error::LeaseLost { .. }), false) => Err(violation(
                "fencing",
                "extend returned LeaseLost although the claim still holds unexpired leases",
            )),
            (Err(e), _) => Err(store_error("extend", e)),
        }
    }

    fn crash(&mut self, relay: usize) {
        let sim = std::mem::take(&mut self.relays[relay]);
        if sim.batch.is_some() {
            self.coverage.crashes_holding += 1;
        }
        if let Some(
            batch @ Batch {
                outcomes: Some(_), ..
            },
        ) = &sim.batch
        {
            for id in &batch.delivered {
                let i = self.by_id[id];
                self.msgs[i].causes.push(CAUSE_CRASH);
            }
            self.note("crashed after publishing, before completing: its leases stay");
        } else if sim.batch.is_some() {
            self.note("crashed between claim and publish: its leases stay");
        } else {
            self.note("crashed holding nothing");
        }
        // Dropping the handle closes the relay's connections without releasing anything.
        drop(sim);
    }

    async fn advance(&mut self, a: Advance) -> Result<(), Violation> {
        self.store
            .advance_time(a.duration())
            .await
            .map_err(|e| store_error("advance_time", &e))?;
        self.now += a.duration().as_secs();
        let waiting = self
            .waiters
            .iter_mut()
            .flatten()
            .flat_map(|w| w.msgs.iter_mut());
        for m in self.msgs.iter_mut().chain(waiting) {
            if matches!(m.status, Status::Open(_)) && m.not_before > 0 {
                m.due_unknown = true;
            }
            // A waiting enqueue's messages are not in the table yet: when they get there, and
            // so their age, is not known either.
            if matches!(m.status, Status::Open(_)) {
                m.created_unsure = true;
            }
        }
        Ok(())
    }

    fn dead_in_order(&self) -> Vec<usize> {
        (0..self.msgs.len())
            .filter(|&i| self.msgs[i].status == Status::Dead)
            .collect()
    }

    async fn check_dead_list(&self) -> Result<(), Violation> {
        let listed = self
            .admin
            .list_dead(None, 10_000)
            .await
            .map_err(|e| store_error("list_dead", &e))?;
        let want = self.dead_in_order();
        let got: Vec<Uuid> = listed.iter().map(|d| d.message.id).collect();
        let want_ids: Vec<Uuid> = want.iter().map(|&i| self.msgs[i].id).collect();
        if got != want_ids {
            return Err(violation(
                "dead letters",
                format!(
                    "list_dead returned {}, expected {} (oldest first)",
                    self.labels(&got),
                    self.labels(&want_ids)
                ),
            ));
        }
        for (d, &i) in listed.iter().zip(&want) {
            let m = &self.msgs[i];
            if Some(&d.last_error) != m.last_error.as_ref() {
                return Err(violation(
                    "every dead message has its reason",
                    format!(
                        "{} is dead with last error {:?}, expected {:?}",
                        m.label, d.last_error, m.last_error
                    ),
                ));
            }
            if d.message.attempts != m.attempts {
                return Err(violation(
                    "exact attempts",
                    format!(
                        "dead {} lists attempts {}, expected {}",
                        m.label, d.message.attempts, m.attempts
                    ),
                ));
            }
        }
        Ok(())
    }

    /// An operator requeues or discards the `pick`-th dead message, by id or (`by_seq`) by its
    /// `seq`; with nothing dead, a live message, which the call must ignore.
    async fn operator(&mut self, pick: u8, requeue: bool, by_seq: bool) -> Result<(), Violation> {
        self.check_dead_list().await?;
        let dead = self.dead_in_order();
        let (target, expect) = if dead.is_empty() {
            // Nothing dead: the call must ignore a live message (by seq: one whose seq a claim
            // has shown).
            match self.msgs.iter().position(|m| {
                matches!(
                    m.status,
                    Status::Pending | Status::Leased { .. } | Status::Published
                ) && (!by_seq || m.seq.is_some())
            }) {
                Some(i) => (i, 0),
                None => {
                    self.note("skipped: no messages");
                    return Ok(());
                }
            }
        } else {
            (dead[usize::from(pick) % dead.len()], 1)
        };
        let id = self.msgs[target].id;
        let seq = self.msgs[target].seq;
        // A dead message was claimed, so its seq is known; a live one was picked with a seq.
        let by_seq = by_seq && seq.is_some();
        let what = match (requeue, by_seq) {
            (true, false) => "requeue",
            (false, false) => "discard",
            (true, true) => "requeue_seqs",
            (false, true) => "discard_seqs",
        };
        let n = match (requeue, seq.filter(|_| by_seq)) {
            (true, None) => self.admin.requeue(&[id]).await,
            (false, None) => self.admin.discard(&[id]).await,
            (true, Some(seq)) => self.admin.requeue_seqs(&[seq]).await,
            (false, Some(seq)) => self.admin.discard_seqs(&[seq]).await,
        }
        .map_err(|e| store_error(what, &e))?;
        if n != expect {
            return Err(violation(
                "dead letters",
                format!(
                    "{what} of {} ({}) returned {n}, expected {expect}",
                    self.msgs[target].label,
                    describe(self.msgs[target].status, self.now)
                ),
            ));
        }
        if expect == 1 && by_seq {
            self.coverage.by_seq += 1;
        }
        if expect == 1 {
            let m = &mut self.msgs[target];
            if requeue {
                m.status = Status::Pending;
                m.attempts = 0;
                m.due = self.now;
                self.coverage.requeued += 1;
            } else {
                m.status = Status::Discarded;
                self.coverage.discarded += 1;
            }
        }
        self.note(format!("{what} {} -> {n}", self.msgs[target].label));
        Ok(())
    }

    async fn purge(&mut self, batch: usize) -> Result<(), Violation> {
        let old = self
            .msgs
            .iter()
            .filter(|m| {
                m.status == Status::Published
                    && m.published_at
                        .is_some_and(|at| at + PURGE_AGE.as_secs() < self.now)
            })
            .count() as u64;
        // Which old ones a store deletes is its choice; the model only tracks how many. A
        // store that deletes on publish holds none.
        let purgeable = if self.caps.store.deletes_published {
            0
        } else {
            old.saturating_sub(self.purged)
        };
        let want = purgeable.min(batch as u64);
        let n = self
            .admin
            .purge_published(PURGE_AGE, batch)
            .await
            .map_err(|e| store_error("purge_published", &e))?;
        if n != want {
            return Err(violation(
                "bounded purge",
                format!(
                    "purge_published(older than {PURGE_AGE:?}, at most {batch}) deleted {n}, expected {want} ({purgeable} published messages were old enough)"
                ),
            ));
        }
        self.purged += n;
        self.note(format!("deleted {n}"));
        Ok(())
    }

    async fn check_counts(&self) -> Result<(), Violation> {
        let counts = self
            .admin
            .counts()
            .await
            .map_err(|e| store_error("counts", &e))?;
        let mut want = outbox_traits::Counts::default();
        let mut committed = 0u64;
        for m in &self.msgs {
            match m.status {
                Status::Pending => want.pending += 1,
                Status::Leased { .. } => want.leased += 1,
                Status::Published => want.published += 1,
                Status::Dead => want.dead += 1,
                Status::Open(_) | Status::RolledBack | Status::Discarded => continue,
            }
            committed += 1;
        }
        want.published -= self.purged.min(want.published);
        if self.caps.store.deletes_published {
            want.published = 0;
        }
        if counts != want {
            return Err(violation(
                "accounting",
                format!(
                    "counts() = {counts:?}, expected {want:?} ({committed} committed and not discarded = published + dead + pending + in flight, {} purged)",
                    self.purged
                ),
            ));
        }
        Ok(())
    }

    /// `status()` against the model: pending, leased and dead as [`Runner::check_counts`];
    /// when the store reports them, the blocked keys (each key whose first unfinished message
    /// is dead, or waits for a retry: failed at least once and not due yet), listed oldest
    /// first with their head's id, state, attempts and last error; and the age of the oldest
    /// unfinished, not dead message, within what the model knows of it (its model age, plus at
    /// most the real time the case has taken).
    async fn check_status(&mut self) -> Result<(), Violation> {
        let status = self
            .admin
            .status(STATUS_LIST)
            .await
            .map_err(|e| store_error("status", &e))?;
        let mut want = outbox_traits::Counts::default();
        for m in &self.msgs {
            match m.status {
                Status::Pending => want.pending += 1,
                Status::Leased { .. } => want.leased += 1,
                Status::Dead => want.dead += 1,
                _ => {}
            }
        }
        if (status.pending, status.leased, status.dead) != (want.pending, want.leased, want.dead) {
            return Err(violation(
                "status",
                format!(
                    "status() reports {} pending, {} leased, {} dead; expected {}, {}, {}",
                    status.pending,
                    status.leased,
                    status.dead,
                    want.pending,
                    want.leased,
                    want.dead
                ),
            ));
        }
        // `backlog()`, asked for beside the status (a drain's progress): the same figures.
        let backlog = self
            .admin
            .backlog()
            .await
            .map_err(|e| store_error("backlog", &e))?;
        let want_backlog = outbox_traits::Backlog {
            unfinished: want.pending + want.leased,
            dead: want.dead,
        };
        if backlog != want_backlog {
            return Err(violation(
                "backlog",
                format!("backlog() reports {backlog:?}; expected {want_backlog:?}"),
            ));
        }
        // The heads: per key, the first message (insert order) not published, committed.
        let mut heads: BTreeMap<u8, usize> = BTreeMap::new();
        for (i, m) in self.msgs.iter().enumerate() {
            if let (Some(k), Status::Pending | Status::Leased { .. } | Status::Dead) =
                (m.key, m.status)
            {
                heads.entry(k).or_insert(i);
            }
        }
        let mut blocked: Vec<usize> = heads
            .into_values()
            .filter(|&i| {
                let m = &self.msgs[i];
                m.status == Status::Dead
                    || (m.status == Status::Pending && m.attempts > 0 && m.due > self.now)
            })
            .collect();
        blocked.sort_by_key(|&i| self.msgs[i].order);
        let dead_heads = blocked
            .iter()
            .filter(|&&i| self.msgs[i].status == Status::Dead)
            .count() as u64;
        self.coverage.blocked_dead += dead_heads;
        self.coverage.blocked_retrying += blocked.len() as u64 - dead_heads;
        if let Some(n) = status.blocked_keys {
            let want_list: Vec<BlockedHead<'_>> = blocked
                .iter()
                .map(|&i| {
                    let m = &self.msgs[i];
                    let state = if m.status == Status::Dead {
                        "dead"
                    } else {
                        "retrying"
                    };
                    let key = m.key.map_or_else(String::new, |k| format!("k{k}"));
                    (key, m.id, state, m.attempts, m.last_error.as_ref())
                })
                .collect();
            let got_list: Vec<BlockedHead<'_>> = status
                .blocked
                .iter()
                .map(|b| {
                    (
                        b.partition_key.clone(),
                        b.head_id,
                        b.head_state.as_str(),
                        b.attempts,
                        b.last_error.as_ref(),
                    )
                })
                .collect();
            if n != blocked.len() as u64 || got_list != want_list {
                return Err(violation(
                    "status",
                    format!(
                        "status() reports {n} blocked keys {got_list:?} (key, head, state, \
                         attempts, last error); expected {} {want_list:?}",
                        blocked.len()
                    ),
                ));
            }
        }
        let oldest = self
            .msgs
            .iter()
            .filter(|m| matches!(m.status, Status::Pending | Status::Leased { .. }))
            .min_by_key(|m| m.order);
        if let Some(age) = status.oldest_pending_age_seconds {
            let Some(m) = oldest else {
                return Err(violation(
                    "status",
                    format!("status() reports an oldest pending age of {age} s with nothing pending or leased"),
                ));
            };
            let model_age = (self.now - m.created) as f64;
            let lowest = if m.created_unsure {
                0.0
            } else {
                model_age - 1.0
            };
            let highest = model_age + self.started.elapsed().as_secs_f64() + 1.0;
            if !(lowest..=highest).contains(&age) {
                return Err(violation(
                    "status",
                    format!(
                        "status() reports the oldest pending message ({}) {age:.1} s old; the \
                         model knows it is {lowest:.1} to {highest:.1} s old",
                        m.label
                    ),
                ));
            }
        }
        Ok(())
    }

    async fn drain(&mut self) -> Result<(), Violation> {
        for relay in 0..self.relays.len() {
            self.crash(relay);
        }
        // Commit every open transaction; one whose enqueue waits for a key lock returns (and
        // commits, or stays open to be committed here) once the transactions it waits for end.
        while let Some(slot) = (0..TX_SLOTS)
            .find(|&s| self.txs[usize::from(s)].is_some() && self.waiters[usize::from(s)].is_none())
        {
            self.end_tx(slot, true).await?;
        }
        if let Some(w) = self.waiters.iter().position(Option::is_some) {
            return Err(violation(
                "test setup",
                format!("tx{}'s enqueue still waits with no transaction open", w + 1),
            ));
        }
        let day = Duration::from_secs(86_400);
        self.store
            .advance_time(day)
            .await
            .map_err(|e| store_error("advance_time", &e))?;
        self.now += day.as_secs();
        self.check_dead_list().await?;
        let dead: Vec<Uuid> = self
            .dead_in_order()
            .into_iter()
            .map(|i| self.msgs[i].id)
            .collect();
        if !dead.is_empty() {
            let n = self
                .admin
                .requeue(&dead)
                .await
                .map_err(|e| store_error("requeue", &e))?;
            if n != dead.len() as u64 {
                return Err(violation(
                    "dead letters",
                    format!("requeue of {} dead messages returned {n}", dead.len()),
                ));
            }
            for id in &dead {
                let i = self.by_id[id];
                self.msgs[i].status = Status::Pending;
                self.msgs[i].attempts = 0;
                self.msgs[i].due = self.now;
            }
        }
        self.check_counts().await?;
        let drain_relay = usize::from(RELAYS);
        let committed = self
            .msgs
            .iter()
            .filter(|m| !matches!(m.status, Status::RolledBack | Status::Discarded))
            .count();
        // Each round publishes at least one message, so this bound only stops a store that
        // keeps handing out nothing new.
        for _ in 0..=committed + 1 {
            self.log
                .push(format!("relay {} claims 4", relay_name(RELAYS)));
            let n = self.claim(drain_relay, 4, None).await?;
            if n == 0 {
                self.relays[drain_relay].batch = None;
                break;
            }
            self.log
                .push(format!("relay {} publishes (ack)", relay_name(RELAYS)));
            self.publish(drain_relay, &[OutcomeSpec::Ack])?;
            self.log
                .push(format!("relay {} settles", relay_name(RELAYS)));
            self.settle(drain_relay).await?;
            self.check_counts().await?;
        }
        let lost: Vec<Uuid> = self
            .msgs
            .iter()
            .filter(|m| !matches!(m.status, Status::RolledBack | Status::Discarded))
            .filter(|m| m.status != Status::Published || m.delivered == 0)
            .map(|m| m.id)
            .collect();
        if !lost.is_empty() {
            let i = self.by_id[&lost[0]];
            return Err(violation(
                "no loss",
                format!(
                    "with faults off and every lease and retry due, the drain never published {} ({} of them is {})",
                    self.labels(&lost),
                    self.msgs[i].label,
                    describe(self.msgs[i].status, self.now)
                ),
            ));
        }
        self.check_counts().await
    }
}

/// How far a lease end read back from the store may lie outside `[before, after] + LEASE`,
/// where `before` and `after` are [`HarnessStore::now`] just before and just after the call:
/// one second covers a clock read at a coarser precision than the lease end (whole
/// milliseconds or seconds) and rounding of the lease to the column's precision. A lease end
/// taken from the old lease end, from the wrong clock, or with the wrong duration is off by
/// at least a time step of the property (70 s or more).
const LEASE_TOLERANCE: Duration = Duration::from_secs(1);

/// Lease arithmetic: a lease end a store returned is its database's now + [`LEASE`], within
/// [`LEASE_TOLERANCE`].
pub(crate) fn check_lease_end(
    call: &str,
    what: &str,
    end: DateTime<Utc>,
    before: DateTime<Utc>,
    after: DateTime<Utc>,
) -> Result<(), Violation> {
    let lease = chrono::Duration::from_std(LEASE).unwrap_or(chrono::Duration::MAX);
    let tol = chrono::Duration::from_std(LEASE_TOLERANCE).unwrap_or(chrono::Duration::MAX);
    let low = before + lease - tol;
    let high = after + lease + tol;
    if end < low || end > high {
        return Err(violation(
            "lease arithmetic",
            format!(
                "{call}: {what} is {end}, expected the store's now + {LEASE:?} = between {} and {} (store now {before} before the call, {after} after; tolerance {LEASE_TOLERANCE:?})",
                before + lease,
                after + lease,
            ),
        ));
    }
    Ok(())
}

fn describe(status: Status, now: u64) -> String {
    match status {
        Status::Open(slot) => format!("uncommitted in tx{}", slot + 1),
        Status::RolledBack => "rolled back".into(),
        Status::Pending => "pending".into(),
        Status::Leased { until, .. } if until > now => {
            format!("leased for {} more seconds", until - now)
        }
        Status::Leased { .. } => "leased, lease expired".into(),
        Status::Published => "published".into(),
        Status::Dead => "dead".into(),
        Status::Discarded => "discarded".into(),
    }
}
