//! Example-based checks, one per rule of the store contract.
//!
//! Each check takes a [`Harness`], makes a fresh store, and returns `Err` with what went wrong
//! in words. Pick single checks with the `pub async fn`s, or run them all through
//! [`Check::ALL`] or the [`conformance_suite!`](crate::conformance_suite) macro.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_traits::{
    Binary, Claim, ClaimRequest, ClaimShard, Error, FailAction, Failure, HeadPolicy, LeaseToken,
    NewMessage, OutboxAdmin, OutboxStore,
};
use uuid::Uuid;

use crate::harness::{Harness, HarnessStore, RawRow, MIN_CLOCK_SKEW};

const LEASE: Duration = Duration::from_secs(600);

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

fn msg(key: &str, label: &str) -> NewMessage {
    NewMessage::new(
        "item",
        key,
        "item.changed",
        serde_json::json!({ "label": label }),
    )
}

fn req(limit: usize, head_policy: HeadPolicy) -> ClaimRequest {
    ClaimRequest {
        limit,
        lease: LEASE,
        head_policy,
        shard: None,
    }
}

/// [`req`] under `Block` for shard `index` of `count` (not validated: checks send bad ones too).
fn sharded_req(limit: usize, index: u32, count: u32) -> ClaimRequest {
    ClaimRequest {
        shard: Some(ClaimShard { index, count }),
        ..req(limit, HeadPolicy::Block)
    }
}

fn ids(claim: &Claim) -> Vec<Uuid> {
    claim.messages.iter().map(|m| m.id).collect()
}

fn err(what: &str) -> impl Fn(Error) -> String + '_ {
    move |e| format!("{what} failed: {e}")
}

fn is_lease_lost(result: &Result<(), Error>, want: &[Uuid]) -> bool {
    match result {
        Err(Error::LeaseLost { ids }) => {
            ids.iter().collect::<HashSet<_>>() == want.iter().collect::<HashSet<_>>()
        }
        _ => false,
    }
}

/// A fresh store with an admin and a first relay handle.
struct Fixture {
    store: Box<dyn HarnessStore>,
    admin: Arc<dyn OutboxAdmin>,
    relay: Arc<dyn OutboxStore>,
}

impl Fixture {
    async fn new(harness: &dyn Harness) -> Result<Self, String> {
        let store = harness.fresh().await.map_err(err("fresh store"))?;
        let admin = store.admin().await.map_err(err("admin handle"))?;
        let relay = store.relay().await.map_err(err("relay handle"))?;
        Ok(Self {
            store,
            admin,
            relay,
        })
    }

    /// How many of `n` published messages `counts()` still reports: none when the store
    /// deletes messages as they are published.
    fn kept(&self, n: u64) -> u64 {
        if self.store.capabilities().store.deletes_published {
            0
        } else {
            n
        }
    }

    async fn enqueue(&self, messages: &[NewMessage]) -> Result<(), String> {
        let mut tx = self.store.begin().await.map_err(err("begin"))?;
        tx.enqueue(messages).await.map_err(err("enqueue"))?;
        tx.commit().await.map_err(err("commit"))
    }

    async fn claim(&self, limit: usize) -> Result<Claim, String> {
        self.claim_with(&self.relay, limit, HeadPolicy::Block).await
    }

    async fn claim_with(
        &self,
        relay: &Arc<dyn OutboxStore>,
        limit: usize,
        policy: HeadPolicy,
    ) -> Result<Claim, String> {
        relay.claim(&req(limit, policy)).await.map_err(err("claim"))
    }

    async fn advance(&self, secs: u64) -> Result<(), String> {
        self.store
            .advance_time(Duration::from_secs(secs))
            .await
            .map_err(err("advance_time"))
    }

    async fn counts(&self) -> Result<outbox_traits::Counts, String> {
        self.admin.counts().await.map_err(err("counts"))
    }

    /// Dead-letter message `id`, leased under `token`, with `error` as its reason.
    async fn dead_letter(&self, token: LeaseToken, id: Uuid, error: &str) -> Result<(), String> {
        self.relay
            .fail(token, &[dead(id, error)])
            .await
            .map_err(err("fail"))
    }

    /// Enqueue `backlog` messages of key `stuck` (labels `stuck#1`...) and then `behind`, and
    /// lease `stuck#1`: the rest of the stuck key waits, ahead of everything in `behind`.
    async fn behind_a_blocked_backlog(
        &self,
        backlog: usize,
        behind: Vec<NewMessage>,
    ) -> Result<(), String> {
        let mut batch: Vec<NewMessage> = (1..=backlog)
            .map(|i| msg("stuck", &format!("stuck#{i}")))
            .collect();
        batch.extend(behind);
        self.enqueue(&batch).await?;
        let head = self.claim(1).await?;
        ensure!(
            labels(&head) == ["stuck#1"],
            "claim(1) returned {:?}, expected the oldest [\"stuck#1\"]",
            labels(&head)
        );
        Ok(())
    }

    async fn finish(self) -> Result<(), String> {
        drop(self.relay);
        drop(self.admin);
        self.store.teardown().await.map_err(err("teardown"))
    }
}

/// A failure that dead-letters message `id` with `error` as its reason.
fn dead(id: Uuid, error: &str) -> Failure {
    Failure {
        id,
        error: error.into(),
        action: FailAction::Dead,
    }
}

fn labels(claim: &Claim) -> Vec<String> {
    claim
        .messages
        .iter()
        .map(|m| {
            serde_json::from_str::<serde_json::Value>(&m.payload)
                .ok()
                .and_then(|v| v.get("label").and_then(|l| l.as_str()).map(String::from))
                .unwrap_or_else(|| format!("<payload {}>", m.payload))
        })
        .collect()
}

/// A claim returns at most its limit, and successive claims hand out each message once.
pub async fn claim_respects_limit(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let batch: Vec<NewMessage> = (0..5)
        .map(|n| msg(&format!("k{n}"), &format!("m{n}")))
        .collect();
    f.enqueue(&batch).await?;
    let mut seen = HashSet::new();
    for _ in 0..10 {
        let claim = f.claim(2).await?;
        ensure!(
            claim.messages.len() <= 2,
            "claim with limit 2 returned {} messages",
            claim.messages.len()
        );
        if claim.messages.is_empty() {
            break;
        }
        for id in ids(&claim) {
            ensure!(
                seen.insert(id),
                "a message was handed out by two claims while leased"
            );
        }
    }
    ensure!(
        seen.len() == 5,
        "claims handed out {} of 5 due messages",
        seen.len()
    );
    f.finish().await
}

/// Uncommitted and rolled-back messages are never claimed.
pub async fn no_phantoms(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let mut rolled = f.store.begin().await.map_err(err("begin"))?;
    rolled
        .enqueue(&[msg("a", "rolled-back")])
        .await
        .map_err(err("enqueue"))?;
    rolled.rollback().await.map_err(err("rollback"))?;
    if f.store.capabilities().concurrent_transactions {
        let mut open = f.store.begin().await.map_err(err("begin"))?;
        open.enqueue(&[msg("b", "open")])
            .await
            .map_err(err("enqueue"))?;
        let claim = f.claim(10).await?;
        ensure!(
            claim.messages.is_empty(),
            "claim returned {:?} from an uncommitted or rolled-back transaction",
            labels(&claim)
        );
        open.commit().await.map_err(err("commit"))?;
        let claim = f.claim(10).await?;
        ensure!(
            labels(&claim) == ["open"],
            "after commit, claim returned {:?}, expected [\"open\"]",
            labels(&claim)
        );
    } else {
        let claim = f.claim(10).await?;
        ensure!(
            claim.messages.is_empty(),
            "claim returned {:?} from a rolled-back transaction",
            labels(&claim)
        );
    }
    let counts = f.counts().await?;
    ensure!(
        counts.pending + counts.leased <= 1,
        "counts include rolled-back messages: {counts:?}"
    );
    f.finish().await
}

/// A transaction that commits after a later one (lower `seq`, later commit) is still claimed:
/// claims go by state, not by a `seq > last_seen` cursor.
pub async fn late_commit_is_claimed(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    if !f.store.capabilities().concurrent_transactions {
        return f.finish().await;
    }
    let mut early = f.store.begin().await.map_err(err("begin"))?;
    early
        .enqueue(&[msg("a", "early-insert")])
        .await
        .map_err(err("enqueue"))?;
    let mut late = f.store.begin().await.map_err(err("begin"))?;
    late.enqueue(&[msg("b", "late-insert")])
        .await
        .map_err(err("enqueue"))?;
    late.commit().await.map_err(err("commit"))?;
    let first = f.claim(10).await?;
    ensure!(
        labels(&first) == ["late-insert"],
        "first claim returned {:?}",
        labels(&first)
    );
    f.relay
        .complete(first.token, &ids(&first))
        .await
        .map_err(err("complete"))?;
    early.commit().await.map_err(err("commit"))?;
    let second = f.claim(10).await?;
    ensure!(
        labels(&second) == ["early-insert"],
        "a message inserted first but committed last was not claimed (claim returned {:?}): claims must select by state, not by a seq cursor",
        labels(&second)
    );
    f.finish().await
}

/// How long [`concurrent_writers_of_a_key`] gives a second writer's enqueue to return while the
/// first writer of its key is open. Not a timing assumption a correct store relies on (its
/// enqueue waits however long this is); a store whose enqueue does not wait returns within
/// milliseconds and is caught here, and by the order of the `seq`s otherwise.
const KEY_LOCK_PROBE: Duration = Duration::from_millis(300);

/// Two open transactions write one partition key, the earlier inserter committing last.
///
/// Without key locks ([`HarnessCapabilities::key_locks`](crate::HarnessCapabilities::key_locks))
/// both insert at once: the later-inserted `k#2`, committed first, is claimable while `k#1` is
/// uncommitted (an uncommitted row holds nothing back); once `k#1` commits it is claimable
/// although `k#2` is leased (it is the key's first), and `k#3`, inserted after `k#2`, waits for
/// `k#2` although another transaction wrote it. With key locks, the second writer's enqueue
/// waits while the first transaction is open (also while it writes `k#3`), and once that
/// commits the key's messages come in insert order, which is commit order: `k#1`, `k#3`, `k#2`.
pub async fn concurrent_writers_of_a_key(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let caps = f.store.capabilities();
    if !caps.concurrent_transactions {
        return f.finish().await;
    }
    let mut first = f.store.begin().await.map_err(err("begin"))?;
    first
        .enqueue(&[msg("k", "k#1")])
        .await
        .map_err(err("enqueue"))?;
    let mut second = f.store.begin().await.map_err(err("begin"))?;
    if caps.key_locks {
        let mut waiting = tokio::spawn(async move {
            let result = second.enqueue(&[msg("k", "k#2")]).await;
            (second, result)
        });
        if let Ok(joined) = tokio::time::timeout(KEY_LOCK_PROBE, &mut waiting).await {
            let how = match joined {
                Ok((_, Ok(()))) => "returned".to_string(),
                Ok((_, Err(e))) => format!("failed ({e})"),
                Err(e) => format!("panicked ({e})"),
            };
            return Err(format!(
                "with key locks, a second writer's enqueue of key k {how} while the first transaction, which wrote k, was open: it must wait until that ends"
            ));
        }
        first
            .enqueue(&[msg("k", "k#3")])
            .await
            .map_err(err("enqueue"))?;
        let none = f.claim(10).await?;
        ensure!(
            none.messages.is_empty(),
            "with both transactions open, claim returned {:?}",
            labels(&none)
        );
        first.commit().await.map_err(err("commit"))?;
        let (second, result) = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .map_err(|_| {
                "with key locks, the second writer's enqueue had not returned 30 s after the first transaction committed".to_string()
            })?
            .map_err(|e| format!("the waiting enqueue panicked: {e}"))?;
        result.map_err(err("enqueue (after waiting for the key lock)"))?;
        second.commit().await.map_err(err("commit"))?;
        let all = f.claim(10).await?;
        ensure!(
            labels(&all) == ["k#1", "k#3", "k#2"],
            "with key locks, after both writers committed, claim returned {:?}; expected [\"k#1\", \"k#3\", \"k#2\"]: the waiting writer's message is inserted (and gets its seq) after every message of the first, also those written while it waited",
            labels(&all)
        );
        return f.finish().await;
    }
    second
        .enqueue(&[msg("k", "k#2")])
        .await
        .map_err(err("enqueue"))?;
    second.commit().await.map_err(err("commit"))?;
    let passed = f.claim(10).await?;
    ensure!(
        labels(&passed) == ["k#2"],
        "while k#1 is uncommitted in another transaction, claim returned {:?}; expected [\"k#2\"]: an uncommitted message holds nothing back",
        labels(&passed)
    );
    first
        .enqueue(&[msg("k", "k#3")])
        .await
        .map_err(err("enqueue"))?;
    first.commit().await.map_err(err("commit"))?;
    let other = f.store.relay().await.map_err(err("relay handle"))?;
    let next = f.claim_with(&other, 10, HeadPolicy::Block).await?;
    ensure!(
        labels(&next) == ["k#1"],
        "with k#2 leased, after k#1 and k#3 committed, claim returned {:?}; expected [\"k#1\"]: k#1 is the key's first message, and k#3 waits for the leased k#2 (which another transaction wrote)",
        labels(&next)
    );
    f.relay
        .complete(passed.token, &ids(&passed))
        .await
        .map_err(err("complete"))?;
    other
        .complete(next.token, &ids(&next))
        .await
        .map_err(err("complete"))?;
    let last = f.claim(10).await?;
    ensure!(
        labels(&last) == ["k#3"],
        "after k#1 and k#2 completed, claim returned {:?}; expected [\"k#3\"]",
        labels(&last)
    );
    f.finish().await
}

