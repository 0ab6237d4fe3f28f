//! Opening the store from a URL, as `outbox::store::open` and the `outbox-relay` program do:
//! this backend's schemes, the [`StoreOptions`] it takes, and [`Migrate`].

use outbox_traits::{async_trait, Error};
use outbox_url::{store_scheme, Migrate, StoreOptions};

use crate::{MysqlConfig, MysqlStore};

/// The URL schemes [`open_url`] opens: `mariadb://` is read as `mysql://`, the driver's name
/// for both servers.
pub const URL_SCHEMES: &[&str] = &["mysql", "mariadb"];

/// Connect to the database `url` names, with the table and publish mode of `options` (the
/// defaults of [`MysqlConfig`] for what they leave out).
///
/// `url` is the database's own connection URL, `mysql://user:password@host:3306/db` or
/// `mariadb://...`: its query options (`ssl-mode`, `ssl-ca`, `password_file`, ...) are the
/// driver's, as for [`MysqlStore::connect`]. The table is not created: call
/// [`MysqlStore::migrate`] (or [`Migrate::migrate`]).
///
/// # Errors
/// [`Error::InvalidInput`] for another scheme, a schema in `options` (MariaDB has none: name
/// the database in the URL), a bad table name or a malformed URL; [`Error::Unavailable`] when
/// the server cannot be reached. Passwords never appear in errors.
pub async fn open_url(url: &str, options: &StoreOptions) -> Result<MysqlStore, Error> {
    let (_, rest) = store_scheme(url, URL_SCHEMES, "MariaDB")?;
    options.refuse_schema("MariaDB")?;
    let mut config = MysqlConfig::builder().delete_published(options.delete_published);
    if let Some(table) = &options.table {
        config = config.table(table.clone());
    }
    MysqlStore::connect(&format!("mysql:{rest}"), config.build()?).await
}

#[async_trait]
impl Migrate for MysqlStore {
    async fn migrate(&self) -> Result<(), Error> {
        MysqlStore::migrate(self).await
    }

    async fn convert_layout(&self) -> Result<bool, Error> {
        self.convert_to_unpublished_table().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refuses_a_schema_before_connecting() {
        let options = StoreOptions {
            schema: Some("app".into()),
            ..StoreOptions::default()
        };
        // Port 9 (discard) is never a MariaDB: the schema is refused before any connection.
        let err = open_url("mariadb://root@127.0.0.1:9/test", &options)
            .await
            .err();
        assert!(
            matches!(&err, Some(Error::InvalidInput(m)) if m.contains("Postgres option")),
            "{err:?}"
        );
    }
}
