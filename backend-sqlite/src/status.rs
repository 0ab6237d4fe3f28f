//! [`OutboxAdmin::status`](outbox_traits::OutboxAdmin::status) and `ping` for SQLite. Every
//! statement reads the unpublished and dead rows (or the last minute's published ones) through
//! their partial indexes, never the whole history.

use rusqlite::{params, Connection};

use outbox_traits::uuid::Uuid;
use outbox_traits::{Backlog, BlockedKey, Counts, Error, StoreStatus};

use crate::error::{map_err, Ctx};
use crate::sql::{Sql, NOW_MS};

/// The [`Counts`] of the table's states (part of [`status`], and
/// [`OutboxAdmin::counts`](outbox_traits::OutboxAdmin::counts)).
pub(crate) fn counts(conn: &Connection, sql: &Sql, table: &str) -> Result<Counts, Error> {
    conn.prepare_cached(&sql.counts)
        .and_then(|mut s| s.query_row([], outbox_sql_support::rusqlite::counts))
        .map_err(|e| map_err(e, Ctx::Admin, table))
}

/// [`OutboxAdmin::backlog`](outbox_traits::OutboxAdmin::backlog): the unfinished rows through
/// the live index and the dead ones through the dead index, two index-only counts, without the
/// published count, the oldest row and the blocked keys the status reads (it holds the store's
/// one connection meanwhile, so a relay's claims wait for it).
pub(crate) fn backlog(conn: &Connection, table: &str) -> Result<Backlog, Error> {
    let t = table;
    conn.prepare_cached(&format!(
        "SELECT (SELECT COUNT(*) FROM {t} INDEXED BY {t}_live \
                   WHERE state IN ('pending', 'leased')), \
                (SELECT COUNT(*) FROM {t} INDEXED BY {t}_dead WHERE state = 'dead')"
    ))
    .and_then(|mut s| {
        s.query_row([], |r| {
            Ok(Backlog {
                unfinished: u64::try_from(r.get::<_, i64>(0)?).unwrap_or(0),
                dead: u64::try_from(r.get::<_, i64>(1)?).unwrap_or(0),
            })
        })
    })
    .map_err(|e| map_err(e, Ctx::Admin, table))
}

pub(crate) fn status(
    conn: &Connection,
    sql: &Sql,
    table: &str,
    limit: usize,
    keeps_published: bool,
) -> Result<StoreStatus, Error> {
    let err = |e| map_err(e, Ctx::Admin, table);
    let t = table;
    let counts = counts(conn, sql, table)?;
    let now: i64 = conn
        .query_row(&format!("SELECT {NOW_MS}"), [], |r| r.get(0))
        .map_err(err)?;
    let oldest: Option<i64> = conn
        .query_row(
            &format!(
                "SELECT ?1 - created_at FROM {t} INDEXED BY {t}_live \
                 WHERE state IN ('pending', 'leased') ORDER BY seq LIMIT 1"
            ),
            [now],
            |r| r.get(0),
        )
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            e => Err(e),
        })
        .map_err(err)?;
    // A key's head is its lowest unfinished seq; it blocks the key when it is dead or waits
    // for a retry.
    let blocked_sql = format!(
        "WITH heads AS (
             SELECT partition_key, min(seq) AS seq FROM {t}
             WHERE state IN ('pending', 'leased', 'dead') AND partition_key IS NOT NULL
             GROUP BY partition_key
         )
         SELECT b.partition_key, b.id, b.seq,
                CASE b.state WHEN 'dead' THEN 'dead' ELSE 'retrying' END, b.attempts,
                b.last_error
         FROM heads h JOIN {t} b ON b.seq = h.seq
         WHERE b.state = 'dead' OR (b.state = 'pending' AND b.attempts > 0 AND b.available_at > ?1)
         ORDER BY b.seq"
    );
    let mut stmt = conn.prepare(&blocked_sql).map_err(err)?;
    let mut rows = stmt.query(params![now]).map_err(err)?;
    let mut blocked = Vec::new();
    let mut blocked_keys = 0u64;
    while let Some(row) = rows.next().map_err(err)? {
        blocked_keys += 1;
        if blocked.len() < limit {
            let id: String = row.get(1).map_err(err)?;
            // A quarantined head whose stored id is not a UUID: the nil id, as in `list_dead`
            // (its seq names it).
            let head_id = Uuid::parse_str(&id).unwrap_or_default();
            blocked.push(BlockedKey {
                partition_key: row.get(0).map_err(err)?,
                head_id,
                head_seq: row.get(2).map_err(err)?,
                head_state: row.get(3).map_err(err)?,
                attempts: row.get(4).map_err(err)?,
                last_error: row.get(5).map_err(err)?,
            });
        }
    }
    let published_last_minute = if keeps_published {
        let n: i64 = conn
            .query_row(
                &format!(
                    "SELECT COUNT(*) FROM {t} INDEXED BY {t}_published \
                     WHERE state = 'published' AND published_at > ?1"
                ),
                [now - 60_000],
                |r| r.get(0),
            )
            .map_err(err)?;
        Some(u64::try_from(n).unwrap_or(0))
    } else {
        None
    };
    Ok(StoreStatus {
        pending: counts.pending,
        leased: counts.leased,
        dead: counts.dead,
        oldest_pending_age_seconds: oldest.map(|ms| ms.max(0) as f64 / 1000.0),
        blocked_keys: Some(blocked_keys),
        blocked,
        published_last_minute,
    })
}

pub(crate) fn ping(conn: &Connection, table: &str) -> Result<(), Error> {
    conn.query_row(
        &format!("SELECT COUNT(*) FROM (SELECT 1 FROM {table} LIMIT 1)"),
        [],
        |r| r.get::<_, i64>(0),
    )
    .map(|_| ())
    .map_err(|e| map_err(e, Ctx::Admin, table))
}
