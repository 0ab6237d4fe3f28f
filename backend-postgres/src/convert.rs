//! Converting a table made in the partial-index layout (by an earlier release, or with
//! `cursor_claims(false)`) to the cursor layout that new tables keeping published rows get
//! (`docs/keep-cursor.md`): [`convert_to_cursor_claims`].
//!
//! Writers may go on writing throughout: the new indexes are built `CONCURRENTLY` and the
//! dead-letter check is validated without blocking writes; two steps take the table's exclusive
//! lock for a moment (adding that check `NOT VALID`, without a scan, and the last transaction,
//! which drops the old indexes and creates the cursor objects), each waiting at most
//! [`CONVERT_LOCK_TIMEOUT`] for it, since writers queue behind a wait for that lock. The steps
//! between wait as long as they must (an index built `CONCURRENTLY` waits for every transaction
//! older than it in the database), holding up nobody. The table's relays must be stopped: a
//! relay keeps the statements of the layout it found when it started (see
//! [`convert_to_cursor_claims`]).

use outbox_traits::Error;
use sqlx::{Executor, PgPool};

use crate::config::PostgresConfig;
use crate::cursor::{seq_index_name, CursorNames};
use crate::error::map_sqlx;
use crate::migrate::MIGRATION_LOCK_KEY;
use crate::sql::derived_name;

/// The longest each step of a conversion that takes the table's exclusive lock waits for it
/// (Postgres's `lock_timeout`), e.g. for a writer's transaction still open on the table; past it
/// the conversion fails with a transient error and can be run again. A step waiting for the
/// table's exclusive lock holds up the writers that come after it, so the wait is short.
pub const CONVERT_LOCK_TIMEOUT: &str = "5s";

/// The first key of the session advisory lock a conversion holds throughout
/// (`pg_try_advisory_lock(CONVERT_LOCK_CLASS, hashtext(<table>))`), so that two conversions of
/// one table never interleave their steps: the second is refused at once.
pub const CONVERT_LOCK_CLASS: i32 = 0x6f75_7463;

/// The cursor layout's indexes: name, then what follows `ON <table>` in its definition. The same
/// as `crate::cursor::ddl`'s (a unit test compares them); the plain `(seq)` index, whose presence
/// tells the layout, comes first and is built under a temporary name.
fn cursor_indexes(table: &str) -> [(String, &'static str); 5] {
    [
        (seq_index_name(table), "(seq)"),
        (derived_name(table, "key_seq_idx"), "(partition_key, seq)"),
        (
            derived_name(table, "aside_idx"),
            "(seq)\n    WHERE last_error IS NOT NULL OR available_at > created_at",
        ),
        (
            derived_name(table, "aside_key_idx"),
            "(partition_key, seq)\n    WHERE last_error IS NOT NULL OR available_at > created_at",
        ),
        (
            derived_name(table, "failed_key_idx"),
            "(partition_key, seq)\n    WHERE last_error IS NOT NULL",
        ),
    ]
}

/// The partial-index layout's indexes, which the conversion drops.
fn partial_indexes(table: &str) -> [String; 4] {
    ["claim_idx", "key_idx", "dead_idx", "published_idx"].map(|s| derived_name(table, s))
}

/// Convert the table of `config` from the partial-index layout to the cursor layout
/// ([`PostgresConfigBuilder::cursor_claims`](crate::PostgresConfigBuilder::cursor_claims)), in
/// which completing a message that is kept writes no index entry. Returns `true` when it
/// converted the table, `false` when the table already had the cursor layout (so it is safe to
/// run again, e.g. after a step failed).
///
/// **Stop the table's relays first** (writers may go on writing). A relay keeps the statements
/// of the layout it found when it started; one of the old layout left running would still be
/// correct except in one case, a release after the database clock stepped back, which leaves a
/// row the cursor then passes. The conversion refuses while any message is leased, which a
/// running relay under load always shows. Store handles that served the table before keep its
/// old layout too: use new ones (a relay started afterwards finds the new layout itself).
///
/// The two steps that take the table's exclusive lock wait at most [`CONVERT_LOCK_TIMEOUT`] for
/// it (a writer's transaction open longer makes the conversion fail with a transient error: run
/// it again); the index builds and the check's validation, which block no writer, wait for the
/// transactions before them as long as those last. One conversion of a table runs at a time: a
/// second is refused with a transient error. The steps, each safe to repeat: dead rows without an error get one (`dead before the cursor
/// layout`: the layout keeps dead rows aside through their `last_error`), and the check that
/// says so is added without blocking writes; the five cursor-layout indexes are built
/// `CONCURRENTLY` (an invalid one a failed earlier run left is dropped and built again); then
/// one transaction, under [`MIGRATION_LOCK_KEY`] and the table's exclusive lock, gives the
/// plain `(seq)` index its name, drops the four partial indexes, sets the cursor layout's fill
/// factor (for pages written from then on), runs the cursor layout's migration, which creates
/// the cursor table and its settle function, and starts the cursor at the first pending row (at
/// 0 when a transaction holds the identity sequence, e.g. one that drew a seq by hand, so the
/// first claims then read the published history once).
///
/// # Errors
/// [`Error::InvalidInput`] when the configuration does not lay tables out for cursor claims
/// (it deletes published rows, names `cursor_claims(false)` or a partition interval), when the
/// table does not exist (a migration creates it in the cursor layout), or when messages are
/// leased (a relay is running); a transient error when another conversion of the table is
/// running; classified database errors otherwise, e.g. a transient one when an exclusive lock
/// was not granted in time.
pub async fn convert_to_cursor_claims(
    pool: &PgPool,
    config: &PostgresConfig,
) -> Result<bool, Error> {
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, "convert to cursor claims", table);
    if !config.new_tables_use_cursor_claims() {
        return Err(Error::invalid_input(format!(
            "the configuration of {table} does not lay tables out for cursor claims (it deletes \
             published rows, names cursor_claims(false) or a partition interval): there is \
             nothing to convert {table} to; the cursor layout is for tables that keep published \
             rows"
        )));
    }
    // Its own connection, closed at the end: every step waits at most the lock timeout, and a
    // pooled connection would keep that setting.
    let mut conn = pool.acquire().await.map_err(err)?.detach();
    let converted = convert_on(&mut conn, config).await;
    // Closing the connection also releases the conversion's session lock.
    let _ = sqlx::Connection::close(conn).await;
    converted
}

