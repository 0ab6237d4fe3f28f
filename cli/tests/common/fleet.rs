//! A fleet of `outbox-relay run` processes over a real store and broker, as the chaos and
//! frozen-relay tests drive them: starting relays, writing to the outbox, watching deliveries
//! reach the broker and reading the stream back.

// Each test binary compiles this module; not every one uses every helper.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Mutex;

use futures::{FutureExt, StreamExt};
use outbox::mysql::{MysqlConfig, MysqlStore};
use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{NewMessage, OutboxAdmin};
use outbox_e2e::{kafka, nats, redis, unique_suffix, Received};
use rdkafka::consumer::StreamConsumer;
use sqlx::mysql::MySqlConnectOptions;
use sqlx::ConnectOptions;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::many::Outbox;
use super::{end_mysql_sessions, nats_subscription, relay_process, BoxError, GUARD};

/// A running relay process.
pub struct Relay {
    pub child: Child,
    /// Its name (on Postgres, its sessions' application name; on MariaDB, its account).
    pub name: String,
    /// Fires when the relay has logged that it started (its stop signal handler is in place).
    pub started: Option<oneshot::Receiver<()>>,
    /// Its standard error, read as it comes (a pipe nobody reads could fill and block it).
    pub stderr: JoinHandle<String>,
}

