//! The diesel enqueue (feature `diesel`) on SQLite files: the conformance suite's enqueue checks
//! with business transactions on diesel-async's `SyncConnectionWrapper<SqliteConnection>` and
//! relays on the rusqlite store; a business row and its outbox rows commit and roll back
//! together on diesel's `SqliteConnection`; bad input gets the rusqlite path's errors. Each
//! test has its own file.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use diesel::connection::{Connection, SimpleConnection};
use diesel::sql_types::Text;
use diesel::sqlite::SqliteConnection;
use diesel::RunQueryDsl;
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use outbox_backend_sqlite::{
    diesel as outbox_diesel, open_connection, sqlite_error, SqliteConfig, SqliteStore,
};
use outbox_conformance_tests::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
use outbox_traits::{
    async_trait, ClaimRequest, Error, HeadPolicy, NewMessage, OutboxAdmin, OutboxStore,
};
use rusqlite::TransactionBehavior;
use serde_json::json;
use tempfile::TempDir;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn harness_err(e: impl std::fmt::Display) -> Error {
    Error::transient(format!("harness: {e}"), None)
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temp path")
}

/// Fresh files whose business transactions run on diesel-async's SQLite wrapper.
struct DieselSqliteHarness;

#[async_trait]
impl Harness for DieselSqliteHarness {
    fn name(&self) -> String {
        "sqlite, enqueue on diesel".into()
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        let dir = tempfile::tempdir().map_err(harness_err)?;
        let path = dir.path().join("outbox.db");
        let config = SqliteConfig::default();
        let admin = SqliteStore::open(&path, config.clone()).await?;
        admin.migrate().await?;
        Ok(Box::new(DieselSqliteStore {
            _dir: dir,
            path,
            config,
            admin,
        }))
    }
}

/// Relays and admin on the rusqlite store; business transactions on diesel.
struct DieselSqliteStore {
    _dir: TempDir,
    path: PathBuf,
    config: SqliteConfig,
    admin: SqliteStore,
}

#[async_trait]
impl HarnessStore for DieselSqliteStore {
    fn capabilities(&self) -> HarnessCapabilities {
        // One writer at a time: a transaction holds the write lock from BEGIN IMMEDIATE.
        HarnessCapabilities::new(OutboxStore::capabilities(&self.admin))
            .with_concurrent_transactions(false)
    }

    async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error> {
        Ok(Arc::new(
            SqliteStore::open(&self.path, self.config.clone()).await?,
        ))
    }

    async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error> {
        Ok(Arc::new(self.admin.clone()))
    }

    async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error> {
        let mut conn = SyncConnectionWrapper::<SqliteConnection>::establish(path_str(&self.path))
            .await
            .map_err(harness_err)?;
        conn.batch_execute("PRAGMA busy_timeout = 30000; BEGIN IMMEDIATE")
            .await
            .map_err(harness_err)?;
        Ok(Box::new(DieselSqliteTx {
            conn,
            config: self.config.clone(),
        }))
    }

    async fn advance_time(&self, by: Duration) -> Result<(), Error> {
        // Round up so that everything due within `by` is due afterwards.
        let ms = i64::try_from(by.as_micros().div_ceil(1000)).map_err(harness_err)?;
        self.admin
            .transaction(move |tx, config| {
                tx.execute(
                    &format!(
                        "UPDATE {} SET available_at = available_at - ?1, \
                         lease_until = lease_until - ?1, created_at = created_at - ?1, \
                         published_at = published_at - ?1",
                        config.table()
                    ),
                    [ms],
                )
                .map_err(sqlite_error)?;
                Ok::<_, Error>(())
            })
            .await
    }
}

/// An open diesel transaction; dropping it closes the connection, which rolls it back.
struct DieselSqliteTx {
    conn: SyncConnectionWrapper<SqliteConnection>,
    config: SqliteConfig,
}

#[async_trait]
impl HarnessTx for DieselSqliteTx {
    async fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error> {
        outbox_diesel::enqueue_batch_async(&mut self.conn, &self.config, messages).await
    }

    async fn commit(mut self: Box<Self>) -> Result<(), Error> {
        self.conn.batch_execute("COMMIT").await.map_err(harness_err)
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), Error> {
        self.conn
            .batch_execute("ROLLBACK")
            .await
            .map_err(harness_err)
    }
}

outbox_conformance_tests::enqueue_suite!(DieselSqliteHarness);

/// One test's file: the rusqlite store (relay side), a diesel connection and a business table.
struct Db {
    _dir: TempDir,
    path: PathBuf,
    config: SqliteConfig,
    store: SqliteStore,
    conn: SqliteConnection,
}

async fn db() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let config = SqliteConfig::default();
    let store = SqliteStore::open(&path, config.clone()).await.unwrap();
    store.migrate().await.unwrap();
    let mut conn = SqliteConnection::establish(path_str(&path)).unwrap();
    conn.batch_execute(
        "PRAGMA busy_timeout = 30000;
         CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER NOT NULL)",
    )
    .unwrap();
    Db {
        _dir: dir,
        path,
        config,
        store,
        conn,
    }
}

impl Db {
    fn order_ids(&mut self) -> Vec<String> {
        #[derive(diesel::QueryableByName)]
        struct Id {
            #[diesel(sql_type = Text)]
            id: String,
        }
        diesel::sql_query("SELECT id FROM orders ORDER BY id")
            .load::<Id>(&mut self.conn)
            .unwrap()
            .into_iter()
            .map(|row| row.id)
            .collect()
    }

