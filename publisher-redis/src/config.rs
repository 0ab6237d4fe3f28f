//! Configuration of the Redis Streams publisher, from code or from a URL.

use std::time::Duration;

use outbox_routing::{Envelope, RoutingTemplate};
use outbox_traits::Error;
use outbox_url::{redact_url, split_seed_list, UrlOptions};

use crate::tls::RedisTls;

/// Default connection and reply timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// How the values of [`URL_OPTIONS`] are read, and named in errors.
const OPTIONS: UrlOptions<'static> = UrlOptions::new("Redis");

/// The query options [`RedisConfig::from_url`] understands.
pub const URL_OPTIONS: &[&str] = &[
    "stream",
    "maxlen",
    "timeout_ms",
    "max_payload",
    "ca_file",
    "cert_file",
    "key_file",
    "password_file",
    "cluster",
    "hash_tag",
    "wait_replicas",
];

/// Everything [`RedisPublisher::connect`](crate::RedisPublisher::connect) needs: built with
/// [`RedisConfig::builder`] or [`RedisConfig::from_url`], both of which check it, and read with
/// getters of the same names.
///
/// `Debug` output shows the URL without its password.
///
/// ```
/// use outbox_publisher_redis::RedisConfig;
/// let config = RedisConfig::builder("redis://127.0.0.1:6379", "outbox.{aggregate_type}")
///     .maxlen(100_000)
///     .build()?;
/// assert_eq!(config.maxlen(), Some(100_000));
/// assert!(RedisConfig::builder("redis://h", "s").maxlen(0).build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Clone)]
pub struct RedisConfig {
    /// Server URL, e.g. `redis://:password@127.0.0.1:6379/0` or `rediss://host:6380` for TLS
    /// (credentials allowed; they never appear in errors).
    pub(crate) url: String,
    /// Stream key of each message.
    pub(crate) stream: RoutingTemplate,
    /// Trim each stream to about this many entries (`MAXLEN ~ N`: Redis trims whole nodes, so a
    /// stream may keep somewhat more). `None`: no trimming.
    pub(crate) maxlen: Option<u64>,
    /// Connection and reply timeout; a batch returns within about this long.
    pub(crate) timeout: Duration,
    /// Refuse (permanently) payloads larger than this many bytes. Redis itself takes up to
    /// 512 MB, which would stall everyone; `None`: no limit.
    pub(crate) max_payload: Option<usize>,
    /// Certificate files of a `rediss://` connection.
    pub(crate) tls: RedisTls,
    /// Talk to a Redis Cluster: [`RedisConfig::url`] is one seed node, [`RedisConfig::seeds`]
    /// the others; the cluster client learns the slot map from any seed that answers and
    /// follows `MOVED`/`ASK` redirects and failovers.
    pub(crate) cluster: bool,
    /// The cluster's other seed nodes, `host:port` each (the credentials and TLS of `url`
    /// apply). Only with [`RedisConfig::cluster`].
    pub(crate) seeds: Vec<String>,
    /// A routing template whose value, in braces, starts each stream key:
    /// `{<hash_tag>}<stream>`. Redis Cluster places a key by its `{...}` part only, so every
    /// stream with the same tag is on one node. `None`: the key is the stream name alone.
    pub(crate) hash_tag: Option<RoutingTemplate>,
    /// After each pipeline, `WAIT N`: count its entries as acknowledged only once `N` replicas
    /// hold them (within half the timeout), else `Ambiguous` (published again). Redis
    /// replicates asynchronously, so without it a master killed right after acknowledging
    /// loses those entries when its replica takes over. `None`: no wait.
    pub(crate) wait_replicas: Option<u32>,
    /// What each entry holds: the outbox fields (default) or a CloudEvents event in binary
    /// (`ce-` fields, `content-type`, `data`) or structured (`content-type`, `data`) mode (URL
    /// options `envelope=` and `ce_source=`; see [`outbox_routing::envelope`]).
    pub(crate) envelope: Envelope,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact_url(&self.url))
            .field("stream", &self.stream.as_str())
            .field("maxlen", &self.maxlen)
            .field("timeout", &self.timeout)
            .field("max_payload", &self.max_payload)
            .field("tls", &self.tls)
            .field("cluster", &self.cluster)
            .field("seeds", &self.seeds)
            .field(
                "hash_tag",
                &self.hash_tag.as_ref().map(RoutingTemplate::as_str),
            )
            .field("wait_replicas", &self.wait_replicas)
            .field("envelope", &self.envelope)
            .finish()
    }
}

