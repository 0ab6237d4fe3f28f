//! `outbox-relay`: the outbox relay as a program, and the operator's commands.
//!
//! ```text
//! outbox-relay --store postgres://app@db/app run --broker 'nats://nats:4222?subject=orders.{event_type}&stream=ORDERS'
//! outbox-relay --store postgres://app@db/app counts
//! outbox-relay --store postgres://app@db/app dead list
//! ```
//!
//! The store and the broker are URLs (`OUTBOX_STORE_URL`, `OUTBOX_BROKER_URL`), so moving from
//! one broker to another is a change of configuration. `run` relays until SIGTERM or Ctrl-C,
//! then shuts down gracefully; `drain` relays until nothing is left to claim and exits. Logs and
//! the relay's closing stats (one JSON line) go to standard error (`RUST_LOG`, default `info`),
//! out of the way of a `stdout://` broker's messages; the other commands print their results
//! (counts, dead letters) to standard output as JSON lines. Exit status: 0 on success, 1 when a command fails, 2 for bad
//! arguments.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use metrics_exporter_prometheus::PrometheusBuilder;
use outbox::relay::{Relay, RelayConfig};
use outbox::store::StoreOptions;
use outbox::{redact_url, Error, HeadPolicy, OutboxAdmin};
use serde_json::{json, Value};
use std::sync::Arc;
use uuid::Uuid;

/// The outbox relay: publishes committed outbox messages to a broker, and manages the outbox.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, long_about = None)]
struct Cli {
    /// The outbox database: postgres://, mysql:// (or mariadb://) or sqlite:// URL.
    #[arg(long, env = "OUTBOX_STORE_URL", hide_env_values = true)]
    store: String,
    /// The outbox table (default: outbox).
    #[arg(long, env = "OUTBOX_TABLE")]
    table: Option<String>,
    /// The Postgres schema of the table (default: public).
    #[arg(long, env = "OUTBOX_SCHEMA")]
    schema: Option<String>,
    /// Delete messages once published instead of marking them published.
    #[arg(long, env = "OUTBOX_DELETE_PUBLISHED", value_parser = clap::builder::BoolishValueParser::new())]
    delete_published: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay until SIGTERM or Ctrl-C, then finish in-flight batches and exit.
    Run(RelayArgs),
    /// Relay until nothing is left to claim (messages waiting for a retry are not waited for);
    /// SIGTERM or Ctrl-C stops it early, gracefully.
    Drain(RelayArgs),
    /// Create the outbox table and indexes if they do not exist.
    Migrate,
    /// Print how many messages are pending, leased, published and dead.
    Counts,
    /// List, requeue or discard dead-lettered messages.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Delete published messages older than a given age, in bounded batches.
    Purge {
        /// Age of the published messages to delete, e.g. 7d, 12h.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Duration,
        /// Messages per delete statement (at least 1).
        #[arg(long, default_value_t = 1000, value_parser = positive_usize)]
        batch: usize,
    },
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// Print dead messages, oldest first, one JSON object per line.
    List {
        /// Only messages after this seq (for paging).
        #[arg(long)]
        after: Option<i64>,
        /// Most messages to print (at least 1).
        #[arg(long, default_value_t = 100, value_parser = positive_usize)]
        limit: usize,
    },
    /// Make dead messages pending again, with their attempts reset.
    Requeue {
        /// Message ids.
        #[arg(required = true)]
        ids: Vec<Uuid>,
    },
    /// Delete dead messages.
    Discard {
        /// Message ids.
        #[arg(required = true)]
        ids: Vec<Uuid>,
    },
}

/// What a dead head message does to its key's later messages.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Head {
    /// Later messages of the key wait until the dead one is requeued or discarded.
    Block,
    /// Later messages of the key go on.
    Skip,
}

