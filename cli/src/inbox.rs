//! `outbox-relay inbox ...`: the consumer side's table on the `--store` database: create it,
//! purge old marks in bounded batches, and show what it holds; and a consumer's dead letters on
//! its broker.

use std::time::{Duration, SystemTime};

use clap::{Args, Subcommand};
use outbox::Error;
use outbox_consumer::DeadLetterPosition;
use outbox_inbox::{InboxConfig, MAX_BATCH};
use serde_json::json;

use crate::ops;
use crate::progress::Progress;

/// Which inbox table: `--inbox-table` (default `outbox_inbox`) and, optionally,
/// `--inbox-schema`.
#[derive(Debug, Clone, Args)]
pub struct InboxTable {
    /// The inbox table (the consumers' `InboxConfig`).
    #[arg(long, env = "OUTBOX_INBOX_TABLE", default_value = outbox_inbox::DEFAULT_TABLE)]
    pub inbox_table: String,
    /// Its Postgres schema, MariaDB database or SQLite attached database, if not the
    /// connection's default.
    #[arg(long, env = "OUTBOX_INBOX_SCHEMA")]
    pub inbox_schema: Option<String>,
}

impl InboxTable {
    fn config(&self) -> Result<InboxConfig, Error> {
        let mut config = InboxConfig::builder().table(self.inbox_table.clone());
        if let Some(schema) = &self.inbox_schema {
            config = config.schema(schema.clone());
        }
        config.build()
    }
}

/// The consumers' inbox (`outbox-inbox`) in the `--store` database: the table of processed
/// message ids that turns at-least-once delivery into exactly-once effects; and the dead
/// letters of an `outbox-consumer`, kept by its broker.
///
/// `dead-letters --consumer-url URL` takes the URL the consumer itself is configured with and
/// reads, without consuming anything, its dead-letter stream or topic: NATS stream
/// `<stream>_DEAD` (subjects `dead.<stream>.>`; or `dead_stream=`), Redis stream `<stream>:dead`
/// (or `dead_stream=`), Kafka topic `<topic>.dead` (or `dead_topic=`). The consumers of one
/// stream or topic share it by default; each dead letter names its consumer. It prints how many
/// it holds and the newest ones: message id, consumer, attempts, reason
/// (`dead-letter-reason`), source (`dead-letter-source`), partition key, body size and type,
/// position and time. To requeue or delete them, use the broker's own tools (e.g.
/// `nats stream view`, `redis-cli XRANGE`, `kafka-console-consumer --property
/// print.headers=true`).
#[derive(Debug, Subcommand)]
pub enum InboxCommand {
    /// Create the inbox table and its index if they do not exist (idempotent).
    Migrate {
        #[command(flatten)]
        table: InboxTable,
    },
    /// Delete marks (processed message ids) older than a given age, oldest first, in bounded
    /// batches, each its own short transaction. Keep marks longer than any redelivery can
    /// arrive: a redelivery whose mark was purged is applied again.
    Purge {
        /// Age of the marks to delete, e.g. 7d, 12h.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Duration,
        /// Only this consumer's marks (the others' are kept).
        #[arg(long)]
        consumer: Option<String>,
        /// Marks per delete statement (1 to 10000).
        #[arg(long, default_value_t = 1000, value_parser = batch)]
        batch: u32,
        #[command(flatten)]
        table: InboxTable,
    },
    /// Marks per consumer, with the oldest and newest mark's age: what a purge would find.
    Status {
        /// One JSON object per consumer, one a line, instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        table: InboxTable,
    },
    /// A consumer's dead letters on its broker: how many its dead-letter stream or topic holds,
    /// and the newest, newest first. Needs no --store.
    DeadLetters {
        /// The consumer's own URL, options included (nats://, redis:// or kafka://, e.g.
        /// redis://127.0.0.1:6379?stream=outbox.order&group=payments).
        #[arg(long, env = "OUTBOX_CONSUMER_URL", hide_env_values = true)]
        consumer_url: String,
        /// How many of the newest to list (0 to 10000); the count covers them all.
        #[arg(long, default_value_t = 20, value_parser = limit)]
        limit: usize,
        /// A JSON line with the count, then one JSON object per dead letter, instead of the
        /// table.
        #[arg(long)]
        json: bool,
    },
}

fn limit(text: &str) -> Result<usize, String> {
    let max = outbox_consumer::MAX_DEAD_LETTER_LIMIT;
    match text.parse::<usize>() {
        Ok(n) if n <= max => Ok(n),
        Ok(n) => Err(format!("must be 0 to {max}, not {n}")),
        Err(e) => Err(format!("{e}; expected a whole number from 0 to {max}")),
    }
}

