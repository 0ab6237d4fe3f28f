//! Benchmark: this project's drains side by side with the peers it is measured against, in one
//! run, alternating, several rounds each; prints Markdown tables for BENCHMARKS.md.
//!
//! ```text
//! eval "$(scripts/services)"
//! cargo run --release -p outbox-bench --bin sidebyside -- [postgres,kafka,sqlite,mysql|all]
//!     [rounds=3] [messages=100000] [keys=1000] [peer_messages=10000] [batch=N] [concurrency=N]
//!     [claim_shards=N]
//!     [kafka_props=a=b;c=d] [pgmq=100x1,100x2,1000x1,1000x2|none] [peer=true|false]
//!     [delete_published=false|true|both] [recommended=false|true]
//!     [partitioned=false|true|both] [cursor_claims=false|true|both] [mysql_floor=2000x2|BATCHxWORKERS,...|none]
//!     [unpublished_table=false|true|both]
//! ```
//!
//! With no `batch=`, `concurrency=`, `claim_shards=` or `recommended=`, this project's drains run
//! at the relay's defaults, as for a user who sets nothing: the batch size and claim shards the
//! store declares (`Capabilities`: Postgres 2,000 in 2 shards, MariaDB its own, SQLite one claim
//! at a time) and the default in-flight count; published rows are kept unless
//! `delete_published=` says otherwise. `delete_published=both` runs each of this project's drains
//! twice a round, keeping then deleting published rows, as two series (`, keeping` and
//! `, deleting`), so that both modes are measured side by side with the same peers.
//!
//! Sections, each round running them in turn (this project first, then its peer):
//!
//! - `postgres`: the store-bound drain: MESSAGES messages over KEYS partition keys enqueued in
//!   batches of 500 (not timed), then one relay at the given (default) settings drains them into
//!   the in-memory recording publisher, with per-key order and fencing on; per-key order is
//!   checked afterwards. Against **pgmq** (the crate, its SQL installed without the extension):
//!   the same count of the same payloads sent in batches of 1,000, then read + delete loops, for
//!   every `BATCHxWORKERS` of `pgmq=` (default batch 100 and 1,000, 1 and 2 workers); the
//!   table's ratio is against the best of them.
//! - `kafka`: Postgres → Kafka (Tansu, 4 partitions), every record read back and checked (ids,
//!   bytes, per-key order). Against **oxide-outbox** (outbox-core 0.6, outbox-postgres 0.3,
//!   outbox-kafka 0.2): PEER_MESSAGES messages enqueued through its transactional API into its
//!   own schema, then its processor (what its manager runs) called until it finds nothing, into
//!   its `KafkaTransport` with `linger.ms=0` (its best setting), batch 100 (its default).
//!   Its migration is read from the crate's source that cargo downloaded (nothing of it is kept
//!   in this repository).
//! - `sqlite`, `mysql`: this project's drain as `postgres`. SQLite has no peer. MariaDB's is a
//!   **floor**, not a product: pgmq's loop written on MariaDB (its table shape, a primary key
//!   and an index on the visibility time; a read is a `SELECT ... FOR UPDATE SKIP LOCKED` of
//!   `BATCH` rows in id order and an `UPDATE` of their visibility time, one transaction; then a
//!   `DELETE` by id, or pgmq's archive: the rows copied to an archive table, then deleted), no
//!   per-key order, no fencing, `WORKERS` loops side by side for each entry of `mysql_floor=`.
//!   What no relay that leases its rows and then settles them can beat on this server, and what
//!   the ratio in the MariaDB table is against.
//!
//! `recommended=true` runs each store at the settings the README's "Speed" recommends for it,
//! each setting unless given explicitly: every store deletes published rows; Postgres (and
//! Postgres → Kafka) claims over 2 claim shards in batches of 2,000; MariaDB takes batches of
//! 1,000 with one in flight; SQLite keeps the defaults otherwise.
//!
//! `cursor_claims=true` lays this project's Postgres tables out for cursor claims
//! (`PostgresConfigBuilder::cursor_claims`: the completion that keeps a row is a HOT update),
//! `cursor_claims=false` for partial indexes; left out, the store's default chooses (cursor
//! claims when published rows are kept, partial indexes when they are deleted).
//! `cursor_claims=both` runs each Postgres drain on both layouts (series suffix `, cursor
//! claims`), side by side. Not with partitioned tables.
//!
//! `unpublished_table=true` lays this project's MariaDB tables out with an unpublished table
//! (`MysqlConfigBuilder::unpublished_table`: the completion that keeps a row changes no index
//! of it), `both` runs each MariaDB drain on both layouts (series suffix `, unpublished
//! table`), side by side; left out, the store's default.
//!
//! `partitioned=true` makes this project's Postgres tables partitioned by day
//! (`PostgresConfigBuilder::partition_interval`, retention by partition); `partitioned=both`
//! runs each Postgres drain on a plain table and then on a partitioned one (series suffix
//! `, partitioned`), side by side. Each Postgres setup also prints its enqueue rate (batches of
//! 500, one transaction each), so that writers on the two shapes are compared too.
//!
//! `pgmq=none` and `peer=false` leave the peers out, to compare this project's settings
//! (`batch=`, `concurrency=`, `claim_shards=`, `kafka_props=`) run against run.
//!
//! For each drain it reads the CPU time (user + system) from `/proc` before and after: the relay
//! (this process; for SQLite the database too, it is in-process), the database server (for
//! Postgres the backends of this run's connections, found by their `application_name`, plus the
//! server's background processes, as other clients may share the server; for MariaDB the
//! `mariadbd` started with `--port=PORT` for the URL's port if there is one, a private server,
//! else every `mariadbd`) and the broker (the `tansu` process listening on the brokers' port), as µs per
//! message, and the share of the machine's cores all of them used over the drain's wall time. The 1-minute load average
//! is printed at the start and at the end. Servers come from `OUTBOX_TEST_POSTGRES_URL`,
//! `OUTBOX_TEST_MYSQL_URL` and `OUTBOX_TEST_KAFKA_BROKERS` (defaults: the loopback servers of
//! SERVICES.md). Every schema, queue, table and topic it makes is removed at the end.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use outbox_backend_mysql::{MysqlConfig, MysqlStore};
use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_backend_sqlite::{SqliteConfig, SqliteStore};
use outbox_bench::{check_key_order, core_share, load_average, median, message, thousands};
use outbox_bench::{
    find_process, payload, postgres_background, process_cpu, CpuReading, TimedStore,
};
use outbox_e2e::{check_delivery, kafka, Expected};
use outbox_engine::{Relay, RelayConfig};
use outbox_memory::RecordingPublisher;
use outbox_traits::{OutboxStore, Publisher};
use oxide_core::prelude::{OutboxConfig, OutboxProcessor, OutboxService};
use oxide_kafka::{KafkaKeyExtractable, KafkaTransport};
use oxide_postgres::{PostgresOutbox, PostgresWriter};
use pgmq::PGMQueueExt;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxResult<T> = Result<T, BoxError>;

