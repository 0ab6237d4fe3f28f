//! Against the real Redis (`OUTBOX_TEST_REDIS_URL`), each test on its own stream keys; outages
//! on a private `redis-server` started on a free port.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::process::wait_until_stopped;
use outbox_conformance_tests::publisher::{
    self as conformance, message, BrokerReader, PublisherHarness, ReceivedMessage,
};
use outbox_publisher_redis::{RedisConfig, RedisPublisher};
use outbox_routing::{
    HEADER_AGGREGATE_ID, HEADER_AGGREGATE_TYPE, HEADER_CONTENT_TYPE, HEADER_EVENT_TYPE,
    HEADER_MESSAGE_ID, HEADER_PARTITION_KEY,
};
use outbox_traits::{async_trait, Error, ErrorKind, PublishOutcome, Publisher};
use redis::AsyncCommands;

const VAR: &str = "OUTBOX_TEST_REDIS_URL";

fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// One stream entry's fields, as (name, bytes) in stored order.
type Fields = Vec<(String, Vec<u8>)>;

/// Every entry of `stream`, oldest first.
async fn entries(url: &str, stream: &str) -> Vec<Fields> {
    let mut con = raw(url).await;
    let reply: Vec<(String, Fields)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut con)
        .await
        .unwrap();
    reply.into_iter().map(|(_, fields)| fields).collect()
}

/// Remove a test's keys so the shared server does not fill up.
async fn delete(url: &str, keys: &[String]) {
    let mut con = raw(url).await;
    let _: usize = con.del(keys).await.unwrap();
}

struct RedisReader {
    url: String,
    stream: String,
}

#[async_trait]
impl BrokerReader for RedisReader {
    async fn read_all(&self) -> Result<Vec<ReceivedMessage>, Error> {
        let mut out = Vec::new();
        for fields in entries(&self.url, &self.stream).await {
            let text = |name: &str| {
                fields
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| String::from_utf8(v.clone()).unwrap())
            };
            let id = text("id").unwrap_or_default();
            let key = text("partition_key");
            let mut headers = vec![
                (HEADER_MESSAGE_ID.to_owned(), id.clone()),
                (
                    HEADER_EVENT_TYPE.to_owned(),
                    text("event_type").unwrap_or_default(),
                ),
                (
                    HEADER_AGGREGATE_TYPE.to_owned(),
                    text("aggregate_type").unwrap_or_default(),
                ),
                (
                    HEADER_AGGREGATE_ID.to_owned(),
                    text("aggregate_id").unwrap_or_default(),
                ),
            ];
            if let Some(key) = &key {
                headers.push((HEADER_PARTITION_KEY.to_owned(), key.clone()));
            }
            // A binary payload's type: the `content_type` field.
            if let Some(content_type) = text("content_type") {
                headers.push((HEADER_CONTENT_TYPE.to_owned(), content_type));
            }
            let user: std::collections::BTreeMap<String, String> =
                serde_json::from_str(&text("headers").unwrap_or_default()).unwrap();
            headers.extend(user);
            let payload = fields
                .iter()
                .find(|(n, _)| n == "payload")
                .map(|(_, v)| v.clone())
                .unwrap_or_default();
            out.push(ReceivedMessage {
                id,
                payload,
                headers,
                key,
            });
        }
        Ok(out)
    }
}

/// A private redis-server on a free port, killed on drop. Never the shared one.
struct PrivateServer {
    child: Child,
    url: String,
}

