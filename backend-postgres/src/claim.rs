//! The relay's side of the store ([`OutboxStore`]): the claim, one short transaction of one or
//! two statements, and the dispatch of the fenced transitions to [`crate::lease`].

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_sql_support::limits::{micros, truncate_error};
use outbox_sql_support::quarantine::{held_back, Poison};
use outbox_traits::{
    async_trait, Capabilities, Claim, ClaimRequest, ClaimShard, Error, Failure, HeadPolicy,
    LeaseToken, Message, OutboxStore, WakeSource,
};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

use crate::error::map_sqlx;
use crate::lease;
use crate::row::decode;
use crate::sql::{CLAIM_IDLE_TIMEOUT, LOCK_TIMEOUT};
use crate::store::PostgresStore;
use crate::wake::PgWakeSource;

/// Begins every claim's transaction, in the same round trip as its `BEGIN` (see
/// [`claim_begin`]). The claim's best plan walks the claim index in `seq`
/// order and stops at the limit; with missing or stale statistics (a new table, or one analyzed
/// while it was empty or all published, then hit by a burst) the planner may instead fetch
/// every pending row with a bitmap or sequential scan and sort them, once per claim, which made
/// an 8,000-row backlog take 150 ms per claim instead of 8 ms. Turning those two scan types off
/// for this transaction only leaves the ordered index scan; nothing else in the claim wants
/// them.
/// (`set_config(..., true)` is `SET LOCAL`, as one statement.)
///
/// It also makes the claim statements run their generic plan (`plan_cache_mode`): sqlx
/// prepares them once per connection, but Postgres would still plan a complex statement
/// afresh for its parameters on every execution (a custom plan) when it estimates that to be
/// cheaper, about 1 to 2 ms of a 500-message claim; the generic plan, made once per
/// connection under these same settings, walks the same indexes (measured side by side in
/// `bench --bin sidebyside`: about 5% less database CPU per message).
///
/// The same statement bounds what a frozen relay can cost the others (see [`LOCK_TIMEOUT`]
/// and [`CLAIM_IDLE_TIMEOUT`]): the claim waits at most that long for a row lock, and its
/// transaction, which holds the rows it locked, cannot stay idle longer than that.
fn claim_settings() -> String {
    format!(
        "SELECT set_config('enable_bitmapscan', 'off', true), \
                set_config('enable_seqscan', 'off', true), \
                set_config('plan_cache_mode', 'force_generic_plan', true), \
                set_config('lock_timeout', '{LOCK_TIMEOUT}', true), \
                set_config('idle_in_transaction_session_timeout', '{CLAIM_IDLE_TIMEOUT}', true)"
    )
}

/// `BEGIN` and [`claim_settings`] as one simple query: one round trip where two were (no
/// parameters, so sqlx sends it as text and the server runs both statements). Serial claims
/// bound a drain (the relay runs one claim per claim shard at a time), so each round trip off a
/// claim counts.
/// Built once, not per claim.
fn claim_begin() -> &'static str {
    static BEGIN: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| format!("BEGIN; {}", claim_settings()));
    BEGIN.as_str()
}

/// A claim of `limit` rows reads at most `limit * CLAIM_WINDOW` unpublished rows in seq order
/// (see `Sql::claim_block`); past them it takes only key heads, key by key. That is the window
/// of a shard's first claim, and the most any claim reads ([`ClaimWindows`] sizes the others).
///
/// Twice the limit: room for one other batch in flight (the relay's default of 2), whose
/// leased rows sit at the head of the window, and for the claimable rows behind them. Reading,
/// sorting and ranking the window is most of a claim's cost, and the relay runs one claim per
/// claim shard at a time, so the window bounds a drain. A sharded claim's window holds only its
/// shard's rows (it steps over the others' in the claim index). Measured side by side (`bench --bin sidebyside`, 100,000
/// messages over 1,000 keys, batch 500, 2 in flight, published rows deleted): a window of 4×
/// the limit 81,514 msg/s, 3× 87,961, **2× 90,278**; 1.5× and 1× come back short of the limit
/// so often that the look-past statement makes them slower (63,808 and 66,037).
const CLAIM_WINDOW: i64 = 2;

