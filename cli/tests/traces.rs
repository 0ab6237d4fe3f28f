//! Traces end to end (issue 30): a service enqueues in its span, into Postgres (through a
//! `tracing` span with the OpenTelemetry layer) and SQLite (through the `opentelemetry` API's
//! current context); the `outbox-relay` program drains both into the real NATS server and
//! exports its producer spans over OTLP/HTTP to a receiver this test runs; an outbox-consumer
//! handles the messages. The service's span, the relay's producer spans and the consumer's
//! spans must form one trace per request, with the messaging attributes.
//!
//! Nothing sleeps: the relay runs to the end (`drain`, which flushes its exporter before it
//! exits), and the consumer is stopped once its handler has seen every message.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue as ProtoKeyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind as ProtoKind;
use opentelemetry_proto::tonic::trace::v1::Span as ProtoSpan;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_conformance_tests::env::service_url;
use outbox_consumer::nats::{NatsConsumer, NatsConsumerConfig};
use outbox_consumer::{handler_fn, CancellationToken, Delivery, Handled};
use outbox_e2e::{nats, unique_suffix};
use prost::Message as _;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;
use uuid::Uuid;

mod common;
use common::{command, message, output, BoxError, GUARD};

type TestResult = Result<(), BoxError>;

/// Spans received over OTLP/HTTP, each with its resource's `service.name`.
type Received = Arc<Mutex<Vec<(String, ProtoSpan)>>>;

/// A minimal OTLP/HTTP receiver: decodes every `POST /v1/traces` (protobuf) and keeps its
/// spans. Returns its base URL.
async fn otlp_receiver(received: Received) -> Result<String, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let received = received.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let received = received.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        let body = req.into_body().collect().await?.to_bytes();
                        let status = match ExportTraceServiceRequest::decode(body) {
                            Ok(export) if path == "/v1/traces" => {
                                let mut spans = received.lock().unwrap();
                                for resource in export.resource_spans {
                                    let service = resource
                                        .resource
                                        .as_ref()
                                        .and_then(|r| string_attr(&r.attributes, "service.name"))
                                        .unwrap_or_default();
                                    for scope in resource.scope_spans {
                                        for span in scope.spans {
                                            spans.push((service.clone(), span));
                                        }
                                    }
                                }
                                200
                            }
                            _ => 400,
                        };
                        Ok::<_, hyper::Error>(
                            Response::builder()
                                .status(status)
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::new()))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(format!("http://{addr}"))
}

fn string_attr(attributes: &[ProtoKeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .and_then(|v| match v {
            AnyValue::StringValue(s) => Some(s.clone()),
            AnyValue::IntValue(i) => Some(i.to_string()),
            _ => None,
        })
}

fn sdk_attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Run `outbox-relay drain --migrate` on `store` into `broker`, exporting to `otlp`.
async fn drain(store: &str, broker: &str, otlp: &str, extra: &[&str]) -> TestResult {
    let mut relay = command(
        [
            &["--store", store][..],
            extra,
            &["drain", "--migrate", "--broker", broker],
        ]
        .concat(),
    );
    relay
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp)
        .env("OTEL_SERVICE_NAME", "outbox-relay-traces-test")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env_remove("OTEL_SDK_DISABLED")
        .env_remove("OTEL_TRACES_EXPORTER");
    let out = output(relay).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "relay failed: {stderr}");
    Ok(())
}

