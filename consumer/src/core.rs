//! The broker-independent part of every consumer: call the handler, retry, decide between
//! acknowledging and dead-lettering, and run ordering lanes side by side.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::delivery::{DecodeError, Delivery};
use crate::handler::{FailureKind, Handled, Handler, HandlerError};
use crate::options::RetryPolicy;
use crate::telemetry::Meters;

/// The pause between attempts of a failing broker call (acknowledge, dead-letter, fetch):
/// doubling from 50 ms up to this cap.
pub(crate) const BROKER_BACKOFF_CAP: Duration = Duration::from_secs(2);

/// What to do with a message once the handler is done with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Acknowledge it: the handler returned success.
    Ack,
    /// Dead-letter it with `reason`, after `attempts` handler calls (0: undecodable), then
    /// acknowledge it.
    Dead { reason: String, attempts: u32 },
    /// The consumer is stopping: leave the message unacknowledged (it comes again).
    Stopped,
}

/// The handler and its policy, shared by the lanes of one consumer.
pub(crate) struct Core {
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) retry: RetryPolicy,
    pub(crate) meters: Meters,
    pub(crate) shutdown: CancellationToken,
    pub(crate) name: String,
}

impl Core {
    /// Handle one decoded (or undecodable) message to its verdict. `progress` is called before
    /// each retry pause and then every `progress_every` during it, so that a broker with an
    /// acknowledgement deadline (NATS) does not redeliver the message meanwhile.
    pub(crate) async fn settle<P, F>(
        &self,
        decoded: Result<Delivery, DecodeError>,
        progress_every: Option<Duration>,
        progress: P,
    ) -> Verdict
    where
        P: Fn() -> F,
        F: Future<Output = ()>,
    {
        let mut delivery = match decoded {
            Ok(delivery) => delivery,
            Err(e) => {
                tracing::warn!(consumer = %self.name, error = %e, "dead-lettering an undecodable message");
                self.meters.dead(true);
                return Verdict::Dead {
                    reason: e.to_string(),
                    attempts: 0,
                };
            }
        };
        let mut unavailable_since: Option<Instant> = None;
        let mut unavailable_tries = 0u32;
        loop {
            let started = Instant::now();
            let result = AssertUnwindSafe(self.handler.handle(&delivery))
                .catch_unwind()
                .instrument(crate::telemetry::handler_span(&self.name, &delivery))
                .await;
            self.meters.handler_seconds(started.elapsed().as_secs_f64());
            let error = match result {
                Ok(Ok(Handled::Processed)) => {
                    self.meters.processed();
                    return Verdict::Ack;
                }
                Ok(Ok(Handled::Duplicate)) => {
                    self.meters.duplicate();
                    return Verdict::Ack;
                }
                Ok(Err(error)) => error,
                Err(panic) => HandlerError::permanent(format!(
                    "handler panicked: {}",
                    panic_text(panic.as_ref())
                )),
            };
            let counted = match error.kind {
                FailureKind::Permanent => {
                    return self.give_up(&delivery, "permanent handler error", &error);
                }
                FailureKind::Transient => true,
                FailureKind::Unavailable => {
                    match (self.retry.unavailable_budget, unavailable_since) {
                        (Some(budget), Some(since)) => since.elapsed() >= budget,
                        _ => false,
                    }
                }
            };
            let pause = if counted {
                unavailable_since = None;
                unavailable_tries = 0;
                if delivery.attempt >= self.retry.max_attempts {
                    return self.give_up(
                        &delivery,
                        &format!("gave up after {} attempts", delivery.attempt),
                        &error,
                    );
                }
                let pause = self.retry.delay(delivery.attempt);
                delivery.attempt += 1;
                pause
            } else {
                unavailable_since.get_or_insert_with(Instant::now);
                unavailable_tries = unavailable_tries.saturating_add(1);
                self.retry.delay(unavailable_tries)
            };
            self.meters.retried(counted);
            tracing::warn!(
                consumer = %self.name,
                message_id = %delivery.message_id,
                attempt = delivery.attempt,
                counted,
                error = %error,
                "handler failed; retrying after {pause:?}"
            );
            if !self
                .pause_with_progress(pause, progress_every, &progress)
                .await
            {
                return Verdict::Stopped;
            }
        }
    }

