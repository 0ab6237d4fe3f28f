//! [`OutboxAdmin::status`](outbox_traits::OutboxAdmin::status) and `ping` for Postgres: one
//! statement whose cost grows with the unpublished and dead rows (read through the partial
//! indexes), never with the published history.

use outbox_traits::{Backlog, BlockedKey, Error, StoreStatus};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::error::map_sqlx;
use crate::PostgresStore;

/// How many of the oldest unpublished rows the status reads from the table itself, for what
/// the claim index cannot say (leases, retries). Leases and retries live there: claims take
/// the oldest rows. A lease or a retrying head further back (a claim past a long blocked
/// backlog) is counted as pending and not listed.
pub const STATUS_WINDOW: i64 = 100_000;

/// The status statement for `table` (`"schema"."table"`, validated and quoted).
///
/// - unpublished (pending or leased): a count over the claim index (`state = 'pending'`),
///   index-only, so it costs a fraction of a microsecond per backlog row and nothing per
///   published row;
/// - leased, and heads waiting for a retry: the oldest [`STATUS_WINDOW`] unpublished rows;
/// - dead: the dead index; dead heads: one probe of the per-key index per dead row;
/// - oldest: the first unpublished row by `seq`, one index probe;
/// - last minute: published rows of the last minute, through the published index.
fn statement(
    table: &str,
    delete_published: bool,
    cursor: Option<&crate::cursor::CursorNames>,
) -> String {
    if let Some(names) = cursor {
        return cursor_statement(table, names, delete_published);
    }
    let blocked_list = blocked_list(table);
    let candidates = candidates(table, "d.state = 'dead'");
    let last_minute = if delete_published {
        "NULL::bigint".to_owned()
    } else {
        format!(
            "(SELECT count(*) FROM {table} WHERE state = 'published' \
               AND published_at > now() - interval '1 minute')"
        )
    };
    format!(
        "WITH win AS MATERIALIZED (
            SELECT w.id, w.seq, w.partition_key, w.lease_token, w.attempts, w.available_at
            FROM {table} w WHERE w.state = 'pending' ORDER BY w.seq LIMIT {STATUS_WINDOW}
        ),
        {candidates},
        blocked AS MATERIALIZED (
            SELECT c.id, c.seq FROM candidates c
            WHERE NOT EXISTS (
                SELECT 1 FROM {table} e
                WHERE e.partition_key = c.partition_key AND e.state IN ('pending', 'dead')
                  AND e.seq < c.seq)
        )
        SELECT (SELECT count(*) FROM {table} WHERE state = 'pending') AS unpublished,
               (SELECT count(*) FROM win WHERE lease_token IS NOT NULL) AS leased,
               (SELECT count(*) FROM {table} WHERE state = 'dead') AS dead,
               (SELECT extract(epoch FROM now() - created_at)::float8 FROM {table}
                 WHERE state = 'pending' ORDER BY seq LIMIT 1) AS oldest,
               {blocked_list},
               {last_minute} AS last_minute"
    )
}

