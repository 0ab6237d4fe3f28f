//! Private broker clusters on loopback for the cluster tests (`tests/clusters.rs`), started by
//! the test on free ports and stopped by pid (each node is a child process, killed and reaped
//! when dropped; the shared servers are never touched).
//!
//! | cluster | how | waits for |
//! |---|---|---|
//! | [`NatsCluster`] | 3 × `nats-server -c conf`: JetStream, `server_name`, a `cluster {}` block with routes to all three | an R3 stream can be created (the JetStream meta group has its quorum) |
//! | [`RedisCluster`] | 6 × `redis-server --cluster-enabled yes`, then `redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes` (3 masters, 3 replicas) | every node reports `cluster_state:ok` and the same slot map |
//!
//! Nodes start all at once and are waited for together. A node can be SIGKILLed
//! ([`NatsCluster::kill`], [`RedisCluster::kill`]) and a NATS node restarted on its port with its
//! JetStream directory ([`NatsCluster::restart`]); [`NatsCluster::step_down`] moves a stream's
//! leader through the JetStream API and [`RedisCluster::failover`] promotes a master's replica
//! with `CLUSTER FAILOVER`. A program that is not installed gives `Ok(None)` after printing why
//! the test skips, or fails when `OUTBOX_REQUIRE_SERVICES=1`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use outbox_conformance_tests::servers::{free_port, installed, missing, wait_port};
use tempfile::TempDir;

use crate::BoxError;

/// The longest a cluster may take to form, or a state change to show: a failure guard, not a
/// timed assertion (a passing test goes on as soon as the state is reached).
pub const GUARD: Duration = Duration::from_secs(90);

/// How often a wait looks at the cluster's state again.
const POLL: Duration = Duration::from_millis(50);

/// A node process, SIGKILLed (by its pid) and reaped when dropped.
#[derive(Debug)]
struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_node(command: &mut Command, log: &Path) -> Result<Node, BoxError> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    Ok(Node(
        command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?,
    ))
}

/// Wait until `check` gives `Some`, looking again every [`POLL`]; an error naming `what` after
/// [`GUARD`].
pub async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> Result<T, BoxError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if start.elapsed() > GUARD {
            return Err(format!("{what}: not reached within {GUARD:?}").into());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Three `nats-server`s with JetStream, routed into one cluster.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<Option<Node>>,
    program: &'static str,
    dir: TempDir,
    /// Client port of each node on 127.0.0.1.
    pub ports: Vec<u16>,
}

