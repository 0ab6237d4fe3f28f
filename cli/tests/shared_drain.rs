//! `outbox-relay drain` beside other relays, as separate processes on the real Postgres and on
//! SQLite files: a drain waits for what other relays hold instead of exiting at its first empty
//! claim, so several drains started at once on one backlog all exit 0, and the backlog is
//! empty when the first one exits. With no flags the relay runs the store's choice of claim
//! shards and batch size (Postgres: 2 and 2,000; SQLite: one claim, no warning).
//!
//! Nothing sleeps: the tests wait for the processes to exit or for the lines they print; a
//! lease the test holds is given back by the test, not waited out. Time limits are only
//! failure guards.

use std::collections::HashSet;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use outbox::store::{OpenedStore, StoreOptions};
use outbox::{ClaimRequest, HeadPolicy, NewMessage};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::unique_suffix;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

mod common;
use common::{command, message, stdout_ids, BoxError, GUARD};

type TestResult = Result<(), BoxError>;

/// One outbox on a real store: the arguments that name it, and its store opened in-process.
struct Outbox {
    args: Vec<String>,
    opened: OpenedStore,
    /// Postgres: the schema to drop at the end.
    schema: Option<(sqlx::PgPool, String)>,
}

impl Outbox {
    /// A fresh SQLite file in `dir` holding `messages`.
    async fn sqlite(dir: &Path, messages: &[NewMessage]) -> Result<Self, BoxError> {
        let path = dir.join("outbox.sqlite");
        let config = outbox::sqlite::SqliteConfig::default();
        let mut conn = outbox::sqlite::open_connection(&path, &config)?;
        outbox::sqlite::migrate(&conn, &config)?;
        let tx = conn.transaction()?;
        outbox::sqlite::enqueue_batch(&tx, &config, messages)?;
        tx.commit()?;
        let url = format!("sqlite://{}", path.display());
        let opened = outbox::store::open(&url, &StoreOptions::default()).await?;
        Ok(Self {
            args: vec!["--store".into(), url],
            opened,
            schema: None,
        })
    }

    /// A fresh schema on the Postgres at `url` holding `messages`.
    async fn postgres(url: &str, messages: &[NewMessage]) -> Result<Self, BoxError> {
        let schema = format!("drain_{}", unique_suffix());
        let options = StoreOptions {
            schema: Some(schema.clone()),
            ..StoreOptions::default()
        };
        let opened = outbox::store::open(url, &options).await?;
        opened.migrate().await?;
        let config = outbox::postgres::PostgresConfig::builder()
            .schema(schema.clone())
            .build()?;
        let pool = sqlx::PgPool::connect(url).await?;
        let mut tx = pool.begin().await?;
        for chunk in messages.chunks(1000) {
            outbox::postgres::enqueue_batch(&mut *tx, &config, chunk).await?;
        }
        tx.commit().await?;
        Ok(Self {
            args: vec![
                "--store".into(),
                url.into(),
                "--schema".into(),
                schema.clone(),
            ],
            opened,
            schema: Some((pool, schema)),
        })
    }

    /// `outbox-relay drain` into `stdout://` on this outbox, logging as `log` says; output
    /// piped, killed if the test drops it.
    fn drain(&self, log: &str) -> Result<tokio::process::Child, BoxError> {
        let mut cmd =
            command(
                self.args
                    .iter()
                    .map(String::as_str)
                    .chain(["drain", "--broker", "stdout://"]),
            );
        cmd.env("RUST_LOG", log)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        Ok(cmd.spawn()?)
    }

    async fn drop_schema(self) -> TestResult {
        if let Some((pool, schema)) = self.schema {
            sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .execute(&pool)
                .await?;
        }
        Ok(())
    }
}

/// The `published` count of a drain's closing summary (the last line of its standard error).
fn published_of(stderr: &str) -> Result<u64, BoxError> {
    let summary = stderr.lines().last().ok_or("no summary")?;
    let stats: Value = serde_json::from_str(summary)?;
    stats["published"]
        .as_u64()
        .ok_or_else(|| format!("no published count in {summary:?}").into())
}

