//! An `outbox-relay purge` SIGKILLed in the middle of its work on the real Postgres (the
//! research plan's F-8, a crash during the cleanup of published messages).
//!
//! The kill is placed by an event, not a clock: the test holds a row lock on a published row of
//! the purge's second batch, waits until `pg_stat_activity` shows the purge's session blocked
//! by that lock (its first batch has committed by then), and kills the process there. The
//! killed batch must roll back whole, nothing but published rows may be gone, and a second
//! purge must finish the job.
//!
//! Postgres only. SQLite locks the whole database for a writer, so a lock that stops the
//! second batch would have stopped the first one too; and a purge waiting in SQLite's busy
//! handler sleeps inside its own process, where no other connection can see it waiting. A kill
//! there could only be placed by timing.

use std::process::Stdio;
use std::time::Duration;

use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::{ClaimRequest, FailAction, Failure, HeadPolicy, NewMessage, OutboxStore};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::unique_suffix;
use serde_json::Value;
use sqlx::{PgPool, Row};
use tokio::process::Command;
use uuid::Uuid;

// Shared with the other test binaries; this one uses no graceful stop (`sigterm`).
#[allow(dead_code)]
mod common;
use common::{message, relay_process, signal, BoxError, BIN, GUARD};

type TestResult = Result<(), BoxError>;

/// Rows per delete statement of the purges under test.
const BATCH: usize = 2;
/// Published messages; the purge deletes them oldest first, `BATCH` at a time.
const PUBLISHED: usize = 6;
/// The published message the test locks: the second of the second batch.
const LOCKED: usize = 3;
/// Messages left pending (never claimed).
const PENDING: usize = 3;

