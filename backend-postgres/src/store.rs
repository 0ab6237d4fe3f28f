//! [`PostgresStore`]: the relay side (claim, complete, fail, extend, release) and operator side.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_traits::{
    async_trait, Capabilities, Claim, ClaimRequest, Counts, DeadMessage, Error, FailAction,
    Failure, HeadPolicy, LeaseToken, OutboxAdmin, OutboxStore, WakeSource,
};
use sqlx::postgres::{PgPool, PgRow};
use sqlx::Row;
use uuid::Uuid;

use crate::config::PostgresConfig;
use crate::error::{map_sqlx, WHAT};
use crate::migrate::migrate;
use crate::row::{message, micros};
use crate::wake::PgWakeSource;

/// Longest stored error text; longer errors are cut (at a character boundary) so a broker that
/// returns a huge error body cannot bloat the table.
const MAX_ERROR_BYTES: usize = 8 * 1024;

/// Run first in every claim's transaction. The claim's best plan walks the claim index in `seq`
/// order and stops at the limit; with missing or stale statistics (a new table, or one analyzed
/// while it was empty or all published, then hit by a burst) the planner may instead fetch
/// every pending row with a bitmap or sequential scan and sort them, once per claim, which made
/// an 8,000-row backlog take 150 ms per claim instead of 8 ms. Turning those two scan types off
/// for this transaction only leaves the ordered index scan; nothing else in the claim wants
/// them.
/// (`set_config(..., true)` is `SET LOCAL`, as one statement.)
const CLAIM_PLAN: &str = "SELECT set_config('enable_bitmapscan', 'off', true), \
                          set_config('enable_seqscan', 'off', true)";

/// A claim of `limit` rows reads at most `limit * CLAIM_WINDOW` unpublished rows in seq order
/// (see `Sql::claim_block`); past them it takes only key heads, key by key.
const CLAIM_WINDOW: i64 = 4;

/// How long [`PostgresStore::connect`] waits for a first connection, and the pool it makes
/// waits for a connection before a call fails with [`Error::Unavailable`].
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// An [`OutboxStore`] and [`OutboxAdmin`] over a Postgres table.
///
/// Holds a connection pool and a [`PostgresConfig`]; cloning is cheap and shares the pool.
/// Every method is one statement in its own short transaction (a claim runs one `set_config`
/// before its statement, see `CLAIM_PLAN`, and a second statement when it comes back short from
/// a full window, see `CLAIM_WINDOW`), so no lock is held between calls.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    config: PostgresConfig,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The pool's options may hold the password; show only what is safe.
        f.debug_struct("PostgresStore")
            .field("config", &self.config)
            .field("pool_size", &self.pool.size())
            .finish()
    }
}

impl PostgresStore {
    /// A store over an existing pool (share your application's pool, or build one with the
    /// connection settings you need).
    pub fn new(pool: PgPool, config: PostgresConfig) -> Self {
        Self { pool, config }
    }

    /// Connect a new pool (sqlx's default size; 10 s to get a connection).
    ///
    /// Does not create the table: call [`PostgresStore::migrate`] or apply
    /// [`PostgresConfig::migration_sql`] with your own migration tool.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a malformed URL and [`Error::Unavailable`] when the server
    /// cannot be reached; neither message contains the URL's password.
    pub async fn connect(url: &str, config: PostgresConfig) -> Result<Self, Error> {
        let pool = outbox_sqlx_support::connect_pool(url, WHAT, CONNECT_TIMEOUT).await?;
        Ok(Self::new(pool, config))
    }

    /// The connection pool, e.g. to begin the transactions you pass to [`crate::enqueue`].
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table and settings this store uses.
    pub fn config(&self) -> &PostgresConfig {
        &self.config
    }

    /// Create the schema, table and indexes if missing (see [`crate::migrate`]).
    pub async fn migrate(&self) -> Result<(), Error> {
        migrate(&self.pool, &self.config).await
    }

    fn err(&self, op: &str) -> impl Fn(sqlx::Error) -> Error + '_ {
        let op = op.to_owned();
        move |e| map_sqlx(e, &op, self.config.qualified_table())
    }

    /// Run a fenced `... RETURNING id` transition and report the ids it did not change.
    async fn fenced(
        &self,
        op: &str,
        sql: &str,
        token: LeaseToken,
        ids: &[Uuid],
    ) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let changed: HashSet<Uuid> = sqlx::query_scalar(sql)
            .bind(token.0)
            .bind(ids)
            .fetch_all(&self.pool)
            .await
            .map_err(self.err(op))?
            .into_iter()
            .collect();
        Error::unless_held(ids, &changed)
    }
}

