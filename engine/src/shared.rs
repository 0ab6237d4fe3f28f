//! What the relay loop and its batches share.

use std::sync::Arc;

use outbox_traits::{OutboxStore, Publisher, RelayGroupStore};

use crate::config::{RelayConfig, Tuning};
use crate::notifier::Notifier;

/// The store, publisher and settings of one [`Relay`](crate::Relay), shared by its loops and
/// their batches.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn OutboxStore>,
    pub(crate) publisher: Arc<dyn Publisher>,
    pub(crate) config: RelayConfig,
    /// The batch size and claim shards in effect: `config`'s, or the store's choice.
    pub(crate) tuning: Tuning,
    pub(crate) notifier: Notifier,
    pub(crate) publisher_name: String,
    /// Producer spans, when on ([`Relay::with_traces`](crate::Relay::with_traces)).
    #[cfg(feature = "otel")]
    pub(crate) traces: crate::trace::SharedTraces,
    /// Where the relay group's leases live, if the store supports groups.
    pub(crate) group_store: Option<Arc<dyn RelayGroupStore>>,
    /// The `outbox` label of this relay's metrics, when it serves one outbox among several.
    pub(crate) outbox: Option<String>,
}
