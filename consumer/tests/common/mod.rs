//! Support shared by the broker tests: outbox messages, a scripted handler that reports every
//! call on a channel, and waits on those reports.
#![allow(dead_code, missing_docs)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use outbox_consumer::{
    async_trait, ConsumerOptions, Delivery, Handled, Handler, HandlerError, RetryPolicy,
};
use outbox_traits::{Binary, Message};
use tokio::sync::mpsc;
use uuid::Uuid;

/// The longest a test waits for an event before it fails (a bound for a failure report, not
/// a timed assertion: passing tests go on as soon as the event is there).
pub const WAIT: Duration = Duration::from_secs(60);

pub fn suffix() -> String {
    Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// An outbox message as a store hands it to the relay.
pub fn message(key: Option<&str>, seq: i64, payload: serde_json::Value) -> Message {
    let mut headers = BTreeMap::new();
    headers.insert(
        "traceparent".to_owned(),
        format!("00-{seq:032x}-{seq:016x}-01"),
    );
    headers.insert("tenant".to_owned(), "acme".to_owned());
    Message {
        id: Uuid::now_v7(),
        seq,
        aggregate_type: "order".into(),
        aggregate_id: format!("order-{seq}"),
        event_type: "order.placed".into(),
        payload: payload.to_string(),
        binary: None,
        headers,
        partition_key: key.map(str::to_owned),
        dedup_key: None,
        attempts: 0,
        created_at: Utc::now(),
    }
}

/// Bytes of a binary payload that are not UTF-8: a NUL, 0xff, a lone continuation byte, a
/// truncated sequence.
pub const BINARY: &[u8] = &[0x00, 0xff, 0x80, 0xc3, 0x28, b'{', 0xe2, 0x82, 0x00, b'\n'];

/// An outbox message with a binary payload ([`BINARY`], `application/x-protobuf`).
pub fn binary_message(key: Option<&str>, seq: i64) -> Message {
    let mut msg = message(key, seq, serde_json::Value::Null);
    msg.binary = Some(Binary::new("application/x-protobuf", BINARY));
    msg
}

/// Checks that `delivery` carries exactly what `msg` had: its JSON payload, or its binary
/// payload's bytes and content type.
pub fn assert_decoded(delivery: &Delivery, msg: &Message) {
    assert_eq!(delivery.message_id, msg.id);
    assert_eq!(delivery.event_type, msg.event_type);
    assert_eq!(delivery.aggregate_type, msg.aggregate_type);
    assert_eq!(delivery.aggregate_id, msg.aggregate_id);
    assert_eq!(delivery.partition_key, msg.partition_key);
    assert_eq!(delivery.headers, msg.headers);
    assert_eq!(delivery.binary, msg.binary, "binary payload of {}", msg.id);
    if let Some(binary) = &msg.binary {
        assert_eq!(delivery.body().as_ref(), binary.data.as_slice());
        assert_eq!(delivery.payload, serde_json::Value::Null);
        return;
    }
    let payload: serde_json::Value = serde_json::from_str(&msg.payload).unwrap();
    assert_eq!(delivery.payload, payload);
}

/// Retries without waiting, so that a test of retries takes no time.
pub fn fast_options(max_attempts: u32) -> ConsumerOptions {
    ConsumerOptions {
        retry: RetryPolicy {
            max_attempts,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(5),
            jitter: 0.0,
            unavailable_budget: None,
        },
        batch: 50,
        concurrency: 4,
    }
}

/// What the scripted handler does with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Transient errors on the first `n` attempts, then success.
    FailFirst(u32),
    /// Always a transient error.
    AlwaysFail,
    /// A permanent error.
    Poison,
    /// Never returns (a consumer that dies while handling).
    Hang,
    /// Already processed: a duplicate dropped.
    Duplicate,
    /// `Unavailable` errors (the database is down) on the first `n` calls, then success.
    UnavailableFirst(u32),
}

/// One handler call, reported on the channel (before the handler returns).
#[derive(Debug, Clone)]
pub struct Call {
    pub delivery: Delivery,
}

/// A handler that follows a plan per message id (default: success) and reports every call.
#[derive(Clone)]
pub struct Scripted {
    plans: Arc<Mutex<HashMap<Uuid, Plan>>>,
    calls: mpsc::UnboundedSender<Call>,
}

impl Scripted {
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Call>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Self {
                plans: Arc::default(),
                calls: tx,
            },
            rx,
        )
    }

    pub fn plan(&self, id: Uuid, plan: Plan) {
        self.plans.lock().unwrap().insert(id, plan);
    }
}

#[async_trait]
impl Handler for Scripted {
    async fn handle(&self, delivery: &Delivery) -> Result<Handled, HandlerError> {
        let plan = self
            .plans
            .lock()
            .unwrap()
            .get(&delivery.message_id)
            .copied();
        let _ = self.calls.send(Call {
            delivery: delivery.clone(),
        });
        match plan {
            Some(Plan::FailFirst(n)) if delivery.attempt <= n => Err(HandlerError::transient(
                format!("induced failure {}", delivery.attempt),
            )),
            Some(Plan::AlwaysFail) => Err(HandlerError::transient("always fails")),
            Some(Plan::Poison) => Err(HandlerError::permanent("poison: cannot apply")),
            Some(Plan::Hang) => futures::future::pending().await,
            Some(Plan::Duplicate) => Ok(Handled::Duplicate),
            Some(Plan::UnavailableFirst(n)) => {
                let mut plans = self.plans.lock().unwrap();
                if n == 0 {
                    Ok(Handled::Processed)
                } else {
                    plans.insert(delivery.message_id, Plan::UnavailableFirst(n - 1));
                    Err(HandlerError::unavailable("database down"))
                }
            }
            _ => Ok(Handled::Processed),
        }
    }
}

/// Receive calls until `done` says the collected ones are enough.
pub async fn calls_until(
    rx: &mut mpsc::UnboundedReceiver<Call>,
    mut done: impl FnMut(&[Call]) -> bool,
) -> Vec<Call> {
    let mut seen = Vec::new();
    let outcome = tokio::time::timeout(WAIT, async {
        while !done(&seen) {
            match rx.recv().await {
                Some(call) => seen.push(call),
                None => break,
            }
        }
    })
    .await;
    assert!(
        outcome.is_ok(),
        "timed out after {WAIT:?}; calls so far: {:?}",
        seen.iter()
            .map(|c| (c.delivery.message_id, c.delivery.attempt))
            .collect::<Vec<_>>()
    );
    seen
}

/// Calls of `id`, in order.
pub fn of(calls: &[Call], id: Uuid) -> Vec<&Delivery> {
    calls
        .iter()
        .map(|c| &c.delivery)
        .filter(|d| d.message_id == id)
        .collect()
}

/// Poll `check` until it returns `Some` (a server-side state the test waits for), or fail.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {WAIT:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
