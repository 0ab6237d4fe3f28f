//! [`KafkaConfig`]: brokers, topic template, timeout and librdkafka properties, from code or a URL.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use outbox_routing::{Envelope, RoutingTemplate};
use outbox_traits::Error;
use outbox_url::{percent_decode, redact_url, UrlOptions};
use rdkafka::ClientConfig;

/// Topic template used when none is given: one topic per aggregate type.
pub const DEFAULT_TOPIC_TEMPLATE: &str = "outbox.{aggregate_type}";

/// Delivery timeout used when none is given.
///
/// librdkafka's own default is 5 minutes; an outbox relay holds a lease on the messages while it
/// publishes, so the timeout must stay well below the relay's lease, and 30 s does for the usual
/// leases of a minute or more.
pub const DEFAULT_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest topic name Kafka accepts.
const MAX_TOPIC_LEN: usize = 249;

/// Query keys of a `kafka://` URL that are not librdkafka properties.
const URL_OPTIONS: &[&str] = &["topic", "password_file"];

/// How the values of [`URL_OPTIONS`] are read, and named in errors.
const OPTIONS: UrlOptions<'static> = UrlOptions::new("Kafka");

/// librdkafka properties without a dot in their name, accepted in a URL query as pass-through
/// (every dotted key is passed through; these are the undotted ones worth setting on a producer).
const UNDOTTED_PROPERTIES: &[&str] = &["acks", "debug", "partitioner", "retries"];

/// Properties the publisher sets itself and refuses to take from configuration, with why.
const OWNED_PROPERTIES: &[(&str, &str)] = &[
    (
        "bootstrap.servers",
        "give the brokers as the URL's host list or KafkaConfig::builder's brokers",
    ),
    (
        "metadata.broker.list",
        "give the brokers as the URL's host list or KafkaConfig::builder's brokers",
    ),
    (
        "message.timeout.ms",
        "set KafkaConfigBuilder::message_timeout (in a URL, ?message.timeout.ms= does that)",
    ),
    (
        "delivery.timeout.ms",
        "set KafkaConfigBuilder::message_timeout (in a URL, ?message.timeout.ms= does that)",
    ),
    (
        "transactional.id",
        "the outbox publisher uses the idempotent producer, not transactions",
    ),
];

/// Configuration of a [`KafkaPublisher`](crate::KafkaPublisher).
///
/// Build it with [`KafkaConfig::builder`], or from a URL with [`KafkaConfig::from_url`]; both
/// check it, and getters of the same names read it. The publisher always runs librdkafka's
/// idempotent producer (`enable.idempotence=true`, `acks=all`), by default with
/// `enable.gapless.guarantee=true` and `linger.ms=1`; every other librdkafka producer property
/// can be passed through [`KafkaConfigBuilder::property`].
///
/// `Debug` output hides the values of secret properties (`sasl.password` and the like).
///
/// ```
/// use std::time::Duration;
/// use outbox_publisher_kafka::KafkaConfig;
/// let config = KafkaConfig::builder("127.0.0.1:9092")
///     .topic("outbox.{aggregate_type}.{event_type}")
///     .message_timeout(Duration::from_secs(10))
///     .property("compression.type", "lz4")
///     .build()?;
/// assert_eq!(config.topic().as_str(), "outbox.{aggregate_type}.{event_type}");
/// assert!(KafkaConfig::builder("127.0.0.1:9092").property("acks", "1").build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Clone)]
pub struct KafkaConfig {
    /// Bootstrap brokers, comma separated `host:port` (librdkafka's `bootstrap.servers`).
    pub(crate) brokers: String,
    /// Where each message goes: a topic name built from the message's fields.
    pub(crate) topic: RoutingTemplate,
    /// How long librdkafka keeps trying to deliver a message before its outcome is reported as a
    /// failure (librdkafka's `message.timeout.ms`). Publishing a batch never takes much longer.
    pub(crate) message_timeout: Duration,
    /// Extra librdkafka properties, passed through unchanged (e.g. `linger.ms`,
    /// `compression.type`, `security.protocol`, `sasl.username`).
    pub(crate) properties: BTreeMap<String, String>,
    /// What each record carries: the standard headers (default) or a CloudEvents event in
    /// binary or structured mode (URL options `envelope=` and `ce_source=`; see
    /// [`outbox_routing::envelope`]). The record key is the partition key in every mode.
    pub(crate) envelope: Envelope,
}

