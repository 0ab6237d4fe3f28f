//! Many outboxes in one `outbox-relay run` (`[[outbox]]` tables): every outbox delivered under
//! its own routing, nothing lost or duplicated across outboxes, new schemas picked up without a
//! restart, one outbox's database outage not stopping the others, and a large backlog in one
//! outbox not starving the small ones. Against the shared Postgres and NATS, SQLite files, and a
//! private Postgres for the outage.

#[allow(dead_code)] // not every helper of the shared module is used here
mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use common::many::{by_outbox, drop_schemas, get, pg_outbox, until_http, Outbox, Relay};
use common::{BoxError, GUARD};
use futures::StreamExt;
use outbox_conformance_tests::env::service_url;
use outbox_e2e::private::{free_port, PlainPostgres};
use outbox_e2e::unique_suffix;

type TestResult = Result<(), BoxError>;

/// The messages a relay published on `prefix.>`: by outbox (the subject's segment after the
/// prefix), their `Nats-Msg-Id`s in arrival order.
struct Deliveries {
    sub: async_nats::Subscriber,
    prefix: String,
    by_outbox: HashMap<String, Vec<String>>,
    /// When each message arrived, by id.
    arrived: HashMap<String, Instant>,
    total: usize,
}

impl Deliveries {
    /// Delete the stream.
    async fn delete(&self, nats: &str) -> TestResult {
        outbox_e2e::nats::delete_stream(nats, &self.prefix).await
    }

    /// A JetStream stream named `prefix` over `prefix.>` (the relays' publishes are acked by
    /// it), and a core subscription to the same subjects.
    async fn subscribe(nats: &str, prefix: &str) -> Result<Self, BoxError> {
        let client = async_nats::connect(nats).await?;
        async_nats::jetstream::new(client)
            .create_stream(async_nats::jetstream::stream::Config {
                name: prefix.to_owned(),
                subjects: vec![format!("{prefix}.>")],
                ..Default::default()
            })
            .await?;
        let sub = common::nats_subscription(nats, format!("{prefix}.>")).await?;
        Ok(Self {
            sub,
            prefix: prefix.to_owned(),
            by_outbox: HashMap::new(),
            arrived: HashMap::new(),
            total: 0,
        })
    }

    /// Take the next message (failing after [`GUARD`]): its outbox and id.
    async fn next(&mut self) -> Result<(String, String), BoxError> {
        let msg = tokio::time::timeout(GUARD, self.sub.next())
            .await
            .map_err(|_| format!("no message within {GUARD:?} ({} so far)", self.total))?
            .ok_or("the subscription ended")?;
        let id = msg
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .ok_or("a message without Nats-Msg-Id")?
            .as_str()
            .to_owned();
        let rest = msg
            .subject
            .as_str()
            .strip_prefix(&format!("{}.", self.prefix))
            .ok_or("a subject outside the prefix")?;
        let outbox = rest.split('.').next().unwrap_or_default().to_owned();
        self.by_outbox
            .entry(outbox.clone())
            .or_default()
            .push(id.clone());
        self.arrived.insert(id.clone(), Instant::now());
        self.total += 1;
        Ok((outbox, id))
    }

    /// Take messages until `total` have arrived.
    async fn until_total(&mut self, total: usize) -> Result<(), BoxError> {
        while self.total < total {
            self.next().await?;
        }
        Ok(())
    }

    /// Take messages until `id` has arrived.
    async fn until_id(&mut self, id: &str) -> Result<(), BoxError> {
        while !self.arrived.contains_key(id) {
            self.next().await?;
        }
        Ok(())
    }

    /// Each outbox got exactly its own messages, each once.
    fn check(&self, expected: &BTreeMap<String, Vec<String>>) -> Result<(), BoxError> {
        self.check_with(expected, None)
    }

