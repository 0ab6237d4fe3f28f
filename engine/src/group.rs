//! Relay groups: replicas of a relay on one outbox divide its claim shards between them.
//!
//! A relay whose [`RelayConfig::group`](crate::RelayConfig::group) is set, and that was given a
//! [`RelayGroupStore`] ([`Relay::with_group_store`](crate::Relay::with_group_store)), runs a
//! renewal task beside its loop: every third of
//! [`RelayConfig::group_lease`](crate::RelayConfig::group_lease), and at least every second
//! ([`RENEW_AT_LEAST_EVERY`]), it renews its heartbeat and shard leases in the database
//! ([`RelayGroupStore::renew_group`], one round trip), which also rebalances: each live member
//! holds at most `ceil(shards / members)` shards, gives back the rest and takes free or expired
//! ones. A member that holds less than its share just after it joined, or after the group's
//! size changed, renews every [`CATCH_UP_EVERY`] for two renewal periods, so it takes the
//! shards the others give back at their next renewal at once: a joining replica gets its share
//! within about a second, not within a lease. The loop claims only the shards the last renewal
//! granted, and only until their lease would end by the relay's own monotonic clock (the
//! database's lease length, counted from before the renewal was sent), so a relay that froze
//! stops claiming them as soon as it resumes, before it even renews. A relay that holds nothing
//! waits as a hot standby. At shutdown it leaves the group, giving its shards back at once.
//!
//! Correctness never depends on the group: claims stay exclusive, fenced and ordered by
//! themselves, so a frozen replica past its lease, or an old relay without groups, costs speed
//! only.

use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge};
use outbox_traits::{GroupRenewal, RelayGroupStore};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};
use uuid::Uuid;

/// Gauge: claim shards this relay holds in its group (labelled `group`).
pub const GROUP_OWNED_SHARDS: &str = "outbox_group_owned_shards";
/// Gauge: live members of this relay's group, as its last renewal counted them.
pub const GROUP_MEMBERS: &str = "outbox_group_members";
/// Group renewals that failed (the relay keeps its shards until their lease would end).
pub const GROUP_RENEWAL_ERRORS_TOTAL: &str = "outbox_group_renewal_errors_total";
/// The longest time between two renewals of a member, whatever the lease: how soon the
/// holders hear that a replica joined (and give it its share), and how soon an expired or
/// given-back shard is taken.
pub const RENEW_AT_LEAST_EVERY: Duration = Duration::from_secs(1);
/// How often a member renews while it catches up: it holds less than its fair share, and it
/// joined, or the group's size changed, within the last two renewal periods.
pub const CATCH_UP_EVERY: Duration = Duration::from_millis(100);

/// Messages handed out by claims, per claim shard (label `shard`; only with more than one).
pub const SHARD_CLAIMED_TOTAL: &str = "outbox_shard_claimed_total";
/// Messages published, per claim shard (label `shard`; only with more than one).
pub const SHARD_PUBLISHED_TOTAL: &str = "outbox_shard_published_total";

/// The shards a relay may claim now, as its group task last heard from the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ownership {
    /// One flag per claim shard.
    pub(crate) owned: Vec<bool>,
    /// When the shortest of the held leases ends, by this host's monotonic clock (`None`: none
    /// held).
    pub(crate) until: Option<Instant>,
}

impl Ownership {
    fn none(shards: usize) -> Self {
        Self {
            owned: vec![false; shards],
            until: None,
        }
    }

    /// Whether shard `index` may be claimed at `now`.
    pub(crate) fn holds(&self, index: usize, now: Instant) -> bool {
        self.owned.get(index).copied().unwrap_or(false) && self.until.is_some_and(|u| now < u)
    }
}

