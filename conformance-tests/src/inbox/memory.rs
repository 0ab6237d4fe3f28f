//! The reference inbox the suite is tested with, and its deliberate defects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use outbox_traits::{async_trait, uuid::Uuid, Error};
use tokio::sync::Notify;

use super::harness::{InboxCapabilities, InboxHarness, InboxStore, InboxTx, Mark};

/// A deliberate defect of [`MemoryInbox`], each a mistake a real inbox could make; the suite's
/// own tests require every one to be caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// The mark is written outside the consumer's transaction (committed at once), so a
    /// rolled-back or crashed handler leaves it and the redelivery is skipped: the effect is lost.
    MarkOutsideTransaction,
    /// A marked id is not detected: every delivery is new, the effect applied again.
    DuplicateNotDetected,
    /// A delivery does not wait for another open transaction's mark of the same id: both are
    /// new, and the effect is applied twice when both commit.
    ConcurrentNotBlocking,
    /// Purge deletes marks whatever their age.
    PurgeIgnoresAge,
    /// Purge deletes every old mark, ignoring the batch size.
    PurgeUnbounded,
}

/// An in-memory inbox with transactions, as a database gives them: marks and effects become
/// visible at commit, a record of an id another open transaction has marked waits until that
/// transaction ends. The suite's reference; with a [`Defect`], broken on purpose.
#[derive(Debug, Clone, Default)]
pub struct MemoryInbox {
    defect: Option<Defect>,
    serial: bool,
}

impl MemoryInbox {
    /// A correct inbox.
    pub fn new() -> Self {
        Self::default()
    }

    /// An inbox with `defect`.
    pub fn broken(defect: Defect) -> Self {
        Self {
            defect: Some(defect),
            serial: false,
        }
    }

    /// Declare no concurrent transactions (as SQLite's harness does), so that the suite plays
    /// no races against it.
    pub fn serial(mut self) -> Self {
        self.serial = true;
        self
    }
}

#[derive(Default)]
struct State {
    /// Committed marks and their age.
    marks: HashMap<Mark, Duration>,
    effects: Vec<Mark>,
    /// Marks of open transactions, by transaction.
    pending: HashMap<Mark, u64>,
    waiting: u64,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Notify,
    next_tx: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere cannot leave the maps half-updated in a way that matters here.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct MemoryStore {
    shared: Arc<Shared>,
    defect: Option<Defect>,
    serial: bool,
}

#[async_trait]
impl InboxHarness for MemoryInbox {
    fn name(&self) -> String {
        match self.defect {
            None => "memory inbox".into(),
            Some(d) => format!("memory inbox with defect {d:?} (serial: {})", self.serial),
        }
    }

    async fn fresh(&self) -> Result<Box<dyn InboxStore>, Error> {
        Ok(Box::new(MemoryStore {
            shared: Arc::default(),
            defect: self.defect,
            serial: self.serial,
        }))
    }
}

#[async_trait]
impl InboxStore for MemoryStore {
    fn capabilities(&self) -> InboxCapabilities {
        InboxCapabilities::new().with_concurrent_transactions(!self.serial)
    }

    async fn begin(&self) -> Result<Box<dyn InboxTx>, Error> {
        Ok(Box::new(MemoryTx {
            shared: self.shared.clone(),
            defect: self.defect,
            id: self.shared.next_tx.fetch_add(1, Ordering::Relaxed),
            marks: Vec::new(),
            effects: Vec::new(),
        }))
    }

    async fn marks(&self) -> Result<Vec<Mark>, Error> {
        Ok(self.shared.lock().marks.keys().cloned().collect())
    }

    async fn effects(&self) -> Result<Vec<Mark>, Error> {
        Ok(self.shared.lock().effects.clone())
    }

    async fn age_marks(&self, by: Duration) -> Result<(), Error> {
        self.shared
            .lock()
            .marks
            .values_mut()
            .for_each(|age| *age += by);
        Ok(())
    }

    async fn lock_waits(&self) -> Result<Option<u64>, Error> {
        Ok(Some(self.shared.lock().waiting))
    }

