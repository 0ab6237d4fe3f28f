//! Relay groups on MariaDB ([`RelayGroupStore`]): two small tables beside the outbox table, a
//! member heartbeat table and a shard lease table, and one stored procedure that renews a member
//! in one round trip. Every time is the database's `UTC_TIMESTAMP(6)`.
//!
//! - `<table>_group_members (group_name, member, member_name, joined_at, renewed_at,
//!   lease_until)`: one row per member; a member is live while `lease_until > now`.
//! - `<table>_group_shards (group_name, shard, owner, fence, lease_until)`: one row per shard of
//!   a group; a shard is held by `owner` while `lease_until > now`. `fence` is bumped on each
//!   takeover, never on a renewal.
//! - `<table>_group_renew(group, member, name, shards, lease_us)`: heartbeat, fair share
//!   `ceil(shards / live members)`, give back the held shards beyond it, renew the others, take
//!   free or expired ones, and return the held shards with the database time and the live
//!   members.
//!
//! Each statement of the procedure is atomic on its own (autocommit). The take is one `UPDATE`
//! whose condition (free, or lease expired) InnoDB checks again on the latest row version once
//! it holds the row's lock, so two members renewing at once never take the same shard: the
//! second waits for the first's statement, then finds the shard held and passes it by.

use chrono::NaiveDateTime;
use outbox_sql_support::names::derived_name;
use outbox_traits::{
    async_trait, Error, GroupMember, GroupRenewal, GroupView, RelayGroupStore, ShardLease,
    MAX_GROUP_NAME_BYTES,
};
use sqlx::Row;
use uuid::Uuid;

use crate::row::{decode_error, text, uuid};
use crate::store::MysqlStore;

/// The quoted names of a table's group objects.
struct Names {
    members: String,
    shards: String,
    renew: String,
}

impl Names {
    fn of(database: Option<&str>, table: &str) -> Self {
        let q = |suffix: &str| {
            let name = derived_name(table, suffix);
            match database {
                Some(db) => format!("`{db}`.`{name}`"),
                None => format!("`{name}`"),
            }
        };
        Self {
            members: q("group_members"),
            shards: q("group_shards"),
            renew: q("group_renew"),
        }
    }
}

