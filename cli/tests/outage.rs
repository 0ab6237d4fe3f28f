//! A broker outage against a real `outbox-relay run --max-attempts 2`: a PRIVATE nats-server
//! (free port, temporary JetStream directory; never the shared one) is stopped for 60 s while
//! messages keep being written, then started again. Nothing may be dead-lettered or lost, the
//! relay must resume by itself, and its probes of the broker must stay bounded (about one a
//! second at most). The 60 s is the outage being tested, not a wait for a retry; every other wait
//! polls for an event.
//!
//! The same for a private Kafka (Tansu) and a private Redis, stopped for 15 s and started again
//! EMPTY (both keep nothing across a restart, like a broker replaced by an empty one): no attempt
//! may be counted, and the relay must resume soon after the broker's return without a restart.
//! The tests of this file run concurrently, so the shorter ones add little to its wall time.

use std::path::Path;
use std::time::Duration;

use outbox::sqlite::{SqliteConfig, SqliteStore};
use outbox::OutboxAdmin;
use outbox_e2e::private::{free_port, PlainKafka, PlainNats, PlainPostgres, PlainRedis};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod common;
use common::{message, relay_process, sigterm, BoxError, GUARD};

type TestResult = Result<(), BoxError>;

/// The outage the issue describes.
const OUTAGE: Duration = Duration::from_secs(60);
/// Messages written before and during the outage.
const BEFORE: usize = 100;
const DURING: usize = 100;

/// The relay's `/metrics` text.
async fn metrics(addr: &str) -> Result<String, BoxError> {
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
        .await?;
    let mut text = String::new();
    conn.read_to_string(&mut text).await?;
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or("")
        .to_owned())
}

/// The value of metric `name` (summed over its labels), 0 when absent.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `outbox-relay run --max-attempts 2` from the SQLite outbox at `path` to `broker`, with its
/// metrics on a free port; returns the process and the metrics address.
fn sqlite_relay(path: &Path, broker: &str) -> Result<(tokio::process::Child, String), BoxError> {
    let addr = format!("127.0.0.1:{}", free_port()?);
    let sqlite = format!("sqlite://{}", path.display());
    let relay = relay_process([
        "run",
        "--store",
        &sqlite,
        "--broker",
        broker,
        "--max-attempts",
        "2",
        "--metrics-addr",
        &addr,
    ])?;
    Ok((relay, addr))
}

/// Stop `relay` (SIGTERM) and check that it exits cleanly and that its log has exactly one WARN
/// when the broker went down, one INFO when it came back, and nothing dead-lettered. Returns
/// those two lines.
async fn stop_checking_the_outage_log(
    relay: tokio::process::Child,
) -> Result<(String, String), BoxError> {
    sigterm(&relay).await?;
    let out = tokio::time::timeout(GUARD, relay.wait_with_output()).await??;
    assert!(out.status.success(), "{out:?}");
    let log = String::from_utf8_lossy(&out.stderr);
    let lines = |text: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains(text))
            .map(str::to_owned)
            .collect()
    };
    let (down, back) = (lines("broker is down"), lines("broker is back after"));
    assert_eq!(down.len(), 1, "one WARN when the broker went down:\n{log}");
    assert!(down[0].contains("WARN"), "{}", down[0]);
    assert_eq!(back.len(), 1, "one INFO when it came back:\n{log}");
    assert!(back[0].contains("INFO"), "{}", back[0]);
    assert!(!log.contains("dead-lettered"), "{log}");
    Ok((down[0].clone(), back[0].clone()))
}

/// Write messages `range` into the SQLite outbox in one transaction; returns their ids.
fn enqueue(path: &Path, range: std::ops::Range<usize>) -> Result<Vec<String>, BoxError> {
    let config = SqliteConfig::default();
    let mut conn = outbox::sqlite::open_connection(path, &config)?;
    outbox::sqlite::migrate(&conn, &config)?;
    let messages: Vec<_> = range.map(|n| message(n, 7)).collect();
    let tx = conn.transaction()?;
    outbox::sqlite::enqueue_batch(&tx, &config, &messages)?;
    tx.commit()?;
    Ok(messages.iter().map(|m| m.id.to_string()).collect())
}

