//! The MariaDB inbox on the real server.

use std::time::Duration;

use outbox_conformance_tests::env::service_url;
use outbox_conformance_tests::inbox::{InboxCapabilities, InboxHarness, InboxStore, InboxTx, Mark};
use outbox_inbox::{mysql, Error, InboxConfig, Outcome, Receipt, Uuid};
use outbox_traits::async_trait;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{Executor, MySql, MySqlPool, Transaction};
use tokio::sync::OnceCell;

use crate::harness_error;

const URL_VAR: &str = "OUTBOX_TEST_MYSQL_URL";

/// Each case gets a database of its own, with the inbox and an effects table.
pub struct MySqlInbox {
    url: String,
    pool: OnceCell<MySqlPool>,
}

impl MySqlInbox {
    fn from_env() -> Option<Self> {
        service_url(URL_VAR).map(|url| Self {
            url,
            pool: OnceCell::new(),
        })
    }

    async fn pool(&self) -> Result<MySqlPool, Error> {
        self.pool
            .get_or_try_init(|| async {
                MySqlPoolOptions::new()
                    .max_connections(4)
                    .connect(&self.url)
                    .await
                    .map_err(harness_error)
            })
            .await
            .cloned()
    }
}

struct MySqlStore {
    pool: MySqlPool,
    config: InboxConfig,
    database: String,
}

struct MySqlTx {
    tx: Transaction<'static, MySql>,
    config: InboxConfig,
    effects: String,
}

#[async_trait]
impl InboxHarness for MySqlInbox {
    fn name(&self) -> String {
        "mariadb inbox (sqlx)".into()
    }

    async fn fresh(&self) -> Result<Box<dyn InboxStore>, Error> {
        Ok(Box::new(self.store().await?))
    }
}

impl MySqlInbox {
    async fn store(&self) -> Result<MySqlStore, Error> {
        let pool = self.pool().await?;
        let database = format!("inbox_{}", Uuid::new_v4().simple());
        let config = InboxConfig::builder()
            .table("inbox")
            .schema(&database)
            .build()?;
        mysql::migrate(&pool, &config).await?;
        pool.execute(
            format!(
                "CREATE TABLE `{database}`.effects (consumer VARCHAR(200) CHARACTER SET utf8mb4 \
                 COLLATE utf8mb4_bin NOT NULL, message_id CHAR(36) NOT NULL)"
            )
            .as_str(),
        )
        .await
        .map_err(harness_error)?;
        Ok(MySqlStore {
            pool,
            config,
            database,
        })
    }
}

#[async_trait]
impl InboxStore for MySqlStore {
    fn capabilities(&self) -> InboxCapabilities {
        InboxCapabilities::new()
    }

    async fn begin(&self) -> Result<Box<dyn InboxTx>, Error> {
        Ok(Box::new(MySqlTx {
            tx: self.pool.begin().await.map_err(harness_error)?,
            config: self.config.clone(),
            effects: format!("`{}`.effects", self.database),
        }))
    }

    async fn marks(&self) -> Result<Vec<Mark>, Error> {
        read_pairs(&self.pool, &format!("`{}`.inbox", self.database)).await
    }

    async fn effects(&self) -> Result<Vec<Mark>, Error> {
        read_pairs(&self.pool, &format!("`{}`.effects", self.database)).await
    }

    async fn age_marks(&self, by: Duration) -> Result<(), Error> {
        sqlx::query(&format!(
            "UPDATE `{}`.inbox SET processed_at = processed_at - INTERVAL ? MICROSECOND",
            self.database
        ))
        .bind(by.as_micros() as i64)
        .execute(&self.pool)
        .await
        .map_err(harness_error)?;
        Ok(())
    }

    async fn lock_waits(&self) -> Result<Option<u64>, Error> {
        // An insert into this inbox still executing on the server: the second delivery of a
        // race, blocked by the first's row lock. (Not `information_schema.innodb_trx`, whose
        // snapshot is not refreshed while it is read more often than every 100 ms.)
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.processlist \
             WHERE info LIKE 'INSERT%' AND info LIKE CONCAT('%', ?, '%')",
        )
        .bind(&self.database)
        .fetch_one(&self.pool)
        .await
        .map_err(harness_error)?;
        Ok(Some(n as u64))
    }

    async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64, Error> {
        mysql::purge(&self.pool, &self.config, older_than, batch).await
    }

    async fn teardown(self: Box<Self>) -> Result<(), Error> {
        self.pool
            .execute(format!("DROP DATABASE `{}`", self.database).as_str())
            .await
            .map_err(harness_error)?;
        Ok(())
    }
}

