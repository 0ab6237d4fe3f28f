//! Relay groups on Postgres ([`RelayGroupStore`]): two small tables beside the outbox table, a
//! member heartbeat table and a shard lease table, and one SQL function that renews a member in
//! one round trip. Every time is the database's `now()`.
//!
//! - `<table>_group_members (group_name, member, member_name, joined_at, renewed_at,
//!   lease_until)`: one row per member; a member is live while `lease_until > now()`.
//! - `<table>_group_shards (group_name, shard, owner, fence, lease_until)`: one row per shard of
//!   a group; a shard is held by `owner` while `lease_until > now()`. `fence` is bumped on each
//!   takeover, never on a renewal.
//! - `<table>_group_renew(group, member, name, shards, lease_us)`: heartbeat, fair share
//!   `ceil(shards / live members)`, give back the held shards beyond it, renew the others, take
//!   free or expired ones (`FOR UPDATE SKIP LOCKED`, so two members renewing at once never take
//!   the same shard), and return the held shards with the database time and the live members.

use outbox_traits::{
    async_trait, Error, GroupMember, GroupRenewal, GroupView, RelayGroupStore, ShardLease,
};
use sqlx::Row;
use uuid::Uuid;

use crate::config::PostgresConfig;
use crate::store::PostgresStore;

/// Postgres's identifier limit, in bytes.
const MAX_IDENT: usize = 63;

/// `<table><suffix>`, shortened with a hash of the full name when that exceeds Postgres's
/// identifier limit (so two long table names never share group tables).
fn derived_name(table: &str, suffix: &str) -> String {
    let full = format!("{table}{suffix}");
    if full.len() <= MAX_IDENT {
        return full;
    }
    // FNV-1a: stable across versions and platforms.
    let hash = full.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let keep = MAX_IDENT - suffix.len() - 9;
    // Table names are ASCII identifiers (validated by the config), so any byte is a boundary.
    format!("{}_{:08x}{suffix}", &table[..keep], hash as u32)
}

/// The quoted names of a table's group objects.
struct Names {
    members: String,
    shards: String,
    renew: String,
}

fn names(config: &PostgresConfig) -> Names {
    let q = |suffix: &str| {
        format!(
            "\"{}\".\"{}\"",
            config.schema(),
            derived_name(config.table(), suffix)
        )
    };
    Names {
        members: q("_group_members"),
        shards: q("_group_shards"),
        renew: q("_group_renew"),
    }
}

/// The idempotent DDL of the relay-group tables and renewal function of `config`'s outbox table.
/// [`crate::migrate`] runs it after [`PostgresConfig::migration_sql`]; teams that apply
/// migrations with their own tool apply both.
pub fn group_migration_sql(config: &PostgresConfig) -> String {
    let Names {
        members,
        shards,
        renew,
    } = names(config);
    format!(
        r#"
CREATE TABLE IF NOT EXISTS {members} (
    group_name   text        NOT NULL,
    member       uuid        NOT NULL,
    member_name  text        NOT NULL,
    joined_at    timestamptz NOT NULL DEFAULT now(),
    renewed_at   timestamptz NOT NULL,
    lease_until  timestamptz NOT NULL,
    PRIMARY KEY (group_name, member)
);
CREATE TABLE IF NOT EXISTS {shards} (
    group_name   text        NOT NULL,
    shard        integer     NOT NULL,
    owner        uuid,
    fence        bigint      NOT NULL DEFAULT 0,
    lease_until  timestamptz,
    PRIMARY KEY (group_name, shard)
);
CREATE OR REPLACE FUNCTION {renew}(
    p_group text, p_member uuid, p_name text, p_shards integer, p_lease_us bigint)
RETURNS TABLE (r_now timestamptz, r_members integer, r_shard integer, r_fence bigint,
               r_until timestamptz)
LANGUAGE plpgsql AS $fn$
DECLARE
    v_now     timestamptz := now();
    v_until   timestamptz := now() + p_lease_us * interval '1 microsecond';
    v_members integer;
    v_share   integer;
    v_held    integer;
BEGIN
    INSERT INTO {members} (group_name, member, member_name, renewed_at, lease_until)
    VALUES (p_group, p_member, p_name, v_now, v_until)
    ON CONFLICT (group_name, member) DO UPDATE
        SET member_name = EXCLUDED.member_name, renewed_at = EXCLUDED.renewed_at,
            lease_until = EXCLUDED.lease_until;
    -- Forget members gone for an hour (status shows the recently gone ones).
    DELETE FROM {members} m
     WHERE m.group_name = p_group AND m.lease_until < v_now - interval '1 hour';
    SELECT count(*) INTO v_members FROM {members} m
     WHERE m.group_name = p_group AND m.lease_until > v_now;
    v_share := (p_shards + v_members - 1) / v_members;
    INSERT INTO {shards} (group_name, shard)
    SELECT p_group, g FROM generate_series(0, p_shards - 1) g
    ON CONFLICT DO NOTHING;
    -- Give back what is beyond the fair share (highest indexes first), or beyond the count.
    UPDATE {shards} s SET owner = NULL, lease_until = NULL
      FROM (SELECT h.shard, row_number() OVER (ORDER BY h.shard) AS rn
              FROM {shards} h
             WHERE h.group_name = p_group AND h.owner = p_member AND h.lease_until > v_now
               AND h.shard < p_shards) k
     WHERE s.group_name = p_group AND s.shard = k.shard AND k.rn > v_share;
    UPDATE {shards} s SET owner = NULL, lease_until = NULL
     WHERE s.group_name = p_group AND s.owner = p_member AND s.shard >= p_shards;
    -- Renew the rest; an expired lease is not revived.
    UPDATE {shards} s SET lease_until = v_until
     WHERE s.group_name = p_group AND s.owner = p_member AND s.lease_until > v_now;
    GET DIAGNOSTICS v_held = ROW_COUNT;
    IF v_held < v_share THEN
        UPDATE {shards} s SET owner = p_member, fence = s.fence + 1, lease_until = v_until
          FROM (SELECT f.shard FROM {shards} f
                 WHERE f.group_name = p_group AND f.shard < p_shards
                   AND (f.owner IS NULL OR f.lease_until IS NULL OR f.lease_until <= v_now)
                 ORDER BY f.shard
                 LIMIT v_share - v_held
                 FOR UPDATE SKIP LOCKED) t
         WHERE s.group_name = p_group AND s.shard = t.shard;
    END IF;
    RETURN QUERY
    SELECT v_now, v_members, s.shard, s.fence, s.lease_until
      FROM (SELECT 1) one
      LEFT JOIN {shards} s
        ON s.group_name = p_group AND s.owner = p_member AND s.lease_until > v_now
     ORDER BY s.shard;
END
$fn$;
"#
    )
}

