//! The Redis Streams publisher: one pipeline of XADDs per batch.

use std::collections::HashMap;

use async_trait::async_trait;
use outbox_routing::Binding;
use outbox_traits::{Error, KeyGate, Message, PublishOutcome, Publisher};
use outbox_url::redact_url;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Value};

use crate::config::RedisConfig;

/// Publishes outbox messages to Redis Streams. Build it with [`RedisPublisher::connect`]; it is
/// cheap to clone (the connection is shared and reconnects by itself).
#[derive(Clone)]
pub struct RedisPublisher {
    connection: Connection,
    config: RedisConfig,
}

/// One server (reconnecting by itself), or a cluster (following redirects and failovers).
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    async fn send(&self, pipe: &redis::Pipeline, count: usize) -> Result<Vec<Value>, RedisError> {
        match self {
            Connection::Single(c) => c.clone().req_packed_commands(pipe, 0, count).await,
            Connection::Cluster(c) => c.clone().req_packed_commands(pipe, 0, count).await,
        }
    }

    async fn ping(&self) -> Result<Value, RedisError> {
        let ping = redis::cmd("PING");
        match self {
            Connection::Single(c) => c.clone().req_packed_command(&ping).await,
            Connection::Cluster(c) => c.clone().req_packed_command(&ping).await,
        }
    }
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
        let connecting = async {
            if config.cluster {
                let client = config
                    .tls
                    .cluster_client(&config.url, &config.seeds, &config)?;
                client
                    .get_async_connection()
                    .await
                    .map(Connection::Cluster)
                    .map_err(|e| connect_error(&config, &shown, &e))
            } else {
                let client = config.tls.client(&config.url)?;
                let manager_config = ConnectionManagerConfig::new()
                    .set_connection_timeout(config.timeout)
                    .set_response_timeout(config.timeout)
                    // Reconnect once per failed call; the relay's own backoff spaces out the rest.
                    .set_number_of_retries(1);
                client
                    .get_connection_manager_with_config(manager_config)
                    .await
                    .map(Connection::Single)
                    .map_err(|e| connect_error(&config, &shown, &e))
            }
        };
        let connection = tokio::time::timeout(config.timeout, connecting)
            .await
            .map_err(|_| {
                Error::unavailable(
                    "redis",
                    if config.url.starts_with("rediss://") {
                        format!("no connection to {shown} within {:?}", config.timeout)
                    } else {
                        format!(
                            "no connection to {shown} within {:?}; if the server serves only \
                             TLS, use rediss:// (with ca_file=)",
                            config.timeout
                        )
                    },
                    "timed out",
                )
            })??;
        Ok(Self { connection, config })
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The key of `msg`'s stream: the rendered stream name, after `{tag}` with a hash tag.
    fn stream_key(&self, msg: &Message) -> String {
        let stream = self.config.stream.render(msg);
        match &self.config.hash_tag {
            Some(tag) => format!("{{{}}}{stream}", tag.render(msg)),
            None => stream,
        }
    }

    /// Record the outcomes of one pipeline's `sent` messages from its `reply`.
    fn settle(
        &self,
        outcomes: &mut [PublishOutcome],
        sent: &[usize],
        reply: Result<Result<Vec<Value>, RedisError>, tokio::time::error::Elapsed>,
    ) {
        let all = |outcomes: &mut [PublishOutcome], outcome: PublishOutcome| {
            for index in sent {
                outcomes[*index] = outcome.clone();
            }
        };
        match reply {
            Ok(Ok(replies)) if replies.len() == sent.len() + self.wait_replies() => {
                let short = self.short_of_replicas(replies.get(sent.len()));
                for (index, reply) in sent.iter().zip(&replies) {
                    outcomes[*index] = match (entry_outcome(reply), &short) {
                        (PublishOutcome::Acked, Some(reason)) => PublishOutcome::Ambiguous {
                            reason: reason.clone(),
                        },
                        (outcome, _) => outcome,
                    };
                }
            }
            Ok(Ok(replies)) => all(
                outcomes,
                PublishOutcome::Ambiguous {
                    reason: format!(
                        "Redis answered {} replies to a pipeline of {} XADDs",
                        replies.len(),
                        sent.len()
                    ),
                },
            ),
            Ok(Err(e)) if e.is_connection_refusal() => all(
                outcomes,
                PublishOutcome::transient(format!(
                    "Redis at {} refused the connection: {}",
                    redact_url(&self.config.url),
                    redact_url(&e.to_string())
                )),
            ),
            // A cluster pipeline reports an error reply of any entry as the pipeline's error,
            // after retrying redirects and failovers; the entries before it may be stored.
            Ok(Err(e)) => all(
                outcomes,
                PublishOutcome::Ambiguous {
                    reason: format!(
                        "Redis pipeline failed, some entries may be stored: {}",
                        redact_url(&e.to_string())
                    ),
                },
            ),
            Err(_) => all(
                outcomes,
                PublishOutcome::Ambiguous {
                    reason: format!(
                        "no Redis reply within {:?}; some entries may be stored",
                        self.config.timeout
                    ),
                },
            ),
        }
    }

    /// Replies a pipeline has beyond one per XADD: `WAIT`'s.
    fn wait_replies(&self) -> usize {
        usize::from(self.config.wait_replicas.is_some())
    }

    /// Why a pipeline's stored entries do not count as delivered: `WAIT` answered fewer
    /// replicas than asked for (`None` when no wait is asked for or enough answered).
    fn short_of_replicas(&self, wait_reply: Option<&Value>) -> Option<String> {
        let wanted = self.config.wait_replicas?;
        let got = match wait_reply {
            Some(Value::Int(n)) => *n,
            _ => -1,
        };
        (got < i64::from(wanted)).then(|| {
            format!(
                "stored on the master, but WAIT found {got} of the {wanted} replicas asked for \
                 (wait_replicas); a failover could lose it, so it is published again"
            )
        })
    }

    fn xadd(&self, key: &str, msg: &Message) -> redis::Cmd {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(key);
        if let Some(maxlen) = self.config.maxlen {
            cmd.arg("MAXLEN").arg("~").arg(maxlen);
        }
        cmd.arg("*");
        if self.config.envelope.is_cloudevents() {
            let ce = self.config.envelope.headers(msg, Binding::Redis);
            for (name, value) in &ce.protocol {
                cmd.arg(name).arg(value);
            }
            cmd.arg("data").arg(self.config.envelope.body(msg).as_ref());
            if !ce.passthrough.is_empty() {
                let plain: std::collections::BTreeMap<&str, &str> =
                    ce.passthrough.into_iter().collect();
                // A map of strings always serializes; the fallback is never taken.
                cmd.arg("headers")
                    .arg(serde_json::to_string(&plain).unwrap_or_else(|_| "{}".to_owned()));
            }
            return cmd;
        }
        cmd.arg("id")
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
        // A binary payload's type; a JSON entry has no such field, as before binary payloads.
        if let Some(binary) = &msg.binary {
            cmd.arg("content_type").arg(&binary.content_type);
        }
        cmd.arg("payload").arg(msg.body());
        cmd.arg("headers").arg(headers_json(msg));
        cmd
    }
}

