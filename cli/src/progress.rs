//! Progress of long commands (purge, drain, bulk requeue and discard): a bar on a terminal,
//! one summary line per interval otherwise (log files, CI, cron mail).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often a summary line is printed off a terminal.
pub const LINE_EVERY: Duration = Duration::from_secs(5);

/// Progress of one command, on standard error.
pub struct Progress {
    what: &'static str,
    total: Option<u64>,
    done: u64,
    bar: Option<ProgressBar>,
    started: Instant,
    last_line: Instant,
}

impl Progress {
    /// Start showing progress of `what` (e.g. `purged`), out of `total` if known.
    pub fn new(what: &'static str, total: Option<u64>) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = match total {
                Some(total) => ProgressBar::new(total),
                None => ProgressBar::new_spinner(),
            };
            let template = if total.is_some() {
                "{msg} [{bar:40}] {pos}/{len} ({per_sec}, {eta} left)"
            } else {
                "{spinner} {msg} {pos} ({per_sec})"
            };
            if let Ok(style) = ProgressStyle::with_template(template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(what);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        let now = Instant::now();
        Self {
            what,
            total,
            done: 0,
            bar,
            started: now,
            last_line: now,
        }
    }

    /// How often it is worth updating: often for a bar, once per line interval otherwise.
    pub fn update_every(&self) -> Duration {
        if self.bar.is_some() {
            Duration::from_secs(1)
        } else {
            LINE_EVERY
        }
    }

    /// Set how many are done so far.
    pub fn set(&mut self, done: u64) {
        self.done = done;
        match &self.bar {
            Some(bar) => bar.set_position(done),
            None => {
                if self.last_line.elapsed() >= LINE_EVERY {
                    self.last_line = Instant::now();
                    self.line("so far");
                }
            }
        }
    }

    fn line(&self, when: &str) {
        let secs = self.started.elapsed().as_secs_f64();
        let rate = if secs > 0.0 {
            self.done as f64 / secs
        } else {
            0.0
        };
        let of = self.total.map(|t| format!(" of {t}")).unwrap_or_default();
        eprintln!(
            "outbox-relay: {what} {done}{of} {when} ({secs:.1}s, {rate:.0}/s)",
            what = self.what,
            done = self.done,
        );
    }

    /// Stop showing progress, with a closing line off a terminal.
    pub fn finish(self) {
        match &self.bar {
            Some(bar) => bar.finish_and_clear(),
            None => self.line("in all"),
        }
    }
}
