//! Every statement the store runs, and the table's DDL, built once per table name.

use outbox_sql_support::quarantine::REASON_PREFIX;

/// "Now" in integer milliseconds since the Unix epoch, from SQLite's own clock.
///
/// SQLite keeps its time as integer milliseconds internally; `julianday('now')` carries them
/// with about 40 µs of rounding error, so rounding gives the exact millisecond, the same value
/// as `unixepoch('now', 'subsec') * 1000` but on SQLite 3.35 and later (`subsec` needs 3.42,
/// and the table's defaults run in whatever SQLite a SQL writer uses). Every lease end, retry
/// time and creation time is computed from this expression (read once per transaction), never
/// from the relay's `SystemTime`.
pub(crate) const NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";

/// A time-ordered (version 7) UUID in its hyphenated lower-case text form: 48 bits of
/// milliseconds since the epoch from [`NOW_MS`], then random bits from `randomblob`; the default of
/// `id`, for SQL writers that leave it out. Time-ordered like the Rust enqueue's ids, so the relay's
/// completions and deletes, which find each row through the unique index on `id`, touch that index
/// in order instead of one random page per message: on rows written by plain SQL with a random
/// (v4) default, a drain that deleted published rows spent 27 µs of CPU per message against 16 on
/// the library's v7 ids (BENCHMARKS.md, "The program against the library"). `'now'` is the same
/// for every call within one statement, so the two halves of the time agree.
const UUID_V7: &str = "substr(printf('%012x', CAST(ROUND((julianday('now') - 2440587.5) * \
     86400000) AS INTEGER)), 1, 8) || '-' || substr(printf('%012x', \
     CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)), 9, 4) || '-7' || \
     substr(lower(hex(randomblob(2))), 2) || '-' || substr('89ab', 1 + (random() & 3), 1) || \
     substr(lower(hex(randomblob(2))), 2) || '-' || lower(hex(randomblob(6)))";

/// Marks a table made with the SQL enqueue contract: [`crate::migrate`] rebuilds a table whose
/// DDL lacks it ([`upgrade_sql`]).
pub(crate) const CONTRACT_MARK: &str = "randomblob";

/// `id GLOB` pattern of a hyphenated UUID.
fn uuid_glob() -> String {
    let hex = |n: usize| "[0-9a-fA-F]".repeat(n);
    format!("{}-{}-{}-{}-{}", hex(8), hex(4), hex(4), hex(4), hex(12))
}

/// `CREATE TABLE {name}` with every column default and check of the SQL enqueue contract
/// (README, "Writing from any language (SQL)"). `max_payload_bytes` is the config's limit.
fn create_table(name: &str, if_not_exists: bool, max_payload_bytes: usize) -> String {
    let if_not_exists = if if_not_exists { "IF NOT EXISTS " } else { "" };
    format!(
        "CREATE TABLE {if_not_exists}{name} (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    -- Ids, payloads and headers are checked so that a row written by plain SQL cannot hold
    -- what the relay cannot read. A SQL writer may leave id out: a time-ordered UUID (v7), as
    -- the Rust enqueue writes (tables made before this default keep their random v4 one).
    id            TEXT    NOT NULL UNIQUE DEFAULT ({UUID_V7})
                  CONSTRAINT id_uuid CHECK (typeof(id) = 'text' AND length(id) = 36
                                            AND id GLOB '{glob}'),
    aggregatetype TEXT    NOT NULL,
    aggregateid   TEXT    NOT NULL,
    type          TEXT    NOT NULL,
    payload       TEXT    NOT NULL
                  CONSTRAINT payload_json CHECK (typeof(payload) = 'text' AND json_valid(payload))
                  CONSTRAINT payload_size CHECK (length(CAST(payload AS BLOB)) <= {max_payload_bytes}),
    -- A binary payload (Protobuf, Avro, ...): its bytes, sent untouched, and their content
    -- type (NULL: application/octet-stream). NULL bytes: a JSON message, whose body is
    -- `payload`; a binary message's `payload` is JSON null.
    {binary_columns},
    headers       TEXT    NOT NULL DEFAULT '{{}}'
                  CONSTRAINT headers_object
                  CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    -- NULL: the aggregate id; '': unordered, stored as NULL (the partition key trigger).
    partition_key TEXT,
    dedup_key     TEXT    UNIQUE,
    state         TEXT    NOT NULL DEFAULT 'pending'
                  CHECK (state IN ('pending', 'leased', 'published', 'dead')),
    attempts      INTEGER NOT NULL DEFAULT 0,
    available_at  INTEGER NOT NULL DEFAULT ({NOW_MS}),
    lease_token   TEXT,
    lease_until   INTEGER,
    last_error    TEXT,
    created_at    INTEGER NOT NULL DEFAULT ({NOW_MS}),
    published_at  INTEGER
);
",
        glob = uuid_glob(),
        binary_columns = binary_columns(max_payload_bytes).join(",\n    "),
    )
}

