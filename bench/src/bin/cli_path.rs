//! Benchmark: the program users run (`outbox-relay drain`) against the library path of the store
//! bench, side by side in one run, interleaved rounds; prints a Markdown table for
//! BENCHMARKS.md (issue 31).
//!
//! ```text
//! eval "$(scripts/services)"
//! cargo build --release -p outbox-cli --bin outbox-relay && \
//! cargo run --release -p outbox-bench --bin cli_path -- [sqlite,mysql|all] [rounds=3]
//!     [messages=200000] [keys=1000] [paths=lib,cli] [settings=defaults,recommended]
//!     [writer=sql|sql_v1|sql_rows|sql_rows_v4|enqueue]
//! ```
//!
//! For each store (SQLite: a file in a temporary directory; MariaDB: `OUTBOX_TEST_MYSQL_URL`,
//! a fresh table per drain, dropped afterwards), each settings row and each path, every round:
//! MESSAGES rows written by plain SQL over KEYS partition keys (one `INSERT ... SELECT`, as a
//! service in another language writes them; not timed), then drained by
//! - `lib`: the library path exactly as the store bench (`bench/src/main.rs`, `sidebyside`)
//!   drains: `Relay::run_until_idle` into the in-memory `RecordingPublisher`, a `SqliteStore`
//!   opened on the file, or a `MysqlStore` over a pool of 8 connections;
//! - `lib_stdout`: the same relay into the `stdout://` publisher writing to `/dev/null` (what
//!   the program publishes with), to tell the publisher's cost from the program's;
//! - `cli`: the release `outbox-relay drain` process (`--broker stdout://`, standard output to
//!   `/dev/null`, standard error read for its start line and closing stats), timed from its
//!   start to its exit;
//! - `cli_before`: the same with the binary named by `OUTBOX_RELAY_BIN_BEFORE` (e.g. one built
//!   from `main` in another worktree), for a before/after in one run.
//!
//! Settings rows: `defaults` (no flags: the store's choices) and `recommended` (the README's
//! "Speed": MariaDB batches of 1,000 with one in flight; SQLite has no other recommendation), each
//! keeping published rows and deleting them (`--delete-published`). Rounds alternate which path
//! goes first. It prints, per row, the median rate of each path, its ratio to `lib`, and the
//! CPU time (user + system) per message of the relay: this process's own for the library paths
//! (for SQLite that includes the database, which runs in-process), the `outbox-relay` child's
//! whole life for the program (read from this process's reaped-children times); for MariaDB
//! also the server's (`mariadbd`). The program's start line (batch size, claim shards and where
//! each came from) is printed once per row, so the effective settings of both paths can be
//! compared.
//!
//! The `outbox-relay` binary is the one beside this program (`target/release/outbox-relay`),
//! or `OUTBOX_RELAY_BIN`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use outbox_backend_mysql::{MysqlConfig, MysqlStore};
use outbox_backend_sqlite::{SqliteConfig, SqliteStore};
use outbox_bench::{check_key_order, load_average, median, thousands, CpuReading};
use outbox_engine::{Relay, RelayConfig};
use outbox_memory::RecordingPublisher;
use outbox_traits::{OutboxStore, Publisher};
use tokio::process::Command;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxResult<T> = Result<T, BoxError>;

/// The payload's filler, as `outbox_bench::payload` (about 200 bytes of JSON in all).
const NOTE: &str = "benchmark payload of about two hundred bytes, as in the raw SQL limits table";

/// Command-line options.
#[derive(Debug, Clone)]
struct Opts {
    stores: Vec<String>,
    rounds: usize,
    messages: usize,
    keys: usize,
    paths: Vec<String>,
    settings: Vec<String>,
    /// `sql` (default): rows written by plain SQL in one `INSERT ... SELECT`, ids from the
    /// table's default (SQLite: a v7 whose time is the statement's, so one statement's rows are
    /// in random order among themselves; MariaDB: a v7 from the insert trigger, version 1 before
    /// 2026-11-28); `sql_v1` (MariaDB): the same with `UUID()` (v1) given as the id, as the
    /// default was before; `sql_rows` (SQLite): one `INSERT`
    /// per row, ids from the default; `sql_rows_v4` (SQLite): the same with the random v4 id the
    /// default was before 2026-11-28 (MariaDB writes `sql` for both); `enqueue`: written by the library's
    /// `enqueue_batch` in batches of 500, as the store bench writes them (ids UUIDv7, in time
    /// order).
    writer: String,
}

