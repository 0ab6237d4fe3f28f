//! The shipped alert rules and Grafana dashboard against a real Prometheus (Debian's
//! `prometheus` package, installed by `scripts/services`): `promtool check rules`, then a
//! private Prometheus on a free port scrapes a running relay, evaluates every alert rule without
//! error, and answers every dashboard query without error. Every metric the rules and the
//! dashboard name is one the relay serves or the operations page documents.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use outbox::sqlite::SqliteConfig;
use outbox::NewMessage;
use outbox_conformance_tests::env::services_required;
use serde_json::Value;

mod common;
use common::{relay_process, sigterm, BoxError, GUARD};

type TestResult = Result<(), BoxError>;

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn free_port() -> Result<u16, BoxError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET path` over HTTP/1.0 (so the body is not chunked): the body, if the status is 200.
async fn get(addr: &str, path: &str) -> Result<String, BoxError> {
    match common::many::get(addr, path).await? {
        (200, body) => Ok(body),
        (code, body) => Err(format!("GET {path}: {code}\n{body}").into()),
    }
}

/// Poll `check` on Prometheus's API until it holds (Prometheus scrapes and evaluates on its own
/// schedule); the last answer.
async fn until<F>(addr: &str, path: &str, what: &str, check: F) -> Result<Value, BoxError>
where
    F: Fn(&Value) -> bool,
{
    let poll = async {
        loop {
            if let Ok(body) = get(addr, path).await {
                if let Ok(value) = serde_json::from_str::<Value>(&body) {
                    if check(&value) {
                        return value;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    Ok(tokio::time::timeout(GUARD, poll)
        .await
        .map_err(|_| format!("Prometheus never showed {what}"))?)
}

fn encode(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("outbox_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        // Strip the histogram series suffixes: the documented name is the histogram's.
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        // `outbox_relay_cli` and the like are not metrics.
        if !base.starts_with("outbox_relay") {
            names.insert(base.to_owned());
        }
        rest = &tail[end..];
    }
    names
}

struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn alert_rules_and_dashboard_queries_evaluate_on_a_real_prometheus() -> TestResult {
    if !Path::new(PROMETHEUS).exists() || !Path::new(PROMTOOL).exists() {
        assert!(
            !services_required(),
            "prometheus and promtool are needed with OUTBOX_REQUIRE_SERVICES=1 \
             (scripts/services installs Debian's prometheus package)"
        );
        eprintln!("skipped: Debian's prometheus package is not installed");
        return Ok(());
    }
    let rules = repo().join("deploy/prometheus/alerts.yml");
    let dashboard_path = repo().join("deploy/grafana/outbox-relay.json");
    let checked = std::process::Command::new(PROMTOOL)
        .args(["check", "rules"])
        .arg(&rules)
        .output()?;
    assert!(checked.status.success(), "promtool: {checked:?}");
    let checked = std::process::Command::new(PROMTOOL)
        .args(["check", "config"])
        .arg(repo().join("deploy/prometheus/scrape.yml"))
        .output()?;
    assert!(checked.status.success(), "promtool: {checked:?}");

    // A relay with messages to publish, so its histograms have series.
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("outbox.sqlite");
    let config = SqliteConfig::default();
    {
        let mut conn = outbox::sqlite::open_connection(&db, &config)?;
        outbox::sqlite::migrate(&conn, &config)?;
        let tx = conn.transaction()?;
        let messages: Vec<NewMessage> = (0..20).map(|n| common::message(n, 4)).collect();
        outbox::sqlite::enqueue_batch(&tx, &config, &messages)?;
        tx.commit()?;
    }
    let relay_addr = format!("127.0.0.1:{}", free_port()?);
    let store = format!("sqlite://{}", db.display());
    let relay = relay_process([
        "run",
        "--store",
        &store,
        "--broker",
        "stdout://",
        "--metrics-addr",
        &relay_addr,
        "--gauges-every",
        "200ms",
    ])?;

    let prom_addr = format!("127.0.0.1:{}", free_port()?);
    let prom_config = dir.path().join("prometheus.yml");
    std::fs::write(
        &prom_config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: outbox-relay\n    static_configs:\n      - targets: [\"{relay_addr}\"]\n",
            rules = rules.display()
        ),
    )?;
    let _prometheus = Killed(
        std::process::Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", prom_config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={prom_addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );

    // Scraped, with the relay's gauges and histograms in the database.
    until(
        &prom_addr,
        &format!("/api/v1/query?query={}", encode("outbox_store_up == 1")),
        "the relay scraped",
        |v| {
            v["data"]["result"]
                .as_array()
                .is_some_and(|r| !r.is_empty())
        },
    )
    .await?;
    until(
        &prom_addr,
        &format!(
            "/api/v1/query?query={}",
            encode("outbox_commit_to_ack_seconds_bucket")
        ),
        "the commit-to-ack histogram",
        |v| v["data"]["result"].as_array().is_some_and(|r| r.len() > 1),
    )
    .await?;

    // Every rule evaluated at least once, none with an error.
    let evaluated = until(&prom_addr, "/api/v1/rules", "every rule evaluated", |v| {
        v["data"]["groups"].as_array().is_some_and(|groups| {
            groups.iter().all(|g| {
                g["rules"].as_array().is_some_and(|rules| {
                    rules.iter().all(|r| {
                        r["lastEvaluation"]
                            .as_str()
                            .is_some_and(|t| !t.starts_with("0001"))
                    })
                })
            })
        })
    })
    .await?;
    let mut rule_count = 0;
    for group in evaluated["data"]["groups"].as_array().ok_or("no groups")? {
        for rule in group["rules"].as_array().ok_or("no rules")? {
            rule_count += 1;
            assert_eq!(rule["health"], "ok", "{rule}");
        }
    }
    assert_eq!(rule_count, 7);
    // With 20 messages published and none failing, no alert fires.
    let alerts = get(&prom_addr, "/api/v1/alerts").await?;
    let alerts: Value = serde_json::from_str(&alerts)?;
    let firing: Vec<&Value> = alerts["data"]["alerts"]
        .as_array()
        .ok_or("no alerts")?
        .iter()
        .filter(|a| a["state"] == "firing")
        .collect();
    assert!(firing.is_empty(), "{firing:?}");

    // Every dashboard query, with the dashboard's variables filled in.
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&dashboard_path)?)?;
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().ok_or("no panels")? {
        for target in panel["targets"].as_array().ok_or("no targets")? {
            let expr = target["expr"]
                .as_str()
                .ok_or("no expr")?
                .replace("$__rate_interval", "1m")
                .replace("$job", "outbox-relay");
            let body = get(
                &prom_addr,
                &format!("/api/v1/query?query={}", encode(&expr)),
            )
            .await?;
            let answer: Value = serde_json::from_str(&body)?;
            assert_eq!(answer["status"], "success", "{expr}: {answer}");
            queries += 1;
        }
    }
    assert!(queries >= 10, "{queries}");

    // The names used exist: served by the relay now, or documented (counters appear once
    // counted, e.g. outbox_dead_total).
    let served = metric_names(&get(&relay_addr, "/metrics").await?);
    let documented = metric_names(&std::fs::read_to_string(repo().join("docs/operations.md"))?);
    let used = metric_names(&format!(
        "{}{}",
        std::fs::read_to_string(&rules)?,
        dashboard
    ));
    for name in &used {
        assert!(
            served.contains(name) || documented.contains(name),
            "{name} is neither served nor documented"
        );
    }
    for name in &served {
        assert!(
            documented.contains(name),
            "{name} is served but not documented"
        );
    }

    sigterm(&relay).await?;
    let out = tokio::time::timeout(GUARD, relay.wait_with_output()).await??;
    assert!(out.status.success(), "{out:?}");
    Ok(())
}