    async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64, Error> {
        let mut state = self.shared.lock();
        let mut old: Vec<(Mark, Duration)> = state
            .marks
            .iter()
            .filter(|(_, age)| **age > older_than || self.defect == Some(Defect::PurgeIgnoresAge))
            .map(|(m, age)| (m.clone(), *age))
            .collect();
        old.sort_by_key(|(_, age)| std::cmp::Reverse(*age));
        if self.defect != Some(Defect::PurgeUnbounded) {
            old.truncate(batch as usize);
        }
        for (mark, _) in &old {
            state.marks.remove(mark);
        }
        Ok(old.len() as u64)
    }
}

struct MemoryTx {
    shared: Arc<Shared>,
    defect: Option<Defect>,
    id: u64,
    marks: Vec<Mark>,
    effects: Vec<Mark>,
}

impl MemoryTx {
    /// Record one id: `Some(new)` when decided, `None` when another open transaction holds it.
    fn try_record(&mut self, state: &mut State, mark: &Mark) -> Option<bool> {
        let outside = self.defect == Some(Defect::MarkOutsideTransaction);
        if state.marks.contains_key(mark) && self.defect != Some(Defect::DuplicateNotDetected) {
            return Some(false);
        }
        match state.pending.get(mark) {
            Some(owner) if *owner == self.id => return Some(false),
            Some(_) if self.defect != Some(Defect::ConcurrentNotBlocking) => return None,
            _ => {}
        }
        if outside {
            state.marks.insert(mark.clone(), Duration::ZERO);
        } else {
            state.pending.insert(mark.clone(), self.id);
            self.marks.push(mark.clone());
        }
        Some(true)
    }

    fn end(&mut self, commit: bool) {
        let mut state = self.shared.lock();
        for mark in self.marks.drain(..) {
            if state.pending.get(&mark) == Some(&self.id) {
                state.pending.remove(&mark);
            }
            if commit {
                state.marks.insert(mark, Duration::ZERO);
            }
        }
        if commit {
            state.effects.append(&mut self.effects);
        }
        self.effects.clear();
        drop(state);
        self.shared.changed.notify_waiters();
    }
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        self.end(false);
    }
}

#[async_trait]
impl InboxTx for MemoryTx {
    async fn record(&mut self, consumer: &str, ids: &[Uuid]) -> Result<Vec<bool>, Error> {
        if consumer.is_empty() || consumer.chars().count() > 200 {
            return Err(Error::invalid_input("bad consumer name"));
        }
        let shared = self.shared.clone();
        let mut answers = Vec::with_capacity(ids.len());
        for id in ids {
            let mark = (consumer.to_owned(), *id);
            loop {
                let changed = shared.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                let decided = {
                    let mut state = shared.lock();
                    let decided = self.try_record(&mut state, &mark);
                    if decided.is_none() {
                        state.waiting += 1;
                    }
                    decided
                };
                if let Some(new) = decided {
                    answers.push(new);
                    break;
                }
                changed.await;
                shared.lock().waiting -= 1;
            }
        }
        Ok(answers)
    }

    async fn apply_effect(&mut self, consumer: &str, id: Uuid) -> Result<(), Error> {
        self.effects.push((consumer.to_owned(), id));
        Ok(())
    }

    async fn commit(mut self: Box<Self>) -> Result<(), Error> {
        self.end(true);
        Ok(())
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), Error> {
        self.end(false);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbox::{check_batch_receipts, check_inbox, check_refusals};
    use proptest::test_runner::Config;

    #[test]
    fn the_reference_inbox_passes() {
        let inbox = MemoryInbox::new();
        check_inbox(&inbox, Config::with_cases(64)).unwrap();
        check_batch_receipts(&inbox).unwrap();
        check_refusals(&inbox).unwrap();
        check_inbox(&inbox.serial(), Config::with_cases(32)).unwrap();
    }

    #[test]
    fn every_defect_is_caught() {
        for defect in [
            Defect::MarkOutsideTransaction,
            Defect::DuplicateNotDetected,
            Defect::ConcurrentNotBlocking,
            Defect::PurgeIgnoresAge,
            Defect::PurgeUnbounded,
        ] {
            // Also without races, except for the defect only a race shows.
            let serial = (defect != Defect::ConcurrentNotBlocking)
                .then(|| MemoryInbox::broken(defect).serial());
            for inbox in std::iter::once(MemoryInbox::broken(defect)).chain(serial) {
                let config = Config {
                    failure_persistence: None,
                    ..Config::with_cases(200)
                };
                let report = check_inbox(&inbox, config)
                    .expect_err(&format!("{} was not caught", inbox.name()));
                assert!(report.contains("shrunk scenario"), "{report}");
            }
        }
    }
}