/// The idempotent DDL of the relay-group tables and renewal procedure of `table`, appended to
/// the outbox table's migration ([`crate::MysqlConfig::migration_sql`]).
pub(crate) fn group_ddl(database: Option<&str>, table: &str) -> String {
    let Names {
        members,
        shards,
        renew,
    } = Names::of(database, table);
    // Group and member names are at most `MAX_GROUP_NAME_BYTES` bytes, so characters too.
    let name = format!("VARCHAR({MAX_GROUP_NAME_BYTES})");
    // The procedure's parameters name their character set: without it they take the
    // database's default, and in a database made `latin1` (or `utf8mb3`) a name with a
    // character outside it fails the renewal ("Incorrect string value", seen on 10.11).
    let param = format!("{name} CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin");
    format!(
        r#"
-- ---------------------------------------------------------------------------------------------
-- Relay groups: replicas of a relay divide the claim shards by leases (outbox-relay --group).
CREATE TABLE IF NOT EXISTS {members} (
    group_name   {name} NOT NULL,
    member       CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    member_name  {name} NOT NULL,
    joined_at    DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    renewed_at   DATETIME(6) NOT NULL,
    lease_until  DATETIME(6) NOT NULL,
    PRIMARY KEY (group_name, member)
)
ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin;
CREATE TABLE IF NOT EXISTS {shards} (
    group_name   {name} NOT NULL,
    shard        INT NOT NULL,
    owner        CHAR(36) CHARACTER SET ascii COLLATE ascii_bin,
    fence        BIGINT NOT NULL DEFAULT 0,
    lease_until  DATETIME(6),
    PRIMARY KEY (group_name, shard)
)
ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin;
CREATE OR REPLACE PROCEDURE {renew}(
    p_group {param}, p_member CHAR(36) CHARACTER SET ascii, p_name {param}, p_shards INT,
    p_lease_us BIGINT)
BEGIN
    DECLARE v_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE v_until DATETIME(6) DEFAULT v_now + INTERVAL p_lease_us MICROSECOND;
    DECLARE v_members INT;
    DECLARE v_share INT;
    DECLARE v_held INT;
    DECLARE v_cut INT;
    DECLARE v_take INT;
    INSERT INTO {members} (group_name, member, member_name, renewed_at, lease_until)
    VALUES (p_group, p_member, p_name, v_now, v_until)
    ON DUPLICATE KEY UPDATE member_name = VALUES(member_name),
        renewed_at = VALUES(renewed_at), lease_until = VALUES(lease_until);
    -- Forget members gone for an hour (status shows the recently gone ones).
    DELETE FROM {members} WHERE group_name = p_group AND lease_until < v_now - INTERVAL 1 HOUR;
    SELECT COUNT(*) INTO v_members FROM {members}
     WHERE group_name = p_group AND lease_until > v_now;
    SET v_share = (p_shards + v_members - 1) DIV v_members;
    INSERT INTO {shards} (group_name, shard)
    WITH RECURSIVE g (n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n + 1 < p_shards)
    SELECT p_group, n FROM g
    ON DUPLICATE KEY UPDATE shard = shard;
    -- Give back what is beyond the fair share (highest indexes first), or beyond the count.
    SET v_cut = (SELECT h.shard FROM {shards} h
                  WHERE h.group_name = p_group AND h.owner = p_member AND h.lease_until > v_now
                    AND h.shard < p_shards
                  ORDER BY h.shard LIMIT 1 OFFSET v_share);
    UPDATE {shards} SET owner = NULL, lease_until = NULL
     WHERE group_name = p_group AND owner = p_member AND (shard >= v_cut OR shard >= p_shards);
    -- Renew the rest; an expired lease is not revived.
    UPDATE {shards} SET lease_until = v_until
     WHERE group_name = p_group AND owner = p_member AND lease_until > v_now;
    SET v_held = ROW_COUNT();
    IF v_held < v_share THEN
        SET v_take = v_share - v_held;
        UPDATE {shards} SET owner = p_member, fence = fence + 1, lease_until = v_until
         WHERE group_name = p_group AND shard < p_shards
           AND (owner IS NULL OR lease_until IS NULL OR lease_until <= v_now)
         ORDER BY shard
         LIMIT v_take;
    END IF;
    SELECT v_now AS r_now, v_members AS r_members, s.shard AS r_shard, s.fence AS r_fence,
           s.lease_until AS r_until
      FROM (SELECT 1) one
      LEFT JOIN {shards} s
        ON s.group_name = p_group AND s.owner = p_member AND s.lease_until > v_now
     ORDER BY s.shard;
END;
"#
    )
}

/// Drops what [`group_ddl`] creates, `IF EXISTS` (see [`crate::MysqlConfig::drop_sql`]).
pub(crate) fn group_drop_sql(database: Option<&str>, table: &str) -> String {
    let Names {
        members,
        shards,
        renew,
    } = Names::of(database, table);
    format!("DROP TABLE IF EXISTS {members}, {shards};\nDROP PROCEDURE IF EXISTS {renew};\n")
}