impl RedisConfig {
    /// A builder for the server at `url` (credentials allowed; they never appear in errors)
    /// writing to `stream` (a routing template such as `outbox.{aggregate_type}`), starting
    /// from the default timeout, no trimming, no payload limit, no cluster and the outbox
    /// fields.
    pub fn builder(url: impl Into<String>, stream: impl Into<String>) -> RedisConfigBuilder {
        RedisConfigBuilder {
            url: url.into(),
            stream: stream.into(),
            maxlen: None,
            timeout: DEFAULT_TIMEOUT,
            max_payload: None,
            tls: RedisTls::default(),
            cluster: false,
            seeds: Vec::new(),
            hash_tag: None,
            wait_replicas: None,
            envelope: Envelope::default(),
        }
    }

    /// The server URL (with its credentials: do not log it, see [`redact_url`]).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The stream key template of each message.
    pub fn stream(&self) -> &RoutingTemplate {
        &self.stream
    }

    /// Approximate length each stream is trimmed to, if any (see [`RedisConfigBuilder::maxlen`]).
    pub fn maxlen(&self) -> Option<u64> {
        self.maxlen
    }

    /// Connection and reply timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Largest payload accepted, in bytes, if limited (see [`RedisConfigBuilder::max_payload`]).
    pub fn max_payload(&self) -> Option<usize> {
        self.max_payload
    }

    /// Certificate files of a `rediss://` connection.
    pub fn tls(&self) -> &RedisTls {
        &self.tls
    }

    /// Whether the server is a Redis Cluster (see [`RedisConfigBuilder::cluster`]).
    pub fn cluster(&self) -> bool {
        self.cluster
    }

    /// The cluster's other seed nodes, `host:port` each.
    pub fn seeds(&self) -> &[String] {
        &self.seeds
    }

    /// The hash tag template that starts each stream key, if any (see
    /// [`RedisConfigBuilder::hash_tag`]).
    pub fn hash_tag(&self) -> Option<&RoutingTemplate> {
        self.hash_tag.as_ref()
    }

    /// Replicas each pipeline waits for, if any (see [`RedisConfigBuilder::wait_replicas`]).
    pub fn wait_replicas(&self) -> Option<u32> {
        self.wait_replicas
    }

