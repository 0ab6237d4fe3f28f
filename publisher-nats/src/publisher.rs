//! The JetStream publisher: lanes per partition key, acks awaited concurrently, verified
//! duplicates.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

use async_nats::connection::State;
use async_nats::header::{HeaderMap, HeaderName, HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, context, ErrorCode};
use async_trait::async_trait;
use futures::StreamExt;
use outbox_routing::standard_headers;
use outbox_traits::{redact_url, Error, Message, PublishOutcome, Publisher};

use crate::config::{NatsConfig, StreamSetup};
use crate::subject;

/// Publishes outbox messages to NATS JetStream. Build it with [`NatsPublisher::connect`]; share it
/// (it is cheap to clone: the connection is shared).
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    config: NatsConfig,
}

/// What one publish did to the batch beyond its own outcome.
#[derive(PartialEq, Eq)]
enum Health {
    Fine,
    /// The server stopped answering or the connection is gone: stop sending the rest.
    Broken,
}

impl NatsPublisher {
    /// Connect to the server, then check (or create) the configured stream.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad configuration or a missing stream that is not to be
    /// created; [`Error::Unavailable`] when the server cannot be reached within the timeout;
    /// [`Error::Backend`] for an authentication failure or a refused stream creation. No message
    /// contains the URL's password.
    pub async fn connect(config: NatsConfig) -> Result<Self, Error> {
        config.validate()?;
        let shown = redact_url(&config.url);
        let client = async_nats::ConnectOptions::new()
            .name("outbox-relay")
            .connection_timeout(config.timeout)
            .request_timeout(Some(config.timeout))
            .connect(config.url.as_str())
            .await
            .map_err(|e| {
                let detail = redact_url(&e.to_string());
                let message = format!("cannot connect to {shown}: {detail}");
                match e.kind() {
                    async_nats::ConnectErrorKind::Authentication
                    | async_nats::ConnectErrorKind::AuthorizationViolation
                    | async_nats::ConnectErrorKind::ServerParse => {
                        Error::permanent(message, Some(detail.into()))
                    }
                    _ => Error::unavailable("nats", message, detail),
                }
            })?;
        Self::with_client(client, config).await
    }

    /// Use an existing client (its own connect options apply), then check (or create) the
    /// configured stream. `config.url` is used only in messages.
    pub async fn with_client(
        client: async_nats::Client,
        config: NatsConfig,
    ) -> Result<Self, Error> {
        config.validate()?;
        let jetstream = jetstream::ContextBuilder::new()
            .timeout(config.timeout)
            // Our lanes bound what is in flight; the context's own limit must not be lower
            // or publishes would queue behind it and time out.
            .max_ack_inflight(config.max_in_flight.max(1))
            .backpressure_on_inflight(true)
            .build(client.clone());
        let publisher = Self {
            client,
            jetstream,
            config,
        };
        if let Some(setup) = publisher.config.stream.clone() {
            publisher.ensure_stream(&setup).await?;
        }
        Ok(publisher)
    }

    /// The configuration in use.
    pub fn config(&self) -> &NatsConfig {
        &self.config
    }

