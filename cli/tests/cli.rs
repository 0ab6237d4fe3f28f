//! The `outbox-relay` program, run as a separate process against SQLite files and the real
//! Postgres, MariaDB and NATS servers.
//!
//! Nothing sleeps: the NATS test waits for the relayed messages on a subscription, then stops
//! the relay with SIGTERM; the stop tests signal once the relay has printed its messages, or
//! once a proxy in front of NATS has accepted its connection; time limits are only failure
//! guards.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{ClaimRequest, FailAction, Failure, HeadPolicy, NewMessage, OutboxStore};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{nats, unique_suffix};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use uuid::Uuid;

mod common;
use common::{
    command, json_lines, json_output, message, nats_msg_ids, nats_subscription, relay_process, run,
    signal, sigterm, stdout_ids, BoxError, BIN, GUARD,
};

type TestResult = Result<(), BoxError>;

/// A SQLite file holding `n` committed messages and a rolled-back transaction's `n` more.
fn sqlite_with(path: &Path, n: usize) -> Result<Vec<Uuid>, BoxError> {
    let config = SqliteConfig::default();
    let mut conn = outbox::sqlite::open_connection(path, &config)?;
    outbox::sqlite::migrate(&conn, &config)?;
    let committed: Vec<NewMessage> = (0..n).map(|n| message(n, 3)).collect();
    let tx = conn.transaction()?;
    outbox::sqlite::enqueue_batch(&tx, &config, &committed)?;
    tx.commit()?;
    let rolled_back: Vec<NewMessage> = (n..2 * n).map(|n| message(n, 3)).collect();
    let tx = conn.transaction()?;
    outbox::sqlite::enqueue_batch(&tx, &config, &rolled_back)?;
    tx.rollback()?;
    Ok(committed.iter().map(|m| m.id).collect())
}

#[tokio::test]
async fn drains_sqlite_to_stdout_then_counts_and_purges() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let ids = sqlite_with(&path, 5)?;
    let store = format!("sqlite://{}", path.display());

    let out = run(&["--store", &store, "drain", "--broker", "stdout://"]).await?;
    assert!(out.status.success(), "{out:?}");
    let published_ids = stdout_ids(&out.stdout)?;
    assert_eq!(
        published_ids, ids,
        "the committed messages, in order, and nothing else"
    );
    // The run's stats are a summary on standard error, out of the way of piped messages.
    let stderr = String::from_utf8(out.stderr)?;
    assert!(stderr.contains(r#""published":5"#), "{stderr}");

    let counts = json_lines(&["--store", &store, "counts"]).await?;
    assert_eq!(
        counts,
        [serde_json::json!({"pending": 0, "leased": 0, "published": 5, "dead": 0})]
    );
    let purged = json_lines(&[
        "--store",
        &store,
        "purge",
        "--older-than",
        "0s",
        "--batch",
        "2",
    ])
    .await?;
    assert_eq!(purged, [serde_json::json!({"purged": 5})]);
    let counts = json_lines(&["--store", &store, "counts"]).await?;
    assert_eq!(counts[0]["published"], 0);
    Ok(())
}

#[tokio::test]
async fn takes_the_store_and_broker_from_the_environment() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let ids = sqlite_with(&path, 3)?;
    let out = Command::new(BIN)
        .arg("drain")
        .env("OUTBOX_STORE_URL", format!("sqlite://{}", path.display()))
        .env("OUTBOX_BROKER_URL", "stdout://")
        .env("OUTBOX_DELETE_PUBLISHED", "1")
        .env("OUTBOX_BATCH_SIZE", "2")
        .stdin(Stdio::null())
        .output();
    let out = tokio::time::timeout(GUARD, out).await??;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8(out.stdout)?.lines().count(), ids.len());
    let stderr = String::from_utf8(out.stderr)?;
    assert!(
        stderr.contains(r#""batches":2"#),
        "batch size from the environment: {stderr}"
    );
    let store = format!("sqlite://{}", path.display());
    let counts = json_lines(&["--store", &store, "counts"]).await?;
    assert_eq!(
        counts,
        [serde_json::json!({"pending": 0, "leased": 0, "published": 0, "dead": 0})],
        "published messages deleted (OUTBOX_DELETE_PUBLISHED=1)"
    );
    Ok(())
}