    /// Claim everything claimable through the rusqlite store: the ids in claim order.
    async fn claim_all(&self) -> Vec<outbox_traits::uuid::Uuid> {
        let claim = self
            .store
            .claim(&ClaimRequest {
                limit: 100,
                lease: Duration::from_secs(30),
                head_policy: HeadPolicy::Block,
                shard: None,
            })
            .await
            .unwrap();
        claim.messages.iter().map(|m| m.id).collect()
    }
}

fn placed(order: &str) -> NewMessage {
    NewMessage::new("order", order, "order.placed", json!({ "order": order }))
        .with_partition_key(order)
}

/// What a caller of diesel writes: a business row and its events in one IMMEDIATE transaction.
fn place_order(
    conn: &mut SqliteConnection,
    config: &SqliteConfig,
    order: &str,
    events: &[NewMessage],
    commit: bool,
) -> Result<(), BoxError> {
    conn.immediate_transaction::<_, BoxError, _>(|conn| {
        diesel::sql_query("INSERT INTO orders (id, total) VALUES (?, 1200)")
            .bind::<Text, _>(order)
            .execute(conn)?;
        outbox_diesel::enqueue_batch(conn, config, events)?;
        if commit {
            Ok(())
        } else {
            Err(diesel::result::Error::RollbackTransaction.into())
        }
    })
}

#[tokio::test]
async fn business_row_and_outbox_rows_commit_and_roll_back_together() {
    let mut db = db().await;
    let committed = [placed("o-1"), placed("o-1").with_header("k", "v")];
    place_order(&mut db.conn, &db.config, "o-1", &committed, true).unwrap();
    let result = place_order(&mut db.conn, &db.config, "o-2", &[placed("o-2")], false);
    assert!(result.is_err(), "the rollback was not reported");

    assert_eq!(db.order_ids(), ["o-1"]);
    assert_eq!(
        db.claim_all().await,
        [committed[0].id, committed[1].id],
        "the committed batch, in slice order, and nothing of the rolled-back transaction"
    );
}

/// The error of enqueueing `batch` in an IMMEDIATE transaction of its own, rolled back, on
/// each driver.
fn both_errors(db: &mut Db, batch: &[NewMessage]) -> (Error, Error) {
    let mut rusqlite_conn = open_connection(&db.path, &db.config).unwrap();
    let tx = rusqlite_conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    let rusqlite_err = outbox_backend_sqlite::enqueue_batch(&tx, &db.config, batch)
        .expect_err("the rusqlite path accepted the batch");
    tx.rollback().unwrap();
    drop(rusqlite_conn);
    let config = &db.config;
    let diesel_err = db
        .conn
        .immediate_transaction::<(), BoxError, _>(|conn| {
            Ok(outbox_diesel::enqueue_batch(conn, config, batch)?)
        })
        .map_err(|err| *err.downcast::<Error>().expect("an outbox error"))
        .expect_err("the diesel path accepted the batch");
    (rusqlite_err, diesel_err)
}

#[tokio::test]
async fn refusals_equal_the_rusqlite_path() {
    let mut db = db().await;
    let stored = placed("o-1").with_dedup_key("once");
    place_order(
        &mut db.conn,
        &db.config,
        "o-1",
        std::slice::from_ref(&stored),
        true,
    )
    .unwrap();
    let twin = placed("o-2");
    let cases: Vec<(&str, Vec<NewMessage>)> = vec![
        (
            "blank event type",
            vec![NewMessage::new("order", "o-9", " ", json!({}))],
        ),
        ("one id twice in a batch", vec![twin.clone(), twin]),
        (
            "one dedup key twice in a batch",
            vec![
                placed("o-3").with_dedup_key("d"),
                placed("o-4").with_dedup_key("d"),
            ],
        ),
        (
            "a dedup key still in the table, second in its batch",
            vec![placed("o-5"), placed("o-6").with_dedup_key("once")],
        ),
        ("an id already enqueued", vec![stored.clone()]),
    ];
    for (what, batch) in cases {
        let (rusqlite_err, diesel_err) = both_errors(&mut db, &batch);
        assert!(
            matches!(
                rusqlite_err,
                Error::InvalidInput(_) | Error::DuplicateKey { .. }
            ),
            "{what}: rusqlite gave {rusqlite_err:?}"
        );
        assert_eq!(
            format!("{diesel_err:?}"),
            format!("{rusqlite_err:?}"),
            "{what}: the drivers disagree"
        );
    }
    assert_eq!(
        db.claim_all().await,
        [stored.id],
        "a refused message was written"
    );

    // A refused batch inside a transaction that goes on: the savepoint drops the whole batch,
    // the business row stays.
    db.conn
        .immediate_transaction::<(), BoxError, _>(|conn| {
            diesel::sql_query("INSERT INTO orders (id, total) VALUES ('o-7', 1)").execute(conn)?;
            let refused = [placed("o-7"), placed("o-7").with_dedup_key("once")];
            let err = outbox_diesel::enqueue_batch(conn, &db.config, &refused).unwrap_err();
            assert!(matches!(err, Error::DuplicateKey { ref key } if key == "once"));
            Ok(())
        })
        .unwrap();
    assert_eq!(db.order_ids(), ["o-1", "o-7"]);
    assert!(db.claim_all().await.is_empty(), "half a batch was written");

    // Without the table: the migration hint, as on the rusqlite path.
    let missing = SqliteConfig::builder()
        .table("not_migrated")
        .build()
        .unwrap();
    let err = outbox_diesel::enqueue(&mut db.conn, &missing, &placed("o-8")).unwrap_err();
    assert!(err.to_string().contains("migrate"), "{err}");
}