impl PrivateServer {
    fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (it is the Redis the project tests against)");
        Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
        }
    }

    /// Connect, retrying while the server starts up (readiness, not a timed assertion).
    async fn connect(&self, config: RedisConfig) -> RedisPublisher {
        for _ in 0..200 {
            if let Ok(p) = RedisPublisher::connect(config.clone()).await {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("private redis-server at {} did not come up", self.url);
    }

    /// Freeze (`SIGSTOP`) or thaw (`SIGCONT`) the server: a black hole that accepts TCP and
    /// never answers.
    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        if signal == "-STOP" {
            // `kill` returns once the stop is queued; wait until it is done.
            wait_until_stopped(self.child.id(), "redis-server");
        }
    }

    fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Harness {
    url: String,
    private: std::sync::Mutex<Vec<PrivateServer>>,
    keys: std::sync::Mutex<Vec<String>>,
}

#[async_trait]
impl PublisherHarness for Harness {
    type Publisher = RedisPublisher;

    async fn fresh(&self) -> (RedisPublisher, Box<dyn BrokerReader>) {
        let s = suffix();
        let config = RedisConfig::from_url(&format!(
            "{}?stream=t{s}.{{aggregate_type}}&max_payload=100000",
            self.url
        ))
        .unwrap();
        let publisher = RedisPublisher::connect(config).await.unwrap();
        let reader = RedisReader {
            url: self.url.clone(),
            stream: format!("t{s}.conformance"),
        };
        self.keys.lock().unwrap().push(reader.stream.clone());
        (publisher, Box::new(reader))
    }

    fn oversized_payload(&self) -> Option<String> {
        Some(format!(r#"{{"big":"{}"}}"#, "x".repeat(200_000)))
    }

    fn broker_dedup(&self) -> bool {
        false
    }

    async fn down(&self) -> (Box<dyn Publisher>, Duration) {
        let mut server = PrivateServer::start();
        let config =
            RedisConfig::from_url(&format!("{}?stream=down&timeout_ms=1000", server.url)).unwrap();
        let publisher = server.connect(config).await;
        server.stop();
        self.private.lock().unwrap().push(server);
        (Box::new(publisher), Duration::from_secs(1))
    }
}

#[tokio::test]
async fn conformance_suite() {
    let Some(url) = service_url(VAR) else { return };
    let harness = Harness {
        url: url.clone(),
        private: Default::default(),
        keys: Default::default(),
    };
    conformance::run_publisher_suite(&harness).await;
    let keys = std::mem::take(&mut *harness.keys.lock().unwrap());
    delete(&url, &keys).await;
}

#[tokio::test]
async fn fields_are_written_as_documented() {
    let Some(url) = service_url(VAR) else { return };
    let s = suffix();
    let config = RedisConfig::from_url(&format!("{url}?stream=f{s}")).unwrap();
    let publisher = RedisPublisher::connect(config).await.unwrap();
    let mut msg = message(Some("k1"), r#"{"a":"é"}"#);
    msg.headers
        .insert("traceparent".into(), "00-aa-bb-01".into());
    let unordered = message(None, "{}");
    let outcomes = publisher.publish(&[msg.clone(), unordered]).await;
    assert_eq!(outcomes, [PublishOutcome::Acked, PublishOutcome::Acked]);
    let stored = entries(&url, &format!("f{s}")).await;
    let names: Vec<&str> = stored[0].iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "id",
            "event_type",
            "aggregate_type",
            "aggregate_id",
            "partition_key",
            "payload",
            "headers"
        ]
    );
    assert_eq!(stored[0][0].1, msg.id.to_string().as_bytes());
    assert_eq!(stored[0][6].1, br#"{"traceparent":"00-aa-bb-01"}"#);
    assert!(stored[1].iter().all(|(n, _)| n != "partition_key"));
    delete(&url, &[format!("f{s}")]).await;
}

#[tokio::test]
async fn maxlen_trims_the_stream() {
    let Some(url) = service_url(VAR) else { return };
    let s = suffix();
    let stream = format!("m{s}");
    let config = RedisConfig::from_url(&format!("{url}?stream={stream}&maxlen=10")).unwrap();
    let publisher = RedisPublisher::connect(config).await.unwrap();
    let batch: Vec<_> = (0..1000)
        .map(|n| message(Some(&format!("k{}", n % 7)), &format!(r#"{{"n":{n}}}"#)))
        .collect();
    let outcomes = publisher.publish(&batch).await;
    assert!(outcomes.iter().all(PublishOutcome::is_acked));
    let mut con = raw(&url).await;
    let len: usize = con.xlen(&stream).await.unwrap();
    // `MAXLEN ~` trims whole nodes (100 entries by default), never below the limit.
    assert!(
        (10..1000).contains(&len),
        "stream kept {len} of 1000 entries"
    );
    let stored = entries(&url, &stream).await;
    let last = stored.last().unwrap();
    assert_eq!(last[0].1, batch[999].id.to_string().as_bytes());
    delete(&url, &[stream]).await;
}

#[tokio::test]
async fn a_refused_entry_fails_alone_in_the_pipeline() {
    let Some(url) = service_url(VAR) else { return };
    let s = suffix();
    let mut con = raw(&url).await;
    // The stream key of aggregate "bad" holds a string: XADD gets WRONGTYPE for it only.
    let _: () = con.set(format!("w{s}.bad"), "not a stream").await.unwrap();
    let config = RedisConfig::from_url(&format!("{url}?stream=w{s}.{{aggregate_id}}")).unwrap();
    let publisher = RedisPublisher::connect(config).await.unwrap();
    let mut bad = message(Some("bad"), "{}");
    bad.aggregate_id = "bad".into();
    let batch = vec![
        message(Some("good"), "{}"),
        bad,
        message(Some("good"), "{}"),
    ];
    let outcomes = publisher.publish(&batch).await;
    assert_eq!(outcomes[0], PublishOutcome::Acked);
    assert!(
        matches!(&outcomes[1], PublishOutcome::Failed { kind: ErrorKind::Permanent, reason } if reason.contains("WRONGTYPE")),
        "{:?}",
        outcomes[1]
    );
    assert_eq!(outcomes[2], PublishOutcome::Acked);
    assert_eq!(entries(&url, &format!("w{s}.good")).await.len(), 2);
    delete(&url, &[format!("w{s}.good"), format!("w{s}.bad")]).await;
}

#[tokio::test]
async fn unreachable_server_is_unavailable_without_the_password() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = RedisConfig::from_url(&format!(
        "redis://app:s3cret@127.0.0.1:{port}?stream=x&timeout_ms=1000"
    ))
    .unwrap();
    let err = RedisPublisher::connect(config).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let text = format!("{err} {err:?}");
    assert!(!text.contains("s3cret"), "{text}");
}

#[tokio::test]
async fn server_killed_mid_session_gives_transient_or_ambiguous_outcomes() {
    // Always runs: it uses its own private server, never the shared one.
    let mut server = PrivateServer::start();
    let config =
        RedisConfig::from_url(&format!("{}?stream=k&timeout_ms=1000", server.url)).unwrap();
    let publisher = server.connect(config).await;
    server.stop();
    conformance::check_broker_down(&publisher, Duration::from_secs(1)).await;
    conformance::check_broker_down(&publisher, Duration::from_secs(1)).await;
}

#[tokio::test]
async fn frozen_server_gives_ambiguous_outcomes_then_recovers() {
    // Always runs: a private server, frozen with SIGSTOP (a black hole).
    let server = PrivateServer::start();
    let config =
        RedisConfig::from_url(&format!("{}?stream=frozen&timeout_ms=1000", server.url)).unwrap();
    let publisher = server.connect(config).await;
    server.signal("-STOP");
    let batch: Vec<_> = (0..6)
        .map(|n| message(Some(["a", "b"][n % 2]), "{}"))
        .collect();
    let outcomes = publisher.publish(&batch).await;
    server.signal("-CONT");
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, PublishOutcome::Ambiguous { .. })),
        "a pipeline without a reply may be stored: {outcomes:?}"
    );
    let outcomes = publisher.publish(&batch).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );
}