    fn give_up(&self, delivery: &Delivery, why: &str, error: &HandlerError) -> Verdict {
        tracing::warn!(
            consumer = %self.name,
            message_id = %delivery.message_id,
            attempt = delivery.attempt,
            error = %error,
            "dead-lettering message: {why}"
        );
        self.meters.dead(false);
        Verdict::Dead {
            reason: format!("{why}: {}", error.message),
            attempts: delivery.attempt,
        }
    }

    async fn pause_with_progress<P, F>(
        &self,
        pause: Duration,
        every: Option<Duration>,
        progress: &P,
    ) -> bool
    where
        P: Fn() -> F,
        F: Future<Output = ()>,
    {
        let end = Instant::now() + pause;
        loop {
            progress().await;
            let left = end.saturating_duration_since(Instant::now());
            let step = every.map_or(left, |every| every.min(left));
            if !self.pause(step).await {
                return false;
            }
            if Instant::now() >= end {
                return true;
            }
        }
    }

    /// Sleep `pause`; `false` when the consumer is told to stop first.
    pub(crate) async fn pause(&self, pause: Duration) -> bool {
        tokio::select! {
            () = self.shutdown.cancelled() => false,
            () = tokio::time::sleep(pause) => true,
        }
    }

    /// Run a broker call until it succeeds (its failures cost the message no attempt), pausing
    /// between tries; `None` when the consumer stops first.
    pub(crate) async fn until_ok<T, E, F, Fut>(&self, what: &str, mut call: F) -> Option<T>
    where
        E: std::fmt::Display,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut tries = 0u32;
        loop {
            match call().await {
                Ok(value) => return Some(value),
                Err(e) => {
                    tries = tries.saturating_add(1);
                    self.meters.broker_error();
                    let pause = broker_pause(tries);
                    tracing::warn!(consumer = %self.name, error = %e, "{what} failed; retrying in {pause:?}");
                    if !self.pause(pause).await {
                        return None;
                    }
                }
            }
        }
    }
}

/// The pause after `tries` failed broker calls in a row.
pub(crate) fn broker_pause(tries: u32) -> Duration {
    let exp = tries.saturating_sub(1).min(10);
    Duration::from_millis(50u64.saturating_mul(1 << exp)).min(BROKER_BACKOFF_CAP)
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "(no message)".to_owned()
    }
}

