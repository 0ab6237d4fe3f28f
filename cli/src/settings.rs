//! Every setting of the program, from four sources: flags > environment > configuration file >
//! defaults.
//!
//! Flags and environment variables are read by clap into [`SettingsArgs`] (a flag wins over its
//! variable); what they leave unset is taken from the TOML file (`--config` / `OUTBOX_CONFIG`),
//! then from the defaults. [`Effective`] is the result, which `outbox-relay config` prints with
//! its secrets masked.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use outbox::relay::{Chosen, RelayConfig};
use outbox::store::StoreOptions;

use crate::secrets::pick;
use outbox::{Capabilities, Error, HeadPolicy};
use serde::{Deserialize, Serialize};

/// What a dead head message does to its key's later messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Head {
    /// Later messages of the key wait until the dead one is requeued or discarded.
    Block,
    /// Later messages of the key go on.
    Skip,
}

/// The format of the log lines on standard error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (timestamp, level, target, fields).
    Json,
}

/// The settings as flags and environment variables. Every one is global: accepted before or
/// after the subcommand.
#[derive(Debug, Default, Clone, Args)]
pub struct SettingsArgs {
    /// A TOML file holding any of these settings (keys as the flags, with `_`: `batch_size`).
    #[arg(long, env = "OUTBOX_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// The outbox database: postgres://, mysql:// (or mariadb://) or sqlite:// URL.
    #[arg(long, env = "OUTBOX_STORE_URL", hide_env_values = true, global = true)]
    pub store: Option<String>,
    /// Read the store URL from this file (a mounted secret) instead of --store.
    #[arg(
        long,
        env = "OUTBOX_STORE_URL_FILE",
        value_name = "PATH",
        global = true
    )]
    pub store_file: Option<PathBuf>,
    /// The outbox table (default: outbox).
    #[arg(long, env = "OUTBOX_TABLE", global = true)]
    pub table: Option<String>,
    /// The Postgres schema of the table (default: public).
    #[arg(long, env = "OUTBOX_SCHEMA", global = true)]
    pub schema: Option<String>,
    /// Delete messages once published instead of marking them published
    /// (`--delete-published`, or `--delete-published=false` over a file's `true`).
    #[arg(long, env = "OUTBOX_DELETE_PUBLISHED", global = true, num_args = 0..=1,
          require_equals = true, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub delete_published: Option<bool>,
    /// The broker: stdout://, nats://, kafka:// or redis:// URL with its options.
    #[arg(long, env = "OUTBOX_BROKER_URL", hide_env_values = true, global = true)]
    pub broker: Option<String>,
    /// Read the broker URL from this file (a mounted secret) instead of --broker.
    #[arg(
        long,
        env = "OUTBOX_BROKER_URL_FILE",
        value_name = "PATH",
        global = true
    )]
    pub broker_file: Option<PathBuf>,
    /// Most messages per claim and publish (default: the store's choice, 2000 on Postgres, 500
    /// elsewhere; on MariaDB, 1000 with `--concurrency 1` drains faster, see the README's
    /// "Speed"). `outbox-relay config` shows the value in effect.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", global = true)]
    pub batch_size: Option<usize>,
    /// Batches in flight at once (default 2).
    #[arg(long, env = "OUTBOX_CONCURRENCY", global = true)]
    pub concurrency: Option<usize>,
    /// Claims that may run at once, each over its own share of the partition keys (default: the
    /// store's choice, 2 on Postgres and MariaDB, see the README's "Speed"; SQLite cannot split
    /// its keys and runs one claim at a time whatever this says, with a warning when more are
    /// asked for). `outbox-relay config` shows the value in effect.
    #[arg(long, env = "OUTBOX_CLAIM_SHARDS", global = true)]
    pub claim_shards: Option<usize>,
    /// Join this relay group: replicas of the relay on one outbox that name the same group
    /// divide its claim shards between them instead of all claiming every shard (Postgres;
    /// MariaDB and SQLite run as without a group, with a warning). Only `run` joins.
    #[arg(long, env = "OUTBOX_GROUP", global = true)]
    pub group: Option<String>,
    /// How long a group member's shard leases last, e.g. 10s (default): a replica that dies or
    /// freezes has its shards taken over within about this long.
    #[arg(long, env = "OUTBOX_GROUP_LEASE", global = true,
          value_parser = humantime::parse_duration)]
    pub group_lease: Option<Duration>,
    /// How long a claim is held before another relay may take it over, e.g. 30s.
    #[arg(long, env = "OUTBOX_LEASE", global = true, value_parser = humantime::parse_duration)]
    pub lease: Option<Duration>,
    /// Attempts after which a failing message is dead-lettered.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", global = true)]
    pub max_attempts: Option<u32>,
    /// What a dead message does to the later messages of its key.
    #[arg(long, env = "OUTBOX_HEAD_POLICY", value_enum, global = true)]
    pub head_policy: Option<Head>,
    /// Longest wait between claims when idle, e.g. 1s (default 100ms: bounds the latency of
    /// stores without wake-ups, MariaDB and SQLite, at about ten claims a second when idle).
    #[arg(long, env = "OUTBOX_POLL_MAX", global = true, value_parser = humantime::parse_duration)]
    pub poll_max: Option<Duration>,
    /// How long a stop waits for in-flight batches, e.g. 10s.
    #[arg(long, env = "OUTBOX_SHUTDOWN_DEADLINE", global = true,
          value_parser = humantime::parse_duration)]
    pub shutdown_deadline: Option<Duration>,
    /// Serve /metrics, /health/live and /health/ready on this address, e.g. 0.0.0.0:9000.
    #[arg(long, env = "OUTBOX_METRICS_ADDR", global = true)]
    pub metrics_addr: Option<SocketAddr>,
    /// Delete published messages older than this (e.g. 7d): in `run` at start and then every
    /// `--purge-every`, in `drain` once after draining. Off by default.
    #[arg(long, env = "OUTBOX_PURGE_OLDER_THAN", global = true,
          value_parser = humantime::parse_duration)]
    pub purge_older_than: Option<Duration>,
    /// How often `run` purges (with `--purge-older-than`; default 1m).
    #[arg(long, env = "OUTBOX_PURGE_EVERY", global = true,
          value_parser = humantime::parse_duration)]
    pub purge_every: Option<Duration>,
    /// How often `run` refreshes the store gauges and the broker check (default 15s).
    #[arg(long, env = "OUTBOX_GAUGES_EVERY", global = true,
          value_parser = humantime::parse_duration)]
    pub gauges_every: Option<Duration>,
    /// How long /health/ready waits for the store and the broker (default 2s).
    #[arg(long, env = "OUTBOX_READY_TIMEOUT", global = true,
          value_parser = humantime::parse_duration)]
    pub ready_timeout: Option<Duration>,
    /// Log lines as text or JSON (default text).
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, global = true)]
    pub log_format: Option<LogFormat>,
    /// Which logs to show, as `RUST_LOG` (default: info, sqlx and librdkafka at warn).
    #[arg(long, env = "RUST_LOG", global = true)]
    pub log: Option<String>,
}