/// The room a window keeps past the limit and the rows held in the shard's last window: an
/// eighth of the limit, for rows that became held since (a retry come due, another relay's
/// lease) and rows held back behind them.
const WINDOW_SLACK_DIVISOR: i64 = 8;

/// Each claim shard's window, sized from what its last claim found (by `(shards, shard)`, as
/// the statements take them).
///
/// A window must hold the claimable rows of the limit and the held rows ahead of them (leased to
/// a batch in flight, or not due). How many are held depends on how the relay runs: unsharded
/// with 2 batches in flight, one batch's rows are leased at every claim; with one claim shard
/// per batch in flight (the relay's default on Postgres: 2 shards, 2 in flight), a shard's
/// next claim starts once its batch is done, and nothing of the shard is held. A fixed window
/// of [`CLAIM_WINDOW`] × the limit fits the first and reads twice what the second needs. So
/// each claim reads `limit + held + limit / 8` rows, `held` being the rows of the shard's last
/// window that were held or waited behind a held row of their key (a key whose head is leased
/// elsewhere holds back its whole backlog in the window), at most [`CLAIM_WINDOW`] × the limit (also the first claim's, and the next one's
/// after a claim that came back short from a full window). Whatever the size, the claim is the
/// same: the window is a prefix of the unpublished rows, and `claim_past` looks past it when
/// it comes back short.
#[derive(Debug, Default)]
pub(crate) struct ClaimWindows(std::sync::Mutex<std::collections::HashMap<(i32, i32), i64>>);

impl ClaimWindows {
    /// The window of a claim of `limit` rows of shard `(shards, shard)`.
    fn window(&self, shards: i32, shard: i32, limit: i64) -> i64 {
        let most = limit.saturating_mul(CLAIM_WINDOW);
        let held = self.lock().get(&(shards, shard)).copied();
        match held {
            None => most,
            Some(held) => limit
                .saturating_add(held)
                .saturating_add((limit / WINDOW_SLACK_DIVISOR).max(1))
                .min(most),
        }
    }

