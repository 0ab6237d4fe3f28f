//! Chaos: two `outbox-relay run` processes relay a Postgres, MariaDB or SQLite outbox into NATS
//! (or Postgres into Redis or Kafka) while a producer commits and rolls back transactions, and relays
//! are SIGKILLed at random points of the stream and replaced.
//!
//! Each round commits a few transactions (and rolls one back), waits until a random number of
//! new messages has reached the broker, then kills a random relay with SIGKILL, expires every
//! lease in SQL (the killed relay's, and the survivor's too, which makes the survivor a zombie
//! the store must fence) and starts a replacement. Kills therefore land anywhere: in a claim, a
//! publish, a complete, between them. At the end the survivors are stopped with SIGTERM and the
//! stream is read back with its own client: every committed message is there with its exact
//! payload, no rolled-back message is, each key's first copies are in commit order, and the
//! copies beyond the first (none on NATS, whose dedup window drops them; some on Redis and
//! Kafka, whose idempotent producer dedups only its own retries) stay
//! within what the kills put in flight; the store has nothing left pending.
//!
//! Nothing sleeps: kills are triggered by deliveries seen on a subscription, and leases are
//! expired by moving their stored end back (on Postgres and MariaDB after ending the dead
//! relay's sessions, so that a statement it had already sent cannot take a lease afterwards; a
//! SQLite writer's locks end with its process). A relay's sessions are found by their
//! application name on Postgres and, since MariaDB sessions carry none, by their user on
//! MariaDB, where each relay connects as an account of its own. The seed is printed;
//! `OUTBOX_CHAOS_SEED=N` replays a run's choices (the exact kill points also depend on timing).

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::str::FromStr;
use std::sync::Mutex;

use futures::StreamExt;
use outbox::mysql::{MysqlConfig, MysqlStore};
use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{NewMessage, OutboxAdmin};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{check_delivery, kafka, nats, redis, unique_suffix, Expected, Received};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::StreamConsumer;
use sqlx::mysql::MySqlConnectOptions;
use sqlx::ConnectOptions;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod common;
use common::{
    end_mysql_sessions, message, nats_subscription, relay_process, sigterm, BoxError, BIN, GUARD,
};

const ROUNDS: usize = 20;
const TXS_PER_ROUND: usize = 4;
const PER_TX: usize = 6;
const KEYS: usize = 5;
const RELAYS: usize = 2;
/// Each relay's batch size and batches in flight.
const BATCH: usize = 4;
const IN_FLIGHT: usize = 2;

/// A running relay process.
struct Relay {
    child: Child,
    /// Its name (on Postgres, its sessions' application name; on MariaDB, its account).
    name: String,
    /// Fires when the relay has logged that it started (its stop signal handler is in place).
    started: Option<oneshot::Receiver<()>>,
    /// Its standard error, read as it comes (a pipe nobody reads could fill and block it).
    stderr: JoinHandle<String>,
}

