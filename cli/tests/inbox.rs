//! `outbox-relay inbox migrate | status | purge`, run as a separate process against a SQLite
//! file and the real Postgres and MariaDB servers (each test in a schema or database of its
//! own). The marks are written with the inbox library, as consumers write them, then aged
//! with SQL: nothing waits for time to pass.

use std::path::Path;

use outbox_conformance_tests::env::service_url;
use outbox_e2e::unique_suffix;
use outbox_inbox::{InboxConfig, Uuid};
use serde_json::{json, Value};

mod common;
use common::{json_lines, run, BoxError};

type TestResult = Result<(), BoxError>;

/// Where a test's inbox lives and how the test writes and ages marks there.
enum Db {
    Postgres(sqlx::PgPool),
    Mysql(sqlx::MySqlPool),
    Sqlite(std::path::PathBuf),
}

struct Case {
    db: Db,
    store: String,
    /// `--inbox-schema` for Postgres and MariaDB, none for SQLite.
    schema: Option<String>,
    config: InboxConfig,
}

impl Case {
    fn args<'a>(&'a self, command: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["--store", self.store.as_str(), "inbox"];
        args.extend_from_slice(command);
        if let Some(schema) = &self.schema {
            args.extend(["--inbox-schema", schema.as_str()]);
        }
        args
    }

    /// Record `n` new marks for `consumer`, as a consumer's transaction does.
    async fn record(&self, consumer: &str, n: usize) -> TestResult {
        let ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
        match &self.db {
            Db::Postgres(pool) => {
                outbox_inbox::postgres::record_batch(pool, &self.config, consumer, &ids).await?;
            }
            Db::Mysql(pool) => {
                outbox_inbox::mysql::record_batch(pool, &self.config, consumer, &ids).await?;
            }
            Db::Sqlite(path) => {
                let conn = open_sqlite(path)?;
                outbox_inbox::sqlite::record_batch(&conn, &self.config, consumer, &ids)?;
            }
        }
        Ok(())
    }

    /// Make every mark of `consumer` two hours older.
    async fn age(&self, consumer: &str) -> TestResult {
        let table = match &self.db {
            Db::Mysql(_) => self.config.qualified('`'),
            _ => self.config.qualified('"'),
        };
        match &self.db {
            Db::Postgres(pool) => {
                sqlx::query(&format!(
                    "UPDATE {table} SET processed_at = processed_at - interval '2 hours' \
                     WHERE consumer = $1"
                ))
                .bind(consumer)
                .execute(pool)
                .await?;
            }
            Db::Mysql(pool) => {
                sqlx::query(&format!(
                    "UPDATE {table} SET processed_at = processed_at - INTERVAL 2 HOUR \
                     WHERE consumer = ?"
                ))
                .bind(consumer)
                .execute(pool)
                .await?;
            }
            Db::Sqlite(path) => {
                open_sqlite(path)?.execute(
                    &format!(
                        "UPDATE {table} SET processed_at = processed_at - 7200000 \
                         WHERE consumer = ?1"
                    ),
                    [consumer],
                )?;
            }
        }
        Ok(())
    }

    async fn clean_up(&self) -> TestResult {
        match (&self.db, &self.schema) {
            (Db::Postgres(pool), Some(schema)) => {
                sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
                    .execute(pool)
                    .await?;
            }
            (Db::Mysql(pool), Some(schema)) => {
                sqlx::query(&format!("DROP DATABASE IF EXISTS `{schema}`"))
                    .execute(pool)
                    .await?;
            }
            _ => {}
        }
        Ok(())
    }
}

fn open_sqlite(path: &Path) -> Result<rusqlite::Connection, BoxError> {
    Ok(outbox::sqlite::open_connection(path, &Default::default())?)
}

/// The status lines by consumer: (marks, oldest age in seconds).
async fn status(case: &Case) -> Result<Vec<(String, i64, f64)>, BoxError> {
    let lines = json_lines(case.args(&["status", "--json"])).await?;
    lines
        .iter()
        .map(|line: &Value| {
            let field = |name: &str| line.get(name).cloned().unwrap_or(Value::Null);
            Ok((
                field("consumer").as_str().ok_or("no consumer")?.to_owned(),
                field("marks").as_i64().ok_or("no marks")?,
                field("oldest_age_seconds").as_f64().ok_or("no age")?,
            ))
        })
        .collect()
}

