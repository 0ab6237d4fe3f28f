//! Outages: telling a broker that is down apart from messages it refuses, probing it back with
//! capped back-off, and logging each outage (of the broker or the store) once when it starts and
//! once when it ends.
//!
//! A batch whose outcomes could all come from an unreachable broker (nothing acknowledged,
//! nothing refused for good) asks [`Publisher::check`]. If the broker is down, the batch's
//! messages are released without counting an attempt and the loop stops claiming; it probes
//! with [`PROBE_BACKOFF`] (capped at about a second, so delivery resumes within about a second
//! of the broker's return) and claims again once a probe succeeds.

use std::time::Duration;

use outbox_traits::{Error, ErrorKind, PublishOutcome, Publisher};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::backoff::Backoff;

/// Back-off between probes of a broker that is down: from 100 ms, capped at 1 s (± 20 %).
pub(crate) const PROBE_BACKOFF: Backoff = Backoff {
    initial: Duration::from_millis(100),
    max: Duration::from_secs(1),
    multiplier: 2.0,
    jitter: 0.2,
};

/// How long a broker check may take before the broker counts as down.
pub(crate) const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether a batch's outcomes could all come from an unreachable broker: not empty, nothing
/// acknowledged, nothing refused for good, and at least one transient failure or unknown
/// outcome (connection refused or lost, no responders, every message timing out).
pub(crate) fn looks_down(outcomes: &[PublishOutcome]) -> bool {
    let mut failed = false;
    for outcome in outcomes {
        match outcome {
            PublishOutcome::NotAttempted => {}
            PublishOutcome::Failed {
                kind: ErrorKind::Transient,
                ..
            }
            | PublishOutcome::Ambiguous { .. } => failed = true,
            _ => return false,
        }
    }
    failed
}

/// Ask `publisher` whether its broker is reachable, within [`CHECK_TIMEOUT`]. Returns why not.
pub(crate) async fn broker_down(publisher: &dyn Publisher) -> Option<String> {
    match tokio::time::timeout(CHECK_TIMEOUT, publisher.check()).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some(format!(
            "the broker check did not answer within {CHECK_TIMEOUT:?}"
        )),
    }
}

/// Whether a server (the broker or the store) is up, logging each change once: a WARN when it
/// goes down, an INFO with how long it was down when it is back.
#[derive(Debug)]
pub(crate) struct Availability {
    what: &'static str,
    down_since: Option<Instant>,
}

impl Availability {
    pub(crate) fn new(what: &'static str) -> Self {
        Self {
            what,
            down_since: None,
        }
    }

    pub(crate) fn is_down(&self) -> bool {
        self.down_since.is_some()
    }

    /// The server failed with `reason`. Returns whether this starts an outage.
    pub(crate) fn went_down(&mut self, reason: &str) -> bool {
        if self.down_since.is_some() {
            return false;
        }
        self.down_since = Some(Instant::now());
        warn!(
            server = self.what,
            error = reason,
            "{} is down; no attempts are counted until it is back",
            self.what
        );
        true
    }

    /// The server answered. Returns whether this ends an outage.
    pub(crate) fn came_back(&mut self) -> bool {
        let Some(since) = self.down_since.take() else {
            return false;
        };
        let down_for = since.elapsed();
        info!(
            server = self.what,
            ?down_for,
            "{} is back after {down_for:.1?}",
            self.what
        );
        true
    }
}

/// The broker side of the loop's state: up, or down and being probed.
#[derive(Debug)]
pub(crate) struct Broker {
    up: Availability,
    /// Failed probes in the current outage.
    probes: u32,
    probe_at: Option<Instant>,
    probing: bool,
}

impl Broker {
    pub(crate) fn new() -> Self {
        Self {
            up: Availability::new("broker"),
            probes: 0,
            probe_at: None,
            probing: false,
        }
    }

    /// The broker is down: no claims until a probe succeeds.
    pub(crate) fn is_down(&self) -> bool {
        self.up.is_down()
    }

    /// A batch found the broker down. Returns whether this starts an outage.
    pub(crate) fn went_down(&mut self, reason: &str) -> bool {
        if !self.up.went_down(reason) {
            return false;
        }
        self.probes = 0;
        self.probe_at = Some(Instant::now() + PROBE_BACKOFF.delay(1));
        true
    }

    /// When the next probe is due (`None`: up, or a probe is running).
    pub(crate) fn probe_at(&self) -> Option<Instant> {
        if self.probing {
            None
        } else {
            self.probe_at.filter(|_| self.is_down())
        }
    }

    /// A probe starts.
    pub(crate) fn probing(&mut self) {
        self.probing = true;
    }

    /// A probe came back: `None` if the broker answered, else why not. Returns whether the
    /// broker is back.
    pub(crate) fn probed(&mut self, down: Option<String>) -> bool {
        self.probing = false;
        match down {
            None => {
                self.probe_at = None;
                self.up.came_back()
            }
            Some(reason) => {
                self.probes = self.probes.saturating_add(1);
                let pause = PROBE_BACKOFF.delay(self.probes.saturating_add(1));
                debug!(error = %reason, retry_in = ?pause, "broker still down");
                self.probe_at = Some(Instant::now() + pause);
                false
            }
        }
    }
}

/// The error a drain ends with when the broker is down: it cannot finish, and counting
/// attempts would dead-letter messages the broker never refused.
pub(crate) fn drain_error(publisher: &str, reason: &str) -> Error {
    Error::Unavailable {
        what: publisher.to_owned(),
        message: format!(
            "the broker is down ({reason}); messages were released without counting an attempt"
        ),
        source: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_batches_without_acks_or_permanent_refusals_look_down() {
        let t = || PublishOutcome::transient("refused");
        let a = || PublishOutcome::Ambiguous {
            reason: "timeout".into(),
        };
        assert!(looks_down(&[t(), PublishOutcome::NotAttempted, a()]));
        assert!(looks_down(&[a()]));
        assert!(!looks_down(&[]));
        assert!(!looks_down(&[PublishOutcome::NotAttempted]));
        assert!(!looks_down(&[t(), PublishOutcome::Acked]));
        assert!(!looks_down(&[t(), PublishOutcome::permanent("too big")]));
    }

    #[tokio::test(start_paused = true)]
    async fn probes_back_off_to_a_cap_of_about_a_second() {
        let mut broker = Broker::new();
        assert!(broker.went_down("refused"));
        assert!(!broker.went_down("refused again"), "one outage, one start");
        let mut gaps = Vec::new();
        for _ in 0..10 {
            let at = broker.probe_at().expect("a probe is due while down");
            gaps.push(at - Instant::now());
            broker.probing();
            assert_eq!(broker.probe_at(), None, "one probe at a time");
            assert!(!broker.probed(Some("refused".into())));
        }
        let cap = PROBE_BACKOFF.max.mul_f64(1.0 + PROBE_BACKOFF.jitter);
        assert!(gaps.iter().all(|g| *g <= cap), "{gaps:?}");
        assert!(gaps[9] >= PROBE_BACKOFF.max.mul_f64(1.0 - PROBE_BACKOFF.jitter));
        broker.probing();
        assert!(broker.probed(None));
        assert!(!broker.is_down());
        assert_eq!(broker.probe_at(), None);
    }
}
