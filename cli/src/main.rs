//! `outbox-relay`: the outbox relay as a program, and the operator's commands.
//!
//! ```text
//! outbox-relay --store postgres://app@db/app run --broker 'nats://nats:4222?subject=orders.{event_type}&stream=ORDERS'
//! outbox-relay --config /etc/outbox-relay.toml status
//! outbox-relay dead list --key order-42
//! ```
//!
//! Every setting is a flag, an environment variable (`OUTBOX_STORE_URL`, `OUTBOX_BROKER_URL`,
//! ...) or a key of a TOML file (`--config`, `OUTBOX_CONFIG`), in that order of precedence, and
//! flags are accepted before or after the subcommand; `outbox-relay config` prints the
//! effective settings with secrets masked. `run` relays until SIGTERM or Ctrl-C, then shuts
//! down gracefully; `drain` relays until nothing is left to claim and exits. With
//! `--metrics-addr`, both serve `/metrics`, `/health/live` and `/health/ready`. Logs (text or
//! JSON, target `outbox_relay_cli` for this program) and the relay's closing stats go to
//! standard error, out of the way of a `stdout://` broker's messages; command results go to
//! standard output. Exit status: 0 on success, 1 when a command fails, 2 for bad arguments.

mod http;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
mod inbox;
mod multi;
mod ops;
#[cfg(feature = "otel")]
mod otel;
mod progress;
mod secrets;
mod settings;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use outbox::relay::metric_names::HISTOGRAM_BUCKETS;
use outbox::relay::Relay;
use outbox::{redact_url, Error, OutboxAdmin, Publisher};
use serde_json::json;
use uuid::Uuid;

use settings::{Effective, LogFormat, SettingsArgs};

/// The tracing target of this program's own logs (the engine logs under `outbox_engine`).
pub const TARGET: &str = "outbox_relay_cli";

