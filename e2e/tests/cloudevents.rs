//! CloudEvents envelopes on the real brokers (`envelope=cloudevents` and
//! `envelope=cloudevents-structured`): Postgres → relay → Kafka (Tansu), NATS and Redis, each
//! message read back with the broker's own client and parsed by the CloudEvents SDK for Python
//! (`e2e/scripts/read_cloudevents.py`, PyPI `cloudevents`, installed by `scripts/build-deps`),
//! every attribute checked against the stored message. Binary payloads (bytes that are not
//! UTF-8, with their content type) are read by the SDK in both modes: the body in binary mode,
//! `data_base64` in structured mode. Then exactly-once effects through `outbox-consumer` and its
//! inbox with a CloudEvents envelope on the wire.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use outbox::chrono::{DateTime, Utc};
use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::relay::{Relay, RelayConfig};
use outbox::{Binary, NewMessage};
use outbox_conformance_tests::env::{service_url, services_required};
use outbox_e2e::unique_suffix;
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;

/// Messages per test.
const N: usize = 12;
/// Failure guard for reading back; a passing test never gets near it.
const GUARD: Duration = Duration::from_secs(60);
const READER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/read_cloudevents.py");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Kafka,
    Nats,
    Redis,
}

impl Broker {
    fn binding(self) -> &'static str {
        match self {
            Broker::Kafka => "kafka",
            Broker::Nats => "nats",
            Broker::Redis => "redis",
        }
    }

    fn var(self) -> &'static str {
        match self {
            Broker::Kafka => "OUTBOX_TEST_KAFKA_BROKERS",
            Broker::Nats => "OUTBOX_TEST_NATS_URL",
            Broker::Redis => "OUTBOX_TEST_REDIS_URL",
        }
    }
}

/// One message as the broker gave it back.
#[derive(Debug)]
struct Raw {
    headers: Vec<(String, String)>,
    key: Option<String>,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A stored message, as the relay read it.
#[derive(Debug)]
struct Stored {
    aggregate_id: String,
    key: Option<String>,
    payload: String,
    created_at: DateTime<Utc>,
}

/// Whether the CloudEvents SDK for Python is there; `false` skips, unless services are required.
fn sdk_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import cloudevents.core.bindings.kafka"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || !services_required(),
        "the CloudEvents SDK for Python is missing: run scripts/build-deps"
    );
    ok
}

/// The `n`th message: an aggregate id with a space and non-ASCII text (percent-encoded in NATS
/// headers), some without a partition key, a trace header, a header that is a valid extension
/// name and one that is not.
fn message(n: usize) -> NewMessage {
    let msg = NewMessage::new(
        "order",
        format!("order {n} ✓"),
        "order.placed",
        json!({"n": n, "note": "grüße \"quoted\" \\ back", "lines": [{"qty": n % 3}]}),
    )
    .with_header("tenant", "acme")
    .with_header(
        "traceparent",
        format!("00-{:032x}-{:016x}-01", n + 1, n + 7),
    )
    .with_header("X-Request-Id", format!("req-{n}"));
    if n % 4 == 3 {
        msg
    } else {
        msg.with_partition_key(format!("customer-{}", n % 3))
    }
}

/// Enqueue [`N`] messages into a fresh schema and relay them to `url`; returns what was stored.
async fn relay(pg: &str, url: &str) -> HashMap<String, Stored> {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(pg)
        .await
        .unwrap();
    let schema = format!("ce_{}", unique_suffix());
    let config = PostgresConfig::builder()
        .schema(&schema)
        .notify(false)
        .build()
        .unwrap();
    let store = Arc::new(PostgresStore::new(pool.clone(), config.clone()));
    store.migrate().await.unwrap();
    let messages: Vec<NewMessage> = (0..N).map(message).collect();
    let mut tx = pool.begin().await.unwrap();
    outbox::postgres::enqueue_batch(&mut *tx, &config, &messages)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    type Row = (String, String, Option<String>, String, DateTime<Utc>);
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "SELECT id::text, aggregateid, partition_key, payload::text, created_at FROM {}",
        config.qualified_table()
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    let publisher = outbox::broker::connect(url).await.unwrap();
    let relay = Relay::new(store, Arc::from(publisher), RelayConfig::default()).unwrap();
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!((stats.published as usize, stats.dead), (N, 0));
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
    rows.into_iter()
        .map(|(id, aggregate_id, key, payload, created_at)| {
            let stored = Stored {
                aggregate_id,
                key,
                payload,
                created_at,
            };
            (id, stored)
        })
        .collect()
}

