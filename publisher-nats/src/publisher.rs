//! The JetStream publisher: connection, stream set-up, headers and the check of duplicate acks.
//! Publishing a batch (lanes per partition key, acks read from one inbox) is in `flight`.

use std::str::FromStr;

use async_nats::connection::State;
use async_nats::header::{HeaderMap, HeaderName, HeaderValue, NATS_MESSAGE_ID};
use async_nats::jetstream::{self, ErrorCode};
use async_trait::async_trait;
use outbox_routing::{standard_header_refs, Binding, Envelope, STANDARD_HEADER_NAMES};
use outbox_traits::{Error, Message, PublishOutcome, Publisher};
use outbox_url::redact_url;

use crate::config::{NatsConfig, StreamSetup};
use crate::flight::Flight;

/// How long start-up goes on looking up (or creating) the stream while the cluster does not
/// answer in time (each attempt within the configured timeout): longer than a JetStream leader
/// election after a server failure.
const STREAM_SETUP_PATIENCE: std::time::Duration = std::time::Duration::from_secs(20);

/// The pause between two such attempts.
const STREAM_SETUP_PAUSE: std::time::Duration = std::time::Duration::from_millis(250);

/// Why the stream set-up failed: worth another try (no answer in time, JetStream temporarily
/// unavailable), or not.
enum Setup {
    Retry(Error),
    Fail(Error),
}

/// Publishes outbox messages to NATS JetStream. Build it with [`NatsPublisher::connect`]; share it
/// (it is cheap to clone: the connection is shared).
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    config: NatsConfig,
}

