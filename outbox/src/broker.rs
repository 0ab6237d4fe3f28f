//! Choose the broker by configuration: a URL picks and configures the publisher.
//!
//! | URL | publisher | feature |
//! |---|---|---|
//! | `stdout://` | one JSON line per message on standard output | always |
//! | `nats://host:4222?subject=...` (or `tls://` for TLS) | NATS JetStream | `nats` |
//! | `kafka://host:9092?topic=...` | Kafka (idempotent producer) | `kafka` |
//! | `redis://host:6379?stream=...` (or `rediss://` for TLS) | Redis Streams | `redis` |
//!
//! A clustered broker is given by its seeds, with credentials and options once:
//! `nats://h1:4222,h2:4222,h3:4222?subject=...`, `redis://h1:7000,h2:7001?stream=...&cluster=true`
//! (Redis Cluster), `kafka://h1:9092,h2:9092?topic=...`. The publisher starts with any seed that
//! answers and follows the cluster when a node fails.
//!
//! TLS and credentials are URL options of each broker (CA file, client certificate, password,
//! token, NKey or `.creds` file, SASL), documented in the README's "TLS and credentials"
//! section and in each publisher's docs.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), outbox::Error> {
//! let publisher = outbox::broker::connect("stdout://").await?;
//! assert_eq!(publisher.name(), "stdout");
//! let err = outbox::broker::connect("amqp://localhost").await.err().unwrap();
//! assert!(err.to_string().contains("stdout://"));
//! # Ok(()) }
//! ```

use outbox_traits::{Error, Publisher};
use outbox_url::redact_url;

use crate::schemes;

/// The schemes [`connect`] understands, whether or not their feature is compiled in.
pub const SCHEMES: &[(&str, &str)] = &[
    ("stdout", "always available"),
    ("nats", "feature `nats`"),
    ("kafka", "feature `kafka`"),
    ("redis", "feature `redis`"),
];

/// How long [`connect`] waits for a `kafka://` broker to answer before it gives up.
#[cfg(feature = "kafka")]
pub const KAFKA_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn choices() -> String {
    schemes::choices(SCHEMES)
}

/// Build the publisher that `url` names, connecting to its broker.
///
/// # Errors
/// [`Error::InvalidInput`] for a URL that does not parse, an unknown scheme, a scheme whose
/// feature is not compiled in, or a bad option (the message names the valid choices);
/// [`Error::Unavailable`] when the broker cannot be reached. Passwords never appear in errors.
pub async fn connect(url: &str) -> Result<Box<dyn Publisher>, Error> {
    let scheme = url.split_once("://").map(|(s, _)| s).ok_or_else(|| {
        Error::invalid_input(format!(
            "broker URL {:?} has no scheme; use one of: {}",
            redact_url(url),
            choices()
        ))
    })?;
    match scheme {
        "stdout" => {
            let rest = &url["stdout://".len()..];
            if !rest.is_empty() {
                return Err(Error::invalid_input(format!(
                    "stdout:// takes no host or options, got {:?}",
                    redact_url(url)
                )));
            }
            Ok(Box::new(outbox_publisher_stdout::StdoutPublisher::new()))
        }
        #[cfg(feature = "nats")]
        "nats" | "tls" => {
            let config = outbox_publisher_nats::NatsConfig::from_url(url)?;
            Ok(Box::new(
                outbox_publisher_nats::NatsPublisher::connect(config).await?,
            ))
        }
        #[cfg(feature = "kafka")]
        "kafka" => {
            let publisher = outbox_publisher_kafka::KafkaPublisher::from_url(url)?;
            // librdkafka connects lazily and retries forever; ask for the cluster's metadata
            // so that an unreachable Kafka fails here, with one clear error, as NATS and
            // Redis do.
            publisher.check_connection(KAFKA_CONNECT_TIMEOUT).await?;
            Ok(Box::new(publisher))
        }
        #[cfg(feature = "redis")]
        "redis" | "rediss" => {
            let config = outbox_publisher_redis::RedisConfig::from_url(url)?;
            Ok(Box::new(
                outbox_publisher_redis::RedisPublisher::connect(config).await?,
            ))
        }
        // Reached only for brokers whose feature is off.
        #[allow(unreachable_patterns)]
        "nats" | "tls" | "kafka" | "redis" | "rediss" => not_compiled(match scheme {
            "tls" => "nats",
            "rediss" => "redis",
            other => other,
        }),
        other => Err(Error::invalid_input(format!(
            "unknown broker scheme {other:?} in {:?}; use one of: {}",
            redact_url(url),
            choices()
        ))),
    }
}

/// The schemes whose publisher is compiled into this build.
pub fn compiled_in() -> Vec<&'static str> {
    schemes::compiled(&[
        ("stdout", true),
        ("nats", cfg!(feature = "nats")),
        ("kafka", cfg!(feature = "kafka")),
        ("redis", cfg!(feature = "redis")),
    ])
}

#[cfg_attr(
    all(feature = "nats", feature = "kafka", feature = "redis"),
    allow(dead_code)
)]
fn not_compiled(scheme: &str) -> Result<Box<dyn Publisher>, Error> {
    Err(schemes::not_compiled(scheme, scheme, &compiled_in()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unknown_and_malformed_urls_name_the_choices() {
        for url in [
            "amqp://guest:secret@localhost",
            "no-scheme",
            "stdout://host",
        ] {
            let err = connect(url).await.err().expect("must fail");
            let text = err.to_string();
            assert!(matches!(err, Error::InvalidInput(_)), "{text}");
            assert!(!text.contains("secret"), "{text}");
        }
        let text = connect("amqp://x").await.err().unwrap().to_string();
        for (scheme, _) in SCHEMES {
            assert!(text.contains(&format!("{scheme}://")), "{text}");
        }
    }

    #[test]
    fn a_broker_without_its_feature_names_the_feature_and_the_compiled_choices() {
        // Called directly: with --all-features (as in CI) no scheme reaches it through connect.
        let text = not_compiled("nats").err().unwrap().to_string();
        assert!(text.contains("`nats` feature"), "{text}");
        for scheme in compiled_in() {
            assert!(text.contains(&format!("{scheme}://")), "{text}");
        }
    }

    /// Through `connect` itself, in a build without the `nats` feature (`scripts/test` runs this
    /// crate's tests once with no features).
    #[cfg(not(feature = "nats"))]
    #[tokio::test]
    async fn a_broker_url_whose_feature_is_off_names_the_feature() {
        let err = connect("nats://app:secret@127.0.0.1:4222?subject=a")
            .await
            .err()
            .expect("nats is not compiled in");
        let text = err.to_string();
        assert!(matches!(err, Error::InvalidInput(_)), "{text}");
        assert!(text.contains("`nats` feature"), "{text}");
        assert!(text.contains("stdout://"), "{text}");
        assert!(!text.contains("secret"), "{text}");
    }

    #[tokio::test]
    async fn stdout_is_always_available() {
        assert_eq!(connect("stdout://").await.unwrap().name(), "stdout");
    }
}
