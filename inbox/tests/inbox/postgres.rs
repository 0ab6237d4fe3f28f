//! The Postgres inbox on the real server.

use std::time::Duration;

use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::inbox::{InboxCapabilities, InboxHarness, InboxStore, InboxTx, Mark};
use outbox_inbox::{postgres, Error, InboxConfig, Outcome, Receipt, Uuid};
use outbox_traits::async_trait;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool, Postgres, Transaction};
use tokio::sync::OnceCell;

use crate::harness_error;

const URL_VAR: &str = "OUTBOX_TEST_POSTGRES_URL";

/// Each case gets a schema of its own, with the inbox and an effects table.
pub struct PgInbox {
    url: String,
    pool: OnceCell<PgPool>,
}

impl PgInbox {
    fn from_env() -> Option<Self> {
        service_url(URL_VAR).map(|url| Self {
            url,
            pool: OnceCell::new(),
        })
    }

    async fn pool(&self) -> Result<PgPool, Error> {
        self.pool
            .get_or_try_init(|| async {
                PgPoolOptions::new()
                    .max_connections(4)
                    // No flush to disk at each commit: what is tested is visibility and
                    // locking, not durability, and the disk is shared.
                    .after_connect(|conn, _| {
                        Box::pin(async move {
                            conn.execute("SET synchronous_commit = off").await?;
                            Ok(())
                        })
                    })
                    .connect(&self.url)
                    .await
                    .map_err(harness_error)
            })
            .await
            .cloned()
    }
}

struct PgStore {
    pool: PgPool,
    config: InboxConfig,
    schema: String,
}

struct PgTx {
    tx: Transaction<'static, Postgres>,
    config: InboxConfig,
    effects: String,
}

#[async_trait]
impl InboxHarness for PgInbox {
    fn name(&self) -> String {
        "postgres inbox (sqlx)".into()
    }

    async fn fresh(&self) -> Result<Box<dyn InboxStore>, Error> {
        Ok(Box::new(self.store().await?))
    }
}

impl PgInbox {
    async fn store(&self) -> Result<PgStore, Error> {
        let pool = self.pool().await?;
        let schema = format!("inbox_{}", Uuid::new_v4().simple());
        let config = InboxConfig::builder()
            .table("inbox")
            .schema(&schema)
            .build()?;
        postgres::migrate(&pool, &config).await?;
        pool.execute(
            format!(
                "CREATE TABLE \"{schema}\".effects (consumer TEXT NOT NULL, message_id UUID NOT NULL)"
            )
            .as_str(),
        )
        .await
        .map_err(harness_error)?;
        Ok(PgStore {
            pool,
            config,
            schema,
        })
    }
}

#[async_trait]
impl InboxStore for PgStore {
    fn capabilities(&self) -> InboxCapabilities {
        InboxCapabilities::new()
    }

    async fn begin(&self) -> Result<Box<dyn InboxTx>, Error> {
        Ok(Box::new(PgTx {
            tx: self.pool.begin().await.map_err(harness_error)?,
            config: self.config.clone(),
            effects: format!("\"{}\".effects", self.schema),
        }))
    }

    async fn marks(&self) -> Result<Vec<Mark>, Error> {
        read_pairs(&self.pool, &format!("\"{}\".inbox", self.schema)).await
    }

    async fn effects(&self) -> Result<Vec<Mark>, Error> {
        read_pairs(&self.pool, &format!("\"{}\".effects", self.schema)).await
    }

    async fn age_marks(&self, by: Duration) -> Result<(), Error> {
        sqlx::query(&format!(
            "UPDATE \"{}\".inbox SET processed_at = processed_at - $1 * interval '1 second'",
            self.schema
        ))
        .bind(by.as_secs_f64())
        .execute(&self.pool)
        .await
        .map_err(harness_error)?;
        Ok(())
    }

    async fn lock_waits(&self) -> Result<Option<u64>, Error> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE NOT l.granted AND a.query LIKE '%' || $1 || '%'",
        )
        .bind(&self.schema)
        .fetch_one(&self.pool)
        .await
        .map_err(harness_error)?;
        Ok(Some(n as u64))
    }

    async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64, Error> {
        postgres::purge(&self.pool, &self.config, older_than, batch).await
    }

    async fn teardown(self: Box<Self>) -> Result<(), Error> {
        self.pool
            .execute(format!("DROP SCHEMA \"{}\" CASCADE", self.schema).as_str())
            .await
            .map_err(harness_error)?;
        Ok(())
    }
}

