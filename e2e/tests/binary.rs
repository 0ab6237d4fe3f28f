//! Binary payloads end to end (issue 30): a Protobuf message encoded by `prost` is enqueued in
//! the service's transaction on Postgres (sqlx), MariaDB (sqlx) and SQLite (rusqlite), beside a
//! JSON message and a Confluent schema-registry framed copy, with a rolled-back transaction in
//! between; the relay publishes into Kafka (Tansu), NATS JetStream and Redis Streams, and each
//! broker's own client reads back exactly the bytes, the content type and the partition key,
//! which `prost` decodes to the message that was enqueued. Nothing of the rolled-back
//! transaction arrives, and the JSON message arrives as JSON text with no content type.

use std::sync::Arc;

use outbox::relay::{Relay, RelayConfig};
use outbox::{Binary, NewMessage, OutboxStore, Publisher};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{kafka, nats, redis, unique_suffix, BoxError, Received};
use prost::Message as _;

type TestResult = Result<(), BoxError>;

/// The service's event, as its `.proto` would generate it.
#[derive(Clone, PartialEq, prost::Message)]
struct OrderPlaced {
    #[prost(string, tag = "1")]
    order_id: String,
    #[prost(uint64, tag = "2")]
    total_cents: u64,
    #[prost(bytes = "vec", tag = "3")]
    blob: Vec<u8>,
    #[prost(string, repeated, tag = "4")]
    skus: Vec<String>,
}

const PROTOBUF: &str = "application/x-protobuf";
const CONFLUENT: &str = "application/vnd.confluent.protobuf";
/// The schema-registry id of the framed copies.
const SCHEMA_ID: u32 = 42;

fn order(n: u64) -> OrderPlaced {
    OrderPlaced {
        order_id: format!("order-{n}"),
        total_cents: 1000 + n,
        // NUL, 0xff and bytes that are no UTF-8: a publisher that treats them as text breaks them.
        blob: vec![0x00, 0xff, 0xfe, 0xc3, 0x28, n as u8],
        skus: vec!["sku-1".into(), "grüße".into()],
    }
}

/// Confluent's wire format for Protobuf: magic byte 0, the schema id (big-endian), the message
/// index list (`0`: the first message type of the schema), then the message.
fn confluent_framed(order: &OrderPlaced) -> Vec<u8> {
    let mut framed = vec![0u8];
    framed.extend(SCHEMA_ID.to_be_bytes());
    framed.push(0);
    framed.extend(order.encode_to_vec());
    framed
}

/// What the service enqueues: per transaction, a Protobuf message, its framed copy and a JSON
/// message, over two keys; and one rolled-back transaction.
fn scenario() -> (Vec<Vec<NewMessage>>, Vec<NewMessage>) {
    let tx = |n: u64| {
        let key = format!("customer-{}", n % 2);
        vec![
            NewMessage::binary(
                "order",
                format!("order-{n}"),
                "order.placed",
                Binary::new(PROTOBUF, order(n).encode_to_vec()),
            )
            .with_partition_key(key.clone()),
            NewMessage::binary(
                "order",
                format!("order-{n}"),
                "order.placed.framed",
                Binary::new(CONFLUENT, confluent_framed(&order(n))),
            )
            .with_partition_key(key.clone()),
            NewMessage::new(
                "order",
                format!("order-{n}"),
                "order.noted",
                serde_json::json!({"n": n}),
            )
            .with_partition_key(key),
        ]
    };
    let mut committed: Vec<Vec<NewMessage>> = (0..4).map(tx).collect();
    // The odd ones: an empty body, and a content type in mixed case with a parameter, both
    // kept as written.
    committed[0].push(
        NewMessage::binary(
            "order",
            "order-0",
            "order.empty",
            Binary::new("Application/X-Custom; Version=1", Vec::new()),
        )
        .with_partition_key("customer-0"),
    );
    (committed, tx(99))
}

/// A store filled with [`scenario`] (the rolled-back transaction after the second committed
/// one), and a clean-up.
struct Source {
    store: Arc<dyn OutboxStore>,
    committed: Vec<NewMessage>,
    rolled_back: Vec<NewMessage>,
    cleanup: Cleanup,
}

enum Cleanup {
    Postgres(sqlx::PgPool, String),
    Mysql(sqlx::MySqlPool, String),
    Sqlite(tempfile::TempDir),
}