    /// What a claim of shard `(shards, shard)` found: `held` rows of its window held, and
    /// whether it came back short from a full window (the next window is then the largest).
    fn record(&self, shards: i32, shard: i32, held: i64, short: bool, limit: i64) {
        let held = if short { limit } else { held.max(0) };
        self.lock().insert((shards, shard), held);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<(i32, i32), i64>> {
        // A panic elsewhere while it was held leaves a map that is still whole.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A claim statement (`Sql::claim_*` or `Sql::claim_past_*`) with its first parameters bound:
/// `$1` how many messages, `$2` the token, `$3` the lease in microseconds, `$4` the window.
/// `claim_*` takes the shard next (`$5` how many, `$6` which: see [`shard_params`]);
/// `claim_past_*` takes the window's last seq (`$5`), then the shard (`$6`, `$7`).
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

/// The claim's shard as the statements' parameters: how many shards, and which (`(1, 0)`, every
/// key, for an unsharded claim). The request was validated, so the index is below the count;
/// both fit an `int` (a count past `i32::MAX` is refused as invalid input).
fn shard_params(shard: Option<ClaimShard>) -> Result<(i32, i32), Error> {
    let Some(shard) = shard else {
        return Ok((1, 0));
    };
    let count = i32::try_from(shard.count).map_err(|_| {
        Error::invalid_input(format!(
            "claim shard count {} is too large for Postgres; use at most {}",
            shard.count,
            i32::MAX
        ))
    })?;
    // Below the count, so it fits too.
    let index = i32::try_from(shard.index).unwrap_or(i32::MAX);
    Ok((count, index))
}

/// How many of a claim's rows are messages (an empty claim's single row carries only the lease
/// end).
fn messages_in(rows: &[PgRow]) -> usize {
    rows.iter()
        .filter(|row| matches!(row.try_get::<Option<Uuid>, _>("id"), Ok(Some(_))))
        .count()
}

/// The claim shards a relay given none runs over Postgres
/// ([`Capabilities::preferred_claim_shards`]): two claims side by side drained 1.37× faster than
/// one over 1,000 keys, and more shards were slower (README, "Speed"; `BENCHMARKS.md`).
pub const PREFERRED_CLAIM_SHARDS: usize = 2;

/// The batch size a relay given none asks Postgres for ([`Capabilities::preferred_batch`]):
/// with 2 claim shards, batches of 2,000 were the fastest measured (README, "Speed").
pub const PREFERRED_BATCH: usize = 2000;

#[async_trait]
impl OutboxStore for PostgresStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, Error> {
        claim(self, req).await
    }

    async fn complete(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        lease::complete(self, token, ids).await
    }

    async fn fail(&self, token: LeaseToken, failures: &[Failure]) -> Result<(), Error> {
        lease::fail(self, token, failures).await
    }

    async fn extend(&self, token: LeaseToken, lease: Duration) -> Result<DateTime<Utc>, Error> {
        lease::extend(self, token, lease).await
    }

    async fn release(&self, token: LeaseToken, ids: &[Uuid]) -> Result<(), Error> {
        lease::release(self, token, ids).await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .with_concurrent_claimers(true)
            .with_wakeups(self.config().notify())
            .with_deletes_published(self.config().delete_published())
            .with_sharded_claims(true)
            .with_preferred_claim_shards(PREFERRED_CLAIM_SHARDS)
            .with_preferred_batch(PREFERRED_BATCH)
    }

    async fn wakeups(&self) -> Result<Option<Box<dyn WakeSource>>, Error> {
        if !self.config().notify() {
            return Ok(None);
        }
        let source = PgWakeSource::listen(self.pool(), self.config()).await?;
        Ok(Some(Box::new(source)))
    }
}

/// A validated claim request, ready to bind: what the claim's task takes with it.
struct ClaimPlan {
    token: LeaseToken,
    /// The lease in microseconds.
    lease_us: i64,
    /// How many messages at most (as the statements' `bigint`, and as asked).
    limit: i64,
    max: usize,
    /// How many unpublished rows the first statement reads (see [`ClaimWindows`]).
    window: i64,
    /// The look-past statement's bound on the keys it walks one by one (see `Sql::claim_past`).
    past_keys: i64,
    /// Where the shard's windows are sized, to record what this claim found.
    windows: std::sync::Arc<ClaimWindows>,
    /// The shard as the statements' parameters (see [`shard_params`]).
    shards: i32,
    shard: i32,
    policy: HeadPolicy,
    table: String,
    /// The first statement, the look-past statement, and the two a claim with undecodable
    /// rows runs.
    sql: String,
    past: String,
    quarantine: String,
    release: String,
    /// The claim transaction's `BEGIN` (see [`claim_begin`]); with cursor claims it also moves
    /// the shard's cursor (`settle`).
    begin: std::borrow::Cow<'static, str>,
    /// Whether the table has the cursor layout: the claim's row then carries the cursor it
    /// read, which the look-past statement takes.
    cursor: bool,
}

impl ClaimPlan {
    /// `req` must have passed [`ClaimRequest::validate`].
    fn new(store: &PostgresStore, req: &ClaimRequest) -> Result<Self, Error> {
        let lease_us = micros("claim lease", req.lease)?;
        let (shards, shard) = shard_params(req.shard)?;
        let limit = i64::try_from(req.limit).unwrap_or(i64::MAX);
        let all = store.sql();
        let (sql, past) = match req.head_policy {
            HeadPolicy::Block => (&all.claim_block, &all.claim_past_block),
            HeadPolicy::Skip => (&all.claim_skip, &all.claim_past_skip),
        };
        Ok(Self {
            token: LeaseToken::new(),
            lease_us,
            limit,
            max: req.limit,
            // The claim reads at most this many unpublished rows (leased ones included): the
            // ones in flight ahead of the claimable rows, and room for rows held back behind
            // them.
            window: store.claim_windows().window(shards, shard, limit),
            past_keys: limit.saturating_mul(CLAIM_WINDOW),
            windows: store.claim_windows().clone(),
            shards,
            shard,
            policy: req.head_policy,
            table: store.config().qualified_table().to_owned(),
            sql: sql.clone(),
            past: past.clone(),
            quarantine: all.quarantine.clone(),
            release: all.release.clone(),
            begin: match &all.cursor {
                None => claim_begin().into(),
                // Its own statement, before the claim's: the claim's snapshot then sees the
                // cursor it moved. The shard numbers are integers, so they go in as text.
                Some(names) => format!(
                    "{}; SELECT {}({shards}, {shard})",
                    claim_begin(),
                    names.settle
                )
                .into(),
            },
            cursor: all.cursor.is_some(),
        })
    }

    fn err(&self) -> impl Fn(sqlx::Error) -> Error + '_ {
        |e| map_sqlx(e, "claim", &self.table)
    }
}

/// The claim's transaction, in Postgres's dialect.
type ClaimTx<'c> = sqlx::Transaction<'c, sqlx::Postgres>;

/// [`OutboxStore::claim`] for the store: [`try_claim`] in a task of its own, then the batch in
/// `seq` order.
async fn claim(store: &PostgresStore, req: &ClaimRequest) -> Result<Claim, Error> {
    req.validate()?;
    store.ensure_shape().await?;
    let plan = ClaimPlan::new(store, req)?;
    let token = plan.token;
    // The claim statement runs in a short transaction of its own whose first statement pins
    // its plan (see `claim_settings`). The transaction runs in its own task, so that a caller
    // that drops this future (a relay aborted mid-claim) cannot leave it open with its rows
    // locked on a pooled connection: it always ends, as a single statement would, and what
    // it leased then expires like a crashed relay's leases.
    let (lease_until, mut messages) = tokio::spawn(try_claim(store.pool().clone(), plan))
        .await
        .map_err(|e| {
        Error::transient(
            format!(
                "claim on {} did not finish: {e}",
                store.config().qualified_table()
            ),
            None,
        )
    })??;
    let table = store.config().qualified_table();
    // Heads found past the window may be older than rows of the window that committed
    // late; hand the batch out in seq order all the same.
    messages.sort_by_key(|m| m.seq);
    let lease_until = lease_until
        .ok_or_else(|| Error::permanent(format!("claim on {table} returned no lease end"), None))?;
    Ok(Claim {
        token,
        lease_until,
        messages,
    })
}

/// One claim transaction: lease the window's claimable rows, [`look_past`] the window when it
/// came back short, decode the rows, [`quarantine`] the ones that do not decode and
/// [`hold_back`] what waits behind them; commit. Returns the lease end (none when nothing was
/// unpublished) and the messages handed out.
async fn try_claim(
    pool: sqlx::PgPool,
    plan: ClaimPlan,
) -> Result<(Option<DateTime<Utc>>, Vec<Message>), Error> {
    let err = plan.err();
    let mut conn = pool.acquire().await.map_err(&err)?;
    let failed = match sqlx::Connection::begin_with(&mut *conn, plan.begin.clone()).await {
        Ok(tx) => return claim_in(tx, &plan).await,
        Err(e) => e,
    };
    // The `BEGIN` is several statements: when one after `BEGIN` fails (the settle, on a table
    // that is missing, or under a lock timeout), the session is left in an aborted transaction
    // that sqlx does not roll back, since the transaction never began for it. Close that
    // session rather than hand it to the next user of the pool, whose statements would fail
    // with 25P02.
    conn.close_on_drop();
    Err(err(failed))
}

/// [`try_claim`] once its transaction began.
async fn claim_in(
    mut tx: ClaimTx<'_>,
    plan: &ClaimPlan,
) -> Result<(Option<DateTime<Utc>>, Vec<Message>), Error> {
    let err = plan.err();
    let mut rows: Vec<PgRow> = claim_statement(
        &plan.sql,
        plan.limit,
        plan.token,
        plan.lease_us,
        plan.window,
    )
    .bind(plan.shards)
    .bind(plan.shard)
    .fetch_all(&mut *tx)
    .await
    .map_err(&err)?;
    let more = look_past(&mut tx, plan, &rows).await?;
    rows.extend(more);
    // More messages than the limit is impossible by the SQL (LIMITs inside MATERIALIZED CTEs,
    // the second statement asked for the rest only); if it ever happens, lease nothing and
    // refuse loudly rather than hand out more than asked.
    let leased = messages_in(&rows);
    if leased > plan.max {
        tx.rollback().await.map_err(&err)?;
        return Err(Error::permanent(
            format!(
                "claim on {} leased {leased} messages, more than the limit of {}; this is a bug in outbox-backend-postgres, please report it",
                plan.table, plan.max
            ),
            None,
        ));
    }
    // Every row of the first statement carries the lease end (the second one's rows, after
    // them, do not).
    let lease_until = match rows.first() {
        Some(row) => Some(
            row.try_get::<DateTime<Utc>, _>("lease_until")
                .map_err(&err)?,
        ),
        None => None,
    };
    let (mut messages, mut poisoned) = decode_all(&rows, plan)?;
    if !poisoned.is_empty() {
        poisoned.sort_by_key(|p| p.seq);
        quarantine(&mut tx, plan, &poisoned).await?;
        messages = hold_back(&mut tx, plan, &poisoned, messages).await?;
        for poison in &poisoned {
            poison.log(&plan.table);
        }
    }
    tx.commit().await.map_err(&err)?;
    Ok((lease_until, messages))
}

/// After a claim came back short from a full window: lease up to the rest of the limit past
/// it, where a long blocked backlog may have hidden claimable keys. A window that held every
/// unpublished row (an idle relay's polls) has nothing past it: no second statement.
async fn look_past(
    tx: &mut ClaimTx<'_>,
    plan: &ClaimPlan,
    rows: &[PgRow],
) -> Result<Vec<PgRow>, Error> {
    let err = plan.err();
    let got = messages_in(rows);
    let (window_end, held) = match rows.first() {
        Some(row) => (
            row.try_get::<Option<i64>, _>("window_end").map_err(&err)?,
            row.try_get::<i64, _>("window_held").map_err(&err)?,
        ),
        None => (None, 0),
    };
    let short = got < plan.max && window_end.is_some();
    plan.windows
        .record(plan.shards, plan.shard, held, short, plan.limit);
    let (true, Some(window_end)) = (got < plan.max, window_end) else {
        return Ok(Vec::new());
    };
    let rest = i64::try_from(plan.max - got).unwrap_or(i64::MAX);
    let mut past = claim_statement(&plan.past, rest, plan.token, plan.lease_us, plan.past_keys)
        .bind(window_end)
        .bind(plan.shards)
        .bind(plan.shard);
    if plan.cursor {
        // The cursor the claim read (a cursor stays right for every later snapshot).
        let cursor = match rows.first() {
            Some(row) => row.try_get::<i64, _>("cursor_seq").map_err(&err)?,
            None => 0,
        };
        past = past.bind(cursor);
    }
    past.fetch_all(&mut **tx).await.map_err(err)
}

/// The claimed rows as messages, and the [`Poison`]s of those that do not decode.
fn decode_all(rows: &[PgRow], plan: &ClaimPlan) -> Result<(Vec<Message>, Vec<Poison>), Error> {
    let mut messages = Vec::with_capacity(rows.len());
    let mut poisoned = Vec::new();
    for row in rows {
        // The single row of an empty claim carries only the lease end.
        let id = row.try_get::<Option<Uuid>, _>("id").map_err(plan.err())?;
        if id.is_some() {
            match decode(row, &plan.table)? {
                Ok(message) => messages.push(message),
                Err(poison) => poisoned.push(poison),
            }
        }
    }
    Ok((messages, poisoned))
}

/// Dead-letter a claim's undecodable rows (leased by its transaction) by `seq`, each with its
/// reason, in one statement.
async fn quarantine(
    tx: &mut ClaimTx<'_>,
    plan: &ClaimPlan,
    poisoned: &[Poison],
) -> Result<(), Error> {
    let seqs: Vec<i64> = poisoned.iter().map(|p| p.seq).collect();
    let reasons: Vec<&str> = poisoned.iter().map(|p| truncate_error(&p.reason)).collect();
    sqlx::query(&plan.quarantine)
        .bind(plan.token.0)
        .bind(&seqs)
        .bind(&reasons)
        .execute(&mut **tx)
        .await
        .map_err(plan.err())?;
    Ok(())
}

/// Under `Block`, a quarantined row's key's later messages of this claim wait behind it like
/// behind any dead head: release them in the claim's transaction; the rest are handed out.
async fn hold_back(
    tx: &mut ClaimTx<'_>,
    plan: &ClaimPlan,
    poisoned: &[Poison],
    messages: Vec<Message>,
) -> Result<Vec<Message>, Error> {
    let (held, kept): (Vec<Message>, Vec<Message>) = messages
        .into_iter()
        .partition(|m| held_back(poisoned, plan.policy, m.seq, m.partition_key.as_deref()));
    if !held.is_empty() {
        let ids: Vec<Uuid> = held.iter().map(|m| m.id).collect();
        sqlx::query(&plan.release)
            .bind(plan.token.0)
            .bind(&ids)
            .execute(&mut **tx)
            .await
            .map_err(plan.err())?;
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PostgresConfig;

    /// A claim's transaction bounds its lock waits and its idle time and runs generic plans,
    /// and only its own: the connection, back in the pool (your application's, perhaps), keeps
    /// its settings.
    #[tokio::test]
    async fn the_claim_s_timeouts_and_plan_mode_end_with_its_transaction(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let Some(url) = outbox_conformance_tests::env::service_url("OUTBOX_TEST_POSTGRES_URL")
        else {
            return Ok(());
        };
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await?;
        let show = "SELECT current_setting('lock_timeout'), \
                    current_setting('idle_in_transaction_session_timeout'), \
                    current_setting('plan_cache_mode')";
        let before: (String, String, String) = sqlx::query_as(show).fetch_one(&mut conn).await?;
        let mut tx = sqlx::Connection::begin_with(&mut conn, claim_begin()).await?;
        let during: (String, String, String) = sqlx::query_as(show).fetch_one(&mut *tx).await?;
        tx.commit().await?;
        let after: (String, String, String) = sqlx::query_as(show).fetch_one(&mut conn).await?;
        // The claim statements run their generic plan, made once per connection.
        assert_eq!(
            during,
            (
                LOCK_TIMEOUT.to_owned(),
                CLAIM_IDLE_TIMEOUT.to_owned(),
                "force_generic_plan".to_owned()
            )
        );
        assert_eq!(after, before);
        Ok(())
    }

    /// A store on a new schema of its own, migrated (`None` without a test server): a table of
    /// the default layout, or (`partial_index`) of the partial-index one.
    async fn migrated_store(
        partial_index: bool,
    ) -> Result<Option<(PostgresStore, PostgresConfig, String)>, Box<dyn std::error::Error>> {
        let Some(url) = outbox_conformance_tests::env::service_url("OUTBOX_TEST_POSTGRES_URL")
        else {
            return Ok(None);
        };
        let schema = format!("outbox_test_{:016x}", rand::random::<u64>());
        let mut builder = PostgresConfig::builder().schema(&schema);
        if partial_index {
            builder = builder.cursor_claims(false);
        }
        let config = builder.build()?;
        let store = PostgresStore::connect(&url, config.clone()).await?;
        store.migrate().await?;
        Ok(Some((store, config, schema)))
    }

    /// A claim can keep the lock of a row another relay has just leased (it read the row before
    /// that lease and locked its new version after, then dropped it). Frozen there, it holds that
    /// lock until the server ends its idle transaction: the row's holder then completes it
    /// after that wait, without an error, because the claim's idle bound is shorter than the
    /// completion's lock bound. Here a transaction begun as a claim locks the row and goes idle.
    #[tokio::test]
    async fn a_frozen_claim_s_stray_lock_delays_a_completion_without_failing_it(
    ) -> Result<(), Box<dyn std::error::Error>> {
        use outbox_traits::{ClaimRequest, HeadPolicy, OutboxStore};
        let Some((store, config, schema)) = migrated_store(false).await? else {
            return Ok(());
        };
        let table = config.qualified_table();
        sqlx::query(&format!(
            "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload)
             VALUES (gen_random_uuid(), 'order', 'o', 'placed', '{{}}'::jsonb)"
        ))
        .execute(store.pool())
        .await?;
        let claim = store
            .claim(&ClaimRequest {
                limit: 10,
                lease: std::time::Duration::from_secs(60),
                head_policy: HeadPolicy::Block,
                shard: None,
            })
            .await?;
        let ids: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
        assert_eq!(ids.len(), 1);

        let mut frozen = store.pool().begin_with(claim_begin()).await?;
        sqlx::query(&format!("SELECT 1 FROM {table} WHERE id = $1 FOR UPDATE"))
            .bind(ids[0])
            .execute(&mut *frozen)
            .await?;
        // The holder's completion waits for the lock, which goes with the frozen claim's
        // session; with an idle bound longer than the lock bound it failed with 55P03.
        let completed = store.complete(claim.token, &ids).await;
        let published: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE state = 'published'"
        ))
        .fetch_one(store.pool())
        .await?;
        // The server ended the frozen claim's session.
        let frozen_after = sqlx::query("SELECT 1").execute(&mut *frozen).await;
        drop(frozen);
        sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(store.pool())
            .await?;
        completed?;
        assert_eq!(published, 1);
        assert!(frozen_after.is_err(), "the frozen claim's session survived");
        Ok(())
    }

