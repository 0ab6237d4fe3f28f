//! What a store opened from a URL is given besides the URL, and what it offers besides the
//! contract: the options every SQL backend's `open_url` takes, and [`Migrate`], the one call the
//! facade's `OpenedStore` makes that is not in [`OutboxStore`](outbox_traits::OutboxStore).

use outbox_traits::{async_trait, Error};

use crate::redact_url;

/// Where the outbox table is and how it treats published messages; the defaults are each
/// backend's own. Each backend's `open_url(url, &StoreOptions)` applies them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// Table name (default `outbox`).
    pub table: Option<String>,
    /// Postgres schema (default `public`); refused for the other backends.
    pub schema: Option<String>,
    /// Delete messages as they are published instead of marking them published.
    pub delete_published: bool,
}

impl StoreOptions {
    /// `Ok` when no [`StoreOptions::schema`] is given, else the [`Error::InvalidInput`] of a
    /// `backend` (`"MariaDB"`, `"SQLite"`) that has no schemas.
    ///
    /// ```
    /// use outbox_url::StoreOptions;
    /// assert!(StoreOptions::default().refuse_schema("SQLite").is_ok());
    /// let options = StoreOptions { schema: Some("app".into()), ..StoreOptions::default() };
    /// let err = options.refuse_schema("SQLite").unwrap_err();
    /// assert!(err.to_string().contains("a schema (\"app\") is a Postgres option; SQLite has none"));
    /// ```
    pub fn refuse_schema(&self, backend: &str) -> Result<(), Error> {
        match &self.schema {
            Some(schema) => Err(Error::invalid_input(format!(
                "a schema ({schema:?}) is a Postgres option; {backend} has none (name the \
                 database in the URL instead)"
            ))),
            None => Ok(()),
        }
    }
}

/// The scheme of a store's `url` and what follows its `:`, when the scheme is one of `schemes`
/// (a backend's, the first its usual name); else the [`Error::InvalidInput`] of a `what` store
/// URL (`"Postgres"`), naming the schemes, without the URL's password.
///
/// ```
/// let (scheme, rest) = outbox_url::store_scheme("postgresql://h/db", &["postgres", "postgresql"], "Postgres").unwrap();
/// assert_eq!((scheme, rest), ("postgresql", "//h/db"));
/// let err = outbox_url::store_scheme("mysql://u:s3cret@h/db", &["postgres", "postgresql"], "Postgres").unwrap_err();
/// assert!(err.to_string().contains("must start with postgres:// (or postgresql://)"));
/// assert!(!err.to_string().contains("s3cret"));
/// ```
pub fn store_scheme<'u>(
    url: &'u str,
    schemes: &[&str],
    what: &str,
) -> Result<(&'u str, &'u str), Error> {
    match url.split_once(':') {
        Some((scheme, rest)) if schemes.contains(&scheme) => Ok((scheme, rest)),
        _ => {
            let mut names = schemes.iter().map(|s| format!("{s}://"));
            let first = names.next().unwrap_or_default();
            let others: Vec<String> = names.collect();
            let others = if others.is_empty() {
                String::new()
            } else {
                format!(" (or {})", others.join(", "))
            };
            Err(Error::invalid_input(format!(
                "{what} store URL {:?} must start with {first}{others}",
                redact_url(url)
            )))
        }
    }
}

/// Create the store's tables and indexes if they do not exist (idempotent): each backend's own
/// `migrate`, behind one name, so that a store opened by URL scheme can be migrated without
/// knowing which backend it is.
#[async_trait]
pub trait Migrate: Send + Sync {
    /// Create what is missing; a permanent error when the role may not create it.
    async fn migrate(&self) -> Result<(), Error>;

    /// Convert an existing table made in an older layout to the one this configuration gives
    /// new tables (Postgres: cursor claims; MariaDB: an unpublished table), where the backend
    /// has more than one. `Ok(true)` when it converted the table, `Ok(false)` when there was
    /// nothing to convert (the default: one layout). Stop the table's relays first; each
    /// backend's own function says what it checks.
    async fn convert_layout(&self) -> Result<bool, Error> {
        Ok(false)
    }
}
