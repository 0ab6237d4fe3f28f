//! The settings every sqlx store's configuration has, with their defaults and checks; each
//! backend's builder adds its dialect's own (Postgres's schema and NOTIFY, MariaDB's database).

use outbox_traits::{validate_sql_identifier, Error, Limits};

/// The default table: `outbox`.
pub const DEFAULT_TABLE: &str = "outbox";

/// The table and the enqueue/complete behaviour shared by every sqlx store's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSettings {
    /// Outbox table name (default [`DEFAULT_TABLE`]).
    pub table: String,
    /// Payload limits enforced at enqueue (default 1 MiB).
    pub limits: Limits,
    /// Delete a message's row when it is published instead of marking it `published`
    /// (default `false`).
    pub delete_published: bool,
}

impl Default for TableSettings {
    fn default() -> Self {
        Self {
            table: DEFAULT_TABLE.to_owned(),
            limits: Limits::default(),
            delete_published: false,
        }
    }
}

impl TableSettings {
    /// Check the table name and the limits.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the setting to fix.
    pub fn validate(&self) -> Result<(), Error> {
        validate_sql_identifier("table name", &self.table)?;
        if self.limits.max_payload_bytes == 0 {
            return Err(Error::invalid_input(
                "max_payload_bytes is 0, which refuses every message; set a positive limit",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_settings_are_named() {
        assert!(TableSettings::default().validate().is_ok());
        let bad = TableSettings {
            table: "a;b".into(),
            ..TableSettings::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("table name"));
        let mut zero = TableSettings::default();
        zero.limits.max_payload_bytes = 0;
        assert!(zero
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_payload_bytes"));
    }
}
