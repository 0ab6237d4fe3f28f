//! Time-partitioned outbox tables (`partition_interval`): their DDL, the claim statements
//! rewritten to address rows exactly across partitions, and retention by dropping whole
//! partitions (README, "Partitioned tables").
//!
//! The plain table's statements are built first ([`crate::sql::Sql::build`]); [`partitioned`]
//! then rewrites the few places that differ. Every rewrite must match exactly once (checked by
//! a test), so the plain table keeps its statements byte for byte.

use std::time::Duration;

use outbox_sql_support::names::{derived_name, fnv1a};
use outbox_traits::Error;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, Postgres, Row};

use crate::config::PostgresConfig;
use crate::error::map_sqlx;
use crate::sql::{Sql, FILLFACTOR};
use crate::store::PostgresStore;

/// How many intervals past the current one the migration and every purge create partitions
/// for. Rows of a range with no partition yet go to the DEFAULT partition (nothing fails), and
/// are then purged row by row.
pub const PARTITIONS_AHEAD: i32 = 4;

/// The longest a purge waits for the table lock that creating or dropping a partition takes
/// (Postgres's `lock_timeout`). While it waits, writers and claims queue behind it; past it the
/// purge leaves that step to its next round instead of holding them up.
pub(crate) const PARTITION_LOCK_TIMEOUT: &str = "500ms";

/// The fixed-length part of a partition's name after the table's prefix: its start, UTC, to the
/// minute (`20261128t0000`), as `to_char` writes it.
const START_FORMAT: &str = "YYYYMMDD\"t\"HH24MI";
const START_EXAMPLE: &str = "p00000000t0000";

/// The names and statements of a partitioned table.
pub(crate) struct PartitionSql {
    /// `"schema"."<table>_premake"(ahead integer)`: creates the missing partitions from the
    /// current one to `ahead` intervals later; returns how many it created.
    pub premake_function: String,
    /// `"schema"."<table>_dedup"`: one row per dedup key still in the table.
    pub dedup_table: String,
    /// The partitions whose range ended before `$1` microseconds ago, oldest first: name
    /// (quoted, qualified), range start and end.
    pub list_old: String,
    /// Delete up to `$2` published rows older than `$1` microseconds (row deletes, as the plain
    /// table's purge, by primary key rather than `ctid`).
    pub purge_rows: String,
    /// The advisory lock key purges of this table take (session level), so two relays never
    /// purge it at once.
    pub purge_lock_key: i64,
}

/// Replace `from` by `to` in `text`, exactly once (a test checks every rewrite matched).
fn rewrite(text: &str, from: &str, to: &str) -> String {
    debug_assert_eq!(text.matches(from).count(), 1, "rewrite of {from:?}");
    text.replacen(from, to, 1)
}

