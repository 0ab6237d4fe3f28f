//! Redis Streams: a consumer group, `XACK` after the handler, `XAUTOCLAIM` of entries a dead
//! consumer left pending.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_traits::Error;
use outbox_url::{read_secret_file, redact_url};

pub use outbox_publisher_redis::RedisTls;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Value;
use tokio_util::sync::CancellationToken;

use crate::core::{broker_pause, in_lanes, Core, Verdict};
use crate::delivery::{
    json_headers, DecodeError, Delivery, RawEnvelope, Source, REDIS_FIELD_NAMES,
};
use crate::handler::Handler;
use crate::options::{self, ConsumerOptions};
use crate::telemetry::Meters;
use crate::{DEAD_ATTEMPTS, DEAD_CONSUMER, DEAD_REASON, DEAD_SOURCE};

const BROKER: &str = "Redis";

/// The query options [`RedisConsumerConfig::from_url`] understands besides
/// [`COMMON_URL_OPTIONS`](crate::COMMON_URL_OPTIONS).
pub const REDIS_URL_OPTIONS: &[&str] = &[
    "stream",
    "group",
    "consumer",
    "dead_stream",
    "claim_idle_ms",
    "block_ms",
    "timeout_ms",
    "ca_file",
    "cert_file",
    "key_file",
    "password_file",
];

/// Default [`RedisConsumerConfig::claim_idle`].
pub const DEFAULT_CLAIM_IDLE: Duration = Duration::from_secs(60);
/// Default [`RedisConsumerConfig::block`].
pub const DEFAULT_BLOCK: Duration = Duration::from_secs(2);
/// Default reply timeout (on top of the blocking read's own wait).
pub const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_secs(5);

/// What to change when connecting failed with `text`, as the Redis publisher advises.
pub(crate) fn connect_fix(text: &str) -> Option<&'static str> {
    let t = text.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    Some(
        if has(&["wrongpass", "invalid password", "noauth", "authentication"]) {
            "check the user name and the password (in the URL, or in a file with password_file=)"
        } else if has(&["unknownissuer", "unknown issuer", "badsignature"]) {
            "the server's certificate is not signed by a CA this client trusts: set ca_file= to \
             the file of the CA that signed it"
        } else if has(&["notvalidforname", "not valid for name"]) {
            "the server's certificate does not name the host in the URL: connect by a name the \
             certificate lists"
        } else if has(&[
            "certificaterequired",
            "certificate required",
            "bad certificate",
            "badcertificate",
        ]) {
            "the server requires a client certificate signed by a CA it trusts: set cert_file= \
             and key_file="
        } else {
            return None;
        },
    )
}

/// The certificates `tls`'s files hold, read as the Redis publisher reads them.
pub(crate) fn certificates(tls: &RedisTls) -> Result<redis::TlsCertificates, Error> {
    let load = |option: &str, path: &Option<std::path::PathBuf>| {
        path.as_ref()
            .map(|path| {
                std::fs::read(path).map_err(|e| {
                    Error::invalid_input(format!(
                        "Redis option {option}={} cannot be read ({}); give the path of a \
                         readable file",
                        path.display(),
                        e.kind()
                    ))
                })
            })
            .transpose()
    };
    let root_cert = load("ca_file", &tls.ca_file)?;
    let client_tls = match (
        load("cert_file", &tls.cert_file)?,
        load("key_file", &tls.key_file)?,
    ) {
        (Some(client_cert), Some(client_key)) => Some(redis::ClientTlsConfig {
            client_cert,
            client_key,
        }),
        _ => None,
    };
    Ok(redis::TlsCertificates {
        client_tls,
        root_cert,
    })
}