/// Messages per enqueue transaction of this project (as the other benchmarks).
const ENQUEUE_BATCH: usize = 500;
/// Messages per enqueue transaction of the peers (as the research measured them).
const PEER_ENQUEUE_BATCH: usize = 1_000;
/// Kafka topic partitions.
const PARTITIONS: i32 = 4;
/// The peer's default batch (`OutboxConfig::batch_size`).
const PEER_BATCH: u32 = 100;
/// pgmq's visibility timeout for a read, in seconds (no message comes back within a run).
const PGMQ_VT_SECS: i32 = 30;

/// Settings from the command line.
#[derive(Debug, Clone)]
struct Opts {
    sections: Vec<String>,
    rounds: usize,
    messages: usize,
    keys: usize,
    peer_messages: usize,
    batch: Option<usize>,
    concurrency: Option<usize>,
    /// The relay's `claim_shards` (claims that run side by side over disjoint keys).
    claim_shards: Option<usize>,
    kafka_props: Vec<(String, String)>,
    /// pgmq loops: (batch, workers).
    pgmq: Vec<(i32, usize)>,
    /// The bare SKIP LOCKED loops on MariaDB (pgmq's statements): (batch, workers).
    mysql_floor: Vec<(usize, usize)>,
    /// Whether to run oxide-outbox in the Kafka section.
    peer: bool,
    /// This project's drains (every store) delete published rows (`delete_published(true)`).
    delete_published: Option<bool>,
    /// `delete_published=both`: each drain of this project keeping, then deleting (see
    /// [`Opts::modes`]).
    both_modes: bool,
    /// Each store at the README's recommended settings (see [`Opts::for_store`]).
    recommended: bool,
    /// The Postgres table shapes each Postgres drain runs on: plain (`false`), partitioned by
    /// day (`true`), or both in turn.
    partitioned: Vec<bool>,
    /// The Postgres table layouts each Postgres drain runs on: partial indexes (`false`), laid
    /// out for cursor claims (`true`), both, or (`None`) the store's default.
    cursor_claims: Vec<Option<bool>>,
    /// The MariaDB table layouts each MariaDB drain runs on: the outbox table's own claim
    /// indexes (`false`), an unpublished table (`true`), both, or (`None`) the store's default.
    unpublished_table: Vec<Option<bool>>,
}

impl Opts {
    fn parse() -> BoxResult<Self> {
        let mut o = Opts {
            sections: vec![],
            rounds: 3,
            messages: 100_000,
            keys: 1_000,
            peer_messages: 10_000,
            batch: None,
            concurrency: None,
            claim_shards: None,
            kafka_props: vec![],
            pgmq: vec![(100, 1), (100, 2), (1_000, 1), (1_000, 2)],
            mysql_floor: vec![(2_000, 2)],
            peer: true,
            delete_published: None,
            both_modes: false,
            partitioned: vec![false],
            cursor_claims: vec![None],
            unpublished_table: vec![None],
            recommended: false,
        };
        for arg in std::env::args().skip(1) {
            let Some((key, value)) = arg.split_once('=') else {
                for s in arg.split(',').filter(|s| !s.is_empty()) {
                    if s == "all" {
                        o.sections = ALL.iter().map(|s| (*s).to_owned()).collect();
                    } else if ALL.contains(&s) {
                        o.sections.push(s.to_owned());
                    } else {
                        return Err(format!(
                            "unknown section {s:?}; use {} or all",
                            ALL.join(", ")
                        )
                        .into());
                    }
                }
                continue;
            };
            match key {
                "rounds" => o.rounds = value.parse::<usize>()?.max(1),
                "messages" => o.messages = value.parse()?,
                "keys" => o.keys = value.parse::<usize>()?.max(1),
                "peer_messages" => o.peer_messages = value.parse()?,
                "batch" => o.batch = Some(value.parse()?),
                "concurrency" => o.concurrency = Some(value.parse()?),
                "claim_shards" => o.claim_shards = Some(value.parse()?),
                "kafka_props" => {
                    for pair in value.split(';').filter(|p| !p.is_empty()) {
                        let (k, v) = pair.split_once('=').ok_or_else(|| {
                            format!("kafka_props entry {pair:?} needs name=value")
                        })?;
                        o.kafka_props.push((k.to_owned(), v.to_owned()));
                    }
                }
                "peer" => o.peer = value.parse()?,
                "delete_published" if value == "both" => {
                    o.both_modes = true;
                    o.delete_published = None;
                }
                "delete_published" => {
                    o.both_modes = false;
                    o.delete_published = Some(value.parse().map_err(|_| {
                        format!("delete_published={value:?}: use false, true or both")
                    })?);
                }
                "recommended" => o.recommended = value.parse()?,
                "cursor_claims" if value == "both" => {
                    o.cursor_claims = vec![Some(false), Some(true)];
                }
                "cursor_claims" => {
                    o.cursor_claims = vec![Some(value.parse().map_err(|_| {
                        format!("cursor_claims={value:?}: use false, true or both")
                    })?)];
                }
                "unpublished_table" if value == "both" => {
                    o.unpublished_table = vec![Some(false), Some(true)];
                }
                "unpublished_table" => {
                    o.unpublished_table = vec![Some(value.parse().map_err(|_| {
                        format!("unpublished_table={value:?}: use false, true or both")
                    })?)];
                }
                "partitioned" if value == "both" => o.partitioned = vec![false, true],
                "partitioned" => {
                    o.partitioned = vec![value
                        .parse()
                        .map_err(|_| format!("partitioned={value:?}: use false, true or both"))?];
                }
                "pgmq" if value == "none" => o.pgmq.clear(),
                "pgmq" => {
                    o.pgmq = batches_by_workers("pgmq", value)?
                        .into_iter()
                        .map(|(b, w)| Ok::<_, BoxError>((i32::try_from(b)?, w)))
                        .collect::<Result<_, _>>()?;
                }
                "mysql_floor" if value == "none" => o.mysql_floor.clear(),
                "mysql_floor" => o.mysql_floor = batches_by_workers("mysql_floor", value)?,
                _ => {
                    return Err(format!(
                        "unknown option {key:?}; use rounds, messages, keys, peer_messages, batch, \
                         concurrency, claim_shards, kafka_props, pgmq, peer, delete_published, \
                         recommended, partitioned, cursor_claims, mysql_floor, unpublished_table"
                    )
                    .into())
                }
            }
        }
        if o.sections.is_empty() {
            o.sections = ALL.iter().map(|s| (*s).to_owned()).collect();
        }
        Ok(o)
    }