impl NatsPublisher {
    /// Connect to the server (for a list of servers, to any one of them that answers), then
    /// check (or create) the configured stream.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad configuration or a missing stream that is not to be
    /// created; [`Error::Unavailable`] when no server can be reached within the timeout, or the
    /// stream does not answer (after trying for 20 s, which outlasts a leader election);
    /// [`Error::Backend`] for an authentication failure or a refused stream creation. No message
    /// contains the URL's password.
    pub async fn connect(config: NatsConfig) -> Result<Self, Error> {
        config.validate()?;
        let shown = redact_url(&config.url);
        let options = async_nats::ConnectOptions::new()
            .name("outbox-relay")
            .connection_timeout(config.timeout)
            .request_timeout(Some(config.timeout))
            .reconnect_delay_callback(reconnect_delay);
        let client = config
            .security
            .apply(options)
            .await?
            // Every seed: the client starts with any that answers.
            .connect(config.servers())
            .await
            .map_err(|e| {
                let detail = redact_url(&outbox_url::error_chain_line(&e));
                let message = match crate::security::connect_fix(&detail, e.kind()) {
                    Some(fix) => format!("cannot connect to {shown}: {detail}; {fix}"),
                    None => format!("cannot connect to {shown}: {detail}"),
                };
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
            // Used for stream set-up and for reading back a duplicate's stored message; batches
            // are published by `Flight`, which bounds its own messages in flight.
            .build(client.clone());
        let publisher = Self {
            client,
            jetstream,
            config,
        };
        if let Some(setup) = publisher.config.stream.clone() {
            // In a cluster whose server just failed, the stream's replicas (and JetStream's meta
            // group) elect a new leader, which takes up to about ten seconds (nats-server's
            // election timeout is 4 to 9 s); until then the lookup times out or answers 503.
            // Keep trying for a while, so that a relay starts while one server is down.
            let started = std::time::Instant::now();
            loop {
                match publisher.ensure_stream(&setup).await {
                    Ok(()) => break,
                    Err(Setup::Retry(_)) if started.elapsed() < STREAM_SETUP_PATIENCE => {
                        tokio::time::sleep(STREAM_SETUP_PAUSE).await;
                    }
                    Err(Setup::Retry(e) | Setup::Fail(e)) => return Err(e),
                }
            }
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

    async fn ensure_stream(&self, setup: &StreamSetup) -> Result<(), Setup> {
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
            if let Some(replicas) = setup.replicas {
                config.num_replicas = replicas;
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
                    // A cluster electing a JetStream or stream leader (a server just failed)
                    // answers late or "temporarily unavailable": worth another try.
                    match e.kind() {
                        jetstream::context::CreateStreamErrorKind::TimedOut => {
                            Setup::Retry(Error::unavailable("nats", message, detail))
                        }
                        jetstream::context::CreateStreamErrorKind::JetStream(j)
                            if j.code() == 503 =>
                        {
                            Setup::Retry(Error::unavailable("nats", message, detail))
                        }
                        _ => Setup::Fail(Error::permanent(message, Some(detail.into()))),
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
                let timed_out = std::error::Error::source(&e)
                    .and_then(|s| s.downcast_ref::<jetstream::context::RequestError>())
                    .is_some_and(|r| r.kind() == jetstream::context::RequestErrorKind::TimedOut);
                let unavailable = matches!(
                    e.kind(),
                    jetstream::context::GetStreamErrorKind::JetStream(j) if j.code() == 503
                );
                if not_found {
                    Err(Setup::Fail(Error::invalid_input(format!(
                        "stream {:?} does not exist on {shown}; create it, or add \
                         create_stream=true (and stream_subjects) to create it at start-up",
                        setup.name
                    ))))
                } else {
                    let error = Error::unavailable(
                        "nats",
                        format!(
                            "cannot look up stream {:?} on {shown}: {detail}",
                            setup.name
                        ),
                        detail,
                    );
                    Err(if timed_out || unavailable {
                        Setup::Retry(error)
                    } else {
                        Setup::Fail(error)
                    })
                }
            }
        }
    }

    /// FM-C4: a duplicate ack names the sequence of the message the server kept for this
    /// `Nats-Msg-Id`; count it as delivered only if that message is there and carries our id.
    pub(crate) async fn verify_duplicate(
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

/// The headers of `msg` in `envelope`: `Nats-Msg-Id` (the message id, JetStream's dedup) in
/// every envelope, then the standard headers, or the CloudEvents headers of the NATS binding.
pub(crate) fn headers_for(msg: &Message, envelope: &Envelope) -> Result<HeaderMap, String> {
    let id = msg.id.hyphenated().to_string();
    let mut headers = HeaderMap::new();
    headers.insert(NATS_MESSAGE_ID, id.as_str());
    if envelope.is_cloudevents() {
        let ce = envelope.headers(msg, Binding::Nats);
        for (name, value) in &ce.protocol {
            // Prefixed extension names (`a-z0-9`) and percent-encoded values: always valid.
            let invalid = || format!("CloudEvents header {name:?} of message {id} is not valid");
            let header_name = HeaderName::from_str(name).map_err(|_| invalid())?;
            let header_value = HeaderValue::from_str(value).map_err(|_| invalid())?;
            headers.append(header_name, header_value);
        }
        for (name, value) in ce.passthrough {
            append_user_header(&mut headers, msg, name, value)?;
        }
        return Ok(headers);
    }
    for (name, value) in standard_header_refs(msg, &id) {
        // The id JetStream deduplicates on is the stored message's own: a user header of that
        // name would add a second, contradicting value.
        if name.eq_ignore_ascii_case(NATS_MESSAGE_ID.as_ref()) {
            continue;
        }
        let header_name = match STANDARD_HEADER_NAMES.iter().find(|std| **std == name) {
            Some(std) => HeaderName::from_static(std),
            None => HeaderName::from_str(name).map_err(|_| {
                format!(
                    "header name {name:?} of message {} is not valid in NATS \
                     (ASCII without ':', spaces or control characters)",
                    msg.id
                )
            })?,
        };
        let header_value = HeaderValue::from_str(value).map_err(|_| {
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

/// Append a user header sent under its own name beside a CloudEvents envelope, with the same
/// checks as in the default envelope.
fn append_user_header(
    headers: &mut HeaderMap,
    msg: &Message,
    name: &str,
    value: &str,
) -> Result<(), String> {
    if name.eq_ignore_ascii_case(NATS_MESSAGE_ID.as_ref()) {
        return Ok(());
    }
    let header_name = HeaderName::from_str(name).map_err(|_| {
        format!(
            "header name {name:?} of message {} is not valid in NATS \
             (ASCII without ':', spaces or control characters)",
            msg.id
        )
    })?;
    let header_value = HeaderValue::from_str(value).map_err(|_| {
        format!(
            "header {name:?} of message {} has a value with a line break, which NATS \
             headers cannot carry",
            msg.id
        )
    })?;
    headers.append(header_name, header_value);
    Ok(())
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
        Flight::new(self, batch).run().await
    }

    fn name(&self) -> &str {
        "nats"
    }

    /// Connected when the client's connection state says so (no round trip).
    async fn check(&self) -> Result<(), Error> {
        match self.client.connection_state() {
            State::Connected => Ok(()),
            state => Err(Error::Unavailable {
                what: "nats".into(),
                message: format!(
                    "not connected to NATS at {} ({state:?})",
                    redact_url(&self.config.url)
                ),
                source: None,
            }),
        }
    }
}

/// The pause before reconnect attempt `attempts` (1-based): at once, then doubling from 2 ms up
/// to 1 s (the client's default caps at 4 s), so that publishing resumes within about a second
/// of the server's return after an outage of any length.
fn reconnect_delay(attempts: usize) -> std::time::Duration {
    let exp = u32::try_from(attempts.saturating_sub(1)).unwrap_or(u32::MAX);
    if exp == 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::from_millis(2_u64.saturating_pow(exp).min(1000))
}

#[cfg(test)]
mod reconnect_tests {
    use super::reconnect_delay;
    use std::time::Duration;

    #[test]
    fn reconnects_back_off_to_a_cap_of_one_second() {
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(2));
        assert_eq!(reconnect_delay(5), Duration::from_millis(16));
        assert_eq!(reconnect_delay(11), Duration::from_secs(1));
        assert_eq!(reconnect_delay(usize::MAX), Duration::from_secs(1));
    }
}