/// Everything [`RedisConsumer::connect`] needs: built with [`RedisConsumerConfig::builder`] or
/// [`RedisConsumerConfig::from_url`], both of which check it, and read with getters of the same
/// names. `Debug` shows the URL without its password.
///
/// ```
/// use std::time::Duration;
/// use outbox_consumer::redis::RedisConsumerConfig;
/// let config = RedisConsumerConfig::builder("redis://:pw@127.0.0.1:6379", "outbox", "payments")
///     .consumer("payments-1")
///     .claim_idle(Duration::from_secs(60))
///     .build()?;
/// assert_eq!(config.dead_letter_stream(), "outbox:dead");
/// assert!(!format!("{config:?}").contains("pw"));
/// assert!(RedisConsumerConfig::builder("redis://h", "s", "").build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Clone)]
pub struct RedisConsumerConfig {
    /// Server URL, e.g. `redis://:password@127.0.0.1:6379/0` or `rediss://` for TLS.
    pub(crate) url: String,
    /// The stream key to consume.
    pub(crate) stream: String,
    /// The consumer group (created at the stream's start if missing, so that entries written
    /// before the group existed are consumed too). Also the `consumer` label of the metrics.
    pub(crate) group: String,
    /// This consumer's name in the group. Default: `consumer-<random>`. A process that restarts
    /// under the same name first takes back its own pending entries; under a new name they are
    /// taken over after [`claim_idle`](Self::claim_idle).
    pub(crate) consumer: String,
    /// Stream key of dead letters. Default: `<stream>:dead`.
    pub(crate) dead_letter_stream: String,
    /// Entries pending (delivered, not acknowledged) in any consumer of the group for longer
    /// than this are taken over with `XAUTOCLAIM`. While an entry waits between retries its
    /// consumer resets its idle time every half of this (`XCLAIM ... JUSTID`); keep it above
    /// your longest single handler call, or a live consumer's entry is handled twice. Default:
    /// [`DEFAULT_CLAIM_IDLE`].
    pub(crate) claim_idle: Duration,
    /// How long one `XREADGROUP` waits for new entries (shortened to half of `claim_idle`).
    /// Default: [`DEFAULT_BLOCK`].
    pub(crate) block: Duration,
    /// Connection and reply timeout. Default: [`DEFAULT_REDIS_TIMEOUT`].
    pub(crate) timeout: Duration,
    /// Retries, batch size and concurrency.
    pub(crate) options: ConsumerOptions,
    /// Certificate files of a `rediss://` connection: the Redis publisher's settings and URL
    /// options (`ca_file`, `cert_file`, `key_file`).
    pub(crate) tls: RedisTls,
}

impl std::fmt::Debug for RedisConsumerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConsumerConfig")
            .field("url", &redact_url(&self.url))
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .field("claim_idle", &self.claim_idle)
            .field("block", &self.block)
            .field("timeout", &self.timeout)
            .field("options", &self.options)
            .field("tls", &self.tls)
            .finish()
    }
}

impl RedisConsumerConfig {
    /// A builder for consumer group `group` of stream `stream` on the server at `url`,
    /// starting from the defaults; finish with [`RedisConsumerConfigBuilder::build`].
    pub fn builder(
        url: impl Into<String>,
        stream: &str,
        group: &str,
    ) -> RedisConsumerConfigBuilder {
        RedisConsumerConfigBuilder {
            config: Self::defaults(url, stream, group),
        }
    }

    /// Server URL, e.g. `redis://:password@127.0.0.1:6379/0` or `rediss://` for TLS.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The stream key to consume.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The consumer group (created at the stream's start if missing, so that entries written
    /// before the group existed are consumed too). Also the `consumer` label of the metrics.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// This consumer's name in the group. Default: `consumer-<random>`. A process that restarts
    /// under the same name first takes back its own pending entries; under a new name they are
    /// taken over after [`claim_idle`](Self::claim_idle).
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Stream key of dead letters. Default: `<stream>:dead`.
    pub fn dead_letter_stream(&self) -> &str {
        &self.dead_letter_stream
    }