#[derive(Debug, Args)]
struct RelayArgs {
    /// The broker: stdout://, nats://, kafka:// or redis:// URL with its options.
    #[arg(long, env = "OUTBOX_BROKER_URL", hide_env_values = true)]
    broker: String,
    /// Create the outbox table first if it does not exist.
    #[arg(long)]
    migrate: bool,
    /// Most messages per claim and publish.
    #[arg(long, env = "OUTBOX_BATCH_SIZE")]
    batch_size: Option<usize>,
    /// Batches in flight at once.
    #[arg(long, env = "OUTBOX_CONCURRENCY")]
    concurrency: Option<usize>,
    /// How long a claim is held before another relay may take it over, e.g. 30s.
    #[arg(long, env = "OUTBOX_LEASE", value_parser = humantime::parse_duration)]
    lease: Option<Duration>,
    /// Attempts after which a failing message is dead-lettered.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS")]
    max_attempts: Option<u32>,
    /// What a dead message does to the later messages of its key.
    #[arg(long, env = "OUTBOX_HEAD_POLICY", value_enum)]
    head_policy: Option<Head>,
    /// Longest wait between claims when idle, e.g. 1s.
    #[arg(long, env = "OUTBOX_POLL_MAX", value_parser = humantime::parse_duration)]
    poll_max: Option<Duration>,
    /// How long a stop waits for in-flight batches, e.g. 10s.
    #[arg(long, env = "OUTBOX_SHUTDOWN_DEADLINE", value_parser = humantime::parse_duration)]
    shutdown_deadline: Option<Duration>,
    /// Serve the relay's metrics for Prometheus on this address (any path), e.g. 0.0.0.0:9000.
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Delete published messages older than this (e.g. 7d): in `run` at start and then every
    /// `--purge-every`, in `drain` once after draining. Off by default.
    #[arg(long, env = "OUTBOX_PURGE_OLDER_THAN", value_parser = humantime::parse_duration)]
    purge_older_than: Option<Duration>,
    /// How often `run` purges (with `--purge-older-than`).
    #[arg(long, env = "OUTBOX_PURGE_EVERY", default_value = "1m",
          value_parser = humantime::parse_duration)]
    purge_every: Duration,
}

