//! Crash tests with real processes: the relay runs as its own OS process (the `crash-relay`
//! binary), is SIGKILLed at a failpoint (or SIGSTOPped there and resumed as a zombie), and a
//! fresh relay process recovers. Producers are processes too, killed inside their transaction
//! (F9a) or right after its COMMIT (F9b).
//!
//! Every case checks, reading the broker back with its own client: every committed message
//! arrived byte-equal; nothing of a rolled-back or killed-before-commit transaction did; the
//! first copies of each key came in commit order; duplicates are same-id copies of the
//! interrupted batch only, and only where the failpoint makes them unavoidable (none at all on
//! NATS, whose `Nats-Msg-Id` dedup drops them); at the end nothing is pending, leased or dead.
//!
//! Nothing sleeps: the harness waits for the line a process prints at its failpoint, for a
//! process to exit, or for a condition it polls; leases are expired by shifting them back in SQL.
//! Time limits are failure guards only.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::postgres::{PostgresConfig, PostgresStore};
use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{Counts, NewMessage, OutboxAdmin};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::crash::{self, message};
use outbox_e2e::{check_delivery, nats, redis, unique_suffix, Expected, Received};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::task::JoinHandle;

/// Committed transactions before and again after the producer crashes, [`PER_TX`] messages each:
/// 192 committed messages in all (204 with F9b's), about 10 relay batches over 20 keys.
const TXS: usize = 8;
const PER_TX: usize = 12;
/// The relay's batch size, and which batch the relay failpoints hit.
const BATCH: usize = crash::DEFAULT_BATCH;
const HIT: usize = 3;
/// Numbers of the messages of each kind of transaction (see [`crash::message`]).
const ROLLED_BACK_FROM: usize = 5000;
const F9A_FROM: usize = 6000;
const F9B_FROM: usize = 7000;
/// Failure guard for every wait; a passing case never gets near it.
const GUARD: Duration = Duration::from_secs(60);

/// Where the crash happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    /// The relay is killed after a claim returned, before publishing.
    F1,
    /// Killed after the broker stored half of the batch.
    F2,
    /// Killed after the broker acknowledged the batch, before the store marked it.
    F3,
    /// Killed after the store marked the batch published.
    F4,
    /// Only the producer crash every case has: killed inside its open transaction.
    F9a,
    /// A second producer is killed right after its COMMIT returned.
    F9b,
    /// The relay is stopped at F3, its lease expires, another relay drains everything, then it
    /// resumes: a zombie, which the store must fence.
    F11,
}

impl Point {
    /// The binary's failpoint for a relay crash.
    fn relay_failpoint(self) -> Option<&'static str> {
        match self {
            Point::F1 => Some("F1"),
            Point::F2 => Some("F2"),
            Point::F3 | Point::F11 => Some("F3"),
            Point::F4 => Some("F4"),
            Point::F9a | Point::F9b => None,
        }
    }
}

/// A `crash-relay` child process and what it printed so far.
struct Proc {
    what: String,
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    printed: Vec<String>,
    stderr: Option<JoinHandle<String>>,
}

