//! What a consuming service implements: a [`Handler`] that applies one message.

use std::future::Future;

use async_trait::async_trait;
use outbox_traits::{BoxError, ErrorKind};

use crate::delivery::Delivery;

/// How a handler finished a message. Either way the consumer acknowledges it to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// The message's effect was applied (its transaction committed).
    Processed,
    /// The message had been processed before (e.g. the inbox already held its id); nothing was
    /// applied. Counted as a dropped duplicate.
    Duplicate,
}

/// How a handler error is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Retry after a back-off; counts toward
    /// [`RetryPolicy::max_attempts`](crate::RetryPolicy::max_attempts), then the message is
    /// dead-lettered.
    Transient,
    /// Retrying cannot help (bad payload, refused by a business rule): dead-letter at once.
    Permanent,
    /// A dependency (the handler's database, another service) is down: retry after a back-off
    /// **without** counting an attempt, like a broker outage. See
    /// [`RetryPolicy::unavailable_budget`](crate::RetryPolicy::unavailable_budget) for the bound.
    Unavailable,
}

/// A handler's failure: its [`FailureKind`] decides how the consumer retries.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct HandlerError {
    /// How to retry.
    pub kind: FailureKind,
    /// What happened (goes into logs and into a dead letter's reason: no secrets).
    pub message: String,
    /// The underlying error.
    #[source]
    pub source: Option<BoxError>,
}

impl HandlerError {
    /// A [`FailureKind::Transient`] error.
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(FailureKind::Transient, message)
    }

    /// A [`FailureKind::Permanent`] error.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(FailureKind::Permanent, message)
    }

    /// A [`FailureKind::Unavailable`] error.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(FailureKind::Unavailable, message)
    }

    /// An error of `kind` with `message`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attach the underlying error.
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }
}

/// An `outbox_traits::Error` (what the project's stores and inboxes return) classified for
/// retrying: `Unavailable` (a database that cannot be reached) costs no attempt, other transient
/// errors count one, permanent ones dead-letter the message.
impl From<outbox_traits::Error> for HandlerError {
    fn from(error: outbox_traits::Error) -> Self {
        let kind = match (&error, error.kind()) {
            (outbox_traits::Error::Unavailable { .. }, _) => FailureKind::Unavailable,
            (_, ErrorKind::Transient) => FailureKind::Transient,
            (_, ErrorKind::Permanent) => FailureKind::Permanent,
        };
        Self {
            kind,
            message: error.to_string(),
            source: Some(Box::new(error)),
        }
    }
}

/// Applies one message. The consumer acknowledges the message to the broker only after
/// `handle` returned `Ok`, so a handler must have committed its effect (and, to drop
/// duplicates, its inbox mark in the same transaction) before it returns.
///
/// A message is delivered **at least once**: after a crash between the handler's commit and the
/// broker's acknowledgement it comes again with the same [`Delivery::message_id`]. The handler
/// may be called for different messages at the same time (see the crate docs on order), so it
/// must be `Send + Sync`.
///
/// ```
/// use outbox_consumer::{async_trait, Delivery, Handled, Handler, HandlerError};
///
/// struct Payments;
///
/// #[async_trait]
/// impl Handler for Payments {
///     async fn handle(&self, delivery: &Delivery) -> Result<Handled, HandlerError> {
///         #[derive(serde::Deserialize)]
///         struct Placed { total: u64 }
///         let placed: Placed = delivery.payload_as()?;
///         // begin; inbox mark (duplicate? -> return Ok(Handled::Duplicate)); effects; commit
///         let _ = placed.total;
///         Ok(Handled::Processed)
///     }
/// }
/// ```
#[async_trait]
pub trait Handler: Send + Sync {
    /// Apply `delivery`. See [`HandlerError`] for how failures are retried.
    async fn handle(&self, delivery: &Delivery) -> Result<Handled, HandlerError>;
}

#[async_trait]
impl<H: Handler + ?Sized> Handler for std::sync::Arc<H> {
    async fn handle(&self, delivery: &Delivery) -> Result<Handled, HandlerError> {
        (**self).handle(delivery).await
    }
}

/// A [`Handler`] made from an async closure; see [`handler_fn`].
#[derive(Debug, Clone)]
pub struct HandlerFn<F>(F);

/// Make a [`Handler`] from a closure that takes the delivery (a clone, one per attempt).
///
/// ```
/// use outbox_consumer::{handler_fn, Handled};
/// let handler = handler_fn(|delivery| async move {
///     println!("{} {}", delivery.event_type, delivery.payload);
///     Ok(Handled::Processed)
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<F, Fut>(f: F) -> HandlerFn<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync,
    Fut: Future<Output = Result<Handled, HandlerError>> + Send,
{
    HandlerFn(f)
}

#[async_trait]
impl<F, Fut> Handler for HandlerFn<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync,
    Fut: Future<Output = Result<Handled, HandlerError>> + Send,
{
    async fn handle(&self, delivery: &Delivery) -> Result<Handled, HandlerError> {
        (self.0)(delivery.clone()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_are_classified() {
        let down = outbox_traits::Error::unavailable("postgres", "down", "refused");
        assert_eq!(HandlerError::from(down).kind, FailureKind::Unavailable);
        let bad = outbox_traits::Error::invalid_input("bad");
        assert_eq!(HandlerError::from(bad).kind, FailureKind::Permanent);
        let busy = outbox_traits::Error::transient("deadlock", None);
        assert_eq!(HandlerError::from(busy).kind, FailureKind::Transient);
    }
}
