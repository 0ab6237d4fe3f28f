//! Exactly-once effects over an at-least-once relay, as two small services.
//!
//! - The **order service** ([`OrderService`]) writes each order row and its `order.placed`
//!   outbox message in one transaction of its database: both commit or neither does.
//! - The **relay** ([`run_relay`]) publishes the committed messages to a broker, at least once:
//!   a relay killed after the broker stored a batch publishes it again.
//! - The **payment service** ([`PaymentService`], an [`outbox_consumer::Handler`]) consumes
//!   them and, in ONE transaction of its own database, records the message id in its inbox
//!   (`outbox-inbox`) and books the payment (a row in `payments` and the customer's balance).
//!   A message whose id the inbox already holds is acknowledged with no second effect; the
//!   consumer acknowledges to the broker only after that transaction committed, so a consumer
//!   killed before its ack gets the message again and the inbox drops it.
//!
//! Each service takes a database URL (`postgres://`, `mysql://` or `mariadb://`,
//! `sqlite:///path`) and a [`Names`] that says which tables it uses, so one database can hold
//! several independent runs. `main.rs` runs the trio SQLite → Redis → SQLite with one command;
//! the end-to-end test of the `outbox-e2e` crate (`tests/exactly_once.rs`) runs the same
//! functions in processes it kills with SIGKILL, on Postgres → NATS → Postgres,
//! MariaDB → Kafka → MariaDB and SQLite → Redis → SQLite.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::relay::{Relay, RelayConfig, RelayStats};
use outbox::store::StoreOptions;
use outbox::{Error, NewMessage};
use outbox_consumer::{async_trait, Delivery, Handled, Handler, HandlerError};
use outbox_inbox::{InboxConfig, Outcome};
use outbox_sql_support::validate_sql_identifier;
use rusqlite::TransactionBehavior;
use sqlx::{MySqlPool, PgPool};
use uuid::Uuid;

/// The event type of the messages the order service writes.
pub const ORDER_PLACED: &str = "order.placed";

/// How long a database connection may take before a call reports the database unavailable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The tables of one run: `orders`, `outbox`, `payments`, `balances` and `inbox`, each with
/// the same suffix (none by default), so that tests can share a database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// The order service's business table.
    pub orders: String,
    /// The order service's outbox table.
    pub outbox: String,
    /// The payment service's effects: one row per payment booked.
    pub payments: String,
    /// The payment service's balance per customer (a second, non-idempotent effect).
    pub balances: String,
    /// The payment service's inbox table.
    pub inbox: String,
}

impl Default for Names {
    fn default() -> Self {
        Self {
            orders: "orders".into(),
            outbox: "outbox".into(),
            payments: "payments".into(),
            balances: "balances".into(),
            inbox: "inbox".into(),
        }
    }
}

impl Names {
    /// The default names followed by `_{suffix}`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when a resulting name is not a plain SQL identifier (letters,
    /// digits and `_`, not starting with a digit).
    pub fn with_suffix(suffix: &str) -> Result<Self, Error> {
        let name = |base: &str| -> Result<String, Error> {
            let name = format!("{base}_{suffix}");
            validate_sql_identifier("table", &name)?;
            Ok(name)
        };
        Ok(Self {
            orders: name("orders")?,
            outbox: name("outbox")?,
            payments: name("payments")?,
            balances: name("balances")?,
            inbox: name("inbox")?,
        })
    }
}

/// One order: its row in `orders` and the payload of its `order.placed` message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Order {
    /// The order id, e.g. `order-17`.
    pub id: String,
    /// The customer: the message's partition key, so one customer's orders stay in order.
    pub customer: String,
    /// The customer's order number, from 1: lets a consumer check the order it sees.
    pub seq: i64,
    /// The amount to book.
    pub amount_cents: i64,
}

/// A payment the payment service booked (one row of `payments`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    /// The order of booking (an auto-increment key: commit order within one customer).
    pub booked: i64,
    /// The outbox message id the payment came from.
    pub message_id: Uuid,
    /// The order id.
    pub order_id: String,
    /// The customer.
    pub customer: String,
    /// The customer's order number.
    pub seq: i64,
    /// The amount booked.
    pub amount_cents: i64,
}