/// The configuration file: the same settings, durations as text (`30s`, `7d`).
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    store: Option<String>,
    store_file: Option<PathBuf>,
    table: Option<String>,
    schema: Option<String>,
    delete_published: Option<bool>,
    broker: Option<String>,
    broker_file: Option<PathBuf>,
    batch_size: Option<usize>,
    concurrency: Option<usize>,
    claim_shards: Option<usize>,
    group: Option<String>,
    group_lease: Option<String>,
    lease: Option<String>,
    max_attempts: Option<u32>,
    head_policy: Option<Head>,
    poll_max: Option<String>,
    shutdown_deadline: Option<String>,
    metrics_addr: Option<String>,
    purge_older_than: Option<String>,
    purge_every: Option<String>,
    gauges_every: Option<String>,
    ready_timeout: Option<String>,
    log_format: Option<LogFormat>,
    log: Option<String>,
    otel: Option<OtelFile>,
    /// `[[outbox]]` tables: the outboxes one `run` serves (see `crate::multi`).
    #[serde(default)]
    outbox: Vec<crate::multi::OutboxFile>,
    /// How often `schemas` patterns are looked up again.
    discover_every: Option<String>,
}

/// The `[otel]` table of the configuration file: OTLP export of the relay's producer spans.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct OtelFile {
    /// The collector's base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` (`/v1/traces` is appended).
    endpoint: Option<String>,
    /// `service.name` of the spans (default `outbox-relay`).
    service_name: Option<String>,
    /// PEM file of CA certificates trusted for an `https://` endpoint, besides the system's
    /// (as `OTEL_EXPORTER_OTLP_CERTIFICATE`).
    certificate: Option<PathBuf>,
    /// PEM file of the client certificate for an `https://` collector that asks for one (as
    /// `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`); needs `client_key`.
    client_certificate: Option<PathBuf>,
    /// PEM file of the client certificate's private key (as `OTEL_EXPORTER_OTLP_CLIENT_KEY`).
    client_key: Option<PathBuf>,
}

