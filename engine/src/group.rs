//! Relay groups: replicas of a relay on one outbox divide its claim shards between them.
//!
//! A relay whose [`RelayConfig::group`](crate::RelayConfig::group) is set, and that was given a
//! [`RelayGroupStore`] ([`Relay::with_group_store`](crate::Relay::with_group_store)), runs a
//! renewal task beside its loop: every third of
//! [`RelayConfig::group_lease`](crate::RelayConfig::group_lease) it renews its heartbeat and
//! shard leases in the database ([`RelayGroupStore::renew_group`], one round trip), which also
//! rebalances: each live member holds at most `ceil(shards / members)` shards, gives back the
//! rest and takes free or expired ones. The loop claims only the shards the last renewal
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

/// Renew every third of the lease (a sixth after a failure) until stopped, publishing what is
/// held; then leave.
async fn renew_loop(
    store: Arc<dyn RelayGroupStore>,
    req: GroupRenewal,
    tx: watch::Sender<Ownership>,
    mut stop: oneshot::Receiver<()>,
) {
    let every = req.lease / 3;
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
                sent + every
            }
            Err(e) => {
                counter!(GROUP_RENEWAL_ERRORS_TOTAL, "group" => group.clone()).increment(1);
                warn!(group = %group, error = %e, "relay group renewal failed; retrying");
                sent + every / 2
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
