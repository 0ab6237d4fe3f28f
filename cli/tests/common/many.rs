//! What the many-outbox tests share (`many.rs`, `many_drain.rs`, `many_kill.rs`): outboxes in
//! Postgres schemas and SQLite files written by the test, an `outbox-relay --config` process
//! and its log, and the relay's HTTP endpoints.

// Each test binary compiles this module; not every one uses every helper.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outbox::NewMessage;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{BoxError, BIN, GUARD};

/// The `n`th message of outbox `outbox`, keyed by one of four keys of that outbox.
pub fn message(outbox: &str, n: usize) -> NewMessage {
    keyed(outbox, n, 4)
}

/// The `n`th message of outbox `outbox`, keyed by one of `keys` keys of that outbox; its id
/// and key name the outbox, so a message delivered under another outbox is recognised.
pub fn keyed(outbox: &str, n: usize, keys: usize) -> NewMessage {
    NewMessage::new(
        "order",
        format!("{outbox}-{n}"),
        "placed",
        serde_json::json!({"outbox": outbox, "n": n}),
    )
    .with_partition_key(format!("{outbox}-key-{}", n % keys))
}

/// The ids of `messages`, as text.
pub fn ids(messages: &[NewMessage]) -> Vec<String> {
    messages.iter().map(|m| m.id.to_string()).collect()
}

/// One outbox the test writes to directly, as a service would: a Postgres schema or a SQLite
/// file.
#[derive(Clone)]
pub enum Outbox {
    Postgres { pool: sqlx::PgPool, schema: String },
    Sqlite { path: PathBuf },
}

impl Outbox {
    /// The outbox in Postgres schema `schema`.
    pub fn postgres(pool: &sqlx::PgPool, schema: &str) -> Self {
        Outbox::Postgres {
            pool: pool.clone(),
            schema: schema.to_owned(),
        }
    }

    /// The outbox in the SQLite file at `path`.
    pub fn sqlite(path: &Path) -> Self {
        Outbox::Sqlite {
            path: path.to_owned(),
        }
    }

    /// Create the outbox table (and the Postgres schema).
    pub async fn create(&self) -> Result<(), BoxError> {
        match self {
            Outbox::Postgres { pool, schema } => {
                outbox::postgres::migrate(pool, &pg_config(schema)?).await?;
            }
            Outbox::Sqlite { path } => {
                let config = outbox::sqlite::SqliteConfig::default();
                let conn = outbox::sqlite::open_connection(path, &config)?;
                outbox::sqlite::migrate(&conn, &config)?;
            }
        }
        Ok(())
    }

    /// Enqueue `messages` in one transaction, then commit it or roll it back: their ids.
    pub async fn write(
        &self,
        messages: &[NewMessage],
        commit: bool,
    ) -> Result<Vec<String>, BoxError> {
        match self {
            Outbox::Postgres { pool, schema } => {
                let config = pg_config(schema)?;
                let mut tx = pool.begin().await?;
                for chunk in messages.chunks(1000) {
                    outbox::postgres::enqueue_batch(&mut *tx, &config, chunk).await?;
                }
                super::fleet::finish(tx, commit).await?;
            }
            Outbox::Sqlite { path } => {
                // rusqlite blocks (a relay holding the write lock makes it wait): off the
                // runtime's workers.
                let (path, batch) = (path.clone(), messages.to_vec());
                tokio::task::spawn_blocking(move || {
                    let config = outbox::sqlite::SqliteConfig::default();
                    let mut conn = outbox::sqlite::open_connection(&path, &config)?;
                    let tx = conn.transaction()?;
                    outbox::sqlite::enqueue_batch(&tx, &config, &batch)?;
                    if commit {
                        tx.commit()?;
                    } else {
                        tx.rollback()?;
                    }
                    Ok::<_, BoxError>(())
                })
                .await??;
            }
        }
        Ok(ids(messages))
    }

    /// Create the outbox and commit its messages `0..n`: their ids.
    pub async fn with(&self, name: &str, n: usize) -> Result<Vec<String>, BoxError> {
        self.create().await?;
        self.enqueue(name, 0..n).await
    }