/// Run `work` over `items` in ordering lanes: items of one lane (same `lane` key, in the order
/// given) one after the other, up to `concurrency` lanes at once. An item whose key is `None`
/// is a lane of its own. A lane stops at the first item for which `work` says `false` (the
/// consumer is stopping); the results of the items done are returned, lane by lane.
pub(crate) async fn in_lanes<T, K, R, L, W, Fut>(
    items: Vec<T>,
    lane: L,
    concurrency: usize,
    work: W,
) -> Vec<R>
where
    K: Hash + Eq,
    L: Fn(&T) -> Option<K>,
    W: Fn(T) -> Fut,
    Fut: Future<Output = (R, bool)>,
{
    let mut lanes: Vec<Vec<T>> = Vec::new();
    let mut index: HashMap<K, usize> = HashMap::new();
    for item in items {
        match lane(&item) {
            Some(key) => {
                let at = *index.entry(key).or_insert_with(|| {
                    lanes.push(Vec::new());
                    lanes.len() - 1
                });
                lanes[at].push(item);
            }
            None => lanes.push(vec![item]),
        }
    }
    let work = &work;
    futures::stream::iter(lanes)
        .map(|lane| async move {
            let mut done = Vec::with_capacity(lane.len());
            for item in lane {
                let (result, go_on) = work(item).await;
                done.push(result);
                if !go_on {
                    break;
                }
            }
            done
        })
        .buffer_unordered(concurrency.max(1))
        .flat_map(futures::stream::iter)
        .collect()
        .await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::delivery::Source;
    use crate::handler::handler_fn;

    fn delivery() -> Delivery {
        Delivery {
            message_id: uuid::Uuid::now_v7(),
            event_type: "e".into(),
            aggregate_type: "a".into(),
            aggregate_id: "1".into(),
            partition_key: None,
            headers: Default::default(),
            payload: serde_json::Value::Null,
            binary: None,
            source: Source::Redis {
                stream: "s".into(),
                entry_id: "1-0".into(),
            },
            attempt: 1,
        }
    }

    fn core(handler: impl Handler + 'static, max_attempts: u32) -> Core {
        Core {
            handler: Arc::new(handler),
            retry: RetryPolicy {
                max_attempts,
                initial_backoff: Duration::ZERO,
                max_backoff: Duration::ZERO,
                jitter: 0.0,
                unavailable_budget: None,
            },
            meters: Meters::new("unit"),
            shutdown: CancellationToken::new(),
            name: "unit".into(),
        }
    }

    async fn settle(core: &Core) -> Verdict {
        core.settle(Ok(delivery()), None, || async {}).await
    }

    #[tokio::test]
    async fn unavailable_errors_cost_no_attempt_and_transient_ones_do() {
        let calls = Arc::new(AtomicU32::new(0));
        let seen = calls.clone();
        // 10 outage errors, then transient errors for ever: 2 counted attempts, then dead.
        let core = core(
            handler_fn(move |d| {
                let n = seen.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n < 10 {
                        assert_eq!(d.attempt, 1);
                        Err(HandlerError::unavailable("db down"))
                    } else {
                        Err(HandlerError::transient(format!("boom {}", d.attempt)))
                    }
                }
            }),
            2,
        );
        let verdict = settle(&core).await;
        assert_eq!(
            verdict,
            Verdict::Dead {
                reason: "gave up after 2 attempts: boom 2".into(),
                attempts: 2
            }
        );
        assert_eq!(calls.load(Ordering::SeqCst), 12);
    }

    #[tokio::test]
    async fn an_exhausted_unavailable_budget_counts_attempts() {
        let mut core = core(
            handler_fn(|_| async { Err(HandlerError::unavailable("db down")) }),
            3,
        );
        core.retry.unavailable_budget = Some(Duration::ZERO);
        let verdict = settle(&core).await;
        assert!(
            matches!(verdict, Verdict::Dead { attempts: 3, .. }),
            "{verdict:?}"
        );
    }

    #[tokio::test]
    async fn panics_and_permanent_errors_dead_letter_at_once() {
        let core1 = core(handler_fn(|_| async { panic!("bug 7") }), 5);
        assert_eq!(
            settle(&core1).await,
            Verdict::Dead {
                reason: "permanent handler error: handler panicked: bug 7".into(),
                attempts: 1
            }
        );
        let core2 = core(
            handler_fn(|_| async { Err(HandlerError::permanent("no such account")) }),
            5,
        );
        assert!(matches!(
            settle(&core2).await,
            Verdict::Dead { attempts: 1, .. }
        ));
    }

    #[tokio::test]
    async fn a_stopping_consumer_leaves_the_message_unacknowledged() {
        let mut core = core(
            handler_fn(|_| async { Err(HandlerError::transient("x")) }),
            5,
        );
        core.retry.initial_backoff = Duration::from_secs(3600);
        core.retry.max_backoff = Duration::from_secs(3600);
        core.shutdown.cancel();
        assert_eq!(settle(&core).await, Verdict::Stopped);
    }

    #[tokio::test]
    async fn lanes_keep_order_within_a_key() {
        let items: Vec<(Option<u8>, u32)> = vec![
            (Some(1), 1),
            (Some(2), 1),
            (None, 9),
            (Some(1), 2),
            (Some(1), 3),
        ];
        let done = in_lanes(
            items,
            |(k, _)| *k,
            4,
            |item| async move { (item, item.1 != 2) },
        )
        .await;
        let key1: Vec<u32> = done
            .iter()
            .filter(|(k, _)| *k == Some(1))
            .map(|i| i.1)
            .collect();
        // The lane of key 1 stops after its item 2 (work said stop): item 3 is not done.
        assert_eq!(key1, vec![1, 2]);
        assert_eq!(done.len(), 4);
    }
}
