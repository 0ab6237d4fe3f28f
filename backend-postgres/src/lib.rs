#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod claim;
mod config;
mod convert;
mod cursor;
#[cfg(feature = "diesel")]
#[cfg_attr(docsrs, doc(cfg(feature = "diesel")))]
pub mod diesel;
mod enqueue;
mod error;
mod group;
mod lease;
mod migrate;
mod partition;
mod row;
mod sql;
mod status;
mod store;
pub mod url;
mod wake;

pub use claim::{PREFERRED_BATCH, PREFERRED_CLAIM_SHARDS};
pub use config::{PostgresConfig, PostgresConfigBuilder, DEFAULT_SCHEMA, DEFAULT_TABLE};
pub use convert::{convert_to_cursor_claims, CONVERT_LOCK_TIMEOUT};
pub use enqueue::{enqueue, enqueue_batch};
pub use group::group_migration_sql;
pub use migrate::{migrate, MIGRATION_LOCK_KEY};
pub use store::PostgresStore;

/// Re-exported so users name the same sqlx version as this crate.
pub use sqlx;
