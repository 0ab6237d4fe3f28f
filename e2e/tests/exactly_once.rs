//! Exactly-once effects end to end, on the real servers: the order service of the
//! exactly-once example commits and rolls back orders while its relay and the payment service's
//! consumer run as processes (`exactly-once-node`) that are SIGKILLed at random points and
//! replaced, on Postgres → NATS → Postgres, MariaDB → Kafka → MariaDB and
//! SQLite → Redis → SQLite, side by side. On Postgres and MariaDB the relay runs as two replicas
//! of a relay group, dividing the claim shards, and a relay kill takes one of them at random.
//!
//! Each round writes a few transactions of orders (one rolled back), then waits until a random
//! share of what is outstanding has got through, measured at the victim's end (the outbox's
//! published count for the relay, the payments booked for the consumer) and kills that process
//! with SIGKILL there: a relay dies between a claim, a publish and its completion (its batch is
//! published again by the next relay once the 2 s lease has passed), a consumer between its
//! commit and its acknowledgement (the message comes again). Afterwards everything is drained,
//! and then a fresh consumer group (a new durable consumer, group or Kafka group) reads the
//! whole stream again under the same inbox name, as a consumer that lost all its acks would.
//!
//! The payment database must then hold **exactly one payment per committed order** and none
//! for a rolled-back one, balances equal to the committed amounts, and each customer's payments
//! in the customer's order on Kafka (a partition) and Redis (one stream, one consumer name);
//! on NATS order can break across a consumer's crash (the consumer docs say so) and the test
//! reports the inversions instead. The duplicates the inbox dropped (the consumers print them)
//! are reported per pipeline: during the chaos, and in the replay (every message).
//!
//! Nothing sleeps: kills are triggered by counts read from the databases, and the drains wait
//! for counts too (a killed relay's lease runs out by itself, 2 s). The seed is printed;
//! `OUTBOX_EXACTLY_ONCE_SEED=N` replays a run's choices (the exact kill points also depend on
//! timing).

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::store::StoreOptions;
use outbox::uuid::Uuid;
use outbox_conformance_tests::env::service_url;
use outbox_e2e::unique_suffix;
use outbox_example_exactly_once::{Names, Order, OrderService, Payment, PaymentService};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const NODE: &str = env!("CARGO_BIN_EXE_exactly-once-node");
const ROUNDS: usize = 10;
const TXS_PER_ROUND: usize = 3;
const ORDERS_PER_TX: usize = 8;
const CUSTOMERS: usize = 5;
const KAFKA_PARTITIONS: i32 = 3;
/// How long one wait may make no progress before the test reports a stall.
const STALL: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relays_and_consumers_killed_at_random_leave_exactly_one_effect_per_committed_order(
) -> Result<(), BoxError> {
    let seed: u64 = match std::env::var("OUTBOX_EXACTLY_ONCE_SEED") {
        Ok(s) => s.parse()?,
        Err(_) => rand::rng().random(),
    };
    eprintln!("exactly-once seed {seed} (OUTBOX_EXACTLY_ONCE_SEED={seed} replays its choices)");
    let dir = tempfile::tempdir()?;

    let postgres_nats = async {
        let (Some(pg), Some(nats)) = (
            service_url("OUTBOX_TEST_POSTGRES_URL"),
            service_url("OUTBOX_TEST_NATS_URL"),
        ) else {
            return Ok(None);
        };
        let s = unique_suffix();
        let js = async_nats::jetstream::new(async_nats::connect(&nats).await?);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: format!("XO_{s}"),
            subjects: vec![format!("xo{s}.>")],
            ..Default::default()
        })
        .await?;
        // The consumer creates stream XODEAD_{s} capturing its dead-letter subject.
        let consumer = |name: &str| {
            format!(
                "{nats}?stream=XO_{s}&consumer={name}&ack_wait_ms=1000\
                 &dead_subject=xodead{s}&dead_stream=XODEAD_{s}"
            )
        };
        let pipeline = Pipeline {
            what: "Postgres → NATS → Postgres",
            orders_url: pg.clone(),
            payments_url: pg,
            relay_url: format!("{nats}?subject=xo{s}.{{partition_key}}&stream=XO_{s}"),
            consumer_url: consumer("payments"),
            replay_url: consumer("replay"),
            keeps_key_order: false,
            relay_group: Some(format!("xo{s}")),
            suffix: s.clone(),
        };
        let outcome = pipeline.run(seed).await;
        for stream in [format!("XO_{s}"), format!("XODEAD_{s}")] {
            let _ = js.delete_stream(&stream).await;
        }
        outcome.map(Some)
    };

    let mariadb_kafka = async {
        let (Some(my), Some(brokers)) = (
            service_url("OUTBOX_TEST_MYSQL_URL"),
            service_url("OUTBOX_TEST_KAFKA_BROKERS"),
        ) else {
            return Ok(None);
        };
        let s = unique_suffix();
        let topic = format!("xo{s}");
        outbox_e2e::kafka::create_topic(&brokers, &topic, KAFKA_PARTITIONS).await?;
        outbox_e2e::kafka::create_topic(&brokers, &format!("{topic}.dead"), 1).await?;
        // Short sessions: a killed consumer's partitions go to its replacement within seconds.
        let consumer = |group: &str| {
            format!(
                "kafka://{brokers}?topic={topic}&group={group}{s}&dead_topic={topic}.dead\
                 &session.timeout.ms=2000&heartbeat.interval.ms=300"
            )
        };
        let pipeline = Pipeline {
            what: "MariaDB → Kafka → MariaDB",
            orders_url: my.clone(),
            payments_url: my,
            relay_url: format!("kafka://{brokers}?topic={topic}"),
            consumer_url: consumer("payments"),
            replay_url: consumer("replay"),
            keeps_key_order: true,
            relay_group: Some(format!("xo{s}")),
            suffix: s.clone(),
        };
        let outcome = pipeline.run(seed.wrapping_add(1)).await;
        for topic in [topic.clone(), format!("{topic}.dead")] {
            let _ = outbox_e2e::kafka::delete_topic(&brokers, &topic).await;
        }
        outcome.map(Some)
    };

    let sqlite_redis = async {
        let Some(redis) = service_url("OUTBOX_TEST_REDIS_URL") else {
            return Ok(None);
        };
        let s = unique_suffix();
        let file = |name: &str| format!("sqlite://{}", dir.path().join(name).display());
        let consumer = |group: &str| {
            // One consumer name for every process of the group: a replacement takes back its
            // predecessor's pending entries first, which keeps each key in order.
            format!(
                "{redis}?stream=xo{s}&group={group}&consumer={group}-1&dead_stream=xo{s}.dead\
                 &claim_idle_ms=1000"
            )
        };
        let pipeline = Pipeline {
            what: "SQLite → Redis → SQLite",
            orders_url: file("orders.sqlite"),
            payments_url: file("payments.sqlite"),
            relay_url: format!("{redis}?stream=xo{s}"),
            consumer_url: consumer("payments"),
            replay_url: consumer("replay"),
            keeps_key_order: true,
            relay_group: None,
            suffix: s.clone(),
        };
        let outcome = pipeline.run(seed.wrapping_add(2)).await;
        for key in [format!("xo{s}"), format!("xo{s}.dead")] {
            let _ = outbox_e2e::redis::delete(&redis, &key).await;
        }
        outcome.map(Some)
    };

    let started = Instant::now();
    let (a, b, c): (Outcome, Outcome, Outcome) =
        tokio::join!(postgres_nats, mariadb_kafka, sqlite_redis);
    let mut failures = Vec::new();
    for outcome in [a, b, c] {
        match outcome {
            Ok(Some(report)) => eprintln!("{report}"),
            Ok(None) => {}
            Err(e) => failures.push(e.to_string()),
        }
    }
    eprintln!(
        "three pipelines in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n\n").into())
    }
}

