//! Which table the store uses, and the SQL built for it once, at construction.

use std::fmt;
use std::sync::Arc;

use outbox_sql_support::validate_sql_identifier;
use outbox_sql_support::TableSettings;
use outbox_traits::Error;

use crate::sql::Sql;

/// The default table: `outbox`, in the connection's database.
pub use outbox_sql_support::DEFAULT_TABLE;

/// Where the outbox lives and how enqueue behaves.
///
/// The table name (and the optional database that qualifies it) are checked with
/// [`validate_sql_identifier`], and every SQL statement is built once, here, with the names
/// quoted; nothing user-given is spliced into SQL later. Cloning is cheap (the statements are
/// shared).
///
/// ```
/// use outbox_backend_mysql::MysqlConfig;
/// let config = MysqlConfig::builder().database("billing").table("outbox").build()?;
/// assert_eq!(config.qualified_table(), "`billing`.`outbox`");
/// // Without a database, the table is the one in the connection's database (from the URL).
/// assert_eq!(MysqlConfig::default().qualified_table(), "`outbox`");
/// assert!(MysqlConfig::builder().table("outbox; drop table x").build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Clone)]
pub struct MysqlConfig {
    inner: Arc<Inner>,
}

struct Inner {
    database: Option<String>,
    common: TableSettings,
    lock_keys: bool,
    /// The layout named by the builder; `None`: the table's own, and for a new table the
    /// default (see [`MysqlConfig::new_tables_use_unpublished_table`]).
    unpublished_table: Option<bool>,
    /// The statements of the named layout, or of a new table's when none is named.
    sql: Sql,
    /// When no layout is named: the statements of the other layout, for an existing table
    /// laid out that way.
    other: Option<Sql>,
}

impl MysqlConfig {
    /// A builder starting from the defaults (table `outbox` in the connection's database,
    /// 1 MiB payloads).
    pub fn builder() -> MysqlConfigBuilder {
        MysqlConfigBuilder::default()
    }

    /// The database that qualifies the table, if one was set; `None` means the connection's
    /// database (the one named in the URL).
    pub fn database(&self) -> Option<&str> {
        self.inner.database.as_deref()
    }

    outbox_sql_support::table_settings_getters!(inner.common);

    /// `` `database`.`table` `` (or `` `table` ``), quoted as it appears in the SQL.
    pub fn qualified_table(&self) -> &str {
        &self.inner.sql.table
    }

    /// Whether enqueue first locks the batch's partition keys until the transaction ends (see
    /// [`MysqlConfigBuilder::lock_keys`]).
    pub fn lock_keys(&self) -> bool {
        self.inner.lock_keys
    }

    /// The key-lock table (created by the migration), quoted like
    /// [`MysqlConfig::qualified_table`]: `` `outbox_key_locks` `` for the default table. See
    /// [`MysqlConfigBuilder::lock_keys`] for the statement a writer in another language runs.
    pub fn key_locks_table(&self) -> &str {
        &self.inner.sql.key_locks
    }

    /// The migration SQL for this table, for teams that apply migrations with their own tool.
    ///
    /// It is idempotent (`IF NOT EXISTS`); [`crate::migrate`] runs exactly this under a
    /// `GET_LOCK`. Statements are separated by `;`.
    pub fn migration_sql(&self) -> &str {
        &self.inner.sql.migrate
    }

    /// The SQL that drops every object the migration creates for this table: the outbox
    /// table (with its triggers), the key-lock table and the relay-group tables and procedure,
    /// each `IF EXISTS`. For tests and uninstalls; statements separated by `;` (run it as one
    /// text-protocol query, e.g. `sqlx::raw_sql`).
    pub fn drop_sql(&self) -> String {
        // Either layout's: an existing table may be in the one not named.
        let unpublished = [Some(&self.inner.sql), self.inner.other.as_ref()]
            .into_iter()
            .flatten()
            .find_map(|sql| sql.unpublished.as_ref())
            .map(|u| format!(", {u}"))
            .unwrap_or_default();
        format!(
            "DROP TABLE IF EXISTS {}, {}{unpublished};\n{}",
            self.qualified_table(),
            self.key_locks_table(),
            crate::group::group_drop_sql(self.database(), self.table())
        )
    }

