//! Settings shared by [`crate::open_connection`], [`crate::migrate`], the enqueue functions and
//! [`crate::SqliteStore`].

use std::time::Duration;

use outbox_traits::{validate_sql_identifier, Error, Limits};

/// The table name used when none is configured.
pub const DEFAULT_TABLE: &str = "outbox";

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
/// Build it from [`SqliteConfig::default`] and the `with_*` methods; every function of this
/// crate validates it (see [`SqliteConfig::validate`]) before touching the database.
///
/// ```
/// use std::time::Duration;
/// use outbox_backend_sqlite::{SqliteConfig, Synchronous};
/// let config = SqliteConfig::default()
///     .with_table("orders_outbox")
///     .with_busy_timeout(Duration::from_secs(10))
///     .with_synchronous(Synchronous::Full);
/// assert!(config.validate().is_ok());
/// assert!(SqliteConfig::default().with_table("bad name").validate().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteConfig {
    /// Name of the outbox table. Default [`DEFAULT_TABLE`] (`outbox`). Must be a plain SQL
    /// identifier (checked by [`outbox_traits::validate_sql_identifier`]); index names are
    /// derived from it.
    pub table: String,
    /// Limits applied to every enqueued message (payload size).
    pub limits: Limits,
    /// How long a connection waits for another connection's write lock. Default 5 s.
    pub busy_timeout: Duration,
    /// Durability of commits; see [`Synchronous`]. Default [`Synchronous::Normal`].
    pub synchronous: Synchronous,
    /// Delete a message's row when it is published instead of keeping it as `published` until
    /// [`purge_published`](outbox_traits::OutboxAdmin::purge_published) removes it. Default
    /// `false` (kept). Deleting keeps the file small with no purge job; the table then holds no
    /// history of published messages (`counts()` reports none) and a dedup key is free again
    /// as soon as its message is published. Declared as
    /// [`Capabilities::deletes_published`](outbox_traits::Capabilities::deletes_published).
    pub delete_published: bool,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        Self {
            table: DEFAULT_TABLE.to_owned(),
            limits: Limits::default(),
            busy_timeout: DEFAULT_BUSY_TIMEOUT,
            synchronous: Synchronous::default(),
            delete_published: false,
        }
    }
}

impl SqliteConfig {
    /// Use `table` as the outbox table name.
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Apply these limits to enqueued messages.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Wait this long for another connection's write lock.
    pub fn with_busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Use this durability setting.
    pub fn with_synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Delete messages as they are published (see [`SqliteConfig::delete_published`]).
    pub fn with_delete_published(mut self, delete: bool) -> Self {
        self.delete_published = delete;
        self
    }

    /// Check every setting; [`Error::InvalidInput`] says which one to fix.
    pub fn validate(&self) -> Result<(), Error> {
        validate_sql_identifier("table name", &self.table)?;
        // Index names append up to 10 bytes to the table name; keep them inside the limit.
        if self.table.len() > 50 {
            return Err(Error::invalid_input(format!(
                "table name {:?} is {} bytes long; use at most 50 bytes (index names are derived from it)",
                self.table,
                self.table.len()
            )));
        }
        if self.limits.max_payload_bytes == 0 {
            return Err(Error::invalid_input(
                "max_payload_bytes is 0, so no message could be enqueued; use e.g. 1 MiB",
            ));
        }
        // SQLite takes the busy timeout as a C int of milliseconds.
        if self.busy_timeout.as_millis() > i32::MAX as u128 {
            return Err(Error::invalid_input(format!(
                "busy timeout {:?} is too long; use at most {} ms",
                self.busy_timeout,
                i32::MAX
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_setting() {
        let err = SqliteConfig::default()
            .with_table("x;drop")
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("table name"), "{err}");
        let err = SqliteConfig::default()
            .with_busy_timeout(Duration::from_secs(u64::MAX / 2))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("busy timeout"), "{err}");
        let err = SqliteConfig::default()
            .with_limits(Limits {
                max_payload_bytes: 0,
            })
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("max_payload_bytes"), "{err}");
        assert!(SqliteConfig::default()
            .with_table("a".repeat(51))
            .validate()
            .is_err());
    }
}