/// A key's later messages wait while its head is leased elsewhere; other keys flow.
pub async fn per_key_head_of_line(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1"), msg("k", "k#2"), msg("j", "j#1")])
        .await?;
    let head = f.claim(1).await?;
    ensure!(
        labels(&head) == ["k#1"],
        "claim(1) returned {:?}, expected the oldest [\"k#1\"]",
        labels(&head)
    );
    let other = f.store.relay().await.map_err(err("relay handle"))?;
    let next = f.claim_with(&other, 10, HeadPolicy::Block).await?;
    ensure!(
        labels(&next) == ["j#1"],
        "while k#1 is leased, a claim returned {:?}; expected only [\"j#1\"] (k#2 must wait for k#1)",
        labels(&next)
    );
    f.relay
        .complete(head.token, &ids(&head))
        .await
        .map_err(err("complete"))?;
    let last = f.claim(10).await?;
    ensure!(
        labels(&last) == ["k#2"],
        "after k#1 completed, claim returned {:?}",
        labels(&last)
    );
    f.finish().await
}

/// A dead head blocks its key under `Block` and is passed under `Skip`.
pub async fn dead_head_blocks_or_skips(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1"), msg("k", "k#2")]).await?;
    let head = f.claim(1).await?;
    let id = ids(&head)[0];
    f.dead_letter(head.token, id, "poison pill").await?;
    let blocked = f.claim_with(&f.relay, 10, HeadPolicy::Block).await?;
    ensure!(
        blocked.messages.is_empty(),
        "under Block, claim returned {:?} behind a dead head",
        labels(&blocked)
    );
    let skipped = f.claim_with(&f.relay, 10, HeadPolicy::Skip).await?;
    ensure!(
        labels(&skipped) == ["k#2"],
        "under Skip, claim returned {:?}, expected [\"k#2\"]",
        labels(&skipped)
    );
    f.finish().await
}

/// Transitions under a token that never held the messages change nothing and name them in
/// `LeaseLost`; a call mixing held and unknown ids changes the held ones and names only the rest.
pub async fn stale_token_is_fenced(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1")]).await?;
    let claim = f.claim(1).await?;
    let id = ids(&claim)[0];
    let stale = LeaseToken::new();
    let r = f.relay.complete(stale, &[id]).await;
    ensure!(
        is_lease_lost(&r, &[id]),
        "complete with a foreign token returned {r:?}, expected LeaseLost naming the message"
    );
    let r = f.relay.fail(stale, &[dead(id, "x")]).await;
    ensure!(
        is_lease_lost(&r, &[id]),
        "fail with a foreign token returned {r:?}"
    );
    let r = f.relay.release(stale, &[id]).await;
    ensure!(
        is_lease_lost(&r, &[id]),
        "release with a foreign token returned {r:?}"
    );
    let r = f.relay.extend(stale, LEASE).await;
    ensure!(
        matches!(r, Err(Error::LeaseLost { .. })),
        "extend with a foreign token returned {r:?}"
    );
    let counts = f.counts().await?;
    ensure!(
        counts.leased == 1 && counts.published == 0 && counts.dead == 0 && counts.pending == 0,
        "a foreign token changed the message: counts {counts:?}"
    );
    let unknown = Uuid::now_v7();
    let r = f.relay.complete(claim.token, &[id, unknown, unknown]).await;
    ensure!(
        is_lease_lost(&r, &[unknown]),
        "complete of a held id and an unknown one (twice) returned {r:?}, expected LeaseLost \
         naming only the unknown one"
    );
    let counts = f.counts().await?;
    ensure!(
        counts.leased == 0 && counts.published == f.kept(1),
        "the held message of a mixed complete was not published: counts {counts:?}"
    );
    f.finish().await
}

/// After its lease expires, a relay can no longer complete, fail, release or extend, and
/// another relay can claim the messages.
pub async fn expired_lease_is_fenced(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1")]).await?;
    let first = f.claim(1).await?;
    let id = ids(&first)[0];
    f.advance(LEASE.as_secs() + 10).await?;
    let r = f.relay.complete(first.token, &[id]).await;
    ensure!(
        is_lease_lost(&r, &[id]),
        "complete after the lease expired returned {r:?}, expected LeaseLost"
    );
    let r = f.relay.extend(first.token, LEASE).await;
    ensure!(
        matches!(r, Err(Error::LeaseLost { .. })),
        "extend revived an expired lease: {r:?}"
    );
    let other = f.store.relay().await.map_err(err("relay handle"))?;
    let second = f.claim_with(&other, 1, HeadPolicy::Block).await?;
    ensure!(
        ids(&second) == [id],
        "after expiry another relay claimed {:?}",
        labels(&second)
    );
    ensure!(
        second.token != first.token,
        "the second claim reused the first token"
    );
    let r = f.relay.complete(first.token, &[id]).await;
    ensure!(
        is_lease_lost(&r, &[id]),
        "the stale relay completed after another took over: {r:?}"
    );
    let r = f.relay.fail(first.token, &[dead(id, "late")]).await;
    ensure!(
        is_lease_lost(&r, &[id]),
        "the stale relay failed the message after another took over: {r:?}"
    );
    other
        .complete(second.token, &[id])
        .await
        .map_err(err("complete by the new holder"))?;
    let counts = f.counts().await?;
    ensure!(
        counts.published == f.kept(1) && counts.dead == 0,
        "counts {counts:?}"
    );
    f.finish().await
}

/// Lease ends come from the store's clock: after the store's clock moved, a fresh lease still
/// lasts its full length. With [`HarnessCapabilities::skewed_clock`](crate::HarnessCapabilities::skewed_clock),
/// the store's clock must also be at least [`MIN_CLOCK_SKEW`] away from the host's, or the
/// harness proves nothing about whose clock the store reads.
pub async fn lease_uses_store_clock(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    if f.store.capabilities().skewed_clock {
        let store_now = f.store.now().await.map_err(err("now"))?;
        let host_now = outbox_traits::chrono::Utc::now();
        let skew = (store_now - host_now).abs().to_std().unwrap_or_default();
        ensure!(
            skew >= MIN_CLOCK_SKEW,
            "the harness declares a skewed store clock, but the store's now ({store_now}) is only {skew:?} from the host's ({host_now}); at least {MIN_CLOCK_SKEW:?} is required"
        );
    }
    f.advance(3600).await?;
    f.enqueue(&[msg("k", "k#1")]).await?;
    let before = f.store.now().await.map_err(err("now"))?;
    let first = f.claim(1).await?;
    let after = f.store.now().await.map_err(err("now"))?;
    ensure!(first.messages.len() == 1, "claim returned nothing");
    crate::model::check_lease_end(
        "claim",
        "Claim::lease_until",
        first.lease_until,
        before,
        after,
    )
    .map_err(|v| format!("{}: {}", v.invariant, v.detail))?;
    let other = f.store.relay().await.map_err(err("relay handle"))?;
    let again = f.claim_with(&other, 1, HeadPolicy::Block).await?;
    ensure!(
        again.messages.is_empty(),
        "a message leased a moment ago was claimed again: the lease end was not computed from the store's clock"
    );
    f.advance(LEASE.as_secs() / 2).await?;
    let again = f.claim_with(&other, 1, HeadPolicy::Block).await?;
    ensure!(
        again.messages.is_empty(),
        "a lease expired after half its length"
    );
    f.advance(LEASE.as_secs()).await?;
    let again = f.claim_with(&other, 1, HeadPolicy::Block).await?;
    ensure!(
        again.messages.len() == 1,
        "a lease did not expire after its length"
    );
    f.finish().await
}

/// A retry waits for its delay by the store's clock and counts exactly one attempt; the id
/// stays the same.
pub async fn retry_waits_and_counts(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1")]).await?;
    let claim = f.claim(1).await?;
    let id = ids(&claim)[0];
    ensure!(
        claim.messages[0].attempts == 0,
        "a new message has attempts {}",
        claim.messages[0].attempts
    );
    let retry = |delay| Failure {
        id,
        error: "broker down".into(),
        action: FailAction::Retry { delay },
    };
    f.relay
        .fail(claim.token, &[retry(Duration::from_secs(300))])
        .await
        .map_err(err("fail"))?;
    let early = f.claim(1).await?;
    ensure!(
        early.messages.is_empty(),
        "a retry was claimed before its delay"
    );
    f.advance(70).await?;
    ensure!(
        f.claim(1).await?.messages.is_empty(),
        "a retry was claimed before its delay"
    );
    f.advance(300).await?;
    let again = f.claim(1).await?;
    ensure!(
        ids(&again) == [id],
        "after its delay the retry was not claimed with the same id (got {:?})",
        ids(&again)
    );
    ensure!(
        again.messages[0].attempts == 1,
        "after one failure attempts is {}",
        again.messages[0].attempts
    );
    f.relay
        .fail(again.token, &[retry(Duration::ZERO)])
        .await
        .map_err(err("fail"))?;
    let third = f.claim(1).await?;
    ensure!(
        ids(&third) == [id],
        "a retry with no delay was not due at once"
    );
    ensure!(
        third.messages[0].attempts == 2,
        "after two failures attempts is {}",
        third.messages[0].attempts
    );
    f.relay
        .release(third.token, &[id])
        .await
        .map_err(err("release"))?;
    let fourth = f.claim(1).await?;
    ensure!(
        fourth.messages.first().map(|m| m.attempts) == Some(2),
        "release counted an attempt or lost the message: {:?}",
        fourth.messages.first().map(|m| m.attempts)
    );
    f.finish().await
}