/// [`convert_to_cursor_claims`] on its own connection `conn`.
async fn convert_on(conn: &mut sqlx::PgConnection, config: &PostgresConfig) -> Result<bool, Error> {
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, "convert to cursor claims", table);
    conn.execute(format!("SET lock_timeout = '{CONVERT_LOCK_TIMEOUT}'").as_str())
        .await
        .map_err(err)?;
    // One conversion of a table at a time: a second one, started while the first builds its
    // indexes, would take the first's half-built index for a failed run's and drop it, or
    // build its own under the same temporary name.
    let alone: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
        .bind(CONVERT_LOCK_CLASS)
        .bind(table)
        .fetch_one(&mut *conn)
        .await
        .map_err(err)?;
    if !alone {
        return Err(Error::transient(
            format!(
                "another conversion of {table} is running: run this one again when it has \
                 ended (on a converted table it does nothing and returns false)"
            ),
            None,
        ));
    }
    match crate::partition::table_layout(&mut *conn, config)
        .await
        .map_err(err)?
    {
        None => {
            return Err(Error::invalid_input(format!(
                "the outbox table {table} does not exist: there is nothing to convert (a \
                 migration creates it in the cursor layout)"
            )))
        }
        Some((true, _)) => {
            return Err(Error::invalid_input(format!(
                "the outbox table {table} is partitioned: a partitioned table has one layout"
            )))
        }
        Some((false, true)) => return Ok(false),
        Some((false, false)) => {}
    }
    let t = table;
    let leased: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {t} WHERE state = 'pending' AND lease_until > now()"
    ))
    .fetch_one(&mut *conn)
    .await
    .map_err(err)?;
    if leased > 0 {
        return Err(Error::invalid_input(format!(
            "{leased} message(s) of {table} are leased: a relay is running on the table. Stop \
             the table's relays (writers may go on), then convert; nothing was changed"
        )));
    }
    // A dead row is aside through its error (`crate::cursor`): one written without an error by
    // hand gets one, then the check is added without a scan under the table's exclusive lock.
    let dead_check = derived_name(config.table(), "dead_check");
    conn.execute(
        format!(
            "UPDATE {t} SET last_error = 'dead before the cursor layout'
             WHERE state = 'dead' AND last_error IS NULL;
             DO $outbox_convert$
             BEGIN
                 IF NOT EXISTS (
                     SELECT 1 FROM pg_constraint
                     WHERE conrelid = '{t}'::regclass AND conname = '{dead_check}'
                 ) THEN
                     ALTER TABLE {t} ADD CONSTRAINT \"{dead_check}\"
                         CHECK (state <> 'dead' OR last_error IS NOT NULL) NOT VALID;
                 END IF;
             END
             $outbox_convert$;"
        )
        .as_str(),
    )
    .await
    .map_err(err)?;
    // From here to the last transaction nothing waits for the table's exclusive lock, so no
    // writer queues behind a wait: no bound (an index build waits for every older transaction
    // in the database, e.g. a report's, and fails past a bound for no harm to anyone).
    conn.execute(
        format!(
            "SET lock_timeout = 0;
             ALTER TABLE {t} VALIDATE CONSTRAINT \"{dead_check}\""
        )
        .as_str(),
    )
    .await
    .map_err(err)?;
    let schema = config.schema();
    let indexes = cursor_indexes(config.table());
    let seq_idx = indexes[0].0.clone();
    let building = derived_name(config.table(), "seq_idx_new");
    for (i, (name, def)) in indexes.iter().enumerate() {
        let name = if i == 0 { &building } else { name };
        // A build that failed (or was cancelled) leaves an invalid index of that name.
        let invalid: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                            JOIN pg_namespace n ON n.oid = c.relnamespace
                            WHERE n.nspname = $1 AND c.relname = $2 AND NOT i.indisvalid)",
        )
        .bind(schema)
        .bind(name)
        .fetch_one(&mut *conn)
        .await
        .map_err(err)?;
        if invalid {
            conn.execute(format!("DROP INDEX CONCURRENTLY \"{schema}\".\"{name}\"").as_str())
                .await
                .map_err(err)?;
        }
        conn.execute(
            format!("CREATE INDEX CONCURRENTLY IF NOT EXISTS \"{name}\" ON {t} {def}").as_str(),
        )
        .await
        .map_err(err)?;
    }
    let drops = partial_indexes(config.table())
        .iter()
        .map(|name| format!("DROP INDEX IF EXISTS \"{schema}\".\"{name}\";"))
        .collect::<Vec<_>>()
        .join("\n");
    conn.execute(format!("SET lock_timeout = '{CONVERT_LOCK_TIMEOUT}'").as_str())
        .await
        .map_err(err)?;
    let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(err)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK_KEY)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
    // The table's exclusive lock first (the drops below would take it anyway): from here no
    // writer of the table is in flight, so the cursor can start where the pending rows start.
    tx.execute(format!("LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE").as_str())
        .await
        .map_err(err)?;
    // Read while the old layout's pending index still serves it.
    let start: Option<i64> = sqlx::query_scalar(&cursor_start_sql(t))
        .fetch_optional(&mut *tx)
        .await
        .map_err(err)?
        .flatten();
    tx.execute(
        format!(
            "ALTER INDEX \"{schema}\".\"{building}\" RENAME TO \"{seq_idx}\";
             {drops}
             ALTER TABLE {t} SET (fillfactor = {ff});",
            ff = crate::sql::CURSOR_FILLFACTOR
        )
        .as_str(),
    )
    .await
    .map_err(err)?;
    tx.execute(config.sql_for(true).migrate.as_str())
        .await
        .map_err(err)?;
    // Cursors left by an earlier table of that name mean nothing for this one; without a start
    // every shard's cursor starts at 0 and the first claims read the history once.
    let cursors = CursorNames::new(schema, config.table()).cursors;
    tx.execute(format!("DELETE FROM {cursors}").as_str())
        .await
        .map_err(err)?;
    if let Some(start) = start {
        // The unsharded cursor; a shard of any count starts from it (the settle function).
        sqlx::query(&format!(
            "INSERT INTO {cursors} (shards, shard, below) VALUES (1, 0, $1)"
        ))
        .bind(start)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
    }
    tx.commit().await.map_err(err)?;
    Ok(true)
}

