//! [`KafkaPublisher`]: the [`Publisher`] implementation.

use std::borrow::Cow;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::FutureExt;
use outbox_routing::{standard_headers, Binding};
use outbox_traits::{
    async_trait, settle_in_key_order, Error, KeyGate, Message, PublishOutcome, Publisher,
};
use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, FromClientConfigAndContext, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer, PurgeConfig};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::{check_topic_name, is_topic_char, KafkaConfig};
use crate::log_limit::LIBRDKAFKA_LOG;

/// Extra time, beyond the message timeout, that `publish` waits for delivery reports before it
/// calls the rest ambiguous. librdkafka reports every message within the message timeout (an
/// in-flight request may add up to one request timeout); this margin only guards against a
/// report that never comes, so that `publish` cannot hang.
const REPORT_MARGIN: Duration = Duration::from_secs(30);

/// How long to wait before retrying an enqueue when librdkafka's local queue is full and this
/// batch has no delivery of its own left to wait for (other batches filled the queue).
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(5);

/// A [`Publisher`] that sends messages to Kafka with librdkafka's idempotent producer.
///
/// Create it with [`KafkaPublisher::new`]; it connects lazily, so it can be created while the
/// brokers are down. It is cheap to share (`Arc`) and safe to call from several tasks at once.
/// See the [crate documentation](crate) for what is sent and how outcomes are classified.
pub struct KafkaPublisher {
    config: KafkaConfig,
    client_config: ClientConfig,
    slot: RwLock<Arc<Slot>>,
}

/// One producer instance and the generation number that tells a replaced one from its successor.
struct Slot {
    producer: Option<FutureProducer<LogContext>>,
    generation: u64,
    /// Set (again) each time librdkafka reports that this producer lost every broker connection
    /// (`ALL_BROKERS_DOWN`); it never goes back, the producer is replaced before its next use.
    lost_brokers: watch::Receiver<bool>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Dropping a producer purges it and may wait for its threads; keep that off the async
        // workers when a runtime is around.
        if let Some(producer) = self.producer.take() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn_blocking(move || drop(producer));
            }
        }
    }
}

impl Slot {
    /// A new producer made from `cc`, as generation `generation`.
    fn new(cc: &ClientConfig, generation: u64) -> Result<Self, Error> {
        let (tx, lost_brokers) = watch::channel(false);
        let producer = create_producer(cc, LogContext { lost_brokers: tx })?;
        Ok(Self {
            producer: Some(producer),
            generation,
            lost_brokers,
        })
    }

    fn producer(&self) -> Option<&FutureProducer<LogContext>> {
        self.producer.as_ref()
    }

    /// Why this producer must not be used again, if it must not: a fatal error, or every
    /// broker connection lost.
    fn unusable(&self) -> Option<Replace> {
        let producer = self.producer()?;
        if producer.client().fatal_error().is_some() {
            Some(Replace::Fatal)
        } else if *self.lost_brokers.borrow() {
            Some(Replace::LostBrokers)
        } else {
            None
        }
    }
}

