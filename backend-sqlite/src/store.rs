//! [`SqliteStore`]: the handle the relay and operators use, one connection run on Tokio's
//! blocking pool; its trait impls are in `claim.rs` (relay side) and `admin.rs`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use rusqlite::{Connection, Transaction, TransactionBehavior};

use outbox_traits::Error;

use crate::cancel::Caller;
use crate::config::SqliteConfig;
use crate::connection::open_connection;
use crate::error::{map_err, Ctx};
use crate::migrate::migrate;
use crate::sql::Sql;

/// The SQLite outbox store: an [`OutboxStore`](outbox_traits::OutboxStore) and
/// [`OutboxAdmin`](outbox_traits::OutboxAdmin) over one file.
///
/// Each handle owns one connection. Every call runs on Tokio's blocking pool
/// ([`tokio::task::spawn_blocking`]) with that connection taken from a mutex, so the async
/// runtime's workers never wait on SQLite's disk I/O or lock waits. Why not a dedicated thread
/// with a channel: SQLite admits one writer at a time anyway, so a queue in front of the
/// connection would add no throughput, and the mutex keeps the store free of a thread's
/// lifecycle (nothing to shut down). A call whose future is dropped keeps running on its
/// thread, but rolls back instead of committing if its caller is gone by then, so an aborted
/// relay leaves (almost always) no trace of the call it was waiting for; a drop right during
/// `COMMIT` lets it take effect, which the trait's cancel-safety rules allow.
///
/// Cloning is cheap and shares the connection. Several handles (in one process or several) may
/// use the same file: writes serialize through `BEGIN IMMEDIATE`, and claims stay exclusive
/// ([`Capabilities::concurrent_claimers`](outbox_traits::Capabilities::concurrent_claimers)). One handle per process is the fastest setup: two
/// handles in one process wait on each other through SQLite's busy handler, which sleeps.
///
/// Requires a Tokio runtime (any flavour); called outside one, methods return a permanent error.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    conn: Mutex<Connection>,
    sql: Sql,
    config: SqliteConfig,
    path: PathBuf,
}

