//! Metrics of the consumers, through the `metrics` facade (install any recorder, e.g.
//! `metrics-exporter-prometheus`, as for the relay). Every metric carries the
//! [`CONSUMER_LABEL`] label.

use metrics::{counter, describe_counter, describe_histogram, histogram, Unit};

use crate::delivery::{Delivery, Source};

/// The label naming the consumer on every metric: the NATS durable consumer, the Redis group or
/// the Kafka group.
pub const CONSUMER_LABEL: &str = "consumer";

/// Messages whose handler returned [`Handled::Processed`](crate::Handled::Processed) (then
/// acknowledged).
pub const PROCESSED_TOTAL: &str = "outbox_consumer_processed_total";
/// Messages whose handler returned [`Handled::Duplicate`](crate::Handled::Duplicate): duplicates
/// dropped.
pub const DUPLICATES_TOTAL: &str = "outbox_consumer_duplicates_total";
/// Handler errors followed by a retry; label `kind` is `transient` (counted toward the maximum)
/// or `unavailable` (not counted).
pub const RETRIED_TOTAL: &str = "outbox_consumer_retried_total";
/// Messages dead-lettered; label `cause` is `handler` (permanent error, panic or attempts used
/// up) or `undecodable`.
pub const DEAD_TOTAL: &str = "outbox_consumer_dead_total";
/// Broker calls (fetch, acknowledge, dead-letter) that failed and were retried without costing
/// the message an attempt.
pub const BROKER_ERRORS_TOTAL: &str = "outbox_consumer_broker_errors_total";
/// Duration of each handler call, in seconds.
pub const HANDLER_SECONDS: &str = "outbox_consumer_handler_seconds";

/// Histogram buckets (seconds) fit for [`HANDLER_SECONDS`]: 0.5 ms to 30 s.
pub const HANDLER_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Register descriptions and units of the consumer metrics with the installed recorder. The
/// consumers call it when they start; call it yourself if you install the recorder later.
pub fn describe_metrics() {
    describe_counter!(
        PROCESSED_TOTAL,
        Unit::Count,
        "Messages processed by the handler and acknowledged."
    );
    describe_counter!(
        DUPLICATES_TOTAL,
        Unit::Count,
        "Duplicate messages dropped by the handler and acknowledged."
    );
    describe_counter!(
        RETRIED_TOTAL,
        Unit::Count,
        "Handler errors followed by a retry (kind: transient or unavailable)."
    );
    describe_counter!(
        DEAD_TOTAL,
        Unit::Count,
        "Messages dead-lettered (cause: handler or undecodable)."
    );
    describe_counter!(
        BROKER_ERRORS_TOTAL,
        Unit::Count,
        "Broker calls that failed and were retried."
    );
    describe_histogram!(
        HANDLER_SECONDS,
        Unit::Seconds,
        "Duration of each handler call."
    );
}

/// The span a handler call runs in: `outbox_handle`, a CONSUMER span in the OpenTelemetry
/// messaging conventions (`process <destination>`, with `messaging.system`,
/// `messaging.destination.name`, `messaging.message.id`, `messaging.consumer.group.name`).
/// With feature `otel` its parent is the trace context the message carries (`traceparent`, the
/// relay's producer span), so the handler continues the trace of the request that enqueued it;
/// the `tracing-opentelemetry` layer exports it.
pub(crate) fn handler_span(consumer: &str, delivery: &Delivery) -> tracing::Span {
    let (system, destination) = match &delivery.source {
        Source::Nats { subject, .. } => ("nats", subject.as_str()),
        Source::Redis { stream, .. } => ("redis", stream.as_str()),
        Source::Kafka { topic, .. } => ("kafka", topic.as_str()),
    };
    let span = tracing::info_span!(
        "outbox_handle",
        otel.kind = "consumer",
        otel.name = %format_args!("process {destination}"),
        messaging.system = system,
        messaging.operation.type = "process",
        messaging.destination.name = destination,
        messaging.message.id = %delivery.message_id,
        messaging.consumer.group.name = consumer,
        attempt = delivery.attempt,
    );
    #[cfg(feature = "otel")]
    if let Some(parent) = outbox_otel::extract(&delivery.headers) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        // Fails only for a span already started by the layer, which this one is not.
        let _ = span.set_parent(parent);
    }
    span
}

/// The metric handles of one consumer.
#[derive(Debug, Clone)]
pub(crate) struct Meters {
    consumer: String,
}

impl Meters {
    pub(crate) fn new(consumer: &str) -> Self {
        describe_metrics();
        Self {
            consumer: consumer.to_owned(),
        }
    }

    pub(crate) fn processed(&self) {
        counter!(PROCESSED_TOTAL, CONSUMER_LABEL => self.consumer.clone()).increment(1);
    }

    pub(crate) fn duplicate(&self) {
        counter!(DUPLICATES_TOTAL, CONSUMER_LABEL => self.consumer.clone()).increment(1);
    }

    pub(crate) fn retried(&self, counted: bool) {
        let kind = if counted { "transient" } else { "unavailable" };
        counter!(RETRIED_TOTAL, CONSUMER_LABEL => self.consumer.clone(), "kind" => kind)
            .increment(1);
    }

    pub(crate) fn dead(&self, undecodable: bool) {
        let cause = if undecodable {
            "undecodable"
        } else {
            "handler"
        };
        counter!(DEAD_TOTAL, CONSUMER_LABEL => self.consumer.clone(), "cause" => cause)
            .increment(1);
    }

    pub(crate) fn broker_error(&self) {
        counter!(BROKER_ERRORS_TOTAL, CONSUMER_LABEL => self.consumer.clone()).increment(1);
    }

    pub(crate) fn handler_seconds(&self, seconds: f64) {
        histogram!(HANDLER_SECONDS, CONSUMER_LABEL => self.consumer.clone()).record(seconds);
    }
}