impl RelayArgs {
    fn config(&self) -> Result<RelayConfig, Error> {
        let defaults = RelayConfig::default();
        let config = RelayConfig {
            batch_size: self.batch_size.unwrap_or(defaults.batch_size),
            concurrency: self.concurrency.unwrap_or(defaults.concurrency),
            lease: self.lease.unwrap_or(defaults.lease),
            max_attempts: self.max_attempts.unwrap_or(defaults.max_attempts),
            head_policy: match self.head_policy {
                Some(Head::Block) => HeadPolicy::Block,
                Some(Head::Skip) => HeadPolicy::Skip,
                None => defaults.head_policy,
            },
            poll_max: self.poll_max.unwrap_or(defaults.poll_max),
            shutdown_deadline: self.shutdown_deadline.unwrap_or(defaults.shutdown_deadline),
            ..defaults
        };
        config.validate()?;
        if self.purge_every.is_zero() {
            return Err(Error::invalid_input(
                "--purge-every is 0; it must be a positive interval (default 1m)",
            ));
        }
        Ok(config)
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours only on a terminal: not in log files, journald or container logs.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match execute(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Errors of this crate's stores and brokers never carry a password; the redaction is
            // for text that came from elsewhere (e.g. a driver's message quoting the URL).
            eprintln!("outbox-relay: {}", redact_url(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

async fn execute(cli: Cli) -> Result<(), Error> {
    let options = StoreOptions {
        table: cli.table.clone(),
        schema: cli.schema.clone(),
        delete_published: cli.delete_published,
    };
    let (args, serve) = match cli.command {
        Command::Run(args) => (args, true),
        Command::Drain(args) => (args, false),
        command => return admin(&cli.store, &options, command).await,
    };
    // Listen before connecting to anything (see `Stop`).
    let stop = Stop::listen();
    // The relay settings, then the broker, are checked before the store is opened (which for
    // SQLite creates the file).
    let config = args.config()?;
    let publisher = outbox::broker::connect(&args.broker).await?;
    let opened = outbox::store::open(&cli.store, &options).await?;
    if args.migrate {
        opened.migrate().await?;
    }
    if let Some(addr) = args.metrics_addr {
        PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| Error::invalid_input(format!("cannot serve metrics on {addr}: {e}")))?;
    }
    // Registers the metrics' descriptions with the exporter installed above.
    let relay = Relay::new(opened.store.clone(), Arc::from(publisher), config)?;
    tracing::info!(
        store = opened.name(),
        broker = %redact_url(&args.broker),
        mode = if serve { "run" } else { "drain" },
        "relay started"
    );
    let stats = if serve {
        let purger = args.purge_older_than.map(|age| {
            let mut tick = tokio::time::interval(args.purge_every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let admin = opened.admin.clone();
            tokio::spawn(async move {
                loop {
                    tick.tick().await;
                    match purge_all(admin.as_ref(), age, PURGE_BATCH).await {
                        Ok(0) => {}
                        Ok(n) => tracing::info!(purged = n, "purged published messages"),
                        Err(e) => tracing::warn!(
                            error = %e,
                            "purge failed; retrying at the next interval"
                        ),
                    }
                }
            })
        });
        let stats = relay.run(stop.requested()).await;
        if let Some(purger) = purger {
            purger.abort();
        }
        stats?
    } else {
        let stats = relay.run_until_idle_or(stop.requested()).await?;
        // One pass; a failure fails the command (a job runner then sees it).
        if let Some(age) = args.purge_older_than {
            let n = purge_all(opened.admin.as_ref(), age, PURGE_BATCH).await?;
            tracing::info!(purged = n, "purged published messages");
        }
        stats
    };
    // A summary, on standard error: standard output may be carrying the messages themselves
    // (stdout://).
    eprintln!("{}", json!(stats));
    Ok(())
}

/// The operator's commands.
async fn admin(store: &str, options: &StoreOptions, command: Command) -> Result<(), Error> {
    let opened = outbox::store::open(store, options).await?;
    match command {
        Command::Run(_) | Command::Drain(_) => Ok(()),
        Command::Migrate => {
            opened.migrate().await?;
            print(&json!({"migrated": opened.name()}));
            Ok(())
        }
        Command::Counts => {
            let counts = opened.admin.counts().await?;
            print(&json!(counts));
            Ok(())
        }
        Command::Dead(DeadCommand::List { after, limit }) => {
            for dead in opened.admin.list_dead(after, limit).await? {
                let mut line = json!(dead.message);
                // The payload is JSON text: print it as JSON, not as a quoted string.
                if let Ok(payload) = serde_json::from_str::<Value>(&dead.message.payload) {
                    line["payload"] = payload;
                }
                line["last_error"] = json!(dead.last_error);
                print(&line);
            }
            Ok(())
        }
        Command::Dead(DeadCommand::Requeue { ids }) => {
            let n = opened.admin.requeue(&ids).await?;
            print(&json!({"requeued": n}));
            Ok(())
        }
        Command::Dead(DeadCommand::Discard { ids }) => {
            let n = opened.admin.discard(&ids).await?;
            print(&json!({"discarded": n}));
            Ok(())
        }
        Command::Purge { older_than, batch } => {
            let purged = purge_all(opened.admin.as_ref(), older_than, batch).await?;
            print(&json!({"purged": purged}));
            Ok(())
        }
    }
}

/// The stop request of `run` and `drain`: SIGTERM (what service managers, job runners and
/// Kubernetes send) or Ctrl-C.
///
/// Listening starts when this is made, at start-up: a stop that arrives while the relay is
/// still connecting is kept, and the relay then stops as soon as it runs, instead of the
/// process dying from the signal's default action.
struct Stop {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl Stop {
    fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let listen = |kind: SignalKind, name: &str| match signal(kind) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for {name}");
                    None
                }
            };
            Self {
                term: listen(SignalKind::terminate(), "SIGTERM"),
                int: listen(SignalKind::interrupt(), "SIGINT"),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// Resolves at the first stop request.
    async fn requested(self) {
        #[cfg(unix)]
        {
            async fn next(signal: Option<tokio::signal::unix::Signal>) {
                match signal {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            tokio::select! {
                () = next(self.term) => {}
                () = next(self.int) => {}
            }
        }
        #[cfg(not(unix))]
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
        tracing::info!("stop requested: finishing in-flight batches");
    }
}

/// A count that must be at least 1 (`purge --batch 0` would never finish, `dead list
/// --limit 0` would print nothing).
fn positive_usize(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1, not 0".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}; expected a whole number of at least 1")),
    }
}

/// Messages per delete statement of the relay's own purges.
const PURGE_BATCH: usize = 1000;

/// Delete published messages older than `age`, `batch` per statement, until none is left.
async fn purge_all(admin: &dyn OutboxAdmin, age: Duration, batch: usize) -> Result<u64, Error> {
    let mut purged = 0;
    loop {
        let n = admin.purge_published(age, batch).await?;
        purged += n;
        if n < u64::try_from(batch).unwrap_or(u64::MAX) {
            return Ok(purged);
        }
    }
}

fn print(value: &Value) {
    println!("{value}");
}