/// The plain table's statements `sql`, rewritten for a table partitioned `interval_s` wide.
pub(crate) fn partitioned(mut sql: Sql, schema: &str, table: &str, interval_s: u64) -> Sql {
    let t = sql.table.clone();
    let prefix_name = derived_name(table, START_EXAMPLE);
    let prefix = &prefix_name[..prefix_name.len() - (START_EXAMPLE.len() - 1)];
    let default_name = derived_name(table, "default");
    let default_partition = format!("\"{schema}\".\"{default_name}\"");
    let dedup_table = format!("\"{schema}\".\"{}\"", derived_name(table, "dedup"));
    let premake_function = format!("\"{schema}\".\"{}\"", derived_name(table, "premake"));
    let dedup_function = derived_name(table, "dedup_sync");

    // --- The table: partitioned by created_at, whose unique indexes must include it. ---
    let mut migrate = format!(
        r#"-- Partitioned outbox table ({interval_s} s partitions). A migration never turns a plain
-- table into a partitioned one or back.
DO $outbox$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_class
               WHERE oid = to_regclass('{t}') AND relkind <> 'p') THEN
        RAISE EXCEPTION 'the outbox table {t} is a plain table, but this migration is for a partitioned one (partition_interval); a migration never converts a table'
            USING ERRCODE = 'wrong_object_type';
    END IF;
END
$outbox$;

"#
    ) + &sql.migrate;
    migrate = rewrite(
        &migrate,
        "PRIMARY KEY (id),",
        "PRIMARY KEY (id, created_at),",
    );
    migrate = rewrite(
        &migrate,
        &format!(
            ")
-- Spare space on every page, so that the new row version written by a claim, extend, release
-- or retry fits on the row's own page: a HOT update, with no index writes.
WITH (fillfactor = {FILLFACTOR});"
        ),
        &format!(
            r#")
-- One partition per interval of created_at (aligned from the Unix epoch, UTC), each with the
-- spare page space of a plain table (fillfactor: claims are HOT updates).
PARTITION BY RANGE (created_at);

-- Rows of a range with no partition (written far in the past or the future, or before the
-- purge made the partition) land here: no write ever fails for want of a partition.
CREATE TABLE IF NOT EXISTS {default_partition} PARTITION OF {t} DEFAULT
    WITH (fillfactor = {FILLFACTOR});"#
        ),
    );
    let dedup_constraint = &sql.dedup_constraint;
    migrate = rewrite(
        &migrate,
        &format!(
            "-- Dedup keys are unique. A partial index, not a UNIQUE constraint: most messages have no dedup
-- key, and a constraint would index their NULLs too, costing every claim and complete (each
-- writes a new row version) one more index insert.
CREATE UNIQUE INDEX IF NOT EXISTS \"{dedup_constraint}\" ON {t} (dedup_key)
    WHERE dedup_key IS NOT NULL;"
        ),
        &format!(
            r#"-- Dedup keys are unique across the whole table. A unique index of a partitioned table must
-- hold the partition column, so the keys live in a small side table instead, one row per key
-- still in the outbox, kept by the row triggers below (a unique index, unlike a lookup,
-- holds under every isolation level). Purges remove its rows with theirs.
CREATE TABLE IF NOT EXISTS {dedup_table} (
    dedup_key  text        NOT NULL,
    id         uuid        NOT NULL,
    created_at timestamptz NOT NULL,
    CONSTRAINT "{dedup_constraint}" PRIMARY KEY (dedup_key)
);
CREATE INDEX IF NOT EXISTS "{dedup_id_idx}" ON {dedup_table} (id);
CREATE INDEX IF NOT EXISTS "{dedup_created_idx}" ON {dedup_table} (created_at);

-- Keeps the side table in step with the outbox rows that have a dedup key. A row moved to
-- another partition (an UPDATE of created_at) runs the UPDATE, DELETE and INSERT triggers in
-- turn; deleting by id makes that come out right whatever changed.
CREATE OR REPLACE FUNCTION "{schema}"."{dedup_function}"() RETURNS trigger
LANGUAGE plpgsql AS $outbox_dedup$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.dedup_key IS NOT NULL THEN
        DELETE FROM {dedup_table} WHERE id = OLD.id;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.dedup_key IS NOT NULL THEN
        INSERT INTO {dedup_table} (dedup_key, id, created_at)
        VALUES (NEW.dedup_key, NEW.id, NEW.created_at);
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$outbox_dedup$;

DO $outbox$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = '{t}'::regclass AND tgname = '{dedup_insert}') THEN
        CREATE TRIGGER "{dedup_insert}" BEFORE INSERT ON {t}
            FOR EACH ROW WHEN (NEW.dedup_key IS NOT NULL)
            EXECUTE FUNCTION "{schema}"."{dedup_function}"();
        CREATE TRIGGER "{dedup_delete}" BEFORE DELETE ON {t}
            FOR EACH ROW WHEN (OLD.dedup_key IS NOT NULL)
            EXECUTE FUNCTION "{schema}"."{dedup_function}"();
        CREATE TRIGGER "{dedup_update}" BEFORE UPDATE OF dedup_key, created_at ON {t}
            FOR EACH ROW WHEN (OLD.dedup_key IS DISTINCT FROM NEW.dedup_key
                               OR OLD.created_at IS DISTINCT FROM NEW.created_at)
            EXECUTE FUNCTION "{schema}"."{dedup_function}"();
    END IF;
END
$outbox$;"#,
            dedup_id_idx = derived_name(table, "dedup_id_idx"),
            dedup_created_idx = derived_name(table, "dedup_created_idx"),
            dedup_insert = derived_name(table, "dedup_insert"),
            dedup_delete = derived_name(table, "dedup_delete"),
            dedup_update = derived_name(table, "dedup_update"),
        ),
    );
    // A row moved to another partition (an UPDATE of created_at) is deleted and inserted
    // again, and the insert runs the BEFORE INSERT triggers: the partition key's default must
    // not turn a moved unordered message (NULL key) into one ordered by its aggregate id. A
    // BEFORE UPDATE OF created_at trigger marks the row being moved for the length of the
    // transaction (its seq, which no new row can have); the relay's updates never name
    // created_at, so they run no trigger.
    let moving_function = derived_name(table, "moving");
    migrate = rewrite(
        &migrate,
        "    IF NEW.partition_key IS NULL THEN\n",
        "    IF NEW.partition_key IS NULL\n       \
         AND current_setting('outbox.moving_seq', true) IS DISTINCT FROM NEW.seq::text THEN\n",
    );
    migrate.push_str(&format!(
        r#"
CREATE OR REPLACE FUNCTION "{schema}"."{moving_function}"() RETURNS trigger
LANGUAGE plpgsql AS $outbox_moving$
BEGIN
    PERFORM set_config('outbox.moving_seq', NEW.seq::text, true);
    RETURN NEW;
END
$outbox_moving$;

DO $outbox$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = '{t_escaped}'::regclass AND tgname = '{moving_function}') THEN
        CREATE TRIGGER "{moving_function}" BEFORE UPDATE OF created_at ON {t}
            FOR EACH ROW WHEN (OLD.created_at IS DISTINCT FROM NEW.created_at)
            EXECUTE FUNCTION "{schema}"."{moving_function}"();
    END IF;
END
$outbox$;
"#,
        t_escaped = t.replace('\'', "''"),
    ));
    migrate.push_str(&format!(
        r#"
-- ---------------------------------------------------------------------------------------------
-- Partitions ahead. Creates the partitions that are missing from the interval holding `start`
-- (default: now) to `ahead` intervals later, named {prefix}<start, UTC, to the minute>; the
-- migration and every purge call it (so can a scheduler, SELECT {premake_function}({PARTITIONS_AHEAD}),
-- or an operator before a backfill of old rows, with a past `start`). A range the DEFAULT
-- partition already holds rows of stays there (Postgres would refuse the partition); so does
-- one overlapping a partition of another width. Returns how many it created.
CREATE OR REPLACE FUNCTION {premake_function}(ahead integer, start timestamptz DEFAULT now())
RETURNS integer
LANGUAGE plpgsql AS $outbox_premake$
DECLARE
    step constant bigint := {interval_s};
    first constant bigint := floor(extract(epoch FROM start) / step)::bigint * step;
    lo timestamptz;
    hi timestamptz;
    part text;
    made integer := 0;
BEGIN
    FOR i IN 0..ahead LOOP
        lo := to_timestamp(first + i * step);
        hi := to_timestamp(first + (i + 1) * step);
        part := '{prefix}' || to_char(lo AT TIME ZONE 'UTC', '{START_FORMAT}');
        CONTINUE WHEN to_regclass(format('%I.%I', '{schema}', part)) IS NOT NULL;
        CONTINUE WHEN EXISTS (SELECT 1 FROM {default_partition}
                              WHERE created_at >= lo AND created_at < hi);
        BEGIN
            EXECUTE format('CREATE TABLE %I.%I PARTITION OF {t_escaped} '
                           'FOR VALUES FROM (%L) TO (%L) WITH (fillfactor = {FILLFACTOR})',
                           '{schema}', part, lo, hi);
            made := made + 1;
        EXCEPTION WHEN invalid_object_definition THEN
            NULL;
        END;
    END LOOP;
    RETURN made;
END
$outbox_premake$;

SELECT {premake_function}({PARTITIONS_AHEAD});
"#,
        t_escaped = t.replace('\'', "''"),
    ));
    sql.migrate = migrate;

    // --- Claims: a ctid is unique only within a partition. ---
    // Rows are found by seq through each partition's claim index and matched on their full
    // address (partition, ctid) by a join with the candidates: a row changed since the
    // statement's snapshot has a new ctid, so, as on a plain table, locking it drops it.
    let locked_plain = format!(
        "    SELECT l.ctid AS tid FROM {t} l
    WHERE l.ctid = ANY(ARRAY(SELECT tid FROM cand))
    FOR UPDATE SKIP LOCKED"
    );
    let locked_exact = format!(
        "    SELECT l.ctid AS tid, l.tableoid AS toid, l.seq FROM {t} l
    JOIN cand a ON a.seq = l.seq AND a.toid = l.tableoid AND a.tid = l.ctid
    WHERE l.seq = ANY(ARRAY(SELECT seq FROM cand)) AND l.state = 'pending'
    FOR UPDATE OF l SKIP LOCKED"
    );
    // The rows to update are found by their address alone (a TID scan per partition for each
    // locked row). A `m.seq = ANY(ARRAY(SELECT seq FROM ...))` filter beside it, as the lock
    // step has, was evaluated against every row the TID scans found, over the whole array
    // (a parameter's array is not hashed): 2,000 × 2,000 comparisons in a claim of 2,000, a
    // third of its time.
    let update_exact = |from: &str| {
        format!(
            "    FROM {from} h
    WHERE m.state = 'pending'
      AND m.seq = h.seq AND m.tableoid = h.toid AND m.ctid = h.tid"
        )
    };
    for claim in [&mut sql.claim_block, &mut sql.claim_skip] {
        let mut s = rewrite(
            claim,
            "SELECT w.ctid AS tid, w.id,",
            "SELECT w.ctid AS tid, w.tableoid AS toid, w.id,",
        );
        s = rewrite(
            &s,
            "SELECT c.tid, c.id, c.seq, c.partition_key, c.key_rank",
            "SELECT c.tid, c.toid, c.id, c.seq, c.partition_key, c.key_rank",
        );
        s = rewrite(
            &s,
            "SELECT c.tid, c.id, c.seq, c.partition_key, NULL::bigint AS key_rank",
            "SELECT c.tid, c.toid, c.id, c.seq, c.partition_key, NULL::bigint AS key_rank",
        );
        s = rewrite(&s, &locked_plain, &locked_exact);
        s = rewrite(
            &s,
            "    SELECT c.tid FROM cand c\n",
            "    SELECT c.tid, c.toid, c.seq FROM cand c\n",
        );
        s = rewrite(
            &s,
            "    SELECT r.tid FROM (
        SELECT c.tid, c.partition_key, c.rank,",
            "    SELECT r.tid, r.toid, r.seq FROM (
        SELECT c.tid, c.toid, c.seq, c.partition_key, c.rank,",
        );
        s = rewrite(
            &s,
            "JOIN locked l ON l.tid = c.tid",
            "JOIN locked l ON l.tid = c.tid AND l.toid = c.toid",
        );
        s = rewrite(
            &s,
            "    WHERE m.ctid = ANY(ARRAY(SELECT tid FROM chosen))",
            &update_exact("chosen"),
        );
        *claim = s;
    }
    for past in [&mut sql.claim_past_block, &mut sql.claim_past_skip] {
        let mut s = rewrite(
            past,
            "SELECT x.tid, x.seq FROM (",
            "SELECT x.tid, x.toid, x.seq FROM (",
        );
        s = rewrite(&s, "SELECT h.tid, h.seq\n", "SELECT h.tid, h.toid, h.seq\n");
        s = rewrite(
            &s,
            "SELECT h.ctid AS tid, h.seq,",
            "SELECT h.ctid AS tid, h.tableoid AS toid, h.seq,",
        );
        s = rewrite(
            &s,
            "(SELECT u.ctid, u.seq FROM",
            "(SELECT u.ctid, u.tableoid, u.seq FROM",
        );
        s = rewrite(
            &s,
            "(SELECT c.ctid, c.seq\n",
            "(SELECT c.ctid, c.tableoid, c.seq\n",
        );
        s = rewrite(&s, &locked_plain, &locked_exact);
        s = rewrite(
            &s,
            "    WHERE m.ctid = ANY(ARRAY(SELECT tid FROM locked))",
            &update_exact("locked"),
        );
        *past = s;
    }

    // --- Retention. ---
    let purge_rows = format!(
        "DELETE FROM {t} d
         USING (SELECT id, created_at FROM {t}
                WHERE state = 'published'
                  AND published_at < now() - $1::bigint * interval '1 microsecond'
                ORDER BY published_at
                LIMIT $2) o
         WHERE d.id = o.id AND d.created_at = o.created_at AND d.state = 'published'"
    );
    let list_old = format!(
        r#"SELECT format('%I.%I', n.nspname, c.relname) AS part, b.lo, b.hi
           FROM pg_inherits i
           JOIN pg_class c ON c.oid = i.inhrelid
           JOIN pg_namespace n ON n.oid = c.relnamespace
           CROSS JOIN LATERAL (
               SELECT m[1]::timestamptz AS lo, m[2]::timestamptz AS hi
               FROM regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                 'FROM \(''([^'']*)''\) TO \(''([^'']*)''\)') AS m
           ) b
           WHERE i.inhparent = '{t_escaped}'::regclass
             AND b.hi <= now() - $1::bigint * interval '1 microsecond'
           ORDER BY b.hi"#,
        t_escaped = t.replace('\'', "''"),
    );
    sql.purge = purge_rows.clone();
    sql.partitioned = Some(PartitionSql {
        premake_function,
        dedup_table,
        list_old,
        purge_rows,
        purge_lock_key: fnv1a(format!("purge {t}").as_bytes()) as i64,
    });
    sql
}

