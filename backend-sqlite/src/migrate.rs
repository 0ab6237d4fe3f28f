//! Creating the outbox table: idempotent DDL in one `BEGIN IMMEDIATE` transaction (or a
//! savepoint inside the caller's), and a check that an existing table is one this crate made.

use rusqlite::{Connection, OptionalExtension};

use outbox_traits::Error;

use crate::config::SqliteConfig;
use crate::error::{map_err, Ctx};
use crate::sql::{
    added_columns, lower_ids_sql, schema_sql, upgrade_sql, COLUMNS, CONTRACT_MARK,
    ID_TRIGGER_SUFFIX,
};

/// Create the outbox table and its indexes if they do not exist, then check the table
/// ([`SqliteStore::migrate`](crate::SqliteStore::migrate) runs this on the store's connection).
///
/// Idempotent: safe to run at every start, from several processes at once. The DDL is
/// [`SqliteConfig::migration_sql`]. Runs in its own `BEGIN IMMEDIATE` transaction, or in a savepoint when `conn`
/// is already inside a transaction (so it can be part of your own migration).
///
/// The check refuses an existing table that lacks a column the store uses, or whose `seq` is not
/// `AUTOINCREMENT` (a migration tool that rebuilt the table may have dropped it; without it,
/// purged `seq` values are handed out again).
///
/// A table made by a version before the SQL enqueue contract (no `id` default) is rebuilt with
/// the contract's defaults, checks and triggers, since SQLite cannot add them to a table: its
/// rows are copied as they are (checks not applied to them) and its `seq` counter kept. That
/// copy holds the write lock for as long as it takes (about a second per few hundred thousand
/// rows), once.
///
/// A table made before binary payloads gets their two nullable columns (`payload_bytes`,
/// `content_type`) with `ALTER TABLE ... ADD COLUMN`, in place: no rebuild, and its rows read
/// as the JSON messages they are.
pub fn migrate(conn: &Connection, config: &SqliteConfig) -> Result<(), Error> {
    let table = config.table();
    // The checks of the existing table run inside the transaction (or savepoint), after the
    // write lock is taken: two processes migrating together then see the table as it is when
    // each runs its DDL, and the second adds no column the first just added.
    let outer = conn.is_autocommit();
    let (begin, end, undo) = if outer {
        ("BEGIN IMMEDIATE", "COMMIT", "ROLLBACK")
    } else {
        (
            "SAVEPOINT outbox_migrate",
            "RELEASE outbox_migrate",
            "ROLLBACK TO outbox_migrate; RELEASE outbox_migrate",
        )
    };
    conn.execute_batch(begin)
        .map_err(|e| map_err(e, Ctx::Migrate, table))?;
    let migrated = ddl(conn, config).and_then(|ddl| {
        conn.execute_batch(&format!("{ddl}{end};"))
            .map_err(|e| map_err(e, Ctx::Migrate, table))
    });
    if migrated.is_err() && !conn.is_autocommit() {
        // Undo a half-run script so the connection is usable; the original error matters more.
        let _ = conn.execute_batch(undo);
    }
    migrated
}

/// The DDL [`migrate`] runs on the table as it is now: [`schema_sql`], after the rebuild of a
/// table made before the SQL enqueue contract or the columns a table made before them lacks.
fn ddl(conn: &Connection, config: &SqliteConfig) -> Result<String, Error> {
    let table = config.table();
    // Check a table that already exists before the DDL touches it, so an incompatible table
    // gets an error that says what is wrong rather than a failed CREATE INDEX.
    let existing = check_table(conn, table)?;
    let max_payload_bytes = config.limits().max_payload_bytes;
    let mut ddl = schema_sql(table, max_payload_bytes);
    if let Some((sql, present)) = &existing {
        if !sql.contains(CONTRACT_MARK) {
            // A table made before the SQL enqueue contract has no id default and lacks its
            // checks: rebuilt in place, rows and seq counter kept, in the same transaction
            // (with the columns added since).
            ddl = format!("{}{ddl}", upgrade_sql(table, max_payload_bytes));
        } else {
            // Columns added since the table was made: added in place.
            let added: String = added_columns(table, max_payload_bytes)
                .into_iter()
                .filter(|(column, _)| !present.iter().any(|p| p.eq_ignore_ascii_case(column)))
                .map(|(_, statement)| statement)
                .collect();
            ddl = format!("{added}{ddl}");
        }
    }
    // A table made before the id trigger may hold ids in upper or mixed case, which the relay
    // could never complete: lowered once, after the DDL has made the trigger (same
    // transaction, so no row slips in between). Later migrations skip the table scan.
    if existing.is_some() && !has_id_trigger(conn, table)? {
        ddl.push_str(&lower_ids_sql(table));
    }
    Ok(ddl)
}

