//! Which table the store uses, and the SQL built for it once, at construction.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use outbox_sql_support::validate_sql_identifier;
use outbox_sql_support::TableSettings;
use outbox_traits::Error;

use crate::sql::Sql;

/// The default schema: `public`.
pub const DEFAULT_SCHEMA: &str = "public";
pub use outbox_sql_support::DEFAULT_TABLE;

/// Where the outbox lives and how enqueue behaves.
///
/// Schema and table names are checked with [`validate_sql_identifier`] and every SQL statement
/// is built once, here, with the names quoted; nothing user-given is spliced into SQL later.
/// Cloning is cheap (the statements are shared).
///
/// ```
/// use outbox_backend_postgres::PostgresConfig;
/// let config = PostgresConfig::builder().schema("billing").table("outbox").build()?;
/// assert_eq!(config.qualified_table(), r#""billing"."outbox""#);
/// assert!(PostgresConfig::builder().table("outbox; drop table x").build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Clone)]
pub struct PostgresConfig {
    inner: Arc<Inner>,
}

struct Inner {
    schema: String,
    notify: bool,
    lock_keys: bool,
    partition_interval: Option<Duration>,
    cursor_claims: Option<bool>,
    common: TableSettings,
    /// The statements of the layout a new table gets (the migration's).
    sql: Sql,
    /// With `cursor_claims` unset on a plain table: the other layout's statements, for an
    /// existing table of that layout, e.g. one made by an earlier release (see
    /// [`PostgresConfig::sql_for`]).
    other_layout: Option<Sql>,
}