    /// What each entry holds (see [`RedisConfigBuilder::envelope`]).
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// Parse `redis://[user:pass@]host:port[/db]?stream=...` (or `rediss://` for TLS).
    ///
    /// Options ([`URL_OPTIONS`]): `stream` (required, a routing template such as
    /// `outbox.{aggregate_type}`), `maxlen` (approximate trim length), `timeout_ms` (default
    /// 5000), `max_payload` (bytes); `ca_file`, `cert_file`, `key_file` (TLS, see [`RedisTls`])
    /// and `password_file` (the password, read from a file); `cluster` and `hash_tag` (Redis
    /// Cluster, below); `envelope` and `ce_source` ([`RedisConfig::envelope`]). An unknown option, a bad value or a missing `stream` gives
    /// [`Error::InvalidInput`] naming the valid options.
    ///
    /// # Redis Cluster
    /// `redis://[user:password@]h1:7000,h2:7001,h3:7002?stream=...&cluster=true` (or
    /// `rediss://` for TLS): the seeds, any of which may be down at start-up, with the
    /// credentials and options once for all. `cluster=true` is required for a cluster even with
    /// one seed (a standalone server has one address, so a list without it is refused). Stream
    /// names stay what `stream` renders, so a consumer reads the same keys as against one
    /// server; each stream is one key, on one node, so each stream keeps its order.
    ///
    /// `hash_tag=TEMPLATE` (e.g. `hash_tag={aggregate_type}`) prefixes every stream key with
    /// `{value}`: Redis Cluster then places all streams with one tag on one node. Use it when one
    /// partition key's messages go to several streams (a `stream` template with
    /// `{event_type}`): with the tag on a field that is equal for all of them, they share a
    /// node, are written by one pipeline in order, and fail or succeed together when that node
    /// fails over. It changes the stream names (consumers read `{Order}outbox.Order.placed`),
    /// and works without `cluster` too, so names stay the same when moving to a cluster.
    ///
    /// `wait_replicas=1` makes a master's failure lose nothing: each pipeline ends with
    /// `WAIT 1`, and its entries count as delivered only once a replica holds them (see
    /// [`RedisConfig::wait_replicas`]).
    ///
    /// ```
    /// use outbox_publisher_redis::RedisConfig;
    /// let c = RedisConfig::from_url("redis://127.0.0.1:6379?stream=outbox.{aggregate_type}&maxlen=1000").unwrap();
    /// assert_eq!(c.url(), "redis://127.0.0.1:6379");
    /// assert_eq!(c.maxlen(), Some(1000));
    /// assert!(RedisConfig::from_url("redis://h?stream=s&colour=red").is_err());
    /// let c = RedisConfig::from_url("redis://h1:7000,h2:7001?stream=s&cluster=true").unwrap();
    /// assert_eq!((c.url(), c.seeds()[0].as_str()), ("redis://h1:7000", "h2:7001"));
    /// ```
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let shown = redact_url(url);
        let seeds = split_seed_list(url)?;
        let parsed = url::Url::parse(&seeds.first)
            .map_err(|e| Error::invalid_input(format!("Redis URL {shown:?} is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "redis" | "rediss") {
            return Err(Error::invalid_input(format!(
                "Redis URL {shown:?} has scheme {:?}; use redis://host:6379?stream=... (or \
                 rediss:// for TLS)",
                parsed.scheme()
            )));
        }
        let mut stream = None;
        let mut maxlen = None;
        let mut timeout = DEFAULT_TIMEOUT;
        let mut max_payload = None;
        let mut tls = RedisTls::default();
        let mut password = None;
        let mut cluster = false;
        let mut hash_tag = None;
        let mut wait_replicas = None;
        let mut envelope = Envelope::default();
        for (key, value) in parsed.query_pairs() {
            // envelope=, ce_source= (outbox_routing::ENVELOPE_URL_OPTIONS).
            if envelope.set_url_option(&key, &value)? {
                continue;
            }
            match key.as_ref() {
                "stream" => stream = Some(value.into_owned()),
                "maxlen" => maxlen = Some(OPTIONS.number(&key, &value)?),
                "timeout_ms" => timeout = OPTIONS.millis(&key, &value)?,
                "max_payload" => max_payload = Some(OPTIONS.number(&key, &value)?),
                "ca_file" => tls.ca_file = Some(value.into_owned().into()),
                "cert_file" => tls.cert_file = Some(value.into_owned().into()),
                "key_file" => tls.key_file = Some(value.into_owned().into()),
                "cluster" => cluster = OPTIONS.boolean(&key, &value)?,
                "hash_tag" => hash_tag = Some(RoutingTemplate::parse(&value)?),
                "wait_replicas" => wait_replicas = Some(OPTIONS.number(&key, &value)?),
                "password_file" => password = Some(OPTIONS.secret_file(&key, &value)?),
                other => {
                    return Err(OPTIONS.unknown(
                        other,
                        &shown,
                        &[URL_OPTIONS, outbox_routing::ENVELOPE_URL_OPTIONS].concat(),
                    ))
                }
            }
        }
        let Some(stream) = stream else {
            return Err(Error::invalid_input(format!(
                "Redis URL {shown:?} has no stream option; add e.g. \
                 ?stream=outbox.{{aggregate_type}} (valid options: {})",
                URL_OPTIONS.join(", ")
            )));
        };
        let mut server = parsed.clone();
        server.set_query(None);
        server.set_fragment(None);
        if let Some(password) = password {
            if parsed.password().is_some() {
                return Err(Error::invalid_input(format!(
                    "Redis URL {shown:?} has both a password and password_file; give one"
                )));
            }
            server.set_password(Some(&password)).map_err(|()| {
                Error::invalid_input(format!("Redis URL {shown:?} cannot take a password"))
            })?;
        }
        if !seeds.others.is_empty() && !cluster {
            return Err(Error::invalid_input(format!(
                "Redis URL {shown:?} lists several servers; for a Redis Cluster add \
                 cluster=true (a standalone server has one address)"
            )));
        }
        let mut others = Vec::with_capacity(seeds.others.len());
        for seed in &seeds.others {
            others.push(seed_node(seed, parsed.scheme(), &shown)?);
        }
        let config = Self {
            url: server.to_string(),
            stream: RoutingTemplate::parse(&stream)?,
            maxlen,
            timeout,
            max_payload,
            tls,
            cluster,
            seeds: others,
            hash_tag,
            wait_replicas,
            envelope,
        };
        config.validate()?;
        Ok(config)
    }

    /// Check the values: a positive timeout, a positive `maxlen` and `max_payload` when set;
    /// seeds and database 0 only for a cluster.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        self.envelope.validate()?;
        if !self.seeds.is_empty() && !self.cluster {
            return Err(Error::invalid_input(
                "Redis seeds are for a cluster: set cluster (cluster=true in a URL)",
            ));
        }
        if self.cluster && !matches!(url_path(&self.url), "" | "/" | "/0") {
            return Err(Error::invalid_input(format!(
                "Redis URL {:?} selects a database; a Redis Cluster has only database 0, so \
                 leave the /N out",
                redact_url(&self.url)
            )));
        }
        self.tls.validate(&self.url)?;
        if self.timeout.is_zero() {
            return Err(Error::invalid_input(
                "Redis timeout must be positive (timeout_ms=5000, for example)",
            ));
        }
        if self.wait_replicas == Some(0) {
            return Err(Error::invalid_input(
                "Redis wait_replicas must be at least 1 (leave it out for no wait)",
            ));
        }
        if self.maxlen == Some(0) {
            return Err(Error::invalid_input(
                "Redis maxlen must be at least 1 (leave it out for no trimming)",
            ));
        }
        if self.max_payload == Some(0) {
            return Err(Error::invalid_input(
                "Redis max_payload must be at least 1 (leave it out for no limit)",
            ));
        }
        Ok(())
    }
}

