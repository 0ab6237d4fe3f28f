//! Crash tests with real processes: the relay runs as its own OS process (the `crash-relay`
//! binary), is SIGKILLed at a failpoint (or SIGSTOPped there and resumed as a zombie), and a
//! fresh relay process recovers. Producers are processes too, killed inside their transaction
//! (F9a) or right after its COMMIT (F9b).
//!
//! The matrix is {postgres, sqlite} x {redis, nats} x these points (the relay points hit the
//! third batch), plus {postgres, sqlite} x kafka x {F1, F2, F3, F4a, F6, F7, F10, F11} (Kafka
//! cases cost about 3 s each, so it leaves out F4, F9a and F9b, where nothing is published
//! twice and nothing depends on the broker):
//!
//! | point | the crash | duplicates allowed (Redis, Kafka; never on NATS) |
//! |---|---|---|
//! | F1 | relay killed after a claim returned, before publishing | none |
//! | F2 | killed after the broker stored the first half of the batch | that half |
//! | F3 | killed after the broker acknowledged the batch, before `complete` | the batch |
//! | F4a | killed while `complete` is in flight: committed or not, whichever the kill decided | the batch if it was not committed, else none |
//! | F4 | killed after `complete` returned | none |
//! | F6 | the publish is held after the broker stored the batch; lease 2 s, killed inside the engine's lease extension at half-time | the batch |
//! | F7 | a poison message is rejected permanently; killed after the `fail` that dead-letters it returned; at the end it is the one dead message, never published | none |
//! | F9a | only the producer crash every case has: killed inside its open transaction | none |
//! | F9b | a second producer killed right after its COMMIT returned | none |
//! | F10 | killed at F1; after its leases expire, the recovering relay is killed at its first claim (the same batch); a third relay drains | none |
//! | F11 | relay stopped at F3, its lease expires, another relay drains everything, then it resumes: a zombie the store must fence | the batch |
//!
//! Every case checks, reading the broker back with its own client: every committed message
//! arrived byte-equal; nothing of a rolled-back or killed-before-commit transaction did; the
//! first copies of each key came in commit order; duplicates are same-id copies of the
//! interrupted batch only, and only where the failpoint makes them unavoidable (none at all on
//! NATS, whose `Nats-Msg-Id` dedup drops them); at the end nothing is pending or leased, and
//! nothing is dead but F7's poison message.
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
use outbox_conformance_tests::process::process_stopped;
use outbox_e2e::crash::{self, message};
use outbox_e2e::{check_delivery, kafka, nats, redis, unique_suffix, Expected, Received};
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
/// F6's lease: short, so that the engine extends it (at half-time) during the held publish.
const F6_LEASE_MS: u64 = 2000;
/// Partitions of a case's Kafka topic.
const KAFKA_PARTITIONS: i32 = 3;

/// Where the crash happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    /// The relay is killed after a claim returned, before publishing.
    F1,
    /// Killed after the broker stored half of the batch.
    F2,
    /// Killed after the broker acknowledged the batch, before the store marked it.
    F3,
    /// Killed while the store's complete is in flight (before or after the database commits).
    F4a,
    /// Killed after the store marked the batch published.
    F4,
    /// The publish is held after the broker stored the batch; killed inside the lease extension.
    F6,
    /// Killed after the fail that dead-letters a poison message returned.
    F7,
    /// Only the producer crash every case has: killed inside its open transaction.
    F9a,
    /// A second producer is killed right after its COMMIT returned.
    F9b,
    /// Killed at F1; the recovering relay is killed at its first claim, a third one drains.
    F10,
    /// The relay is stopped at F3, its lease expires, another relay drains everything, then it
    /// resumes: a zombie, which the store must fence.
    F11,
}

