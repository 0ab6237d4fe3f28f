//! W3C trace context for outbox messages, written once for every store, the relay and the
//! consumers.
//!
//! - **Enqueue** ([`capture`]): the backends' enqueue functions (feature `otel`) call it on the
//!   batch they are given. When the caller is inside a span, through `tracing` with the
//!   [`tracing-opentelemetry`](tracing_opentelemetry) layer or through the `opentelemetry` API's
//!   current [`Context`], each message that has no `traceparent` header of its own gets the
//!   span's `traceparent` (and `tracestate`, when set). Without a span the batch is passed on
//!   untouched and nothing is copied.
//! - **Relay and consumers** ([`extract`], [`inject`]): read the context a message carries and
//!   write another one (the relay's producer span's) in its place.
//!
//! ```
//! use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
//! use opentelemetry::Context;
//! use outbox_traits::NewMessage;
//!
//! let span = SpanContext::new(
//!     TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
//!     SpanId::from_hex("00f067aa0ba902b7").unwrap(),
//!     TraceFlags::SAMPLED,
//!     true,
//!     TraceState::NONE,
//! );
//! let _attached = Context::new().with_remote_span_context(span).attach();
//! let batch = [NewMessage::new("order", "o-1", "order.placed", serde_json::json!({}))];
//! let traced = outbox_otel::capture(&batch);
//! assert_eq!(
//!     traced[0].headers["traceparent"],
//!     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
//! );
//! ```

use std::borrow::Cow;
use std::collections::BTreeMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use outbox_traits::{NewMessage, TRACEPARENT_HEADER};
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub use opentelemetry;

/// The W3C header that carries vendor-specific trace data beside [`TRACEPARENT_HEADER`].
pub const TRACESTATE_HEADER: &str = "tracestate";

/// The caller's current trace context, if it is in a valid span: the current `tracing` span's
/// (when the subscriber has the OpenTelemetry layer), else the `opentelemetry` API's current
/// context.
pub fn current() -> Option<Context> {
    let span = tracing::Span::current();
    if !span.is_none() {
        let cx = span.context();
        if cx.span().span_context().is_valid() {
            return Some(cx);
        }
    }
    let cx = Context::current();
    cx.span().span_context().is_valid().then_some(cx)
}

/// Whether `headers` already carry a `traceparent` (in any letter case).
pub fn has_traceparent(headers: &BTreeMap<String, String>) -> bool {
    headers
        .keys()
        .any(|name| name.eq_ignore_ascii_case(TRACEPARENT_HEADER))
}

/// The batch with the caller's trace context in the headers of each message that has no
/// `traceparent` of its own; the batch itself (borrowed, nothing copied) when the caller is in
/// no span or every message already has one.
pub fn capture(messages: &[NewMessage]) -> Cow<'_, [NewMessage]> {
    let Some(cx) = current() else {
        return Cow::Borrowed(messages);
    };
    if messages.iter().all(|m| has_traceparent(&m.headers)) {
        return Cow::Borrowed(messages);
    }
    let mut context = BTreeMap::new();
    inject(&cx, &mut context);
    Cow::Owned(
        messages
            .iter()
            .map(|m| {
                let mut m = m.clone();
                if !has_traceparent(&m.headers) {
                    m.headers
                        .extend(context.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
                m
            })
            .collect(),
    )
}

/// Write `cx`'s span context into `headers` as `traceparent` (and `tracestate` when set),
/// replacing the ones there. Nothing is written for a context without a valid span.
pub fn inject(cx: &Context, headers: &mut BTreeMap<String, String>) {
    if !cx.span().span_context().is_valid() {
        return;
    }
    headers.retain(|name, _| {
        !name.eq_ignore_ascii_case(TRACEPARENT_HEADER)
            && !name.eq_ignore_ascii_case(TRACESTATE_HEADER)
    });
    TraceContextPropagator::new().inject_context(cx, &mut HeaderMap(headers));
}

/// The remote span context carried by `headers` (`traceparent`, `tracestate`, names in any
/// letter case), as a parent [`Context`]; `None` when there is none or it is malformed.
pub fn extract(headers: &BTreeMap<String, String>) -> Option<Context> {
    let cx = TraceContextPropagator::new().extract(&HeaderRef(headers));
    cx.span().span_context().is_valid().then_some(cx)
}

struct HeaderMap<'a>(&'a mut BTreeMap<String, String>);

impl Injector for HeaderMap<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator writes an empty `tracestate` when there is none: leave it out.
        if !value.is_empty() {
            self.0.insert(key.to_owned(), value);
        }
    }
}

struct HeaderRef<'a>(&'a BTreeMap<String, String>);

impl Extractor for HeaderRef<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(key))
            .map(|(_, value)| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use serde_json::json;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn remote(state: TraceState) -> Context {
        Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            state,
        ))
    }

    fn message() -> NewMessage {
        NewMessage::new("order", "o-1", "order.placed", json!({"n": 1}))
    }

    #[test]
    fn no_span_no_copy() {
        let batch = [message()];
        assert!(matches!(capture(&batch), Cow::Borrowed(_)));
    }

    #[test]
    fn the_callers_context_fills_messages_without_their_own() {
        let state = TraceState::from_key_value([("vendor", "x")]).unwrap();
        let _guard = remote(state).attach();
        let own = "00-11111111111111111111111111111111-2222222222222222-01";
        let batch = [message(), message().with_header("TraceParent", own)];
        let traced = capture(&batch);
        assert_eq!(traced[0].headers[TRACEPARENT_HEADER], PARENT);
        assert_eq!(traced[0].headers[TRACESTATE_HEADER], "vendor=x");
        assert_eq!(
            traced[1].headers, batch[1].headers,
            "an explicit one is kept"
        );
        assert_eq!(traced[0].payload, batch[0].payload);
    }

    #[test]
    fn all_explicit_no_copy() {
        let _guard = remote(TraceState::NONE).attach();
        let batch = [message().with_header(TRACEPARENT_HEADER, PARENT)];
        assert!(matches!(capture(&batch), Cow::Borrowed(_)));
    }

    #[test]
    fn a_tracing_span_without_the_layer_falls_back_to_the_api_context() {
        let subscriber = tracing_subscriber::registry();
        tracing::subscriber::with_default(subscriber, || {
            let _guard = remote(TraceState::NONE).attach();
            let span = tracing::info_span!("service");
            let _entered = span.enter();
            let traced = capture(std::slice::from_ref(&message())).into_owned();
            assert_eq!(traced[0].headers[TRACEPARENT_HEADER], PARENT);
        });
    }

    #[test]
    fn extract_and_inject_round_trip() {
        let mut headers = BTreeMap::from([("TRACEPARENT".to_owned(), PARENT.to_owned())]);
        let cx = extract(&headers).unwrap();
        assert_eq!(
            cx.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        inject(&cx, &mut headers);
        assert_eq!(
            headers,
            BTreeMap::from([(TRACEPARENT_HEADER.to_owned(), PARENT.to_owned())])
        );
        let bad = BTreeMap::from([(TRACEPARENT_HEADER.to_owned(), "00-zz".to_owned())]);
        assert!(extract(&bad).is_none());
        inject(&Context::new(), &mut headers);
        assert_eq!(headers[TRACEPARENT_HEADER], PARENT, "no span, no change");
    }
}