fn batch(text: &str) -> Result<u32, String> {
    match text.parse::<u32>() {
        Ok(n) if (1..=MAX_BATCH as u32).contains(&n) => Ok(n),
        Ok(n) => Err(format!("must be 1 to {MAX_BATCH}, not {n}")),
        Err(e) => Err(format!(
            "{e}; expected a whole number from 1 to {MAX_BATCH}"
        )),
    }
}

/// One consumer's marks.
struct ConsumerMarks {
    consumer: String,
    marks: i64,
    oldest_age_seconds: f64,
    newest_age_seconds: f64,
}

/// The store's connection, opened with the store's own URL handling (TLS, `password_file`).
enum Db {
    #[cfg(feature = "postgres")]
    Postgres(outbox::postgres::PostgresStore),
    #[cfg(feature = "mysql")]
    Mysql(outbox::mysql::MysqlStore),
    #[cfg(feature = "sqlite")]
    Sqlite(rusqlite::Connection),
}

async fn open(url: &str) -> Result<Db, Error> {
    let scheme = url.split_once(':').map(|(s, _)| s).unwrap_or_default();
    match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Db::Postgres(
            outbox::postgres::PostgresStore::connect(url, Default::default()).await?,
        )),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            let url = match url.strip_prefix("mariadb:") {
                Some(rest) => format!("mysql:{rest}"),
                None => url.to_owned(),
            };
            Ok(Db::Mysql(
                outbox::mysql::MysqlStore::connect(&url, Default::default()).await?,
            ))
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            let rest = &url["sqlite:".len()..];
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() || path.contains('?') {
                return Err(Error::invalid_input(format!(
                    "SQLite store URL {url:?} must name a file and take no options: \
                     sqlite:///absolute/path.db or sqlite://relative/path.db"
                )));
            }
            Ok(Db::Sqlite(outbox::sqlite::open_connection(
                path,
                &Default::default(),
            )?))
        }
        _ => Err(Error::invalid_input(format!(
            "the inbox lives in a SQL database: give --store a postgres://, mysql:// or \
             sqlite:// URL (compiled in: {}), not {:?}",
            outbox::store::compiled_in().join(", "),
            outbox::redact_url(url)
        ))),
    }
}

/// Run one `inbox` command against the store at `url` (`dead-letters` needs none).
pub async fn execute(url: Result<&str, Error>, command: InboxCommand) -> Result<(), Error> {
    // Check the names before connecting.
    let config = match &command {
        InboxCommand::Migrate { table }
        | InboxCommand::Purge { table, .. }
        | InboxCommand::Status { table, .. } => table.config()?,
        InboxCommand::DeadLetters {
            consumer_url,
            limit,
            json,
        } => return dead_letters(consumer_url, *limit, *json).await,
    };
    let url = url?;
    if let InboxCommand::Purge {
        consumer: Some(consumer),
        ..
    } = &command
    {
        outbox_inbox::validate_consumer(consumer)?;
    }
    let db = open(url).await?;
    match command {
        InboxCommand::Migrate { .. } => {
            migrate(&db, &config).await?;
            ops::print(&json!({"migrated": config.table()}));
            Ok(())
        }
        InboxCommand::Purge {
            older_than,
            consumer,
            batch,
            ..
        } => {
            let mut progress = Progress::new("purged", None);
            let mut purged = 0;
            loop {
                let n = purge(&db, &config, consumer.as_deref(), older_than, batch).await?;
                purged += n;
                progress.set(purged);
                if n < u64::from(batch) {
                    break;
                }
            }
            progress.finish();
            ops::print(&json!({"purged": purged}));
            Ok(())
        }
        InboxCommand::Status { json: as_json, .. } => {
            let rows = status(&db, &config).await?;
            if as_json {
                for r in &rows {
                    ops::print(&json!({
                        "consumer": r.consumer,
                        "marks": r.marks,
                        "oldest_age_seconds": r.oldest_age_seconds,
                        "newest_age_seconds": r.newest_age_seconds,
                    }));
                }
            } else {
                let cells: Vec<Vec<String>> = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.consumer.clone(),
                            r.marks.to_string(),
                            ops::age(r.oldest_age_seconds),
                            ops::age(r.newest_age_seconds),
                        ]
                    })
                    .collect();
                ops::table(&["CONSUMER", "MARKS", "OLDEST", "NEWEST"], &cells);
            }
            Ok(())
        }
        // Answered above.
        InboxCommand::DeadLetters { .. } => Ok(()),
    }
}