/// Builder of [`RedisConfig`] ([`RedisConfig::builder`]); [`RedisConfigBuilder::build`] checks
/// every setting. `Debug` output shows the URL without its password.
#[derive(Clone)]
pub struct RedisConfigBuilder {
    url: String,
    stream: String,
    maxlen: Option<u64>,
    timeout: Duration,
    max_payload: Option<usize>,
    tls: RedisTls,
    cluster: bool,
    seeds: Vec<String>,
    hash_tag: Option<String>,
    wait_replicas: Option<u32>,
    envelope: Envelope,
}

impl std::fmt::Debug for RedisConfigBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfigBuilder")
            .field("url", &redact_url(&self.url))
            .field("stream", &self.stream)
            .field("maxlen", &self.maxlen)
            .field("timeout", &self.timeout)
            .field("max_payload", &self.max_payload)
            .field("tls", &self.tls)
            .field("cluster", &self.cluster)
            .field("seeds", &self.seeds)
            .field("hash_tag", &self.hash_tag)
            .field("wait_replicas", &self.wait_replicas)
            .field("envelope", &self.envelope)
            .finish()
    }
}

impl RedisConfigBuilder {
    /// Trim each stream to about this many entries (`MAXLEN ~ N`: Redis trims whole nodes, so a
    /// stream may keep somewhat more). `None` (the default): no
    /// trimming.
    pub fn maxlen(mut self, maxlen: impl Into<Option<u64>>) -> Self {
        self.maxlen = maxlen.into();
        self
    }

    /// Connection and reply timeout; a batch returns within about this long. Default: 5 s
    /// ([`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Refuse (permanently) payloads larger than this many bytes. Redis itself takes up to
    /// 512 MB, which would stall everyone; `None` (the default): no limit.
    pub fn max_payload(mut self, max_payload: impl Into<Option<usize>>) -> Self {
        self.max_payload = max_payload.into();
        self
    }

    /// Certificate files of a `rediss://` connection.
    pub fn tls(mut self, tls: RedisTls) -> Self {
        self.tls = tls;
        self
    }

