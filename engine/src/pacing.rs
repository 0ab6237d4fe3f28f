//! When the relay loop claims next: adaptive polling, wake-ups, back-off after store errors, and
//! what the claims so far said about the backlog.

use std::time::Duration;

use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::config::RelayConfig;

/// Longest pause [`woken`] puts between a wake-up and its claim (shorter if `poll_min` is).
pub(crate) const WAKE_PACING: Duration = Duration::from_millis(10);

/// The claim side of the loop's state. Every change goes through a named transition.
pub(crate) struct Pacing {
    /// Serve mode: run until stopped, polling when idle (drain mode never waits for a poll).
    serve: bool,
    poll_min: Duration,
    poll_max: Duration,
    batch_size: usize,
    /// A claim is running.
    claiming: bool,
    /// Drain mode: the last claim found no (or only a partial) batch, and no batch has settled
    /// since, so claiming again now would find nothing new.
    quiet: bool,
    /// Batches settled so far, and how many had settled when the running claim started: a
    /// claim that overlapped a settle may have been held back by leases that are gone now, so
    /// its empty (or partial) answer says nothing about the backlog.
    settles: u64,
    settles_at_claim: u64,
    /// Earliest next claim, from adaptive polling.
    next_claim: Option<Instant>,
    /// Earliest next claim, from back-off after store errors.
    paused_until: Option<Instant>,
    idle_wait: Duration,
    /// A wake-up arrived since the last claim started / the running claim followed one.
    hinted: bool,
    claim_hinted: bool,
    /// When a claim made on a wake-up came back empty: the next wake-up waits a short pause
    /// from then (see [`woken`]), so a burst of stale hints (or a source that is always ready)
    /// cannot spin the claim loop.
    spurious_at: Option<Instant>,
    store_failures: u32,
}

impl Pacing {
    pub(crate) fn new(config: &RelayConfig, batch_size: usize, serve: bool) -> Self {
        Self {
            serve,
            poll_min: config.poll_min,
            poll_max: config.poll_max,
            batch_size,
            claiming: false,
            quiet: false,
            settles: 0,
            settles_at_claim: 0,
            next_claim: None,
            paused_until: None,
            idle_wait: config.poll_min,
            hinted: false,
            claim_hinted: false,
            spurious_at: None,
            store_failures: 0,
        }
    }

    /// A claim is running.
    pub(crate) fn claiming(&self) -> bool {
        self.claiming
    }

    /// The last claim found nothing new and nothing settled since (see the field).
    pub(crate) fn quiet(&self) -> bool {
        self.quiet
    }

    /// The earliest time the next claim may start (`None`: at once).
    pub(crate) fn claim_at(&self) -> Option<Instant> {
        later(self.next_claim, self.paused_until)
    }

    /// Transition: a claim starts now.
    pub(crate) fn start_claim(&mut self) {
        self.claiming = true;
        self.settles_at_claim = self.settles;
        self.claim_hinted = std::mem::take(&mut self.hinted);
        self.next_claim = None;
        self.paused_until = None;
    }

    /// Transition: the running claim returned. Says whether a batch settled while it ran.
    pub(crate) fn claim_returned(&mut self) -> bool {
        self.claiming = false;
        self.settles != self.settles_at_claim
    }

    /// Transition: the claim found nothing.
    pub(crate) fn found_nothing(&mut self, overlapped_settle: bool) {
        self.store_failures = 0;
        if overlapped_settle {
            // Claim again at once: see `settles_at_claim`.
            self.next_claim = None;
            return;
        }
        self.quiet = true;
        if self.claim_hinted {
            self.spurious_at = Some(Instant::now());
        }
        if self.serve && self.hinted {
            // A wake-up arrived while this claim ran; it may have missed what the wake-up
            // announced.
            self.next_claim = woken(self.spurious_at, self.poll_min);
        } else if self.serve {
            self.next_claim = Some(Instant::now() + self.idle_wait);
            self.idle_wait = (self.idle_wait * 2).min(self.poll_max);
        }
    }

    /// Transition: the claim found `size` messages.
    pub(crate) fn found(&mut self, size: usize, overlapped_settle: bool) {
        self.store_failures = 0;
        self.spurious_at = None;
        self.idle_wait = self.poll_min;
        if size < self.batch_size && !overlapped_settle {
            // Partial: the backlog is drained for now; claim again soon rather than at once,
            // so that small batches do not spin.
            self.quiet = true;
            if self.serve && !self.hinted {
                self.next_claim = Some(Instant::now() + self.poll_min);
            }
        }
    }

    /// Transition: a store call failed; no claim before the back-off pause it returns.
    pub(crate) fn back_off(&mut self, backoff: &Backoff) -> Duration {
        self.store_failures += 1;
        let pause = backoff.delay(self.store_failures);
        self.paused_until = Some(Instant::now() + pause);
        pause
    }

