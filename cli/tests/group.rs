//! A relay group on the real Postgres and MariaDB: `outbox-relay run --group` processes divide
//! the claim shards, rebalance when a replica joins or leaves (SIGTERM: it gives its shards back), and a
//! standby or the survivors take over the shards of a replica that is SIGKILLed or frozen
//! (SIGSTOP) past its shard lease, while a writer commits and rolls back transactions all along.
//! At the end the NATS stream is read back: every committed message once (NATS dedups), no
//! rolled-back one, each key in commit order; and the store holds nothing pending.
//!
//! Nothing sleeps for a lease: each step waits until the group table shows the expected
//! division (a status query per tick, bounded by [`GUARD`]), with a short group lease (1 s) so
//! that takeovers come quickly. Each tick also writes one transaction (one in four rolled back),
//! so messages keep arriving across every change of ownership.

use std::collections::HashSet;
use std::time::Duration;

use outbox::{GroupMember, NewMessage, RelayGroupStore};
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{check_delivery, unique_suffix};

mod common;
use common::fleet::{spawn_relay, Broker, Db, Relay, Watch};
use common::{message, run, signal, sigterm, BoxError, GUARD};

const GROUP: &str = "relays";
const SHARDS: usize = 4;
const KEYS: usize = 16;
const PER_TX: usize = 8;
/// How soon after a SIGKILL the survivors must hold the killed replica's shards: about one
/// group lease (1 s), with room for a loaded machine.
const TAKEOVER_BOUND: Duration = Duration::from_secs(3);
/// Each relay's options: a group of 4 shards with a 1 s lease, short message leases (a frozen
/// relay's claims hold their keys only that long), fast polls.
const RUN: [&str; 14] = [
    "--group",
    GROUP,
    "--group-lease",
    "1s",
    "--claim-shards",
    "4",
    "--concurrency",
    "4",
    "--batch-size",
    "20",
    "--lease",
    "2s",
    "--poll-max",
    "20ms",
];

/// What the test writes: the committed messages in commit order, and a counter.
struct Writer {
    committed: Vec<NewMessage>,
    rolled_back: usize,
    n: usize,
}

impl Writer {
    /// One transaction of [`PER_TX`] messages; every fourth is rolled back.
    async fn write(&mut self, db: &Db) -> Result<(), BoxError> {
        let batch: Vec<NewMessage> = (self.n..self.n + PER_TX)
            .map(|n| message(n, KEYS))
            .collect();
        self.n += PER_TX;
        let commit = !(self.n / PER_TX).is_multiple_of(4);
        db.write(&batch, commit).await?;
        if commit {
            self.committed.extend(batch);
        } else {
            self.rolled_back += batch.len();
        }
        Ok(())
    }
}

/// Wait until the live members named in `want` hold exactly those shard counts (and nobody else
/// live holds any), writing a transaction per tick. Returns the members seen.
async fn wait_group(
    store: &dyn RelayGroupStore,
    db: &Db,
    writer: &mut Writer,
    want: &[(&Relay, usize)],
    what: &str,
) -> Result<Vec<GroupMember>, BoxError> {
    let deadline = tokio::time::Instant::now() + GUARD;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        writer.write(db).await?;
        let members = store.group_status(GROUP).await?;
        let holds = |relay: &Relay| -> Option<usize> {
            let pid = relay.child.id()?;
            members
                .iter()
                .find(|m| m.alive && m.member_name.ends_with(&format!(":{pid}")))
                .map(|m| m.shards.len())
        };
        let named: usize = want.iter().map(|(_, n)| n).sum();
        let live_held: usize = members
            .iter()
            .filter(|m| m.alive)
            .map(|m| m.shards.len())
            .sum();
        let mut all: Vec<u32> = members.iter().flat_map(|m| m.shards.clone()).collect();
        all.sort_unstable();
        let before = all.len();
        all.dedup();
        assert_eq!(before, all.len(), "{what}: a shard held twice: {members:?}");
        if want.iter().all(|(r, n)| holds(r) == Some(*n)) && live_held == named {
            return Ok(members);
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "{what}: group never reached {:?}: {members:?}",
                want.iter()
                    .map(|(r, n)| (r.name.clone(), *n))
                    .collect::<Vec<_>>()
            )
            .into());
        }
    }
}

