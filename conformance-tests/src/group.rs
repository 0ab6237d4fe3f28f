//! Conformance of relay groups ([`RelayGroupStore`]): shard leases are exclusive at every
//! database time, the fair share `ceil(shards / live members)` is taken and given back, an
//! expired holder is taken over and fenced (its lease is not revived and the shard's fence
//! moves), a member that leaves gives its shards back at once, bad requests are refused, and
//! members renewing at the same moment never hold one shard twice.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_traits::async_trait;
use outbox_traits::{Error, GroupRenewal, GroupView, RelayGroupStore};
use uuid::Uuid;

/// What [`check_group`] needs from a store that keeps relay groups.
#[async_trait]
pub trait GroupHarness: Send + Sync {
    /// The store under test.
    fn groups(&self) -> &dyn RelayGroupStore;
    /// Move the database's clock forward by `by` for the group leases and heartbeats (e.g. by
    /// moving their stored times back).
    async fn advance(&self, by: Duration) -> Result<(), Error>;

    /// Remove what the check left behind (e.g. drop a schema made for it), after the check
    /// passed or failed. By default nothing.
    async fn cleanup(&self) -> Result<(), Error> {
        Ok(())
    }
}

/// Run [`check_group`] on a runtime of its own, in a fresh group, against the harness the
/// future `harness` gives (`None`: skip, as when a server's URL is unset), then
/// [`GroupHarness::cleanup`]. What [`group_suite!`](crate::group_suite) expands to.
///
/// # Errors
/// The first broken rule, in words.
pub fn run_group_suite<H, F>(harness: F) -> Result<(), String>
where
    H: GroupHarness,
    F: std::future::Future<Output = Option<H>>,
{
    crate::property::runtime()?.block_on(async {
        let Some(harness) = harness.await else {
            return Ok(());
        };
        let group = format!("conformance-{}", Uuid::new_v4().simple());
        let result = check_group(&harness, &group).await;
        let cleaned = harness.cleanup().await;
        result?;
        cleaned.map_err(|e| format!("cleanup after the group check: {e}"))
    })
}

const LEASE: Duration = Duration::from_secs(10);
const SHARDS: u32 = 4;

fn renewal(group: &str, member: Uuid, shards: u32) -> GroupRenewal {
    GroupRenewal {
        group: group.to_owned(),
        member,
        member_name: format!("member-{member}"),
        shards,
        lease: LEASE,
    }
}

fn held(view: &GroupView) -> Vec<u32> {
    view.owned.iter().map(|l| l.shard).collect()
}

async fn renew(h: &dyn GroupHarness, group: &str, member: Uuid) -> Result<GroupView, String> {
    h.groups()
        .renew_group(&renewal(group, member, SHARDS))
        .await
        .map_err(|e| format!("renew_group: {e}"))
}

/// Every live member's shards, checking that no shard is listed twice.
async fn exclusive(h: &dyn GroupHarness, group: &str) -> Result<Vec<(Uuid, Vec<u32>)>, String> {
    let members = h
        .groups()
        .group_status(group)
        .await
        .map_err(|e| format!("group_status: {e}"))?;
    let mut seen = BTreeSet::new();
    for m in &members {
        for s in &m.shards {
            if !seen.insert(*s) {
                return Err(format!("shard {s} held by two members: {members:?}"));
            }
        }
        if !m.alive && !m.shards.is_empty() {
            return Err(format!(
                "a member whose heartbeat expired holds shards: {members:?}"
            ));
        }
    }
    Ok(members.into_iter().map(|m| (m.member, m.shards)).collect())
}

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