/// Read every message of the test's destination back with the broker's own client.
async fn read_back(broker: Broker, server: &str, name: &str, count: usize) -> Vec<Raw> {
    match broker {
        Broker::Kafka => {
            let (server, name) = (server.to_owned(), name.to_owned());
            tokio::task::spawn_blocking(move || read_kafka(&server, &name, count))
                .await
                .unwrap()
        }
        Broker::Nats => {
            let js = async_nats::jetstream::new(async_nats::connect(server).await.unwrap());
            let mut stream = js.get_stream(name).await.unwrap();
            let state = stream.info().await.unwrap().state.clone();
            let mut out = Vec::new();
            for seq in state.first_sequence..=state.last_sequence {
                let stored = stream.get_raw_message(seq).await.unwrap();
                let headers = stored
                    .headers
                    .iter()
                    .flat_map(|(n, vs)| {
                        vs.iter()
                            .map(move |v| (n.to_string(), v.as_str().to_owned()))
                    })
                    .collect();
                out.push(Raw {
                    headers,
                    key: None,
                    body: stored.payload.to_vec(),
                });
            }
            js.delete_stream(name).await.unwrap();
            out
        }
        Broker::Redis => {
            let mut con = redis::Client::open(server)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let reply: redis::streams::StreamRangeReply =
                redis::AsyncCommands::xrange_all(&mut con, name)
                    .await
                    .unwrap();
            let _: () = redis::AsyncCommands::del(&mut con, name).await.unwrap();
            reply
                .ids
                .into_iter()
                .map(|entry| {
                    let mut fields: BTreeMap<String, redis::Value> =
                        entry.map.into_iter().collect();
                    let data = fields.remove("data").expect("a data field");
                    let body = redis::from_redis_value::<Vec<u8>>(&data).unwrap();
                    let fields: BTreeMap<String, String> = fields
                        .into_iter()
                        .map(|(k, v)| (k, redis::from_redis_value::<String>(&v).unwrap()))
                        .collect();
                    Raw {
                        headers: fields.into_iter().collect(),
                        key: None,
                        body,
                    }
                })
                .collect()
        }
    }
}

fn read_kafka(brokers: &str, topic: &str, count: usize) -> Vec<Raw> {
    use rdkafka::consumer::BaseConsumer;
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = outbox_e2e::kafka::consumer_from_start(brokers, topic, 1).unwrap();
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < count {
        assert!(
            started.elapsed() < GUARD,
            "read {} of {count} records",
            out.len()
        );
        let Some(record) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let record = record.unwrap();
        let headers = record
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        let value = String::from_utf8(h.value.unwrap_or_default().to_vec());
                        (h.key.to_owned(), value.unwrap())
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(Raw {
            headers,
            key: record.key().map(|k| String::from_utf8(k.to_vec()).unwrap()),
            body: record.payload().unwrap_or_default().to_vec(),
        });
    }
    out
}

