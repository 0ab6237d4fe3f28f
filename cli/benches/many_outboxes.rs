//! One relay over many outboxes against one relay process per outbox, side by side in one run,
//! on a private Postgres the bench starts (a hundred relay processes need several hundred
//! connections; `OUTBOX_TEST_POSTGRES_URL` when PostgreSQL is not installed) and the NATS of
//! `OUTBOX_TEST_NATS_URL`:
//!
//! ```text
//! cargo bench -p outbox-cli --bench many_outboxes              # 1, 10 and 100 outboxes
//! cargo bench -p outbox-cli --bench many_outboxes -- backlog   # 200,000 rows beside 5 small tenants
//! cargo bench -p outbox-cli --bench many_outboxes -- backlog streams=own big_batch=500
//! ```
//!
//! For each count: idle cost (claims per second, from the relays' own `outbox_claim_seconds`
//! counts, and CPU seconds per second of the relay processes) over 5 s with nothing written;
//! then the same total rate (500 messages a second spread over the outboxes) for 10 s:
//! messages delivered per second and commit-to-receipt p99; then a 20,000-message backlog spread
//! over the outboxes: drain throughput.
//!
//! `backlog`: one relay over a 200,000-row tenant and five tenants writing a message a second
//! each; the small tenants' commit-to-receipt p50/p99/max, and from the relay's own histograms
//! the mean claim and publish call of the small tenants and of the large one. By default three
//! variants one after the other: one JetStream stream for all tenants, a stream per tenant, and
//! the large tenant's batch at 500 instead of the store's 2,000; `streams=own|shared` and
//! `big_batch=N` run one.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use outbox::NewMessage;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
const RATE: u64 = 500;

/// A free port for a relay's metrics, below Linux's ephemeral range (32768 up): a port the
/// kernel handed out for the probe could be handed again to one of the hundred relays'
/// outgoing connections before the relay meant for it binds it.
fn free_port() -> Result<u16, BoxError> {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    if NEXT.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        let start = 20_000 + (std::process::id() % 5_000) as u16;
        let _ = NEXT.compare_exchange(
            0,
            start,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    loop {
        let port = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if port >= 32_000 {
            return Err("no free port below 32000".into());
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
}

async fn get(addr: &str, path: &str) -> Result<String, BoxError> {
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut text = String::new();
    conn.read_to_string(&mut text).await?;
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default())
}

/// Where the relay serving metrics on `metrics` logs.
fn log_of(metrics: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "many-outboxes-relay-{}.log",
        metrics.replace(':', "_")
    ))
}

/// The sum of `outbox_claim_seconds_count` samples on a relay's endpoint.
async fn claims(addr: &str) -> f64 {
    get(addr, "/metrics")
        .await
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("outbox_claim_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// CPU seconds used so far by process `pid` (user + system).
fn cpu(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let after = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    ticks / 100.0
}

struct Relays {
    children: Vec<Child>,
    metrics: Vec<String>,
}

impl Relays {
    /// A relay with `args` serving metrics on `metrics`; its warnings go to a log file named
    /// after the address (printed by [`Relays::check`] if it exits).
    fn spawn(args: &[String], metrics: String) -> Result<Child, BoxError> {
        Ok(Command::new(BIN)
            .args(args)
            .arg("--metrics-addr")
            .arg(&metrics)
            .arg("run")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log_of(&metrics))?)
            .kill_on_drop(true)
            .spawn()?)
    }

    /// Fail if a relay exited (a metrics port taken between `free_port` and its bind, say):
    /// the figures would be those of fewer relays, and its outbox would never drain.
    fn check(&mut self) -> Result<(), BoxError> {
        for (child, metrics) in self.children.iter_mut().zip(&self.metrics) {
            if let Some(status) = child.try_wait()? {
                let log = std::fs::read_to_string(log_of(metrics)).unwrap_or_default();
                return Err(format!("a relay exited at start-up ({status}):\n{log}").into());
            }
        }
        Ok(())
    }

    async fn claims(&self) -> f64 {
        let mut total = 0.0;
        for m in &self.metrics {
            total += claims(m).await;
        }
        total
    }

    fn cpu(&self) -> f64 {
        self.children.iter().filter_map(Child::id).map(cpu).sum()
    }

    async fn stop(mut self) {
        for child in &mut self.children {
            if let Some(pid) = child.id() {
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
            }
        }
        for child in &mut self.children {
            let _ = tokio::time::timeout(Duration::from_secs(20), child.wait()).await;
        }
    }
}

