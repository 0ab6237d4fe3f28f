//! Draining a backlog that other relays share ([`Relay::run_until_drained`]): drain rounds of
//! the relay loop until the store shows nothing that this relay could still claim.
//!
//! A round ([`Mode::Drain`]) ends once a claim finds nothing while nothing is in flight. That
//! alone says little when other relays work the same table: their leased messages, and the
//! later messages of those messages' keys, were not claimable then but will be. So after each
//! round the store's [`StoreStatus`] decides (read only when its backlog,
//! [`OutboxAdmin::backlog`], is not empty):
//! - nothing pending and nothing leased: the backlog is done;
//! - something leased (by another relay: this one has nothing in flight between rounds): drain
//!   another round after a pause (cut short by a [`Notifier`](crate::Notifier) wake-up); a
//!   lease that expires is claimed by such a round;
//! - pending messages but none leased: what is left is waiting for a retry or a not-before
//!   time, or held back by a dead head, none of which a drain waits for; or it was given back
//!   by a relay that stopped meanwhile; or another relay's claim is taking it right now (a
//!   claim's rows read as pending until it commits, and a claim beside it skips them). More
//!   rounds settle which: the drain ends once rounds over at least [`DRAIN_SETTLE`] all find the same
//!   pending count and nothing leased.
//!
//! Between rounds that end otherwise the drain waits, from `poll_min` doubling up to
//! `poll_max` while rounds find nothing.
//!
//! [`Relay::run_until_drained`]: crate::Relay::run_until_drained

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use outbox_traits::{Error, OutboxAdmin, StoreStatus};
use tracing::debug;

use crate::run_loop::{run_loop, Mode};
use crate::shared::Shared;
use crate::telemetry::Recorder;

/// How long the pending count must stay the same, with nothing leased, before a drain believes
/// that what is left is not for it (see the module docs): far longer than a claim statement.
pub const DRAIN_SETTLE: Duration = Duration::from_secs(1);

/// What the store's status after a round says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// Nothing left this relay could claim: the drain is over.
    Done,
    /// Drain another round: the pending count must be seen again to be believed.
    Again,
    /// Other relays hold leases (or the status could not be read): wait, then drain again.
    Wait,
}

/// Decide from `status` (read `now`, after a round) and the pending count seen with no lease
/// since a time (`clear`), which this updates.
fn after(status: &StoreStatus, clear: &mut Option<(u64, Instant)>, now: Instant) -> After {
    if status.leased > 0 {
        *clear = None;
        return After::Wait;
    }
    if status.pending == 0 {
        return After::Done;
    }
    match *clear {
        Some((pending, since)) if pending == status.pending => {
            if now.duration_since(since) >= DRAIN_SETTLE {
                After::Done
            } else {
                After::Again
            }
        }
        _ => {
            *clear = Some((status.pending, now));
            After::Again
        }
    }
}

/// The store's status after a round, for [`after`]: first its backlog
/// ([`OutboxAdmin::backlog`], cheaper), and the whole status only when something is left
/// unfinished, to tell leased from pending. The round that ends a drain, which finds the
/// backlog empty, thus reads no status.
async fn settled_status(admin: &dyn OutboxAdmin) -> Result<StoreStatus, Error> {
    if admin.backlog().await?.unfinished == 0 {
        return Ok(StoreStatus::default());
    }
    admin.status(0).await
}