const STORES: [&str; 2] = ["sqlite", "mysql"];
const PATHS: [&str; 4] = ["lib", "lib_stdout", "cli", "cli_before"];
const SETTINGS: [&str; 2] = ["defaults", "recommended"];

fn list(value: &str, allowed: &[&str], what: &str) -> BoxResult<Vec<String>> {
    value
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            if allowed.contains(&s) {
                Ok(s.to_owned())
            } else {
                Err(format!("unknown {what} {s:?}; use {}", allowed.join(", ")).into())
            }
        })
        .collect()
}

impl Opts {
    fn parse() -> BoxResult<Self> {
        let mut o = Opts {
            stores: vec![],
            rounds: 3,
            messages: 200_000,
            keys: 1_000,
            paths: vec!["lib".into(), "cli".into()],
            settings: SETTINGS.iter().map(|s| (*s).to_owned()).collect(),
            writer: "sql".to_owned(),
        };
        for arg in std::env::args().skip(1) {
            let Some((key, value)) = arg.split_once('=') else {
                if arg == "all" {
                    o.stores = STORES.iter().map(|s| (*s).to_owned()).collect();
                } else {
                    o.stores.extend(list(&arg, &STORES, "store")?);
                }
                continue;
            };
            match key {
                "rounds" => o.rounds = value.parse::<usize>()?.max(1),
                "messages" => o.messages = value.parse::<usize>()?.max(1),
                "keys" => o.keys = value.parse::<usize>()?.max(1),
                "paths" => o.paths = list(value, &PATHS, "path")?,
                "settings" => o.settings = list(value, &SETTINGS, "settings")?,
                "writer" => {
                    o.writer = list(
                        value,
                        &["sql", "sql_v1", "sql_rows", "sql_rows_v4", "enqueue"],
                        "writer",
                    )?
                    .concat()
                }
                _ => {
                    return Err(format!(
                        "unknown option {key:?}; use rounds, messages, keys, paths, settings, \
                         writer"
                    )
                    .into())
                }
            }
        }
        if o.stores.is_empty() {
            o.stores = STORES.iter().map(|s| (*s).to_owned()).collect();
        }
        if o.paths.is_empty() {
            return Err("paths= names no path".into());
        }
        Ok(o)
    }
}

/// One settings row of one store.
#[derive(Debug, Clone)]
struct Setting {
    store: &'static str,
    /// `defaults` or `recommended`.
    name: &'static str,
    delete: bool,
    /// `--batch-size`, `--concurrency` (`None`: not given, the program's default).
    batch: Option<usize>,
    concurrency: Option<usize>,
}

impl Setting {
    fn label(&self) -> String {
        format!(
            "{} {}, {}",
            self.store,
            self.name,
            if self.delete {
                "published rows deleted"
            } else {
                "published rows kept"
            }
        )
    }

    /// The flags the program is given (also shown in the table).
    fn flags(&self) -> Vec<String> {
        let mut flags = vec![];
        if let Some(b) = self.batch {
            flags.extend(["--batch-size".to_owned(), b.to_string()]);
        }
        if let Some(c) = self.concurrency {
            flags.extend(["--concurrency".to_owned(), c.to_string()]);
        }
        if self.delete {
            flags.push("--delete-published".to_owned());
        }
        flags
    }

    /// The library's config at the same settings: what is not given is the library's default,
    /// as the program leaves it.
    fn relay(&self) -> Result<RelayConfig, outbox_traits::Error> {
        RelayConfig::builder()
            .batch_size(self.batch)
            .concurrency(
                self.concurrency
                    .unwrap_or(RelayConfig::default().concurrency()),
            )
            .build()
    }
}