impl Proc {
    fn spawn(what: &str, mode: &str, env: &[(&str, String)], stdin: bool) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_crash-relay"))
            .arg(mode)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut err = child.stderr.take().unwrap();
        let stderr = tokio::spawn(async move {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text).await;
            text
        });
        Proc {
            what: what.to_owned(),
            child,
            lines,
            printed: Vec::new(),
            stderr: Some(stderr),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id().expect("the process is still running")
    }

    /// What the process wrote to stderr (once its stderr is closed, i.e. it has exited).
    async fn stderr(&mut self) -> String {
        match self.stderr.take() {
            Some(task) => task.await.unwrap_or_default(),
            None => String::new(),
        }
    }

    /// The next line, or `None` at end of output. Fails after [`GUARD`].
    async fn next_line(&mut self) -> Option<String> {
        let line = tokio::time::timeout(GUARD, self.lines.next_line())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{}: no output within {GUARD:?}; printed so far {:?}",
                    self.what, self.printed
                )
            })
            .unwrap_or_else(|e| panic!("{}: reading its output: {e}", self.what));
        if let Some(line) = &line {
            self.printed.push(line.clone());
        }
        line
    }

    /// Read until the process prints `line`; returns the lines it printed before.
    async fn wait_for(&mut self, line: &str) -> Vec<String> {
        let from = self.printed.len();
        loop {
            match self.next_line().await {
                Some(l) if l == line => return self.printed[from..self.printed.len() - 1].to_vec(),
                Some(_) => {}
                None => {
                    let status = self.child.wait().await;
                    let stderr = self.stderr().await;
                    panic!(
                        "{} ended ({status:?}) without printing {line:?}; printed {:?}, stderr: {stderr}",
                        self.what, self.printed
                    );
                }
            }
        }
    }

    /// SIGKILL the process and check that the kill is what ended it.
    async fn kill(mut self) {
        self.child.start_kill().unwrap();
        let status = tokio::time::timeout(GUARD, self.child.wait())
            .await
            .expect("a killed process ends")
            .unwrap();
        if status.signal() != Some(9) {
            let stderr = self.stderr().await;
            panic!(
                "{} ended on its own ({status}) before the kill: {:?}, stderr: {stderr}",
                self.what, self.printed
            );
        }
    }

    /// Send `signal` (e.g. `STOP`) with kill(1); the crate forbids `unsafe`, so no libc::kill.
    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([format!("-{signal}"), self.pid().to_string()])
            .status()
            .expect("kill(1) runs");
        assert!(status.success(), "kill -{signal} {} failed", self.what);
    }

    /// The process state letter from `/proc/<pid>/stat` (`T` when stopped).
    fn state(&self) -> char {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        // The command name is in parentheses and may contain spaces: the state follows it.
        let after = &stat[stat.rfind(')').unwrap() + 1..];
        after.trim_start().chars().next().unwrap()
    }

    /// SIGSTOP the process and wait until the kernel reports it stopped.
    async fn stop(&self) {
        self.signal("STOP");
        let start = Instant::now();
        while self.state() != 'T' {
            assert!(start.elapsed() < GUARD, "{} did not stop", self.what);
            tokio::task::yield_now().await;
        }
    }

    /// SIGCONT the process and send the byte its `wait` failpoint waits for.
    async fn resume(&mut self) {
        self.signal("CONT");
        let mut stdin = self.child.stdin.take().expect("started with a stdin pipe");
        stdin.write_all(b"\n").await.unwrap();
        drop(stdin);
    }

    /// Wait for a successful exit; returns everything printed after the last wait.
    async fn finish(mut self) -> Vec<String> {
        let from = self.printed.len();
        while self.next_line().await.is_some() {}
        let status = tokio::time::timeout(GUARD, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit", self.what))
            .unwrap();
        if !status.success() {
            let stderr = self.stderr().await;
            panic!(
                "{} failed ({status}); printed {:?}, stderr: {stderr}",
                self.what, self.printed
            );
        }
        self.printed[from..].to_vec()
    }
}

/// The value of the line `<label> <value>` among `lines`.
fn field<'a>(lines: &'a [String], label: &str) -> Option<&'a str> {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(label)?.strip_prefix(' '))
}

fn id_list(text: &str) -> Vec<String> {
    text.split(',').map(str::to_owned).collect()
}

fn number(lines: &[String], label: &str) -> u64 {
    field(lines, label)
        .unwrap_or_else(|| panic!("no `{label} <n>` line in {lines:?}"))
        .parse()
        .unwrap()
}

/// The outbox of one case, with what the service committed and what it must never see.
struct Source {
    db: Db,
    admin: Arc<dyn OutboxAdmin>,
    /// Committed messages, in commit order.
    committed: Vec<NewMessage>,
    /// Ids of messages whose transaction rolled back or was killed before its COMMIT.
    never_committed: Vec<String>,
}

enum Db {
    Postgres {
        url: String,
        pool: PgPool,
        config: PostgresConfig,
    },
    Sqlite {
        _dir: tempfile::TempDir,
        path: PathBuf,
    },
}

