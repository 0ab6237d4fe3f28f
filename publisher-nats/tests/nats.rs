//! Against the real NATS server (`OUTBOX_TEST_NATS_URL`), each test on its own stream and
//! subjects; outages on a private `nats-server` started on a free port.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream;
use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::process::wait_until_stopped;
use outbox_conformance_tests::publisher::{
    self as conformance, message, BrokerReader, PublisherHarness, ReceivedMessage,
};
use outbox_publisher_nats::{NatsConfig, NatsPublisher, StreamSetup};
use outbox_routing::HEADER_PARTITION_KEY;
use outbox_traits::{async_trait, Error, ErrorKind, PublishOutcome, Publisher};

const VAR: &str = "OUTBOX_TEST_NATS_URL";

fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// A config for a fresh stream `T_<suffix>` capturing `t<suffix>.>`.
fn fresh_config(url: &str) -> (NatsConfig, String) {
    let s = suffix();
    let stream = format!("T_{s}");
    let config = NatsConfig::from_url(&format!(
        "{url}?subject=t{s}.{{aggregate_type}}.{{event_type}}&stream={stream}&create_stream=true\
         &duplicate_window_ms=60000&timeout_ms=5000"
    ))
    .unwrap();
    (config, stream)
}

struct NatsReader {
    jetstream: jetstream::Context,
    stream: String,
}

#[async_trait]
impl BrokerReader for NatsReader {
    async fn read_all(&self) -> Result<Vec<ReceivedMessage>, Error> {
        let fail = |e: String| Error::transient(format!("reading stream back: {e}"), None);
        let stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let state = stream.cached_info().state.clone();
        let mut out = Vec::new();
        if state.messages == 0 {
            return Ok(out);
        }
        for seq in state.first_sequence..=state.last_sequence {
            let stored = stream
                .get_raw_message(seq)
                .await
                .map_err(|e| fail(e.to_string()))?;
            let mut headers = Vec::new();
            for (name, values) in stored.headers.iter() {
                for value in values {
                    headers.push((name.to_string(), value.as_str().to_owned()));
                }
            }
            out.push(ReceivedMessage {
                id: stored
                    .headers
                    .get(NATS_MESSAGE_ID)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default(),
                payload: stored.payload.to_vec(),
                key: stored
                    .headers
                    .get(HEADER_PARTITION_KEY)
                    .map(|v| v.as_str().to_owned()),
                headers,
            });
        }
        Ok(out)
    }
}

/// A private nats-server on a free port, killed on drop. Never the shared one.
struct PrivateServer {
    child: Child,
    url: String,
    store: Option<std::path::PathBuf>,
}

impl PrivateServer {
    fn start() -> Self {
        Self::start_with(false)
    }