/// Why a producer is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replace {
    /// librdkafka declared it fatally failed; it refuses all further work.
    Fatal,
    /// It lost every broker connection. Its idempotence session (producer id, epoch, sequence
    /// numbers) may be gone with the broker's state (a broker replaced by an empty one answers
    /// it with `UNKNOWN_PRODUCER_ID`, a fatal error that would cost the next batch an attempt),
    /// and it reconnects only after its reconnect back-off (up to 10 s), while a new producer
    /// connects at once and asks the brokers for a new producer id.
    LostBrokers,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// Check `config` and create the producer. Does not connect: the brokers are contacted on
    /// the first publish (or by [`KafkaPublisher::check_connection`]).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad configuration (what to fix is in the message; secret
    /// values are never shown), [`Error::Unavailable`] when librdkafka cannot create a client.
    pub fn new(config: KafkaConfig) -> Result<Self, Error> {
        let client_config = config.client_config()?;
        let slot = Slot::new(&client_config, 0)?;
        Ok(Self {
            config,
            client_config,
            slot: RwLock::new(Arc::new(slot)),
        })
    }

    /// Parse a `kafka://` URL ([`KafkaConfig::from_url`]) and create the publisher
    /// ([`KafkaPublisher::new`]).
    ///
    /// # Errors
    /// As [`KafkaConfig::from_url`] and [`KafkaPublisher::new`].
    pub fn from_url(url: &str) -> Result<Self, Error> {
        Self::new(KafkaConfig::from_url(url)?)
    }

    /// The configuration this publisher was made from.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// How many times the producer has been replaced (after a fatal error, or after it lost
    /// every broker connection).
    pub fn producer_generation(&self) -> u64 {
        self.current().generation
    }

    /// Ask the cluster for its metadata, to fail fast at start-up when no broker answers (and,
    /// as [`Publisher::check`], to tell whether the brokers are reachable now). A producer that
    /// lost every broker connection is replaced first, so that a broker that came back is
    /// seen at once rather than after the old producer's reconnect back-off.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when no broker answered within `timeout`.
    pub async fn check_connection(&self, timeout: Duration) -> Result<(), Error> {
        let slot = self.usable_slot();
        let brokers = self.config.brokers.clone();
        let result = tokio::task::spawn_blocking(move || {
            // A client of this slot: the producer itself is kept alive by `slot`.
            slot.producer()
                .map(|p| p.client().fetch_metadata(None, timeout).map(|_| ()))
        })
        .await;
        match result {
            Ok(Some(Ok(()))) => Ok(()),
            Ok(Some(Err(e))) => Err(Error::unavailable(
                "kafka",
                format!(
                    "no metadata from brokers {brokers} within {timeout:?}: {e}; check that the \
                     brokers are up and reachable, and with TLS or SASL that security.protocol \
                     matches the listener, ssl.ca.location holds the CA that signed the \
                     brokers' certificates (which must name the host connected to) and the SASL \
                     user and password are right (the Kafka client's warnings say which)"
                ),
                e,
            )),
            Ok(None) => Err(Error::Unavailable {
                what: "kafka".into(),
                message: "no Kafka producer could be created".into(),
                source: None,
            }),
            Err(join) => Err(Error::Unavailable {
                what: "kafka".into(),
                message: format!("metadata request did not complete: {join}"),
                source: None,
            }),
        }
    }

    fn current(&self) -> Arc<Slot> {
        // A poisoned lock only means another thread panicked while swapping the Arc; the Arc
        // inside is still a whole, valid value.
        match self.slot.read() {
            Ok(guard) => Arc::clone(&guard),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// The current producer, replaced first if it has hit a fatal error or lost every broker
    /// connection.
    fn usable_slot(&self) -> Arc<Slot> {
        let slot = self.current();
        if slot.producer().is_none() {
            return self.replace_producer(slot.generation, Replace::Fatal);
        }
        match slot.unusable() {
            None => slot,
            Some(why) => self.replace_producer(slot.generation, why),
        }
    }

    /// Replace the producer of generation `seen` (unless another task already did) and return
    /// the current slot.
    fn replace_producer(&self, seen: u64, why: Replace) -> Arc<Slot> {
        let mut guard = match self.slot.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if guard.generation == seen {
            match Slot::new(&self.client_config, seen + 1) {
                Ok(slot) => {
                    match why {
                        Replace::Fatal => tracing::warn!(
                            generation = seen + 1,
                            "kafka: replaced the producer after a fatal error"
                        ),
                        // Logged once per outage by the relay ("broker is down"); a probe may
                        // replace a producer every second while the brokers stay down.
                        Replace::LostBrokers => tracing::debug!(
                            generation = seen + 1,
                            "kafka: replaced a producer that lost every broker connection"
                        ),
                    }
                    *guard = Arc::new(slot);
                }
                Err(e) => {
                    tracing::error!(error = %e, "kafka: could not create a new producer; will retry on the next batch");
                }
            }
        }
        Arc::clone(&guard)
    }

    /// The headers and value of `msg`'s record in the configured envelope (the key is the
    /// partition key in every envelope).
    fn envelope<'m>(&self, msg: &'m Message) -> (OwnedHeaders, Cow<'m, [u8]>) {
        let envelope = &self.config.envelope;
        let mut headers = OwnedHeaders::new_with_capacity(9 + msg.headers.len());
        if !envelope.is_cloudevents() {
            for (name, value) in standard_headers(msg) {
                headers = headers.insert(Header {
                    key: &name,
                    value: Some(value.as_bytes()),
                });
            }
            return (headers, Cow::Borrowed(msg.body()));
        }
        let ce = envelope.headers(msg, Binding::Kafka);
        let protocol = ce.protocol.iter().map(|(n, v)| (n.as_str(), v.as_str()));
        for (name, value) in protocol.chain(ce.passthrough.iter().copied()) {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        (headers, envelope.body(msg))
    }

    fn topic_for(&self, msg: &Message) -> Result<String, String> {
        let topic = self.config.topic.render_with(msg, sanitize_topic_value);
        check_topic_name(&topic)?;
        Ok(topic)
    }
}

/// Make a field value usable inside a topic name.
fn sanitize_topic_value(value: &str) -> Cow<'_, str> {
    if value.chars().all(is_topic_char) {
        Cow::Borrowed(value)
    } else {
        Cow::Owned(
            value
                .chars()
                .map(|c| if is_topic_char(c) { c } else { '_' })
                .collect(),
        )
    }
}

