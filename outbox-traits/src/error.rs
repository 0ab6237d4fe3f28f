//! The one error type at the contract boundary, classified so the engine can decide retries
//! without matching strings.

use uuid::Uuid;

/// A boxed error source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Whether retrying the same operation later can succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A retry later may succeed (connection lost, timeout, broker down, lock conflict).
    Transient,
    /// A retry will fail the same way (bad input, missing table, message too large).
    Permanent,
}

/// Errors returned by stores, publishers and the engine.
///
/// Marked `#[non_exhaustive]`: match the named cases you branch on and use [`Error::kind`] for
/// the rest.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller no longer holds the lease on these messages: it expired, was released, or the
    /// token is stale. Nothing was changed for them. The relay must drop them; another relay owns
    /// them (or will).
    #[error("lease lost on {} message(s) (expired, released or claimed by another relay); nothing was changed for them", ids.len())]
    LeaseLost {
        /// The messages whose lease was not held.
        ids: Vec<Uuid>,
    },

    /// The input was invalid; nothing was written. The message says what to fix.
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// A message with this dedup key already exists; nothing was written.
    #[error("duplicate dedup key {key:?}: a message with this key was already enqueued")]
    DuplicateKey {
        /// The offending dedup key.
        key: String,
    },

    /// The named messages do not exist (or are not in the state the operation needs).
    #[error("not found: {0}")]
    NotFound(String),

    /// A server (database or broker) could not be reached or timed out. Transient.
    #[error("{what} unavailable: {message}")]
    Unavailable {
        /// What was unavailable, e.g. `postgres` or `nats`. Never contains credentials.
        what: String,
        /// What happened, with any password removed.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<BoxError>,
    },

    /// Any other backend or publisher error, with its classification.
    #[error("{message}")]
    Backend {
        /// What happened, with any password removed.
        message: String,
        /// Whether a retry may succeed.
        kind: ErrorKind,
        /// The underlying error.
        #[source]
        source: Option<BoxError>,
    },
}

impl Error {
    /// An [`Error::InvalidInput`].
    pub fn invalid_input(message: impl Into<String>) -> Self {
        Error::InvalidInput(message.into())
    }

    /// An [`Error::Unavailable`] with a source.
    pub fn unavailable(
        what: impl Into<String>,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Unavailable {
            what: what.into(),
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// `Ok` when every requested message was held, else [`Error::LeaseLost`] naming those that
    /// were not, once each, in request order. For stores reporting which messages a fenced
    /// transition changed.
    ///
    /// ```
    /// # use std::collections::HashSet;
    /// # use outbox_traits::{Error, uuid::Uuid};
    /// let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    /// assert!(Error::unless_held(&[a], &HashSet::from([a])).is_ok());
    /// assert!(matches!(
    ///     Error::unless_held(&[a, b, b], &HashSet::from([a])),
    ///     Err(Error::LeaseLost { ids }) if ids == [b]
    /// ));
    /// ```
    pub fn unless_held(
        requested: &[Uuid],
        held: &std::collections::HashSet<Uuid>,
    ) -> Result<(), Error> {
        let mut seen = std::collections::HashSet::new();
        let lost: Vec<Uuid> = requested
            .iter()
            .filter(|id| !held.contains(id) && seen.insert(**id))
            .copied()
            .collect();
        if lost.is_empty() {
            Ok(())
        } else {
            Err(Error::LeaseLost { ids: lost })
        }
    }

    /// A transient [`Error::Backend`].
    pub fn transient(message: impl Into<String>, source: Option<BoxError>) -> Self {
        Error::Backend {
            message: message.into(),
            kind: ErrorKind::Transient,
            source,
        }
    }

    /// A permanent [`Error::Backend`].
    pub fn permanent(message: impl Into<String>, source: Option<BoxError>) -> Self {
        Error::Backend {
            message: message.into(),
            kind: ErrorKind::Permanent,
            source,
        }
    }

    /// Whether retrying later may succeed.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Unavailable { .. } | Error::LeaseLost { .. } => ErrorKind::Transient,
            Error::InvalidInput(_) | Error::DuplicateKey { .. } | Error::NotFound(_) => {
                ErrorKind::Permanent
            }
            Error::Backend { kind, .. } => *kind,
        }
    }

    /// Shorthand for `self.kind() == ErrorKind::Transient`.
    pub fn is_transient(&self) -> bool {
        self.kind() == ErrorKind::Transient
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        assert!(Error::LeaseLost { ids: vec![] }.is_transient());
        assert!(!Error::invalid_input("x").is_transient());
        assert!(Error::transient("x", None).is_transient());
        assert!(!Error::permanent("x", None).is_transient());
    }
}
