//! Classification of sqlx errors into the contract's [`Error`], with passwords removed.

use outbox_traits::{BoxError, Error};
use sqlx::mysql::MySqlDatabaseError;

/// What is unavailable, in [`Error::Unavailable`].
pub(crate) const WHAT: &str = "mysql";

/// `ER_LOCK_DEADLOCK`: InnoDB chose this transaction as a deadlock victim and rolled it back.
pub(crate) const DEADLOCK: u16 = 1213;
/// `ER_DUP_ENTRY`: a unique index refused a value.
pub(crate) const DUPLICATE_ENTRY: u16 = 1062;

/// The server's error number, if `err` came from the server.
pub(crate) fn error_number(err: &sqlx::Error) -> Option<u16> {
    err.as_database_error()
        .and_then(|db| db.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

/// Whether `err` (as mapped by [`map_sqlx`]) is a deadlock: the server rolled the whole
/// transaction back, so running it again from the start is safe.
pub(crate) fn is_deadlock(err: &Error) -> bool {
    let source = match err {
        Error::Backend {
            source: Some(source),
            ..
        } => source,
        _ => return false,
    };
    source
        .downcast_ref::<sqlx::Error>()
        .and_then(error_number)
        .is_some_and(|n| n == DEADLOCK)
}

/// Map a sqlx error from operation `op` on `table` to the contract's error.
///
/// Connection, I/O and pool errors are `Unavailable` (transient); deadlocks, lock wait and
/// statement timeouts are transient; a missing table, column or database is permanent with a
/// hint to run the migration; the rest is permanent.
pub(crate) fn map_sqlx(err: sqlx::Error, op: &str, table: &str) -> Error {
    outbox_sql_support::map_sqlx(err, WHAT, op, table, |err, text| {
        let number = error_number(&err).unwrap_or(0);
        let sqlstate = err
            .as_database_error()
            .and_then(|db| db.code())
            .map(|c| c.into_owned())
            .unwrap_or_default();
        classify(number, &sqlstate, op, table, text, Box::new(err))
    })
}

fn classify(
    number: u16,
    sqlstate: &str,
    op: &str,
    table: &str,
    text: String,
    source: BoxError,
) -> Error {
    let what = format!("{op} on {table} failed: {text} (error {number}, SQLSTATE {sqlstate})");
    match number {
        // ER_NO_SUCH_TABLE, ER_BAD_FIELD_ERROR, ER_BAD_DB_ERROR
        1146 | 1054 | 1049 => Error::permanent(
            format!(
                "{what}; the outbox table is missing or outdated: run `outbox-relay migrate` (or \
                 call `MysqlStore::migrate()`, or apply `MysqlConfig::migration_sql()`)"
            ),
            Some(source),
        ),
        // ER_NO_DB_ERROR
        1046 => Error::permanent(
            format!(
                "{what}; name a database in the URL (mysql://host/db) or with \
                 `MysqlConfig::builder().database(..)`"
            ),
            Some(source),
        ),
        // ER_NET_PACKET_TOO_LARGE
        1153 => Error::permanent(
            format!("{what}; enqueue smaller batches or raise the server's max_allowed_packet"),
            Some(source),
        ),
        // ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT, ER_QUERY_INTERRUPTED, ER_STATEMENT_TIMEOUT
        // (MariaDB max_statement_time), ER_QUERY_TIMEOUT (MySQL max_execution_time),
        // ER_LOCK_ABORTED, ER_CHECKREAD (record changed since last read)
        DEADLOCK | 1205 | 1317 | 1969 | 3024 | 1689 | 1020 => {
            Error::transient(format!("{what}; retry later"), Some(source))
        }
        // ER_CON_COUNT_ERROR (too many connections), ER_SERVER_SHUTDOWN, ER_CONNECTION_KILLED,
        // ER_OPTION_PREVENTS_STATEMENT (--read-only, e.g. a replica after failover),
        // ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION, ER_READ_ONLY_MODE, ER_OUT_OF_RESOURCES,
        // ER_OUTOFMEMORY
        1040 | 1053 | 1927 | 1290 | 1792 | 1836 | 1041 | 1037 => Error::Unavailable {
            what: WHAT.to_owned(),
            message: what,
            source: Some(source),
        },
        _ if sqlstate.starts_with("08") => Error::Unavailable {
            what: WHAT.to_owned(),
            message: what,
            source: Some(source),
        },
        _ if sqlstate == "40001" => Error::transient(format!("{what}; retry later"), Some(source)),
        _ => Error::permanent(what, Some(source)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::ErrorKind;

    fn classify_number(number: u16, sqlstate: &str) -> Error {
        classify(
            number,
            sqlstate,
            "claim",
            "`outbox`",
            "x".into(),
            "x".into(),
        )
    }

    #[test]
    fn server_errors_are_classified() {
        let missing = classify_number(1146, "42S02");
        assert!(
            missing.to_string().contains("run `outbox-relay migrate`"),
            "{missing}"
        );
        assert_eq!(missing.kind(), ErrorKind::Permanent);
        for transient in [1213, 1205, 1969, 3024] {
            assert!(
                classify_number(transient, "HY000").is_transient(),
                "{transient}"
            );
        }
        for down in [1040, 1053, 1927, 1290] {
            assert!(
                matches!(classify_number(down, "HY000"), Error::Unavailable { .. }),
                "{down}"
            );
        }
        assert!(matches!(
            classify_number(9999, "08S01"),
            Error::Unavailable { .. }
        ));
        assert_eq!(classify_number(1064, "42000").kind(), ErrorKind::Permanent);
    }

    #[test]
    fn an_io_error_is_no_deadlock() {
        // The classification of I/O and pool errors is shared (`outbox_sql_support::map_sqlx`,
        // tested there); a lost connection must not be run again as a deadlock victim.
        let err = map_sqlx(
            sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "refused",
            )),
            "claim",
            "t",
        );
        assert!(matches!(err, Error::Unavailable { .. }));
        assert!(!is_deadlock(&err));
    }
}
