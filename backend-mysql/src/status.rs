//! [`OutboxAdmin::status`](outbox_traits::OutboxAdmin::status) and `ping` for MariaDB/MySQL.
//! Every count reads an index range of the unpublished, dead or last minute's published rows
//! (`ix_claim`, `ix_key`, `ix_published`), never the whole history. Two statements: the
//! figures, then at most `limit` blocked keys. A table laid out with an unpublished table
//! (`unpublished_table`) is read through it instead (see [`unpublished_figures`]).

use outbox_traits::uuid::Uuid;
use outbox_traits::{Backlog, BlockedKey, Error, StoreStatus};
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

/// [`blocked_from`] for a table with unpublished table `u`: the heads found there, read with
/// their outbox rows (alias `b`).
fn blocked_from_unpublished(t: &str, u: &str) -> String {
    format!(
        "FROM {u} bs FORCE INDEX (PRIMARY)
         STRAIGHT_JOIN {t} b FORCE INDEX (PRIMARY) ON b.seq = bs.seq
         WHERE bs.partition_key IS NOT NULL
           AND (bs.state = 'dead'
                OR (bs.state = 'pending' AND b.attempts > 0 AND {free}
                    AND b.available_at > UTC_TIMESTAMP(6)))
           AND NOT EXISTS (
               SELECT 1 FROM {u} e FORCE INDEX (ix_key)
               WHERE e.partition_key = bs.partition_key AND e.state IN ('pending', 'dead')
                 AND e.seq < bs.seq)",
        free = unleased("b")
    )
}

/// The most rows below the oldest unpublished one, and above it, that the last minute's published
/// count of a table with an unpublished table reads (it has no index on `published_at`).
pub const STATUS_WINDOW: i64 = 100_000;

/// The figures of a table with unpublished table `u`: the pending, leased and retrying-head rows
/// in **one pass** over the unpublished table's pending entries with their outbox rows (the
/// lease and the retry time are only there), the dead rows and dead heads from the unpublished
/// table alone, and the last minute's published rows among those from [`STATUS_WINDOW`] rows
/// below the oldest unpublished one to as many above it (exact while fewer than that many
/// were published in the minute around it, as a relay draining a backlog publishes). A
/// status query's cost then grows with the backlog once, not three times: with 200,000 pending
/// messages, three passes took 1.8 s of MariaDB's time alone, and `outbox-relay drain` asks for
/// the status every few seconds for its progress lines (issue 31).
fn unpublished_figures(t: &str, u: &str, delete_published: bool) -> String {
    let last_minute = if delete_published {
        "NULL".to_owned()
    } else {
        format!(
            "(SELECT COUNT(*) FROM {t} p FORCE INDEX (PRIMARY)
              JOIN (SELECT COALESCE(
                      (SELECT MIN(o.seq) FROM {u} o FORCE INDEX (PRIMARY) WHERE o.state = 'pending'),
                      (SELECT MAX(x.seq) + 1 FROM {t} x)) AS front) w
              WHERE p.seq >= w.front - {STATUS_WINDOW} AND p.seq < w.front + {STATUS_WINDOW}
                AND p.state = 'published'
                AND p.published_at > UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE)"
        )
    };
    let earlier = |a: &str| {
        format!(
            "SELECT 1 FROM {u} e FORCE INDEX (ix_key)
                   WHERE e.partition_key = {a}.partition_key AND e.state IN ('pending', 'dead')
                     AND e.seq < {a}.seq"
        )
    };
    format!(
        "SELECT f.pending, f.leased,
            (SELECT COUNT(*) FROM {u} WHERE state = 'dead') AS dead,
            (SELECT TIMESTAMPDIFF(MICROSECOND, m.created_at, UTC_TIMESTAMP(6))
              FROM {u} s FORCE INDEX (PRIMARY)
              STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = s.seq
              WHERE s.state = 'pending' ORDER BY s.seq LIMIT 1) AS oldest_us,
            f.retrying + (SELECT COUNT(*) FROM {u} d FORCE INDEX (PRIMARY)
              WHERE d.state = 'dead' AND d.partition_key IS NOT NULL
                AND NOT EXISTS ({dead_earlier})) AS blocked_keys,
            {last_minute} AS last_minute
         FROM (SELECT CAST(COALESCE(SUM({free}), 0) AS SIGNED) AS pending,
                      CAST(COALESCE(SUM(NOT {free}), 0) AS SIGNED) AS leased,
                      -- Short-circuit: the earlier-row probe runs for retrying rows only.
                      CAST(COALESCE(SUM(s.partition_key IS NOT NULL AND m.attempts > 0 AND {free}
                               AND m.available_at > UTC_TIMESTAMP(6)
                               AND NOT EXISTS ({pending_earlier})), 0) AS SIGNED) AS retrying
               FROM {u} s FORCE INDEX (PRIMARY)
               STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = s.seq
               WHERE s.state = 'pending' AND m.state = 'pending') f",
        dead_earlier = earlier("d"),
        pending_earlier = earlier("s"),
        free = unleased("m")
    )
}

pub(crate) async fn status(store: &MysqlStore, limit: usize) -> Result<StoreStatus, Error> {
    let config = store.config();
    let t = config.qualified_table();
    let unpublished = store.sql().await?.unpublished.as_deref();
    let last_minute = if config.delete_published() {
        "NULL".to_owned()
    } else {
        format!(
            "(SELECT COUNT(*) FROM {t} WHERE state = 'published' \
               AND published_at > UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE)"
        )
    };
    let figures = match unpublished {
        Some(u) => unpublished_figures(t, u, config.delete_published()),
        None => format!(
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
        ),
    };
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
            blocked = match unpublished {
                Some(u) => blocked_from_unpublished(t, u),
                None => blocked_from(t),
            }
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

/// [`OutboxAdmin::backlog`](outbox_traits::OutboxAdmin::backlog): two counts over the index of
/// unfinished and dead rows, `ix_claim` (led by `state`), or over the unpublished table where
/// the table has one, whose entries are exactly the pending and dead rows. No lease, retry time
/// or key is read: on the unpublished table with 200,000 pending messages this is one scan of
/// small entries where `status` joins each to its row.
pub(crate) async fn backlog(store: &MysqlStore) -> Result<Backlog, Error> {
    let t = store.config().qualified_table();
    let (from, index) = match store.sql().await?.unpublished.as_deref() {
        Some(u) => (u.to_owned(), "PRIMARY"),
        None => (t.to_owned(), "ix_claim"),
    };
    let (unfinished, dead): (i64, i64) = sqlx::query_as(&format!(
        "SELECT (SELECT COUNT(*) FROM {from} FORCE INDEX ({index}) WHERE state = 'pending'),
                (SELECT COUNT(*) FROM {from} FORCE INDEX ({index}) WHERE state = 'dead')"
    ))
    .fetch_one(store.pool())
    .await
    .map_err(store.err("backlog"))?;
    Ok(Backlog {
        unfinished: u64::try_from(unfinished).unwrap_or(0),
        dead: u64::try_from(dead).unwrap_or(0),
    })
}

pub(crate) async fn ping(store: &MysqlStore) -> Result<(), Error> {
    let t = store.config().qualified_table();
    sqlx::query(&format!("SELECT 1 FROM {t} LIMIT 0"))
        .execute(store.pool())
        .await
        .map_err(store.err("ping"))?;
    Ok(())
}
