//! Postgres and SQLite through the real relay engine into real NATS, Kafka (Tansu) and Redis,
//! checked by reading each broker back with its own client.
//!
//! Every test has its own Postgres schema or SQLite file and its own subject/stream/topic, and
//! deletes its broker stream or topic afterwards. Nothing sleeps: the crash is triggered by an
//! event (a publish that reached the broker), leases are expired by shifting their stored times
//! back, and time limits are only failure guards.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::relay::{Relay, RelayConfig};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{async_trait, Counts, Message, NewMessage, OutboxAdmin, OutboxStore};
use outbox::{PublishOutcome, Publisher};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{check_delivery, kafka, nats, redis, unique_suffix, Delivery, Expected, Received};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::watch;

/// Partition keys of the scenario.
const KEYS: usize = 8;
/// Committed transactions, each enqueuing [`PER_TX`] messages.
const TXS: usize = 30;
const PER_TX: usize = 12;
/// Messages per claim: several batches per run, so batches overlap (concurrency 2).
const BATCH: usize = 40;
/// Failure guard for waiting on an event; a passing test never gets near it.
const GUARD: Duration = Duration::from_secs(120);

fn relay_config() -> RelayConfig {
    RelayConfig::builder().batch_size(BATCH).build().unwrap()
}

/// The `n`th message of the scenario: keys interleave, payloads have escapes and non-ASCII text
/// so that a publisher that re-encodes them would be caught.
fn message(n: usize, tag: &str) -> NewMessage {
    let key = format!("customer-{}", n % KEYS);
    NewMessage::new(
        "order",
        format!("order-{n}"),
        "order.placed",
        serde_json::json!({
            "n": n,
            "tag": tag,
            "customer": key,
            "note": "grüße ✓ \"quoted\" \\ back\tslash",
            "lines": [{"sku": format!("sku-{}", n % 7), "qty": n % 3 + 1}],
        }),
    )
    .with_partition_key(key)
    .with_header("tenant", "acme")
}

/// The scenario's transactions: [`TXS`] committed ones and one rolled back in the middle.
/// Returns (committed messages in commit order, rolled-back messages).
fn scenario() -> (Vec<Vec<NewMessage>>, Vec<NewMessage>) {
    let committed = (0..TXS)
        .map(|t| {
            (0..PER_TX)
                .map(|i| message(t * PER_TX + i, "committed"))
                .collect()
        })
        .collect();
    let rolled_back = (0..PER_TX)
        .map(|i| message(TXS * PER_TX + i, "rolled-back"))
        .collect();
    (committed, rolled_back)
}

/// A store filled with the scenario, and what the consumer must see.
struct Source {
    store: Arc<dyn OutboxStore>,
    admin: Arc<dyn OutboxAdmin>,
    db: Db,
    expected: Vec<Expected>,
    rolled_back: Vec<String>,
}

enum Db {
    Postgres {
        pool: PgPool,
        schema: String,
        table: String,
    },
    Sqlite {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
    },
}

impl Source {
    async fn postgres(url: &str) -> Source {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(url)
            .await
            .unwrap();
        let schema = format!("e2e_{}", unique_suffix());
        let config = PostgresConfig::builder()
            .schema(&schema)
            .notify(false)
            .build()
            .unwrap();
        let store = Arc::new(PostgresStore::new(pool.clone(), config.clone()));
        store.migrate().await.unwrap();
        let (committed, rolled_back) = scenario();
        for (t, batch) in committed.iter().enumerate() {
            let mut tx = pool.begin().await.unwrap();
            outbox::postgres::enqueue_batch(&mut *tx, &config, batch)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            if t == TXS / 2 {
                let mut tx = pool.begin().await.unwrap();
                outbox::postgres::enqueue_batch(&mut *tx, &config, &rolled_back)
                    .await
                    .unwrap();
                tx.rollback().await.unwrap();
            }
        }
        // The payload bytes the relay must publish are the store's own text (jsonb normalizes
        // spacing), checked below to mean the same JSON as what was enqueued.
        let rows: Vec<(String, String)> = sqlx::query_as(&format!(
            "SELECT id::text, payload::text FROM {} ORDER BY seq",
            config.qualified_table()
        ))
        .fetch_all(&pool)
        .await
        .unwrap();
        let table = config.qualified_table().to_owned();
        Source {
            expected: expected(&committed, rows),
            rolled_back: rolled_back.iter().map(|m| m.id.to_string()).collect(),
            store: store.clone(),
            admin: store,
            db: Db::Postgres {
                pool,
                schema,
                table,
            },
        }
    }

