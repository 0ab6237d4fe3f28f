//! Which table the store uses and how its connections are set up: [`SqliteConfig`], built and
//! checked by [`SqliteConfigBuilder`], shared by [`crate::open_connection`], [`crate::migrate`],
//! the enqueue functions and [`crate::SqliteStore`].

use std::time::Duration;

use outbox_sql_support::TableSettings;
use outbox_traits::Error;

use crate::sql::schema_sql;

/// The table name used when none is configured.
pub use outbox_sql_support::DEFAULT_TABLE;

/// The default time a connection waits for another connection's write lock before it reports
/// `SQLITE_BUSY` (as a transient error).
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// SQLite's `PRAGMA synchronous` setting, which trades commit speed for durability.
///
/// The store always runs in WAL mode. In WAL mode:
/// - [`Synchronous::Normal`] (the default) does not sync the WAL on every commit. A committed
///   transaction survives a crash of the *process* (including `kill -9`), but the last
///   transactions before a *power loss or OS crash* can roll back. For an outbox that means the
///   relay may have published a message whose business transaction then disappears (a phantom
///   publish), or an acknowledged completion is undone (a duplicate publish). About 5× faster
///   than `Full` on ordinary disks.
/// - [`Synchronous::Full`] syncs the WAL on every commit: committed means durable, also across
///   power loss. Choose it when a phantom publish after power loss is not acceptable.
/// - [`Synchronous::Extra`] additionally syncs the directory after deleting journals; only
///   matters in rollback-journal mode, offered for completeness.
///
/// `OFF` is deliberately not offered: it can corrupt the database on power loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Synchronous {
    /// `PRAGMA synchronous = NORMAL`: durable across process crashes, not across power loss.
    #[default]
    Normal,
    /// `PRAGMA synchronous = FULL`: durable across power loss.
    Full,
    /// `PRAGMA synchronous = EXTRA`: `FULL` plus directory syncs.
    Extra,
}

impl Synchronous {
    /// The pragma value.
    pub fn as_sql(self) -> &'static str {
        match self {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
            Synchronous::Extra => "EXTRA",
        }
    }
}

/// Configuration of the SQLite outbox.
///
/// Build it with [`SqliteConfig::builder`] (or take [`SqliteConfig::default`]);
/// [`SqliteConfigBuilder::build`] checks every setting, so a config is always valid. The same
/// API as the other backends' configs.
///
/// ```
/// use std::time::Duration;
/// use outbox_backend_sqlite::{SqliteConfig, Synchronous};
/// let config = SqliteConfig::builder()
///     .table("orders_outbox")
///     .busy_timeout(Duration::from_secs(10))
///     .synchronous(Synchronous::Full)
///     .build()?;
/// assert_eq!(config.table(), "orders_outbox");
/// assert!(SqliteConfig::builder().table("bad name").build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteConfig {
    common: TableSettings,
    busy_timeout: Duration,
    synchronous: Synchronous,
}

impl Default for SqliteConfig {
    /// Table `outbox`, 1 MiB payloads, 5 s busy timeout, `synchronous = NORMAL`, published rows
    /// kept.
    fn default() -> Self {
        SqliteConfigBuilder::default().config
    }
}

impl SqliteConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> SqliteConfigBuilder {
        SqliteConfigBuilder::default()
    }

    outbox_sql_support::table_settings_getters!(common);

    /// How long a connection waits for another connection's write lock.
    pub fn busy_timeout(&self) -> Duration {
        self.busy_timeout
    }

    /// The durability of commits.
    pub fn synchronous(&self) -> Synchronous {
        self.synchronous
    }

    /// The migration SQL for this table, for teams that apply migrations with their own tool.
    /// It is idempotent; [`crate::migrate`] runs exactly this (and checks an existing table).
    pub fn migration_sql(&self) -> String {
        schema_sql(&self.common.table, self.common.limits.max_payload_bytes)
    }
}

/// Builder of [`SqliteConfig`]; [`SqliteConfigBuilder::build`] validates everything. A table
/// name is at most 50 bytes here (index names are derived from it).
#[derive(Debug, Clone)]
pub struct SqliteConfigBuilder {
    config: SqliteConfig,
}

impl Default for SqliteConfigBuilder {
    fn default() -> Self {
        Self {
            config: SqliteConfig {
                common: TableSettings::default(),
                busy_timeout: DEFAULT_BUSY_TIMEOUT,
                synchronous: Synchronous::default(),
            },
        }
    }
}

impl SqliteConfigBuilder {
    outbox_sql_support::table_settings_setters!(config.common;
        /// In SQLite, deleting also keeps the database file small.
    );

    /// How long a connection waits for another connection's write lock (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.config.busy_timeout = timeout;
        self
    }

    /// Durability of commits; see [`Synchronous`] (default [`Synchronous::Normal`]).
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.config.synchronous = synchronous;
        self
    }

    /// Check every setting and build the config.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] saying which setting to fix.
    pub fn build(self) -> Result<SqliteConfig, Error> {
        let config = self.config;
        config.common.validate()?;
        let table = &config.common.table;
        // Index names append up to 10 bytes to the table name; keep them inside the limit.
        if table.len() > 50 {
            return Err(Error::invalid_input(format!(
                "table name {table:?} is {} bytes long; use at most 50 bytes (index names are derived from it)",
                table.len()
            )));
        }
        // SQLite takes the busy timeout as a C int of milliseconds.
        if config.busy_timeout.as_millis() > i32::MAX as u128 {
            return Err(Error::invalid_input(format!(
                "busy timeout {:?} is too long; use at most {} ms",
                config.busy_timeout,
                i32::MAX
            )));
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_setting() {
        let err = SqliteConfig::builder().table("x;drop").build().unwrap_err();
        assert!(err.to_string().contains("table name"), "{err}");
        let err = SqliteConfig::builder()
            .busy_timeout(Duration::from_secs(u64::MAX / 2))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("busy timeout"), "{err}");
        let err = SqliteConfig::builder()
            .max_payload_bytes(0)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("max_payload_bytes"), "{err}");
        assert!(SqliteConfig::builder()
            .table("a".repeat(51))
            .build()
            .is_err());
        assert_eq!(
            SqliteConfig::builder().build().ok(),
            Some(SqliteConfig::default())
        );
    }
}