impl KafkaConfig {
    /// A builder for `brokers` (comma separated `host:port`), starting from the default topic
    /// template [`DEFAULT_TOPIC_TEMPLATE`], [`DEFAULT_MESSAGE_TIMEOUT`], no extra properties and
    /// the standard headers.
    pub fn builder(brokers: impl Into<String>) -> KafkaConfigBuilder {
        KafkaConfigBuilder {
            config: Self::with_defaults(brokers.into()),
            topic: None,
        }
    }

    /// `brokers` with every other setting at its default, unchecked.
    fn with_defaults(brokers: String) -> Self {
        Self {
            brokers,
            topic: default_template(),
            message_timeout: DEFAULT_MESSAGE_TIMEOUT,
            properties: BTreeMap::new(),
            envelope: Envelope::default(),
        }
    }

    /// The bootstrap brokers, comma separated `host:port`.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// The topic template of each message.
    pub fn topic(&self) -> &RoutingTemplate {
        &self.topic
    }

    /// The delivery timeout (see [`KafkaConfigBuilder::message_timeout`]).
    pub fn message_timeout(&self) -> Duration {
        self.message_timeout
    }

    /// The extra librdkafka properties, passed through unchanged (secret values included: do
    /// not log them; `Debug` of the config hides them).
    pub fn properties(&self) -> &BTreeMap<String, String> {
        &self.properties
    }