    /// The underlying client (e.g. to read back in tests or share the connection).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    async fn ensure_stream(&self, setup: &StreamSetup) -> Result<(), Error> {
        let shown = redact_url(&self.config.url);
        if setup.create {
            let mut config = jetstream::stream::Config {
                name: setup.name.clone(),
                subjects: setup.subjects.clone(),
                ..Default::default()
            };
            if let Some(window) = setup.duplicate_window {
                config.duplicate_window = window;
            }
            if let Some(size) = setup.max_message_size {
                config.max_message_size = size;
            }
            self.jetstream
                .get_or_create_stream(config)
                .await
                .map_err(|e| {
                    let detail = redact_url(&e.to_string());
                    let message = format!(
                        "cannot create or open stream {:?} on {shown}: {detail}",
                        setup.name
                    );
                    if matches!(
                        e.kind(),
                        jetstream::context::CreateStreamErrorKind::TimedOut
                    ) {
                        Error::unavailable("nats", message, detail)
                    } else {
                        Error::permanent(message, Some(detail.into()))
                    }
                })?;
            return Ok(());
        }
        match self.jetstream.get_stream(&setup.name).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let detail = redact_url(&e.to_string());
                let not_found = matches!(
                    e.kind(),
                    jetstream::context::GetStreamErrorKind::JetStream(j)
                        if j.error_code() == ErrorCode::STREAM_NOT_FOUND
                );
                if not_found {
                    Err(Error::invalid_input(format!(
                        "stream {:?} does not exist on {shown}; create it, or add \
                         create_stream=true (and stream_subjects) to create it at start-up",
                        setup.name
                    )))
                } else {
                    Err(Error::unavailable(
                        "nats",
                        format!(
                            "cannot look up stream {:?} on {shown}: {detail}",
                            setup.name
                        ),
                        detail,
                    ))
                }
            }
        }
    }

    /// Publish the messages of one partition key (or one unordered message) in order, one in
    /// flight at a time.
    async fn run_lane(
        &self,
        batch: &[Message],
        lane: Vec<usize>,
        broken: &AtomicBool,
    ) -> Vec<(usize, PublishOutcome)> {
        let mut out = Vec::with_capacity(lane.len());
        let mut stopped = false;
        for index in lane {
            if stopped {
                out.push((index, PublishOutcome::NotAttempted));
                continue;
            }
            let outcome = if broken.load(Ordering::Relaxed) {
                PublishOutcome::transient("not sent: NATS stopped answering earlier in this batch")
            } else {
                let (outcome, health) = self.publish_one(&batch[index]).await;
                if health == Health::Broken {
                    broken.store(true, Ordering::Relaxed);
                }
                outcome
            };
            stopped = !outcome.is_acked();
            out.push((index, outcome));
        }
        out
    }

    async fn publish_one(&self, msg: &Message) -> (PublishOutcome, Health) {
        let subject = self
            .config
            .subject
            .render_with(msg, subject::sanitize_value);
        let headers = match headers_for(msg) {
            Ok(h) => h,
            Err(reason) => return (PublishOutcome::permanent(reason), Health::Fine),
        };
        let publish = jetstream::message::PublishMessage::build()
            .payload(msg.payload.clone().into())
            .headers(headers);
        let ack = match self.jetstream.send_publish(subject.clone(), publish).await {
            Ok(ack) => ack,
            Err(e) => return classify_send_error(&e, &subject),
        };
        match ack.await {
            Ok(ack) if !ack.duplicate => (PublishOutcome::Acked, Health::Fine),
            Ok(ack) => (self.verify_duplicate(msg, &ack).await, Health::Fine),
            Err(e) => classify_ack_error(&e, &subject),
        }
    }

    /// FM-C4: a duplicate ack names the sequence of the message the server kept for this
    /// `Nats-Msg-Id`; count it as delivered only if that message is there and carries our id.
    async fn verify_duplicate(
        &self,
        msg: &Message,
        ack: &jetstream::publish::PublishAck,
    ) -> PublishOutcome {
        let id = msg.id.hyphenated().to_string();
        if ack.sequence == 0 {
            return PublishOutcome::Ambiguous {
                reason: format!(
                    "stream {} answered 'duplicate' for message {id} without a stored sequence",
                    ack.stream
                ),
            };
        }
        let stored = async {
            let stream = self.jetstream.get_stream_no_info(&ack.stream).await?;
            Ok::<_, async_nats::Error>(stream.get_raw_message(ack.sequence).await?)
        }
        .await;
        match stored {
            Ok(stored) => {
                let stored_id = stored.headers.get(NATS_MESSAGE_ID).map(|v| v.as_str());
                if stored_id == Some(id.as_str()) {
                    PublishOutcome::Acked
                } else {
                    PublishOutcome::Ambiguous {
                        reason: format!(
                            "stream {} answered 'duplicate' for message {id}, but its message {} \
                             carries Nats-Msg-Id {stored_id:?}",
                            ack.stream, ack.sequence
                        ),
                    }
                }
            }
            Err(e) => PublishOutcome::Ambiguous {
                reason: format!(
                    "stream {} answered 'duplicate' for message {id}, and its message {} could \
                     not be read back to verify it: {}",
                    ack.stream,
                    ack.sequence,
                    redact_url(&e.to_string())
                ),
            },
        }
    }
}

fn headers_for(msg: &Message) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, msg.id.hyphenated().to_string().as_str());
    for (name, value) in standard_headers(msg) {
        let header_name = HeaderName::from_str(&name).map_err(|_| {
            format!(
                "header name {name:?} of message {} is not valid in NATS \
                 (ASCII without ':', spaces or control characters)",
                msg.id
            )
        })?;
        let header_value = HeaderValue::from_str(&value).map_err(|_| {
            format!(
                "header {name:?} of message {} has a value with a line break, which NATS \
                 headers cannot carry",
                msg.id
            )
        })?;
        headers.append(header_name, header_value);
    }
    Ok(headers)
}