/// A message waiting for its retry holds back its own key only: later messages of the key wait
/// (a released one too), other keys and unordered messages go on, and once the retry is due the
/// key resumes in order, with the failure counted and the release not.
pub async fn retry_holds_back_its_key_only(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[
        msg("k", "k1"),
        msg("k", "k2"),
        msg("other", "o1"),
        msg("x", "u1").unordered(),
    ])
    .await?;
    let claim = f.claim(10).await?;
    ensure!(
        labels(&claim) == ["k1", "k2", "o1", "u1"],
        "claim returned {:?}",
        labels(&claim)
    );
    let [k1, k2, o1, u1] = ids(&claim)[..] else {
        return Err("the claim did not return 4 messages".into());
    };
    f.relay
        .fail(
            claim.token,
            &[Failure {
                id: k1,
                error: "broker said no".into(),
                action: FailAction::Retry {
                    delay: Duration::from_secs(60),
                },
            }],
        )
        .await
        .map_err(err("fail"))?;
    f.relay
        .release(claim.token, &[k2])
        .await
        .map_err(err("release"))?;
    f.relay
        .complete(claim.token, &[o1, u1])
        .await
        .map_err(err("complete"))?;

    f.enqueue(&[
        msg("k", "k3"),
        msg("other", "o2"),
        msg("y", "u2").unordered(),
    ])
    .await?;
    let claim = f.claim(10).await?;
    ensure!(
        labels(&claim) == ["o2", "u2"],
        "while k1 waits for its retry, claim returned {:?}: only key k may wait",
        labels(&claim)
    );
    f.relay
        .complete(claim.token, &ids(&claim))
        .await
        .map_err(err("complete"))?;

    f.advance(61).await?;
    let claim = f.claim(10).await?;
    ensure!(
        labels(&claim) == ["k1", "k2", "k3"],
        "once the retry was due, claim returned {:?}",
        labels(&claim)
    );
    let attempts: Vec<u32> = claim.messages.iter().map(|m| m.attempts).collect();
    ensure!(
        attempts == [1, 0, 0],
        "attempts after one failure (k1) and one release (k2): {attempts:?}"
    );
    f.finish().await
}

/// Dead letters keep their reason, requeue resets attempts, discard deletes; counts follow.
pub async fn dead_letters_requeue_discard(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1"), msg("j", "j#1")]).await?;
    let claim = f.claim(2).await?;
    let failures: Vec<Failure> = ids(&claim)
        .into_iter()
        .map(|id| dead(id, &format!("rejected {id}")))
        .collect();
    f.relay
        .fail(claim.token, &failures)
        .await
        .map_err(err("fail"))?;
    let counts = f.counts().await?;
    ensure!(
        counts.dead == 2 && counts.pending == 0,
        "after dead-lettering two: counts {counts:?}"
    );
    let dead = f
        .admin
        .list_dead(None, 10)
        .await
        .map_err(err("list_dead"))?;
    ensure!(dead.len() == 2, "list_dead returned {} of 2", dead.len());
    for d in &dead {
        ensure!(
            d.last_error == format!("rejected {}", d.message.id),
            "dead message kept error {:?}",
            d.last_error
        );
        ensure!(
            d.message.attempts == 1,
            "dead message has attempts {}",
            d.message.attempts
        );
    }
    let page = f
        .admin
        .list_dead(Some(dead[0].message.seq), 10)
        .await
        .map_err(err("list_dead"))?;
    ensure!(
        page.len() == 1 && page[0].message.id == dead[1].message.id,
        "list_dead after a seq did not page"
    );
    ensure!(
        f.claim(10).await?.messages.is_empty(),
        "a dead message was claimed"
    );
    let (a, b) = (dead[0].message.id, dead[1].message.id);
    let n = f
        .admin
        .requeue(&[a, Uuid::now_v7()])
        .await
        .map_err(err("requeue"))?;
    ensure!(
        n == 1,
        "requeue of one dead and one unknown id returned {n}"
    );
    let again = f.claim(10).await?;
    ensure!(
        ids(&again) == [a],
        "a requeued message was not claimable: {:?}",
        ids(&again)
    );
    ensure!(
        again.messages[0].attempts == 0,
        "requeue did not reset attempts: {}",
        again.messages[0].attempts
    );
    let n = f.admin.discard(&[b, a]).await.map_err(err("discard"))?;
    ensure!(
        n == 1,
        "discard of one dead and one leased message returned {n}"
    );
    let counts = f.counts().await?;
    ensure!(
        counts.dead == 0 && counts.leased == 1,
        "after discard: counts {counts:?}"
    );
    f.finish().await
}

/// Purge deletes at most its batch, only published messages older than asked (and nothing
/// from a store that deletes messages as they are published).
pub async fn purge_is_bounded(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let batch: Vec<NewMessage> = (0..5)
        .map(|n| msg(&format!("k{n}"), &format!("m{n}")))
        .collect();
    f.enqueue(&batch).await?;
    let claim = f.claim(3).await?;
    ensure!(
        claim.messages.len() == 3,
        "claim(3) of 5 returned {}",
        claim.messages.len()
    );
    f.relay
        .complete(claim.token, &ids(&claim))
        .await
        .map_err(err("complete"))?;
    let age = Duration::from_secs(100);
    let n = f
        .admin
        .purge_published(age, 10)
        .await
        .map_err(err("purge"))?;
    ensure!(
        n == 0,
        "purge deleted {n} messages published less than its age ago"
    );
    f.advance(170).await?;
    // A batch of 0 could never make progress (a caller purging until it gets less than its
    // batch would loop forever): refused, with nothing deleted (the next purge finds all 3).
    match f.admin.purge_published(age, 0).await {
        Err(Error::InvalidInput(_)) => {}
        other => {
            return Err(format!(
                "purge with batch 0 returned {other:?}, expected InvalidInput"
            ))
        }
    }
    let n = f
        .admin
        .purge_published(age, 2)
        .await
        .map_err(err("purge"))?;
    ensure!(
        n == f.kept(2),
        "purge with batch 2 deleted {n} of {} old published messages",
        f.kept(3)
    );
    let n = f
        .admin
        .purge_published(age, 2)
        .await
        .map_err(err("purge"))?;
    ensure!(
        n == f.kept(1),
        "second purge deleted {n}, expected the last {}",
        f.kept(1)
    );
    let n = f
        .admin
        .purge_published(age, 2)
        .await
        .map_err(err("purge"))?;
    ensure!(
        n == 0,
        "third purge deleted {n}: it must not touch unpublished messages"
    );
    let counts = f.counts().await?;
    ensure!(
        counts.published == 0 && counts.pending == 2,
        "after purge: counts {counts:?}"
    );
    f.finish().await
}

/// Two purges at once, from two admin handles, many times over: together they delete each old
/// published message once and report exactly what they deleted (a purge that finds another
/// one at work may return 0 and leave the rows to it); unfinished, dead and recently published
/// messages stay.
pub async fn concurrent_purges_count_exactly(harness: &dyn Harness) -> Result<(), String> {
    const OLD: usize = 48;
    const DEAD: usize = 6;
    const PENDING: usize = 6;
    const RECENT: usize = 6;
    let f = Fixture::new(harness).await?;
    // One key per message, so that no claim waits behind another message of its key.
    let first: Vec<NewMessage> = (0..OLD + DEAD)
        .map(|n| msg(&format!("k{n}"), &format!("m{n}")))
        .collect();
    f.enqueue(&first).await?;
    let mut seen = 0;
    while seen < OLD + DEAD {
        let claim = f.claim(OLD + DEAD - seen).await?;
        ensure!(
            !claim.messages.is_empty(),
            "claim returned nothing with {seen} of {} messages leased",
            OLD + DEAD
        );
        let mut done = Vec::new();
        for id in ids(&claim) {
            if seen < OLD {
                done.push(id);
            } else {
                f.dead_letter(claim.token, id, "refused").await?;
            }
            seen += 1;
        }
        f.relay
            .complete(claim.token, &done)
            .await
            .map_err(err("complete"))?;
    }
    let age = Duration::from_secs(100);
    f.advance(170).await?;
    // Published just now (younger than the purge's age), and never claimed: both kept.
    let later: Vec<NewMessage> = (0..RECENT)
        .map(|n| msg(&format!("r{n}"), &format!("recent{n}")))
        .chain((0..PENDING).map(|n| msg(&format!("p{n}"), &format!("pending{n}"))))
        .collect();
    f.enqueue(&later).await?;
    let recent = f.claim(RECENT).await?;
    ensure!(
        labels(&recent)
            == (0..RECENT)
                .map(|n| format!("recent{n}"))
                .collect::<Vec<_>>(),
        "claim({RECENT}) returned {:?}, expected the oldest pending messages",
        labels(&recent)
    );
    f.relay
        .complete(recent.token, &ids(&recent))
        .await
        .map_err(err("complete"))?;

    let admins = [
        f.store.admin().await.map_err(err("admin handle"))?,
        f.store.admin().await.map_err(err("admin handle"))?,
    ];
    let mut purged = 0_u64;
    let mut rounds = 0;
    loop {
        rounds += 1;
        ensure!(
            rounds <= 200,
            "two purges of batch 5 still deleting after 200 rounds ({purged} deleted)"
        );
        let start = Arc::new(tokio::sync::Barrier::new(2));
        let tasks: Vec<_> = admins
            .iter()
            .map(|admin| {
                let (admin, start) = (Arc::clone(admin), Arc::clone(&start));
                tokio::spawn(async move {
                    start.wait().await;
                    admin.purge_published(age, 5).await
                })
            })
            .collect();
        let mut round = 0;
        for task in tasks {
            round += task
                .await
                .map_err(|e| format!("purge task failed: {e}"))?
                .map_err(err("concurrent purge"))?;
        }
        purged += round;
        if round == 0 {
            break;
        }
    }
    ensure!(
        purged == f.kept(OLD as u64),
        "two purges at once reported {purged} deleted of {} old published messages",
        f.kept(OLD as u64)
    );
    let last = f
        .admin
        .purge_published(age, 100)
        .await
        .map_err(err("purge"))?;
    ensure!(
        last == 0,
        "a purge after two purges at once had finished deleted {last} more"
    );
    let counts = f.counts().await?;
    ensure!(
        counts.published == f.kept(RECENT as u64)
            && counts.dead == DEAD as u64
            && counts.pending == PENDING as u64
            && counts.leased == 0,
        "after two purges at once: counts {counts:?}, expected {} published (recent), {DEAD} \
         dead, {PENDING} pending",
        f.kept(RECENT as u64)
    );
    drop(admins);
    f.finish().await
}

/// A message with a not-before time waits for it, by the store's clock.
pub async fn not_before_delays(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let now = f.store.now().await.map_err(err("now"))?;
    let at = now + outbox_traits::chrono::Duration::seconds(1000);
    f.enqueue(&[
        msg("k", "later").not_before(at),
        msg("k", "after-later"),
        msg("j", "now"),
    ])
    .await?;
    let first = f.claim(10).await?;
    ensure!(
        labels(&first) == ["now"],
        "before the not-before time, claim returned {:?}",
        labels(&first)
    );
    f.relay
        .complete(first.token, &ids(&first))
        .await
        .map_err(err("complete"))?;
    f.advance(1070).await?;
    let second = f.claim(10).await?;
    ensure!(
        labels(&second) == ["later", "after-later"],
        "after the not-before time, claim returned {:?}",
        labels(&second)
    );
    f.finish().await
}

/// A crashed relay's leases stay until they expire, then its messages are claimed again.
pub async fn crash_keeps_leases(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1"), msg("j", "j#1")]).await?;
    let doomed = f.store.relay().await.map_err(err("relay handle"))?;
    let claim = f.claim_with(&doomed, 10, HeadPolicy::Block).await?;
    ensure!(
        claim.messages.len() == 2,
        "claim returned {} of 2",
        claim.messages.len()
    );
    drop(doomed);
    ensure!(
        f.claim(10).await?.messages.is_empty(),
        "a crashed relay's leases were released at once"
    );
    let counts = f.counts().await?;
    ensure!(counts.leased == 2, "after the crash: counts {counts:?}");
    f.advance(LEASE.as_secs() + 10).await?;
    let again = f.claim(10).await?;
    ensure!(
        ids(&again) == ids(&claim),
        "after the lease expired, claim returned {:?}",
        labels(&again)
    );
    f.finish().await
}