    /// The plan a claim runs with on a table without statistics: with `claim_settings` it walks the
    /// claim index in `seq` order; without it the planner sorts the whole backlog (the control,
    /// which shows this test would notice the setting's removal).
    #[tokio::test]
    async fn the_claim_plan_walks_the_index_even_without_statistics(
    ) -> Result<(), Box<dyn std::error::Error>> {
        use sqlx::Executor;
        // The partial-index layout's claim (the cursor layout's has its own plan test).
        let Some((store, config, schema)) = migrated_store(true).await? else {
            return Ok(());
        };
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
                let mut tx = if pin {
                    pool.begin_with(claim_begin()).await?
                } else {
                    pool.begin().await?
                };
                tx.execute(
                    format!("PREPARE claim_plan(bigint, uuid, bigint, bigint, int, int) AS {sql}")
                        .as_str(),
                )
                .await?;
                let lines: Vec<String> = sqlx::query_scalar(
                    "EXPLAIN EXECUTE claim_plan(500, gen_random_uuid(), 30000000, 2000, 1, 0)",
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

    #[test]
    fn a_shard_s_window_is_the_limit_and_what_its_last_claim_found_held() {
        let windows = ClaimWindows::default();
        // A shard's first claim reads the most.
        assert_eq!(windows.window(2, 0, 2000), 4000);
        // Nothing held: the limit and an eighth.
        windows.record(2, 0, 0, false, 2000);
        assert_eq!(windows.window(2, 0, 2000), 2250);
        // Another shard, or another shard count, keeps its own.
        assert_eq!(windows.window(2, 1, 2000), 4000);
        assert_eq!(windows.window(1, 0, 2000), 4000);
        // A batch in flight ahead of the claimable rows: room for it.
        windows.record(2, 0, 1000, false, 2000);
        assert_eq!(windows.window(2, 0, 2000), 3250);
        // Never past twice the limit.
        windows.record(2, 0, 5000, false, 2000);
        assert_eq!(windows.window(2, 0, 2000), 4000);
        // Short from a full window: the next is the largest, whatever was held.
        windows.record(2, 0, 0, true, 2000);
        assert_eq!(windows.window(2, 0, 2000), 4000);
        // A limit of 1 still leaves room for one more row.
        windows.record(1, 0, 0, false, 1);
        assert_eq!(windows.window(1, 0, 1), 2);
    }
}
