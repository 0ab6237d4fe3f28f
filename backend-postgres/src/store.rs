//! [`PostgresStore`]: the handle the relay and operators use, a pool and a [`PostgresConfig`]
//! (the shared [`SqlxStore`]); its trait impls are in `claim.rs` (relay side) and `admin.rs`.

use std::fmt;
use std::sync::{Arc, OnceLock};

use outbox_sql_support::SqlxStore;
use outbox_traits::Error;
use sqlx::postgres::{PgPool, Postgres};

use crate::config::PostgresConfig;
use crate::error::{map_sqlx, WHAT};
use crate::migrate::migrate;
use crate::sql::Sql;

/// An [`OutboxStore`](outbox_traits::OutboxStore) and [`OutboxAdmin`](outbox_traits::OutboxAdmin)
/// over a Postgres table.
///
/// Holds a connection pool and a [`PostgresConfig`]; cloning is cheap and shares the pool.
/// Every method is one statement in its own short transaction (a claim runs one `set_config`
/// before its statement, and a second statement when it comes back short from a full window),
/// so no lock is held between calls.
#[derive(Clone)]
pub struct PostgresStore {
    inner: SqlxStore<Postgres, PostgresConfig>,
    /// Set once the table was found to have the configuration's shape (plain or partitioned)
    /// and layout: whether it is laid out for cursor claims. Checked before the first statement
    /// whose text depends on it, see [`PostgresStore::ensure_shape`].
    layout: Arc<OnceLock<bool>>,
    /// Each claim shard's window, sized from its last claim (shared by the store's clones).
    windows: Arc<crate::claim::ClaimWindows>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt_as("PostgresStore", f)
    }
}

impl PostgresStore {
    /// A store over an existing pool (share your application's pool, or build one with the
    /// connection settings you need).
    pub fn new(pool: PgPool, config: PostgresConfig) -> Self {
        Self {
            inner: SqlxStore::new(pool, config),
            layout: Arc::default(),
            windows: Arc::default(),
        }
    }

    /// Connect a new pool (sqlx's default size; 10 s to get a connection).
    ///
    /// Does not create the table: call [`PostgresStore::migrate`] or apply
    /// [`PostgresConfig::migration_sql`] with your own migration tool.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a malformed URL and [`Error::Unavailable`] when the server
    /// cannot be reached; neither message contains the URL's password.
    pub async fn connect(url: &str, config: PostgresConfig) -> Result<Self, Error> {
        Ok(Self {
            inner: SqlxStore::connect(url, WHAT, config).await?,
            layout: Arc::default(),
            windows: Arc::default(),
        })
    }

    /// The connection pool, e.g. to begin the transactions you pass to [`crate::enqueue`].
    pub fn pool(&self) -> &PgPool {
        self.inner.pool()
    }

    /// The table and settings this store uses.
    pub fn config(&self) -> &PostgresConfig {
        self.inner.config()
    }

    /// Create the schema, table and indexes if missing (see [`crate::migrate`]).
    ///
    /// # Errors
    /// As [`crate::migrate`].
    pub async fn migrate(&self) -> Result<(), Error> {
        migrate(self.pool(), self.config()).await
    }

    /// Convert the table from the partial-index layout to the cursor layout; `false` when it
    /// had it already (see [`crate::convert_to_cursor_claims`]: stop the table's relays first).
    ///
    /// # Errors
    /// As [`crate::convert_to_cursor_claims`].
    pub async fn convert_to_cursor_claims(&self) -> Result<bool, Error> {
        crate::convert_to_cursor_claims(self.pool(), self.config()).await
    }

    /// Refuse to run this configuration's statements on a table of the other shape, and learn
    /// the table's layout. The plain table's claims address rows by `ctid`, which is unique
    /// only within one partition, so on a partitioned table they would lease and update rows
    /// of other partitions; the cursor layout's claims would miss rows of a table without
    /// cursors. Checked once per store (one catalog query), before its first statement whose
    /// text depends on the layout; a missing table passes (the statements then fail as on any
    /// missing table) and is checked again next time.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming both shapes or layouts when they differ.
    pub(crate) async fn ensure_shape(&self) -> Result<(), Error> {
        if self.layout.get().is_some() {
            return Ok(());
        }
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(self.err("check the table's shape"))?;
        if let Some(cursor) = crate::partition::check_shape(&mut conn, self.config()).await? {
            let _ = self.layout.set(cursor);
        }
        Ok(())
    }

    /// The statements for the table's layout once [`PostgresStore::ensure_shape`] found it,
    /// and those of a new table's layout before.
    pub(crate) fn sql(&self) -> &Sql {
        match self.layout.get() {
            Some(&cursor) => self.config().sql_for(cursor),
            None => self.config().sql(),
        }
    }

    /// Each claim shard's window (see [`crate::claim::ClaimWindows`]).
    pub(crate) fn claim_windows(&self) -> &Arc<crate::claim::ClaimWindows> {
        &self.windows
    }

    /// [`PostgresStore::ensure_shape`], then [`PostgresStore::sql`].
    pub(crate) async fn checked_sql(&self) -> Result<&Sql, Error> {
        self.ensure_shape().await?;
        Ok(self.sql())
    }

    /// Maps a sqlx error of operation `op` on this store's table.
    pub(crate) fn err(&self, op: &str) -> impl Fn(sqlx::Error) -> Error + '_ {
        let op = op.to_owned();
        move |e| map_sqlx(e, &op, self.config().qualified_table())
    }
}