    /// Entries pending (delivered, not acknowledged) in any consumer of the group for longer
    /// than this are taken over with `XAUTOCLAIM`. While an entry waits between retries its
    /// consumer resets its idle time every half of this (`XCLAIM ... JUSTID`); keep it above
    /// your longest single handler call, or a live consumer's entry is handled twice. Default:
    /// [`DEFAULT_CLAIM_IDLE`].
    pub fn claim_idle(&self) -> Duration {
        self.claim_idle
    }

    /// How long one `XREADGROUP` waits for new entries (shortened to half of `claim_idle`).
    /// Default: [`DEFAULT_BLOCK`].
    pub fn block(&self) -> Duration {
        self.block
    }

    /// Connection and reply timeout. Default: [`DEFAULT_REDIS_TIMEOUT`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Retries, batch size and concurrency.
    pub fn options(&self) -> &ConsumerOptions {
        &self.options
    }

    /// Certificate files of a `rediss://` connection: the Redis publisher's settings and URL
    /// options (`ca_file`, `cert_file`, `key_file`).
    pub fn tls(&self) -> &RedisTls {
        &self.tls
    }

    /// The configuration with the defaults for `stream` and `group`.
    fn defaults(url: impl Into<String>, stream: &str, group: &str) -> Self {
        Self {
            url: url.into(),
            stream: stream.to_owned(),
            group: group.to_owned(),
            consumer: format!(
                "consumer-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ),
            dead_letter_stream: format!("{stream}:dead"),
            claim_idle: DEFAULT_CLAIM_IDLE,
            block: DEFAULT_BLOCK,
            timeout: DEFAULT_REDIS_TIMEOUT,
            options: ConsumerOptions::default(),
            tls: RedisTls::default(),
        }
    }

    /// Parse `redis://[:password@]host:6379[/db]?stream=outbox.order&group=payments`.
    ///
    /// Options: [`REDIS_URL_OPTIONS`] (`stream` and `group` required; `consumer`,
    /// `dead_stream`, `claim_idle_ms`, `block_ms`, `timeout_ms`) and
    /// [`COMMON_URL_OPTIONS`](crate::COMMON_URL_OPTIONS). An unknown option, a bad value or a
    /// missing required one gives [`Error::InvalidInput`] naming the valid options.
    ///
    /// ```
    /// use outbox_consumer::redis::RedisConsumerConfig;
    /// let c = RedisConsumerConfig::from_url(
    ///     "redis://127.0.0.1:6379/0?stream=outbox.order&group=payments&claim_idle_ms=30000",
    /// ).unwrap();
    /// assert_eq!(c.url(), "redis://127.0.0.1:6379/0");
    /// assert_eq!(c.dead_letter_stream(), "outbox.order:dead");
    /// assert!(RedisConsumerConfig::from_url("redis://h?stream=s").is_err()); // no group
    /// ```
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let shown = redact_url(url);
        let parsed = url::Url::parse(url).map_err(|e| {
            Error::invalid_input(format!("Redis consumer URL {shown:?} is not a URL: {e}"))
        })?;
        if !matches!(parsed.scheme(), "redis" | "rediss") {
            return Err(Error::invalid_input(format!(
                "Redis consumer URL {shown:?} has scheme {:?}; use redis:// (or rediss:// for TLS)",
                parsed.scheme()
            )));
        }
        let (mut stream, mut group, mut consumer, mut dead) = (None, None, None, None);
        let mut claim_idle = DEFAULT_CLAIM_IDLE;
        let mut block = DEFAULT_BLOCK;
        let mut timeout = DEFAULT_REDIS_TIMEOUT;
        let mut common = ConsumerOptions::default();
        let (mut tls, mut password) = (RedisTls::default(), None);
        for (key, value) in parsed.query_pairs() {
            let value = value.into_owned();
            match key.as_ref() {
                "ca_file" => tls.ca_file = Some(value.into()),
                "cert_file" => tls.cert_file = Some(value.into()),
                "key_file" => tls.key_file = Some(value.into()),
                "password_file" => password = Some(read_secret_file(BROKER, &key, &value)?),
                "stream" => stream = Some(value),
                "group" => group = Some(value),
                "consumer" => consumer = Some(value),
                "dead_stream" => dead = Some(value),
                "claim_idle_ms" => claim_idle = options::millis(BROKER, &key, &value)?,
                "block_ms" => block = options::millis(BROKER, &key, &value)?,
                "timeout_ms" => timeout = options::millis(BROKER, &key, &value)?,
                other => {
                    if !common.apply(BROKER, other, &value)? {
                        return Err(options::unknown_option(
                            BROKER,
                            other,
                            &shown,
                            REDIS_URL_OPTIONS,
                        ));
                    }
                }
            }
        }
        let example = "?stream=outbox.order&group=payments";
        let stream =
            stream.ok_or_else(|| options::missing_option(BROKER, "stream", &shown, example))?;
        let group =
            group.ok_or_else(|| options::missing_option(BROKER, "group", &shown, example))?;
        let mut server = parsed.clone();
        server.set_query(None);
        server.set_fragment(None);
        if let Some(password) = password {
            if parsed.password().is_some() {
                return Err(Error::invalid_input(format!(
                    "Redis consumer URL {shown:?} has both a password and password_file; give one"
                )));
            }
            // Kept in the URL, as the publisher does: `Debug` and errors show it redacted.
            server.set_password(Some(&password)).map_err(|()| {
                Error::invalid_input(format!(
                    "Redis consumer URL {shown:?} cannot take a password"
                ))
            })?;
        }
        let mut config = Self::defaults(server.to_string(), &stream, &group);
        config.tls = tls;
        if let Some(consumer) = consumer {
            config.consumer = consumer;
        }
        if let Some(dead) = dead {
            config.dead_letter_stream = dead;
        }
        config.claim_idle = claim_idle;
        config.block = block;
        config.timeout = timeout;
        config.options = common;
        config.validate()?;
        Ok(config)
    }