    /// What each record carries (see [`KafkaConfigBuilder::envelope`]).
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// Parse a `kafka://` URL.
    ///
    /// ```text
    /// kafka://[user:password@]host1:9092[,host2:9092...][/]?topic=outbox.{aggregate_type}&message.timeout.ms=5000&linger.ms=5
    /// ```
    ///
    /// - The host list becomes `bootstrap.servers`. A port is required for each host.
    /// - `user:password@` becomes `sasl.username` / `sasl.password` (set `security.protocol` and
    ///   `sasl.mechanism` as query options too); `password_file=PATH` reads the SASL password
    ///   from a file instead.
    /// - `topic` is the routing template (default [`DEFAULT_TOPIC_TEMPLATE`]); write its braces
    ///   as-is or percent-encoded.
    /// - `message.timeout.ms` (or its alias `delivery.timeout.ms`) sets
    ///   [`KafkaConfig::message_timeout`].
    /// - `envelope=outbox|cloudevents|cloudevents-structured` and `ce_source=` set
    ///   [`KafkaConfig::envelope`].
    /// - Every other key containing a dot, and the undotted librdkafka properties `acks`,
    ///   `debug`, `partitioner` and `retries`, is passed through to librdkafka. Any other key is
    ///   refused with [`Error::InvalidInput`] naming the valid choices.
    ///
    /// Values are percent-decoded. Errors never contain the password.
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let shown = redact_url(url);
        let rest = url.strip_prefix("kafka://").ok_or_else(|| {
            Error::invalid_input(format!(
                "Kafka URL {shown:?} must start with kafka://, e.g. kafka://127.0.0.1:9092?topic=outbox.{{aggregate_type}}"
            ))
        })?;
        let (authority_and_path, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match authority_and_path.split_once('/') {
            Some((a, p)) => (a, p),
            None => (authority_and_path, ""),
        };
        if !path.is_empty() {
            return Err(Error::invalid_input(format!(
                "Kafka URL {shown:?} has a path ({path:?}); a Kafka URL has none: \
                 set the topic with ?topic=..."
            )));
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let brokers = parse_hosts(hosts, &shown)?;
        let mut config = KafkaConfig::with_defaults(brokers);
        if let Some(userinfo) = userinfo {
            let (user, password) = match userinfo.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => (userinfo, None),
            };
            let user = decode(user, "user name", &shown)?;
            if !user.is_empty() {
                config.properties.insert("sasl.username".into(), user);
            }
            if let Some(password) = password {
                let password = decode(password, "password", &shown)?;
                config.properties.insert("sasl.password".into(), password);
            }
        }
        for (key, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            let (key, value) = (key.into_owned(), value.into_owned());
            // envelope=, ce_source= (outbox_routing::ENVELOPE_URL_OPTIONS).
            if config.envelope.set_url_option(&key, &value)? {
                continue;
            }
            match key.as_str() {
                "topic" => config.topic = parse_topic_template(&value)?,
                "password_file" => {
                    if config.properties.contains_key("sasl.password") {
                        return Err(Error::invalid_input(format!(
                            "Kafka URL {shown:?} has both a password and password_file; give one"
                        )));
                    }
                    let password = OPTIONS.secret_file(&key, &value)?;
                    config.properties.insert("sasl.password".into(), password);
                }
                "message.timeout.ms" | "delivery.timeout.ms" => {
                    config.message_timeout = parse_timeout_ms(&key, &value)?;
                }
                _ if key.contains('.') || UNDOTTED_PROPERTIES.contains(&key.as_str()) => {
                    config.properties.insert(key, value);
                }
                _ => {
                    return Err(Error::invalid_input(format!(
                        "unknown option {key:?} in Kafka URL {shown:?}; valid options: {}, \
                         or any librdkafka producer property (every dotted name such as \
                         linger.ms or compression.type, and {})",
                        [URL_OPTIONS, outbox_routing::ENVELOPE_URL_OPTIONS]
                            .concat()
                            .join(", "),
                        UNDOTTED_PROPERTIES.join(", ")
                    )));
                }
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Check the configuration without connecting: brokers given, timeout in range, no property
    /// that conflicts with what the publisher needs, and every property known to librdkafka.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        self.envelope.validate()?;
        self.client_config().map(|_| ())
    }

    /// The librdkafka configuration the producer is made from, checked by librdkafka itself.
    pub(crate) fn client_config(&self) -> Result<ClientConfig, Error> {
        if self.brokers.trim().is_empty() {
            return Err(Error::invalid_input(
                "no Kafka brokers given; set them as host:port[,host:port], e.g. 127.0.0.1:9092",
            ));
        }
        let timeout_ms = self.message_timeout.as_millis();
        if !(1..=i32::MAX as u128).contains(&timeout_ms) {
            return Err(Error::invalid_input(format!(
                "Kafka message timeout {:?} is out of range; give 1 ms to {} ms",
                self.message_timeout,
                i32::MAX
            )));
        }
        Self::check_template(&self.topic)?;
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.brokers);
        for (name, value) in &self.properties {
            check_property(name, value)?;
            cc.set(name, value);
        }
        // Set after the pass-through so that nothing can turn them off; check_property refused
        // conflicting values already, with a message saying why.
        cc.set("enable.idempotence", "true");
        cc.set("acks", "all");
        if !self.properties.contains_key("enable.gapless.guarantee") {
            cc.set("enable.gapless.guarantee", "true");
        }
        // The whole batch is handed over at once, so waiting for more messages only delays the
        // batch's tail: 1 ms instead of librdkafka's 5 ms doubled the rate of one relay
        // publishing batches of 500 one at a time (54,000 -> 100,000 msg/s on Tansu).
        if !self.properties.contains_key("linger.ms")
            && !self.properties.contains_key("queue.buffering.max.ms")
        {
            cc.set("linger.ms", "1");
        }
        cc.set("message.timeout.ms", timeout_ms.to_string());
        // librdkafka checks names and values here, before any connection.
        cc.create_native_config()
            .map_err(|e| Error::invalid_input(describe_config_error(&e)))?;
        Ok(cc)
    }

    /// The topic `template` would produce for a message whose fields are all `x`, to check the
    /// template's literal text once at configuration time.
    fn check_template(template: &RoutingTemplate) -> Result<(), Error> {
        let sample = template.render_with(&sample_message(), |_| "x".into());
        if let Err(why) = check_topic_name(&sample) {
            return Err(Error::invalid_input(format!(
                "topic template {:?} cannot make a valid Kafka topic: {why}",
                template.as_str()
            )));
        }
        Ok(())
    }
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let shown = if is_sensitive(k) { "***" } else { v.as_str() };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic.as_str())
            .field("message_timeout", &self.message_timeout)
            .field("properties", &properties)
            .field("envelope", &self.envelope)
            .finish()
    }
}

/// Builder of [`KafkaConfig`] ([`KafkaConfig::builder`]); [`KafkaConfigBuilder::build`] checks
/// every setting. `Debug` output hides the values of secret properties.
#[derive(Debug, Clone)]
pub struct KafkaConfigBuilder {
    config: KafkaConfig,
    /// The topic template as given, parsed by `build`.
    topic: Option<String>,
}

