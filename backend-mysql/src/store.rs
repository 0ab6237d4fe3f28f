//! [`MysqlStore`]: the handle the relay and operators use, a pool and a [`MysqlConfig`] (the
//! shared [`SqlxStore`]); its trait impls are in `claim.rs` (relay side) and `admin.rs`.

use std::fmt;
use std::sync::Arc;

use outbox_sql_support::SqlxStore;
use outbox_traits::Error;
use sqlx::mysql::{MySql, MySqlPool};
use sqlx::pool::PoolOptions;
use sqlx::Executor;

use crate::config::MysqlConfig;
use crate::error::{map_sqlx, WHAT};
use crate::leased::LeasedSeqs;
use crate::migrate::migrate;
use crate::sql::IDLE_TRANSACTION_SECS;

/// How many times a transaction that InnoDB rolled back as a deadlock victim is run again
/// before the (transient) error is returned.
pub(crate) const DEADLOCK_RETRIES: usize = 3;

/// An [`OutboxStore`](outbox_traits::OutboxStore) and [`OutboxAdmin`](outbox_traits::OutboxAdmin)
/// over a MariaDB (MySQL) table.
///
/// Holds a connection pool and a [`MysqlConfig`]; cloning is cheap and shares the pool. Every
/// method is one statement or one short transaction of a fixed number of statements, so no
/// lock or transaction is held between calls.
#[derive(Clone)]
pub struct MysqlStore {
    inner: SqlxStore<MySql, MysqlConfig>,
    /// The seqs of the rows this handle's claims leased, for their transitions (see
    /// [`LeasedSeqs`]); shared by clones.
    pub(crate) leased: Arc<LeasedSeqs>,
}

impl fmt::Debug for MysqlStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt_as("MysqlStore", f)
    }
}

impl MysqlStore {
    /// A store over an existing pool (share your application's pool, or build one with the
    /// connection settings you need).
    pub fn new(pool: MySqlPool, config: MysqlConfig) -> Self {
        Self {
            inner: SqlxStore::new(pool, config),
            leased: Arc::default(),
        }
    }

    /// Connect a new pool (sqlx's default size; 10 s to get a connection).
    ///
    /// Does not create the table: call [`MysqlStore::migrate`] or apply
    /// [`MysqlConfig::migration_sql`] with your own migration tool.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a malformed URL and [`Error::Unavailable`] when the server
    /// cannot be reached; neither message contains the URL's password.
    ///
    /// Its connections end a transaction left idle for 5 seconds (`idle_transaction_timeout`):
    /// a relay frozen mid-claim then frees the rows it locked within that time. Set the same on
    /// a pool you pass to [`MysqlStore::new`] for the same bound (see the crate docs, "A frozen
    /// relay").
    pub async fn connect(url: &str, config: MysqlConfig) -> Result<Self, Error> {
        let pool = PoolOptions::<MySql>::new().after_connect(|conn, _| {
            Box::pin(async move {
                let set = format!("SET SESSION idle_transaction_timeout = {IDLE_TRANSACTION_SECS}");
                conn.execute(set.as_str()).await?;
                Ok(())
            })
        });
        Ok(Self {
            inner: SqlxStore::connect_with(url, WHAT, config, pool).await?,
            leased: Arc::default(),
        })
    }

    /// The connection pool, e.g. to begin the transactions you pass to [`crate::enqueue`].
    pub fn pool(&self) -> &MySqlPool {
        self.inner.pool()
    }

    /// The table and settings this store uses.
    pub fn config(&self) -> &MysqlConfig {
        self.inner.config()
    }

    /// Create the database (if the config names one), table and indexes if missing (see
    /// [`crate::migrate`]).
    ///
    /// # Errors
    /// As [`crate::migrate`].
    pub async fn migrate(&self) -> Result<(), Error> {
        migrate(self.pool(), self.config()).await
    }

    /// Maps a sqlx error of operation `op` on this store's table.
    pub(crate) fn err(&self, op: &str) -> impl Fn(sqlx::Error) -> Error + '_ {
        let op = op.to_owned();
        move |e| map_sqlx(e, &op, self.config().qualified_table())
    }
}
