//! Producer spans (feature `otel`): one span per message published, in the OpenTelemetry
//! messaging conventions, and the span's context in the message's headers for the consumer.
//!
//! For each message of a batch the relay starts a PRODUCER span whose parent is the context
//! the message carries (its `traceparent`, captured at enqueue), so the publish shows in the
//! trace of the request that enqueued it; the span's own context replaces the message's
//! `traceparent` before the publisher sends it, so a consumer continues the trace from the
//! publish. A batch of one message gets one `send` span; a larger batch gets a `create` span
//! per message and one `send` span (kind CLIENT) for the publish call, with
//! `messaging.batch.message_count` and a link to every message's span: the conventions'
//! shape for batches (a batch belongs to many traces, so it links to them rather than having
//! one parent). Each message span ends with the message's outcome: an error status for a
//! failed or ambiguous publish.
//!
//! Off unless [`Relay::with_traces`](crate::Relay::with_traces) is called; then spans go
//! through the tracer given (by default the global tracer provider's), and its sampler
//! decides which are recorded.

use std::borrow::Cow;
use std::sync::Arc;

use opentelemetry::global::{self, BoxedTracer};
use opentelemetry::trace::{Link, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};
use outbox_routing::RoutingTemplate;
use outbox_traits::{ErrorKind, Message, PublishOutcome};

use crate::shared::Shared;

/// `messaging.system`.
pub const MESSAGING_SYSTEM: &str = "messaging.system";
/// `messaging.destination.name`.
pub const MESSAGING_DESTINATION_NAME: &str = "messaging.destination.name";
/// `messaging.destination.template`.
pub const MESSAGING_DESTINATION_TEMPLATE: &str = "messaging.destination.template";
/// `messaging.message.id`.
pub const MESSAGING_MESSAGE_ID: &str = "messaging.message.id";
/// `messaging.batch.message_count`.
pub const MESSAGING_BATCH_MESSAGE_COUNT: &str = "messaging.batch.message_count";
/// `messaging.operation.type`: `create` or `send`.
pub const MESSAGING_OPERATION_TYPE: &str = "messaging.operation.type";
/// `messaging.operation.name`: `create` or `send`.
pub const MESSAGING_OPERATION_NAME: &str = "messaging.operation.name";
/// `error.type`: why a message's publish failed (`transient`, `permanent`, `ambiguous`).
pub const ERROR_TYPE: &str = "error.type";

/// The relay's producer spans: which tracer, which messaging system, and where messages go.
///
/// ```no_run
/// # use std::sync::Arc;
/// # fn f(relay: outbox_engine::Relay) -> Result<(), outbox_traits::Error> {
/// use outbox_engine::Traces;
/// use outbox_routing::RoutingTemplate;
/// // After installing a tracer provider (e.g. the OTLP exporter's) as the global one:
/// let traces = Traces::global("kafka")
///     .with_destination(RoutingTemplate::parse("outbox.{aggregate_type}")?);
/// let relay = relay.with_traces(traces);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Traces {
    tracer: BoxedTracer,
    system: Cow<'static, str>,
    destination: Option<RoutingTemplate>,
}

impl Traces {
    /// Spans through the global tracer provider's tracer `outbox-relay` (install the provider
    /// first: a tracer taken before stays a no-op), with `messaging.system` = `system` (e.g.
    /// `kafka`, `nats`, `redis`).
    pub fn global(system: impl Into<Cow<'static, str>>) -> Self {
        Self::with_tracer(global::tracer("outbox-relay"), system)
    }

    /// Spans through `tracer`.
    pub fn with_tracer(tracer: BoxedTracer, system: impl Into<Cow<'static, str>>) -> Self {
        Self {
            tracer,
            system: system.into(),
            destination: None,
        }
    }

    /// Name each message's destination (`messaging.destination.name`, and the template as
    /// `messaging.destination.template`) with the publisher's routing template, rendered for
    /// the message (before any sanitizing the broker's adapter applies).
    pub fn with_destination(mut self, template: RoutingTemplate) -> Self {
        self.destination = Some(template);
        self
    }

    fn common(&self, operation: &'static str) -> Vec<KeyValue> {
        let mut attributes = vec![
            KeyValue::new(MESSAGING_SYSTEM, self.system.clone()),
            KeyValue::new(MESSAGING_OPERATION_TYPE, operation),
            KeyValue::new(MESSAGING_OPERATION_NAME, operation),
        ];
        if let Some(template) = &self.destination {
            attributes.push(KeyValue::new(
                MESSAGING_DESTINATION_TEMPLATE,
                template.as_str().to_owned(),
            ));
        }
        attributes
    }