    fn relay(&self) -> Result<RelayConfig, outbox_traits::Error> {
        let defaults = RelayConfig::default();
        RelayConfig::builder()
            // Unset: the store's choice (Postgres: 2,000 and 2 shards), as for a user.
            .batch_size(self.batch)
            .concurrency(self.concurrency.unwrap_or(defaults.concurrency()))
            .claim_shards(self.claim_shards)
            .build()
    }

    fn relay_settings(&self) -> String {
        let c = match self.relay() {
            Ok(c) => c,
            Err(e) => return format!("invalid relay settings: {e}"),
        };
        format!(
            "batch {}, {} in flight{}, order + fencing on{}",
            c.batch_size()
                .map_or("chosen by the store".to_owned(), |n| n.to_string()),
            c.concurrency(),
            match c.claim_shards() {
                Some(n) if n > 1 => format!(", {n} claim shards"),
                Some(_) => String::new(),
                None => ", claim shards chosen by the store".to_owned(),
            },
            if self.deletes() {
                ", published rows deleted"
            } else {
                ""
            }
        )
    }

    /// [`Opts::relay_settings`] for a Postgres store, naming what it chooses where nothing was
    /// given (its `PREFERRED_BATCH` and `PREFERRED_CLAIM_SHARDS`).
    fn postgres_settings(&self) -> String {
        let cursor = match self.cursor_claims.as_slice() {
            [Some(on)] => *on,
            // The store's default for a new table.
            _ => self.partitioned != [true] && !self.deletes(),
        };
        let shape = if self.partitioned == [true] {
            ", table partitioned by day"
        } else if cursor {
            ", cursor claims"
        } else {
            ""
        };
        self.relay_settings()
            .replace(
                "batch chosen by the store",
                &format!(
                    "batch {} (the store's choice)",
                    outbox_backend_postgres::PREFERRED_BATCH
                ),
            )
            .replace(
                "claim shards chosen by the store",
                &format!(
                    "{} claim shards (the store's choice)",
                    outbox_backend_postgres::PREFERRED_CLAIM_SHARDS
                ),
            )
            + shape
    }

    /// Whether this project's drains delete published rows.
    fn deletes(&self) -> bool {
        self.delete_published.unwrap_or(false)
    }

    /// The options for `store` (`postgres`, which the Kafka section uses too, `sqlite` or
    /// `mysql`): with `recommended=true`, the README's recommended settings for that store where
    /// none was given explicitly.
    fn for_store(&self, store: &str) -> Opts {
        let mut o = self.clone();
        if !self.recommended {
            return o;
        }
        o.delete_published.get_or_insert(true);
        match store {
            "postgres" => {
                o.batch.get_or_insert(2_000);
                o.claim_shards.get_or_insert(2);
            }
            "mysql" => {
                o.batch.get_or_insert(1_000);
                o.concurrency.get_or_insert(1);
            }
            _ => {}
        }
        o
    }

    /// The publish modes each of this project's drains runs in, each with its series name's
    /// suffix: one (no suffix) unless `delete_published=both`, then keeping and deleting.
    fn modes(&self) -> Vec<(&'static str, Opts)> {
        if !self.both_modes {
            return vec![("", self.clone())];
        }
        [(", keeping", false), (", deleting", true)]
            .into_iter()
            .map(|(suffix, deletes)| {
                let mut o = self.clone();
                o.both_modes = false;
                o.delete_published = Some(deletes);
                (suffix, o)
            })
            .collect()
    }

    fn has(&self, section: &str) -> bool {
        self.sections.iter().any(|s| s == section)
    }
}

const ALL: [&str; 4] = ["postgres", "kafka", "sqlite", "mysql"];

/// `BATCHxWORKERS,...` (e.g. `1000x1,1000x2`) as (batch, workers) pairs.
fn batches_by_workers(option: &str, value: &str) -> BoxResult<Vec<(usize, usize)>> {
    value
        .split(',')
        .map(|c| {
            let (b, w) = c
                .split_once('x')
                .ok_or_else(|| format!("{option} entry {c:?} needs BATCHxWORKERS"))?;
            Ok::<_, BoxError>((b.parse::<usize>()?.max(1), w.parse::<usize>()?.max(1)))
        })
        .collect()
}

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// One timed drain.
#[derive(Debug, Clone, Copy)]
struct Run {
    rate: f64,
    /// CPU µs per message: this process, the database server, the broker server.
    relay_us: f64,
    db_us: f64,
    broker_us: f64,
    /// Share of the machine's cores the three used over the drain.
    share: f64,
}

/// `application_name` of this benchmark's Postgres connections, to find their server backends.
const APP_NAME: &str = "outbox-sidebyside";

