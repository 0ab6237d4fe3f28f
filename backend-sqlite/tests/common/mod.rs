//! The conformance harness of the SQLite store, shared by `conformance.rs` and
//! `skewed_clock.rs`.
//!
//! Every case gets its own database file in a temp directory. Relays are separate
//! [`SqliteStore`] handles, each with its own connection, so the suite's concurrent relays really
//! contend through `BEGIN IMMEDIATE`; dropping one closes its connection and leaves its leases in
//! the file, as a crashed process would. Time moves by shifting every stored time back.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outbox_backend_sqlite::{
    enqueue_batch, open_connection, sqlite_error, SqliteConfig, SqliteStore,
};
use outbox_conformance_tests::harness::{
    Harness, HarnessCapabilities, HarnessStore, HarnessTx, RawRow,
};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{async_trait, Error, NewMessage, OutboxAdmin, OutboxStore};
use rusqlite::functions::FunctionFlags;
use rusqlite::{Connection, TransactionBehavior};
use tempfile::TempDir;
use tokio::sync::oneshot;

/// The store's "now" (`outbox_backend_sqlite`'s `NOW_MS`, private to it): every lease end, due
/// time and age of the store is computed from it, read once per transaction.
const NOW_MS_SQL: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";

/// The Julian day of the Unix epoch.
const UNIX_EPOCH_JULIAN_DAY: f64 = 2_440_587.5;

fn refuse(what: &str) -> rusqlite::Error {
    rusqlite::Error::UserFunctionError(
        format!("the skewed test clock serves only julianday('now'), not {what}").into(),
    )
}

/// Move SQLite's clock on `conn` by `offset_ms` (nothing when 0), leaving the process's clock
/// (the relay's `SystemTime`) alone.
///
/// SQLite is embedded: its "database clock" is the host's clock read by SQLite's own date
/// functions, and the store takes every time from one of them, `julianday('now')` (its
/// `NOW_MS`, which works on SQLite 3.35 and later). An application-defined function overrides a
/// built-in one of the same name and arity on its connection, so this one answers that call
/// with the host's time + `offset_ms`. A store that reads the host's clock anywhere instead
/// (`SystemTime::now()` in Rust, or another SQL time function) is then off by the offset,
/// exactly as a relay on a host whose clock differs from a database server's. Other forms of
/// `julianday`, and every form of `unixepoch`, are refused, so a statement of the store that
/// reads time differently fails loudly instead of escaping the skew.
pub fn skew_clock(conn: &Connection, offset_ms: i64) -> Result<(), Error> {
    if offset_ms == 0 {
        return Ok(());
    }
    conn.create_scalar_function("julianday", 1, FunctionFlags::SQLITE_UTF8, move |ctx| {
        let what: String = ctx.get(0)?;
        if what != "now" {
            return Err(refuse(&format!("julianday({what:?})")));
        }
        let host = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| rusqlite::Error::UserFunctionError(e.into()))?;
        let ms = host.as_millis() as f64 + offset_ms as f64;
        Ok(ms / 86_400_000.0 + UNIX_EPOCH_JULIAN_DAY)
    })
    .map_err(sqlite_error)?;
    for (name, arity) in [
        ("julianday", 2),
        ("unixepoch", 0),
        ("unixepoch", 1),
        ("unixepoch", 2),
    ] {
        conn.create_scalar_function(name, arity, FunctionFlags::SQLITE_UTF8, move |_| {
            Err::<f64, _>(refuse(&format!("{name} with {arity} arguments")))
        })
        .map_err(sqlite_error)?;
    }
    Ok(())
}

/// A store on its own connection to `path`, its clock moved by `offset_ms`.
async fn open_store(
    path: &Path,
    config: &SqliteConfig,
    offset_ms: i64,
) -> Result<SqliteStore, Error> {
    let store = SqliteStore::open(path, config.clone()).await?;
    store
        .transaction(move |tx, _| skew_clock(tx, offset_ms))
        .await?;
    Ok(store)
}

/// Fresh stores keep published rows, or delete them with `delete_published`.
pub struct SqliteHarness {
    /// Stores delete messages as they are published.
    pub delete_published: bool,
    /// How far every connection's SQLite clock is moved from the host's, in milliseconds
    /// (see [`skew_clock`]); 0 for the host's clock.
    pub clock_offset_ms: i64,
}

