//! The settings every SQL store's configuration has, with their defaults, checks and builder
//! setters; each backend's builder adds its dialect's own (Postgres's schema and NOTIFY,
//! MariaDB's database, SQLite's busy timeout and durability).

use outbox_traits::{Error, Limits};

use crate::ident::validate_sql_identifier;

/// The default table: `outbox`.
pub const DEFAULT_TABLE: &str = "outbox";

/// The table and the enqueue/complete behaviour shared by every SQL store's configuration.
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

/// The builder setters of the [`TableSettings`] part of a store's configuration builder, written
/// once for every backend: `table`, `limits`, `max_payload_bytes` and `delete_published`. Call
/// it inside the builder's `impl` block with the path to its `TableSettings` field, then any
/// doc lines the backend adds to `delete_published` (what deleting costs or saves there):
///
/// ```
/// use outbox_sql_support::TableSettings;
///
/// /// A store's configuration builder.
/// #[derive(Default)]
/// pub struct MyConfigBuilder {
///     common: TableSettings,
/// }
///
/// impl MyConfigBuilder {
///     outbox_sql_support::table_settings_setters!(common;
///         /// In this store, deleting is a `DELETE` by primary key.
///     );
/// }
///
/// let b = MyConfigBuilder::default().table("orders_outbox").delete_published(true);
/// assert_eq!(b.common.table, "orders_outbox");
/// assert!(b.common.delete_published);
/// ```
#[macro_export]
macro_rules! table_settings_setters {
    ($($field:ident).+ ; $(#[$delete_doc:meta])*) => {
        /// Outbox table name (default `outbox`): a plain SQL identifier, checked by `build`.
        pub fn table(mut self, table: impl Into<String>) -> Self {
            self.$($field).+.table = table.into();
            self
        }

        /// Payload limits enforced at enqueue (default 1 MiB).
        pub fn limits(mut self, limits: $crate::__private::Limits) -> Self {
            self.$($field).+.limits = limits;
            self
        }

        /// Largest accepted payload, in bytes of its JSON text.
        pub fn max_payload_bytes(mut self, bytes: usize) -> Self {
            self.$($field).+.limits.max_payload_bytes = bytes;
            self
        }

        /// Delete a message's row when it is published, instead of keeping it with state
        /// `published` until
        /// [`purge_published`](outbox_traits::OutboxAdmin::purge_published) removes it
        /// (default off: kept).
        ///
        /// Deleting keeps the table small with no purge job; the table then holds no history
        /// of published messages ([`counts`](outbox_traits::OutboxAdmin::counts) reports none),
        /// and a dedup key is free again as soon as its message is published rather than after
        /// the purge. The store declares it through
        /// [`Capabilities::deletes_published`](outbox_traits::Capabilities::deletes_published).
        /// The table is the same either way, so the setting can change between runs.
        ///
        $(#[$delete_doc])*
        pub fn delete_published(mut self, delete: bool) -> Self {
            self.$($field).+.delete_published = delete;
            self
        }
    };
}

/// The getters of the [`TableSettings`] part of a store's configuration, written once for every
/// backend: `table`, `limits` and `delete_published`. Call it inside the configuration's `impl`
/// block with the path to its `TableSettings` field (as [`table_settings_setters!`]).
#[macro_export]
macro_rules! table_settings_getters {
    ($($field:ident).+) => {
        /// The table name.
        pub fn table(&self) -> &str {
            &self.$($field).+.table
        }

        /// The payload limits enqueue enforces.
        pub fn limits(&self) -> $crate::__private::Limits {
            self.$($field).+.limits
        }

        /// Whether completing a message deletes its row instead of marking it published (set
        /// by the builder's `delete_published`).
        pub fn delete_published(&self) -> bool {
            self.$($field).+.delete_published
        }
    };
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

    #[derive(Default)]
    struct Builder {
        inner: Inner,
    }

    #[derive(Default)]
    struct Inner {
        common: TableSettings,
    }

    impl Builder {
        crate::table_settings_setters!(inner.common;);
    }

    impl Inner {
        crate::table_settings_getters!(common);
    }

    #[test]
    fn the_setters_reach_a_nested_field() {
        let b = Builder::default()
            .table("t")
            .max_payload_bytes(7)
            .delete_published(true);
        assert_eq!(b.inner.common.table, "t");
        assert_eq!(b.inner.common.limits.max_payload_bytes, 7);
        assert!(b.inner.common.delete_published);
        assert_eq!(b.inner.table(), "t");
        assert!(b.inner.delete_published());
        let b = b.limits(Limits::default());
        assert_eq!(b.inner.limits(), Limits::default());
    }
}