#[async_trait]
impl RelayGroupStore for MysqlStore {
    async fn renew_group(&self, req: &GroupRenewal) -> Result<GroupView, Error> {
        let (shards, lease_us) = outbox_sql_support::limits::group_renewal(req)?;
        let config = self.config();
        let renew = Names::of(config.database(), config.table()).renew;
        let table = config.qualified_table();
        let decode = |e| decode_error(e, table);
        let rows = sqlx::query(&format!("CALL {renew}(?, ?, ?, ?, ?)"))
            .bind(&req.group)
            .bind(req.member.hyphenated().to_string())
            .bind(&req.member_name)
            .bind(shards)
            .bind(lease_us)
            .fetch_all(self.pool())
            .await
            .map_err(self.err("renew relay group"))?;
        let mut view = GroupView {
            now: chrono::Utc::now(),
            members: 1,
            owned: Vec::new(),
        };
        // By position: sqlx names a row's columns from the prepared `CALL`, which has none.
        for row in &rows {
            let now: NaiveDateTime = row.try_get(0).map_err(decode)?;
            view.now = now.and_utc();
            let members: i64 = row.try_get(1).map_err(decode)?;
            view.members = u32::try_from(members).unwrap_or(1);
            let shard: Option<i32> = row.try_get(2).map_err(decode)?;
            let fence: Option<i64> = row.try_get(3).map_err(decode)?;
            let until: Option<NaiveDateTime> = row.try_get(4).map_err(decode)?;
            if let (Some(shard), Some(fence), Some(until)) = (shard, fence, until) {
                if let Ok(shard) = u32::try_from(shard) {
                    view.owned.push(ShardLease {
                        shard,
                        fence,
                        lease_until: until.and_utc(),
                    });
                }
            }
        }
        Ok(view)
    }

    async fn leave_group(&self, group: &str, member: Uuid) -> Result<(), Error> {
        let config = self.config();
        let Names {
            members, shards, ..
        } = Names::of(config.database(), config.table());
        let member = member.hyphenated().to_string();
        let err = self.err("leave relay group");
        // Shards first: a member that is gone from the members table but still owns a shard
        // would hold it to the end of its lease.
        let mut tx = self.pool().begin().await.map_err(&err)?;
        sqlx::query(&format!(
            "UPDATE {shards} SET owner = NULL, lease_until = NULL \
              WHERE group_name = ? AND owner = ?"
        ))
        .bind(group)
        .bind(&member)
        .execute(&mut *tx)
        .await
        .map_err(&err)?;
        sqlx::query(&format!(
            "DELETE FROM {members} WHERE group_name = ? AND member = ?"
        ))
        .bind(group)
        .bind(&member)
        .execute(&mut *tx)
        .await
        .map_err(&err)?;
        tx.commit().await.map_err(&err)?;
        Ok(())
    }

    async fn group_status(&self, group: &str) -> Result<Vec<GroupMember>, Error> {
        let config = self.config();
        let Names {
            members, shards, ..
        } = Names::of(config.database(), config.table());
        let table = config.qualified_table();
        let decode = |e| decode_error(e, table);
        let rows = sqlx::query(&format!(
            "SELECT m.member, m.member_name, m.renewed_at, m.lease_until, \
                    m.lease_until > UTC_TIMESTAMP(6) AS alive, \
                    COALESCE(GROUP_CONCAT(s.shard ORDER BY s.shard), '') AS shards \
               FROM {members} m \
               LEFT JOIN {shards} s ON s.group_name = m.group_name AND s.owner = m.member \
                                   AND s.lease_until > UTC_TIMESTAMP(6) \
              WHERE m.group_name = ? \
              GROUP BY m.member, m.member_name, m.renewed_at, m.lease_until, m.joined_at \
              ORDER BY m.joined_at, m.member"
        ))
        .bind(group)
        .fetch_all(self.pool())
        .await
        .map_err(self.err("relay group status"))?;
        rows.iter()
            .map(|row| {
                let member = uuid(&text(row, "member", table)?, table)?;
                let renewed_at: NaiveDateTime = row.try_get("renewed_at").map_err(decode)?;
                let lease_until: NaiveDateTime = row.try_get("lease_until").map_err(decode)?;
                let alive: i64 = row.try_get("alive").map_err(decode)?;
                let shards = text(row, "shards", table)?;
                Ok(GroupMember {
                    member,
                    member_name: text(row, "member_name", table)?,
                    renewed_at: renewed_at.and_utc(),
                    lease_until: lease_until.and_utc(),
                    alive: alive != 0,
                    shards: shards
                        .split(',')
                        .filter_map(|s| s.parse::<u32>().ok())
                        .collect(),
                })
            })
            .collect()
    }
}