#[async_trait]
impl Harness for SqliteHarness {
    fn name(&self) -> String {
        let mut name = String::from("sqlite");
        if self.delete_published {
            name.push_str(", deleting published");
        }
        if self.clock_offset_ms != 0 {
            name.push_str(", SQLite clock skewed from the host's");
        }
        name
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        let dir =
            tempfile::tempdir().map_err(|e| Error::unavailable("temp dir", e.to_string(), e))?;
        let path = dir.path().join("outbox.db");
        let config = SqliteConfig::builder()
            .delete_published(self.delete_published)
            .build()?;
        let offset = self.clock_offset_ms;
        let admin = open_store(&path, &config, offset).await?;
        admin.migrate().await?;
        Ok(Box::new(SqliteHarnessStore {
            _dir: dir,
            path,
            config,
            admin,
            clock_offset_ms: offset,
        }))
    }
}

struct SqliteHarnessStore {
    /// Deleted (with the database) when the store is torn down or dropped.
    _dir: TempDir,
    path: PathBuf,
    config: SqliteConfig,
    admin: SqliteStore,
    clock_offset_ms: i64,
}

#[async_trait]
impl HarnessStore for SqliteHarnessStore {
    fn capabilities(&self) -> HarnessCapabilities {
        // One writer at a time: a transaction holds the write lock from BEGIN IMMEDIATE.
        HarnessCapabilities::new(OutboxStore::capabilities(&self.admin))
            .with_concurrent_transactions(false)
            .with_skewed_clock(self.clock_offset_ms != 0)
            .with_raw_rows(true, true, true)
    }

    /// One plain `INSERT` per row of the columns given, in one transaction on the admin
    /// connection. Unchecked: with `ignore_check_constraints` on and the headers trigger
    /// dropped, as in a table made before them.
    async fn insert_raw(&self, rows: &[RawRow], checked: bool) -> Result<(), Error> {
        let rows = rows.to_vec();
        self.admin
            .transaction(move |tx, config| {
                let table = config.table();
                if !checked {
                    tx.execute_batch(&format!(
                        "PRAGMA ignore_check_constraints = ON; \
                         DROP TRIGGER IF EXISTS {table}_headers;"
                    ))
                    .map_err(sqlite_error)?;
                }
                let inserted = rows.iter().try_for_each(|row| {
                    let mut columns = vec!["aggregatetype", "aggregateid", "type", "payload"];
                    let mut values = vec![
                        row.aggregate_type.as_str(),
                        row.aggregate_id.as_str(),
                        row.event_type.as_str(),
                        row.payload.as_str(),
                    ];
                    for (column, value) in [
                        ("id", &row.id),
                        ("partition_key", &row.partition_key),
                        ("headers", &row.headers),
                    ] {
                        if let Some(value) = value {
                            columns.push(column);
                            values.push(value);
                        }
                    }
                    let sql = format!(
                        "INSERT INTO {table} ({}) VALUES ({})",
                        columns.join(", "),
                        vec!["?"; values.len()].join(", ")
                    );
                    tx.execute(&sql, rusqlite::params_from_iter(values))
                        .map(|_| ())
                        .map_err(sqlite_error)
                });
                if !checked {
                    tx.execute_batch("PRAGMA ignore_check_constraints = OFF;")
                        .map_err(sqlite_error)?;
                }
                inserted
            })
            .await
    }

    async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error> {
        Ok(Arc::new(
            open_store(&self.path, &self.config, self.clock_offset_ms).await?,
        ))
    }

    async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error> {
        Ok(Arc::new(self.admin.clone()))
    }

    async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error> {
        SqliteHarnessTx::begin(self.path.clone(), self.config.clone(), self.clock_offset_ms).await
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

    /// SQLite's clock as the store reads it (the expression every statement of the store
    /// takes "now" from), on the admin connection.
    async fn now(&self) -> Result<DateTime<Utc>, Error> {
        let ms: i64 = self
            .admin
            .transaction(|tx, _| {
                tx.query_row(&format!("SELECT {NOW_MS_SQL}"), [], |r| r.get(0))
                    .map_err(sqlite_error)
            })
            .await?;
        DateTime::from_timestamp_millis(ms)
            .ok_or_else(|| Error::permanent(format!("SQLite's now {ms} ms is out of range"), None))
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
    async fn begin(
        path: PathBuf,
        config: SqliteConfig,
        clock_offset_ms: i64,
    ) -> Result<Box<dyn HarnessTx>, Error> {
        let (cmds, rx) = mpsc::channel::<Cmd>();
        let (ready, started) = oneshot::channel::<Result<(), Error>>();
        std::thread::spawn(move || {
            let opened = open_connection(&path, &config)
                .and_then(|conn| skew_clock(&conn, clock_offset_ms).map(|()| conn));
            let mut conn = match opened {
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