/// CPU seconds of this benchmark's Postgres backends and of the server's background processes,
/// by process.
async fn postgres_cpu(pool: &sqlx::PgPool) -> BoxResult<Vec<(u32, f64)>> {
    let pids: Vec<(i32,)> =
        sqlx::query_as("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(APP_NAME)
            .fetch_all(pool)
            .await?;
    let mut pids: Vec<u32> = pids.into_iter().map(|(p,)| p as u32).collect();
    pids.extend(postgres_background());
    Ok(pids
        .into_iter()
        .filter_map(|pid| Some((pid, process_cpu(pid)?)))
        .collect())
}

/// CPU seconds used between two [`postgres_cpu`] readings (a process that appeared in between
/// counts from zero).
fn postgres_secs(before: &[(u32, f64)], after: &[(u32, f64)]) -> f64 {
    after
        .iter()
        .map(|(pid, now)| {
            let start = before
                .iter()
                .find(|(p, _)| p == pid)
                .map_or(0.0, |(_, s)| *s);
            (now - start).max(0.0)
        })
        .sum()
}

/// Where the database's CPU time is read from.
enum Db<'a> {
    /// Not a server (SQLite runs in this process).
    None,
    /// This benchmark's backends (pool with [`APP_NAME`]) and the server's background processes.
    Postgres(&'a sqlx::PgPool),
    /// Every process of this name (MariaDB is one process).
    Process(&'static str),
    /// One process (a private MariaDB started with `--port=PORT`, apart from the shared one).
    Pid(u32),
}

/// The CPU readings and clock around one drain.
struct Timer<'a> {
    cpu: CpuReading,
    db: Db<'a>,
    /// CPU seconds at the start of the Postgres backends, or of the one process of `Db::Pid`.
    postgres: Vec<(u32, f64)>,
    /// The broker server's process and its CPU seconds at the start.
    broker: Option<(u32, f64)>,
    started: Instant,
}

impl<'a> Timer<'a> {
    /// Start timing; `broker` is the broker server's process, if any.
    async fn start(db: Db<'a>, broker: Option<u32>) -> BoxResult<Timer<'a>> {
        let postgres = match db {
            Db::Postgres(pool) => postgres_cpu(pool).await?,
            Db::Pid(pid) => process_cpu(pid)
                .map(|secs| vec![(pid, secs)])
                .unwrap_or_default(),
            _ => vec![],
        };
        Ok(Self {
            cpu: CpuReading::now(),
            db,
            postgres,
            broker: broker.and_then(|pid| Some((pid, process_cpu(pid)?))),
            started: Instant::now(),
        })
    }

    /// The drain's figures.
    async fn stop(self, messages: usize) -> BoxResult<Run> {
        let wall = self.started.elapsed();
        let after = CpuReading::now();
        let db = match self.db {
            Db::None => 0.0,
            Db::Postgres(pool) => postgres_secs(&self.postgres, &postgres_cpu(pool).await?),
            Db::Process(name) => after.since(&self.cpu, name),
            Db::Pid(pid) => self.postgres.first().map_or(0.0, |&(_, before)| {
                process_cpu(pid).map_or(0.0, |now| (now - before).max(0.0))
            }),
        };
        let per_msg = |secs: f64| secs * 1e6 / messages.max(1) as f64;
        let broker = self.broker.map_or(0.0, |(pid, before)| {
            process_cpu(pid).map_or(0.0, |now| (now - before).max(0.0))
        });
        let relay = after.since(&self.cpu, "self");
        Ok(Run {
            rate: messages as f64 / wall.as_secs_f64(),
            relay_us: per_msg(relay),
            db_us: per_msg(db),
            broker_us: per_msg(broker),
            share: core_share(relay + db + broker, wall),
        })
    }
}

/// Runs of one drain configuration, in round order.
#[derive(Default)]
struct Series {
    settings: String,
    messages: usize,
    runs: Vec<Run>,
}

impl Series {
    fn median_of(&self, f: impl Fn(&Run) -> f64) -> f64 {
        median(&self.runs.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
    }

    fn rate(&self) -> f64 {
        self.median_of(|r| r.rate)
    }

    fn rates(&self) -> String {
        self.runs
            .iter()
            .map(|r| thousands(r.rate))
            .collect::<Vec<_>>()
            .join(" / ")
    }

    /// Median CPU per message of each part present, and the median share of the cores.
    fn cpu(&self, db: bool, broker: bool) -> (String, String) {
        let mut parts = vec![format!("{:.1}", self.median_of(|r| r.relay_us))];
        let mut total = self.median_of(|r| r.relay_us);
        if db {
            parts.push(format!("{:.1}", self.median_of(|r| r.db_us)));
            total += self.median_of(|r| r.db_us);
        }
        if broker {
            parts.push(format!("{:.1}", self.median_of(|r| r.broker_us)));
            total += self.median_of(|r| r.broker_us);
        }
        let cpu = if parts.len() == 1 {
            parts.remove(0)
        } else {
            format!("{} = {total:.1}", parts.join(" + "))
        };
        (cpu, format!("{:.0}%", self.median_of(|r| r.share) * 100.0))
    }
}

/// Every series by name, in insertion order.
#[derive(Default)]
struct Results(Vec<(String, Series)>);

impl Results {
    fn add(&mut self, name: &str, settings: &str, messages: usize, run: Run) {
        eprintln!(
            "  {name}: {} msg/s; CPU µs/msg relay {:.1}, db {:.1}, broker {:.1}; {:.0}% of the cores",
            thousands(run.rate),
            run.relay_us,
            run.db_us,
            run.broker_us,
            run.share * 100.0
        );
        if let Some((_, s)) = self.0.iter_mut().find(|(n, _)| n == name) {
            s.runs.push(run);
            return;
        }
        self.0.push((
            name.to_owned(),
            Series {
                settings: settings.to_owned(),
                messages,
                runs: vec![run],
            },
        ));
    }

    fn get(&self, name: &str) -> Option<&Series> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, s)| s)
    }

    fn starting<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'a String, &'a Series)> + 'a {
        self.0
            .iter()
            .filter(move |(n, _)| n.starts_with(prefix))
            .map(|(n, s)| (n, s))
    }
}

/// The Tansu process serving `brokers` (`host:port`), for its CPU time: other Tansu brokers
/// may run beside it.
fn tansu_pid(brokers: &str) -> Option<u32> {
    let port = brokers.rsplit(':').next().unwrap_or(brokers);
    find_process("tansu", &format!(":{port}"))
}

// ---------------------------------------------------------------------------------------------
// This project.

/// A fresh Postgres store in its own schema, holding MESSAGES enqueued messages.
async fn postgres_store(
    pool: &sqlx::PgPool,
    o: &Opts,
) -> BoxResult<(Arc<PostgresStore>, PostgresConfig)> {
    let schema = format!("bench_{}", outbox_e2e::unique_suffix());
    let partitioned = o.partitioned.first().copied().unwrap_or(false);
    let mut config = PostgresConfig::builder()
        .schema(&schema)
        .notify(false)
        .delete_published(o.deletes())
        .partition_interval(partitioned.then_some(std::time::Duration::from_secs(86_400)));
    if let Some(Some(on)) = o.cursor_claims.first() {
        config = config.cursor_claims(*on);
    }
    let config = config.build()?;
    let store = Arc::new(PostgresStore::new(pool.clone(), config.clone()));
    store.migrate().await?;
    let started = Instant::now();
    for chunk in (0..o.messages).collect::<Vec<_>>().chunks(ENQUEUE_BATCH) {
        let batch: Vec<_> = chunk.iter().map(|&n| message(n, o.keys)).collect();
        let mut tx = pool.begin().await?;
        outbox_backend_postgres::enqueue_batch(&mut *tx, &config, &batch).await?;
        tx.commit().await?;
    }
    eprintln!(
        "  enqueue ({} table): {} msg/s",
        if partitioned { "partitioned" } else { "plain" },
        thousands(o.messages as f64 / started.elapsed().as_secs_f64())
    );
    sqlx::query(&format!("ANALYZE {}", config.qualified_table()))
        .execute(pool)
        .await?;
    Ok((store, config))
}

async fn drop_schema(pool: &sqlx::PgPool, config: &PostgresConfig) -> BoxResult<()> {
    sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", config.schema()))
        .execute(pool)
        .await?;
    Ok(())
}

