//! `outbox-relay drain` over many outboxes (`[[outbox]]` tables): every outbox drained into its
//! own broker (Kafka for some, Redis for others), nothing of another outbox's and nothing rolled
//! back; and one outbox whose table is missing or whose database is unreachable failing alone,
//! named in the error, while the others drain fully. Against the shared Postgres, Redis and
//! Kafka (Tansu), and SQLite files.

#[allow(dead_code)] // not every helper of the shared module is used here
mod common;

use std::collections::{BTreeMap, HashSet};

use common::many::{by_outbox, drain, drop_schemas, get, message, summary, until_http, Outbox};
use common::BoxError;
use outbox::NewMessage;
use outbox_conformance_tests::env::service_url;
use outbox_e2e::private::free_port;
use outbox_e2e::{kafka, redis, unique_suffix, Received};

type TestResult = Result<(), BoxError>;

/// Partitions of each Kafka topic: more than one, so the read covers several.
const PARTITIONS: i32 = 2;

/// Committed messages per outbox.
const N: usize = 150;

/// What one outbox holds: the ids it committed and the ids of a transaction it rolled back.
struct Written {
    committed: Vec<String>,
    rolled_back: Vec<String>,
}

/// Create the outbox `target` (named `name`), commit [`N`] messages and roll back a few.
async fn fill(target: Outbox, name: &str) -> Result<Written, BoxError> {
    target.create().await?;
    let committed: Vec<NewMessage> = (0..N).map(|i| message(name, i)).collect();
    let rolled_back: Vec<NewMessage> = (N..N + 5).map(|i| message(name, i)).collect();
    Ok(Written {
        committed: target.write(&committed, true).await?,
        rolled_back: target.write(&rolled_back, false).await?,
    })
}

/// `received` (one outbox's broker stream or topic) holds each of `written`'s committed
/// messages exactly once, and nothing else: none of another outbox's, none rolled back.
fn check(outbox: &str, received: &[Received], written: &Written) -> TestResult {
    let got: Vec<&str> = received.iter().map(|r| r.id.as_str()).collect();
    let unique: HashSet<&str> = got.iter().copied().collect();
    let want: HashSet<&str> = written.committed.iter().map(String::as_str).collect();
    let leaked = written
        .rolled_back
        .iter()
        .filter(|id| unique.contains(id.as_str()))
        .count();
    assert_eq!(leaked, 0, "{outbox}: rolled-back messages published");
    assert_eq!(
        got.len(),
        unique.len(),
        "{outbox}: some messages delivered more than once"
    );
    assert_eq!(
        unique.difference(&want).count(),
        0,
        "{outbox}: messages that are not its own"
    );
    assert_eq!(
        want.difference(&unique).count(),
        0,
        "{outbox}: committed messages missing"
    );
    Ok(())
}

/// Three Postgres schemas (one named, two through a `schemas` pattern that also matches a schema
/// without the table) and a SQLite file, routed to Kafka (the named schema and the file) and to
/// Redis (the pattern's, one stream each through `{outbox}`): one drain publishes every
/// committed message to its own outbox's broker, once, and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_empties_every_outbox_into_its_own_broker() -> TestResult {
    let (Some(pg), Some(redis_url), Some(brokers)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_REDIS_URL"),
        service_url("OUTBOX_TEST_KAFKA_BROKERS"),
    ) else {
        return Ok(());
    };
    let p = format!("mdrain{}", unique_suffix());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&pg)
        .await?;
    let billing = format!("{p}_billing");
    let tenants = [format!("{p}_t1"), format!("{p}_t2")];
    let bare = format!("{p}_t3");
    let mut written = BTreeMap::new();
    written.insert(
        billing.clone(),
        fill(Outbox::postgres(&pool, &billing), &billing).await?,
    );
    for t in &tenants {
        written.insert(t.clone(), fill(Outbox::postgres(&pool, t), t).await?);
    }
    // Matches the pattern but has no table: skipped, not a failure.
    sqlx::query(&format!("CREATE SCHEMA \"{bare}\""))
        .execute(&pool)
        .await?;
    let dir = tempfile::tempdir()?;
    let edge = format!("{p}_edge");
    let file = dir.path().join("edge.db");
    written.insert(edge.clone(), fill(Outbox::sqlite(&file), &edge).await?);
    for outbox in [&billing, &edge] {
        kafka::create_topic(&brokers, outbox, PARTITIONS).await?;
    }
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            r#"
store = "{pg}"
broker = "kafka://{brokers}?topic={{outbox}}"