/// Start three drains at once on `outbox`, which holds `messages`; check that every one exits
/// 0, that the backlog is empty when the first exits, that every message was published exactly
/// once between them, each key's messages in order within each drain, and return the
/// standard error of each.
async fn three_drains_share(
    outbox: &Outbox,
    messages: &[NewMessage],
) -> Result<Vec<String>, BoxError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<std::io::Result<Output>>();
    for _ in 0..3 {
        let child = outbox.drain("info")?;
        let tx = tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(child.wait_with_output().await);
        });
    }
    drop(tx);
    let first = tokio::time::timeout(GUARD, rx.recv())
        .await?
        .ok_or("no drain exited")??;
    // Read before the other drains can finish anything more.
    let counts = outbox.opened.admin.counts().await?;
    assert!(first.status.success(), "{first:?}");
    assert_eq!(
        (counts.pending, counts.leased, counts.published, counts.dead),
        (0, 0, messages.len() as u64, 0),
        "the backlog is done when the first drain exits"
    );
    let mut outputs = vec![first];
    while let Some(out) = tokio::time::timeout(GUARD, rx.recv()).await? {
        outputs.push(out?);
    }
    assert_eq!(outputs.len(), 3);

    let key_of: std::collections::HashMap<Uuid, (Option<String>, usize)> = messages
        .iter()
        .enumerate()
        .map(|(n, m)| (m.id, (m.partition_key.clone(), n)))
        .collect();
    let mut seen = HashSet::new();
    let mut published = 0;
    let mut stderrs = Vec::new();
    for out in outputs {
        let stderr = String::from_utf8(out.stderr)?;
        assert!(out.status.success(), "a drain failed: {stderr}");
        let ids = stdout_ids(&out.stdout)?;
        published += published_of(&stderr)?;
        // Within one drain, each key's messages come in their order.
        let mut last: std::collections::HashMap<Option<String>, usize> = Default::default();
        for id in &ids {
            let (key, n) = key_of.get(id).ok_or("a message that was never written")?;
            if let Some(before) = last.insert(key.clone(), *n) {
                assert!(before < *n, "key {key:?}: message {n} after {before}");
            }
            assert!(seen.insert(*id), "message {id} published twice");
        }
        stderrs.push(stderr);
    }
    assert_eq!(seen.len(), messages.len(), "every message published");
    assert_eq!(published, messages.len() as u64, "the summaries add up");
    Ok(stderrs)
}

#[tokio::test]
async fn three_drains_at_once_share_a_postgres_backlog_with_the_stores_shards() -> TestResult {
    let Some(pg_url) = service_url("OUTBOX_TEST_POSTGRES_URL") else {
        return Ok(());
    };
    // 50 keys: a first claim of 2,000 holds every key's head, so the others' first claims find
    // nothing and must wait for it.
    let messages: Vec<NewMessage> = (0..6000).map(|n| message(n, 50)).collect();
    let outbox = Outbox::postgres(&pg_url, &messages).await?;

    let stderrs = three_drains_share(&outbox, &messages).await?;

    for stderr in &stderrs {
        // No flag given: Postgres's choice, said at start.
        assert!(
            stderr.contains("batch_size=2000") && stderr.contains("claim_shards=2"),
            "{stderr}"
        );
        assert!(stderr.contains("claim_shards_from=\"store\""), "{stderr}");
    }
    outbox.drop_schema().await
}

#[tokio::test]
async fn three_drains_at_once_share_a_sqlite_backlog_with_one_claim_and_no_warning() -> TestResult {
    let dir = tempfile::tempdir()?;
    // 30 keys: a first claim of 500 holds every key's head.
    let messages: Vec<NewMessage> = (0..3000).map(|n| message(n, 30)).collect();
    let outbox = Outbox::sqlite(dir.path(), &messages).await?;

    let stderrs = three_drains_share(&outbox, &messages).await?;

    for stderr in &stderrs {
        assert!(
            stderr.contains("batch_size=500") && stderr.contains("claim_shards=1"),
            "{stderr}"
        );
        assert!(!stderr.contains("WARN"), "no warning: {stderr}");
    }
    Ok(())
}