#[tokio::test]
async fn lists_requeues_and_discards_dead_letters() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let ids = sqlite_with(&path, 2)?;
    {
        let store = SqliteStore::open(&path, SqliteConfig::default()).await?;
        let claim = store
            .claim(&ClaimRequest {
                limit: 2,
                lease: Duration::from_secs(30),
                head_policy: HeadPolicy::Block,
                shard: None,
            })
            .await?;
        let failures: Vec<Failure> = ids
            .iter()
            .map(|id| Failure {
                id: *id,
                error: format!("rejected {id}"),
                action: FailAction::Dead,
            })
            .collect();
        store.fail(claim.token, &failures).await?;
    }
    let store = format!("sqlite://{}", path.display());

    let dead = json_lines(&["--store", &store, "dead", "list", "--json"]).await?;
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(dead[0]["id"], ids[0].to_string());
    assert_eq!(dead[0]["last_error"], format!("rejected {}", ids[0]));
    // The payload is printed as JSON, not as a quoted string.
    assert_eq!(dead[0]["payload"]["note"], "grüße \"quoted\" \\ back");
    let paged = json_lines(&[
        "--store",
        &store,
        "dead",
        "list",
        "--json",
        "--after",
        &dead[0]["seq"].to_string(),
    ])
    .await?;
    assert_eq!(paged.len(), 1);
    assert_eq!(paged[0]["id"], ids[1].to_string());

    let requeued = json_lines(&["--store", &store, "dead", "requeue", &ids[0].to_string()]).await?;
    assert_eq!(requeued, [serde_json::json!({"requeued": 1})]);
    let discarded =
        json_lines(&["--store", &store, "dead", "discard", &ids[1].to_string()]).await?;
    assert_eq!(discarded, [serde_json::json!({"discarded": 1})]);
    let counts = json_lines(&["--store", &store, "counts"]).await?;
    assert_eq!(
        counts,
        [serde_json::json!({"pending": 1, "leased": 0, "published": 0, "dead": 0})]
    );
    Ok(())
}

#[tokio::test]
async fn bad_urls_and_settings_fail_with_a_clear_message_and_no_password() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = format!("sqlite://{}", dir.path().join("outbox.sqlite").display());
    let cases: [(&[&str], i32, &str); 9] = [
        (
            &[
                "--store",
                &store,
                "purge",
                "--older-than",
                "1d",
                "--batch",
                "0",
            ],
            2,
            "must be at least 1",
        ),
        (
            &[
                "--store",
                &store,
                "purge",
                "--older-than",
                "1d",
                "--batch=-1",
            ],
            2,
            "expected a whole number of at least 1",
        ),
        (
            &["--store", &store, "dead", "list", "--limit", "0"],
            2,
            "must be at least 1",
        ),
        (
            &["--store", "amqp://guest:secret@localhost/", "counts"],
            1,
            "use one of: postgres://",
        ),
        (
            &[
                "--store",
                "postgres://app:secret@127.0.0.1:1/app",
                "--table",
                "bad name",
                "counts",
            ],
            1,
            "table",
        ),
        (
            &[
                "--store",
                &store,
                "drain",
                "--broker",
                "amqp://guest:secret@localhost/",
            ],
            1,
            "unknown broker scheme",
        ),
        (
            &[
                "--store",
                &store,
                "drain",
                "--broker",
                "stdout://",
                "--lease",
                "0s",
            ],
            1,
            "lease is 0",
        ),
        (
            &[
                "--store",
                &store,
                "drain",
                "--broker",
                "stdout://",
                "--lease",
                "soon",
            ],
            2,
            "--lease",
        ),
        (
            &[
                "--store",
                &store,
                "run",
                "--broker",
                "stdout://",
                "--purge-every",
                "0s",
            ],
            1,
            "--purge-every is 0",
        ),
    ];
    for (args, code, says) in cases {
        let out = run(args).await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("secret"),
            "{args:?} leaked the password: {stderr}"
        );
    }
    // A relay setting is refused before anything is opened: no database file was created.
    assert!(!dir.path().join("outbox.sqlite").exists());
    Ok(())
}