#[async_trait]
impl RelayGroupStore for PostgresStore {
    async fn renew_group(&self, req: &GroupRenewal) -> Result<GroupView, Error> {
        let (shards, lease_us) = outbox_sql_support::limits::group_renewal(req)?;
        let renew = names(self.config()).renew;
        let rows = sqlx::query(&format!(
            "SELECT r_now, r_members, r_shard, r_fence, r_until FROM {renew}($1, $2, $3, $4, $5)"
        ))
        .bind(&req.group)
        .bind(req.member)
        .bind(&req.member_name)
        .bind(shards)
        .bind(lease_us)
        .fetch_all(self.pool())
        .await
        .map_err(self.err("renew relay group"))?;
        let decode = |e| self.err("renew relay group")(e);
        let mut view = GroupView {
            now: chrono::Utc::now(),
            members: 1,
            owned: Vec::new(),
        };
        for row in &rows {
            view.now = row.try_get("r_now").map_err(decode)?;
            let members: i32 = row.try_get("r_members").map_err(decode)?;
            view.members = u32::try_from(members).unwrap_or(1);
            let shard: Option<i32> = row.try_get("r_shard").map_err(decode)?;
            let fence: Option<i64> = row.try_get("r_fence").map_err(decode)?;
            let until: Option<chrono::DateTime<chrono::Utc>> =
                row.try_get("r_until").map_err(decode)?;
            if let (Some(shard), Some(fence), Some(lease_until)) = (shard, fence, until) {
                if let Ok(shard) = u32::try_from(shard) {
                    view.owned.push(ShardLease {
                        shard,
                        fence,
                        lease_until,
                    });
                }
            }
        }
        Ok(view)
    }

    async fn leave_group(&self, group: &str, member: Uuid) -> Result<(), Error> {
        let Names {
            members, shards, ..
        } = names(self.config());
        sqlx::query(&format!(
            "WITH gone AS (DELETE FROM {members} WHERE group_name = $1 AND member = $2) \
             UPDATE {shards} SET owner = NULL, lease_until = NULL \
              WHERE group_name = $1 AND owner = $2"
        ))
        .bind(group)
        .bind(member)
        .execute(self.pool())
        .await
        .map_err(self.err("leave relay group"))?;
        Ok(())
    }

    async fn group_status(&self, group: &str) -> Result<Vec<GroupMember>, Error> {
        let Names {
            members, shards, ..
        } = names(self.config());
        let rows = sqlx::query(&format!(
            "SELECT m.member, m.member_name, m.renewed_at, m.lease_until, \
                    m.lease_until > now() AS alive, \
                    COALESCE(array_agg(s.shard ORDER BY s.shard) \
                             FILTER (WHERE s.shard IS NOT NULL), '{{}}') AS shards \
               FROM {members} m \
               LEFT JOIN {shards} s ON s.group_name = m.group_name AND s.owner = m.member \
                                   AND s.lease_until > now() \
              WHERE m.group_name = $1 \
              GROUP BY m.member, m.member_name, m.renewed_at, m.lease_until, m.joined_at \
              ORDER BY m.joined_at, m.member"
        ))
        .bind(group)
        .fetch_all(self.pool())
        .await
        .map_err(self.err("relay group status"))?;
        let decode = |e| self.err("relay group status")(e);
        rows.iter()
            .map(|row| {
                let shards: Vec<i32> = row.try_get("shards").map_err(decode)?;
                Ok(GroupMember {
                    member: row.try_get("member").map_err(decode)?,
                    member_name: row.try_get("member_name").map_err(decode)?,
                    renewed_at: row.try_get("renewed_at").map_err(decode)?,
                    lease_until: row.try_get("lease_until").map_err(decode)?,
                    alive: row.try_get("alive").map_err(decode)?,
                    shards: shards
                        .into_iter()
                        .filter_map(|s| u32::try_from(s).ok())
                        .collect(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::derived_name;

    #[test]
    fn long_names_are_shortened_with_a_hash() {
        assert_eq!(
            derived_name("outbox", "_group_shards"),
            "outbox_group_shards"
        );
        let long = "t".repeat(63);
        let a = derived_name(&long, "_group_shards");
        let b = derived_name(&format!("{}u", &long[..62]), "_group_shards");
        assert!(a.len() <= 63 && b.len() <= 63);
        assert_ne!(a, b);
        assert!(a.ends_with("_group_shards"));
    }
}