impl Source {
    async fn postgres(url: &str) -> Source {
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await
            .unwrap();
        let config = PostgresConfig::builder()
            .schema(format!("crash_{}", unique_suffix()))
            .notify(false)
            .build()
            .unwrap();
        let store = Arc::new(PostgresStore::new(pool.clone(), config.clone()));
        store.migrate().await.unwrap();
        sqlx::query(&format!(
            "CREATE TABLE {}.{} (id text PRIMARY KEY, tag text NOT NULL)",
            config.schema(),
            crash::BUSINESS_TABLE
        ))
        .execute(&pool)
        .await
        .unwrap();
        Source {
            db: Db::Postgres {
                url: url.to_owned(),
                pool,
                config,
            },
            admin: store,
            committed: Vec::new(),
            never_committed: Vec::new(),
        }
    }

    async fn sqlite() -> Source {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outbox.sqlite");
        let store = Arc::new(
            SqliteStore::open(&path, SqliteConfig::default())
                .await
                .unwrap(),
        );
        outbox::sqlite::open_connection(&path, &SqliteConfig::default())
            .unwrap()
            .execute_batch(&format!(
                "CREATE TABLE {} (id TEXT PRIMARY KEY, tag TEXT NOT NULL)",
                crash::BUSINESS_TABLE
            ))
            .unwrap();
        Source {
            db: Db::Sqlite { _dir: dir, path },
            admin: store,
            committed: Vec::new(),
            never_committed: Vec::new(),
        }
    }

    fn is_sqlite(&self) -> bool {
        matches!(self.db, Db::Sqlite { .. })
    }

    /// The binary's settings for this outbox.
    fn env(&self) -> Vec<(&'static str, String)> {
        match &self.db {
            Db::Postgres { url, config, .. } => vec![
                (crash::SOURCE, "postgres".into()),
                (crash::POSTGRES_URL, url.clone()),
                (crash::POSTGRES_SCHEMA, config.schema().into()),
            ],
            Db::Sqlite { path, .. } => vec![
                (crash::SOURCE, "sqlite".into()),
                (crash::SQLITE_PATH, path.display().to_string()),
            ],
        }
    }