/// The XADDs of one cluster slot and the batch indexes of their messages.
struct Group {
    pipe: redis::Pipeline,
    sent: Vec<usize>,
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag (the text between the first
/// `{` and the next `}`, when not empty) or of the whole key, modulo 16384.
fn key_slot(key: &[u8]) -> u16 {
    let tag = key.iter().position(|b| *b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter()
            .position(|b| *b == b'}')
            .filter(|len| *len > 0)
            .map(|len| &rest[..len])
    });
    crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(key)) % 16384
}

fn connect_error(config: &RedisConfig, shown: &str, e: &RedisError) -> Error {
    let detail = redact_url(&outbox_url::error_chain_line(e));
    let tls = config.url.starts_with("rediss://");
    let message = match crate::tls::fix(&detail, tls) {
        Some(fix) => format!("cannot connect to {shown}: {detail}; {fix}"),
        None => format!("cannot connect to {shown}: {detail}"),
    };
    Error::unavailable("redis", message, detail)
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
        // One pipeline per cluster slot (one in all for a single server): a cluster pipeline
        // may not cross slots, and each stream is one key, so each stream's entries stay in
        // batch order within their pipeline.
        let mut groups: Vec<Group> = Vec::new();
        let mut group_of_slot: HashMap<u16, usize> = HashMap::new();
        let cluster = matches!(self.connection, Connection::Cluster(_));
        for (index, msg) in batch.iter().enumerate() {
            if !gate.admits(msg) {
                continue; // stays NotAttempted
            }
            if let Some(limit) = self.config.max_payload {
                if msg.body().len() > limit {
                    outcomes[index] = PublishOutcome::permanent(format!(
                        "payload of message {} is {} bytes, over this publisher's max_payload of \
                         {limit}; store large bodies elsewhere and publish a reference",
                        msg.id,
                        msg.body().len()
                    ));
                    gate.record(msg, &outcomes[index]);
                    continue;
                }
            }
            let key = self.stream_key(msg);
            let slot = if cluster { key_slot(key.as_bytes()) } else { 0 };
            let group = *group_of_slot.entry(slot).or_insert_with(|| {
                groups.push(Group {
                    pipe: redis::pipe(),
                    sent: Vec::new(),
                });
                groups.len() - 1
            });
            groups[group].pipe.add_command(self.xadd(&key, msg));
            groups[group].sent.push(index);
        }
        if let Some(replicas) = self.config.wait_replicas {
            // Within half the timeout, so that WAIT's answer arrives before the timeout.
            let wait_ms = u64::try_from(self.config.timeout.as_millis() / 2).unwrap_or(1);
            for group in &mut groups {
                group.pipe.cmd("WAIT").arg(replicas).arg(wait_ms.max(1));
            }
        }
        let replies = futures::future::join_all(groups.iter().map(|group| {
            tokio::time::timeout(
                self.config.timeout,
                self.connection
                    .send(&group.pipe, group.sent.len() + self.wait_replies()),
            )
        }))
        .await;
        for (group, reply) in groups.iter().zip(replies) {
            self.settle(&mut outcomes, &group.sent, reply);
        }
        outcomes
    }

    fn name(&self) -> &str {
        "redis"
    }

    /// A `PING` within the publisher's timeout.
    async fn check(&self) -> Result<(), Error> {
        let shown = redact_url(&self.config.url);
        match tokio::time::timeout(self.config.timeout, self.connection.ping()).await {
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

#[cfg(test)]
mod tests {
    use super::key_slot;

    #[test]
    fn slots_follow_redis_cluster_hash_tags() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(
            key_slot(b"{user1000}.followers"),
            key_slot(b"{user1000}.following")
        );
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }
}