    /// Commit messages `range` of outbox `name`: their ids.
    pub async fn enqueue(
        &self,
        name: &str,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<String>, BoxError> {
        let messages: Vec<NewMessage> = range.map(|i| message(name, i)).collect();
        self.write(&messages, true).await
    }

    /// Every stored message's payload text by id: what the relay publishes byte for byte
    /// (Postgres normalises JSON text).
    pub async fn payloads(&self) -> Result<HashMap<String, String>, BoxError> {
        Ok(match self {
            Outbox::Postgres { pool, schema } => sqlx::query_as(&format!(
                "SELECT id::text, payload::text FROM \"{schema}\".outbox"
            ))
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect(),
            Outbox::Sqlite { path } => {
                let conn = outbox::sqlite::open_connection(path, &Default::default())?;
                let mut stmt = conn.prepare("SELECT id, payload FROM outbox")?;
                let rows = stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?;
                rows.collect::<Result<_, _>>()?
            }
        })
    }

    /// The pending, leased and dead counts of the outbox.
    pub async fn left(&self) -> Result<(u64, u64, u64), BoxError> {
        let counts = match self {
            Outbox::Postgres { pool, schema } => {
                let store = outbox::postgres::PostgresStore::new(pool.clone(), pg_config(schema)?);
                outbox::OutboxAdmin::counts(&store).await?
            }
            Outbox::Sqlite { path } => {
                let store = outbox::sqlite::SqliteStore::open(
                    path,
                    outbox::sqlite::SqliteConfig::default(),
                )
                .await?;
                outbox::OutboxAdmin::counts(&store).await?
            }
        };
        Ok((counts.pending, counts.leased, counts.dead))
    }
}

fn pg_config(schema: &str) -> Result<outbox::postgres::PostgresConfig, BoxError> {
    Ok(outbox::postgres::PostgresConfig::builder()
        .schema(schema.to_owned())
        .build()?)
}

/// Create `schema` with its outbox table on the Postgres at `pool` and commit `n` messages:
/// their ids.
pub async fn pg_outbox(
    pool: &sqlx::PgPool,
    schema: &str,
    n: usize,
) -> Result<Vec<String>, BoxError> {
    Outbox::postgres(pool, schema).with(schema, n).await
}

/// Drop `schemas` (and their tables).
pub async fn drop_schemas(pool: &sqlx::PgPool, schemas: &[String]) -> Result<(), BoxError> {
    for schema in schemas {
        sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// `outbox-relay --config CONFIG run`, its standard error into a log file beside the
/// configuration (printed by [`Relay::fail`]).
pub struct Relay {
    pub child: tokio::process::Child,
    log: PathBuf,
}

impl Relay {
    pub fn start(config: &Path) -> Result<Self, BoxError> {
        Self::start_logging(config, &config.with_extension("log"))
    }

    /// Start it with its log in `log` (a restarted relay's beside its predecessor's).
    pub fn start_logging(config: &Path, log: &Path) -> Result<Self, BoxError> {
        let child = tokio::process::Command::new(BIN)
            .arg("--config")
            .arg(config)
            .arg("run")
            .env("RUST_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(log)?)
            .kill_on_drop(true)
            .spawn()?;
        Ok(Self {
            child,
            log: log.to_owned(),
        })
    }

    /// The relay's log, for a failure report.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Add the relay's warnings to a failure.
    pub fn fail<T>(&self, result: Result<T, BoxError>) -> Result<T, BoxError> {
        result.map_err(|e| {
            let log = self.log();
            eprintln!("{e}\nrelay log:\n{log}");
            let warnings: Vec<&str> = log
                .lines()
                .filter(|l| !l.contains(" INFO ") || std::env::var_os("MANY_LOG").is_some())
                .take(200)
                .collect();
            format!("{e}\nrelay log (not INFO):\n{}", warnings.join("\n")).into()
        })
    }

    /// SIGKILL, and wait until the process is gone.
    pub async fn kill(mut self) -> Result<(), BoxError> {
        self.child.start_kill()?;
        tokio::time::timeout(GUARD, self.child.wait()).await??;
        Ok(())
    }

    /// SIGTERM, and wait for a clean exit: its log.
    pub async fn stop(mut self) -> Result<String, BoxError> {
        super::sigterm(&self.child).await?;
        let status = tokio::time::timeout(GUARD, self.child.wait()).await??;
        let log = self.log();
        if !status.success() {
            return Err(format!("relay exited with {status}:\n{log}").into());
        }
        Ok(log)
    }
}

/// `outbox-relay --config CONFIG drain` to its end: its exit success, and its standard error.
pub async fn drain(config: &Path) -> Result<(bool, String), BoxError> {
    let mut command = super::command(["--config".as_ref(), config.as_os_str(), "drain".as_ref()]);
    command.env("RUST_LOG", "info");
    let out = super::output(command).await?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// A relay's closing summary: the last line of its standard error that is a JSON object with
/// `outboxes`.
pub fn summary(stderr: &str) -> Result<Value, BoxError> {
    stderr
        .lines()
        .rev()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|v| v.get("outboxes").is_some())
        .ok_or_else(|| format!("no summary line in:\n{stderr}").into())
}

/// `GET path`: the status code and body.
pub async fn get(addr: &str, path: &str) -> Result<(u16, String), BoxError> {
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut text = String::new();
    conn.read_to_string(&mut text).await?;
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no HTTP header")?;
    let code = head.split_whitespace().nth(1).ok_or("no status")?.parse()?;
    Ok((code, body.to_owned()))
}

/// The sum of `metric`'s samples carrying `outbox="name"`, by outbox.
pub fn by_outbox(text: &str, metric: &str) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric) else {
            continue;
        };
        if !rest.starts_with('{') {
            continue;
        }
        let Some(start) = rest.find("outbox=\"") else {
            continue;
        };
        let name = &rest[start + 8..];
        let Some(end) = name.find('"') else { continue };
        let value: f64 = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *sums.entry(name[..end].to_owned()).or_insert(0.0) += value;
    }
    sums
}

/// Wait (polling the endpoint, [`GUARD`] at most) until `check` holds for `GET path`.
pub async fn until_http<F>(addr: &str, path: &str, what: &str, check: F) -> Result<String, BoxError>
where
    F: Fn(u16, &str) -> bool,
{
    let deadline = Instant::now() + GUARD;
    loop {
        if let Ok((code, body)) = get(addr, path).await {
            if check(code, &body) {
                return Ok(body);
            }
            if Instant::now() > deadline {
                return Err(format!("{path} never showed {what}: {code} {body}").into());
            }
        } else if Instant::now() > deadline {
            return Err(format!("{path} never answered").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