impl PostgresConfig {
    /// A builder starting from the defaults (`public.outbox`, 1 MiB payloads, NOTIFY on).
    pub fn builder() -> PostgresConfigBuilder {
        PostgresConfigBuilder::default()
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    outbox_sql_support::table_settings_getters!(inner.common);

    /// `"schema"."table"`, quoted as it appears in the SQL.
    pub fn qualified_table(&self) -> &str {
        &self.inner.sql.table
    }

    /// Whether the table's insert trigger wakes relays (see [`PostgresConfigBuilder::notify`]).
    pub fn notify(&self) -> bool {
        self.inner.notify
    }

    /// Whether enqueue first locks the batch's partition keys until the transaction ends (see
    /// [`PostgresConfigBuilder::lock_keys`]).
    pub fn lock_keys(&self) -> bool {
        self.inner.lock_keys
    }

    /// `"schema"."<table>_lock_key"`: the SQL function, created by the migration, that a writer
    /// calls first in its transaction to serialise the writers of its keys:
    /// `SELECT "public"."outbox_lock_key"('order-42')` (any number of keys as further
    /// arguments). See [`PostgresConfigBuilder::lock_keys`].
    pub fn lock_function(&self) -> &str {
        &self.inner.sql.lock_function
    }

    /// The name of the statement-level `AFTER INSERT` trigger that sends the NOTIFY.
    pub fn notify_trigger(&self) -> &str {
        &self.inner.sql.notify_trigger
    }

    /// The `LISTEN/NOTIFY` channel for this table: `outbox.<schema>.<table>`, shortened with a
    /// hash when that would exceed Postgres's 63-byte identifier limit.
    pub fn notify_channel(&self) -> &str {
        &self.inner.sql.channel
    }

    /// The migration SQL for this table, for teams that apply migrations with their own tool.
    /// It is idempotent; [`crate::migrate`] runs exactly this under an advisory lock, or, with
    /// [`cursor_claims`](PostgresConfigBuilder::cursor_claims) unset, the other layout's SQL for
    /// an existing table of the other layout.
    ///
    /// It lays a new table out as [`PostgresConfig::new_tables_use_cursor_claims`] says, and
    /// refuses (raises) to run on a table of the other layout: a team whose table was made by
    /// an earlier release and that runs this SQL again with its own tool takes it from a
    /// configuration with `cursor_claims(false)`.
    pub fn migration_sql(&self) -> &str {
        &self.inner.sql.migrate
    }

    /// The width of the table's time partitions, or `None` for a plain table (the default). See
    /// [`PostgresConfigBuilder::partition_interval`].
    pub fn partition_interval(&self) -> Option<Duration> {
        self.inner.partition_interval
    }

    /// `"schema"."<table>_premake"` on a partitioned table (`None` on a plain one): the SQL
    /// function, created by the migration, that creates the missing partitions from the
    /// interval holding `start` (default now) to `ahead` intervals later, e.g. before a backfill
    /// of old rows: `SELECT "public"."outbox_premake"(4, now() - interval '3 days')`. Every
    /// purge calls it for the intervals ahead.
    pub fn premake_function(&self) -> Option<&str> {
        self.inner
            .sql
            .partitioned
            .as_ref()
            .map(|p| p.premake_function.as_str())
    }

    /// The table layout asked for: `Some(true)` cursor claims, `Some(false)` the partial-index
    /// layout, `None` (the default) whichever the table has. See
    /// [`PostgresConfigBuilder::cursor_claims`].
    pub fn cursor_claims(&self) -> Option<bool> {
        self.inner.cursor_claims
    }

    /// Whether a table this configuration creates is laid out for cursor claims: with
    /// `cursor_claims` unset, a plain table whose published rows are kept.
    pub fn new_tables_use_cursor_claims(&self) -> bool {
        self.inner.sql.cursor.is_some()
    }

    /// The statements of the layout a new table gets.
    pub(crate) fn sql(&self) -> &Sql {
        &self.inner.sql
    }

    /// The statements for a table found laid out for cursor claims (`cursor`) or not. Where the
    /// configuration names a layout the store refuses a table of the other one
    /// ([`crate::cursor::check_layout`]), so these are its statements whatever `cursor` says.
    pub(crate) fn sql_for(&self, cursor: bool) -> &Sql {
        match &self.inner.other_layout {
            Some(other) if self.inner.sql.cursor.is_some() != cursor => other,
            _ => &self.inner.sql,
        }
    }
}

/// The shortest partition interval: one minute (partition names carry the minute they start).
pub const MIN_PARTITION_INTERVAL: Duration = Duration::from_secs(60);

/// The longest partition interval: 366 days.
pub const MAX_PARTITION_INTERVAL: Duration = Duration::from_secs(366 * 86_400);

/// Check a partition interval: whole minutes, from [`MIN_PARTITION_INTERVAL`] to
/// [`MAX_PARTITION_INTERVAL`].
fn validate_partition_interval(interval: Duration) -> Result<(), Error> {
    if interval < MIN_PARTITION_INTERVAL
        || interval > MAX_PARTITION_INTERVAL
        || interval.subsec_nanos() != 0
        || !interval.as_secs().is_multiple_of(60)
    {
        return Err(Error::invalid_input(format!(
            "partition_interval {interval:?} is not a whole number of minutes from 1 minute to \
             366 days; give e.g. 1h or 1d"
        )));
    }
    Ok(())
}

impl Default for PostgresConfig {
    /// `public.outbox`, 1 MiB payloads, NOTIFY on, published rows kept.
    fn default() -> Self {
        PostgresConfigBuilder::default().into_config()
    }
}

impl PostgresConfig {
    /// Build from a builder whose names already passed [`validate_sql_identifier`].
    fn from_valid(b: PostgresConfigBuilder) -> Self {
        let build = |cursor_claims: bool| {
            Sql::build(
                &b.schema,
                &b.common.table,
                b.notify,
                b.lock_keys,
                b.common.delete_published,
                b.partition_interval.map(|i| i.as_secs()),
                cursor_claims,
            )
        };
        // Unnamed, a new plain table is laid out for cursor claims when published rows are
        // kept: deleting them is a little faster on the partial-index layout (`BENCHMARKS.md`,
        // "Postgres cursor claims"). A partitioned table never is (`build` refuses asking for
        // both).
        let plain = b.partition_interval.is_none();
        let new_cursor = match b.cursor_claims {
            Some(on) => on,
            None => plain && !b.common.delete_published,
        };
        let sql = build(new_cursor);
        // Unnamed, an existing plain table may have the other layout: its statements too.
        let other_layout = (plain && b.cursor_claims.is_none()).then(|| build(!new_cursor));
        Self {
            inner: Arc::new(Inner {
                schema: b.schema,
                notify: b.notify,
                lock_keys: b.lock_keys,
                partition_interval: b.partition_interval,
                cursor_claims: b.cursor_claims,
                common: b.common,
                sql,
                other_layout,
            }),
        }
    }
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("schema", &self.inner.schema)
            .field("table", &self.inner.common.table)
            .field("limits", &self.inner.common.limits)
            .field("notify", &self.inner.notify)
            .field("lock_keys", &self.inner.lock_keys)
            .field("delete_published", &self.inner.common.delete_published)
            .field("partition_interval", &self.inner.partition_interval)
            .field("cursor_claims", &self.inner.cursor_claims)
            .finish()
    }
}

