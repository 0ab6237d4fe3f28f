#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod claim;
mod config;
mod convert;
#[cfg(feature = "diesel")]
#[cfg_attr(docsrs, doc(cfg(feature = "diesel")))]
pub mod diesel;
mod enqueue;
mod error;
mod group;
mod lease;
mod leased;
mod migrate;
mod row;
mod sql;
mod status;
mod store;
pub mod url;

pub use claim::PREFERRED_CLAIM_SHARDS;
pub use config::{MysqlConfig, MysqlConfigBuilder, DEFAULT_TABLE};
pub use convert::convert_to_unpublished_table;
pub use enqueue::{enqueue, enqueue_batch};
pub use migrate::{migrate, MIGRATION_LOCK_PREFIX};
pub use store::MysqlStore;

/// Re-exported so users name the same sqlx version as this crate.
pub use sqlx;
