//! The inbox on the real servers: the conformance suite against each SQL inbox (each case on
//! its own schema, database or file), and the calls the suite does not drive (`process`,
//! `migrate`, errors, Redis). Postgres and MariaDB
//! run it twice, through sqlx and through diesel-async (at half the cases). One test binary for
//! all stores, to link once.

mod mysql;
mod postgres;
mod redis;
mod sqlite;

use outbox_inbox::Error;

/// A harness-side failure (not the inbox's) as the contract's error.
pub fn harness_error(e: impl std::fmt::Display) -> Error {
    Error::permanent(format!("test harness: {e}"), None)
}