/// Drain `store` into the recording publisher; checks the count and per-key order.
async fn drain_recording(store: Arc<dyn OutboxStore>, o: &Opts, db: Db<'_>) -> BoxResult<Run> {
    let publisher = Arc::new(RecordingPublisher::new());
    let timed = Arc::new(TimedStore::new(store));
    let relay = Relay::new(timed.clone(), publisher.clone(), o.relay()?)?;
    let timer = Timer::start(db, None).await?;
    let stats = relay.run_until_idle().await?;
    let run = timer.stop(o.messages).await?;
    eprintln!("  store calls: {}", timed.summary());
    if stats.published as usize != o.messages {
        return Err(format!("published {} of {}", stats.published, o.messages).into());
    }
    check_key_order(publisher.published().iter().map(|d| &d.message))?;
    Ok(run)
}

async fn postgres_ours(pool: &sqlx::PgPool, o: &Opts) -> BoxResult<Run> {
    let (store, config) = postgres_store(pool, o).await?;
    let run = drain_recording(store, o, Db::Postgres(pool)).await;
    drop_schema(pool, &config).await?;
    run
}

async fn kafka_ours(pool: &sqlx::PgPool, brokers: &str, o: &Opts) -> BoxResult<Run> {
    let (store, config) = postgres_store(pool, o).await?;
    let topic = format!("bench-{}", outbox_e2e::unique_suffix());
    let result = async {
        kafka::create_topic(brokers, &topic, PARTITIONS).await?;
        let mut url = format!("kafka://{brokers}?topic={topic}");
        for (k, v) in &o.kafka_props {
            url.push_str(&format!("&{k}={v}"));
        }
        let publisher: Arc<dyn Publisher> = Arc::from(outbox::broker::connect(&url).await?);
        let rows: Vec<(String, Option<String>, String)> = sqlx::query_as(&format!(
            "SELECT id::text, partition_key, payload::text FROM {} ORDER BY seq",
            config.qualified_table()
        ))
        .fetch_all(pool)
        .await?;
        let expected: Vec<Expected> = rows
            .into_iter()
            .map(|(id, key, payload)| Expected {
                id,
                key,
                payload: payload.into_bytes(),
            })
            .collect();
        let relay = Relay::new(store.clone(), publisher, o.relay()?)?;
        let timer = Timer::start(Db::Postgres(pool), tansu_pid(brokers)).await?;
        let stats = relay.run_until_idle().await?;
        let run = timer.stop(o.messages).await?;
        if stats.published as usize != o.messages {
            return Err(format!("published {} of {}", stats.published, o.messages).into());
        }
        let received = kafka::read_topic(brokers, &topic, PARTITIONS).await?;
        let delivery = check_delivery(&received, &expected)?;
        eprintln!(
            "  kafka: {} read back and checked, {} duplicates",
            delivery.distinct, delivery.duplicates
        );
        Ok::<_, BoxError>(run)
    }
    .await;
    let _ = kafka::delete_topic(brokers, &topic).await;
    drop_schema(pool, &config).await?;
    result
}

async fn sqlite_ours(o: &Opts) -> BoxResult<Run> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.sqlite");
    let config = SqliteConfig::builder()
        .delete_published(o.deletes())
        .build()?;
    let store = SqliteStore::open(&path, config.clone()).await?;
    store.migrate().await?;
    let (messages, keys) = (o.messages, o.keys);
    tokio::task::spawn_blocking(move || {
        outbox_bench::sqlite_enqueue(&path, &config, messages, keys, ENQUEUE_BATCH)
    })
    .await??;
    drain_recording(Arc::new(store), o, Db::None).await
}

async fn mysql_ours(pool: &sqlx::MySqlPool, o: &Opts) -> BoxResult<Run> {
    let table = format!("bench_{}", outbox_e2e::unique_suffix());
    let mut config = MysqlConfig::builder()
        .table(&table)
        .delete_published(o.deletes());
    if let Some(Some(on)) = o.unpublished_table.first() {
        config = config.unpublished_table(*on);
    }
    let config = config.build()?;
    let store = Arc::new(MysqlStore::new(pool.clone(), config.clone()));
    store.migrate().await?;
    let result = async {
        for chunk in (0..o.messages).collect::<Vec<_>>().chunks(ENQUEUE_BATCH) {
            let batch: Vec<_> = chunk.iter().map(|&n| message(n, o.keys)).collect();
            let mut tx = pool.begin().await?;
            outbox_backend_mysql::enqueue_batch(&mut *tx, &config, &batch).await?;
            tx.commit().await?;
        }
        sqlx::raw_sql(&format!("ANALYZE TABLE {}", config.qualified_table()))
            .execute(pool)
            .await?;
        drain_recording(store.clone(), o, mariadb_cpu(pool)).await
    }
    .await;
    sqlx::raw_sql(&config.drop_sql()).execute(pool).await?;
    result
}

/// Where MariaDB's CPU time is read from: the `mariadbd` started with `--port=PORT` for the
/// pool's port if there is one (a private server, e.g. one with the performance schema on, next
/// to the shared one), else every `mariadbd`.
fn mariadb_cpu(pool: &sqlx::MySqlPool) -> Db<'static> {
    let port = pool.connect_options().get_port();
    match find_process("mariadbd", &format!("--port={port}")) {
        Some(pid) => Db::Pid(pid),
        None => Db::Process("mariadbd"),
    }
}

