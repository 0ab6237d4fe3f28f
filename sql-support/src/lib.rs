//! What the SQL outbox stores (`outbox-backend-postgres`, `outbox-backend-mysql`,
//! `outbox-backend-sqlite`) share, so that what differs between them is their SQL dialect and
//! their driver.
//!
//! The core needs no database driver:
//! - [`config`]: the table settings every store's configuration has ([`TableSettings`]) and the
//!   builder setters written once for the three builders ([`table_settings_setters!`]);
//! - [`ident`]: the check of every schema and table name spliced into SQL
//!   ([`validate_sql_identifier`]), and [`names`]: names derived from them;
//! - [`limits`]: durations in the units the SQL takes, the one limit on stored error texts;
//! - [`quarantine`]: rows that do not decode, their reasons and their one log line;
//! - [`admin`]: the admin flows that differ only by dialect (dead letters, requeue checks,
//!   purge loops).
//!
//! The driver parts are features, so each backend compiles only what it uses:
//! - `sqlx`: connecting a pool with errors that name the real cause and never the password
//!   ([`connect_pool`]), the classification of sqlx errors ([`map_sqlx`]; the database's own
//!   error codes stay with each backend), the store's pool and configuration ([`store`]), and
//!   row helpers ([`row`]), and the admin flows written once over a store's dialect
//!   ([`sqlx_admin`]). No sqlx driver is turned on here: each backend turns on its own.
//!   A failed connection's error says what to fix as well as what went wrong: a TLS
//!   certificate the client does not trust, a host name the certificate does not list, a
//!   TLS-only server reached without TLS, a wrong password (see the option table in `tls.rs`,
//!   also in the backends' READMEs).
//! - `diesel`: the classification of diesel-async errors shared by the stores' `diesel`
//!   enqueue modules.
//! - `rusqlite`: the conversions of the rusqlite store (SQLite).
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
pub mod config;
pub mod ident;
pub mod limits;
pub mod names;
pub mod quarantine;

#[cfg(feature = "sqlx")]
mod connect;
#[cfg(feature = "diesel")]
pub mod diesel;
#[cfg(feature = "sqlx")]
mod password;
#[cfg(feature = "sqlx")]
pub mod row;
#[cfg(feature = "rusqlite")]
pub mod rusqlite;
#[cfg(feature = "sqlx")]
pub mod sqlx_admin;
#[cfg(feature = "sqlx")]
pub mod store;
#[cfg(feature = "sqlx")]
mod tls;

pub use config::{TableSettings, DEFAULT_TABLE};
pub use ident::validate_sql_identifier;
pub use quarantine::Poison;

#[cfg(feature = "sqlx")]
pub use connect::{connect_pool, connect_pool_with, map_sqlx};
#[cfg(feature = "sqlx")]
pub use password::PASSWORD_FILE;
#[cfg(feature = "sqlx")]
pub use store::{SqlxStore, CONNECT_TIMEOUT};

/// What [`table_settings_setters!`] names from other crates; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use outbox_traits::Limits;
}