/// A database opened from its URL.
#[derive(Debug, Clone)]
enum Db {
    Postgres(PgPool),
    Mysql(MySqlPool),
    /// SQLite: one connection, used from blocking tasks (SQLite has one writer anyway).
    Sqlite(Arc<Mutex<rusqlite::Connection>>),
}

impl Db {
    async fn open(url: &str) -> Result<Self, Error> {
        let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
        match scheme {
            "postgres" | "postgresql" => Ok(Db::Postgres(
                outbox_sql_support::connect_pool(url, "postgres", CONNECT_TIMEOUT).await?,
            )),
            "mysql" | "mariadb" => {
                let url = url.replacen("mariadb:", "mysql:", 1);
                Ok(Db::Mysql(
                    outbox_sql_support::connect_pool(&url, "mysql", CONNECT_TIMEOUT).await?,
                ))
            }
            "sqlite" => {
                let path = sqlite_path(url)?;
                let conn = outbox::sqlite::open_connection(&path, &Default::default())?;
                Ok(Db::Sqlite(Arc::new(Mutex::new(conn))))
            }
            _ => Err(Error::invalid_input(format!(
                "database URL {:?} names no database this example knows; use postgres://, \
                 mysql:// (or mariadb://) or sqlite:///path",
                outbox::redact_url(url)
            ))),
        }
    }

    /// Run `work` on the SQLite connection in a blocking task.
    async fn sqlite<T: Send + 'static>(
        conn: &Arc<Mutex<rusqlite::Connection>>,
        work: impl FnOnce(&mut rusqlite::Connection) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        let conn = conn.clone();
        tokio::task::spawn_blocking(move || {
            // A panic while holding the lock cannot leave a half-done transaction behind:
            // rusqlite rolls back an unfinished transaction when it is dropped.
            let mut conn = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            work(&mut conn)
        })
        .await
        .map_err(|e| Error::permanent(format!("SQLite task failed: {e}"), None))?
    }
}

/// The file of a `sqlite:///absolute/path`, `sqlite://relative/path` or `sqlite:path` URL.
fn sqlite_path(url: &str) -> Result<PathBuf, Error> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or_default();
    let path = rest.split('?').next().unwrap_or_default();
    if path.is_empty() {
        return Err(Error::invalid_input(format!(
            "SQLite URL {url:?} names no file; use sqlite:///absolute/path.db"
        )));
    }
    Ok(PathBuf::from(path))
}

fn sql(op: &'static str) -> impl Fn(sqlx::Error) -> Error {
    move |e| {
        outbox_sql_support::map_sqlx(e, "database", op, "the example's tables", |_, text| {
            // Deadlocks and lock waits included: the consumer retries the message.
            Error::transient(format!("{op} failed: {text}"), None)
        })
    }
}

fn sqlite(e: rusqlite::Error) -> Error {
    outbox::sqlite::sqlite_error(e)
}

/// The order service: orders and their outbox messages, in one transaction each.
#[derive(Debug, Clone)]
pub struct OrderService {
    db: Db,
    names: Names,
}

impl OrderService {
    /// Connect to the database at `url` (`postgres://`, `mysql://`, `sqlite:///path`).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a URL of another kind; [`Error::Unavailable`] when the
    /// database cannot be reached.
    pub async fn connect(url: &str, names: Names) -> Result<Self, Error> {
        Ok(Self {
            db: Db::open(url).await?,
            names,
        })
    }