/// The columns of a binary payload, as in `CREATE TABLE` and as [`add_binary_columns_sql`] adds
/// them to a table made before them: `payload_bytes` (a BLOB, at most `max_payload_bytes`)
/// and `content_type`.
fn binary_columns(max_payload_bytes: usize) -> [String; 2] {
    [
        format!(
            "payload_bytes BLOB\n                  CONSTRAINT payload_bytes_blob CHECK (payload_bytes IS NULL OR \
             (typeof(payload_bytes) = 'blob' AND length(payload_bytes) <= {max_payload_bytes}))"
        ),
        "content_type  TEXT".to_owned(),
    ]
}

/// Columns added after the first release, each with the statement that adds it to a table made
/// before it: nullable, so `ALTER TABLE ... ADD COLUMN` adds it in place (no rebuild; rows
/// already there read NULL). [`crate::migrate`] runs the statement of each missing one.
pub(crate) fn added_columns(table: &str, max_payload_bytes: usize) -> Vec<(&'static str, String)> {
    let [bytes, content_type] = binary_columns(max_payload_bytes);
    vec![
        (
            "payload_bytes",
            format!("ALTER TABLE {table} ADD COLUMN {bytes};\n"),
        ),
        (
            "content_type",
            format!("ALTER TABLE {table} ADD COLUMN {content_type};\n"),
        ),
    ]
}

/// The DDL that [`crate::migrate`] runs for `table`, as one SQL script (what
/// [`SqliteConfig::migration_sql`](crate::SqliteConfig::migration_sql) returns).
///
/// Every statement is `IF NOT EXISTS`, so running it again changes nothing. `table` must
/// already be validated (a built [`SqliteConfig`](crate::SqliteConfig) is). It runs on SQLite
/// 3.35 and later, and so do its defaults, checks and triggers when another program inserts.
///
/// Times are integer milliseconds since the Unix epoch, taken from SQLite's clock.
/// `seq` is `AUTOINCREMENT` so that a value is never handed out twice, even after the newest
/// rows are purged and the database is reopened (plain `INTEGER PRIMARY KEY` reuses the largest
/// deleted value).
pub(crate) fn schema_sql(table: &str, max_payload_bytes: usize) -> String {
    format!(
        "{create}{rest}",
        create = create_table(table, true, max_payload_bytes),
        rest = indexes_and_triggers(table)
    )
}