fn settings_of(store: &'static str, names: &[String]) -> Vec<Setting> {
    let mut out = vec![];
    for name in names {
        let (name, batch, concurrency) = match (store, name.as_str()) {
            ("mysql", "recommended") => ("recommended", Some(1_000), Some(1)),
            // SQLite: the README recommends nothing besides deleting published rows, which
            // both rows of the defaults cover.
            ("sqlite", "recommended") => continue,
            _ => ("defaults", None, None),
        };
        for delete in [false, true] {
            out.push(Setting {
                store,
                name,
                delete,
                batch,
                concurrency,
            });
        }
    }
    out
}

/// One timed drain.
#[derive(Debug, Clone, Copy)]
struct Run {
    rate: f64,
    /// Relay CPU µs per message (for SQLite, with the database).
    relay_us: f64,
    /// Database server CPU µs per message (0 for SQLite).
    db_us: f64,
}

/// CPU seconds of this process's reaped children (`cutime + cstime` of `/proc/self/stat`).
fn children_cpu() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let close = stat.rfind(')')?;
            let fields: Vec<&str> = stat.get(close + 2..)?.split(' ').collect();
            // After the name: cutime is field 16, cstime 17 (indexes 13 and 14 from state).
            let ticks = fields
                .get(13..15)?
                .iter()
                .map(|f| f.parse::<u64>().ok())
                .sum::<Option<u64>>()?;
            Some(ticks as f64 / 100.0)
        })
        .unwrap_or(0.0)
}

/// Own CPU seconds of this process (user + system), without reaped children.
fn self_cpu() -> f64 {
    outbox_bench::process_cpu(std::process::id()).unwrap_or(0.0)
}

fn relay_bin(var: &str) -> BoxResult<PathBuf> {
    if let Ok(bin) = std::env::var(var) {
        return Ok(bin.into());
    }
    if var != "OUTBOX_RELAY_BIN" {
        return Err(format!("path cli_before needs {var} (the binary to compare against)").into());
    }
    Ok(std::env::current_exe()?.with_file_name("outbox-relay"))
}

// ---------------------------------------------------------------------------------------------
// Writing the backlog by SQL.

fn sqlite_write(path: &Path, messages: usize, keys: usize) -> BoxResult<()> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    conn.execute_batch("BEGIN IMMEDIATE")?;
    conn.execute(
        "WITH RECURSIVE g(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n + 1 < ?1)
         INSERT INTO outbox (aggregatetype, aggregateid, type, payload, partition_key)
         SELECT 'order', 'order-' || n, 'order.placed',
                json_object('order', n, 'customer', 'customer-' || (n % ?2),
                            'total_cents', 1000 + n, 'note', ?3),
                'customer-' || (n % ?2)
         FROM g",
        rusqlite::params![messages as i64, keys as i64, NOTE],
    )?;
    conn.execute_batch("COMMIT; PRAGMA wal_checkpoint(TRUNCATE);")?;
    Ok(())
}

/// The random (v4) id expression that was the SQLite table's default before 2026-11-28.
const SQLITE_V4_ID: &str = "lower(hex(randomblob(4))) || '-' || lower(hex(randomblob(2))) || \
     '-4' || substr(lower(hex(randomblob(2))), 2) || '-' || substr('89ab', 1 + (random() & 3), \
     1) || substr(lower(hex(randomblob(2))), 2) || '-' || lower(hex(randomblob(6)))";

/// MESSAGES rows written by SQL one `INSERT` per row (a service writing one message per business
/// transaction; here in one transaction, not timed): `writer=sql_rows` leaves `id` to the
/// table's default, `writer=sql_rows_v4` gives the random v4 id the default was before, for the
/// default's cost side by side.
fn sqlite_write_rows(path: &Path, messages: usize, keys: usize, v4: bool) -> BoxResult<()> {
    let conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let (id_col, id_val) = if v4 {
        ("id, ", format!("{SQLITE_V4_ID}, "))
    } else {
        ("", String::new())
    };
    {
        let mut stmt = conn.prepare(&format!(
            "INSERT INTO outbox ({id_col}aggregatetype, aggregateid, type, payload, partition_key)
             VALUES ({id_val}'order', 'order-' || ?1, 'order.placed',
                     json_object('order', ?1, 'customer', 'customer-' || (?1 % ?2),
                                 'total_cents', 1000 + ?1, 'note', ?3),
                     'customer-' || (?1 % ?2))"
        ))?;
        for n in 0..messages {
            stmt.execute(rusqlite::params![n as i64, keys as i64, NOTE])?;
        }
    }
    conn.execute_batch("COMMIT; PRAGMA wal_checkpoint(TRUNCATE);")?;
    Ok(())
}