impl KafkaConfigBuilder {
    /// Route messages with `template`, e.g. `outbox.{aggregate_type}.{event_type}` (default
    /// [`DEFAULT_TOPIC_TEMPLATE`]).
    ///
    /// [`build`](Self::build) refuses with [`Error::InvalidInput`] a template that is malformed
    /// or whose literal text has characters Kafka does not allow in topic names (only
    /// `a-z A-Z 0-9 . _ -`).
    pub fn topic(mut self, template: impl Into<String>) -> Self {
        self.topic = Some(template.into());
        self
    }

    /// How long librdkafka keeps trying to deliver a message before its outcome is reported as a
    /// failure (librdkafka's `message.timeout.ms`). Publishing a batch never takes much longer. Default: 30 s ([`DEFAULT_MESSAGE_TIMEOUT`]).
    pub fn message_timeout(mut self, message_timeout: Duration) -> Self {
        self.config.message_timeout = message_timeout;
        self
    }

    /// Pass the librdkafka property `name=value` through to the producer (e.g. `linger.ms`,
    /// `compression.type`, `security.protocol`, `sasl.username`). [`build`](Self::build)
    /// refuses the properties the publisher sets itself and unknown ones.
    pub fn property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.properties.insert(name.into(), value.into());
        self
    }

    /// What each record carries: the standard headers (default) or a CloudEvents event in
    /// binary or structured mode (URL options `envelope=` and `ce_source=`; see
    /// [`outbox_routing::envelope`]). The record key is the partition key in every mode.
    pub fn envelope(mut self, envelope: Envelope) -> Self {
        self.config.envelope = envelope;
        self
    }

    /// Parse the topic template and check the configuration without connecting (see
    /// [`KafkaConfig`]); [`Error::InvalidInput`] says what to fix.
    pub fn build(mut self) -> Result<KafkaConfig, Error> {
        if let Some(template) = &self.topic {
            self.config.topic = parse_topic_template(template)?;
        }
        self.config.validate()?;
        Ok(self.config)
    }
}

fn default_template() -> RoutingTemplate {
    // Infallible: DEFAULT_TOPIC_TEMPLATE is a constant valid template (a unit test parses it).
    #[allow(clippy::expect_used)]
    RoutingTemplate::parse(DEFAULT_TOPIC_TEMPLATE).expect("DEFAULT_TOPIC_TEMPLATE parses")
}

fn parse_topic_template(template: &str) -> Result<RoutingTemplate, Error> {
    let parsed = RoutingTemplate::parse(template)?;
    KafkaConfig::check_template(&parsed)?;
    Ok(parsed)
}

fn parse_hosts(hosts: &str, shown: &str) -> Result<String, Error> {
    let mut out = Vec::new();
    for host in hosts.split(',') {
        let host = host.trim();
        let valid_port = host
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !valid_port {
            return Err(Error::invalid_input(format!(
                "Kafka URL {shown:?} has broker {host:?} without host:port; \
                 list brokers as host:port[,host:port], e.g. kafka://127.0.0.1:9092"
            )));
        }
        out.push(host);
    }
    Ok(out.join(","))
}

fn decode(text: &str, what: &str, shown: &str) -> Result<String, Error> {
    percent_decode(text).ok_or_else(|| {
        Error::invalid_input(format!(
            "Kafka URL {shown:?} has a {what} that is not valid percent-encoded UTF-8"
        ))
    })
}

fn parse_timeout_ms(key: &str, value: &str) -> Result<Duration, Error> {
    match value.parse::<u64>() {
        Ok(ms) if ms > 0 && ms <= i32::MAX as u64 => Ok(Duration::from_millis(ms)),
        _ => Err(Error::invalid_input(format!(
            "{key}={value:?} is not a valid timeout; give milliseconds from 1 to {}",
            i32::MAX
        ))),
    }
}

fn check_property(name: &str, value: &str) -> Result<(), Error> {
    if let Some((_, why)) = OWNED_PROPERTIES.iter().find(|(n, _)| *n == name) {
        return Err(Error::invalid_input(format!(
            "librdkafka property {name} cannot be set here: {why}"
        )));
    }
    let v = value.trim().to_ascii_lowercase();
    let refused = match name {
        "enable.idempotence" => v != "true",
        "acks" | "request.required.acks" => v != "all" && v != "-1",
        "max.in.flight.requests.per.connection" | "max.in.flight" => {
            // Idempotence keeps order only with at most 5 requests in flight (KAFKA-17926).
            !v.parse::<u32>().is_ok_and(|n| (1..=5).contains(&n))
        }
        _ => false,
    };
    if refused {
        let shown = if is_sensitive(name) { "***" } else { value };
        return Err(Error::invalid_input(format!(
            "librdkafka property {name}={shown} is not allowed: the outbox publisher needs the \
             idempotent producer (enable.idempotence=true, acks=all, at most 5 requests in \
             flight) so that retries neither duplicate nor reorder messages; remove the option"
        )));
    }
    Ok(())
}

