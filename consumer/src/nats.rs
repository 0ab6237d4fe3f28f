//! NATS JetStream: a durable pull consumer with explicit acknowledgements.

use std::sync::Arc;
use std::time::Duration;

use async_nats::header::HeaderValue;
use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::StreamExt;
use outbox_traits::Error;
use outbox_url::{read_secret_file, redact_url};
use tokio_util::sync::CancellationToken;

use crate::core::{broker_pause, in_lanes, Core, Verdict};
use crate::delivery::{DecodeError, Delivery, RawEnvelope, Source};
use crate::handler::Handler;
use crate::options::{self, ConsumerOptions};
use crate::telemetry::Meters;
use crate::{DEAD_ATTEMPTS, DEAD_CONSUMER, DEAD_REASON, DEAD_SOURCE};

const BROKER: &str = "NATS";

/// The query options [`NatsConsumerConfig::from_url`] understands besides
/// [`COMMON_URL_OPTIONS`](crate::COMMON_URL_OPTIONS).
pub const NATS_URL_OPTIONS: &[&str] = &[
    "stream",
    "consumer",
    "subject",
    "dead_subject",
    "dead_stream",
    "ack_wait_ms",
    "timeout_ms",
    "tls_required",
    "ca_file",
    "cert_file",
    "key_file",
    "password_file",
    "token_file",
    "nkey_file",
    "creds_file",
];

pub use outbox_publisher_nats::{NatsAuth, NatsSecurity};

/// How long one pull request waits for messages.
const PULL_EXPIRES: Duration = Duration::from_secs(2);

/// Default [`NatsConsumerConfig::ack_wait`].
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Default connection and request timeout.
pub const DEFAULT_NATS_TIMEOUT: Duration = Duration::from_secs(5);

/// Everything [`NatsConsumer::connect`] needs: built with [`NatsConsumerConfig::builder`] or
/// [`NatsConsumerConfig::from_url`], both of which check it, and read with getters of the same
/// names. `Debug` shows the URL without its password.
///
/// ```
/// use std::time::Duration;
/// use outbox_consumer::nats::NatsConsumerConfig;
/// let config = NatsConsumerConfig::builder("nats://127.0.0.1:4222", "OUTBOX", "payments")
///     .subject("outbox.order.>")
///     .ack_wait(Duration::from_secs(10))
///     .build()?;
/// assert_eq!(config.dead_letter_subject(), "dead.OUTBOX.payments");
/// assert!(NatsConsumerConfig::builder("nats://h:4222", "A.B", "c").build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Clone)]
pub struct NatsConsumerConfig {
    /// Server URL, e.g. `nats://user:pass@127.0.0.1:4222` (credentials never appear in errors).
    pub(crate) url: String,
    /// The stream to consume (it must exist: the relay's publisher creates it).
    pub(crate) stream: String,
    /// The durable consumer's name; created on first connect. Processes that share it share
    /// the messages. Also the `consumer` label of the metrics.
    pub(crate) consumer: String,
    /// Only messages of this subject (wildcards allowed); `None`: the whole stream.
    pub(crate) subject: Option<String>,
    /// Subject of dead letters. Default: `dead.<stream>.<consumer>`.
    pub(crate) dead_letter_subject: String,
    /// A stream to create (if missing) for the dead letters: it captures `dead.<stream>.>` when
    /// the dead-letter subject is under it (the default: every consumer of the stream shares
    /// it), else the dead-letter subject itself. Default: `Some("<stream>_DEAD")`. With `None`,
    /// a stream must already capture the dead-letter subject; `connect` checks it (also when an
    /// existing stream of this name captures other subjects).
    pub(crate) dead_letter_stream: Option<String>,
    /// How long JetStream waits for an acknowledgement before redelivering. While a message is
    /// between retries the consumer tells JetStream it is in progress every half of this; a
    /// single handler call longer than this gets the message redelivered meanwhile. It is set
    /// when the durable consumer is created; an existing one keeps its own. Default:
    /// [`DEFAULT_ACK_WAIT`].
    pub(crate) ack_wait: Duration,
    /// Connection and request timeout. Default: [`DEFAULT_NATS_TIMEOUT`].
    pub(crate) timeout: Duration,
    /// Retries, batch size and concurrency.
    pub(crate) options: ConsumerOptions,
    /// TLS and credentials: the same settings, URL options and semantics as the NATS
    /// publisher's ([`NatsSecurity`]). Its `Debug` shows no secret.
    pub(crate) security: NatsSecurity,
}