/// The indexes and the triggers of the SQL enqueue contract.
fn indexes_and_triggers(t: &str) -> String {
    format!(
        "-- The claim walks the unpublished, undead rows in seq order; covering, so it never reads the
-- table, and partial, so it stays as small as the backlog however long the history grows.
CREATE INDEX IF NOT EXISTS {t}_live
    ON {t} (seq, partition_key, state, available_at, lease_until)
    WHERE state IN ('pending', 'leased');
-- extend() finds a claim's messages by token.
CREATE INDEX IF NOT EXISTS {t}_lease ON {t} (lease_token) WHERE state = 'leased';
-- list_dead() pages dead messages in seq order.
CREATE INDEX IF NOT EXISTS {t}_dead ON {t} (seq) WHERE state = 'dead';
-- Per-key check under HeadPolicy::Block: the first dead message of a key.
CREATE INDEX IF NOT EXISTS {t}_dead_key ON {t} (partition_key, seq) WHERE state = 'dead';
-- purge_published() deletes the oldest published rows first.
CREATE INDEX IF NOT EXISTS {t}_published ON {t} (published_at) WHERE state = 'published';
-- SQL enqueue contract. Header values are strings (a CHECK cannot read json_each); runs only
-- for headers other than the empty object.
CREATE TRIGGER IF NOT EXISTS {t}_headers BEFORE INSERT ON {t}
    WHEN NEW.headers <> '{{}}' AND json_valid(NEW.headers) AND EXISTS (
        SELECT 1 FROM json_each(NEW.headers) WHERE type <> 'text')
BEGIN
    SELECT RAISE(ABORT, 'CHECK constraint failed: headers_strings (headers must be a JSON object of string values)');
END;
-- Ids are stored in lower case, the form the relay completes by: an id written in upper or
-- mixed case (the id check allows A-F) is lowered after the insert, so claims and completions
-- match it with a plain comparison on the unique index. Runs only for such ids.
CREATE TRIGGER IF NOT EXISTS {t}_{ID_TRIGGER_SUFFIX} AFTER INSERT ON {t}
    WHEN NEW.id <> lower(NEW.id)
BEGIN
    UPDATE {t} SET id = lower(NEW.id) WHERE seq = NEW.seq;
END;
-- partition_key defaults to the aggregate id; '' asks for an unordered message (stored as
-- NULL). A column default cannot read another column and a BEFORE trigger cannot change the
-- row, hence an update after the insert, only when the key was left out or ''.
CREATE TRIGGER IF NOT EXISTS {t}_partition_key AFTER INSERT ON {t}
    WHEN NEW.partition_key IS NULL OR NEW.partition_key = ''
BEGIN
    UPDATE {t} SET partition_key = CASE WHEN NEW.partition_key IS NULL THEN NEW.aggregateid END
    WHERE seq = NEW.seq;
END;
"
    )
}

/// Suffix of the trigger that lowers ids written in upper or mixed case: `{table}_id_case`.
pub(crate) const ID_TRIGGER_SUFFIX: &str = "id_case";

/// Lower the ids of rows written in upper or mixed case before `table` had its id trigger
/// ([`crate::migrate`] appends this once, when it creates the trigger on an existing table).
/// Only ids of the UUID form are lowered (others are dead-lettered by the claim, as they
/// are). A row whose lowered id another row already holds keeps its id and, if not yet
/// published, is dead-lettered with a reason: the relay could not complete it.
pub(crate) fn lower_ids_sql(table: &str) -> String {
    let t = table;
    format!(
        "UPDATE OR IGNORE {t} SET id = lower(id) WHERE id <> lower(id) AND id GLOB '{glob}';
UPDATE {t} SET state = 'dead', lease_token = NULL, lease_until = NULL,
    last_error = 'undecodable row: column id value \"' || id || '\": differs only in case from \
the id of another message, so the relay cannot complete it; dead-lettered without publishing'
WHERE id <> lower(id) AND id GLOB '{glob}' AND state IN ('pending', 'leased');
",
        glob = uuid_glob(),
    )
}

