//! Classification of sqlx errors into the contract's [`Error`], with passwords removed.

use outbox_traits::{BoxError, Error};

/// What is unavailable, in [`Error::Unavailable`].
pub(crate) const WHAT: &str = "postgres";

/// Map a sqlx error from operation `op` on `table` to the contract's error.
///
/// Connection, I/O and pool errors are `Unavailable` (transient); serialization failures,
/// deadlocks, lock and statement timeouts are transient; a missing table or column is permanent
/// with a hint to run the migration; the rest is permanent.
pub(crate) fn map_sqlx(err: sqlx::Error, op: &str, table: &str) -> Error {
    outbox_sql_support::map_sqlx(err, WHAT, op, table, |err, text| {
        let code = err
            .as_database_error()
            .and_then(|db| db.code())
            .map(|c| c.into_owned())
            .unwrap_or_default();
        classify_sqlstate(&code, op, table, text, Box::new(err))
    })
}

fn classify_sqlstate(code: &str, op: &str, table: &str, text: String, source: BoxError) -> Error {
    match code {
        // undefined_table, invalid_schema_name, undefined_column, undefined_object
        "42P01" | "3F000" | "42703" | "42704" => Error::permanent(
            format!(
                "{op} on {table} failed: {text} (SQLSTATE {code}); the outbox table is missing \
                 or outdated: run `outbox-relay migrate` (or call \
                 `PostgresStore::migrate()`, or apply `PostgresConfig::migration_sql()`)"
            ),
            Some(source),
        ),
        // serialization_failure, deadlock_detected, lock_not_available, query_canceled
        // (statement_timeout), idle_in_transaction_session_timeout
        "40001" | "40P01" | "55P03" | "57014" | "25P03" => Error::transient(
            format!("{op} on {table} failed: {text} (SQLSTATE {code}); retry later"),
            Some(source),
        ),
        // connection exceptions, insufficient resources (too many connections, disk full,
        // out of memory), server shutting down or starting, read-only standby after failover
        c if c.starts_with("08")
            || c.starts_with("53")
            || matches!(c, "57P01" | "57P02" | "57P03" | "25006") =>
        {
            Error::Unavailable {
                what: WHAT.to_owned(),
                message: format!("{op} on {table} failed: {text} (SQLSTATE {code})"),
                source: Some(source),
            }
        }
        _ => Error::permanent(
            format!("{op} on {table} failed: {text} (SQLSTATE {code})"),
            Some(source),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::ErrorKind;

    fn classify(code: &str) -> Error {
        classify_sqlstate(
            code,
            "claim",
            "\"public\".\"outbox\"",
            "x".into(),
            "x".into(),
        )
    }

    #[test]
    fn sqlstates_are_classified() {
        assert!(classify("42P01")
            .to_string()
            .contains("run `outbox-relay migrate`"));
        assert_eq!(classify("42P01").kind(), ErrorKind::Permanent);
        for transient in ["40001", "40P01", "55P03", "57014"] {
            assert!(classify(transient).is_transient(), "{transient}");
        }
        for down in ["08006", "53300", "57P01", "57P03"] {
            assert!(
                matches!(classify(down), Error::Unavailable { .. }),
                "{down}"
            );
        }
        assert_eq!(classify("22P02").kind(), ErrorKind::Permanent);
    }
}