    /// With JetStream enabled, storing in a fresh temporary directory.
    fn start_with(jetstream: bool) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut args = vec![
            "-a".to_owned(),
            "127.0.0.1".to_owned(),
            "-p".to_owned(),
            port.to_string(),
        ];
        let store =
            jetstream.then(|| std::env::temp_dir().join(format!("outbox-nats-{}", suffix())));
        if let Some(dir) = &store {
            args.extend([
                "-js".to_owned(),
                "-sd".to_owned(),
                dir.display().to_string(),
            ]);
        }
        // Debian installs it in /usr/sbin, which a non-login PATH may lack.
        let binary = if std::path::Path::new("/usr/sbin/nats-server").exists() {
            "/usr/sbin/nats-server"
        } else {
            "nats-server"
        };
        let child = Command::new(binary)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server must be installed (it is the NATS the project tests against)");
        Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            store,
        }
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
            wait_until_stopped(self.child.id(), "nats-server");
        }
    }

    /// Connect, retrying while the server starts up (readiness, not a timed assertion).
    async fn connect(&self, config: NatsConfig) -> NatsPublisher {
        for _ in 0..200 {
            if let Ok(p) = NatsPublisher::connect(config.clone()).await {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("private nats-server at {} did not come up", self.url);
    }

    fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = self.store.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
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
    streams: std::sync::Mutex<Vec<String>>,
}

impl Harness {
    fn new(url: String) -> Self {
        Self {
            url,
            private: Default::default(),
            streams: Default::default(),
        }
    }

    /// Delete the streams this harness created, so the shared server does not fill up.
    async fn cleanup(&self) {
        let client = async_nats::connect(&self.url).await.unwrap();
        let js = jetstream::new(client);
        let streams = std::mem::take(&mut *self.streams.lock().unwrap());
        for stream in streams {
            js.delete_stream(&stream).await.unwrap();
        }
    }
}

#[async_trait]
impl PublisherHarness for Harness {
    type Publisher = NatsPublisher;

    async fn fresh(&self) -> (NatsPublisher, Box<dyn BrokerReader>) {
        let (config, stream) = fresh_config(&self.url);
        let publisher = NatsPublisher::connect(config).await.unwrap();
        self.streams.lock().unwrap().push(stream.clone());
        let reader = NatsReader {
            jetstream: jetstream::new(publisher.client().clone()),
            stream,
        };
        (publisher, Box::new(reader))
    }

    fn oversized_payload(&self) -> Option<String> {
        // Over the server's default max_payload of 1 MiB.
        Some(format!(r#"{{"big":"{}"}}"#, "x".repeat(2 * 1024 * 1024)))
    }

    fn broker_dedup(&self) -> bool {
        true
    }

    async fn down(&self) -> (Box<dyn Publisher>, Duration) {
        let mut server = PrivateServer::start();
        let config = NatsConfig::from_url(&format!(
            "{}?subject=down.{{aggregate_type}}&timeout_ms=1000",
            server.url
        ))
        .unwrap();
        let publisher = server.connect(config).await;
        server.stop();
        self.private.lock().unwrap().push(server);
        (Box::new(publisher), Duration::from_secs(1))
    }
}

#[tokio::test]
async fn conformance_suite() {
    let Some(url) = service_url(VAR) else { return };
    let harness = Harness::new(url);
    conformance::run_publisher_suite(&harness).await;
    harness.cleanup().await;
}

#[tokio::test]
async fn many_keys_keep_order_under_load() {
    let Some(url) = service_url(VAR) else { return };
    let harness = Harness::new(url);
    let (publisher, reader) = harness.fresh().await;
    let mut batch = Vec::new();
    for n in 0..20 {
        for key in 0..50 {
            batch.push(message(
                Some(&format!("k{key}")),
                &format!(r#"{{"n":{n}}}"#),
            ));
        }
    }
    let outcomes = publisher.publish(&batch).await;
    assert!(outcomes.iter().all(PublishOutcome::is_acked));
    let stored = reader.read_all().await.unwrap();
    assert_eq!(stored.len(), batch.len());
    let mut last: std::collections::HashMap<String, u32> = Default::default();
    for r in &stored {
        let n: u32 = serde_n(&r.payload);
        let key = r.key.clone().unwrap();
        if let Some(prev) = last.insert(key.clone(), n) {
            assert_eq!(prev + 1, n, "key {key} out of order");
        }
    }
    harness.cleanup().await;
}

fn serde_n(payload: &[u8]) -> u32 {
    let text = std::str::from_utf8(payload).unwrap();
    text.trim_start_matches(r#"{"n":"#)
        .trim_end_matches('}')
        .parse()
        .unwrap()
}

#[tokio::test]
async fn stream_max_msg_size_fails_only_that_message_permanently() {
    let Some(url) = service_url(VAR) else { return };
    let s = suffix();
    let config = NatsConfig::from_url(&format!(
        "{url}?subject=m{s}.{{aggregate_type}}&stream=M_{s}&create_stream=true&max_msg_size=2000"
    ))
    .unwrap();
    let publisher = NatsPublisher::connect(config).await.unwrap();
    let big = format!(r#"{{"x":"{}"}}"#, "y".repeat(5000));
    let batch = vec![
        message(Some("a"), "{}"),
        message(Some("a"), &big),
        message(Some("a"), "{}"),
        message(Some("b"), "{}"),
    ];
    let outcomes = publisher.publish(&batch).await;
    assert_eq!(outcomes[0], PublishOutcome::Acked);
    assert!(
        matches!(&outcomes[1], PublishOutcome::Failed { kind: ErrorKind::Permanent, reason } if reason.contains("max_msg_size")),
        "{:?}",
        outcomes[1]
    );
    assert_eq!(outcomes[2], PublishOutcome::NotAttempted);
    assert_eq!(outcomes[3], PublishOutcome::Acked);
    let js = jetstream::new(publisher.client().clone());
    js.delete_stream(format!("M_{s}")).await.unwrap();
}

/// The subject each message is stored under is the template rendered over its own fields, and
/// a user header that forges the id (`Nats-Msg-Id`, `message-id`, in any case) is dropped: the
/// stored message carries its real id once under each name.
#[tokio::test]
async fn subjects_follow_the_template_and_forged_id_headers_are_dropped() {
    let Some(url) = service_url(VAR) else { return };
    let harness = Harness::new(url);
    let s = suffix();
    let (prefix, stream) = (format!("t{s}"), format!("T_{s}"));
    let config = NatsConfig::from_url(&format!(
        "{}?subject={prefix}.{{aggregate_type}}.{{event_type}}&stream={stream}&create_stream=true",
        harness.url
    ))
    .unwrap();
    let publisher = NatsPublisher::connect(config).await.unwrap();
    harness.streams.lock().unwrap().push(stream.clone());
    let mut batch = Vec::new();
    for (aggregate, event) in [
        ("order", "order.placed"),
        ("invoice", "sent"),
        ("order", "paid"),
    ] {
        let mut msg = message(Some(aggregate), "{}");
        msg.aggregate_type = aggregate.into();
        msg.event_type = event.into();
        msg.headers.insert("nats-msg-id".into(), "forged".into());
        msg.headers.insert("Message-ID".into(), "forged".into());
        msg.headers.insert("tenant".into(), "acme".into());
        batch.push(msg);
    }
    let outcomes = publisher.publish(&batch).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );

    let js = jetstream::new(publisher.client().clone());
    let info = js.get_stream(&stream).await.unwrap();
    for (seq, msg) in (1..).zip(&batch) {
        let stored = info.get_raw_message(seq).await.unwrap();
        assert_eq!(
            stored.subject.as_str(),
            format!("{prefix}.{}.{}", msg.aggregate_type, msg.event_type)
        );
        let id = msg.id.hyphenated().to_string();
        let mut ids = Vec::new();
        let mut tenant = Vec::new();
        for (name, values) in stored.headers.iter() {
            let values = values.iter().map(|v| v.as_str().to_owned());
            match name.to_string().to_ascii_lowercase().as_str() {
                "nats-msg-id" | "message-id" => ids.extend(values.map(|v| (name.to_string(), v))),
                "tenant" => tenant.extend(values),
                _ => {}
            }
        }
        ids.sort();
        assert_eq!(
            ids,
            vec![
                ("Nats-Msg-Id".to_owned(), id.clone()),
                ("message-id".to_owned(), id)
            ]
        );
        assert_eq!(tenant, ["acme"]);
    }
    harness.cleanup().await;
}

#[tokio::test]
async fn subject_without_stream_is_a_transient_failure_naming_the_fix() {
    let Some(url) = service_url(VAR) else { return };
    let s = suffix();
    let config =
        NatsConfig::from_url(&format!("{url}?subject=nostream{s}.{{aggregate_type}}")).unwrap();
    let publisher = NatsPublisher::connect(config).await.unwrap();
    let batch = vec![message(Some("a"), "{}"), message(Some("a"), "{}")];
    let outcomes = publisher.publish(&batch).await;
    assert!(
        matches!(&outcomes[0], PublishOutcome::Failed { kind: ErrorKind::Transient, reason } if reason.contains("no JetStream stream")),
        "{:?}",
        outcomes[0]
    );
    assert_eq!(outcomes[1], PublishOutcome::NotAttempted);
}

#[tokio::test]
async fn missing_stream_that_is_not_created_is_refused_at_connect() {
    let Some(url) = service_url(VAR) else { return };
    let config = NatsConfig::builder(url, "x.{id}")
        .stream(StreamSetup::existing(format!("MISSING_{}", suffix())))
        .build()
        .unwrap();
    let err = NatsPublisher::connect(config).await.unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert!(err.to_string().contains("create_stream=true"), "{err}");
}

#[tokio::test]
async fn duplicate_ack_for_a_message_no_longer_stored_is_ambiguous() {
    let Some(url) = service_url(VAR) else { return };
    let (config, stream) = fresh_config(&url);
    let publisher = NatsPublisher::connect(config).await.unwrap();
    let msg = message(Some("k"), r#"{"v":1}"#);
    assert_eq!(
        publisher.publish(std::slice::from_ref(&msg)).await,
        [PublishOutcome::Acked]
    );
    // The stored copy disappears while its Nats-Msg-Id stays in the dedup window: the server
    // answers "duplicate" to the retry, but nothing with this id is stored any more.
    let js = jetstream::new(publisher.client().clone());
    let handle = js.get_stream(&stream).await.unwrap();
    assert!(handle.delete_message(1).await.unwrap());
    let outcome = publisher.publish(std::slice::from_ref(&msg)).await;
    assert!(
        matches!(&outcome[0], PublishOutcome::Ambiguous { reason } if reason.contains("duplicate")),
        "{outcome:?}"
    );
    js.delete_stream(&stream).await.unwrap();
}

#[tokio::test]
async fn unreachable_server_is_unavailable_without_the_password() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = NatsConfig::from_url(&format!(
        "nats://app:s3cret@127.0.0.1:{port}?subject=x.{{id}}&timeout_ms=1000"
    ))
    .unwrap();
    let err = NatsPublisher::connect(config).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.is_transient());
    let text = format!("{err} {err:?}");
    assert!(!text.contains("s3cret"), "{text}");
}

#[tokio::test]
async fn server_killed_mid_session_gives_transient_or_ambiguous_outcomes() {
    // Always runs: it uses its own private server, never the shared one.
    let mut server = PrivateServer::start();
    let config = NatsConfig::from_url(&format!(
        "{}?subject=k.{{aggregate_type}}&timeout_ms=1000",
        server.url
    ))
    .unwrap();
    let publisher = server.connect(config).await;
    server.stop();
    conformance::check_broker_down(&publisher, Duration::from_secs(1)).await;
    // And again, once the client knows it is disconnected.
    conformance::check_broker_down(&publisher, Duration::from_secs(1)).await;
}

#[tokio::test]
async fn frozen_server_gives_ambiguous_outcomes_then_recovers() {
    // Always runs: a private JetStream server, frozen with SIGSTOP (FM-C3's black hole).
    let server = PrivateServer::start_with(true);
    let config = NatsConfig::from_url(&format!(
        "{}?subject=f.{{aggregate_type}}&stream=F&create_stream=true&timeout_ms=1000",
        server.url
    ))
    .unwrap();
    let publisher = server.connect(config).await;
    server.signal("-STOP");
    let mut batch = Vec::new();
    for n in 0..3 {
        for key in ["a", "b", "c"] {
            batch.push(message(Some(key), &format!(r#"{{"n":{n}}}"#)));
        }
    }
    let outcomes = publisher.publish(&batch).await;
    server.signal("-CONT");
    assert!(
        outcomes
            .iter()
            .any(|o| matches!(o, PublishOutcome::Ambiguous { .. })),
        "{outcomes:?}"
    );
    for (i, outcome) in outcomes.iter().enumerate() {
        match outcome {
            PublishOutcome::Ambiguous { .. } => assert!(i < 3, "only first messages were sent"),
            PublishOutcome::NotAttempted => assert!(i >= 3),
            other => panic!("frozen server: unexpected {other:?}"),
        }
    }
    // Thawed: the same messages go through (the ambiguous ones as verified duplicates).
    let outcomes = publisher.publish(&batch).await;
    assert!(
        outcomes.iter().all(PublishOutcome::is_acked),
        "{outcomes:?}"
    );
}