/// A drain that finds some keys' heads leased by another relay publishes the rest, waits (it
/// does not exit), and publishes the held keys once they are given back.
async fn waits_for_a_lease_held_elsewhere(outbox: &Outbox, messages: &[NewMessage]) -> TestResult {
    // "Another relay": the heads of customer-0 and customer-1 (the first two rows).
    let held = outbox
        .opened
        .store
        .claim(&ClaimRequest {
            limit: 2,
            lease: Duration::from_secs(600),
            head_policy: HeadPolicy::Block,
            shard: None,
        })
        .await?;
    let held_ids: Vec<Uuid> = held.messages.iter().map(|m| m.id).collect();
    assert_eq!(held_ids, [messages[0].id, messages[1].id]);

    // At debug, the relay logs each drain round's end with what the store showed.
    let mut drain = outbox.drain("info,outbox_engine=debug")?;
    let stderr = drain.stderr.take().ok_or("stderr")?;
    let (log_tx, mut log_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if log_tx.send(line).is_err() {
                break;
            }
        }
    });
    let stdout = drain.stdout.take().ok_or("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let free: Vec<Uuid> = messages
        .iter()
        .filter(|m| m.partition_key.as_deref() == Some("customer-2"))
        .map(|m| m.id)
        .collect();
    let mut printed = Vec::new();
    while printed.len() < free.len() {
        let line = tokio::time::timeout(GUARD, lines.next_line())
            .await??
            .ok_or("the drain stopped printing")?;
        printed.extend(stdout_ids(line.as_bytes())?);
    }
    assert_eq!(printed, free, "the free key, in order");
    // The drain has found nothing more to claim, seen the two leases, and decided to wait.
    loop {
        let line = tokio::time::timeout(GUARD, log_rx.recv())
            .await?
            .ok_or("the drain ended its log without waiting for the leases")?;
        if line.contains("drain round over") && line.contains("leased=2") {
            assert!(line.contains("next=Wait"), "{line}");
            break;
        }
    }
    assert!(
        drain.try_wait()?.is_none(),
        "the drain exited while another relay held messages"
    );

    outbox.opened.store.release(held.token, &held_ids).await?;
    while let Some(line) = tokio::time::timeout(GUARD, lines.next_line()).await?? {
        printed.extend(stdout_ids(line.as_bytes())?);
    }
    let status = tokio::time::timeout(GUARD, drain.wait()).await??;
    assert!(status.success(), "{status}");
    let mut all: Vec<Uuid> = printed.clone();
    all.sort();
    let mut want: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
    want.sort();
    assert_eq!(all, want, "every message once");
    for key in ["customer-0", "customer-1"] {
        let of_key = |ids: &[Uuid]| -> Vec<Uuid> {
            ids.iter()
                .copied()
                .filter(|id| {
                    messages
                        .iter()
                        .any(|m| m.id == *id && m.partition_key.as_deref() == Some(key))
                })
                .collect()
        };
        let want: Vec<Uuid> = of_key(&messages.iter().map(|m| m.id).collect::<Vec<_>>());
        assert_eq!(of_key(&printed), want, "{key} in order");
    }
    let counts = outbox.opened.admin.counts().await?;
    assert_eq!((counts.pending, counts.leased), (0, 0));
    Ok(())
}

#[tokio::test]
async fn a_sqlite_drain_waits_for_a_lease_held_elsewhere() -> TestResult {
    let dir = tempfile::tempdir()?;
    let messages: Vec<NewMessage> = (0..30).map(|n| message(n, 3)).collect();
    let outbox = Outbox::sqlite(dir.path(), &messages).await?;
    waits_for_a_lease_held_elsewhere(&outbox, &messages).await
}

#[tokio::test]
async fn a_postgres_drain_waits_for_a_lease_held_elsewhere() -> TestResult {
    let Some(pg_url) = service_url("OUTBOX_TEST_POSTGRES_URL") else {
        return Ok(());
    };
    let messages: Vec<NewMessage> = (0..30).map(|n| message(n, 3)).collect();
    let outbox = Outbox::postgres(&pg_url, &messages).await?;
    waits_for_a_lease_held_elsewhere(&outbox, &messages).await?;
    outbox.drop_schema().await
}

/// `outbox-relay config` prints the batch size and claim shards in effect, and says which the
/// store chose (without connecting to it).
#[tokio::test]
async fn config_says_which_settings_the_store_chose() -> TestResult {
    let config = |args: &[&str]| {
        let args: Vec<String> = ["config", "--broker", "stdout://"]
            .iter()
            .chain(args)
            .map(|a| (*a).to_owned())
            .collect();
        async move {
            let out = common::output(command(args)).await?;
            assert!(out.status.success(), "{out:?}");
            let text = String::from_utf8(out.stdout)?;
            let table: toml::Table = toml::from_str(&text)?;
            let value = |key: &str| table[key].as_integer();
            Ok::<_, BoxError>((value("batch_size"), value("claim_shards"), text))
        }
    };
    // Nothing listens there: `config` must not connect.
    let postgres = "postgres://app:secret@127.0.0.1:9/app";

    let (batch, shards, text) = config(&["--store", postgres]).await?;
    assert_eq!((batch, shards), (Some(2000), Some(2)), "{text}");
    assert!(
        text.contains("# batch_size and claim_shards chosen by the store (postgres)"),
        "{text}"
    );

    let (batch, shards, text) = config(&["--store", postgres, "--claim-shards", "1"]).await?;
    assert_eq!((batch, shards), (Some(2000), Some(1)), "{text}");
    assert!(
        text.contains("# batch_size chosen by the store (postgres)"),
        "{text}"
    );

    let sqlite = "sqlite:///nonexistent/dir/outbox.db";
    let (batch, shards, text) = config(&["--store", sqlite]).await?;
    assert_eq!((batch, shards), (Some(500), Some(1)), "{text}");
    assert!(!text.contains("chosen by the store"), "{text}");

    let (_, shards, text) = config(&["--store", sqlite, "--claim-shards", "3"]).await?;
    assert_eq!(shards, Some(1), "{text}");
    assert!(
        text.contains("# claim_shards is 3: sqlite cannot split its keys"),
        "{text}"
    );
    Ok(())
}