/// [`statement`] for a table laid out for cursor claims (`crate::cursor`): the same figures, read
/// from the smallest settled cursor up and from the rows aside below it, never through the kept
/// history, in **one pass** over the rows from the low cursor up (pending, leased and the last
/// minute's published rows together; three passes took 1.4 s with 200,000 pending messages,
/// and `outbox-relay drain` reads the status before it starts and for its progress lines). Leases
/// are counted exactly, and the heads waiting for a retry come from the aside index: a row
/// waiting for a retry failed, so it has an error and is aside wherever its seq. No index holds
/// `published_at` there, so the last minute's publications are counted among the rows from the
/// low cursor up and the [`STATUS_WINDOW`] rows just below it, where the cursor passed them:
/// exact while fewer than that many were published in the minute (claims publish in about seq
/// order), a lower bound above (still telling a running relay).
fn cursor_statement(
    table: &str,
    names: &crate::cursor::CursorNames,
    delete_published: bool,
) -> String {
    let cursors = &names.cursors;
    let aside_b = crate::cursor::aside("b");
    let aside_r = crate::cursor::aside("r");
    let aside_e = crate::cursor::aside("e");
    let (recent, last_minute) = if delete_published {
        ("NULL::bigint", "NULL::bigint".to_owned())
    } else {
        (
            "count(*) FILTER (WHERE a.state = 'published'
                                   AND a.published_at > now() - interval '1 minute')",
            format!(
                "(SELECT recent FROM above)
               + (SELECT count(*) FROM (
                    SELECT r.state, r.published_at FROM {table} r
                    WHERE r.seq < (SELECT seq FROM low)
                    ORDER BY r.seq DESC LIMIT {STATUS_WINDOW}) r
                  WHERE r.state = 'published'
                    AND r.published_at > now() - interval '1 minute')"
            ),
        )
    };
    let blocked_list = blocked_list(table);
    let low = low_cte(cursors);
    format!(
        "WITH {low},
        above AS MATERIALIZED (
            SELECT count(*) FILTER (WHERE a.state = 'pending') AS pending,
                   count(*) FILTER (WHERE a.state = 'pending' AND a.lease_token IS NOT NULL)
                       AS leased,
                   {recent} AS recent
            FROM {table} a WHERE a.seq >= (SELECT seq FROM low)
        ),
        below AS MATERIALIZED (
            SELECT count(*) AS pending, count(*) FILTER (WHERE b.lease_token IS NOT NULL) AS leased
            FROM {table} b
            WHERE {aside_b} AND b.seq < (SELECT seq FROM low) AND b.state = 'pending'
        ),
        candidates AS (
            SELECT d.id, d.seq, d.partition_key FROM {table} d
            WHERE d.last_error IS NOT NULL AND d.state = 'dead' AND d.partition_key IS NOT NULL
            UNION ALL
            SELECT r.id, r.seq, r.partition_key FROM {table} r
            WHERE {aside_r} AND r.state = 'pending' AND r.partition_key IS NOT NULL
              AND r.attempts > 0 AND r.lease_token IS NULL AND r.available_at > now()
        ),
        blocked AS MATERIALIZED (
            SELECT c.id, c.seq FROM candidates c
            WHERE NOT EXISTS (
                SELECT 1 FROM {table} e
                WHERE e.partition_key = c.partition_key AND e.seq >= (SELECT seq FROM low)
                  AND e.state IN ('pending', 'dead') AND e.seq < c.seq)
              AND NOT EXISTS (
                SELECT 1 FROM {table} e
                WHERE e.partition_key = c.partition_key AND {aside_e}
                  AND e.seq < (SELECT seq FROM low)
                  AND e.state IN ('pending', 'dead') AND e.seq < c.seq)
        )
        SELECT (SELECT pending FROM above) + (SELECT pending FROM below) AS unpublished,
               (SELECT leased FROM above) + (SELECT leased FROM below) AS leased,
               (SELECT count(*) FROM {table} d
                 WHERE d.last_error IS NOT NULL AND d.state = 'dead') AS dead,
               (SELECT extract(epoch FROM now() - p.created_at)::float8 FROM {pending} p
                 ORDER BY p.seq LIMIT 1) AS oldest,
               {blocked_list},
               {last_minute} AS last_minute",
        pending = pending_rows(table)
    )
}

/// The `low` CTE of a cursor-layout table whose cursor table is `cursors`: the seq below which
/// every row is published, aside or rolled back.
fn low_cte(cursors: &str) -> String {
    format!(
        "low AS MATERIALIZED (
            -- Below the smallest cursor of a shard count whose every shard has one, every row
            -- is published, aside or rolled back.
            SELECT COALESCE(max(s.low), 0) AS seq FROM (
                SELECT min(c.below) AS low FROM {cursors} c
                GROUP BY c.shards HAVING count(*) = min(c.shards)) s
        )"
    )
}

/// The backlog statement ([`OutboxAdmin::backlog`](outbox_traits::OutboxAdmin::backlog)): the
/// status's unfinished and dead counts alone, without the leases, the oldest row, the blocked
/// keys and the last minute. A partial-index table counts its claim and dead indexes; a cursor
/// table its rows from the low cursor up, its aside rows below and its dead rows.
fn backlog_statement(table: &str, cursor: Option<&crate::cursor::CursorNames>) -> String {
    let Some(names) = cursor else {
        return format!(
            "SELECT (SELECT count(*) FROM {table} WHERE state = 'pending') AS unfinished,
                    (SELECT count(*) FROM {table} WHERE state = 'dead') AS dead"
        );
    };
    let low = low_cte(&names.cursors);
    let aside_b = crate::cursor::aside("b");
    format!(
        "WITH {low}
        SELECT (SELECT count(*) FROM {table} a
                 WHERE a.seq >= (SELECT seq FROM low) AND a.state = 'pending')
             + (SELECT count(*) FROM {table} b
                 WHERE {aside_b} AND b.seq < (SELECT seq FROM low) AND b.state = 'pending')
                 AS unfinished,
               (SELECT count(*) FROM {table} d
                 WHERE d.last_error IS NOT NULL AND d.state = 'dead') AS dead"
    )
}