/// Start a relay on `store_args` (`--store ...` and its options) into `broker`.
fn spawn_relay(store_args: &[String], broker: &str, name: &str) -> Result<Relay, BoxError> {
    let mut child = relay_process(store_args.iter().map(String::as_str).chain([
        "run",
        "--broker",
        broker,
        "--batch-size",
        &BATCH.to_string(),
        "--concurrency",
        &IN_FLIGHT.to_string(),
        "--poll-max",
        "20ms",
    ]))?;
    let pipe = child.stderr.take().ok_or("no stderr pipe")?;
    let (tx, started) = oneshot::channel();
    let stderr = tokio::spawn(async move {
        let mut tx = Some(tx);
        let mut text = String::new();
        let mut lines = BufReader::new(pipe).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("relay started") {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(());
                }
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    Ok(Relay {
        child,
        name: name.to_owned(),
        started: Some(started),
        stderr,
    })
}

/// The outbox under test, and what the test does to it directly.
enum Db {
    Postgres {
        url: String,
        store: PostgresStore,
        schema: String,
    },
    Sqlite {
        path: std::path::PathBuf,
        store: SqliteStore,
        _dir: tempfile::TempDir,
    },
    Mysql {
        /// The test's own (administrator's) URL.
        url: String,
        store: MysqlStore,
        table: String,
        /// The relays' accounts created so far, dropped at the end.
        users: Mutex<Vec<String>>,
    },
}

impl Db {
    async fn postgres(url: String, suffix: &str) -> Result<Self, BoxError> {
        let schema = format!("chaos_{suffix}");
        let config = PostgresConfig::builder().schema(schema.clone()).build()?;
        let store = PostgresStore::connect(&url, config).await?;
        store.migrate().await?;
        Ok(Db::Postgres { url, store, schema })
    }

    async fn sqlite() -> Result<Self, BoxError> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("outbox.sqlite");
        let store = SqliteStore::open(&path, SqliteConfig::default()).await?;
        store.migrate().await?;
        Ok(Db::Sqlite {
            path,
            store,
            _dir: dir,
        })
    }

    async fn mysql(url: String, suffix: &str) -> Result<Self, BoxError> {
        let table = format!("chaos_{suffix}");
        let config = MysqlConfig::builder().table(table.clone()).build()?;
        let store = MysqlStore::connect(&url, config).await?;
        store.migrate().await?;
        Ok(Db::Mysql {
            url,
            store,
            table,
            users: Mutex::new(Vec::new()),
        })
    }

    /// `--store ...` for a relay named `name` (on MariaDB, after creating its account).
    async fn store_args(&self, name: &str) -> Result<Vec<String>, BoxError> {
        Ok(match self {
            Db::Postgres { url, schema, .. } => {
                let sep = if url.contains('?') { '&' } else { '?' };
                vec![
                    "--store".into(),
                    format!("{url}{sep}application_name={name}"),
                    "--schema".into(),
                    schema.clone(),
                ]
            }
            Db::Sqlite { path, .. } => {
                vec!["--store".into(), format!("sqlite://{}", path.display())]
            }
            Db::Mysql {
                url,
                store,
                table,
                users,
            } => {
                // MariaDB sessions carry no application name: an account per relay is what
                // tells its sessions apart. It may read and change the test's table (claim,
                // complete) and nothing else.
                let password = unique_suffix();
                sqlx::query(&format!(
                    "CREATE USER '{name}'@'%' IDENTIFIED BY '{password}'"
                ))
                .execute(store.pool())
                .await?;
                users.lock().map_err(|_| "poisoned")?.push(name.to_owned());
                sqlx::query(&format!(
                    "GRANT SELECT, UPDATE, DELETE ON `{table}` TO '{name}'@'%'"
                ))
                .execute(store.pool())
                .await?;
                let relay_url = MySqlConnectOptions::from_str(url)?
                    .username(name)
                    .password(&password)
                    .to_url_lossy();
                vec![
                    "--store".into(),
                    relay_url.to_string(),
                    "--table".into(),
                    table.clone(),
                ]
            }
        })
    }

    /// Enqueue `batch` in one transaction, then commit it or roll it back.
    async fn write(&self, batch: &[NewMessage], commit: bool) -> Result<(), BoxError> {
        match self {
            Db::Postgres { store, .. } => {
                let mut tx = store.pool().begin().await?;
                outbox::postgres::enqueue_batch(&mut *tx, store.config(), batch).await?;
                finish(tx, commit).await?;
            }
            Db::Mysql { store, .. } => {
                let mut tx = store.pool().begin().await?;
                outbox::mysql::enqueue_batch(&mut *tx, store.config(), batch).await?;
                finish(tx, commit).await?;
            }
            Db::Sqlite { path, .. } => {
                let config = SqliteConfig::default();
                let mut conn = outbox::sqlite::open_connection(path, &config)?;
                let tx = conn.transaction()?;
                outbox::sqlite::enqueue_batch(&tx, &config, batch)?;
                if commit {
                    tx.commit()?;
                } else {
                    tx.rollback()?;
                }
            }
        }
        Ok(())
    }

    /// After relay `name` was killed: end its sessions, then expire every lease (its, and the
    /// survivor's).
    async fn after_kill(&self, name: &str) -> Result<(), BoxError> {
        match self {
            Db::Postgres { store, schema, .. } => {
                sqlx::query(
                    "SELECT count(pg_terminate_backend(pid, 10000)) FROM pg_stat_activity \
                     WHERE application_name = $1",
                )
                .bind(name)
                .execute(store.pool())
                .await?;
                // The survivor's transitions lock rows in their own order, so this statement,
                // which locks every leased row, may be chosen as a deadlock's victim: it changed
                // nothing then, and runs again.
                let mut attempts = 0;
                loop {
                    let expired = sqlx::query(&format!(
                        "UPDATE \"{schema}\".outbox SET lease_until = now() - interval '1 second' \
                         WHERE lease_until IS NOT NULL AND state = 'pending'"
                    ))
                    .execute(store.pool())
                    .await;
                    match expired {
                        Err(sqlx::Error::Database(e))
                            if e.code().as_deref() == Some("40P01") && attempts < 10 =>
                        {
                            attempts += 1;
                        }
                        other => break other.map(drop)?,
                    }
                }
            }
            Db::Sqlite { path, .. } => {
                let conn = outbox::sqlite::open_connection(path, &SqliteConfig::default())?;
                conn.execute(
                    "UPDATE outbox SET lease_until = lease_until - 3600000 \
                     WHERE state = 'leased'",
                    [],
                )?;
            }
            Db::Mysql { store, table, .. } => {
                // Once none of the dead relay's sessions is listed, nothing it sent can still
                // take a lease. No new session of its account can start (its process is
                // gone), and a session leaves the process list only once it has ended: KILL
                // CONNECTION (or the closed socket) aborts its statement and rolls back its
                // open transaction, so a claim whose COMMIT had not run leaves no lease, while
                // a COMMIT that had run is durable and visible before the session is gone
                // (checked by hand: a killed session that rolls back 300,000 row changes stays
                // listed until its locks are free). Every lease the relay ever wrote is
                // therefore in the table when the expiry below reads it. Expiring first would
                // race: the plain read of leased rows sees a row that a claim has leased but
                // not committed as not leased, and that claim's COMMIT, already sent, would
                // then leave a lease of the dead relay that holds its messages back for a
                // whole lease.
                end_mysql_sessions(store.pool(), name).await?;
                let leased: Vec<i64> = sqlx::query_scalar(&format!(
                    "SELECT seq FROM `{table}` WHERE state = 'pending' AND lease_until IS NOT NULL"
                ))
                .fetch_all(store.pool())
                .await?;
                // One row per statement, found by primary key (forced: through `ix_claim` the
                // statement would lock that index's entry, then the row) and changed in no
                // index: a statement that holds one lock cannot deadlock with the survivor's
                // transitions, which lock several rows.
                for seq in leased {
                    sqlx::query(&format!(
                        "UPDATE `{table}` FORCE INDEX (PRIMARY) \
                         SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
                         WHERE seq = ? AND state = 'pending' AND lease_until IS NOT NULL"
                    ))
                    .bind(seq)
                    .execute(store.pool())
                    .await?;
                }
            }
        }
        Ok(())
    }

    /// Every stored message's payload text by id: what the relay publishes byte for byte
    /// (Postgres normalises JSON text).
    async fn payloads(&self) -> Result<HashMap<String, String>, BoxError> {
        Ok(match self {
            Db::Postgres { store, schema, .. } => sqlx::query_as(&format!(
                "SELECT id::text, payload::text FROM \"{schema}\".outbox"
            ))
            .fetch_all(store.pool())
            .await?
            .into_iter()
            .collect(),
            Db::Sqlite { path, .. } => {
                let conn = outbox::sqlite::open_connection(path, &SqliteConfig::default())?;
                let mut stmt = conn.prepare("SELECT id, payload FROM outbox")?;
                let rows = stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?;
                rows.collect::<Result<_, _>>()?
            }
            Db::Mysql { store, table, .. } => {
                // Both columns have binary collations, which sqlx types as bytes: read the
                // bytes the relay reads.
                let rows: Vec<(Vec<u8>, Vec<u8>)> =
                    sqlx::query_as(&format!("SELECT id, payload FROM `{table}`"))
                        .fetch_all(store.pool())
                        .await?;
                rows.into_iter()
                    .map(|(id, payload)| Ok((String::from_utf8(id)?, String::from_utf8(payload)?)))
                    .collect::<Result<_, BoxError>>()?
            }
        })
    }

    /// The rows of messages `ids` as the store holds them, one line each, and the store's
    /// clock: what a stall report shows.
    async fn describe(&self, ids: &[String]) -> Result<String, BoxError> {
        let mut out = String::new();
        match self {
            Db::Postgres { store, schema, .. } => {
                let rows: Vec<(String,)> = sqlx::query_as(&format!(
                    "SELECT concat_ws(' ', 'now', now(), '|', seq, id, partition_key, state, \
                     'attempts', attempts, 'available_at', available_at, 'lease_until', \
                     coalesce(lease_until::text, '-'), 'error', coalesce(last_error, '-')) \
                     FROM \"{schema}\".outbox WHERE id::text = ANY($1) ORDER BY seq"
                ))
                .bind(ids)
                .fetch_all(store.pool())
                .await?;
                rows.into_iter()
                    .for_each(|(r,)| out.push_str(&format!("{r}\n")));
            }
            Db::Sqlite { path, .. } => {
                let conn = outbox::sqlite::open_connection(path, &SqliteConfig::default())?;
                let mut stmt = conn.prepare(
                    "SELECT 'now ' || CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) || ' | ' || seq || ' ' || id \
                     || ' ' || ifnull(partition_key, '-') || ' ' || state || ' attempts ' \
                     || attempts || ' available_at ' || available_at || ' lease_until ' \
                     || ifnull(lease_until, '-') || ' error ' || ifnull(last_error, '-') \
                     FROM outbox WHERE id = ?1",
                )?;
                for id in ids {
                    let rows = stmt.query_map([id], |row| row.get::<_, String>(0))?;
                    for row in rows {
                        out.push_str(&format!("{}\n", row?));
                    }
                }
            }
            Db::Mysql { store, table, .. } => {
                // Ids are UUIDs: no comma inside one.
                let rows: Vec<(String,)> = sqlx::query_as(&format!(
                    "SELECT CAST(CONCAT_WS(' ', 'now', UTC_TIMESTAMP(6), '|', seq, id, \
                     IFNULL(partition_key, '-'), state, 'attempts', attempts, \
                     'available_at', available_at, 'lease_until', \
                     IFNULL(lease_until, '-'), 'error', IFNULL(last_error, '-')) AS CHAR) \
                     FROM `{table}` WHERE FIND_IN_SET(id, ?) ORDER BY seq"
                ))
                .bind(ids.join(","))
                .fetch_all(store.pool())
                .await?;
                rows.into_iter()
                    .for_each(|(r,)| out.push_str(&format!("{r}\n")));
            }
        }
        Ok(out)
    }

    fn name(&self) -> &'static str {
        match self {
            Db::Postgres { .. } => "postgres",
            Db::Sqlite { .. } => "sqlite",
            Db::Mysql { .. } => "mariadb",
        }
    }

    fn admin(&self) -> &dyn OutboxAdmin {
        match self {
            Db::Postgres { store, .. } => store,
            Db::Sqlite { store, .. } => store,
            Db::Mysql { store, .. } => store,
        }
    }

    /// Drop what the test created in the server: the schema, or the table and accounts.
    async fn clean_up(&self) -> Result<(), BoxError> {
        match self {
            Db::Postgres { store, schema, .. } => {
                sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                    .execute(store.pool())
                    .await?;
            }
            Db::Sqlite { .. } => {}
            Db::Mysql {
                store,
                table,
                users,
                ..
            } => {
                sqlx::query(&format!("DROP TABLE `{table}`"))
                    .execute(store.pool())
                    .await?;
                let users = std::mem::take(&mut *users.lock().map_err(|_| "poisoned")?);
                for user in users {
                    sqlx::query(&format!("DROP USER '{user}'@'%'"))
                        .execute(store.pool())
                        .await?;
                }
            }
        }
        Ok(())
    }
}

