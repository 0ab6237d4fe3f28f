//! In-process wake-ups: the fastest way to tell an idle relay that a message was committed.

use std::sync::Arc;

use tokio::sync::Notify;

/// Wakes an idle relay at once, instead of waiting for its next poll.
///
/// Call [`Notifier::notify`] after the transaction that enqueued messages has **committed**
/// (a wake-up before the commit finds nothing to claim). Cheap to clone and to call; a
/// notification sent while the relay is busy is remembered, so the relay claims again as soon
/// as it is free. Wake-ups are only hints: without them the relay still finds every message by
/// polling.
#[derive(Debug, Clone, Default)]
pub struct Notifier {
    inner: Arc<Notify>,
}

impl Notifier {
    /// A notifier not yet attached to a relay; see [`Relay::with_notifier`](crate::Relay::with_notifier).
    pub fn new() -> Self {
        Self::default()
    }

    /// Wake the relay (or let its next wait return at once).
    pub fn notify(&self) {
        self.inner.notify_one();
    }

    /// Wait for a notification; used by the relay loop. Cancel safe.
    pub(crate) async fn notified(&self) {
        self.inner.notified().await;
    }
}