pub(crate) async fn backlog(store: &PostgresStore) -> Result<Backlog, Error> {
    let table = store.config().qualified_table();
    let err = |e| map_sqlx(e, "backlog", table);
    let (unfinished, dead): (i64, i64) = sqlx::query_as(&backlog_statement(
        table,
        store.checked_sql().await?.cursor.as_ref(),
    ))
    .fetch_one(store.pool())
    .await
    .map_err(err)?;
    Ok(Backlog {
        unfinished: u64::try_from(unfinished).unwrap_or(0),
        dead: u64::try_from(dead).unwrap_or(0),
    })
}

/// The pending rows of a cursor-layout table: from the low cursor up, and aside below it.
fn pending_rows(table: &str) -> String {
    let aside = crate::cursor::aside("p");
    format!(
        "(SELECT * FROM {table} p
              WHERE p.seq >= (SELECT seq FROM low) AND p.state IN ('pending')
              UNION ALL
              SELECT * FROM {table} p
              WHERE {aside} AND p.seq < (SELECT seq FROM low) AND p.state IN ('pending'))"
    )
}

/// The status's `candidates` CTE: rows that may block their key, the dead rows (`dead`, the
/// filter that finds them: a layout's index) and the window's rows waiting for a retry.
fn candidates(table: &str, dead: &str) -> String {
    format!(
        "candidates AS (
            SELECT d.id, d.seq, d.partition_key FROM {table} d
            WHERE {dead} AND d.partition_key IS NOT NULL
            UNION ALL
            SELECT r.id, r.seq, r.partition_key FROM win r
            WHERE r.partition_key IS NOT NULL AND r.attempts > 0 AND r.lease_token IS NULL
              AND r.available_at > now()
        )"
    )
}

/// The status's blocked keys, from its `blocked` CTE: how many, and the first `$1` of them as
/// JSON (their head's key, id, seq, state, attempts and last error), oldest first.
fn blocked_list(table: &str) -> String {
    format!(
        "(SELECT count(*) FROM blocked) AS blocked_keys,
               (SELECT coalesce(json_agg(json_build_object(
                        'partition_key', m.partition_key, 'head_id', m.id, 'head_seq', m.seq,
                        'head_state', CASE WHEN m.state = 'dead' THEN 'dead' ELSE 'retrying' END,
                        'attempts', m.attempts, 'last_error', m.last_error) ORDER BY m.seq),
                        '[]'::json)
                  FROM (SELECT b.id FROM blocked b ORDER BY b.seq LIMIT $1) x
                  JOIN {table} m ON m.id = x.id)::text AS blocked"
    )
}

pub(crate) async fn status(store: &PostgresStore, limit: usize) -> Result<StoreStatus, Error> {
    let config = store.config();
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, "status", table);
    let row: PgRow = sqlx::query(&statement(
        table,
        config.delete_published(),
        store.checked_sql().await?.cursor.as_ref(),
    ))
    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
    .fetch_one(store.pool())
    .await
    .map_err(err)?;
    let count = |name: &str| -> Result<u64, Error> {
        let n: i64 = row.try_get(name).map_err(err)?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    let blocked_text: String = row.try_get("blocked").map_err(err)?;
    let blocked: Vec<BlockedKey> = serde_json::from_str(&blocked_text).map_err(|e| {
        Error::permanent(
            format!("status of {table}: unreadable blocked keys: {e}"),
            None,
        )
    })?;
    let last_minute: Option<i64> = row.try_get("last_minute").map_err(err)?;
    let leased = count("leased")?;
    Ok(StoreStatus {
        pending: count("unpublished")?.saturating_sub(leased),
        leased,
        dead: count("dead")?,
        oldest_pending_age_seconds: row
            .try_get::<Option<f64>, _>("oldest")
            .map_err(err)?
            .map(|age| age.max(0.0)),
        blocked_keys: Some(count("blocked_keys")?),
        blocked,
        published_last_minute: last_minute.map(|n| u64::try_from(n).unwrap_or(0)),
    })
}

pub(crate) async fn ping(store: &PostgresStore) -> Result<(), Error> {
    let table = store.config().qualified_table();
    sqlx::query(&format!("SELECT 1 FROM {table} LIMIT 0"))
        .execute(store.pool())
        .await
        .map_err(|e| map_sqlx(e, "ping", table))?;
    Ok(())
}