[[outbox]]
name = "{billing}"
schema = "{billing}"

[[outbox]]
schemas = "{p}_t*"
broker = "{redis_url}?stream={{outbox}}"

[[outbox]]
name = "{edge}"
store = "sqlite://{file}"
"#,
            file = file.display(),
        ),
    )?;
    let (ok, stderr) = drain(&config).await?;
    assert!(ok, "the drain failed:\n{stderr}");
    let summary = summary(&stderr)?;
    for (outbox, w) in &written {
        assert_eq!(
            summary["outboxes"][outbox]["published"],
            w.committed.len(),
            "{outbox} in the summary: {summary}"
        );
    }
    assert_eq!(
        summary["outboxes"].as_object().map(|o| o.len()),
        Some(written.len()),
        "the bare schema is no outbox: {summary}"
    );
    assert_eq!(summary["total"]["published"], 4 * N, "{summary}");
    assert_eq!(summary["failed"], serde_json::json!({}), "{summary}");
    // Each outbox's broker holds exactly its committed messages.
    for outbox in [&billing, &edge] {
        let received = kafka::read_topic(&brokers, outbox, PARTITIONS).await?;
        check(outbox, &received, &written[outbox])?;
    }
    for outbox in &tenants {
        let received = redis::read_stream(&redis_url, outbox).await?;
        check(outbox, &received, &written[outbox])?;
    }
    for outbox in [&billing, &edge] {
        kafka::delete_topic(&brokers, outbox).await?;
    }
    for outbox in &tenants {
        redis::delete(&redis_url, outbox).await?;
    }
    drop_schemas(
        &pool,
        &[billing, tenants[0].clone(), tenants[1].clone(), bare],
    )
    .await
}

/// Beside a Postgres schema and a SQLite file that drain fully, an outbox whose table does not
/// exist and one whose database does not answer (its URL carrying a password) fail alone: the
/// drain exits 1, its error names both, and the password appears nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_outbox_fails_the_drain_alone() -> TestResult {
    let (Some(pg), Some(redis_url)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_REDIS_URL"),
    ) else {
        return Ok(());
    };
    let p = format!("mdfail{}", unique_suffix());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&pg)
        .await?;
    let good = format!("{p}_good");
    let mut written = BTreeMap::new();
    written.insert(
        good.clone(),
        fill(Outbox::postgres(&pool, &good), &good).await?,
    );
    let dir = tempfile::tempdir()?;
    let edge = format!("{p}_edge");
    let file = dir.path().join("edge.db");
    written.insert(edge.clone(), fill(Outbox::sqlite(&file), &edge).await?);
    let missing = format!("{p}_missing");
    let down = format!("{p}_down");
    let password = "s3cret-drain-pw";
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            r#"
store = "{pg}"
broker = "{redis_url}?stream={{outbox}}"

[[outbox]]
name = "{good}"
schema = "{good}"

[[outbox]]
name = "{missing}"
schema = "{missing}"

[[outbox]]
name = "{down}"
store = "postgres://postgres:{password}@127.0.0.1:{port}/test"

[[outbox]]
name = "{edge}"
store = "sqlite://{file}"
"#,
            port = free_port()?,
            file = file.display(),
        ),
    )?;
    let (ok, stderr) = drain(&config).await?;
    assert!(
        !ok,
        "the drain succeeded with two failing outboxes:\n{stderr}"
    );
    assert!(!stderr.contains(password), "the password leaked:\n{stderr}");
    let error = stderr
        .lines()
        .find(|l| l.starts_with("outbox-relay: "))
        .ok_or_else(|| format!("no error line:\n{stderr}"))?;
    assert!(
        error.contains("2 of 4 outboxes failed")
            && error.contains(&missing)
            && error.contains(&down),
        "{error}"
    );
    assert!(
        !error.contains(&good) && !error.contains(&edge),
        "healthy outboxes named as failed: {error}"
    );
    let summary = summary(&stderr)?;
    assert_eq!(
        summary["failed"].as_object().map(|f| f.len()),
        Some(2),
        "{summary}"
    );
    for (outbox, w) in &written {
        assert_eq!(
            summary["outboxes"][outbox]["published"],
            w.committed.len(),
            "{outbox} in the summary: {summary}"
        );
        let received = redis::read_stream(&redis_url, outbox).await?;
        check(outbox, &received, w)?;
        redis::delete(&redis_url, outbox).await?;
    }
    for outbox in [&missing, &down] {
        assert_eq!(redis::stream_len(&redis_url, outbox).await?, 0, "{outbox}");
    }
    drop_schemas(&pool, &[good]).await
}