async fn enqueue(pool: &sqlx::PgPool, schema: &str, n: usize) -> Result<(), BoxError> {
    let config = outbox::postgres::PostgresConfig::builder()
        .schema(schema.to_owned())
        .build()?;
    let messages: Vec<NewMessage> = (0..n)
        .map(|i| {
            NewMessage::new("b", format!("{i}"), "e", serde_json::json!({"n": i}))
                .with_partition_key(format!("k{}", i % 16))
        })
        .collect();
    let mut tx = pool.begin().await?;
    for chunk in messages.chunks(1000) {
        outbox::postgres::enqueue_batch(&mut *tx, &config, chunk).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Arrival times by message id, filled by a core subscription.
type Arrivals = Arc<Mutex<HashMap<String, Instant>>>;

async fn listen(nats: &str, subject: String) -> Result<Arrivals, BoxError> {
    let client = async_nats::connect(nats).await?;
    let mut sub = client.subscribe(subject).await?;
    client.flush().await?;
    let arrivals: Arrivals = Arc::default();
    let sink = arrivals.clone();
    tokio::spawn(async move {
        let _keep = client;
        while let Some(msg) = sub.next().await {
            if let Some(id) = msg.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
                if let Ok(mut map) = sink.lock() {
                    map.insert(id.as_str().to_owned(), Instant::now());
                }
            }
        }
    });
    Ok(arrivals)
}

fn count(arrivals: &Arrivals) -> usize {
    arrivals.lock().map(|m| m.len()).unwrap_or(0)
}

async fn wait_for(arrivals: &Arrivals, n: usize, guard: Duration) -> bool {
    let deadline = Instant::now() + guard;
    while count(arrivals) < n {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

fn p99(mut v: Vec<Duration>) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

/// Write `RATE` messages a second spread over `schemas` for `secs`: commit instants by id.
async fn steady(
    pool: &sqlx::PgPool,
    schemas: &[String],
    secs: u64,
) -> Result<HashMap<String, Instant>, BoxError> {
    let mut committed = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE.min(1000)));
    let mut i = 0usize;
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        tick.tick().await;
        let schema = &schemas[i % schemas.len()];
        i += 1;
        let config = outbox::postgres::PostgresConfig::builder()
            .schema(schema.clone())
            .build()?;
        let m = NewMessage::new("b", "s", "e", serde_json::json!({})).with_partition_key("s");
        let id = m.id.to_string();
        let mut tx = pool.begin().await?;
        outbox::postgres::enqueue(&mut *tx, &config, &m).await?;
        tx.commit().await?;
        committed.insert(id, Instant::now());
    }
    Ok(committed)
}

