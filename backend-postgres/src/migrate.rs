//! Creating the outbox table: idempotent DDL under a transaction-scoped advisory lock.

use outbox_traits::Error;
use sqlx::{Executor, PgPool};

use crate::config::PostgresConfig;
use crate::error::map_sqlx;

/// Advisory lock key taken while migrating ("outbox" in ASCII). One key for every outbox table:
/// two tables in one new schema would otherwise race on creating the schema.
pub const MIGRATION_LOCK_KEY: i64 = 0x6f75_7462_6f78;

/// Create the schema, table and indexes of `config` if they do not exist.
///
/// Runs [`PostgresConfig::migration_sql`] in one transaction that first takes the advisory lock
/// [`MIGRATION_LOCK_KEY`] (`pg_advisory_xact_lock`), so processes starting together migrate one
/// after the other instead of colliding on `CREATE ... IF NOT EXISTS`. The lock is released at
/// commit. Safe to call at every start-up.
///
/// # Errors
/// [`Error::InvalidInput`] when the table exists with the other shape than the configuration's
/// (plain, or partitioned by [`PostgresConfigBuilder::partition_interval`](crate::PostgresConfigBuilder::partition_interval)),
/// or the other layout than the one it names ([`PostgresConfigBuilder::cursor_claims`](crate::PostgresConfigBuilder::cursor_claims)):
/// a migration never converts a table. With the layout unnamed, an existing table is migrated
/// in its own layout and a new one is laid out as
/// [`PostgresConfig::new_tables_use_cursor_claims`] says.
/// Classified database errors, e.g. [`Error::Unavailable`] when the server cannot be reached or a
/// permanent error when the role may not create the schema or table.
pub async fn migrate(pool: &PgPool, config: &PostgresConfig) -> Result<(), Error> {
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, "migrate", table);
    let mut tx = pool.begin().await.map_err(err)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK_KEY)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
    // A plain table is never turned into a partitioned one, nor the reverse, nor laid out
    // anew: an existing table keeps its layout (the DDL below creates a missing one).
    let sql = match crate::partition::check_shape(&mut tx, config).await? {
        Some(cursor) => config.sql_for(cursor).migrate.as_str(),
        None => config.migration_sql(),
    };
    // Several statements: a query without arguments goes through the simple query protocol,
    // which runs them all, in this transaction.
    tx.execute(sql).await.map_err(err)?;
    tx.execute(crate::group::group_migration_sql(config).as_str())
        .await
        .map_err(err)?;
    tx.commit().await.map_err(err)?;
    Ok(())
}