/// Extend keeps a live lease past its first end.
pub async fn extend_keeps_lease(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1")]).await?;
    let claim = f.claim(1).await?;
    f.advance(300).await?;
    let before = f.store.now().await.map_err(err("now"))?;
    let end = f
        .relay
        .extend(claim.token, LEASE)
        .await
        .map_err(err("extend"))?;
    let after = f.store.now().await.map_err(err("now"))?;
    crate::model::check_lease_end(
        "extend",
        "the lease end extend returned",
        end,
        before,
        after,
    )
    .map_err(|v| format!("{}: {}", v.invariant, v.detail))?;
    f.advance(400).await?;
    let other = f.store.relay().await.map_err(err("relay handle"))?;
    let taken = f.claim_with(&other, 1, HeadPolicy::Block).await?;
    ensure!(
        taken.messages.is_empty(),
        "an extended lease was taken over at its original end"
    );
    f.relay
        .complete(claim.token, &ids(&claim))
        .await
        .map_err(err("complete after extend"))?;
    f.finish().await
}

/// Every field enqueued comes back as enqueued, with the same id on every attempt.
pub async fn message_round_trip(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let sent = NewMessage::new(
        "order",
        "o-7",
        "order.placed",
        serde_json::json!({"total": 12, "items": ["a"]}),
    )
    .with_header(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    .with_partition_key("customer-3")
    .with_dedup_key("order-7-placed");
    f.enqueue(std::slice::from_ref(&sent)).await?;
    let claim = f.claim(1).await?;
    let got = claim.messages.first().ok_or("claim returned nothing")?;
    ensure!(got.id == sent.id, "id changed: {} -> {}", sent.id, got.id);
    ensure!(
        got.aggregate_type == "order"
            && got.aggregate_id == "o-7"
            && got.event_type == "order.placed",
        "aggregate or event type changed: {got:?}"
    );
    ensure!(
        got.headers == sent.headers,
        "headers changed: {:?}",
        got.headers
    );
    ensure!(
        got.partition_key.as_deref() == Some("customer-3"),
        "partition key changed: {:?}",
        got.partition_key
    );
    ensure!(
        got.dedup_key.as_deref() == Some("order-7-placed"),
        "dedup key changed: {:?}",
        got.dedup_key
    );
    let payload: serde_json::Value =
        serde_json::from_str(&got.payload).map_err(|e| format!("payload is not JSON: {e}"))?;
    ensure!(payload == sent.payload, "payload changed: {}", got.payload);
    let retry = Failure {
        id: got.id,
        error: "again".into(),
        action: FailAction::Retry {
            delay: Duration::ZERO,
        },
    };
    f.relay
        .fail(claim.token, &[retry])
        .await
        .map_err(err("fail"))?;
    let again = f.claim(1).await?;
    ensure!(
        ids(&again) == [sent.id],
        "the retry carries another id: {:?}",
        ids(&again)
    );
    f.relay
        .complete(again.token, &ids(&again))
        .await
        .map_err(err("complete"))?;
    // The default key is the aggregate id; an unordered message comes back without one (SQL
    // backends store both through the table's partition key default, see the README).
    let keyed = NewMessage::new("order", "o-8", "order.placed", serde_json::json!({}));
    let unordered =
        NewMessage::new("order", "o-9", "order.placed", serde_json::json!({})).unordered();
    f.enqueue(&[keyed, unordered]).await?;
    let claim = f.claim(2).await?;
    let keys: Vec<Option<&str>> = claim
        .messages
        .iter()
        .map(|m| m.partition_key.as_deref())
        .collect();
    ensure!(
        keys == [Some("o-8"), None],
        "default and unordered keys changed: {keys:?}"
    );
    f.finish().await
}

/// A second message with the same dedup key, and an invalid message, are refused with typed
/// errors and write nothing.
pub async fn enqueue_refusals(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "first").with_dedup_key("once")])
        .await?;
    let mut tx = f.store.begin().await.map_err(err("begin"))?;
    let result = match tx
        .enqueue(&[msg("k", "second").with_dedup_key("once")])
        .await
    {
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
        Ok(()) => tx.commit().await,
    };
    ensure!(
        matches!(result, Err(Error::DuplicateKey { .. })),
        "a second message with the same dedup key gave {result:?}, expected DuplicateKey"
    );
    let mut tx = f.store.begin().await.map_err(err("begin"))?;
    let bad = NewMessage::new("item", "k", " ", serde_json::json!({}));
    let result = tx.enqueue(&[bad]).await;
    let _ = tx.rollback().await;
    ensure!(
        matches!(result, Err(Error::InvalidInput(_))),
        "a message with a blank event type gave {result:?}, expected InvalidInput"
    );
    let counts = f.counts().await?;
    ensure!(
        counts.pending == 1,
        "refused messages were written: counts {counts:?}"
    );
    f.finish().await
}

/// Relays claiming at the same moment get disjoint messages (stores declaring concurrent
/// claimers only).
pub async fn concurrent_claims_are_exclusive(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    if !f.store.capabilities().store.concurrent_claimers {
        return f.finish().await;
    }
    let batch: Vec<NewMessage> = (0..40)
        .map(|n| {
            let m = msg(&format!("k{}", n % 8), &format!("m{n}"));
            if n % 5 == 0 {
                m.unordered()
            } else {
                m
            }
        })
        .collect();
    f.enqueue(&batch).await?;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let relay = f.store.relay().await.map_err(err("relay handle"))?;
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let claim = relay.claim(&req(3, HeadPolicy::Block)).await?;
                if claim.messages.is_empty() {
                    return Ok::<_, Error>(got);
                }
                got.extend(ids(&claim));
                relay.complete(claim.token, &ids(&claim)).await?;
            }
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        let got = task
            .await
            .map_err(|e| format!("claimer task failed: {e}"))?
            .map_err(err("concurrent claim"))?;
        all.extend(got);
    }
    let unique: HashSet<Uuid> = all.iter().copied().collect();
    ensure!(
        unique.len() == all.len(),
        "{} messages were handed to two concurrent claimers",
        all.len() - unique.len()
    );
    let counts = f.counts().await?;
    ensure!(
        counts.published + counts.pending == f.kept(40) && counts.leased == 0,
        "after concurrent claims: counts {counts:?}"
    );
    f.finish().await
}

/// A dedup key stays taken while its message is kept, published or not, and is free again once
/// the message is gone: purged, or deleted as it was published by a store that declares
/// `deletes_published`. Completing a deleted message again is a lost lease.
pub async fn dedup_key_outlives_its_message_only_while_kept(
    harness: &dyn Harness,
) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let deletes = f.store.capabilities().store.deletes_published;
    f.enqueue(&[msg("k", "first").with_dedup_key("once")])
        .await?;
    let claim = f.claim(1).await?;
    let id = ids(&claim)[0];
    f.relay
        .complete(claim.token, &[id])
        .await
        .map_err(err("complete"))?;
    let r = f.relay.complete(claim.token, &[id]).await;
    ensure!(
        is_lease_lost(&r, &[id]),
        "completing a published message again returned {r:?}, expected LeaseLost naming it"
    );
    let counts = f.counts().await?;
    ensure!(
        counts.published == f.kept(1) && counts.pending + counts.leased + counts.dead == 0,
        "after publishing the only message: counts {counts:?}"
    );

    let mut tx = f.store.begin().await.map_err(err("begin"))?;
    let again = tx
        .enqueue(&[msg("k", "second").with_dedup_key("once")])
        .await;
    match (&again, deletes) {
        (Ok(()), true) => tx.commit().await.map_err(err("commit"))?,
        (Err(Error::DuplicateKey { .. }), false) => {
            let _ = tx.rollback().await;
        }
        _ => {
            let _ = tx.rollback().await;
            return Err(if deletes {
                format!(
                    "the dedup key of a message deleted as it was published is still taken: \
                     {again:?}"
                )
            } else {
                format!(
                    "the dedup key of a published message that is still kept was taken again: \
                     {again:?}, expected DuplicateKey"
                )
            });
        }
    }
    f.advance(7200).await?;
    let purged = f
        .admin
        .purge_published(Duration::from_secs(60), 100)
        .await
        .map_err(err("purge"))?;
    ensure!(
        purged == f.kept(1),
        "purge deleted {purged}, expected {}",
        f.kept(1)
    );
    if !deletes {
        f.enqueue(&[msg("k", "second").with_dedup_key("once")])
            .await
            .map_err(|e| format!("the dedup key of a purged message is still taken: {e}"))?;
    }
    let counts = f.counts().await?;
    ensure!(
        counts.pending == 1 && counts.published == 0,
        "after reusing the dedup key: counts {counts:?}"
    );
    f.finish().await
}

/// A key whose head is leased holds back only its own backlog, however long: a claim still
/// finds the claimable messages behind it (another key's head and an unordered message), so a
/// store that reads only a bounded stretch of the backlog must look past it for them. Past it,
/// a dead head still holds back its key under `Block` and not under `Skip`.
pub async fn blocked_backlog_hides_no_key(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.behind_a_blocked_backlog(
        100,
        vec![
            msg("d", "d#1"),
            msg("j", "j#1"),
            msg("d", "d#2"),
            msg("u", "u#1").unordered(),
        ],
    )
    .await?;
    // Make d#1 dead: the next claim returns it, whatever else it takes.
    let first = f.claim(10).await?;
    let Some(d1) = first
        .messages
        .iter()
        .zip(labels(&first))
        .find_map(|(m, label)| (label == "d#1").then_some(m.id))
    else {
        return Err(format!(
            "while stuck#1 is leased with 99 messages of its key behind it, claim(10) returned \
             {:?}, without the claimable d#1",
            labels(&first)
        ));
    };
    f.dead_letter(first.token, d1, "poison").await?;
    let others: Vec<Uuid> = ids(&first).into_iter().filter(|id| *id != d1).collect();
    f.relay
        .release(first.token, &others)
        .await
        .map_err(err("release"))?;

    let next = f.claim(2).await?;
    ensure!(
        labels(&next) == ["j#1", "u#1"],
        "behind the leased stuck#1 and its 99 messages, with d#1 dead, claim(2) under Block \
         returned {:?}; expected [\"j#1\", \"u#1\"] (d#2 waits behind the dead d#1)",
        labels(&next)
    );
    let skip = f.claim_with(&f.relay, 2, HeadPolicy::Skip).await?;
    ensure!(
        labels(&skip) == ["d#2"],
        "under Skip the dead d#1 holds nothing back, but claim(2) returned {:?}; expected \
         [\"d#2\"]",
        labels(&skip)
    );
    f.finish().await
}

/// Behind a long blocked backlog, many keys (more than a claim's limit many times over) are
/// claimed oldest first, one after another, and each still holds back its own later messages.
pub async fn many_keys_behind_a_blocked_backlog(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let keyed: Vec<String> = (1..=12).map(|i| format!("k{i:02}#1")).collect();
    let mut behind: Vec<NewMessage> = keyed
        .iter()
        .enumerate()
        .map(|(i, label)| msg(&format!("k{:02}", i + 1), label))
        .collect();
    behind.push(msg("k01", "k01#2"));
    behind.push(msg("u", "u#1").unordered());
    f.behind_a_blocked_backlog(10, behind).await?;
    let mut claimed = Vec::new();
    for _ in 0..6 {
        claimed.extend(labels(&f.claim(2).await?));
    }
    ensure!(
        claimed == keyed,
        "six claim(2) behind the leased stuck#1 returned {claimed:?}; expected the twelve keys' \
         first messages, oldest first: {keyed:?}"
    );
    let last = f.claim(2).await?;
    ensure!(
        labels(&last) == ["u#1"],
        "then claim(2) returned {:?}; expected [\"u#1\"] (k01#2 waits for the leased k01#1)",
        labels(&last)
    );
    f.finish().await
}