fn create_producer(
    cc: &ClientConfig,
    context: LogContext,
) -> Result<FutureProducer<LogContext>, Error> {
    FutureProducer::from_config_and_context(cc, context).map_err(|e| match e {
        KafkaError::ClientConfig(..) => Error::invalid_input(format!(
            "librdkafka refused the producer configuration: {}",
            redact_config_error(&e)
        )),
        other => Error::unavailable("kafka", format!("cannot create a producer: {other}"), other),
    })
}

fn redact_config_error(err: &KafkaError) -> String {
    match err {
        KafkaError::ClientConfig(_, description, key, value) => {
            let value = if crate::config::is_sensitive(key) {
                "***"
            } else {
                value
            };
            format!("{key}={value}: {description}")
        }
        other => other.to_string(),
    }
}

/// Sends librdkafka's own log lines and errors to `tracing`, and tells its producer's slot when
/// every broker connection is lost.
struct LogContext {
    lost_brokers: watch::Sender<bool>,
}

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        // Rate limited: an unreachable broker makes librdkafka repeat itself many times a second.
        let Some(dropped) = LIBRDKAFKA_LOG.admit(std::time::Instant::now()) else {
            return;
        };
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", dropped, "{fac} {log_message}")
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: "librdkafka", dropped, "{fac} {log_message}")
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", dropped, "{fac} {log_message}")
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: "librdkafka", dropped, "{fac} {log_message}")
            }
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(error, KafkaError::Global(RDKafkaErrorCode::AllBrokersDown)) {
            // Before the rate limit: this must never be dropped.
            self.lost_brokers.send_replace(true);
        }
        // Connection errors repeat while a broker is down; each message's outcome carries what
        // matters to the relay, so these are warnings, not errors (and rate limited).
        let Some(dropped) = LIBRDKAFKA_LOG.admit(std::time::Instant::now()) else {
            return;
        };
        tracing::warn!(target: "librdkafka", error = %error, dropped, "{reason}");
    }
}