#[cfg(feature = "kafka")]
/// An unreachable Kafka at start-up fails like NATS and Redis do: a non-zero exit with one
/// clear error line, and librdkafka's own retries do not flood the log.
#[tokio::test]
async fn an_unreachable_kafka_fails_fast_with_one_clear_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = format!("sqlite://{}", dir.path().join("outbox.sqlite").display());
    // Port 1 on loopback: nothing listens there, every connection is refused.
    let out = run(&[
        "--store",
        &store,
        "drain",
        "--broker",
        "kafka://127.0.0.1:1?topic=orders",
    ])
    .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("no metadata from brokers 127.0.0.1:1"))
        .collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    let librdkafka = stderr.lines().filter(|l| l.contains("librdkafka")).count();
    assert!(
        librdkafka <= 5,
        "{librdkafka} librdkafka lines in one connect timeout:\n{stderr}"
    );
    // The broker is checked before the store is opened.
    assert!(!dir.path().join("outbox.sqlite").exists());
    Ok(())
}

/// Postgres into NATS: `migrate`, then `run` relays what producers commit until SIGTERM, and
/// exits cleanly with its stats.
#[tokio::test]
async fn runs_postgres_into_nats_until_sigterm() -> TestResult {
    let (Some(pg_url), Some(nats_url)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let suffix = unique_suffix();
    let schema = format!("cli_{suffix}");
    let stream = format!("CLI_{suffix}");
    let subject = format!("cli{suffix}");
    let store_args = ["--store", pg_url.as_str(), "--schema", schema.as_str()];

    let migrated = json_lines(&[&store_args[..], &["migrate"]].concat()).await?;
    assert_eq!(migrated, [serde_json::json!({"migrated": "postgres"})]);

    // Every message the relay stores in the stream is also delivered to core subscribers.
    let mut sub = nats_subscription(&nats_url, format!("{subject}.>")).await?;
    let broker = format!(
        "{nats_url}?subject={subject}.{{event_type}}&stream={stream}&create_stream=true\
         &stream_subjects={subject}.>"
    );
    let relay = relay_process(store_args.into_iter().chain([
        "run",
        "--broker",
        &broker,
        "--batch-size",
        "7",
    ]))?;

    // Committed while the relay runs: it is woken by the store (LISTEN/NOTIFY) or its poll.
    let config = outbox::postgres::PostgresConfig::builder()
        .schema(schema.clone())
        .build()?;
    let pool = sqlx::PgPool::connect(&pg_url).await?;
    let messages: Vec<NewMessage> = (0..20).map(|n| message(n, 3)).collect();
    let mut tx = pool.begin().await?;
    outbox::postgres::enqueue_batch(&mut *tx, &config, &messages).await?;
    tx.commit().await?;

    let seen: Vec<Uuid> = nats_msg_ids(&mut sub, messages.len())
        .await?
        .iter()
        .map(|id| id.parse())
        .collect::<Result<_, _>>()?;
    let stored = nats::read_stream(&nats_url, &stream).await?;
    assert_eq!(stored.len(), messages.len(), "each message stored once");
    for key in 0..3 {
        let want: Vec<Uuid> = messages
            .iter()
            .filter(|m| m.partition_key == Some(format!("customer-{key}")))
            .map(|m| m.id)
            .collect();
        let got: Vec<Uuid> = seen
            .iter()
            .copied()
            .filter(|id| want.contains(id))
            .collect();
        assert_eq!(got, want, "per-key order of customer-{key}");
    }

    sigterm(&relay).await?;
    let stderr = stopped_gracefully(relay, "SIGTERM").await?;
    assert!(stderr.contains(r#""published":20"#), "{stderr}");
    assert!(!stderr.contains("password"), "{stderr}");

    let counts = json_lines(&[&store_args[..], &["counts"]].concat()).await?;
    assert_eq!(
        counts,
        [serde_json::json!({"pending": 0, "leased": 0, "published": 20, "dead": 0})]
    );
    nats::delete_stream(&nats_url, &stream).await?;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}

/// MariaDB through a `mariadb://` URL: `drain --migrate` creates the table and relays.
#[tokio::test]
async fn drains_mariadb_with_migrate() -> TestResult {
    let Some(my_url) = service_url("OUTBOX_TEST_MYSQL_URL") else {
        return Ok(());
    };
    let table = format!("cli_{}", unique_suffix());
    let mariadb_url = my_url.replacen("mysql:", "mariadb:", 1);
    let store_args = ["--store", mariadb_url.as_str(), "--table", table.as_str()];
    let drained = run(&[
        &store_args[..],
        &["drain", "--migrate", "--broker", "stdout://"],
    ]
    .concat())
    .await?;
    assert!(drained.status.success(), "{drained:?}");
    assert!(drained.stdout.is_empty(), "nothing to relay yet");

    let config = outbox::mysql::MysqlConfig::builder()
        .table(table.clone())
        .build()?;
    let pool = sqlx::MySqlPool::connect(&my_url).await?;
    let messages: Vec<NewMessage> = (0..4).map(|n| message(n, 3)).collect();
    let mut tx = pool.begin().await?;
    outbox::mysql::enqueue_batch(&mut *tx, &config, &messages).await?;
    tx.commit().await?;

    let out = run(&[&store_args[..], &["drain", "--broker", "stdout://"]].concat()).await?;
    assert!(out.status.success(), "{out:?}");
    let ids = stdout_ids(&out.stdout)?;
    assert_eq!(ids, messages.iter().map(|m| m.id).collect::<Vec<_>>());
    sqlx::query(&format!("DROP TABLE `{table}`"))
        .execute(&pool)
        .await?;
    Ok(())
}

/// `convert-layout` converts a table made in an earlier release's layout in place (Postgres's
/// partial indexes to cursor claims, MariaDB's claim indexes to an unpublished table), says so,
/// and does nothing the second time; SQLite has one layout. The messages pending before go on.
#[tokio::test]
async fn converts_an_earlier_release_s_table_in_place() -> TestResult {
    let (Some(pg_url), Some(my_url)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_MYSQL_URL"),
    ) else {
        return Ok(());
    };
    let suffix = unique_suffix();
    let schema = format!("cli_convert_{suffix}");
    let table = format!("cli_convert_{suffix}");
    let pg_old = format!("{pg_url}?cursor_claims=false");
    let postgres = ["--store", pg_url.as_str(), "--schema", schema.as_str()];
    let mysql = ["--store", my_url.as_str(), "--table", table.as_str()];
    let migrated = json_lines(&["--store", &pg_old, "--schema", &schema, "migrate"]).await?;
    assert_eq!(migrated, [serde_json::json!({"migrated": "postgres"})]);
    let old_mysql = outbox::mysql::MysqlConfig::builder()
        .table(table.clone())
        .unpublished_table(false)
        .build()?;
    let pool = sqlx::MySqlPool::connect(&my_url).await?;
    outbox::mysql::MysqlStore::new(pool.clone(), old_mysql.clone())
        .migrate()
        .await?;
    let messages: Vec<NewMessage> = (0..4).map(|n| message(n, 2)).collect();
    let mut tx = pool.begin().await?;
    outbox::mysql::enqueue_batch(&mut *tx, &old_mysql, &messages).await?;
    tx.commit().await?;
    for (store, backend) in [(&postgres, "postgres"), (&mysql, "mysql")] {
        for converted in [true, false] {
            let out = json_lines(&[&store[..], &["convert-layout"]].concat()).await?;
            assert_eq!(
                out,
                [serde_json::json!({"backend": backend, "converted": converted})]
            );
        }
    }
    let out = run(&[&mysql[..], &["drain", "--broker", "stdout://"]].concat()).await?;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout_ids(&out.stdout)?,
        messages.iter().map(|m| m.id).collect::<Vec<_>>()
    );
    let unpublished: i64 =
        sqlx::query_scalar(&format!("SELECT COUNT(*) FROM `{table}_unpublished`"))
            .fetch_one(&pool)
            .await?;
    assert_eq!(
        unpublished, 0,
        "the drain went through the unpublished table"
    );
    let pg = sqlx::PgPool::connect(&pg_url).await?;
    let cursor_index: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(format!("\"{schema}\".outbox_seq_idx"))
        .fetch_one(&pg)
        .await?;
    assert!(cursor_index);
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pg)
        .await?;
    sqlx::raw_sql(&old_mysql.drop_sql()).execute(&pool).await?;
    sqlx::query(&format!("DROP TABLE IF EXISTS `{table}_unpublished`"))
        .execute(&pool)
        .await?;

    let dir = tempfile::tempdir()?;
    let sqlite = format!("sqlite://{}", dir.path().join("o.sqlite").display());
    let out = json_lines(&["--store", &sqlite, "convert-layout"]).await?;
    assert_eq!(
        out,
        [serde_json::json!({"backend": "sqlite", "converted": false})]
    );
    Ok(())
}

/// `--metrics-addr` serves the relay's counters for Prometheus while it runs.
#[tokio::test]
async fn serves_prometheus_metrics_while_running() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let ids = sqlite_with(&path, 3)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let store = format!("sqlite://{}", path.display());
    let mut relay = relay_process([
        "--store",
        &store,
        "run",
        "--broker",
        "stdout://",
        "--metrics-addr",
        &addr,
    ])?;
    // The messages on standard output: the relay is running, its exporter installed.
    let stdout = relay.stdout.take().ok_or("no stdout pipe")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    for _ in &ids {
        tokio::time::timeout(GUARD, lines.next_line())
            .await??
            .ok_or("stdout closed")?;
    }
    let scrape = async {
        let mut conn = tokio::net::TcpStream::connect(&addr).await?;
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
            .await?;
        let mut body = String::new();
        conn.read_to_string(&mut body).await?;
        Ok::<_, BoxError>(body)
    };
    let body = tokio::time::timeout(GUARD, scrape).await??;
    // Claimed before they were printed (their completion may still be on its way).
    assert!(
        body.contains(r#"outbox_claimed_total{publisher="stdout"} 3"#),
        "{body}"
    );
    assert!(body.contains("# HELP outbox_claim_seconds"), "{body}");

    sigterm(&relay).await?;
    let status = tokio::time::timeout(GUARD, relay.wait()).await??;
    assert!(status.success(), "{status}");
    Ok(())
}

/// `run --purge-older-than` deletes old published messages while it relays (at start, then at
/// each interval); `drain --purge-older-than` once after draining.
#[tokio::test]
async fn purges_published_messages_while_relaying() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    sqlite_with(&path, 3)?;
    let store = format!("sqlite://{}", path.display());
    let drained = run(&["--store", &store, "drain", "--broker", "stdout://"]).await?;
    assert_eq!(stdout_ids(&drained.stdout)?.len(), 3);

    let mut relay = relay_process([
        "--store",
        &store,
        "run",
        "--broker",
        "stdout://",
        "--purge-older-than",
        "0s",
        "--purge-every",
        "1h",
    ])?;
    let stderr = relay.stderr.take().ok_or("no stderr pipe")?;
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    loop {
        let line = tokio::time::timeout(GUARD, lines.next_line())
            .await??
            .ok_or("the relay closed its stderr before purging")?;
        if line.contains("purged published messages") {
            assert!(line.contains("purged=3"), "{line}");
            break;
        }
    }
    sigterm(&relay).await?;
    let status = tokio::time::timeout(GUARD, relay.wait()).await??;
    assert!(status.success(), "{status}");
    let counts = json_lines(&["--store", &store, "counts"]).await?;
    assert_eq!(counts[0]["published"], 0, "{counts:?}");

    // drain: one pass after draining. The messages are published by an earlier drain: older
    // than "0s" means strictly older, and the store's clock counts milliseconds, so messages a
    // drain completes may be too recent for its own purge.
    let path = dir.path().join("second.sqlite");
    sqlite_with(&path, 2)?;
    let store = format!("sqlite://{}", path.display());
    let first = run(&["--store", &store, "drain", "--broker", "stdout://"]).await?;
    assert_eq!(stdout_ids(&first.stdout)?.len(), 2);
    sqlite_with(&path, 1)?;
    let out = run(&[
        "--store",
        &store,
        "drain",
        "--broker",
        "stdout://",
        "--purge-older-than",
        "0s",
    ])
    .await?;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout_ids(&out.stdout)?.len(),
        1,
        "the new message is relayed"
    );
    let counts = json_lines(&["--store", &store, "counts"]).await?;
    let (pending, published) = (
        counts[0]["pending"].as_u64(),
        counts[0]["published"].as_u64(),
    );
    assert_eq!(pending, Some(0), "{counts:?}");
    // Without the purge, 3; the one just published may or may not be old enough yet.
    assert!(
        published.is_some_and(|n| n <= 1),
        "the two published by the first drain are purged: {counts:?}"
    );
    Ok(())
}

