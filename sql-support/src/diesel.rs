//! What the diesel-async enqueue modules of the Postgres and MariaDB stores share (feature
//! `diesel`): the classification of diesel errors, whose skeleton is the same on both databases
//! while the texts that tell the causes apart are each database's own ([`DieselDialect`]).
//!
//! diesel-async reports a database error as a kind and a message, with no SQLSTATE or error
//! number, so beyond the kinds diesel knows the causes are read from the message.

use diesel::result::{DatabaseErrorInformation, DatabaseErrorKind, Error as DieselError};
use outbox_traits::Error;

/// What one database says in the messages of diesel's `DatabaseError`s.
#[derive(Debug, Clone, Copy)]
pub struct DieselDialect {
    /// The database named in [`Error::Unavailable`] (`"postgres"`, `"mysql"`).
    pub what: &'static str,
    /// The store type named in the missing-table hint (`"PostgresStore"`).
    pub store: &'static str,
    /// The configuration type named in the missing-table hint (`"PostgresConfig"`).
    pub config: &'static str,
    /// Whether a message reports a lost connection (besides diesel's own kinds for it).
    pub unavailable: fn(&str) -> bool,
    /// Whether a message reports a deadlock, lock wait or timeout worth retrying.
    pub transient: fn(&str) -> bool,
    /// Whether a message reports a missing table or column (the migration was not run).
    pub missing: fn(&str) -> bool,
}

/// The contract's error for a failed insert of the outbox's rows on `table`: a unique
/// violation becomes what `unique` makes of it (the sqlx path's error for the outbox's own
/// constraints), the rest is [`classify`]d as operation `enqueue`.
pub fn classify_insert(
    err: DieselError,
    table: &str,
    dialect: &DieselDialect,
    unique: impl FnOnce(&dyn DatabaseErrorInformation) -> Option<Error>,
) -> Error {
    if let DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, info) = &err {
        if let Some(mapped) = unique(info.as_ref()) {
            return mapped;
        }
    }
    classify(err, "enqueue", table, dialect)
}

/// Map a diesel error from operation `op` on `table` to the contract's error: a lost
/// connection or a read-only server is [`Error::Unavailable`], a serialization failure or what
/// the dialect calls transient is transient, a missing table or column is permanent with a hint
/// to run the migration, the rest is permanent.
pub fn classify(err: DieselError, op: &str, table: &str, dialect: &DieselDialect) -> Error {
    let message = format!("{op} on {table} failed: {err}");
    let (kind, text) = match &err {
        DieselError::DatabaseError(kind, info) => (*kind, info.message()),
        _ => return Error::permanent(message, Some(Box::new(err))),
    };
    if matches!(
        kind,
        DatabaseErrorKind::UnableToSendCommand
            | DatabaseErrorKind::ClosedConnection
            | DatabaseErrorKind::ReadOnlyTransaction
    ) || (dialect.unavailable)(text)
    {
        Error::Unavailable {
            what: dialect.what.to_owned(),
            message,
            source: Some(Box::new(err)),
        }
    } else if kind == DatabaseErrorKind::SerializationFailure || (dialect.transient)(text) {
        Error::transient(format!("{message}; retry later"), Some(Box::new(err)))
    } else if (dialect.missing)(text) {
        Error::permanent(
            format!(
                "{message}; the outbox table is missing or outdated: run `outbox-relay migrate` \
                 (or call `{}::migrate()`, or apply `{}::migration_sql()`)",
                dialect.store, dialect.config
            ),
            Some(Box::new(err)),
        )
    } else {
        Error::permanent(message, Some(Box::new(err)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_traits::ErrorKind;

    const DIALECT: DieselDialect = DieselDialect {
        what: "db",
        store: "DbStore",
        config: "DbConfig",
        unavailable: |t| t.starts_with("gone"),
        transient: |t| t.starts_with("deadlock"),
        missing: |t| t.ends_with("does not exist"),
    };

    fn database_error(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn kinds_and_dialect_texts_are_classified() {
        use DatabaseErrorKind as K;
        let classify = |err| classify(err, "enqueue", "t", &DIALECT);
        for down in [
            database_error(K::UnableToSendCommand, "x"),
            database_error(K::ClosedConnection, "x"),
            database_error(K::Unknown, "gone away"),
        ] {
            let mapped = classify(down);
            assert!(
                matches!(&mapped, Error::Unavailable { what, .. } if what == "db"),
                "{mapped}"
            );
        }
        for again in [
            database_error(K::SerializationFailure, "x"),
            database_error(K::Unknown, "deadlock found"),
        ] {
            let mapped = classify(again);
            assert!(mapped.is_transient(), "{mapped}");
        }
        let missing = classify(database_error(K::Unknown, "table t does not exist"));
        assert_eq!(missing.kind(), ErrorKind::Permanent);
        let text = missing.to_string();
        assert!(text.contains("enqueue on t failed"), "{text}");
        assert!(
            text.contains("`DbStore::migrate()`") && text.contains("`DbConfig::migration_sql()`")
        );
        assert_eq!(classify(DieselError::NotFound).kind(), ErrorKind::Permanent);
    }

    #[test]
    fn unique_violations_go_to_the_dialect_first() {
        let dup = || database_error(DatabaseErrorKind::UniqueViolation, "dup on outbox_dedup");
        let mapped = classify_insert(dup(), "t", &DIALECT, |info| {
            Some(Error::invalid_input(format!("mapped: {}", info.message())))
        });
        assert!(matches!(mapped, Error::InvalidInput(ref m) if m.contains("outbox_dedup")));
        let other = classify_insert(dup(), "t", &DIALECT, |_| None);
        assert_eq!(other.kind(), ErrorKind::Permanent);
        assert!(other.to_string().contains("enqueue on t failed"), "{other}");
    }
}
