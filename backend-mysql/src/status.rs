//! [`OutboxAdmin::status`](outbox_traits::OutboxAdmin::status) and `ping` for MariaDB/MySQL.
//! Every count reads an index range of the unpublished, dead or last minute's published rows
//! (`ix_claim`, `ix_key`, `ix_published`), never the whole history. Two statements: the
//! figures, then at most `limit` blocked keys.

use outbox_traits::uuid::Uuid;
use outbox_traits::{BlockedKey, Error, StoreStatus};
use sqlx::mysql::MySqlRow;
use sqlx::Row;

use crate::row::{decode_error, optional_text, text};
use crate::sql::unleased;
use crate::MysqlStore;

/// Dead heads, and pending heads waiting for a retry: rows with no earlier unfinished row of
/// their key.
fn blocked_from(t: &str) -> String {
    format!(
        "FROM {t} b
         WHERE b.partition_key IS NOT NULL
           AND (b.state = 'dead'
                OR (b.state = 'pending' AND b.attempts > 0 AND {free}
                    AND b.available_at > UTC_TIMESTAMP(6)))
           AND NOT EXISTS (
               SELECT 1 FROM {t} e
               WHERE e.partition_key = b.partition_key AND e.state IN ('pending', 'dead')
                 AND e.seq < b.seq)",
        free = unleased("b")
    )
}

pub(crate) async fn status(store: &MysqlStore, limit: usize) -> Result<StoreStatus, Error> {
    let config = store.config();
    let t = config.qualified_table();
    let last_minute = if config.delete_published() {
        "NULL".to_owned()
    } else {
        format!(
            "(SELECT COUNT(*) FROM {t} WHERE state = 'published' \
               AND published_at > UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE)"
        )
    };
    let figures = format!(
        "SELECT
            (SELECT COUNT(*) FROM {t} m WHERE m.state = 'pending' AND {free}) AS pending,
            (SELECT COUNT(*) FROM {t} m WHERE m.state = 'pending' AND NOT {free})
                AS leased,
            (SELECT COUNT(*) FROM {t} WHERE state = 'dead') AS dead,
            (SELECT TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) FROM {t}
              WHERE state = 'pending' ORDER BY seq LIMIT 1) AS oldest_us,
            (SELECT COUNT(*) {blocked}) AS blocked_keys,
            {last_minute} AS last_minute",
        blocked = blocked_from(t),
        free = unleased("m")
    );
    let row: MySqlRow = sqlx::query(&figures)
        .fetch_one(store.pool())
        .await
        .map_err(store.err("status"))?;
    let count = |name: &str| -> Result<u64, Error> {
        let n: i64 = row.try_get(name).map_err(|e| decode_error(e, t))?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    let oldest_us: Option<i64> = row.try_get("oldest_us").map_err(|e| decode_error(e, t))?;
    let last_minute: Option<i64> = row.try_get("last_minute").map_err(|e| decode_error(e, t))?;
    let mut status = StoreStatus {
        pending: count("pending")?,
        leased: count("leased")?,
        dead: count("dead")?,
        oldest_pending_age_seconds: oldest_us.map(|us| us.max(0) as f64 / 1e6),
        blocked_keys: Some(count("blocked_keys")?),
        blocked: Vec::new(),
        published_last_minute: last_minute.map(|n| u64::try_from(n).unwrap_or(0)),
    };
    if limit > 0 && status.blocked_keys.unwrap_or(0) > 0 {
        let list = format!(
            "SELECT b.partition_key, b.id, b.seq, CAST(b.state AS CHAR) AS state, b.attempts,
                    b.last_error
             {blocked}
             ORDER BY b.seq LIMIT ?",
            blocked = blocked_from(t)
        );
        let rows: Vec<MySqlRow> = sqlx::query(&list)
            .bind(u64::try_from(limit).unwrap_or(u64::MAX))
            .fetch_all(store.pool())
            .await
            .map_err(store.err("status"))?;
        for row in &rows {
            let state = text(row, "state", t)?;
            let attempts: i32 = row.try_get("attempts").map_err(|e| decode_error(e, t))?;
            status.blocked.push(BlockedKey {
                partition_key: text(row, "partition_key", t)?,
                // A quarantined head whose stored id is not a UUID: the nil id, as in
                // `list_dead` (its seq names it).
                head_id: Uuid::parse_str(&text(row, "id", t)?).unwrap_or_default(),
                head_seq: row.try_get("seq").map_err(|e| decode_error(e, t))?,
                head_state: if state == "dead" { "dead" } else { "retrying" }.to_owned(),
                attempts: u32::try_from(attempts).unwrap_or(0),
                last_error: optional_text(row, "last_error", t)?,
            });
        }
    }
    Ok(status)
}

pub(crate) async fn ping(store: &MysqlStore) -> Result<(), Error> {
    let t = store.config().qualified_table();
    sqlx::query(&format!("SELECT 1 FROM {t} LIMIT 0"))
        .execute(store.pool())
        .await
        .map_err(store.err("ping"))?;
    Ok(())
}
