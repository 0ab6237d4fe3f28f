//! The broker side of the contract: publish a batch, report an outcome per message.

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::ErrorKind;
use crate::message::Message;

/// The result of publishing one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PublishOutcome {
    /// The broker acknowledged that it stored the message.
    Acked,
    /// The broker refused the message or could not be reached; it was not stored.
    Failed {
        /// Transient (retry later) or permanent (dead-letter it).
        kind: ErrorKind,
        /// Why, for the message's last error. Never contains credentials.
        reason: String,
    },
    /// The message may or may not have been stored (e.g. a timeout after sending). The relay
    /// retries it; the consumer may see it twice, with the same id.
    Ambiguous {
        /// Why the outcome is unknown.
        reason: String,
    },
    /// Not sent, because an earlier message of the same partition key in this batch did not
    /// succeed. The relay gives it back without counting an attempt.
    NotAttempted,
}

impl PublishOutcome {
    /// A transient failure.
    pub fn transient(reason: impl Into<String>) -> Self {
        PublishOutcome::Failed {
            kind: ErrorKind::Transient,
            reason: reason.into(),
        }
    }

    /// A permanent failure.
    pub fn permanent(reason: impl Into<String>) -> Self {
        PublishOutcome::Failed {
            kind: ErrorKind::Permanent,
            reason: reason.into(),
        }
    }

    /// Whether the broker acknowledged the message.
    pub fn is_acked(&self) -> bool {
        matches!(self, PublishOutcome::Acked)
    }
}

/// A message broker adapter.
#[async_trait]
pub trait Publisher: Send + Sync {
    /// Publish a batch and return one outcome per message, in the batch's order.
    ///
    /// # Behavior
    /// - MUST return exactly `batch.len()` outcomes; outcome `i` belongs to `batch[i]`.
    /// - MUST return [`PublishOutcome::Acked`] only after the broker confirmed it stored the
    ///   message.
    /// - MUST keep per-key order: messages of one partition key are stored in batch order, and
    ///   once one of them is not acknowledged, the key's later messages in the batch are not
    ///   sent and get [`PublishOutcome::NotAttempted`].
    /// - SHOULD pipeline: many messages in flight, not one round trip per message.
    /// - MUST carry the message id to the broker (header or field) so consumers can deduplicate.
    /// - MUST NOT panic or hang when the broker is down: outcomes become transient failures
    ///   within the publisher's timeout.
    ///
    /// # Cancel safety
    /// May be dropped at any await point (relay shutdown or crash). The relay has not marked
    /// anything yet, so the messages are published again later: duplicates, never loss.
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome>;

    /// A short name for logs and metrics, e.g. `nats` or `kafka`.
    fn name(&self) -> &str;

    /// Whether the broker is reachable now, for readiness probes and the `broker up` gauge.
    ///
    /// # Behavior
    /// - SHOULD be cheap (a connection state, a ping, a metadata fetch) and publish nothing.
    /// - MUST return within the publisher's own timeout; callers also bound it with theirs.
    /// - Returns [`Error::Unavailable`](crate::Error::Unavailable) (or another error) when
    ///   the broker cannot be reached; the message never contains credentials.
    ///
    /// The default says `Ok`: a publisher with nothing to check (e.g. standard output).
    async fn check(&self) -> Result<(), crate::Error> {
        Ok(())
    }
}

#[async_trait]
impl<T: Publisher + ?Sized> Publisher for &T {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        (**self).publish(batch).await
    }
    fn name(&self) -> &str {
        (**self).name()
    }
    async fn check(&self) -> Result<(), crate::Error> {
        (**self).check().await
    }
}

#[async_trait]
impl<T: Publisher + ?Sized> Publisher for Arc<T> {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        (**self).publish(batch).await
    }
    fn name(&self) -> &str {
        (**self).name()
    }
    async fn check(&self) -> Result<(), crate::Error> {
        (**self).check().await
    }
}

#[async_trait]
impl<T: Publisher + ?Sized> Publisher for Box<T> {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        (**self).publish(batch).await
    }
    fn name(&self) -> &str {
        (**self).name()
    }
    async fn check(&self) -> Result<(), crate::Error> {
        (**self).check().await
    }
}
