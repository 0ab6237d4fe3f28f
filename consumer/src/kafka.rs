//! Kafka: a consumer group through librdkafka, auto-commit off, offsets committed after the
//! handler.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use outbox_traits::Error;
use outbox_url::redact_url;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::core::{broker_pause, in_lanes, Core, Verdict};
use crate::delivery::{DecodeError, Delivery, RawEnvelope, Source};
use crate::handler::Handler;
use crate::options::{self, ConsumerOptions};
use crate::telemetry::Meters;
use crate::{DEAD_ATTEMPTS, DEAD_CONSUMER, DEAD_REASON, DEAD_SOURCE};

const BROKER: &str = "Kafka";

/// The query options [`KafkaConsumerConfig::from_url`] understands besides
/// [`COMMON_URL_OPTIONS`](crate::COMMON_URL_OPTIONS) and librdkafka properties.
pub const KAFKA_URL_OPTIONS: &[&str] = &[
    "topic",
    "group",
    "dead_topic",
    "timeout_ms",
    "password_file",
];

/// librdkafka properties the consumer sets itself; giving them is refused.
const OWN_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
];

/// Default timeout of a dead-letter write and of topic creation.
pub const DEFAULT_KAFKA_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything [`KafkaConsumer::connect`] needs: built with [`KafkaConsumerConfig::builder`] or
/// [`KafkaConsumerConfig::from_url`], both of which check it, and read with getters of the same
/// names. `Debug` hides secret properties.
///
/// ```
/// use outbox_consumer::kafka::KafkaConsumerConfig;
/// let config = KafkaConsumerConfig::builder("127.0.0.1:9092", "outbox.order", "payments")
///     .property("session.timeout.ms", "6000")
///     .build()?;
/// assert_eq!(config.dead_letter_topic(), "outbox.order.dead");
/// assert!(KafkaConsumerConfig::builder("", "t", "g").build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Clone)]
pub struct KafkaConsumerConfig {
    /// `bootstrap.servers`: `host:port[,host:port]`.
    pub(crate) brokers: String,
    /// The topic to consume.
    pub(crate) topic: String,
    /// The consumer group (`group.id`); also the `consumer` label of the metrics. A new group
    /// starts at the earliest offset, so messages published before it existed are consumed.
    pub(crate) group: String,
    /// Topic of dead letters, created (one partition, the broker's default replication) if
    /// missing. Default: `<topic>.dead`.
    pub(crate) dead_letter_topic: String,
    /// Further librdkafka properties (e.g. `session.timeout.ms`, `security.protocol`,
    /// `sasl.username`); they apply to the consumer and to the dead-letter producer.
    ///
    /// **Static membership**: give each consumer process a stable, unique
    /// `group.instance.id` (e.g. the pod's name) and a process restarted under the same id
    /// after a crash takes its partitions back without a rebalance of the group and without
    /// waiting for the dead member's session timeout (`examples/kafka_static_membership.rs`
    /// measured 8 s on Tansu against 18 s for a dynamic member, with a 10 s session timeout).
    /// The other side: a static member that stops for good keeps its partitions unconsumed
    /// until its session timeout ends, even after a graceful shutdown.
    pub(crate) properties: BTreeMap<String, String>,
    /// Timeout of a dead-letter write and of topic creation. Default:
    /// [`DEFAULT_KAFKA_TIMEOUT`].
    pub(crate) timeout: Duration,
    /// Retries, batch size and concurrency.
    pub(crate) options: ConsumerOptions,
}

impl std::fmt::Debug for KafkaConsumerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let shown = if outbox_url::is_secret_option(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConsumerConfig")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("properties", &properties)
            .field("timeout", &self.timeout)
            .field("options", &self.options)
            .finish()
    }
}

impl KafkaConsumerConfig {
    /// A builder for consumer group `group` of topic `topic` on the cluster at `brokers`,
    /// starting from the defaults; finish with [`KafkaConsumerConfigBuilder::build`].
    pub fn builder(
        brokers: impl Into<String>,
        topic: &str,
        group: &str,
    ) -> KafkaConsumerConfigBuilder {
        KafkaConsumerConfigBuilder {
            config: Self::defaults(brokers, topic, group),
        }
    }

    /// `bootstrap.servers`: `host:port[,host:port]`.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// The topic to consume.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The consumer group (`group.id`); also the `consumer` label of the metrics. A new group
    /// starts at the earliest offset, so messages published before it existed are consumed.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// Topic of dead letters, created (one partition, the broker's default replication) if
    /// missing. Default: `<topic>.dead`.
    pub fn dead_letter_topic(&self) -> &str {
        &self.dead_letter_topic
    }