/// The database a test's relay group runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Database {
    Postgres,
    Mariadb,
}

/// The shared servers and a fresh schema (Postgres) or table (MariaDB), stream subscription and
/// writer for one test; `None` when the database or NATS is not configured.
struct Setup {
    suffix: String,
    db: Db,
    broker: Broker,
    watch: Watch,
    broker_url: String,
    writer: Writer,
}

impl Setup {
    async fn new(database: Database) -> Result<Option<Self>, BoxError> {
        let var = match database {
            Database::Postgres => "OUTBOX_TEST_POSTGRES_URL",
            Database::Mariadb => "OUTBOX_TEST_MYSQL_URL",
        };
        let (Some(db_url), Some(nats_url)) =
            (service_url(var), service_url("OUTBOX_TEST_NATS_URL"))
        else {
            return Ok(None);
        };
        let suffix = unique_suffix();
        let db = match database {
            Database::Postgres => Db::postgres(db_url, &suffix).await?,
            Database::Mariadb => Db::mysql(db_url, &suffix).await?,
        };
        let broker = Broker::Nats { url: nats_url };
        let watch = broker.watch(&suffix).await?;
        let broker_url = broker.relay_url(&suffix);
        Ok(Some(Self {
            suffix,
            db,
            broker,
            watch,
            broker_url,
            writer: Writer {
                committed: Vec::new(),
                rolled_back: 0,
                n: 0,
            },
        }))
    }
}

/// The group tables of the outbox under test.
fn groups(db: &Db) -> Result<&dyn RelayGroupStore, BoxError> {
    match db {
        Db::Postgres { store, .. } => Ok(store),
        Db::Mysql { store, .. } => Ok(store),
        Db::Sqlite { .. } => Err("SQLite has no relay groups".into()),
    }
}

/// `--store ...` for the test's own `outbox-relay` commands (status), as the administrator.
fn admin_args(db: &Db) -> Result<Vec<&str>, BoxError> {
    match db {
        Db::Postgres { url, schema, .. } => Ok(vec!["--store", url, "--schema", schema]),
        Db::Mysql { url, table, .. } => Ok(vec!["--store", url, "--table", table]),
        Db::Sqlite { .. } => Err("SQLite has no relay groups".into()),
    }
}

/// Start a replica named `name` of `db` into `broker_url` with [`RUN`], and wait until it has
/// started.
async fn start_relay(db: &Db, broker_url: &str, name: &str) -> Result<Relay, BoxError> {
    let store_args = db.store_args(name).await?;
    if let Db::Mysql { store, table, .. } = db {
        // The relay's account may change the outbox table only (`store_args`); a member of a
        // group also renews through the procedure, leaves, and reads the group's tables.
        for grant in [
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON `{table}_group_members` TO '{name}'@'%'"
            ),
            format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON `{table}_group_shards` TO '{name}'@'%'"
            ),
            format!("GRANT EXECUTE ON PROCEDURE `{table}_group_renew` TO '{name}'@'%'"),
        ] {
            sqlx::query(&grant).execute(store.pool()).await?;
        }
    }
    let mut relay = spawn_relay(&store_args, broker_url, name, &RUN)?;
    if let Some(started) = relay.started.take() {
        tokio::time::timeout(GUARD, started).await??;
    }
    Ok(relay)
}

#[tokio::test]
async fn postgres_relay_group_rebalances_and_takes_over_without_loss() -> Result<(), BoxError> {
    rebalances_and_takes_over_without_loss(Database::Postgres).await
}

/// The same on MariaDB: the shared server, a table of the test's own, an account per replica.
#[tokio::test]
async fn mariadb_relay_group_rebalances_and_takes_over_without_loss() -> Result<(), BoxError> {
    rebalances_and_takes_over_without_loss(Database::Mariadb).await
}