    /// Check the values without connecting.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        self.options.validate()?;
        self.tls.validate(&self.url)?;
        options::non_empty(BROKER, "stream", &self.stream)?;
        options::non_empty(BROKER, "group", &self.group)?;
        options::non_empty(BROKER, "consumer name", &self.consumer)?;
        options::non_empty(BROKER, "dead-letter stream", &self.dead_letter_stream)?;
        if self.dead_letter_stream == self.stream {
            return Err(Error::invalid_input(format!(
                "Redis dead-letter stream {:?} is the stream consumed; dead letters would come \
                 back (default: <stream>:dead)",
                self.stream
            )));
        }
        if self.claim_idle < Duration::from_millis(10) {
            return Err(Error::invalid_input(format!(
                "Redis claim_idle {:?} is too short: live consumers' entries would be taken \
                 from them (at least 10 ms; default 60 s)",
                self.claim_idle
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid_input(
                "Redis timeout must be positive (timeout_ms=5000, for example)",
            ));
        }
        Ok(())
    }

    /// The wait of one blocking read: `block`, at most half of `claim_idle`, at least 1 ms
    /// (`BLOCK 0` would wait for ever).
    fn block_for(&self) -> Duration {
        self.block
            .min(self.claim_idle / 2)
            .max(Duration::from_millis(1))
    }
}

/// Builder of [`RedisConsumerConfig`] ([`RedisConsumerConfig::builder`]); [`RedisConsumerConfigBuilder::build`] checks every setting.
/// `Debug` is the config's: no secret shows.
#[derive(Clone)]
pub struct RedisConsumerConfigBuilder {
    config: RedisConsumerConfig,
}

impl std::fmt::Debug for RedisConsumerConfigBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RedisConsumerConfigBuilder")
            .field(&self.config)
            .finish()
    }
}

impl RedisConsumerConfigBuilder {
    /// This consumer's name in the group. Default: `consumer-<random>`. A process that restarts
    /// under the same name first takes back its own pending entries; under a new name they are
    /// taken over after [`claim_idle`](Self::claim_idle).
    pub fn consumer(mut self, name: impl Into<String>) -> Self {
        self.config.consumer = name.into();
        self
    }

