//! Binary payloads in the SQLite store: a table made before them is upgraded in place, and
//! rows written by plain SQL (as a program in another language writes them) are claimed with
//! their bytes, or dead-lettered when their content type is not one.

use std::time::Duration;

use outbox_backend_sqlite::{migrate, open_connection, SqliteConfig, SqliteStore};
use outbox_traits::uuid::Uuid;
use outbox_traits::{
    Binary, Claim, ClaimRequest, Error, HeadPolicy, NewMessage, OutboxAdmin, OutboxStore,
};
use rusqlite::{Connection, TransactionBehavior};
use tempfile::TempDir;

struct Db {
    _dir: TempDir,
    path: std::path::PathBuf,
    config: SqliteConfig,
}

impl Db {
    fn new(config: SqliteConfig) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("outbox.db");
        Db {
            _dir: dir,
            path,
            config,
        }
    }

    fn conn(&self) -> Connection {
        open_connection(&self.path, &self.config).expect("open connection")
    }

    async fn store(&self) -> SqliteStore {
        let store = SqliteStore::open(&self.path, self.config.clone())
            .await
            .expect("open store");
        store.migrate().await.expect("migrate");
        store
    }

    /// Insert one row as a SQL writer does, with `bytes` and `content_type` as SQL
    /// expressions.
    fn insert(&self, key: &str, bytes: &str, content_type: &str) -> rusqlite::Result<Uuid> {
        let id = Uuid::now_v7();
        self.conn().execute(
            &format!(
                "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, payload_bytes,
                                     content_type)
                 VALUES (?1, 'order', ?2, 'order.placed', 'null', {bytes}, {content_type})"
            ),
            (id.to_string(), key),
        )?;
        Ok(id)
    }

    fn columns(&self) -> Vec<String> {
        self.conn()
            .prepare(
                "SELECT name FROM pragma_table_info('outbox')
                 WHERE name IN ('payload_bytes', 'content_type') ORDER BY name",
            )
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }
}