async fn compare(pg: &str, nats: &str, pool: &sqlx::PgPool, n: usize) -> Result<(), BoxError> {
    let p = format!("bm{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let schemas: Vec<String> = (0..n).map(|i| format!("{p}_{i:03}")).collect();
    for s in &schemas {
        let config = outbox::postgres::PostgresConfig::builder()
            .schema(s.clone())
            .build()?;
        outbox::postgres::migrate(pool, &config).await?;
    }
    let js = async_nats::jetstream::new(async_nats::connect(nats).await?);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: p.clone(),
        subjects: vec![format!("{p}.>")],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await?;
    let broker = format!("{nats}?subject={p}.{{outbox}}.{{event_type}}&stream={p}");
    for mode in ["one relay", "one per outbox"] {
        let mut relays = if mode == "one relay" {
            let dir = std::env::temp_dir().join(format!("{p}.toml"));
            std::fs::write(
                &dir,
                format!(
                    "broker = \"{broker}\"\n[[outbox]]\nstore = \"{pg}\"\nschemas = \"{p}_*\"\n"
                ),
            )?;
            let m = format!("127.0.0.1:{}", free_port()?);
            let child = Relays::spawn(&["--config".into(), dir.display().to_string()], m.clone())?;
            Relays {
                children: vec![child],
                metrics: vec![m],
            }
        } else {
            let mut r = Relays {
                children: vec![],
                metrics: vec![],
            };
            for s in &schemas {
                let m = format!("127.0.0.1:{}", free_port()?);
                let b = broker.replace("{outbox}", s);
                let args = ["--store", pg, "--schema", s, "--broker", &b].map(String::from);
                r.children.push(Relays::spawn(&args, m.clone())?);
                r.metrics.push(m);
            }
            r
        };
        // Settle, then idle cost over 5 s.
        tokio::time::sleep(Duration::from_secs(3)).await;
        relays.check()?;
        let (c0, t0, at) = (relays.claims().await, relays.cpu(), Instant::now());
        tokio::time::sleep(Duration::from_secs(5)).await;
        let secs = at.elapsed().as_secs_f64();
        let idle_claims = (relays.claims().await - c0) / secs;
        let idle_cpu = (relays.cpu() - t0) / secs;
        // Steady rate.
        let arrivals = listen(nats, format!("{p}.>")).await?;
        let committed = steady(pool, &schemas, 10).await?;
        wait_for(&arrivals, committed.len(), Duration::from_secs(60)).await;
        let lat: Vec<Duration> = {
            let map = arrivals.lock().map_err(|_| "poisoned")?;
            committed
                .iter()
                .filter_map(|(id, at)| map.get(id).map(|r| r.saturating_duration_since(*at)))
                .collect()
        };
        let steady_p99 = p99(lat);
        // Backlog drain: 20,000 spread over the outboxes.
        let before = count(&arrivals);
        let per = 20_000 / n;
        for s in &schemas {
            enqueue(pool, s, per).await?;
        }
        let start = Instant::now();
        wait_for(&arrivals, before + per * n, Duration::from_secs(300)).await;
        let drain = (count(&arrivals) - before) as f64 / start.elapsed().as_secs_f64();
        println!(
            "| {n:>3} | {mode:<15} | {:>4} | {idle_claims:>8.1} | {idle_cpu:>6.3} | {:>8} | {drain:>9.0} |",
            relays.children.len(),
            format!("{steady_p99:.1?}"),
        );
        relays.stop().await;
    }
    js.delete_stream(&p).await?;
    for s in &schemas {
        sqlx::query(&format!("DROP SCHEMA \"{s}\" CASCADE"))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// How the backlog case is set up.
#[derive(Clone, Copy, Debug)]
struct Variant {
    /// One JetStream stream per outbox (else one stream for all, as in the other cases).
    own_streams: bool,
    /// The large tenant's batch size (else the store's choice).
    big_batch: Option<usize>,
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let streams = if self.own_streams { "own" } else { "shared" };
        write!(f, "streams={streams}")?;
        match self.big_batch {
            Some(b) => write!(f, " big_batch={b}"),
            None => write!(f, " big_batch=default"),
        }
    }
}

/// Sum of `metric` samples whose labels hold one of `outboxes`.
fn metric_sum(text: &str, metric: &str, outboxes: &[String]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(metric) && l[metric.len()..].starts_with('{'))
        .filter(|l| {
            outboxes
                .iter()
                .any(|o| l.contains(&format!("outbox=\"{o}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// The mean of histogram `name` over `outboxes`' samples on the endpoint's text.
fn mean(text: &str, name: &str, outboxes: &[String]) -> Duration {
    let count = metric_sum(text, &format!("{name}_count"), outboxes);
    let sum = metric_sum(text, &format!("{name}_sum"), outboxes);
    if count > 0.0 {
        Duration::from_secs_f64(sum / count)
    } else {
        Duration::ZERO
    }
}

/// A `ROWS`-row backlog beside five tenants writing one message a second each.
async fn backlog(
    pg: &str,
    nats: &str,
    pool: &sqlx::PgPool,
    variant: Variant,
) -> Result<(), BoxError> {
    const ROWS: usize = 200_000;
    let p = format!("bb{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let big = format!("{p}_big");
    let small: Vec<String> = (0..5).map(|i| format!("{p}_s{i}")).collect();
    for s in small.iter().chain([&big]) {
        let config = outbox::postgres::PostgresConfig::builder()
            .schema(s.clone())
            .build()?;
        outbox::postgres::migrate(pool, &config).await?;
    }
    enqueue(pool, &big, ROWS).await?;
    let js = async_nats::jetstream::new(async_nats::connect(nats).await?);
    let streams: Vec<(String, String)> = if variant.own_streams {
        small
            .iter()
            .chain([&big])
            .map(|s| (s.clone(), format!("{p}.{s}.>")))
            .collect()
    } else {
        vec![(p.clone(), format!("{p}.>"))]
    };
    for (name, subjects) in &streams {
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subjects.clone()],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await?;
    }
    let arrivals = listen(nats, format!("{p}.>")).await?;
    let stream = if variant.own_streams { "{outbox}" } else { &p };
    let broker = format!("{nats}?subject={p}.{{outbox}}.{{event_type}}&stream={stream}");
    let path = std::env::temp_dir().join(format!("{p}.toml"));
    let big_batch = variant
        .big_batch
        .map(|b| format!("batch_size = {b}\n"))
        .unwrap_or_default();
    std::fs::write(
        &path,
        format!(
            "broker = \"{broker}\"\n[[outbox]]\nname = \"{big}\"\nstore = \"{pg}\"\n\
             schema = \"{big}\"\n{big_batch}[[outbox]]\nstore = \"{pg}\"\nschemas = \"{p}_s*\"\n"
        ),
    )?;
    let m = format!("127.0.0.1:{}", free_port()?);
    let relay = Relays::spawn(&["--config".into(), path.display().to_string()], m.clone())?;
    let relays = Relays {
        children: vec![relay],
        metrics: vec![m.clone()],
    };
    let start = Instant::now();
    // Five tenants, one message a second each, until the backlog is drained.
    let mut committed = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut i = 0;
    while count(&arrivals) < ROWS + committed.len() || committed.len() < 25 {
        tick.tick().await;
        if start.elapsed() > Duration::from_secs(600) {
            break;
        }
        let s = &small[i % 5];
        i += 1;
        let config = outbox::postgres::PostgresConfig::builder()
            .schema(s.clone())
            .build()?;
        let msg = NewMessage::new("b", "s", "e", serde_json::json!({})).with_partition_key("s");
        let mut tx = pool.begin().await?;
        outbox::postgres::enqueue(&mut *tx, &config, &msg).await?;
        tx.commit().await?;
        committed.insert(msg.id.to_string(), Instant::now());
    }
    let took = start.elapsed();
    wait_for(&arrivals, ROWS + committed.len(), Duration::from_secs(30)).await;
    let lat: Vec<Duration> = {
        let map = arrivals.lock().map_err(|_| "poisoned")?;
        committed
            .iter()
            .filter_map(|(id, at)| map.get(id).map(|r| r.saturating_duration_since(*at)))
            .collect()
    };
    let text = get(&m, "/metrics").await.unwrap_or_default();
    let n = lat.len();
    let mut sorted = lat.clone();
    sorted.sort();
    println!(
        "{variant}: {ROWS}-row backlog drained in {took:.1?} ({:.0} msg/s) beside 5 tenants at \
         1 msg/s: {n} small messages, commit-to-receipt p50 {:.1?}, p99 {:.1?}, max {:.1?}; \
         small tenants' mean claim {:.1?}, publish {:.1?}; large tenant's mean claim {:.1?}, \
         publish {:.1?}",
        ROWS as f64 / took.as_secs_f64(),
        sorted.get(n / 2).copied().unwrap_or_default(),
        p99(lat),
        sorted.last().copied().unwrap_or_default(),
        mean(&text, "outbox_claim_seconds", &small),
        mean(&text, "outbox_publish_seconds", &small),
        mean(&text, "outbox_claim_seconds", std::slice::from_ref(&big)),
        mean(&text, "outbox_publish_seconds", std::slice::from_ref(&big)),
    );
    relays.stop().await;
    for (name, _) in &streams {
        js.delete_stream(name).await?;
    }
    for s in small.iter().chain([&big]) {
        sqlx::query(&format!("DROP SCHEMA \"{s}\" CASCADE"))
            .execute(pool)
            .await?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // A private server: a hundred relay processes hold several hundred connections, more than
    // the shared server allows (100), and other jobs' queries stay out of the figures.
    let private = outbox_conformance_tests::servers::PostgresCluster::start(
        outbox_conformance_tests::servers::PostgresSetup {
            conf: "max_connections = 800\nshared_buffers = 256MB".into(),
            ..Default::default()
        },
    )?;
    let pg = match &private {
        Some(cluster) => format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port()),
        None => std::env::var("OUTBOX_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
    };
    println!(
        "Postgres: {}",
        if private.is_some() {
            "a private server started by the bench (max_connections 800, fsync off)"
        } else {
            "OUTBOX_TEST_POSTGRES_URL (no PostgreSQL binaries for a private one)"
        }
    );
    let nats =
        std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&pg)
        .await?;
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "backlog") {
        // `streams=own` and `big_batch=N` pick one variant; without them, the variants side
        // by side.
        let own = args
            .iter()
            .find_map(|a| a.strip_prefix("streams="))
            .map(|s| s == "own");
        let batch = args
            .iter()
            .find_map(|a| a.strip_prefix("big_batch="))
            .map(str::parse)
            .transpose()?;
        let variants = if own.is_some() || batch.is_some() {
            vec![Variant {
                own_streams: own.unwrap_or(false),
                big_batch: batch,
            }]
        } else {
            vec![
                Variant {
                    own_streams: false,
                    big_batch: None,
                },
                Variant {
                    own_streams: true,
                    big_batch: None,
                },
                Variant {
                    own_streams: false,
                    big_batch: Some(500),
                },
            ]
        };
        for variant in variants {
            backlog(&pg, &nats, &pool, variant).await?;
        }
        return Ok(());
    }
    let counts: Vec<usize> = args
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect::<Vec<_>>();
    let counts = if counts.is_empty() {
        vec![1, 10, 100]
    } else {
        counts
    };
    println!("| outboxes | mode | processes | idle claims/s | idle CPU s/s | p99 at {RATE} msg/s | drain msg/s |");
    println!("|---|---|---|---|---|---|---|");
    for n in counts {
        compare(&pg, &nats, &pool, n).await?;
    }
    Ok(())
}
