//! Kill at random: one `outbox-relay run` serving four Postgres tenant schemas (a `schemas`
//! pattern) and a SQLite file is SIGKILLed at random points and restarted, round after round,
//! while a writer per outbox commits and rolls back transactions. Each outbox publishes to its
//! own JetStream stream (`{outbox}` in the subject and the stream name).
//!
//! A kill comes once a random number of new messages (none to 40) has reached the broker, so it
//! lands anywhere: while the relay discovers the schemas or connects, in a claim, a publish, a
//! complete. The replacement takes over the killed relay's messages when their (short) leases
//! end. At the end the writers stop, every committed message is awaited on the broker, the last
//! relay is stopped with SIGTERM and a `drain` of the same configuration settles what a killed
//! relay published but never completed. Each outbox's stream is then read back with the NATS
//! client: every committed message of that outbox is there with its exact payload and key, no
//! rolled-back message and no message of another outbox is, copies beyond the first carry the
//! same id (NATS's dedup window drops most), and each key's first copies are in commit order;
//! nothing is left pending, leased or dead.
//!
//! Nothing sleeps to let a lease come due: kills and the end wait on deliveries. The writers
//! pace themselves (a transaction every 40 ms each). The seed is printed;
//! `OUTBOX_CHAOS_SEED=N` replays the run's choices (the exact kill points also depend on
//! timing).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fleet::Watch;
use common::many::{drain, drop_schemas, keyed, Outbox, Relay};
use common::{nats_subscription, BoxError};
use outbox::NewMessage;
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{check_delivery, unique_suffix};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Kills (and restarts) of the relay.
const KILLS: usize = 6;
/// Partition keys per outbox.
const KEYS: usize = 3;
/// Batch size and batches in flight of each outbox's relay.
const BATCH: usize = 8;
const IN_FLIGHT: usize = 2;

/// What one outbox's writer committed (in commit order) and rolled back.
#[derive(Default)]
struct Written {
    committed: Vec<NewMessage>,
    rolled_back: HashSet<String>,
}

