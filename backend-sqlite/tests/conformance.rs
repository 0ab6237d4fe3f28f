//! The conformance suite (`outbox-conformance-tests`) against the SQLite store, keeping published
//! rows (the default) and deleting them (`delete_published`).
//!
//! Every case gets its own database file in a temp directory. Relays are separate
//! [`SqliteStore`] handles, each with its own connection, so the suite's concurrent relays really
//! contend through `BEGIN IMMEDIATE`; dropping one closes its connection and leaves its leases in
//! the file, as a crashed process would. Time moves by shifting every stored time back.

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use outbox_backend_sqlite::{
    enqueue_batch, open_connection, sqlite_error, SqliteConfig, SqliteStore,
};
use outbox_conformance_tests::harness::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
use outbox_traits::{async_trait, Error, NewMessage, OutboxAdmin, OutboxStore};
use rusqlite::TransactionBehavior;
use tempfile::TempDir;
use tokio::sync::oneshot;

/// Fresh stores keep published rows, or delete them with `delete_published`.
struct SqliteHarness {
    delete_published: bool,
}

#[async_trait]
impl Harness for SqliteHarness {
    fn name(&self) -> String {
        if self.delete_published {
            "sqlite, deleting published".into()
        } else {
            "sqlite".into()
        }
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        let dir =
            tempfile::tempdir().map_err(|e| Error::unavailable("temp dir", e.to_string(), e))?;
        let path = dir.path().join("outbox.db");
        let config = SqliteConfig::builder()
            .delete_published(self.delete_published)
            .build()?;
        let admin = SqliteStore::open(&path, config.clone()).await?;
        admin.migrate().await?;
        Ok(Box::new(SqliteHarnessStore {
            _dir: dir,
            path,
            config,
            admin,
        }))
    }
}

struct SqliteHarnessStore {
    /// Deleted (with the database) when the store is torn down or dropped.
    _dir: TempDir,
    path: PathBuf,
    config: SqliteConfig,
    admin: SqliteStore,
}

#[async_trait]
impl HarnessStore for SqliteHarnessStore {
    fn capabilities(&self) -> HarnessCapabilities {
        // One writer at a time: a transaction holds the write lock from BEGIN IMMEDIATE.
        HarnessCapabilities::new(OutboxStore::capabilities(&self.admin))
            .with_concurrent_transactions(false)
    }

    async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error> {
        Ok(Arc::new(
            SqliteStore::open(&self.path, self.config.clone()).await?,
        ))
    }

    async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error> {
        Ok(Arc::new(self.admin.clone()))
    }

    async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error> {
        SqliteHarnessTx::begin(self.path.clone(), self.config.clone()).await
    }

    async fn advance_time(&self, by: Duration) -> Result<(), Error> {
        // Round up so that everything due within `by` is due afterwards.
        let ms = i64::try_from(by.as_micros().div_ceil(1000))
            .map_err(|_| Error::invalid_input("advance_time: duration too long"))?;
        self.admin
            .transaction(move |tx, config| {
                tx.execute(
                    &format!(
                        "UPDATE {} SET available_at = available_at - ?1, \
                         lease_until = lease_until - ?1, created_at = created_at - ?1, \
                         published_at = published_at - ?1",
                        config.table()
                    ),
                    [ms],
                )
                .map_err(sqlite_error)?;
                Ok::<_, Error>(())
            })
            .await
    }
}

/// What the transaction's thread is asked to do.
enum Cmd {
    Enqueue(Vec<NewMessage>, oneshot::Sender<Result<(), Error>>),
    Finish {
        commit: bool,
        reply: oneshot::Sender<Result<(), Error>>,
    },
}

/// A real rusqlite transaction on its own connection. A `rusqlite::Transaction` borrows its
/// connection, so both live on a thread that runs the suite's commands; dropping the handle
/// closes the channel, and the thread drops the transaction, which rolls it back.
struct SqliteHarnessTx {
    cmds: mpsc::Sender<Cmd>,
}

impl SqliteHarnessTx {
    async fn begin(path: PathBuf, config: SqliteConfig) -> Result<Box<dyn HarnessTx>, Error> {
        let (cmds, rx) = mpsc::channel::<Cmd>();
        let (ready, started) = oneshot::channel::<Result<(), Error>>();
        std::thread::spawn(move || {
            let mut conn = match open_connection(&path, &config) {
                Ok(conn) => conn,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
                Ok(tx) => tx,
                Err(e) => {
                    let _ = ready.send(Err(sqlite_error(e)));
                    return;
                }
            };
            let _ = ready.send(Ok(()));
            while let Ok(cmd) = rx.recv() {
                match cmd {
                    Cmd::Enqueue(messages, reply) => {
                        let _ = reply.send(enqueue_batch(&tx, &config, &messages));
                    }
                    Cmd::Finish { commit, reply } => {
                        let done = if commit { tx.commit() } else { tx.rollback() };
                        let _ = reply.send(done.map_err(sqlite_error));
                        return;
                    }
                }
            }
        });
        started.await.map_err(|_| thread_gone())??;
        Ok(Box::new(SqliteHarnessTx { cmds }))
    }

    async fn finish(self, commit: bool) -> Result<(), Error> {
        let (reply, answer) = oneshot::channel();
        self.cmds
            .send(Cmd::Finish { commit, reply })
            .map_err(|_| thread_gone())?;
        answer.await.map_err(|_| thread_gone())?
    }
}

fn thread_gone() -> Error {
    Error::permanent("the transaction's thread ended", None)
}

#[async_trait]
impl HarnessTx for SqliteHarnessTx {
    async fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error> {
        let (reply, answer) = oneshot::channel();
        self.cmds
            .send(Cmd::Enqueue(messages.to_vec(), reply))
            .map_err(|_| thread_gone())?;
        answer.await.map_err(|_| thread_gone())?
    }

    async fn commit(self: Box<Self>) -> Result<(), Error> {
        self.finish(true).await
    }

    async fn rollback(self: Box<Self>) -> Result<(), Error> {
        self.finish(false).await
    }
}

outbox_conformance_tests::conformance_suite!(SqliteHarness {
    delete_published: false
});

/// The same suite with `delete_published`: completing deletes the row.
mod deleting_published {
    use super::SqliteHarness;

    outbox_conformance_tests::conformance_suite!(SqliteHarness {
        delete_published: true
    });
}