    /// Talk to a Redis Cluster: the URL is one seed node, [`seeds`](Self::seeds)
    /// the others; the cluster client learns the slot map from any seed that answers and
    /// follows `MOVED`/`ASK` redirects and failovers. Default: off.
    pub fn cluster(mut self, cluster: bool) -> Self {
        self.cluster = cluster;
        self
    }

    /// The cluster's other seed nodes, `host:port` each (the credentials and TLS of `url`
    /// apply). Only with [`cluster`](Self::cluster).
    pub fn seeds(mut self, seeds: Vec<String>) -> Self {
        self.seeds = seeds;
        self
    }

    /// A routing template whose value, in braces, starts each stream key:
    /// `{<hash_tag>}<stream>`. Redis Cluster places a key by its `{...}` part only, so every
    /// stream with the same tag is on one node. `None` (the default): the key is the stream name alone.
    pub fn hash_tag(mut self, hash_tag: impl Into<Option<String>>) -> Self {
        self.hash_tag = hash_tag.into();
        self
    }

    /// After each pipeline, `WAIT N`: count its entries as acknowledged only once `N` replicas
    /// hold them (within half the timeout), else `Ambiguous` (published again). Redis
    /// replicates asynchronously, so without it a master killed right after acknowledging
    /// loses those entries when its replica takes over. `None` (the default): no wait.
    pub fn wait_replicas(mut self, wait_replicas: impl Into<Option<u32>>) -> Self {
        self.wait_replicas = wait_replicas.into();
        self
    }

    /// What each entry holds: the outbox fields (default) or a CloudEvents event in binary
    /// (`ce-` fields, `content-type`, `data`) or structured (`content-type`, `data`) mode (URL
    /// options `envelope=` and `ce_source=`; see [`outbox_routing::envelope`]).
    pub fn envelope(mut self, envelope: Envelope) -> Self {
        self.envelope = envelope;
        self
    }

    /// Parse the templates and check every setting; [`Error::InvalidInput`] says which one to
    /// fix.
    pub fn build(self) -> Result<RedisConfig, Error> {
        let config = RedisConfig {
            url: self.url,
            stream: RoutingTemplate::parse(&self.stream)?,
            maxlen: self.maxlen,
            timeout: self.timeout,
            max_payload: self.max_payload,
            tls: self.tls,
            cluster: self.cluster,
            seeds: self.seeds,
            hash_tag: self
                .hash_tag
                .as_deref()
                .map(RoutingTemplate::parse)
                .transpose()?,
            wait_replicas: self.wait_replicas,
            envelope: self.envelope,
        };
        config.validate()?;
        Ok(config)
    }
}

/// The path of `url` (`/2` for database 2), or "" when it does not parse.
fn url_path(url: &str) -> &str {
    let Some((_, rest)) = url.split_once("://") else {
        return "";
    };
    let rest = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    rest.find('/').map_or("", |slash| &rest[slash..])
}