impl NatsCluster {
    /// Start three nodes at once and wait until the cluster places a 3-replica stream.
    pub async fn start() -> Result<Option<Self>, BoxError> {
        let program = ["/usr/sbin/nats-server", "nats-server"]
            .into_iter()
            .find(|p| installed(p));
        let Some(program) = program else {
            return Ok(missing("nats-server")?);
        };
        let dir = tempfile::Builder::new()
            .prefix("outbox-nats-cluster-")
            .tempdir()?;
        let ports = (0..3).map(|_| free_port()).collect::<Result<Vec<_>, _>>()?;
        let routes = (0..3).map(|_| free_port()).collect::<Result<Vec<_>, _>>()?;
        let route_list = routes
            .iter()
            .map(|p| format!("\"nats-route://127.0.0.1:{p}\""))
            .collect::<Vec<_>>()
            .join(", ");
        for (i, (port, route)) in ports.iter().zip(&routes).enumerate() {
            let d = dir.path().display();
            let conf = format!(
                "server_name: n{i}\nlisten: \"127.0.0.1:{port}\"\n\
                 jetstream {{ store_dir: \"{d}/js{i}\" }}\n\
                 cluster {{\n  name: outbox\n  listen: \"127.0.0.1:{route}\"\n  \
                 routes: [{route_list}]\n}}\n"
            );
            std::fs::write(dir.path().join(format!("n{i}.conf")), conf)?;
        }
        let mut cluster = Self {
            nodes: (0..3).map(|_| None).collect(),
            program,
            dir,
            ports,
        };
        for i in 0..3 {
            cluster.spawn(i)?;
        }
        for i in 0..3 {
            cluster.wait_listening(i)?;
        }
        cluster.wait_jetstream().await?;
        Ok(Some(cluster))
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("n{i}.log"))
    }

    fn spawn(&mut self, i: usize) -> Result<(), BoxError> {
        let conf = self.dir.path().join(format!("n{i}.conf"));
        let node = start_node(Command::new(self.program).arg("-c").arg(conf), &self.log(i))?;
        self.nodes[i] = Some(node);
        Ok(())
    }

    fn wait_listening(&mut self, i: usize) -> Result<(), BoxError> {
        let log = self.log(i);
        let child = self.nodes[i].as_mut().map(|n| &mut n.0);
        wait_port(self.ports[i], child, &log)?;
        Ok(())
    }

    /// Wait until JetStream places a stream with 3 replicas (meta leader elected, every peer
    /// known), by creating one and deleting it.
    async fn wait_jetstream(&self) -> Result<(), BoxError> {
        let js = jetstream::new(self.client().await?);
        wait_for("a 3-replica JetStream stream in the new cluster", || {
            let js = js.clone();
            async move {
                let config = jetstream::stream::Config {
                    name: "OUTBOX_READY".into(),
                    subjects: vec!["outbox-ready".into()],
                    num_replicas: 3,
                    ..Default::default()
                };
                js.get_or_create_stream(config).await.ok()?;
                js.delete_stream("OUTBOX_READY").await.ok()
            }
        })
        .await?;
        Ok(())
    }

    /// Every node as a seed list: `nats://127.0.0.1:P0,127.0.0.1:P1,127.0.0.1:P2`.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("nats://{}", seeds.join(","))
    }

    /// Node `i` alone: `nats://127.0.0.1:Pi`.
    pub fn node_url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.ports[i])
    }

    /// A client that knows every node (and so survives any one of them failing).
    pub async fn client(&self) -> Result<async_nats::Client, BoxError> {
        let seeds: Vec<String> = (0..3).map(|i| self.node_url(i)).collect();
        Ok(async_nats::ConnectOptions::new()
            .request_timeout(Some(Duration::from_secs(5)))
            .connect(seeds)
            .await?)
    }

    /// The node listening on `port`, if any.
    pub fn node_of_port(&self, port: u16) -> Option<usize> {
        self.ports.iter().position(|p| *p == port)
    }

    /// SIGKILL node `i` (its JetStream directory stays).
    pub fn kill(&mut self, i: usize) {
        self.nodes[i] = None;
    }

    /// Start node `i` again on its port with its JetStream directory, and wait until it listens.
    pub fn restart(&mut self, i: usize) -> Result<(), BoxError> {
        self.spawn(i)?;
        self.wait_listening(i)
    }

    /// The server name of `stream`'s leader (`n0`, `n1`, `n2`), once it has one, and whether
    /// every replica is current.
    pub async fn stream_state(
        js: &jetstream::Context,
        stream: &str,
    ) -> Option<(String, bool, u64)> {
        let mut stream = js.get_stream(stream).await.ok()?;
        let info = stream.info().await.ok()?;
        let cluster = info.cluster.clone()?;
        let leader = cluster.leader?;
        let current =
            cluster.replicas.len() == 2 && cluster.replicas.iter().all(|r| r.current && !r.offline);
        Some((leader, current, info.state.messages))
    }

    /// Ask `stream`'s leader to step down (`$JS.API.STREAM.LEADER.STEPDOWN`) and wait until
    /// another node leads it; returns the new leader's name.
    pub async fn step_down(
        &self,
        js: &jetstream::Context,
        stream: &str,
    ) -> Result<String, BoxError> {
        let (old, _, _) =
            wait_for("a leader of the stream", || Self::stream_state(js, stream)).await?;
        let client = self.client().await?;
        let reply = client
            .request(
                format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}"),
                "".into(),
            )
            .await?;
        let text = String::from_utf8_lossy(&reply.payload).into_owned();
        if !text.contains("\"success\":true") {
            return Err(format!("stream leader step-down refused: {text}").into());
        }
        wait_for("a new stream leader after the step-down", || async {
            Self::stream_state(js, stream)
                .await
                .filter(|(leader, _, _)| *leader != old)
                .map(|(leader, _, _)| leader)
        })
        .await
    }
}