/// OTLP trace export (HTTP/protobuf) in effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtelSettings {
    /// Where spans are sent: the full traces URL, e.g. `http://collector:4318/v1/traces`.
    pub endpoint: String,
    /// `service.name` of the spans.
    pub service_name: String,
    /// CA certificates (PEM) trusted for an `https://` endpoint besides the system's.
    pub certificate: Option<PathBuf>,
    /// Client certificate and key (PEM files) for a collector that verifies clients.
    pub client_identity: Option<(PathBuf, PathBuf)>,
}

/// The `service.name` of the relay's spans when none is given.
pub const DEFAULT_SERVICE_NAME: &str = "outbox-relay";

/// The OTLP export in effect, from the standard variables (read through `env`) over the
/// `[otel]` table: on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as is),
/// `OTEL_EXPORTER_OTLP_ENDPOINT` or the table's `endpoint` (both a base URL, `/v1/traces`
/// appended) is set, unless `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. The
/// name is `OTEL_SERVICE_NAME`, else the table's `service_name`, else `outbox-relay`.
fn resolve_otel(
    file: Option<OtelFile>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<OtelSettings>, Error> {
    let file = file.unwrap_or_default();
    let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
        || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"))
    {
        return Ok(None);
    }
    let base = |url: String| format!("{}/v1/traces", url.trim_end_matches('/'));
    let (endpoint, from) = match (
        set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        set("OTEL_EXPORTER_OTLP_ENDPOINT"),
        file.endpoint,
    ) {
        (Some(url), _, _) => (url, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        (None, Some(url), _) => (base(url), "OTEL_EXPORTER_OTLP_ENDPOINT"),
        (None, None, Some(url)) => (base(url), "`endpoint` of [otel]"),
        (None, None, None) => return Ok(None),
    };
    let parsed = url::Url::parse(endpoint.trim()).map_err(|e| {
        Error::invalid_input(format!(
            "{from} = {:?} is not a URL ({e}); write e.g. \"http://collector:4318\"",
            mask_url(&endpoint)
        ))
    })?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(Error::invalid_input(format!(
            "{from} = {:?}: the OTLP exporter of this program speaks HTTP/protobuf over \
             http:// or https:// (port 4318 by convention); {}:// is not supported",
            mask_url(&endpoint),
            parsed.scheme()
        )));
    }
    // A signal's own variable, then the generic one, then the table's key.
    let path = |signal: &str, generic: &str, from_file: Option<PathBuf>| {
        set(signal)
            .or_else(|| set(generic))
            .map(|v| PathBuf::from(v.trim()))
            .or(from_file)
    };
    let certificate = path(
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
        file.certificate,
    );
    let client_certificate = path(
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        file.client_certificate,
    );
    let client_key = path(
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
        "OTEL_EXPORTER_OTLP_CLIENT_KEY",
        file.client_key,
    );
    let client_identity = match (client_certificate, client_key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        (Some(_), None) | (None, Some(_)) => {
            return Err(Error::invalid_input(
                "OTLP export: a client certificate needs its key and a key its certificate \
                 (OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY, or \
                 `client_certificate` and `client_key` of [otel])",
            ))
        }
    };
    if parsed.scheme() == "http" && (certificate.is_some() || client_identity.is_some()) {
        return Err(Error::invalid_input(format!(
            "{from} = {:?} is plain http://, but OTLP certificates are set: use an https:// \
             endpoint, or leave the certificates out",
            mask_url(&endpoint)
        )));
    }
    Ok(Some(OtelSettings {
        endpoint: endpoint.trim().to_owned(),
        service_name: set("OTEL_SERVICE_NAME")
            .or(file.service_name)
            .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned()),
        certificate,
        client_identity,
    }))
}