async fn claim(store: &SqliteStore) -> Claim {
    store
        .claim(&ClaimRequest {
            limit: 10,
            lease: Duration::from_secs(60),
            head_policy: HeadPolicy::Block,
            shard: None,
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn migrate_adds_the_binary_columns_to_an_older_table_in_place_keeping_its_rows() {
    let db = Db::new(SqliteConfig::default());
    let conn = db.conn();
    migrate(&conn, &db.config).unwrap();
    // A table made by the previous release: no binary columns, and a row written then.
    conn.execute_batch(
        "ALTER TABLE outbox DROP COLUMN payload_bytes;
         ALTER TABLE outbox DROP COLUMN content_type;",
    )
    .unwrap();
    assert!(db.columns().is_empty());
    let old = Uuid::now_v7();
    conn.execute(
        "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
         VALUES (?1, 'test', 'old', 'test.event', '{\"name\": \"old\"}')",
        [old.to_string()],
    )
    .unwrap();

    // In place: the table keeps its DDL (no rebuild), with the two columns added.
    let ddl = |conn: &Connection| -> String {
        conn.query_row(
            "SELECT sql FROM sqlite_master WHERE name = 'outbox'",
            [],
            |r| r.get(0),
        )
        .unwrap()
    };
    let before = ddl(&conn);
    migrate(&conn, &db.config).unwrap();
    assert_eq!(db.columns(), ["content_type", "payload_bytes"]);
    let after = ddl(&conn);
    assert!(after.starts_with(before.trim_end_matches(')')), "{after}");
    // Idempotent.
    migrate(&conn, &db.config).unwrap();
    assert_eq!(ddl(&conn), after);
    // The added column keeps the checks of a new table's.
    assert!(db.insert("x", "'text, not a blob'", "NULL").is_err());

    let binary = NewMessage::binary(
        "test",
        "new",
        "test.event",
        Binary::new("application/x-protobuf", vec![0x08, 0x01, 0x00, 0xff]),
    );
    let mut conn = conn;
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    outbox_backend_sqlite::enqueue(&tx, &db.config, &binary).unwrap();
    tx.commit().unwrap();
    let store = db.store().await;
    let claim = claim(&store).await;
    let got: Vec<_> = claim
        .messages
        .iter()
        .map(|m| (m.id, m.payload.as_str(), m.binary.clone()))
        .collect();
    assert_eq!(got.len(), 2, "{got:?}");
    // The old row is the JSON message it was.
    assert_eq!(got[0].0, old);
    assert_eq!(got[0].2, None);
    assert!(got[0].1.contains("old"), "{}", got[0].1);
    assert_eq!(
        (got[1].0, got[1].1, got[1].2.clone()),
        (binary.id, "null", binary.binary.clone())
    );
}

#[tokio::test]
async fn binary_rows_written_by_plain_sql_are_claimed_and_a_bad_content_type_is_dead_lettered() {
    let db = Db::new(SqliteConfig::default());
    let store = db.store().await;
    // A literal, as the README shows; no content type means application/octet-stream.
    let protobuf = db
        .insert("a", "X'0801'", "'application/x-protobuf'")
        .unwrap();
    let octets = db.insert("b", "X'00ff'", "NULL").unwrap();
    // A bound parameter, as a driver sends it.
    let bound = Uuid::now_v7();
    db.conn()
        .execute(
            "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, payload_bytes,
                                 content_type)
             VALUES (?1, 'order', 'c', 'order.placed', 'null', ?2, ?3)",
            (bound.to_string(), vec![0xc3_u8, 0x28], "application/avro"),
        )
        .unwrap();
    // A content type with a line break (a header injection if it were sent), and a good row of
    // another key next to it.
    let bad = db
        .insert("d", "X'01'", "'text/plain' || char(10) || 'X-Injected: 1'")
        .unwrap();
    let good = db.insert("e", "X'02'", "'text/plain'").unwrap();

    let claimed = claim(&store).await;
    let got: Vec<(Uuid, Option<Binary>)> = claimed
        .messages
        .iter()
        .map(|m| (m.id, m.binary.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (
                protobuf,
                Some(Binary::new("application/x-protobuf", [0x08, 0x01]))
            ),
            (
                octets,
                Some(Binary::new("application/octet-stream", [0x00, 0xff]))
            ),
            (bound, Some(Binary::new("application/avro", [0xc3, 0x28]))),
            (good, Some(Binary::new("text/plain", [0x02]))),
        ]
    );
    assert!(claimed.messages.iter().all(|m| m.payload == "null"));

    // The bad row is dead, its reason naming the column; the listing shows its bytes.
    let dead = store.list_dead(None, 10).await.unwrap();
    let [shown] = dead.as_slice() else {
        panic!("{dead:?}")
    };
    assert_eq!(shown.message.id, bad);
    assert!(
        shown.last_error.contains("column content_type"),
        "{}",
        shown.last_error
    );
    assert_eq!(
        shown.message.binary.as_ref().map(|b| b.data.as_slice()),
        Some(&[0x01][..])
    );
    // A requeue is refused until the row is fixed, then the row is claimed with its bytes.
    let refused = store.requeue(&[bad]).await.unwrap_err();
    assert!(
        matches!(&refused, Error::InvalidInput(text) if text.contains("SET content_type")),
        "{refused}"
    );
    db.conn()
        .execute(
            "UPDATE outbox SET content_type = 'text/plain' WHERE id = ?1",
            [bad.to_string()],
        )
        .unwrap();
    assert_eq!(store.requeue(&[bad]).await.unwrap(), 1);
    let again = claim(&store).await;
    assert_eq!(again.messages.len(), 1);
    assert_eq!(
        again.messages[0].binary,
        Some(Binary::new("text/plain", [0x01]))
    );
}

#[tokio::test]
async fn the_table_refuses_sql_written_bytes_that_are_text_or_over_the_payload_limit() {
    let config = SqliteConfig::builder()
        .max_payload_bytes(16)
        .build()
        .unwrap();
    let db = Db::new(config);
    let _store = db.store().await;
    db.insert("a", "zeroblob(16)", "NULL").unwrap();
    let err = db.insert("b", "zeroblob(17)", "NULL").unwrap_err();
    assert!(err.to_string().contains("payload_bytes_blob"), "{err}");
    let err = db.insert("c", "'text'", "NULL").unwrap_err();
    assert!(err.to_string().contains("payload_bytes_blob"), "{err}");
}