/// A running group membership: the ownership the loop reads, and the renewal task.
pub(crate) struct Membership {
    pub(crate) ownership: watch::Receiver<Ownership>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Membership {
    /// Join `group` with `shards` claim shards: start renewing in a task.
    pub(crate) fn join(
        store: Arc<dyn RelayGroupStore>,
        group: String,
        shards: u32,
        lease: Duration,
    ) -> Self {
        let (tx, rx) = watch::channel(Ownership::none(shards as usize));
        let (stop_tx, stop_rx) = oneshot::channel();
        let req = GroupRenewal {
            group,
            member: Uuid::new_v4(),
            member_name: member_name(),
            shards,
            lease,
        };
        let task = tokio::spawn(renew_loop(store, req, tx, stop_rx));
        Self {
            ownership: rx,
            stop: Some(stop_tx),
            task,
        }
    }

    /// Stop renewing and leave the group (giving the shards back), waiting up to `grace`.
    pub(crate) async fn leave(mut self, grace: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(grace, &mut self.task).await.is_err() {
            self.task.abort();
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        // Dropped without `leave` (the loop's future was dropped): stop renewing; the leases
        // expire by themselves.
        if self.stop.is_some() {
            self.task.abort();
        }
    }
}

/// `host:pid`, for operators reading `outbox-relay status`.
fn member_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let mut name = format!("{host}:{}", std::process::id());
    name.truncate(outbox_traits::MAX_GROUP_NAME_BYTES);
    name
}

/// When a member renews: its period, and the catch-up after a change of the group's size.
#[derive(Debug)]
struct Cadence {
    /// A third of the lease, at most [`RENEW_AT_LEAST_EVERY`].
    every: Duration,
    /// Until when a member short of its share renews every [`CATCH_UP_EVERY`].
    catch_up_until: Instant,
    /// The group's size at the last renewal (`None` before the first).
    members: Option<u32>,
}

impl Cadence {
    fn new(lease: Duration, joined: Instant) -> Self {
        let every = (lease / 3).min(RENEW_AT_LEAST_EVERY);
        Self {
            every,
            catch_up_until: joined + every * 2,
            members: None,
        }
    }

    /// When to renew after a renewal sent at `sent` that answered: `members` live, `held` of
    /// `shards` held.
    fn after_renewal(&mut self, sent: Instant, members: u32, held: usize, shards: u32) -> Instant {
        if self.members.is_some_and(|m| m != members) {
            // Someone joined or left: the holders give back or take at their next renewal,
            // within one period.
            self.catch_up_until = sent + self.every * 2;
        }
        self.members = Some(members);
        let short = (held as u64) < u64::from(outbox_traits::fair_share(shards, members));
        if short && sent < self.catch_up_until {
            sent + CATCH_UP_EVERY.min(self.every)
        } else {
            sent + self.every
        }
    }

    /// When to renew after a renewal sent at `sent` failed.
    fn after_failure(&self, sent: Instant) -> Instant {
        sent + self.every / 2
    }
}

/// Renew on the member's [`Cadence`] until stopped, publishing what is held; then leave.
async fn renew_loop(
    store: Arc<dyn RelayGroupStore>,
    req: GroupRenewal,
    tx: watch::Sender<Ownership>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut cadence = Cadence::new(req.lease, Instant::now());
    let group = req.group.clone();
    let mut last: Vec<u32> = Vec::new();
    info!(group = %req.group, member = %req.member, name = %req.member_name, "joining relay group");
    loop {
        let sent = Instant::now();
        let result = tokio::select! {
            r = store.renew_group(&req) => r,
            _ = &mut stop => break,
        };
        let next = match result {
            Ok(view) => {
                let held: Vec<u32> = view.owned.iter().map(|l| l.shard).collect();
                let until = view
                    .owned
                    .iter()
                    .map(|l| l.lease_until)
                    .min()
                    .map(|end| sent + (end - view.now).to_std().unwrap_or(Duration::ZERO));
                let mut owned = vec![false; req.shards as usize];
                for shard in &held {
                    if let Some(flag) = owned.get_mut(*shard as usize) {
                        *flag = true;
                    }
                }
                if held != last {
                    info!(
                        group = %group,
                        shards = ?held,
                        of = req.shards,
                        members = view.members,
                        "relay group: holding shards"
                    );
                    last = held;
                }
                gauge!(GROUP_OWNED_SHARDS, "group" => group.clone()).set(last.len() as f64);
                gauge!(GROUP_MEMBERS, "group" => group.clone()).set(f64::from(view.members));
                tx.send_replace(Ownership { owned, until });
                cadence.after_renewal(sent, view.members, last.len(), req.shards)
            }
            Err(e) => {
                counter!(GROUP_RENEWAL_ERRORS_TOTAL, "group" => group.clone()).increment(1);
                warn!(group = %group, error = %e, "relay group renewal failed; retrying");
                cadence.after_failure(sent)
            }
        };
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            _ = &mut stop => break,
        }
    }
    gauge!(GROUP_OWNED_SHARDS, "group" => group.clone()).set(0.0);
    tx.send_replace(Ownership::none(req.shards as usize));
    match store.leave_group(&req.group, req.member).await {
        Ok(()) => info!(group = %group, "left relay group"),
        Err(e) => {
            warn!(group = %group, error = %e, "leaving the relay group failed; its leases will expire")
        }
    }
}

