//! Rolling back the work of a call whose caller went away.
//!
//! Store calls run on the blocking pool, and dropping the async call does not stop that work.
//! Without a check, a dropped `fail` or `claim` would still commit, and its caller (an aborted
//! relay task) would never learn it: a claim's leases would sit unused until they expire, and a
//! failure would be counted that nobody saw accepted. So the work checks, just before `COMMIT`,
//! whether its caller is still waiting, and rolls back if not. A drop that lands after the check
//! can still see the call take effect; the trait's cancel-safety rules allow both outcomes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rusqlite::Transaction;

use outbox_traits::Error;

/// Whether the caller of one store call is still waiting for its result.
#[derive(Debug, Clone, Default)]
pub(crate) struct Caller {
    gone: Arc<AtomicBool>,
}

impl Caller {
    /// A guard that marks the caller gone when dropped before [`Waiting::done`].
    pub(crate) fn waiting(&self) -> Waiting {
        Waiting {
            gone: Some(Arc::clone(&self.gone)),
        }
    }

    fn is_gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// Commit `tx`, or roll it back if the caller went away.
    pub(crate) fn commit(
        &self,
        tx: Transaction<'_>,
        err: impl Fn(rusqlite::Error) -> Error,
    ) -> Result<(), Error> {
        if self.is_gone() {
            tx.rollback().map_err(err)?;
            return Err(Error::transient(
                "sqlite: the caller stopped waiting, so the transaction was rolled back",
                None,
            ));
        }
        tx.commit().map_err(err)
    }
}

/// Held by the async side while it awaits the blocking work.
pub(crate) struct Waiting {
    gone: Option<Arc<AtomicBool>>,
}

impl Waiting {
    /// The result arrived: the caller did not go away.
    pub(crate) fn done(mut self) {
        self.gone = None;
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(gone) = self.gone.take() {
            gone.store(true, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_waiter_rolls_back_and_a_finished_one_commits() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (x INTEGER)").unwrap();
        let err = |e: rusqlite::Error| Error::permanent(e.to_string(), None);

        let caller = Caller::default();
        drop(caller.waiting());
        let tx = conn.transaction().unwrap();
        tx.execute("INSERT INTO t VALUES (1)", []).unwrap();
        assert!(caller.commit(tx, err).unwrap_err().is_transient());

        let caller = Caller::default();
        caller.waiting().done();
        let tx = conn.transaction().unwrap();
        tx.execute("INSERT INTO t VALUES (2)", []).unwrap();
        caller.commit(tx, err).unwrap();

        let rows: Vec<i64> = conn
            .prepare("SELECT x FROM t")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(rows, vec![2]);
    }
}