/// What the table named by `config` is: `None` when it does not exist, else whether it is
/// partitioned and whether it is laid out for cursor claims.
pub(crate) async fn table_layout(
    conn: &mut sqlx::PgConnection,
    config: &PostgresConfig,
) -> Result<Option<(bool, bool)>, sqlx::Error> {
    // Whether it is partitioned, and whether it is laid out for cursor claims (it has their
    // plain seq index): one catalog query.
    sqlx::query_as(
        "SELECT t.relkind = 'p',
                EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                        WHERE i.indrelid = t.oid AND c.relname = $2)
         FROM pg_class t WHERE t.oid = to_regclass($1)",
    )
    .bind(config.qualified_table())
    .bind(crate::cursor::seq_index_name(config.table()))
    .fetch_optional(conn)
    .await
}

/// The typed error of a table whose shape or layout is not the configuration's; when they agree,
/// whether the table is laid out for cursor claims (`None`: it does not exist yet). One catalog
/// query.
pub(crate) async fn check_shape(
    conn: &mut sqlx::PgConnection,
    config: &PostgresConfig,
) -> Result<Option<bool>, Error> {
    let table = config.qualified_table();
    let found = table_layout(conn, config)
        .await
        .map_err(|e| map_sqlx(e, "check the table's shape", table))?;
    let partitioned = found.map(|(partitioned, _)| partitioned);
    match (partitioned, config.partition_interval()) {
        (Some(false), Some(interval)) => Err(Error::invalid_input(format!(
            "the outbox table {table} is a plain table, but the configuration asks for a \
             partitioned one (partition_interval {interval:?}); a migration never converts a \
             table: drop partition_interval for this table, or migrate a new, partitioned table \
             under another name and move the writers to it"
        ))),
        (Some(true), None) => Err(Error::invalid_input(format!(
            "the outbox table {table} is partitioned (PARTITION BY RANGE (created_at)), but the \
             configuration asks for a plain one (no partition_interval); set the table's \
             partition_interval (`PostgresConfigBuilder::partition_interval`, or \
             `?partition_interval=1d` in the store URL): the plain table's statements address \
             rows in a way that is wrong across partitions"
        ))),
        (Some(false), None) => {
            let laid_for_cursor = found.is_some_and(|(_, cursor)| cursor);
            crate::cursor::check_layout(config, laid_for_cursor)?;
            Ok(Some(laid_for_cursor))
        }
        (Some(true), Some(_)) => Ok(Some(false)),
        (None, _) => Ok(None),
    }
}

