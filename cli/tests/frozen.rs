//! A frozen relay blocks no other beyond its lease: two `outbox-relay run` processes drain a
//! backlog from Postgres or MariaDB into NATS, and one is frozen (SIGSTOP) while it holds
//! leases. The other must publish everything while it stays frozen, including the frozen
//! relay's leased messages (which it can claim only once their lease has run out) and the rest
//! of their keys (held back behind them until then); the frozen relay is resumed (SIGCONT)
//! only after that, so it is frozen for longer than its lease. Its late completions are then
//! fenced, and at the end every message is in the stream once, in key order, and the store has
//! nothing left pending.
//!
//! The frozen relay runs with a short lease (2 s) and the other with a long one, so the
//! messages the frozen relay holds are told apart by their lease end. Progress is counted by
//! deliveries seen on a subscription, never by time: the test waits for events, and [`GUARD`]
//! only catches a stall. Rows the frozen relay had locked in a claim it had not committed are
//! freed when the server ends its idle transaction (the stores bound that to a few seconds).
//!
//! The frozen relay holds none of the other relay's messages, wherever it froze (in a claim, in
//! a complete, or between them): none of the other relay's store calls may fail for a lock
//! wait. Such a failure is a call held for the whole statement bound (2 s, `lock_timeout` /
//! `innodb_lock_wait_timeout`) and then retried; on MariaDB, a claim that locked the rows its
//! scan read held the other relay's completions that way, 2 s at a time, until the server
//! ended it (5 s). (The store tests freeze a claim and a complete at a chosen point; here the
//! freeze falls wherever the relay is.)

use std::collections::HashSet;

use outbox::NewMessage;
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{check_delivery, unique_suffix};

mod common;
use common::fleet::{spawn_relay, Broker, Db, Relay};
use common::{message, signal, sigterm, BoxError, GUARD};

const MESSAGES: usize = 1_500;
const KEYS: usize = 10;
/// The frozen relay's lease: short, so that the test stays short.
const FROZEN_LEASE: &str = "2s";
/// The other relay's lease: long, so that a lease ending within [`FROZEN_WITHIN`] seconds of
/// the freeze is the frozen relay's.
const OTHER_LEASE: &str = "120s";
const FROZEN_WITHIN: u32 = 30;
/// Each relay's options besides its lease: small batches, two in flight, fast polls.
const RUN: [&str; 6] = [
    "--batch-size",
    "10",
    "--concurrency",
    "2",
    "--poll-max",
    "20ms",
];