/// A Redis Cluster of 3 masters and 3 replicas.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Option<Node>>,
    server: &'static str,
    dir: TempDir,
    /// Port of each node on 127.0.0.1.
    pub ports: Vec<u16>,
    /// Cluster bus port of each node: a free port of its own, not Redis's default of the node's
    /// port + 10,000, which another program (e.g. a second test's cluster) may hold.
    bus_ports: Vec<u16>,
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNode {
    /// Node id.
    pub id: String,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Whether it is a master (else a replica).
    pub master: bool,
    /// The master's id, for a replica.
    pub master_id: Option<String>,
    /// Whether the cluster sees it as failing (`fail` or `fail?`).
    pub failing: bool,
    /// The slot ranges it serves (masters), as `(first, last)`.
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    /// Start six nodes at once, join them with `redis-cli --cluster create` and wait until
    /// every node reports `cluster_state:ok`.
    pub async fn start() -> Result<Option<Self>, BoxError> {
        let Some(server) = ["/usr/bin/redis-server", "redis-server"]
            .into_iter()
            .find(|p| installed(p))
        else {
            return Ok(missing("redis-server")?);
        };
        let Some(cli) = ["/usr/bin/redis-cli", "redis-cli"]
            .into_iter()
            .find(|p| installed(p))
        else {
            return Ok(missing("redis-cli")?);
        };
        let dir = tempfile::Builder::new()
            .prefix("outbox-redis-cluster-")
            .tempdir()?;
        let ports = (0..6).map(|_| free_port()).collect::<Result<Vec<_>, _>>()?;
        let bus_ports = (0..6).map(|_| free_port()).collect::<Result<Vec<_>, _>>()?;
        let mut cluster = Self {
            nodes: (0..6).map(|_| None).collect(),
            server,
            dir,
            ports,
            bus_ports,
        };
        for i in 0..6 {
            cluster.spawn(i)?;
        }
        for i in 0..6 {
            cluster.wait_listening(i)?;
        }
        let output = Command::new(cli)
            .arg("--cluster")
            .arg("create")
            .args(cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()?;
        if !output.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
            .into());
        }
        cluster.wait_ok().await?;
        Ok(Some(cluster))
    }

    fn spawn(&mut self, i: usize) -> Result<(), BoxError> {
        let p = self.ports[i].to_string();
        self.nodes[i] = Some(start_node(
            Command::new(self.server)
                .args(["--port", &p, "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-port", &self.bus_ports[i].to_string()])
                // Kept in the directory, so a restarted node rejoins as the node it was.
                .args(["--cluster-config-file", &format!("nodes-{p}.conf")])
                // A killed master is noticed (and its replica promoted) within seconds.
                .args(["--cluster-node-timeout", "2000"])
                .args(["--save", "", "--appendonly", "no"])
                // Its own RDB file: a replica's full sync writes the master's snapshot to
                // `dbfilename` in the shared directory and loads it from there, so with one
                // name for all six nodes, replicas syncing at once could load each other's
                // master's data (a replica missing its master's early entries, lost on failover).
                .args(["--dbfilename", &format!("dump-{p}.rdb")])
                .arg("--dir")
                .arg(self.dir.path()),
            &self.dir.path().join(format!("{p}.log")),
        )?);
        Ok(())
    }

    fn wait_listening(&mut self, i: usize) -> Result<(), BoxError> {
        let log = self.dir.path().join(format!("{}.log", self.ports[i]));
        wait_port(
            self.ports[i],
            self.nodes[i].as_mut().map(|n| &mut n.0),
            &log,
        )?;
        Ok(())
    }

    /// Wait until every running node reports `cluster_state:ok` and all agree on the masters.
    pub async fn wait_ok(&self) -> Result<(), BoxError> {
        let running: Vec<u16> = self
            .ports
            .iter()
            .zip(&self.nodes)
            .filter(|(_, n)| n.is_some())
            .map(|(p, _)| *p)
            .collect();
        let expected_nodes = running.len();
        wait_for("cluster_state:ok on every node", || {
            let running = running.clone();
            async move {
                let mut views = Vec::new();
                for port in running {
                    let info = node_query(port, redis::cmd("CLUSTER").arg("INFO"))
                        .await
                        .ok()?;
                    if !info.contains("cluster_state:ok") {
                        return None;
                    }
                    let nodes = parse_nodes(
                        &node_query(port, redis::cmd("CLUSTER").arg("NODES"))
                            .await
                            .ok()?,
                    );
                    let mut masters: Vec<(u16, Vec<(u16, u16)>)> = nodes
                        .iter()
                        .filter(|n| n.master && !n.failing && !n.slots.is_empty())
                        .map(|n| (n.port, n.slots.clone()))
                        .collect();
                    masters.sort();
                    // Every running node that serves no slots is a replica of a serving master.
                    let replicas = nodes
                        .iter()
                        .filter(|n| !n.master && !n.failing)
                        .filter(|n| {
                            nodes.iter().any(|m| {
                                Some(m.id.as_str()) == n.master_id.as_deref()
                                    && m.master
                                    && !m.slots.is_empty()
                            })
                        })
                        .count();
                    if replicas + masters.len() != expected_nodes {
                        return None;
                    }
                    views.push(masters);
                }
                let covered: usize = views
                    .first()?
                    .iter()
                    .flat_map(|(_, s)| s)
                    .map(|(a, b)| usize::from(b - a) + 1)
                    .sum();
                (covered == 16384 && views.windows(2).all(|w| w[0] == w[1])).then_some(())
            }
        })
        .await
        .map_err(|e| format!("{e}; the nodes' logs, last lines:\n{}", self.log_tails()).into())
    }

    /// The last lines of every node's log, one block per node: what a cluster that did not form
    /// says about why.
    fn log_tails(&self) -> String {
        self.ports
            .iter()
            .map(|p| {
                let text = std::fs::read_to_string(self.dir.path().join(format!("{p}.log")))
                    .unwrap_or_else(|e| format!("(no log: {e})"));
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(8)..].join("\n");
                format!("-- node {p}:\n{tail}")
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every node as a seed list: `redis://127.0.0.1:P0,...,127.0.0.1:P5`.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis://{}", seeds.join(","))
    }

    /// A cluster client over every node.
    pub async fn client(&self) -> Result<redis::cluster_async::ClusterConnection, BoxError> {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect();
        Ok(redis::cluster::ClusterClient::new(nodes)?
            .get_async_connection()
            .await?)
    }

    /// The nodes as node `port` sees them (`CLUSTER NODES`).
    pub async fn nodes(&self, port: u16) -> Result<Vec<ClusterNode>, BoxError> {
        Ok(parse_nodes(
            &node_query(port, redis::cmd("CLUSTER").arg("NODES")).await?,
        ))
    }

    /// The master serving `key`'s slot and its replica, as a running node sees them.
    pub async fn master_of(&self, key: &str) -> Result<(ClusterNode, ClusterNode), BoxError> {
        let port = self.running_port()?;
        let slot: u16 = {
            let mut con = node_connection(port).await?;
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key)
                .query_async(&mut con)
                .await?
        };
        let nodes = self.nodes(port).await?;
        let master = nodes
            .iter()
            .find(|n| n.master && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .ok_or_else(|| format!("no master serves slot {slot}"))?
            .clone();
        let replica = nodes
            .iter()
            .find(|n| n.master_id.as_deref() == Some(master.id.as_str()) && !n.failing)
            .ok_or_else(|| format!("master {} has no replica", master.port))?
            .clone();
        Ok((master, replica))
    }

    fn running_port(&self) -> Result<u16, BoxError> {
        self.ports
            .iter()
            .zip(&self.nodes)
            .find(|(_, n)| n.is_some())
            .map(|(p, _)| *p)
            .ok_or_else(|| "no node is running".into())
    }

    /// `CLUSTER FAILOVER` on `replica` (it waits for the replica to catch up with its master,
    /// then swaps them), and wait until every node sees it as a master.
    pub async fn failover(&self, replica: &ClusterNode) -> Result<(), BoxError> {
        let reply = node_query(replica.port, redis::cmd("CLUSTER").arg("FAILOVER")).await?;
        if !reply.eq_ignore_ascii_case("ok") {
            return Err(format!("CLUSTER FAILOVER answered {reply:?}").into());
        }
        self.wait_promoted(replica).await?;
        self.wait_ok().await
    }

    /// Wait until `replica` sees itself as a master serving slots (after a failover, or after
    /// its master was killed and the cluster promoted it).
    pub async fn wait_promoted(&self, replica: &ClusterNode) -> Result<(), BoxError> {
        let port = replica.port;
        let id = replica.id.clone();
        wait_for("the replica promoted by CLUSTER FAILOVER", || {
            let id = id.clone();
            async move {
                let nodes = parse_nodes(
                    &node_query(port, redis::cmd("CLUSTER").arg("NODES"))
                        .await
                        .ok()?,
                );
                nodes
                    .iter()
                    .any(|n| n.id == id && n.master && !n.slots.is_empty())
                    .then_some(())
            }
        })
        .await
    }

    /// SIGKILL the node on `port`.
    pub fn kill(&mut self, port: u16) {
        if let Some(i) = self.ports.iter().position(|p| *p == port) {
            self.nodes[i] = None;
        }
    }

    /// Start the node on `port` again (it rejoins with its `nodes.conf`, as a replica when its
    /// slots moved while it was down) and wait until the cluster is whole again.
    pub async fn restart(&mut self, port: u16) -> Result<(), BoxError> {
        let i = self
            .ports
            .iter()
            .position(|p| *p == port)
            .ok_or_else(|| format!("no node on port {port}"))?;
        self.spawn(i)?;
        self.wait_listening(i)?;
        self.wait_ok().await
    }
}

