//! Every statement the store runs, and the table's DDL, built once per table name.

/// "Now" in integer milliseconds since the Unix epoch, from SQLite's own clock.
///
/// SQLite keeps its time as integer milliseconds internally, so rounding the `subsec` value
/// gives the exact millisecond. Every lease end, retry time and creation time is computed from
/// this expression (read once per transaction), never from the relay's `SystemTime`.
pub(crate) const NOW_MS: &str = "CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)";

/// The DDL that [`crate::migrate`] runs for `table`, as one SQL script (what
/// [`SqliteConfig::migration_sql`](crate::SqliteConfig::migration_sql) returns).
///
/// Every statement is `IF NOT EXISTS`, so running it again changes nothing. `table` must
/// already be validated (a built [`SqliteConfig`](crate::SqliteConfig) is).
///
/// Times are integer milliseconds since the Unix epoch, taken from SQLite's clock.
/// `seq` is `AUTOINCREMENT` so that a value is never handed out twice, even after the newest
/// rows are purged and the database is reopened (plain `INTEGER PRIMARY KEY` reuses the largest
/// deleted value).
pub(crate) fn schema_sql(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {t} (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    -- Ids, payloads and headers are checked so that a row written by plain SQL cannot hold
    -- what the relay cannot read (tables made before these checks keep their rows; the relay
    -- dead-letters a bad one, see the README).
    id            TEXT    NOT NULL UNIQUE CHECK (typeof(id) = 'text' AND length(id) = 36),
    aggregatetype TEXT    NOT NULL,
    aggregateid   TEXT    NOT NULL,
    type          TEXT    NOT NULL,
    payload       TEXT    NOT NULL CHECK (typeof(payload) = 'text'),
    headers       TEXT    NOT NULL DEFAULT '{{}}'
                  CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    partition_key TEXT,
    dedup_key     TEXT    UNIQUE,
    state         TEXT    NOT NULL DEFAULT 'pending'
                  CHECK (state IN ('pending', 'leased', 'published', 'dead')),
    attempts      INTEGER NOT NULL DEFAULT 0,
    available_at  INTEGER NOT NULL DEFAULT ({now}),
    lease_token   TEXT,
    lease_until   INTEGER,
    last_error    TEXT,
    created_at    INTEGER NOT NULL DEFAULT ({now}),
    published_at  INTEGER
);
-- The claim walks the unpublished, undead rows in seq order; covering, so it never reads the
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
",
        t = table,
        now = NOW_MS
    )
}

/// The columns of a [`outbox_traits::Message`], in the order [`crate::row::decode`] reads them.
pub(crate) const MESSAGE_COLUMNS: &str = "id, seq, aggregatetype, aggregateid, type, payload, \
     headers, partition_key, dedup_key, attempts, created_at";

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

/// `?1` id, `?2` aggregatetype, `?3` aggregateid, `?4` type, `?5` payload, `?6` headers,
/// `?7` partition_key, `?8` dedup_key, `?9` not-before in ms (NULL = now).
pub(crate) fn insert_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload, headers, \
         partition_key, dedup_key, available_at, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, COALESCE(?9, {NOW_MS}), {NOW_MS})"
    )
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::migrate::migrate;
    use crate::SqliteConfig;

    fn migrated() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        migrate(&conn, &SqliteConfig::default()).unwrap();
        conn
    }

    #[test]
    fn every_statement_prepares_and_migrate_is_idempotent() {
        let conn = migrated();
        migrate(&conn, &SqliteConfig::default()).unwrap();
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
            &sql.purge,
            &sql.counts,
            &insert_sql("outbox"),
        ] {
            conn.prepare(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }

    #[test]
    fn now_is_sqlite_clock_in_milliseconds() {
        let conn = migrated();
        let now: i64 = conn
            .query_row(&format!("SELECT {NOW_MS}"), [], |r| r.get(0))
            .unwrap();
        let host = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        assert!((now - host).abs() < 60_000, "sqlite {now} vs host {host}");
    }
}