/// The settings in effect.
#[derive(Debug, Clone)]
pub struct Effective {
    /// The configuration file read, if any.
    pub config: Option<PathBuf>,
    /// Store URL.
    pub store: Option<String>,
    /// Table, schema and published-message handling.
    pub options: StoreOptions,
    /// Broker URL.
    pub broker: Option<String>,
    /// The relay engine's settings, or why they are invalid (see [`Effective::relay`]).
    relay: Result<RelayConfig, String>,
    /// Where to serve metrics and health.
    pub metrics_addr: Option<SocketAddr>,
    /// Age of published messages to purge.
    pub purge_older_than: Option<Duration>,
    /// Purge interval.
    pub purge_every: Duration,
    /// Gauge refresh interval.
    pub gauges_every: Duration,
    /// Readiness check timeout.
    pub ready_timeout: Duration,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log: String,
    /// OTLP export of producer spans; `None`: off.
    pub otel: Option<OtelSettings>,
    /// The outboxes of the configuration file's `[[outbox]]` tables; empty: the one outbox of
    /// `store`.
    pub outboxes: Vec<crate::multi::OutboxSpec>,
    /// How often `schemas` patterns are looked up again (default 30s).
    pub discover_every: Duration,
}

/// The log filter when none is given: the program and the engine at info, the drivers quieter
/// (sqlx logs every statement at info; librdkafka's chatter is for debugging).
pub const DEFAULT_LOG: &str = "info,sqlx=warn,rdkafka=warn,librdkafka=warn";

fn duration(key: &str, value: Option<String>) -> Result<Option<Duration>, Error> {
    value
        .map(|text| {
            humantime::parse_duration(&text).map_err(|e| {
                Error::invalid_input(format!(
                    "configuration key `{key}` = {text:?} is not a duration ({e}); write e.g. \
                     \"30s\", \"5m\" or \"7d\""
                ))
            })
        })
        .transpose()
}

fn read_file(path: &Path) -> Result<FileSettings, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::invalid_input(format!(
            "cannot read the configuration file {}: {e}",
            path.display()
        ))
    })?;
    toml::from_str(&text).map_err(|e| {
        // toml's message quotes the offending line, which may hold a URL with a password.
        Error::invalid_input(format!(
            "configuration file {}: {}",
            path.display(),
            outbox::redact_url(&e.to_string())
        ))
    })
}