/// A seed after the first (`host:port`, or `redis://host:port`), checked, as `host:port`.
fn seed_node(seed: &str, scheme: &str, shown: &str) -> Result<String, Error> {
    let text = if seed.contains("://") {
        seed.to_owned()
    } else {
        format!("{scheme}://{seed}")
    };
    let bad = |why: &str| {
        Error::invalid_input(format!(
            "Redis URL {shown:?} lists server {seed:?}, which {why}; write the seeds as \
             {scheme}://h1:7000,h2:7001,h3:7002?stream=...&cluster=true"
        ))
    };
    let parsed = url::Url::parse(&text).map_err(|e| bad(&format!("is not host:port ({e})")))?;
    if parsed.scheme() != scheme {
        return Err(bad(&format!(
            "has scheme {}:// where the first has {scheme}:// (TLS is all or nothing)",
            parsed.scheme()
        )));
    }
    let Some(host) = parsed.host_str().filter(|h| !h.is_empty()) else {
        return Err(bad("has no host"));
    };
    if !matches!(parsed.path(), "" | "/") {
        return Err(bad(
            "has a path; give the database (if any) after the last seed",
        ));
    }
    Ok(format!("{host}:{}", parsed.port().unwrap_or(6379)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_option() {
        let c = RedisConfig::from_url(
            "redis://:pw@127.0.0.1:6379/2?stream=o.{aggregate_type}&maxlen=5&timeout_ms=250&max_payload=1000",
        )
        .unwrap();
        assert_eq!(c.url, "redis://:pw@127.0.0.1:6379/2");
        assert_eq!(c.stream.as_str(), "o.{aggregate_type}");
        assert_eq!(c.maxlen, Some(5));
        assert_eq!(c.timeout, Duration::from_millis(250));
        assert_eq!(c.max_payload, Some(1000));
    }

    #[test]
    fn a_cluster_is_given_by_its_seeds() {
        let c = RedisConfig::from_url(
            "redis://app:s3cret@10.0.0.1:7000,10.0.0.2:7001,redis://10.0.0.3?stream=o\
             &cluster=true&hash_tag={aggregate_type}&wait_replicas=1",
        )
        .unwrap();
        assert!(c.cluster);
        assert_eq!(c.url, "redis://app:s3cret@10.0.0.1:7000");
        assert_eq!(c.seeds, ["10.0.0.2:7001", "10.0.0.3:6379"]);
        assert_eq!(c.hash_tag.as_ref().unwrap().as_str(), "{aggregate_type}");
        assert_eq!(c.wait_replicas, Some(1));
        assert!(!format!("{c:?}").contains("s3cret"));
        let one = RedisConfig::from_url("redis://h:7000/0?stream=o&cluster=1").unwrap();
        assert!(one.cluster && one.seeds.is_empty());

        for bad in [
            "redis://app:s3cret@h1:7000,h2:7001?stream=o",
            "redis://app:s3cret@h1:7000,h2:7001/3?stream=o&cluster=true",
            "redis://app:s3cret@h1:7000,rediss://h2:7001?stream=o&cluster=true",
            "redis://app:s3cret@h1:7000,app:s3cret@h2:7001?stream=o&cluster=true",
            "redis://app:s3cret@h1:7000,,h2:7001?stream=o&cluster=true",
            "redis://app:s3cret@h1:7000?stream=o&cluster=maybe",
            "redis://app:s3cret@h1:7000?stream=o&hash_tag={tenant}",
            "redis://app:s3cret@h1:7000?stream=o&wait_replicas=0",
        ] {
            let err = RedisConfig::from_url(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{bad}: {err}");
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn refuses_bad_options_naming_the_valid_ones() {
        for url in [
            "redis://h?stream=s&colour=red",
            "redis://h",
            "redis://h?stream=s.{tenant}",
            "redis://h?stream=s&maxlen=-1",
            "redis://h?stream=s&maxlen=0",
            "redis://h?stream=s&timeout_ms=0",
            "redis://h?stream=s&max_payload=big",
            "nats://h?stream=s",
            "redis://h?stream=s&ca_file=/etc/hostname",
            "rediss://h?stream=s&ca_file=/nonexistent/ca.pem",
            "rediss://h?stream=s&cert_file=/etc/hostname",
            "redis://h?stream=s&password_file=/nonexistent/pw",
        ] {
            let err = RedisConfig::from_url(url).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{url}: {err}");
        }
        let err = RedisConfig::from_url("redis://u:s3cret@h?stream=s&colour=red").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("maxlen") && !text.contains("s3cret"),
            "{text}"
        );
    }

    #[test]
    fn the_builder_checks_like_from_url_and_hides_the_password() {
        let builder = RedisConfig::builder("redis://:s3cret@h:6379", "o.{aggregate_type}")
            .hash_tag("{aggregate_type}".to_owned())
            .wait_replicas(1);
        assert!(!format!("{builder:?}").contains("s3cret"));
        let c = builder.clone().build().unwrap();
        assert_eq!(
            c.hash_tag().map(RoutingTemplate::as_str),
            Some("{aggregate_type}")
        );
        assert_eq!(c.wait_replicas(), Some(1));
        assert!(!format!("{c:?}").contains("s3cret"));
        for bad in [
            builder.clone().wait_replicas(0),
            builder.clone().timeout(Duration::ZERO),
            builder.clone().hash_tag("{tenant}".to_owned()),
            builder.seeds(vec!["h2:6379".into()]),
        ] {
            let err = bad.build().unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{err}");
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }
}
