//! The memory store's relay groups ([`RelayGroupStore`]): the reference model of the Postgres
//! implementation, on the store's [`Clock`](crate::Clock).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use outbox_traits::{
    async_trait, fair_share, Error, GroupMember, GroupRenewal, GroupView, RelayGroupStore,
    ShardLease,
};
use uuid::Uuid;

use crate::defect::Defect;
use crate::store::MemoryStore;

/// One member's heartbeat.
#[derive(Debug, Clone)]
struct Member {
    name: String,
    /// Order of joining, for status.
    joined: u64,
    renewed_at: DateTime<Utc>,
    lease_until: DateTime<Utc>,
}

/// One shard's lease.
#[derive(Debug, Clone, Default)]
struct Shard {
    owner: Option<Uuid>,
    fence: i64,
    lease_until: Option<DateTime<Utc>>,
}

impl Shard {
    fn held_by(&self, member: Uuid, now: DateTime<Utc>) -> bool {
        self.owner == Some(member) && self.lease_until.is_some_and(|until| until > now)
    }

    fn free(&self, now: DateTime<Utc>, defect: Option<Defect>) -> bool {
        match defect {
            Some(Defect::GroupSharesShards) => true,
            Some(Defect::GroupNoTakeover) => self.owner.is_none(),
            _ => self.owner.is_none() || self.lease_until.is_none_or(|until| until <= now),
        }
    }
}

/// One group's members and shards.
#[derive(Debug, Default)]
struct Group {
    members: BTreeMap<Uuid, Member>,
    shards: BTreeMap<u32, Shard>,
}

/// Every group of a memory store.
#[derive(Debug, Default)]
pub(crate) struct Groups {
    groups: BTreeMap<String, Group>,
    joins: u64,
}

/// How long a member whose heartbeat expired is still listed by status.
const FORGET_AFTER: chrono::TimeDelta = chrono::TimeDelta::hours(1);

impl Groups {
    fn renew(
        &mut self,
        req: &GroupRenewal,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
        defect: Option<Defect>,
    ) -> GroupView {
        self.joins += 1;
        let joins = self.joins;
        let group = self.groups.entry(req.group.clone()).or_default();
        let member = req.member;
        group
            .members
            .entry(member)
            .and_modify(|m| {
                m.name.clone_from(&req.member_name);
                m.renewed_at = now;
                m.lease_until = until;
            })
            .or_insert_with(|| Member {
                name: req.member_name.clone(),
                joined: joins,
                renewed_at: now,
                lease_until: until,
            });
        group
            .members
            .retain(|_, m| m.lease_until >= now - FORGET_AFTER);
        let live = group
            .members
            .values()
            .filter(|m| m.lease_until > now)
            .count();
        let members = u32::try_from(live).unwrap_or(u32::MAX);
        let share = if defect == Some(Defect::GroupGreedy) {
            req.shards as usize
        } else {
            fair_share(req.shards, members) as usize
        };
        for index in 0..req.shards {
            group.shards.entry(index).or_default();
        }
        // Give back what is beyond the share (highest indexes first), or beyond the count.
        let mut held = 0;
        for (index, shard) in group.shards.iter_mut() {
            if !shard.held_by(member, now) {
                continue;
            }
            if *index < req.shards && held < share {
                held += 1;
                shard.lease_until = Some(until);
            } else {
                shard.owner = None;
                shard.lease_until = None;
            }
        }
        for (index, shard) in group.shards.iter_mut() {
            if held >= share {
                break;
            }
            if *index < req.shards && shard.free(now, defect) && !shard.held_by(member, now) {
                let taken_over = shard.owner.is_some();
                shard.owner = Some(member);
                if !(taken_over && defect == Some(Defect::GroupKeepsFence)) {
                    shard.fence += 1;
                }
                shard.lease_until = Some(until);
                held += 1;
            }
        }
        let owned = group
            .shards
            .iter()
            .filter(|(_, s)| s.held_by(member, now))
            .filter_map(|(index, s)| {
                Some(ShardLease {
                    shard: *index,
                    fence: s.fence,
                    lease_until: s.lease_until?,
                })
            })
            .collect();
        GroupView {
            now,
            members,
            owned,
        }
    }
}

#[async_trait]
impl RelayGroupStore for MemoryStore {
    async fn renew_group(&self, req: &GroupRenewal) -> Result<GroupView, Error> {
        req.validate()?;
        let now = self.clock().now();
        let until = chrono::Duration::from_std(req.lease)
            .ok()
            .and_then(|lease| now.checked_add_signed(lease))
            .ok_or_else(|| Error::invalid_input("relay group lease is too long"))?;
        let defect = self.defect();
        Ok(self.with_groups(|groups| groups.renew(req, now, until, defect)))
    }

    async fn leave_group(&self, group: &str, member: Uuid) -> Result<(), Error> {
        if self.defect() == Some(Defect::GroupLeaveKeeps) {
            self.with_groups(|groups| {
                if let Some(group) = groups.groups.get_mut(group) {
                    group.members.remove(&member);
                }
            });
            return Ok(());
        }
        self.with_groups(|groups| {
            if let Some(group) = groups.groups.get_mut(group) {
                group.members.remove(&member);
                for shard in group.shards.values_mut() {
                    if shard.owner == Some(member) {
                        shard.owner = None;
                        shard.lease_until = None;
                    }
                }
            }
        });
        Ok(())
    }

    async fn group_status(&self, group: &str) -> Result<Vec<GroupMember>, Error> {
        let now = self.clock().now();
        Ok(self.with_groups(|groups| {
            let Some(group) = groups.groups.get(group) else {
                return Vec::new();
            };
            let mut members: Vec<(u64, GroupMember)> = group
                .members
                .iter()
                .map(|(id, m)| {
                    let member = GroupMember {
                        member: *id,
                        member_name: m.name.clone(),
                        renewed_at: m.renewed_at,
                        lease_until: m.lease_until,
                        alive: m.lease_until > now,
                        shards: group
                            .shards
                            .iter()
                            .filter(|(_, s)| s.held_by(*id, now))
                            .map(|(index, _)| *index)
                            .collect(),
                    };
                    (m.joined, member)
                })
                .collect();
            members.sort_by_key(|(joined, _)| *joined);
            members.into_iter().map(|(_, m)| m).collect()
        }))
    }
}