/// Rebuild `table`, made by a version before the SQL enqueue contract, with the contract's
/// defaults and checks (SQLite cannot add them to an existing table): copy its rows into a new
/// table, keep its `seq` counter, drop it and rename the copy. Rows already there are copied
/// without checking them (old rows the checks refuse are dead-lettered by the relay, as
/// before). [`schema_sql`] then recreates the indexes and triggers. Runs inside
/// [`crate::migrate`]'s transaction.
pub(crate) fn upgrade_sql(table: &str, max_payload_bytes: usize) -> String {
    let new = format!("{table}_contract_upgrade");
    let columns = COLUMNS.join(", ");
    format!(
        "DROP TABLE IF EXISTS {new};
{create}PRAGMA ignore_check_constraints = ON;
INSERT INTO {new} ({columns}) SELECT {columns} FROM {table} ORDER BY seq;
PRAGMA ignore_check_constraints = OFF;
-- The old counter is at least the largest seq copied (AUTOINCREMENT), and higher when the
-- newest rows were purged: keep it, so no seq is handed out twice.
DELETE FROM sqlite_sequence WHERE name = '{new}';
INSERT INTO sqlite_sequence (name, seq) SELECT '{new}', seq FROM sqlite_sequence WHERE name = '{table}';
DROP TABLE {table};
ALTER TABLE {new} RENAME TO {table};
",
        create = create_table(&new, false, max_payload_bytes),
    )
}
/// Columns the store needs; checked by [`crate::migrate`] on an existing table.
pub(crate) const COLUMNS: [&str; 17] = [
    "seq",
    "id",
    "aggregatetype",
    "aggregateid",
    "type",
    "payload",
    "headers",
    "partition_key",
    "dedup_key",
    "state",
    "attempts",
    "available_at",
    "lease_token",
    "lease_until",
    "last_error",
    "created_at",
    "published_at",
];

/// The columns of a [`outbox_traits::Message`], in the order [`crate::row::decode`] reads them.
pub(crate) const MESSAGE_COLUMNS: &str = "id, seq, aggregatetype, aggregateid, type, payload, \
     headers, partition_key, dedup_key, attempts, created_at, payload_bytes, content_type";

/// How many columns [`MESSAGE_COLUMNS`] lists: a statement's next column has this index.
pub(crate) const MESSAGE_COLUMN_COUNT: usize = 13;

/// The fence every lease transition checks: `?1` id, `?2` token, `?3` database now.
const FENCE: &str = "id = ?1 AND state = 'leased' AND lease_token = ?2 AND lease_until > ?3";

/// Every statement of the store, with the table name spliced in once.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) now: String,
    pub(crate) walk: String,
    pub(crate) any_dead: String,
    pub(crate) first_dead_of_key: String,
    pub(crate) lease: String,
    /// Dead-letter an undecodable row just leased by a claim: `?1` seq, `?2` reason.
    pub(crate) quarantine: String,
    /// Give back a row just leased by a claim that waits behind an undecodable one: `?1` seq.
    pub(crate) unlease: String,
    pub(crate) complete: String,
    pub(crate) fail_retry: String,
    pub(crate) fail_dead: String,
    pub(crate) release: String,
    pub(crate) extend: String,
    pub(crate) list_dead: String,
    pub(crate) requeue: String,
    pub(crate) discard: String,
    /// [`Sql::requeue`] by seq.
    pub(crate) requeue_seq: String,
    /// [`Sql::discard`] by seq.
    pub(crate) discard_seq: String,
    /// The dead row `?1` (an id) if it was dead-lettered because it did not decode
    /// (`last_error` is a quarantine reason), with the message columns: a requeue checks that
    /// it decodes now.
    pub(crate) requeue_check: String,
    /// [`Sql::requeue_check`] by seq.
    pub(crate) requeue_check_seq: String,
    pub(crate) purge: String,
    pub(crate) counts: String,
}