/// `run` stops gracefully on SIGINT (Ctrl-C) as on SIGTERM: it finishes its in-flight batches,
/// so every message it printed is marked published, then exits 0 with its stats.
#[tokio::test]
async fn run_stops_gracefully_on_sigterm_and_sigint() -> TestResult {
    for name in ["TERM", "INT"] {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("outbox.sqlite");
        let ids = sqlite_with(&path, 5)?;
        let store = format!("sqlite://{}", path.display());
        let mut relay = relay_process([
            "--store",
            &store,
            "run",
            "--broker",
            "stdout://",
            "--batch-size",
            "2",
        ])?;
        let stdout = relay.stdout.take().ok_or("no stdout pipe")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let mut printed = Vec::new();
        while printed.len() < ids.len() {
            let line = tokio::time::timeout(GUARD, lines.next_line())
                .await??
                .ok_or("the relay closed its stdout")?;
            printed.extend(stdout_ids(line.as_bytes())?);
        }
        assert_eq!(printed, ids);

        signal(&relay, name).await?;
        let stderr = stopped_gracefully(relay, &format!("SIG{name}")).await?;
        assert!(stderr.contains(r#""published":5"#), "SIG{name}: {stderr}");
        let counts = json_lines(&["--store", &store, "counts"]).await?;
        assert_eq!(
            counts,
            [serde_json::json!({"pending": 0, "leased": 0, "published": 5, "dead": 0})],
            "SIG{name}: what was printed is marked published"
        );
    }
    Ok(())
}

/// Wait for a relay that was sent a stop signal, check that it stopped gracefully (exit code 0,
/// not killed by the signal, and "stop requested" logged), and return its standard error.
/// `what` names the case in failure messages.
async fn stopped_gracefully(relay: Child, what: &str) -> Result<String, BoxError> {
    let out = tokio::time::timeout(GUARD, relay.wait_with_output()).await??;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{what}: not a graceful stop ({}): {stderr}",
        out.status
    );
    assert!(stderr.contains("stop requested"), "{what}: {stderr}");
    Ok(stderr)
}

/// The `user:pass@` part (empty without credentials) and the `host:port` of a `nats://` URL.
fn nats_authority(url: &str) -> Result<(&str, &str), BoxError> {
    let rest = url
        .strip_prefix("nats://")
        .ok_or_else(|| format!("{url:?} is not a nats:// URL"))?;
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    Ok(match authority.rfind('@') {
        Some(at) => authority.split_at(at + 1),
        None => ("", authority),
    })
}

/// A SIGTERM that arrives while `run` is still connecting is kept: the relay listens for it
/// before connecting, and stops gracefully once it runs instead of dying by the signal.
///
/// A proxy in front of NATS holds the relay's connection: the signal is sent once the proxy has
/// accepted it, while the relay waits for the server's greeting; then the proxy forwards.
#[tokio::test]
async fn keeps_a_sigterm_that_arrives_while_connecting() -> TestResult {
    let Some(nats_url) = service_url("OUTBOX_TEST_NATS_URL") else {
        return Ok(());
    };
    let (credentials, upstream) = nats_authority(&nats_url)?;
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = proxy.local_addr()?.port();
    let suffix = unique_suffix();
    let stream = format!("CLI_{suffix}");
    let subject = format!("cli{suffix}");
    let broker = format!(
        "nats://{credentials}127.0.0.1:{port}?subject={subject}.{{event_type}}&stream={stream}\
         &create_stream=true&stream_subjects={subject}.>"
    );
    let dir = tempfile::tempdir()?;
    let store = format!("sqlite://{}", dir.path().join("outbox.sqlite").display());
    let relay = relay_process(["--store", &store, "run", "--broker", &broker])?;

    let (mut client, _) = tokio::time::timeout(GUARD, proxy.accept()).await??;
    sigterm(&relay).await?;
    let mut server = tokio::net::TcpStream::connect(upstream).await?;
    let forward =
        tokio::spawn(async move { tokio::io::copy_bidirectional(&mut client, &mut server).await });

    let stderr = stopped_gracefully(relay, "SIGTERM while connecting").await;
    forward.abort();
    let stderr = stderr?;
    assert!(stderr.contains("relay started"), "{stderr}");
    assert!(
        stderr
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .any(|stats| stats.get("published").is_some()),
        "no stats line: {stderr}"
    );
    nats::delete_stream(&nats_url, &stream).await?;
    Ok(())
}

/// `sqlite:path` (without `//`) names a file as `sqlite://path` does, absolute or relative to
/// the working directory: `migrate` creates it, `counts` reads it.
#[tokio::test]
async fn sqlite_urls_with_or_without_slashes_name_a_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = |name: &str| dir.path().join(name);
    let cases = [
        (format!("sqlite:{}", file("a.db").display()), file("a.db")),
        (format!("sqlite://{}", file("b.db").display()), file("b.db")),
        ("sqlite:c.db".to_owned(), file("c.db")),
        ("sqlite://d.db".to_owned(), file("d.db")),
    ];
    for (url, path) in cases {
        assert!(!path.exists());
        let mut migrate = command(["--store", &url, "migrate"]);
        migrate.current_dir(dir.path());
        assert_eq!(
            json_output(migrate).await?,
            [serde_json::json!({"migrated": "sqlite"})],
            "{url}"
        );
        assert!(path.is_file(), "{url} did not create {}", path.display());
        let mut counts = command(["--store", &url, "counts"]);
        counts.current_dir(dir.path());
        assert_eq!(
            json_output(counts).await?,
            [serde_json::json!({"pending": 0, "leased": 0, "published": 0, "dead": 0})],
            "{url}"
        );
    }
    Ok(())
}
