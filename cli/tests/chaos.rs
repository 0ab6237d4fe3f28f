//! Chaos: two `outbox-relay run` processes relay a Postgres outbox, or a SQLite file, into NATS
//! (or Postgres into Redis) while a producer commits and rolls back transactions, and relays
//! are SIGKILLed at random points of the stream and replaced.
//!
//! Each round commits a few transactions (and rolls one back), waits until a random number of
//! new messages has reached the broker, then kills a random relay with SIGKILL, expires every
//! lease in SQL (the killed relay's, and the survivor's too, which makes the survivor a zombie
//! the store must fence) and starts a replacement. Kills therefore land anywhere: in a claim, a
//! publish, a complete, between them. At the end the survivors are stopped with SIGTERM and the
//! stream is read back with its own client: every committed message is there with its exact
//! payload, no rolled-back message is, each key's first copies are in commit order, and the
//! copies beyond the first (none on NATS, whose dedup window drops them; some on Redis) stay
//! within what the kills put in flight; the store has nothing left pending.
//!
//! Nothing sleeps: kills are triggered by deliveries seen on a subscription, and leases are
//! expired by moving their stored end back (on Postgres after ending the dead relay's sessions,
//! so that a statement it had already sent cannot take a lease afterwards; a SQLite writer's
//! locks end with its process). The seed is printed; `OUTBOX_CHAOS_SEED=N` replays
//! a run's choices (the exact kill points also depend on timing).

use std::collections::{HashMap, HashSet};
use std::process::Stdio;

use futures::StreamExt;
use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{NewMessage, OutboxAdmin};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{check_delivery, nats, redis, unique_suffix, Expected, Received};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod common;
use common::{message, relay_process, sigterm, BoxError, BIN, GUARD};

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
    /// Its name (on Postgres, its sessions' application name).
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
        Ok(Db::Sqlite {
            path,
            store,
            _dir: dir,
        })
    }

    /// `--store ...` for a relay named `name`.
    fn store_args(&self, name: &str) -> Vec<String> {
        match self {
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
        }
    }

    /// Enqueue `batch` in one transaction, then commit it or roll it back.
    async fn write(&self, batch: &[NewMessage], commit: bool) -> Result<(), BoxError> {
        match self {
            Db::Postgres { store, .. } => {
                let mut tx = store.pool().begin().await?;
                outbox::postgres::enqueue_batch(&mut *tx, store.config(), batch).await?;
                if commit {
                    tx.commit().await?;
                } else {
                    tx.rollback().await?;
                }
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
                sqlx::query(&format!(
                    "UPDATE \"{schema}\".outbox SET lease_until = now() - interval '1 second' \
                     WHERE lease_until IS NOT NULL AND state = 'pending'"
                ))
                .execute(store.pool())
                .await?;
            }
            Db::Sqlite { path, .. } => {
                let conn = outbox::sqlite::open_connection(path, &SqliteConfig::default())?;
                conn.execute(
                    "UPDATE outbox SET lease_until = lease_until - 3600000 \
                     WHERE state = 'leased'",
                    [],
                )?;
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
        })
    }

    fn name(&self) -> &'static str {
        match self {
            Db::Postgres { .. } => "postgres",
            Db::Sqlite { .. } => "sqlite",
        }
    }

    fn admin(&self) -> &dyn OutboxAdmin {
        match self {
            Db::Postgres { store, .. } => store,
            Db::Sqlite { store, .. } => store,
        }
    }

    async fn drop_schema(&self) -> Result<(), BoxError> {
        if let Db::Postgres { store, schema, .. } = self {
            sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .execute(store.pool())
                .await?;
        }
        Ok(())
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
    let mut spawn = || {
        started += 1;
        let name = format!("chaos-{suffix}-{started}");
        spawn_relay(&db.store_args(&name), &broker_url, &name)
    };
    let mut relays: Vec<Relay> = Vec::new();
    for _ in 0..RELAYS {
        relays.push(spawn()?);
    }

    let mut committed: Vec<NewMessage> = Vec::new();
    let mut rolled_back: HashSet<String> = HashSet::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut n = 0;
    let mut kills = 0;
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
        watch.wait_for(&mut seen, target).await?;
        let victim = rng.random_range(0..relays.len());
        relays[victim].child.start_kill()?;
        relays[victim].child.wait().await?;
        kills += 1;
        // The dead relay's sessions end, as a crashed host's do once the server notices: a
        // statement it had already sent (a claim's COMMIT, say) finishes or is aborted first.
        // Then the killed relay's leases (and the survivor's) end now.
        db.after_kill(&relays[victim].name).await?;
        relays[victim] = spawn()?;
    }
    watch.wait_for(&mut seen, committed.len()).await?;

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
        .args(db.store_args("chaos-drain"))
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
    db.drop_schema().await
}

/// The broker under test.
enum Broker {
    /// NATS JetStream: deliveries are seen on a core subscription to the stream's subjects
    /// (its dedup window drops republished copies).
    Nats { url: String },
    /// Redis Streams: deliveries are seen with a blocking `XREAD` (no dedup: republished copies
    /// stay in the stream).
    Redis { url: String },
}

/// Deliveries as they reach the broker.
enum Watch {
    Nats(async_nats::Subscriber),
    Redis {
        url: String,
        key: String,
        last: String,
    },
}

impl Broker {
    fn name(&self) -> &'static str {
        match self {
            Broker::Nats { .. } => "nats",
            Broker::Redis { .. } => "redis",
        }
    }

    fn relay_url(&self, suffix: &str) -> String {
        match self {
            Broker::Nats { url } => format!(
                "{url}?subject=chaos{suffix}.{{event_type}}&stream=CHAOS_{suffix}\
                 &create_stream=true&stream_subjects=chaos{suffix}.>"
            ),
            Broker::Redis { url } => format!("{url}?stream=chaos{suffix}"),
        }
    }

    async fn watch(&self, suffix: &str) -> Result<Watch, BoxError> {
        Ok(match self {
            Broker::Nats { url } => {
                let client = async_nats::connect(url).await?;
                Watch::Nats(client.subscribe(format!("chaos{suffix}.>")).await?)
            }
            Broker::Redis { url } => Watch::Redis {
                url: url.clone(),
                key: format!("chaos{suffix}"),
                last: "0".into(),
            },
        })
    }

    async fn read_back(&self, suffix: &str) -> Result<Vec<Received>, BoxError> {
        match self {
            Broker::Nats { url } => nats::read_stream(url, &format!("CHAOS_{suffix}")).await,
            Broker::Redis { url } => redis::read_stream(url, &format!("chaos{suffix}")).await,
        }
    }

    async fn delete(&self, suffix: &str) -> Result<(), BoxError> {
        match self {
            Broker::Nats { url } => nats::delete_stream(url, &format!("CHAOS_{suffix}")).await,
            Broker::Redis { url } => redis::delete(url, &format!("chaos{suffix}")).await,
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
            }
        }
        Ok(())
    }
}