/// [`purge_published`](outbox_traits::OutboxAdmin::purge_published) on a partitioned table, in
/// a task of its own (so a caller that drops the future cannot leave the purge lock held on a
/// pooled connection).
pub(crate) async fn purge(store: &PostgresStore, age_us: i64, batch: i64) -> Result<u64, Error> {
    let store = store.clone();
    let table = store.config().qualified_table().to_owned();
    tokio::spawn(async move { purge_task(&store, age_us, batch).await })
        .await
        .map_err(|e| Error::transient(format!("purge of {table} did not finish: {e}"), None))?
}

async fn purge_task(store: &PostgresStore, age_us: i64, batch: i64) -> Result<u64, Error> {
    let config = store.config();
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, "purge_published", table);
    let Some(p) = config.sql().partitioned.as_ref() else {
        return Err(Error::permanent(
            format!("purge of {table}: not a partitioned configuration"),
            None,
        ));
    };
    let mut conn = store.pool().acquire().await.map_err(err)?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(p.purge_lock_key)
        .fetch_one(&mut *conn)
        .await
        .map_err(err)?;
    if !locked {
        // Another relay is purging this table right now: leave it to that one.
        return Ok(0);
    }
    let result = purge_locked(&mut conn, store, p, age_us, batch).await;
    let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(p.purge_lock_key)
        .execute(&mut *conn)
        .await;
    if unlocked.is_err() {
        // Closing the session releases its lock.
        let _ = conn.detach().close().await;
    }
    result
}