impl std::fmt::Debug for NatsConsumerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConsumerConfig")
            .field("url", &redact_url(&self.url))
            .field("stream", &self.stream)
            .field("consumer", &self.consumer)
            .field("subject", &self.subject)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .field("ack_wait", &self.ack_wait)
            .field("timeout", &self.timeout)
            .field("options", &self.options)
            .field("security", &self.security)
            .finish()
    }
}

impl NatsConsumerConfig {
    /// A builder for durable consumer `consumer` of `stream` on the server at `url`,
    /// starting from the defaults; finish with [`NatsConsumerConfigBuilder::build`].
    pub fn builder(
        url: impl Into<String>,
        stream: &str,
        consumer: &str,
    ) -> NatsConsumerConfigBuilder {
        NatsConsumerConfigBuilder {
            config: Self::defaults(url, stream, consumer),
        }
    }

    /// Server URL, e.g. `nats://user:pass@127.0.0.1:4222` (credentials never appear in errors).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The stream to consume (it must exist: the relay's publisher creates it).
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The durable consumer's name; created on first connect. Processes that share it share
    /// the messages. Also the `consumer` label of the metrics.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Only messages of this subject (wildcards allowed); `None`: the whole stream.
    pub fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }

    /// Subject of dead letters. Default: `dead.<stream>.<consumer>`.
    pub fn dead_letter_subject(&self) -> &str {
        &self.dead_letter_subject
    }

    /// A stream to create (if missing) for the dead letters: it captures `dead.<stream>.>` when
    /// the dead-letter subject is under it (the default: every consumer of the stream shares
    /// it), else the dead-letter subject itself. Default: `Some("<stream>_DEAD")`. With `None`,
    /// a stream must already capture the dead-letter subject; `connect` checks it (also when an
    /// existing stream of this name captures other subjects).
    pub fn dead_letter_stream(&self) -> Option<&str> {
        self.dead_letter_stream.as_deref()
    }

    /// How long JetStream waits for an acknowledgement before redelivering. While a message is
    /// between retries the consumer tells JetStream it is in progress every half of this; a
    /// single handler call longer than this gets the message redelivered meanwhile. It is set
    /// when the durable consumer is created; an existing one keeps its own. Default:
    /// [`DEFAULT_ACK_WAIT`].
    pub fn ack_wait(&self) -> Duration {
        self.ack_wait
    }

    /// Connection and request timeout. Default: [`DEFAULT_NATS_TIMEOUT`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Retries, batch size and concurrency.
    pub fn options(&self) -> &ConsumerOptions {
        &self.options
    }

    /// TLS and credentials: the same settings, URL options and semantics as the NATS
    /// publisher's ([`NatsSecurity`]). Its `Debug` shows no secret.
    pub fn security(&self) -> &NatsSecurity {
        &self.security
    }

    /// The configuration with the defaults for `stream` and durable consumer `consumer`.
    fn defaults(url: impl Into<String>, stream: &str, consumer: &str) -> Self {
        Self {
            url: url.into(),
            stream: stream.to_owned(),
            consumer: consumer.to_owned(),
            subject: None,
            dead_letter_subject: format!("dead.{stream}.{consumer}"),
            dead_letter_stream: Some(format!("{stream}_DEAD")),
            ack_wait: DEFAULT_ACK_WAIT,
            timeout: DEFAULT_NATS_TIMEOUT,
            options: ConsumerOptions::default(),
            security: NatsSecurity::default(),
        }
    }

    /// Parse `nats://[user:pass@]host:4222?stream=ORDERS&consumer=payments[&subject=orders.>]`.
    ///
    /// Options: [`NATS_URL_OPTIONS`] (`stream` and `consumer` required; `dead_subject`,
    /// `dead_stream` (empty: none), `ack_wait_ms`, `timeout_ms`) and
    /// [`COMMON_URL_OPTIONS`](crate::COMMON_URL_OPTIONS). An unknown option, a bad value or a
    /// missing required one gives [`Error::InvalidInput`] naming the valid options.
    ///
    /// ```
    /// use outbox_consumer::nats::NatsConsumerConfig;
    /// let c = NatsConsumerConfig::from_url(
    ///     "nats://127.0.0.1:4222?stream=OUTBOX&consumer=payments&subject=outbox.order.>&max_attempts=3",
    /// ).unwrap();
    /// assert_eq!(c.url(), "nats://127.0.0.1:4222");
    /// assert_eq!(c.dead_letter_subject(), "dead.OUTBOX.payments");
    /// assert_eq!(c.options().retry.max_attempts, 3);
    /// assert!(NatsConsumerConfig::from_url("nats://h?stream=S&consumer=c&colour=red").is_err());
    /// ```
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let shown = redact_url(url);
        let parsed = url::Url::parse(url).map_err(|e| {
            Error::invalid_input(format!("NATS consumer URL {shown:?} is not a URL: {e}"))
        })?;
        if !matches!(parsed.scheme(), "nats" | "tls" | "ws" | "wss") {
            return Err(Error::invalid_input(format!(
                "NATS consumer URL {shown:?} has scheme {:?}; use nats:// (or tls://, ws://, wss://)",
                parsed.scheme()
            )));
        }
        let (mut stream, mut consumer) = (None, None);
        let (mut subject, mut dead_subject, mut dead_stream) = (None, None, None);
        let (mut ack_wait, mut timeout) = (DEFAULT_ACK_WAIT, DEFAULT_NATS_TIMEOUT);
        let mut common = ConsumerOptions::default();
        let mut security = NatsSecurity {
            tls_required: parsed.scheme() == "tls",
            ..NatsSecurity::default()
        };
        let (mut password_file, mut auths) = (None, Vec::new());
        for (key, value) in parsed.query_pairs() {
            let value = value.into_owned();
            match key.as_ref() {
                "tls_required" => {
                    security.tls_required = match value.as_str() {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        _ => {
                            return Err(Error::invalid_input(format!(
                                "NATS option tls_required={value:?} is not a boolean; use true \
                                 or false"
                            )))
                        }
                    }
                }
                "ca_file" => security.ca_file = Some(value.into()),
                "cert_file" => security.cert_file = Some(value.into()),
                "key_file" => security.key_file = Some(value.into()),
                "password_file" => {
                    password_file = Some(read_secret_file(BROKER, &key, &value)?);
                }
                "token_file" => {
                    auths.push(NatsAuth::Token(read_secret_file(BROKER, &key, &value)?))
                }
                "nkey_file" => {
                    auths.push(NatsAuth::NkeySeed(read_secret_file(BROKER, &key, &value)?));
                }
                "creds_file" => auths.push(NatsAuth::CredsFile(value.into())),
                "stream" => stream = Some(value),
                "consumer" => consumer = Some(value),
                "subject" => subject = Some(value),
                "dead_subject" => dead_subject = Some(value),
                "dead_stream" => dead_stream = Some(value),
                "ack_wait_ms" => ack_wait = options::millis(BROKER, &key, &value)?,
                "timeout_ms" => timeout = options::millis(BROKER, &key, &value)?,
                other => {
                    if !common.apply(BROKER, other, &value)? {
                        return Err(options::unknown_option(
                            BROKER,
                            other,
                            &shown,
                            NATS_URL_OPTIONS,
                        ));
                    }
                }
            }
        }
        let example = "?stream=OUTBOX&consumer=payments";
        let stream =
            stream.ok_or_else(|| options::missing_option(BROKER, "stream", &shown, example))?;
        let consumer =
            consumer.ok_or_else(|| options::missing_option(BROKER, "consumer", &shown, example))?;
        let decode = |text: &str| {
            percent_encoding::percent_decode_str(text)
                .decode_utf8_lossy()
                .into_owned()
        };
        let user = decode(parsed.username());
        match (
            user.is_empty(),
            parsed.password().map(decode).or(password_file),
        ) {
            (true, None) => {}
            (false, None) => auths.push(NatsAuth::Token(user)),
            (false, Some(password)) => auths.push(NatsAuth::UserPassword { user, password }),
            (true, Some(_)) => {
                return Err(Error::invalid_input(format!(
                    "NATS consumer URL {shown:?} has a password but no user name; write \
                     nats://USER@host:4222?password_file=... (or USER:PASSWORD@)"
                )))
            }
        }
        if auths.len() > 1 {
            return Err(Error::invalid_input(format!(
                "NATS consumer URL {shown:?} gives more than one kind of credentials; use one \
                 of: user:password@ (or user@ with password_file=), token@ (or token_file=), \
                 nkey_file=, creds_file="
            )));
        }
        security.auth = auths.pop().unwrap_or_default();
        let mut server = parsed.clone();
        // The credentials are in `security`; the URL keeps none, so it can be shown.
        let _ = server.set_username("");
        let _ = server.set_password(None);
        server.set_query(None);
        server.set_fragment(None);
        let mut config =
            Self::defaults(server.to_string().trim_end_matches('/'), &stream, &consumer);
        config.security = security;
        config.subject = subject;
        if let Some(dead_subject) = dead_subject {
            config.dead_letter_subject = dead_subject;
        }
        if let Some(dead_stream) = dead_stream {
            config.dead_letter_stream = (!dead_stream.is_empty()).then_some(dead_stream);
        }
        config.ack_wait = ack_wait;
        config.timeout = timeout;
        config.options = common;
        config.validate()?;
        Ok(config)
    }

    /// The subject filter of the dead-letter stream [`NatsConsumer::connect`] creates: every
    /// consumer's default dead-letter subject (`dead.<stream>.>`) when the dead-letter subject
    /// is under it, else the dead-letter subject itself.
    fn dead_letter_stream_subject(&self) -> String {
        let shared = format!("dead.{}.", self.stream);
        if self.dead_letter_subject.starts_with(&shared) {
            format!("{shared}>")
        } else {
            self.dead_letter_subject.clone()
        }
    }

    /// Check the values without connecting.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        self.options.validate()?;
        for (what, name) in [("stream", &self.stream), ("consumer", &self.consumer)] {
            options::non_empty(BROKER, what, name)?;
            if name.contains(['.', '*', '>', ' ', '\t', '/', '\\']) {
                return Err(Error::invalid_input(format!(
                    "NATS {what} name {name:?} may not contain '.', '*', '>', '/', '\\' or \
                     whitespace"
                )));
            }
        }
        options::non_empty(BROKER, "dead-letter subject", &self.dead_letter_subject)?;
        self.security.validate()?;
        if self.ack_wait < Duration::from_millis(100) {
            return Err(Error::invalid_input(format!(
                "NATS ack_wait {:?} is too short (at least 100 ms; default 30 s)",
                self.ack_wait
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid_input(
                "NATS timeout must be positive (timeout_ms=5000, for example)",
            ));
        }
        Ok(())
    }
}