async fn read_pairs(pool: &PgPool, table: &str) -> Result<Vec<Mark>, Error> {
    sqlx::query_as(&format!("SELECT consumer, message_id FROM {table}"))
        .fetch_all(pool)
        .await
        .map_err(harness_error)
}

#[async_trait]
impl InboxTx for PgTx {
    async fn record(&mut self, consumer: &str, ids: &[Uuid]) -> Result<Vec<bool>, Error> {
        let receipts = match ids {
            [id] => vec![postgres::record(&mut *self.tx, &self.config, consumer, *id).await?],
            _ => postgres::record_batch(&mut *self.tx, &self.config, consumer, ids).await?,
        };
        Ok(receipts.into_iter().map(Receipt::is_new).collect())
    }

    async fn apply_effect(&mut self, consumer: &str, id: Uuid) -> Result<(), Error> {
        sqlx::query(&format!(
            "INSERT INTO {} (consumer, message_id) VALUES ($1, $2)",
            self.effects
        ))
        .bind(consumer)
        .bind(id)
        .execute(&mut *self.tx)
        .await
        .map_err(harness_error)?;
        Ok(())
    }

    async fn commit(self: Box<Self>) -> Result<(), Error> {
        self.tx.commit().await.map_err(harness_error)
    }

    async fn rollback(self: Box<Self>) -> Result<(), Error> {
        self.tx.rollback().await.map_err(harness_error)
    }
}

outbox_conformance_tests::inbox_suite!(optional: PgInbox::from_env());

/// A fresh inbox for the tests below, on the harness's schema-per-case layout.
async fn fresh() -> Option<(PgPool, InboxConfig, String)> {
    let harness = PgInbox::from_env()?;
    let pool = harness.pool().await.ok()?;
    let schema = format!("inbox_{}", Uuid::new_v4().simple());
    let config = InboxConfig::builder()
        .table("inbox")
        .schema(&schema)
        .build()
        .ok()?;
    Some((pool, config, schema))
}

#[tokio::test]
async fn process_runs_the_handler_once_and_rolls_back_its_failures() {
    let Some((pool, config, schema)) = fresh().await else {
        return;
    };
    postgres::migrate(&pool, &config).await.unwrap();
    // Idempotent: consumers starting together each migrate.
    let (a, b) = tokio::join!(
        postgres::migrate(&pool, &config),
        postgres::migrate(&pool, &config)
    );
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    pool.execute(format!("CREATE TABLE \"{schema}\".paid (id UUID NOT NULL)").as_str())
        .await
        .unwrap();
    let paid = format!("INSERT INTO \"{schema}\".paid VALUES ($1)");
    let id = Uuid::now_v7();

    // A failing handler: no effect, no mark, the error as returned.
    let sql = paid.clone();
    let failed = postgres::process(&pool, &config, "payments", id, move |tx| {
        Box::pin(async move {
            sqlx::query(&sql).bind(id).execute(&mut **tx).await.unwrap();
            Err::<(), _>(Error::transient("card service down", None))
        })
    })
    .await;
    assert!(matches!(failed, Err(Error::Backend { .. })), "{failed:?}");

    // The future is Send: a consumer can spawn it.
    let (p, c, q) = (pool.clone(), config.clone(), paid.clone());
    let first = tokio::spawn(async move {
        postgres::process(&p, &c, "payments", id, move |tx| {
            Box::pin(async move {
                sqlx::query(&q)
                    .bind(id)
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| Error::permanent(e.to_string(), None))?;
                Ok::<_, Error>(7)
            })
        })
        .await
    })
    .await
    .unwrap();
    assert_eq!(first.unwrap(), Outcome::Handled(7));

    let mut ran = false;
    let second = postgres::process(&pool, &config, "payments", id, |_tx| {
        ran = true;
        Box::pin(async { Ok::<(), Error>(()) })
    })
    .await;
    assert_eq!(second.unwrap(), Outcome::Duplicate);
    assert!(!ran, "a duplicate must not run the handler");

    let count: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".paid"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        count, 1,
        "the effect is applied once: the failed attempt left nothing"
    );
    pool.execute(format!("DROP SCHEMA \"{schema}\" CASCADE").as_str())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_missing_table_says_to_migrate_and_bad_purges_are_refused() {
    let Some((pool, config, _schema)) = fresh().await else {
        return;
    };
    let err = postgres::record(&pool, &config, "payments", Uuid::now_v7())
        .await
        .unwrap_err();
    assert!(!err.is_transient(), "{err}");
    assert!(err.to_string().contains("postgres::migrate"), "{err}");
    for batch in [0, 10_001] {
        let err = postgres::purge(&pool, &config, Duration::from_secs(60), batch)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    }
}

