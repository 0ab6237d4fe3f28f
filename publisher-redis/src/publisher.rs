//! The Redis Streams publisher: one pipeline of XADDs per batch.

use async_trait::async_trait;
use outbox_routing::KeyGate;
use outbox_traits::{redact_url, Error, Message, PublishOutcome, Publisher};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::Value;

use crate::config::RedisConfig;

/// Publishes outbox messages to Redis Streams. Build it with [`RedisPublisher::connect`]; it is
/// cheap to clone (the connection is shared and reconnects by itself).
#[derive(Clone)]
pub struct RedisPublisher {
    connection: ConnectionManager,
    config: RedisConfig,
}

impl std::fmt::Debug for RedisPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPublisher")
            .field("url", &redact_url(&self.config.url))
            .field("stream", &self.config.stream.as_str())
            .finish_non_exhaustive()
    }
}

impl RedisPublisher {
    /// Connect to the server.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad configuration; [`Error::Unavailable`] when the server
    /// cannot be reached within the timeout (or refuses the credentials). No message contains the
    /// URL's password.
    pub async fn connect(config: RedisConfig) -> Result<Self, Error> {
        config.validate()?;
        let shown = redact_url(&config.url);
        let client = config.tls.client(&config.url)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(config.timeout)
            .set_response_timeout(config.timeout)
            // Reconnect once per failed call; the relay's own backoff spaces out the rest.
            .set_number_of_retries(1);
        let connection = tokio::time::timeout(
            config.timeout,
            client.get_connection_manager_with_config(manager_config),
        )
        .await
        .map_err(|_| {
            Error::unavailable(
                "redis",
                if config.url.starts_with("rediss://") {
                    format!("no connection to {shown} within {:?}", config.timeout)
                } else {
                    format!(
                        "no connection to {shown} within {:?}; if the server serves only TLS, \
                         use rediss:// (with ca_file=)",
                        config.timeout
                    )
                },
                "timed out",
            )
        })?
        .map_err(|e| {
            let detail = redact_url(&outbox_traits::error_chain_line(&e));
            let tls = config.url.starts_with("rediss://");
            let message = match crate::tls::fix(&detail, tls) {
                Some(fix) => format!("cannot connect to {shown}: {detail}; {fix}"),
                None => format!("cannot connect to {shown}: {detail}"),
            };
            Error::unavailable("redis", message, detail)
        })?;
        Ok(Self { connection, config })
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    fn xadd(&self, msg: &Message) -> redis::Cmd {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.config.stream.render(msg));
        if let Some(maxlen) = self.config.maxlen {
            cmd.arg("MAXLEN").arg("~").arg(maxlen);
        }
        cmd.arg("*")
            .arg("id")
            .arg(msg.id.hyphenated().to_string())
            .arg("event_type")
            .arg(&msg.event_type)
            .arg("aggregate_type")
            .arg(&msg.aggregate_type)
            .arg("aggregate_id")
            .arg(&msg.aggregate_id);
        if let Some(key) = &msg.partition_key {
            cmd.arg("partition_key").arg(key);
        }
        cmd.arg("payload").arg(&msg.payload);
        cmd.arg("headers").arg(headers_json(msg));
        cmd
    }
}

/// The user headers as one JSON object (`{}` when none).
fn headers_json(msg: &Message) -> String {
    // A map of strings always serializes; the fallback is never taken.
    serde_json::to_string(&msg.headers).unwrap_or_else(|_| "{}".to_owned())
}

/// Outcome of one entry's reply.
fn entry_outcome(reply: &Value) -> PublishOutcome {
    match reply {
        Value::ServerError(err) => {
            let text = format!(
                "Redis refused XADD: {} {}",
                err.code(),
                err.details().unwrap_or("")
            );
            match err.code() {
                // The stream key holds another type, or the command is malformed: retrying the
                // same XADD can never succeed.
                "WRONGTYPE" | "ERR" => PublishOutcome::permanent(text),
                _ => PublishOutcome::transient(text),
            }
        }
        Value::BulkString(_) | Value::SimpleString(_) | Value::VerbatimString { .. } => {
            PublishOutcome::Acked
        }
        other => PublishOutcome::Ambiguous {
            reason: format!("unexpected Redis reply to XADD: {other:?}"),
        },
    }
}

#[async_trait]
impl Publisher for RedisPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        let mut outcomes = vec![PublishOutcome::NotAttempted; batch.len()];
        let mut gate = KeyGate::new();
        let mut pipe = redis::pipe();
        let mut sent = Vec::with_capacity(batch.len());
        for (index, msg) in batch.iter().enumerate() {
            if !gate.admits(msg) {
                continue; // stays NotAttempted
            }
            if let Some(limit) = self.config.max_payload {
                if msg.payload.len() > limit {
                    outcomes[index] = PublishOutcome::permanent(format!(
                        "payload of message {} is {} bytes, over this publisher's max_payload of \
                         {limit}; store large bodies elsewhere and publish a reference",
                        msg.id,
                        msg.payload.len()
                    ));
                    gate.record(msg, &outcomes[index]);
                    continue;
                }
            }
            pipe.add_command(self.xadd(msg));
            sent.push(index);
        }
        if sent.is_empty() {
            return outcomes;
        }
        let mut connection = self.connection.clone();
        let reply = tokio::time::timeout(
            self.config.timeout,
            connection.req_packed_commands(&pipe, 0, sent.len()),
        )
        .await;
        match reply {
            Ok(Ok(replies)) if replies.len() == sent.len() => {
                for (index, reply) in sent.iter().zip(&replies) {
                    outcomes[*index] = entry_outcome(reply);
                }
            }
            Ok(Ok(replies)) => {
                let reason = format!(
                    "Redis answered {} replies to a pipeline of {} XADDs",
                    replies.len(),
                    sent.len()
                );
                for index in &sent {
                    outcomes[*index] = PublishOutcome::Ambiguous {
                        reason: reason.clone(),
                    };
                }
            }
            Ok(Err(e)) if e.is_connection_refusal() => {
                let reason = format!(
                    "Redis at {} refused the connection: {}",
                    redact_url(&self.config.url),
                    redact_url(&e.to_string())
                );
                for index in &sent {
                    outcomes[*index] = PublishOutcome::transient(reason.clone());
                }
            }
            Ok(Err(e)) => {
                let reason = format!(
                    "Redis pipeline failed, some entries may be stored: {}",
                    redact_url(&e.to_string())
                );
                for index in &sent {
                    outcomes[*index] = PublishOutcome::Ambiguous {
                        reason: reason.clone(),
                    };
                }
            }
            Err(_) => {
                let reason = format!(
                    "no Redis reply within {:?}; some entries may be stored",
                    self.config.timeout
                );
                for index in &sent {
                    outcomes[*index] = PublishOutcome::Ambiguous {
                        reason: reason.clone(),
                    };
                }
            }
        }
        outcomes
    }

    fn name(&self) -> &str {
        "redis"
    }

    /// A `PING` within the publisher's timeout.
    async fn check(&self) -> Result<(), Error> {
        let mut connection = self.connection.clone();
        let ping = redis::cmd("PING");
        let shown = redact_url(&self.config.url);
        match tokio::time::timeout(self.config.timeout, connection.req_packed_command(&ping)).await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(Error::unavailable(
                "redis",
                format!("PING to {shown} failed: {}", redact_url(&e.to_string())),
                e,
            )),
            Err(_) => Err(Error::Unavailable {
                what: "redis".into(),
                message: format!(
                    "no PING reply from {shown} within {:?}",
                    self.config.timeout
                ),
                source: None,
            }),
        }
    }
}