impl Source {
    async fn postgres(url: &str) -> Result<Self, BoxError> {
        let pool = sqlx::PgPool::connect(url).await?;
        let schema = format!("bin_{}", unique_suffix());
        let config = outbox::postgres::PostgresConfig::builder()
            .schema(&schema)
            .build()?;
        let store = Arc::new(outbox::postgres::PostgresStore::new(
            pool.clone(),
            config.clone(),
        ));
        store.migrate().await?;
        let (committed, rolled_back) = scenario();
        for (t, batch) in committed.iter().enumerate() {
            let mut tx = pool.begin().await?;
            outbox::postgres::enqueue_batch(&mut *tx, &config, batch).await?;
            tx.commit().await?;
            if t == 1 {
                let mut tx = pool.begin().await?;
                outbox::postgres::enqueue_batch(&mut *tx, &config, &rolled_back).await?;
                tx.rollback().await?;
            }
        }
        Ok(Self {
            store,
            committed: committed.concat(),
            rolled_back,
            cleanup: Cleanup::Postgres(pool, schema),
        })
    }

    async fn mysql(url: &str) -> Result<Self, BoxError> {
        let pool = sqlx::MySqlPool::connect(url).await?;
        let table = format!("bin_{}", unique_suffix());
        let config = outbox::mysql::MysqlConfig::builder()
            .table(table.clone())
            .build()?;
        let store = Arc::new(outbox::mysql::MysqlStore::new(pool.clone(), config.clone()));
        store.migrate().await?;
        let (committed, rolled_back) = scenario();
        for (t, batch) in committed.iter().enumerate() {
            let mut tx = pool.begin().await?;
            outbox::mysql::enqueue_batch(&mut *tx, &config, batch).await?;
            tx.commit().await?;
            if t == 1 {
                let mut tx = pool.begin().await?;
                outbox::mysql::enqueue_batch(&mut *tx, &config, &rolled_back).await?;
                tx.rollback().await?;
            }
        }
        Ok(Self {
            store,
            committed: committed.concat(),
            rolled_back,
            cleanup: Cleanup::Mysql(pool, table),
        })
    }

    async fn sqlite() -> Result<Self, BoxError> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("outbox.sqlite");
        let config = outbox::sqlite::SqliteConfig::default();
        let (committed, rolled_back) = scenario();
        {
            let mut conn = outbox::sqlite::open_connection(&path, &config)?;
            outbox::sqlite::migrate(&conn, &config)?;
            for (t, batch) in committed.iter().enumerate() {
                let tx = conn.transaction()?;
                outbox::sqlite::enqueue_batch(&tx, &config, batch)?;
                tx.commit()?;
                if t == 1 {
                    let tx = conn.transaction()?;
                    outbox::sqlite::enqueue_batch(&tx, &config, &rolled_back)?;
                    tx.rollback()?;
                }
            }
        }
        let store = Arc::new(outbox::sqlite::SqliteStore::open(&path, config).await?);
        Ok(Self {
            store,
            committed: committed.concat(),
            rolled_back,
            cleanup: Cleanup::Sqlite(dir),
        })
    }

    async fn cleanup(self) -> TestResult {
        match self.cleanup {
            Cleanup::Postgres(pool, schema) => {
                sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                    .execute(&pool)
                    .await?;
            }
            Cleanup::Mysql(pool, table) => {
                sqlx::query(&format!("DROP TABLE `{table}`"))
                    .execute(&pool)
                    .await?;
            }
            Cleanup::Sqlite(_dir) => {}
        }
        Ok(())
    }
}

/// A broker destination of one test: publisher URL, reader, clean-up.
enum Broker {
    Nats { url: String, stream: String },
    Kafka { brokers: String, topic: String },
    Redis { url: String, stream: String },
}

impl Broker {
    fn named(name: &str) -> Option<Self> {
        let suffix = unique_suffix();
        Some(match name {
            "nats" => Broker::Nats {
                url: service_url("OUTBOX_TEST_NATS_URL")?,
                stream: format!("BIN_{suffix}"),
            },
            "kafka" => Broker::Kafka {
                brokers: service_url("OUTBOX_TEST_KAFKA_BROKERS")?,
                topic: format!("bin-{suffix}"),
            },
            _ => Broker::Redis {
                url: service_url("OUTBOX_TEST_REDIS_URL")?,
                stream: format!("bin-{suffix}"),
            },
        })
    }

    async fn publisher(&self) -> Result<Arc<dyn Publisher>, BoxError> {
        let url = match self {
            Broker::Nats { url, stream } => format!(
                "{url}?subject={}.{{event_type}}&stream={stream}&create_stream=true",
                stream.to_lowercase()
            ),
            Broker::Kafka { brokers, topic } => {
                kafka::create_topic(brokers, topic, 1).await?;
                format!("kafka://{brokers}?topic={topic}")
            }
            Broker::Redis { url, stream } => format!("{url}?stream={stream}"),
        };
        Ok(Arc::new(outbox::broker::connect(&url).await?))
    }