/// A fresh SQLite file with MESSAGES rows written by SQL; the directory is removed on drop.
async fn sqlite_backlog(o: &Opts, delete: bool) -> BoxResult<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.db");
    let config = SqliteConfig::builder().delete_published(delete).build()?;
    SqliteStore::open(&path, config).await?.migrate().await?;
    let (p, messages, keys) = (path.clone(), o.messages, o.keys);
    if o.writer == "enqueue" {
        let config = SqliteConfig::builder().delete_published(delete).build()?;
        tokio::task::spawn_blocking(move || {
            outbox_bench::sqlite_enqueue(&p, &config, messages, keys, 500)?;
            let conn = rusqlite::Connection::open(&p)?;
            conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE);")?;
            Ok::<_, BoxError>(())
        })
        .await??;
    } else {
        let writer = o.writer.clone();
        tokio::task::spawn_blocking(move || match writer.as_str() {
            "sql_rows" => sqlite_write_rows(&p, messages, keys, false),
            "sql_rows_v4" => sqlite_write_rows(&p, messages, keys, true),
            _ => sqlite_write(&p, messages, keys),
        })
        .await??;
    }
    Ok((dir, path))
}

async fn mysql_backlog(
    pool: &sqlx::MySqlPool,
    o: &Opts,
    delete: bool,
) -> BoxResult<(MysqlConfig, String)> {
    let table = format!("cli_path_{}", uuid::Uuid::new_v4().simple());
    let config = MysqlConfig::builder()
        .table(&table)
        .delete_published(delete)
        .build()?;
    MysqlStore::new(pool.clone(), config.clone())
        .migrate()
        .await?;
    if o.writer == "enqueue" {
        for chunk in (0..o.messages).collect::<Vec<_>>().chunks(500) {
            let batch: Vec<_> = chunk
                .iter()
                .map(|&n| outbox_bench::message(n, o.keys))
                .collect();
            let mut tx = pool.begin().await?;
            outbox_backend_mysql::enqueue_batch(&mut *tx, &config, &batch).await?;
            tx.commit().await?;
        }
    }
    // MariaDB's sequence engine: seq_0_to_N, in statements of 50,000 rows.
    let chunk = 50_000;
    let mut from = 0;
    let (id_col, id_val) = if o.writer == "sql_v1" {
        ("id, ", "UUID(), ")
    } else {
        ("", "")
    };
    while o.writer != "enqueue" && from < o.messages {
        let to = (from + chunk).min(o.messages) - 1;
        sqlx::query(&format!(
            "INSERT INTO {} ({id_col}aggregatetype, aggregateid, type, payload, partition_key)
             SELECT {id_val}'order', CONCAT('order-', seq), 'order.placed',
                    JSON_OBJECT('order', seq, 'customer', CONCAT('customer-', seq % ?),
                                'total_cents', 1000 + seq, 'note', ?),
                    CONCAT('customer-', seq % ?)
             FROM seq_{from}_to_{to}",
            config.qualified_table()
        ))
        .bind(o.keys as i64)
        .bind(NOTE)
        .bind(o.keys as i64)
        .execute(pool)
        .await?;
        from = to + 1;
    }
    sqlx::raw_sql(&format!("ANALYZE TABLE {}", config.qualified_table()))
        .execute(pool)
        .await?;
    Ok((config, table))
}

// ---------------------------------------------------------------------------------------------
// The drains.