/// A claim with a shard no store can serve (a count of 0, an index not below the count) is
/// refused with [`Error::InvalidInput`] before anything is leased: a following unsharded claim
/// still gets every message. Stores declaring
/// [`Capabilities::sharded_claims`](outbox_traits::Capabilities::sharded_claims) only.
pub async fn invalid_shard_is_refused(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    if !f.store.capabilities().store.sharded_claims {
        return f.finish().await;
    }
    f.enqueue(&[
        msg("a", "a#1"),
        msg("b", "b#1"),
        msg("u", "u#1").unordered(),
    ])
    .await?;
    for (index, count) in [(0, 0), (1, 0), (2, 2), (3, 3), (1, 1)] {
        let result = f.relay.claim(&sharded_req(10, index, count)).await;
        ensure!(
            matches!(result, Err(Error::InvalidInput(_))),
            "a claim of shard {index} of {count} returned {}, expected InvalidInput",
            match &result {
                Ok(claim) => format!("Ok with {:?}", labels(claim)),
                Err(e) => format!("the error {e:?}"),
            }
        );
    }
    let counts = f.counts().await?;
    ensure!(
        counts.pending == 3 && counts.leased == 0,
        "after refused claims with bad shards: counts {counts:?}, expected 3 pending and none \
         leased"
    );
    let all = f.claim(10).await?;
    ensure!(
        labels(&all) == ["a#1", "b#1", "u#1"],
        "after refused claims with bad shards, an unsharded claim returned {:?}; expected \
         [\"a#1\", \"b#1\", \"u#1\"]",
        labels(&all)
    );
    f.finish().await
}

/// How many keys, messages per key and unordered messages [`shards_partition_keys`] enqueues.
const SHARD_KEYS: usize = 24;
const SHARD_ROUNDS: usize = 3;
const SHARD_UNORDERED: usize = 4;

/// Sharded claims split the keys between shards: two relays claiming shard 0 and shard 1 of 2
/// in turn (completing what they get) publish every message exactly once, each key's messages
/// all under one shard and in `seq` order, and both shards get keys; a claim of shard 0 of 1
/// is an unsharded claim. Stores declaring
/// [`Capabilities::sharded_claims`](outbox_traits::Capabilities::sharded_claims) only.
pub async fn shards_partition_keys(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    if !f.store.capabilities().store.sharded_claims {
        return f.finish().await;
    }
    // 24 keys, 3 messages each (one round of every key after the other), and unordered
    // messages before, between and after the rounds.
    let mut expected = Vec::new();
    let mut unordered = 0;
    let mut add_unordered = |batch: &mut Vec<NewMessage>, expected: &mut Vec<String>| {
        unordered += 1;
        let label = format!("u#{unordered}");
        batch.push(msg("u", &label).unordered());
        expected.push(label);
    };
    for round in 1..=SHARD_ROUNDS {
        let mut batch = Vec::new();
        add_unordered(&mut batch, &mut expected);
        for key in 0..SHARD_KEYS {
            let label = format!("key-{key:02}#{round}");
            batch.push(msg(&format!("key-{key:02}"), &label));
            expected.push(label);
        }
        if round == SHARD_ROUNDS {
            add_unordered(&mut batch, &mut expected);
        }
        f.enqueue(&batch).await?;
    }
    ensure!(
        unordered == SHARD_UNORDERED,
        "test setup: {unordered} unordered messages"
    );
    let total = expected.len();
    let relays = [
        f.relay.clone(),
        f.store.relay().await.map_err(err("relay handle"))?,
    ];
    // label -> (shard index, seq); key -> shard indexes and labels in the order returned.
    let mut seen: BTreeMap<String, (u32, i64)> = BTreeMap::new();
    let mut key_shards: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    let mut key_order: BTreeMap<String, Vec<(String, i64)>> = BTreeMap::new();
    let mut drained = false;
    // Each round publishes at least one message until both shards come back empty.
    for _ in 0..=total {
        let mut got = 0;
        for (index, relay) in relays.iter().enumerate() {
            let index = index as u32;
            let claim = relay
                .claim(&sharded_req(7, index, 2))
                .await
                .map_err(err("sharded claim"))?;
            got += claim.messages.len();
            for (m, label) in claim.messages.iter().zip(labels(&claim)) {
                if let Some((other, _)) = seen.insert(label.clone(), (index, m.seq)) {
                    return Err(format!(
                        "{label} was returned twice, by a claim of shard {other} of 2 and then of \
                         shard {index} of 2 (it was completed the first time)"
                    ));
                }
                if let Some(key) = &m.partition_key {
                    key_shards.entry(key.clone()).or_default().insert(index);
                    key_order
                        .entry(key.clone())
                        .or_default()
                        .push((label, m.seq));
                }
            }
            if !claim.messages.is_empty() {
                relay
                    .complete(claim.token, &ids(&claim))
                    .await
                    .map_err(err("complete"))?;
            }
        }
        if got == 0 {
            drained = true;
            break;
        }
    }
    ensure!(
        drained,
        "claims of shards 0 and 1 of 2 still returned messages after {} rounds",
        total + 1
    );
    let missing: Vec<&String> = expected.iter().filter(|l| !seen.contains_key(*l)).collect();
    ensure!(
        missing.is_empty() && seen.len() == total,
        "claims of shards 0 and 1 of 2, until both came back empty, never returned {missing:?} \
         (each of the {total} messages must be in exactly one shard)"
    );
    for (key, shards) in &key_shards {
        ensure!(
            shards.len() == 1,
            "the messages of key {key} were returned by claims of shards {shards:?} of 2: every \
             message of a key must be in the key's one shard ({:?})",
            key_order.get(key)
        );
    }
    for (key, returned) in &key_order {
        let want: Vec<String> = (1..=SHARD_ROUNDS).map(|r| format!("{key}#{r}")).collect();
        let got: Vec<&String> = returned.iter().map(|(l, _)| l).collect();
        ensure!(
            got == want.iter().collect::<Vec<_>>() && returned.windows(2).all(|w| w[0].1 < w[1].1),
            "the messages of key {key} were returned as {returned:?} (label, seq); expected \
             {want:?} with rising seqs"
        );
    }
    // A sane hash puts all 24 keys in one shard of 2 with odds of 2 in 2^24 (about one in
    // eight million): a store whose claims of one shard get every key does not split them.
    let per_shard: Vec<usize> = (0..2)
        .map(|i| key_shards.values().filter(|s| s.contains(&i)).count())
        .collect();
    ensure!(
        per_shard.iter().all(|&n| n > 0),
        "the {SHARD_KEYS} keys were split {per_shard:?} between shards 0 and 1 of 2: a shard \
         function must spread keys"
    );

    // Shard 0 of 1 is every key: per-key order and completeness as for an unsharded claim.
    f.enqueue(&[
        msg("one", "one#1"),
        msg("one", "one#2"),
        msg("two", "two#1"),
        msg("u", "v#1").unordered(),
    ])
    .await?;
    let head = f
        .relay
        .claim(&sharded_req(1, 0, 1))
        .await
        .map_err(err("claim of shard 0 of 1"))?;
    ensure!(
        labels(&head) == ["one#1"],
        "a claim(1) of shard 0 of 1 returned {:?}; expected the oldest [\"one#1\"], as \
         unsharded",
        labels(&head)
    );
    let rest = f
        .relay
        .claim(&sharded_req(10, 0, 1))
        .await
        .map_err(err("claim of shard 0 of 1"))?;
    ensure!(
        labels(&rest) == ["two#1", "v#1"],
        "with one#1 leased, a claim of shard 0 of 1 returned {:?}; expected [\"two#1\", \
         \"v#1\"] (one#2 waits for one#1), as unsharded",
        labels(&rest)
    );
    for claim in [&head, &rest] {
        f.relay
            .complete(claim.token, &ids(claim))
            .await
            .map_err(err("complete"))?;
    }
    let last = f
        .relay
        .claim(&sharded_req(10, 0, 1))
        .await
        .map_err(err("claim of shard 0 of 1"))?;
    ensure!(
        labels(&last) == ["one#2"],
        "after one#1 was completed, a claim of shard 0 of 1 returned {:?}; expected \
         [\"one#2\"]",
        labels(&last)
    );
    f.finish().await
}

/// `result` is [`Error::InvalidInput`]; otherwise an explanation naming `call`.
fn refused<T: std::fmt::Debug>(call: &str, result: Result<T, Error>) -> Result<(), String> {
    match result {
        Err(Error::InvalidInput(_)) => Ok(()),
        other => Err(format!(
            "{call} returned {other:?}; the contract refuses it with InvalidInput before \
             anything changes"
        )),
    }
}