    /// Stream key of dead letters. Default: `<stream>:dead`.
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.config.dead_letter_stream = stream.into();
        self
    }

    /// Entries pending (delivered, not acknowledged) in any consumer of the group for longer
    /// than this are taken over with `XAUTOCLAIM`. While an entry waits between retries its
    /// consumer resets its idle time every half of this (`XCLAIM ... JUSTID`); keep it above
    /// your longest single handler call, or a live consumer's entry is handled twice. Default:
    /// [`DEFAULT_CLAIM_IDLE`].
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.config.claim_idle = idle;
        self
    }

    /// How long one `XREADGROUP` waits for new entries (shortened to half of `claim_idle`).
    /// Default: [`DEFAULT_BLOCK`].
    pub fn block(mut self, block: Duration) -> Self {
        self.config.block = block;
        self
    }

    /// Connection and reply timeout. Default: [`DEFAULT_REDIS_TIMEOUT`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// Retries, batch size and concurrency.
    pub fn options(mut self, options: ConsumerOptions) -> Self {
        self.config.options = options;
        self
    }

    /// Certificate files of a `rediss://` connection: the Redis publisher's settings and URL
    /// options (`ca_file`, `cert_file`, `key_file`).
    pub fn tls(mut self, tls: RedisTls) -> Self {
        self.config.tls = tls;
        self
    }

    /// Check every setting without connecting; [`Error::InvalidInput`] says which one to fix.
    pub fn build(self) -> Result<RedisConsumerConfig, Error> {
        self.config.validate()?;
        Ok(self.config)
    }
}

/// One stream entry as Redis returned it; `fields` is `None` for an entry deleted while
/// pending.
#[derive(Debug, Clone)]
struct Entry {
    id: String,
    fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
}

impl Entry {
    fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .as_ref()?
            .iter()
            .find(|(n, _)| n == name.as_bytes())
            .map(|(_, v)| v.as_slice())
    }
}

/// A Redis Streams consumer in a consumer group. Build it with [`RedisConsumer::connect`], then
/// [`run`](RedisConsumer::run) it with your handler.
pub struct RedisConsumer {
    connection: ConnectionManager,
    config: RedisConsumerConfig,
}

