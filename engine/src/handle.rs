//! Control of a spawned relay.

use std::sync::Arc;
use std::time::Duration;

use outbox_traits::Error;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::notifier::Notifier;
use crate::stats::{RelayStats, StatsCell};

/// Controls a relay started with [`Relay::spawn`](crate::Relay::spawn).
///
/// Dropping the handle shuts the relay down gracefully in the background, within
/// [`RelayConfig::shutdown_deadline`](crate::RelayConfig::shutdown_deadline).
#[must_use = "dropping the handle shuts the relay down"]
#[derive(Debug)]
pub struct RelayHandle {
    stop: oneshot::Sender<Duration>,
    task: JoinHandle<Result<RelayStats, Error>>,
    stats: Arc<StatsCell>,
    notifier: Notifier,
}

impl RelayHandle {
    pub(crate) fn new(
        stop: oneshot::Sender<Duration>,
        task: JoinHandle<Result<RelayStats, Error>>,
        stats: Arc<StatsCell>,
        notifier: Notifier,
    ) -> Self {
        Self {
            stop,
            task,
            stats,
            notifier,
        }
    }

    /// The notifier that wakes the relay; call [`Notifier::notify`] after an enqueue commits.
    pub fn notifier(&self) -> Notifier {
        self.notifier.clone()
    }

    /// What the relay has done so far (a live snapshot).
    pub fn stats(&self) -> RelayStats {
        self.stats.snapshot()
    }

    /// Whether the relay task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stop claiming, let in-flight batches publish and settle until `deadline`, then release
    /// what is still leased, and return the stats of the whole run.
    ///
    /// Past the deadline the relay waits at most
    /// [`RELEASE_GRACE`](crate::RELEASE_GRACE) more for the releases; anything still leased then
    /// is picked up again when its lease ends.
    pub async fn shutdown(self, deadline: Duration) -> Result<RelayStats, Error> {
        // A send error means the task already ended; its result is in the join handle.
        let _ = self.stop.send(deadline);
        join(self.task, &self.stats).await
    }

    /// Stop the relay at its current await point, as a crash would, and wait until it has
    /// stopped. Nothing is lost: messages it held are claimed again once their leases end, and
    /// anything it published but had not yet completed is published again (a duplicate).
    pub async fn abort(self) -> RelayStats {
        self.task.abort();
        let _ = self.task.await;
        self.stats.snapshot()
    }
}

async fn join(
    task: JoinHandle<Result<RelayStats, Error>>,
    stats: &StatsCell,
) -> Result<RelayStats, Error> {
    match task.await {
        Ok(result) => result,
        Err(e) if e.is_cancelled() => Ok(stats.snapshot()),
        Err(e) => Err(Error::permanent(
            format!("the relay task panicked: {e}"),
            Some(Box::new(e)),
        )),
    }
}