/// Starts each transaction of the MariaDB floor loop.
const READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// The floor on MariaDB: pgmq's loop written on MariaDB, `workers` loops of read `batch` then
/// delete (or archive, `archive`) until the table is empty; see the module docs. Nothing is
/// published and nothing is ordered: what is measured is the least a relay that leases rows and
/// then settles them asks of the server.
async fn mysql_floor(
    pool: &sqlx::MySqlPool,
    o: &Opts,
    batch: usize,
    workers: usize,
    archive: bool,
) -> BoxResult<Run> {
    let suffix = outbox_e2e::unique_suffix();
    let (q, a) = (format!("floor_q_{suffix}"), format!("floor_a_{suffix}"));
    // pgmq's queue table (`pgmq.q_*`), in MariaDB's types, and its archive (`pgmq.a_*`).
    sqlx::raw_sql(&format!(
        "CREATE TABLE {q} (
             msg_id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
             read_ct INT NOT NULL DEFAULT 0,
             enqueued_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
             vt TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
             message LONGTEXT NOT NULL,
             INDEX (vt)
         ) ENGINE = InnoDB;
         CREATE TABLE {a} (
             msg_id BIGINT NOT NULL PRIMARY KEY,
             read_ct INT NOT NULL,
             enqueued_at TIMESTAMP(6) NOT NULL,
             archived_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
             vt TIMESTAMP(6) NOT NULL,
             message LONGTEXT NOT NULL,
             INDEX (archived_at)
         ) ENGINE = InnoDB;"
    ))
    .execute(pool)
    .await?;
    let result = async {
        for chunk in (0..o.messages)
            .collect::<Vec<_>>()
            .chunks(PEER_ENQUEUE_BATCH)
        {
            let mut insert = sqlx::QueryBuilder::new(format!("INSERT INTO {q} (message) "));
            insert.push_values(chunk, |mut row, &n| {
                row.push_bind(payload(n, &format!("customer-{}", n % o.keys)).to_string());
            });
            insert.build().execute(pool).await?;
        }
        sqlx::raw_sql(&format!("ANALYZE TABLE {q}"))
            .execute(pool)
            .await?;
        let timer = Timer::start(mariadb_cpu(pool), None).await?;
        let loops = (0..workers).map(|_| {
            let (pool, q, a) = (pool.clone(), q.clone(), a.clone());
            tokio::spawn(async move {
                let mut done = 0u64;
                loop {
                    // pgmq's read: the first visible rows, skipping locked ones, made invisible
                    // for the visibility timeout, in one transaction.
                    // READ COMMITTED, as this project's store: locking reads lock only the rows
                    // they return (under REPEATABLE READ two loops deadlock on gap locks).
                    let mut tx = pool.begin_with(READ_COMMITTED).await?;
                    let rows: Vec<(i64, String)> = sqlx::query_as(&format!(
                        "SELECT msg_id, message FROM {q} WHERE vt <= NOW(6)
                         ORDER BY msg_id LIMIT ? FOR UPDATE SKIP LOCKED"
                    ))
                    .bind(batch as u64)
                    .fetch_all(&mut *tx)
                    .await?;
                    if rows.is_empty() {
                        return Ok::<_, sqlx::Error>(done);
                    }
                    // The ids are this table's own integers: written into the statement.
                    let ids = rows
                        .iter()
                        .map(|(id, _)| id.to_string())
                        .collect::<Vec<_>>()
                        .join(",");
                    sqlx::query(&format!(
                        "UPDATE {q} SET vt = NOW(6) + INTERVAL {PGMQ_VT_SECS} SECOND,
                         read_ct = read_ct + 1 WHERE msg_id IN ({ids})"
                    ))
                    .execute(&mut *tx)
                    .await?;
                    tx.commit().await?;
                    // pgmq's delete, or its archive (copy, then delete, in one transaction).
                    let mut tx = pool.begin_with(READ_COMMITTED).await?;
                    if archive {
                        sqlx::query(&format!(
                            "INSERT INTO {a} (msg_id, read_ct, enqueued_at, vt, message)
                             SELECT msg_id, read_ct, enqueued_at, vt, message FROM {q}
                             WHERE msg_id IN ({ids})"
                        ))
                        .execute(&mut *tx)
                        .await?;
                    }
                    done += sqlx::query(&format!("DELETE FROM {q} WHERE msg_id IN ({ids})"))
                        .execute(&mut *tx)
                        .await?
                        .rows_affected();
                    tx.commit().await?;
                }
            })
        });
        let mut done = 0;
        for r in futures::future::join_all(loops).await {
            done += r??;
        }
        let run = timer.stop(o.messages).await?;
        if done != o.messages as u64 {
            return Err(format!("the MariaDB floor loop deleted {done} of {}", o.messages).into());
        }
        Ok::<_, BoxError>(run)
    }
    .await;
    sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {q}, {a}"))
        .execute(pool)
        .await?;
    result
}

// ---------------------------------------------------------------------------------------------
// The peers.

/// pgmq: send MESSAGES payloads, then `workers` loops of read `batch` + delete until empty.
async fn pgmq_run(
    q: &PGMQueueExt,
    pool: &sqlx::PgPool,
    o: &Opts,
    batch: i32,
    workers: usize,
) -> BoxResult<Run> {
    // pgmq limits queue names to 47 characters.
    let name = format!("bench_{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    q.create(&name).await?;
    let result = async {
        for chunk in (0..o.messages)
            .collect::<Vec<_>>()
            .chunks(PEER_ENQUEUE_BATCH)
        {
            let batch: Vec<serde_json::Value> = chunk
                .iter()
                .map(|&n| payload(n, &format!("customer-{}", n % o.keys)))
                .collect();
            q.send_batch(&name, &batch).await?;
        }
        sqlx::query(&format!("ANALYZE pgmq.q_{name}"))
            .execute(pool)
            .await?;
        let timer = Timer::start(Db::Postgres(pool), None).await?;
        let loops = (0..workers).map(|_| {
            let (q, name) = (q.clone(), name.clone());
            tokio::spawn(async move {
                let mut done = 0usize;
                loop {
                    let msgs = q
                        .read_batch::<serde_json::Value>(&name, PGMQ_VT_SECS, batch)
                        .await?;
                    if msgs.is_empty() {
                        return Ok::<_, pgmq::PgmqError>(done);
                    }
                    let ids: Vec<i64> = msgs.iter().map(|m| m.msg_id).collect();
                    done += q.delete_batch(&name, &ids).await?;
                }
            })
        });
        let mut done = 0;
        for r in futures::future::join_all(loops).await {
            done += r??;
        }
        let run = timer.stop(o.messages).await?;
        if done != o.messages {
            return Err(format!("pgmq deleted {done} of {}", o.messages).into());
        }
        Ok::<_, BoxError>(run)
    }
    .await;
    q.drop_queue(&name).await?;
    result
}

/// The peer's payload: the same JSON as this project's messages.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    order: usize,
    customer: String,
    total_cents: usize,
    note: String,
}

impl KafkaKeyExtractable for Order {
    fn kafka_key(&self) -> Vec<u8> {
        self.customer.clone().into_bytes()
    }
}

/// The peer's table, from the migration in the crate cargo downloaded.
fn peer_migration() -> BoxResult<String> {
    let home = std::env::var("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| std::path::Path::new(&h).join(".cargo")))?;
    for index in std::fs::read_dir(home.join("registry/src"))?.flatten() {
        let dir = index.path().join("outbox-postgres-0.3.0/migrations");
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().ends_with("_init.sql") {
                    return Ok(std::fs::read_to_string(e.path())?);
                }
            }
        }
    }
    Err("outbox-postgres 0.3.0's migration not found under $CARGO_HOME/registry/src (build this binary first)".into())
}