fn truncate_error(text: &str) -> String {
    // Postgres text cannot hold NUL.
    let mut cut = text.len().min(MAX_ERROR_BYTES);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text[..cut].replace('\0', "\u{FFFD}")
}

/// A claim statement (`Sql::claim_*` or `Sql::claim_past_*`) with its parameters bound:
/// `$1` how many messages, `$2` the token, `$3` the lease in microseconds, `$4` the window
/// (`claim_past_*` takes a fifth, the window's last seq).
fn claim_statement(
    sql: &str,
    limit: i64,
    token: LeaseToken,
    lease_us: i64,
    window: i64,
) -> sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(limit)
        .bind(token.0)
        .bind(lease_us)
        .bind(window)
}

/// How many of a claim's rows are messages (an empty claim's single row carries only the lease
/// end).
fn messages_in(rows: &[PgRow]) -> usize {
    rows.iter()
        .filter(|row| matches!(row.try_get::<Option<Uuid>, _>("id"), Ok(Some(_))))
        .count()
}

#[async_trait]
impl OutboxStore for PostgresStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        req.validate()?;
        let lease_us = micros("claim lease", req.lease)?;
        let limit = i64::try_from(req.limit).unwrap_or(i64::MAX);
        let token = LeaseToken::new();
        let all = self.config.sql();
        let (sql, past) = match req.head_policy {
            HeadPolicy::Block => (&all.claim_block, &all.claim_past_block),
            HeadPolicy::Skip => (&all.claim_skip, &all.claim_past_skip),
        };
        // The claim reads at most this many unpublished rows (leased ones included): the ones in
        // flight ahead of the claimable rows, and room for rows held back behind them.
        let window = limit.saturating_mul(CLAIM_WINDOW);
        // The claim statement runs in a short transaction of its own whose first statement pins
        // its plan (see `CLAIM_PLAN`). The transaction runs in its own task, so that a caller
        // that drops this future (a relay aborted mid-claim) cannot leave it open with its rows
        // locked on a pooled connection: it always ends, as a single statement would, and what
        // it leased then expires like a crashed relay's leases.
        let (pool, sql, past, table) = (
            self.pool.clone(),
            sql.clone(),
            past.clone(),
            self.config.qualified_table().to_owned(),
        );
        let max = req.limit;
        let rows = tokio::spawn(async move {
            let err = |e| map_sqlx(e, "claim", &table);
            let mut tx = pool.begin().await.map_err(err)?;
            sqlx::query(CLAIM_PLAN)
                .execute(&mut *tx)
                .await
                .map_err(err)?;
            let mut rows: Vec<PgRow> = claim_statement(&sql, limit, token, lease_us, window)
                .fetch_all(&mut *tx)
                .await
                .map_err(err)?;
            // Short from a full window: look past it, where a long blocked backlog may have
            // hidden claimable keys. A window that held every unpublished row (an idle
            // relay's polls) has nothing past it: no second statement.
            let got = messages_in(&rows);
            let window_end = match rows.first() {
                Some(row) => row.try_get::<Option<i64>, _>("window_end").map_err(err)?,
                None => None,
            };
            if let (true, Some(window_end)) = (got < max, window_end) {
                let rest = i64::try_from(max - got).unwrap_or(i64::MAX);
                let more = claim_statement(&past, rest, token, lease_us, window)
                    .bind(window_end)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(err)?;
                rows.extend(more);
            }
            // More messages than the limit is impossible by the SQL (LIMITs inside MATERIALIZED
            // CTEs, the second statement asked for the rest only); if it ever happens, lease
            // nothing and let the caller refuse the claim loudly.
            let leased = messages_in(&rows);
            if leased > max {
                tx.rollback().await.map_err(err)?;
            } else {
                tx.commit().await.map_err(err)?;
            }
            Ok::<_, Error>(rows)
        })
        .await
        .map_err(|e| {
            Error::transient(
                format!(
                    "claim on {} did not finish: {e}",
                    self.config.qualified_table()
                ),
                None,
            )
        })??;
        let table = self.config.qualified_table();
        // Every row of the first statement carries the lease end (the second one's rows, after
        // them, do not).
        let lease_until = match rows.first() {
            Some(row) => Some(
                row.try_get::<DateTime<Utc>, _>("lease_until")
                    .map_err(self.err("claim"))?,
            ),
            None => None,
        };
        let mut messages = Vec::with_capacity(rows.len());
        for row in &rows {
            // The single row of an empty claim carries only the lease end.
            if row
                .try_get::<Option<Uuid>, _>("id")
                .map_err(self.err("claim"))?
                .is_some()
            {
                messages.push(message(row, table)?);
            }
        }
        if messages.len() > req.limit {
            // The SQL makes this impossible (LIMIT inside a MATERIALIZED CTE); if it ever
            // happens, refuse loudly rather than hand out more than asked (the transaction
            // above was rolled back: nothing is leased).
            return Err(Error::permanent(
                format!(
                    "claim on {table} leased {} messages, more than the limit of {}; \
                     this is a bug in outbox-backend-postgres, please report it",
                    messages.len(),
                    req.limit
                ),
                None,
            ));
        }
        // Heads found past the window may be older than rows of the window that committed
        // late; hand the batch out in seq order all the same.
        messages.sort_by_key(|m| m.seq);
        let lease_until = lease_until.ok_or_else(|| {
            Error::permanent(format!("claim on {table} returned no lease end"), None)
        })?;
        Ok(Claim {
            token,
            lease_until,
            messages,
        })
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.fenced("complete", &self.config.sql().complete, token, ids)
            .await
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        if failures.is_empty() {
            return Ok(());
        }
        let mut ids = Vec::with_capacity(failures.len());
        let mut errors = Vec::with_capacity(failures.len());
        let mut dead = Vec::with_capacity(failures.len());
        let mut delays = Vec::with_capacity(failures.len());
        for failure in failures {
            ids.push(failure.id);
            errors.push(truncate_error(&failure.error));
            match &failure.action {
                FailAction::Retry { delay } => {
                    dead.push(false);
                    delays.push(micros("retry delay", *delay)?);
                }
                FailAction::Dead => {
                    dead.push(true);
                    delays.push(0);
                }
            }
        }
        let changed: HashSet<Uuid> = sqlx::query_scalar(&self.config.sql().fail)
            .bind(token.0)
            .bind(&ids)
            .bind(errors)
            .bind(dead)
            .bind(delays)
            .fetch_all(&self.pool)
            .await
            .map_err(self.err("fail"))?
            .into_iter()
            .collect();
        Error::unless_held(&ids, &changed)
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        if lease.is_zero() {
            return Err(Error::invalid_input(
                "lease extension is 0; give the relay time to publish, e.g. 30s",
            ));
        }
        let lease_us = micros("lease extension", lease)?;
        let row: PgRow = sqlx::query(&self.config.sql().extend)
            .bind(token.0)
            .bind(lease_us)
            .fetch_one(&self.pool)
            .await
            .map_err(self.err("extend"))?;
        let held: i64 = row.try_get("held").map_err(self.err("extend"))?;
        if held == 0 {
            return Err(Error::LeaseLost { ids: Vec::new() });
        }
        row.try_get("lease_until").map_err(self.err("extend"))
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        self.fenced("release", &self.config.sql().release, token, ids)
            .await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .with_concurrent_claimers(true)
            .with_wakeups(self.config.notify())
            .with_deletes_published(self.config.delete_published())
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        if !self.config.notify() {
            return Ok(None);
        }
        let source = PgWakeSource::listen(&self.pool, &self.config).await?;
        Ok(Some(Box::new(source)))
    }
}