impl SettingsArgs {
    /// Merge with the configuration file and the defaults, and check the result.
    pub fn resolve(&self) -> Result<Effective, Error> {
        let mut file = match &self.config {
            Some(path) => read_file(path)?,
            None => FileSettings::default(),
        };
        let defaults = RelayConfig::default();
        let metrics_addr = match (&self.metrics_addr, &file.metrics_addr) {
            (Some(addr), _) => Some(*addr),
            (None, Some(text)) => Some(text.parse().map_err(|e| {
                Error::invalid_input(format!(
                    "configuration key `metrics_addr` = {text:?} is not an address ({e}); write \
                     e.g. \"0.0.0.0:9000\""
                ))
            })?),
            (None, None) => None,
        };
        let head = self.head_policy.or(file.head_policy);
        let otel = resolve_otel(file.otel.clone(), |name| std::env::var(name).ok())?;
        let relay = RelayConfig::builder()
            // Unset: chosen by the store when the relay starts (`RelayConfig::tuned_for`).
            .batch_size(self.batch_size.or(file.batch_size))
            .concurrency(
                self.concurrency
                    .or(file.concurrency)
                    .unwrap_or(defaults.concurrency()),
            )
            .claim_shards(self.claim_shards.or(file.claim_shards))
            .group(self.group.clone().or(file.group))
            .group_lease(
                self.group_lease
                    .or(duration("group_lease", file.group_lease)?)
                    .unwrap_or(defaults.group_lease()),
            )
            .lease(
                self.lease
                    .or(duration("lease", file.lease)?)
                    .unwrap_or(defaults.lease()),
            )
            .max_attempts(
                self.max_attempts
                    .or(file.max_attempts)
                    .unwrap_or(defaults.max_attempts()),
            )
            .head_policy(match head {
                Some(Head::Block) => HeadPolicy::Block,
                Some(Head::Skip) => HeadPolicy::Skip,
                None => defaults.head_policy(),
            })
            .poll_max(
                self.poll_max
                    .or(duration("poll_max", file.poll_max)?)
                    .unwrap_or(defaults.poll_max()),
            )
            .shutdown_deadline(
                self.shutdown_deadline
                    .or(duration("shutdown_deadline", file.shutdown_deadline)?)
                    .unwrap_or(defaults.shutdown_deadline()),
            )
            // Checked by `check_relay`, which `run` and `drain` call: the other commands work
            // with relay settings they do not use.
            .build()
            .map_err(|e| match e {
                Error::InvalidInput(message) => message,
                other => other.to_string(),
            });
        let outbox_files = std::mem::take(&mut file.outbox);
        let discover_every = duration("discover_every", file.discover_every.take())?
            .unwrap_or(Duration::from_secs(30));
        let mut effective = Effective {
            config: self.config.clone(),
            store: pick(
                self.store.clone(),
                self.store_file.as_deref(),
                "--store",
                "--store-file",
            )?
            .or(pick(
                file.store,
                file.store_file.as_deref(),
                "store",
                "store_file",
            )?),
            options: StoreOptions {
                table: self.table.clone().or(file.table),
                schema: self.schema.clone().or(file.schema),
                delete_published: self
                    .delete_published
                    .or(file.delete_published)
                    .unwrap_or(false),
            },
            broker: pick(
                self.broker.clone(),
                self.broker_file.as_deref(),
                "--broker",
                "--broker-file",
            )?
            .or(pick(
                file.broker,
                file.broker_file.as_deref(),
                "broker",
                "broker_file",
            )?),
            relay,
            metrics_addr,
            purge_older_than: self
                .purge_older_than
                .or(duration("purge_older_than", file.purge_older_than)?),
            purge_every: self
                .purge_every
                .or(duration("purge_every", file.purge_every)?)
                .unwrap_or(Duration::from_secs(60)),
            gauges_every: self
                .gauges_every
                .or(duration("gauges_every", file.gauges_every)?)
                .unwrap_or(Duration::from_secs(15)),
            ready_timeout: self
                .ready_timeout
                .or(duration("ready_timeout", file.ready_timeout)?)
                .unwrap_or(Duration::from_secs(2)),
            log_format: self
                .log_format
                .or(file.log_format)
                .unwrap_or(LogFormat::Text),
            log: self
                .log
                .clone()
                .or(file.log)
                .unwrap_or_else(|| DEFAULT_LOG.to_owned()),
            otel,
            outboxes: Vec::new(),
            discover_every,
        };
        effective.outboxes = crate::multi::resolve(outbox_files, &effective)?;
        Ok(effective)
    }
}

impl Effective {
    /// The store URL, or an error saying how to give it.
    pub fn store(&self) -> Result<&str, Error> {
        self.store.as_deref().ok_or_else(|| {
            Error::invalid_input(
                "no store: give --store URL, OUTBOX_STORE_URL, --store-file PATH (OUTBOX_STORE_URL_FILE) \
                 or `store` in the configuration file (--config)",
            )
        })
    }

