//! Validation of SQL identifiers (schema and table names) that backends splice into SQL.

use outbox_traits::Error;

/// Check that `name` is a plain SQL identifier: an ASCII letter or underscore, then letters,
/// digits or underscores, at most 63 bytes (Postgres's limit, also within MySQL's and SQLite's).
///
/// Backends call this for every configurable schema or table name before building any SQL, so
/// that a name can never inject SQL. `what` names the setting in the error, e.g. `table name`.
///
/// ```
/// use outbox_sql_support::validate_sql_identifier;
/// assert!(validate_sql_identifier("table name", "outbox_messages").is_ok());
/// let err = validate_sql_identifier("table name", "a;b").unwrap_err();
/// assert!(err.to_string().contains("not a valid SQL identifier"));
/// ```
pub fn validate_sql_identifier(what: &str, name: &str) -> Result<(), Error> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if first_ok && rest_ok && name.len() <= 63 {
        Ok(())
    } else {
        Err(Error::invalid_input(format!(
            "{what} {name:?} is not a valid SQL identifier \
             (a letter or underscore, then letters, digits or underscores, at most 63 bytes)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::validate_sql_identifier;

    #[test]
    fn accepts_plain_names_and_refuses_the_rest() {
        for ok in ["outbox", "_x", "Outbox_2", &"a".repeat(63)] {
            assert!(validate_sql_identifier("table name", ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "a;b",
            "a b",
            "a\"b",
            "sch.tbl",
            "é",
            &"a".repeat(64),
        ] {
            assert!(validate_sql_identifier("table name", bad).is_err(), "{bad}");
        }
    }
}