/// Start `outbox-relay run` on `store_args` (`--store ...` and its options) into `broker`, with
/// the further options `run_args` (batch size, lease...).
pub fn spawn_relay(
    store_args: &[String],
    broker: &str,
    name: &str,
    run_args: &[&str],
) -> Result<Relay, BoxError> {
    let mut child = relay_process(
        store_args
            .iter()
            .map(String::as_str)
            .chain(["run", "--broker", broker])
            .chain(run_args.iter().copied()),
    )?;
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
pub enum Db {
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
    pub async fn postgres(url: String, suffix: &str) -> Result<Self, BoxError> {
        let schema = format!("chaos_{suffix}");
        let config = PostgresConfig::builder().schema(schema.clone()).build()?;
        let store = PostgresStore::connect(&url, config).await?;
        store.migrate().await?;
        Ok(Db::Postgres { url, store, schema })
    }

    pub async fn sqlite() -> Result<Self, BoxError> {
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

    pub async fn mysql(url: String, suffix: &str) -> Result<Self, BoxError> {
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
    pub async fn store_args(&self, name: &str) -> Result<Vec<String>, BoxError> {
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
                // And its unpublished table (the default layout of a table keeping published
                // rows), whose entries a relay reads, moves and deletes.
                sqlx::query(&format!(
                    "GRANT SELECT, UPDATE, DELETE ON `{table}_unpublished` TO '{name}'@'%'"
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
    pub async fn write(&self, batch: &[NewMessage], commit: bool) -> Result<(), BoxError> {
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
    pub async fn after_kill(&self, name: &str) -> Result<(), BoxError> {
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
                    "SELECT seq FROM `{table}` WHERE state = 'pending' \
                     AND COALESCE(lease_token, '') <> ''"
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
                         WHERE seq = ? AND state = 'pending' AND COALESCE(lease_token, '') <> ''"
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
    pub async fn payloads(&self) -> Result<HashMap<String, String>, BoxError> {
        Ok(match self {
            Db::Postgres { store, schema, .. } => {
                Outbox::postgres(store.pool(), schema).payloads().await?
            }
            Db::Sqlite { path, .. } => Outbox::sqlite(path).payloads().await?,
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

    /// The ids of the messages whose lease ends within `secs` seconds by the store's clock
    /// (Postgres and MariaDB; a MariaDB row that is not leased holds the epoch, so its token
    /// tells).
    pub async fn leases_ending_within(&self, secs: u32) -> Result<Vec<String>, BoxError> {
        Ok(match self {
            Db::Postgres { store, schema, .. } => {
                sqlx::query_scalar(&format!(
                    "SELECT id::text FROM \"{schema}\".outbox WHERE state = 'pending' \
                     AND lease_until < now() + $1 * interval '1 second'"
                ))
                .bind(i64::from(secs))
                .fetch_all(store.pool())
                .await?
            }
            Db::Mysql { store, table, .. } => {
                let ids: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
                    "SELECT id FROM `{table}` WHERE state = 'pending' \
                     AND COALESCE(lease_token, '') <> '' \
                     AND lease_until < UTC_TIMESTAMP(6) + INTERVAL ? SECOND"
                ))
                .bind(secs)
                .fetch_all(store.pool())
                .await?;
                ids.into_iter()
                    .map(String::from_utf8)
                    .collect::<Result<_, _>>()?
            }
            Db::Sqlite { .. } => return Err("leases_ending_within: not on SQLite".into()),
        })
    }

    /// The rows of messages `ids` as the store holds them, one line each, and the store's
    /// clock: what a stall report shows.
    pub async fn describe(&self, ids: &[String]) -> Result<String, BoxError> {
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

    pub fn name(&self) -> &'static str {
        match self {
            Db::Postgres { .. } => "postgres",
            Db::Sqlite { .. } => "sqlite",
            Db::Mysql { .. } => "mariadb",
        }
    }

    pub fn admin(&self) -> &dyn OutboxAdmin {
        match self {
            Db::Postgres { store, .. } => store,
            Db::Sqlite { store, .. } => store,
            Db::Mysql { store, .. } => store,
        }
    }

    /// Drop what the test created in the server: the schema, or the table and accounts.
    pub async fn clean_up(&self) -> Result<(), BoxError> {
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
pub async fn finish<DB: sqlx::Database>(
    tx: sqlx::Transaction<'_, DB>,
    commit: bool,
) -> Result<(), sqlx::Error> {
    if commit {
        tx.commit().await
    } else {
        tx.rollback().await
    }
}

/// The broker under test.
pub enum Broker {
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
pub enum Watch {
    Nats(async_nats::Subscriber),
    Redis {
        url: String,
        key: String,
        last: String,
    },
    Kafka(StreamConsumer),
}

impl Broker {
    pub fn name(&self) -> &'static str {
        match self {
            Broker::Nats { .. } => "nats",
            Broker::Redis { .. } => "redis",
            Broker::Kafka { .. } => "kafka",
        }
    }

    pub fn relay_url(&self, suffix: &str) -> String {
        match self {
            Broker::Nats { url } => format!(
                "{url}?subject=chaos{suffix}.{{event_type}}&stream=CHAOS_{suffix}\
                 &create_stream=true&stream_subjects=chaos{suffix}.>"
            ),
            Broker::Redis { url } => format!("{url}?stream=chaos{suffix}"),
            Broker::Kafka { brokers } => format!("kafka://{brokers}?topic=chaos{suffix}"),
        }
    }

    pub async fn watch(&self, suffix: &str) -> Result<Watch, BoxError> {
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

    pub async fn read_back(&self, suffix: &str) -> Result<Vec<Received>, BoxError> {
        match self {
            Broker::Nats { url } => nats::read_stream(url, &format!("CHAOS_{suffix}")).await,
            Broker::Redis { url } => redis::read_stream(url, &format!("chaos{suffix}")).await,
            Broker::Kafka { brokers } => {
                kafka::read_topic(brokers, &format!("chaos{suffix}"), KAFKA_PARTITIONS).await
            }
        }
    }

    pub async fn delete(&self, suffix: &str) -> Result<(), BoxError> {
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
    /// Take the deliveries that have already arrived (NATS only), without waiting for more.
    pub fn take_ready(&mut self, seen: &mut HashSet<String>) -> Result<(), BoxError> {
        let Watch::Nats(sub) = self else {
            return Err("take_ready: NATS only".into());
        };
        while let Some(next) = sub.next().now_or_never() {
            let msg = next.ok_or("subscription ended")?;
            if let Some(id) = msg.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
                seen.insert(id.as_str().to_owned());
            }
        }
        Ok(())
    }

    /// Wait until `target` distinct message ids have reached the broker.
    pub async fn wait_for(
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