/// Every argument rule of the contract, answered alike by every store: typed
/// [`Error::InvalidInput`] before anything changes for a claim limit or lease of 0, a lease,
/// lease extension or retry delay longer than [`MAX_DURATION`](outbox_traits::MAX_DURATION), a
/// zero-length extension (also under a token that holds nothing: arguments are checked first)
/// and a purge batch of 0; and no error, nothing changed, for empty id and seq lists (complete,
/// fail, release, requeue, discard and their by-seq forms, under any token), a dead-letter
/// listing or status of limit 0, and a purge age beyond
/// [`MAX_DURATION`](outbox_traits::MAX_DURATION) (nothing is that old: 0 deleted). After the
/// refusals the held lease is intact (not taken over, not shortened, still completable) and
/// every other message still flows.
pub async fn argument_rules(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    f.enqueue(&[msg("k", "k#1"), msg("k", "k#2"), msg("j", "j#1")])
        .await?;
    let too_long = outbox_traits::MAX_DURATION + Duration::from_secs(1);
    // Claims no store can serve.
    for (what, request) in [
        (
            "claim with limit 0",
            ClaimRequest {
                limit: 0,
                ..req(1, HeadPolicy::Block)
            },
        ),
        (
            "claim with a lease of 0",
            ClaimRequest {
                lease: Duration::ZERO,
                ..req(1, HeadPolicy::Block)
            },
        ),
        (
            "claim with a lease of 100 years and 1 s",
            ClaimRequest {
                lease: too_long,
                ..req(1, HeadPolicy::Skip)
            },
        ),
    ] {
        refused(what, f.relay.claim(&request).await.map(|c| labels(&c)))?;
    }
    let counts = f.counts().await?;
    ensure!(
        counts.pending == 3 && counts.leased == 0,
        "after refused claims: counts {counts:?}, expected 3 pending and none leased"
    );
    let claim = f.claim(1).await?;
    ensure!(
        labels(&claim) == ["k#1"],
        "claim(1) returned {:?}, expected [\"k#1\"]",
        labels(&claim)
    );
    let k1 = claim.messages[0].id;
    let stranger = LeaseToken::new();
    // Lease extensions: a bad length is refused before the token is looked up.
    for (what, token, lease) in [
        (
            "extend(token, 0) of a held lease",
            claim.token,
            Duration::ZERO,
        ),
        ("extend(unknown token, 0)", stranger, Duration::ZERO),
        ("extend(token, 100 years and 1 s)", claim.token, too_long),
    ] {
        refused(what, f.relay.extend(token, lease).await)?;
    }
    // A retry delay beyond the limit refuses the whole call: the dead-lettering beside it
    // does not happen either.
    refused(
        "fail with a retry delay of 100 years and 1 s",
        f.relay
            .fail(
                claim.token,
                &[
                    dead(k1, "beside a bad entry"),
                    Failure {
                        id: k1,
                        error: "too long".into(),
                        action: FailAction::Retry { delay: too_long },
                    },
                ],
            )
            .await,
    )?;
    refused(
        "purge_published(1 s, batch 0)",
        f.admin.purge_published(Duration::from_secs(1), 0).await,
    )?;
    // Empty lists change nothing and are no error, under the held token or any other.
    for token in [claim.token, stranger] {
        let which = if token == claim.token {
            "the held token"
        } else {
            "an unknown token"
        };
        for (what, result) in [
            ("complete", f.relay.complete(token, &[]).await),
            ("fail", f.relay.fail(token, &[]).await),
            ("release", f.relay.release(token, &[]).await),
        ] {
            ensure!(
                result.is_ok(),
                "{what}({which}, []) returned {result:?}; an empty list changes nothing and \
                 returns Ok"
            );
        }
    }
    for (what, result) in [
        ("requeue([])", f.admin.requeue(&[]).await),
        ("discard([])", f.admin.discard(&[]).await),
        ("requeue_seqs([])", f.admin.requeue_seqs(&[]).await),
        ("discard_seqs([])", f.admin.discard_seqs(&[]).await),
        (
            "purge_published(100 years and 1 s, 10)",
            f.admin.purge_published(too_long, 10).await,
        ),
    ] {
        ensure!(
            matches!(result, Ok(0)),
            "{what} returned {result:?}, expected Ok(0)"
        );
    }
    let listed = f.admin.list_dead(None, 0).await;
    ensure!(
        matches!(&listed, Ok(l) if l.is_empty()),
        "list_dead(None, 0) returned {listed:?}, expected an empty list"
    );
    let status = f.admin.status(0).await;
    ensure!(
        matches!(&status, Ok(s) if s.blocked.is_empty() && s.leased == 1 && s.pending == 2),
        "status(0) returned {status:?}, expected 1 leased, 2 pending and no key listed"
    );
    // The held lease is intact: not shortened (another relay cannot take k#1 just before its
    // end), still extendable to the longest lease and back, and completable.
    f.advance(LEASE.as_secs() - 60).await?;
    let other = f.store.relay().await.map_err(err("relay handle"))?;
    let taken = f.claim_with(&other, 10, HeadPolicy::Block).await?;
    ensure!(
        labels(&taken) == ["j#1"],
        "after the refused calls, a claim by another relay 60 s before k#1's lease ends \
         returned {:?}; expected only [\"j#1\"] (k#1 still leased, k#2 behind it)",
        labels(&taken)
    );
    f.relay
        .extend(claim.token, outbox_traits::MAX_DURATION)
        .await
        .map_err(err("extend by exactly 100 years (the longest accepted)"))?;
    f.relay
        .extend(claim.token, LEASE)
        .await
        .map_err(err("extend back to the property's lease"))?;
    f.relay
        .complete(claim.token, &[k1])
        .await
        .map_err(err("complete after the refused calls"))?;
    other
        .complete(taken.token, &ids(&taken))
        .await
        .map_err(err("complete"))?;
    let last = f.claim(10).await?;
    ensure!(
        labels(&last) == ["k#2"],
        "after k#1 and j#1 were completed, a claim returned {:?}; expected [\"k#2\"]",
        labels(&last)
    );
    let counts = f.counts().await?;
    ensure!(
        counts.dead == 0 && counts.leased == 1 && counts.published == f.kept(2),
        "at the end: counts {counts:?}, expected nothing dead (the refused fail changed \
         nothing), 1 leased, {} published",
        f.kept(2)
    );
    f.finish().await
}

/// What a raw row must come back as: the message fields a claim returns, the payload compared
/// as JSON (a database may store it in another text form, e.g. Postgres's `jsonb`).
struct RawExpect {
    id: Option<Uuid>,
    aggregate_type: String,
    event_type: String,
    payload: serde_json::Value,
    headers: BTreeMap<String, String>,
    partition_key: Option<String>,
}

