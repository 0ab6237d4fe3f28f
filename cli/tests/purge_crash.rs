//! An `outbox-relay purge` SIGKILLed in the middle of its work on the real Postgres and
//! MariaDB (the research plan's F-8, a crash during the cleanup of published messages).
//!
//! The kill is placed by an event, not a clock: the test holds a row lock on a published row of
//! the purge's second batch, waits until the database shows the purge's session blocked by
//! that lock (its first batch has committed by then), and kills the process there. The killed
//! batch must roll back whole, nothing but published rows may be gone, and a second purge must
//! finish the job. Both databases run the same steps and checks ([`purge_crash`]); only how
//! each one is set up, read and watched differs ([`Db`]).
//!
//! Not SQLite. SQLite locks the whole database for a writer, so a lock that stops the second
//! batch would have stopped the first one too; and a purge waiting in SQLite's busy handler
//! sleeps inside its own process, where no other connection can see it waiting. A kill there
//! could only be placed by timing.

use std::str::FromStr;
use std::time::Duration;

use outbox::mysql::{MysqlConfig, MysqlStore};
use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::{ClaimRequest, FailAction, Failure, HeadPolicy, NewMessage, OutboxStore};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::unique_suffix;
use serde_json::Value;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use sqlx::{ConnectOptions, MySql, PgPool, Postgres, Transaction};
use uuid::Uuid;

// Shared with the other test binaries; this one uses no graceful stop (`sigterm`).
#[allow(dead_code)]
mod common;
use common::{end_mysql_sessions, json_lines, message, relay_process, signal, BoxError, GUARD};

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
async fn json_line<S: AsRef<str>>(args: &[S]) -> Result<Value, BoxError> {
    let lines = json_lines(args.iter().map(|a| -> &str { a.as_ref() })).await?;
    match <[Value; 1]>::try_from(lines) {
        Ok([line]) => Ok(line),
        Err(lines) => {
            Err(format!("outbox-relay printed {} JSON lines, not one", lines.len()).into())
        }
    }
}

/// The database under test: its store (in a schema or table of the test's own) and how to
/// tell the purge's session apart from the test's.
enum Db {
    Postgres {
        url: String,
        store: PostgresStore,
        schema: String,
        /// The purge's `application_name`.
        app: String,
    },
    Mysql {
        url: String,
        store: MysqlStore,
        table: String,
        /// The purge's own account: MariaDB sessions carry no application name.
        user: String,
        password: String,
    },
}

