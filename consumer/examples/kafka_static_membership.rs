//! Experiment: does static group membership (`group.instance.id`) give a killed Kafka
//! consumer's partitions back to its replacement without waiting for the session timeout, on
//! the broker at `OUTBOX_TEST_KAFKA_BROKERS` (default `127.0.0.1:19092`)?
//!
//! ```text
//! cargo run -p outbox-consumer --example kafka_static_membership
//! ```
//!
//! For a dynamic member and a static one: a child process joins a fresh group on a fresh topic
//! and is SIGKILLed once it has its assignment; then a new consumer (the same
//! `group.instance.id` for the static case) joins, and the time until it is assigned the
//! partition is printed, beside the session timeout (10 s).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

const SESSION_MS: &str = "10000";

fn consumer(brokers: &str, group: &str, instance: Option<&str>) -> BaseConsumer {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("session.timeout.ms", SESSION_MS)
        .set("enable.auto.commit", "false");
    if let Some(instance) = instance {
        config.set("group.instance.id", instance);
    }
    config.create().expect("consumer")
}

/// Poll until the consumer holds a partition; how long it took.
fn until_assigned(c: &BaseConsumer, topic: &str) -> Option<Duration> {
    c.subscribe(&[topic]).expect("subscribe");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let _ = c.poll(Duration::from_millis(100));
        if c.assignment().map(|a| a.count() > 0).unwrap_or(false) {
            return Some(start.elapsed());
        }
    }
    None
}

fn main() {
    let brokers =
        std::env::var("OUTBOX_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:19092".to_owned());
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        // The member to be killed: join, say so, then keep heartbeating until SIGKILL.
        let instance = args.get(4).filter(|s| !s.is_empty()).map(String::as_str);
        let c = consumer(&brokers, &args[2], instance);
        match until_assigned(&c, &args[3]) {
            Some(_) => println!("assigned"),
            None => println!("never assigned"),
        }
        loop {
            let _ = c.poll(Duration::from_millis(100));
        }
    }
    let run = std::process::id();
    for (label, instance) in [("dynamic", None), ("static", Some("payments-1"))] {
        let topic = format!("static-membership-{run}-{label}");
        let group = format!("static-membership-{run}-{label}");
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .expect("admin");
        let created = futures::executor::block_on(admin.create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        ));
        if let Err(e) = created {
            println!("{label}: cannot create topic {topic}: {e}");
            continue;
        }
        let mut child = Command::new(&args[0])
            .args(["child", &group, &topic, instance.unwrap_or("")])
            .stdout(Stdio::piped())
            .spawn()
            .expect("child");
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read");
        if line.trim() != "assigned" {
            println!(
                "{label}: the first member was not assigned ({})",
                line.trim()
            );
            let _ = child.kill();
            continue;
        }
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let killed = Instant::now();
        let c = consumer(&brokers, &group, instance);
        match until_assigned(&c, &topic) {
            Some(_) => println!(
                "{label}: replacement assigned {:.1} s after the kill (session timeout {} ms)",
                killed.elapsed().as_secs_f64(),
                SESSION_MS
            ),
            None => println!("{label}: replacement not assigned within 60 s"),
        }
    }
}