/// Builder of [`NatsConsumerConfig`] ([`NatsConsumerConfig::builder`]); [`NatsConsumerConfigBuilder::build`] checks every setting.
/// `Debug` is the config's: no secret shows.
#[derive(Clone)]
pub struct NatsConsumerConfigBuilder {
    config: NatsConsumerConfig,
}

impl std::fmt::Debug for NatsConsumerConfigBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("NatsConsumerConfigBuilder")
            .field(&self.config)
            .finish()
    }
}

impl NatsConsumerConfigBuilder {
    /// Only messages of this subject (wildcards allowed); `None`: the whole stream.
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.config.subject = Some(subject.into());
        self
    }

    /// Subject of dead letters. Default: `dead.<stream>.<consumer>`.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.config.dead_letter_subject = subject.into();
        self
    }

    /// A stream to create (if missing) for the dead letters: it captures `dead.<stream>.>` when
    /// the dead-letter subject is under it (the default: every consumer of the stream shares
    /// it), else the dead-letter subject itself. Default: `Some("<stream>_DEAD")`. With `None`,
    /// a stream must already capture the dead-letter subject; `connect` checks it (also when an
    /// existing stream of this name captures other subjects).
    pub fn dead_letter_stream(mut self, stream: Option<String>) -> Self {
        self.config.dead_letter_stream = stream;
        self
    }

    /// How long JetStream waits for an acknowledgement before redelivering. While a message is
    /// between retries the consumer tells JetStream it is in progress every half of this; a
    /// single handler call longer than this gets the message redelivered meanwhile. It is set
    /// when the durable consumer is created; an existing one keeps its own. Default:
    /// [`DEFAULT_ACK_WAIT`].
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.config.ack_wait = ack_wait;
        self
    }

    /// Connection and request timeout. Default: [`DEFAULT_NATS_TIMEOUT`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// Retries, batch size and concurrency.
    pub fn options(mut self, options: ConsumerOptions) -> Self {
        self.config.options = options;
        self
    }

    /// TLS and credentials: the same settings, URL options and semantics as the NATS
    /// publisher's ([`NatsSecurity`]). Its `Debug` shows no secret.
    pub fn security(mut self, security: NatsSecurity) -> Self {
        self.config.security = security;
        self
    }

    /// Check every setting without connecting; [`Error::InvalidInput`] says which one to fix.
    pub fn build(self) -> Result<NatsConsumerConfig, Error> {
        self.config.validate()?;
        Ok(self.config)
    }
}

