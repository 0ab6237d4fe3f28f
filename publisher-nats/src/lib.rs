//! NATS JetStream publisher for the `outbox` relay.
//!
//! ```no_run
//! # async fn demo() -> Result<(), outbox_traits::Error> {
//! use outbox_publisher_nats::{NatsConfig, NatsPublisher};
//! let config = NatsConfig::from_url(
//!     "nats://127.0.0.1:4222?subject=outbox.{aggregate_type}.{event_type}&stream=OUTBOX&create_stream=true",
//! )?;
//! let publisher = NatsPublisher::connect(config).await?;
//! # Ok(()) }
//! ```
//!
//! # What it guarantees
//! - **Subject** from a [`RoutingTemplate`](outbox_routing::RoutingTemplate) over the message's
//!   fields. Field values are made subject-safe: spaces, control characters, `*` and `>` become `_`,
//!   and an empty token becomes `_` (dots are kept, so `order.placed` adds a subject level).
//! - **Headers**: `Nats-Msg-Id` = the message id (JetStream drops a republish within the stream's
//!   duplicate window), plus [`outbox_routing::standard_headers`] (message id, event type,
//!   aggregate type and id, partition key, `content-type` for a binary payload, user headers
//!   such as `traceparent`). A user header named `Nats-Msg-Id` (in any case) is left out: the
//!   id JetStream deduplicates on is always the stored message's own.
//! - **CloudEvents** ([`NatsConfig::envelope`], URL options `envelope=` and `ce_source=`): by the
//!   NATS protocol binding (1.0.3) instead of the standard headers, with `Nats-Msg-Id` kept.
//!   `envelope=cloudevents` (binary mode): every attribute in a `ce-` header, values
//!   percent-encoded as the binding says (`ce-id`, `ce-source`, `ce-type`, `ce-subject`,
//!   `ce-time`, `ce-datacontenttype: application/json`, `ce-partitionkey`,
//!   `ce-aggregatetype`, `ce-traceparent`...), the payload as the body.
//!   `envelope=cloudevents-structured`: `content-type: application/cloudevents+json` and the
//!   whole event as the body. See [`outbox_routing::envelope`] for every attribute.
//! - **Binary payloads** ([`outbox_traits::Binary`]): the body is the bytes, untouched, with
//!   their content type in `content-type` (binary mode: `ce-datacontenttype`); structured mode
//!   carries them base64-encoded in the event's `data_base64`. JSON messages get no
//!   `content-type` in the default envelope, as before.
//! - **Pipelining with per-key order**: every partition key is a lane that has at most one
//!   message in flight, and up to `max_in_flight` lanes run at once. JetStream can store a later
//!   message after an earlier one failed, so a key never has two messages in flight; different keys
//!   (and unordered messages) go in parallel. When a key's message is not acknowledged, its later
//!   messages in the batch are not sent ([`PublishOutcome::NotAttempted`](outbox_traits::PublishOutcome)).
//! - **Verified duplicates** (FM-C4): an ack with `duplicate: true` counts as
//!   [`Acked`](outbox_traits::PublishOutcome::Acked) only after the stream message at the acked
//!   sequence is read back and carries this message's `Nats-Msg-Id`; otherwise it is
//!   [`Ambiguous`](outbox_traits::PublishOutcome::Ambiguous), because a server can refuse a retry
//!   as a duplicate of a message it never stored (nats-server PR #6415).
//!
//! # Outcome classification
//! | what happened | outcome |
//! |---|---|
//! | ack | `Acked` |
//! | duplicate ack, stored message verified | `Acked` |
//! | duplicate ack, not verifiable | `Ambiguous` |
//! | no ack within the timeout, connection lost after sending | `Ambiguous` |
//! | client not connected, or the send itself timed out (nothing left the client) | `Failed` transient |
//! | no stream captures the subject ("no responders") | `Failed` transient: an operator can create the stream and the relay's retries then succeed; `max_attempts` still dead-letters it eventually |
//! | message over the server's `max_payload` or the stream's `max_msg_size` | `Failed` permanent: retrying can never succeed |
//! | subject or header not valid in NATS | `Failed` permanent |
//! | other JetStream API errors (e.g. stream limits with discard=new) | `Failed` transient |
//!
//! Once one message of a batch times out or finds the connection gone, messages of other lanes
//! that were not sent yet fail as transient at once instead of each waiting for its own timeout,
//! so a batch against a dead server returns within about one timeout.

//! # Capabilities
//! - [x] ids carried to the broker: `Nats-Msg-Id` and `message-id` headers
//! - [x] broker-side dedup by id, within the stream's duplicate window (FM-C4)
//! - [x] per-key order, with `NotAttempted` for a key's messages after a failure
//! - [x] pipelined: up to `max_in_flight` keys in flight per publish call
//! - [x] per-message classified outcomes, verified duplicates
//! - [x] bounded time when the server is down (about one `timeout`)
//! - [x] optional stream creation at start-up
//!
//! # Clusters
//! List the cluster's seed servers in the URL, `nats://h1:4222,h2:4222,h3:4222?subject=...`
//! (credentials, TLS and the other options once, for every server), and create the stream
//! with `stream_replicas=3` (or create it so yourself). The relay starts while any seed is down
//! (the client tries each), learns the rest of the cluster from the server it reaches, and
//! moves to another server when its server fails: messages in flight then are `Ambiguous` and
//! published again, which the stream's duplicate window absorbs (`Nats-Msg-Id`). A stream
//! leader moving (a server killed, or `$JS.API.STREAM.LEADER.STEPDOWN`) shows as a few acks
//! timing out or "no responders" while the replicas elect a new leader: transient failures the
//! relay retries. Tested against a private 3-server cluster in `e2e/tests/clusters.rs`.
//!
//! # Use through `outbox` or directly
//! Through the `outbox` facade (feature `nats`), a `nats://...` URL picks this publisher. Directly:
//! depend on `outbox-publisher-nats`, build a [`NatsConfig`] (from a URL, or in code with
//! [`NatsConfig::builder`]) and hand
//! `NatsPublisher::connect(config).await?` to the relay as its `Publisher`.
//!
//! To share a connection, pass your own client to [`NatsPublisher::with_client`]. The in-flight
//! limit applies to each publish call: concurrent calls on one publisher (several relay
//! workers, or batches in flight) each have up to `max_in_flight` keys in flight, on one shared
//! connection.

mod config;
mod flight;
mod publisher;
mod security;
mod subject;

pub use config::{
    NatsConfig, NatsConfigBuilder, StreamSetup, DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT, URL_OPTIONS,
};
pub use publisher::NatsPublisher;
pub use security::{connect_fix, NatsAuth, NatsSecurity};
