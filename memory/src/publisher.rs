//! A publisher that records what it is asked to publish, with scripted outcomes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use outbox_traits::{attempt_in_key_order, Error, Message, PublishOutcome, Publisher};
use tokio::sync::watch;
use uuid::Uuid;

type OutcomeFn = Arc<dyn Fn(&Message) -> PublishOutcome + Send + Sync>;

/// One message the publisher sent, with the outcome it reported.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    /// The message as the relay handed it over (its `attempts` is the failed attempts so far).
    pub message: Message,
    /// What the publisher reported for it.
    pub outcome: PublishOutcome,
    /// Which delivery of this id this is, from 1: above 1 means a duplicate reached the broker.
    pub delivery: u32,
    /// Which `publish` call carried it, from 1.
    pub call: u64,
}

#[derive(Default)]
struct Log {
    sent: Vec<Delivery>,
    delivered_per_id: HashMap<Uuid, u32>,
    /// How many of `sent` reached the broker, kept as they are pushed (counting them on every
    /// publish made a long drain quadratic).
    reached: usize,
    calls: u64,
    scripted: HashMap<Uuid, VecDeque<PublishOutcome>>,
}

/// A [`Publisher`] for tests: acknowledges everything unless told otherwise, and records every
/// message it sends.
///
/// A message whose outcome is [`PublishOutcome::Acked`] or [`PublishOutcome::Ambiguous`] counts
/// as *published* (it reached the broker, or may have); a failed one was refused. Like a real
/// publisher it keeps per-key order within a batch: after a key's message is not acknowledged,
/// the key's later messages in that batch are not sent, not recorded, and get
/// [`PublishOutcome::NotAttempted`].
///
/// Cloning shares the same log and script.
#[derive(Clone)]
pub struct RecordingPublisher {
    log: Arc<Mutex<Log>>,
    outcome: Arc<Mutex<Option<OutcomeFn>>>,
    published: watch::Sender<usize>,
    down: Arc<AtomicBool>,
    checks: Arc<AtomicU64>,
}

impl std::fmt::Debug for RecordingPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordingPublisher")
            .field("published", &*self.published.borrow())
            .finish_non_exhaustive()
    }
}

impl Default for RecordingPublisher {
    fn default() -> Self {
        Self::new()
    }
}

impl RecordingPublisher {
    /// A publisher that acknowledges every message.
    pub fn new() -> Self {
        Self {
            log: Arc::default(),
            outcome: Arc::default(),
            published: watch::Sender::new(0),
            down: Arc::default(),
            checks: Arc::default(),
        }
    }

    /// Act as if the broker were down (`true`) or back (`false`): while down, every message of
    /// a publish fails transiently (its key's later messages are not attempted), unscripted or
    /// not, and [`Publisher::check`] returns [`Error::Unavailable`].
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// How many times [`Publisher::check`] was called (the relay's probes while the broker is
    /// down).
    pub fn checks(&self) -> u64 {
        self.checks.load(Ordering::SeqCst)
    }

    /// Report `outcome` for the next publish of message `id` (queued: call it twice to script
    /// two attempts). Scripted outcomes win over [`RecordingPublisher::set_outcome`].
    pub fn fail_next(&self, id: Uuid, outcome: PublishOutcome) {
        self.lock()
            .scripted
            .entry(id)
            .or_default()
            .push_back(outcome);
    }

    /// Decide every unscripted outcome with `f` (the default acknowledges everything).
    pub fn set_outcome(&self, f: impl Fn(&Message) -> PublishOutcome + Send + Sync + 'static) {
        *self
            .outcome
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Arc::new(f));
    }

    /// Go back to acknowledging every unscripted message.
    pub fn ack_all(&self) {
        *self
            .outcome
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }

    /// Every message sent, failed ones included, in order.
    pub fn sent(&self) -> Vec<Delivery> {
        self.lock().sent.clone()
    }

    /// Every delivery that reached the broker (acknowledged or ambiguous), in order, duplicates
    /// included.
    pub fn published(&self) -> Vec<Delivery> {
        self.lock()
            .sent
            .iter()
            .filter(|d| reached_broker(&d.outcome))
            .cloned()
            .collect()
    }

    /// The ids of [`RecordingPublisher::published`], in order.
    pub fn published_ids(&self) -> Vec<Uuid> {
        self.lock()
            .sent
            .iter()
            .filter(|d| reached_broker(&d.outcome))
            .map(|d| d.message.id)
            .collect()
    }

    /// How many `publish` calls were made.
    pub fn calls(&self) -> u64 {
        self.lock().calls
    }

    /// Wait until at least `count` deliveries reached the broker (see
    /// [`RecordingPublisher::published`]). Returns at once if they already did.
    pub async fn wait_for(&self, count: usize) {
        let mut rx = self.published.subscribe();
        // The sender is owned by `self`, which outlives this borrow, so `wait_for` cannot see a
        // closed channel; if it somehow did, returning is the only non-hanging choice.
        let _ = rx.wait_for(|n| *n >= count).await;
    }

    fn lock(&self) -> MutexGuard<'_, Log> {
        self.log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn reached_broker(outcome: &PublishOutcome) -> bool {
    matches!(
        outcome,
        PublishOutcome::Acked | PublishOutcome::Ambiguous { .. }
    )
}

#[async_trait]
impl Publisher for RecordingPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        let decide = self
            .outcome
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let down = self.down.load(Ordering::SeqCst);
        let (outcomes, published) = {
            let mut log = self.lock();
            log.calls += 1;
            let call = log.calls;
            let outcomes = attempt_in_key_order(batch, |message| {
                let outcome = if down {
                    PublishOutcome::transient("connection refused: the broker is down")
                } else {
                    log.scripted
                        .get_mut(&message.id)
                        .and_then(VecDeque::pop_front)
                        .or_else(|| decide.as_ref().map(|f| f(message)))
                        .unwrap_or(PublishOutcome::Acked)
                };
                let delivery = if reached_broker(&outcome) {
                    log.reached += 1;
                    let n = log.delivered_per_id.entry(message.id).or_insert(0);
                    *n += 1;
                    *n
                } else {
                    0
                };
                log.sent.push(Delivery {
                    message: message.clone(),
                    outcome: outcome.clone(),
                    delivery,
                    call,
                });
                outcome
            });
            (outcomes, log.reached)
        };
        self.published.send_replace(published);
        outcomes
    }

    fn name(&self) -> &str {
        "recording"
    }

    async fn check(&self) -> Result<(), Error> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(Error::Unavailable {
                what: "recording".into(),
                message: "the broker is down".into(),
                source: None,
            });
        }
        Ok(())
    }
}