    /// Transition: a batch settled, which may have released messages or unblocked keys.
    pub(crate) fn settled(&mut self) {
        self.settles += 1;
        self.quiet = false;
        self.next_claim = None;
    }

    /// Transition: a wake-up (notifier or the store's source) arrived.
    pub(crate) fn woken_up(&mut self) {
        self.hinted = true;
        self.next_claim = woken(self.spurious_at, self.poll_min);
        self.idle_wait = self.poll_min;
    }
}

/// When to claim after a wake-up: at once, unless a claim made on an earlier wake-up came back
/// empty less than `min(poll_min, WAKE_PACING)` ago. Such an empty claim is usually innocent
/// (the hint's message was taken by an earlier claim), so the pause stays short whatever
/// `poll_min` is; it only caps a flood of hints at about one claim per pause.
fn woken(spurious_at: Option<Instant>, poll_min: Duration) -> Option<Instant> {
    spurious_at
        .map(|at| at + poll_min.min(WAKE_PACING))
        .filter(|at| *at > Instant::now())
}

fn later(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// The earliest of `times`, ignoring the absent ones.
pub(crate) fn earliest(times: impl IntoIterator<Item = Option<Instant>>) -> Option<Instant> {
    times.into_iter().flatten().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RelayConfig {
        RelayConfig::builder()
            .batch_size(10)
            .poll_min(Duration::from_millis(100))
            .poll_max(Duration::from_millis(350))
            .build()
            .unwrap()
    }

    /// Start a claim and let it return with nothing (`overlapped`: a batch settled meanwhile).
    fn empty_claim(pacing: &mut Pacing) {
        pacing.start_claim();
        let overlapped = pacing.claim_returned();
        pacing.found_nothing(overlapped);
    }

    #[tokio::test(start_paused = true)]
    async fn empty_claims_double_the_idle_wait_up_to_poll_max() {
        let mut pacing = Pacing::new(&config(), 10, true);
        assert_eq!(pacing.claim_at(), None, "the first claim is due at once");
        let mut waits = Vec::new();
        for _ in 0..4 {
            empty_claim(&mut pacing);
            waits.push(pacing.claim_at().unwrap() - Instant::now());
        }
        let ms = Duration::from_millis;
        assert_eq!(waits, [ms(100), ms(200), ms(350), ms(350)]);
        pacing.start_claim();
        let overlapped = pacing.claim_returned();
        pacing.found(10, overlapped);
        assert_eq!(pacing.claim_at(), None, "a full batch claims again at once");
        empty_claim(&mut pacing);
        assert_eq!(pacing.claim_at().unwrap() - Instant::now(), ms(100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_that_overlapped_a_settle_is_repeated_at_once() {
        let mut pacing = Pacing::new(&config(), 10, false);
        pacing.start_claim();
        pacing.settled();
        assert!(pacing.claim_returned(), "the settle overlapped the claim");
        pacing.found_nothing(true);
        assert!(!pacing.quiet(), "an overlapped empty claim proves nothing");
        assert_eq!(pacing.claim_at(), None);
        empty_claim(&mut pacing);
        assert!(
            pacing.quiet(),
            "drain mode is done once a claim finds nothing"
        );
        pacing.settled();
        assert!(!pacing.quiet(), "a settle may have freed messages");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stale_wake_up_paces_the_next_one() {
        let mut pacing = Pacing::new(&config(), 10, true);
        pacing.woken_up();
        assert_eq!(pacing.claim_at(), None, "a first wake-up claims at once");
        empty_claim(&mut pacing);
        pacing.woken_up();
        let pause = pacing.claim_at().unwrap() - Instant::now();
        assert_eq!(
            pause, WAKE_PACING,
            "a wake-up after a stale one waits the short pause"
        );
        tokio::time::advance(WAKE_PACING).await;
        pacing.woken_up();
        assert_eq!(
            pacing.claim_at(),
            None,
            "once the pause is over, at once again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn store_errors_pause_claims_until_a_claim_succeeds() {
        let config = config();
        let mut pacing = Pacing::new(&config, 10, true);
        let first = pacing.back_off(&config.store_backoff);
        assert_eq!(pacing.claim_at(), Some(Instant::now() + first));
        pacing.start_claim();
        assert_eq!(pacing.claim_at(), None, "starting a claim clears the pause");
        pacing.claim_returned();
        pacing.back_off(&config.store_backoff);
        assert_eq!(pacing.store_failures, 2);
        pacing.start_claim();
        pacing.claim_returned();
        pacing.found(10, false);
        pacing.back_off(&config.store_backoff);
        assert_eq!(
            pacing.store_failures, 1,
            "a successful claim resets the failure count"
        );
    }
}
