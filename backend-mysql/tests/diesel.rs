//! The diesel-async enqueue (feature `diesel`) on the real MariaDB named by
//! `OUTBOX_TEST_MYSQL_URL`: the conformance suite's enqueue checks with business transactions
//! on diesel-async and relays on the sqlx store; a business row and its outbox row commit and
//! roll back together; bad input gets the sqlx path's errors. Each test has its own tables.

mod common;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use common::harness::{self, err as harness_err};
use common::{random_table, URL_VAR};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncMysqlConnection, RunQueryDsl, TransactionManager,
};
use outbox_backend_mysql::{diesel as outbox_diesel, MysqlConfig, MysqlStore};
use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{
    async_trait, ClaimRequest, Error, HeadPolicy, NewMessage, OutboxAdmin, OutboxStore,
};
use serde_json::json;
use sqlx::mysql::MySqlConnectOptions;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The outbox error a diesel transaction's closure returned.
fn outbox_error(err: BoxError) -> Error {
    *err.downcast::<Error>().expect("an outbox error")
}

/// Fresh stores whose business transactions run on diesel-async.
struct DieselMysqlHarness {
    url: String,
    options: MySqlConnectOptions,
}

impl DieselMysqlHarness {
    fn from_env() -> Option<Self> {
        let url = service_url(URL_VAR)?;
        let options = MySqlConnectOptions::from_str(&url).expect("OUTBOX_TEST_MYSQL_URL");
        Some(Self { url, options })
    }
}

fn sqlx_store(options: &MySqlConnectOptions, max: u32, config: MysqlConfig) -> MysqlStore {
    MysqlStore::new(harness::pool(options, max), config)
}

#[async_trait]
impl Harness for DieselMysqlHarness {
    fn name(&self) -> String {
        "mysql, enqueue on diesel-async".into()
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        let config = MysqlConfig::builder().table(random_table()).build()?;
        let store = sqlx_store(&self.options, 4, config);
        store.migrate().await?;
        Ok(Box::new(DieselMysqlStore {
            url: self.url.clone(),
            options: self.options.clone(),
            store,
        }))
    }
}

/// Relays and admin on the sqlx store; business transactions on diesel-async.
struct DieselMysqlStore {
    url: String,
    options: MySqlConnectOptions,
    store: MysqlStore,
}

#[async_trait]
impl HarnessStore for DieselMysqlStore {
    fn capabilities(&self) -> HarnessCapabilities {
        HarnessCapabilities::new(OutboxStore::capabilities(&self.store))
    }

    async fn relay(&self) -> Result<Arc<dyn OutboxStore>, Error> {
        Ok(Arc::new(sqlx_store(
            &self.options,
            1,
            self.store.config().clone(),
        )))
    }

    async fn admin(&self) -> Result<Arc<dyn OutboxAdmin>, Error> {
        Ok(Arc::new(self.store.clone()))
    }

    async fn begin(&self) -> Result<Box<dyn HarnessTx>, Error> {
        let mut conn = AsyncMysqlConnection::establish(&self.url)
            .await
            .map_err(harness_err)?;
        <AnsiTransactionManager as TransactionManager<AsyncMysqlConnection>>::begin_transaction(
            &mut conn,
        )
        .await
        .map_err(harness_err)?;
        Ok(Box::new(DieselMysqlTx {
            conn,
            config: self.store.config().clone(),
        }))
    }

    async fn advance_time(&self, by: Duration) -> Result<(), Error> {
        harness::advance_time(&self.store, by).await
    }

    async fn now(&self) -> Result<DateTime<Utc>, Error> {
        harness::now(&self.store).await
    }

    async fn teardown(self: Box<Self>) -> Result<(), Error> {
        harness::teardown(&self.store).await?;
        self.store.pool().close().await;
        Ok(())
    }
}

/// An open diesel-async transaction; dropping it closes the connection, which rolls it back.
struct DieselMysqlTx {
    conn: AsyncMysqlConnection,
    config: MysqlConfig,
}

#[async_trait]
impl HarnessTx for DieselMysqlTx {
    async fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error> {
        outbox_diesel::enqueue_batch(&mut self.conn, &self.config, messages).await
    }

    async fn commit(mut self: Box<Self>) -> Result<(), Error> {
        <AnsiTransactionManager as TransactionManager<AsyncMysqlConnection>>::commit_transaction(
            &mut self.conn,
        )
        .await
        .map_err(harness_err)
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), Error> {
        <AnsiTransactionManager as TransactionManager<AsyncMysqlConnection>>::rollback_transaction(
            &mut self.conn,
        )
        .await
        .map_err(harness_err)
    }
}