/// The library path: `run_until_idle` into the recording publisher (`stdout: false`) or the
/// stdout publisher writing to /dev/null.
async fn drain_lib(
    store: Arc<dyn OutboxStore>,
    setting: &Setting,
    messages: usize,
    stdout: bool,
    db: Option<&'static str>,
) -> BoxResult<Run> {
    let recording = Arc::new(RecordingPublisher::new());
    let publisher: Arc<dyn Publisher> = if stdout {
        Arc::new(outbox::StdoutPublisher::to_writer(std::fs::File::create(
            "/dev/null",
        )?))
    } else {
        recording.clone()
    };
    let relay = Relay::new(store, publisher, setting.relay()?)?;
    let (cpu0, procs0) = (self_cpu(), CpuReading::now());
    let started = Instant::now();
    let stats = relay.run_until_idle().await?;
    let wall = started.elapsed().as_secs_f64();
    let (cpu1, procs1) = (self_cpu(), CpuReading::now());
    if stats.published as usize != messages {
        return Err(format!(
            "{}: library drain published {} of {messages}",
            setting.label(),
            stats.published
        )
        .into());
    }
    if !stdout {
        check_key_order(recording.published().iter().map(|d| &d.message))?;
    }
    let per = |secs: f64| secs * 1e6 / messages as f64;
    Ok(Run {
        rate: messages as f64 / wall,
        relay_us: per(cpu1 - cpu0),
        db_us: db.map_or(0.0, |name| per(procs1.since(&procs0, name))),
    })
}

/// The program path: `outbox-relay drain`, timed from its start to its exit. Returns the run
/// and the program's start line.
async fn drain_cli(
    bin: &Path,
    store_args: &[String],
    setting: &Setting,
    messages: usize,
    db: Option<&'static str>,
) -> BoxResult<(Run, String)> {
    let mut args: Vec<String> = store_args.to_vec();
    args.extend(["--broker".to_owned(), "stdout://".to_owned()]);
    args.extend(setting.flags());
    args.push("drain".to_owned());
    let (cpu0, procs0) = (children_cpu(), CpuReading::now());
    let started = Instant::now();
    let child = Command::new(bin)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let out = child.wait_with_output().await?;
    let wall = started.elapsed().as_secs_f64();
    let (cpu1, procs1) = (children_cpu(), CpuReading::now());
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{} drain failed: {stderr}", bin.display()).into());
    }
    // The closing stats: the last line, one JSON object.
    let stats: serde_json::Value = stderr
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| format!("no stats line from the program: {stderr}"))?;
    if stats["published"].as_u64() != Some(messages as u64) {
        return Err(format!(
            "{}: program published {} of {messages}",
            setting.label(),
            stats["published"]
        )
        .into());
    }
    // From "relay started" on: without the timestamp, the same settings print the same line.
    let start_line = stderr
        .lines()
        .find_map(|l| l.find("relay started").and_then(|at| l.get(at..)))
        .unwrap_or("")
        .to_owned();
    let per = |secs: f64| secs * 1e6 / messages as f64;
    Ok((
        Run {
            rate: messages as f64 / wall,
            relay_us: per(cpu1 - cpu0),
            db_us: db.map_or(0.0, |name| per(procs1.since(&procs0, name))),
        },
        start_line,
    ))
}