/// Whether `table` has the trigger that lowers ids ([`ID_TRIGGER_SUFFIX`]).
fn has_id_trigger(conn: &Connection, table: &str) -> Result<bool, Error> {
    conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'trigger' AND name = ?1)",
        [format!("{table}_{ID_TRIGGER_SUFFIX}")],
        |row| row.get(0),
    )
    .map_err(|e| map_err(e, Ctx::Migrate, table))
}

/// The DDL of the existing table `table` and its columns, after checking that the store can
/// use it; `None` when there is no such table yet.
fn check_table(conn: &Connection, table: &str) -> Result<Option<(String, Vec<String>)>, Error> {
    let sql: Option<String> = conn
        .query_row(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [table],
            |row| row.get(0),
        )
        .optional()
        .map_err(|e| map_err(e, Ctx::Migrate, table))?;
    let Some(sql) = sql else {
        return Ok(None); // not created yet
    };
    if !sql.to_ascii_uppercase().contains("AUTOINCREMENT") {
        return Err(Error::permanent(
            format!(
                "table {table:?} exists but its seq column is not AUTOINCREMENT, so purged seq \
                 values could be reused; rebuild it with the DDL from SqliteConfig::migration_sql() and copy the rows"
            ),
            None,
        ));
    }
    let mut stmt = conn
        .prepare("SELECT name FROM pragma_table_info(?1)")
        .map_err(|e| map_err(e, Ctx::Migrate, table))?;
    let present: Vec<String> = stmt
        .query_map([table], |row| row.get(0))
        .and_then(|rows| rows.collect())
        .map_err(|e| map_err(e, Ctx::Migrate, table))?;
    let missing: Vec<&str> = COLUMNS
        .iter()
        .copied()
        .filter(|c| !present.iter().any(|p| p.eq_ignore_ascii_case(c)))
        .collect();
    if !missing.is_empty() {
        return Err(Error::permanent(
            format!(
                "table {table:?} exists but lacks column(s) {}; it was not created by this crate's \
                 migrate(); use another table name or rebuild it with SqliteConfig::migration_sql()",
                missing.join(", ")
            ),
            None,
        ));
    }
    Ok(Some((sql, present)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_table_without_autoincrement() -> Result<(), Box<dyn std::error::Error>> {
        let conn = Connection::open_in_memory()?;
        let ddl = schema_sql("outbox", 1024).replace(" AUTOINCREMENT", "");
        conn.execute_batch(&ddl)?;
        let err = migrate(&conn, &SqliteConfig::default()).unwrap_err();
        assert!(err.to_string().contains("AUTOINCREMENT"), "{err}");
        Ok(())
    }

    #[test]
    fn refuses_a_foreign_table_with_the_same_name() -> Result<(), Box<dyn std::error::Error>> {
        let conn = Connection::open_in_memory()?;
        conn.execute_batch("CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, x TEXT)")?;
        let err = migrate(&conn, &SqliteConfig::default()).unwrap_err();
        assert!(err.to_string().contains("lacks column"), "{err}");
        Ok(())
    }

    #[test]
    fn a_table_made_before_the_sql_contract_is_rebuilt_once_keeping_rows_and_seq(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let mut conn = Connection::open_in_memory()?;
        // The shape of the previous release's table: no id default, no payload or header
        // checks beyond the types (the exact DDL is in cli/tests/fixtures).
        conn.execute_batch(
            "CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
                aggregatetype TEXT NOT NULL, aggregateid TEXT NOT NULL, type TEXT NOT NULL,
                payload TEXT NOT NULL, headers TEXT NOT NULL DEFAULT '{}', partition_key TEXT,
                dedup_key TEXT UNIQUE, state TEXT NOT NULL DEFAULT 'pending',
                attempts INTEGER NOT NULL DEFAULT 0, available_at INTEGER NOT NULL DEFAULT 0,
                lease_token TEXT, lease_until INTEGER, last_error TEXT,
                created_at INTEGER NOT NULL DEFAULT 0, published_at INTEGER);
             INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers,
                                 partition_key)
             VALUES ('a', 'o', 'o-1', 't', '{}', '{\"n\": 1}', NULL),
                    ('b', 'o', 'o-2', 't', 'not json', '{}', 'k'),
                    ('c', 'o', 'o-3', 't', '{}', '{}', 'k');
             DELETE FROM outbox WHERE id = 'c';",
        )?;
        let tx = conn.transaction()?;
        migrate(&tx, &SqliteConfig::default())?;
        tx.commit()?;
        let ddl = |conn: &Connection| -> rusqlite::Result<String> {
            conn.query_row(
                "SELECT group_concat(sql, ';') FROM sqlite_master WHERE tbl_name = 'outbox'",
                [],
                |r| r.get(0),
            )
        };
        let upgraded = ddl(&conn)?;
        assert!(upgraded.contains(CONTRACT_MARK) && upgraded.contains("outbox_partition_key"));
        // Rows are kept as they were, even those the new checks refuse; NULL stays unordered.
        let rows: Vec<(i64, String, Option<String>)> = conn
            .prepare("SELECT seq, id, partition_key FROM outbox ORDER BY seq")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<Result<_, _>>()?;
        assert_eq!(
            rows,
            [(1, "a".into(), None), (2, "b".into(), Some("k".into()))]
        );
        // The seq counter survives (3 was used, then deleted), and the defaults work.
        conn.execute(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload) \
             VALUES ('o', 'o-4', 't', '{}')",
            [],
        )?;
        let (seq, key): (i64, String) = conn.query_row(
            "SELECT seq, partition_key FROM outbox WHERE aggregateid = 'o-4'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        assert_eq!((seq, key.as_str()), (4, "o-4"));
        // Once is enough: a second migration changes nothing.
        migrate(&conn, &SqliteConfig::default())?;
        assert_eq!(ddl(&conn)?, upgraded);
        Ok(())
    }

    #[test]
    fn ids_are_stored_in_lower_case_and_migrate_lowers_old_ones_once(
    ) -> Result<(), Box<dyn std::error::Error>> {
        const UPPER: &str = "BF3D6C4D-09A7-46F2-9F2F-5F7372B91D29";
        const MIXED: &str = "bf3d6c4d-09A7-46f2-9F2F-5f7372b91d2a";
        const TAKEN: &str = "BF3D6C4D-09A7-46F2-9F2F-5F7372B91D2B";
        let conn = Connection::open_in_memory()?;
        migrate(&conn, &SqliteConfig::default())?;
        let insert = |id: &str| {
            conn.execute(
                "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload) \
                 VALUES (?1, 'o', 'o-1', 't', '{}')",
                [id],
            )
        };
        let ids = |conn: &Connection| -> rusqlite::Result<Vec<(String, String)>> {
            conn.prepare("SELECT id, state FROM outbox ORDER BY seq")?
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect()
        };
        // A table made before the trigger: rows keep the case they were written in.
        conn.execute_batch("DROP TRIGGER outbox_id_case")?;
        insert(UPPER)?;
        insert(MIXED)?;
        insert(TAKEN)?;
        insert(&TAKEN.to_lowercase())?;
        migrate(&conn, &SqliteConfig::default())?;
        let rows = ids(&conn)?;
        assert_eq!(rows[0], (UPPER.to_lowercase(), "pending".into()));
        assert_eq!(rows[1], (MIXED.to_lowercase(), "pending".into()));
        // Two rows whose ids differ only in case: the one that cannot be lowered is
        // dead-lettered with a reason, not republished forever.
        assert_eq!(rows[2], (TAKEN.into(), "dead".into()));
        assert_eq!(rows[3], (TAKEN.to_lowercase(), "pending".into()));
        let reason: String =
            conn.query_row("SELECT last_error FROM outbox WHERE seq = 3", [], |r| {
                r.get(0)
            })?;
        assert!(reason.contains("differs only in case"), "{reason}");
        // The trigger is back: a new row is lowered on insert, and the same id in another
        // case is the same id.
        let new = "0B1E5A52-6C0E-4B8E-9D7E-6D1C2A0000FF";
        insert(new)?;
        assert_eq!(ids(&conn)?[4].0, new.to_lowercase());
        assert!(insert(&new.to_lowercase()).is_err());
        Ok(())
    }

    #[test]
    fn migrate_inside_a_transaction_uses_a_savepoint() -> Result<(), Box<dyn std::error::Error>> {
        let mut conn = Connection::open_in_memory()?;
        let tx = conn.transaction()?;
        migrate(&tx, &SqliteConfig::default())?;
        tx.rollback()?;
        let exists: bool = conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE name = 'outbox')",
            [],
            |r| r.get(0),
        )?;
        assert!(!exists, "the caller's rollback must undo the migration");
        Ok(())
    }
}