#[tokio::test]
async fn a_request_trace_runs_through_enqueue_relay_and_consumer() -> TestResult {
    let (Some(pg_url), Some(nats_url)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let received: Received = Arc::default();
    let otlp = otlp_receiver(received.clone()).await?;

    // The service's (and the consumer's) spans, kept in memory.
    let memory = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(memory.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("shop")));
    // The test runs on one thread (current-thread runtime): every task sees this subscriber.
    let _subscriber = tracing::subscriber::set_default(subscriber);

    let suffix = unique_suffix();
    let schema = format!("traces_{suffix}");
    let stream = format!("TRACES_{suffix}");
    let subject = format!("traces{suffix}");
    let broker = format!(
        "{nats_url}?subject={subject}.{{event_type}}&stream={stream}&create_stream=true\
         &stream_subjects={subject}.>"
    );

    // Postgres: two messages of one key (one claim shard, so one batch: a create span each,
    // one send span) in one `tracing` span.
    let pg_msgs = [message(1, 1), message(2, 1)];
    let pool = sqlx::PgPool::connect(&pg_url).await?;
    let config = outbox::postgres::PostgresConfig::builder()
        .schema(schema.clone())
        .build()?;
    sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
        .execute(&pool)
        .await?;
    outbox::postgres::migrate(&pool, &config).await?;
    async {
        let mut tx = pool.begin().await?;
        outbox::postgres::enqueue_batch(&mut *tx, &config, &pg_msgs).await?;
        tx.commit().await?;
        Ok::<_, BoxError>(())
    }
    .instrument(tracing::info_span!("checkout-postgres"))
    .await?;

    // SQLite: one message under the `opentelemetry` API's current span (no `tracing` span).
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.db");
    let sqlite_msg = message(3, 1);
    {
        let sqlite = outbox::sqlite::SqliteConfig::default();
        let mut conn = outbox::sqlite::open_connection(&path, &sqlite)?;
        outbox::sqlite::migrate(&conn, &sqlite)?;
        let span = provider.tracer("shop").start("checkout-sqlite");
        let cx = Context::current_with_span(span);
        let attached = cx.clone().attach();
        let tx = conn.transaction()?;
        outbox::sqlite::enqueue(&tx, &sqlite, &sqlite_msg)?;
        tx.commit()?;
        drop(attached);
        cx.span().end();
    }

    drain(&pg_url, &broker, &otlp, &["--schema", &schema]).await?;
    drain(&format!("sqlite://{}", path.display()), &broker, &otlp, &[]).await?;

    // The consumer: its handler notes each message's id as it runs, in its span.
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<Uuid>();
    let consumer = NatsConsumer::connect(
        NatsConsumerConfig::builder(nats_url.clone(), &stream, "traces").build()?,
    )
    .await?;
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run_until(
        handler_fn(move |d: Delivery| {
            let seen = seen_tx.clone();
            async move {
                let _ = seen.send(d.message_id);
                Ok(Handled::Processed)
            }
        }),
        stop.clone(),
    ));
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let id = tokio::time::timeout(GUARD, seen_rx.recv())
            .await?
            .ok_or("the consumer stopped")?;
        seen.push(id);
    }
    stop.cancel();
    running.await?;

    let local = memory.get_finished_spans()?;
    let service_span = |name: &str| {
        local
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.span_context.clone())
            .ok_or(format!("no service span {name}"))
    };
    let pg_parent = service_span("checkout-postgres")?;
    let sqlite_parent = service_span("checkout-sqlite")?;
    let relayed = received.lock().unwrap().clone();
    let destination = format!("{subject}.order.placed");
    let producer = |id: Uuid| {
        relayed
            .iter()
            .find(|(_, s)| {
                string_attr(&s.attributes, "messaging.message.id") == Some(id.to_string())
            })
            .map(|(service, s)| (service.clone(), s.clone()))
            .ok_or(format!("no producer span for message {id}"))
    };
    let mut producer_ids = HashMap::new();
    for (msg, parent, operation) in [
        (&pg_msgs[0], &pg_parent, "create"),
        (&pg_msgs[1], &pg_parent, "create"),
        (&sqlite_msg, &sqlite_parent, "send"),
    ] {
        let (service, span) = producer(msg.id)?;
        assert_eq!(service, "outbox-relay-traces-test");
        assert_eq!(span.kind, ProtoKind::Producer as i32, "{span:?}");
        assert_eq!(
            hex(&span.trace_id),
            parent.trace_id().to_string(),
            "one trace"
        );
        assert_eq!(
            hex(&span.parent_span_id),
            parent.span_id().to_string(),
            "the producer span is a child of the enqueue's span"
        );
        assert_eq!(span.name, format!("{operation} {destination}"));
        let attr = |key| string_attr(&span.attributes, key);
        assert_eq!(attr("messaging.system").as_deref(), Some("nats"));
        assert_eq!(
            attr("messaging.destination.name"),
            Some(destination.clone())
        );
        assert_eq!(attr("messaging.operation.type").as_deref(), Some(operation));
        producer_ids.insert(msg.id, hex(&span.span_id));
    }
    // The Postgres batch's send span: the batch size and a link to each message's span.
    let (_, batch) = relayed
        .iter()
        .find(|(_, s)| string_attr(&s.attributes, "messaging.batch.message_count").is_some())
        .ok_or("no batch send span")?;
    assert_eq!(batch.kind, ProtoKind::Client as i32);
    assert_eq!(
        string_attr(&batch.attributes, "messaging.batch.message_count").as_deref(),
        Some("2")
    );
    let mut linked: Vec<String> = batch.links.iter().map(|l| hex(&l.span_id)).collect();
    let mut want = vec![
        producer_ids[&pg_msgs[0].id].clone(),
        producer_ids[&pg_msgs[1].id].clone(),
    ];
    linked.sort();
    want.sort();
    assert_eq!(linked, want, "the batch span links to its messages' spans");

    // The consumer's spans continue each trace from the producer span.
    for (msg, parent) in [
        (&pg_msgs[0], &pg_parent),
        (&pg_msgs[1], &pg_parent),
        (&sqlite_msg, &sqlite_parent),
    ] {
        let span = local
            .iter()
            .find(|s| {
                s.span_kind == SpanKind::Consumer
                    && sdk_attr(s, "messaging.message.id") == Some(msg.id.to_string())
            })
            .ok_or(format!("no consumer span for {}", msg.id))?;
        assert_eq!(span.name, format!("process {destination}"));
        assert_eq!(span.span_context.trace_id(), parent.trace_id(), "one trace");
        assert_eq!(
            span.parent_span_id.to_string(),
            producer_ids[&msg.id],
            "the consumer's span is a child of the relay's producer span"
        );
    }

    nats::delete_stream(&nats_url, &stream).await?;
    nats::delete_stream(&nats_url, &format!("{stream}_DEAD")).await?;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}