    /// The broker URL, or an error saying how to give it.
    pub fn broker(&self) -> Result<&str, Error> {
        self.broker.as_deref().ok_or_else(|| {
            Error::invalid_input(
                "no broker: give --broker URL, OUTBOX_BROKER_URL, --broker-file PATH \
                 (OUTBOX_BROKER_URL_FILE) or `broker` in the configuration file (--config)",
            )
        })
    }

    /// The relay engine's settings, or [`Error::InvalidInput`] saying which one to fix.
    pub fn relay(&self) -> Result<&RelayConfig, Error> {
        self.relay
            .as_ref()
            .map_err(|message| Error::invalid_input(message.clone()))
    }

    /// Check what `run` and `drain` need beyond the URLs.
    pub fn check_relay(&self) -> Result<(), Error> {
        self.relay()?;
        for (name, value) in [
            ("--purge-every", self.purge_every),
            ("--gauges-every", self.gauges_every),
            ("--ready-timeout", self.ready_timeout),
            ("discover_every", self.discover_every),
        ] {
            if value.is_zero() {
                return Err(Error::invalid_input(format!(
                    "{name} is 0; it must be a positive interval"
                )));
            }
        }
        Ok(())
    }

    /// The effective configuration as a TOML document that `--config` accepts, secrets masked;
    /// [`Error::InvalidInput`] if the relay settings are invalid.
    pub fn to_masked_toml(&self) -> Result<String, Error> {
        let d = |d: Duration| humantime::format_duration(d).to_string();
        let mut table = toml::Table::new();
        let mut put = |key: &str, value: toml::Value| {
            table.insert(key.to_owned(), value);
        };
        if let Some(store) = &self.store {
            put("store", mask_url(store).into());
        }
        if let Some(table) = &self.options.table {
            put("table", table.clone().into());
        }
        if let Some(schema) = &self.options.schema {
            put("schema", schema.clone().into());
        }
        put("delete_published", self.options.delete_published.into());
        if let Some(broker) = &self.broker {
            put("broker", mask_url(broker).into());
        }
        let r = self.relay()?;
        let (backend, caps) = store_capabilities(self.store.as_deref());
        let tuning = r.tuned_for(&caps);
        put(
            "batch_size",
            i64::try_from(tuning.batch_size).unwrap_or(i64::MAX).into(),
        );
        put(
            "concurrency",
            i64::try_from(r.concurrency()).unwrap_or(i64::MAX).into(),
        );
        put(
            "claim_shards",
            i64::try_from(tuning.claim_shards)
                .unwrap_or(i64::MAX)
                .into(),
        );
        if let Some(group) = r.group() {
            put("group", group.into());
            put("group_lease", d(r.group_lease()).into());
        }
        put("lease", d(r.lease()).into());
        put("max_attempts", i64::from(r.max_attempts()).into());
        put(
            "head_policy",
            match r.head_policy() {
                HeadPolicy::Skip => "skip",
                _ => "block",
            }
            .into(),
        );
        put("poll_max", d(r.poll_max()).into());
        put("shutdown_deadline", d(r.shutdown_deadline()).into());
        if let Some(addr) = self.metrics_addr {
            put("metrics_addr", addr.to_string().into());
        }
        if let Some(age) = self.purge_older_than {
            put("purge_older_than", d(age).into());
        }
        put("purge_every", d(self.purge_every).into());
        put("gauges_every", d(self.gauges_every).into());
        put("ready_timeout", d(self.ready_timeout).into());
        put(
            "log_format",
            match self.log_format {
                LogFormat::Text => "text",
                LogFormat::Json => "json",
            }
            .into(),
        );
        put("log", self.log.clone().into());
        if let Some(otel) = &self.otel {
            let mut t = toml::Table::new();
            // The base URL, as the table takes it (`/v1/traces` is appended again).
            t.insert(
                "endpoint".to_owned(),
                mask_url(otel.endpoint.trim_end_matches("/v1/traces")).into(),
            );
            t.insert("service_name".to_owned(), otel.service_name.clone().into());
            if let Some(ca) = &otel.certificate {
                t.insert("certificate".to_owned(), ca.display().to_string().into());
            }
            if let Some((cert, key)) = &otel.client_identity {
                t.insert(
                    "client_certificate".to_owned(),
                    cert.display().to_string().into(),
                );
                t.insert("client_key".to_owned(), key.display().to_string().into());
            }
            put("otel", t.into());
        }
        let mut source = match &self.config {
            Some(path) => format!("# flags > environment > {} > defaults\n", path.display()),
            None => "# flags > environment > defaults (no --config file)\n".to_owned(),
        };
        let by_store: Vec<&str> = [
            ("batch_size", tuning.batch_size_chosen),
            ("claim_shards", tuning.claim_shards_chosen),
        ]
        .into_iter()
        .filter(|(_, chosen)| *chosen == Chosen::Store)
        .map(|(key, _)| key)
        .collect();
        if !by_store.is_empty() {
            source += &format!(
                "# {} chosen by the store ({backend}); give a value to override\n",
                by_store.join(" and ")
            );
        }
        if tuning.shards_ignored {
            source += &format!(
                "# claim_shards is {}: {backend} cannot split its keys, so the relay runs one \
                 claim at a time\n",
                r.claim_shards().unwrap_or(1)
            );
        }
        Ok(source + &toml::to_string(&table).unwrap_or_default())
    }
}