    /// Further librdkafka properties (e.g. `session.timeout.ms`, `security.protocol`,
    /// `sasl.username`); they apply to the consumer and to the dead-letter producer.
    ///
    /// **Static membership**: give each consumer process a stable, unique
    /// `group.instance.id` (e.g. the pod's name) and a process restarted under the same id
    /// after a crash takes its partitions back without a rebalance of the group and without
    /// waiting for the dead member's session timeout (`examples/kafka_static_membership.rs`
    /// measured 8 s on Tansu against 18 s for a dynamic member, with a 10 s session timeout).
    /// The other side: a static member that stops for good keeps its partitions unconsumed
    /// until its session timeout ends, even after a graceful shutdown.
    pub fn properties(&self) -> &BTreeMap<String, String> {
        &self.properties
    }

    /// Timeout of a dead-letter write and of topic creation. Default:
    /// [`DEFAULT_KAFKA_TIMEOUT`].
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Retries, batch size and concurrency.
    pub fn options(&self) -> &ConsumerOptions {
        &self.options
    }

    /// The configuration with the defaults for `topic` and `group`.
    fn defaults(brokers: impl Into<String>, topic: &str, group: &str) -> Self {
        Self {
            brokers: brokers.into(),
            topic: topic.to_owned(),
            group: group.to_owned(),
            dead_letter_topic: format!("{topic}.dead"),
            properties: BTreeMap::new(),
            timeout: DEFAULT_KAFKA_TIMEOUT,
            options: ConsumerOptions::default(),
        }
    }