async fn read_pairs(pool: &MySqlPool, table: &str) -> Result<Vec<Mark>, Error> {
    // Binary collations come back as bytes.
    let rows: Vec<(Vec<u8>, Vec<u8>)> =
        sqlx::query_as(&format!("SELECT consumer, message_id FROM {table}"))
            .fetch_all(pool)
            .await
            .map_err(harness_error)?;
    rows.into_iter()
        .map(|(consumer, id)| {
            Ok((
                String::from_utf8(consumer).map_err(harness_error)?,
                Uuid::try_parse_ascii(&id).map_err(harness_error)?,
            ))
        })
        .collect()
}

#[async_trait]
impl InboxTx for MySqlTx {
    async fn record(&mut self, consumer: &str, ids: &[Uuid]) -> Result<Vec<bool>, Error> {
        let receipts = match ids {
            [id] => vec![mysql::record(&mut *self.tx, &self.config, consumer, *id).await?],
            _ => mysql::record_batch(&mut *self.tx, &self.config, consumer, ids).await?,
        };
        Ok(receipts.into_iter().map(Receipt::is_new).collect())
    }

    async fn apply_effect(&mut self, consumer: &str, id: Uuid) -> Result<(), Error> {
        sqlx::query(&format!(
            "INSERT INTO {} (consumer, message_id) VALUES (?, ?)",
            self.effects
        ))
        .bind(consumer)
        .bind(id.to_string())
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

outbox_conformance_tests::inbox_suite!(optional: MySqlInbox::from_env());

#[tokio::test]
async fn process_runs_the_handler_once_and_a_missing_table_says_to_migrate() {
    let Some(harness) = MySqlInbox::from_env() else {
        return;
    };
    let pool = harness.pool().await.unwrap();
    let database = format!("inbox_{}", Uuid::new_v4().simple());
    let config = InboxConfig::builder()
        .table("inbox")
        .schema(&database)
        .build()
        .unwrap();
    pool.execute(format!("CREATE DATABASE `{database}`").as_str())
        .await
        .unwrap();
    let err = mysql::record(&pool, &config, "payments", Uuid::now_v7())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("mysql::migrate"), "{err}");

    let (a, b) = tokio::join!(
        mysql::migrate(&pool, &config),
        mysql::migrate(&pool, &config)
    );
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    let id = Uuid::now_v7();
    let failed = mysql::process(&pool, &config, "payments", id, |_tx| {
        Box::pin(async { Err::<(), _>(Error::transient("card service down", None)) })
    })
    .await;
    assert!(failed.is_err());
    let first = mysql::process(&pool, &config, "payments", id, |_tx| {
        Box::pin(async { Ok::<_, Error>(1) })
    })
    .await;
    assert_eq!(first.unwrap(), Outcome::Handled(1));
    let second = mysql::process(&pool, &config, "payments", id, |_tx| {
        Box::pin(async { Ok::<_, Error>(2) })
    })
    .await;
    assert_eq!(second.unwrap(), Outcome::Duplicate);
    pool.execute(format!("DROP DATABASE `{database}`").as_str())
        .await
        .unwrap();
}

/// The same inbox through diesel-async: transactions, records and purges on
/// `AsyncMysqlConnection`s, reads through the sqlx store.
mod diesel_async_inbox {
    use std::sync::{Arc, Mutex};

    use diesel::sql_types::Text;
    use diesel_async::{AsyncConnection, AsyncMysqlConnection, RunQueryDsl, SimpleAsyncConnection};

    use super::*;

    type Idle = Arc<Mutex<Vec<AsyncMysqlConnection>>>;

    /// Idle connections are kept across cases (one runtime runs them all), so a case does not
    /// pay for connecting.
    struct DieselMySqlInbox(MySqlInbox, Idle);

    struct DieselMySqlStore {
        url: String,
        inner: MySqlStore,
        idle: Idle,
    }

    struct DieselMySqlTx {
        conn: Option<AsyncMysqlConnection>,
        idle: Idle,
        config: InboxConfig,
        effects: String,
    }

    impl DieselMySqlStore {
        async fn connection(&self) -> Result<AsyncMysqlConnection, Error> {
            let idle = self.idle.lock().map_err(harness_error)?.pop();
            match idle {
                Some(conn) => Ok(conn),
                None => AsyncMysqlConnection::establish(&self.url)
                    .await
                    .map_err(harness_error),
            }
        }
    }

    #[async_trait]
    impl InboxHarness for DieselMySqlInbox {
        fn name(&self) -> String {
            "mariadb inbox (diesel-async)".into()
        }

        async fn fresh(&self) -> Result<Box<dyn InboxStore>, Error> {
            Ok(Box::new(DieselMySqlStore {
                url: self.0.url.clone(),
                inner: self.0.store().await?,
                idle: self.1.clone(),
            }))
        }
    }