impl Point {
    /// The binary's failpoint for a relay crash.
    fn relay_failpoint(self) -> Option<&'static str> {
        match self {
            Point::F1 | Point::F10 => Some("F1"),
            Point::F2 => Some("F2"),
            Point::F3 | Point::F11 => Some("F3"),
            Point::F4a => Some("F4a"),
            Point::F4 => Some("F4"),
            Point::F6 => Some("F6"),
            Point::F7 => Some("F7"),
            Point::F9a | Point::F9b => None,
        }
    }

    /// Which pass of the failpoint the crashing relay stops at: the third batch, except F7's,
    /// which fires at the first dead-lettering (the poison message is in the third batch).
    fn hit(self) -> usize {
        match self {
            Point::F7 => 1,
            _ => HIT,
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

    /// SIGSTOP the process and wait until the kernel reports every thread of it stopped.
    async fn stop(&self) {
        self.signal("STOP");
        let start = Instant::now();
        while !process_stopped(self.pid()) {
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
        let store = SqliteStore::open(&path, SqliteConfig::default())
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let store = Arc::new(store);
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

    /// The settings of a relay process: as [`Source::env`], with the Postgres connections
    /// named, so that [`Source::relays_gone`] can tell when the server is done with a killed
    /// relay's sessions.
    fn relay_env(&self) -> Vec<(&'static str, String)> {
        let mut env = self.env();
        if let Db::Postgres { url, config, .. } = &self.db {
            let sep = if url.contains('?') { '&' } else { '?' };
            let url = format!("{url}{sep}application_name={}", self.relay_app_name(config));
            for (k, v) in &mut env {
                if *k == crash::POSTGRES_URL {
                    *v = url.clone();
                }
            }
        }
        env
    }

    fn relay_app_name(&self, config: &PostgresConfig) -> String {
        format!("crash-relay-{}", config.schema())
    }

    /// Wait until the server has ended every session of the killed relays: a statement a relay
    /// sent before the kill (F4a's complete) is then committed or rolled back for good, so the
    /// state the test reads is the state the next relay finds. SQLite needs no wait: a killed
    /// process's unfinished transaction is gone with it.
    async fn relays_gone(&self) {
        let Db::Postgres { pool, config, .. } = &self.db else {
            return;
        };
        let name = self.relay_app_name(config);
        let start = Instant::now();
        loop {
            let (sessions,): (i64,) =
                sqlx::query_as("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                    .bind(&name)
                    .fetch_one(pool)
                    .await
                    .unwrap();
            if sessions == 0 {
                return;
            }
            assert!(
                start.elapsed() < GUARD,
                "the server still has {sessions} sessions of killed relays"
            );
            tokio::task::yield_now().await;
        }
    }

    /// The committed message numbered `n` (see [`crash::message`]).
    fn committed_message(&self, n: usize) -> &NewMessage {
        let aggregate = crash::aggregate_id(n);
        self.committed
            .iter()
            .find(|m| m.aggregate_id == aggregate)
            .unwrap_or_else(|| panic!("message {n} was not committed"))
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

    /// The distinct ends of the current leases, in Unix milliseconds.
    async fn lease_ends(&self) -> BTreeSet<String> {
        self.query_rows(
            "SELECT floor(extract(epoch FROM lease_until) * 1000)::bigint::text FROM {t} \
             WHERE lease_token IS NOT NULL",
            "SELECT lease_until FROM {t} WHERE state = 'leased'",
        )
        .await
        .into_iter()
        .map(|mut row| row.remove(0))
        .collect()
    }

    /// Ids of the dead messages.
    async fn dead(&self) -> BTreeSet<String> {
        self.query_rows(
            "SELECT id::text FROM {t} WHERE state = 'dead'",
            "SELECT id FROM {t} WHERE state = 'dead'",
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
    Kafka { brokers: String, topic: String },
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

    fn kafka() -> Option<Broker> {
        Some(Broker::Kafka {
            brokers: service_url("OUTBOX_TEST_KAFKA_BROKERS")?,
            topic: format!("crash-{}", unique_suffix()),
        })
    }

    /// Create the destination where the publisher does not (the Kafka topic).
    async fn create(&self) {
        if let Broker::Kafka { brokers, topic } = self {
            kafka::create_topic(brokers, topic, KAFKA_PARTITIONS)
                .await
                .unwrap();
        }
    }

    /// The URL the relay processes publish to (the NATS stream is created by the publisher).
    fn relay_url(&self) -> String {
        match self {
            Broker::Nats { url, stream } => format!(
                "{url}?subject={}.{{aggregate_type}}.{{event_type}}&stream={stream}&create_stream=true",
                stream.to_lowercase()
            ),
            Broker::Redis { url, stream } => format!("{url}?stream={stream}"),
            Broker::Kafka { brokers, topic } => format!("kafka://{brokers}?topic={topic}"),
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
            Broker::Kafka { brokers, topic } => {
                kafka::read_topic(brokers, topic, KAFKA_PARTITIONS).await
            }
        }
        .unwrap();
        match self {
            Broker::Nats { url, stream } => nats::delete_stream(url, stream).await,
            Broker::Redis { url, stream } => redis::delete(url, stream).await,
            Broker::Kafka { brokers, topic } => kafka::delete_topic(brokers, topic).await,
        }
        .unwrap();
        received
    }
}

/// The poison message of F7: a message of the third batch whose key has a later message in the
/// same batch, so that the dead-lettering also leaves a not-attempted message behind. Its
/// number is its index among the committed messages of the first phase.
fn poison_number() -> usize {
    let batch = (HIT - 1) * BATCH..HIT * BATCH;
    batch
        .clone()
        .find(|&n| (n + 1..batch.end).any(|later| crash::key(later) == crash::key(n)))
        .expect("the third batch repeats a key")
}

/// One case of the matrix: write the scenario (a rolled-back transaction and a producer killed
/// inside its transaction included), crash at `point`, recover with a fresh relay process, and
/// check the broker and the store.
async fn crash_case(mut source: Source, broker: Broker, point: Point) {
    broker.create().await;
    let mut relay_env = source.relay_env();
    relay_env.push((crash::BROKER_URL, broker.relay_url()));
    let poison = (point == Point::F7).then(poison_number);
    if let Some(n) = poison {
        // Every relay of the case rejects it, the recovering one too.
        relay_env.push((crash::POISON, n.to_string()));
    }

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
    let poison_id = poison.map(|n| source.committed_message(n).id.to_string());

    // The first relay, killed (or stopped) at its failpoint.
    let mut batch: Vec<String> = Vec::new();
    let mut prefix = 0;
    let mut zombie = None;
    if let Some(failpoint) = point.relay_failpoint() {
        let mut env = relay_env.clone();
        env.push((crash::FAILPOINT, format!("{failpoint}:{}", point.hit())));
        if point == Point::F11 {
            env.push((crash::FAILPOINT_ACTION, "wait".into()));
        }
        if point == Point::F6 {
            env.push((crash::LEASE_MS, F6_LEASE_MS.to_string()));
        }
        let mut relay = Proc::spawn("crashing relay", "relay", &env, point == Point::F11);
        let details = relay.wait_for(&format!("reached {failpoint}")).await;
        if point == Point::F7 {
            let dead = id_list(field(&details, "dead").expect("the relay names the dead"));
            assert_eq!(
                Some(&dead),
                poison_id.as_ref().map(|id| vec![id.clone()]).as_ref(),
                "the poison message, and only it, is dead-lettered"
            );
        } else {
            batch = id_list(field(&details, "batch").expect("the relay names the batch"));
        }
        if point == Point::F6 {
            // The extension is stored: the batch's lease ends where `extend` said (a claim's
            // lease would end a half-lease earlier).
            let until = number(&details, "lease until").to_string();
            assert_eq!(
                source.lease_ends().await,
                BTreeSet::from([until]),
                "the held batch's lease ends where the extension put it"
            );
        }
        if point == Point::F2 {
            prefix = number(&details, "prefix") as usize;
            assert!(prefix > 0 && prefix < batch.len(), "{details:?}");
        }
        if point == Point::F11 {
            relay.stop().await;
            zombie = Some(relay);
        } else {
            relay.kill().await;
            source.relays_gone().await;
        }
    }
    if point == Point::F10 {
        // Startup recovery: the crashed relay's leases expire and the next relay is killed at
        // its first claim, which must be the expired batch, taken over whole.
        assert_eq!(source.expire_leases().await, BATCH as u64);
        let mut env = relay_env.clone();
        env.push((crash::FAILPOINT, "F1:1".into()));
        let mut relay = Proc::spawn("recovering relay killed at F1", "relay", &env, false);
        let details = relay.wait_for("reached F1").await;
        let taken_over = id_list(field(&details, "batch").expect("the relay names the batch"));
        assert_eq!(
            taken_over.iter().collect::<BTreeSet<_>>(),
            batch.iter().collect::<BTreeSet<_>>(),
            "the recovering relay's first claim takes over the expired batch"
        );
        relay.kill().await;
        source.relays_gone().await;
    }
    if let Some(f9a) = f9a.take() {
        f9a.kill().await;
    }

    // What the crash left: one batch leased (F1, F2, F3, F6, F10, F11), none (F4, F9a, F9b),
    // either (F4a), or the poison's not-attempted key-mates (F7); the batches before it
    // published.
    let leased = source.leased().await;
    let at_crash = source.counts().await;
    let batch_set: BTreeSet<String> = batch.iter().cloned().collect();
    // F4a: whether the kill came after the database committed the complete.
    let completed = point == Point::F4a && leased.is_empty();
    let mut dead = 0;
    let published_at_crash = match point {
        Point::F1 | Point::F2 | Point::F3 | Point::F6 | Point::F10 | Point::F11 => {
            assert_eq!(
                leased, batch_set,
                "the interrupted batch is what stays leased"
            );
            (HIT - 1) * BATCH
        }
        Point::F4a if !completed => {
            assert_eq!(
                leased, batch_set,
                "an uncommitted complete leaves the whole batch leased"
            );
            (HIT - 1) * BATCH
        }
        Point::F4 | Point::F4a => {
            assert!(leased.is_empty(), "{leased:?}");
            assert!(
                batch_set.is_subset(&source.published().await),
                "the batch was marked published"
            );
            HIT * BATCH
        }
        Point::F7 => {
            // The third batch: its messages before the poison and those of other keys are
            // published, the poison is dead, and its key's later messages in the batch were not
            // attempted and are still leased (the release never ran).
            let n = poison.unwrap();
            let mates: BTreeSet<String> = (n + 1..HIT * BATCH)
                .filter(|&m| crash::key(m) == crash::key(n))
                .map(|m| source.committed_message(m).id.to_string())
                .collect();
            assert!(!mates.is_empty());
            assert_eq!(leased, mates, "the poison's key-mates stay leased");
            dead = 1;
            assert_eq!(
                source.dead().await,
                poison_id.iter().cloned().collect::<BTreeSet<_>>(),
                "the poison is dead once its fail returned"
            );
            HIT * BATCH - 1 - mates.len()
        }
        Point::F9a | Point::F9b => {
            assert!(leased.is_empty(), "{leased:?}");
            0
        }
    };
    let batched = point.relay_failpoint().is_some() && point != Point::F7;
    assert_eq!(batch.len(), if batched { BATCH } else { 0 });
    assert_eq!(
        at_crash.published, published_at_crash as u64,
        "{at_crash:?}"
    );
    assert_eq!(at_crash.dead, dead);

    // Recovery: the crashed relay's leases expire (shifted back, not waited for) and a fresh
    // relay process drains everything.
    assert_eq!(source.expire_leases().await, leased.len() as u64);
    let out = Proc::spawn("recovering relay", "relay", &relay_env, false)
        .finish()
        .await;
    assert_eq!(field(&out, "lease lost"), None, "{out:?}");
    assert_eq!(at_crash.published + number(&out, "drained"), total - dead);

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

    // At the end nothing is pending or leased; nothing is dead but F7's poison.
    let counts = source.counts().await;
    assert_eq!(
        (counts.pending, counts.leased, counts.dead, counts.published),
        (0, 0, dead, total - dead),
        "{counts:?}"
    );
    if point == Point::F7 {
        assert_eq!(
            source.dead().await,
            poison_id.iter().cloned().collect::<BTreeSet<_>>(),
            "the dead message is the poison"
        );
    }
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
    for id in source.never_committed.iter().chain(&poison_id) {
        assert!(
            !received.iter().any(|r| &r.id == id),
            "message {id} was published: it never committed, or it is the dead poison message"
        );
    }
    let expected: Vec<Expected> = source
        .expected()
        .await
        .into_iter()
        .filter(|e| Some(&e.id) != poison_id.as_ref())
        .collect();
    let delivery = check_delivery(&received, &expected).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(delivery.distinct as u64, total - dead);
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
        Point::F1 | Point::F4 | Point::F7 | Point::F9a | Point::F9b | Point::F10 => BTreeSet::new(),
        Point::F2 => batch[..prefix].iter().cloned().collect(),
        Point::F4a if completed => BTreeSet::new(),
        Point::F3 | Point::F4a | Point::F6 | Point::F11 => batch_set.clone(),
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
    if point == Point::F4a {
        eprintln!(
            "F4a: the kill came {} the complete committed",
            if completed { "after" } else { "before" }
        );
    }
    source.cleanup().await;
}

macro_rules! crash_matrix {
    ($($module:ident: $source:ident -> $broker:ident [$points:ident];)*) => {$(
        mod $module {
            use super::*;
            crash_matrix!(@$points $source $broker);
        }
    )*};
    (@all $source:ident $broker:ident) => {
        crash_matrix!(@points $source $broker;
            f1_after_claim: F1,
            f2_after_part_of_batch_stored: F2,
            f3_after_ack_before_complete: F3,
            f4a_during_complete: F4a,
            f4_after_complete: F4,
            f6_during_lease_extension: F6,
            f7_during_dead_letter: F7,
            f9a_producer_killed_before_commit: F9a,
            f9b_producer_killed_after_commit: F9b,
            f10_recovery_killed_at_first_claim: F10,
            f11_zombie_relay_is_fenced: F11,
        );
    };
    // Kafka cases cost about 3 s each (its publishes on Tansu are slow): the points where the
    // broker stored part or all of the interrupted batch (its duplicates are Kafka's own, no
    // dedup across producer restarts), the dead-letter transition (the publisher's
    // not-attempted key-mates), the zombie, and a crash before publishing, once plain and once
    // with the recovery crashing too.
    (@kafka $source:ident $broker:ident) => {
        crash_matrix!(@points $source $broker;
            f1_after_claim: F1,
            f2_after_part_of_batch_stored: F2,
            f3_after_ack_before_complete: F3,
            f4a_during_complete: F4a,
            f6_during_lease_extension: F6,
            f7_during_dead_letter: F7,
            f10_recovery_killed_at_first_claim: F10,
            f11_zombie_relay_is_fenced: F11,
        );
    };
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
    postgres_to_redis: postgres -> redis [all];
    postgres_to_nats: postgres -> nats [all];
    sqlite_to_redis: sqlite -> redis [all];
    sqlite_to_nats: sqlite -> nats [all];
    postgres_to_kafka: postgres -> kafka [kafka];
    sqlite_to_kafka: sqlite -> kafka [kafka];
}
