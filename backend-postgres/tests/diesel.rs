//! The diesel-async enqueue (feature `diesel`) on the real Postgres named by
//! `OUTBOX_TEST_POSTGRES_URL`: the conformance suite's enqueue checks with business
//! transactions on diesel-async and relays on the sqlx store; a business row and its outbox
//! row commit and roll back together; bad input gets the sqlx path's errors; NOTIFY wakes
//! listeners. Each test has its own schema.

mod common;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use common::harness::{self, err as harness_err};
use common::{random_schema, URL_VAR};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, RunQueryDsl, TransactionManager,
};
use outbox_backend_postgres::{diesel as outbox_diesel, PostgresConfig, PostgresStore};
use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::{Harness, HarnessCapabilities, HarnessStore, HarnessTx};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{
    async_trait, ClaimRequest, Error, HeadPolicy, NewMessage, OutboxAdmin, OutboxStore,
};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgListener};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The outbox error a diesel transaction's closure returned.
fn outbox_error(err: BoxError) -> Error {
    *err.downcast::<Error>().expect("an outbox error")
}

/// Fresh stores whose business transactions run on diesel-async.
struct DieselPgHarness {
    url: String,
    options: PgConnectOptions,
}

impl DieselPgHarness {
    fn from_env() -> Option<Self> {
        let url = service_url(URL_VAR)?;
        let options = PgConnectOptions::from_str(&url).expect("OUTBOX_TEST_POSTGRES_URL");
        Some(Self { url, options })
    }
}

fn sqlx_store(options: &PgConnectOptions, max: u32, config: PostgresConfig) -> PostgresStore {
    PostgresStore::new(harness::pool(options, max), config)
}

#[async_trait]
impl Harness for DieselPgHarness {
    fn name(&self) -> String {
        "postgres, enqueue on diesel-async".into()
    }

    async fn fresh(&self) -> Result<Box<dyn HarnessStore>, Error> {
        let config = PostgresConfig::builder().schema(random_schema()).build()?;
        let store = sqlx_store(&self.options, 4, config);
        store.migrate().await?;
        Ok(Box::new(DieselPgStore {
            url: self.url.clone(),
            options: self.options.clone(),
            store,
        }))
    }
}

/// Relays and admin on the sqlx store; business transactions on diesel-async.
struct DieselPgStore {
    url: String,
    options: PgConnectOptions,
    store: PostgresStore,
}

#[async_trait]
impl HarnessStore for DieselPgStore {
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
        let mut conn = AsyncPgConnection::establish(&self.url)
            .await
            .map_err(harness_err)?;
        <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::begin_transaction(
            &mut conn,
        )
        .await
        .map_err(harness_err)?;
        Ok(Box::new(DieselPgTx {
            conn,
            config: self.store.config().clone(),
        }))
    }

    /// Shift every stored time back by `by`: to the store, `by` has passed.
    async fn advance_time(&self, by: Duration) -> Result<(), Error> {
        harness::advance_time(&self.store, by).await
    }

    async fn now(&self) -> Result<DateTime<Utc>, Error> {
        harness::now(&self.store).await
    }

    async fn teardown(self: Box<Self>) -> Result<(), Error> {
        harness::teardown(&self.store).await
    }
}

/// An open diesel-async transaction; dropping it closes the connection, which rolls it back.
struct DieselPgTx {
    conn: AsyncPgConnection,
    config: PostgresConfig,
}

#[async_trait]
impl HarnessTx for DieselPgTx {
    async fn enqueue(&mut self, messages: &[NewMessage]) -> Result<(), Error> {
        outbox_diesel::enqueue_batch(&mut self.conn, &self.config, messages).await
    }

    async fn commit(mut self: Box<Self>) -> Result<(), Error> {
        <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::commit_transaction(
            &mut self.conn,
        )
        .await
        .map_err(harness_err)
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), Error> {
        <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::rollback_transaction(
            &mut self.conn,
        )
        .await
        .map_err(harness_err)
    }
}

outbox_conformance_tests::enqueue_suite!(optional: DieselPgHarness::from_env());

/// One test's schema: the sqlx store (relay side), a diesel connection and a business table.
struct Db {
    store: PostgresStore,
    config: PostgresConfig,
    conn: AsyncPgConnection,
    orders: String,
}

async fn db() -> Option<Db> {
    let url = service_url(URL_VAR)?;
    let schema = random_schema();
    let config = PostgresConfig::builder().schema(&schema).build().unwrap();
    let store = PostgresStore::connect(&url, config.clone()).await.unwrap();
    store.migrate().await.unwrap();
    let orders = format!("\"{schema}\".orders");
    sqlx::query(&format!(
        "CREATE TABLE {orders} (id text PRIMARY KEY, total bigint NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let conn = AsyncPgConnection::establish(&url).await.unwrap();
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
        let _ = sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.config.schema()))
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
    conn: &mut AsyncPgConnection,
    db_orders: &str,
    config: &PostgresConfig,
    order: &str,
    events: &[NewMessage],
    commit: bool,
) -> Result<(), BoxError> {
    let insert = format!("INSERT INTO {db_orders} (id, total) VALUES ($1, $2)");
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
    let sqlx_err = outbox_backend_postgres::enqueue_batch(&mut *tx, &db.config, batch)
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
            "NUL in the payload",
            vec![NewMessage::new("order", "o-9", "x", json!({"a": "b\u{0}"}))],
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
    let missing = PostgresConfig::builder()
        .schema(random_schema())
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
async fn enqueue_notifies_listeners_on_commit() {
    let Some(mut db) = db().await else {
        return;
    };
    let notifying = PostgresConfig::builder()
        .schema(db.config.schema())
        .notify(true)
        .build()
        .unwrap();
    let mut listener = PgListener::connect_with(db.store.pool()).await.unwrap();
    listener.listen(notifying.notify_channel()).await.unwrap();
    let event = placed("o-1");
    db.conn
        .transaction::<(), BoxError, _>(async |conn| {
            Ok(outbox_diesel::enqueue(conn, &notifying, &event).await?)
        })
        .await
        .unwrap();
    let note = tokio::time::timeout(Duration::from_secs(60), listener.recv())
        .await
        .expect("no notification within a minute")
        .unwrap();
    assert_eq!(note.channel(), notifying.notify_channel());
    assert_eq!(db.claim_all().await, [event.id]);
    db.drop().await;
}