    #[async_trait]
    impl InboxStore for DieselMySqlStore {
        fn capabilities(&self) -> InboxCapabilities {
            self.inner.capabilities()
        }

        async fn begin(&self) -> Result<Box<dyn InboxTx>, Error> {
            let mut conn = self.connection().await?;
            conn.batch_execute("BEGIN").await.map_err(harness_error)?;
            Ok(Box::new(DieselMySqlTx {
                conn: Some(conn),
                idle: self.idle.clone(),
                config: self.inner.config.clone(),
                effects: format!("`{}`.effects", self.inner.database),
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
                mysql::diesel::purge(&mut conn, &self.inner.config, older_than, batch).await;
            self.idle.lock().map_err(harness_error)?.push(conn);
            purged
        }

        async fn teardown(self: Box<Self>) -> Result<(), Error> {
            Box::new(self.inner).teardown().await
        }
    }

    impl DieselMySqlTx {
        fn conn(&mut self) -> Result<&mut AsyncMysqlConnection, Error> {
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
    impl InboxTx for DieselMySqlTx {
        async fn record(&mut self, consumer: &str, ids: &[Uuid]) -> Result<Vec<bool>, Error> {
            let config = self.config.clone();
            let conn = self.conn()?;
            let receipts = match ids {
                [id] => vec![mysql::diesel::record(conn, &config, consumer, *id).await?],
                _ => mysql::diesel::record_batch(conn, &config, consumer, ids).await?,
            };
            Ok(receipts.into_iter().map(Receipt::is_new).collect())
        }

        async fn apply_effect(&mut self, consumer: &str, id: Uuid) -> Result<(), Error> {
            let sql = format!(
                "INSERT INTO {} (consumer, message_id) VALUES (?, ?)",
                self.effects
            );
            diesel::sql_query(sql)
                .bind::<Text, _>(consumer)
                .bind::<Text, _>(id.to_string())
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

    outbox_conformance_tests::inbox_suite!(optional: MySqlInbox::from_env().map(|h| DieselMySqlInbox(h, Idle::default())), reduced: 2);

    #[tokio::test]
    async fn migrate_is_idempotent_a_missing_table_says_to_migrate_and_process_applies_once() {
        let Some(harness) = MySqlInbox::from_env() else {
            return;
        };
        let mut conn = AsyncMysqlConnection::establish(&harness.url).await.unwrap();
        let database = format!("inbox_{}", Uuid::new_v4().simple());
        let config = InboxConfig::builder()
            .table("inbox")
            .schema(&database)
            .build()
            .unwrap();
        conn.batch_execute(&format!("CREATE DATABASE `{database}`"))
            .await
            .unwrap();
        let err = mysql::diesel::record(&mut conn, &config, "payments", Uuid::now_v7())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("mysql::diesel::migrate"), "{err}");
        mysql::diesel::migrate(&mut conn, &config).await.unwrap();
        mysql::diesel::migrate(&mut conn, &config).await.unwrap();
        let id = Uuid::now_v7();
        let first = mysql::diesel::record(&mut conn, &config, "payments", id).await;
        assert_eq!(first.unwrap(), Receipt::New);
        let again = mysql::diesel::record(&mut conn, &config, "payments", id).await;
        assert_eq!(again.unwrap(), Receipt::Duplicate);

        // `process`: the handler's write and the mark commit together, once.
        conn.batch_execute(&format!(
            "CREATE TABLE `{database}`.paid (id TEXT NOT NULL)"
        ))
        .await
        .unwrap();
        let id = Uuid::now_v7();
        let insert = format!("INSERT INTO `{database}`.paid VALUES (?)");
        let failed = mysql::diesel::process(&mut conn, &config, "payments", id, async |conn| {
            diesel::sql_query(&insert)
                .bind::<Text, _>(id.to_string())
                .execute(conn)
                .await
                .map_err(harness_error)?;
            Err::<(), _>(Error::transient("card service down", None))
        })
        .await;
        assert!(failed.is_err());
        for expected in [Outcome::Handled(1), Outcome::Duplicate] {
            let outcome =
                mysql::diesel::process(&mut conn, &config, "payments", id, async |conn| {
                    diesel::sql_query(&insert)
                        .bind::<Text, _>(id.to_string())
                        .execute(conn)
                        .await
                        .map_err(harness_error)
                })
                .await;
            assert_eq!(outcome.unwrap(), expected);
        }
        let paid = diesel::sql_query(format!("DELETE FROM `{database}`.paid"))
            .execute(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            paid, 1,
            "one effect for three deliveries, one of them failed"
        );
        conn.batch_execute(&format!("DROP DATABASE `{database}`"))
            .await
            .unwrap();
    }
}