impl std::fmt::Debug for RedisConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConsumer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RedisConsumer {
    /// Connect and create the consumer group (at the stream's start, creating the stream) if
    /// it does not exist.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad configuration or a key that is not a stream;
    /// [`Error::Unavailable`] when the server cannot be reached. No message contains the
    /// password.
    pub async fn connect(config: RedisConsumerConfig) -> Result<Self, Error> {
        config.validate()?;
        let shown = redact_url(&config.url);
        let unavailable = |e: &dyn std::fmt::Display| {
            let detail = redact_url(&e.to_string());
            let message = match connect_fix(&detail) {
                Some(fix) => format!("cannot connect to {shown}: {detail}; {fix}"),
                None => format!("cannot connect to {shown}: {detail}"),
            };
            Error::unavailable("redis", message, detail)
        };
        let client = if config.tls.is_set() {
            redis::Client::build_with_tls(config.url.as_str(), certificates(&config.tls)?)
        } else {
            redis::Client::open(config.url.as_str())
        };
        let client = client.map_err(|e| {
            Error::invalid_input(format!(
                "Redis URL {shown:?} is not valid: {}",
                redact_url(&e.to_string())
            ))
        })?;
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(config.timeout)
            .set_response_timeout(config.timeout + config.block_for())
            .set_number_of_retries(1);
        let mut connection = tokio::time::timeout(
            config.timeout,
            client.get_connection_manager_with_config(manager),
        )
        .await
        .map_err(|_| unavailable(&format!("no connection within {:?}", config.timeout)))?
        .map_err(|e| unavailable(&e))?;
        match create_group(&mut connection, &config).await {
            Ok(()) => {}
            Err(e) if e.code() == Some("WRONGTYPE") => {
                return Err(Error::invalid_input(format!(
                    "Redis key {:?} on {shown} is not a stream",
                    config.stream
                )))
            }
            Err(e) => return Err(unavailable(&e)),
        }
        Ok(Self { connection, config })
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConsumerConfig {
        &self.config
    }

    /// Consume until the task is dropped. See [`RedisConsumer::run_until`].
    pub async fn run(self, handler: impl Handler + 'static) {
        self.run_until(handler, CancellationToken::new()).await;
    }

    /// Consume until `shutdown` is cancelled: a message being handled is finished and
    /// acknowledged; one waiting for a retry stays pending for this consumer name (taken back
    /// at its next start, or over by another after `claim_idle`). Outages are waited out.
    ///
    /// Each round reads this consumer's own pending entries first (once, at start), then every
    /// half `claim_idle` takes over entries idle that long (`XAUTOCLAIM`), and otherwise reads
    /// new entries (`XREADGROUP ... >`). The entries of a round that were handled (or
    /// dead-lettered) are acknowledged with one `XACK`.
    pub async fn run_until(self, handler: impl Handler + 'static, shutdown: CancellationToken) {
        let core = Core {
            handler: Arc::new(handler),
            retry: self.config.options.retry,
            meters: Meters::new(&self.config.group),
            shutdown: shutdown.clone(),
            name: self.config.group.clone(),
        };
        let claim_every = (self.config.claim_idle / 2).max(Duration::from_millis(5));
        let mut own_pending = true;
        let mut cursor = "0-0".to_owned();
        let mut last_claim = Instant::now();
        let mut failures = 0u32;
        while !shutdown.is_cancelled() {
            let read = if own_pending {
                self.read("0", None).await
            } else if last_claim.elapsed() >= claim_every {
                last_claim = Instant::now();
                self.claim(&mut cursor).await
            } else {
                let left = claim_every.saturating_sub(last_claim.elapsed());
                let block = self
                    .config
                    .block_for()
                    .min(left)
                    .max(Duration::from_millis(1));
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    read = self.read(">", Some(block)) => read,
                }
            };
            let entries = match read {
                Ok(entries) => entries,
                Err(e) if e.code() == Some("NOGROUP") => {
                    // The stream or its group is gone (deleted, or a server restarted without
                    // persistence): make them again and read from the stream's start.
                    tracing::warn!(consumer = %core.name, "Redis consumer group missing; creating it again");
                    if let Err(e) = create_group(&mut self.connection.clone(), &self.config).await {
                        core.meters.broker_error();
                        tracing::warn!(consumer = %core.name, error = %redact_url(&e.to_string()), "Redis consumer group not created");
                        failures = failures.saturating_add(1);
                        if !core.pause(broker_pause(failures)).await {
                            return;
                        }
                    }
                    own_pending = true;
                    continue;
                }
                Err(e) => {
                    core.meters.broker_error();
                    failures = failures.saturating_add(1);
                    let pause = broker_pause(failures);
                    tracing::warn!(consumer = %core.name, error = %redact_url(&e.to_string()), "Redis read failed; retrying in {pause:?}");
                    if !core.pause(pause).await {
                        return;
                    }
                    continue;
                }
            };
            failures = 0;
            if own_pending && entries.is_empty() {
                own_pending = false;
            }
            if entries.is_empty() {
                continue;
            }
            let done: Vec<String> = in_lanes(
                entries,
                |e| e.field("partition_key").map(<[u8]>::to_vec),
                self.config.options.concurrency,
                |e| self.one(&core, e),
            )
            .await
            .into_iter()
            .flatten()
            .collect();
            if !done.is_empty() && core.until_ok("XACK", || self.xack(&done)).await.is_none() {
                return;
            }
        }
    }