/// Poll the store's counts until `published` messages are published.
async fn until_published(store: &SqliteStore, published: u64) -> TestResult {
    let poll = async {
        loop {
            if let Ok(c) = store.counts().await {
                if c.published >= published {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(GUARD, poll)
        .await
        .map_err(|_| format!("{published} messages were not published in time"))?;
    Ok(())
}

#[tokio::test]
async fn a_minute_long_nats_outage_dead_letters_nothing_and_loses_nothing() -> TestResult {
    let Some(mut nats) = PlainNats::start()? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    enqueue(&path, 0..BEFORE)?;
    let store = SqliteStore::open(&path, SqliteConfig::default()).await?;
    let url = nats.url();
    let broker = format!("{url}?subject=outage.{{event_type}}&stream=OUTAGE&create_stream=true");
    let (relay, addr) = sqlite_relay(&path, &broker)?;
    until_published(&store, BEFORE as u64).await?;

    // Mid-stream: the broker goes away while more messages are written.
    nats.stop();
    enqueue(&path, BEFORE..BEFORE + DURING)?;
    tokio::time::sleep(OUTAGE).await;
    let during = metrics(&addr).await?;
    let counts = store.counts().await?;
    assert_eq!(
        counts.dead, 0,
        "dead-lettered during the outage: {counts:?}"
    );
    assert_eq!(metric(&during, "outbox_broker_up"), 0.0, "{during}");
    let probes = metric(&during, "outbox_broker_probes_total");
    // Back-off from 100 ms capped at 1 s (± 20 %): about 50-70 probes in a minute.
    assert!(
        (1.0..=80.0).contains(&probes),
        "{probes} probes during a {OUTAGE:?} outage"
    );

    nats.resume()?;
    until_published(&store, (BEFORE + DURING) as u64).await?;
    let after = metrics(&addr).await?;
    assert_eq!(metric(&after, "outbox_dead_total"), 0.0, "{after}");
    assert_eq!(metric(&after, "outbox_broker_up"), 1.0, "{after}");
    let counts = store.counts().await?;
    assert_eq!(
        (counts.published, counts.dead),
        ((BEFORE + DURING) as u64, 0)
    );

    let (down, back) = stop_checking_the_outage_log(relay).await?;
    eprintln!("{probes} probes; {down}\n{back}");

    // Every message is in the stream exactly once (JetStream drops a republished id).
    let client = async_nats::connect(&url).await?;
    let mut stream = async_nats::jetstream::new(client)
        .get_stream("OUTAGE")
        .await?;
    assert_eq!(
        stream.info().await?.state.messages,
        (BEFORE + DURING) as u64
    );
    drop(nats);
    Ok(())
}

/// Poll the Postgres store's counts until `published` messages are published.
async fn until_pg_published(store: &outbox::postgres::PostgresStore, published: u64) -> TestResult {
    let poll = async {
        loop {
            if let Ok(c) = store.counts().await {
                if c.published >= published {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(GUARD, poll)
        .await
        .map_err(|_| format!("{published} messages were not published in time"))?;
    Ok(())
}

/// A private Postgres stopped (immediate shutdown) for 10 s mid-stream under `outbox-relay run
/// --max-attempts 2` and started again: nothing dead, nothing lost, one WARN and one INFO.
#[tokio::test]
async fn a_postgres_restart_mid_stream_dead_letters_nothing_and_loses_nothing() -> TestResult {
    let (Some(pg), Some(nats)) = (PlainPostgres::start()?, PlainNats::start()?) else {
        return Ok(());
    };
    let config = outbox::postgres::PostgresConfig::default();
    let pool = sqlx::PgPool::connect(&pg.url()).await?;
    let store = outbox::postgres::PostgresStore::new(pool.clone(), config.clone());
    store.migrate().await?;
    let batch = |range: std::ops::Range<usize>| range.map(|n| message(n, 7)).collect::<Vec<_>>();
    outbox::postgres::enqueue_batch(&pool, &config, &batch(0..BEFORE)).await?;
    let url = nats.url();
    let broker = format!("{url}?subject=pgout.{{event_type}}&stream=PGOUT&create_stream=true");
    let relay = relay_process([
        "run",
        "--store",
        &pg.url(),
        "--broker",
        &broker,
        "--max-attempts",
        "2",
        "--lease",
        "3s",
    ])?;
    until_pg_published(&store, BEFORE as u64).await?;

    pg.stop()?;
    // The outage under test (not a wait for a retry to come due).
    tokio::time::sleep(Duration::from_secs(10)).await;
    pg.resume()?;
    outbox::postgres::enqueue_batch(&pool, &config, &batch(BEFORE..BEFORE + DURING)).await?;
    until_pg_published(&store, (BEFORE + DURING) as u64).await?;
    let counts = store.counts().await?;
    assert_eq!(
        (counts.published, counts.dead),
        ((BEFORE + DURING) as u64, 0)
    );

    sigterm(&relay).await?;
    let out = tokio::time::timeout(GUARD, relay.wait_with_output()).await??;
    assert!(out.status.success(), "{out:?}");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!log.contains("dead-lettered"), "{log}");
    let down = log.lines().filter(|l| l.contains("store is down")).count();
    let back = log
        .lines()
        .filter(|l| l.contains("store is back after"))
        .count();
    assert_eq!((down, back), (1, 1), "one WARN and one INFO:\n{log}");
    let client = async_nats::connect(&url).await?;
    let mut stream = async_nats::jetstream::new(client)
        .get_stream("PGOUT")
        .await?;
    assert_eq!(
        stream.info().await?.state.messages,
        (BEFORE + DURING) as u64
    );
    Ok(())
}

/// How long the Kafka and Redis outages last: shorter than the Kafka publisher's default
/// message timeout (30 s), the case where librdkafka would otherwise hold the batch until the
/// broker is back and report it timed out then, when a check finds the broker up.
const SHORT_OUTAGE: Duration = Duration::from_secs(15);

/// How long after the broker's return every message must be published: a failure guard well
/// under the 30 s message timeout (a relay that recovers only when librdkafka gives up on its
/// old messages fails it) and far above the second or two a recovering relay takes.
const RESUME_GUARD: Duration = Duration::from_secs(20);

/// A private broker that forgets everything when restarted.
enum Forgetful {
    Kafka(PlainKafka),
    Redis(PlainRedis),
}

/// Where the relay publishes: the Kafka topic or the Redis stream.
const DESTINATION: &str = "outage";

impl Forgetful {
    fn relay_url(&self) -> String {
        match self {
            // Default message timeout (30 s). Tansu creates the topic when the producer's
            // metadata request names it (librdkafka's producers allow auto-creation), before
            // the outage and again after it.
            Self::Kafka(k) => format!("kafka://{}?topic={DESTINATION}", k.brokers()),
            Self::Redis(r) => format!("{}?stream={DESTINATION}", r.url()),
        }
    }

    fn stop(&mut self) {
        match self {
            Self::Kafka(k) => k.stop(),
            Self::Redis(r) => r.stop(),
        }
    }

    fn resume(&mut self) -> TestResult {
        match self {
            Self::Kafka(k) => k.resume(),
            Self::Redis(r) => r.resume(),
        }
    }

    /// The message ids the broker holds, in its order.
    async fn ids(&self) -> Result<Vec<String>, BoxError> {
        let received = match self {
            Self::Kafka(k) => {
                let brokers = k.brokers();
                let partitions = partitions(&brokers).await?;
                outbox_e2e::kafka::read_topic(&brokers, DESTINATION, partitions).await?
            }
            Self::Redis(r) => outbox_e2e::redis::read_stream(&r.url(), DESTINATION).await?,
        };
        Ok(received.into_iter().map(|r| r.id).collect())
    }
}

/// How many partitions the broker gave the topic it created.
async fn partitions(brokers: &str) -> Result<i32, BoxError> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let brokers = brokers.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()?;
        let metadata = consumer.fetch_metadata(Some(DESTINATION), Duration::from_secs(10))?;
        let topic = metadata
            .topics()
            .iter()
            .find(|t| t.name() == DESTINATION)
            .ok_or("the topic is not in the broker's metadata")?;
        Ok(i32::try_from(topic.partitions().len())?)
    })
    .await?
}

/// `ids` sorted, for comparing sets that must hold each id once.
fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

/// Messages with an attempt counted.
fn attempted(path: &Path) -> Result<i64, BoxError> {
    let conn = outbox::sqlite::open_connection(path, &SqliteConfig::default())?;
    Ok(
        conn.query_row("SELECT count(*) FROM outbox WHERE attempts > 0", [], |r| {
            r.get(0)
        })?,
    )
}

/// The broker is stopped right after `BEFORE` messages are published and read back, `DURING`
/// more are written, and after [`SHORT_OUTAGE`] it comes back empty: the relay must have seen
/// the outage (one WARN, `outbox_broker_up` 0), counted no attempt, dead-lettered nothing, and
/// published the `DURING` messages once each within [`RESUME_GUARD`] of the return.
async fn forgetful_broker_outage(mut broker: Forgetful) -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let before = enqueue(&path, 0..BEFORE)?;
    let store = SqliteStore::open(&path, SqliteConfig::default()).await?;
    let (relay, addr) = sqlite_relay(&path, &broker.relay_url())?;
    until_published(&store, BEFORE as u64).await?;
    // Read back before the broker forgets them: every one, once.
    assert_eq!(sorted(broker.ids().await?), sorted(before));

    broker.stop();
    let during = enqueue(&path, BEFORE..BEFORE + DURING)?;
    // The outage under test (not a wait for a retry to come due).
    tokio::time::sleep(SHORT_OUTAGE).await;
    let text = metrics(&addr).await?;
    assert_eq!(metric(&text, "outbox_broker_up"), 0.0, "{text}");
    assert_eq!(store.counts().await?.published, BEFORE as u64);

    broker.resume()?;
    let back = tokio::time::Instant::now();
    let all = (BEFORE + DURING) as u64;
    tokio::time::timeout(RESUME_GUARD, until_published(&store, all))
        .await
        .map_err(|_| format!("not all published within {RESUME_GUARD:?} of the return"))??;
    let resumed_in = back.elapsed();
    let counts = store.counts().await?;
    assert_eq!((counts.published, counts.dead), (all, 0));
    assert_eq!(attempted(&path)?, 0, "the outage cost attempts");
    let text = metrics(&addr).await?;
    assert_eq!(metric(&text, "outbox_broker_up"), 1.0, "{text}");
    assert_eq!(metric(&text, "outbox_retried_total"), 0.0, "{text}");
    // The broker came back empty: it holds exactly what was published after its return.
    assert_eq!(sorted(broker.ids().await?), sorted(during));

    let (down, _) = stop_checking_the_outage_log(relay).await?;
    eprintln!("resumed {resumed_in:?} after the broker's return; {down}");
    Ok(())
}

/// Issue 27: a Kafka broker restarted empty after 15 s (Tansu keeps nothing) under
/// `--max-attempts 2`. Before the fix the relay counted attempts for messages librdkafka held
/// through the outage, its producer failed on the new broker, and it published nothing more.
#[tokio::test]
async fn a_kafka_broker_restarted_empty_costs_no_attempt_and_the_relay_resumes() -> TestResult {
    let Some(kafka) = PlainKafka::start()? else {
        return Ok(());
    };
    forgetful_broker_outage(Forgetful::Kafka(kafka)).await
}

/// The same outage on a Redis restarted empty.
#[tokio::test]
async fn a_redis_restarted_empty_costs_no_attempt_and_the_relay_resumes() -> TestResult {
    let Some(redis) = PlainRedis::start()? else {
        return Ok(());
    };
    forgetful_broker_outage(Forgetful::Redis(redis)).await
}
