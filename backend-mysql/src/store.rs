//! [`MysqlStore`]: the handle the relay and operators use, a pool and a [`MysqlConfig`] (the
//! shared [`SqlxStore`]); its trait impls are in `claim.rs` (relay side) and `admin.rs`.

use std::fmt;
use std::sync::{Arc, OnceLock};

use outbox_sql_support::SqlxStore;
use outbox_traits::Error;
use sqlx::mysql::{MySql, MySqlPool};
use sqlx::pool::PoolOptions;
use sqlx::Executor;

use crate::config::MysqlConfig;
use crate::error::{map_sqlx, WHAT};
use crate::leased::LeasedSeqs;
use crate::migrate::migrate;
use crate::sql::Sql;
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
    /// The layout found for the table when the config names none: whether it has an
    /// unpublished table (see [`MysqlStore::sql`]); shared by clones.
    layout: Arc<OnceLock<bool>>,
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
            layout: Arc::default(),
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
            layout: Arc::default(),
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

    /// Convert the table from claim indexes of its own to an unpublished table; `false` when it
    /// had one already (see [`crate::convert_to_unpublished_table`]: stop the table's relays
    /// first).
    ///
    /// # Errors
    /// As [`crate::convert_to_unpublished_table`].
    pub async fn convert_to_unpublished_table(&self) -> Result<bool, Error> {
        crate::convert_to_unpublished_table(self.pool(), self.config()).await
    }

    /// The statements for the table's layout: the one the config names, else the one found
    /// the first time the table exists (one catalog query per store and its clones; a table
    /// keeps its layout), else a new table's (the call then fails on the missing table, as
    /// with any layout, and the next one looks again).
    pub(crate) async fn sql(&self) -> Result<&Sql, Error> {
        let config = self.config();
        if let Some(on) = config
            .unpublished_table()
            .or_else(|| self.layout.get().copied())
        {
            return Ok(config.sql_for(on));
        }
        let (exists, unpublished) = table_layout(self.pool(), config)
            .await
            .map_err(self.err("find the table's layout"))?;
        if !exists {
            return Ok(config.sql());
        }
        Ok(config.sql_for(*self.layout.get_or_init(|| unpublished)))
    }

    /// [`MysqlStore::sql`] without a query: the layout named or already found, else a new
    /// table's. For the admin statements, after an `await` of [`MysqlStore::sql`].
    pub(crate) fn sql_found(&self) -> &Sql {
        let config = self.config();
        match config
            .unpublished_table()
            .or_else(|| self.layout.get().copied())
        {
            Some(on) => config.sql_for(on),
            None => config.sql(),
        }
    }

    /// Maps a sqlx error of operation `op` on this store's table.
    pub(crate) fn err(&self, op: &str) -> impl Fn(sqlx::Error) -> Error + '_ {
        let op = op.to_owned();
        move |e| map_sqlx(e, &op, self.config().qualified_table())
    }
}

/// Whether `config`'s table exists, and whether it is laid out with an unpublished table, from
/// the catalog: the table without its own claim index (`ix_claim`) is. Read from the outbox
/// table's own entries, which a user with rights on that table alone sees (the unpublished
/// table is invisible to one without rights on it, whose calls then fail saying so).
pub(crate) async fn table_layout<'c, E>(
    executor: E,
    config: &MysqlConfig,
) -> Result<(bool, bool), sqlx::Error>
where
    E: sqlx::Executor<'c, Database = MySql>,
{
    let (exists, claim_index): (i64, i64) = sqlx::query_as(
        "SELECT
            EXISTS (SELECT 1 FROM information_schema.TABLES
                    WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?),
            EXISTS (SELECT 1 FROM information_schema.STATISTICS
                    WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?
                      AND INDEX_NAME = 'ix_claim')",
    )
    .bind(config.database())
    .bind(config.table())
    .bind(config.database())
    .bind(config.table())
    .fetch_one(executor)
    .await?;
    Ok((exists != 0, exists != 0 && claim_index == 0))
}