    /// Handle one entry; `Some(id)` to acknowledge, `None` (and stop the lane) when the consumer
    /// stops first.
    async fn one(&self, core: &Core, entry: Entry) -> (Option<String>, bool) {
        if entry.fields.is_none() {
            // Deleted (e.g. trimmed) while pending: there is nothing left to handle.
            return (Some(entry.id), true);
        }
        let decoded = self.decode(&entry);
        // Between retries, reset the entry's idle time so that no other consumer of the group
        // takes it over while this one still works on it.
        let progress_every = Some(self.config.claim_idle / 2);
        let progress = || async {
            if let Err(e) = self.touch(&entry.id).await {
                tracing::debug!(consumer = %core.name, error = %redact_url(&e.to_string()), "XCLAIM to keep an entry failed");
            }
        };
        match core.settle(decoded, progress_every, progress).await {
            Verdict::Ack => (Some(entry.id), true),
            Verdict::Dead { reason, attempts } => {
                match core
                    .until_ok("XADD of a dead letter", || {
                        self.dead_letter(&entry, &reason, attempts)
                    })
                    .await
                {
                    Some(()) => (Some(entry.id), true),
                    None => (None, false),
                }
            }
            Verdict::Stopped => (None, false),
        }
    }

    fn decode(&self, entry: &Entry) -> Result<Delivery, DecodeError> {
        let source = Source::Redis {
            stream: self.config.stream.clone(),
            entry_id: entry.id.clone(),
        };
        let user = match entry.field("headers") {
            Some(text) => json_headers(text).map_err(|problem| DecodeError {
                source_text: source.to_string(),
                problem,
            })?,
            None => Vec::new(),
        };
        if entry.field("id").is_none() {
            if let Some(data) = entry.field("data") {
                // A CloudEvents envelope: `ce-` and `content-type` fields, the body in `data`.
                let mut raw = RawEnvelope::default();
                for (name, value) in entry.fields.iter().flatten() {
                    match std::str::from_utf8(name) {
                        Ok("data" | "headers") | Err(_) => {}
                        Ok(name) => raw.header(name, value),
                    }
                }
                raw.headers
                    .extend(user.iter().map(|(n, v)| (n.as_str(), v.as_bytes())));
                return raw.decode(data, source);
            }
        }
        let raw = RawEnvelope {
            message_id: entry.field("id"),
            event_type: entry.field("event_type"),
            aggregate_type: entry.field("aggregate_type"),
            aggregate_id: entry.field("aggregate_id"),
            partition_key: entry.field("partition_key"),
            headers: user
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_bytes()))
                .collect(),
            names: Some(REDIS_FIELD_NAMES),
            content_type: entry.field("content_type").map(|v| ("content_type", v)),
            ..RawEnvelope::default()
        };
        let Some(payload) = entry.field("payload") else {
            return Err(DecodeError {
                source_text: source.to_string(),
                problem: "no \"payload\" field; outbox publishers always write it".into(),
            });
        };
        raw.decode(payload, source)
    }

    async fn read(&self, from: &str, block: Option<Duration>) -> redis::RedisResult<Vec<Entry>> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg("COUNT")
            .arg(self.config.options.batch);
        if let Some(block) = block {
            cmd.arg("BLOCK")
                .arg(u64::try_from(block.as_millis()).unwrap_or(u64::MAX).max(1));
        }
        cmd.arg("STREAMS").arg(&self.config.stream).arg(from);
        let reply: Value = cmd.query_async(&mut self.connection.clone()).await?;
        // Nil: nothing new within the block time. Otherwise [[stream, [entries]]].
        let mut out = Vec::new();
        if let Value::Array(streams) = reply {
            for stream in streams {
                if let Value::Array(mut parts) = stream {
                    if parts.len() == 2 {
                        out.extend(entries(parts.swap_remove(1))?);
                    }
                }
            }
        }
        Ok(out)
    }

    async fn claim(&self, cursor: &mut String) -> redis::RedisResult<Vec<Entry>> {
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg(u64::try_from(self.config.claim_idle.as_millis()).unwrap_or(u64::MAX))
            .arg(cursor.as_str())
            .arg("COUNT")
            .arg(self.config.options.batch)
            .query_async(&mut self.connection.clone())
            .await?;
        // [next cursor, [entries], [deleted ids]]
        let Value::Array(mut parts) = reply else {
            return Err(unexpected("XAUTOCLAIM"));
        };
        if parts.len() < 2 {
            return Err(unexpected("XAUTOCLAIM"));
        }
        let claimed = parts.swap_remove(1);
        *cursor = redis::from_redis_value(&parts[0])?;
        let claimed = entries(claimed)?;
        if !claimed.is_empty() {
            tracing::info!(consumer = %self.config.group, count = claimed.len(), "took over entries idle for {:?}", self.config.claim_idle);
        }
        Ok(claimed)
    }

    /// `XCLAIM ... 0 id JUSTID`: keep the entry, resetting its idle time.
    async fn touch(&self, id: &str) -> redis::RedisResult<()> {
        redis::cmd("XCLAIM")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(&self.config.consumer)
            .arg(0)
            .arg(id)
            .arg("JUSTID")
            .query_async::<Value>(&mut self.connection.clone())
            .await
            .map(|_| ())
    }

    async fn xack(&self, ids: &[String]) -> redis::RedisResult<()> {
        redis::cmd("XACK")
            .arg(&self.config.stream)
            .arg(&self.config.group)
            .arg(ids)
            .query_async::<Value>(&mut self.connection.clone())
            .await
            .map(|_| ())
    }

    async fn dead_letter(
        &self,
        entry: &Entry,
        reason: &str,
        attempts: u32,
    ) -> redis::RedisResult<()> {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.config.dead_letter_stream).arg("*");
        for (name, value) in entry.fields.iter().flatten() {
            cmd.arg(name.as_slice()).arg(value.as_slice());
        }
        cmd.arg(DEAD_REASON)
            .arg(reason)
            .arg(DEAD_ATTEMPTS)
            .arg(attempts)
            .arg(DEAD_SOURCE)
            .arg(format!(
                "redis stream {} entry {}",
                self.config.stream, entry.id
            ))
            .arg(DEAD_CONSUMER)
            .arg(&self.config.group);
        cmd.query_async::<Value>(&mut self.connection.clone())
            .await
            .map(|_| ())
    }
}

