//! Configuration of the Redis Streams publisher, from code or from a URL.

use std::time::Duration;

use outbox_routing::RoutingTemplate;
use outbox_traits::{read_secret_file, redact_url, Error};

use crate::tls::RedisTls;

/// Default connection and reply timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

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
];

/// Everything [`RedisPublisher::connect`](crate::RedisPublisher::connect) needs.
///
/// `Debug` output shows the URL without its password.
#[derive(Clone)]
pub struct RedisConfig {
    /// Server URL, e.g. `redis://:password@127.0.0.1:6379/0` or `rediss://host:6380` for TLS
    /// (credentials allowed; they never appear in errors).
    pub url: String,
    /// Stream key of each message.
    pub stream: RoutingTemplate,
    /// Trim each stream to about this many entries (`MAXLEN ~ N`: Redis trims whole nodes, so a
    /// stream may keep somewhat more). `None`: no trimming.
    pub maxlen: Option<u64>,
    /// Connection and reply timeout; a batch returns within about this long.
    pub timeout: Duration,
    /// Refuse (permanently) payloads larger than this many bytes. Redis itself takes up to
    /// 512 MB, which would stall everyone; `None`: no limit.
    pub max_payload: Option<usize>,
    /// Certificate files of a `rediss://` connection.
    pub tls: RedisTls,
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
            .finish()
    }
}

impl RedisConfig {
    /// A configuration with the default timeout, no trimming and no payload limit.
    pub fn new(url: impl Into<String>, stream: &str) -> Result<Self, Error> {
        let config = Self {
            url: url.into(),
            stream: RoutingTemplate::parse(stream)?,
            maxlen: None,
            timeout: DEFAULT_TIMEOUT,
            max_payload: None,
            tls: RedisTls::default(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Parse `redis://[user:pass@]host:port[/db]?stream=...` (or `rediss://` for TLS).
    ///
    /// Options ([`URL_OPTIONS`]): `stream` (required, a routing template such as
    /// `outbox.{aggregate_type}`), `maxlen` (approximate trim length), `timeout_ms` (default
    /// 5000), `max_payload` (bytes); `ca_file`, `cert_file`, `key_file` (TLS, see [`RedisTls`])
    /// and `password_file` (the password, read from a file). An unknown option, a bad value or a missing `stream` gives
    /// [`Error::InvalidInput`] naming the valid options.
    ///
    /// ```
    /// use outbox_publisher_redis::RedisConfig;
    /// let c = RedisConfig::from_url("redis://127.0.0.1:6379?stream=outbox.{aggregate_type}&maxlen=1000").unwrap();
    /// assert_eq!(c.url, "redis://127.0.0.1:6379");
    /// assert_eq!(c.maxlen, Some(1000));
    /// assert!(RedisConfig::from_url("redis://h?stream=s&colour=red").is_err());
    /// ```
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let shown = redact_url(url);
        let parsed = url::Url::parse(url)
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
        for (key, value) in parsed.query_pairs() {
            match key.as_ref() {
                "stream" => stream = Some(value.into_owned()),
                "maxlen" => maxlen = Some(parse_num(&key, &value)?),
                "timeout_ms" => timeout = Duration::from_millis(parse_num(&key, &value)?),
                "max_payload" => max_payload = Some(parse_num(&key, &value)?),
                "ca_file" => tls.ca_file = Some(value.into_owned().into()),
                "cert_file" => tls.cert_file = Some(value.into_owned().into()),
                "key_file" => tls.key_file = Some(value.into_owned().into()),
                "password_file" => {
                    password = Some(read_secret_file("Redis", "password_file", &value)?)
                }
                other => {
                    return Err(Error::invalid_input(format!(
                        "unknown Redis option {other:?} in {shown:?}; valid options: {}",
                        URL_OPTIONS.join(", ")
                    )))
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
        let config = Self {
            url: server.to_string(),
            stream: RoutingTemplate::parse(&stream)?,
            maxlen,
            timeout,
            max_payload,
            tls,
        };
        config.validate()?;
        Ok(config)
    }

    /// Check the values: a positive timeout, a positive `maxlen` and `max_payload` when set.
    pub fn validate(&self) -> Result<(), Error> {
        self.tls.validate(&self.url)?;
        if self.timeout.is_zero() {
            return Err(Error::invalid_input(
                "Redis timeout must be positive (timeout_ms=5000, for example)",
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

fn parse_num<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, Error> {
    value.parse().map_err(|_| {
        Error::invalid_input(format!(
            "Redis option {key}={value:?} is not a non-negative whole number"
        ))
    })
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
}