/// Run every group rule against `h`, in group `group` (fresh: never used before).
pub async fn check_group(h: &dyn GroupHarness, group: &str) -> Result<(), String> {
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    // Bad requests change nothing.
    for (bad, what) in [
        (renewal(group, a, 0), "no shards"),
        (renewal("", a, SHARDS), "an empty group name"),
        (
            GroupRenewal {
                lease: Duration::ZERO,
                ..renewal(group, a, SHARDS)
            },
            "a lease of 0",
        ),
    ] {
        let r = h.groups().renew_group(&bad).await;
        ensure!(
            matches!(r, Err(Error::InvalidInput(_))),
            "a renewal with {what} returned {r:?}, expected InvalidInput"
        );
    }
    ensure!(
        exclusive(h, group).await?.is_empty(),
        "refused renewals joined the group"
    );

    // Alone, a member takes every shard.
    let va = renew(h, group, a).await?;
    ensure!(
        held(&va) == [0, 1, 2, 3] && va.members == 1,
        "a lone member holds {:?} with {} members",
        held(&va),
        va.members
    );
    let first_fence = va.owned[0].fence;
    // A second joins: nothing is free until the first gives back its extra share.
    let vb = renew(h, group, b).await?;
    ensure!(
        held(&vb).is_empty() && vb.members == 2,
        "a joining member took {:?} while every shard was held ({} members)",
        held(&vb),
        vb.members
    );
    let va = renew(h, group, a).await?;
    ensure!(
        held(&va) == [0, 1],
        "with 2 members the first kept {:?}",
        held(&va)
    );
    let vb = renew(h, group, b).await?;
    ensure!(
        held(&vb) == [2, 3],
        "with 2 members the second took {:?}",
        held(&vb)
    );
    exclusive(h, group).await?;
    // A renewal of held shards keeps their fence.
    let va2 = renew(h, group, a).await?;
    ensure!(
        va2.owned[0].fence == first_fence && va2.owned[0].lease_until >= va.owned[0].lease_until,
        "a renewal changed the fence or shortened the lease: {va:?} then {va2:?}"
    );

    // Both expire; a third takes every shard, with new fences.
    h.advance(LEASE + Duration::from_secs(1))
        .await
        .map_err(|e| format!("advance: {e}"))?;
    let members = exclusive(h, group).await?;
    ensure!(
        members.iter().all(|(_, s)| s.is_empty()),
        "expired leases still held: {members:?}"
    );
    let vc = renew(h, group, c).await?;
    ensure!(
        held(&vc) == [0, 1, 2, 3] && vc.members == 1,
        "after both expired the third holds {:?} ({} members)",
        held(&vc),
        vc.members
    );
    ensure!(
        vc.owned[0].fence > first_fence,
        "a takeover kept the fence {first_fence}: {vc:?}"
    );
    // The stale first member is fenced: its expired leases are not revived.
    let va = renew(h, group, a).await?;
    ensure!(
        held(&va).is_empty(),
        "a stale member got back {:?} that another holds",
        held(&va)
    );
    exclusive(h, group).await?;
    let vc = renew(h, group, c).await?;
    ensure!(
        held(&vc) == [0, 1],
        "the third kept {:?} with 2 members",
        held(&vc)
    );
    let va = renew(h, group, a).await?;
    ensure!(
        held(&va) == [2, 3],
        "the rejoined member took {:?}",
        held(&va)
    );

    // Leaving gives the shards back at once.
    h.groups()
        .leave_group(group, a)
        .await
        .map_err(|e| format!("leave_group: {e}"))?;
    h.groups()
        .leave_group(group, a)
        .await
        .map_err(|e| format!("leaving twice: {e}"))?;
    let members = exclusive(h, group).await?;
    ensure!(
        members.iter().all(|(m, _)| *m != a),
        "a member that left is still listed: {members:?}"
    );
    let vc = renew(h, group, c).await?;
    ensure!(
        held(&vc) == [0, 1, 2, 3],
        "after a leave the last holds {:?}",
        held(&vc)
    );

    // Members renewing at the same moment never hold a shard twice.
    let many: Vec<Uuid> = (0..6).map(|_| Uuid::new_v4()).collect();
    for _round in 0..4 {
        let views =
            futures::future::join_all(many.iter().chain([&c]).map(|m| renew(h, group, *m))).await;
        let mut seen = BTreeSet::new();
        for view in views {
            for s in held(&view?) {
                ensure!(
                    seen.insert(s),
                    "shard {s} granted to two members renewing at once"
                );
            }
        }
        exclusive(h, group).await?;
    }
    for m in many.iter().chain([&c]) {
        h.groups()
            .leave_group(group, *m)
            .await
            .map_err(|e| format!("leave_group: {e}"))?;
    }
    Ok(())
}