/// What became of one message while the batch was handed to librdkafka.
enum Slotted {
    /// Enqueued; its delivery report is pending.
    Pending(DeliveryFuture),
    /// Outcome known without a delivery report.
    Done(PublishOutcome),
    /// Enqueued, and its delivery report was awaited early (to make room in a full queue).
    Reported(PublishOutcome),
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish(&self, batch: &[Message]) -> Vec<PublishOutcome> {
        let slot = self.usable_slot();
        let Some(producer) = slot.producer() else {
            return batch
                .iter()
                .map(|_| PublishOutcome::transient("kafka: no producer could be created"))
                .collect();
        };
        let mut outage = Outage {
            slot: Arc::clone(&slot),
            lost_brokers: slot.lost_brokers.clone(),
            purged: false,
        };
        let report_deadline = Instant::now() + self.config.message_timeout + REPORT_MARGIN;
        let queue_deadline = Instant::now() + self.config.message_timeout;

        let mut slots: Vec<Slotted> = Vec::with_capacity(batch.len());
        // The topic of each message, for error reasons (empty when it had none).
        let mut topics: Vec<String> = Vec::with_capacity(batch.len());
        // Closes a key once one of its messages is not handed to librdkafka: the key's later
        // messages are not sent at all.
        let mut gate = KeyGate::new();
        // Index of the oldest pending delivery not yet awaited, for freeing queue space.
        let mut oldest = 0usize;
        let mut fatal_while_enqueueing = false;

        for msg in batch {
            let key = msg.partition_key.as_deref();
            if !gate.admits(msg) {
                slots.push(Slotted::Done(PublishOutcome::NotAttempted));
                topics.push(String::new());
                continue;
            }
            if fatal_while_enqueueing || outage.purged {
                topics.push(String::new());
                slots.push(Slotted::Done(PublishOutcome::transient(if outage.purged {
                    "kafka: not sent: every broker connection was lost"
                } else {
                    "kafka: not sent: the producer hit a fatal error and is being replaced"
                })));
                gate.close(msg);
                continue;
            }
            let topic = match self.topic_for(msg) {
                Ok(t) => t,
                Err(why) => {
                    slots.push(Slotted::Done(PublishOutcome::permanent(format!(
                        "kafka: no valid topic for message {}: {why}",
                        msg.id
                    ))));
                    topics.push(String::new());
                    gate.close(msg);
                    continue;
                }
            };
            let (headers, body) = self.envelope(msg);
            let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(&topic)
                .payload(body.as_ref())
                .headers(headers);
            if let Some(k) = key {
                record = record.key(k);
            }
            let outcome = loop {
                match producer.send_result(record) {
                    Ok(delivery) => break Slotted::Pending(delivery),
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        record = back;
                        if Instant::now() >= queue_deadline {
                            break Slotted::Done(PublishOutcome::transient(format!(
                                "kafka: local producer queue stayed full for {:?}; raise \
                                 queue.buffering.max.messages or publish smaller batches",
                                self.config.message_timeout
                            )));
                        }
                        // Waiting for this batch's oldest delivery frees queue space without
                        // polling in a loop.
                        if let Some(i) = next_pending(&slots, oldest) {
                            if let Slotted::Pending(fut) = &mut slots[i] {
                                let report = outage.report(fut, report_deadline, &topics[i]).await;
                                slots[i] = Slotted::Reported(report);
                            }
                            oldest = i + 1;
                        } else {
                            tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                        }
                    }
                    Err((KafkaError::MessageProduction(code), _)) => {
                        if code == RDKafkaErrorCode::Fatal {
                            fatal_while_enqueueing = true;
                        }
                        break Slotted::Done(classify_enqueue_error(code, &topic));
                    }
                    Err((other, _)) => {
                        break Slotted::Done(PublishOutcome::transient(format!(
                            "kafka: could not enqueue to {topic}: {other}"
                        )));
                    }
                }
            };
            if matches!(outcome, Slotted::Done(_)) {
                gate.close(msg);
            }
            slots.push(outcome);
            topics.push(topic);
        }

        // Every message is in librdkafka's hands now; collect the reports. Awaiting them one
        // after the other costs nothing extra: they are all in flight together.
        let mut outcomes = Vec::with_capacity(batch.len());
        let mut sent = Vec::with_capacity(batch.len());
        for (i, s) in slots.into_iter().enumerate() {
            let (outcome, was_sent) = match s {
                Slotted::Pending(mut fut) => (
                    outage.report(&mut fut, report_deadline, &topics[i]).await,
                    true,
                ),
                Slotted::Reported(o) => (o, true),
                Slotted::Done(o) => (o, false),
            };
            outcomes.push(outcome);
            sent.push(was_sent);
        }