    async fn read_and_remove(&self) -> Result<Vec<Received>, BoxError> {
        Ok(match self {
            Broker::Nats { url, stream } => {
                let read = nats::read_stream(url, stream).await?;
                nats::delete_stream(url, stream).await?;
                read
            }
            Broker::Kafka { brokers, topic } => {
                let read = kafka::read_topic(brokers, topic, 1).await?;
                kafka::delete_topic(brokers, topic).await?;
                read
            }
            Broker::Redis { url, stream } => {
                let read = redis::read_stream(url, stream).await?;
                redis::delete(url, stream).await?;
                read
            }
        })
    }
}

/// Relay `source` into `broker`, read the broker back and check every record.
async fn bytes_arrive_untouched(source: Source, broker: Broker) -> TestResult {
    let relay = Relay::new(
        source.store.clone(),
        broker.publisher().await?,
        RelayConfig::default(),
    )?;
    let stats = relay.run_until_idle().await?;
    assert_eq!(stats.published as usize, source.committed.len());
    assert_eq!(stats.dead, 0);
    let received = broker.read_and_remove().await?;

    for m in &source.rolled_back {
        assert!(
            !received.iter().any(|r| r.id == m.id.to_string()),
            "rolled-back message {} was published",
            m.id
        );
    }
    assert_eq!(received.len(), source.committed.len(), "{received:?}");
    for m in &source.committed {
        let r = received
            .iter()
            .find(|r| r.id == m.id.to_string())
            .ok_or(format!("message {} never arrived", m.id))?;
        assert_eq!(r.key, m.partition_key, "key of {}", m.id);
        match &m.binary {
            Some(binary) => {
                assert_eq!(r.payload, binary.data, "bytes of {}", m.id);
                assert_eq!(
                    r.content_type.as_deref(),
                    Some(binary.content_type.as_str())
                );
                let n: u64 = m.aggregate_id.trim_start_matches("order-").parse()?;
                let body = match binary.content_type.as_str() {
                    CONFLUENT => {
                        assert_eq!(r.payload[0], 0, "magic byte");
                        assert_eq!(r.payload[1..5], SCHEMA_ID.to_be_bytes(), "schema id");
                        Some(&r.payload[6..])
                    }
                    PROTOBUF => Some(&r.payload[..]),
                    _ => None,
                };
                if let Some(body) = body {
                    assert_eq!(OrderPlaced::decode(body)?, order(n), "decoded {}", m.id);
                }
            }
            None => {
                let json: serde_json::Value = serde_json::from_slice(&r.payload)?;
                assert_eq!(json, m.payload);
                assert_eq!(r.content_type, None, "a JSON message gained a content type");
            }
        }
    }
    // Per key, in the order the service committed them.
    for key in ["customer-0", "customer-1"] {
        let sent: Vec<String> = source
            .committed
            .iter()
            .filter(|m| m.partition_key.as_deref() == Some(key))
            .map(|m| m.id.to_string())
            .collect();
        let got: Vec<String> = received
            .iter()
            .filter(|r| r.key.as_deref() == Some(key))
            .map(|r| r.id.clone())
            .collect();
        assert_eq!(got, sent, "order of {key}");
    }
    source.cleanup().await
}

macro_rules! matrix {
    ($($name:ident: $store:ident $(($var:literal))? => $broker:literal,)*) => {$(
        #[tokio::test]
        async fn $name() -> TestResult {
            $(let Some(url) = service_url($var) else { return Ok(()) };)?
            let Some(broker) = Broker::named($broker) else { return Ok(()) };
            let source = Source::$store($(matrix!(@url url $var))?).await?;
            bytes_arrive_untouched(source, broker).await
        }
    )*};
    (@url $url:ident $var:literal) => { &$url };
}

matrix! {
    postgres_to_kafka: postgres("OUTBOX_TEST_POSTGRES_URL") => "kafka",
    postgres_to_nats: postgres("OUTBOX_TEST_POSTGRES_URL") => "nats",
    postgres_to_redis: postgres("OUTBOX_TEST_POSTGRES_URL") => "redis",
    mysql_to_kafka: mysql("OUTBOX_TEST_MYSQL_URL") => "kafka",
    mysql_to_nats: mysql("OUTBOX_TEST_MYSQL_URL") => "nats",
    mysql_to_redis: mysql("OUTBOX_TEST_MYSQL_URL") => "redis",
    sqlite_to_kafka: sqlite => "kafka",
    sqlite_to_nats: sqlite => "nats",
    sqlite_to_redis: sqlite => "redis",
}