outbox_conformance_tests::enqueue_suite!(optional: DieselMysqlHarness::from_env());

/// One test's tables: the sqlx store (relay side), a diesel connection and a business table.
struct Db {
    store: MysqlStore,
    config: MysqlConfig,
    conn: AsyncMysqlConnection,
    orders: String,
}

async fn db() -> Option<Db> {
    let url = service_url(URL_VAR)?;
    let table = random_table();
    let config = MysqlConfig::builder().table(&table).build().unwrap();
    let store = MysqlStore::connect(&url, config.clone()).await.unwrap();
    store.migrate().await.unwrap();
    let orders = format!("`{table}_orders`");
    sqlx::query(&format!(
        "CREATE TABLE {orders} (id VARCHAR(64) PRIMARY KEY, total BIGINT NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let conn = AsyncMysqlConnection::establish(&url).await.unwrap();
    Some(Db {
        store,
        config,
        conn,
        orders,
    })
}

impl Db {
    async fn order_ids(&self) -> Vec<String> {
        sqlx::query_scalar(&format!("SELECT id FROM {} ORDER BY id", self.orders))
            .fetch_all(self.store.pool())
            .await
            .unwrap()
    }

    /// Claim everything claimable through the sqlx store: the ids in claim order.
    async fn claim_all(&self) -> Vec<uuid::Uuid> {
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

    async fn drop(self) {
        let _ = sqlx::raw_sql(&format!(
            "{}DROP TABLE {};",
            self.config.drop_sql(),
            self.orders
        ))
        .execute(self.store.pool())
        .await;
    }
}

fn placed(order: &str) -> NewMessage {
    NewMessage::new("order", order, "order.placed", json!({ "order": order }))
        .with_partition_key(order)
}

/// What a caller of diesel-async writes: a business row and its event in one transaction.
async fn place_order(
    conn: &mut AsyncMysqlConnection,
    db_orders: &str,
    config: &MysqlConfig,
    order: &str,
    events: &[NewMessage],
    commit: bool,
) -> Result<(), BoxError> {
    let insert = format!("INSERT INTO {db_orders} (id, total) VALUES (?, ?)");
    conn.transaction::<_, BoxError, _>(async |conn| {
        diesel::sql_query(insert)
            .bind::<Text, _>(order)
            .bind::<BigInt, _>(1200_i64)
            .execute(conn)
            .await?;
        outbox_diesel::enqueue_batch(conn, config, events).await?;
        if commit {
            Ok(())
        } else {
            Err(diesel::result::Error::RollbackTransaction.into())
        }
    })
    .await
}

#[tokio::test]
async fn business_row_and_outbox_rows_commit_and_roll_back_together() {
    let Some(mut db) = db().await else {
        return;
    };
    let committed = [placed("o-1"), placed("o-1").with_header("k", "v")];
    place_order(
        &mut db.conn,
        &db.orders,
        &db.config,
        "o-1",
        &committed,
        true,
    )
    .await
    .unwrap();
    let rolled_back = [placed("o-2")];
    let result = place_order(
        &mut db.conn,
        &db.orders,
        &db.config,
        "o-2",
        &rolled_back,
        false,
    )
    .await;
    assert!(result.is_err(), "the rollback was not reported");

    assert_eq!(db.order_ids().await, ["o-1"]);
    assert_eq!(
        db.claim_all().await,
        [committed[0].id, committed[1].id],
        "the committed batch, in slice order, and nothing of the rolled-back transaction"
    );
    // An empty batch writes nothing and leaves the transaction usable.
    place_order(&mut db.conn, &db.orders, &db.config, "o-3", &[], true)
        .await
        .unwrap();
    assert_eq!(db.order_ids().await, ["o-1", "o-3"]);
    assert!(db.claim_all().await.is_empty());
    db.drop().await;
}

/// The error of enqueueing `batch` in a transaction of its own, rolled back, on each driver.
async fn both_errors(db: &mut Db, batch: &[NewMessage]) -> (Error, Error) {
    let mut tx = db.store.pool().begin().await.unwrap();
    let sqlx_err = outbox_backend_mysql::enqueue_batch(&mut *tx, &db.config, batch)
        .await
        .expect_err("the sqlx path accepted the batch");
    tx.rollback().await.unwrap();
    let config = &db.config;
    let diesel_err = db
        .conn
        .transaction::<(), BoxError, _>(async |conn| {
            outbox_diesel::enqueue_batch(conn, config, batch).await?;
            Ok(())
        })
        .await
        .map_err(outbox_error)
        .expect_err("the diesel path accepted the batch");
    (sqlx_err, diesel_err)
}

#[tokio::test]
async fn refusals_equal_the_sqlx_path() {
    let Some(mut db) = db().await else {
        return;
    };
    let stored = placed("o-1").with_dedup_key("once");
    db.conn
        .transaction::<(), BoxError, _>(async |conn| {
            Ok(outbox_diesel::enqueue(conn, &db.config, &stored).await?)
        })
        .await
        .unwrap();
    let twin = placed("o-2");
    let cases: Vec<(&str, Vec<NewMessage>)> = vec![
        (
            "blank event type",
            vec![NewMessage::new("order", "o-9", " ", json!({}))],
        ),
        (
            "a partition key over 255 characters",
            vec![placed("o-9").with_partition_key("k".repeat(256))],
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
            "a dedup key still in the table",
            vec![placed("o-5").with_dedup_key("once")],
        ),
        ("an id already enqueued", vec![stored.clone()]),
    ];
    for (what, batch) in cases {
        let (sqlx_err, diesel_err) = both_errors(&mut db, &batch).await;
        assert!(
            matches!(
                sqlx_err,
                Error::InvalidInput(_) | Error::DuplicateKey { .. }
            ),
            "{what}: sqlx gave {sqlx_err:?}"
        );
        assert_eq!(
            format!("{diesel_err:?}"),
            format!("{sqlx_err:?}"),
            "{what}: the drivers disagree"
        );
    }
    assert_eq!(
        db.claim_all().await,
        [stored.id],
        "a refused message was written"
    );

    // Without the table: the migration hint, as on the sqlx path.
    let missing = MysqlConfig::builder()
        .table(random_table())
        .build()
        .unwrap();
    let err = db
        .conn
        .transaction::<(), BoxError, _>(async |conn| {
            Ok(outbox_diesel::enqueue(conn, &missing, &placed("o-6")).await?)
        })
        .await
        .map_err(outbox_error)
        .unwrap_err();
    assert!(
        err.to_string().contains("run `outbox-relay migrate`"),
        "{err}"
    );
    db.drop().await;
}

#[tokio::test]
async fn batches_of_every_size_are_written_in_order_and_twice_on_one_connection() {
    let Some(mut db) = db().await else {
        return;
    };
    // 40 is past the sizes whose statement stays prepared on the connection; 1 and 3 are
    // within them, and the second round reuses the prepared statements.
    for round in 0..2 {
        for size in [1, 3, 40] {
            let batch: Vec<NewMessage> = (0..size)
                .map(|i| placed(&format!("r{round}-s{size}-{i}")))
                .collect();
            let config = &db.config;
            db.conn
                .transaction::<(), BoxError, _>(async |conn| {
                    Ok(outbox_diesel::enqueue_batch(conn, config, &batch).await?)
                })
                .await
                .unwrap();
            let want: Vec<_> = batch.iter().map(|m| m.id).collect();
            assert_eq!(db.claim_all().await, want, "round {round}, size {size}");
        }
    }
    db.drop().await;
}

#[tokio::test]
async fn the_key_lock_takes_the_same_round_trip_on_diesel() {
    let Some(mut db) = db().await else {
        return;
    };
    let locking = MysqlConfig::builder()
        .table(db.config.table())
        .lock_keys(true)
        .build()
        .unwrap();
    let events = [
        placed("o-1"),
        placed("o-1").with_header("quote", "it's \"quoted\"; --"),
    ];
    place_order(&mut db.conn, &db.orders, &locking, "o-1", &events, true)
        .await
        .unwrap();
    let rolled_back = [placed("o-2")];
    let result = place_order(
        &mut db.conn,
        &db.orders,
        &locking,
        "o-2",
        &rolled_back,
        false,
    )
    .await;
    assert!(result.is_err(), "the rollback was not reported");
    // The key-lock rows are written (and locked) by the same transactions: o-1's committed.
    let locked: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT CAST(partition_key AS CHAR CHARACTER SET utf8mb4) FROM {} ORDER BY partition_key",
        locking.key_locks_table()
    ))
    .fetch_all(db.store.pool())
    .await
    .unwrap();
    assert_eq!(locked, ["o-1"]);
    assert_eq!(db.claim_all().await, [events[0].id, events[1].id]);
    db.drop().await;
}