/// Commit `tx`, or roll it back.
async fn finish<DB: sqlx::Database>(
    tx: sqlx::Transaction<'_, DB>,
    commit: bool,
) -> Result<(), sqlx::Error> {
    if commit {
        tx.commit().await
    } else {
        tx.rollback().await
    }
}

#[tokio::test]
async fn postgres_relays_killed_at_random_points_lose_nothing_and_keep_key_order(
) -> Result<(), BoxError> {
    let (Some(pg_url), Some(nats_url)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let suffix = unique_suffix();
    chaos(
        Db::postgres(pg_url, &suffix).await?,
        Broker::Nats { url: nats_url },
        &suffix,
    )
    .await
}

#[tokio::test]
async fn sqlite_relays_killed_at_random_points_lose_nothing_and_keep_key_order(
) -> Result<(), BoxError> {
    let Some(nats_url) = service_url("OUTBOX_TEST_NATS_URL") else {
        return Ok(());
    };
    chaos(
        Db::sqlite().await?,
        Broker::Nats { url: nats_url },
        &unique_suffix(),
    )
    .await
}

/// MariaDB, whose relays are told apart by their accounts: each relay connects as its own user,
/// whose sessions are ended with `KILL CONNECTION` after its kill.
#[tokio::test]
async fn mariadb_relays_killed_at_random_points_lose_nothing_and_keep_key_order(
) -> Result<(), BoxError> {
    let (Some(my_url), Some(nats_url)) = (
        service_url("OUTBOX_TEST_MYSQL_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let suffix = unique_suffix();
    chaos(
        Db::mysql(my_url, &suffix).await?,
        Broker::Nats { url: nats_url },
        &suffix,
    )
    .await
}

/// Into Redis, which keeps every republished copy: duplicates show, and must stay within what
/// the kills put in flight, with each key's first copies in commit order.
#[tokio::test]
async fn postgres_into_redis_relays_killed_at_random_points_lose_nothing() -> Result<(), BoxError> {
    let (Some(pg_url), Some(redis_url)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_REDIS_URL"),
    ) else {
        return Ok(());
    };
    let suffix = unique_suffix();
    chaos(
        Db::postgres(pg_url, &suffix).await?,
        Broker::Redis { url: redis_url },
        &suffix,
    )
    .await
}

/// Into Kafka (Tansu), whose idempotent producer drops only its own retries: a replaced relay's
/// new producer republishes what its predecessor may have stored, so duplicates show as on Redis.
#[tokio::test]
async fn postgres_into_kafka_relays_killed_at_random_points_lose_nothing() -> Result<(), BoxError> {
    let (Some(pg_url), Some(brokers)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_KAFKA_BROKERS"),
    ) else {
        return Ok(());
    };
    let suffix = unique_suffix();
    chaos(
        Db::postgres(pg_url, &suffix).await?,
        Broker::Kafka { brokers },
        &suffix,
    )
    .await
}

async fn chaos(db: Db, broker: Broker, suffix: &str) -> Result<(), BoxError> {
    let seed = match std::env::var("OUTBOX_CHAOS_SEED") {
        Ok(s) => s.parse()?,
        Err(_) => rand::rng().random(),
    };
    let what = db.name();
    eprintln!("{what} chaos seed {seed} (OUTBOX_CHAOS_SEED={seed} replays its choices)");
    let mut rng = StdRng::seed_from_u64(seed);

    let mut watch = broker.watch(suffix).await?;
    let broker_url = broker.relay_url(suffix);
    let broker_name = broker.name();
    let what = format!("{what} → {broker_name}");
    let mut started = 0;
    let mut spawn = async || {
        started += 1;
        let name = format!("chaos-{suffix}-{started}");
        spawn_relay(&db.store_args(&name).await?, &broker_url, &name)
    };
    let mut relays: Vec<Relay> = Vec::new();
    for _ in 0..RELAYS {
        relays.push(spawn().await?);
    }

    let mut committed: Vec<NewMessage> = Vec::new();
    let mut rolled_back: HashSet<String> = HashSet::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut n = 0;
    let mut kills = 0;
    // The killed relays' names and standard error, for the report of a stall.
    let mut killed: Vec<(String, JoinHandle<String>)> = Vec::new();
    for round in 0..ROUNDS {
        for t in 0..TXS_PER_ROUND {
            let batch: Vec<NewMessage> = (n..n + PER_TX).map(|n| message(n, KEYS)).collect();
            n += PER_TX;
            let commit = t != round % TXS_PER_ROUND;
            db.write(&batch, commit).await?;
            if commit {
                committed.extend(batch);
            } else {
                rolled_back.extend(batch.iter().map(|m| m.id.to_string()));
            }
        }
        // Kill once a random share of this round's messages has arrived: mid-stream.
        let pending = committed.len() - seen.len();
        let target = seen.len() + rng.random_range(1..=pending.max(1));
        if let Err(e) = watch.wait_for(&mut seen, target).await {
            return Err(stalled(e, &db, &committed, &seen, relays, killed).await);
        }
        let victim = rng.random_range(0..relays.len());
        relays[victim].child.start_kill()?;
        relays[victim].child.wait().await?;
        kills += 1;
        let name = relays[victim].name.clone();
        // The dead relay's sessions end, as a crashed host's do once the server notices: a
        // statement it had already sent (a claim's COMMIT, say) finishes or is aborted first.
        // Then the killed relay's leases (and the survivor's) end now.
        db.after_kill(&name).await?;
        let dead = std::mem::replace(&mut relays[victim], spawn().await?);
        killed.push((name, dead.stderr));
    }
    if let Err(e) = watch.wait_for(&mut seen, committed.len()).await {
        return Err(stalled(e, &db, &committed, &seen, relays, killed).await);
    }
    // Closed before the stream is read back and deleted: with the Kafka watcher left open
    // through the read-back and the topic's deletion, librdkafka crashed (SIGSEGV) in 5 of 12
    // runs; closed first, in none of 15.
    drop(watch);

    for relay in &mut relays {
        // A SIGTERM before the relay listens for it would kill it by default action.
        if let Some(started) = relay.started.take() {
            tokio::time::timeout(GUARD, started).await??;
        }
        sigterm(&relay.child).await?;
    }
    for mut relay in relays {
        let status = tokio::time::timeout(GUARD, relay.child.wait()).await??;
        let stderr = relay.stderr.await?;
        assert!(status.success(), "relay exit {status}: {stderr}");
        assert!(
            stderr.contains(r#""order_violations":0"#),
            "a relay reported order violations: {stderr}"
        );
    }
    // A message whose complete a fenced zombie lost may still be pending (its new holder may
    // not have claimed it before the stop): a last drain settles it, as the next start would.
    let drained = Command::new(BIN)
        .args(db.store_args(&format!("chaos-{suffix}-drain")).await?)
        .args(["drain", "--broker", &broker_url])
        .stdin(Stdio::null())
        .output();
    let drained = tokio::time::timeout(GUARD, drained).await??;
    assert!(drained.status.success(), "{drained:?}");

    let received = broker.read_back(suffix).await?;
    let stored = db.payloads().await?;
    let expected: Vec<Expected> = committed
        .iter()
        .map(|m| Expected {
            id: m.id.to_string(),
            key: m.partition_key.clone(),
            payload: stored
                .get(&m.id.to_string())
                .map(|p| p.as_bytes().to_vec())
                .unwrap_or_default(),
        })
        .collect();
    let leaked: Vec<&str> = received
        .iter()
        .map(|r| r.id.as_str())
        .filter(|id| rolled_back.contains(*id))
        .collect();
    assert!(
        leaked.is_empty(),
        "rolled-back messages published: {leaked:?}"
    );
    let delivery =
        check_delivery(&received, &expected).map_err(|e| format!("{what} seed {seed}: {e}"))?;
    assert_eq!(delivery.distinct, committed.len());
    eprintln!(
        "{what} chaos seed {seed}: {kills} kills, {} messages, {} duplicates in the stream",
        committed.len(),
        delivery.duplicates
    );
    // Duplicates come only from a kill or a fenced zombie: at most what the killed relay and
    // the survivor (whose leases were expired) had in flight, per kill.
    let bound = kills * RELAYS * IN_FLIGHT * BATCH;
    assert!(
        delivery.duplicates <= bound,
        "{what} seed {seed}: {} duplicates, more than {bound}",
        delivery.duplicates
    );
    let counts = db.admin().counts().await?;
    assert_eq!(
        (counts.pending, counts.leased, counts.dead),
        (0, 0, 0),
        "{counts:?}"
    );
    assert_eq!(counts.published, committed.len() as u64);

    broker.delete(suffix).await?;
    db.clean_up().await
}

/// The report of a stall (committed messages that stopped reaching the broker): `err`, then
/// each missing message's row as the store holds it, then what every relay (killed, replaced
/// and running, which are stopped here) logged above INFO.
async fn stalled(
    err: BoxError,
    db: &Db,
    committed: &[NewMessage],
    seen: &HashSet<String>,
    relays: Vec<Relay>,
    killed: Vec<(String, JoinHandle<String>)>,
) -> BoxError {
    let missing: Vec<String> = committed
        .iter()
        .map(|m| m.id.to_string())
        .filter(|id| !seen.contains(id))
        .take(20)
        .collect();
    let mut report = format!("{err}\nmissing (first 20): {missing:?}\n");
    match db.describe(&missing).await {
        Ok(rows) => report.push_str(&rows),
        Err(e) => report.push_str(&format!("could not read their rows: {e}\n")),
    }
    let mut logs = killed;
    for mut relay in relays {
        let _ = relay.child.start_kill();
        let _ = relay.child.wait().await;
        logs.push((format!("{} (running)", relay.name), relay.stderr));
    }
    for (name, stderr) in logs {
        let text = stderr.await.unwrap_or_default();
        report.push_str(&format!("--- relay {name}:\n"));
        // A log line's second word is its level; other lines (a panic, the exit error) stay.
        let quiet = |l: &&str| {
            l.split_whitespace()
                .nth(1)
                .is_some_and(|level| ["INFO", "DEBUG", "TRACE"].contains(&level))
        };
        for line in text.lines().filter(|l| !quiet(l)) {
            report.push_str(line);
            report.push('\n');
        }
    }
    report.into()
}

/// The broker under test.
enum Broker {
    /// NATS JetStream: deliveries are seen on a core subscription to the stream's subjects
    /// (its dedup window drops republished copies).
    Nats { url: String },
    /// Redis Streams: deliveries are seen with a blocking `XREAD` (no dedup: republished copies
    /// stay in the stream).
    Redis { url: String },
    /// Kafka (Tansu): a topic of [`KAFKA_PARTITIONS`] partitions, keyed by partition key;
    /// deliveries are seen by a consumer that reads every partition from its start.
    Kafka { brokers: String },
}

/// Partitions of the Kafka variant's topic: several, so keys spread and order is per partition.
const KAFKA_PARTITIONS: i32 = 4;

/// Deliveries as they reach the broker.
enum Watch {
    Nats(async_nats::Subscriber),
    Redis {
        url: String,
        key: String,
        last: String,
    },
    Kafka(StreamConsumer),
}

impl Broker {
    fn name(&self) -> &'static str {
        match self {
            Broker::Nats { .. } => "nats",
            Broker::Redis { .. } => "redis",
            Broker::Kafka { .. } => "kafka",
        }
    }

    fn relay_url(&self, suffix: &str) -> String {
        match self {
            Broker::Nats { url } => format!(
                "{url}?subject=chaos{suffix}.{{event_type}}&stream=CHAOS_{suffix}\
                 &create_stream=true&stream_subjects=chaos{suffix}.>"
            ),
            Broker::Redis { url } => format!("{url}?stream=chaos{suffix}"),
            Broker::Kafka { brokers } => format!("kafka://{brokers}?topic=chaos{suffix}"),
        }
    }

    async fn watch(&self, suffix: &str) -> Result<Watch, BoxError> {
        Ok(match self {
            Broker::Nats { url } => {
                Watch::Nats(nats_subscription(url, format!("chaos{suffix}.>")).await?)
            }
            Broker::Redis { url } => Watch::Redis {
                url: url.clone(),
                key: format!("chaos{suffix}"),
                last: "0".into(),
            },
            Broker::Kafka { brokers } => {
                let topic = format!("chaos{suffix}");
                kafka::create_topic(brokers, &topic, KAFKA_PARTITIONS).await?;
                // From each partition's start: nothing the relays store can be missed, however
                // early.
                Watch::Kafka(kafka::consumer_from_start(
                    brokers,
                    &topic,
                    KAFKA_PARTITIONS,
                )?)
            }
        })
    }

    async fn read_back(&self, suffix: &str) -> Result<Vec<Received>, BoxError> {
        match self {
            Broker::Nats { url } => nats::read_stream(url, &format!("CHAOS_{suffix}")).await,
            Broker::Redis { url } => redis::read_stream(url, &format!("chaos{suffix}")).await,
            Broker::Kafka { brokers } => {
                kafka::read_topic(brokers, &format!("chaos{suffix}"), KAFKA_PARTITIONS).await
            }
        }
    }

    async fn delete(&self, suffix: &str) -> Result<(), BoxError> {
        match self {
            Broker::Nats { url } => nats::delete_stream(url, &format!("CHAOS_{suffix}")).await,
            Broker::Redis { url } => redis::delete(url, &format!("chaos{suffix}")).await,
            Broker::Kafka { brokers } => {
                kafka::delete_topic(brokers, &format!("chaos{suffix}")).await
            }
        }
    }
}

impl Watch {
    /// Wait until `target` distinct message ids have reached the broker.
    async fn wait_for(
        &mut self,
        seen: &mut HashSet<String>,
        target: usize,
    ) -> Result<(), BoxError> {
        let deadline = tokio::time::Instant::now() + GUARD;
        while seen.len() < target {
            let late = || {
                format!(
                    "{} of {target} messages reached the broker; no more within {GUARD:?}",
                    seen.len()
                )
            };
            match self {
                Watch::Nats(sub) => {
                    let next = tokio::time::timeout_at(deadline, sub.next())
                        .await
                        .map_err(|_| late())?;
                    let Some(msg) = next else {
                        return Err("subscription ended".into());
                    };
                    if let Some(id) = msg.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
                        seen.insert(id.as_str().to_owned());
                    }
                }
                Watch::Redis { url, key, last } => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(late().into());
                    }
                    // Blocks until entries arrive (or the guard's time is up).
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    let ids = redis::ids_after(url, key, last, left).await?;
                    seen.extend(ids);
                }
                Watch::Kafka(consumer) => {
                    let record = tokio::time::timeout_at(deadline, consumer.recv())
                        .await
                        .map_err(|_| late())??;
                    if let Some(id) = kafka::message_id(&record) {
                        seen.insert(id);
                    }
                }
            }
        }
        Ok(())
    }
}