        if let Some((code, reason)) = producer.client().fatal_error() {
            tracing::error!(%code, %reason, "kafka: fatal producer error; replacing the producer");
            in_doubt(&mut outcomes, &sent, |_| {
                format!("kafka: fatal producer error ({code}: {reason}); the producer was replaced")
            });
            let generation = slot.generation;
            drop(outage);
            drop(slot);
            self.replace_producer(generation, Replace::Fatal);
        } else if outage.purged {
            // Every broker connection was lost while this batch waited for its reports: the
            // undelivered messages were purged rather than left to time out, so that the relay
            // asks `check` while the brokers are still down (and releases the batch without
            // counting an attempt) instead of minutes later, when they may be back. The
            // producer is replaced before its next use.
            tracing::debug!("kafka: every broker connection was lost during a batch; purged");
            in_doubt(&mut outcomes, &sent, |i| {
                format!(
                    "kafka: every broker connection was lost before delivery to {} was \
                     confirmed; the message may or may not be stored",
                    topics[i]
                )
            });
        }

        keep_key_order(batch, &mut outcomes);
        outcomes
    }

    fn name(&self) -> &str {
        "kafka"
    }

    /// A metadata fetch, bounded by [`CHECK_TIMEOUT`].
    async fn check(&self) -> Result<(), Error> {
        self.check_connection(CHECK_TIMEOUT).await
    }
}

/// How long [`Publisher::check`] waits for the cluster's metadata: under the relay's 5 s bound
/// on a check, so that the relay logs this publisher's own reason when the brokers are down.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(4);

/// Make every message that was handed to librdkafka and neither acknowledged nor refused for
/// good [`PublishOutcome::Ambiguous`], with the reason `reason(index)`.
fn in_doubt(outcomes: &mut [PublishOutcome], sent: &[bool], reason: impl Fn(usize) -> String) {
    for (i, (outcome, was_sent)) in outcomes.iter_mut().zip(sent).enumerate() {
        let own_permanent = matches!(
            outcome,
            PublishOutcome::Failed {
                kind: outbox_traits::ErrorKind::Permanent,
                ..
            }
        );
        if *was_sent && !outcome.is_acked() && !own_permanent {
            *outcome = PublishOutcome::Ambiguous { reason: reason(i) };
        }
    }
}

/// One batch's watch over its producer's broker connections while it waits for reports.
struct Outage {
    slot: Arc<Slot>,
    lost_brokers: watch::Receiver<bool>,
    /// The producer's queues were purged because every broker connection was lost.
    purged: bool,
}

/// How long a batch that saw every broker connection lost waits for the cluster's metadata
/// before it calls the brokers unreachable and purges its messages.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);

impl Outage {
    /// Wait for one delivery report (see [`await_report`]). Each time the producer reports
    /// every broker connection lost meanwhile, ask the cluster for its metadata: a broker that
    /// dropped one connection and answers again (librdkafka then retries by itself) changes
    /// nothing, while brokers that stay unreachable get the producer's queued and in-flight
    /// messages purged (once per batch), so that their reports come at once (`PURGE_QUEUE` /
    /// `PURGE_INFLIGHT`) instead of after the message timeout: an outage is then seen while
    /// it lasts.
    async fn report(
        &mut self,
        fut: &mut DeliveryFuture,
        deadline: Instant,
        topic: &str,
    ) -> PublishOutcome {
        while !self.purged {
            let lost = self.lost_brokers.changed().map(|r| r.is_ok());
            let lost = tokio::select! {
                biased;
                outcome = await_report(&mut *fut, deadline, topic) => return outcome,
                true = lost => true,
            };
            if lost {
                self.lost_brokers.borrow_and_update();
                if self.unreachable().await {
                    self.purged = true;
                    if let Some(producer) = self.slot.producer() {
                        producer.purge(PurgeConfig::default().queue().inflight().non_blocking());
                    }
                }
            }
        }
        await_report(fut, deadline, topic).await
    }