/// Run `outbox-relay` with `args` to the end, expect success, return its one JSON line.
async fn json_line(args: &[&str]) -> Result<Value, BoxError> {
    let out = tokio::time::timeout(
        GUARD,
        Command::new(BIN)
            .args(args)
            .env_remove("OUTBOX_STORE_URL")
            .stdin(Stdio::null())
            .output(),
    )
    .await??;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(format!("outbox-relay {args:?} failed ({}): {stderr}", out.status).into());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Claim the next `n` pending messages (each under its own key, so none waits for another).
async fn claim(store: &PostgresStore, n: usize) -> Result<outbox::Claim, BoxError> {
    let claim = store
        .claim(&ClaimRequest {
            limit: n,
            lease: Duration::from_secs(60),
            head_policy: HeadPolicy::Block,
        })
        .await?;
    assert_eq!(claim.messages.len(), n, "claimed the next {n}");
    Ok(claim)
}

/// Every row not published, in `seq` order, as `(id, whole row as JSON)`.
async fn unpublished_rows(pool: &PgPool, table: &str) -> Result<Vec<(Uuid, Value)>, BoxError> {
    sqlx::query(&format!(
        "SELECT id, to_jsonb(t)::text AS row FROM {table} t \
         WHERE state <> 'published' ORDER BY seq"
    ))
    .fetch_all(pool)
    .await?
    .iter()
    .map(|r| Ok((r.try_get("id")?, serde_json::from_str(r.try_get("row")?)?)))
    .collect()
}

/// The published rows' ids, oldest first.
async fn published_ids(pool: &PgPool, table: &str) -> Result<Vec<Uuid>, BoxError> {
    Ok(sqlx::query_scalar(&format!(
        "SELECT id FROM {table} WHERE state = 'published' ORDER BY published_at"
    ))
    .fetch_all(pool)
    .await?)
}

#[tokio::test]
async fn a_purge_killed_mid_batch_loses_nothing_but_committed_batches() -> TestResult {
    let Some(pg_url) = service_url("OUTBOX_TEST_POSTGRES_URL") else {
        return Ok(());
    };
    let suffix = unique_suffix();
    let schema = format!("purge_crash_{suffix}");
    let table = format!("\"{schema}\".outbox");
    let store_args = ["--store", pg_url.as_str(), "--schema", schema.as_str()];
    json_line(&[&store_args[..], &["migrate"]].concat()).await?;

    let pool = PgPool::connect(&pg_url).await?;
    let config = PostgresConfig::builder().schema(schema.clone()).build()?;
    let store = PostgresStore::new(pool.clone(), config.clone());
    let keys = PUBLISHED + 1 + PENDING;
    let messages: Vec<NewMessage> = (0..keys).map(|n| message(n, keys)).collect();
    let (to_publish, rest) = messages.split_at(PUBLISHED);
    let (to_kill, pending) = rest.split_at(1);

    // Published: claimed and completed, as a relay does.
    let mut tx = pool.begin().await?;
    outbox::postgres::enqueue_batch(&mut *tx, &config, to_publish).await?;
    tx.commit().await?;
    let claimed = claim(&store, PUBLISHED).await?;
    let published: Vec<Uuid> = to_publish.iter().map(|m| m.id).collect();
    store.complete(claimed.token, &published).await?;
    // One completion gives them one timestamp; spread them an hour apart, the first oldest, so
    // which rows each batch of the purge takes is known.
    for (age, id) in (1..=PUBLISHED).rev().zip(&published) {
        sqlx::query(&format!(
            "UPDATE {table} SET published_at = now() - $1 * interval '1 hour' WHERE id = $2"
        ))
        .bind(f64::from(u32::try_from(age)?))
        .bind(id)
        .execute(&pool)
        .await?;
    }
    // Dead: one failed attempt, dead-lettered.
    let mut tx = pool.begin().await?;
    outbox::postgres::enqueue_batch(&mut *tx, &config, to_kill).await?;
    tx.commit().await?;
    let claimed = claim(&store, 1).await?;
    store
        .fail(
            claimed.token,
            &[Failure {
                id: to_kill[0].id,
                error: "rejected by the broker".into(),
                action: FailAction::Dead,
            }],
        )
        .await?;
    // Pending: never claimed.
    let mut tx = pool.begin().await?;
    outbox::postgres::enqueue_batch(&mut *tx, &config, pending).await?;
    tx.commit().await?;

    assert_eq!(published_ids(&pool, &table).await?, published);
    let before = unpublished_rows(&pool, &table).await?;
    let want: Vec<Uuid> = rest.iter().map(|m| m.id).collect();
    assert_eq!(
        before.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        want,
        "the dead message, then the pending ones"
    );
    for ((_, row), m) in before.iter().zip(rest) {
        assert_eq!(row["payload"], m.payload, "{row}");
    }
    assert_eq!(before[0].1["state"], "dead");
    assert_eq!(before[0].1["last_error"], "rejected by the broker");
    assert!(before[1..].iter().all(|(_, row)| row["state"] == "pending"));

    // Hold a row of the second batch, so that batch's DELETE waits for this transaction.
    let mut lock = pool.begin().await?;
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *lock)
        .await?;
    sqlx::query(&format!("SELECT id FROM {table} WHERE id = $1 FOR UPDATE"))
        .bind(published[LOCKED])
        .execute(&mut *lock)
        .await?;

    let app = format!("purge_crash_{suffix}");
    let sep = if pg_url.contains('?') { '&' } else { '?' };
    let named_url = format!("{pg_url}{sep}application_name={app}");
    let mut purge = relay_process([
        "--store",
        named_url.as_str(),
        "--schema",
        schema.as_str(),
        "purge",
        "--older-than",
        "0s",
        "--batch",
        &BATCH.to_string(),
    ])?;

    // Wait until the purge's session is blocked by the held lock: its first batch has
    // committed, its second is inside its DELETE.
    let waiting = tokio::time::timeout(GUARD, async {
        loop {
            if let Some(status) = purge.try_wait()? {
                return Err::<(), BoxError>(
                    format!("the purge exited ({status}) instead of waiting on the lock").into(),
                );
            }
            let blocked: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND wait_event_type = 'Lock' \
                   AND $2 = ANY(pg_blocking_pids(pid))",
            )
            .bind(&app)
            .bind(holder)
            .fetch_one(&pool)
            .await?;
            if blocked > 0 {
                return Ok(());
            }
        }
    })
    .await;
    waiting.map_err(|_| format!("the purge did not block on the held row within {GUARD:?}"))??;

    signal(&purge, "KILL").await?;
    let status = tokio::time::timeout(GUARD, purge.wait()).await??;
    assert!(!status.success(), "killed: {status}");
    // End its session before releasing the lock: a session outliving its client would finish
    // the DELETE and commit it.
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 60000)) \
         FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&app)
    .fetch_one(&pool)
    .await?;
    assert_eq!(ended, 1, "the purge's one session, ended");
    lock.rollback().await?;

    // The first batch is gone; the killed batch rolled back whole, so its rows are still here.
    assert_eq!(
        published_ids(&pool, &table).await?,
        published[BATCH..],
        "published rows after the kill: all but the committed first batch"
    );
    assert_eq!(
        unpublished_rows(&pool, &table).await?,
        before,
        "dead and pending rows untouched by the killed purge"
    );

    // A second purge finishes the job and touches nothing else.
    let purged = json_line(
        &[
            &store_args[..],
            &["purge", "--older-than", "0s", "--batch", &BATCH.to_string()],
        ]
        .concat(),
    )
    .await?;
    assert_eq!(purged, serde_json::json!({"purged": PUBLISHED - BATCH}));
    assert_eq!(
        unpublished_rows(&pool, &table).await?,
        before,
        "dead and pending rows untouched by the second purge"
    );
    let counts = json_line(&[&store_args[..], &["counts"]].concat()).await?;
    assert_eq!(
        counts,
        serde_json::json!({"pending": PENDING, "leased": 0, "published": 0, "dead": 1})
    );

    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}
