//! The SQLite inbox on a real database file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_conformance_tests::inbox::{InboxCapabilities, InboxHarness, InboxStore, InboxTx, Mark};
use outbox_inbox::{sqlite, Error, InboxConfig, Outcome, Receipt, Uuid};
use outbox_traits::async_trait;
use rusqlite::Connection;

use crate::harness_error;

/// Each case gets a database file of its own, with the inbox and an effects table.
pub struct SqliteInbox;

struct SqliteStore {
    _dir: tempfile::TempDir,
    path: PathBuf,
    config: InboxConfig,
}

struct SqliteTx {
    conn: Connection,
    config: InboxConfig,
}

fn open(path: &Path) -> Result<Connection, Error> {
    let conn = Connection::open(path).map_err(harness_error)?;
    conn.busy_timeout(Duration::from_secs(10))
        .map_err(harness_error)?;
    // No flush to disk at each commit: what is tested is visibility, not durability.
    conn.execute_batch("PRAGMA synchronous = OFF")
        .map_err(harness_error)?;
    Ok(conn)
}

#[async_trait]
impl InboxHarness for SqliteInbox {
    fn name(&self) -> String {
        "sqlite inbox (rusqlite)".into()
    }

    async fn fresh(&self) -> Result<Box<dyn InboxStore>, Error> {
        let dir = tempfile::tempdir().map_err(harness_error)?;
        let path = dir.path().join("consumer.db");
        let config = InboxConfig::default();
        let conn = open(&path)?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; \
             CREATE TABLE effects (consumer TEXT NOT NULL, message_id TEXT NOT NULL);",
        )
        .map_err(harness_error)?;
        sqlite::migrate(&conn, &config)?;
        Ok(Box::new(SqliteStore {
            _dir: dir,
            path,
            config,
        }))
    }
}

impl SqliteStore {
    fn read_pairs(&self, table: &str) -> Result<Vec<Mark>, Error> {
        let conn = open(&self.path)?;
        let mut stmt = conn
            .prepare(&format!("SELECT consumer, message_id FROM {table}"))
            .map_err(harness_error)?;
        let rows = stmt
            .query_map([], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
            })
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
            .map_err(harness_error)?;
        rows.into_iter()
            .map(|(consumer, id)| Ok((consumer, Uuid::parse_str(&id).map_err(harness_error)?)))
            .collect()
    }
}

#[async_trait]
impl InboxStore for SqliteStore {
    fn capabilities(&self) -> InboxCapabilities {
        // One writer: a second IMMEDIATE transaction waits at BEGIN, before it can record.
        InboxCapabilities::new().with_concurrent_transactions(false)
    }

    async fn begin(&self) -> Result<Box<dyn InboxTx>, Error> {
        let conn = open(&self.path)?;
        conn.execute_batch("BEGIN IMMEDIATE")
            .map_err(harness_error)?;
        Ok(Box::new(SqliteTx {
            conn,
            config: self.config.clone(),
        }))
    }

    async fn marks(&self) -> Result<Vec<Mark>, Error> {
        self.read_pairs(self.config.table())
    }

    async fn effects(&self) -> Result<Vec<Mark>, Error> {
        self.read_pairs("effects")
    }

    async fn age_marks(&self, by: Duration) -> Result<(), Error> {
        open(&self.path)?
            .execute(
                &format!(
                    "UPDATE {} SET processed_at = processed_at - ?1",
                    self.config.table()
                ),
                [by.as_millis() as i64],
            )
            .map_err(harness_error)?;
        Ok(())
    }

    async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64, Error> {
        sqlite::purge(&open(&self.path)?, &self.config, older_than, batch)
    }
}

#[async_trait]
impl InboxTx for SqliteTx {
    async fn record(&mut self, consumer: &str, ids: &[Uuid]) -> Result<Vec<bool>, Error> {
        let receipts = match ids {
            [id] => vec![sqlite::record(&self.conn, &self.config, consumer, *id)?],
            _ => sqlite::record_batch(&self.conn, &self.config, consumer, ids)?,
        };
        Ok(receipts.into_iter().map(Receipt::is_new).collect())
    }

    async fn apply_effect(&mut self, consumer: &str, id: Uuid) -> Result<(), Error> {
        self.conn
            .execute(
                "INSERT INTO effects (consumer, message_id) VALUES (?1, ?2)",
                (consumer, id.to_string()),
            )
            .map_err(harness_error)?;
        Ok(())
    }

    async fn commit(self: Box<Self>) -> Result<(), Error> {
        self.conn.execute_batch("COMMIT").map_err(harness_error)
    }

    async fn rollback(self: Box<Self>) -> Result<(), Error> {
        self.conn.execute_batch("ROLLBACK").map_err(harness_error)
    }
}