/// Three replicas join one by one (the third a hot standby), one is SIGKILLed and its shards
/// taken over within about one group lease, one is frozen past its lease and taken over, wakes
/// and rejoins, one leaves; a writer commits and rolls back all along; then the read back.
async fn rebalances_and_takes_over_without_loss(database: Database) -> Result<(), BoxError> {
    let started = std::time::Instant::now();
    let Some(Setup {
        suffix,
        db,
        broker,
        mut watch,
        broker_url,
        mut writer,
    }) = Setup::new(database).await?
    else {
        return Ok(());
    };
    let store = groups(&db)?;
    let start = |name: &str| {
        let name = format!("group-{suffix}-{name}");
        let (db, broker_url) = (&db, &broker_url);
        async move { start_relay(db, broker_url, &name).await }
    };

    // One replica holds every shard.
    let a = start("a").await?;
    wait_group(store, &db, &mut writer, &[(&a, SHARDS)], "a alone").await?;
    // A second joins: 2 and 2.
    let b = start("b").await?;
    wait_group(store, &db, &mut writer, &[(&a, 2), (&b, 2)], "b joined").await?;
    // A third joins: ceil(4 / 3) = 2 each, so it waits as a hot standby.
    let mut c = start("c").await?;
    wait_group(
        store,
        &db,
        &mut writer,
        &[(&a, 2), (&b, 2), (&c, 0)],
        "c standby",
    )
    .await?;
    // b is SIGKILLed: the standby takes its shards once its lease is over, within about one
    // group lease (1 s; members renew every third of it, and each step polls every 50 ms).
    let mut b = b;
    b.child.start_kill()?;
    b.child.wait().await?;
    let killed = std::time::Instant::now();
    wait_group(store, &db, &mut writer, &[(&a, 2), (&c, 2)], "b killed").await?;
    let takeover = killed.elapsed();
    assert!(
        takeover < TAKEOVER_BOUND,
        "{database:?}: the standby took the SIGKILLed replica's shards after {takeover:?}"
    );
    // a is frozen past its lease: c takes every shard.
    signal(&a.child, "STOP").await?;
    wait_group(store, &db, &mut writer, &[(&c, SHARDS)], "a frozen").await?;
    // a wakes up: it finds its leases taken over (fenced), rejoins, and the two rebalance.
    signal(&a.child, "CONT").await?;
    wait_group(store, &db, &mut writer, &[(&a, 2), (&c, 2)], "a resumed").await?;

    // `status --group` shows the two members and their shards.
    let mut args = admin_args(&db)?;
    args.extend(["--group", GROUP, "status", "--json"]);
    let out = run(&args).await?;
    let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let live: Vec<&serde_json::Value> = status["group"]["members"]
        .as_array()
        .ok_or("status shows no group")?
        .iter()
        .filter(|m| m["alive"] == true)
        .collect();
    assert_eq!(live.len(), 2, "{status}");
    assert!(
        live.iter()
            .all(|m| m["shards"].as_array().map(Vec::len) == Some(2)),
        "{status}"
    );

    // c leaves gracefully: it gives its shards back at once, and a takes them.
    let c_pid = c.child.id();
    sigterm(&c.child).await?;
    let status_c = tokio::time::timeout(GUARD, c.child.wait()).await??;
    let log_c = c.stderr.await?;
    assert!(status_c.success(), "{log_c}");
    let members = wait_group(store, &db, &mut writer, &[(&a, SHARDS)], "c left").await?;
    assert!(
        members
            .iter()
            .all(|m| c_pid.is_none_or(|pid| !m.member_name.ends_with(&format!(":{pid}")))),
        "a member that left is forgotten at once: {members:?}"
    );

    // Everything committed reaches the broker; then a stops.
    let mut seen: HashSet<String> = HashSet::new();
    watch.wait_for(&mut seen, writer.committed.len()).await?;
    drop(watch);
    sigterm(&a.child).await?;
    let mut a = a;
    let status_a = tokio::time::timeout(GUARD, a.child.wait()).await??;
    let log = a.stderr.await?;
    assert!(status_a.success(), "{log}");
    assert!(log.contains("relay group: holding shards"), "{log}");
    read_back(&db, &broker, &suffix, &writer).await?;
    eprintln!(
        "group on {database:?}: {} committed ({} rolled back) across join, standby, SIGKILL \
         (taken over after {takeover:?}), SIGSTOP, leave; {:?} in all",
        writer.committed.len(),
        writer.rolled_back,
        started.elapsed()
    );
    broker.delete(&suffix).await?;
    clean_up(&db).await
}

