//! Opening the store from a URL, as `outbox::store::open` and the `outbox-relay` program do:
//! this backend's scheme, the [`StoreOptions`] it takes, and [`Migrate`].

use outbox_traits::{async_trait, Error};
use outbox_url::{store_scheme, Migrate, StoreOptions};

use crate::{SqliteConfig, SqliteStore};

/// The URL schemes [`open_url`] opens.
pub const URL_SCHEMES: &[&str] = &["sqlite"];

/// Open (creating it if missing) the database file `url` names, with the table and publish
/// mode of `options` (the defaults of [`SqliteConfig`] for what they leave out):
/// `sqlite:///absolute/path.db`, `sqlite://relative/path.db` or `sqlite:path.db`, without
/// query options. The table is not created: call [`SqliteStore::migrate`] (or
/// [`Migrate::migrate`]).
///
/// # Errors
/// [`Error::InvalidInput`] for another scheme, a URL without a file or with options, a schema
/// in `options` (SQLite has none) or a bad table name; as [`SqliteStore::open`] when the file
/// cannot be opened.
pub async fn open_url(url: &str, options: &StoreOptions) -> Result<SqliteStore, Error> {
    let (_, rest) = store_scheme(url, URL_SCHEMES, "SQLite")?;
    options.refuse_schema("SQLite")?;
    let path = rest.strip_prefix("//").unwrap_or(rest);
    if path.is_empty() || path.contains('?') {
        return Err(Error::invalid_input(format!(
            "SQLite store URL {url:?} must name a file and take no options: \
             sqlite:///absolute/path.db or sqlite://relative/path.db"
        )));
    }
    let mut config = SqliteConfig::builder().delete_published(options.delete_published);
    if let Some(table) = &options.table {
        config = config.table(table.clone());
    }
    SqliteStore::open(path, config.build()?).await
}

#[async_trait]
impl Migrate for SqliteStore {
    async fn migrate(&self) -> Result<(), Error> {
        SqliteStore::migrate(self).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn opens_the_file_a_url_names_with_the_options_table() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outbox.db");
        let options = StoreOptions {
            table: Some("events".into()),
            delete_published: true,
            ..StoreOptions::default()
        };
        let store = open_url(&format!("sqlite://{}", path.display()), &options)
            .await
            .unwrap();
        assert_eq!(store.config().table(), "events");
        assert!(store.config().delete_published());
        Migrate::migrate(&store).await.unwrap();
        assert!(path.exists());
    }

    #[tokio::test]
    async fn refuses_another_scheme_and_a_url_without_a_file() {
        // The facade's tests (outbox::store) check the rest of the refusals through open.
        for url in ["postgres://h/db", "sqlite:"] {
            let err = open_url(url, &StoreOptions::default()).await.err();
            assert!(
                matches!(err, Some(Error::InvalidInput(_))),
                "{url}: {err:?}"
            );
        }
    }
}
