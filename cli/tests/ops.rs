//! Operating `outbox-relay`: health endpoints against private servers that the tests stop and
//! start, `status` against the store's rows, dead-letter filters and bulk commands, the
//! configuration file's precedence and masking, JSON logs, and progress off a terminal.
//!
//! The readiness tests wait for the endpoint to change (polling it) while the private server is
//! down or back; nothing sleeps for a lease or a retry.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::{
    ClaimRequest, FailAction, Failure, HeadPolicy, NewMessage, OutboxAdmin, OutboxStore, Publisher,
};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::private::{free_port, PlainNats, PlainPostgres, PlainRedis};
use outbox_e2e::unique_suffix;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

mod common;
use common::{command, json_lines, output, relay_process, run, sigterm, BoxError, GUARD};

type TestResult = Result<(), BoxError>;

/// `GET path` on `addr`: the status code and the body.
async fn get(addr: &str, path: &str) -> Result<(u16, String), BoxError> {
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut text = String::new();
    conn.read_to_string(&mut text).await?;
    let code = text.split(' ').nth(1).ok_or("no status line")?.parse()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok((code, body.to_owned()))
}

/// Poll `GET path` until it answers `code` (the relay reacts to the server's state); the body.
async fn until_status(addr: &str, path: &str, code: u16) -> Result<String, BoxError> {
    let poll = async {
        loop {
            if let Ok((got, body)) = get(addr, path).await {
                if got == code {
                    return body;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    Ok(tokio::time::timeout(GUARD, poll)
        .await
        .map_err(|_| format!("{path} never answered {code}"))?)
}

/// Poll `/metrics` until it contains `needle` (the gauge loop's next round); the body.
async fn until_metrics(addr: &str, needle: &str) -> Result<String, BoxError> {
    let poll = async {
        loop {
            if let Ok((200, body)) = get(addr, "/metrics").await {
                if body.contains(needle) {
                    return body;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    Ok(tokio::time::timeout(GUARD, poll)
        .await
        .map_err(|_| format!("/metrics never showed {needle}"))?)
}

/// `/health/ready` answers 503 naming the broker while a private NATS is down, and 200 again
/// once it is back; `/metrics` has real histograms and the gauges; other paths are 404.
#[tokio::test]
async fn readiness_follows_a_private_nats_server() -> TestResult {
    let Some(mut nats) = PlainNats::start()? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let store = format!("sqlite://{}", dir.path().join("outbox.sqlite").display());
    let broker = format!(
        "{}?subject=ops.{{event_type}}&stream=OPS&create_stream=true",
        nats.url()
    );
    let addr = format!("127.0.0.1:{}", free_port()?);
    let relay = relay_process([
        "run",
        "--migrate",
        "--store",
        &store,
        "--broker",
        &broker,
        "--metrics-addr",
        &addr,
        "--gauges-every",
        "100ms",
    ])?;

    let body = until_status(&addr, "/health/ready", 200).await?;
    let ready: Value = serde_json::from_str(&body)?;
    assert_eq!(ready["status"], "ready", "{body}");
    assert_eq!(get(&addr, "/health/live").await?.0, 200);
    assert_eq!(get(&addr, "/nothing").await?.0, 404);
    assert_eq!(get(&addr, "/health").await?.0, 404);
    // The gauge loop runs every 100 ms: wait for its first figures.
    let metrics = until_metrics(&addr, "outbox_broker_up 1").await?;
    assert!(metrics.contains("outbox_store_up 1"), "{metrics}");
    assert!(metrics.contains("outbox_pending_messages 0"), "{metrics}");
    assert!(metrics.contains("outbox_blocked_keys 0"), "{metrics}");

    nats.stop();
    let body = until_status(&addr, "/health/ready", 503).await?;
    let not_ready: Value = serde_json::from_str(&body)?;
    assert_eq!(not_ready["store"], "ok", "{body}");
    assert_ne!(not_ready["broker"], "ok", "{body}");
    until_metrics(&addr, "outbox_broker_up 0").await?;

    nats.resume()?;
    until_status(&addr, "/health/ready", 200).await?;

    sigterm(&relay).await?;
    let status = tokio::time::timeout(GUARD, relay.wait_with_output()).await??;
    assert!(status.status.success(), "{status:?}");
    Ok(())
}

/// `/health/ready` answers 503 naming the store while a private Postgres is stopped, and 200
/// once it runs again.
#[tokio::test]
async fn readiness_follows_a_private_postgres() -> TestResult {
    let Some(pg) = PlainPostgres::start()? else {
        return Ok(());
    };
    let addr = format!("127.0.0.1:{}", free_port()?);
    let relay = relay_process([
        "run",
        "--migrate",
        "--store",
        &pg.url(),
        "--broker",
        "stdout://",
        "--metrics-addr",
        &addr,
        "--ready-timeout",
        "1s",
    ])?;
    until_status(&addr, "/health/ready", 200).await?;

    pg.stop()?;
    let body = until_status(&addr, "/health/ready", 503).await?;
    let not_ready: Value = serde_json::from_str(&body)?;
    assert_ne!(not_ready["store"], "ok", "{body}");
    assert_eq!(not_ready["broker"], "ok", "{body}");

    pg.resume()?;
    until_status(&addr, "/health/ready", 200).await?;
    sigterm(&relay).await?;
    let out = tokio::time::timeout(GUARD, relay.wait_with_output()).await??;
    assert!(out.status.success(), "{out:?}");
    Ok(())
}

/// Two messages of `ka` (the first to be dead), one of `kb` (to wait for a retry), two of `kc`
/// (pending), one of `kd` (to be published). Returns the ids in that order.
fn scenario_messages() -> Vec<NewMessage> {
    [
        ("ka", "order.placed"),
        ("ka", "order.placed"),
        ("kb", "order.paid"),
        ("kc", "order.placed"),
        ("kc", "order.placed"),
        ("kd", "order.placed"),
    ]
    .iter()
    .enumerate()
    .map(|(n, (key, event))| {
        NewMessage::new(
            "order",
            format!("o-{n}"),
            *event,
            serde_json::json!({"n": n}),
        )
        .with_partition_key(*key)
    })
    .collect()
}

/// Claim everything, then: `ka`'s head dead, `kb`'s head retrying in an hour, `kd` published,
/// the rest released.
async fn settle(store: &dyn OutboxStore, ids: &[Uuid]) -> TestResult {
    let claim = store
        .claim(&ClaimRequest {
            limit: 100,
            lease: Duration::from_secs(60),
            head_policy: HeadPolicy::Block,
            shard: None,
        })
        .await?;
    assert_eq!(claim.messages.len(), 6);
    store
        .fail(
            claim.token,
            &[
                Failure {
                    id: ids[0],
                    error: "rejected by the broker".into(),
                    action: FailAction::Dead,
                },
                Failure {
                    id: ids[2],
                    error: "timed out".into(),
                    action: FailAction::Retry {
                        delay: Duration::from_secs(3600),
                    },
                },
            ],
        )
        .await?;
    store.complete(claim.token, &[ids[5]]).await?;
    store
        .release(claim.token, &[ids[1], ids[3], ids[4]])
        .await?;
    Ok(())
}

/// `status --json` and the table against the rows of [`settle`].
async fn check_status(store_args: &[&str], ids: &[Uuid]) -> TestResult {
    let status = json_lines([store_args, &["status", "--json"]].concat()).await?;
    let s = &status[0];
    assert_eq!(s["pending"], 4, "{s}");
    assert_eq!(s["leased"], 0, "{s}");
    assert_eq!(s["dead"], 1, "{s}");
    assert_eq!(s["published_last_minute"], 1, "{s}");
    assert_eq!(s["relay_running"], true, "{s}");
    assert!(s["oldest_pending_age_seconds"].as_f64().is_some(), "{s}");
    assert_eq!(s["blocked_keys"], 2, "{s}");
    let blocked = s["blocked"].as_array().ok_or("no blocked list")?;
    assert_eq!(blocked[0]["partition_key"], "ka");
    assert_eq!(blocked[0]["head_id"], ids[0].to_string());
    assert_eq!(blocked[0]["head_state"], "dead");
    assert_eq!(blocked[0]["last_error"], "rejected by the broker");
    assert_eq!(blocked[1]["partition_key"], "kb");
    assert_eq!(blocked[1]["head_id"], ids[2].to_string());
    assert_eq!(blocked[1]["head_state"], "retrying");
    assert_eq!(blocked[1]["attempts"], 1);

    let out = run(&[store_args, &["status"]].concat()).await?;
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8(out.stdout)?;
    let row = |name: &str| -> String {
        table
            .lines()
            .find(|l| l.starts_with(name))
            .map(|l| l[name.len()..].trim().to_owned())
            .unwrap_or_default()
    };
    assert_eq!(row("pending"), "4", "{table}");
    assert_eq!(row("dead"), "1", "{table}");
    assert_eq!(row("blocked keys"), "2", "{table}");
    assert!(
        row("throughput (last minute)").contains("1 published"),
        "{table}"
    );
    assert!(table.contains(&ids[0].to_string()), "{table}");
    assert!(table.contains(&ids[2].to_string()), "{table}");
    Ok(())
}

async fn sqlite_scenario(path: &Path) -> Result<(SqliteStore, Vec<Uuid>), BoxError> {
    let config = SqliteConfig::default();
    let messages = scenario_messages();
    {
        let mut conn = outbox::sqlite::open_connection(path, &config)?;
        outbox::sqlite::migrate(&conn, &config)?;
        let tx = conn.transaction()?;
        outbox::sqlite::enqueue_batch(&tx, &config, &messages)?;
        tx.commit()?;
    }
    let store = SqliteStore::open(path, config).await?;
    let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
    settle(&store, &ids).await?;
    Ok((store, ids))
}

#[tokio::test]
async fn status_matches_the_rows_of_sqlite() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let (_store, ids) = sqlite_scenario(&path).await?;
    let store = format!("sqlite://{}", path.display());
    check_status(&["--store", &store], &ids).await
}

#[tokio::test]
async fn status_matches_the_rows_of_postgres() -> TestResult {
    let Some(url) = service_url("OUTBOX_TEST_POSTGRES_URL") else {
        return Ok(());
    };
    let table = format!("ops_{}", unique_suffix());
    let config = outbox::postgres::PostgresConfig::builder()
        .table(table.clone())
        .build()?;
    let pool = sqlx::PgPool::connect(&url).await?;
    let store = outbox::postgres::PostgresStore::new(pool.clone(), config.clone());
    store.migrate().await?;
    let messages = scenario_messages();
    outbox::postgres::enqueue_batch(&pool, &config, &messages).await?;
    let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
    settle(&store, &ids).await?;
    let status = store.status(10).await?;
    assert_eq!(status.pending, 4);
    check_status(&["--store", &url, "--table", &table], &ids).await?;
    sqlx::query(&format!("DROP TABLE public.\"{table}\""))
        .execute(&pool)
        .await?;
    Ok(())
}

#[tokio::test]
async fn status_matches_the_rows_of_mariadb() -> TestResult {
    let Some(url) = service_url("OUTBOX_TEST_MYSQL_URL") else {
        return Ok(());
    };
    let table = format!("ops_{}", unique_suffix());
    let config = outbox::mysql::MysqlConfig::builder()
        .table(table.clone())
        .build()?;
    let pool = sqlx::MySqlPool::connect(&url).await?;
    let store = outbox::mysql::MysqlStore::new(pool.clone(), config.clone());
    store.migrate().await?;
    let messages = scenario_messages();
    outbox::mysql::enqueue_batch(&pool, &config, &messages).await?;
    let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
    settle(&store, &ids).await?;
    check_status(&["--store", &url, "--table", &table], &ids).await?;
    sqlx::query(&format!("DROP TABLE `{table}`"))
        .execute(&pool)
        .await?;
    Ok(())
}

/// `dead list` filters by key and event type; bulk requeue by key and discard of all; bulk
/// commands off a terminal need `--yes`.
#[tokio::test]
async fn dead_letters_by_key_event_type_and_all() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let config = SqliteConfig::default();
    let messages: Vec<NewMessage> = (0..6)
        .map(|n| {
            NewMessage::new(
                "order",
                format!("o-{n}"),
                if n % 2 == 0 {
                    "order.placed"
                } else {
                    "order.paid"
                },
                serde_json::json!({"n": n}),
            )
            .with_partition_key(format!("k{}", n % 3))
        })
        .collect();
    {
        let mut conn = outbox::sqlite::open_connection(&path, &config)?;
        outbox::sqlite::migrate(&conn, &config)?;
        let tx = conn.transaction()?;
        outbox::sqlite::enqueue_batch(&tx, &config, &messages)?;
        tx.commit()?;
    }
    let store = Arc::new(SqliteStore::open(&path, config).await?);
    let claim = store
        .claim(&ClaimRequest {
            limit: 100,
            lease: Duration::from_secs(60),
            head_policy: HeadPolicy::Skip,
            shard: None,
        })
        .await?;
    let failures: Vec<Failure> = claim
        .messages
        .iter()
        .map(|m| Failure {
            id: m.id,
            error: format!("bad {}", m.id),
            action: FailAction::Dead,
        })
        .collect();
    store.fail(claim.token, &failures).await?;
    let s = format!("sqlite://{}", path.display());

    let k1 = json_lines(["--store", &s, "dead", "list", "--json", "--key", "k1"]).await?;
    let ids: Vec<&str> = k1.iter().filter_map(|d| d["id"].as_str()).collect();
    assert_eq!(
        ids,
        [messages[1].id.to_string(), messages[4].id.to_string()]
    );
    let paid = json_lines([
        "dead",
        "list",
        "--json",
        "--event-type",
        "order.paid",
        "--store",
        &s,
    ])
    .await?;
    assert_eq!(paid.len(), 3);
    assert!(
        paid.iter().all(|d| d["event_type"] == "order.paid"),
        "{paid:?}"
    );
    let both = json_lines([
        "--store",
        &s,
        "dead",
        "list",
        "--json",
        "--key",
        "k1",
        "--event-type",
        "order.paid",
    ])
    .await?;
    assert_eq!(both.len(), 1);
    assert_eq!(both[0]["id"], messages[1].id.to_string());
    let table = run(&["--store", &s, "dead", "list", "--key", "k2"]).await?;
    let table = String::from_utf8(table.stdout)?;
    assert!(table.starts_with("SEQ"), "{table}");
    assert_eq!(table.lines().count(), 3, "{table}");
    assert!(table.contains(&messages[2].id.to_string()), "{table}");

    // Off a terminal, a bulk change needs --yes; nothing changes without it.
    let refused = run(&["--store", &s, "dead", "requeue", "--key", "k1"]).await?;
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--yes"));
    assert_eq!(store.counts().await?.dead, 6);

    let requeued = json_lines(["--store", &s, "dead", "requeue", "--key", "k1", "--yes"]).await?;
    assert_eq!(requeued, [serde_json::json!({"requeued": 2})]);
    let counts = store.counts().await?;
    assert_eq!((counts.pending, counts.dead), (2, 4));
    let discarded = command(["--store", &s, "dead", "discard", "--all", "--yes"]);
    let out = output(discarded).await?;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8(out.stdout)?.trim(), r#"{"discarded":4}"#);
    // Off a terminal, the progress is a closing summary line, not a bar.
    let stderr = String::from_utf8(out.stderr)?;
    assert!(
        stderr.contains("outbox-relay: discarded 4 of 4 in all"),
        "{stderr}"
    );
    assert!(
        !stderr.contains('\r') && !stderr.contains('\u{1b}'),
        "{stderr:?}"
    );
    assert_eq!(store.counts().await?.dead, 0);

    let neither = run(&["--store", &s, "dead", "discard"]).await?;
    assert_eq!(neither.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&neither.stderr).contains("--all"));
    Ok(())
}

/// flags > environment > file > defaults, for settings of each kind; `config` masks secrets.
#[tokio::test]
async fn config_precedence_and_masked_secrets() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("relay.toml");
    std::fs::write(
        &file,
        r#"
store = "postgres://app:filesecret@db:5432/app"
broker = "kafka://u:brokersecret@k:9092?topic=t&sasl.password=saslsecret&acks=all"
batch_size = 7
concurrency = 3
claim_shards = 2
lease = "45s"
head_policy = "skip"
metrics_addr = "127.0.0.1:9100"
log_format = "json"
"#,
    )?;
    let mut cmd = command([
        "config",
        "--config",
        file.to_str().ok_or("path")?,
        "--concurrency",
        "5",
    ]);
    cmd.env("OUTBOX_BATCH_SIZE", "9")
        .env("OUTBOX_CONCURRENCY", "4");
    let out = output(cmd).await?;
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout)?;
    let effective: toml::Table = toml::from_str(&text)?;
    assert_eq!(
        effective["concurrency"].as_integer(),
        Some(5),
        "flag over env: {text}"
    );
    assert_eq!(
        effective["batch_size"].as_integer(),
        Some(9),
        "env over file: {text}"
    );
    assert_eq!(
        effective["lease"].as_str(),
        Some("45s"),
        "file over default: {text}"
    );
    assert_eq!(effective["head_policy"].as_str(), Some("skip"));
    assert_eq!(
        effective["claim_shards"].as_integer(),
        Some(2),
        "file over default: {text}"
    );
    assert_eq!(
        effective["max_attempts"].as_integer(),
        Some(10),
        "default: {text}"
    );
    assert_eq!(effective["metrics_addr"].as_str(), Some("127.0.0.1:9100"));
    assert_eq!(effective["log_format"].as_str(), Some("json"));
    for secret in ["filesecret", "brokersecret", "saslsecret"] {
        assert!(!text.contains(secret), "{secret} shown: {text}");
    }
    assert!(text.contains("acks=all"), "{text}");
    assert!(text.contains("postgres://app:***@db:5432/app"), "{text}");

    // The printed configuration is a valid file: reading it back gives the same settings.
    let again = dir.path().join("again.toml");
    std::fs::write(&again, &text)?;
    let out = output(command([
        "config",
        "--config",
        again.to_str().ok_or("path")?,
    ]))
    .await?;
    assert_eq!(
        String::from_utf8(out.stdout)?
            .lines()
            .skip(1)
            .collect::<Vec<_>>(),
        text.lines().skip(1).collect::<Vec<_>>()
    );

    // A switch before the subcommand does not take it for its value; `=false` beats the file.
    let out = output(command(["--delete-published", "config"])).await?;
    assert!(String::from_utf8(out.stdout)?.contains("delete_published = true"));
    let switched = dir.path().join("switched.toml");
    std::fs::write(&switched, "delete_published = true\n")?;
    let mut cmd = command(["config", "--delete-published=false"]);
    cmd.env("OUTBOX_CONFIG", &switched);
    let out = output(cmd).await?;
    assert!(String::from_utf8(out.stdout)?.contains("delete_published = false"));

    // Global flags before or after the subcommand; OUTBOX_CONFIG names the file.
    let mut cmd = command(["--lease", "1m", "config"]);
    cmd.env("OUTBOX_CONFIG", &file);
    let text = String::from_utf8(output(cmd).await?.stdout)?;
    assert!(text.contains("lease = \"1m\""), "{text}");

    // Bad files are refused with what is wrong, before anything is opened.
    std::fs::write(&file, "batch_sise = 3\n")?;
    let out = run(&["counts", "--config", file.to_str().ok_or("path")?]).await?;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("batch_sise"),
        "{out:?}"
    );
    std::fs::write(&file, "lease = \"soon\"\n")?;
    let out = run(&["counts", "--config", file.to_str().ok_or("path")?]).await?;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("`lease`"),
        "{out:?}"
    );
    Ok(())
}

/// `--log-format json`: one JSON object per line, the program's own lines under its target.
/// `purge` and `drain` report progress off a terminal as summary lines.
#[tokio::test]
async fn json_logs_and_progress_lines_off_a_terminal() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let config = SqliteConfig::default();
    {
        let mut conn = outbox::sqlite::open_connection(&path, &config)?;
        outbox::sqlite::migrate(&conn, &config)?;
        let tx = conn.transaction()?;
        let messages: Vec<NewMessage> = (0..5).map(|n| common::message(n, 2)).collect();
        outbox::sqlite::enqueue_batch(&tx, &config, &messages)?;
        tx.commit()?;
    }
    let s = format!("sqlite://{}", path.display());
    let mut drain = command([
        "--store",
        &s,
        "drain",
        "--broker",
        "stdout://",
        "--log-format",
        "json",
    ]);
    drain.env("RUST_LOG", "info");
    let out = output(drain).await?;
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8(out.stderr)?;
    let logs: Vec<Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{') && l.contains("\"level\""))
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let started = logs
        .iter()
        .find(|l| l["message"] == "relay started")
        .ok_or_else(|| format!("no start line: {stderr}"))?;
    assert_eq!(started["target"], "outbox_relay_cli", "{started}");
    assert_eq!(started["level"], "INFO");
    assert!(
        stderr.contains("outbox-relay: drained 5 of 5 in all"),
        "{stderr}"
    );

    let out = run(&["purge", "--older-than", "0s", "--batch", "2", "--store", &s]).await?;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8(out.stdout)?.trim(), r#"{"purged":5}"#);
    let stderr = String::from_utf8(out.stderr)?;
    assert!(stderr.contains("outbox-relay: purged 5 in all"), "{stderr}");
    Ok(())
}

/// Completion scripts for bash, zsh and fish name the subcommands.
#[tokio::test]
async fn prints_shell_completions() -> TestResult {
    for shell in ["bash", "zsh", "fish"] {
        let out = run(&["completions", shell]).await?;
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout)?;
        assert!(script.contains("outbox-relay"), "{shell}");
        assert!(script.contains("requeue"), "{shell}");
    }
    Ok(())
}

/// `Publisher::check` (readiness, `outbox_broker_up`) against the real Redis and Kafka, and a
/// private Redis that is stopped: an error naming it, within the publisher's timeout.
#[tokio::test]
async fn broker_checks_of_redis_and_kafka() -> TestResult {
    if let Some(url) = service_url("OUTBOX_TEST_REDIS_URL") {
        let publisher = outbox::broker::connect(&format!("{url}?stream=ops")).await?;
        publisher.check().await?;
    }
    if let Some(brokers) = service_url("OUTBOX_TEST_KAFKA_BROKERS") {
        let publisher = outbox::broker::connect(&format!("kafka://{brokers}?topic=ops")).await?;
        publisher.check().await?;
    }
    let Some(mut redis) = PlainRedis::start()? else {
        return Ok(());
    };
    let publisher =
        outbox::broker::connect(&format!("{}?stream=ops&timeout_ms=1000", redis.url())).await?;
    publisher.check().await?;
    redis.stop();
    let err = publisher
        .check()
        .await
        .err()
        .ok_or("check passed with Redis stopped")?;
    assert!(err.to_string().contains("redis"), "{err}");
    Ok(())
}
