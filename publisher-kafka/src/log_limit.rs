//! A process-wide limit on librdkafka's own log lines: while a broker is unreachable
//! librdkafka repeats the same connection errors many times a second (129 lines in 20 s were
//! seen), which would drown the relay's own lines. At most [`LINES_PER_WINDOW`] lines pass per
//! [`WINDOW`]; the first line of the next window says how many were dropped.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Length of one window.
pub(crate) const WINDOW: Duration = Duration::from_secs(10);

/// Lines let through per window.
pub(crate) const LINES_PER_WINDOW: u32 = 5;

/// The state of the current window.
#[derive(Debug)]
pub(crate) struct LogLimit {
    state: Mutex<Option<(Instant, u32, u64)>>,
}

impl LogLimit {
    /// A limiter whose first window starts with its first line.
    pub(crate) const fn new() -> Self {
        Self {
            state: Mutex::new(None),
        }
    }

    /// Whether a line seen at `now` may be logged: `Some(dropped)` (how many lines were dropped
    /// since the last one let through), or `None` to drop it.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match state.as_mut() {
            Some((start, passed, dropped)) if now.duration_since(*start) < WINDOW => {
                if *passed < LINES_PER_WINDOW {
                    *passed += 1;
                    Some(std::mem::take(dropped))
                } else {
                    *dropped = dropped.saturating_add(1);
                    None
                }
            }
            Some((start, passed, dropped)) => {
                *start = now;
                *passed = 1;
                Some(std::mem::take(dropped))
            }
            None => {
                *state = Some((now, 1, 0));
                Some(0)
            }
        }
    }
}

/// The limiter every producer of this process shares.
pub(crate) static LIBRDKAFKA_LOG: LogLimit = LogLimit::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lets_a_few_lines_through_per_window_and_counts_the_rest() {
        let limit = LogLimit::new();
        let t0 = Instant::now();
        for _ in 0..LINES_PER_WINDOW {
            assert_eq!(limit.admit(t0), Some(0));
        }
        for _ in 0..100 {
            assert_eq!(limit.admit(t0 + Duration::from_secs(1)), None);
        }
        // The next window's first line reports the dropped ones, once.
        assert_eq!(limit.admit(t0 + WINDOW), Some(100));
        assert_eq!(limit.admit(t0 + WINDOW), Some(0));
    }
}