/// `inbox dead-letters`: the count, then the newest dead letters as a table or JSON lines.
async fn dead_letters(url: &str, limit: usize, as_json: bool) -> Result<(), Error> {
    let found = outbox_consumer::dead_letters(url, limit)
        .await
        .map_err(|e| masked(e, url))?;
    let now = SystemTime::now();
    let age = |time: Option<SystemTime>| {
        time.map(|t| now.duration_since(t).unwrap_or_default().as_secs_f64())
    };
    if as_json {
        ops::print(&json!({
            "broker": found.broker,
            "destination": found.destination,
            "count": found.count,
            "listed": found.letters.len(),
        }));
        for l in &found.letters {
            let position = match &l.position {
                DeadLetterPosition::Nats { sequence } => json!({"sequence": sequence}),
                DeadLetterPosition::Redis { entry_id } => json!({"entry_id": entry_id}),
                DeadLetterPosition::Kafka { partition, offset } => {
                    json!({"partition": partition, "offset": offset})
                }
                _ => json!(l.position.to_string()),
            };
            ops::print(&json!({
                "message_id": l.message_id,
                "consumer": l.consumer,
                "attempts": l.attempts,
                "reason": l.reason,
                "source": l.source,
                "partition_key": l.partition_key,
                "content_type": l.content_type,
                "body_bytes": l.body_bytes,
                "position": position,
                "time": l.time.map(|t| humantime::format_rfc3339_millis(t).to_string()),
                "age_seconds": age(l.time),
            }));
        }
        return Ok(());
    }
    println!(
        "{} dead letters in {} {} {}",
        found.count,
        found.broker,
        if found.broker == "kafka" {
            "topic"
        } else {
            "stream"
        },
        found.destination
    );
    if found.letters.is_empty() {
        return Ok(());
    }
    let text = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
    let cells: Vec<Vec<String>> = found
        .letters
        .iter()
        .map(|l| {
            vec![
                l.position.to_string(),
                age(l.time).map_or_else(|| "-".to_owned(), ops::age),
                text(&l.message_id),
                text(&l.consumer),
                l.attempts.map_or_else(|| "-".to_owned(), |a| a.to_string()),
                ops::cell(&text(&l.partition_key), 24),
                match &l.content_type {
                    Some(t) => format!("{} {}", l.body_bytes, ops::cell(t, 24)),
                    None => l.body_bytes.to_string(),
                },
                ops::cell(&text(&l.reason), 100),
            ]
        })
        .collect();
    ops::table(
        &[
            "POSITION",
            "AGE",
            "MESSAGE ID",
            "CONSUMER",
            "ATTEMPTS",
            "KEY",
            "BODY",
            "REASON",
        ],
        &cells,
    );
    Ok(())
}

/// `e` with a NATS token given as the URL's user name (`nats://TOKEN@host`) masked, as
/// `settings::mask_url` masks it; passwords and secret options are never in the library's
/// errors.
fn masked(e: Error, url: &str) -> Error {
    let Ok(parsed) = url::Url::parse(url) else {
        return e;
    };
    let token = parsed.username();
    let nats = matches!(parsed.scheme(), "nats" | "tls" | "ws" | "wss");
    if !nats || token.is_empty() || parsed.password().is_some() || !e.to_string().contains(token) {
        return e;
    }
    let mask = |text: &str| text.replace(token, "***");
    match e {
        Error::InvalidInput(message) => Error::invalid_input(mask(&message)),
        Error::Unavailable { what, message, .. } => {
            Error::unavailable(what, mask(&message), "see the message")
        }
        other => Error::permanent(mask(&other.to_string()), None),
    }
}

async fn migrate(db: &Db, config: &InboxConfig) -> Result<(), Error> {
    match db {
        #[cfg(feature = "postgres")]
        Db::Postgres(store) => outbox_inbox::postgres::migrate(store.pool(), config).await,
        #[cfg(feature = "mysql")]
        Db::Mysql(store) => outbox_inbox::mysql::migrate(store.pool(), config).await,
        #[cfg(feature = "sqlite")]
        Db::Sqlite(conn) => outbox_inbox::sqlite::migrate(conn, config),
    }
}