/// Whether `sqlx::Error` is Postgres's `lock_not_available` (a `lock_timeout`).
fn lock_timed_out(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == "55P03")
}

/// The steps of a purge, under the table's purge lock: partitions ahead, old partitions
/// dropped, the rest deleted row by row.
async fn purge_locked(
    conn: &mut PoolConnection<Postgres>,
    store: &PostgresStore,
    p: &PartitionSql,
    age_us: i64,
    batch: i64,
) -> Result<u64, Error> {
    let config = store.config();
    let table = config.qualified_table();
    let err = |e| map_sqlx(e, "purge_published", table);
    let timeout = format!("SET LOCAL lock_timeout = '{PARTITION_LOCK_TIMEOUT}'");

    // (a) Partitions ahead, so that writes keep landing in droppable partitions.
    {
        let mut tx = conn.begin().await.map_err(err)?;
        sqlx::query(&timeout).execute(&mut *tx).await.map_err(err)?;
        let made = sqlx::query(&format!("SELECT {}($1)", p.premake_function))
            .bind(PARTITIONS_AHEAD)
            .execute(&mut *tx)
            .await;
        match made {
            Ok(_) => tx.commit().await.map_err(err)?,
            Err(e) if lock_timed_out(&e) => tx.rollback().await.map_err(err)?,
            Err(e) => return Err(err(e)),
        }
    }

    // (b) Whole partitions whose range ended before the cut-off and that hold only rows
    // published before it: detached and dropped, each in a short transaction of its own.
    let mut removed: u64 = 0;
    let old = sqlx::query(&p.list_old)
        .bind(age_us)
        .fetch_all(&mut **conn)
        .await
        .map_err(err)?;
    // A partition is kept while it holds a row that is not yet purgeable: unfinished (pending,
    // dead), or published within `older_than` (a message created long ago, published late).
    let unfinished = |part: &str| {
        format!(
            "SELECT EXISTS (SELECT 1 FROM {part} WHERE state = 'pending') \
                 OR EXISTS (SELECT 1 FROM {part} WHERE state = 'dead') \
                 OR EXISTS (SELECT 1 FROM {part} WHERE state = 'published' \
                            AND published_at >= now() - $1::bigint * interval '1 microsecond')"
        )
    };
    for row in old {
        let part: String = row.try_get("part").map_err(err)?;
        let lo: chrono::DateTime<chrono::Utc> = row.try_get("lo").map_err(err)?;
        let hi: chrono::DateTime<chrono::Utc> = row.try_get("hi").map_err(err)?;
        // Cheap through the partial claim and dead-letter indexes.
        let pinned: bool = sqlx::query_scalar(&unfinished(&part))
            .bind(age_us)
            .fetch_one(&mut **conn)
            .await
            .map_err(err)?;
        if pinned {
            continue;
        }
        // Counted before the lock (a full read of the partition, but no lock held).
        let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {part}"))
            .fetch_one(&mut **conn)
            .await
            .map_err(err)?;
        // Free the dedup keys of its rows first, outside the table lock: they are old
        // published rows that this purge removes either way (dropped now, or deleted below
        // if the partition turns out to be pinned).
        sqlx::query(&format!(
            "DELETE FROM {dedup} s
             WHERE s.created_at >= $1 AND s.created_at < $2
               AND EXISTS (SELECT 1 FROM {part} r
                           WHERE r.id = s.id AND r.state = 'published')",
            dedup = p.dedup_table
        ))
        .bind(lo)
        .bind(hi)
        .execute(&mut **conn)
        .await
        .map_err(err)?;
        let mut tx = conn.begin().await.map_err(err)?;
        sqlx::query(&timeout).execute(&mut *tx).await.map_err(err)?;
        let detached = sqlx::query(&format!("ALTER TABLE {table} DETACH PARTITION {part}"))
            .execute(&mut *tx)
            .await;
        match detached {
            Ok(_) => {}
            Err(e) if lock_timed_out(&e) => {
                // Writers or claims hold the table: try again at the next purge.
                tx.rollback().await.map_err(err)?;
                break;
            }
            Err(e) => return Err(err(e)),
        }
        // Under the lock, nothing can have been written into it since the check above,
        // unless it was before the lock: check again.
        let pinned: bool = sqlx::query_scalar(&unfinished(&part))
            .bind(age_us)
            .fetch_one(&mut *tx)
            .await
            .map_err(err)?;
        if pinned {
            tx.rollback().await.map_err(err)?;
            continue;
        }
        sqlx::query(&format!("DROP TABLE {part}"))
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        tx.commit().await.map_err(err)?;
        removed += u64::try_from(rows).unwrap_or(0);
    }

    // (c) Old published rows elsewhere (partitions kept for an unfinished row, the DEFAULT
    // partition): deleted in a batch, as on a plain table. Their dedup keys go with them (the
    // delete trigger).
    let deleted = sqlx::query(&p.purge_rows)
        .bind(age_us)
        .bind(batch)
        .execute(&mut **conn)
        .await
        .map_err(err)?;
    Ok(removed + deleted.rows_affected())
}