/// The same inbox through diesel-async: transactions, records and purges on
/// `AsyncPgConnection`s, reads through the sqlx store.
mod diesel_async_inbox {
    use std::sync::{Arc, Mutex};

    use diesel::sql_types::{Text, Uuid as SqlUuid};
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

    use super::*;

    type Idle = Arc<Mutex<Vec<AsyncPgConnection>>>;

    /// Idle connections are kept across cases (one runtime runs them all), so a case does not
    /// pay for connecting.
    struct DieselPgInbox(PgInbox, Idle);

    struct DieselPgStore {
        url: String,
        inner: PgStore,
        idle: Idle,
    }

    struct DieselPgTx {
        conn: Option<AsyncPgConnection>,
        idle: Idle,
        config: InboxConfig,
        effects: String,
    }

    impl DieselPgStore {
        async fn connection(&self) -> Result<AsyncPgConnection, Error> {
            let idle = self.idle.lock().map_err(harness_error)?.pop();
            if let Some(conn) = idle {
                return Ok(conn);
            }
            let mut conn = AsyncPgConnection::establish(&self.url)
                .await
                .map_err(harness_error)?;
            conn.batch_execute("SET synchronous_commit = off")
                .await
                .map_err(harness_error)?;
            Ok(conn)
        }
    }

    #[async_trait]
    impl InboxHarness for DieselPgInbox {
        fn name(&self) -> String {
            "postgres inbox (diesel-async)".into()
        }

        async fn fresh(&self) -> Result<Box<dyn InboxStore>, Error> {
            Ok(Box::new(DieselPgStore {
                url: self.0.url.clone(),
                inner: self.0.store().await?,
                idle: self.1.clone(),
            }))
        }
    }

    #[async_trait]
    impl InboxStore for DieselPgStore {
        fn capabilities(&self) -> InboxCapabilities {
            self.inner.capabilities()
        }

        async fn begin(&self) -> Result<Box<dyn InboxTx>, Error> {
            let mut conn = self.connection().await?;
            conn.batch_execute("BEGIN").await.map_err(harness_error)?;
            Ok(Box::new(DieselPgTx {
                conn: Some(conn),
                idle: self.idle.clone(),
                config: self.inner.config.clone(),
                effects: format!("\"{}\".effects", self.inner.schema),
            }))
        }

        async fn marks(&self) -> Result<Vec<Mark>, Error> {
            self.inner.marks().await
        }

        async fn effects(&self) -> Result<Vec<Mark>, Error> {
            self.inner.effects().await
        }

        async fn age_marks(&self, by: Duration) -> Result<(), Error> {
            self.inner.age_marks(by).await
        }

        async fn lock_waits(&self) -> Result<Option<u64>, Error> {
            self.inner.lock_waits().await
        }

        async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64, Error> {
            let mut conn = self.connection().await?;
            let purged =
                postgres::diesel::purge(&mut conn, &self.inner.config, older_than, batch).await;
            self.idle.lock().map_err(harness_error)?.push(conn);
            purged
        }

        async fn teardown(self: Box<Self>) -> Result<(), Error> {
            Box::new(self.inner).teardown().await
        }
    }

    impl DieselPgTx {
        fn conn(&mut self) -> Result<&mut AsyncPgConnection, Error> {
            self.conn
                .as_mut()
                .ok_or_else(|| harness_error("the transaction has ended"))
        }