    /// Create the `orders` and outbox tables if they do not exist.
    ///
    /// # Errors
    /// Database errors.
    pub async fn migrate(&self) -> Result<(), Error> {
        let orders = &self.names.orders;
        match &self.db {
            Db::Postgres(pool) => {
                outbox::postgres::migrate(pool, &self.postgres_config()?).await?;
                sqlx::query(&format!(
                    "CREATE TABLE IF NOT EXISTS \"{orders}\" (id TEXT PRIMARY KEY, \
                     customer TEXT NOT NULL, seq BIGINT NOT NULL, amount_cents BIGINT NOT NULL)"
                ))
                .execute(pool)
                .await
                .map_err(sql("create orders"))?;
            }
            Db::Mysql(pool) => {
                outbox::mysql::migrate(pool, &self.mysql_config()?).await?;
                sqlx::query(&format!(
                    "CREATE TABLE IF NOT EXISTS `{orders}` (id VARCHAR(64) PRIMARY KEY, \
                     customer VARCHAR(64) NOT NULL, seq BIGINT NOT NULL, \
                     amount_cents BIGINT NOT NULL)"
                ))
                .execute(pool)
                .await
                .map_err(sql("create orders"))?;
            }
            Db::Sqlite(conn) => {
                let config = self.sqlite_config()?;
                let orders = orders.clone();
                Db::sqlite(conn, move |conn| {
                    outbox::sqlite::migrate(conn, &config)?;
                    conn.execute_batch(&format!(
                        "CREATE TABLE IF NOT EXISTS \"{orders}\" (id TEXT PRIMARY KEY, \
                         customer TEXT NOT NULL, seq INTEGER NOT NULL, \
                         amount_cents INTEGER NOT NULL)"
                    ))
                    .map_err(sqlite)
                })
                .await?;
            }
        }
        Ok(())
    }

