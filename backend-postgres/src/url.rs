//! Opening the store from a URL, as `outbox::store::open` and the `outbox-relay` program do:
//! this backend's schemes, the [`StoreOptions`] it takes, and [`Migrate`].

use outbox_traits::{async_trait, Error};
use outbox_url::{store_scheme, Migrate, StoreOptions};

use crate::{PostgresConfig, PostgresStore};

/// The URL schemes [`open_url`] opens.
pub const URL_SCHEMES: &[&str] = &["postgres", "postgresql"];

/// Connect to the database `url` names, with the table, schema and publish mode of `options`
/// (the defaults of [`PostgresConfig`] for what they leave out).
///
/// `url` is the database's own connection URL, `postgres://user:password@host:5432/db` or
/// `postgresql://...`: its query options (`sslmode`, `sslrootcert`, `password_file`, ...) are
/// the driver's, as for [`PostgresStore::connect`]. The table is not created: call
/// [`PostgresStore::migrate`] (or [`Migrate::migrate`]).
///
/// # Errors
/// [`Error::InvalidInput`] for another scheme, a bad table or schema name, or a malformed URL;
/// [`Error::Unavailable`] when the server cannot be reached. Passwords never appear in errors.
pub async fn open_url(url: &str, options: &StoreOptions) -> Result<PostgresStore, Error> {
    store_scheme(url, URL_SCHEMES, "Postgres")?;
    let mut config = PostgresConfig::builder().delete_published(options.delete_published);
    if let Some(table) = &options.table {
        config = config.table(table.clone());
    }
    if let Some(schema) = &options.schema {
        config = config.schema(schema.clone());
    }
    PostgresStore::connect(url, config.build()?).await
}

#[async_trait]
impl Migrate for PostgresStore {
    async fn migrate(&self) -> Result<(), Error> {
        PostgresStore::migrate(self).await
    }
}