    /// The table layout named with [`MysqlConfigBuilder::unpublished_table`], if one was.
    /// `None`: the store uses the layout it finds the table in.
    pub fn unpublished_table(&self) -> Option<bool> {
        self.inner.unpublished_table
    }

    /// Whether a table this configuration's migration creates gets an unpublished table: the
    /// layout named, or by default when published rows are kept (not with
    /// `delete_published`, which gains nothing from it).
    pub fn new_tables_use_unpublished_table(&self) -> bool {
        self.inner.sql.unpublished.is_some()
    }

    /// The statements of the named layout, or of a new table's: the migration SQL, the
    /// enqueue, the key locks (which both layouts share).
    pub(crate) fn sql(&self) -> &Sql {
        &self.inner.sql
    }

    /// The statements of a table laid out with an unpublished table (`true`) or without.
    pub(crate) fn sql_for(&self, unpublished: bool) -> &Sql {
        match &self.inner.other {
            Some(other) if self.inner.sql.unpublished.is_some() != unpublished => other,
            _ => &self.inner.sql,
        }
    }

    /// Build from settings that already passed their checks.
    fn from_valid(
        database: Option<String>,
        common: TableSettings,
        lock_keys: bool,
        unpublished_table: Option<bool>,
    ) -> Self {
        let build = |unpublished: bool| {
            Sql::build(
                database.as_deref(),
                &common.table,
                common.delete_published,
                common.limits.max_payload_bytes,
                unpublished,
            )
        };
        let new_tables = unpublished_table.unwrap_or(!common.delete_published);
        let sql = build(new_tables);
        let other = unpublished_table.is_none().then(|| build(!new_tables));
        Self {
            inner: Arc::new(Inner {
                database,
                common,
                lock_keys,
                unpublished_table,
                sql,
                other,
            }),
        }
    }
}

impl Default for MysqlConfig {
    /// Table `outbox` in the connection's database, 1 MiB payloads.
    fn default() -> Self {
        Self::from_valid(None, TableSettings::default(), false, None)
    }
}

impl fmt::Debug for MysqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlConfig")
            .field("database", &self.inner.database)
            .field("table", &self.inner.common.table)
            .field("limits", &self.inner.common.limits)
            .field("delete_published", &self.inner.common.delete_published)
            .field("lock_keys", &self.inner.lock_keys)
            .finish()
    }
}

/// Builder of [`MysqlConfig`]; [`MysqlConfigBuilder::build`] validates everything.
#[derive(Debug, Clone, Default)]
pub struct MysqlConfigBuilder {
    database: Option<String>,
    common: TableSettings,
    lock_keys: bool,
    unpublished_table: Option<bool>,
}

impl MysqlConfigBuilder {
    /// Database (MySQL's word for a schema) holding the outbox table. Default: none, so the
    /// table is looked up in the connection's database, the one named in the URL. When set,
    /// the migration creates the database if it is missing.
    pub fn database(mut self, database: impl Into<String>) -> Self {
        self.database = Some(database.into());
        self
    }

    outbox_sql_support::table_settings_setters!(common;
        /// Here completion is then a `DELETE` by primary key.
    );