#[async_trait]
impl OutboxAdmin for PostgresStore {
    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows: Vec<PgRow> = sqlx::query(&self.config.sql().list_dead)
            .bind(after_seq.unwrap_or(i64::MIN))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(self.err("list_dead"))?;
        let table = self.config.qualified_table();
        rows.iter()
            .map(|row| {
                Ok(DeadMessage {
                    message: message(row, table)?,
                    last_error: row.try_get("last_error").map_err(self.err("list_dead"))?,
                })
            })
            .collect()
    }

    async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.config.sql().requeue)
            .bind(ids)
            .execute(&self.pool)
            .await
            .map_err(self.err("requeue"))?;
        Ok(done.rows_affected())
    }

    async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(&self.config.sql().discard)
            .bind(ids)
            .execute(&self.pool)
            .await
            .map_err(self.err("discard"))?;
        Ok(done.rows_affected())
    }

    async fn purge_published(&self, older_than: Duration, batch: usize) -> Result<u64, Error> {
        if batch == 0 {
            return Ok(0);
        }
        // Nothing was published more than a century ago.
        let Ok(age_us) = micros("purge age", older_than) else {
            return Ok(0);
        };
        let done = sqlx::query(&self.config.sql().purge)
            .bind(age_us)
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(self.err("purge_published"))?;
        Ok(done.rows_affected())
    }

    async fn counts(&self) -> Result<Counts, Error> {
        let row: PgRow = sqlx::query(&self.config.sql().counts)
            .fetch_one(&self.pool)
            .await
            .map_err(self.err("counts"))?;
        let get = |name: &str| -> Result<u64, Error> {
            let n: i64 = row.try_get(name).map_err(self.err("counts"))?;
            // count(*) is never negative.
            Ok(u64::try_from(n).unwrap_or(0))
        };
        Ok(Counts {
            pending: get("pending")?,
            leased: get("leased")?,
            published: get("published")?,
            dead: get("dead")?,
        })
    }

    async fn status(&self, blocked_limit: usize) -> Result<outbox_traits::StoreStatus, Error> {
        crate::status::status(self, blocked_limit).await
    }

    async fn ping(&self) -> Result<(), Error> {
        crate::status::ping(self).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan a claim runs with on a table without statistics: with `CLAIM_PLAN` it walks the
    /// claim index in `seq` order; without it the planner sorts the whole backlog (the control,
    /// which shows this test would notice the setting's removal).
    #[tokio::test]
    async fn the_claim_plan_walks_the_index_even_without_statistics(
    ) -> Result<(), Box<dyn std::error::Error>> {
        use sqlx::Executor;
        let Some(url) = outbox_conformance_tests::env::service_url("OUTBOX_TEST_POSTGRES_URL")
        else {
            return Ok(());
        };
        let schema = format!("outbox_test_{:016x}", rand::random::<u64>());
        let config = PostgresConfig::new(&schema, "outbox")?;
        let store = PostgresStore::connect(&url, config.clone()).await?;
        store.migrate().await?;
        // 8,000 pending rows, 8 per key in a row, never analyzed.
        let table = config.qualified_table();
        store
            .pool()
            .execute(
                format!(
                    "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload, partition_key)
                     SELECT gen_random_uuid(), 'order', 'o', 'placed', '{{}}'::jsonb,
                            'customer-' || (g / 8)
                     FROM generate_series(0, 7999) g ORDER BY g"
                )
                .as_str(),
            )
            .await?;
        let plan = |pin: bool| {
            let (pool, sql) = (store.pool().clone(), config.sql().claim_block.clone());
            async move {
                let mut tx = pool.begin().await?;
                if pin {
                    sqlx::query(CLAIM_PLAN).execute(&mut *tx).await?;
                }
                tx.execute(
                    format!("PREPARE claim_plan(bigint, uuid, bigint, bigint) AS {sql}").as_str(),
                )
                .await?;
                let lines: Vec<String> = sqlx::query_scalar(
                    "EXPLAIN EXECUTE claim_plan(500, gen_random_uuid(), 30000000, 2000)",
                )
                .fetch_all(&mut *tx)
                .await?;
                tx.rollback().await?;
                Ok::<_, sqlx::Error>(lines.join("\n"))
            }
        };
        let unpinned = plan(false).await?;
        let pinned = plan(true).await?;
        sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(store.pool())
            .await?;
        assert!(
            unpinned.contains("Bitmap") || unpinned.contains("Seq Scan"),
            "control: without statistics the unpinned claim was expected to scan and sort the \
             backlog; if the planner no longer does, this test proves nothing:\n{unpinned}"
        );
        assert!(
            !pinned.contains("Bitmap") && !pinned.contains("Seq Scan"),
            "the pinned claim scans the backlog:\n{pinned}"
        );
        assert!(pinned.contains("_claim_idx"), "{pinned}");
        Ok(())
    }
}