    /// Write `orders` and one `order.placed` message each (partition key: the customer) in one
    /// transaction, then commit it, or roll it back when `commit` is false (a business rule
    /// refused the orders: neither the rows nor the messages exist afterwards). Returns the
    /// message ids, in the order of `orders`.
    ///
    /// # Errors
    /// Database errors, and the outbox's checks of the messages; nothing is written then.
    pub async fn place(&self, orders: &[Order], commit: bool) -> Result<Vec<Uuid>, Error> {
        let messages = orders
            .iter()
            .map(|order| {
                Ok(NewMessage::new(
                    "order",
                    order.id.as_str(),
                    ORDER_PLACED,
                    serde_json::to_value(order)
                        .map_err(|e| Error::invalid_input(format!("order payload: {e}")))?,
                )
                .with_partition_key(order.customer.as_str()))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let ids = messages.iter().map(|m| m.id).collect();
        let table = &self.names.orders;
        match &self.db {
            Db::Postgres(pool) => {
                let config = self.postgres_config()?;
                let mut tx = pool.begin().await.map_err(sql("begin"))?;
                for order in orders {
                    sqlx::query(&format!(
                        "INSERT INTO \"{table}\" (id, customer, seq, amount_cents) \
                         VALUES ($1, $2, $3, $4)"
                    ))
                    .bind(&order.id)
                    .bind(&order.customer)
                    .bind(order.seq)
                    .bind(order.amount_cents)
                    .execute(&mut *tx)
                    .await
                    .map_err(sql("insert order"))?;
                }
                outbox::postgres::enqueue_batch(&mut *tx, &config, &messages).await?;
                if commit {
                    tx.commit().await.map_err(sql("commit"))?;
                } else {
                    tx.rollback().await.map_err(sql("rollback"))?;
                }
            }
            Db::Mysql(pool) => {
                let config = self.mysql_config()?;
                let mut tx = pool.begin().await.map_err(sql("begin"))?;
                for order in orders {
                    sqlx::query(&format!(
                        "INSERT INTO `{table}` (id, customer, seq, amount_cents) \
                         VALUES (?, ?, ?, ?)"
                    ))
                    .bind(&order.id)
                    .bind(&order.customer)
                    .bind(order.seq)
                    .bind(order.amount_cents)
                    .execute(&mut *tx)
                    .await
                    .map_err(sql("insert order"))?;
                }
                outbox::mysql::enqueue_batch(&mut *tx, &config, &messages).await?;
                if commit {
                    tx.commit().await.map_err(sql("commit"))?;
                } else {
                    tx.rollback().await.map_err(sql("rollback"))?;
                }
            }
            Db::Sqlite(conn) => {
                let config = self.sqlite_config()?;
                let table = table.clone();
                let orders = orders.to_vec();
                Db::sqlite(conn, move |conn| {
                    let tx = conn
                        .transaction_with_behavior(TransactionBehavior::Immediate)
                        .map_err(sqlite)?;
                    for order in &orders {
                        tx.execute(
                            &format!(
                                "INSERT INTO \"{table}\" (id, customer, seq, amount_cents) \
                                 VALUES (?1, ?2, ?3, ?4)"
                            ),
                            (&order.id, &order.customer, order.seq, order.amount_cents),
                        )
                        .map_err(sqlite)?;
                    }
                    outbox::sqlite::enqueue_batch(&tx, &config, &messages)?;
                    if commit {
                        tx.commit().map_err(sqlite)
                    } else {
                        tx.rollback().map_err(sqlite)
                    }
                })
                .await?;
            }
        }
        Ok(ids)
    }

    fn postgres_config(&self) -> Result<outbox::postgres::PostgresConfig, Error> {
        outbox::postgres::PostgresConfig::builder()
            .table(self.names.outbox.as_str())
            .build()
    }

    fn mysql_config(&self) -> Result<outbox::mysql::MysqlConfig, Error> {
        outbox::mysql::MysqlConfig::builder()
            .table(self.names.outbox.as_str())
            .build()
    }

    fn sqlite_config(&self) -> Result<outbox::sqlite::SqliteConfig, Error> {
        outbox::sqlite::SqliteConfig::builder()
            .table(self.names.outbox.as_str())
            .build()
    }
}

/// Relay the outbox table `names.outbox` of the database at `store_url` to the broker at
/// `broker_url` (`nats://`, `kafka://`, `redis://`; see `outbox::broker::connect`) until
/// `shutdown` resolves. A `config` that names a relay group joins it where the store keeps
/// groups (Postgres, MariaDB).
///
/// # Errors
/// Bad URLs and unreachable servers at start; the relay's own errors.
pub async fn run_relay(
    store_url: &str,
    names: &Names,
    broker_url: &str,
    config: RelayConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<RelayStats, Error> {
    let options = StoreOptions {
        table: Some(names.outbox.clone()),
        ..StoreOptions::default()
    };
    let store = outbox::store::open(store_url, &options).await?;
    store.migrate().await?;
    let groups = store.group_store();
    let publisher = outbox::broker::connect(broker_url).await?;
    let mut relay = Relay::new(store.store, Arc::from(publisher), config)?;
    if let Some(groups) = groups {
        relay = relay.with_group_store(groups);
    }
    relay.run(shutdown).await
}

/// The payment service: books each `order.placed` message once, whatever the broker redelivers.
///
/// In one transaction of its database it records the message id in the inbox table and, only
/// when the id is new, inserts a row into `payments` and adds the amount to the customer's
/// balance; a duplicate changes nothing and is acknowledged.
#[derive(Debug, Clone)]
pub struct PaymentService {
    db: Db,
    names: Names,
    inbox: InboxConfig,
    consumer: String,
}

impl PaymentService {
    /// Connect to the payment database at `url`; `consumer` is the name the inbox records ids
    /// under (one inbox table can serve several consumers).
    ///
    /// # Errors
    /// As [`OrderService::connect`]; [`Error::InvalidInput`] for a bad inbox table name.
    pub async fn connect(url: &str, names: Names, consumer: &str) -> Result<Self, Error> {
        let inbox = InboxConfig::builder().table(names.inbox.as_str()).build()?;
        Ok(Self {
            db: Db::open(url).await?,
            names,
            inbox,
            consumer: consumer.to_owned(),
        })
    }

    /// Create the inbox, `payments` and `balances` tables if they do not exist. `payments` has
    /// no unique key on the message id on purpose: the inbox alone keeps effects single.
    ///
    /// # Errors
    /// Database errors.
    pub async fn migrate(&self) -> Result<(), Error> {
        let Names {
            payments, balances, ..
        } = &self.names;
        match &self.db {
            Db::Postgres(pool) => {
                outbox_inbox::postgres::migrate(pool, &self.inbox).await?;
                for ddl in [
                    format!(
                        "CREATE TABLE IF NOT EXISTS \"{payments}\" (booked BIGSERIAL PRIMARY KEY, \
                         message_id UUID NOT NULL, order_id TEXT NOT NULL, \
                         customer TEXT NOT NULL, seq BIGINT NOT NULL, \
                         amount_cents BIGINT NOT NULL)"
                    ),
                    format!(
                        "CREATE TABLE IF NOT EXISTS \"{balances}\" (customer TEXT PRIMARY KEY, \
                         total_cents BIGINT NOT NULL)"
                    ),
                ] {
                    sqlx::query(&ddl)
                        .execute(pool)
                        .await
                        .map_err(sql("create payments"))?;
                }
            }
            Db::Mysql(pool) => {
                outbox_inbox::mysql::migrate(pool, &self.inbox).await?;
                for ddl in [
                    format!(
                        "CREATE TABLE IF NOT EXISTS `{payments}` \
                         (booked BIGINT AUTO_INCREMENT PRIMARY KEY, message_id CHAR(36) NOT NULL, \
                         order_id VARCHAR(64) NOT NULL, customer VARCHAR(64) NOT NULL, \
                         seq BIGINT NOT NULL, amount_cents BIGINT NOT NULL)"
                    ),
                    format!(
                        "CREATE TABLE IF NOT EXISTS `{balances}` \
                         (customer VARCHAR(64) PRIMARY KEY, total_cents BIGINT NOT NULL)"
                    ),
                ] {
                    sqlx::query(&ddl)
                        .execute(pool)
                        .await
                        .map_err(sql("create payments"))?;
                }
            }
            Db::Sqlite(conn) => {
                let inbox = self.inbox.clone();
                let ddl = format!(
                    "CREATE TABLE IF NOT EXISTS \"{payments}\" \
                     (booked INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL, \
                     order_id TEXT NOT NULL, customer TEXT NOT NULL, seq INTEGER NOT NULL, \
                     amount_cents INTEGER NOT NULL);
                     CREATE TABLE IF NOT EXISTS \"{balances}\" (customer TEXT PRIMARY KEY, \
                     total_cents INTEGER NOT NULL);"
                );
                Db::sqlite(conn, move |conn| {
                    outbox_inbox::sqlite::migrate(conn, &inbox)?;
                    conn.execute_batch(&ddl).map_err(sqlite)
                })
                .await?;
            }
        }
        Ok(())
    }

    /// Book `order` (from message `id`) unless the inbox already holds `id`: the inbox mark,
    /// the payment row and the balance change commit together or not at all.
    ///
    /// # Errors
    /// Database errors: the transaction is rolled back (no mark, no effect), so the
    /// redelivery books it.
    pub async fn book(&self, id: Uuid, order: Order) -> Result<Outcome<()>, Error> {
        let Names {
            payments, balances, ..
        } = self.names.clone();
        match &self.db {
            Db::Postgres(pool) => {
                outbox_inbox::postgres::process(pool, &self.inbox, &self.consumer, id, |tx| {
                    Box::pin(async move {
                        sqlx::query(&format!(
                            "INSERT INTO \"{payments}\" \
                             (message_id, order_id, customer, seq, amount_cents) \
                             VALUES ($1, $2, $3, $4, $5)"
                        ))
                        .bind(id)
                        .bind(&order.id)
                        .bind(&order.customer)
                        .bind(order.seq)
                        .bind(order.amount_cents)
                        .execute(&mut **tx)
                        .await
                        .map_err(sql("insert payment"))?;
                        sqlx::query(&format!(
                            "INSERT INTO \"{balances}\" (customer, total_cents) VALUES ($1, $2) \
                             ON CONFLICT (customer) DO UPDATE \
                             SET total_cents = \"{balances}\".total_cents + EXCLUDED.total_cents"
                        ))
                        .bind(&order.customer)
                        .bind(order.amount_cents)
                        .execute(&mut **tx)
                        .await
                        .map_err(sql("update balance"))?;
                        Ok::<_, Error>(())
                    })
                })
                .await
            }
            Db::Mysql(pool) => {
                outbox_inbox::mysql::process(pool, &self.inbox, &self.consumer, id, |tx| {
                    Box::pin(async move {
                        sqlx::query(&format!(
                            "INSERT INTO `{payments}` \
                             (message_id, order_id, customer, seq, amount_cents) \
                             VALUES (?, ?, ?, ?, ?)"
                        ))
                        .bind(id.hyphenated().to_string())
                        .bind(&order.id)
                        .bind(&order.customer)
                        .bind(order.seq)
                        .bind(order.amount_cents)
                        .execute(&mut **tx)
                        .await
                        .map_err(sql("insert payment"))?;
                        sqlx::query(&format!(
                            "INSERT INTO `{balances}` (customer, total_cents) VALUES (?, ?) \
                             ON DUPLICATE KEY UPDATE total_cents = total_cents + VALUES(total_cents)"
                        ))
                        .bind(&order.customer)
                        .bind(order.amount_cents)
                        .execute(&mut **tx)
                        .await
                        .map_err(sql("update balance"))?;
                        Ok::<_, Error>(())
                    })
                })
                .await
            }
            Db::Sqlite(conn) => {
                let inbox = self.inbox.clone();
                let consumer = self.consumer.clone();
                Db::sqlite(conn, move |conn| {
                    outbox_inbox::sqlite::process(conn, &inbox, &consumer, id, |tx| {
                        tx.execute(
                            &format!(
                                "INSERT INTO \"{payments}\" \
                                 (message_id, order_id, customer, seq, amount_cents) \
                                 VALUES (?1, ?2, ?3, ?4, ?5)"
                            ),
                            (
                                id.hyphenated().to_string(),
                                &order.id,
                                &order.customer,
                                order.seq,
                                order.amount_cents,
                            ),
                        )
                        .map_err(sqlite)?;
                        tx.execute(
                            &format!(
                                "INSERT INTO \"{balances}\" (customer, total_cents) \
                                 VALUES (?1, ?2) ON CONFLICT (customer) DO UPDATE \
                                 SET total_cents = total_cents + excluded.total_cents"
                            ),
                            (&order.customer, order.amount_cents),
                        )
                        .map_err(sqlite)?;
                        Ok::<_, Error>(())
                    })
                })
                .await
            }
        }
    }

    /// Every payment booked, in booking order.
    ///
    /// # Errors
    /// Database errors.
    pub async fn payments(&self) -> Result<Vec<Payment>, Error> {
        let table = &self.names.payments;
        type Row = (i64, String, String, String, i64, i64);
        let rows: Vec<Row> = match &self.db {
            Db::Postgres(pool) => sqlx::query_as(&format!(
                "SELECT booked, message_id::text, order_id, customer, seq, amount_cents \
                 FROM \"{table}\" ORDER BY booked"
            ))
            .fetch_all(pool)
            .await
            .map_err(sql("read payments"))?,
            Db::Mysql(pool) => sqlx::query_as(&format!(
                "SELECT booked, message_id, order_id, customer, seq, amount_cents \
                 FROM `{table}` ORDER BY booked"
            ))
            .fetch_all(pool)
            .await
            .map_err(sql("read payments"))?,
            Db::Sqlite(conn) => {
                let query = format!(
                    "SELECT booked, message_id, order_id, customer, seq, amount_cents \
                     FROM \"{table}\" ORDER BY booked"
                );
                Db::sqlite(conn, move |conn| {
                    let mut statement = conn.prepare(&query).map_err(sqlite)?;
                    let rows = statement
                        .query_map([], |r| {
                            Ok((
                                r.get(0)?,
                                r.get(1)?,
                                r.get(2)?,
                                r.get(3)?,
                                r.get(4)?,
                                r.get(5)?,
                            ))
                        })
                        .map_err(sqlite)?
                        .collect::<Result<Vec<Row>, _>>()
                        .map_err(sqlite)?;
                    Ok(rows)
                })
                .await?
            }
        };
        rows.into_iter()
            .map(|(booked, id, order_id, customer, seq, amount_cents)| {
                Ok(Payment {
                    booked,
                    message_id: Uuid::parse_str(&id).map_err(|e| {
                        Error::permanent(format!("stored message id {id:?}: {e}"), None)
                    })?,
                    order_id,
                    customer,
                    seq,
                    amount_cents,
                })
            })
            .collect()
    }

    /// Each customer's balance.
    ///
    /// # Errors
    /// Database errors.
    pub async fn balances(&self) -> Result<Vec<(String, i64)>, Error> {
        let table = &self.names.balances;
        let query = format!("SELECT customer, total_cents FROM {table} ORDER BY customer");
        match &self.db {
            Db::Postgres(pool) => sqlx::query_as(&query)
                .fetch_all(pool)
                .await
                .map_err(sql("read balances")),
            Db::Mysql(pool) => sqlx::query_as(&query)
                .fetch_all(pool)
                .await
                .map_err(sql("read balances")),
            Db::Sqlite(conn) => {
                Db::sqlite(conn, move |conn| {
                    let mut statement = conn.prepare(&query).map_err(sqlite)?;
                    let rows = statement
                        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                        .map_err(sqlite)?
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(sqlite)?;
                    Ok(rows)
                })
                .await
            }
        }
    }
}

#[async_trait]
impl Handler for PaymentService {
    async fn handle(&self, delivery: &Delivery) -> Result<Handled, HandlerError> {
        if delivery.event_type != ORDER_PLACED {
            return Err(HandlerError::permanent(format!(
                "message {} is a {:?}; the payment service takes {ORDER_PLACED:?} only",
                delivery.message_id, delivery.event_type
            )));
        }
        let order: Order = delivery.payload_as()?;
        match self.book(delivery.message_id, order).await? {
            Outcome::Handled(()) => Ok(Handled::Processed),
            Outcome::Duplicate => Ok(Handled::Duplicate),
        }
    }
}

/// Consume the broker at `consumer_url` (see `outbox_consumer::Consumer::connect`) with
/// `handler` (a [`PaymentService`], or one that wraps it) until `shutdown` is cancelled.
///
/// # Errors
/// Bad URLs and unreachable servers at start.
pub async fn run_payments(
    handler: impl Handler + 'static,
    consumer_url: &str,
    shutdown: outbox_consumer::CancellationToken,
) -> Result<(), Error> {
    let consumer = outbox_consumer::Consumer::connect(consumer_url).await?;
    consumer.run_until(handler, shutdown).await;
    Ok(())
}

/// How to call [`serve`].
pub const SERVE_USAGE: &str = "usage:
  relay STORE_URL BROKER_URL [SUFFIX [GROUP]]
                                             relay the order service's outbox to the broker
                                             (as a replica of relay group GROUP, if given)
  payments DB_URL CONSUMER_URL [SUFFIX]      consume into the payment service (consumer name `payments`)
SUFFIX selects the tables `orders_SUFFIX`, `outbox_SUFFIX`, ... (default: `orders`, `outbox`, ...).";

/// Run one service as a long-lived process, from command-line arguments (without the
/// program name): `relay STORE_URL BROKER_URL [SUFFIX [GROUP]]` or `payments DB_URL
/// CONSUMER_URL [SUFFIX]` (see [`SERVE_USAGE`]). It migrates its tables, prints `ready` on
/// standard output, and runs until SIGTERM or Ctrl-C. The relay leases claims for 2 s, and in a
/// group its shards for 2 s too, so that after a crash another relay takes over within seconds.
///
/// # Errors
/// [`Error::InvalidInput`] for bad arguments (with [`SERVE_USAGE`]); the services' errors.
pub async fn serve(args: &[String]) -> Result<(), Error> {
    let usage = || Error::invalid_input(SERVE_USAGE);
    let (role, url, broker) = match args {
        [role, url, broker, ..] if args.len() <= 4 || (args.len() == 5 && role == "relay") => {
            (role.as_str(), url, broker)
        }
        _ => return Err(usage()),
    };
    let names = match args.get(3) {
        Some(suffix) => Names::with_suffix(suffix)?,
        None => Names::default(),
    };
    let shutdown = outbox_consumer::CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        terminated().await;
        on_signal.cancel();
    });
    match role {
        "relay" => {
            OrderService::connect(url, names.clone())
                .await?
                .migrate()
                .await?;
            let config = RelayConfig::builder()
                .batch_size(20)
                .lease(Duration::from_secs(2))
                .group(args.get(4).cloned())
                .group_lease(Duration::from_secs(2))
                .build()?;
            println!("ready");
            run_relay(url, &names, broker, config, shutdown.cancelled_owned()).await?;
        }
        "payments" => {
            let payments = PaymentService::connect(url, names, "payments").await?;
            payments.migrate().await?;
            println!("ready");
            // One line per duplicate dropped, for whoever watches the process (the e2e test).
            let handler = outbox_consumer::handler_fn(move |delivery| {
                let payments = payments.clone();
                async move {
                    let handled = payments.handle(&delivery).await?;
                    if handled == Handled::Duplicate {
                        println!("duplicate {}", delivery.message_id);
                    }
                    Ok(handled)
                }
            });
            run_payments(handler, broker, shutdown).await?;
        }
        _ => return Err(usage()),
    }
    Ok(())
}

/// Resolves on SIGTERM (Unix) or Ctrl-C.
async fn terminated() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
