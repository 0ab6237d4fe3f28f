//! Converting a table made with claim indexes (by an earlier release, or with
//! `unpublished_table(false)`) to the layout with an unpublished table that new tables keeping
//! published rows get: [`convert_to_unpublished_table`].

use outbox_traits::Error;
use sqlx::{Executor, MySqlPool};

use crate::config::MysqlConfig;
use crate::error::map_sqlx;
use crate::migrate::LockGuard;
use crate::sql::{KEY_HASH, NO_LEASE_END};
use crate::store::table_layout;

/// What a conversion is called in errors.
const OP: &str = "convert to an unpublished table";

/// Convert the table of `config` from claim indexes of its own to an unpublished table
/// ([`MysqlConfigBuilder::unpublished_table`](crate::MysqlConfigBuilder::unpublished_table)),
/// in which completing a message that is kept changes no index of its row. Returns `true` when
/// it converted the table, `false` when the table had that layout already (so it is safe to
/// run again, e.g. after a step failed).
///
/// **Stop the table's relays first** (writers may go on writing). A relay keeps the statements
/// of the layout it found when it started: one of the old layout left running would complete
/// rows without removing their entries from the unpublished table, and a stale entry holds its
/// key back. The conversion refuses while any message is leased, which a running relay under
/// load always shows, and a relay of the old layout fails from the moment the claim indexes are
/// gone (its claims name them). Store handles that served the table before keep its old
/// layout too: use new ones (a relay started afterwards finds the new layout itself).
///
/// Under the table's migration lock (as [`crate::migrate`]), each step safe to repeat: the
/// unpublished table and its two triggers are created (from then on, every row written gets its
/// entry in the writer's own transaction); the entries of the rows already pending or dead are
/// written, in one statement that reads the rows with locks, so that a writer's row committed
/// meanwhile is waited for and found once (its trigger's entry is kept); the outbox table's
/// `ix_claim`, `ix_key` and `ix_published` are dropped (in place, without blocking writes) and
/// `published_at` defaults to the epoch from then on; then the new layout's migration runs.
///
/// # Errors
/// [`Error::InvalidInput`] when the configuration does not give new tables an unpublished table
/// (it deletes published rows or names `unpublished_table(false)`), when the table does not
/// exist (a migration creates it in the new layout), or when messages are leased (a relay is
/// running); classified database errors otherwise. A conversion that failed half-way leaves a
/// table that both layouts' migrations refuse: run the conversion again to finish it.
pub async fn convert_to_unpublished_table(
    pool: &MySqlPool,
    config: &MysqlConfig,
) -> Result<bool, Error> {
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, OP, table);
    if !config.new_tables_use_unpublished_table() {
        return Err(Error::invalid_input(format!(
            "the configuration of {table} gives new tables no unpublished table (it deletes \
             published rows, or names unpublished_table(false)): there is nothing to convert \
             {table} to; the unpublished table is for tables that keep published rows"
        )));
    }
    let mut guard = LockGuard::acquire(pool, config, OP).await?;
    let converted = convert(&mut guard, config).await;
    guard.release(config, OP).await?;
    converted.map_err(|e| match e {
        Converted::Refused(e) => e,
        Converted::Sql(e) => err(e),
    })
}

enum Converted {
    Refused(Error),
    Sql(sqlx::Error),
}

impl From<sqlx::Error> for Converted {
    fn from(e: sqlx::Error) -> Self {
        Converted::Sql(e)
    }
}

async fn convert(guard: &mut LockGuard, config: &MysqlConfig) -> Result<bool, Converted> {
    let table = config.qualified_table();
    let conn = &mut *guard.conn;
    match table_layout(&mut *conn, config).await? {
        (false, _) => {
            return Err(Converted::Refused(Error::invalid_input(format!(
                "the outbox table {table} does not exist: there is nothing to convert (a \
                 migration creates it with an unpublished table)"
            ))))
        }
        (true, true) => return Ok(false),
        (true, false) => {}
    }
    let t = table;
    let sql = config.sql_for(true);
    let Some(u) = sql.unpublished.as_deref() else {
        return Err(Converted::Refused(Error::permanent(
            format!("{table}: the configuration names no unpublished table"),
            None,
        )));
    };
    let leased: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {t} WHERE state = 'pending' AND lease_until > UTC_TIMESTAMP(6)"
    ))
    .fetch_one(&mut *conn)
    .await?;
    if leased > 0 {
        return Err(Converted::Refused(Error::invalid_input(format!(
            "{leased} message(s) of {table} are leased: a relay is running on the table. Stop \
             the table's relays (writers may go on), then convert; nothing was changed"
        ))));
    }
    // The table and its triggers first: every row written from here on gets its entry.
    conn.execute(sql.unpublished_ddl.as_str()).await?;
    // Then the rows already there. A locking read (INSERT ... SELECT reads its source so), so
    // a writer still open when the triggers were made is waited for; its row's trigger entry,
    // if any, is kept.
    conn.execute(
        format!(
            "INSERT INTO {u} (state, seq, partition_key, {KEY_HASH})
             SELECT CAST(state AS CHAR), seq, partition_key, {KEY_HASH} FROM {t}
             WHERE state IN ('pending', 'dead')
             ON DUPLICATE KEY UPDATE seq = VALUES(seq)"
        )
        .as_str(),
    )
    .await?;
    conn.execute(
        format!(
            "ALTER TABLE {t} DROP INDEX IF EXISTS ix_claim, DROP INDEX IF EXISTS ix_key,
                 DROP INDEX IF EXISTS ix_published,
                 ALTER COLUMN published_at SET DEFAULT '{NO_LEASE_END}',
                 ALGORITHM = INPLACE, LOCK = NONE"
        )
        .as_str(),
    )
    .await?;
    conn.execute(sql.migrate.as_str()).await?;
    Ok(true)
}