#[tokio::test]
async fn postgres_a_frozen_relay_blocks_no_other_beyond_its_lease() -> Result<(), BoxError> {
    let (Some(pg_url), Some(nats_url)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let suffix = unique_suffix();
    frozen(
        Db::postgres(pg_url, &suffix).await?,
        Broker::Nats { url: nats_url },
        &suffix,
    )
    .await
}

#[tokio::test]
async fn mariadb_a_frozen_relay_blocks_no_other_beyond_its_lease() -> Result<(), BoxError> {
    let (Some(my_url), Some(nats_url)) = (
        service_url("OUTBOX_TEST_MYSQL_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let suffix = unique_suffix();
    frozen(
        Db::mysql(my_url, &suffix).await?,
        Broker::Nats { url: nats_url },
        &suffix,
    )
    .await
}

async fn frozen(db: Db, broker: Broker, suffix: &str) -> Result<(), BoxError> {
    let what = db.name();
    let committed: Vec<NewMessage> = (0..MESSAGES).map(|n| message(n, KEYS)).collect();
    for batch in committed.chunks(500) {
        db.write(batch, true).await?;
    }
    let mut watch = broker.watch(suffix).await?;
    let broker_url = broker.relay_url(suffix);
    let start = |name: String, lease: &'static str| {
        let (db, broker_url) = (&db, &broker_url);
        async move {
            let mut args = RUN.to_vec();
            args.extend(["--lease", lease]);
            spawn_relay(&db.store_args(&name).await?, broker_url, &name, &args)
        }
    };
    let mut frozen = start(format!("frozen-{suffix}-a"), FROZEN_LEASE).await?;
    let mut other = start(format!("frozen-{suffix}-b"), OTHER_LEASE).await?;
    // A SIGSTOP or SIGTERM before a relay's handlers are in place would not do what is meant.
    for relay in [&mut frozen, &mut other] {
        if let Some(started) = relay.started.take() {
            tokio::time::timeout(GUARD, started).await??;
        }
    }

    // Freeze the relay at a delivery; keep it frozen only if it then holds leased messages it
    // has not published yet (else let it go on to the next delivery). Those it cannot have
    // completed before the freeze (a batch completes after publishing), so the other relay
    // must take them over, and the frozen relay's own completion of them must be refused.
    let mut seen: HashSet<String> = HashSet::new();
    let (held, unpublished) = loop {
        if seen.len() >= MESSAGES {
            return Err(format!(
                "{what}: the backlog drained before the relay was caught holding unpublished \
                 messages"
            )
            .into());
        }
        let next = seen.len() + 1;
        watch.wait_for(&mut seen, next).await?;
        signal(&frozen.child, "STOP").await?;
        let held = db.leases_ending_within(FROZEN_WITHIN).await?;
        // What it published before the freeze has reached the subscription by now (the
        // query above took a round trip to the database).
        watch.take_ready(&mut seen)?;
        let unpublished: Vec<&String> = held.iter().filter(|id| !seen.contains(*id)).collect();
        if !unpublished.is_empty() {
            break (held.len(), unpublished.len());
        }
        signal(&frozen.child, "CONT").await?;
    };

    let frozen_at = std::time::Instant::now();
    let seen_at_freeze = seen.len();

    // While it is frozen, the other relay publishes everything: the frozen relay's messages
    // once their lease has run out, the rest of their keys behind them, and every other key.
    if let Err(e) = watch.wait_for(&mut seen, MESSAGES).await {
        frozen.child.start_kill()?;
        return Err(format!(
            "{what}: while one relay was frozen holding {held} leases, the other stalled: {e}\n{}",
            stop(other).await?
        )
        .into());
    }
    // A figure for the reader, not an assertion.
    eprintln!(
        "{what}: while one relay was frozen holding {held} leases ({unpublished} of them not yet \
         published), the other published the remaining {} of {MESSAGES} messages in {:.1?}",
        MESSAGES - seen_at_freeze,
        frozen_at.elapsed()
    );
    drop(watch);

    signal(&frozen.child, "CONT").await?;
    let frozen_log = stop(frozen).await?;
    let other_log = stop(other).await?;
    // A figure for the reader: the other relay's store calls that met a frozen relay's lock
    // (each a bounded wait, retried).
    let retried = other_log
        .lines()
        .filter(|l| l.contains("store call failed") || l.contains("could not extend"))
        .count();
    eprintln!("{what}: the other relay retried {retried} store calls");
    // None of them because the frozen relay held a row it needed: no call was held for the
    // statement bound.
    let held_back: Vec<&str> = other_log
        .lines()
        .filter(|l| l.contains("store call failed") || l.contains("could not extend"))
        .filter(|l| l.contains("Lock wait timeout") || l.contains("lock timeout"))
        .collect();
    assert!(
        held_back.is_empty(),
        "{what}: the other relay's store calls waited the whole statement bound for the frozen \
         relay's locks:\n{}",
        held_back.join("\n")
    );
    // Its late completions of what the other relay took over were refused. Or, when the freeze
    // caught it inside a completion's transaction (a MariaDB completion is several statements;
    // the freeze comes right after a delivery, when a completion is due), the server ended that
    // idle transaction and closed the session (`IDLE_TRANSACTION_SECS`): on waking the relay
    // finds its connection gone and gives the batch up, so no late completion reaches the
    // store at all. Either way nothing it held was completed by it after the takeover; the
    // delivery check below shows every message published once, in key order.
    let lease_lost = stat(&frozen_log, "lease_lost")?;
    let ended_by_server =
        stat(&frozen_log, "store_errors")? > 0 && frozen_log.contains("giving up on this batch");
    assert!(
        lease_lost > 0 || ended_by_server,
        "{what}: the frozen relay lost no lease, and no transaction of its was ended:\n{frozen_log}"
    );
    for log in [&frozen_log, &other_log] {
        assert_eq!(stat(log, "order_violations")?, 0, "{log}");
    }

    let received = broker.read_back(suffix).await?;
    let stored = db.payloads().await?;
    let expected = common::expected(&committed, &stored);
    let delivery = check_delivery(&received, &expected).map_err(|e| format!("{what}: {e}"))?;
    assert_eq!(delivery.distinct, MESSAGES);
    let counts = db.admin().counts().await?;
    assert_eq!(
        (counts.pending, counts.leased, counts.dead, counts.published),
        (0, 0, 0, MESSAGES as u64),
        "{what}: {counts:?}"
    );
    broker.delete(suffix).await?;
    db.clean_up().await
}

/// Stop `relay` (SIGTERM), expect a clean exit, and return what it logged.
async fn stop(mut relay: Relay) -> Result<String, BoxError> {
    sigterm(&relay.child).await?;
    let status = tokio::time::timeout(GUARD, relay.child.wait()).await??;
    let log = relay.stderr.await?;
    assert!(
        status.success(),
        "relay {} exit {status}:\n{log}",
        relay.name
    );
    Ok(log)
}

/// Counter `name` of the closing stats line (JSON) a relay printed.
fn stat(log: &str, name: &str) -> Result<u64, BoxError> {
    let stats = log
        .lines()
        .rev()
        .find_map(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()?
                .get(name)
                .cloned()
        })
        .ok_or_else(|| format!("no stats line with {name} in:\n{log}"))?;
    stats
        .as_u64()
        .ok_or_else(|| format!("{name} is not a count: {stats}").into())
}