/// Drop what the test made: the schema (Postgres), or the outbox table, the relays' accounts
/// and the group and key-lock tables beside the outbox table (MariaDB).
async fn clean_up(db: &Db) -> Result<(), BoxError> {
    db.clean_up().await?;
    if let Db::Mysql { store, .. } = db {
        sqlx::raw_sql(&store.config().drop_sql())
            .execute(store.pool())
            .await?;
    }
    Ok(())
}

/// Read the broker back: every committed message (once, NATS dedups by id), no rolled-back
/// one, each key in commit order; and the store holds nothing pending, leased or dead.
async fn read_back(
    db: &Db,
    broker: &Broker,
    suffix: &str,
    writer: &Writer,
) -> Result<(), BoxError> {
    let received = broker.read_back(suffix).await?;
    let stored = db.payloads().await?;
    let expected = common::expected(&writer.committed, &stored);
    let delivery = check_delivery(&received, &expected)?;
    assert_eq!(delivery.distinct, writer.committed.len());
    let counts = db.admin().counts().await?;
    assert_eq!(
        (counts.pending, counts.leased, counts.dead),
        (0, 0, 0),
        "{counts:?}"
    );
    Ok(())
}

/// Wait until the running, unfrozen relays `live` hold every shard between them, each at most
/// its fair share `ceil(SHARDS / live)`, and nobody else holds any (a SIGKILLed or frozen
/// replica's leases have run out and been taken over), writing a transaction per tick.
async fn wait_division(
    store: &dyn RelayGroupStore,
    db: &Db,
    writer: &mut Writer,
    live: &[&Relay],
    what: &str,
) -> Result<(), BoxError> {
    let share = SHARDS.div_ceil(live.len());
    let deadline = tokio::time::Instant::now() + GUARD;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        writer.write(db).await?;
        let members = store.group_status(GROUP).await?;
        let mut all: Vec<u32> = members.iter().flat_map(|m| m.shards.clone()).collect();
        all.sort_unstable();
        let before = all.len();
        all.dedup();
        assert_eq!(before, all.len(), "{what}: a shard held twice: {members:?}");
        let ours = |m: &&GroupMember| {
            live.iter().any(|r| {
                r.child
                    .id()
                    .is_some_and(|pid| m.member_name.ends_with(&format!(":{pid}")))
            })
        };
        let held_by_live: Vec<usize> = members
            .iter()
            .filter(ours)
            .map(|m| m.shards.len())
            .collect();
        if held_by_live.iter().sum::<usize>() == SHARDS && held_by_live.iter().all(|n| *n <= share)
        {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "{what}: group never divided among {} live: {members:?}",
                live.len()
            )
            .into());
        }
    }
}

/// What the crash loop does to one replica in a round.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL, then start a new process in its place.
    Kill,
    /// SIGSTOP until the others hold its shards, then SIGCONT.
    Freeze,
    /// SIGTERM (it leaves the group), then start a new process in its place.
    Leave,
}