async fn purge(
    db: &Db,
    config: &InboxConfig,
    consumer: Option<&str>,
    older_than: Duration,
    batch: u32,
) -> Result<u64, Error> {
    match (db, consumer) {
        #[cfg(feature = "postgres")]
        (Db::Postgres(store), None) => {
            outbox_inbox::postgres::purge(store.pool(), config, older_than, batch).await
        }
        #[cfg(feature = "postgres")]
        (Db::Postgres(store), Some(c)) => {
            outbox_inbox::postgres::purge_consumer(store.pool(), config, c, older_than, batch).await
        }
        #[cfg(feature = "mysql")]
        (Db::Mysql(store), None) => {
            outbox_inbox::mysql::purge(store.pool(), config, older_than, batch).await
        }
        #[cfg(feature = "mysql")]
        (Db::Mysql(store), Some(c)) => {
            outbox_inbox::mysql::purge_consumer(store.pool(), config, c, older_than, batch).await
        }
        #[cfg(feature = "sqlite")]
        (Db::Sqlite(conn), None) => outbox_inbox::sqlite::purge(conn, config, older_than, batch),
        #[cfg(feature = "sqlite")]
        (Db::Sqlite(conn), Some(c)) => {
            outbox_inbox::sqlite::purge_consumer(conn, config, c, older_than, batch)
        }
    }
}

fn read_error(table: &str) -> impl Fn(String) -> Error + '_ {
    move |e| {
        Error::permanent(
            format!(
                "cannot read inbox table {table}: {e}; `outbox-relay inbox migrate` creates it"
            ),
            None,
        )
    }
}

async fn status(db: &Db, config: &InboxConfig) -> Result<Vec<ConsumerMarks>, Error> {
    match db {
        #[cfg(feature = "postgres")]
        Db::Postgres(store) => {
            let table = config.qualified('"');
            let sql = format!(
                "SELECT consumer, count(*), \
                 EXTRACT(EPOCH FROM now() - min(processed_at))::float8, \
                 EXTRACT(EPOCH FROM now() - max(processed_at))::float8 \
                 FROM {table} GROUP BY consumer ORDER BY consumer"
            );
            let rows: Vec<(String, i64, f64, f64)> = sqlx::query_as(&sql)
                .fetch_all(store.pool())
                .await
                .map_err(|e| read_error(&table)(e.to_string()))?;
            Ok(rows.into_iter().map(ConsumerMarks::from).collect())
        }
        #[cfg(feature = "mysql")]
        Db::Mysql(store) => {
            let table = config.qualified('`');
            let sql = format!(
                "SELECT consumer, count(*), \
                 CAST(TIMESTAMPDIFF(MICROSECOND, min(processed_at), UTC_TIMESTAMP(6)) AS DOUBLE) / 1e6, \
                 CAST(TIMESTAMPDIFF(MICROSECOND, max(processed_at), UTC_TIMESTAMP(6)) AS DOUBLE) / 1e6 \
                 FROM {table} GROUP BY consumer ORDER BY consumer"
            );
            // The column's binary collation makes it VARBINARY to the driver.
            let rows: Vec<(Vec<u8>, i64, f64, f64)> = sqlx::query_as(&sql)
                .fetch_all(store.pool())
                .await
                .map_err(|e| read_error(&table)(e.to_string()))?;
            Ok(rows
                .into_iter()
                .map(|(consumer, marks, oldest, newest)| {
                    let consumer = String::from_utf8_lossy(&consumer).into_owned();
                    ConsumerMarks::from((consumer, marks, oldest, newest))
                })
                .collect())
        }
        #[cfg(feature = "sqlite")]
        Db::Sqlite(conn) => {
            let table = config.qualified('"');
            let sql = format!(
                "SELECT consumer, count(*), \
                 (CAST(unixepoch('subsec') * 1000 AS INTEGER) - min(processed_at)) / 1000.0, \
                 (CAST(unixepoch('subsec') * 1000 AS INTEGER) - max(processed_at)) / 1000.0 \
                 FROM {table} GROUP BY consumer ORDER BY consumer"
            );
            let read = || -> rusqlite::Result<Vec<(String, i64, f64, f64)>> {
                let mut stmt = conn.prepare(&sql)?;
                let rows =
                    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
                rows.collect()
            };
            let rows = read().map_err(|e| read_error(&table)(e.to_string()))?;
            Ok(rows.into_iter().map(ConsumerMarks::from).collect())
        }
    }
}

impl From<(String, i64, f64, f64)> for ConsumerMarks {
    fn from((consumer, marks, oldest, newest): (String, i64, f64, f64)) -> Self {
        Self {
            consumer,
            marks,
            oldest_age_seconds: oldest,
            newest_age_seconds: newest,
        }
    }
}
