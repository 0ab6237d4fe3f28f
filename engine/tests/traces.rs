//! The relay's producer spans (feature `otel`), against the in-memory reference store and
//! publisher (the end-to-end test on real servers is cli/tests/traces.rs): what the publisher
//! receives, each span's parent, attributes and status, the batch span's links, and that a
//! relay without traces leaves the headers alone.

use std::collections::HashMap;
use std::sync::Arc;

use opentelemetry::global::BoxedTracer;
use opentelemetry::trace::{SpanKind, Status, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_engine::{Relay, RelayConfig, Traces};
use outbox_memory::{MemoryStore, RecordingPublisher};
use outbox_routing::RoutingTemplate;
use outbox_traits::{NewMessage, PublishOutcome, TRACEPARENT_HEADER};
use uuid::Uuid;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

fn msg(key: &str) -> NewMessage {
    NewMessage::new("order", key, "order.placed", serde_json::json!({}))
        .with_header(TRACEPARENT_HEADER, format!("00-{TRACE}-{PARENT}-01"))
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

fn traced(provider: &SdkTracerProvider) -> Traces {
    Traces::with_tracer(
        BoxedTracer::new(Box::new(provider.tracer("outbox-relay"))),
        "memory",
    )
    .with_destination(RoutingTemplate::parse("outbox.{aggregate_type}").unwrap())
}

#[tokio::test]
async fn a_batch_gets_a_span_per_message_and_a_linked_send_span() {
    let spans = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(spans.clone())
        .build();
    let store = Arc::new(MemoryStore::new());
    let publisher = Arc::new(RecordingPublisher::new());
    let (ok, refused, untraced) = (msg("o-1"), msg("o-2"), {
        let mut m = msg("o-3");
        m.headers.clear();
        m
    });
    publisher.fail_next(refused.id, PublishOutcome::permanent("too large"));
    store
        .enqueue([ok.clone(), refused.clone(), untraced.clone()])
        .unwrap();
    let relay = Relay::new(store, publisher.clone(), RelayConfig::default())
        .unwrap()
        .with_traces(traced(&provider));
    relay.run_until_idle().await.unwrap();

    let finished = spans.get_finished_spans().unwrap();
    let by_id: HashMap<String, &SpanData> = finished
        .iter()
        .filter_map(|s| Some((attr(s, "messaging.message.id")?, s)))
        .collect();
    let sent: HashMap<Uuid, String> = publisher
        .sent()
        .into_iter()
        .map(|d| (d.message.id, d.message.headers[TRACEPARENT_HEADER].clone()))
        .collect();
    for m in [&ok, &refused] {
        let span = by_id[&m.id.to_string()];
        assert_eq!(span.span_kind, SpanKind::Producer);
        assert_eq!(span.name, "create outbox.order");
        assert_eq!(span.span_context.trace_id().to_string(), TRACE);
        assert_eq!(
            span.parent_span_id.to_string(),
            PARENT,
            "child of the enqueue"
        );
        assert_eq!(attr(span, "messaging.system").as_deref(), Some("memory"));
        assert_eq!(
            attr(span, "messaging.destination.name").as_deref(),
            Some("outbox.order")
        );
        assert_eq!(
            sent[&m.id],
            format!("00-{TRACE}-{}-01", span.span_context.span_id()),
            "the broker gets the producer span's context"
        );
    }
    let failed = by_id[&refused.id.to_string()];
    assert!(matches!(&failed.status, Status::Error { description } if description == "too large"));
    assert_eq!(attr(failed, "error.type").as_deref(), Some("permanent"));
    assert_eq!(by_id[&ok.id.to_string()].status, Status::Unset);
    // No context at enqueue: a new trace, whose context still goes to the broker.
    let root = by_id[&untraced.id.to_string()];
    assert_ne!(root.span_context.trace_id().to_string(), TRACE);
    assert!(sent[&untraced.id].contains(&root.span_context.trace_id().to_string()));

    let batch = finished
        .iter()
        .find(|s| attr(s, "messaging.batch.message_count").is_some())
        .expect("a send span for the batch");
    assert_eq!(batch.span_kind, SpanKind::Client);
    assert_eq!(batch.name, "send outbox.order");
    assert_eq!(
        attr(batch, "messaging.batch.message_count").as_deref(),
        Some("3")
    );
    assert!(matches!(batch.status, Status::Error { .. }));
    let mut linked: Vec<_> = batch
        .links
        .iter()
        .map(|l| l.span_context.span_id().to_string())
        .collect();
    let mut want: Vec<_> = [&ok, &refused, &untraced]
        .iter()
        .map(|m| by_id[&m.id.to_string()].span_context.span_id().to_string())
        .collect();
    linked.sort();
    want.sort();
    assert_eq!(linked, want);
}

#[tokio::test]
async fn without_traces_the_headers_go_out_as_enqueued() {
    let store = Arc::new(MemoryStore::new());
    let publisher = Arc::new(RecordingPublisher::new());
    let m = msg("o-1");
    store.enqueue([m.clone()]).unwrap();
    let relay = Relay::new(store, publisher.clone(), RelayConfig::default()).unwrap();
    relay.run_until_idle().await.unwrap();
    assert_eq!(publisher.sent()[0].message.headers, m.headers);
}