    /// Whether no broker gives the cluster's metadata within [`CONFIRM_TIMEOUT`].
    async fn unreachable(&self) -> bool {
        let slot = Arc::clone(&self.slot);
        let answered = tokio::task::spawn_blocking(move || {
            slot.producer()
                .is_some_and(|p| p.client().fetch_metadata(None, CONFIRM_TIMEOUT).is_ok())
        })
        .await;
        !matches!(answered, Ok(true))
    }
}

fn next_pending(slots: &[Slotted], from: usize) -> Option<usize> {
    (from..slots.len()).find(|&i| matches!(slots[i], Slotted::Pending(_)))
}

/// Wait for one delivery report, at most until `deadline`.
async fn await_report(fut: &mut DeliveryFuture, deadline: Instant, topic: &str) -> PublishOutcome {
    match tokio::time::timeout_at(deadline, fut).await {
        Ok(Ok(Ok(_delivery))) => PublishOutcome::Acked,
        Ok(Ok(Err((KafkaError::MessageProduction(code), _)))) => classify_delivery(code, topic),
        Ok(Ok(Err((other, _)))) => PublishOutcome::Ambiguous {
            reason: format!("kafka: delivery to {topic} failed: {other}"),
        },
        Ok(Err(_canceled)) => PublishOutcome::Ambiguous {
            reason: format!("kafka: the producer was closed before reporting delivery to {topic}"),
        },
        Err(_elapsed) => PublishOutcome::Ambiguous {
            reason: format!("kafka: no delivery report from {topic} in time"),
        },
    }
}

/// Whether a broker or librdkafka error code means the message will never be accepted as is.
fn is_permanent(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::MessageBatchTooLarge
            | C::InvalidMessage
            | C::InvalidRecord
            | C::InvalidTopic
            | C::UnknownTopic
            | C::UnknownTopicOrPartition
            | C::UnknownPartition
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::InvalidTimestamp
            | C::UnsupportedForMessageFormat
            | C::PolicyViolation
            | C::InvalidRequiredAcks
            | C::InvalidArgument
            | C::BadMessage
    )
}

/// Classify a failed delivery report.
fn classify_delivery(code: RDKafkaErrorCode, topic: &str) -> PublishOutcome {
    use RDKafkaErrorCode as C;
    let reason = format!("kafka: delivery to {topic} failed: {code}");
    if is_permanent(code) {
        return PublishOutcome::permanent(hint(code, reason));
    }
    match code {
        // The message was (or may have been) sent; the broker may have stored it.
        C::MessageTimedOut
        | C::RequestTimedOut
        | C::OperationTimedOut
        | C::PurgeInflight
        | C::Fatal
        | C::GaplessGuarantee
        | C::NotEnoughReplicasAfterAppend
        | C::BrokerTransportFailure
        | C::NetworkException
        | C::OutOfOrderSequenceNumber
        | C::UnknownProducerId
        | C::InvalidProducerEpoch
        | C::InvalidProducerIdMapping => PublishOutcome::Ambiguous { reason },
        // Never left the local queue, or a retriable broker error: not stored.
        _ => PublishOutcome::transient(reason),
    }
}

/// Classify an error returned when handing a message to librdkafka (nothing was sent).
fn classify_enqueue_error(code: RDKafkaErrorCode, topic: &str) -> PublishOutcome {
    let reason = format!("kafka: could not enqueue to {topic}: {code}");
    if is_permanent(code) {
        PublishOutcome::permanent(hint(code, reason))
    } else {
        PublishOutcome::transient(reason)
    }
}