/// The statement that reads where the converted table's cursor can start, under the table's
/// exclusive lock: the first pending row's seq (every row below it is published or dead, and a
/// dead row is aside through its error), or past the last seq drawn when nothing is pending.
/// NULL (no start, the cursor starts at 0) when a seq may still arrive below that point: a
/// transaction other than this one holds the sequence (a writer that drew a seq by hand, or a
/// prepared one), or the sequence caches, so that a session may hand out seqs it drew before.
fn cursor_start_sql(t: &str) -> String {
    format!(
        "SELECT CASE
                  WHEN s.seqcache <> 1 OR EXISTS (
                      SELECT 1 FROM pg_locks k
                      WHERE k.relation = s.seqrelid AND k.mode = 'RowExclusiveLock'
                        AND k.pid IS DISTINCT FROM pg_backend_pid())
                  THEN NULL
                  ELSE COALESCE(
                      (SELECT min(r.seq) FROM {t} r WHERE r.state = 'pending'),
                      GREATEST(COALESCE(pg_sequence_last_value(s.seqrelid), 0),
                               COALESCE((SELECT max(r.seq) FROM {t} r), 0)) + 1)
                END
           FROM pg_sequence s
          WHERE s.seqrelid = pg_get_serial_sequence('{t}', 'seq')::regclass"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The conversion builds exactly the indexes the cursor layout's migration creates.
    #[test]
    fn the_converted_indexes_are_the_migration_s() {
        let config = PostgresConfig::builder()
            .schema("s")
            .table("events")
            .build()
            .unwrap();
        let migrate = &config.sql_for(true).migrate;
        for (name, def) in cursor_indexes("events") {
            let create =
                format!("CREATE INDEX IF NOT EXISTS \"{name}\" ON \"s\".\"events\" {def};");
            assert!(migrate.contains(&create), "{create} not in the migration");
        }
        let old = &config.sql_for(false).migrate;
        for name in partial_indexes("events") {
            assert!(old.contains(&format!("CREATE INDEX IF NOT EXISTS \"{name}\"")));
        }
    }
}