/// oxide-outbox into Kafka: PEER_MESSAGES messages through its transactional API, then its
/// processor until it finds nothing.
async fn kafka_peer(pool: &sqlx::PgPool, url: &str, brokers: &str, o: &Opts) -> BoxResult<Run> {
    let n = o.peer_messages;
    let schema = format!("peer_{}", outbox_e2e::unique_suffix());
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(pool)
        .await?;
    let topic = format!("peer-{}", outbox_e2e::unique_suffix());
    let result = async {
        let options = PgConnectOptions::from_str(url)?
            .application_name(APP_NAME)
            .options([("search_path", schema.as_str())]);
        let ppool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        sqlx::raw_sql(&peer_migration()?).execute(&ppool).await?;
        let mut cfg = OutboxConfig::<Order>::default();
        cfg.batch_size = PEER_BATCH;
        let cfg = Arc::new(cfg);
        let service = OutboxService::new(Arc::new(PostgresWriter), cfg.clone());
        for chunk in (0..n).collect::<Vec<_>>().chunks(PEER_ENQUEUE_BATCH) {
            let mut tx = ppool.begin().await?;
            for &i in chunk {
                let order: Order =
                    serde_json::from_value(payload(i, &format!("customer-{}", i % o.keys)))?;
                service
                    .add_event("order.placed", order, None, &mut *tx)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            tx.commit().await?;
        }
        sqlx::query("ANALYZE outbox_events").execute(&ppool).await?;
        kafka::create_topic(brokers, &topic, PARTITIONS).await?;
        let mut client = rdkafka::ClientConfig::new();
        client
            .set("bootstrap.servers", brokers)
            .set("linger.ms", "0");
        let transport = KafkaTransport::new(&topic, &client).map_err(|e| e.to_string())?;
        let processor = OutboxProcessor::new(
            Arc::new(PostgresOutbox::new(ppool.clone(), cfg.clone())),
            Arc::new(transport),
            cfg.clone(),
        );
        let timer = Timer::start(Db::Postgres(&ppool), tansu_pid(brokers)).await?;
        loop {
            let done = processor
                .process_pending_events()
                .await
                .map_err(|e| e.to_string())?;
            if done == 0 {
                break;
            }
        }
        let run = timer.stop(n).await?;
        let (sent,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM outbox_events WHERE status = 'Sent'")
                .fetch_one(&ppool)
                .await?;
        let received = kafka::read_topic(brokers, &topic, PARTITIONS).await?;
        ppool.close().await;
        if sent as usize != n || received.len() < n {
            return Err(
                format!("peer: {sent} sent, {} in the topic, of {n}", received.len()).into(),
            );
        }
        Ok::<_, BoxError>(run)
    }
    .await;
    let _ = kafka::delete_topic(brokers, &topic).await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(pool)
        .await?;
    result
}

// ---------------------------------------------------------------------------------------------
// Tables.

fn print_tables(o: &Opts, r: &Results, load: (Option<f64>, Option<f64>)) {
    let fmt_load = |l: Option<f64>| l.map_or("?".to_owned(), |l| format!("{l:.2}"));
    println!(
        "Side by side, {} round(s), taken in turn; {} UTC; load average (1 min) {} at the start, {} at the end; {} cores.\n",
        o.rounds,
        chrono::Utc::now().format("%Y-%m-%d %H:%M"),
        fmt_load(load.0),
        fmt_load(load.1),
        outbox_bench::cores()
    );
    if o.has("postgres") {
        let best = r
            .starting("pgmq")
            .max_by(|a, b| a.1.rate().total_cmp(&b.1.rate()));
        println!(
            "Postgres store-bound drain, {} messages over {} keys (this project: recording publisher)\n",
            thousands(o.messages as f64),
            thousands(o.keys as f64)
        );
        println!("| drain | settings | msg/s, rounds | median | vs pgmq's best | CPU µs/msg: relay + Postgres | share of cores |");
        println!("|---|---|---|---|---|---|---|");
        for (name, s) in r.starting("postgres").chain(r.starting("pgmq")) {
            let ratio = best.map_or("—".to_owned(), |(_, b)| {
                format!("{:.2}×", s.rate() / b.rate())
            });
            let (cpu, share) = s.cpu(true, false);
            println!(
                "| {name} | {} | {} | **{}** | {ratio} | {cpu} | {share} |",
                s.settings,
                s.rates(),
                thousands(s.rate())
            );
        }
        println!();
    }
    if o.has("kafka") {
        let peer = r.get("oxide-outbox → kafka");
        println!("Postgres → Kafka (Tansu, {PARTITIONS} partitions)\n");
        println!("| drain | messages | settings | msg/s, rounds | median | vs oxide-outbox | CPU µs/msg: relay + Postgres + Tansu | share of cores |");
        println!("|---|---|---|---|---|---|---|---|");
        for (name, s) in r
            .starting("this project → kafka")
            .chain(r.starting("oxide-outbox"))
        {
            let ratio = peer.map_or("—".to_owned(), |p| format!("{:.1}×", s.rate() / p.rate()));
            let (cpu, share) = s.cpu(true, true);
            println!(
                "| {name} | {} | {} | {} | **{}** | {ratio} | {cpu} | {share} |",
                thousands(s.messages as f64),
                s.settings,
                s.rates(),
                thousands(s.rate())
            );
        }
        println!();
    }
    let stores = [
        (
            "sqlite",
            "SQLite (WAL, synchronous=NORMAL)",
            60_000.0,
            false,
        ),
        ("mysql", "MariaDB", 20_000.0, true),
    ];
    if stores.iter().any(|(s, ..)| o.has(s)) {
        println!(
            "Other stores, {} messages over {} keys, recording publisher\n",
            thousands(o.messages as f64),
            thousands(o.keys as f64)
        );
        println!("| store | settings | msg/s, rounds | median | vs target | CPU µs/msg: relay (+ server) | share of cores |");
        println!("|---|---|---|---|---|---|---|");
        for (section, label, target, server) in stores {
            for (name, s) in r.starting(section) {
                let (cpu, share) = s.cpu(server, false);
                // The publish mode's suffix, if any (`delete_published=both`).
                let mode = name.get(section.len()..).unwrap_or_default();
                println!(
                    "| {label}{mode} | {} | {} | **{}** | {:.2}× of {} | {cpu} | {share} |",
                    s.settings,
                    s.rates(),
                    thousands(s.rate()),
                    s.rate() / target,
                    thousands(target)
                );
            }
        }
        println!();
    }
    if o.has("mysql") && r.starting("floor:").next().is_some() {
        // The best floor loop of each kind: deleting, and archiving (pgmq's way of keeping).
        let best = |verb: &str| {
            r.starting("floor:")
                .filter(|(name, _)| name.contains(verb))
                .map(|(_, s)| s.rate())
                .fold(None, |best: Option<f64>, rate| {
                    Some(best.map_or(rate, |b| b.max(rate)))
                })
        };
        let (delete, archive) = (best("+ delete"), best("+ archive"));
        let ratio = |rate: f64, floor: Option<f64>| {
            floor.map_or("—".to_owned(), |f| format!("{:.2}×", rate / f))
        };
        println!("MariaDB against the floor (pgmq's loop on MariaDB), same run\n");
        println!("| drain | settings | msg/s, rounds | median | vs the floor, deleting | vs the floor, archiving | CPU µs/msg: relay + MariaDB | share of cores |");
        println!("|---|---|---|---|---|---|---|---|");
        for (name, s) in r.starting("mysql").chain(r.starting("floor:")) {
            let (cpu, share) = s.cpu(true, false);
            println!(
                "| {name} | {} | {} | **{}** | {} | {} | {cpu} | {share} |",
                s.settings,
                s.rates(),
                thousands(s.rate()),
                ratio(s.rate(), delete),
                ratio(s.rate(), archive),
            );
        }
        println!();
    }
}

#[tokio::main]
async fn main() -> BoxResult<()> {
    let o = Opts::parse()?;
    let pg_url = env_or(
        "OUTBOX_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    );
    let pg = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(PgConnectOptions::from_str(&pg_url)?.application_name(APP_NAME))
        .await
        .map_err(|e| outbox_url::redact_url(&e.to_string()))?;
    let brokers = env_or("OUTBOX_TEST_KAFKA_BROKERS", "127.0.0.1:19092");
    let mysql = if o.has("mysql") {
        let url = env_or("OUTBOX_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
        Some(
            sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(8)
                .connect(&url)
                .await
                .map_err(|e| outbox_url::redact_url(&e.to_string()))?,
        )
    } else {
        None
    };
    let q = if o.has("postgres") {
        let q = PGMQueueExt::new_with_pool(pg.clone()).await;
        q.install_sql_from_embedded().await?;
        Some(q)
    } else {
        None
    };

    let mut r = Results::default();
    // Each store's options in each publish mode, with the series names' suffix.
    let per_store = |store: &str| -> Vec<(String, Opts)> {
        o.modes()
            .into_iter()
            .map(|(suffix, m)| (suffix.to_owned(), m.for_store(store)))
            .collect()
    };
    // Postgres also in each table shape asked for (`partitioned=`).
    let pg_shapes = |modes: Vec<(String, Opts)>| -> Vec<(String, Opts)> {
        let mut out = Vec::new();
        for (suffix, m) in modes {
            for &parted in &o.partitioned {
                for &cursor in &o.cursor_claims {
                    if parted && cursor == Some(true) {
                        continue;
                    }
                    let mut m = m.clone();
                    m.partitioned = vec![parted];
                    m.cursor_claims = vec![cursor];
                    let shape = if parted && o.partitioned.len() > 1 {
                        ", partitioned"
                    } else if cursor == Some(true) && o.cursor_claims.len() > 1 {
                        ", cursor claims"
                    } else {
                        ""
                    };
                    out.push((format!("{suffix}{shape}"), m));
                }
            }
        }
        out
    };
    // MariaDB also in each table layout asked for (`unpublished_table=`).
    let mysql_layouts = |modes: Vec<(String, Opts)>| -> Vec<(String, Opts)> {
        let mut out = Vec::new();
        for (suffix, m) in modes {
            for &layout in &o.unpublished_table {
                let mut m = m.clone();
                m.unpublished_table = vec![layout];
                let shape = if layout == Some(true) && o.unpublished_table.len() > 1 {
                    ", unpublished table"
                } else {
                    ""
                };
                out.push((format!("{suffix}{shape}"), m));
            }
        }
        out
    };
    let (pg_o, sqlite_o, mysql_o) = (
        pg_shapes(per_store("postgres")),
        per_store("sqlite"),
        mysql_layouts(per_store("mysql")),
    );
    let load_start = load_average();
    for round in 1..=o.rounds {
        eprintln!("round {round} of {}", o.rounds);
        if let Some(q) = &q {
            for (suffix, pg_o) in &pg_o {
                r.add(
                    &format!("postgres (this project){suffix}"),
                    &pg_o.postgres_settings(),
                    o.messages,
                    postgres_ours(&pg, pg_o).await?,
                );
            }
            for &(batch, workers) in &o.pgmq {
                let name = format!("pgmq, read {batch} + delete, {workers} worker(s)");
                r.add(
                    &name,
                    "no order, no fencing",
                    o.messages,
                    pgmq_run(q, &pg, &o, batch, workers).await?,
                );
            }
        }
        if o.has("kafka") {
            for (suffix, pg_o) in &pg_o {
                let mut settings = format!("{}, idempotent, acks=all", pg_o.postgres_settings());
                for (k, v) in &o.kafka_props {
                    settings.push_str(&format!(", {k}={v}"));
                }
                r.add(
                    &format!("this project → kafka{suffix}"),
                    &settings,
                    o.messages,
                    kafka_ours(&pg, &brokers, pg_o).await?,
                );
            }
            if o.peer {
                r.add(
                    "oxide-outbox → kafka",
                    &format!("batch {PEER_BATCH}, linger.ms=0, idempotent"),
                    o.peer_messages,
                    kafka_peer(&pg, &pg_url, &brokers, &o).await?,
                );
            }
        }
        if o.has("sqlite") {
            for (suffix, sqlite_o) in &sqlite_o {
                r.add(
                    &format!("sqlite{suffix}"),
                    &sqlite_o.relay_settings(),
                    o.messages,
                    sqlite_ours(sqlite_o).await?,
                );
            }
        }
        if let Some(mysql) = &mysql {
            for (suffix, mysql_o) in &mysql_o {
                r.add(
                    &format!("mysql{suffix}"),
                    &mysql_o.relay_settings(),
                    o.messages,
                    mysql_ours(mysql, mysql_o).await?,
                );
            }
            for &(batch, workers) in &o.mysql_floor {
                for archive in [false, true] {
                    let verb = if archive { "archive" } else { "delete" };
                    r.add(
                        &format!("floor: pgmq's loop on MariaDB, read {batch} + {verb}, {workers} worker(s)"),
                        "no order, no fencing",
                        o.messages,
                        mysql_floor(mysql, &o, batch, workers, archive).await?,
                    );
                }
            }
        }
    }
    print_tables(&o, &r, (load_start, load_average()));
    Ok(())
}