    async fn sqlite() -> Source {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outbox.sqlite");
        let config = SqliteConfig::default();
        let (committed, rolled_back) = scenario();
        let rows = {
            let mut conn = outbox::sqlite::open_connection(&path, &config).unwrap();
            outbox::sqlite::migrate(&conn, &config).unwrap();
            for (t, batch) in committed.iter().enumerate() {
                let tx = conn.transaction().unwrap();
                outbox::sqlite::enqueue_batch(&tx, &config, batch).unwrap();
                tx.commit().unwrap();
                if t == TXS / 2 {
                    let tx = conn.transaction().unwrap();
                    outbox::sqlite::enqueue_batch(&tx, &config, &rolled_back).unwrap();
                    tx.rollback().unwrap();
                }
            }
            let mut stmt = conn
                .prepare(&format!(
                    "SELECT id, payload FROM {} ORDER BY seq",
                    config.table()
                ))
                .unwrap();
            let rows: Vec<(String, String)> = stmt
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            rows
        };
        let store = SqliteStore::open(&path, config).await.unwrap();
        store.migrate().await.unwrap();
        let store = Arc::new(store);
        Source {
            expected: expected(&committed, rows),
            rolled_back: rolled_back.iter().map(|m| m.id.to_string()).collect(),
            store: store.clone(),
            admin: store,
            db: Db::Sqlite { _dir: dir, path },
        }
    }

    /// Make every current lease look expired by moving its stored expiry an hour back: what a
    /// crashed relay's leases look like once their time has passed, without waiting for it.
    /// Returns how many leased rows were shifted.
    async fn expire_leases(&self) -> u64 {
        match &self.db {
            Db::Postgres { pool, table, .. } => sqlx::query(&format!(
                "UPDATE {table} SET lease_until = lease_until - interval '1 hour' \
                 WHERE lease_token IS NOT NULL"
            ))
            .execute(pool)
            .await
            .unwrap()
            .rows_affected(),
            Db::Sqlite { path, .. } => {
                let conn = outbox::sqlite::open_connection(path, &SqliteConfig::default()).unwrap();
                conn.execute(
                    "UPDATE outbox SET lease_until = lease_until - 3600000 WHERE state = 'leased'",
                    [],
                )
                .unwrap() as u64
            }
        }
    }

    async fn counts(&self) -> Counts {
        self.admin.counts().await.unwrap()
    }

    async fn cleanup(self) {
        if let Db::Postgres { pool, schema, .. } = &self.db {
            sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
                .execute(pool)
                .await
                .unwrap();
        }
    }
}

/// The committed messages in commit order, with the payload text the store holds for each; the
/// stored text must be the same JSON as the enqueued payload.
fn expected(committed: &[Vec<NewMessage>], rows: Vec<(String, String)>) -> Vec<Expected> {
    let stored: std::collections::HashMap<String, String> = rows.into_iter().collect();
    let expected: Vec<Expected> = committed
        .iter()
        .flatten()
        .map(|m| {
            let text = stored
                .get(&m.id.to_string())
                .unwrap_or_else(|| panic!("committed message {} is not in the table", m.id));
            let parsed: serde_json::Value = serde_json::from_str(text).unwrap();
            assert_eq!(parsed, m.payload, "the store changed the payload's meaning");
            Expected {
                id: m.id.to_string(),
                key: m.partition_key.clone(),
                payload: text.clone().into_bytes(),
            }
        })
        .collect();
    assert_eq!(
        stored.len(),
        expected.len(),
        "the table holds rows of the rolled-back transaction"
    );
    expected
}

/// A broker destination of one test, with a reader and a clean-up.
enum Broker {
    Nats { url: String, stream: String },
    Kafka { brokers: String, topic: String },
    Redis { url: String, stream: String },
}

