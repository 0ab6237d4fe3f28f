//! Retry back-off: exponential growth, a cap, and jitter so that relays recovering from the same
//! outage do not retry in lock step (a retry storm, FM-D2).

use std::time::Duration;

use rand::Rng;

/// Exponential back-off with a cap and jitter, used to schedule retries of failed messages and
/// to pace the relay while its store is unreachable.
///
/// The delay before attempt `n` (1-based: the first retry follows attempt 1) is
/// `min(max, initial * multiplier^(n-1)) * (1 ± jitter * r)` with `r` uniform in `[0, 1)`, so the
/// jitter may take a capped delay up to `max * (1 + jitter)`.
///
/// ```
/// use std::time::Duration;
/// use outbox_engine::Backoff;
/// let backoff = Backoff { jitter: 0.0, ..Backoff::default() };
/// assert_eq!(backoff.delay(1), Duration::from_secs(1));
/// assert_eq!(backoff.delay(3), Duration::from_secs(4));
/// assert_eq!(backoff.delay(30), Duration::from_secs(300));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay before the first retry. Default: 1 s.
    pub initial: Duration,
    /// Largest delay before jitter. Default: 5 min.
    pub max: Duration,
    /// Growth factor per attempt; at least 1. Default: 2.
    pub multiplier: f64,
    /// Relative jitter in `0..=1`: 0.2 spreads each delay over ±20 %. Default: 0.2.
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl Backoff {
    /// The delay before retrying after failed attempt `attempt` (1-based), with random jitter.
    pub fn delay(&self, attempt: u32) -> Duration {
        self.delay_with_rng(attempt, &mut rand::rng())
    }

    /// [`Backoff::delay`] drawing the jitter from `rng`, for reproducible schedules.
    pub fn delay_with_rng<R: Rng + ?Sized>(&self, attempt: u32, rng: &mut R) -> Duration {
        self.delay_with_unit(attempt, rng.random::<f64>())
    }

    /// [`Backoff::delay`] with the jitter's random draw given as `unit` in `[0, 1]`: 0 gives the
    /// shortest delay (`-jitter`), 0.5 the un-jittered one, 1 the longest (`+jitter`).
    pub fn delay_with_unit(&self, attempt: u32, unit: f64) -> Duration {
        let exponent = attempt.saturating_sub(1).min(i32::MAX as u32) as i32;
        let max = self.max.as_secs_f64();
        // An overflowing power becomes +inf, which the cap turns back into `max`.
        let base = (self.initial.as_secs_f64() * self.multiplier.powi(exponent)).min(max);
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let factor = 1.0 + self.jitter * (2.0 * unit - 1.0);
        Duration::try_from_secs_f64(base * factor).unwrap_or(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn secs(d: Duration) -> f64 {
        d.as_secs_f64()
    }

    #[test]
    fn grows_by_the_multiplier_until_the_cap() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
            multiplier: 3.0,
            jitter: 0.0,
        };
        let got: Vec<u128> = (1..=6).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(got, vec![100, 300, 900, 2000, 2000, 2000]);
        // Attempt 0 (never failed) behaves like the first retry rather than shrinking.
        assert_eq!(b.delay(0), Duration::from_millis(100));
        // Huge attempt counts overflow the power; the cap still holds.
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(2));
    }

    #[test]
    fn jitter_bounds_are_exact_at_the_extremes() {
        let b = Backoff::default();
        assert!((secs(b.delay_with_unit(1, 0.0)) - 0.8).abs() < 1e-9);
        assert!((secs(b.delay_with_unit(1, 0.5)) - 1.0).abs() < 1e-9);
        assert!((secs(b.delay_with_unit(1, 1.0)) - 1.2).abs() < 1e-9);
        // Capped delays are jittered around the cap.
        assert!((secs(b.delay_with_unit(40, 1.0)) - 360.0).abs() < 1e-6);
        assert!((secs(b.delay_with_unit(40, 0.0)) - 240.0).abs() < 1e-6);
        // Out-of-range draws are clamped rather than producing negative or huge delays.
        assert!((secs(b.delay_with_unit(1, -3.0)) - 0.8).abs() < 1e-9);
        assert!((secs(b.delay_with_unit(1, f64::NAN)) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn random_delays_stay_within_the_jitter_band() {
        let b = Backoff::default();
        let mut rng = StdRng::seed_from_u64(7);
        let mut distinct = std::collections::BTreeSet::new();
        for attempt in 1..=20u32 {
            let base = (2f64.powi(attempt as i32 - 1)).min(300.0);
            for _ in 0..50 {
                let d = secs(b.delay_with_rng(attempt, &mut rng));
                assert!(
                    d >= base * 0.8 - 1e-9 && d <= base * 1.2 + 1e-9,
                    "{attempt}: {d}"
                );
                distinct.insert(d.to_bits());
            }
        }
        // Jitter actually varies the delays.
        assert!(distinct.len() > 100);
        // Same seed, same schedule.
        let a: Vec<_> = (1..5)
            .map(|n| b.delay_with_rng(n, &mut StdRng::seed_from_u64(1)))
            .collect();
        let c: Vec<_> = (1..5)
            .map(|n| b.delay_with_rng(n, &mut StdRng::seed_from_u64(1)))
            .collect();
        assert_eq!(a, c);
    }
}