/// A relay group under a random crash loop: three replicas, and in each round one of them is
/// SIGKILLed and replaced, frozen past its shard lease and woken, or stopped gracefully and
/// replaced, while a writer commits and rolls back all along. After every fault the group must
/// come back to a fair division among the running replicas with no shard held twice; at the
/// end the broker holds every committed message once, none rolled back, each key in order.
/// `OUTBOX_GROUP_SEED` replays a run's choices (the seed is printed).
#[tokio::test]
async fn postgres_relay_group_survives_a_random_crash_loop() -> Result<(), BoxError> {
    survives_a_random_crash_loop(Database::Postgres).await
}

/// The same on MariaDB.
#[tokio::test]
async fn mariadb_relay_group_survives_a_random_crash_loop() -> Result<(), BoxError> {
    survives_a_random_crash_loop(Database::Mariadb).await
}

async fn survives_a_random_crash_loop(database: Database) -> Result<(), BoxError> {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    let Some(Setup {
        suffix,
        db,
        broker,
        mut watch,
        broker_url,
        mut writer,
    }) = Setup::new(database).await?
    else {
        return Ok(());
    };
    let store = groups(&db)?;
    let seed = match std::env::var("OUTBOX_GROUP_SEED") {
        Ok(s) => s.parse()?,
        Err(_) => rand::rng().random(),
    };
    eprintln!("group crash loop seed {seed} (OUTBOX_GROUP_SEED={seed} replays its choices)");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut spawned = 0;
    let mut start = async || {
        spawned += 1;
        start_relay(&db, &broker_url, &format!("loop-{suffix}-{spawned}")).await
    };
    let mut relays = vec![start().await?, start().await?, start().await?];
    wait_division(
        store,
        &db,
        &mut writer,
        &relays.iter().collect::<Vec<_>>(),
        "three started",
    )
    .await?;
    let mut faults = Vec::new();
    for round in 0..8 {
        let victim = rng.random_range(0..relays.len());
        let fault = match rng.random_range(0..3) {
            0 => Fault::Kill,
            1 => Fault::Freeze,
            _ => Fault::Leave,
        };
        faults.push(fault);
        let what = format!("round {round}: {fault:?} of replica {victim}");
        match fault {
            Fault::Kill => {
                relays[victim].child.start_kill()?;
                relays[victim].child.wait().await?;
                let others: Vec<&Relay> = relays
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != victim)
                    .map(|(_, r)| r)
                    .collect();
                wait_division(store, &db, &mut writer, &others, &what).await?;
                relays[victim] = start().await?;
            }
            Fault::Freeze => {
                signal(&relays[victim].child, "STOP").await?;
                let others: Vec<&Relay> = relays
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != victim)
                    .map(|(_, r)| r)
                    .collect();
                wait_division(store, &db, &mut writer, &others, &what).await?;
                signal(&relays[victim].child, "CONT").await?;
            }
            Fault::Leave => {
                sigterm(&relays[victim].child).await?;
                let status = tokio::time::timeout(GUARD, relays[victim].child.wait()).await??;
                assert!(
                    status.success(),
                    "{what}: a replica stopped by SIGTERM exited with {status}"
                );
                let others: Vec<&Relay> = relays
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != victim)
                    .map(|(_, r)| r)
                    .collect();
                wait_division(store, &db, &mut writer, &others, &what).await?;
                relays[victim] = start().await?;
            }
        }
        wait_division(
            store,
            &db,
            &mut writer,
            &relays.iter().collect::<Vec<_>>(),
            &format!("{what}, then all three"),
        )
        .await?;
    }

    let mut seen: HashSet<String> = HashSet::new();
    watch.wait_for(&mut seen, writer.committed.len()).await?;
    drop(watch);
    for relay in &relays {
        sigterm(&relay.child).await?;
    }
    for relay in &mut relays {
        tokio::time::timeout(GUARD, relay.child.wait()).await??;
    }
    read_back(&db, &broker, &suffix, &writer).await?;
    eprintln!(
        "group crash loop on {database:?} (seed {seed}): {} committed ({} rolled back) across {faults:?}",
        writer.committed.len(),
        writer.rolled_back
    );
    broker.delete(&suffix).await?;
    clean_up(&db).await
}