/// A durable JetStream pull consumer. Build it with [`NatsConsumer::connect`], then
/// [`run`](NatsConsumer::run) it with your handler.
#[derive(Debug)]
pub struct NatsConsumer {
    jetstream: jetstream::Context,
    consumer: jetstream::consumer::PullConsumer,
    config: NatsConsumerConfig,
}

impl NatsConsumer {
    /// Connect, create (or open) the durable consumer and the dead-letter stream, and check that
    /// a stream captures the dead-letter subject.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad configuration, a missing stream or an uncaptured
    /// dead-letter subject; [`Error::Unavailable`] when the server cannot be reached;
    /// [`Error::Backend`] when the server refuses the consumer. No message contains the password.
    pub async fn connect(config: NatsConsumerConfig) -> Result<Self, Error> {
        config.validate()?;
        let shown = redact_url(&config.url);
        let options = config
            .security
            .apply(async_nats::ConnectOptions::new())
            .await?;
        let client = options
            .name("outbox-consumer")
            .connection_timeout(config.timeout)
            .request_timeout(Some(config.timeout))
            .reconnect_delay_callback(|attempts| {
                // At once, then doubling from 2 ms to 1 s: resume soon after an outage ends.
                let exp = u32::try_from(attempts.saturating_sub(1))
                    .unwrap_or(u32::MAX)
                    .min(10);
                if exp == 0 {
                    Duration::ZERO
                } else {
                    Duration::from_millis(2u64.saturating_pow(exp).min(1000))
                }
            })
            .connect(config.url.as_str())
            .await
            .map_err(|e| connect_error(&shown, &e))?;
        let mut jetstream = jetstream::new(client);
        jetstream.set_timeout(config.timeout);
        let backend = |what: String, e: &dyn std::fmt::Display| {
            let detail = redact_url(&e.to_string());
            Error::permanent(format!("{what} on {shown}: {detail}"), Some(detail.into()))
        };
        let stream = jetstream.get_stream(&config.stream).await.map_err(|e| {
            Error::invalid_input(format!(
                "cannot open stream {:?} on {shown}: {}; the relay's NATS publisher creates it \
                 (create_stream=true)",
                config.stream,
                redact_url(&e.to_string())
            ))
        })?;
        let consumer = stream
            .get_or_create_consumer(
                &config.consumer,
                pull::Config {
                    durable_name: Some(config.consumer.clone()),
                    filter_subject: config.subject.clone().unwrap_or_default(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    deliver_policy: jetstream::consumer::DeliverPolicy::All,
                    max_deliver: -1,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| backend(format!("cannot create consumer {:?}", config.consumer), &e))?;
        if let Some(name) = &config.dead_letter_stream {
            jetstream
                .get_or_create_stream(jetstream::stream::Config {
                    name: name.clone(),
                    subjects: vec![config.dead_letter_stream_subject()],
                    ..Default::default()
                })
                .await
                .map_err(|e| backend(format!("cannot create dead-letter stream {name:?}"), &e))?;
        }
        jetstream
            .stream_by_subject(config.dead_letter_subject.clone())
            .await
            .map_err(|e| {
                Error::invalid_input(format!(
                    "no stream on {shown} captures the dead-letter subject {:?} ({}); create \
                     one, or keep the default dead-letter subject and stream",
                    config.dead_letter_subject,
                    redact_url(&e.to_string())
                ))
            })?;
        Ok(Self {
            jetstream,
            consumer,
            config,
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &NatsConsumerConfig {
        &self.config
    }

    /// Consume until the task is dropped. See [`NatsConsumer::run_until`].
    pub async fn run(self, handler: impl Handler + 'static) {
        self.run_until(handler, CancellationToken::new()).await;
    }

    /// Consume until `shutdown` is cancelled: a message being handled is finished (and
    /// acknowledged), one waiting for a retry is left unacknowledged for redelivery. Broker
    /// outages are waited out; nothing here returns an error.
    pub async fn run_until(self, handler: impl Handler + 'static, shutdown: CancellationToken) {
        let core = Core {
            handler: Arc::new(handler),
            retry: self.config.options.retry,
            meters: Meters::new(&self.config.consumer),
            shutdown: shutdown.clone(),
            name: self.config.consumer.clone(),
        };
        let batch = self.config.options.batch;
        let mut failures = 0u32;
        while !shutdown.is_cancelled() {
            let Some(messages) = core
                .until_ok("opening the NATS message stream", || {
                    self.consumer
                        .stream()
                        .max_messages_per_batch(batch)
                        // An idle consumer renews its pull every 2 s, with heartbeats every
                        // 1 s: a pull lost to a server restart is noticed within seconds.
                        .expires(PULL_EXPIRES)
                        .messages()
                })
                .await
            else {
                break;
            };
            let mut chunks = messages.ready_chunks(batch);
            loop {
                let chunk = tokio::select! {
                    () = shutdown.cancelled() => return,
                    chunk = chunks.next() => chunk,
                };
                let Some(chunk) = chunk else { break };
                let mut ready = Vec::with_capacity(chunk.len());
                for item in chunk {
                    match item {
                        Ok(message) => ready.push(message),
                        Err(e) => {
                            core.meters.broker_error();
                            tracing::warn!(consumer = %core.name, error = %redact_url(&e.to_string()), "NATS message stream error");
                        }
                    }
                }
                if ready.is_empty() {
                    failures = failures.saturating_add(1);
                    if !core.pause(broker_pause(failures)).await {
                        return;
                    }
                    continue;
                }
                failures = 0;
                in_lanes(
                    ready,
                    |m| Some(m.subject.to_string()),
                    self.config.options.concurrency,
                    |m| self.one(&core, m),
                )
                .await;
            }
        }
    }

    /// Handle one message to its end: acknowledged, or dead-lettered then acknowledged; `false`
    /// when the consumer stopped first.
    async fn one(&self, core: &Core, message: jetstream::Message) -> ((), bool) {
        let decoded = decode(&message);
        let progress_every = Some(self.config.ack_wait / 2);
        let verdict = core
            .settle(decoded, progress_every, || async {
                // Best effort: a lost progress note only risks an early redelivery.
                let _ = message.ack_with(AckKind::Progress).await;
            })
            .await;
        match verdict {
            Verdict::Ack => {}
            Verdict::Dead { reason, attempts } => {
                let stored = core
                    .until_ok("publishing a NATS dead letter", || {
                        self.dead_letter(&message, &reason, attempts)
                    })
                    .await;
                if stored.is_none() {
                    return ((), false);
                }
            }
            Verdict::Stopped => return ((), false),
        }
        if let Err(e) = message.ack().await {
            // The message comes again after ack_wait; the handler sees a duplicate.
            core.meters.broker_error();
            tracing::warn!(consumer = %core.name, error = %e, "NATS ack failed");
        }
        ((), true)
    }

    async fn dead_letter(
        &self,
        message: &jetstream::Message,
        reason: &str,
        attempts: u32,
    ) -> Result<(), Error> {
        let mut headers = message.headers.clone().unwrap_or_default();
        let source = match message.info() {
            Ok(info) => format!(
                "nats stream {} sequence {} subject {}",
                info.stream, info.stream_sequence, message.subject
            ),
            Err(_) => format!("nats subject {}", message.subject),
        };
        // A header value cannot hold a line break.
        let one_line = |text: &str| text.replace(['\r', '\n'], " ");
        headers.insert(DEAD_REASON, HeaderValue::from(one_line(reason).as_str()));
        headers.insert(
            DEAD_ATTEMPTS,
            HeaderValue::from(attempts.to_string().as_str()),
        );
        headers.insert(DEAD_SOURCE, HeaderValue::from(one_line(&source).as_str()));
        headers.insert(
            DEAD_CONSUMER,
            HeaderValue::from(self.config.consumer.as_str()),
        );
        let fail = |e: &dyn std::fmt::Display| {
            Error::transient(format!("dead letter not stored: {e}"), None)
        };
        self.jetstream
            .publish_with_headers(
                self.config.dead_letter_subject.clone(),
                headers,
                message.payload.clone(),
            )
            .await
            .map_err(|e| fail(&e))?
            .await
            .map_err(|e| fail(&e))?;
        Ok(())
    }
}

fn decode(message: &jetstream::Message) -> Result<Delivery, DecodeError> {
    let source = match message.info() {
        Ok(info) => Source::Nats {
            stream: info.stream.to_owned(),
            subject: message.subject.to_string(),
            stream_sequence: info.stream_sequence,
            delivered: info.delivered,
        },
        Err(_) => Source::Nats {
            stream: String::new(),
            subject: message.subject.to_string(),
            stream_sequence: 0,
            delivered: 0,
        },
    };
    let mut raw = RawEnvelope::default();
    if let Some(headers) = &message.headers {
        for (name, values) in headers.iter() {
            for value in values {
                raw.header(name.as_ref(), value.as_str().as_bytes());
            }
        }
    }
    raw.decode(&message.payload, source)
}

/// The error of a failed connect to `shown` (a URL without secrets), with the publisher's advice
/// where it has one: refused credentials (or a server that is no NATS) are permanent, anything
/// else an outage.
pub(crate) fn connect_error(shown: &str, e: &async_nats::ConnectError) -> Error {
    use async_nats::ConnectErrorKind as K;
    let detail = redact_url(&outbox_url::error_chain_line(e));
    let message = match outbox_publisher_nats::connect_fix(&detail, e.kind()) {
        Some(fix) => format!("cannot connect to {shown}: {detail}; {fix}"),
        None => format!("cannot connect to {shown}: {detail}"),
    };
    match e.kind() {
        K::Authentication | K::AuthorizationViolation | K::ServerParse => {
            Error::permanent(message, Some(detail.into()))
        }
        _ => Error::unavailable("nats", message, detail),
    }
}