/// A drain of several outboxes with a metrics address serves `/metrics` and readiness as `run`
/// does, each outbox under its label, while it drains; SIGTERM stops it gracefully. One outbox
/// is drained, another waits for messages a second relay holds (for ten minutes): meanwhile
/// the endpoint shows the first's publications and the second's leased messages, each under
/// its own name; the stop ends the wait, and the drain exits 0 with its summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_of_several_outboxes_serves_metrics_and_stops_on_sigterm() -> TestResult {
    use outbox::sqlite::{SqliteConfig, SqliteStore};
    use outbox::{ClaimRequest, HeadPolicy, OutboxStore};
    use tokio::io::{AsyncBufReadExt, BufReader};

    let dir = tempfile::tempdir()?;
    let free = dir.path().join("free.db");
    let held = dir.path().join("held.db");
    let written = fill(Outbox::sqlite(&free), "free").await?;
    fill(Outbox::sqlite(&held), "held").await?;
    // Another relay's claim of everything in `held`, for longer than the test may take.
    let other = SqliteStore::open(&held, SqliteConfig::default()).await?;
    let claim = other
        .claim(&ClaimRequest {
            limit: N,
            lease: std::time::Duration::from_secs(600),
            head_policy: HeadPolicy::Block,
            shard: None,
        })
        .await?;
    assert_eq!(claim.messages.len(), N);
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            r#"
broker = "stdout://"
metrics_addr = "{metrics}"
gauges_every = "100ms"

[[outbox]]
name = "free"
store = "sqlite://{free}"

[[outbox]]
name = "held"
store = "sqlite://{held}"
"#,
            free = free.display(),
            held = held.display(),
        ),
    )?;
    let mut child = common::command(["--config".as_ref(), config.as_os_str(), "drain".as_ref()])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stderr.take().ok_or("no stderr")?).lines();
    let mut stderr = String::new();
    // Once `free` is drained, `held` is the one left, waiting for the other relay's lease.
    let drained = async {
        while let Some(line) = lines.next_line().await? {
            stderr += &line;
            stderr.push('\n');
            if line.contains("outbox drained") && line.contains("outbox=free") {
                return Ok(());
            }
        }
        Err::<(), BoxError>(format!("the drain ended before `free` was drained:\n{stderr}").into())
    };
    tokio::time::timeout(common::GUARD, drained).await??;
    // While `held` waits: each outbox's metrics under its own label. The store gauges are
    // sampled every `gauges_every`, so a scrape just after `free` drained can still show its
    // sample from before (all 150 leased; seen once in 50 runs): wait for the first sample of
    // both outboxes taken after that.
    let text = until_http(&metrics, "/metrics", "both outboxes' figures", |_, body| {
        by_outbox(body, "outbox_leased_messages").get("held") == Some(&(N as f64))
            && by_outbox(body, "outbox_leased_messages").get("free") == Some(&0.0)
            && by_outbox(body, "outbox_store_up").len() == 2
    })
    .await?;
    assert_eq!(
        by_outbox(&text, "outbox_published_total"),
        BTreeMap::from([("free".to_owned(), N as f64)]),
        "{text}"
    );
    assert_eq!(
        by_outbox(&text, "outbox_leased_messages").get("free"),
        Some(&0.0),
        "{text}"
    );
    let (code, body) = get(&metrics, "/health/ready").await?;
    let ready: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(code, 200, "{body}");
    for outbox in ["free", "held"] {
        assert_eq!(ready["outboxes"][outbox]["status"], "ready", "{body}");
    }
    common::sigterm(&child).await?;
    let rest = async {
        while let Some(line) = lines.next_line().await? {
            stderr += &line;
            stderr.push('\n');
        }
        Ok::<_, BoxError>(child.wait().await?)
    };
    let status = tokio::time::timeout(common::GUARD, rest)
        .await
        .map_err(|_| "the drain did not stop on SIGTERM")??;
    assert!(status.success(), "{status}:\n{stderr}");
    let summary = summary(&stderr)?;
    assert_eq!(
        summary["outboxes"]["free"]["published"],
        written.committed.len(),
        "{summary}"
    );
    assert_eq!(summary["outboxes"]["held"]["published"], 0, "{summary}");
    assert_eq!(summary["failed"], serde_json::json!({}), "{summary}");
    Ok(())
}