const KAFKA_PARTITIONS: i32 = 3;

impl Broker {
    fn nats() -> Option<Broker> {
        let url = service_url("OUTBOX_TEST_NATS_URL")?;
        Some(Broker::Nats {
            url,
            stream: format!("E2E_{}", unique_suffix()),
        })
    }

    fn kafka() -> Option<Broker> {
        let brokers = service_url("OUTBOX_TEST_KAFKA_BROKERS")?;
        Some(Broker::Kafka {
            brokers,
            topic: format!("e2e-{}", unique_suffix()),
        })
    }

    fn redis() -> Option<Broker> {
        let url = service_url("OUTBOX_TEST_REDIS_URL")?;
        Some(Broker::Redis {
            url,
            stream: format!("e2e-{}", unique_suffix()),
        })
    }

    /// Whether the broker itself drops a re-publish of a message it already stored.
    fn dedups(&self) -> bool {
        matches!(self, Broker::Nats { .. })
    }

    /// Create the destination (the NATS stream is created by the publisher) and connect the
    /// publisher the facade picks for the URL.
    async fn publisher(&self) -> Arc<dyn Publisher> {
        let url = match self {
            Broker::Nats { url, stream } => format!(
                "{url}?subject={}.{{aggregate_type}}.{{event_type}}&stream={stream}&create_stream=true",
                stream.to_lowercase()
            ),
            Broker::Kafka { brokers, topic } => {
                kafka::create_topic(brokers, topic, KAFKA_PARTITIONS)
                    .await
                    .unwrap();
                format!("kafka://{brokers}?topic={topic}")
            }
            Broker::Redis { url, stream } => format!("{url}?stream={stream}"),
        };
        Arc::new(outbox::broker::connect(&url).await.unwrap())
    }

    async fn read(&self) -> Vec<Received> {
        match self {
            Broker::Nats { url, stream } => nats::read_stream(url, stream).await,
            Broker::Kafka { brokers, topic } => {
                kafka::read_topic(brokers, topic, KAFKA_PARTITIONS).await
            }
            Broker::Redis { url, stream } => redis::read_stream(url, stream).await,
        }
        .unwrap()
    }

    async fn cleanup(&self) {
        match self {
            Broker::Nats { url, stream } => nats::delete_stream(url, stream).await,
            Broker::Kafka { brokers, topic } => kafka::delete_topic(brokers, topic).await,
            Broker::Redis { url, stream } => redis::delete(url, stream).await,
        }
        .unwrap()
    }
}

/// Read the broker back, delete the destination, and check the delivery against the source.
async fn delivered(source: &Source, broker: &Broker) -> Delivery {
    let received = broker.read().await;
    broker.cleanup().await;
    for id in &source.rolled_back {
        assert!(
            !received.iter().any(|r| &r.id == id),
            "rolled-back message {id} was published"
        );
    }
    let delivery = check_delivery(&received, &source.expected).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(delivery.distinct, TXS * PER_TX);
    delivery
}

/// The happy path: one relay drains the store into the broker; the consumer sees exactly the
/// committed messages, once each, byte-equal, in per-key order.
async fn relay_everything(source: Source, broker: Broker) {
    let publisher = broker.publisher().await;
    let relay = Relay::new(source.store.clone(), publisher, relay_config()).unwrap();
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!(stats.published as usize, TXS * PER_TX);
    assert_eq!(stats.dead, 0);
    let counts = source.counts().await;
    assert_eq!(counts.published as usize, TXS * PER_TX);
    assert_eq!((counts.pending, counts.leased, counts.dead), (0, 0, 0));

    let delivery = delivered(&source, &broker).await;
    assert_eq!(delivery.duplicates, 0, "no crash, so no redelivery");
    source.cleanup().await;
}

/// Forwards to the real publisher; from the `crash_at`th publish call on, it lets the batch
/// reach the broker, reports that, and then never returns: the relay is stuck after the broker
/// stored the batch and before the store heard about it, which is where a crash hurts most.
struct CrashAfterPublish {
    inner: Arc<dyn Publisher>,
    calls: AtomicUsize,
    crash_at: usize,
    reached: watch::Sender<bool>,
}