async fn node_connection(port: u16) -> Result<redis::aio::MultiplexedConnection, BoxError> {
    Ok(redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_multiplexed_async_connection()
        .await?)
}

/// A command's text reply from one node (not through the cluster client).
async fn node_query(port: u16, cmd: &redis::Cmd) -> Result<String, BoxError> {
    let mut con = node_connection(port).await?;
    let value: redis::Value = cmd.query_async(&mut con).await?;
    Ok(match value {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        redis::Value::SimpleString(text) => text,
        redis::Value::VerbatimString { text, .. } => text,
        other => format!("{other:?}"),
    })
}

fn parse_nodes(text: &str) -> Vec<ClusterNode> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port = fields
                .get(1)?
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()?;
            let flags = fields.get(2)?;
            let slots = fields
                .iter()
                .skip(8)
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(ClusterNode {
                id: fields.first()?.to_string(),
                port,
                master: flags.contains("master"),
                master_id: fields.get(3).filter(|m| **m != "-").map(|m| m.to_string()),
                failing: flags.contains("fail"),
                slots,
            })
        })
        .collect()
}

/// Two Tansu (Kafka) brokers on one storage: an S3 bucket served by a private `moto_server`
/// (Tansu 0.6's `s3://` storage engine; its `postgres://` engine is not compiled into the
/// binary the project installs). Both brokers serve the same topics and records, so a client
/// with both in its bootstrap list goes on through the second when the first is killed.
///
/// Tansu has no replication of its own (the storage is shared) and every broker calls itself
/// node 111, so clients see one broker whose address changes: this is failover between
/// brokers, not Kafka's partition leadership moving between replicas.
#[derive(Debug)]
pub struct TansuPair {
    brokers: Vec<Option<Node>>,
    _moto: Node,
    _dir: TempDir,
    /// The brokers' ports on 127.0.0.1.
    pub ports: Vec<u16>,
}

