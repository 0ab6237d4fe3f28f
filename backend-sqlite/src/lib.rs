#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod cancel;
mod claim;
mod config;
mod connection;
#[cfg(feature = "diesel")]
#[cfg_attr(docsrs, doc(cfg(feature = "diesel")))]
pub mod diesel;
mod enqueue;
mod error;
mod lease;
mod migrate;
mod row;
mod sql;
mod status;
mod store;

pub use config::{
    SqliteConfig, SqliteConfigBuilder, Synchronous, DEFAULT_BUSY_TIMEOUT, DEFAULT_TABLE,
};
pub use connection::open_connection;
pub use enqueue::{enqueue, enqueue_batch};
pub use error::sqlite_error;
pub use migrate::migrate;
pub use store::SqliteStore;

/// Re-exported so that callers name the same rusqlite version as this crate.
pub use rusqlite;