    /// Enqueue `messages` in one transaction, then commit it or roll it back.
    async fn transaction(&mut self, messages: Vec<NewMessage>, commit: bool) {
        match &self.db {
            Db::Postgres { pool, config, .. } => {
                let mut tx = pool.begin().await.unwrap();
                outbox::postgres::enqueue_batch(&mut *tx, config, &messages)
                    .await
                    .unwrap();
                if commit {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
            }
            Db::Sqlite { path, .. } => {
                let config = SqliteConfig::default();
                let mut conn = outbox::sqlite::open_connection(path, &config).unwrap();
                let tx = conn
                    .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                    .unwrap();
                outbox::sqlite::enqueue_batch(&tx, &config, &messages).unwrap();
                if commit {
                    tx.commit().unwrap();
                } else {
                    tx.rollback().unwrap();
                }
            }
        }
        if commit {
            self.committed.extend(messages);
        } else {
            self.never_committed
                .extend(messages.iter().map(|m| m.id.to_string()));
        }
    }

    /// [`TXS`] committed transactions of messages numbered from `first`; with `roll_back`, one
    /// more transaction in the middle is rolled back.
    async fn commit_phase(&mut self, first: usize, roll_back: bool) {
        for t in 0..TXS {
            let from = first + t * PER_TX;
            let messages = (from..from + PER_TX)
                .map(|n| message(n, "committed"))
                .collect();
            self.transaction(messages, true).await;
            if roll_back && t == TXS / 2 {
                let messages = (ROLLED_BACK_FROM..ROLLED_BACK_FROM + PER_TX)
                    .map(|n| message(n, "rolled-back"))
                    .collect();
                self.transaction(messages, false).await;
            }
        }
    }

    /// Start a producer process that writes [`PER_TX`] messages from `first` in one transaction
    /// and parks at `failpoint`; returns it (parked) and the ids of its messages.
    async fn producer(&self, failpoint: &str, first: usize, tag: &str) -> (Proc, Vec<String>) {
        let mut env = self.env();
        env.extend([
            (crash::FAILPOINT, failpoint.to_owned()),
            (crash::PRODUCE_FIRST, first.to_string()),
            (crash::PRODUCE_COUNT, PER_TX.to_string()),
            (crash::PRODUCE_TAG, tag.to_owned()),
        ]);
        let mut producer = Proc::spawn(&format!("producer {failpoint}"), "produce", &env, false);
        let before = producer.wait_for(&format!("reached {failpoint}")).await;
        let ids = id_list(field(&before, "ids").expect("the producer prints its ids"));
        assert_eq!(ids.len(), PER_TX);
        (producer, ids)
    }

    async fn query_rows(&self, sql_postgres: &str, sql_sqlite: &str) -> Vec<Vec<String>> {
        match &self.db {
            Db::Postgres { pool, config, .. } => {
                let sql = sql_postgres.replace("{t}", config.qualified_table());
                let sql = sql.replace("{schema}", config.schema());
                let rows: Vec<sqlx::postgres::PgRow> =
                    sqlx::query(&sql).fetch_all(pool).await.unwrap();
                rows.iter()
                    .map(|row| {
                        use sqlx::Row as _;
                        (0..row.len())
                            .map(|i| row.get::<Option<String>, _>(i).unwrap_or_default())
                            .collect()
                    })
                    .collect()
            }
            Db::Sqlite { path, .. } => {
                let sql = sql_sqlite.replace("{t}", "outbox").replace("{schema}.", "");
                let conn = outbox::sqlite::open_connection(path, &SqliteConfig::default()).unwrap();
                let mut stmt = conn.prepare(&sql).unwrap();
                let width = stmt.column_count();
                stmt.query_map([], |row| {
                    (0..width)
                        .map(|i| {
                            Ok(match row.get_ref(i)? {
                                rusqlite::types::ValueRef::Null => String::new(),
                                rusqlite::types::ValueRef::Integer(n) => n.to_string(),
                                rusqlite::types::ValueRef::Text(t) => {
                                    String::from_utf8_lossy(t).into_owned()
                                }
                                other => format!("{other:?}"),
                            })
                        })
                        .collect()
                })
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap()
            }
        }
    }

    /// Ids of the messages under a lease (expired or not).
    async fn leased(&self) -> BTreeSet<String> {
        self.query_rows(
            "SELECT id::text FROM {t} WHERE lease_token IS NOT NULL",
            "SELECT id FROM {t} WHERE state = 'leased'",
        )
        .await
        .into_iter()
        .map(|mut row| row.remove(0))
        .collect()
    }

    /// Ids of the published messages.
    async fn published(&self) -> BTreeSet<String> {
        self.query_rows(
            "SELECT id::text FROM {t} WHERE state = 'published'",
            "SELECT id FROM {t} WHERE state = 'published'",
        )
        .await
        .into_iter()
        .map(|mut row| row.remove(0))
        .collect()
    }

    /// Every message's state, attempts, lease and publication time, in `seq` order: what a
    /// fenced zombie must not change.
    async fn snapshot(&self) -> Vec<Vec<String>> {
        self.query_rows(
            "SELECT id::text, state, attempts::text, lease_token::text, lease_until::text, \
             published_at::text, last_error FROM {t} ORDER BY seq",
            "SELECT id, state, attempts, lease_token, lease_until, published_at, last_error \
             FROM {t} ORDER BY seq",
        )
        .await
    }

    /// The business rows that exist.
    async fn business_rows(&self) -> HashSet<String> {
        let sql = format!("SELECT id FROM {{schema}}.{}", crash::BUSINESS_TABLE);
        self.query_rows(&sql, &sql)
            .await
            .into_iter()
            .map(|mut row| row.remove(0))
            .collect()
    }

    /// Make every lease look expired by moving its stored end an hour back: a crashed (or
    /// stopped) relay's leases once their time has passed, without waiting for it. Returns how
    /// many messages were leased.
    async fn expire_leases(&self) -> u64 {
        match &self.db {
            Db::Postgres { pool, config, .. } => sqlx::query(&format!(
                "UPDATE {} SET lease_until = lease_until - interval '1 hour' \
                 WHERE lease_token IS NOT NULL",
                config.qualified_table()
            ))
            .execute(pool)
            .await
            .unwrap()
            .rows_affected(),
            Db::Sqlite { path, .. } => {
                let conn = outbox::sqlite::open_connection(path, &SqliteConfig::default()).unwrap();
                conn.execute(
                    "UPDATE outbox SET lease_until = lease_until - 3600000 WHERE state = 'leased'",
                    [],
                )
                .unwrap() as u64
            }
        }
    }

    async fn counts(&self) -> Counts {
        self.admin.counts().await.unwrap()
    }

    /// The committed messages as the consumer must see them: in commit order, with the payload
    /// text the store holds, which must be the same JSON as what was enqueued. The table must
    /// hold nothing else.
    async fn expected(&self) -> Vec<Expected> {
        let stored: HashMap<String, String> = self
            .query_rows(
                "SELECT id::text, payload::text FROM {t}",
                "SELECT id, payload FROM {t}",
            )
            .await
            .into_iter()
            .map(|row| (row[0].clone(), row[1].clone()))
            .collect();
        for id in &self.never_committed {
            assert!(
                !stored.contains_key(id),
                "message {id} of a transaction that never committed is in the table"
            );
        }
        assert_eq!(
            stored.len(),
            self.committed.len(),
            "unexpected rows in the table"
        );
        self.committed
            .iter()
            .map(|m| {
                let text = &stored[&m.id.to_string()];
                let parsed: serde_json::Value = serde_json::from_str(text).unwrap();
                assert_eq!(parsed, m.payload, "the store changed a payload's meaning");
                Expected {
                    id: m.id.to_string(),
                    key: m.partition_key.clone(),
                    payload: text.clone().into_bytes(),
                }
            })
            .collect()
    }

    async fn cleanup(self) {
        if let Db::Postgres { pool, config, .. } = &self.db {
            sqlx::query(&format!("DROP SCHEMA {} CASCADE", config.schema()))
                .execute(pool)
                .await
                .unwrap();
        }
    }
}

/// The broker destination of one case.
enum Broker {
    Nats { url: String, stream: String },
    Redis { url: String, stream: String },
}

impl Broker {
    fn nats() -> Option<Broker> {
        Some(Broker::Nats {
            url: service_url("OUTBOX_TEST_NATS_URL")?,
            stream: format!("CRASH_{}", unique_suffix()),
        })
    }