/// A partition interval from a URL parameter: a whole number followed by `m` (minutes), `h`
/// (hours) or `d` (days): `15m`, `1h`, `1d`.
///
/// # Errors
/// [`Error::InvalidInput`] naming the parameter and the accepted forms.
pub(crate) fn parse_interval(value: &str) -> Result<Duration, Error> {
    let bad = || {
        Error::invalid_input(format!(
            "partition_interval={value:?} is not a whole number of minutes, hours or days; \
             write e.g. 15m, 1h or 1d"
        ))
    };
    let (number, unit) = value.split_at(value.len().saturating_sub(1));
    let n: u64 = number.parse().map_err(|_| bad())?;
    let secs = match unit {
        "m" => n.checked_mul(60),
        "h" => n.checked_mul(3600),
        "d" => n.checked_mul(86_400),
        _ => None,
    }
    .ok_or_else(bad)?;
    Ok(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rewrite_matches_once_and_the_plain_table_keeps_its_statements() {
        // `rewrite` asserts (debug builds) that each rewrite matched exactly once.
        let plain = Sql::build("s", "t", true, false, false, None, false);
        let parted = Sql::build("s", "t", true, false, false, Some(3600), false);
        for (a, b) in [
            (&plain.claim_block, &parted.claim_block),
            (&plain.claim_skip, &parted.claim_skip),
            (&plain.claim_past_block, &parted.claim_past_block),
            (&plain.claim_past_skip, &parted.claim_past_skip),
        ] {
            assert!(a.contains("WHERE l.ctid = ANY(ARRAY(SELECT tid FROM cand))"));
            assert!(!b.contains("l.ctid = ANY"), "{b}");
            assert!(!b.contains("m.ctid = ANY"), "{b}");
            assert!(b.contains("m.tableoid = h.toid AND m.ctid = h.tid"), "{b}");
        }
        assert!(plain.partitioned.is_none());
        assert!(parted.migrate.contains("PARTITION BY RANGE (created_at)"));
        assert!(parted.migrate.contains("PRIMARY KEY (id, created_at)"));
        assert!(!parted.migrate.contains("-- Spare space on every page"));
        assert!(!plain.migrate.contains("PARTITION"));
        assert!(!parted.purge.contains("ctid"));
        if let Ok(path) = std::env::var("OUTBOX_DUMP_PARTITIONED_SQL") {
            let dump = format!("{}\n-- claim\n{}\n", parted.migrate, parted.claim_block);
            std::fs::write(path, dump).unwrap();
        }
    }

    /// On a partitioned table a `ctid` is unique only within its partition: the plain table's
    /// claim, which locks and updates rows by `ctid` alone, leases the rows of every partition
    /// that sit at a candidate's address (the control below). The partitioned statements lease
    /// exactly the candidates.
    #[tokio::test]
    async fn claims_on_a_partitioned_table_lease_only_their_candidates(
    ) -> Result<(), Box<dyn std::error::Error>> {
        use crate::PostgresStore;
        use outbox_traits::{ClaimRequest, HeadPolicy, OutboxStore};
        use sqlx::Executor;
        let Some(url) = outbox_conformance_tests::env::service_url("OUTBOX_TEST_POSTGRES_URL")
        else {
            return Ok(());
        };
        let schema = format!("outbox_test_{:016x}", rand::random::<u64>());
        let config = PostgresConfig::builder()
            .schema(&schema)
            .partition_interval(Some(Duration::from_secs(3600)))
            .build()?;
        let store = PostgresStore::connect(&url, config.clone()).await?;
        store.migrate().await?;
        let table = config.qualified_table();
        let premake = config.premake_function().ok_or("no premake function")?;
        // Two rows, different keys, each the first of its partition: the same ctid, (0,1).
        let setup = format!(
            "SELECT {premake}(0, now() - interval '5 hours');
             INSERT INTO {table} (aggregatetype, aggregateid, type, payload, created_at)
             VALUES ('o', 'a', 't', '{{}}', now() - interval '5 hours');
             INSERT INTO {table} (aggregatetype, aggregateid, type, payload)
             VALUES ('o', 'b', 't', '{{}}');"
        );
        store.pool().execute(setup.as_str()).await?;
        let ctids: Vec<String> =
            sqlx::query_scalar(&format!("SELECT ctid::text FROM {table} ORDER BY seq"))
                .fetch_all(store.pool())
                .await?;
        assert_eq!(ctids, ["(0,1)", "(0,1)"]);
        let leased = format!("SELECT count(*) FROM {table} WHERE lease_token IS NOT NULL");

        // Control: the plain table's claim statement leases both rows for a limit of one.
        let plain = Sql::build(&schema, "outbox", true, false, false, None, false);
        let mut tx = store.pool().begin().await?;
        sqlx::query(&plain.claim_skip)
            .bind(1_i64)
            .bind(uuid::Uuid::new_v4())
            .bind(30_000_000_i64)
            .bind(2_i64)
            .bind(1_i32)
            .bind(0_i32)
            .fetch_all(&mut *tx)
            .await?;
        let n: i64 = sqlx::query_scalar(&leased).fetch_one(&mut *tx).await?;
        tx.rollback().await?;
        assert_eq!(
            n, 2,
            "control: the ctid-only claim was expected to lease both rows"
        );

        for policy in [HeadPolicy::Skip, HeadPolicy::Block] {
            let claim = store
                .claim(&ClaimRequest {
                    limit: 1,
                    lease: Duration::from_secs(30),
                    head_policy: policy,
                    shard: None,
                })
                .await?;
            assert_eq!(claim.messages.len(), 1);
            assert_eq!(
                claim.messages[0].aggregate_id,
                if policy == HeadPolicy::Skip { "a" } else { "b" }
            );
            let n: i64 = sqlx::query_scalar(&leased).fetch_one(store.pool()).await?;
            assert_eq!(n, if policy == HeadPolicy::Skip { 1 } else { 2 });
        }
        sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(store.pool())
            .await?;
        Ok(())
    }

    #[test]
    fn partition_names_fit_the_identifier_limit() {
        let long = "t".repeat(63);
        let name = derived_name(&long, START_EXAMPLE);
        assert!(name.len() <= 63 && name.ends_with(START_EXAMPLE), "{name}");
        let sql = Sql::build("s", &long, true, false, false, Some(60), false);
        let prefix = &name[..name.len() - (START_EXAMPLE.len() - 1)];
        assert!(sql.migrate.contains(&format!("part := '{prefix}' ||")));
    }

    #[test]
    fn intervals_from_url_parameters() {
        assert_eq!(parse_interval("15m").ok(), Some(Duration::from_secs(900)));
        assert_eq!(parse_interval("1h").ok(), Some(Duration::from_secs(3600)));
        assert_eq!(
            parse_interval("2d").ok(),
            Some(Duration::from_secs(172_800))
        );
        for bad in ["", "d", "1", "1s", "-1d", "1.5h", "99999999999999999999d"] {
            let e = parse_interval(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidInput(_)), "{bad}");
            assert!(e.to_string().contains("partition_interval"), "{e}");
        }
    }
}
