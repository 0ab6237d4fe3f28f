// The README's examples use Postgres; without that feature the crate docs are this line only,
// so `cargo test -p outbox` passes with any feature set.
#![cfg_attr(feature = "postgres", doc = include_str!("../../README.md"))]
#![cfg_attr(
    not(feature = "postgres"),
    doc = "Transactional outbox for Rust; see the README (built into these docs with the `postgres` feature)."
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use outbox_traits::*;
/// Passwords out of text that may hold a URL, before it is logged or shown (from `outbox-url`).
pub use outbox_url::{is_secret_option, redact_url};

/// The relay engine: claim → publish → complete/fail, batching, back-off, shutdown, metrics.
pub mod relay {
    pub use outbox_engine::*;
}

/// The in-memory reference store and the recording publisher, for unit tests of code that
/// enqueues or relays (feature `testing`, for `[dev-dependencies]`).
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod memory {
    pub use outbox_memory::*;
}

pub use outbox_publisher_stdout::{SharedBuffer, StdoutPublisher};

/// The PostgreSQL backend (`outbox-backend-postgres`).
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres {
    pub use outbox_backend_postgres::*;
}

/// The SQLite backend (`outbox-backend-sqlite`), the embedded default.
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite {
    pub use outbox_backend_sqlite::*;
}

/// The MariaDB (MySQL) backend (`outbox-backend-mysql`).
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql {
    pub use outbox_backend_mysql::*;
}

/// The NATS JetStream publisher (`outbox-publisher-nats`).
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats {
    pub use outbox_publisher_nats::*;
}

/// The Kafka publisher (`outbox-publisher-kafka`).
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka {
    pub use outbox_publisher_kafka::*;
}

/// The Redis Streams publisher (`outbox-publisher-redis`).
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis {
    pub use outbox_publisher_redis::*;
}

/// Trace context for messages (feature `otel`): what enqueue captures and the relay and
/// consumers read back. See the README, "Traces".
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub mod otel {
    pub use outbox_otel::*;
}

pub mod broker;
mod schemes;
pub mod store;
