#![cfg_attr(
    all(feature = "postgres", feature = "mysql", feature = "sqlite", feature = "redis"),
    doc = include_str!("../README.md")
)]
#![cfg_attr(
    not(all(
        feature = "postgres",
        feature = "mysql",
        feature = "sqlite",
        feature = "redis"
    )),
    doc = "Consumer-side inbox for the transactional outbox: see the README (its examples \
           compile as doctests with every feature on)."
)]

mod common;
#[cfg(all(
    feature = "diesel",
    any(feature = "postgres", feature = "mysql", feature = "sqlite")
))]
mod diesel_common;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sqlx_common;

pub use common::{
    validate_consumer, InboxConfig, InboxConfigBuilder, Outcome, Receipt, DEFAULT_TABLE, MAX_BATCH,
    MAX_CONSUMER_CHARS,
};
pub use outbox_traits::Error;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use sqlx_common::HandlerFuture;
pub use uuid::Uuid;