    /// Each outbox got exactly its own messages, each once, but for outbox `may_repeat`: its
    /// database stopped under the relay, so a batch the broker took but whose completion the
    /// store never recorded is published again when its lease ends (an unavoidable duplicate,
    /// same id; a core NATS subscription sees it, JetStream's dedup window does not hide it).
    /// That outbox still gets every message, and only its own.
    fn check_with(
        &self,
        expected: &BTreeMap<String, Vec<String>>,
        may_repeat: Option<&str>,
    ) -> Result<(), BoxError> {
        for (outbox, ids) in expected {
            let got = self.by_outbox.get(outbox).cloned().unwrap_or_default();
            let unique: HashSet<&String> = got.iter().collect();
            if unique.len() != got.len() && may_repeat != Some(outbox.as_str()) {
                let mut seen = HashMap::new();
                for id in &got {
                    *seen.entry(id).or_insert(0) += 1;
                }
                let twice = seen.values().filter(|n| **n > 1).count();
                let missing = ids.iter().filter(|id| !seen.contains_key(id)).count();
                return Err(format!(
                    "outbox {outbox}: {} delivered, {twice} of them more than once, {missing} \
                     missing",
                    got.len()
                )
                .into());
            }
            let want: HashSet<&String> = ids.iter().collect();
            if unique != want {
                return Err(format!(
                    "outbox {outbox}: {} delivered, {} expected, {} of them missing",
                    got.len(),
                    ids.len(),
                    want.difference(&unique).count()
                )
                .into());
            }
        }
        let extra: Vec<&String> = self
            .by_outbox
            .keys()
            .filter(|k| !expected.contains_key(*k))
            .collect();
        if !extra.is_empty() {
            return Err(format!("messages under unknown outboxes: {extra:?}").into());
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_serves_fifty_schemas_and_two_sqlite_files() -> TestResult {
    let (Some(pg), Some(nats)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let p = format!("many{}", unique_suffix());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&pg)
        .await?;
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut schemas = Vec::new();
    for i in 0..50 {
        let schema = format!("{p}_t{i:02}");
        expected.insert(schema.clone(), pg_outbox(&pool, &schema, 20).await?);
        schemas.push(schema);
    }
    // Matches the pattern but has no table: skipped, not an error.
    let bare = format!("{p}_bare");
    sqlx::query(&format!("CREATE SCHEMA \"{bare}\""))
        .execute(&pool)
        .await?;
    schemas.push(bare.clone());
    let dir = tempfile::tempdir()?;
    for f in ["filea", "fileb"] {
        let name = format!("{p}_{f}");
        let path = dir.path().join(format!("{f}.db"));
        expected.insert(name.clone(), Outbox::sqlite(&path).with(&name, 200).await?);
    }
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            r#"
broker = "{nats}?subject={p}.{{outbox}}.{{event_type}}&stream={p}"
metrics_addr = "{metrics}"
gauges_every = "1s"
discover_every = "1s"

[[outbox]]
store = "{pg}"
schemas = "{p}_*"

[[outbox]]
name = "{p}_filea"
store = "sqlite://{a}"

[[outbox]]
name = "{p}_fileb"
store = "sqlite://{b}"
batch_size = 50
"#,
            a = dir.path().join("filea.db").display(),
            b = dir.path().join("fileb.db").display(),
        ),
    )?;
    let mut deliveries = Deliveries::subscribe(&nats, &p).await?;
    let started = Instant::now();
    let relay = Relay::start(&config)?;
    let first: usize = expected.values().map(Vec::len).sum();
    relay.fail(deliveries.until_total(first).await)?;
    eprintln!(
        "{first} messages of 52 outboxes delivered in {:?}",
        started.elapsed()
    );
    // A tenant created while the relay runs is picked up without a restart.
    let late = format!("{p}_t50");
    expected.insert(late.clone(), pg_outbox(&pool, &late, 20).await?);
    schemas.push(late.clone());
    relay.fail(deliveries.until_total(first + 20).await)?;
    relay.fail(deliveries.check(&expected))?;
    // Readiness reports each outbox; metrics carry each one's label and count its own messages.
    let ready = until_http(
        &metrics,
        "/health/ready",
        "53 ready outboxes",
        |code, body| {
            code == 200
                && serde_json::from_str::<serde_json::Value>(body)
                    .map(|v| {
                        v["status"] == "ready"
                            && v["outboxes"].as_object().map(|o| o.len()) == Some(53)
                    })
                    .unwrap_or(false)
        },
    )
    .await?;
    assert!(
        !ready.contains(&bare),
        "the bare schema is no outbox: {ready}"
    );
    // The relay counts a message once its completion returns, which may be after the broker
    // delivered it: wait for every count to come up (the wait names the last text on failure).
    let text = until_http(&metrics, "/metrics", "every outbox's count", |_, body| {
        let counts = by_outbox(body, "outbox_published_total");
        counts.len() == 53
            && expected
                .iter()
                .all(|(outbox, ids)| counts.get(outbox).copied() == Some(ids.len() as f64))
    })
    .await?;
    let published = by_outbox(&text, "outbox_published_total");
    for (outbox, ids) in &expected {
        assert_eq!(
            published.get(outbox).copied(),
            Some(ids.len() as f64),
            "outbox_published_total{{outbox=\"{outbox}\"}}"
        );
    }
    let stderr = relay.stop().await?;
    // The schema without the table: one line, however many discovery rounds ran.
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.contains("has no outbox table") && l.contains(&bare))
            .count(),
        1,
        "{stderr}"
    );
    eprintln!("test took {:?} after the setup", started.elapsed());
    deliveries.delete(&nats).await?;
    drop_schemas(&pool, &schemas).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_whose_database_is_down_for_30s_does_not_stop_the_others() -> TestResult {
    let (Some(pg), Some(nats)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let Some(private) = PlainPostgres::start()? else {
        return Ok(());
    };
    let p = format!("down{}", unique_suffix());
    let private_pool = sqlx::PgPool::connect(&private.url()).await?;
    let pool = sqlx::PgPool::connect(&pg).await?;
    let down = format!("{p}_down");
    let up_pg = format!("{p}_uppg");
    let up_file = format!("{p}_upfile");
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    expected.insert(down.clone(), pg_outbox(&private_pool, &down, 10).await?);
    expected.insert(up_pg.clone(), pg_outbox(&pool, &up_pg, 10).await?);
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("up.db");
    expected.insert(
        up_file.clone(),
        Outbox::sqlite(&file).with(&up_file, 10).await?,
    );
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            r#"
broker = "{nats}?subject={p}.{{outbox}}.{{event_type}}&stream={p}"
metrics_addr = "{metrics}"
gauges_every = "1s"
ready_timeout = "1s"

[[outbox]]
name = "{down}"
store = "{private}"
schema = "{down}"

[[outbox]]
name = "{up_pg}"
store = "{pg}"
schema = "{up_pg}"

[[outbox]]
name = "{up_file}"
store = "sqlite://{file}"
"#,
            private = private.url(),
            file = file.display(),
        ),
    )?;
    let mut deliveries = Deliveries::subscribe(&nats, &p).await?;
    let relay = Relay::start(&config)?;
    relay.fail(deliveries.until_total(30).await)?;
    private_pool.close().await;
    private.stop()?;
    let outage = Instant::now();
    // While the private database is down, the others keep flowing: each of their messages is
    // delivered before it comes back.
    let mut during = 0;
    let mut n = 10;
    let mut degraded_seen = false;
    while outage.elapsed() < Duration::from_secs(30) {
        let a = Outbox::postgres(&pool, &up_pg)
            .enqueue(&up_pg, n..n + 1)
            .await?;
        let b = Outbox::sqlite(&file).enqueue(&up_file, n..n + 1).await?;
        n += 1;
        relay.fail(deliveries.until_id(&a[0]).await)?;
        relay.fail(deliveries.until_id(&b[0]).await)?;
        expected.get_mut(&up_pg).ok_or("up_pg")?.extend(a);
        expected.get_mut(&up_file).ok_or("up_file")?.extend(b);
        during += 2;
        if !degraded_seen {
            let (code, body) = get(&metrics, "/health/ready").await?;
            let v: serde_json::Value = serde_json::from_str(&body)?;
            if v["status"] == "degraded" {
                assert_eq!(code, 200, "degraded is still ready: {body}");
                assert_eq!(v["outboxes"][&down]["status"], "not ready", "{body}");
                assert_eq!(v["outboxes"][&up_pg]["status"], "ready", "{body}");
                let (strict, _) = get(&metrics, "/health/ready?all").await?;
                assert_eq!(strict, 503, "?all wants every outbox");
                degraded_seen = true;
            }
        }
        // One message a second per outbox, the outage's pace.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(degraded_seen, "readiness never reported the outage");
    eprintln!(
        "{during} messages of the two healthy outboxes delivered during the {:?} outage",
        outage.elapsed()
    );
    assert!(during >= 20, "only {during} delivered during the outage");
    private.resume()?;
    let private_pool = sqlx::PgPool::connect(&private.url()).await?;
    let late = Outbox::postgres(&private_pool, &down)
        .enqueue(&down, 10..20)
        .await?;
    for id in &late {
        relay.fail(deliveries.until_id(id).await)?;
    }
    expected.get_mut(&down).ok_or("down")?.extend(late);
    relay.fail(deliveries.check_with(&expected, Some(&down)))?;
    // Each outbox's messages counted under its own label only.
    let text = until_http(&metrics, "/metrics", "the counts", |_, body| {
        by_outbox(body, "outbox_published_total").get(&down) == Some(&20.0)
    })
    .await?;
    let published = by_outbox(&text, "outbox_published_total");
    for (outbox, ids) in &expected {
        assert_eq!(published.get(outbox), Some(&(ids.len() as f64)), "{outbox}");
    }
    relay.stop().await?;
    deliveries.delete(&nats).await?;
    drop_schemas(&pool, &[up_pg]).await
}