/// Migrate, status, a purge of one consumer, then of all, on one store.
async fn migrate_status_and_purge(case: &Case) -> TestResult {
    let table = case.config.table();
    assert_eq!(
        json_lines(case.args(&["migrate"])).await?,
        [json!({"migrated": table})]
    );
    // Idempotent.
    json_lines(case.args(&["migrate"])).await?;
    assert_eq!(status(case).await?, []);

    case.record("payments", 5).await?;
    case.record("shipping", 3).await?;
    case.age("payments").await?;
    case.age("shipping").await?;
    case.record("payments", 2).await?; // fresh: no purge below takes them

    let before = status(case).await?;
    let consumers: Vec<(&str, i64)> = before.iter().map(|(c, n, _)| (c.as_str(), *n)).collect();
    assert_eq!(consumers, [("payments", 7), ("shipping", 3)]);
    assert!(
        before.iter().all(|(_, _, age)| *age >= 7000.0),
        "{before:?}"
    );

    // One consumer, in batches of 2: 5 old marks take three statements.
    let purged = json_lines(case.args(&[
        "purge",
        "--older-than",
        "1h",
        "--consumer",
        "payments",
        "--batch",
        "2",
    ]))
    .await?;
    assert_eq!(purged, [json!({"purged": 5})]);
    let after: Vec<(String, i64)> = status(case)
        .await?
        .into_iter()
        .map(|(c, n, _)| (c, n))
        .collect();
    assert_eq!(
        after,
        [("payments".to_owned(), 2), ("shipping".to_owned(), 3)]
    );

    // Every consumer.
    let purged = json_lines(case.args(&["purge", "--older-than", "1h"])).await?;
    assert_eq!(purged, [json!({"purged": 3})]);
    let left: Vec<(String, i64)> = status(case)
        .await?
        .into_iter()
        .map(|(c, n, _)| (c, n))
        .collect();
    assert_eq!(left, [("payments".to_owned(), 2)]);
    Ok(())
}

#[tokio::test]
async fn sqlite_inbox_migrate_status_and_purge() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("payments.db");
    let case = Case {
        store: format!("sqlite://{}", path.display()),
        db: Db::Sqlite(path),
        schema: None,
        config: InboxConfig::default(),
    };
    migrate_status_and_purge(&case).await
}

#[tokio::test]
async fn postgres_inbox_migrate_status_and_purge() -> TestResult {
    let Some(url) = service_url("OUTBOX_TEST_POSTGRES_URL") else {
        return Ok(());
    };
    let schema = format!("inbox_cli_{}", unique_suffix());
    let case = Case {
        db: Db::Postgres(sqlx::PgPool::connect(&url).await?),
        store: url,
        config: InboxConfig::builder().schema(&schema).build()?,
        schema: Some(schema),
    };
    let outcome = migrate_status_and_purge(&case).await;
    case.clean_up().await?;
    outcome
}

#[tokio::test]
async fn mariadb_inbox_migrate_status_and_purge() -> TestResult {
    let Some(url) = service_url("OUTBOX_TEST_MYSQL_URL") else {
        return Ok(());
    };
    let schema = format!("inbox_cli_{}", unique_suffix());
    let case = Case {
        db: Db::Mysql(sqlx::MySqlPool::connect(&url).await?),
        store: url,
        config: InboxConfig::builder().schema(&schema).build()?,
        schema: Some(schema),
    };
    let outcome = migrate_status_and_purge(&case).await;
    case.clean_up().await?;
    outcome
}

/// Bad arguments are refused before anything is opened or written, with a message that says
/// what to give instead.
#[tokio::test]
async fn bad_arguments_are_refused_before_anything_is_written() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("never.db");
    let store = format!("sqlite://{}", path.display());
    let cases: [(&[&str], i32, &str); 4] = [
        (
            &["purge", "--older-than", "1h", "--batch", "0"],
            2,
            "must be 1 to 10000",
        ),
        (&["purge", "--older-than", "soon"], 2, "older-than"),
        (
            &["migrate", "--inbox-table", "bad name"],
            1,
            "inbox table name",
        ),
        (
            &["purge", "--older-than", "1h", "--consumer", ""],
            1,
            "consumer name is empty",
        ),
    ];
    for (command, code, says) in cases {
        let mut args = vec!["--store", store.as_str(), "inbox"];
        args.extend_from_slice(command);
        let out = run(&args).await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{command:?}: {stderr}");
        assert!(stderr.contains(says), "{command:?}: {stderr}");
    }
    assert!(!path.exists(), "nothing is opened for refused arguments");
    let out = run(&["--store", "redis://127.0.0.1:6379", "inbox", "status"]).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("postgres://, mysql:// or sqlite://"),
        "{stderr}"
    );
    Ok(())
}