#[async_trait]
impl Publisher for CrashAfterPublish {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        let outcomes = self.inner.publish(batch).await;
        if self.calls.fetch_add(1, Ordering::SeqCst) + 1 >= self.crash_at {
            self.reached.send_replace(true);
            std::future::pending::<()>().await;
        }
        outcomes
    }

    fn name(&self) -> &str {
        self.inner.name()
    }
}

/// A relay is aborted after some batches were published and completed and one more reached the
/// broker without being completed; its leases are expired in SQL and a new relay drains the
/// rest. Nothing is lost, and after deduplication by id the consumer has exactly the committed
/// messages in per-key order; every duplicate is a byte-equal copy with the same id.
async fn crash_and_recover(source: Source, broker: Broker) {
    let publisher = broker.publisher().await;
    let (reached, mut crashed) = watch::channel(false);
    let crashing = Arc::new(CrashAfterPublish {
        inner: publisher.clone(),
        calls: AtomicUsize::new(0),
        crash_at: 4,
        reached,
    });
    let relay = Relay::new(source.store.clone(), crashing, relay_config()).unwrap();
    let task = tokio::spawn(async move { relay.run_until_idle().await });
    tokio::time::timeout(GUARD, crashed.wait_for(|r| *r))
        .await
        .expect("the relay never reached its fourth publish")
        .unwrap();
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());

    let counts = source.counts().await;
    let total = (TXS * PER_TX) as u64;
    assert!(
        counts.published > 0 && counts.published < total,
        "the crash must fall mid-run: {counts:?}"
    );
    let shifted = source.expire_leases().await;
    assert!(shifted > 0, "the stuck batch must still be leased");

    // A claim the aborted relay had already sent still commits on the server, possibly after
    // the leases were expired above; its leases then hold their keys back like those of any
    // crashed relay, until they too are expired. So recover in rounds (a few at most).
    let mut counts = source.counts().await;
    for round in 0..3 {
        if round > 0 {
            source.expire_leases().await;
        }
        let relay = Relay::new(source.store.clone(), publisher.clone(), relay_config()).unwrap();
        let stats = relay.run_until_idle().await.unwrap();
        assert_eq!(stats.dead, 0);
        counts = source.counts().await;
        if counts.published == total {
            break;
        }
    }
    assert_eq!(counts.published, total, "{counts:?}");
    assert_eq!((counts.pending, counts.leased, counts.dead), (0, 0, 0));

    let dedups = broker.dedups();
    let delivery = delivered(&source, &broker).await;
    if dedups {
        // The re-published batch carries the same Nats-Msg-Id: JetStream stores it once.
        assert_eq!(delivery.duplicates, 0);
    } else {
        // The batch the broker stored before the crash was published again.
        assert!(delivery.duplicates > 0, "{delivery:?}");
    }
    source.cleanup().await;
}

macro_rules! e2e_tests {
    ($($name:ident: $source:ident -> $broker:ident, $scenario:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(broker) = Broker::$broker() else { return };
            let source = e2e_tests!(@source $source);
            $scenario(source, broker).await;
        }
    )*};
    (@source postgres) => {{
        let Some(url) = service_url("OUTBOX_TEST_POSTGRES_URL") else { return };
        Source::postgres(&url).await
    }};
    (@source sqlite) => { Source::sqlite().await };
}

e2e_tests! {
    postgres_to_nats: postgres -> nats, relay_everything;
    postgres_to_kafka: postgres -> kafka, relay_everything;
    postgres_to_redis: postgres -> redis, relay_everything;
    sqlite_to_nats: sqlite -> nats, relay_everything;
    sqlite_to_kafka: sqlite -> kafka, relay_everything;
    sqlite_to_redis: sqlite -> redis, relay_everything;
    postgres_crash_into_nats: postgres -> nats, crash_and_recover;
    postgres_crash_into_kafka: postgres -> kafka, crash_and_recover;
    postgres_crash_into_redis: postgres -> redis, crash_and_recover;
    sqlite_crash_into_nats: sqlite -> nats, crash_and_recover;
    sqlite_crash_into_kafka: sqlite -> kafka, crash_and_recover;
    sqlite_crash_into_redis: sqlite -> redis, crash_and_recover;
}