/// Resolve when the ownership changes (never, without a group or once the task is gone).
pub(crate) async fn changed(rx: &mut Option<watch::Receiver<Ownership>>) -> Option<Ownership> {
    match rx {
        Some(r) => match r.changed().await {
            Ok(()) => Some(r.borrow_and_update().clone()),
            Err(_) => {
                *rx = None;
                None
            }
        },
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_memory::MemoryStore;

    #[test]
    fn a_member_renews_every_third_of_the_lease_but_at_least_every_second() {
        let t0 = Instant::now();
        assert_eq!(
            Cadence::new(Duration::from_secs(10), t0).every,
            Duration::from_secs(1)
        );
        assert_eq!(
            Cadence::new(Duration::from_millis(300), t0).every,
            Duration::from_millis(100)
        );
    }

    #[test]
    fn a_member_short_of_its_share_catches_up_only_after_a_join_or_a_change() {
        let t0 = Instant::now();
        let mut c = Cadence::new(Duration::from_secs(10), t0);
        // Just joined, holding 0 of its share of 3 (6 shards, 2 members): renew soon.
        assert_eq!(c.after_renewal(t0, 2, 0, 6), t0 + CATCH_UP_EVERY);
        // Holding its share: the ordinary period.
        let t1 = t0 + Duration::from_millis(300);
        assert_eq!(c.after_renewal(t1, 2, 3, 6), t1 + Duration::from_secs(1));
        // Two periods after joining, still short with no change (a standby when there are more
        // members than shards): the ordinary period, no busy renewing.
        let t2 = t0 + Duration::from_secs(3);
        assert_eq!(c.after_renewal(t2, 2, 0, 6), t2 + Duration::from_secs(1));
        // The group grew: short of the new share, catch up again.
        let t3 = t2 + Duration::from_secs(1);
        assert_eq!(c.after_renewal(t3, 3, 1, 6), t3 + CATCH_UP_EVERY);
        // A failure retries at half the period.
        assert_eq!(c.after_failure(t3), t3 + Duration::from_millis(500));
    }

    async fn holding(m: &mut Membership, count: usize) -> Instant {
        loop {
            if m.ownership.borrow().owned.iter().filter(|o| **o).count() == count {
                return Instant::now();
            }
            m.ownership.changed().await.expect("renewal task runs");
        }
    }

    /// The first replica takes every shard; one that joins gets its share at the holder's next
    /// renewal, within about a second of tokio's (paused) time, not within the 10 s lease.
    #[tokio::test(start_paused = true)]
    async fn a_joining_replica_gets_its_share_within_about_a_second() {
        let store: Arc<dyn RelayGroupStore> = Arc::new(MemoryStore::new());
        let lease = Duration::from_secs(10);
        let mut first = Membership::join(store.clone(), "g".into(), 6, lease);
        holding(&mut first, 6).await;
        // Join half a period after the holder's renewal. The holder gives back at its next
        // renewal, half a period later, and the joiner, catching up, takes them within
        // CATCH_UP_EVERY (without the catch-up it would wait for its own next renewal, a full
        // period after joining). The worst case, joining just after the holder renewed, is a
        // period and a catch-up step.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let joined = Instant::now();
        let mut second = Membership::join(store.clone(), "g".into(), 6, lease);
        let got = holding(&mut second, 3).await;
        holding(&mut first, 3).await;
        let waited = got - joined;
        assert!(
            waited <= Duration::from_millis(500) + CATCH_UP_EVERY,
            "the joiner waited {waited:?} for its share"
        );
        second.leave(Duration::from_secs(1)).await;
        // The one left takes the given-back shards back at its next renewal.
        holding(&mut first, 6).await;
        first.leave(Duration::from_secs(1)).await;
    }
}