    /// Parse `kafka://[user:password@]host:9092[,host:9092]?topic=outbox.order&group=payments`.
    ///
    /// Options: [`KAFKA_URL_OPTIONS`] (`topic` and `group` required; `dead_topic`,
    /// `timeout_ms`), [`COMMON_URL_OPTIONS`](crate::COMMON_URL_OPTIONS), and any librdkafka
    /// property (a dotted name such as `session.timeout.ms`). `user:password@` becomes
    /// `sasl.username` / `sasl.password`; `password_file=PATH` reads the SASL password from a
    /// file instead, as the Kafka publisher does. TLS is librdkafka's, as for the publisher:
    /// `security.protocol=SSL` (or `SASL_SSL`), `ssl.ca.location`, `ssl.certificate.location`,
    /// `ssl.key.location`. Anything else gives [`Error::InvalidInput`] naming the
    /// valid options; values are checked by librdkafka itself. Errors never show the password.
    ///
    /// ```
    /// use outbox_consumer::kafka::KafkaConsumerConfig;
    /// let c = KafkaConsumerConfig::from_url(
    ///     "kafka://127.0.0.1:9092?topic=outbox.order&group=payments&session.timeout.ms=6000",
    /// ).unwrap();
    /// assert_eq!(c.brokers(), "127.0.0.1:9092");
    /// assert_eq!(c.dead_letter_topic(), "outbox.order.dead");
    /// assert_eq!(c.properties()["session.timeout.ms"], "6000");
    /// assert!(KafkaConsumerConfig::from_url("kafka://h:9092?topic=t&group=g&colour=red").is_err());
    /// ```
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let shown = redact_url(url);
        let rest = url.strip_prefix("kafka://").ok_or_else(|| {
            Error::invalid_input(format!(
                "Kafka consumer URL {shown:?} must start with kafka://, e.g. \
                 kafka://127.0.0.1:9092?topic=outbox.order&group=payments"
            ))
        })?;
        let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
        let authority = authority.trim_end_matches('/');
        if authority.contains('/') {
            return Err(Error::invalid_input(format!(
                "Kafka consumer URL {shown:?} has a path; a Kafka URL has none (set ?topic=...)"
            )));
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        if hosts.split(',').any(|h| {
            h.trim()
                .rsplit_once(':')
                .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
        }) {
            return Err(Error::invalid_input(format!(
                "Kafka consumer URL {shown:?}: give each broker as host:port, separated by commas"
            )));
        }
        let (mut topic, mut group, mut dead) = (None, None, None);
        let mut properties = BTreeMap::new();
        if let Some(userinfo) = userinfo {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            let decode = |s: &str| {
                percent_decode(s).ok_or_else(|| {
                    Error::invalid_input(format!(
                        "Kafka consumer URL {shown:?} has badly percent-encoded credentials"
                    ))
                })
            };
            properties.insert("sasl.username".to_owned(), decode(user)?);
            if !password.is_empty() {
                properties.insert("sasl.password".to_owned(), decode(password)?);
            }
        }
        let mut timeout = DEFAULT_KAFKA_TIMEOUT;
        let mut common = ConsumerOptions::default();
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            let (key, value) = (key.into_owned(), value.into_owned());
            match key.as_str() {
                "topic" => topic = Some(value),
                "group" => group = Some(value),
                "dead_topic" => dead = Some(value),
                "timeout_ms" => timeout = options::millis(BROKER, &key, &value)?,
                "password_file" => {
                    if properties.contains_key("sasl.password") {
                        return Err(Error::invalid_input(format!(
                            "Kafka consumer URL {shown:?} has both a password and \
                             password_file; give one"
                        )));
                    }
                    let password = outbox_url::read_secret_file(BROKER, &key, &value)?;
                    properties.insert("sasl.password".to_owned(), password);
                }
                _ if key.contains('.') => {
                    properties.insert(key, value);
                }
                other => {
                    if !common.apply(BROKER, other, &value)? {
                        let mut own = KAFKA_URL_OPTIONS.to_vec();
                        own.push("any dotted librdkafka property");
                        return Err(options::unknown_option(BROKER, other, &shown, &own));
                    }
                }
            }
        }
        let example = "?topic=outbox.order&group=payments";
        let topic =
            topic.ok_or_else(|| options::missing_option(BROKER, "topic", &shown, example))?;
        let group =
            group.ok_or_else(|| options::missing_option(BROKER, "group", &shown, example))?;
        let mut config = Self::defaults(hosts, &topic, &group);
        if let Some(dead) = dead {
            config.dead_letter_topic = dead;
        }
        config.properties = properties;
        config.timeout = timeout;
        config.options = common;
        config.validate()?;
        Ok(config)
    }

    /// Check the values without connecting (librdkafka checks the properties).
    pub(crate) fn validate(&self) -> Result<(), Error> {
        self.options.validate()?;
        options::non_empty(BROKER, "brokers", &self.brokers)?;
        options::non_empty(BROKER, "topic", &self.topic)?;
        options::non_empty(BROKER, "group", &self.group)?;
        options::non_empty(BROKER, "dead-letter topic", &self.dead_letter_topic)?;
        if self.dead_letter_topic == self.topic {
            return Err(Error::invalid_input(format!(
                "Kafka dead-letter topic {:?} is the topic consumed; dead letters would come \
                 back (default: <topic>.dead)",
                self.topic
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::invalid_input("Kafka timeout must be positive"));
        }
        if let Some(own) = OWN_PROPERTIES
            .iter()
            .find(|p| self.properties.contains_key(**p))
        {
            return Err(Error::invalid_input(format!(
                "Kafka property {own} is set by the consumer itself (brokers, group, and offsets \
                 committed after the handler); leave it out"
            )));
        }
        self.consumer_config().create_native_config().map_err(|e| {
            Error::invalid_input(format!(
                "Kafka consumer properties refused by librdkafka: {}",
                redact_url(&e.to_string())
            ))
        })?;
        Ok(())
    }

    /// The brokers and the user's properties (TLS, SASL): what every client of this
    /// configuration starts from (also the dead-letter reader of `crate::dead`).
    pub(crate) fn base_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (name, value) in &self.properties {
            config.set(name, value);
        }
        config
    }

    fn consumer_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false");
        for (name, value) in self.base_config().config_map() {
            config.set(name, value);
        }
        config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        config
    }
}

/// Builder of [`KafkaConsumerConfig`] ([`KafkaConsumerConfig::builder`]); [`KafkaConsumerConfigBuilder::build`] checks every setting.
/// `Debug` is the config's: no secret shows.
#[derive(Clone)]
pub struct KafkaConsumerConfigBuilder {
    config: KafkaConsumerConfig,
}

impl std::fmt::Debug for KafkaConsumerConfigBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("KafkaConsumerConfigBuilder")
            .field(&self.config)
            .finish()
    }
}