/// The test's transaction that holds the row lock, and its session's id.
enum Lock {
    Postgres(Transaction<'static, Postgres>, i32),
    Mysql(Transaction<'static, MySql>, u64),
}

impl Lock {
    async fn rollback(self) -> Result<(), BoxError> {
        match self {
            Lock::Postgres(tx, _) => tx.rollback().await?,
            Lock::Mysql(tx, _) => tx.rollback().await?,
        }
        Ok(())
    }
}

impl Db {
    /// A fresh schema, migrated by `outbox-relay migrate`.
    async fn postgres(url: String, suffix: &str) -> Result<Self, BoxError> {
        let schema = format!("purge_crash_{suffix}");
        let config = PostgresConfig::builder().schema(schema.clone()).build()?;
        let store = PostgresStore::new(PgPool::connect(&url).await?, config);
        let db = Db::Postgres {
            url,
            store,
            schema,
            app: format!("purge_crash_{suffix}"),
        };
        json_line(&[db.store_args(), vec!["migrate".into()]].concat()).await?;
        Ok(db)
    }

    /// A fresh table, migrated by `outbox-relay migrate`, and an account for the purge that
    /// may read and change that table and nothing else.
    async fn mysql(url: String, suffix: &str) -> Result<Self, BoxError> {
        let table = format!("purge_crash_{suffix}");
        let config = MysqlConfig::builder().table(table.clone()).build()?;
        let store = MysqlStore::new(MySqlPool::connect(&url).await?, config);
        let db = Db::Mysql {
            url,
            store,
            table: table.clone(),
            user: format!("purge_crash_{suffix}"),
            password: unique_suffix(),
        };
        json_line(&[db.store_args(), vec!["migrate".into()]].concat()).await?;
        if let Db::Mysql {
            store,
            user,
            password,
            ..
        } = &db
        {
            sqlx::query(&format!(
                "CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'"
            ))
            .execute(store.pool())
            .await?;
            sqlx::query(&format!(
                "GRANT SELECT, UPDATE, DELETE ON `{table}` TO '{user}'@'%'"
            ))
            .execute(store.pool())
            .await?;
        }
        Ok(db)
    }

    /// `--store ...` for the test's own runs of `outbox-relay`.
    fn store_args(&self) -> Vec<String> {
        match self {
            Db::Postgres { url, schema, .. } => {
                vec![
                    "--store".into(),
                    url.clone(),
                    "--schema".into(),
                    schema.clone(),
                ]
            }
            Db::Mysql { url, table, .. } => {
                vec![
                    "--store".into(),
                    url.clone(),
                    "--table".into(),
                    table.clone(),
                ]
            }
        }
    }

    /// `--store ...` for the purge that is killed: its sessions are told apart by them.
    fn purge_store_args(&self) -> Result<Vec<String>, BoxError> {
        Ok(match self {
            Db::Postgres {
                url, schema, app, ..
            } => {
                let sep = if url.contains('?') { '&' } else { '?' };
                vec![
                    "--store".into(),
                    format!("{url}{sep}application_name={app}"),
                    "--schema".into(),
                    schema.clone(),
                ]
            }
            Db::Mysql {
                url,
                table,
                user,
                password,
                ..
            } => {
                let url = MySqlConnectOptions::from_str(url)?
                    .username(user)
                    .password(password)
                    .to_url_lossy();
                vec![
                    "--store".into(),
                    url.to_string(),
                    "--table".into(),
                    table.clone(),
                ]
            }
        })
    }

    fn store(&self) -> &dyn OutboxStore {
        match self {
            Db::Postgres { store, .. } => store,
            Db::Mysql { store, .. } => store,
        }
    }

    /// Enqueue `batch` in one committed transaction.
    async fn enqueue(&self, batch: &[NewMessage]) -> Result<(), BoxError> {
        match self {
            Db::Postgres { store, .. } => {
                let mut tx = store.pool().begin().await?;
                outbox::postgres::enqueue_batch(&mut *tx, store.config(), batch).await?;
                tx.commit().await?;
            }
            Db::Mysql { store, .. } => {
                let mut tx = store.pool().begin().await?;
                outbox::mysql::enqueue_batch(&mut *tx, store.config(), batch).await?;
                tx.commit().await?;
            }
        }
        Ok(())
    }

    /// Set message `id`'s publication `hours` back.
    async fn published_ago(&self, id: Uuid, hours: u32) -> Result<(), BoxError> {
        match self {
            Db::Postgres { store, schema, .. } => {
                sqlx::query(&format!(
                    "UPDATE \"{schema}\".outbox \
                     SET published_at = now() - $1 * interval '1 hour' WHERE id = $2"
                ))
                .bind(f64::from(hours))
                .bind(id)
                .execute(store.pool())
                .await?;
            }
            Db::Mysql { store, table, .. } => {
                sqlx::query(&format!(
                    "UPDATE `{table}` \
                     SET published_at = UTC_TIMESTAMP(6) - INTERVAL ? HOUR WHERE id = ?"
                ))
                .bind(hours)
                .bind(id.to_string())
                .execute(store.pool())
                .await?;
            }
        }
        Ok(())
    }

    /// Every row not published, in `seq` order, as `(id, whole row as JSON)`.
    async fn unpublished_rows(&self) -> Result<Vec<(Uuid, Value)>, BoxError> {
        let rows: Vec<(String, String)> = match self {
            Db::Postgres { store, schema, .. } => {
                sqlx::query_as(&format!(
                    "SELECT id::text, to_jsonb(t)::text FROM \"{schema}\".outbox t \
                     WHERE state <> 'published' ORDER BY seq"
                ))
                .fetch_all(store.pool())
                .await?
            }
            Db::Mysql { store, table, .. } => {
                // Every column, the JSON ones as JSON (MariaDB has no row-to-JSON function).
                let columns: Vec<String> = sqlx::query_scalar(
                    "SELECT COLUMN_NAME FROM information_schema.COLUMNS \
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? \
                     ORDER BY ORDINAL_POSITION",
                )
                .bind(table)
                .fetch_all(store.pool())
                .await?;
                let fields: Vec<String> = columns
                    .iter()
                    .map(|c| match c.as_str() {
                        "payload" | "headers" => format!("'{c}', JSON_EXTRACT(`{c}`, '$')"),
                        _ => format!("'{c}', `{c}`"),
                    })
                    .collect();
                sqlx::query_as(&format!(
                    "SELECT CONVERT(id USING utf8mb4), CONVERT(JSON_OBJECT({}) USING utf8mb4) FROM `{table}` \
                     WHERE state <> 'published' ORDER BY seq",
                    fields.join(", ")
                ))
                .fetch_all(store.pool())
                .await?
            }
        };
        rows.iter()
            .map(|(id, row)| Ok((Uuid::parse_str(id)?, serde_json::from_str(row)?)))
            .collect()
    }

    /// The published rows' ids, oldest first.
    async fn published_ids(&self) -> Result<Vec<Uuid>, BoxError> {
        let ids: Vec<String> = match self {
            Db::Postgres { store, schema, .. } => {
                sqlx::query_scalar(&format!(
                    "SELECT id::text FROM \"{schema}\".outbox \
                     WHERE state = 'published' ORDER BY published_at"
                ))
                .fetch_all(store.pool())
                .await?
            }
            Db::Mysql { store, table, .. } => {
                sqlx::query_scalar(&format!(
                    "SELECT CONVERT(id USING utf8mb4) FROM `{table}` WHERE state = 'published' ORDER BY published_at"
                ))
                .fetch_all(store.pool())
                .await?
            }
        };
        Ok(ids
            .iter()
            .map(|id| Uuid::parse_str(id))
            .collect::<Result<_, _>>()?)
    }

    /// Lock message `id`'s row in a transaction of the test's, left open.
    async fn lock(&self, id: Uuid) -> Result<Lock, BoxError> {
        Ok(match self {
            Db::Postgres { store, schema, .. } => {
                let mut tx = store.pool().begin().await?;
                let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&mut *tx)
                    .await?;
                sqlx::query(&format!(
                    "SELECT id FROM \"{schema}\".outbox WHERE id = $1 FOR UPDATE"
                ))
                .bind(id)
                .execute(&mut *tx)
                .await?;
                Lock::Postgres(tx, holder)
            }
            Db::Mysql { store, table, .. } => {
                let mut tx = store.pool().begin().await?;
                let holder: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                    .fetch_one(&mut *tx)
                    .await?;
                sqlx::query(&format!("SELECT id FROM `{table}` WHERE id = ? FOR UPDATE"))
                    .bind(id.to_string())
                    .execute(&mut *tx)
                    .await?;
                Lock::Mysql(tx, holder)
            }
        })
    }

    /// The session of the purge that waits for a lock `lock`'s session holds, if one does.
    async fn purge_blocked_by(&self, lock: &Lock) -> Result<Option<i64>, BoxError> {
        Ok(match (self, lock) {
            (Db::Postgres { store, app, .. }, Lock::Postgres(_, holder)) => {
                sqlx::query_scalar(
                    "SELECT pid::int8 FROM pg_stat_activity \
                     WHERE application_name = $1 AND wait_event_type = 'Lock' \
                       AND $2 = ANY(pg_blocking_pids(pid))",
                )
                .bind(app)
                .bind(holder)
                .fetch_optional(store.pool())
                .await?
            }
            (Db::Mysql { store, user, .. }, Lock::Mysql(_, holder)) => {
                // InnoDB's lock tables are a snapshot that is refreshed only once nobody has
                // read it for 0.1 s: polled back to back they would never show the wait. So
                // wait that long before each look; the kill is still placed by the wait seen,
                // not by this pause (the purge stays blocked until the test lets it go).
                tokio::time::sleep(Duration::from_millis(150)).await;
                sqlx::query_scalar(
                    "SELECT CAST(r.trx_mysql_thread_id AS SIGNED) \
                     FROM information_schema.INNODB_LOCK_WAITS w \
                     JOIN information_schema.INNODB_TRX r ON r.trx_id = w.requesting_trx_id \
                     JOIN information_schema.INNODB_TRX b ON b.trx_id = w.blocking_trx_id \
                     JOIN information_schema.PROCESSLIST p ON p.ID = r.trx_mysql_thread_id \
                     WHERE p.USER = ? AND r.trx_state = 'LOCK WAIT' \
                       AND b.trx_mysql_thread_id = ?",
                )
                .bind(user)
                .bind(holder)
                .fetch_optional(store.pool())
                .await?
            }
            _ => return Err("a lock of the other database".into()),
        })
    }

    /// End every session of the (killed) purge and return, once none is left, their ids. A
    /// session outliving its client would finish the DELETE and commit it once the lock is
    /// released.
    async fn end_purge_sessions(&self) -> Result<Vec<i64>, BoxError> {
        match self {
            Db::Postgres { store, app, .. } => Ok(sqlx::query_scalar(
                // Materialized first, so that no other session can be terminated.
                "WITH purge AS MATERIALIZED \
                   (SELECT pid FROM pg_stat_activity WHERE application_name = $1) \
                 SELECT pid::int8 FROM purge WHERE pg_terminate_backend(pid, 60000)",
            )
            .bind(app)
            .fetch_all(store.pool())
            .await?),
            Db::Mysql { store, user, .. } => end_mysql_sessions(store.pool(), user).await,
        }
    }

    async fn clean_up(&self) -> Result<(), BoxError> {
        match self {
            Db::Postgres { store, schema, .. } => {
                sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                    .execute(store.pool())
                    .await?;
            }
            Db::Mysql {
                store, table, user, ..
            } => {
                sqlx::query(&format!("DROP TABLE `{table}`"))
                    .execute(store.pool())
                    .await?;
                sqlx::query(&format!("DROP USER '{user}'@'%'"))
                    .execute(store.pool())
                    .await?;
            }
        }
        Ok(())
    }
}

/// Claim the next `n` pending messages (each under its own key, so none waits for another).
async fn claim(store: &dyn OutboxStore, n: usize) -> Result<outbox::Claim, BoxError> {
    let claim = store
        .claim(&ClaimRequest {
            limit: n,
            lease: Duration::from_secs(60),
            head_policy: HeadPolicy::Block,
            shard: None,
        })
        .await?;
    assert_eq!(claim.messages.len(), n, "claimed the next {n}");
    Ok(claim)
}

#[tokio::test]
async fn a_purge_killed_mid_batch_loses_nothing_but_committed_batches() -> TestResult {
    let Some(url) = service_url("OUTBOX_TEST_POSTGRES_URL") else {
        return Ok(());
    };
    purge_crash(Db::postgres(url, &unique_suffix()).await?).await
}

#[tokio::test]
async fn a_mariadb_purge_killed_mid_batch_loses_nothing_but_committed_batches() -> TestResult {
    let Some(url) = service_url("OUTBOX_TEST_MYSQL_URL") else {
        return Ok(());
    };
    purge_crash(Db::mysql(url, &unique_suffix()).await?).await
}

async fn purge_crash(db: Db) -> TestResult {
    let store = db.store();
    let keys = PUBLISHED + 1 + PENDING;
    let messages: Vec<NewMessage> = (0..keys).map(|n| message(n, keys)).collect();
    let (to_publish, rest) = messages.split_at(PUBLISHED);
    let (to_kill, pending) = rest.split_at(1);

    // Published: claimed and completed, as a relay does.
    db.enqueue(to_publish).await?;
    let claimed = claim(store, PUBLISHED).await?;
    let published: Vec<Uuid> = to_publish.iter().map(|m| m.id).collect();
    store.complete(claimed.token, &published).await?;
    // One completion gives them one timestamp; spread them an hour apart, the first oldest, so
    // which rows each batch of the purge takes is known.
    for (age, id) in (1..=PUBLISHED).rev().zip(&published) {
        db.published_ago(*id, u32::try_from(age)?).await?;
    }
    // Dead: one failed attempt, dead-lettered.
    db.enqueue(to_kill).await?;
    let claimed = claim(store, 1).await?;
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
    db.enqueue(pending).await?;

    assert_eq!(db.published_ids().await?, published);
    let before = db.unpublished_rows().await?;
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
    let lock = db.lock(published[LOCKED]).await?;
    let batch = BATCH.to_string();
    let purge_args = ["purge", "--older-than", "0s", "--batch", batch.as_str()];
    let mut purge = relay_process(
        db.purge_store_args()?
            .iter()
            .map(String::as_str)
            .chain(purge_args),
    )?;

    // Wait until the purge's session is blocked by the held lock: its first batch has
    // committed, its second is inside its DELETE. (On MariaDB the wait lasts at most
    // `innodb_lock_wait_timeout`, 50 s by default; the kill follows as soon as it is seen.)
    let waiting = tokio::time::timeout(GUARD, async {
        loop {
            if let Some(status) = purge.try_wait()? {
                return Err::<i64, BoxError>(
                    format!("the purge exited ({status}) instead of waiting on the lock").into(),
                );
            }
            if let Some(session) = db.purge_blocked_by(&lock).await? {
                return Ok(session);
            }
        }
    })
    .await;
    let blocked = waiting
        .map_err(|_| format!("the purge did not block on the held row within {GUARD:?}"))??;

    signal(&purge, "KILL").await?;
    let status = tokio::time::timeout(GUARD, purge.wait()).await??;
    assert!(!status.success(), "killed: {status}");
    // End its session before releasing the lock: a session outliving its client would finish
    // the DELETE and commit it.
    let ended = db.end_purge_sessions().await?;
    assert!(
        ended.contains(&blocked),
        "the purge's blocked session {blocked} is among those ended: {ended:?}"
    );
    lock.rollback().await?;

    // The first batch is gone; the killed batch rolled back whole, so its rows are still here.
    assert_eq!(
        db.published_ids().await?,
        published[BATCH..],
        "published rows after the kill: all but the committed first batch"
    );
    assert_eq!(
        db.unpublished_rows().await?,
        before,
        "dead and pending rows untouched by the killed purge"
    );

    // A second purge finishes the job and touches nothing else.
    let store_args = db.store_args();
    let purged = json_line(&[&store_args[..], &purge_args.map(String::from)[..]].concat()).await?;
    assert_eq!(purged, serde_json::json!({"purged": PUBLISHED - BATCH}));
    assert_eq!(
        db.unpublished_rows().await?,
        before,
        "dead and pending rows untouched by the second purge"
    );
    let counts = json_line(&[store_args, vec!["counts".into()]].concat()).await?;
    assert_eq!(
        counts,
        serde_json::json!({"pending": PENDING, "leased": 0, "published": 0, "dead": 1})
    );

    db.clean_up().await
}