impl Sql {
    /// `table` must be validated.
    pub(crate) fn new(table: &str, delete_published: bool) -> Self {
        let t = table;
        Sql {
            now: format!("SELECT {NOW_MS}"),
            // The dueness test is done in SQL so the walk reads three narrow columns; a leased
            // row is due when its lease has ended.
            walk: format!(
                "SELECT seq, partition_key, \
                 CASE state WHEN 'pending' THEN available_at ELSE IFNULL(lease_until, 0) END <= ?1 \
                 FROM {t} INDEXED BY {t}_live WHERE state IN ('pending', 'leased') ORDER BY seq"
            ),
            any_dead: format!(
                "SELECT EXISTS (SELECT 1 FROM {t} INDEXED BY {t}_dead WHERE state = 'dead')"
            ),
            first_dead_of_key: format!(
                "SELECT MIN(seq) FROM {t} INDEXED BY {t}_dead_key \
                 WHERE state = 'dead' AND partition_key = ?1"
            ),
            lease: format!(
                "UPDATE {t} SET state = 'leased', lease_token = ?1, lease_until = ?2 \
                 WHERE seq = ?3 RETURNING {MESSAGE_COLUMNS}"
            ),
            quarantine: format!(
                "UPDATE {t} SET state = 'dead', last_error = ?2, lease_token = NULL, \
                 lease_until = NULL WHERE seq = ?1"
            ),
            unlease: format!(
                "UPDATE {t} SET state = 'pending', lease_token = NULL, lease_until = NULL \
                 WHERE seq = ?1"
            ),
            complete: if delete_published {
                format!("DELETE FROM {t} WHERE {FENCE}")
            } else {
                format!(
                    "UPDATE {t} SET state = 'published', published_at = ?3, lease_token = NULL, \
                     lease_until = NULL WHERE {FENCE}"
                )
            },
            fail_retry: format!(
                "UPDATE {t} SET state = 'pending', attempts = attempts + 1, last_error = ?4, \
                 available_at = ?5, lease_token = NULL, lease_until = NULL WHERE {FENCE}"
            ),
            fail_dead: format!(
                "UPDATE {t} SET state = 'dead', attempts = attempts + 1, last_error = ?4, \
                 lease_token = NULL, lease_until = NULL WHERE {FENCE}"
            ),
            release: format!(
                "UPDATE {t} SET state = 'pending', available_at = ?3, lease_token = NULL, \
                 lease_until = NULL WHERE {FENCE}"
            ),
            extend: format!(
                "UPDATE {t} SET lease_until = ?3 \
                 WHERE lease_token = ?1 AND state = 'leased' AND lease_until > ?2"
            ),
            list_dead: format!(
                "SELECT {MESSAGE_COLUMNS}, last_error FROM {t} INDEXED BY {t}_dead \
                 WHERE state = 'dead' AND seq > ?1 ORDER BY seq LIMIT ?2"
            ),
            requeue: format!(
                "UPDATE {t} SET state = 'pending', attempts = 0, available_at = ?2 \
                 WHERE id = ?1 AND state = 'dead'"
            ),
            discard: format!("DELETE FROM {t} WHERE id = ?1 AND state = 'dead'"),
            requeue_seq: format!(
                "UPDATE {t} SET state = 'pending', attempts = 0, available_at = ?2 \
                 WHERE seq = ?1 AND state = 'dead'"
            ),
            discard_seq: format!("DELETE FROM {t} WHERE seq = ?1 AND state = 'dead'"),
            requeue_check: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {t} \
                 WHERE id = ?1 AND state = 'dead' AND substr(last_error, 1, {n}) = '{prefix}'",
                n = REASON_PREFIX.len(),
                prefix = REASON_PREFIX,
            ),
            requeue_check_seq: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {t} \
                 WHERE seq = ?1 AND state = 'dead' AND substr(last_error, 1, {n}) = '{prefix}'",
                n = REASON_PREFIX.len(),
                prefix = REASON_PREFIX,
            ),
            purge: format!(
                "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} INDEXED BY {t}_published \
                 WHERE state = 'published' AND published_at < ?1 ORDER BY published_at LIMIT ?2)"
            ),
            // Each count reads only its partial index.
            counts: format!(
                "SELECT \
                 (SELECT COUNT(*) FROM {t} INDEXED BY {t}_live \
                    WHERE state IN ('pending', 'leased') AND state = 'pending'), \
                 (SELECT COUNT(*) FROM {t} INDEXED BY {t}_lease WHERE state = 'leased'), \
                 (SELECT COUNT(*) FROM {t} INDEXED BY {t}_published WHERE state = 'published'), \
                 (SELECT COUNT(*) FROM {t} INDEXED BY {t}_dead WHERE state = 'dead')"
            ),
        }
    }
}