/// `XGROUP CREATE ... 0 MKSTREAM`; an existing group is fine.
async fn create_group(
    connection: &mut ConnectionManager,
    config: &RedisConsumerConfig,
) -> redis::RedisResult<()> {
    let created: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&config.stream)
        .arg(&config.group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(connection)
        .await;
    match created {
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        other => other,
    }
}

fn unexpected(what: &str) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::TypeError,
        "unexpected reply",
        what.to_owned(),
    ))
}

/// Parse `[[id, [field, value, ...] | nil], ...]`.
fn entries(value: Value) -> redis::RedisResult<Vec<Entry>> {
    let Value::Array(items) = value else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Value::Array(mut pair) = item else {
            return Err(unexpected("stream entry"));
        };
        if pair.len() != 2 {
            return Err(unexpected("stream entry"));
        }
        let body = pair.pop();
        let id: String = redis::from_redis_value(&pair[0])?;
        let fields = match body {
            Some(Value::Array(flat)) => {
                let mut fields = Vec::with_capacity(flat.len() / 2);
                let mut flat = flat.into_iter();
                while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
                    fields.push((bytes(name)?, bytes(value)?));
                }
                Some(fields)
            }
            _ => None,
        };
        out.push(Entry { id, fields });
    }
    Ok(out)
}

fn bytes(value: Value) -> redis::RedisResult<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Ok(bytes),
        Value::SimpleString(text) => Ok(text.into_bytes()),
        other => redis::from_redis_value(&other),
    }
}