    /// Serialise the writers of one partition key for the length of their transactions
    /// (default off).
    ///
    /// Per-key order follows `seq`, which is drawn at insert: two transactions that write one
    /// key at the same time can commit in the other order, and then the message inserted
    /// second is published first. On, [`crate::enqueue_batch`] (and the diesel functions)
    /// first upsert each of the batch's keys into the key-lock table
    /// ([`MysqlConfig::key_locks_table`], created by the migration), in the same round trip as
    /// the insert: the row lock lasts until the transaction ends (unlike `GET_LOCK`, which is
    /// the session's), and a second writer of the key waits on it until the first commits or
    /// rolls back, so commit order is insert order. Writers in other languages run, first in
    /// their transaction:
    ///
    /// ```sql
    /// INSERT INTO outbox_key_locks (partition_key) VALUES ('order-42')
    ///     ON DUPLICATE KEY UPDATE partition_key = partition_key;
    /// ```
    ///
    /// Cost: writers of one key no longer overlap, each enqueue writes one more row per key
    /// (measured in `BENCHMARKS.md`), and the statement carries its values as hexadecimal
    /// literals (a payload counts twice against `max_allowed_packet`). When the first writer
    /// of a key that was never locked rolls back, two writers waiting on it can deadlock;
    /// MariaDB rolls one back with a transient error (retry it). Writers of different keys do
    /// not wait for each other, with one exception: when that first writer rolls back while a
    /// second one waits, InnoDB hands the waiter a lock on the gap after the key, and until the
    /// waiter's transaction ends, writers of other keys that are new to the key-lock table and
    /// sort into that gap wait too (keys already in the table are not affected). Messages
    /// without a partition key take no lock.
    ///
    /// The key-lock table keeps a row per key ever locked: each
    /// [`purge_published`](outbox_traits::OutboxAdmin::purge_published) call (the relay's
    /// `--purge-older-than` job, `outbox-relay purge`) also deletes up to its batch of those
    /// rows that no writer holds (skipping held ones, so it never waits for a writer; a
    /// writer then inserts its key again).
    pub fn lock_keys(mut self, lock: bool) -> Self {
        self.lock_keys = lock;
        self
    }

    /// Lay the table out with an **unpublished table** (`true`), or with the outbox table's
    /// own claim indexes (`false`). Not set, the store uses the layout it finds an existing
    /// table in, and a new table gets an unpublished table unless the configuration deletes
    /// published rows ([`MysqlConfig::new_tables_use_unpublished_table`]). A second table,
    /// `<table>_unpublished`, holds one small row per pending or dead message, and the claim
    /// scans and per-key order probes read it instead of indexes of the outbox table holding
    /// `state`. A completion that keeps its row then deletes that small row and changes no
    /// index of the outbox row (with the outbox table's own claim indexes it moves the row's
    /// entry in three of them). For tables that keep published rows; see the README,
    /// "Unpublished table", for the figures and what it costs writers.
    ///
    /// A table is made in one layout and stays in it: the migration refuses a table of the
    /// other layout with a clear error, and a store whose configuration names the other
    /// layout fails its first claim. Triggers keep the unpublished table in step with inserts
    /// and deletes of any writer; change `state` only through the relay and its admin
    /// commands.
    pub fn unpublished_table(mut self, on: bool) -> Self {
        self.unpublished_table = Some(on);
        self
    }

    /// Validate the names and limits and build every SQL statement.
    pub fn build(self) -> Result<MysqlConfig, Error> {
        if let Some(database) = &self.database {
            validate_sql_identifier("database name", database)?;
        }
        self.common.validate()?;
        Ok(MysqlConfig::from_valid(
            self.database,
            self.common,
            self.lock_keys,
            self.unpublished_table,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() -> Result<(), Error> {
        let config = MysqlConfig::default();
        assert_eq!(config.database(), None);
        assert_eq!(config.table(), "outbox");
        assert_eq!(config.qualified_table(), "`outbox`");
        let config = MysqlConfig::builder().database("app").build()?;
        assert_eq!(config.qualified_table(), "`app`.`outbox`");
        assert!(config
            .migration_sql()
            .starts_with("CREATE DATABASE IF NOT EXISTS `app`;"));

        for table in ["a;b", "x`y", "", "1x", "sch.tbl"] {
            let err = MysqlConfig::builder().table(table).build().unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{table}: {err}");
        }
        let err = MysqlConfig::builder().database("a b").build().unwrap_err();
        assert!(err.to_string().contains("database name"), "{err}");
        let err = MysqlConfig::builder()
            .max_payload_bytes(0)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
        Ok(())
    }

    #[test]
    fn readme_shows_the_default_migration_verbatim() {
        let readme = include_str!("../README.md");
        let sql = MysqlConfig::default().migration_sql().to_owned();
        assert!(
            readme.contains(&sql),
            "README's migration SQL is stale; paste this:\n{sql}"
        );
    }
}