/// Run `outbox-relay drain` on the SQLite outbox at `path` into `stdout://`, exporting to the
/// https `otlp` endpoint with the `OTEL_*` variables `vars`; returns its standard error.
async fn drain_tls(
    path: &std::path::Path,
    otlp: &str,
    vars: &[(&str, &std::path::Path)],
) -> Result<String, BoxError> {
    let store = format!("sqlite://{}", path.display());
    let mut relay = command([
        "--store",
        &store,
        "drain",
        "--migrate",
        "--broker",
        "stdout://",
    ]);
    relay
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp)
        .env("OTEL_SERVICE_NAME", "outbox-relay-tls-test")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_CERTIFICATE")
        .env_remove("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE")
        .env_remove("OTEL_EXPORTER_OTLP_CLIENT_KEY")
        .env_remove("OTEL_SDK_DISABLED")
        .env_remove("OTEL_TRACES_EXPORTER");
    for (name, value) in vars {
        relay.env(name, value);
    }
    let out = output(relay).await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "relay failed: {stderr}");
    Ok(stderr)
}

/// The TLS front's runtime, shut down without blocking when the test ends (a runtime may not be
/// dropped inside another).
struct Front(Option<tokio::runtime::Runtime>);

impl Drop for Front {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// Producer spans the receiver holds for `id`.
fn spans_for(received: &Received, id: Uuid) -> usize {
    received
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, s)| string_attr(&s.attributes, "messaging.message.id") == Some(id.to_string()))
        .count()
}

/// An `https://` collector that verifies clients: the relay trusts it through
/// `OTEL_EXPORTER_OTLP_CERTIFICATE` and presents `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` and
/// `_KEY`. Trusting another CA, or presenting no client certificate, exports nothing (the drain
/// flushes its exporter before it exits, so "nothing" is final when it returns).
#[tokio::test]
async fn an_https_collector_gets_the_spans_only_over_verified_tls() -> TestResult {
    let received: Received = Arc::default();
    let plain = otlp_receiver(received.clone()).await?;
    let inner: u16 = plain.rsplit(':').next().unwrap_or_default().parse()?;
    let pki = outbox_e2e::private::Pki::new()?;
    let port = outbox_e2e::private::free_port()?;
    let _front = Front(Some(outbox_e2e::private::tls_front(
        &pki, port, inner, true,
    )?));
    let otlp = format!("https://{}:{port}", outbox_e2e::private::TLS_HOST);

    let dir = tempfile::tempdir()?;
    let enqueue = |path: &std::path::Path, n: usize| -> Result<Uuid, BoxError> {
        let sqlite = outbox::sqlite::SqliteConfig::default();
        let mut conn = outbox::sqlite::open_connection(path, &sqlite)?;
        outbox::sqlite::migrate(&conn, &sqlite)?;
        let msg = message(n, 1);
        let tx = conn.transaction()?;
        outbox::sqlite::enqueue(&tx, &sqlite, &msg)?;
        tx.commit()?;
        Ok(msg.id)
    };

    // Another CA: the collector's certificate is refused, nothing arrives.
    let wrong = dir.path().join("wrong.db");
    let id = enqueue(&wrong, 1)?;
    drain_tls(
        &wrong,
        &otlp,
        &[
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", &pki.other_ca),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", &pki.client_cert),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", &pki.client_key),
        ],
    )
    .await?;
    assert_eq!(
        spans_for(&received, id),
        0,
        "exported past a CA the relay does not trust"
    );

    // The right CA but no client certificate: the collector refuses the relay.
    let anonymous = dir.path().join("anonymous.db");
    let id = enqueue(&anonymous, 2)?;
    drain_tls(
        &anonymous,
        &otlp,
        &[("OTEL_EXPORTER_OTLP_CERTIFICATE", &pki.ca)],
    )
    .await?;
    assert_eq!(
        spans_for(&received, id),
        0,
        "a collector that verifies clients took an anonymous one"
    );

    // Both: the producer span arrives.
    let good = dir.path().join("good.db");
    let id = enqueue(&good, 3)?;
    drain_tls(
        &good,
        &otlp,
        &[
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", &pki.ca),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", &pki.client_cert),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", &pki.client_key),
        ],
    )
    .await?;
    assert_eq!(spans_for(&received, id), 1, "no producer span over https");
    let service = received
        .lock()
        .unwrap()
        .iter()
        .find(|(_, s)| string_attr(&s.attributes, "messaging.message.id") == Some(id.to_string()))
        .map(|(service, _)| service.clone());
    assert_eq!(service.as_deref(), Some("outbox-relay-tls-test"));
    Ok(())
}
