//! Settings shared by every consumer: retries, concurrency, batch size; and their URL options.

use std::time::Duration;

use outbox_traits::Error;
use rand::Rng;

/// How handler errors are retried.
///
/// The pause before retry `n` (after the `n`-th failed attempt) is
/// `min(max_backoff, initial_backoff * 2^(n-1))`, spread by ±`jitter` so that consumers
/// recovering from the same outage do not retry in step.
///
/// ```
/// use std::time::Duration;
/// use outbox_consumer::RetryPolicy;
/// let p = RetryPolicy { jitter: 0.0, ..RetryPolicy::default() };
/// assert_eq!(p.delay(1), Duration::from_millis(100));
/// assert_eq!(p.delay(4), Duration::from_millis(800));
/// assert_eq!(p.delay(40), Duration::from_secs(30));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Handler calls per message before it is dead-lettered, counting only
    /// [`Transient`](crate::FailureKind::Transient) errors (at least 1). Default: 5.
    pub max_attempts: u32,
    /// Pause before the first retry. Default: 100 ms.
    pub initial_backoff: Duration,
    /// Longest pause before jitter. Default: 30 s.
    pub max_backoff: Duration,
    /// Relative jitter in `0..=1`. Default: 0.2 (±20 %).
    pub jitter: f64,
    /// How long a message may keep failing with
    /// [`Unavailable`](crate::FailureKind::Unavailable) errors without counting attempts.
    /// `None` (the default): for ever, like a broker outage: the message waits (unacknowledged,
    /// its lane held, one handler call per back-off of at most `max_backoff`) until the database
    /// is back or the consumer stops. `Some(d)`: after `d` of uninterrupted unavailability each
    /// further `Unavailable` error counts as an attempt, so a handler that misreports a
    /// permanent fault as an outage still ends in the dead letters.
    pub unavailable_budget: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(30),
            jitter: 0.2,
            unavailable_budget: None,
        }
    }
}

impl RetryPolicy {
    /// The pause after failed attempt `attempt` (1-based), jittered.
    pub fn delay(&self, attempt: u32) -> Duration {
        let exponent = i32::try_from(attempt.saturating_sub(1).min(64)).unwrap_or(64);
        let max = self.max_backoff.as_secs_f64();
        let base = (self.initial_backoff.as_secs_f64() * 2f64.powi(exponent)).min(max);
        let spread = if self.jitter > 0.0 {
            rand::rng().random_range(-self.jitter..=self.jitter)
        } else {
            0.0
        };
        Duration::try_from_secs_f64(base * (1.0 + spread)).unwrap_or(self.max_backoff)
    }

    /// Check the values.
    pub fn validate(&self) -> Result<(), Error> {
        if self.max_attempts == 0 {
            return Err(Error::invalid_input(
                "consumer max_attempts must be at least 1 (1: dead-letter on the first error)",
            ));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(Error::invalid_input(format!(
                "consumer retry jitter {} is outside 0..=1 (0.2 spreads pauses over ±20 %)",
                self.jitter
            )));
        }
        if self.initial_backoff > self.max_backoff {
            return Err(Error::invalid_input(format!(
                "consumer initial back-off {:?} exceeds the maximum back-off {:?}",
                self.initial_backoff, self.max_backoff
            )));
        }
        Ok(())
    }
}

/// Default number of messages fetched per batch.
pub const DEFAULT_BATCH: usize = 100;
/// Default number of ordering lanes handled at once.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// Settings every consumer has.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerOptions {
    /// Retry and dead-letter policy.
    pub retry: RetryPolicy,
    /// Messages fetched from the broker at a time (at least 1). Default: [`DEFAULT_BATCH`].
    pub batch: usize,
    /// Ordering lanes (a Kafka partition, a NATS subject, a Redis partition key) handled at
    /// once; messages of one lane are handled one after the other (at least 1). Default:
    /// [`DEFAULT_CONCURRENCY`].
    pub concurrency: usize,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            retry: RetryPolicy::default(),
            batch: DEFAULT_BATCH,
            concurrency: DEFAULT_CONCURRENCY,
        }
    }
}