/// Drain rounds until [`after`] says done, or `stop` resolves (then the round running shuts
/// down gracefully within `deadline`). Returns a permanent error of a round or of the status.
pub(crate) async fn until_drained<F>(
    shared: &Shared,
    rec: &Recorder,
    admin: &dyn OutboxAdmin,
    shutdown: F,
) -> Result<(), Error>
where
    F: Future<Output = ()>,
{
    let cfg = &shared.config;
    let deadline = cfg.shutdown_deadline;
    let stopped = AtomicBool::new(false);
    let mut stop = pin!(async {
        shutdown.await;
        stopped.store(true, Ordering::Relaxed);
        deadline
    });
    let mut wait = cfg.poll_min;
    let mut clear = None;
    loop {
        let claimed_before = rec.stats().snapshot().claimed;
        run_loop(shared, rec, Mode::Drain, stop.as_mut()).await?;
        if stopped.load(Ordering::Relaxed) {
            return Ok(());
        }
        if rec.stats().snapshot().claimed > claimed_before {
            wait = cfg.poll_min;
        }
        let next = match settled_status(admin).await {
            Ok(status) => {
                let next = after(&status, &mut clear, Instant::now());
                debug!(
                    pending = status.pending,
                    leased = status.leased,
                    next = ?next,
                    "drain round over"
                );
                next
            }
            Err(e) if e.is_transient() => {
                debug!(error = %e, "store status failed; draining again after a pause");
                clear = None;
                After::Wait
            }
            Err(e) => return Err(e),
        };
        if next == After::Done {
            return Ok(());
        }
        // Also before a round that only confirms the pending count: writers that keep adding
        // rows nobody can claim yet must not spin the loop.
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shared.notifier.notified() => {}
            _ = stop.as_mut() => return Ok(()),
        }
        wait = (wait * 2).min(cfg.poll_max).max(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(pending: u64, leased: u64) -> StoreStatus {
        StoreStatus {
            pending,
            leased,
            ..StoreStatus::default()
        }
    }

    #[test]
    fn an_empty_store_ends_the_drain_at_once() {
        assert_eq!(after(&status(0, 0), &mut None, Instant::now()), After::Done);
    }

    #[test]
    fn leases_held_by_others_are_waited_for() {
        let now = Instant::now();
        let mut clear = Some((3, now));
        assert_eq!(
            after(&status(3, 1), &mut clear, now + DRAIN_SETTLE),
            After::Wait
        );
        assert_eq!(clear, None, "a lease seen starts the count again");
        assert_eq!(after(&status(0, 2), &mut clear, now), After::Wait);
    }

    #[test]
    fn pending_rows_left_with_no_lease_end_the_drain_once_settled() {
        let t0 = Instant::now();
        let mut clear = None;
        assert_eq!(after(&status(4, 0), &mut clear, t0), After::Again);
        // The count moved: it starts again.
        assert_eq!(
            after(&status(3, 0), &mut clear, t0 + DRAIN_SETTLE),
            After::Again
        );
        let t1 = t0 + DRAIN_SETTLE;
        assert_eq!(
            after(&status(3, 0), &mut clear, t1 + DRAIN_SETTLE / 2),
            After::Again
        );
        assert_eq!(
            after(&status(3, 0), &mut clear, t1 + DRAIN_SETTLE),
            After::Done
        );
    }

    /// An admin whose backlog is `unfinished` messages and whose status says `leased` of them
    /// are leased; counts its status queries.
    struct FixedAdmin {
        unfinished: u64,
        statuses: std::sync::atomic::AtomicUsize,
    }

    #[outbox_traits::async_trait]
    impl OutboxAdmin for FixedAdmin {
        async fn list_dead(
            &self,
            _: Option<i64>,
            _: usize,
        ) -> Result<Vec<outbox_traits::DeadMessage>, Error> {
            Ok(vec![])
        }
        async fn requeue(&self, _: &[outbox_traits::uuid::Uuid]) -> Result<u64, Error> {
            Ok(0)
        }
        async fn discard(&self, _: &[outbox_traits::uuid::Uuid]) -> Result<u64, Error> {
            Ok(0)
        }
        async fn purge_published(&self, _: Duration, _: usize) -> Result<u64, Error> {
            Ok(0)
        }
        async fn counts(&self) -> Result<outbox_traits::Counts, Error> {
            Ok(outbox_traits::Counts::default())
        }
        async fn status(&self, _: usize) -> Result<StoreStatus, Error> {
            self.statuses.fetch_add(1, Ordering::SeqCst);
            Ok(status(0, self.unfinished))
        }
        async fn backlog(&self) -> Result<outbox_traits::Backlog, Error> {
            Ok(outbox_traits::Backlog {
                unfinished: self.unfinished,
                dead: 0,
            })
        }
    }

    /// The round that ends a drain reads the backlog only; one that finds messages left reads
    /// the status too, whose leases decide.
    #[tokio::test]
    async fn the_status_is_read_only_when_the_backlog_is_not_empty() {
        for (unfinished, statuses) in [(0, 0), (2, 1)] {
            let admin = FixedAdmin {
                unfinished,
                statuses: Default::default(),
            };
            let status = settled_status(&admin).await.unwrap();
            assert_eq!(status.leased, unfinished);
            assert_eq!(admin.statuses.load(Ordering::SeqCst), statuses);
        }
    }
}