/// An unordered message (`?7` NULL) is written as '', which the partition key trigger stores
/// as NULL: NULL itself means "the aggregate id", as for a SQL writer that leaves it out.
///
/// `?1` id, `?2` aggregatetype, `?3` aggregateid, `?4` type, `?5` payload, `?6` headers,
/// `?7` partition_key, `?8` dedup_key, `?9` not-before in ms (NULL = now), `?10` payload bytes
/// and `?11` content type (both NULL for a JSON message).
pub(crate) fn insert_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload, headers, \
         partition_key, dedup_key, available_at, created_at, payload_bytes, content_type) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, COALESCE(?7, ''), ?8, COALESCE(?9, {NOW_MS}), {NOW_MS}, \
         ?10, ?11)"
    )
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::migrate::migrate;
    use crate::SqliteConfig;

    fn migrated() -> Result<Connection, Box<dyn std::error::Error>> {
        let conn = Connection::open_in_memory()?;
        migrate(&conn, &SqliteConfig::default())?;
        Ok(conn)
    }

    #[test]
    fn every_statement_prepares_and_migrate_is_idempotent() -> Result<(), Box<dyn std::error::Error>>
    {
        let conn = migrated()?;
        migrate(&conn, &SqliteConfig::default())?;
        let sql = Sql::new("outbox", false);
        let deleting = Sql::new("outbox", true);
        for text in [
            &deleting.complete,
            &sql.now,
            &sql.walk,
            &sql.any_dead,
            &sql.first_dead_of_key,
            &sql.lease,
            &sql.complete,
            &sql.fail_retry,
            &sql.fail_dead,
            &sql.release,
            &sql.extend,
            &sql.list_dead,
            &sql.requeue,
            &sql.discard,
            &sql.requeue_check,
            &sql.requeue_check_seq,
            &sql.purge,
            &sql.counts,
            &insert_sql("outbox"),
        ] {
            conn.prepare(text).map_err(|e| format!("{text}: {e}"))?;
        }
        Ok(())
    }

    #[test]
    fn message_columns_are_counted() {
        assert_eq!(MESSAGE_COLUMNS.split(", ").count(), MESSAGE_COLUMN_COUNT);
    }

    #[test]
    fn now_is_unixepoch_subsec_in_milliseconds() -> Result<(), Box<dyn std::error::Error>> {
        let conn = Connection::open_in_memory()?;
        // 'now' is one instant within a statement.
        let (ours, subsec): (i64, i64) = conn.query_row(
            &format!("SELECT {NOW_MS}, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)"),
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        assert_eq!(ours, subsec);
        // The julianday round trip is exact to the millisecond, up to year 2100.
        let at = NOW_MS.replace("'now'", "?1 / 1000.0, 'unixepoch'");
        for ms in (0..2000_i64).chain([1_700_000_000_123, 1_795_630_962_698, 4_102_444_799_999]) {
            let got: i64 = conn.query_row(&format!("SELECT {at}"), [ms], |r| r.get(0))?;
            assert_eq!(got, ms);
        }
        Ok(())
    }

    #[test]
    fn now_is_sqlite_clock_in_milliseconds() -> Result<(), Box<dyn std::error::Error>> {
        let conn = migrated()?;
        let now: i64 = conn.query_row(&format!("SELECT {NOW_MS}"), [], |r| r.get(0))?;
        let host = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis() as i64;
        assert!((now - host).abs() < 60_000, "sqlite {now} vs host {host}");
        Ok(())
    }
}