impl KafkaConsumerConfigBuilder {
    /// Topic of dead letters, created (one partition, the broker's default replication) if
    /// missing. Default: `<topic>.dead`.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.config.dead_letter_topic = topic.into();
        self
    }

    /// Further librdkafka properties (e.g. `session.timeout.ms`, `security.protocol`,
    /// `sasl.username`); they apply to the consumer and to the dead-letter producer.
    ///
    /// **Static membership**: give each consumer process a stable, unique
    /// `group.instance.id` (e.g. the pod's name) and a process restarted under the same id
    /// after a crash takes its partitions back without a rebalance of the group and without
    /// waiting for the dead member's session timeout (`examples/kafka_static_membership.rs`
    /// measured 8 s on Tansu against 18 s for a dynamic member, with a 10 s session timeout).
    /// The other side: a static member that stops for good keeps its partitions unconsumed
    /// until its session timeout ends, even after a graceful shutdown.
    ///
    /// Sets one property; call it once per property.
    pub fn property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.properties.insert(name.into(), value.into());
        self
    }

    /// Timeout of a dead-letter write and of topic creation. Default:
    /// [`DEFAULT_KAFKA_TIMEOUT`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// Retries, batch size and concurrency.
    pub fn options(mut self, options: ConsumerOptions) -> Self {
        self.config.options = options;
        self
    }

    /// Check every setting without connecting; [`Error::InvalidInput`] says which one to fix.
    pub fn build(self) -> Result<KafkaConsumerConfig, Error> {
        self.config.validate()?;
        Ok(self.config)
    }
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A Kafka consumer in a consumer group. Build it with [`KafkaConsumer::connect`], then
/// [`run`](KafkaConsumer::run) it with your handler.
pub struct KafkaConsumer {
    consumer: StreamConsumer,
    producer: FutureProducer,
    config: KafkaConsumerConfig,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KafkaConsumer {
    /// Create the consumer and the dead-letter producer, create the dead-letter topic if
    /// missing, and subscribe to the topic.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad configuration; [`Error::Unavailable`] when the
    /// dead-letter topic cannot be created or checked (brokers unreachable);
    /// [`Error::Backend`] when librdkafka refuses to create a client.
    pub async fn connect(config: KafkaConsumerConfig) -> Result<Self, Error> {
        config.validate()?;
        let backend = |what: &str, e: &dyn std::fmt::Display| {
            let detail = redact_url(&e.to_string());
            Error::permanent(format!("Kafka {what}: {detail}"), Some(detail.into()))
        };
        let consumer: StreamConsumer = config
            .consumer_config()
            .create()
            .map_err(|e| backend("consumer not created", &e))?;
        let producer: FutureProducer = config
            .base_config()
            .set("message.timeout.ms", config.timeout.as_millis().to_string())
            .create()
            .map_err(|e| backend("dead-letter producer not created", &e))?;
        let admin: AdminClient<_> = config
            .base_config()
            .create()
            .map_err(|e| backend("admin client not created", &e))?;
        let created = admin
            .create_topics(
                &[NewTopic::new(
                    &config.dead_letter_topic,
                    1,
                    TopicReplication::Fixed(-1),
                )],
                &AdminOptions::new().operation_timeout(Some(config.timeout)),
            )
            .await
            .map_err(|e| {
                let detail = redact_url(&e.to_string());
                Error::unavailable(
                    "kafka",
                    format!(
                        "cannot create dead-letter topic {:?} on {}: {detail}",
                        config.dead_letter_topic, config.brokers
                    ),
                    detail,
                )
            })?;
        for result in created {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((topic, code)) => {
                    return Err(Error::unavailable(
                        "kafka",
                        format!("cannot create dead-letter topic {topic:?}: {code}"),
                        code.to_string(),
                    ))
                }
            }
        }
        consumer
            .subscribe(&[config.topic.as_str()])
            .map_err(|e| backend("subscription refused", &e))?;
        Ok(Self {
            consumer,
            producer,
            config,
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &KafkaConsumerConfig {
        &self.config
    }

    /// Consume until the task is dropped. See [`KafkaConsumer::run_until`].
    pub async fn run(self, handler: impl Handler + 'static) {
        self.run_until(handler, CancellationToken::new()).await;
    }

    /// Consume until `shutdown` is cancelled: a message being handled is finished and its
    /// offset committed; a message waiting for a retry is left uncommitted (the group gets it
    /// again). Each batch is split into partitions handled side by side (each in order), and
    /// the offsets of the handled (or dead-lettered) messages are committed in one call.
    pub async fn run_until(self, handler: impl Handler + 'static, shutdown: CancellationToken) {
        let core = Core {
            handler: Arc::new(handler),
            retry: self.config.options.retry,
            meters: Meters::new(&self.config.group),
            shutdown: shutdown.clone(),
            name: self.config.group.clone(),
        };
        let batch = self.config.options.batch;
        let mut chunks = self.consumer.stream().ready_chunks(batch);
        let mut failures = 0u32;
        loop {
            let chunk = tokio::select! {
                () = shutdown.cancelled() => return,
                chunk = chunks.next() => chunk,
            };
            let Some(chunk) = chunk else { return };
            let mut ready = Vec::with_capacity(chunk.len());
            for item in chunk {
                match item {
                    Ok(message) => ready.push(message.detach()),
                    Err(e) => {
                        core.meters.broker_error();
                        tracing::warn!(consumer = %core.name, error = %redact_url(&e.to_string()), "Kafka consumer error");
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
            let done = in_lanes(
                ready,
                |m| Some(m.partition()),
                self.config.options.concurrency,
                |m| self.one(&core, m),
            )
            .await;
            let mut next: HashMap<i32, i64> = HashMap::new();
            for (partition, offset) in done.into_iter().flatten() {
                let at = next.entry(partition).or_insert(offset + 1);
                *at = (*at).max(offset + 1);
            }
            if !next.is_empty() {
                self.commit(&core, &next);
            }
        }
    }

    fn commit(&self, core: &Core, next: &HashMap<i32, i64>) {
        let mut list = TopicPartitionList::new();
        for (partition, offset) in next {
            if let Err(e) =
                list.add_partition_offset(&self.config.topic, *partition, Offset::Offset(*offset))
            {
                tracing::warn!(consumer = %core.name, error = %e, "Kafka offset not added");
            }
        }
        // Asynchronous: a lost commit is covered by the next one, or the messages come again
        // (the handler sees duplicates), never lost.
        if let Err(e) = self.consumer.commit(&list, CommitMode::Async) {
            core.meters.broker_error();
            tracing::warn!(consumer = %core.name, error = %redact_url(&e.to_string()), "Kafka offset commit failed");
        }
    }

    /// Handle one record; `Some((partition, offset))` once done, `None` (and stop the lane)
    /// when the consumer stops first.
    async fn one(&self, core: &Core, message: OwnedMessage) -> (Option<(i32, i64)>, bool) {
        let done = Some((message.partition(), message.offset()));
        match core.settle(decode(&message), None, || async {}).await {
            Verdict::Ack => (done, true),
            Verdict::Dead { reason, attempts } => {
                match core
                    .until_ok("writing a Kafka dead letter", || {
                        self.dead_letter(&message, &reason, attempts)
                    })
                    .await
                {
                    Some(()) => (done, true),
                    None => (None, false),
                }
            }
            Verdict::Stopped => (None, false),
        }
    }

    async fn dead_letter(
        &self,
        message: &OwnedMessage,
        reason: &str,
        attempts: u32,
    ) -> Result<(), Error> {
        let mut headers = OwnedHeaders::new();
        if let Some(original) = message.headers() {
            for header in original.iter() {
                headers = headers.insert(header);
            }
        }
        let source = format!(
            "kafka topic {} partition {} offset {}",
            message.topic(),
            message.partition(),
            message.offset()
        );
        let attempts = attempts.to_string();
        for (key, value) in [
            (DEAD_REASON, reason),
            (DEAD_ATTEMPTS, attempts.as_str()),
            (DEAD_SOURCE, source.as_str()),
            (DEAD_CONSUMER, self.config.group.as_str()),
        ] {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.config.dead_letter_topic).headers(headers);
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        if let Some(payload) = message.payload() {
            record = record.payload(payload);
        }
        self.producer
            .send(record, self.config.timeout)
            .await
            .map(|_| ())
            .map_err(|(e, _)| {
                Error::transient(
                    format!("dead letter not stored: {}", redact_url(&e.to_string())),
                    None,
                )
            })
    }
}

fn decode(message: &OwnedMessage) -> Result<Delivery, DecodeError> {
    let source = Source::Kafka {
        topic: message.topic().to_owned(),
        partition: message.partition(),
        offset: message.offset(),
    };
    let mut raw = RawEnvelope::default();
    if let Some(headers) = message.headers() {
        for header in headers.iter() {
            raw.header(header.key, header.value.unwrap_or_default());
        }
    }
    if raw.partition_key.is_none() {
        raw.partition_key = message.key();
    }
    raw.decode(message.payload().unwrap_or_default(), source)
}