impl TansuPair {
    /// Start `moto_server`, create the bucket, start two brokers on it and wait until they
    /// listen.
    pub async fn start() -> Result<Option<Self>, BoxError> {
        let home = std::env::var_os("OUTBOX_TANSU_HOME")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/outbox"))
            })
            .unwrap_or_default();
        let tansu = home.join("bin/tansu");
        if !tansu.is_file() {
            return Ok(missing("tansu (scripts/tansu install)")?);
        }
        if !installed("moto_server") {
            return Ok(missing("moto_server (the Python package moto)")?);
        }
        let dir = tempfile::Builder::new()
            .prefix("outbox-tansu-pair-")
            .tempdir()?;
        let s3 = free_port()?;
        let moto_log = dir.path().join("moto.log");
        let mut moto = start_node(
            Command::new("moto_server").args(["-H", "127.0.0.1", "-p", &s3.to_string()]),
            &moto_log,
        )?;
        wait_port(s3, Some(&mut moto.0), &moto_log)?;
        create_bucket(s3, "tansu").await?;
        let ports = vec![free_port()?, free_port()?];
        let mut brokers = Vec::new();
        for port in &ports {
            let listener = format!("tcp://127.0.0.1:{port}");
            let log = dir.path().join(format!("tansu-{port}.log"));
            let mut node = start_node(
                Command::new(&tansu)
                    .arg("broker")
                    .args(["--listener-url", &listener])
                    .args(["--advertised-listener-url", &listener])
                    .args(["--storage-engine", "s3://tansu/"])
                    .env("AWS_ENDPOINT", format!("http://127.0.0.1:{s3}"))
                    .env("AWS_ALLOW_HTTP", "true")
                    .env("AWS_ACCESS_KEY_ID", "outbox")
                    .env("AWS_SECRET_ACCESS_KEY", "outbox")
                    .env("AWS_DEFAULT_REGION", "us-east-1")
                    .env("AWS_REGION", "us-east-1"),
                &log,
            )?;
            wait_port(*port, Some(&mut node.0), &log)?;
            brokers.push(Some(node));
        }
        Ok(Some(Self {
            brokers,
            _moto: moto,
            _dir: dir,
            ports,
        }))
    }

    /// Broker `i` alone: `127.0.0.1:PORT`.
    pub fn broker(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.ports[i])
    }

    /// SIGKILL broker `i` (the records stay in the shared storage).
    pub fn kill(&mut self, i: usize) {
        self.brokers[i] = None;
    }
}

/// `PUT /bucket` on the S3 server at `port` (moto checks no signatures).
async fn create_bucket(port: u16, bucket: &str) -> Result<(), BoxError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(
            format!(
                "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\n\
                 Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await?;
    if !reply.starts_with("HTTP/1.1 200") {
        return Err(format!("creating bucket {bucket}: {reply}").into());
    }
    Ok(())
}
