//! [`OutboxAdmin::status`](outbox_traits::OutboxAdmin::status) and `ping` for Postgres: one
//! statement whose cost grows with the unpublished and dead rows (read through the partial
//! indexes), never with the published history.

use outbox_traits::{BlockedKey, Error, StoreStatus};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::error::map_sqlx;
use crate::PostgresStore;

/// The status statement for `table` (`"schema"."table"`, validated and quoted).
///
/// - pending/leased: the pending rows, through the claim index (`state = 'pending'`);
/// - dead: the dead index;
/// - oldest: the first pending row by `seq`, one index probe;
/// - blocked keys: dead rows and pending rows waiting for a retry that are their key's first
///   unfinished row (one probe of the per-key index each);
/// - last minute: published rows of the last minute, through the published index.
fn statement(table: &str, delete_published: bool) -> String {
    let last_minute = if delete_published {
        "NULL::bigint".to_owned()
    } else {
        format!(
            "(SELECT count(*) FROM {table} WHERE state = 'published' \
               AND published_at > now() - interval '1 minute')"
        )
    };
    format!(
        "WITH blocked AS MATERIALIZED (
            SELECT b.partition_key COLLATE \"default\" AS partition_key, b.id, b.seq,
                   CASE WHEN b.state = 'dead' THEN 'dead' ELSE 'retrying' END AS head_state,
                   b.attempts, b.last_error
            FROM {table} b
            WHERE b.partition_key IS NOT NULL
              AND (b.state = 'dead'
                   OR (b.state = 'pending' AND b.attempts > 0 AND b.lease_token IS NULL
                       AND b.available_at > now()))
              AND NOT EXISTS (
                  SELECT 1 FROM {table} e
                  WHERE e.partition_key = b.partition_key AND e.state IN ('pending', 'dead')
                    AND e.seq < b.seq)
        ),
        p AS (
            SELECT count(*) FILTER (WHERE lease_token IS NULL) AS pending,
                   count(*) FILTER (WHERE lease_token IS NOT NULL) AS leased
            FROM {table} WHERE state = 'pending'
        )
        SELECT p.pending, p.leased,
               (SELECT count(*) FROM {table} WHERE state = 'dead') AS dead,
               (SELECT extract(epoch FROM now() - created_at)::float8 FROM {table}
                 WHERE state = 'pending' ORDER BY seq LIMIT 1) AS oldest,
               (SELECT count(*) FROM blocked) AS blocked_keys,
               (SELECT coalesce(json_agg(json_build_object(
                        'partition_key', x.partition_key, 'head_id', x.id, 'head_seq', x.seq,
                        'head_state', x.head_state, 'attempts', x.attempts,
                        'last_error', x.last_error) ORDER BY x.seq), '[]'::json)
                  FROM (SELECT * FROM blocked ORDER BY seq LIMIT $1) x)::text AS blocked,
               {last_minute} AS last_minute
        FROM p"
    )
}

pub(crate) async fn status(store: &PostgresStore, limit: usize) -> Result<StoreStatus, Error> {
    let config = store.config();
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, "status", table);
    let row: PgRow = sqlx::query(&statement(table, config.delete_published()))
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
    Ok(StoreStatus {
        pending: count("pending")?,
        leased: count("leased")?,
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