/// The outbox relay: publishes committed outbox messages to a broker, and manages the outbox.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    settings: SettingsArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay until SIGTERM or Ctrl-C, then finish in-flight batches and exit.
    Run {
        /// Create the outbox table first if it does not exist.
        #[arg(long)]
        migrate: bool,
    },
    /// Relay until nothing is left that this relay could claim, then exit: no message due and
    /// none leased by any relay. Messages other relays hold are waited for until they are
    /// published, or their lease ends and this drain claims them, so several drains started
    /// at once on one backlog share it and all exit 0 once it is done. Messages waiting for a
    /// retry or a not-before time, and keys blocked by a dead message, are not waited for: once
    /// only such messages are left (the pending count unchanged and nothing leased for a
    /// second), the drain exits. SIGTERM or Ctrl-C stops it early, gracefully. With
    /// `[[outbox]]` tables, every outbox is drained at once; one that fails fails alone, and
    /// the command then exits 1 naming it.
    Drain {
        /// Create the outbox table first if it does not exist.
        #[arg(long)]
        migrate: bool,
    },
    /// Create the outbox table and indexes if they do not exist.
    Migrate,
    /// Convert an outbox table made by an earlier release to the layout new tables get when
    /// published rows are kept (Postgres: cursor claims; MariaDB: an unpublished table), in
    /// which completing a message changes no index of its row. Stop the table's relays first:
    /// it refuses while messages are leased. Writers may go on writing. Prints whether it
    /// converted the table; running it again does nothing.
    ConvertLayout,
    /// Print how many messages are pending, leased, published and dead (one JSON line).
    Counts {
        /// JSON (the only format; accepted for symmetry with the other commands).
        #[arg(long)]
        json: bool,
    },
    /// Pending, leased and dead messages, the oldest pending age, blocked keys with their head
    /// message, and the last minute's throughput.
    Status {
        /// One JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Most blocked keys to list.
        #[arg(long, default_value_t = 20)]
        keys: usize,
    },
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
    /// The consumers' inbox in the store's database (migrate, purge, status) and a consumer's
    /// dead letters on its broker (dead-letters).
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    #[command(subcommand)]
    Inbox(inbox::InboxCommand),
    /// Print the effective configuration (flags > environment > file > defaults) as TOML,
    /// secrets masked.
    Config,
    /// Print a shell completion script: `outbox-relay completions bash > /etc/bash_completion.d/outbox-relay`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// Which dead messages a bulk command takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Select {
    /// Message ids.
    pub ids: Vec<Uuid>,
    /// Dead messages by `seq` (repeatable): also works for a quarantined row whose id is not a
    /// UUID (`dead list` shows every row's seq).
    #[arg(long = "seq", value_name = "SEQ")]
    pub seqs: Vec<i64>,
    /// Every dead message of this partition key.
    #[arg(long)]
    pub key: Option<String>,
    /// Every dead message of this event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Every dead message.
    #[arg(long)]
    pub all: bool,
    /// Do not ask for confirmation of a bulk change (required off a terminal).
    #[arg(long, short = 'y')]
    pub yes: bool,
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// Print dead messages, oldest first, as a table (or JSON lines with --json).
    List {
        /// Only messages after this seq (for paging).
        #[arg(long)]
        after: Option<i64>,
        /// Most messages to print (at least 1).
        #[arg(long, default_value_t = 100, value_parser = positive_usize)]
        limit: usize,
        /// Only messages of this partition key.
        #[arg(long)]
        key: Option<String>,
        /// Only messages of this event type.
        #[arg(long)]
        event_type: Option<String>,
        /// One JSON object per line instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Make dead messages pending again, with their attempts reset: by id, `--seq`, `--key`,
    /// `--event-type` or `--all`. A row dead-lettered because it did not decode is requeued
    /// only once it does (fix it with SQL first; the error says what is wrong); `--key`,
    /// `--event-type` and `--all` requeue the others and fail naming the rows left dead.
    Requeue(Select),
    /// Delete dead messages: by id, `--seq`, `--key`, `--event-type` or `--all`.
    Discard(Select),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let effective = match cli.settings.resolve() {
        Ok(effective) => effective,
        Err(e) => {
            eprintln!("outbox-relay: {}", redact_url(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    init_logs(&effective);
    match execute(cli.command, effective).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Errors of this crate's stores and brokers never carry a password; the redaction is
            // for text that came from elsewhere (e.g. a driver's message quoting the URL).
            eprintln!("outbox-relay: {}", redact_url(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

fn init_logs(effective: &Effective) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_new(&effective.log).unwrap_or_else(|e| {
        eprintln!(
            "outbox-relay: log filter {:?} is not valid ({e}); using {:?}",
            effective.log,
            settings::DEFAULT_LOG
        );
        tracing_subscriber::EnvFilter::new(settings::DEFAULT_LOG)
    });
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    // `try_init` also routes the `log` records of sqlx and rdkafka through tracing.
    let _ = match effective.log_format {
        // Colours only on a terminal: not in log files, journald or container logs.
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
    };
}

async fn execute(command: Command, effective: Effective) -> Result<(), Error> {
    // `[[outbox]]` tables in the configuration file: `run`, `drain` and `status` serve them
    // all.
    if !effective.outboxes.is_empty() {
        match command {
            Command::Run { migrate } => {
                return multi::run(&effective, migrate, Stop::listen().requested()).await
            }
            Command::Drain { migrate } => {
                return multi::drain(&effective, migrate, Stop::listen().requested()).await
            }
            Command::Status { json, .. } => return multi::status(&effective, json).await,
            Command::Config => {
                print!("{}", effective.to_masked_toml()?);
                print!("{}", multi::masked_tables(&effective.outboxes));
                return Ok(());
            }
            Command::Completions { .. } => {}
            _ if effective.store.is_some() => {}
            _ => {
                return Err(Error::invalid_input(
                    "the configuration has [[outbox]] tables, which `run`, `drain`, `status` \
                     and `config` serve; this command works on one outbox: give its --store (and \
                     --schema, --table)",
                ))
            }
        }
    }
    let serve = match command {
        Command::Run { migrate } => (true, migrate),
        Command::Drain { migrate } => (false, migrate),
        Command::Config => {
            print!("{}", effective.to_masked_toml()?);
            return Ok(());
        }
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "outbox-relay",
                &mut std::io::stdout(),
            );
            return Ok(());
        }
        #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
        Command::Inbox(command) => return inbox::execute(effective.store(), command).await,
        command => return admin(&effective, command).await,
    };
    relay(&effective, serve).await
}

/// The exporter, with the relay's histograms given their buckets.
fn metrics_recorder() -> Result<PrometheusHandle, Error> {
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in HISTOGRAM_BUCKETS {
        builder = builder
            .set_buckets_for_metric(Matcher::Full((*name).to_owned()), buckets)
            .map_err(|e| Error::invalid_input(format!("metric buckets of {name}: {e}")))?;
    }
    builder
        .install_recorder()
        .map_err(|e| Error::invalid_input(format!("cannot install the metrics recorder: {e}")))
}

async fn relay(effective: &Effective, (serve, migrate): (bool, bool)) -> Result<(), Error> {
    // Listen before connecting to anything (see `Stop`).
    let stop = Stop::listen();
    // The relay settings, then the broker, are checked before the store is opened (which for
    // SQLite creates the file).
    let store_url = effective.store()?;
    let broker_url = effective.broker()?;
    effective.check_relay()?;
    let publisher: Arc<dyn Publisher> = Arc::from(outbox::broker::connect(broker_url).await?);
    let opened = outbox::store::open(store_url, &effective.options).await?;
    if migrate {
        opened.migrate().await?;
    }
    let mut tasks = Vec::new();
    if let Some(addr) = effective.metrics_addr {
        let handle = metrics_recorder()?;
        let heartbeat = http::Heartbeat::new(effective.gauges_every * 3 + effective.ready_timeout);
        heartbeat.beat();
        let probe = http::Probe {
            ready: http::Ready::One {
                admin: opened.admin.clone(),
                publisher: publisher.clone(),
            },
            timeout: effective.ready_timeout,
            metrics: handle,
            heartbeat,
        };
        tasks.push(http::serve(addr, probe.clone()).await?);
        tasks.push(tokio::spawn(gauges(probe, effective.gauges_every)));
    }
    #[cfg(feature = "otel")]
    let exporter = match &effective.otel {
        Some(settings) => Some(otel::install(settings).await?),
        None => None,
    };
    #[cfg(not(feature = "otel"))]
    if effective.otel.is_some() {
        return Err(Error::invalid_input(
            "trace export is configured ([otel] or OTEL_EXPORTER_OTLP_*), but this build has no \
             exporter: build outbox-cli with its `otel` feature",
        ));
    }
    // Registers the metrics' descriptions with the exporter installed above.
    let mut relay = Relay::new(
        opened.store.clone(),
        publisher.clone(),
        effective.relay()?.clone(),
    )?;
    if let Some(groups) = opened.group_store() {
        relay = relay.with_group_store(groups);
    }
    #[cfg(feature = "otel")]
    let relay = match &exporter {
        Some(_) => otel::traced(relay, publisher.name(), broker_url),
        None => relay,
    };
    let tuning = relay.tuning();
    tracing::info!(
        target: TARGET,
        store = opened.name(),
        broker = %settings::mask_url(broker_url),
        mode = if serve { "run" } else { "drain" },
        batch_size = tuning.batch_size,
        batch_size_from = tuning.batch_size_chosen.as_str(),
        claim_shards = tuning.claim_shards,
        claim_shards_from = tuning.claim_shards_chosen.as_str(),
        "relay started"
    );
    let purge_age = effective.purge_older_than;
    // The store's backlog before the relay starts: `drain`'s progress is measured against it,
    // and rows a claim dead-letters because they do not decode never reach the relay's
    // counters (see `ops::count_quarantined`). The backlog query, not the status: it reads no
    // lease, retry time or key, and costs a fraction of the status on a long backlog.
    let start = opened.admin.backlog().await.ok();
    let stats = if serve {
        if let Some(age) = purge_age {
            let mut tick = tokio::time::interval(effective.purge_every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let admin = opened.admin.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    tick.tick().await;
                    match ops::purge_all(admin.as_ref(), age, PURGE_BATCH, None).await {
                        Ok(0) => {}
                        Ok(n) => {
                            tracing::info!(target: TARGET, purged = n, "purged published messages")
                        }
                        Err(e) => tracing::warn!(
                            target: TARGET,
                            error = %e,
                            "purge failed; retrying at the next interval"
                        ),
                    }
                }
            }));
        }
        relay.run(stop.requested()).await
    } else {
        let (done, finished) = tokio::sync::oneshot::channel();
        // The backlog is read before the relay starts: read beside it, a short drain could be
        // over first and report "0 of 0". No status, no progress lines; the drain still runs.
        let backlog = start.map(|b| b.unfinished);
        let opened_admin = opened.admin.clone();
        let watch = tokio::spawn(async move {
            if let Some(backlog) = backlog {
                ops::drain_progress(opened_admin, backlog, finished).await;
            }
        });
        // Waits for what other relays hold (see `Command::Drain`).
        let stats = relay
            .run_until_drained_or(opened.admin.as_ref(), stop.requested())
            .await;
        let _ = done.send(());
        let _ = watch.await;
        stats
    };
    for task in &tasks {
        task.abort();
    }
    #[cfg(feature = "otel")]
    if let Some(exporter) = exporter {
        exporter.shutdown().await;
    }
    let mut stats = stats?;
    if let Some(start) = &start {
        ops::count_quarantined(opened.admin.as_ref(), start, &mut stats).await;
    }
    // One pass after draining; a failure fails the command (a job runner then sees it).
    if let (false, Some(age)) = (serve, purge_age) {
        let n = ops::purge_all(opened.admin.as_ref(), age, PURGE_BATCH, None).await?;
        tracing::info!(target: TARGET, purged = n, "purged published messages");
    }
    // A summary, on standard error: standard output may be carrying the messages themselves
    // (stdout://).
    eprintln!("{}", json!(stats));
    Ok(())
}

/// Refresh the store gauges and the up gauges, and beat the heartbeat, every `every`.
async fn gauges(probe: http::Probe, every: Duration) {
    let http::Ready::One { admin, publisher } = probe.ready.clone() else {
        return;
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        probe.heartbeat.beat();
        probe.metrics.run_upkeep();
        let status = tokio::time::timeout(probe.timeout * 5, admin.status(0)).await;
        let store_up = match status {
            Ok(Ok(status)) => {
                outbox::relay::record_status(&status);
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(target: TARGET, error = %redact_url(&e.to_string()), "store status query failed");
                false
            }
            Err(_) => {
                tracing::warn!(target: TARGET, "store status query timed out");
                false
            }
        };
        let broker_up = matches!(
            tokio::time::timeout(probe.timeout, publisher.check()).await,
            Ok(Ok(()))
        );
        outbox::relay::record_up(broker_up, store_up);
    }
}

/// The operator's commands.
async fn admin(effective: &Effective, command: Command) -> Result<(), Error> {
    let opened = outbox::store::open(effective.store()?, &effective.options).await?;
    let admin: &dyn OutboxAdmin = opened.admin.as_ref();
    match command {
        Command::Migrate => {
            opened.migrate().await?;
            ops::print(&json!({"migrated": opened.name()}));
            Ok(())
        }
        Command::ConvertLayout => {
            let converted = opened.convert_layout().await?;
            ops::print(&json!({"backend": opened.name(), "converted": converted}));
            Ok(())
        }
        Command::Counts { json: _ } => {
            let counts = admin.counts().await?;
            ops::print(&json!(counts));
            Ok(())
        }
        Command::Status { json, keys } => {
            let group = effective.relay()?.group();
            ops::status(admin, json, keys, group.zip(opened.group_store())).await
        }
        Command::Dead(DeadCommand::List {
            after,
            limit,
            key,
            event_type,
            json,
        }) => ops::dead_list(admin, after, limit, key, event_type, json).await,
        Command::Dead(DeadCommand::Requeue(select)) => {
            ops::dead_bulk(admin, &select, ops::Bulk::Requeue).await
        }
        Command::Dead(DeadCommand::Discard(select)) => {
            ops::dead_bulk(admin, &select, ops::Bulk::Discard).await
        }
        Command::Purge { older_than, batch } => {
            let mut progress = progress::Progress::new("purged", None);
            let purged = ops::purge_all(admin, older_than, batch, Some(&mut progress)).await?;
            progress.finish();
            ops::print(&json!({"purged": purged}));
            Ok(())
        }
        #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
        Command::Inbox(_) => Ok(()),
        Command::Run { .. }
        | Command::Drain { .. }
        | Command::Config
        | Command::Completions { .. } => Ok(()),
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
                    tracing::warn!(target: TARGET, error = %e, "cannot listen for {name}");
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
        tracing::info!(target: TARGET, "stop requested: finishing in-flight batches");
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
pub(crate) const PURGE_BATCH: usize = 1000;