/// Write transactions of 1 to 4 messages into `outbox` (named `name`), one every 40 ms, each
/// committed or (one in four) rolled back, until `stop`.
async fn writer(
    outbox: Outbox,
    name: String,
    seed: u64,
    written: Arc<Mutex<Written>>,
    stop: Arc<AtomicBool>,
) -> Result<(), BoxError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tick = tokio::time::interval(Duration::from_millis(40));
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let size = rng.random_range(1..=4);
        let batch: Vec<NewMessage> = (n..n + size).map(|i| keyed(&name, i, KEYS)).collect();
        n += size;
        let commit = rng.random_ratio(3, 4);
        let ids = outbox.write(&batch, commit).await?;
        let mut written = written.lock().map_err(|_| "poisoned")?;
        if commit {
            written.committed.extend(batch);
        } else {
            written.rolled_back.extend(ids);
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_of_many_outboxes_killed_at_random_loses_nothing_and_mixes_nothing(
) -> Result<(), BoxError> {
    let (Some(pg), Some(nats)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let seed = match std::env::var("OUTBOX_CHAOS_SEED") {
        Ok(s) => s.parse()?,
        Err(_) => rand::rng().random(),
    };
    eprintln!("many-outbox kill seed {seed} (OUTBOX_CHAOS_SEED={seed} replays its choices)");
    let mut rng = StdRng::seed_from_u64(seed);

    let p = format!("mkill{}", unique_suffix());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .connect(&pg)
        .await?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("edge.db");
    let mut outboxes: BTreeMap<String, Outbox> = (0..4)
        .map(|i| {
            let schema = format!("{p}_t{i}");
            (schema.clone(), Outbox::postgres(&pool, &schema))
        })
        .collect();
    outboxes.insert(format!("{p}_file"), Outbox::sqlite(&file));
    for outbox in outboxes.values() {
        outbox.create().await?;
    }
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            r#"
broker = "{nats}?subject={p}.{{outbox}}.{{event_type}}&stream={{outbox}}&create_stream=true&stream_subjects={p}.{{outbox}}.>"
batch_size = {BATCH}
concurrency = {IN_FLIGHT}
lease = "2s"

[[outbox]]
store = "{pg}"
schemas = "{p}_t*"

[[outbox]]
name = "{p}_file"
store = "sqlite://{file}"
"#,
            file = file.display(),
        ),
    )?;
    let mut watch = Watch::Nats(nats_subscription(&nats, format!("{p}.>")).await?);
    let mut seen = HashSet::new();

    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    let mut written = BTreeMap::new();
    for (name, outbox) in &outboxes {
        let w = Arc::new(Mutex::new(Written::default()));
        written.insert(name.clone(), w.clone());
        writers.push(tokio::spawn(writer(
            outbox.clone(),
            name.clone(),
            rng.random(),
            w,
            stop.clone(),
        )));
    }

    let log = |i: usize| dir.path().join(format!("relay-{i}.log"));
    let mut relay = Relay::start_logging(&config, &log(0))?;
    for kill in 1..=KILLS {
        let target = seen.len() + rng.random_range(0..=40);
        relay.fail(watch.wait_for(&mut seen, target).await)?;
        relay.kill().await?;
        relay = Relay::start_logging(&config, &log(kill))?;
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await??;
    }
    let mut all = BTreeMap::new();
    for (name, w) in written {
        let w = Arc::try_unwrap(w)
            .map_err(|_| "a writer still holds its record")?
            .into_inner()
            .map_err(|_| "poisoned")?;
        all.insert(name, w);
    }
    let committed: usize = all.values().map(|w| w.committed.len()).sum();
    relay.fail(watch.wait_for(&mut seen, committed).await)?;
    relay.stop().await?;
    // A killed relay's published but uncompleted messages whose lease the last relay had not
    // taken over yet: the drain publishes them again (the dedup window drops the copies).
    let (ok, stderr) = drain(&config).await?;
    assert!(ok, "the closing drain failed:\n{stderr}");

    let mut duplicates = 0;
    for (name, w) in &all {
        let outbox = &outboxes[name];
        let stored = outbox.payloads().await?;
        let expected = common::expected(&w.committed, &stored);
        let received = outbox_e2e::nats::read_stream(&nats, name).await?;
        let leaked = received
            .iter()
            .filter(|r| w.rolled_back.contains(&r.id))
            .count();
        assert_eq!(
            leaked, 0,
            "{name}, seed {seed}: rolled-back messages published"
        );
        let foreign: Vec<&str> = received
            .iter()
            .filter(|r| {
                !r.key
                    .as_deref()
                    .is_some_and(|k| k.starts_with(&format!("{name}-key-")))
            })
            .map(|r| r.id.as_str())
            .collect();
        assert!(
            foreign.is_empty(),
            "{name}, seed {seed}: another outbox's messages on its stream: {foreign:?}"
        );
        let delivery = check_delivery(&received, &expected)
            .map_err(|e| format!("{name}, seed {seed}: {e}"))?;
        duplicates += delivery.duplicates;
        assert_eq!(
            outbox.left().await?,
            (0, 0, 0),
            "{name}: pending, leased, dead"
        );
        eprintln!(
            "{name}: {} committed, {} rolled back, {} copies in its stream",
            w.committed.len(),
            w.rolled_back.len(),
            received.len()
        );
    }
    eprintln!(
        "seed {seed}: {KILLS} kills, {committed} messages in {} outboxes, {duplicates} duplicates",
        all.len()
    );
    // A copy beyond the first comes only from a kill: at most what each outbox had in flight.
    let bound = KILLS * all.len() * IN_FLIGHT * BATCH;
    assert!(
        duplicates <= bound,
        "{duplicates} duplicates, more than {bound}"
    );
    for name in all.keys() {
        outbox_e2e::nats::delete_stream(&nats, name).await?;
    }
    let schemas: Vec<String> = outboxes
        .iter()
        .filter(|(_, o)| matches!(o, Outbox::Postgres { .. }))
        .map(|(name, _)| name.clone())
        .collect();
    drop_schemas(&pool, &schemas).await
}