/// Whether a librdkafka property holds a secret whose value must never be shown.
pub(crate) fn is_sensitive(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("password")
        || n.contains("secret")
        || n.contains("token")
        || n.contains("private.key")
        || n == "sasl.oauthbearer.config"
        || n == "ssl.key.pem"
        || n == "ssl_key"
        || n == "ssl.certificate.pem"
}

/// A librdkafka configuration error, without the rejected value when the property is secret.
fn describe_config_error(err: &rdkafka::error::KafkaError) -> String {
    match err {
        rdkafka::error::KafkaError::ClientConfig(_, description, key, value) => {
            let value = if is_sensitive(key) { "***" } else { value };
            format!(
                "librdkafka refused property {key}={value}: {description}; see \
                 https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md for valid \
                 producer properties"
            )
        }
        other => format!("invalid librdkafka configuration: {other}"),
    }
}

/// Why `topic` is not a valid Kafka topic name, if it is not.
pub(crate) fn check_topic_name(topic: &str) -> Result<(), String> {
    if topic.is_empty() {
        return Err("the topic name is empty".into());
    }
    if topic == "." || topic == ".." {
        return Err(format!("{topic:?} is not a valid topic name"));
    }
    if topic.len() > MAX_TOPIC_LEN {
        return Err(format!(
            "the topic name is {} characters long, over Kafka's limit of {MAX_TOPIC_LEN}",
            topic.len()
        ));
    }
    if let Some(bad) = topic.chars().find(|c| !is_topic_char(*c)) {
        return Err(format!(
            "topic {topic:?} contains {bad:?}; Kafka topics allow only a-z A-Z 0-9 . _ -"
        ));
    }
    Ok(())
}

pub(crate) fn is_topic_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