    fn redis() -> Option<Broker> {
        Some(Broker::Redis {
            url: service_url("OUTBOX_TEST_REDIS_URL")?,
            stream: format!("crash-{}", unique_suffix()),
        })
    }

    /// The URL the relay processes publish to (the NATS stream is created by the publisher).
    fn relay_url(&self) -> String {
        match self {
            Broker::Nats { url, stream } => format!(
                "{url}?subject={}.{{aggregate_type}}.{{event_type}}&stream={stream}&create_stream=true",
                stream.to_lowercase()
            ),
            Broker::Redis { url, stream } => format!("{url}?stream={stream}"),
        }
    }

    /// Whether the broker drops a re-publish of a message id it already stored.
    fn dedups(&self) -> bool {
        matches!(self, Broker::Nats { .. })
    }

    /// Everything the broker holds, then delete the destination.
    async fn read_and_delete(&self) -> Vec<Received> {
        let received = match self {
            Broker::Nats { url, stream } => nats::read_stream(url, stream).await,
            Broker::Redis { url, stream } => redis::read_stream(url, stream).await,
        }
        .unwrap();
        match self {
            Broker::Nats { url, stream } => nats::delete_stream(url, stream).await,
            Broker::Redis { url, stream } => redis::delete(url, stream).await,
        }
        .unwrap();
        received
    }
}

/// One case of the matrix: write the scenario (a rolled-back transaction and a producer killed
/// inside its transaction included), crash at `point`, recover with a fresh relay process, and
/// check the broker and the store.
async fn crash_case(mut source: Source, broker: Broker, point: Point) {
    let mut relay_env = source.env();
    relay_env.push((crash::BROKER_URL, broker.relay_url()));

    // The service: committed transactions, one rolled back, and a producer killed inside its
    // open transaction. On Postgres the killed producer's transaction stays open while the
    // later transactions commit and the first relay runs, so its rows hold lower `seq` values
    // than committed ones and are invisible to the relay until the kill aborts them; SQLite has
    // one writer at a time, so there it is killed at once.
    source.commit_phase(0, true).await;
    let (f9a, f9a_ids) = source
        .producer("F9a", F9A_FROM, "killed-before-commit")
        .await;
    let mut f9a = Some(f9a);
    if source.is_sqlite() {
        f9a.take().unwrap().kill().await;
    }
    source.never_committed.extend(f9a_ids);
    if point == Point::F9b {
        let (f9b, ids) = source
            .producer("F9b", F9B_FROM, "killed-after-commit")
            .await;
        f9b.kill().await;
        source
            .committed
            .extend(ids.iter().enumerate().map(|(i, id)| {
                message(F9B_FROM + i, "killed-after-commit").with_id(id.parse().unwrap())
            }));
    }
    source.commit_phase(TXS * PER_TX, false).await;
    let total = source.committed.len() as u64;

    // The first relay, killed (or stopped) at its failpoint.
    let mut batch: Vec<String> = Vec::new();
    let mut prefix = 0;
    let mut zombie = None;
    if let Some(failpoint) = point.relay_failpoint() {
        let mut env = relay_env.clone();
        env.push((crash::FAILPOINT, format!("{failpoint}:{HIT}")));
        if point == Point::F11 {
            env.push((crash::FAILPOINT_ACTION, "wait".into()));
        }
        let mut relay = Proc::spawn("crashing relay", "relay", &env, point == Point::F11);
        let details = relay.wait_for(&format!("reached {failpoint}")).await;
        batch = id_list(field(&details, "batch").expect("the relay names the batch"));
        if point == Point::F2 {
            prefix = number(&details, "prefix") as usize;
            assert!(prefix > 0 && prefix < batch.len(), "{details:?}");
        }
        if point == Point::F11 {
            relay.stop().await;
            zombie = Some(relay);
        } else {
            relay.kill().await;
        }
    }
    if let Some(f9a) = f9a.take() {
        f9a.kill().await;
    }

    // What the crash left: one batch leased (F1, F2, F3, F11) or none (F4, F9a, F9b), and the
    // batches before it published.
    let leased = source.leased().await;
    let at_crash = source.counts().await;
    let batch_set: BTreeSet<String> = batch.iter().cloned().collect();
    let published_batches = match point {
        Point::F1 | Point::F2 | Point::F3 | Point::F11 => {
            assert_eq!(
                leased, batch_set,
                "the interrupted batch is what stays leased"
            );
            HIT - 1
        }
        Point::F4 => {
            assert!(leased.is_empty(), "{leased:?}");
            assert!(
                batch_set.is_subset(&source.published().await),
                "F4 comes after the batch was marked published"
            );
            HIT
        }
        Point::F9a | Point::F9b => {
            assert!(leased.is_empty(), "{leased:?}");
            0
        }
    };
    let relay_crashed = point.relay_failpoint().is_some();
    assert_eq!(batch.len(), if relay_crashed { BATCH } else { 0 });
    assert_eq!(
        at_crash.published,
        (published_batches * BATCH) as u64,
        "{at_crash:?}"
    );
    assert_eq!(at_crash.dead, 0);

    // Recovery: the crashed relay's leases expire (shifted back, not waited for) and a fresh
    // relay process drains everything.
    assert_eq!(source.expire_leases().await, leased.len() as u64);
    let out = Proc::spawn("recovering relay", "relay", &relay_env, false)
        .finish()
        .await;
    assert_eq!(field(&out, "lease lost"), None, "{out:?}");
    assert_eq!(at_crash.published + number(&out, "drained"), total);

    if let Some(mut zombie) = zombie {
        // The zombie wakes up after its batch was taken over and published by the recovering
        // relay: its complete must be refused and change nothing, and it must say so.
        let before = source.snapshot().await;
        zombie.resume().await;
        let out = zombie.finish().await;
        assert_eq!(
            number(&out, "lease lost"),
            batch.len() as u64,
            "the zombie's complete must be fenced: {out:?}"
        );
        // Its count covers its whole run: the batches it marked before it was stopped, and
        // nothing after.
        assert_eq!(number(&out, "drained"), at_crash.published, "{out:?}");
        let after = source.snapshot().await;
        let changed: Vec<_> = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| b != a)
            .take(3)
            .collect();
        assert!(
            changed.is_empty() && before.len() == after.len(),
            "the zombie changed the store, e.g. (before, after): {changed:?}"
        );
    }

