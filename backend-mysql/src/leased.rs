//! The seqs of the rows a store handle leased, by id: a transition of those rows then locks
//! them by primary key at once, without first reading them by id (a plain read through the id
//! index that cost MariaDB about 5 µs a message, `BENCHMARKS.md`).
//!
//! Only a shortcut. The transition's locking read checks the fence (token, pending, unexpired
//! lease) on every row as before, so a seq remembered for a row whose lease was lost changes
//! nothing. Ids it does not know (another process's claim, an entry forgotten or evicted) send
//! the transition the old way.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use outbox_traits::LeaseToken;
use uuid::Uuid;

/// How long past its claim's lease an entry is kept. A batch the relay never completes, fails or
/// releases (its lease lost, the relay gave up on it) is evicted after this; a batch extended
/// past it only loses the shortcut.
const KEEP_PAST_LEASE: Duration = Duration::from_secs(300);

struct Entry {
    token: LeaseToken,
    seq: i64,
    until: Instant,
}

/// Id → (token, seq) of the rows this handle's claims leased, shared by its clones.
#[derive(Default)]
pub(crate) struct LeasedSeqs {
    map: Mutex<HashMap<Uuid, Entry>>,
}

impl LeasedSeqs {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Entry>> {
        // No code panics while holding the lock; if one ever did, the map is still whole.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remember a claim's rows (id and seq of each message), and evict the entries of batches
    /// long past their lease.
    pub(crate) fn remember(
        &self,
        token: LeaseToken,
        rows: impl IntoIterator<Item = (Uuid, i64)>,
        lease: Duration,
    ) {
        let now = Instant::now();
        let until = now + lease + KEEP_PAST_LEASE;
        let mut map = self.entries();
        map.retain(|_, e| e.until > now);
        for (id, seq) in rows {
            map.insert(id, Entry { token, seq, until });
        }
    }

    /// The seqs of `ids` (deduplicated, sorted by id) if every one was leased under `token` by
    /// this handle; `None` otherwise.
    pub(crate) fn recall(&self, token: LeaseToken, ids: &[Uuid]) -> Option<Vec<(Uuid, i64)>> {
        let map = self.entries();
        let mut found = Vec::with_capacity(ids.len());
        for id in ids {
            let entry = map.get(id)?;
            if entry.token != token {
                return None;
            }
            found.push((*id, entry.seq));
        }
        found.sort_unstable();
        found.dedup();
        Some(found)
    }

    /// Forget `ids` leased under `token` (their transition is done).
    pub(crate) fn forget(&self, token: LeaseToken, ids: &[Uuid]) {
        let mut map = self.entries();
        for id in ids {
            if map.get(id).is_some_and(|e| e.token == token) {
                map.remove(id);
            }
        }
    }

    /// How many entries are kept (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(seq: i64) -> (Uuid, i64) {
        (Uuid::now_v7(), seq)
    }

    #[test]
    fn recalls_only_a_whole_batch_under_its_own_token() {
        let leased = LeasedSeqs::default();
        let (a, b) = (LeaseToken::new(), LeaseToken::new());
        let (m1, m2, m3) = (row(1), row(2), row(3));
        leased.remember(a, [m1, m2], Duration::from_secs(30));
        leased.remember(b, [m3], Duration::from_secs(30));
        let mut want = vec![m1, m2];
        want.sort_unstable();
        assert_eq!(leased.recall(a, &[m2.0, m1.0, m2.0]), Some(want));
        // Another token's row, or one never leased here: the transition reads by id.
        assert_eq!(leased.recall(a, &[m1.0, m3.0]), None);
        assert_eq!(leased.recall(b, &[m1.0]), None);
        assert_eq!(leased.recall(a, &[Uuid::now_v7()]), None);
        // Forgetting under another token keeps the entry.
        leased.forget(b, &[m1.0]);
        assert_eq!(leased.recall(a, &[m1.0]), Some(vec![m1]));
        leased.forget(a, &[m1.0, m2.0]);
        assert_eq!(leased.recall(a, &[m1.0]), None);
        assert_eq!(leased.len(), 1);
    }

    #[test]
    fn evicts_batches_long_past_their_lease() {
        let leased = LeasedSeqs::default();
        let token = LeaseToken::new();
        let old = row(1);
        leased.remember(token, [old], Duration::ZERO);
        // Its time is up: set it in the past rather than wait.
        leased
            .entries()
            .values_mut()
            .for_each(|e| e.until = Instant::now() - Duration::from_secs(1));
        leased.remember(token, [row(2)], Duration::from_secs(30));
        assert_eq!(leased.len(), 1);
        assert_eq!(leased.recall(token, &[old.0]), None);
    }
}