type Outcome = Result<Option<String>, BoxError>;

/// One store → broker → store run.
struct Pipeline {
    what: &'static str,
    orders_url: String,
    payments_url: String,
    /// The relay's publisher URL.
    relay_url: String,
    /// The payment service's consumer URL during the chaos.
    consumer_url: String,
    /// A second consumer (another durable consumer or group) over the same stream, same inbox.
    replay_url: String,
    /// Whether the broker keeps one key's messages in order across consumer crashes.
    keeps_key_order: bool,
    /// Run the relay as two replicas of this relay group (stores that keep groups), instead of
    /// one relay.
    relay_group: Option<String>,
    suffix: String,
}

/// A running `exactly-once-node`; the ids of the duplicates it reported go to a shared list.
struct Node {
    child: Child,
    reader: JoinHandle<()>,
}

impl Node {
    fn spawn(
        role: &str,
        url: &str,
        broker: &str,
        suffix: &str,
        group: Option<&str>,
        duplicates: &Duplicates,
    ) -> Result<Self, BoxError> {
        let mut child = Command::new(NODE)
            .args([role, url, broker, suffix])
            .args(group)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no standard output")?;
        let duplicates = duplicates.clone();
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(id) = line.strip_prefix("duplicate ") {
                    if let Ok(id) = Uuid::parse_str(id) {
                        lock(&duplicates).push(id);
                    }
                }
            }
        });
        Ok(Self { child, reader })
    }

    /// SIGKILL, then wait until the process and its output are gone.
    async fn kill(mut self) -> Result<(), BoxError> {
        self.child.start_kill()?;
        self.child.wait().await?;
        self.reader.await?;
        Ok(())
    }

    /// SIGTERM (a graceful stop), then wait as [`Node::kill`].
    async fn stop(mut self) -> Result<(), BoxError> {
        let pid = self.child.id().ok_or("the process already exited")?;
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await?;
        self.child.wait().await?;
        self.reader.await?;
        Ok(())
    }

    /// The exit status if the process has ended (it never should by itself).
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