        async fn end(mut self: Box<Self>, sql: &str) -> Result<(), Error> {
            let mut conn = self
                .conn
                .take()
                .ok_or_else(|| harness_error("the transaction has ended"))?;
            conn.batch_execute(sql).await.map_err(harness_error)?;
            self.idle.lock().map_err(harness_error)?.push(conn);
            Ok(())
        }
    }

    #[async_trait]
    impl InboxTx for DieselPgTx {
        async fn record(&mut self, consumer: &str, ids: &[Uuid]) -> Result<Vec<bool>, Error> {
            let config = self.config.clone();
            let conn = self.conn()?;
            let receipts = match ids {
                [id] => vec![postgres::diesel::record(conn, &config, consumer, *id).await?],
                _ => postgres::diesel::record_batch(conn, &config, consumer, ids).await?,
            };
            Ok(receipts.into_iter().map(Receipt::is_new).collect())
        }

        async fn apply_effect(&mut self, consumer: &str, id: Uuid) -> Result<(), Error> {
            let sql = format!(
                "INSERT INTO {} (consumer, message_id) VALUES ($1, $2)",
                self.effects
            );
            diesel::sql_query(sql)
                .bind::<Text, _>(consumer)
                .bind::<SqlUuid, _>(id)
                .execute(self.conn()?)
                .await
                .map_err(harness_error)?;
            Ok(())
        }

        async fn commit(self: Box<Self>) -> Result<(), Error> {
            self.end("COMMIT").await
        }

        async fn rollback(self: Box<Self>) -> Result<(), Error> {
            self.end("ROLLBACK").await
        }
    }

    outbox_conformance_tests::inbox_suite!(optional: PgInbox::from_env().map(|h| DieselPgInbox(h, Idle::default())), reduced: 2);

    #[tokio::test]
    async fn migrate_is_idempotent_a_missing_table_says_to_migrate_and_process_applies_once() {
        let Some(harness) = PgInbox::from_env() else {
            return;
        };
        let mut conn = AsyncPgConnection::establish(&harness.url).await.unwrap();
        let schema = format!("inbox_{}", Uuid::new_v4().simple());
        let config = InboxConfig::builder()
            .table("inbox")
            .schema(&schema)
            .build()
            .unwrap();
        let err = postgres::diesel::record(&mut conn, &config, "payments", Uuid::now_v7())
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("postgres::diesel::migrate"),
            "{err}"
        );
        postgres::diesel::migrate(&mut conn, &config).await.unwrap();
        postgres::diesel::migrate(&mut conn, &config).await.unwrap();
        let id = Uuid::now_v7();
        let first = postgres::diesel::record(&mut conn, &config, "payments", id).await;
        assert_eq!(first.unwrap(), Receipt::New);

        // `process`: the handler's write and the mark commit together, once.
        conn.batch_execute(&format!(
            "CREATE TABLE \"{schema}\".paid (id UUID NOT NULL)"
        ))
        .await
        .unwrap();
        let id = Uuid::now_v7();
        let insert = format!("INSERT INTO \"{schema}\".paid VALUES ($1)");
        let failed = postgres::diesel::process(&mut conn, &config, "payments", id, async |conn| {
            diesel::sql_query(&insert)
                .bind::<SqlUuid, _>(id)
                .execute(conn)
                .await
                .map_err(harness_error)?;
            Err::<(), _>(Error::transient("card service down", None))
        })
        .await;
        assert!(failed.is_err());
        for expected in [Outcome::Handled(1), Outcome::Duplicate] {
            let outcome =
                postgres::diesel::process(&mut conn, &config, "payments", id, async |conn| {
                    diesel::sql_query(&insert)
                        .bind::<SqlUuid, _>(id)
                        .execute(conn)
                        .await
                        .map_err(harness_error)
                })
                .await;
            assert_eq!(outcome.unwrap(), expected);
        }
        let paid = diesel::sql_query(format!("DELETE FROM \"{schema}\".paid"))
            .execute(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            paid, 1,
            "one effect for three deliveries, one of them failed"
        );
        conn.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .await
            .unwrap();
    }
}