outbox_conformance_tests::inbox_suite!(SqliteInbox);

#[test]
fn process_runs_the_handler_once_and_a_missing_table_says_to_migrate() {
    let mut conn = Connection::open_in_memory().unwrap();
    let config = InboxConfig::builder().table("consumed").build().unwrap();
    let id = Uuid::now_v7();
    let err = sqlite::record(&conn, &config, "payments", id).unwrap_err();
    assert!(err.to_string().contains("sqlite::migrate"), "{err}");
    sqlite::migrate(&conn, &config).unwrap();
    sqlite::migrate(&conn, &config).unwrap();
    conn.execute_batch("CREATE TABLE paid (id TEXT NOT NULL)")
        .unwrap();
    let pay = |tx: &rusqlite::Transaction<'_>| {
        tx.execute("INSERT INTO paid VALUES (?1)", [id.to_string()])
            .map_err(harness_error)
    };
    let failed = sqlite::process(&mut conn, &config, "payments", id, |tx| {
        pay(tx)?;
        Err::<(), _>(Error::transient("card service down", None))
    });
    assert!(failed.is_err());
    let first = sqlite::process(&mut conn, &config, "payments", id, |tx| pay(tx));
    assert_eq!(first.unwrap(), Outcome::Handled(1));
    let second = sqlite::process(&mut conn, &config, "payments", id, |tx| pay(tx));
    assert_eq!(second.unwrap(), Outcome::Duplicate);
    let paid: i64 = conn
        .query_row("SELECT count(*) FROM paid", [], |r| r.get(0))
        .unwrap();
    assert_eq!(paid, 1);
}

#[test]
fn purge_consumer_keeps_the_other_consumers_marks() {
    let conn = Connection::open_in_memory().unwrap();
    let config = InboxConfig::default();
    sqlite::migrate(&conn, &config).unwrap();
    for consumer in ["payments", "shipping"] {
        let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
        sqlite::record_batch(&conn, &config, consumer, &ids).unwrap();
    }
    conn.execute_batch("UPDATE outbox_inbox SET processed_at = processed_at - 3600000")
        .unwrap();
    let hour = Duration::from_secs(1800);
    assert_eq!(
        sqlite::purge_consumer(&conn, &config, "payments", hour, 2).unwrap(),
        2
    );
    assert_eq!(
        sqlite::purge_consumer(&conn, &config, "payments", hour, 2).unwrap(),
        1
    );
    let left: Vec<String> = conn
        .prepare("SELECT DISTINCT consumer FROM outbox_inbox")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(left, ["shipping"]);
    assert!(sqlite::purge_consumer(&conn, &config, "", hour, 2).is_err());
}

/// The same inbox through diesel: transactions and records on diesel's `SqliteConnection`
/// (the driver of the outbox's own diesel support for SQLite), reads through rusqlite.
mod diesel_inbox {
    use diesel::connection::SimpleConnection;
    use diesel::sql_types::Text;
    use diesel::{Connection as _, RunQueryDsl, SqliteConnection};

    use super::*;

    struct DieselSqliteInbox;

    struct DieselSqliteStore(SqliteStore);

    struct DieselSqliteTx {
        conn: SqliteConnection,
        config: InboxConfig,
    }

    fn establish(path: &Path) -> Result<SqliteConnection, Error> {
        let mut conn =
            SqliteConnection::establish(&path.to_string_lossy()).map_err(harness_error)?;
        conn.batch_execute("PRAGMA busy_timeout = 10000; PRAGMA synchronous = OFF;")
            .map_err(harness_error)?;
        Ok(conn)
    }

    #[async_trait]
    impl InboxHarness for DieselSqliteInbox {
        fn name(&self) -> String {
            "sqlite inbox (diesel)".into()
        }

        async fn fresh(&self) -> Result<Box<dyn InboxStore>, Error> {
            let dir = tempfile::tempdir().map_err(harness_error)?;
            let path = dir.path().join("consumer.db");
            let config = InboxConfig::default();
            let mut conn = establish(&path)?;
            conn.batch_execute(
                "PRAGMA journal_mode = WAL; \
                 CREATE TABLE effects (consumer TEXT NOT NULL, message_id TEXT NOT NULL);",
            )
            .map_err(harness_error)?;
            sqlite::diesel::migrate(&mut conn, &config)?;
            Ok(Box::new(DieselSqliteStore(SqliteStore {
                _dir: dir,
                path,
                config,
            })))
        }
    }

    #[async_trait]
    impl InboxStore for DieselSqliteStore {
        fn capabilities(&self) -> InboxCapabilities {
            self.0.capabilities()
        }