/// The URL options every consumer URL understands.
pub const COMMON_URL_OPTIONS: &[&str] = &[
    "max_attempts",
    "backoff_ms",
    "max_backoff_ms",
    "unavailable_budget_ms",
    "batch",
    "concurrency",
];

impl ConsumerOptions {
    /// Check the values.
    pub fn validate(&self) -> Result<(), Error> {
        self.retry.validate()?;
        if self.batch == 0 {
            return Err(Error::invalid_input("consumer batch must be at least 1"));
        }
        if self.concurrency == 0 {
            return Err(Error::invalid_input(
                "consumer concurrency must be at least 1",
            ));
        }
        Ok(())
    }

    /// Apply one of [`COMMON_URL_OPTIONS`]; `Ok(false)` when `key` is not one of them.
    pub(crate) fn apply(&mut self, broker: &str, key: &str, value: &str) -> Result<bool, Error> {
        match key {
            "max_attempts" => self.retry.max_attempts = number(broker, key, value)?,
            "backoff_ms" => self.retry.initial_backoff = millis(broker, key, value)?,
            "max_backoff_ms" => self.retry.max_backoff = millis(broker, key, value)?,
            "unavailable_budget_ms" => {
                self.retry.unavailable_budget = Some(millis(broker, key, value)?)
            }
            "batch" => self.batch = number(broker, key, value)?,
            "concurrency" => self.concurrency = number(broker, key, value)?,
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Parse a whole number option.
pub(crate) fn number<T: std::str::FromStr>(
    broker: &str,
    key: &str,
    value: &str,
) -> Result<T, Error> {
    value.trim().parse().map_err(|_| {
        Error::invalid_input(format!(
            "{broker} consumer option {key}={value:?} is not a non-negative whole number"
        ))
    })
}

/// Parse a duration option given in milliseconds.
pub(crate) fn millis(broker: &str, key: &str, value: &str) -> Result<Duration, Error> {
    number(broker, key, value).map(Duration::from_millis)
}

/// The error for an option no consumer of `broker` knows.
pub(crate) fn unknown_option(broker: &str, key: &str, shown: &str, own: &[&str]) -> Error {
    let mut valid: Vec<&str> = own.to_vec();
    valid.extend_from_slice(COMMON_URL_OPTIONS);
    Error::invalid_input(format!(
        "unknown {broker} consumer option {key:?} in {shown:?}; valid options: {}",
        valid.join(", ")
    ))
}

/// The error for a required option left out.
pub(crate) fn missing_option(broker: &str, key: &str, shown: &str, example: &str) -> Error {
    Error::invalid_input(format!(
        "{broker} consumer URL {shown:?} has no {key} option; add e.g. {example}"
    ))
}

/// Refuse an empty or blank name.
pub(crate) fn non_empty(broker: &str, what: &str, value: &str) -> Result<(), Error> {
    if value.trim().is_empty() {
        return Err(Error::invalid_input(format!(
            "{broker} consumer {what} is empty; give a name"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_bounds() {
        let p = RetryPolicy::default();
        for _ in 0..200 {
            let d = p.delay(2).as_secs_f64();
            assert!((0.16..=0.24).contains(&d), "{d}");
        }
    }

    #[test]
    fn refuses_bad_values() {
        let mut o = ConsumerOptions::default();
        o.retry.max_attempts = 0;
        assert!(o.validate().is_err());
        let mut o = ConsumerOptions::default();
        o.retry.jitter = 2.0;
        assert!(o.validate().is_err());
        let o = ConsumerOptions {
            batch: 0,
            ..ConsumerOptions::default()
        };
        assert!(o.validate().is_err());
        let mut o = ConsumerOptions::default();
        assert!(o.apply("NATS", "batch", "-1").is_err());
        assert!(!o.apply("NATS", "colour", "red").unwrap());
    }
}