/// The backend a store URL names, and what it declares for the relay's batch size and claim
/// shards (read without connecting: `config` prints offline). Postgres prefers
/// [`outbox::postgres::PREFERRED_CLAIM_SHARDS`] sharded claims of
/// [`outbox::postgres::PREFERRED_BATCH`]; MariaDB prefers
/// [`outbox::mysql::PREFERRED_CLAIM_SHARDS`] sharded claims and declares no batch; SQLite cannot
/// shard and declares no batch.
fn store_capabilities(url: Option<&str>) -> (&'static str, Capabilities) {
    let scheme = url.and_then(|u| u.split_once(':')).map(|(s, _)| s);
    match scheme {
        #[cfg(feature = "postgres")]
        Some("postgres" | "postgresql") => (
            "postgres",
            Capabilities::none()
                .with_sharded_claims(true)
                .with_preferred_claim_shards(outbox::postgres::PREFERRED_CLAIM_SHARDS)
                .with_preferred_batch(outbox::postgres::PREFERRED_BATCH),
        ),
        #[cfg(feature = "mysql")]
        Some("mysql" | "mariadb") => (
            "mysql",
            Capabilities::none()
                .with_sharded_claims(true)
                .with_preferred_claim_shards(outbox::mysql::PREFERRED_CLAIM_SHARDS),
        ),
        #[cfg(not(feature = "mysql"))]
        Some("mysql" | "mariadb") => ("mysql", Capabilities::none()),
        Some("sqlite") => ("sqlite", Capabilities::none()),
        _ => ("no store given", Capabilities::none()),
    }
}

/// Query options whose values are secrets, by a part of their name.
const SECRET_WORDS: &[&str] = &["password", "secret", "token", "credential", "private"];

