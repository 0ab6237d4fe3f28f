#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod enqueue;
mod error;
mod migrate;
mod row;
mod sql;
mod status;
mod store;
mod wake;

pub use config::{PostgresConfig, PostgresConfigBuilder, DEFAULT_SCHEMA, DEFAULT_TABLE};
pub use enqueue::{enqueue, enqueue_batch};
pub use migrate::{migrate, MIGRATION_LOCK_KEY};
pub use store::PostgresStore;

/// Re-exported so users name the same sqlx version as this crate.
pub use sqlx;
