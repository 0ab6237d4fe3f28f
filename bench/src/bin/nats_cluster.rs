//! Publishing into a 3-node NATS cluster against one NATS server, side by side in one run: the
//! cost of clustering for the relay's publisher (issue 32's "msg/s ratio").
//!
//! ```text
//! cargo run --release -p outbox-bench --bin nats_cluster -- [messages=50000] [rounds=3] \
//!     [batch=500] [concurrency=2]
//! ```
//!
//! The bench starts its own servers on free loopback ports, all from the same `nats-server`
//! program and with JetStream file storage in temporary directories on the same disk: one
//! single server, and a cluster of three routed nodes (`outbox_e2e::cluster::NatsCluster`). Each
//! round publishes `messages` (~200-byte JSON, 1,000 keys) through the relay's `NatsPublisher`
//! (batches of `batch`, `concurrency` in flight, as the relay does) into three streams in turn:
//!
//! - `single R1`: the single server, a stream with one replica;
//! - `cluster R1`: the cluster, one replica (the client may sit on another node than the
//!   stream's);
//! - `cluster R3`: the cluster, three replicas (every ack waits for a quorum of two).
//!
//! It prints each round and the median of each setting as msg/s and as a ratio to `single R1`.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use outbox::nats::{NatsConfig, NatsPublisher};
use outbox_bench::throughput::{arg, drive_throughput, throughput_messages};
use outbox_e2e::cluster::NatsCluster;
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A private single `nats-server` with JetStream, killed when dropped.
struct Single {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Single {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Single {
    async fn start() -> Result<Self, BoxError> {
        let dir = tempfile::Builder::new()
            .prefix("outbox-nats-single-")
            .tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let program = ["/usr/sbin/nats-server", "nats-server"]
            .into_iter()
            .find(|p| {
                Command::new(p)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .status()
                    .is_ok()
            })
            .ok_or("nats-server is not installed")?;
        let child = Command::new(program)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let single = Self {
            child,
            port,
            _dir: dir,
        };
        for _ in 0..200 {
            if async_nats::connect(single.url()).await.is_ok() {
                return Ok(single);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err("the single nats-server did not start within 10 s".into())
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

/// Publish `total` messages into a fresh stream of `replicas` at `url`; msg/s.
async fn round(
    url: &str,
    replicas: u32,
    total: usize,
    batch: usize,
    concurrency: usize,
) -> Result<f64, BoxError> {
    let suffix = Uuid::new_v4().simple().to_string();
    let stream = format!("BENCH_{suffix}");
    let config = NatsConfig::from_url(&format!(
        "{url}?subject=bench{suffix}.{{aggregate_type}}&stream={stream}&create_stream=true\
         &stream_replicas={replicas}"
    ))?;
    let publisher = NatsPublisher::connect(config).await?;
    let messages = throughput_messages(total, 1000);
    let (acked, elapsed) = drive_throughput(&publisher, &messages, batch, concurrency).await;
    if acked != total {
        return Err(format!("{acked} of {total} acked at {url} (R{replicas})").into());
    }
    // A seed list (`nats://h1:p1,h2:p2`) as the client's list of servers.
    let seeds = url
        .trim_start_matches("nats://")
        .split(',')
        .map(|seed| format!("nats://{seed}").parse())
        .collect::<Result<Vec<async_nats::ServerAddr>, _>>()?;
    let client = async_nats::connect(seeds).await?;
    async_nats::jetstream::new(client)
        .delete_stream(&stream)
        .await?;
    Ok(total as f64 / elapsed.as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (total, rounds, batch, concurrency) = (arg(1, 50_000), arg(2, 3), arg(3, 500), arg(4, 2));
    let single = Single::start().await?;
    let cluster = NatsCluster::start()
        .await?
        .ok_or("nats-server is not installed")?;
    let settings = [
        ("single R1", single.url(), 1),
        ("cluster R1", cluster.url(), 1),
        ("cluster R3", cluster.url(), 3),
    ];
    println!(
        "NATS publish, {total} messages per round, batches of {batch}, {concurrency} in flight, \
         {rounds} interleaved rounds"
    );
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); settings.len()];
    for r in 0..rounds {
        for (i, (name, url, replicas)) in settings.iter().enumerate() {
            let rate = round(url, *replicas, total, batch, concurrency).await?;
            println!("round {}: {name:<10} {rate:>9.0} msg/s", r + 1);
            rates[i].push(rate);
        }
    }
    let base = median(rates[0].clone());
    println!("| setting | msg/s (median) | vs single R1 |");
    println!("|---|---|---|");
    for ((name, _, _), rates) in settings.iter().zip(rates) {
        let m = median(rates);
        println!("| {name} | {m:.0} | {:.2}x |", m / base);
    }
    Ok(())
}