/// Parse every message with the CloudEvents SDK for Python; one event (attributes, and `data`
/// or, for bytes, `data_base64`) each.
fn parse_with_sdk(broker: Broker, raws: &[Raw]) -> Vec<Value> {
    let mut child = Command::new("python3")
        .arg(READER)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        for raw in raws {
            let headers: BTreeMap<&str, &str> = raw
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            let line = json!({
                "binding": broker.binding(),
                "headers": headers,
                "key": raw.key,
                "body_base64": BASE64.encode(&raw.body),
            });
            writeln!(stdin, "{line}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the CloudEvents SDK refused a message: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Relay [`N`] messages in `envelope` to `broker`, read them back, parse them with the SDK and
/// check every attribute.
async fn round_trip(broker: Broker, envelope: &str, ce_source: Option<&str>) {
    let (Some(pg), Some(server)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url(broker.var()),
    ) else {
        return;
    };
    if !sdk_available() {
        return;
    }
    let s = unique_suffix();
    let mut options = format!("envelope={envelope}");
    if let Some(source) = ce_source {
        options.push_str(&format!("&ce_source={source}"));
    }
    let (url, name) = match broker {
        Broker::Kafka => {
            let topic = format!("ce-{s}");
            outbox_e2e::kafka::create_topic(&server, &topic, 1)
                .await
                .unwrap();
            (format!("kafka://{server}?topic={topic}&{options}"), topic)
        }
        Broker::Nats => (
            format!("{server}?subject=ce{s}.{{aggregate_type}}&stream=CE_{s}&create_stream=true&{options}"),
            format!("CE_{s}"),
        ),
        Broker::Redis => (
            format!("{server}?stream=ce-{s}&{options}"),
            format!("ce-{s}"),
        ),
    };
    let stored = relay(&pg, &url).await;
    let raws = read_back(broker, &server, &name, N).await;
    if broker == Broker::Kafka {
        outbox_e2e::kafka::delete_topic(&server, &name)
            .await
            .unwrap();
    }
    assert_eq!(raws.len(), N);
    let events = parse_with_sdk(broker, &raws);
    assert_eq!(events.len(), N);
    let structured = envelope == "cloudevents-structured";
    let source_prefix = ce_source.unwrap_or("/outbox/{aggregate_type}");
    let expected_source = source_prefix.replace("{aggregate_type}", "order");

    for (raw, event) in raws.iter().zip(&events) {
        let attributes = &event["attributes"];
        let id = attributes["id"].as_str().expect("an id");
        let stored = stored.get(id).unwrap_or_else(|| panic!("unknown id {id}"));
        let text = |name: &str| attributes[name].as_str().map(str::to_owned);
        assert_eq!(text("specversion").as_deref(), Some("1.0"));
        assert_eq!(text("type").as_deref(), Some("order.placed"));
        assert_eq!(text("source"), Some(expected_source.clone()));
        assert_eq!(text("subject"), Some(stored.aggregate_id.clone()));
        assert_eq!(text("datacontenttype").as_deref(), Some("application/json"));
        let time: DateTime<Utc> = text("time").unwrap().parse().unwrap();
        assert_eq!(time, stored.created_at, "{id}");
        assert_eq!(text("aggregatetype").as_deref(), Some("order"));
        assert_eq!(text("partitionkey"), stored.key, "{id}");
        assert_eq!(text("tenant").as_deref(), Some("acme"));
        assert!(text("traceparent").unwrap().starts_with("00-"));
        // Not an extension name: beside the event, never an attribute.
        assert!(attributes.get("x-request-id").is_none());
        assert!(attributes.get("X-Request-Id").is_none());
        // data is the payload; in binary mode the body is the stored text, byte for byte.
        let payload: Value = serde_json::from_str(&stored.payload).unwrap();
        assert_eq!(event["data"], payload, "{id}");
        if !structured {
            assert_eq!(raw.body, stored.payload.as_bytes());
        }
        // The broker-level ids and keys are unchanged in every mode.
        match broker {
            Broker::Kafka => {
                assert_eq!(raw.key, stored.key);
                assert!(raw.header("x-request-id").is_some());
                assert!(raw.header("traceparent").is_some());
            }
            Broker::Nats => {
                assert_eq!(raw.header("Nats-Msg-Id"), Some(id));
                assert!(raw.header("x-request-id").is_some());
                assert!(raw.header("traceparent").is_some());
            }
            Broker::Redis => {
                let plain: BTreeMap<String, String> =
                    serde_json::from_str(raw.header("headers").unwrap()).unwrap();
                assert!(plain["X-Request-Id"].starts_with("req-"));
            }
        }
        let content_type = raw.header("content-type");
        if structured {
            assert_eq!(content_type, Some("application/cloudevents+json"));
        } else if broker == Broker::Nats {
            assert_eq!(content_type, None);
            assert_eq!(raw.header("ce-datacontenttype"), Some("application/json"));
        } else {
            assert_eq!(content_type, Some("application/json"));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_binary_read_by_the_sdk() {
    round_trip(Broker::Kafka, "cloudevents", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_structured_read_by_the_sdk() {
    round_trip(
        Broker::Kafka,
        "cloudevents-structured",
        Some("/orders-service/{aggregate_type}"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_binary_read_by_the_sdk() {
    round_trip(Broker::Nats, "cloudevents", Some("/orders-service")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_structured_read_by_the_sdk() {
    round_trip(Broker::Nats, "cloudevents-structured", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_binary_read_by_the_sdk() {
    round_trip(Broker::Redis, "cloudevents", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_structured_read_by_the_sdk() {
    round_trip(
        Broker::Redis,
        "cloudevents-structured",
        Some("urn:outbox:{aggregate_type}"),
    )
    .await;
}

/// Binary messages per test of [`binary_round_trip`].
const N_BINARY: usize = 3;

/// The `n`th binary payload: not UTF-8 (a NUL, `0xff`, a lone continuation byte, a truncated
/// sequence), a different length each.
fn binary_bytes(n: usize) -> Vec<u8> {
    let mut bytes = vec![0x00, 0xff, 0x80, 0xc3, 0x28, b'{', 0xe2, 0x82, n as u8];
    bytes.extend(std::iter::repeat_n(0xfe, n * 7));
    bytes
}

/// Relay [`N_BINARY`] binary messages (from the in-memory store, which keeps the bytes) in
/// `envelope` to `broker`, read them back, and check that the CloudEvents SDK gives exactly the
/// bytes as the event's data with their content type as `datacontenttype`; in binary mode the
/// broker's body is the bytes themselves.
async fn binary_round_trip(broker: Broker, envelope: &str) {
    let Some(server) = service_url(broker.var()) else {
        return;
    };
    if !sdk_available() {
        return;
    }
    let s = unique_suffix();
    let (url, name) = match broker {
        Broker::Kafka => {
            let topic = format!("ceb-{s}");
            outbox_e2e::kafka::create_topic(&server, &topic, 1)
                .await
                .unwrap();
            (format!("kafka://{server}?topic={topic}&envelope={envelope}"), topic)
        }
        Broker::Nats => (
            format!("{server}?subject=ceb{s}.{{aggregate_type}}&stream=CEB_{s}&create_stream=true&envelope={envelope}"),
            format!("CEB_{s}"),
        ),
        Broker::Redis => (
            format!("{server}?stream=ceb-{s}&envelope={envelope}"),
            format!("ceb-{s}"),
        ),
    };
    let content_types = [
        "application/x-protobuf",
        "application/vnd.confluent.avro",
        "text/plain; charset=utf-8",
    ];
    // By id: the bytes, their content type and the partition key.
    let mut sent: HashMap<String, (Vec<u8>, &str, Option<String>)> = HashMap::new();
    let mut messages = Vec::new();
    for n in 0..N_BINARY {
        let content_type = content_types[n % content_types.len()];
        let msg = NewMessage::binary(
            "order",
            format!("order-{n}"),
            "order.placed",
            Binary::new(content_type, binary_bytes(n)),
        )
        .with_header("tenant", "acme");
        let msg = if n == 2 { msg.unordered() } else { msg };
        let expected = (binary_bytes(n), content_type, msg.partition_key.clone());
        sent.insert(msg.id.to_string(), expected);
        messages.push(msg);
    }
    let store = Arc::new(outbox::memory::MemoryStore::new());
    store.enqueue(messages).unwrap();
    let publisher = outbox::broker::connect(&url).await.unwrap();
    let relay = Relay::new(store, Arc::from(publisher), RelayConfig::default()).unwrap();
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!((stats.published as usize, stats.dead), (N_BINARY, 0));
    let raws = read_back(broker, &server, &name, N_BINARY).await;
    if broker == Broker::Kafka {
        outbox_e2e::kafka::delete_topic(&server, &name)
            .await
            .unwrap();
    }
    assert_eq!(raws.len(), N_BINARY);
    let events = parse_with_sdk(broker, &raws);
    assert_eq!(events.len(), N_BINARY);
    let structured = envelope == "cloudevents-structured";
    for (raw, event) in raws.iter().zip(&events) {
        let attributes = &event["attributes"];
        let id = attributes["id"].as_str().expect("an id");
        let (bytes, content_type, key) = sent.get(id).unwrap_or_else(|| panic!("unknown id {id}"));
        assert_eq!(
            attributes["datacontenttype"].as_str(),
            Some(*content_type),
            "{id}"
        );
        assert_eq!(attributes["partitionkey"].as_str(), key.as_deref(), "{id}");
        assert_eq!(attributes["tenant"].as_str(), Some("acme"));
        let data = event["data_base64"]
            .as_str()
            .unwrap_or_else(|| panic!("the SDK did not give bytes for {id}: {event}"));
        assert_eq!(BASE64.decode(data).unwrap(), *bytes, "data of {id}");
        if structured {
            assert_eq!(
                raw.header("content-type"),
                Some("application/cloudevents+json")
            );
            // The event format's binary data: data_base64, no data.
            let body: Value = serde_json::from_slice(&raw.body).unwrap();
            assert!(body.get("data").is_none(), "{body}");
            assert_eq!(
                BASE64
                    .decode(body["data_base64"].as_str().unwrap())
                    .unwrap(),
                *bytes
            );
        } else {
            assert_eq!(raw.body, *bytes, "body of {id}: the bytes, untouched");
            match broker {
                Broker::Nats => {
                    assert_eq!(raw.header("content-type"), None);
                    let encoded = raw.header("ce-datacontenttype").unwrap();
                    assert_eq!(
                        encoded
                            .replace("%2F", "/")
                            .replace("%3B", ";")
                            .replace("%20", " "),
                        *content_type
                    );
                }
                Broker::Kafka | Broker::Redis => {
                    assert_eq!(raw.header("content-type"), Some(*content_type));
                }
            }
        }
        if broker == Broker::Kafka {
            assert_eq!(raw.key, *key, "the record key is the partition key");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_binary_payload_in_both_modes_read_by_the_sdk() {
    binary_round_trip(Broker::Kafka, "cloudevents").await;
    binary_round_trip(Broker::Kafka, "cloudevents-structured").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_binary_payload_in_both_modes_read_by_the_sdk() {
    binary_round_trip(Broker::Nats, "cloudevents").await;
    binary_round_trip(Broker::Nats, "cloudevents-structured").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_binary_payload_in_both_modes_read_by_the_sdk() {
    binary_round_trip(Broker::Redis, "cloudevents").await;
    binary_round_trip(Broker::Redis, "cloudevents-structured").await;
}

/// An unknown envelope is refused with a typed error before anything is sent.
#[test]
fn an_unknown_envelope_is_refused() {
    let errors = [
        outbox::kafka::KafkaConfig::from_url("kafka://127.0.0.1:9092?topic=t&envelope=cloudevent")
            .unwrap_err(),
        outbox::nats::NatsConfig::from_url("nats://127.0.0.1:4222?subject=s&envelope=avro")
            .unwrap_err(),
        outbox::redis::RedisConfig::from_url("redis://127.0.0.1:6379?stream=s&envelope=CE")
            .unwrap_err(),
        // ce_source without a CloudEvents envelope says what to add.
        outbox::redis::RedisConfig::from_url("redis://127.0.0.1:6379?stream=s&ce_source=/x")
            .unwrap_err(),
    ];
    for err in &errors[..3] {
        assert!(matches!(err, outbox::Error::InvalidInput(_)), "{err:?}");
        assert!(err.to_string().contains("cloudevents-structured"), "{err}");
    }
    assert!(errors[3].to_string().contains("envelope=cloudevents"));
}

/// Exactly-once effects with a CloudEvents envelope on the wire: the exactly-once example's
/// order service commits orders (and rolls one transaction back) in Postgres, the relay
/// publishes them with `envelope`, `outbox-consumer` decodes them into its `Delivery` and the
/// payment service books each once with its inbox in Postgres. A second consumer group then
/// reads the whole stream again under the same inbox name: every message is a duplicate and
/// nothing is booked again.
async fn exactly_once(broker: Broker, envelope: &str) {
    use outbox_consumer::{handler_fn, CancellationToken, Handled, Handler as _};
    use outbox_example_exactly_once::{run_payments, Names, Order, OrderService, PaymentService};

    let (Some(pg), Some(server)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url(broker.var()),
    ) else {
        return;
    };
    let s = unique_suffix();
    let relay_url = match broker {
        Broker::Kafka => {
            outbox_e2e::kafka::create_topic(&server, &format!("cexo{s}"), 2)
                .await
                .unwrap();
            format!("kafka://{server}?topic=cexo{s}&envelope={envelope}")
        }
        Broker::Redis => format!("{server}?stream=cexo{s}&envelope={envelope}"),
        Broker::Nats => unreachable!("not used"),
    };
    let consumer_url = |group: &str| match broker {
        Broker::Kafka => format!(
            "kafka://{server}?topic=cexo{s}&group={group}{s}\
             &session.timeout.ms=2000&heartbeat.interval.ms=300"
        ),
        _ => format!("{server}?stream=cexo{s}&group={group}&consumer={group}-1"),
    };

    let names = Names::with_suffix(&s).unwrap();
    let orders = OrderService::connect(&pg, names.clone()).await.unwrap();
    orders.migrate().await.unwrap();
    let payments = PaymentService::connect(&pg, names.clone(), "payments")
        .await
        .unwrap();
    payments.migrate().await.unwrap();
    let order = |n: usize| Order {
        id: format!("order-{n}"),
        customer: format!("customer-{}", n % 3),
        seq: n as i64,
        amount_cents: 100 + n as i64,
    };
    let mut committed = Vec::new();
    for t in 0..3 {
        let batch: Vec<Order> = (t * 5..t * 5 + 5).map(order).collect();
        committed.extend(orders.place(&batch, true).await.unwrap());
    }
    let rolled_back = orders.place(&[order(99)], false).await.unwrap();

    let store = outbox::store::open(
        &pg,
        &outbox::store::StoreOptions {
            table: Some(names.outbox.clone()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let publisher = outbox::broker::connect(&relay_url).await.unwrap();
    let relay = Relay::new(store.store, Arc::from(publisher), RelayConfig::default()).unwrap();
    let stats = relay.run_until_idle().await.unwrap();
    assert_eq!(stats.published as usize, committed.len());

    // Consume with `group` until its handler has seen `want` messages handled as `kind`.
    let consume = |group: &'static str, kind: Handled, want: usize| {
        let url = consumer_url(group);
        let payments = payments.clone();
        async move {
            let (seen, mut watch) = tokio::sync::watch::channel(0usize);
            let handler = handler_fn(move |delivery| {
                let (payments, seen) = (payments.clone(), seen.clone());
                async move {
                    let handled = payments.handle(&delivery).await?;
                    if handled == kind {
                        seen.send_modify(|n| *n += 1);
                    }
                    Ok(handled)
                }
            });
            let stop = CancellationToken::new();
            let stopping = stop.clone();
            let task = tokio::spawn(async move { run_payments(handler, &url, stopping).await });
            tokio::time::timeout(GUARD, watch.wait_for(|n| *n >= want))
                .await
                .unwrap_or_else(|_| panic!("{group}: fewer than {want} messages {kind:?}"))
                .unwrap();
            stop.cancel();
            task.await.unwrap().unwrap();
        }
    };
    consume("payments", Handled::Processed, committed.len()).await;
    let booked = payments.payments().await.unwrap();
    let mut ids: Vec<_> = booked.iter().map(|p| p.message_id).collect();
    ids.sort_unstable();
    let mut want = committed.clone();
    want.sort_unstable();
    assert_eq!(ids, want, "exactly one payment per committed order");
    assert!(!ids.contains(&rolled_back[0]));
    // Every message again, under the same inbox name: all duplicates, nothing booked again.
    consume("replay", Handled::Duplicate, committed.len()).await;
    assert_eq!(payments.payments().await.unwrap(), booked);

    match broker {
        Broker::Kafka => outbox_e2e::kafka::delete_topic(&server, &format!("cexo{s}"))
            .await
            .unwrap(),
        Broker::Redis => outbox_e2e::redis::delete(&server, &format!("cexo{s}"))
            .await
            .unwrap(),
        Broker::Nats => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_through_redis_with_cloudevents_binary() {
    exactly_once(Broker::Redis, "cloudevents").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_through_kafka_with_cloudevents_structured() {
    exactly_once(Broker::Kafka, "cloudevents-structured").await;
}