fn sample_message() -> outbox_traits::Message {
    outbox_traits::Message {
        id: outbox_traits::uuid::Uuid::nil(),
        seq: 0,
        aggregate_type: "x".into(),
        aggregate_id: "x".into(),
        event_type: "x".into(),
        payload: "{}".into(),
        binary: None,
        headers: BTreeMap::new(),
        partition_key: Some("x".into()),
        dedup_key: None,
        attempts: 0,
        created_at: outbox_traits::chrono::DateTime::UNIX_EPOCH,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_template_parses() {
        assert_eq!(
            RoutingTemplate::parse(DEFAULT_TOPIC_TEMPLATE).unwrap(),
            default_template()
        );
    }

    #[test]
    fn parses_a_full_url() {
        let c = KafkaConfig::from_url(
            "kafka://127.0.0.1:9092,other:9093?topic=outbox.{aggregate_type}&message.timeout.ms=5000&linger.ms=5&acks=all",
        )
        .unwrap();
        assert_eq!(c.brokers, "127.0.0.1:9092,other:9093");
        assert_eq!(c.topic.as_str(), "outbox.{aggregate_type}");
        assert_eq!(c.message_timeout, Duration::from_millis(5000));
        assert_eq!(c.properties.get("linger.ms").map(String::as_str), Some("5"));
        assert_eq!(c.properties.get("acks").map(String::as_str), Some("all"));
        assert!(!c.properties.contains_key("message.timeout.ms"));
    }

    #[test]
    fn percent_encoded_template_and_defaults() {
        let c = KafkaConfig::from_url("kafka://h:1/?topic=t.%7Bevent_type%7D").unwrap();
        assert_eq!(c.topic.as_str(), "t.{event_type}");
        let d = KafkaConfig::from_url("kafka://h:1").unwrap();
        assert_eq!(d.topic.as_str(), DEFAULT_TOPIC_TEMPLATE);
        assert_eq!(d.message_timeout, DEFAULT_MESSAGE_TIMEOUT);
    }

    #[test]
    fn unknown_undotted_option_names_the_choices() {
        let err = KafkaConfig::from_url("kafka://h:1?topik=x").unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
        let text = err.to_string();
        assert!(text.contains("topik") && text.contains("topic") && text.contains("linger.ms"));
    }

    #[test]
    fn unknown_dotted_property_is_refused_by_librdkafka() {
        let err = KafkaConfig::from_url("kafka://h:1?no.such.property=1").unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
        assert!(err.to_string().contains("no.such.property"), "{err}");
    }

    #[test]
    fn password_never_shown() {
        let c = KafkaConfig::from_url(
            "kafka://app:s3cr%40t@h:1?security.protocol=sasl_plaintext&sasl.mechanism=PLAIN",
        )
        .unwrap();
        assert_eq!(
            c.properties.get("sasl.password").map(String::as_str),
            Some("s3cr@t")
        );
        assert_eq!(
            c.properties.get("sasl.username").map(String::as_str),
            Some("app")
        );
        assert!(!format!("{c:?}").contains("s3cr"));
        // An error about the URL must not show the password either.
        let err = KafkaConfig::from_url("kafka://app:s3cret@h:1?bogus=1").unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
        // Nor a librdkafka refusal of a secret property's value.
        let err = KafkaConfig::builder("h:1")
            .property("ssl.key.password", "s3cret")
            .property("ssl.key.location", "/nonexistent/key.pem")
            .build();
        if let Err(err) = err {
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }

    /// librdkafka refuses `security.protocol=SSL` / `SASL_SSL` and SCRAM when it is built
    /// without OpenSSL; this build has them (rdkafka's `ssl` feature).
    #[test]
    fn ssl_and_sasl_scram_are_compiled_in_and_the_password_can_come_from_a_file() {
        let dir = std::env::temp_dir().join(format!("outbox-kafka-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, "").unwrap();
        let password = dir.join("pw");
        std::fs::write(&password, "s3cret\n").unwrap();
        for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
            let url = format!(
                "kafka://app@h:9093?security.protocol=SASL_SSL&sasl.mechanism={mechanism}\
                 &ssl.ca.location={}&password_file={}",
                ca.display(),
                password.display()
            );
            let c = KafkaConfig::from_url(&url).unwrap();
            assert_eq!(c.properties["sasl.username"], "app");
            assert_eq!(c.properties["sasl.password"], "s3cret");
            assert!(!format!("{c:?}").contains("s3cret"));
        }
        for protocol in ["SSL", "SASL_PLAINTEXT"] {
            KafkaConfig::from_url(&format!("kafka://h:9093?security.protocol={protocol}")).unwrap();
        }
        let both = format!("kafka://app:pw@h:9093?password_file={}", password.display());
        assert!(KafkaConfig::from_url(&both).is_err());
        let missing =
            KafkaConfig::from_url("kafka://app@h:9093?password_file=/nonexistent/pw").unwrap_err();
        assert!(missing.to_string().contains("/nonexistent/pw"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refuses_bad_urls() {
        for bad in [
            "nats://h:1",
            "kafka://",
            "kafka://h",
            "kafka://h:0",
            "kafka://h:1/topic",
            "kafka://h:1?message.timeout.ms=0",
            "kafka://h:1?message.timeout.ms=abc",
            "kafka://h:1?topic=a.{tenant}",
            "kafka://h:1?topic=a%20b",
            "kafka://h:1?enable.idempotence=false",
            "kafka://h:1?acks=1",
            "kafka://h:1?max.in.flight.requests.per.connection=6",
            "kafka://h:1?transactional.id=x",
            "kafka://h:1?bootstrap.servers=x:1",
        ] {
            let err = KafkaConfig::from_url(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{bad}: {err}");
        }
        // In code the timeout has its own field; a property would be silently overridden.
        let err = KafkaConfig::builder("h:1")
            .property("message.timeout.ms", "5")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("message_timeout"), "{err}");
        // librdkafka checks the values of passed-through properties too.
        let err = KafkaConfig::from_url("kafka://h:1?debug=nonsense").unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    }

    #[test]
    fn topic_names() {
        assert!(check_topic_name("outbox.order-1_x").is_ok());
        assert!(check_topic_name("").is_err());
        assert!(check_topic_name("..").is_err());
        assert!(check_topic_name("a b").is_err());
        assert!(check_topic_name(&"a".repeat(250)).is_err());
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%40b").as_deref(), Some("a@b"));
        assert_eq!(percent_decode("100%").as_deref(), Some("100%"));
        assert_eq!(percent_decode("%zz").as_deref(), Some("%zz"));
        assert_eq!(percent_decode("%ff"), None);
    }
}