impl SqliteStore {
    /// Open the database at `path` (created if missing, its directory must exist) with
    /// [`open_connection`].
    ///
    /// Does not create the table: call [`SqliteStore::migrate`] or apply
    /// [`SqliteConfig::migration_sql`] with your own migration tool.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a missing directory; [`Error::Unavailable`] when the file
    /// cannot be opened.
    pub async fn open(path: impl AsRef<Path>, config: SqliteConfig) -> Result<Self, Error> {
        let path = path.as_ref().to_path_buf();
        let handle = runtime(Ctx::Open)?;
        let (conn, path, config) = handle
            .spawn_blocking(move || {
                let conn = open_connection(&path, &config)?;
                Ok::<_, Error>((conn, path, config))
            })
            .await
            .map_err(|e| join_error(Ctx::Open, e))??;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                conn: Mutex::new(conn),
                sql: Sql::new(config.table(), config.delete_published()),
                config,
                path,
            }),
        })
    }

    /// The configuration this store was opened with (pass it to [`crate::enqueue`]).
    pub fn config(&self) -> &SqliteConfig {
        &self.inner.config
    }

    /// Create the outbox table and indexes if missing, and check an existing table (see
    /// [`crate::migrate`]). Idempotent: safe to call at every start-up.
    ///
    /// # Errors
    /// As [`crate::migrate`]: a permanent error when an existing table is not compatible.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.blocking(Ctx::Migrate, |conn, inner, _| migrate(conn, &inner.config))
            .await?
    }

    /// The database path this store was opened with.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Run `f` in a `BEGIN IMMEDIATE` transaction on the store's own connection and commit it
    /// if `f` returns `Ok` (roll back otherwise).
    ///
    /// For applications that keep their business tables in the same file and want no second
    /// connection: write your rows and call [`crate::enqueue`] with the given transaction and
    /// config. Runs on the blocking pool like every other call, and holds this handle's
    /// connection (and SQLite's write lock) until `f` returns: keep `f` short and never wait on
    /// anything slow inside it. Convert rusqlite errors of your
    /// own statements with [`crate::sqlite_error`] (or use an error type that converts both).
    ///
    /// ```
    /// use outbox_backend_sqlite::{enqueue, sqlite_error, SqliteConfig, SqliteStore};
    /// use outbox_traits::{Error, NewMessage};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Error> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// let store = SqliteStore::open(dir.path().join("app.db"), SqliteConfig::default()).await?;
    /// store.migrate().await?;
    /// store
    ///     .transaction(|tx, config| {
    ///         tx.execute_batch("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
    ///             .map_err(sqlite_error)?;
    ///         tx.execute("INSERT INTO orders (id) VALUES (?1)", ["order-7"])
    ///             .map_err(sqlite_error)?;
    ///         let event = serde_json::json!({"id": "order-7"});
    ///         enqueue(tx, config, &NewMessage::new("order", "order-7", "order.placed", event))
    ///     })
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn transaction<T, E, F>(&self, f: F) -> Result<T, E>
    where
        F: FnOnce(&Transaction<'_>, &SqliteConfig) -> Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: From<Error> + Send + 'static,
    {
        let result = self
            .blocking(Ctx::Transaction, move |conn, inner, caller| {
                let table = inner.config.table();
                let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
                    Ok(tx) => tx,
                    Err(e) => return Err(E::from(map_err(e, Ctx::Transaction, table))),
                };
                let value = f(&tx, &inner.config)?;
                caller
                    .commit(tx, |e| map_err(e, Ctx::Transaction, table))
                    .map_err(E::from)?;
                Ok(value)
            })
            .await;
        match result {
            Ok(inner) => inner,
            Err(e) => Err(E::from(e)),
        }
    }

    /// Run `f` with the connection on the blocking pool.
    async fn blocking<R, F>(&self, ctx: Ctx, f: F) -> Result<R, Error>
    where
        F: FnOnce(&mut Connection, &Inner, &Caller) -> R + Send + 'static,
        R: Send + 'static,
    {
        let handle = runtime(ctx)?;
        let inner = Arc::clone(&self.inner);
        let caller = Caller::default();
        let waiting = caller.waiting();
        let result = handle
            .spawn_blocking(move || {
                // A panic in a caller's transaction closure poisons the mutex, but rusqlite's
                // Transaction rolls back while unwinding, so the connection is still sound.
                let mut conn = inner.conn.lock().unwrap_or_else(PoisonError::into_inner);
                if !conn.is_autocommit() {
                    // Only reachable if a caller's closure left a transaction of its own open;
                    // never let it swallow the relay's writes.
                    let _ = conn.execute_batch("ROLLBACK");
                }
                f(&mut conn, &inner, &caller)
            })
            .await
            .map_err(|e| join_error(ctx, e));
        waiting.done();
        result
    }

    /// Run a store operation that returns the contract's error.
    pub(crate) async fn run<T, F>(&self, ctx: Ctx, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Connection, &Sql, &str, &Caller) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        self.blocking(ctx, move |conn, inner, caller| {
            f(conn, &inner.sql, inner.config.table(), caller)
        })
        .await?
    }
}

fn runtime(ctx: Ctx) -> Result<tokio::runtime::Handle, Error> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        Error::permanent(
            format!(
                "sqlite: {}: SqliteStore must be used inside a Tokio runtime (it runs \
                 SQLite on the blocking pool)",
                ctx.what()
            ),
            None,
        )
    })
}

fn join_error(ctx: Ctx, err: tokio::task::JoinError) -> Error {
    if err.is_panic() {
        Error::permanent(
            format!(
                "sqlite: {}: the blocking task panicked (in a transaction closure?)",
                ctx.what()
            ),
            None,
        )
    } else {
        Error::transient(
            format!(
                "sqlite: {}: the blocking task was cancelled (runtime shutting down)",
                ctx.what()
            ),
            Some(Box::new(err)),
        )
    }
}
