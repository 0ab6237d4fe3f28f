//! A manual clock: the memory store's stand-in for a database clock.

use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A clock that only moves when told to.
///
/// The memory store takes every time (lease ends, retry due times, publish times) from its
/// clock, as a database takes them from its own `now()`. Tests move it with
/// [`Clock::advance`] to expire leases or make retries due, so they never sleep.
#[derive(Debug)]
pub struct Clock {
    now: Mutex<DateTime<Utc>>,
}

impl Clock {
    /// A clock stopped at the real current time.
    pub fn new() -> Self {
        Self::starting_at(Utc::now())
    }

    /// A clock stopped at `start`.
    pub fn starting_at(start: DateTime<Utc>) -> Self {
        Self {
            now: Mutex::new(start),
        }
    }

    /// The clock's current time.
    pub fn now(&self) -> DateTime<Utc> {
        *self
            .now
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Move the clock forward by `by`. A step too large to represent leaves the clock at the
    /// latest representable time instead of failing, since tests only use it to mean "later".
    pub fn advance(&self, by: Duration) {
        let mut now = self
            .now
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *now = chrono::Duration::from_std(by)
            .ok()
            .and_then(|step| now.checked_add_signed(step))
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_only_when_advanced() {
        let clock = Clock::new();
        let t0 = clock.now();
        assert_eq!(clock.now(), t0);
        clock.advance(Duration::from_secs(90));
        assert_eq!(clock.now() - t0, chrono::Duration::seconds(90));
    }
}