/// A URL with its secrets replaced by `***`: the password, a NATS token or user name standing
/// alone before `@` (`nats://TOKEN@host`), and query options named like a secret
/// (`sasl.password=`, `token=`, ...).
pub fn mask_url(text: &str) -> String {
    let redacted = outbox::redact_url(text);
    let Ok(mut url) = url::Url::parse(&redacted) else {
        return redacted;
    };
    if url.scheme() == "nats" && !url.username().is_empty() && url.password().is_none() {
        let _ = url.set_username("***");
    }
    let pairs: Vec<(String, String)> = url
        .query_pairs()
        .map(|(k, v)| {
            let lower = k.to_ascii_lowercase();
            let secret = SECRET_WORDS.iter().any(|w| lower.contains(w));
            (
                k.into_owned(),
                if secret {
                    "***".to_owned()
                } else {
                    v.into_owned()
                },
            )
        })
        .collect();
    if !pairs.is_empty() {
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
    // Url percent-encodes the braces of subject templates; show them as written.
    url.to_string()
        .replace("%7B", "{")
        .replace("%7D", "}")
        .replace("%2A%2A%2A", "***")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_of_urls_are_masked() {
        let masked = mask_url("kafka://u:pw@h:9092?topic=t&sasl.password=hunter2&acks=all");
        assert!(!masked.contains("pw@"), "{masked}");
        assert!(!masked.contains("hunter2"), "{masked}");
        assert!(masked.contains("acks=all"), "{masked}");
        let masked = mask_url("nats://s3cr3ttoken@127.0.0.1:4222?subject=a.{event_type}");
        assert!(!masked.contains("s3cr3ttoken"), "{masked}");
        assert!(masked.contains("subject=a.{event_type}"), "{masked}");
    }

    /// An environment of `vars` only.
    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name: &str| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn otel_export_is_off_by_default_and_the_standard_variables_win() {
        assert_eq!(resolve_otel(None, env(&[])).unwrap(), None);
        let file = OtelFile {
            endpoint: Some("http://file:4318/".into()),
            service_name: Some("relay-a".into()),
            ..OtelFile::default()
        };
        let from_file = resolve_otel(Some(file.clone()), env(&[])).unwrap().unwrap();
        assert_eq!(from_file.endpoint, "http://file:4318/v1/traces");
        assert_eq!(from_file.service_name, "relay-a");
        let generic = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
            ("OTEL_SERVICE_NAME", "relay-b"),
        ];
        let from_env = resolve_otel(Some(file.clone()), env(&generic))
            .unwrap()
            .unwrap();
        assert_eq!(from_env.endpoint, "http://env:4318/v1/traces");
        assert_eq!(from_env.service_name, "relay-b");
        let signal = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://traces:4318/custom",
            ),
        ];
        let exact = resolve_otel(None, env(&signal)).unwrap().unwrap();
        assert_eq!(exact.endpoint, "http://traces:4318/custom");
        assert_eq!(exact.service_name, DEFAULT_SERVICE_NAME);
        for off in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(resolve_otel(Some(file.clone()), env(&[off])).unwrap(), None);
        }
        let bad = OtelFile {
            endpoint: Some("grpc://u:secret@collector:4317".into()),
            ..OtelFile::default()
        };
        let err = resolve_otel(Some(bad), env(&[])).unwrap_err().to_string();
        assert!(err.contains("grpc:// is not supported"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        let bad = OtelFile {
            endpoint: Some("collector 4318".into()),
            ..OtelFile::default()
        };
        let err = resolve_otel(Some(bad), env(&[])).unwrap_err().to_string();
        assert!(err.contains("is not a URL"), "{err}");
    }

    #[test]
    fn an_https_endpoint_takes_a_ca_file_and_a_client_certificate() {
        let file = OtelFile {
            endpoint: Some("https://collector:4318".into()),
            certificate: Some("/etc/file-ca.pem".into()),
            ..OtelFile::default()
        };
        let plain = resolve_otel(Some(file.clone()), env(&[])).unwrap().unwrap();
        assert_eq!(plain.endpoint, "https://collector:4318/v1/traces");
        assert_eq!(plain.certificate, Some(PathBuf::from("/etc/file-ca.pem")));
        assert_eq!(plain.client_identity, None);
        let vars = [
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/env-ca.pem"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
                "/etc/traces-ca.pem",
            ),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/etc/client.pem"),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/etc/client.key"),
        ];
        let tls = resolve_otel(Some(file.clone()), env(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(tls.certificate, Some(PathBuf::from("/etc/traces-ca.pem")));
        assert_eq!(
            tls.client_identity,
            Some(("/etc/client.pem".into(), "/etc/client.key".into()))
        );
        let half = [("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/etc/client.pem")];
        let err = resolve_otel(Some(file), env(&half))
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs its key"), "{err}");
        let on_http = OtelFile {
            endpoint: Some("http://collector:4318".into()),
            certificate: Some("/etc/ca.pem".into()),
            ..OtelFile::default()
        };
        let err = resolve_otel(Some(on_http), env(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("use an https:// endpoint"), "{err}");
    }
}
