//! Redis Streams publisher for the `outbox` relay.
//!
//! ```no_run
//! # async fn demo() -> Result<(), outbox_traits::Error> {
//! use outbox_publisher_redis::{RedisConfig, RedisPublisher};
//! let config = RedisConfig::from_url("redis://127.0.0.1:6379?stream=outbox.{aggregate_type}&maxlen=100000")?;
//! let publisher = RedisPublisher::connect(config).await?;
//! # Ok(()) }
//! ```
//!
//! # What it writes
//! One `XADD <stream> [MAXLEN ~ N] * field value ...` per message, into the stream named by a
//! [`RoutingTemplate`](outbox_routing::RoutingTemplate) (Redis keys are binary-safe, so values are
//! used as they are). Fields, in this order:
//!
//! | field | value |
//! |---|---|
//! | `id` | message id (UUID, hyphenated): consumers deduplicate on it |
//! | `event_type`, `aggregate_type`, `aggregate_id` | the message's fields |
//! | `partition_key` | only when the message has one |
//! | `content_type` | a binary payload's content type; absent for JSON |
//! | `payload` | the JSON payload text, byte for byte, or a binary payload's bytes, untouched (Redis strings are binary-safe) |
//! | `headers` | the user headers (including `traceparent`) as one JSON object, `{}` when none |
//!
//! Headers go in one JSON field rather than one `h:<name>` field each, so a header can never
//! collide with the fixed fields and a consumer reads them with one lookup.
//!
//! ## CloudEvents (`envelope=cloudevents`, `envelope=cloudevents-structured`)
//! Redis has no CloudEvents binding; with [`RedisConfig::envelope`] (URL options `envelope=`
//! and `ce_source=`) an entry follows the HTTP binding's header rules, field by field, with the
//! body in a `data` field (as Dapr's Redis Streams component writes it), so any SDK's HTTP
//! reader parses it given the fields as headers and `data` as the body:
//!
//! | mode | fields |
//! |---|---|
//! | binary | `ce-specversion`, `ce-id`, `ce-source`, `ce-type`, `ce-subject`, `ce-time`, `content-type` (= `datacontenttype`: `application/json`, or a binary payload's type), `ce-partitionkey`, `ce-aggregatetype`, `ce-<ext>`; values percent-encoded as in HTTP; `data` = the payload (a binary payload's bytes) |
//! | structured | `content-type: application/cloudevents+json`; `data` = the whole event (a binary payload base64-encoded in its `data_base64`) |
//!
//! In both, user headers that cannot be extension attributes go in a `headers` JSON field
//! (only when there are any). See [`outbox_routing::envelope`] for every attribute.
//!
//! # Batches, order and outcomes
//! A batch is one pipeline, in batch order, so per-key order holds: Redis runs a connection's
//! commands in the order sent. Outcomes:
//! - an entry id back: `Acked`;
//! - a message over `max_payload` (when set): `Failed` permanent before anything is sent, and
//!   its key's later messages are left out of the pipeline (`NotAttempted`);
//! - an error reply for one entry (`WRONGTYPE`: the stream key holds another type; `ERR`):
//!   `Failed` permanent; `OOM`, `READONLY`, `LOADING`, `BUSY`, `TRYAGAIN`, `MASTERDOWN` and the
//!   rest: `Failed` transient. Its key's later entries were already in the pipeline: they are
//!   reported as they came back (a stored entry is `Acked`, as it is stored). Such a per-entry
//!   error hits every entry of that stream alike (a wrong key type, out of memory, a read-only
//!   replica), so in practice a key's later entries on the same stream fail too; only a key whose
//!   messages go to several streams (a template using `{event_type}`) could see a later entry
//!   stored after an earlier one failed. Use a stream template without `{event_type}` when that
//!   matters;
//! - connection refused: `Failed` transient (nothing was sent);
//! - any other connection error or no reply within the timeout: `Ambiguous` for every message
//!   of the pipeline (some entries may be stored).
//!
//! Redis has no dedup by message id: a retried message is stored again, with the same `id`.

//! # Capabilities
//! - [x] ids carried to the broker: the `id` field
//! - [ ] broker-side dedup (consumers deduplicate on `id`)
//! - [x] per-key order (one ordered pipeline per batch; see above for a refused entry)
//! - [x] pipelined: one round trip per batch
//! - [x] per-message classified outcomes
//! - [x] bounded time when the server is down (about one `timeout`)
//! - [x] optional approximate trimming (`MAXLEN ~`)
//!
//! # Redis Cluster
//! `redis://h1:7000,h2:7001,h3:7002?stream=...&cluster=true` (see [`RedisConfig::from_url`]):
//! the cluster client (the `redis` crate's `cluster-async`) starts from any seed that answers,
//! follows `MOVED`/`ASK` redirects and retries through a failover. A cluster pipeline may not
//! cross slots, so a batch goes out as one pipeline per slot, all at once; each stream is one
//! key, so each stream's entries keep batch order. A pipeline error in a cluster (a node lost
//! mid-pipeline, or an error reply to any of its entries) makes every entry of that pipeline
//! `Ambiguous`: the relay publishes them again, and consumers deduplicate on `id`.
//! `hash_tag={aggregate_type}` puts all streams of one tag on one node (see
//! [`RedisConfig::hash_tag`]). Stream names are otherwise unchanged, so consumers read the same
//! keys as against one server.
//!
//! Redis replicates asynchronously: a master killed before its replica received an entry it
//! acknowledged loses that entry when the replica takes over. Even a manual `CLUSTER FAILOVER`,
//! which pauses the master's clients until the replica has caught up, can lose entries when the
//! pause runs out before the replica takes over. `wait_replicas=1` closes that gap: each
//! pipeline ends with `WAIT 1`, and its entries count as delivered only once a replica holds
//! them, else they are `Ambiguous` and published again. The price is availability: a master
//! with no live replica (its replica was promoted and the old master has not come back) takes
//! no acknowledged writes, so its streams' messages wait in the outbox until a replica returns.
//! Tested against a private 6-node cluster in `e2e/tests/clusters.rs`: with `wait_replicas=1`,
//! a master SIGKILLed mid-stream and a manual `CLUSTER FAILOVER` mid-stream each lose nothing
//! and keep every key's order. (Losses the failover test once reported came from its cluster:
//! the six nodes shared one RDB file, so a replica's full sync could load another master's
//! snapshot; each node now has its own.) As Redis's own documentation of `WAIT` says, it does
//! not make Redis strongly consistent (e.g. a replica that acknowledged and then failed with
//! its master): where a lost message is not acceptable, prefer a broker with replicated
//! acknowledgements (NATS JetStream with 3 replicas, Kafka with `acks=all`).
//!
//! # Use through `outbox` or directly
//! Through the `outbox` facade (feature `redis`), a `redis://...` URL picks this publisher.
//! Directly: depend on `outbox-publisher-redis`, build a [`RedisConfig`] (from a URL, or in code with [`RedisConfig::builder`])
//! and hand `RedisPublisher::connect(config).await?` to the relay as its `Publisher`.

mod config;
mod publisher;
mod tls;

pub use config::{RedisConfig, RedisConfigBuilder, DEFAULT_TIMEOUT, URL_OPTIONS};
pub use publisher::RedisPublisher;
pub use tls::RedisTls;