/// One drain of `setting` by `path` on a fresh backlog.
async fn one(
    o: &Opts,
    setting: &Setting,
    path: &str,
    mysql: Option<&(sqlx::MySqlPool, String)>,
    start_lines: &mut Vec<String>,
) -> BoxResult<Run> {
    let cli_bin = match path {
        "cli" => Some(relay_bin("OUTBOX_RELAY_BIN")?),
        "cli_before" => Some(relay_bin("OUTBOX_RELAY_BIN_BEFORE")?),
        _ => None,
    };
    let mut keep_line = |line: String| {
        let line = format!("{path}: {line}");
        if !start_lines.contains(&line) {
            start_lines.push(line);
        }
    };
    match setting.store {
        "sqlite" => {
            let (_dir, file) = sqlite_backlog(o, setting.delete).await?;
            match cli_bin {
                Some(bin) => {
                    let store = vec!["--store".to_owned(), format!("sqlite://{}", file.display())];
                    let (run, line) = drain_cli(&bin, &store, setting, o.messages, None).await?;
                    keep_line(line);
                    Ok(run)
                }
                None => {
                    let config = SqliteConfig::builder()
                        .delete_published(setting.delete)
                        .build()?;
                    let store = Arc::new(SqliteStore::open(&file, config).await?);
                    drain_lib(store, setting, o.messages, path == "lib_stdout", None).await
                }
            }
        }
        _ => {
            let (pool, url) = mysql.ok_or("no MariaDB pool")?;
            let (config, table) = mysql_backlog(pool, o, setting.delete).await?;
            let result = match cli_bin {
                Some(bin) => {
                    let store = vec![
                        "--store".to_owned(),
                        url.clone(),
                        "--table".to_owned(),
                        table,
                    ];
                    drain_cli(&bin, &store, setting, o.messages, Some("mariadbd"))
                        .await
                        .map(|(run, line)| {
                            keep_line(line);
                            run
                        })
                }
                None => {
                    let store = Arc::new(MysqlStore::new(pool.clone(), config.clone()));
                    drain_lib(
                        store,
                        setting,
                        o.messages,
                        path == "lib_stdout",
                        Some("mariadbd"),
                    )
                    .await
                }
            };
            sqlx::raw_sql(&config.drop_sql()).execute(pool).await?;
            result
        }
    }
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    let o = Opts::parse()?;
    let mysql = if o.stores.iter().any(|s| s == "mysql") {
        let url = std::env::var("OUTBOX_TEST_MYSQL_URL")
            .ok()
            .filter(|v| !v.trim().is_empty())
            .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".to_owned());
        // As the store bench's pool (sidebyside): 8 connections.
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .map_err(|e| outbox_url::redact_url(&e.to_string()))?;
        Some((pool, url))
    } else {
        None
    };
    let mut rows: Vec<Setting> = vec![];
    for store in &o.stores {
        let store: &'static str = if store == "sqlite" { "sqlite" } else { "mysql" };
        rows.extend(settings_of(store, &o.settings));
    }
    eprintln!(
        "cores: {}, load average at start: {:?}",
        outbox_bench::cores(),
        load_average()
    );
    // runs[row][path]
    let mut runs: Vec<Vec<Vec<Run>>> = vec![vec![vec![]; o.paths.len()]; rows.len()];
    let mut start_lines: Vec<Vec<String>> = vec![vec![]; rows.len()];
    for round in 0..o.rounds {
        for (r, setting) in rows.iter().enumerate() {
            // Alternate which path goes first.
            let order: Vec<usize> = if round % 2 == 0 {
                (0..o.paths.len()).collect()
            } else {
                (0..o.paths.len()).rev().collect()
            };
            for p in order {
                let path = &o.paths[p];
                let run = one(&o, setting, path, mysql.as_ref(), &mut start_lines[r]).await?;
                eprintln!(
                    "round {}: {} by {path}: {} msg/s, relay CPU {:.1} µs/msg, db {:.1}",
                    round + 1,
                    setting.label(),
                    thousands(run.rate),
                    run.relay_us,
                    run.db_us
                );
                runs[r][p].push(run);
            }
        }
    }
    println!(
        "| settings | flags | path | msg/s (rounds) | median | vs lib | relay CPU µs/msg | db CPU µs/msg |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (r, setting) in rows.iter().enumerate() {
        let lib = o
            .paths
            .iter()
            .position(|p| p == "lib")
            .and_then(|p| median(&runs[r][p].iter().map(|x| x.rate).collect::<Vec<_>>()));
        for (p, path) in o.paths.iter().enumerate() {
            let of = |f: fn(&Run) -> f64| {
                median(&runs[r][p].iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
            };
            let rate = of(|x| x.rate);
            let rates: Vec<String> = runs[r][p].iter().map(|x| thousands(x.rate)).collect();
            let flags = setting.flags().join(" ");
            println!(
                "| {} | {} | {path} | {} | **{}** | {} | {:.1} | {} |",
                setting.label(),
                if flags.is_empty() { "(none)" } else { &flags },
                rates.join(" / "),
                thousands(rate),
                lib.map_or("–".to_owned(), |l| format!("{:.2}×", rate / l)),
                of(|x| x.relay_us),
                if setting.store == "sqlite" {
                    "in-process".to_owned()
                } else {
                    format!("{:.1}", of(|x| x.db_us))
                },
            );
        }
    }
    println!();
    for (r, setting) in rows.iter().enumerate() {
        for line in &start_lines[r] {
            println!("- {}: {}", setting.label(), line.trim());
        }
    }
    eprintln!("load average at end: {:?}", load_average());
    Ok(())
}