/// Builder of [`PostgresConfig`]; [`PostgresConfigBuilder::build`] validates everything.
#[derive(Debug, Clone)]
pub struct PostgresConfigBuilder {
    schema: String,
    notify: bool,
    lock_keys: bool,
    partition_interval: Option<Duration>,
    cursor_claims: Option<bool>,
    common: TableSettings,
}

impl Default for PostgresConfigBuilder {
    fn default() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
            notify: true,
            lock_keys: false,
            partition_interval: None,
            cursor_claims: None,
            common: TableSettings::default(),
        }
    }
}

impl PostgresConfigBuilder {
    /// Schema holding the outbox table (default `public`). Created by the migration if missing.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    outbox_sql_support::table_settings_setters!(common;
        /// Here deleting makes completion about three times cheaper (no new row version, no
        /// index entries), as Debezium-style outboxes do.
    );

    /// Wake relays on every insert into the table (default on).
    ///
    /// On: the migration installs a statement-level `AFTER INSERT` trigger that sends one
    /// `pg_notify` on [`PostgresConfig::notify_channel`] per INSERT statement, whoever the
    /// writer (this crate's enqueue, another language's SQL, `psql`), and relays `LISTEN` on
    /// the channel, so a commit reaches a waiting relay at once. Enqueue itself sends no
    /// notification. A table migrated by an earlier release, whose enqueue sent the
    /// notification, gets the trigger at its next migration; until then relays find new rows
    /// by polling (a relay warns at start-up when the trigger is missing).
    ///
    /// Off: the migration drops the trigger and relays only poll. A NOTIFY takes a
    /// database-wide lock at commit that serialises committing writers, so services with many
    /// concurrent writers may prefer that. The setting is the table's: give the migration and
    /// the relays the same value. A notification is only a hint; relays poll regardless.
    pub fn notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// Serialise the writers of one partition key for the length of their transactions
    /// (default off).
    ///
    /// Per-key order follows `seq`, which is drawn at insert: two transactions that write one
    /// key at the same time can commit in the other order, and then the message inserted
    /// second is published first. On, [`crate::enqueue_batch`] (and the diesel functions)
    /// first take a transaction-scoped advisory lock on each of the batch's keys, in the same
    /// statement as the insert, through the function [`PostgresConfig::lock_function`]
    /// (created by the migration): a second writer of the key waits there until the first
    /// commits or rolls back, so commit order is insert order. Writers in other languages call
    /// the function first in their transaction: `SELECT "public"."outbox_lock_key"('k')`.
    ///
    /// Cost: writers of one key no longer overlap (their transactions queue), and each enqueue
    /// does a little more work (measured in `BENCHMARKS.md`). Writers of different keys do not
    /// wait for each other (unless two keys' 64-bit hashes collide). Messages without a
    /// partition key take no lock.
    pub fn lock_keys(mut self, lock: bool) -> Self {
        self.lock_keys = lock;
        self
    }

    /// Partition the table by time, `interval` wide (default `None`: a plain table).
    ///
    /// The migration then creates the table `PARTITION BY RANGE (created_at)`, with partitions
    /// aligned to `interval` from the Unix epoch (UTC), a DEFAULT partition, and the
    /// partitions from the current one to four intervals ahead; and
    /// [`purge_published`](outbox_traits::OutboxAdmin::purge_published) drops whole old
    /// partitions instead of deleting their rows one by one. See the README, "Partitioned
    /// tables", for what it costs and when it pays. `interval` must be a whole number of
    /// minutes, from 1 minute to 366 days (checked by [`build`](Self::build)). The setting is
    /// the table's: a migration refuses to turn a plain table into a partitioned one or back.
    pub fn partition_interval(mut self, interval: Option<Duration>) -> Self {
        self.partition_interval = interval;
        self
    }

    /// Name the table's layout: cursor claims (`true`) or the partial-index layout (`false`).
    /// Unset (the default), an existing table is used as it is laid out, so a table made by an
    /// earlier release keeps working unchanged, and a new plain table is laid out for cursor
    /// claims when published rows are kept (the default), for partial indexes when the
    /// configuration deletes them ([`delete_published`](Self::delete_published): deleting is
    /// 1.06× and 1.13× faster there in two side-by-side runs, `BENCHMARKS.md`).
    /// `docs/keep-cursor.md` has the design.
    ///
    /// **Cursor claims.** Published rows kept (the default) are marked published by a HOT
    /// update, which writes no index entry: `state` is in no index. Claims start from a
    /// per-shard cursor, below which every row is published, set aside (failed, released,
    /// requeued, dead or scheduled: small indexes of their own) or rolled back, and which moves
    /// only over seqs whose writers have all ended. A transaction that holds a write lock on the
    /// table for a long time stops the cursor (claims go on, reading from where it stopped).
    /// The relay's role needs `SELECT` on the table's identity sequence and may read `pg_locks`
    /// (every role may). Keeping published rows drained 1.12× to 1.15× faster than on the
    /// partial-index layout (`BENCHMARKS.md`).
    ///
    /// **The partial-index layout** (tables made before cursor claims existed, and every
    /// partitioned table): claims read partial indexes on `state`, so every completion writes
    /// index entries.
    ///
    /// Named, the layout is checked: the store refuses a table of the other one, and a
    /// migration never converts a table. `true` cannot be combined with
    /// [`partition_interval`](Self::partition_interval).
    pub fn cursor_claims(mut self, on: bool) -> Self {
        self.cursor_claims = Some(on);
        self
    }

    /// Validate the names and limits and build every SQL statement.
    pub fn build(self) -> Result<PostgresConfig, Error> {
        validate_sql_identifier("schema name", &self.schema)?;
        self.common.validate()?;
        if let Some(interval) = self.partition_interval {
            validate_partition_interval(interval)?;
            if self.cursor_claims == Some(true) {
                return Err(Error::invalid_input(
                    "cursor_claims and partition_interval cannot be combined: cursor claims \
                     need a plain table",
                ));
            }
        }
        Ok(self.into_config())
    }

    fn into_config(self) -> PostgresConfig {
        PostgresConfig::from_valid(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() {
        let config = PostgresConfig::default();
        assert_eq!(config.schema(), "public");
        assert_eq!(config.table(), "outbox");
        assert_eq!(config.qualified_table(), "\"public\".\"outbox\"");
        assert_eq!(config.notify_channel(), "outbox.public.outbox");
        assert!(config.notify());
        assert!(!config.lock_keys());
        assert_eq!(config.lock_function(), "\"public\".\"outbox_lock_key\"");
        assert_eq!(config.notify_trigger(), "outbox_notify");

        for (schema, table) in [("a;b", "outbox"), ("public", "x\"y"), ("", "t"), ("s", "")] {
            let err = PostgresConfig::builder()
                .schema(schema)
                .table(table)
                .build()
                .unwrap_err();
            assert!(
                matches!(err, Error::InvalidInput(_)),
                "{schema}.{table}: {err}"
            );
        }
        let err = PostgresConfig::builder()
            .max_payload_bytes(0)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
    }

    #[test]
    fn readme_shows_the_default_migration_verbatim() {
        let readme = include_str!("../README.md");
        let sql = PostgresConfig::default().migration_sql().to_owned();
        assert!(
            readme.contains(&sql),
            "README's migration SQL is stale; paste this:\n{sql}"
        );
    }

    #[test]
    fn long_names_keep_derived_names_distinct_and_short() {
        let long = "t".repeat(63);
        let partial_index = ["claim_idx", "key_idx", "dead_idx", "published_idx"];
        let cursor = [
            "seq_idx",
            "key_seq_idx",
            "aside_idx",
            "aside_key_idx",
            "failed_key_idx",
            "dead_check",
            "cursors",
            "settle",
        ];
        for (cursor_claims, layout) in [(false, &partial_index[..]), (true, &cursor[..])] {
            let config = PostgresConfig::builder()
                .schema("s".repeat(63))
                .table(&long)
                .cursor_claims(cursor_claims)
                .build()
                .unwrap();
            assert!(config.notify_channel().len() <= 63);
            let sql = config.migration_sql();
            for suffix in layout.iter().chain(&["dedup_key", "notify", "lock_key"]) {
                let name = crate::sql::derived_name(&long, suffix);
                assert!(name.len() <= 63 && name.ends_with(suffix), "{name}");
                assert!(sql.contains(&name), "{name}");
            }
        }
    }
}