/// `text` with every other letter in upper case: a mixed-case id.
fn mixed_case(text: &str) -> String {
    text.chars()
        .enumerate()
        .map(|(i, c)| {
            if i % 2 == 0 {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect()
}

/// JSON nested `depth` levels deep, alternating objects and arrays.
fn nested(depth: usize) -> String {
    let mut text = String::from("\"bottom\"");
    for level in 0..depth {
        text = if level % 2 == 0 {
            format!("{{\"level{level}\":{text}}}")
        } else {
            format!("[{level},{text}]")
        };
    }
    text
}

/// An odd row's id, event type, payload, partition key and headers (see [`odd_rows`]).
type OddRow = (
    Option<String>,
    &'static str,
    String,
    Option<String>,
    Option<String>,
);

/// Odd but valid rows, as a SQL writer in another language may write them: ids in upper and
/// mixed case and left out, every kind of JSON payload (scalars, `null`, arrays, deeply nested,
/// close to the size limit), Unicode everywhere, empty and 200-character partition keys, a key
/// left out, headers with Unicode, empty names, escapes and long values. The aggregate id of
/// row `n` is `raw-n`; keys `ключ-🔑` (two rows, in this order) and `ordered` are shared.
fn odd_rows() -> Vec<RawRow> {
    let upper = Uuid::new_v4().to_string().to_uppercase();
    let mixed = mixed_case(&Uuid::new_v4().to_string());
    let blob = "x".repeat(outbox_traits::DEFAULT_MAX_PAYLOAD_BYTES - 1024);
    let long_key = "é".repeat(100) + &"k".repeat(100);
    let rows: Vec<OddRow> = vec![
        (Some(upper), "order.placed", r#"{"total": 1200}"#.into(), None, None),
        (Some(mixed), "order.placed", "1".into(), None, None),
        (None, "order.placed", r#""a string ✓""#.into(), None, None),
        (None, "заказ.создан", "null".into(), None, None),
        (None, "t", "false".into(), Some("ordered".into()), None),
        (None, "t", r#"[1, "a", null, {"b": []}]"#.into(), Some("ordered".into()), None),
        (None, "t", "{}".into(), Some(String::new()), None),
        (None, "t", "[]".into(), Some("ключ-🔑".into()), None),
        (None, "t", nested(30), Some("ключ-🔑".into()), None),
        (None, "t", format!(r#"{{"blob": "{blob}"}}"#), Some(long_key), None),
        (
            None,
            "t",
            r#"{"emoji": "🎉", "escaped": "a\"b\\c\n\t\u00e9"}"#.into(),
            None,
            Some(
                r#"{"ключ": "значение 🎉", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#
                    .into(),
            ),
        ),
        (
            None,
            "t",
            "2".into(),
            Some("ordered".into()),
            Some(format!(
                r#"{{"": "", "quote": "a\"b\\c\n", "long": "{}"}}"#,
                "v".repeat(1000)
            )),
        ),
        (None, "t", "3".into(), None, Some("{}".into())),
    ];
    rows.into_iter()
        .enumerate()
        .map(|(n, (id, event_type, payload, key, headers))| RawRow {
            id,
            partition_key: key,
            headers,
            ..RawRow::new("注文", format!("raw-{n}"), event_type, payload)
        })
        .collect()
}

fn raw_expect(row: &RawRow) -> Result<RawExpect, String> {
    let json = |what: &str, text: &str| {
        serde_json::from_str::<serde_json::Value>(text)
            .map_err(|e| format!("test setup: {what} {text:?} is not JSON: {e}"))
    };
    let headers = match &row.headers {
        Some(text) => {
            serde_json::from_str(text).map_err(|e| format!("test setup: headers {text:?}: {e}"))?
        }
        None => BTreeMap::new(),
    };
    Ok(RawExpect {
        id: match &row.id {
            Some(text) => {
                Some(Uuid::parse_str(text).map_err(|e| format!("test setup: id {text:?}: {e}"))?)
            }
            None => None,
        },
        aggregate_type: row.aggregate_type.clone(),
        event_type: row.event_type.clone(),
        payload: json("payload", &row.payload)?,
        headers,
        partition_key: match &row.partition_key {
            Some(key) if key.is_empty() => None,
            Some(key) => Some(key.clone()),
            None => Some(row.aggregate_id.clone()),
        },
    })
}

/// Claim (limit `limit`, `policy`) and complete until a claim comes back empty; every message
/// by aggregate id, with the order they came in. Fails on a message returned twice or a
/// complete that is refused.
async fn drain_raw(
    f: &Fixture,
    limit: usize,
    policy: HeadPolicy,
) -> Result<Vec<outbox_traits::Message>, String> {
    let mut got: Vec<outbox_traits::Message> = Vec::new();
    // A claim that met only malformed rows quarantines them and returns nothing: stop after
    // two empty claims in a row.
    let mut empty = 0;
    for _ in 0..100 {
        let claim = f.claim_with(&f.relay, limit, policy).await?;
        if claim.messages.is_empty() {
            empty += 1;
            if empty == 2 {
                return Ok(got);
            }
            continue;
        }
        empty = 0;
        for m in &claim.messages {
            if let Some(first) = got.iter().find(|g| g.aggregate_id == m.aggregate_id) {
                return Err(format!(
                    "row {} (id {}) was claimed again after it was completed (first as id {})",
                    m.aggregate_id, m.id, first.id
                ));
            }
        }
        let result = f.relay.complete(claim.token, &ids(&claim)).await;
        ensure!(
            result.is_ok(),
            "complete of claimed rows {:?} returned {result:?}: a row written by SQL must be \
             completed by the id its claim returned",
            claim
                .messages
                .iter()
                .map(|m| (&m.aggregate_id, m.id))
                .collect::<Vec<_>>()
        );
        got.extend(claim.messages);
    }
    Err("claims still returned messages after 100 rounds".into())
}

/// Rows written behind the contract's back, as a SQL writer in another language would
/// (harnesses declaring [`HarnessCapabilities::raw_rows`](crate::HarnessCapabilities::raw_rows)):
/// every odd value the database accepts (ids in upper and mixed case, every kind
/// of JSON payload up to near the size limit, Unicode, empty and long keys, header edge cases)
/// is claimed exactly once, comes back as written (payload equal as JSON, the id equal as a
/// UUID), in key order, and is completed: nothing stays leased, and once every lease has run
/// out nothing is claimed again. Other forms of an id (braces, no hyphens, `urn:uuid:`) are
/// each written alone: a form the database refuses is no concern, one it accepts must
/// round-trip alike.
pub async fn raw_rows_round_trip(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    if !f.store.capabilities().raw_rows {
        return f.finish().await;
    }
    let mut rows = odd_rows();
    f.store
        .insert_raw(&rows, true)
        .await
        .map_err(err("insert_raw of valid odd rows"))?;
    let base = Uuid::new_v4().simple().to_string();
    let forms = [
        format!("{{{}}}", Uuid::new_v4()),
        base.to_uppercase(),
        format!("urn:uuid:{}", Uuid::new_v4()),
    ];
    for form in forms {
        let row = RawRow {
            id: Some(form),
            ..RawRow::new("注文", format!("raw-{}", rows.len()), "t", "4")
        };
        if f.store
            .insert_raw(std::slice::from_ref(&row), true)
            .await
            .is_ok()
        {
            rows.push(row);
        }
    }
    let expected: BTreeMap<String, RawExpect> = rows
        .iter()
        .map(|r| raw_expect(r).map(|e| (r.aggregate_id.clone(), e)))
        .collect::<Result<_, _>>()?;
    let got = drain_raw(&f, 5, HeadPolicy::Block).await?;
    let missing: Vec<&String> = expected
        .keys()
        .filter(|a| !got.iter().any(|m| &m.aggregate_id == *a))
        .collect();
    ensure!(
        missing.is_empty() && got.len() == expected.len(),
        "claims until empty returned {} messages; rows never claimed: {missing:?}",
        got.len()
    );
    for m in &got {
        let Some(want) = expected.get(&m.aggregate_id) else {
            return Err(format!(
                "a claim returned an unknown row {:?}",
                m.aggregate_id
            ));
        };
        let payload: Result<serde_json::Value, _> = serde_json::from_str(&m.payload);
        let shown = |p: &str| p.chars().take(120).collect::<String>();
        ensure!(
            want.id.is_none_or(|id| id == m.id)
                && m.aggregate_type == want.aggregate_type
                && m.event_type == want.event_type
                && payload.as_ref().is_ok_and(|p| *p == want.payload)
                && m.headers == want.headers
                && m.partition_key == want.partition_key,
            "row {} came back as id {}, type {:?}/{:?}, payload {:?}, headers {:?}, key {:?}; \
             written as id {:?}, type {:?}/{:?}, payload {:?}, headers {:?}, key {:?}",
            m.aggregate_id,
            m.id,
            m.aggregate_type,
            m.event_type,
            shown(&m.payload),
            m.headers,
            m.partition_key,
            want.id,
            want.aggregate_type,
            want.event_type,
            shown(&want.payload.to_string()),
            want.headers,
            want.partition_key
        );
    }
    // Per-key order: a key's rows were claimed in insert order.
    for key in ["ordered", "ключ-🔑"] {
        let order: Vec<&str> = got
            .iter()
            .filter(|m| m.partition_key.as_deref() == Some(key))
            .map(|m| m.aggregate_id.as_str())
            .collect();
        let want: Vec<&str> = rows
            .iter()
            .filter(|r| r.partition_key.as_deref() == Some(key))
            .map(|r| r.aggregate_id.as_str())
            .collect();
        ensure!(
            order == want,
            "the rows of key {key:?} were claimed as {order:?}, written as {want:?}"
        );
    }
    let n = expected.len() as u64;
    let counts = f.counts().await?;
    ensure!(
        counts.pending == 0
            && counts.leased == 0
            && counts.dead == 0
            && counts.published == f.kept(n),
        "after every raw row was claimed and completed: counts {counts:?}, expected {} \
         published and nothing pending, leased or dead",
        f.kept(n)
    );
    f.advance(2 * LEASE.as_secs()).await?;
    let again = f.claim(100).await?;
    ensure!(
        again.messages.is_empty(),
        "once every lease had run out, a claim returned completed rows again: {:?}",
        again
            .messages
            .iter()
            .map(|m| (&m.aggregate_id, m.id))
            .collect::<Vec<_>>()
    );
    f.finish().await
}

/// One malformed row of [`malformed_raw_rows_quarantined`] and the column its reason names.
struct Malformed {
    row: RawRow,
    column: &'static str,
}

/// Malformed rows, each of its own key `bad-<round>-<n>` followed by a valid row of that key
/// (`behind-<round>-<n>`): headers that are not a JSON object of strings, and with
/// [`HarnessCapabilities::text_ids`](crate::HarnessCapabilities::text_ids) an id that is not
/// a UUID.
fn malformed_rows(round: &str, text_ids: bool) -> Vec<Malformed> {
    let mut bad = vec![
        (Some(Uuid::new_v4().to_string()), r#"{"n": 1}"#, "headers"),
        (Some(Uuid::new_v4().to_string()), "[1]", "headers"),
        (Some(Uuid::new_v4().to_string()), r#""text""#, "headers"),
    ];
    if text_ids {
        bad.push((Some(format!("not-a-uuid-{round}")), "{}", "id"));
    }
    bad.into_iter()
        .enumerate()
        .map(|(n, (id, headers, column))| Malformed {
            row: RawRow {
                id,
                headers: Some(headers.into()),
                partition_key: Some(format!("bad-{round}-{n}")),
                ..RawRow::new("item", format!("bad-{round}-{n}"), "t", "{}")
            },
            column,
        })
        .collect()
}

/// Malformed rows written past the database's checks (harnesses declaring
/// [`HarnessCapabilities::unchecked_raw_rows`](crate::HarnessCapabilities::unchecked_raw_rows)):
/// under each head policy, every one is dead-lettered on its own with a `last_error` naming
/// its column, the other keys' rows and unordered rows flow on, and a valid row behind a bad
/// one of its key waits under `Block` and flows under `Skip`. Then every admin path treats the
/// quarantined rows alike: `list_dead` lists them (a bad id as `raw_id`), `status` counts them,
/// `purge_published` leaves them, requeue by id and by `seq` give the same answer (a requeued
/// row is quarantined again by the next claim), and discard by id and by `seq` delete them and
/// unblock their keys.
pub async fn malformed_raw_rows_quarantined(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let caps = f.store.capabilities();
    if !caps.unchecked_raw_rows {
        return f.finish().await;
    }
    for (round, policy) in [("block", HeadPolicy::Block), ("skip", HeadPolicy::Skip)] {
        let bad = malformed_rows(round, caps.text_ids);
        let mut rows = Vec::new();
        let mut flowing = Vec::new();
        let mut behind = Vec::new();
        for (n, m) in bad.iter().enumerate() {
            let ok = RawRow::new("item", format!("ok-{round}-{n}"), "t", "{}");
            flowing.push(ok.aggregate_id.clone());
            rows.push(ok);
            rows.push(m.row.clone());
            let after = RawRow {
                partition_key: m.row.partition_key.clone(),
                ..RawRow::new("item", format!("behind-{round}-{n}"), "t", "{}")
            };
            behind.push(after.aggregate_id.clone());
            rows.push(after);
        }
        let unordered = RawRow {
            partition_key: Some(String::new()),
            ..RawRow::new("item", format!("unordered-{round}"), "t", "{}")
        };
        flowing.push(unordered.aggregate_id.clone());
        rows.push(unordered);
        f.store
            .insert_raw(&rows, false)
            .await
            .map_err(err("insert_raw of malformed rows, unchecked"))?;
        let got = drain_raw(&f, 3, policy).await?;
        let got_ids: BTreeSet<&str> = got.iter().map(|m| m.aggregate_id.as_str()).collect();
        let mut want: BTreeSet<&str> = flowing.iter().map(String::as_str).collect();
        if policy == HeadPolicy::Skip {
            want.extend(behind.iter().map(String::as_str));
        }
        ensure!(
            got_ids == want,
            "under {policy:?}, with malformed rows among them, claims until empty returned \
             {got_ids:?}; expected {want:?} (every valid row of another key, and {})",
            if policy == HeadPolicy::Skip {
                "under Skip the rows behind a quarantined one"
            } else {
                "under Block not the rows behind a quarantined one"
            }
        );
        // Every malformed row is dead, with its column named.
        let dead = f
            .admin
            .list_dead(None, 1000)
            .await
            .map_err(err("list_dead"))?;
        for m in &bad {
            let found = dead
                .iter()
                .find(|d| d.message.partition_key == m.row.partition_key);
            let Some(d) = found else {
                return Err(format!(
                    "under {policy:?}, malformed row {} (bad {}) is not listed dead: {:?}",
                    m.row.aggregate_id,
                    m.column,
                    dead.iter()
                        .map(|d| &d.message.partition_key)
                        .collect::<Vec<_>>()
                ));
            };
            ensure!(
                d.last_error.contains(&format!("column {}", m.column)),
                "malformed row {} is dead with last_error {:?}, which does not name the \
                 column {}",
                m.row.aggregate_id,
                d.last_error,
                m.column
            );
            if m.column == "id" {
                ensure!(
                    d.raw_id.as_deref() == m.row.id.as_deref() && d.message.id.is_nil(),
                    "the dead row with id {:?} is listed with raw_id {:?} and id {}; expected \
                     its stored id as raw_id and the nil UUID",
                    m.row.id,
                    d.raw_id,
                    d.message.id
                );
            }
        }
        let status = f.admin.status(100).await.map_err(err("status"))?;
        ensure!(
            status.dead == bad.len() as u64,
            "under {policy:?}: status reports {} dead, expected the {} quarantined rows",
            status.dead,
            bad.len()
        );
        // A purge deletes published rows only, never a quarantined one.
        f.advance(10).await?;
        f.admin
            .purge_published(Duration::from_secs(1), 1000)
            .await
            .map_err(err("purge_published"))?;
        let counts = f.counts().await?;
        ensure!(
            counts.dead == bad.len() as u64 && counts.published == 0,
            "under {policy:?}: after purging everything published, counts {counts:?}; \
             expected the {} quarantined rows still dead and nothing published",
            bad.len()
        );
        // Requeue by id and by seq answer alike; a requeued row is quarantined again.
        let headers_rows: Vec<&outbox_traits::DeadMessage> = bad
            .iter()
            .filter(|m| m.column == "headers")
            .filter_map(|m| {
                dead.iter()
                    .find(|d| d.message.partition_key == m.row.partition_key)
            })
            .collect();
        let (a, b) = (headers_rows[0], headers_rows[1]);
        let by_id = f.admin.requeue(&[a.message.id]).await;
        let by_seq = f.admin.requeue_seqs(&[b.message.seq]).await;
        let same = match (&by_id, &by_seq) {
            (Ok(x), Ok(y)) => x == y,
            (Err(x), Err(y)) => x.kind() == y.kind(),
            _ => false,
        };
        ensure!(
            same,
            "requeue by id of a quarantined row returned {by_id:?}, requeue by seq of one \
             alike returned {by_seq:?}: both paths must treat it the same way"
        );
        if matches!(by_id, Ok(1)) {
            let again = drain_raw(&f, 3, policy).await?;
            ensure!(
                again.is_empty(),
                "after requeueing two quarantined rows, claims returned {:?}",
                again.iter().map(|m| &m.aggregate_id).collect::<Vec<_>>()
            );
            let counts = f.counts().await?;
            ensure!(
                counts.dead == bad.len() as u64
                    && counts.pending + counts.leased
                        == if policy == HeadPolicy::Block {
                            behind.len() as u64
                        } else {
                            0
                        },
                "after requeueing two quarantined rows and claiming again: counts {counts:?}; \
                 expected them quarantined again ({} dead)",
                bad.len()
            );
        }
        // Discard: the header rows by id, the others by seq; their keys then flow.
        let dead = f
            .admin
            .list_dead(None, 1000)
            .await
            .map_err(err("list_dead"))?;
        let mut discarded = 0;
        for d in dead.iter().filter(|d| {
            bad.iter()
                .any(|m| m.row.partition_key == d.message.partition_key)
        }) {
            discarded += if d.message.id.is_nil() {
                f.admin.discard_seqs(&[d.message.seq]).await
            } else {
                f.admin.discard(&[d.message.id]).await
            }
            .map_err(err("discard of a quarantined row"))?;
        }
        ensure!(
            discarded == bad.len() as u64,
            "discarding the {} quarantined rows by id and by seq discarded {discarded}",
            bad.len()
        );
        let rest = drain_raw(&f, 3, policy).await?;
        let rest_ids: BTreeSet<&str> = rest.iter().map(|m| m.aggregate_id.as_str()).collect();
        let want: BTreeSet<&str> = if policy == HeadPolicy::Block {
            behind.iter().map(String::as_str).collect()
        } else {
            BTreeSet::new()
        };
        ensure!(
            rest_ids == want,
            "under {policy:?}, once the quarantined rows were discarded, claims returned \
             {rest_ids:?}, expected {want:?}"
        );
    }
    let counts = f.counts().await?;
    ensure!(
        counts.pending == 0 && counts.leased == 0 && counts.dead == 0,
        "at the end: counts {counts:?}, expected nothing pending, leased or dead"
    );
    f.finish().await
}

/// Binary payloads round-trip byte for byte, next to JSON ones in the same batch: bytes 0x00
/// and 0xff, invalid UTF-8, an empty body and a 64 KiB one (every byte value, repeated), each
/// with its content type, and `payload` JSON `null`; the JSON message of the batch comes back
/// with no binary payload and its JSON unchanged. A dead-lettered binary message is listed
/// with its bytes, and a requeued one is claimed with them again.
pub async fn binary_round_trip(harness: &dyn Harness) -> Result<(), String> {
    let f = Fixture::new(harness).await?;
    let large: Vec<u8> = (0..64 * 1024).map(|i| (i % 256) as u8).collect();
    let bin = |key: &str, content_type: &str, data: Vec<u8>| {
        NewMessage::binary(
            "order",
            key,
            "order.placed",
            Binary::new(content_type, data),
        )
        .with_header("tenant", "acme")
    };
    let sent = [
        // 0xc3 0x28 is not UTF-8; nor is a lone 0x80.
        bin(
            "o-1",
            "application/x-protobuf",
            vec![0x00, 0xff, 0xc3, 0x28, 0x80, 0x00],
        ),
        NewMessage::new("order", "o-2", "order.placed", serde_json::json!({"n": 1})),
        bin("o-3", "application/vnd.confluent.avro", large),
        bin("o-4", "text/plain; charset=utf-8", Vec::new()),
    ];
    f.enqueue(&sent).await?;
    let claim = f.claim(sent.len()).await?;
    ensure!(
        ids(&claim) == sent.iter().map(|m| m.id).collect::<Vec<_>>(),
        "claimed {:?}, enqueued {:?}",
        ids(&claim),
        sent.iter().map(|m| m.id).collect::<Vec<_>>()
    );
    for (want, got) in sent.iter().zip(&claim.messages) {
        match &want.binary {
            Some(binary) => {
                let back = got.binary.as_ref().ok_or_else(|| {
                    format!(
                        "binary message {} came back without its bytes (payload {:?})",
                        got.id, got.payload
                    )
                })?;
                ensure!(
                    back.content_type == binary.content_type,
                    "content type changed: {:?} -> {:?}",
                    binary.content_type,
                    back.content_type
                );
                ensure!(
                    back.data == binary.data,
                    "bytes changed for {:?}: {} bytes sent, {} back, first difference at {:?}",
                    binary.content_type,
                    binary.data.len(),
                    back.data.len(),
                    binary.data.iter().zip(&back.data).position(|(a, b)| a != b)
                );
                ensure!(
                    got.payload == "null",
                    "a binary message's payload is {:?}, not null",
                    got.payload
                );
                ensure!(
                    got.body() == binary.data.as_slice()
                        && got.content_type() == binary.content_type,
                    "body or content type of {} is not its binary payload's",
                    got.id
                );
            }
            None => {
                ensure!(
                    got.binary.is_none(),
                    "the JSON message came back binary: {:?}",
                    got.binary.as_ref().map(|b| &b.content_type)
                );
                let payload: serde_json::Value = serde_json::from_str(&got.payload)
                    .map_err(|e| format!("payload is not JSON: {e}"))?;
                ensure!(payload == want.payload, "payload changed: {}", got.payload);
            }
        }
        ensure!(
            got.headers == want.headers,
            "headers changed: {:?}",
            got.headers
        );
    }
    // The dead-letter listing and a requeue keep the bytes.
    let first = sent[0].id;
    f.relay
        .fail(claim.token, &[dead(first, "broker refused it")])
        .await
        .map_err(err("fail"))?;
    let rest: Vec<Uuid> = ids(&claim).into_iter().filter(|id| *id != first).collect();
    f.relay
        .complete(claim.token, &rest)
        .await
        .map_err(err("complete"))?;
    let listed = f
        .admin
        .list_dead(None, 10)
        .await
        .map_err(err("list_dead"))?;
    let shown = listed
        .iter()
        .find(|d| d.message.id == first)
        .ok_or("the dead binary message is not listed")?;
    ensure!(
        shown.message.binary == sent[0].binary,
        "list_dead shows the binary message as {:?}",
        shown.message.binary
    );
    let requeued = f.admin.requeue(&[first]).await.map_err(err("requeue"))?;
    ensure!(requeued == 1, "requeue returned {requeued}");
    let again = f.claim(1).await?;
    ensure!(
        ids(&again) == [first]
            && again.messages.first().and_then(|m| m.binary.as_ref()) == sent[0].binary.as_ref(),
        "the requeued binary message came back as {:?}",
        again.messages.first().map(|m| &m.binary)
    );
    f.relay
        .complete(again.token, &ids(&again))
        .await
        .map_err(err("complete"))?;
    f.finish().await
}

/// Every check, by name, so the macro and pickers can run them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Check {
    /// [`claim_respects_limit`]
    ClaimRespectsLimit,
    /// [`no_phantoms`]
    NoPhantoms,
    /// [`late_commit_is_claimed`]
    LateCommitIsClaimed,
    /// [`per_key_head_of_line`]
    PerKeyHeadOfLine,
    /// [`concurrent_writers_of_a_key`]
    ConcurrentWritersOfAKey,
    /// [`dead_head_blocks_or_skips`]
    DeadHeadBlocksOrSkips,
    /// [`stale_token_is_fenced`]
    StaleTokenIsFenced,
    /// [`expired_lease_is_fenced`]
    ExpiredLeaseIsFenced,
    /// [`lease_uses_store_clock`]
    LeaseUsesStoreClock,
    /// [`retry_waits_and_counts`]
    RetryWaitsAndCounts,
    /// [`retry_holds_back_its_key_only`]
    RetryHoldsBackItsKeyOnly,
    /// [`dead_letters_requeue_discard`]
    DeadLettersRequeueDiscard,
    /// [`purge_is_bounded`]
    PurgeIsBounded,
    /// [`concurrent_purges_count_exactly`]
    ConcurrentPurgesCountExactly,
    /// [`not_before_delays`]
    NotBeforeDelays,
    /// [`crash_keeps_leases`]
    CrashKeepsLeases,
    /// [`extend_keeps_lease`]
    ExtendKeepsLease,
    /// [`message_round_trip`]
    MessageRoundTrip,
    /// [`enqueue_refusals`]
    EnqueueRefusals,
    /// [`concurrent_claims_are_exclusive`]
    ConcurrentClaimsAreExclusive,
    /// [`dedup_key_outlives_its_message_only_while_kept`]
    DedupKeyOutlivesItsMessageOnlyWhileKept,
    /// [`blocked_backlog_hides_no_key`]
    BlockedBacklogHidesNoKey,
    /// [`many_keys_behind_a_blocked_backlog`]
    ManyKeysBehindABlockedBacklog,
    /// [`invalid_shard_is_refused`]
    InvalidShardIsRefused,
    /// [`shards_partition_keys`]
    ShardsPartitionKeys,
    /// [`argument_rules`]
    ArgumentRules,
    /// [`raw_rows_round_trip`]
    RawRowsRoundTrip,
    /// [`malformed_raw_rows_quarantined`]
    MalformedRawRowsQuarantined,
    /// [`binary_round_trip`]
    BinaryRoundTrip,
}

impl Check {
    /// Every check.
    pub const ALL: [Check; 29] = [
        Check::ClaimRespectsLimit,
        Check::NoPhantoms,
        Check::LateCommitIsClaimed,
        Check::PerKeyHeadOfLine,
        Check::ConcurrentWritersOfAKey,
        Check::DeadHeadBlocksOrSkips,
        Check::StaleTokenIsFenced,
        Check::ExpiredLeaseIsFenced,
        Check::LeaseUsesStoreClock,
        Check::RetryWaitsAndCounts,
        Check::RetryHoldsBackItsKeyOnly,
        Check::DeadLettersRequeueDiscard,
        Check::PurgeIsBounded,
        Check::ConcurrentPurgesCountExactly,
        Check::NotBeforeDelays,
        Check::CrashKeepsLeases,
        Check::ExtendKeepsLease,
        Check::MessageRoundTrip,
        Check::EnqueueRefusals,
        Check::ConcurrentClaimsAreExclusive,
        Check::DedupKeyOutlivesItsMessageOnlyWhileKept,
        Check::BlockedBacklogHidesNoKey,
        Check::ManyKeysBehindABlockedBacklog,
        Check::InvalidShardIsRefused,
        Check::ShardsPartitionKeys,
        Check::ArgumentRules,
        Check::RawRowsRoundTrip,
        Check::MalformedRawRowsQuarantined,
        Check::BinaryRoundTrip,
    ];

    /// The checks that go through the enqueue path: transactions that commit late, roll back or
    /// stay open, batch order, every field round-tripped, not-before times, typed refusals and
    /// dedup keys. A backend with a second enqueue path (another driver) runs these through it
    /// with [`enqueue_suite!`](crate::enqueue_suite): its harness opens business transactions on
    /// that driver while relays and admin stay the backend's store.
    pub const ENQUEUE: [Check; 9] = [
        Check::ClaimRespectsLimit,
        Check::NoPhantoms,
        Check::LateCommitIsClaimed,
        Check::PerKeyHeadOfLine,
        Check::NotBeforeDelays,
        Check::MessageRoundTrip,
        Check::EnqueueRefusals,
        Check::DedupKeyOutlivesItsMessageOnlyWhileKept,
        Check::BinaryRoundTrip,
    ];

    /// Run this check against a fresh store of `harness`.
    pub async fn run(self, harness: &dyn Harness) -> Result<(), String> {
        match self {
            Check::ClaimRespectsLimit => claim_respects_limit(harness).await,
            Check::NoPhantoms => no_phantoms(harness).await,
            Check::LateCommitIsClaimed => late_commit_is_claimed(harness).await,
            Check::PerKeyHeadOfLine => per_key_head_of_line(harness).await,
            Check::ConcurrentWritersOfAKey => concurrent_writers_of_a_key(harness).await,
            Check::DeadHeadBlocksOrSkips => dead_head_blocks_or_skips(harness).await,
            Check::StaleTokenIsFenced => stale_token_is_fenced(harness).await,
            Check::ExpiredLeaseIsFenced => expired_lease_is_fenced(harness).await,
            Check::LeaseUsesStoreClock => lease_uses_store_clock(harness).await,
            Check::RetryWaitsAndCounts => retry_waits_and_counts(harness).await,
            Check::RetryHoldsBackItsKeyOnly => retry_holds_back_its_key_only(harness).await,
            Check::DeadLettersRequeueDiscard => dead_letters_requeue_discard(harness).await,
            Check::PurgeIsBounded => purge_is_bounded(harness).await,
            Check::ConcurrentPurgesCountExactly => concurrent_purges_count_exactly(harness).await,
            Check::NotBeforeDelays => not_before_delays(harness).await,
            Check::CrashKeepsLeases => crash_keeps_leases(harness).await,
            Check::ExtendKeepsLease => extend_keeps_lease(harness).await,
            Check::MessageRoundTrip => message_round_trip(harness).await,
            Check::EnqueueRefusals => enqueue_refusals(harness).await,
            Check::ConcurrentClaimsAreExclusive => concurrent_claims_are_exclusive(harness).await,
            Check::DedupKeyOutlivesItsMessageOnlyWhileKept => {
                dedup_key_outlives_its_message_only_while_kept(harness).await
            }
            Check::BlockedBacklogHidesNoKey => blocked_backlog_hides_no_key(harness).await,
            Check::ManyKeysBehindABlockedBacklog => {
                many_keys_behind_a_blocked_backlog(harness).await
            }
            Check::InvalidShardIsRefused => invalid_shard_is_refused(harness).await,
            Check::ShardsPartitionKeys => shards_partition_keys(harness).await,
            Check::ArgumentRules => argument_rules(harness).await,
            Check::RawRowsRoundTrip => raw_rows_round_trip(harness).await,
            Check::MalformedRawRowsQuarantined => malformed_raw_rows_quarantined(harness).await,
            Check::BinaryRoundTrip => binary_round_trip(harness).await,
        }
    }

    /// Run this check on a runtime of its own, for a plain `#[test]`. Blocking.
    pub fn run_blocking(self, harness: &dyn Harness) -> Result<(), String> {
        crate::property::runtime()?
            .block_on(self.run(harness))
            .map_err(|e| format!("{} failed check {self:?}: {e}", harness.name()))
    }
}
