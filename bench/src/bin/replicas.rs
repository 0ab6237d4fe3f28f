//! Benchmark: 1, 2 and 3 replicas of `outbox-relay run` on one Postgres outbox, in a relay group
//! (`--group`) and without one, side by side in one run, interleaved rounds; prints a Markdown
//! table for BENCHMARKS.md.
//!
//! ```text
//! eval "$(scripts/services)"
//! cargo build --release -p outbox-cli && \
//! cargo run --release -p outbox-bench --bin replicas -- [rounds=3] [messages=200000] [keys=1000]
//!     [shards=6] [batch=2000] [broker=stdout|nats]
//! ```
//!
//! Each round runs every configuration in turn: MESSAGES rows written by plain SQL (one
//! `INSERT ... SELECT generate_series`, not timed) over KEYS partition keys into a fresh schema,
//! then N `outbox-relay run` processes started together (`--claim-shards SHARDS --batch-size
//! BATCH --delete-published`, stdout broker to /dev/null, plus `--group bench` for the group
//! rows), timed from their start until no row is left (one probe of the claim index per 20
//! ms), then stopped with SIGTERM. A last configuration runs one relay in a group with the
//! in-flight batches of three (`--concurrency 6`; the default is 2), to tell what replicas add
//! beyond more batches at once. It prints the median rate of each configuration, its ratio to
//! one replica in the group, and the CPU time (user + system, from `/proc`) of the relay
//! processes per message, which with the database's is what bounds scaling on more cores.
//!
//! `broker=nats` publishes to NATS JetStream (`OUTBOX_TEST_NATS_URL`, a stream per drain, deleted
//! after it) instead of stdout into /dev/null: a broker whose acknowledgements the relay waits
//! for, where more batches in flight can add speed even when the database has spare cores.
//!
//! The `outbox-relay` binary is the one beside this program (`target/release/outbox-relay`),
//! or `OUTBOX_RELAY_BIN`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use outbox_bench::{load_average, median, process_cpu, thousands};
use sqlx::postgres::PgPoolOptions;
use tokio::process::{Child, Command};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The broker: `stdout` (into /dev/null, the default) or `nats` (JetStream at
/// `OUTBOX_TEST_NATS_URL`, a stream per drain, deleted after it).
fn broker_arg() -> String {
    std::env::args()
        .skip(1)
        .find_map(|a| a.strip_prefix("broker=").map(str::to_owned))
        .unwrap_or_else(|| "stdout".to_owned())
}

fn arg(name: &str, default: usize) -> usize {
    std::env::args()
        .skip(1)
        .find_map(|a| a.strip_prefix(&format!("{name}=")).map(str::to_owned))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn relay_bin() -> Result<std::path::PathBuf, BoxError> {
    if let Ok(bin) = std::env::var("OUTBOX_RELAY_BIN") {
        return Ok(bin.into());
    }
    let exe = std::env::current_exe()?;
    Ok(exe.with_file_name("outbox-relay"))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let rounds = arg("rounds", 3);
    let messages = arg("messages", 200_000);
    let keys = arg("keys", 1_000);
    let shards = arg("shards", 6);
    let batch = arg("batch", 2_000);
    let broker = broker_arg();
    if broker != "stdout" && broker != "nats" {
        return Err(format!("broker={broker}: stdout or nats").into());
    }
    let url = std::env::var("OUTBOX_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let bin = relay_bin()?;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await?;
    // (replicas, in a group, batches in flight each). The last row is one relay given the
    // in-flight batches of three (the relay's default is 2), to tell what replicas add beyond
    // more batches at once.
    let configs: [(usize, bool, usize); 7] = [
        (1, true, 2),
        (2, true, 2),
        (3, true, 2),
        (1, false, 2),
        (2, false, 2),
        (3, false, 2),
        (1, true, 6),
    ];
    eprintln!(
        "cores: {}, load average at start: {:?}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average()
    );
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut cpus: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for round in 0..rounds {
        for (i, (replicas, group, in_flight)) in configs.iter().enumerate() {
            let schema = format!("bench_replicas_{}_{round}_{i}", std::process::id());
            let (rate, cpu_us) = drain(
                &pool, &url, &bin, &broker, &schema, *replicas, *group, *in_flight, messages, keys,
                shards, batch,
            )
            .await?;
            eprintln!(
                "round {round}: {replicas} replica(s){}, {in_flight} in flight each: {} msg/s, \
                 relay CPU {cpu_us:.1} µs/msg",
                if *group { " in a group" } else { "" },
                thousands(rate)
            );
            rates[i].push(rate);
            cpus[i].push(cpu_us);
        }
    }
    let base = median(&rates[0]).unwrap_or(1.0);
    println!(
        "| replicas | group | in flight each | msg/s (median of {rounds}) | vs one in a group | \
         relay CPU µs/msg |"
    );
    println!("|---|---|---|---|---|---|");
    for (i, (replicas, group, in_flight)) in configs.iter().enumerate() {
        let rate = median(&rates[i]).unwrap_or(0.0);
        println!(
            "| {replicas} | {} | {in_flight} | {} | {:.2}× | {:.1} |",
            if *group { "yes" } else { "no" },
            thousands(rate),
            rate / base,
            median(&cpus[i]).unwrap_or(0.0)
        );
    }
    eprintln!("load average at end: {:?}", load_average());
    Ok(())
}

/// Write `messages` rows by SQL into a fresh schema, drain them with `replicas` relays, and
/// return the rate and the relays' CPU per message (µs).
#[allow(clippy::too_many_arguments)]
async fn drain(
    pool: &sqlx::PgPool,
    url: &str,
    bin: &std::path::Path,
    broker: &str,
    schema: &str,
    replicas: usize,
    group: bool,
    in_flight: usize,
    messages: usize,
    keys: usize,
    shards: usize,
    batch: usize,
) -> Result<(f64, f64), BoxError> {
    let config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(schema)
        .delete_published(true)
        .build()?;
    let store = outbox_backend_postgres::PostgresStore::new(pool.clone(), config);
    store.migrate().await?;
    let table = format!("\"{schema}\".\"outbox\"");
    sqlx::query(&format!(
        "INSERT INTO {table} (aggregatetype, aggregateid, type, payload, partition_key) \
         SELECT 'order', 'o-' || g, 'order.placed', jsonb_build_object('n', g), \
                'customer-' || (g % $2) \
           FROM generate_series(1, $1) g"
    ))
    .bind(i64::try_from(messages)?)
    .bind(i64::try_from(keys)?)
    .execute(pool)
    .await?;
    sqlx::query(&format!("VACUUM ANALYZE {table}"))
        .execute(pool)
        .await?;
    let shards = shards.to_string();
    let batch = batch.to_string();
    let in_flight = in_flight.to_string();
    let nats = std::env::var("OUTBOX_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let stream = schema.to_uppercase();
    let broker_url = match broker {
        "nats" => format!(
            "{nats}?subject={schema}.{{event_type}}&stream={stream}&create_stream=true\
             &stream_subjects={schema}.>"
        ),
        _ => "stdout://".to_owned(),
    };
    let started = Instant::now();
    let mut children: Vec<Child> = Vec::new();
    for _ in 0..replicas {
        let mut args = vec![
            "--store",
            url,
            "--schema",
            schema,
            "--broker",
            &broker_url,
            "--claim-shards",
            &shards,
            "--batch-size",
            &batch,
            "--delete-published",
            "--concurrency",
            &in_flight,
            "--log",
            "warn",
            "run",
        ];
        if group {
            args.extend(["--group", "bench"]);
        }
        children.push(
            Command::new(bin)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()?,
        );
    }
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        // One probe of the claim index (a row is pending until its delete), not a count: a
        // count every 20 ms scans the table and takes a good part of a core from the drain.
        let (left,): (bool,) = sqlx::query_as(&format!(
            "SELECT EXISTS (SELECT 1 FROM {table} WHERE state = 'pending')"
        ))
        .fetch_one(pool)
        .await?;
        if !left {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err("messages left after 10 minutes".into());
        }
    }
    let wall = started.elapsed();
    let mut cpu = 0.0;
    for child in &mut children {
        if let Some(pid) = child.id() {
            cpu += process_cpu(pid).unwrap_or(0.0);
            // SIGTERM: a graceful stop (leaves the group).
            let _ = Command::new("kill").arg(pid.to_string()).status().await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    }
    if broker == "nats" {
        let client = async_nats::connect(nats.trim_start_matches("nats://")).await?;
        let js = async_nats::jetstream::new(client);
        let _ = js.delete_stream(&stream).await;
    }
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(pool)
        .await?;
    Ok((
        messages as f64 / wall.as_secs_f64(),
        cpu * 1e6 / messages as f64,
    ))
}