fn jetstream_code(e: &(dyn std::error::Error + 'static)) -> Option<(ErrorCode, String)> {
    e.source()
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(|j| (j.error_code(), j.to_string()))
}

fn classify_send_error(e: &context::PublishError, subject: &str) -> (PublishOutcome, Health) {
    use context::PublishErrorKind as K;
    let detail = redact_url(&e.to_string());
    match e.kind() {
        K::MaxPayloadExceeded => (
            PublishOutcome::permanent(format!(
                "message for {subject} is larger than the NATS server's max_payload: {detail}; \
                 store large bodies elsewhere and publish a reference"
            )),
            Health::Fine,
        ),
        // Nothing left the client: the command queue did not take it in time.
        K::TimedOut => (
            PublishOutcome::transient(format!("NATS publish to {subject} not sent: {detail}")),
            Health::Broken,
        ),
        _ => (
            PublishOutcome::transient(format!("NATS publish to {subject} not sent: {detail}")),
            Health::Fine,
        ),
    }
}

fn classify_ack_error(e: &context::PublishError, subject: &str) -> (PublishOutcome, Health) {
    use context::PublishErrorKind as K;
    let detail = redact_url(&e.to_string());
    match e.kind() {
        K::TimedOut | K::BrokenPipe => (
            PublishOutcome::Ambiguous {
                reason: format!("no JetStream ack for {subject}: {detail}"),
            },
            Health::Broken,
        ),
        // "No responders": no stream captures the subject, so nothing was stored. Transient
        // because creating the stream fixes it without touching the message; the relay's
        // max_attempts still dead-letters it if nobody does.
        K::StreamNotFound => (
            PublishOutcome::transient(format!(
                "no JetStream stream captures subject {subject} (no responders); create a \
                 stream for it or set create_stream=true"
            )),
            Health::Fine,
        ),
        K::MaxPayloadExceeded => (
            PublishOutcome::permanent(format!("message for {subject} too large: {detail}")),
            Health::Fine,
        ),
        _ => match jetstream_code(e) {
            Some((code, text)) if code == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM => (
                PublishOutcome::permanent(format!(
                    "message for {subject} is larger than the stream's max_msg_size: {text}; \
                     store large bodies elsewhere and publish a reference"
                )),
                Health::Fine,
            ),
            Some((_, text)) => (
                PublishOutcome::transient(format!("JetStream refused {subject}: {text}")),
                Health::Fine,
            ),
            // An answer we cannot read: it may have been stored.
            None => (
                PublishOutcome::Ambiguous {
                    reason: format!("unreadable JetStream answer for {subject}: {detail}"),
                },
                Health::Fine,
            ),
        },
    }
}

#[async_trait]
impl Publisher for NatsPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        if self.client.connection_state() != State::Connected {
            // The client would buffer these until it reconnects; fail them now (nothing was
            // sent) so the relay backs off instead of waiting on a dead server.
            let reason = format!(
                "not connected to NATS at {}; the client is reconnecting",
                redact_url(&self.config.url)
            );
            return batch
                .iter()
                .map(|_| PublishOutcome::transient(reason.clone()))
                .collect();
        }
        let mut lanes: Vec<Vec<usize>> = Vec::new();
        let mut lane_of_key: HashMap<&str, usize> = HashMap::new();
        for (index, msg) in batch.iter().enumerate() {
            match msg.partition_key.as_deref() {
                Some(key) => {
                    let lane = *lane_of_key.entry(key).or_insert_with(|| {
                        lanes.push(Vec::new());
                        lanes.len() - 1
                    });
                    lanes[lane].push(index);
                }
                None => lanes.push(vec![index]),
            }
        }
        let broken = AtomicBool::new(false);
        let results: Vec<Vec<(usize, PublishOutcome)>> = futures::stream::iter(lanes)
            .map(|lane| self.run_lane(batch, lane, &broken))
            .buffer_unordered(self.config.max_in_flight)
            .collect()
            .await;
        let mut outcomes = vec![PublishOutcome::NotAttempted; batch.len()];
        for (index, outcome) in results.into_iter().flatten() {
            outcomes[index] = outcome;
        }
        outcomes
    }

    fn name(&self) -> &str {
        "nats"
    }
}