type Duplicates = Arc<Mutex<Vec<Uuid>>>;

/// The relays and the consumer, for [`Pipeline::wait`] to watch.
fn nodes<'a>(relays: &'a mut [Node], consumer: &'a mut Node) -> Vec<&'a mut Node> {
    relays.iter_mut().chain([consumer]).collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Pipeline {
    async fn run(self, seed: u64) -> Result<String, BoxError> {
        let what = self.what;
        let started = Instant::now();
        match self.chaos(seed).await {
            Ok(report) => Ok(format!(
                "{report}; {:.1} s",
                started.elapsed().as_secs_f64()
            )),
            Err(e) => Err(format!("{what} (seed {seed}): {e}").into()),
        }
    }

    async fn chaos(&self, seed: u64) -> Result<String, BoxError> {
        let mut rng = StdRng::seed_from_u64(seed);
        let names = Names::with_suffix(&self.suffix)?;
        let orders = OrderService::connect(&self.orders_url, names.clone()).await?;
        orders.migrate().await?;
        let payments =
            PaymentService::connect(&self.payments_url, names.clone(), "payments").await?;
        payments.migrate().await?;
        let outbox = outbox::store::open(
            &self.orders_url,
            &StoreOptions {
                table: Some(names.outbox.clone()),
                ..StoreOptions::default()
            },
        )
        .await?;

        let duplicates: Duplicates = Arc::default();
        let relay_node = || {
            Node::spawn(
                "relay",
                &self.orders_url,
                &self.relay_url,
                &self.suffix,
                self.relay_group.as_deref(),
                &duplicates,
            )
        };
        let consumer_node = || {
            Node::spawn(
                "payments",
                &self.payments_url,
                &self.consumer_url,
                &self.suffix,
                None,
                &duplicates,
            )
        };
        // In a group, two replicas divide the claim shards; a kill takes one of them, whose
        // shards the other takes over once their 2 s lease has passed.
        let replicas = if self.relay_group.is_some() { 2 } else { 1 };
        let mut relays = (0..replicas)
            .map(|_| relay_node())
            .collect::<Result<Vec<_>, _>>()?;
        let mut consumer = consumer_node()?;
        if let Some(group) = &self.relay_group {
            // The replicas did form the group: both alive, each holding claim shards.
            let groups = outbox
                .group_store()
                .ok_or("this store keeps no relay groups")?;
            self.wait(
                "group's division",
                &mut nodes(&mut relays, &mut consumer),
                async || {
                    let members = groups.group_status(group).await?;
                    Ok(members
                        .iter()
                        .filter(|m| m.alive && !m.shards.is_empty())
                        .count()
                        == 2)
                },
            )
            .await?;
        }

        let mut committed: HashMap<Uuid, Order> = HashMap::new();
        let mut rolled_back: HashSet<Uuid> = HashSet::new();
        let mut seqs = [0i64; CUSTOMERS];
        let mut n = 0usize;
        let (mut relay_kills, mut consumer_kills) = (0, 0);
        for round in 0..ROUNDS {
            for t in 0..TXS_PER_ROUND {
                let batch: Vec<Order> = (0..ORDERS_PER_TX)
                    .map(|_| {
                        n += 1;
                        let c = n % CUSTOMERS;
                        seqs[c] += 1;
                        Order {
                            id: format!("order-{n}"),
                            customer: format!("customer-{c}"),
                            seq: seqs[c],
                            amount_cents: 100 + n as i64,
                        }
                    })
                    .collect();
                let commit = t != round % TXS_PER_ROUND;
                let ids = orders.place(&batch, commit).await?;
                if commit {
                    committed.extend(ids.into_iter().zip(batch));
                } else {
                    rolled_back.extend(ids);
                }
            }
            // Kill the relay or the consumer once a random share of what is outstanding has
            // got past it.
            if rng.random_bool(0.5) {
                let counts = outbox.admin.counts().await?;
                let outstanding = counts.pending + counts.leased;
                let target = counts.published + rng.random_range(1..=outstanding.max(1));
                self.wait(
                    "relay kill point",
                    &mut nodes(&mut relays, &mut consumer),
                    async || {
                        let counts = outbox.admin.counts().await?;
                        Ok(counts.published >= target || counts.pending + counts.leased == 0)
                    },
                )
                .await?;
                let victim = rng.random_range(0..relays.len());
                relays.swap_remove(victim).kill().await?;
                relays.push(relay_node()?);
                relay_kills += 1;
            } else {
                let booked = payments.payments().await?.len();
                let outstanding = committed.len().saturating_sub(booked);
                let target = booked + rng.random_range(1..=outstanding.max(1));
                self.wait(
                    "consumer kill point",
                    &mut nodes(&mut relays, &mut consumer),
                    async || Ok(payments.payments().await?.len() >= target.min(committed.len())),
                )
                .await?;
                consumer.kill().await?;
                consumer = consumer_node()?;
                consumer_kills += 1;
            }
        }

        // Drain: every committed order booked, nothing left in the outbox.
        self.wait(
            "drain",
            &mut nodes(&mut relays, &mut consumer),
            async || {
                let counts = outbox.admin.counts().await?;
                Ok(counts.pending + counts.leased == 0
                    && payments.payments().await?.len() >= committed.len())
            },
        )
        .await?;
        consumer.stop().await?;
        for relay in relays {
            relay.stop().await?;
        }
        let chaos_duplicates = lock(&duplicates).len();
        let after_chaos = payments.payments().await?;
        check(&after_chaos, &committed, &rolled_back)?;

        // Replay the whole stream through a new consumer group under the same inbox name: every
        // message is a duplicate, nothing is booked again.
        let replayed: Duplicates = Arc::default();
        let mut replay = Node::spawn(
            "payments",
            &self.payments_url,
            &self.replay_url,
            &self.suffix,
            None,
            &replayed,
        )?;
        self.wait("replay", &mut [&mut replay], async || {
            let seen: HashSet<Uuid> = lock(&replayed).iter().copied().collect();
            Ok(committed.keys().all(|id| seen.contains(id)))
        })
        .await?;
        replay.stop().await?;
        let booked = payments.payments().await?;
        if booked != after_chaos {
            return Err(format!(
                "the replay changed the payments: {} rows before, {} after",
                after_chaos.len(),
                booked.len()
            )
            .into());
        }

        // Balances: the committed amounts, once each.
        let mut expected: HashMap<String, i64> = HashMap::new();
        for order in committed.values() {
            *expected.entry(order.customer.clone()).or_default() += order.amount_cents;
        }
        let balances: HashMap<String, i64> = payments.balances().await?.into_iter().collect();
        if balances != expected {
            return Err(format!("balances {balances:?}, expected {expected:?}").into());
        }

        // Order: each customer's payments in the customer's order.
        let inversions = inversions(&booked);
        if self.keeps_key_order && inversions > 0 {
            return Err(format!(
                "{inversions} payments were booked after a later order of their customer"
            )
            .into());
        }
        let distinct: HashSet<Uuid> = lock(&duplicates).iter().copied().collect();
        Ok(format!(
            "{}: {} orders committed, {} rolled back; {relay_kills} relay{} and {consumer_kills} \
             consumer SIGKILLs; {} payments, one per committed order; the inbox dropped \
             {chaos_duplicates} duplicates ({} messages) during the chaos and {} in the replay; \
             {inversions} key-order inversions{}",
            self.what,
            committed.len(),
            rolled_back.len(),
            if replicas > 1 {
                " (of 2 replicas in a group)"
            } else {
                ""
            },
            booked.len(),
            distinct.len(),
            lock(&replayed).len(),
            if self.keeps_key_order {
                ""
            } else {
                " (allowed: NATS redelivers after the ack wait)"
            },
        ))
    }

    /// Wait until `done` holds, failing if one of `nodes` exits or nothing changes for
    /// [`STALL`].
    async fn wait(
        &self,
        what: &str,
        nodes: &mut [&mut Node],
        mut done: impl AsyncFnMut() -> Result<bool, BoxError>,
    ) -> Result<(), BoxError> {
        let started = Instant::now();
        loop {
            if done().await? {
                return Ok(());
            }
            for node in nodes.iter_mut() {
                if let Some(status) = node.exited() {
                    return Err(
                        format!("waiting for the {what}: a process exited ({status})").into(),
                    );
                }
            }
            if started.elapsed() > STALL {
                return Err(format!("waiting for the {what}: no end within {STALL:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Exactly one payment per committed order, with its amount; none for a rolled-back one.
fn check(
    payments: &[Payment],
    committed: &HashMap<Uuid, Order>,
    rolled_back: &HashSet<Uuid>,
) -> Result<(), BoxError> {
    let mut per_id: HashMap<Uuid, usize> = HashMap::new();
    for payment in payments {
        *per_id.entry(payment.message_id).or_default() += 1;
        if rolled_back.contains(&payment.message_id) {
            return Err(format!("rolled-back order {} was paid", payment.order_id).into());
        }
        let Some(order) = committed.get(&payment.message_id) else {
            return Err(format!("payment for unknown message {}", payment.message_id).into());
        };
        if (order.id.as_str(), order.amount_cents)
            != (payment.order_id.as_str(), payment.amount_cents)
        {
            return Err(format!("payment {payment:?} does not match its order {order:?}").into());
        }
    }
    let twice: Vec<_> = per_id.iter().filter(|(_, n)| **n > 1).collect();
    if !twice.is_empty() {
        return Err(format!("{} orders were paid more than once: {twice:?}", twice.len()).into());
    }
    let missing = committed
        .keys()
        .filter(|id| !per_id.contains_key(id))
        .count();
    if missing > 0 {
        return Err(format!("{missing} committed orders were never paid").into());
    }
    Ok(())
}

/// Payments booked after a payment of a later order of the same customer.
fn inversions(payments: &[Payment]) -> usize {
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut inversions = 0;
    for payment in payments {
        let seen = last.entry(payment.customer.as_str()).or_insert(0);
        if payment.seq < *seen {
            inversions += 1;
        } else {
            *seen = payment.seq;
        }
    }
    inversions
}
