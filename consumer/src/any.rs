//! One entry point for a consumer URL of any broker.

use outbox_traits::Error;
use outbox_url::redact_url;
use tokio_util::sync::CancellationToken;

use crate::handler::Handler;

/// A consumer of whichever broker its URL names; see [`Consumer::connect`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Consumer {
    /// NATS JetStream (boxed: its client is much larger than the others).
    #[cfg(feature = "nats")]
    Nats(Box<crate::nats::NatsConsumer>),
    /// Redis Streams.
    #[cfg(feature = "redis")]
    Redis(crate::redis::RedisConsumer),
    /// Kafka.
    #[cfg(feature = "kafka")]
    Kafka(crate::kafka::KafkaConsumer),
}

impl Consumer {
    /// Parse `url` by its scheme and connect: `nats://` (also `tls://`, `ws://`, `wss://`;
    /// see [`NatsConsumerConfig::from_url`](crate::nats::NatsConsumerConfig::from_url)),
    /// `redis://` or `rediss://`
    /// ([`RedisConsumerConfig::from_url`](crate::redis::RedisConsumerConfig::from_url)),
    /// `kafka://` ([`KafkaConsumerConfig::from_url`](crate::kafka::KafkaConsumerConfig::from_url)).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an unknown scheme (or one whose feature is off) and for a bad
    /// URL; otherwise the errors of the broker's `connect`.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        match scheme {
            #[cfg(feature = "nats")]
            "nats" | "tls" | "ws" | "wss" => Ok(Self::Nats(Box::new(
                crate::nats::NatsConsumer::connect(crate::nats::NatsConsumerConfig::from_url(url)?)
                    .await?,
            ))),
            #[cfg(feature = "redis")]
            "redis" | "rediss" => Ok(Self::Redis(
                crate::redis::RedisConsumer::connect(crate::redis::RedisConsumerConfig::from_url(
                    url,
                )?)
                .await?,
            )),
            #[cfg(feature = "kafka")]
            "kafka" => Ok(Self::Kafka(
                crate::kafka::KafkaConsumer::connect(crate::kafka::KafkaConsumerConfig::from_url(
                    url,
                )?)
                .await?,
            )),
            _ => Err(Error::invalid_input(format!(
                "consumer URL {:?} names no broker this build consumes; use nats://, redis:// \
                 or kafka:// (features nats, redis, kafka)",
                redact_url(url)
            ))),
        }
    }

    /// Consume until the task is dropped.
    pub async fn run(self, handler: impl Handler + 'static) {
        self.run_until(handler, CancellationToken::new()).await;
    }

    /// Consume until `shutdown` is cancelled (see each broker's `run_until`).
    pub async fn run_until(self, handler: impl Handler + 'static, shutdown: CancellationToken) {
        match self {
            #[cfg(feature = "nats")]
            Self::Nats(consumer) => consumer.run_until(handler, shutdown).await,
            #[cfg(feature = "redis")]
            Self::Redis(consumer) => consumer.run_until(handler, shutdown).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(consumer) => consumer.run_until(handler, shutdown).await,
            #[allow(unreachable_patterns)]
            _ => drop((handler, shutdown)),
        }
    }
}
