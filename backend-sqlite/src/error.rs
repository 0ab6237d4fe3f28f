//! Classification of rusqlite errors into the contract's [`Error`].

use rusqlite::ErrorCode;

use outbox_traits::Error;

/// What the store was doing, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ctx {
    Open,
    Migrate,
    Enqueue,
    Claim,
    Complete,
    Fail,
    Extend,
    Release,
    Admin,
    Transaction,
}

impl Ctx {
    pub(crate) fn what(self) -> &'static str {
        match self {
            Ctx::Open => "opening the database",
            Ctx::Migrate => "migrating the outbox table",
            Ctx::Enqueue => "enqueueing",
            Ctx::Claim => "claiming",
            Ctx::Complete => "completing",
            Ctx::Fail => "recording failures",
            Ctx::Extend => "extending a lease",
            Ctx::Release => "releasing",
            Ctx::Admin => "running an admin operation",
            Ctx::Transaction => "running a transaction",
        }
    }
}

/// Classify a rusqlite error for callers who run their own statements next to
/// [`crate::enqueue`] (e.g. in [`crate::SqliteStore::transaction`]) and want one error type.
///
/// `SQLITE_BUSY`/`SQLITE_LOCKED` become transient, I/O failures [`Error::Unavailable`], a
/// missing table a permanent error that says to run [`crate::migrate`], everything else a
/// permanent [`Error::Backend`].
pub fn sqlite_error(err: rusqlite::Error) -> Error {
    map_err(err, Ctx::Transaction, "")
}

/// Classify `err`, raised while doing `ctx` on `table` (empty if unknown).
pub(crate) fn map_err(err: rusqlite::Error, ctx: Ctx, table: &str) -> Error {
    let what = ctx.what();
    let code = err.sqlite_error_code();
    let text = err.to_string();
    match code {
        Some(ErrorCode::DatabaseBusy) | Some(ErrorCode::DatabaseLocked) => Error::transient(
            format!(
                "sqlite: {what}: the database is locked by another connection for longer than \
                 the busy timeout ({text}); retry, or shorten other write transactions"
            ),
            Some(Box::new(err)),
        ),
        Some(
            ErrorCode::SystemIoFailure
            | ErrorCode::DiskFull
            | ErrorCode::CannotOpen
            | ErrorCode::FileLockingProtocolFailed
            | ErrorCode::OutOfMemory,
        ) => Error::unavailable("sqlite", format!("{what}: {text}"), err),
        _ if text.contains("no such table") || text.contains("no such index") => Error::permanent(
            format!(
                "sqlite: {what}: {text}; run `outbox-relay migrate` for table {table:?} \
                 first (or call `SqliteStore::migrate()` or `outbox_backend_sqlite::migrate()`, or apply \
                 `SqliteConfig::migration_sql()`; opening a store does not create the table)"
            ),
            Some(Box::new(err)),
        ),
        _ => Error::permanent(format!("sqlite: {what}: {text}"), Some(Box::new(err))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::ErrorKind;

    fn failure(code: i32, msg: &str) -> rusqlite::Error {
        rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), Some(msg.to_owned()))
    }

    #[test]
    fn classifies_busy_io_and_missing_table() {
        let busy = map_err(
            failure(rusqlite::ffi::SQLITE_BUSY, "database is locked"),
            Ctx::Claim,
            "outbox",
        );
        assert_eq!(busy.kind(), ErrorKind::Transient);
        let io = map_err(
            failure(rusqlite::ffi::SQLITE_IOERR, "disk I/O error"),
            Ctx::Claim,
            "outbox",
        );
        assert!(matches!(io, Error::Unavailable { .. }), "{io:?}");
        let missing = map_err(
            failure(rusqlite::ffi::SQLITE_ERROR, "no such table: outbox"),
            Ctx::Enqueue,
            "outbox",
        );
        assert_eq!(missing.kind(), ErrorKind::Permanent);
        assert!(
            missing.to_string().contains("run `outbox-relay migrate`"),
            "{missing}"
        );
        // Opening a store no longer migrates: the hint must not say it does.
        assert!(
            missing.to_string().contains("SqliteStore::migrate()")
                && missing.to_string().contains("does not create the table"),
            "{missing}"
        );
    }
}