fn hint(code: RDKafkaErrorCode, reason: String) -> String {
    use RDKafkaErrorCode as C;
    match code {
        C::MessageSizeTooLarge | C::InvalidMessageSize | C::MessageBatchTooLarge => format!(
            "{reason}; the broker's max.message.bytes (or the producer's message.max.bytes) is \
             smaller than the message: store large bodies elsewhere or raise the limits"
        ),
        C::UnknownTopic | C::UnknownTopicOrPartition | C::UnknownPartition => {
            format!("{reason}; create the topic or enable the broker's auto.create.topics.enable")
        }
        _ => reason,
    }
}

/// Apply the per-key rule of the contract to the delivery reports (see
/// [`settle_in_key_order`]), warning about each message acknowledged after an earlier message of
/// its key was not: the key's order is broken if the earlier one is republished.
fn keep_key_order(batch: &[Message], outcomes: &mut [PublishOutcome]) {
    for index in settle_in_key_order(batch, outcomes) {
        tracing::warn!(
            message_id = %batch[index].id,
            "kafka: message acknowledged after an earlier message of its key was not; \
             the key's order is broken if the earlier one is republished"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::chrono::Utc;
    use outbox_traits::uuid::Uuid;

    fn msg(key: Option<&str>) -> Message {
        Message {
            id: Uuid::now_v7(),
            seq: 1,
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            event_type: "order.placed".into(),
            payload: "{}".into(),
            binary: None,
            headers: Default::default(),
            partition_key: key.map(str::to_owned),
            dedup_key: None,
            attempts: 0,
            created_at: Utc::now(),
        }
    }

    #[test]
    fn later_messages_of_a_failed_key_become_not_attempted() {
        let batch = [
            msg(Some("a")),
            msg(Some("b")),
            msg(Some("a")),
            msg(Some("a")),
            msg(None),
            msg(None),
        ];
        let mut outcomes = vec![
            PublishOutcome::Ambiguous { reason: "t".into() },
            PublishOutcome::Acked,
            PublishOutcome::transient("x"),
            PublishOutcome::Acked,
            PublishOutcome::transient("y"),
            PublishOutcome::transient("z"),
        ];
        keep_key_order(&batch, &mut outcomes);
        assert!(matches!(outcomes[0], PublishOutcome::Ambiguous { .. }));
        assert_eq!(outcomes[1], PublishOutcome::Acked);
        assert_eq!(outcomes[2], PublishOutcome::NotAttempted);
        // Stored: reported truthfully.
        assert_eq!(outcomes[3], PublishOutcome::Acked);
        // Unordered messages are independent of each other.
        assert!(matches!(outcomes[4], PublishOutcome::Failed { .. }));
        assert!(matches!(outcomes[5], PublishOutcome::Failed { .. }));
    }

    #[test]
    fn classification() {
        use outbox_traits::ErrorKind;
        let kind = |o: PublishOutcome| match o {
            PublishOutcome::Failed { kind, .. } => Some(kind),
            _ => None,
        };
        assert_eq!(
            kind(classify_delivery(
                RDKafkaErrorCode::MessageSizeTooLarge,
                "t"
            )),
            Some(ErrorKind::Permanent)
        );
        assert_eq!(
            kind(classify_delivery(
                RDKafkaErrorCode::TopicAuthorizationFailed,
                "t"
            )),
            Some(ErrorKind::Permanent)
        );
        assert!(matches!(
            classify_delivery(RDKafkaErrorCode::MessageTimedOut, "t"),
            PublishOutcome::Ambiguous { .. }
        ));
        assert_eq!(
            kind(classify_delivery(RDKafkaErrorCode::PurgeQueue, "t")),
            Some(ErrorKind::Transient)
        );
        assert_eq!(
            kind(classify_enqueue_error(RDKafkaErrorCode::QueueFull, "t")),
            Some(ErrorKind::Transient)
        );
    }

    #[test]
    fn topic_values_are_sanitized() {
        assert_eq!(sanitize_topic_value("order-1.x_y"), "order-1.x_y");
        assert_eq!(sanitize_topic_value("a b/c*"), "a_b_c_");
    }
}