    fn span_name(&self, operation: &str, destination: Option<&str>) -> String {
        format!("{operation} {}", destination.unwrap_or(&self.system))
    }
}

/// The spans of one batch's publish, open until its outcomes are known.
pub(crate) struct BatchSpans {
    messages: Vec<Context>,
    batch: Option<Context>,
}

/// Start the spans of a batch and put each message span's context into the message's
/// headers. `None` (and nothing done) when traces are off.
pub(crate) fn start(shared: &Shared, messages: &mut [Message]) -> Option<BatchSpans> {
    let traces = shared.traces.as_deref()?;
    Some(start_spans(traces, messages))
}

fn start_spans(traces: &Traces, messages: &mut [Message]) -> BatchSpans {
    let single = messages.len() == 1;
    let operation = if single { "send" } else { "create" };
    let common = traces.common(operation);
    let mut spans = Vec::with_capacity(messages.len());
    for message in messages.iter_mut() {
        let parent = outbox_otel::extract(&message.headers).unwrap_or_default();
        let destination = traces.destination.as_ref().map(|t| t.render(message));
        let mut attributes = common.clone();
        attributes.push(KeyValue::new(MESSAGING_MESSAGE_ID, message.id.to_string()));
        if let Some(destination) = &destination {
            attributes.push(KeyValue::new(
                MESSAGING_DESTINATION_NAME,
                destination.clone(),
            ));
        }
        let span = traces
            .tracer
            .span_builder(traces.span_name(operation, destination.as_deref()))
            .with_kind(SpanKind::Producer)
            .with_attributes(attributes)
            .start_with_context(&traces.tracer, &parent);
        let cx = Context::new().with_span(span);
        outbox_otel::inject(&cx, &mut message.headers);
        spans.push(cx);
    }
    let batch = (!single && !messages.is_empty()).then(|| {
        let links = spans
            .iter()
            .map(|cx| Link::with_context(cx.span().span_context().clone()))
            .collect();
        let mut attributes = traces.common("send");
        attributes.push(KeyValue::new(
            MESSAGING_BATCH_MESSAGE_COUNT,
            messages.len() as i64,
        ));
        let destination = traces.destination.as_ref().and_then(|t| {
            let first = t.render(&messages[0]);
            messages[1..]
                .iter()
                .all(|m| t.render(m) == first)
                .then_some(first)
        });
        if let Some(destination) = &destination {
            attributes.push(KeyValue::new(
                MESSAGING_DESTINATION_NAME,
                destination.clone(),
            ));
        }
        let span = traces
            .tracer
            .span_builder(traces.span_name("send", destination.as_deref()))
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .with_links(links)
            .start_with_context(&traces.tracer, &Context::new());
        Context::new().with_span(span)
    });
    BatchSpans {
        messages: spans,
        batch,
    }
}

/// End the spans of a batch with its outcomes (spans without an outcome, from a publisher
/// that returned too few, end unset).
pub(crate) fn end(spans: Option<BatchSpans>, outcomes: &[PublishOutcome]) {
    let Some(spans) = spans else {
        return;
    };
    let mut failed = 0usize;
    for (cx, outcome) in spans.messages.iter().zip(outcomes) {
        let span = cx.span();
        let error = match outcome {
            PublishOutcome::Failed { kind, reason } => Some((
                match kind {
                    ErrorKind::Transient => "transient",
                    ErrorKind::Permanent => "permanent",
                },
                reason.as_str(),
            )),
            PublishOutcome::Ambiguous { reason } => Some(("ambiguous", reason.as_str())),
            _ => None,
        };
        if let Some((kind, reason)) = error {
            failed += 1;
            span.set_attribute(KeyValue::new(ERROR_TYPE, kind));
            span.set_status(Status::error(reason.to_owned()));
        }
        if matches!(outcome, PublishOutcome::NotAttempted) {
            span.set_attribute(KeyValue::new("outbox.not_attempted", true));
        }
    }
    for cx in &spans.messages {
        cx.span().end();
    }
    if let Some(batch) = spans.batch {
        let span = batch.span();
        if failed > 0 {
            span.set_attribute(KeyValue::new(ERROR_TYPE, "partial"));
            span.set_status(Status::error(format!(
                "{failed} of {} messages not published",
                spans.messages.len()
            )));
        }
        span.end();
    }
}

/// Shared by clones of a relay.
pub(crate) type SharedTraces = Option<Arc<Traces>>;