        async fn begin(&self) -> Result<Box<dyn InboxTx>, Error> {
            let mut conn = establish(&self.0.path)?;
            conn.batch_execute("BEGIN IMMEDIATE")
                .map_err(harness_error)?;
            Ok(Box::new(DieselSqliteTx {
                conn,
                config: self.0.config.clone(),
            }))
        }

        async fn marks(&self) -> Result<Vec<Mark>, Error> {
            self.0.marks().await
        }

        async fn effects(&self) -> Result<Vec<Mark>, Error> {
            self.0.effects().await
        }

        async fn age_marks(&self, by: Duration) -> Result<(), Error> {
            self.0.age_marks(by).await
        }

        async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64, Error> {
            sqlite::diesel::purge(
                &mut establish(&self.0.path)?,
                &self.0.config,
                older_than,
                batch,
            )
        }
    }

    #[async_trait]
    impl InboxTx for DieselSqliteTx {
        async fn record(&mut self, consumer: &str, ids: &[Uuid]) -> Result<Vec<bool>, Error> {
            let receipts = match ids {
                [id] => vec![sqlite::diesel::record(
                    &mut self.conn,
                    &self.config,
                    consumer,
                    *id,
                )?],
                _ => sqlite::diesel::record_batch(&mut self.conn, &self.config, consumer, ids)?,
            };
            Ok(receipts.into_iter().map(Receipt::is_new).collect())
        }

        async fn apply_effect(&mut self, consumer: &str, id: Uuid) -> Result<(), Error> {
            diesel::sql_query("INSERT INTO effects (consumer, message_id) VALUES (?, ?)")
                .bind::<Text, _>(consumer)
                .bind::<Text, _>(id.to_string())
                .execute(&mut self.conn)
                .map_err(harness_error)?;
            Ok(())
        }

        async fn commit(mut self: Box<Self>) -> Result<(), Error> {
            self.conn.batch_execute("COMMIT").map_err(harness_error)
        }

        async fn rollback(mut self: Box<Self>) -> Result<(), Error> {
            self.conn.batch_execute("ROLLBACK").map_err(harness_error)
        }
    }

    outbox_conformance_tests::inbox_suite!(DieselSqliteInbox);

    #[test]
    fn process_runs_the_handler_once_and_a_missing_table_says_to_migrate() {
        let mut conn = SqliteConnection::establish(":memory:").unwrap();
        let config = InboxConfig::builder().table("consumed").build().unwrap();
        let id = Uuid::now_v7();
        let err = sqlite::diesel::record(&mut conn, &config, "payments", id).unwrap_err();
        assert!(err.to_string().contains("sqlite::diesel::migrate"), "{err}");
        sqlite::diesel::migrate(&mut conn, &config).unwrap();
        sqlite::diesel::migrate(&mut conn, &config).unwrap();
        conn.batch_execute("CREATE TABLE paid (id TEXT NOT NULL)")
            .unwrap();
        let pay = |conn: &mut SqliteConnection| {
            diesel::sql_query("INSERT INTO paid VALUES (?)")
                .bind::<Text, _>(id.to_string())
                .execute(conn)
                .map_err(harness_error)
        };
        let failed = sqlite::diesel::process(&mut conn, &config, "payments", id, |conn| {
            pay(conn)?;
            Err::<usize, _>(Error::transient("card service down", None))
        });
        assert!(failed.is_err());
        let first = sqlite::diesel::process(&mut conn, &config, "payments", id, pay);
        assert_eq!(first.unwrap(), Outcome::Handled(1));
        let second = sqlite::diesel::process(&mut conn, &config, "payments", id, pay);
        assert_eq!(second.unwrap(), Outcome::Duplicate);
        let paid: i64 = diesel::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "(SELECT count(*) FROM paid)",
        ))
        .get_result(&mut conn)
        .unwrap();
        assert_eq!(paid, 1, "one effect for three deliveries");
    }

    #[tokio::test]
    async fn the_async_wrapper_records_and_processes_on_the_blocking_pool() {
        use outbox_inbox::sqlite::diesel::AsyncSqliteConnection;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("async.db");
        let mut conn = AsyncSqliteConnection::new(establish(&path).unwrap());
        let config = InboxConfig::default();
        sqlite::diesel::migrate_async(&mut conn, &config)
            .await
            .unwrap();
        let id = Uuid::now_v7();
        let outcome = sqlite::diesel::process_async(&mut conn, &config, "payments", id, |_| {
            Ok::<_, Error>("applied")
        })
        .await
        .unwrap();
        assert_eq!(outcome, Outcome::Handled("applied"));
        let receipts = sqlite::diesel::record_batch_async(
            &mut conn,
            &config,
            "payments",
            &[id, Uuid::now_v7()],
        )
        .await
        .unwrap();
        assert_eq!(receipts, [Receipt::Duplicate, Receipt::New]);
    }
}