    let counts = source.counts().await;
    assert_eq!(
        (counts.pending, counts.leased, counts.dead, counts.published),
        (0, 0, 0, total),
        "{counts:?}"
    );
    let business = source.business_rows().await;
    assert!(
        !business.contains(&crash::business_row(F9A_FROM)),
        "the killed transaction's business row committed"
    );
    assert_eq!(
        business.contains(&crash::business_row(F9B_FROM)),
        point == Point::F9b,
        "the business row of the producer killed after COMMIT"
    );

    // The consumer's view.
    let received = broker.read_and_delete().await;
    for id in &source.never_committed {
        assert!(
            !received.iter().any(|r| &r.id == id),
            "message {id} of a transaction that never committed was published"
        );
    }
    let expected = source.expected().await;
    let delivery = check_delivery(&received, &expected).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(delivery.distinct as u64, total);
    let mut copies: HashMap<&str, usize> = HashMap::new();
    for r in &received {
        *copies.entry(r.id.as_str()).or_default() += 1;
    }
    let duplicated: BTreeSet<String> = copies
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| (*id).to_owned())
        .collect();
    assert!(
        copies.values().all(|n| *n <= 2),
        "a message arrived 3 times"
    );
    // Which messages the broker stored before the crash and was sent again by the recovery.
    let resent: BTreeSet<String> = match point {
        Point::F1 | Point::F4 | Point::F9a | Point::F9b => BTreeSet::new(),
        Point::F2 => batch[..prefix].iter().cloned().collect(),
        Point::F3 | Point::F11 => batch_set.clone(),
    };
    if broker.dedups() {
        assert_eq!(
            delivery.duplicates, 0,
            "JetStream drops a re-publish with the same Nats-Msg-Id"
        );
    } else {
        assert_eq!(
            duplicated, resent,
            "duplicates must be exactly the interrupted batch's messages the broker had stored"
        );
    }
    source.cleanup().await;
}

macro_rules! crash_matrix {
    ($($module:ident: $source:ident -> $broker:ident;)*) => {$(
        mod $module {
            use super::*;
            crash_matrix!(@points $source $broker;
                f1_after_claim: F1,
                f2_after_part_of_batch_stored: F2,
                f3_after_ack_before_complete: F3,
                f4_after_complete: F4,
                f9a_producer_killed_before_commit: F9a,
                f9b_producer_killed_after_commit: F9b,
                f11_zombie_relay_is_fenced: F11,
            );
        }
    )*};
    (@points $source:ident $broker:ident; $($test:ident: $point:ident,)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let Some(broker) = Broker::$broker() else { return };
            let source = crash_matrix!(@source $source);
            crash_case(source, broker, Point::$point).await;
        }
    )*};
    (@source postgres) => {{
        let Some(url) = service_url("OUTBOX_TEST_POSTGRES_URL") else { return };
        Source::postgres(&url).await
    }};
    (@source sqlite) => { Source::sqlite().await };
}

crash_matrix! {
    postgres_to_redis: postgres -> redis;
    postgres_to_nats: postgres -> nats;
    sqlite_to_redis: sqlite -> redis;
    sqlite_to_nats: sqlite -> nats;
}