/// A tenant with a 20,000-row backlog beside five writing a message every 200 ms: the small
/// ones are published while the backlog drains (not after it), and their commit-to-publish p99
/// is printed. The 200,000-row case is `cargo run -p outbox-bench --bin many-outboxes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_backlog_does_not_starve_small_tenants() -> TestResult {
    let (Some(pg), Some(nats)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    const BACKLOG: usize = 20_000;
    let p = format!("fair{}", unique_suffix());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .connect(&pg)
        .await?;
    let big = format!("{p}_big");
    let backlog = pg_outbox(&pool, &big, BACKLOG).await?;
    let small: Vec<String> = (0..5).map(|i| format!("{p}_s{i}")).collect();
    for s in &small {
        pg_outbox(&pool, s, 0).await?;
    }
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            r#"
broker = "{nats}?subject={p}.{{outbox}}.{{event_type}}&stream={p}"

[[outbox]]
store = "{pg}"
schemas = "{p}_*"
"#
        ),
    )?;
    let mut deliveries = Deliveries::subscribe(&nats, &p).await?;
    let relay = Relay::start(&config)?;
    // The backlog is being worked off.
    while !deliveries.by_outbox.contains_key(&big) {
        relay.fail(deliveries.next().await)?;
    }
    let drained = |d: &Deliveries| d.by_outbox.get(&big).map_or(0, Vec::len) >= BACKLOG;
    let mut committed: HashMap<String, Instant> = HashMap::new();
    let mut n = 0;
    let mut small_before_backlog_end = 0;
    let writer_pool = pool.clone();
    // Write a round, then read what arrived until the next round is due.
    let mut round = tokio::time::interval(Duration::from_millis(200));
    loop {
        round.tick().await;
        let backlog_done = drained(&deliveries);
        if backlog_done && n >= 10 {
            break;
        }
        for s in &small {
            let id = Outbox::postgres(&writer_pool, s)
                .enqueue(s, n..n + 1)
                .await?;
            committed.insert(id[0].clone(), Instant::now());
        }
        n += 1;
        let due = tokio::time::Instant::now() + Duration::from_millis(150);
        while let Ok(next) = tokio::time::timeout_at(due, deliveries.next()).await {
            let (outbox, _) = next?;
            if outbox != big && !drained(&deliveries) {
                small_before_backlog_end += 1;
            }
        }
    }
    for id in committed.keys() {
        relay.fail(deliveries.until_id(id).await)?;
    }
    let mut latencies: Vec<Duration> = committed
        .iter()
        .map(|(id, at)| deliveries.arrived[id].saturating_duration_since(*at))
        .collect();
    latencies.sort();
    let p99 = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
    eprintln!(
        "{} small-tenant messages beside a {BACKLOG}-row backlog: commit-to-receipt p50 {:?}, \
         p99 {p99:?}, max {:?}; {small_before_backlog_end} arrived before the backlog was drained",
        latencies.len(),
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1],
    );
    assert!(
        small_before_backlog_end > 0,
        "no small-tenant message was published while the backlog drained"
    );
    let mut expected = BTreeMap::new();
    expected.insert(big.clone(), backlog);
    for s in &small {
        let ids: Vec<String> = committed
            .keys()
            .filter(|id| deliveries.by_outbox.get(s).is_some_and(|v| v.contains(id)))
            .cloned()
            .collect();
        assert_eq!(ids.len(), n, "{s}");
        expected.insert(s.clone(), ids);
    }
    relay.fail(deliveries.check(&expected))?;
    relay.stop().await?;
    let mut schemas = small;
    schemas.push(big);
    deliveries.delete(&nats).await?;
    drop_schemas(&pool, &schemas).await
}
