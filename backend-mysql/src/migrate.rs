//! Creating the outbox table: idempotent DDL under a named lock (`GET_LOCK`).

use std::time::Duration;

use outbox_traits::Error;
use sqlx::pool::PoolConnection;
use sqlx::{Executor, MySql, MySqlPool};

use crate::config::MysqlConfig;
use crate::error::map_sqlx;
use crate::store::table_layout;

/// Prefix of the `GET_LOCK` name taken while migrating. The full name is this prefix and the
/// MD5 of `database.table` (the connection's database when the config names none), so
/// migrations of one table run one after the other while different tables migrate in
/// parallel, and the name stays within MariaDB's 64 characters.
pub const MIGRATION_LOCK_PREFIX: &str = "outbox_migrate_";

/// How long [`migrate`] waits for another process's migration of the same table.
const LOCK_TIMEOUT: Duration = Duration::from_secs(60);

/// Create the database (when the config names one), the table and its indexes if they do not
/// exist.
///
/// Runs [`MysqlConfig::migration_sql`] on one connection holding a `GET_LOCK` named after the
/// table (see [`MIGRATION_LOCK_PREFIX`]), so processes starting together migrate one after the
/// other. MariaDB commits each DDL statement on its own; every statement is idempotent (`IF NOT
/// EXISTS`, `SET DEFAULT`), so a migration interrupted half-way is completed by the next one. It
/// also brings a table made by an earlier version up to the SQL enqueue contract (id default,
/// headers check, partition key trigger). Safe to call at every
/// start-up.
///
/// If the call is cancelled (or the lock cannot be released) while the lock is held, its
/// connection is closed rather than returned to the pool, so no pooled connection keeps the
/// lock.
///
/// # Errors
/// Classified database errors, e.g. [`Error::Unavailable`] when the server cannot be reached,
/// a transient error when another migration of the table held the lock for 60 s, or a permanent
/// error when the user may not create the database or table.
pub async fn migrate(pool: &MySqlPool, config: &MysqlConfig) -> Result<(), Error> {
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, "migrate", table);
    let mut guard = LockGuard::acquire(pool, config, "migrate").await?;
    // The layout: the one named, else an existing table's, else a new table's.
    let sql = match config.unpublished_table() {
        Some(on) => Ok(config.sql_for(on)),
        None => table_layout(&mut *guard.conn, config)
            .await
            .map(|(exists, unpublished)| {
                if exists {
                    config.sql_for(unpublished)
                } else {
                    config.sql()
                }
            }),
    };
    // A query without arguments goes through the text protocol, which runs every statement.
    let migrated = match sql {
        Ok(sql) => guard.conn.execute(sql.migrate.as_str()).await.map(|_| ()),
        Err(e) => Err(e),
    }
    .map_err(err);
    guard.release(config, "migrate").await?;
    migrated?;
    Ok(())
}

/// The `GET_LOCK` name of the table, as a SQL expression of three parameters (see
/// [`MIGRATION_LOCK_PREFIX`]).
const LOCK_NAME: &str = "CONCAT(?, MD5(CONCAT_WS('.', COALESCE(?, DATABASE(), ''), ?)))";

/// A pooled connection that may hold the migration lock. Dropped while it may, it is closed
/// instead of returned to the pool: closing the session releases the lock.
pub(crate) struct LockGuard {
    pub(crate) conn: PoolConnection<MySql>,
    may_hold_lock: bool,
}

impl LockGuard {
    /// A connection holding the table's migration lock, for operation `op` (named in errors).
    /// From here until the lock is released, a cancelled call closes the connection.
    pub(crate) async fn acquire(
        pool: &MySqlPool,
        config: &MysqlConfig,
        op: &str,
    ) -> Result<Self, Error> {
        let table = config.qualified_table();
        let err = |e| map_sqlx(e, op, table);
        let mut guard = LockGuard {
            conn: pool.acquire().await.map_err(err)?,
            may_hold_lock: true,
        };
        let locked: Option<i64> = sqlx::query_scalar(&format!("SELECT GET_LOCK({LOCK_NAME}, ?)"))
            .bind(MIGRATION_LOCK_PREFIX)
            .bind(config.database())
            .bind(config.table())
            .bind(LOCK_TIMEOUT.as_secs())
            .fetch_one(&mut *guard.conn)
            .await
            .map_err(err)?;
        if locked != Some(1) {
            guard.may_hold_lock = false;
            return Err(Error::transient(
                format!(
                    "{op} on {table}: another process held the migration lock for \
                     {LOCK_TIMEOUT:?}; retry later"
                ),
                None,
            ));
        }
        Ok(guard)
    }

    /// Release the lock and return the connection to the pool.
    pub(crate) async fn release(mut self, config: &MysqlConfig, op: &str) -> Result<(), Error> {
        sqlx::query(&format!("DO RELEASE_LOCK({LOCK_NAME})"))
            .bind(MIGRATION_LOCK_PREFIX)
            .bind(config.database())
            .bind(config.table())
            .execute(&mut *self.conn)
            .await
            .map_err(|e| map_sqlx(e, op, config.qualified_table()))?;
        self.may_hold_lock = false;
        Ok(())
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.may_hold_lock {
            self.conn.close_on_drop();
        }
    }
}
