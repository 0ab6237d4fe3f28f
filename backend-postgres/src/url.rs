//! Opening the store from a URL, as `outbox::store::open` and the `outbox-relay` program do:
//! this backend's schemes, the [`StoreOptions`] it takes, and [`Migrate`].

use std::time::Duration;

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
/// the driver's, as for [`PostgresStore::connect`], except two, which are this crate's and are
/// taken out before connecting: `partition_interval` (`15m`, `1h`, `1d`: whole minutes, hours
/// or days), the table's [`partition_interval`](crate::PostgresConfigBuilder::partition_interval)
/// (`postgres://host/db?partition_interval=1d`), and `cursor_claims` (`true` or `false`), the
/// table's [`cursor_claims`](crate::PostgresConfigBuilder::cursor_claims) (left out: whichever
/// layout the table has, cursor claims for a new plain table). The table is not
/// created: call
/// [`PostgresStore::migrate`] (or [`Migrate::migrate`]).
///
/// # Errors
/// [`Error::InvalidInput`] for another scheme, a bad table or schema name, or a malformed URL;
/// [`Error::Unavailable`] when the server cannot be reached. Passwords never appear in errors.
pub async fn open_url(url: &str, options: &StoreOptions) -> Result<PostgresStore, Error> {
    store_scheme(url, URL_SCHEMES, "Postgres")?;
    let (url, interval, cursor_claims) = take_table_options(url)?;
    let mut config = PostgresConfig::builder()
        .delete_published(options.delete_published)
        .partition_interval(interval);
    if let Some(on) = cursor_claims {
        config = config.cursor_claims(on);
    }
    if let Some(table) = &options.table {
        config = config.table(table.clone());
    }
    if let Some(schema) = &options.schema {
        config = config.schema(schema.clone());
    }
    PostgresStore::connect(&url, config.build()?).await
}

/// The URL without this crate's query options, and their values: `partition_interval` and
/// `cursor_claims`.
fn take_table_options(url: &str) -> Result<(String, Option<Duration>, Option<bool>), Error> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), None, None));
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let mut interval = None;
    let mut cursor_claims = None;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("partition_interval", value)) => {
                interval = Some(crate::partition::parse_interval(value)?);
            }
            Some(("cursor_claims", value)) => {
                cursor_claims = match value {
                    "true" => Some(true),
                    "false" => Some(false),
                    other => {
                        return Err(Error::invalid_input(format!(
                            "cursor_claims={other:?} in the store URL: give true or false"
                        )))
                    }
                };
            }
            _ => kept.push(pair),
        }
    }
    let mut url = base.to_owned();
    if !kept.is_empty() {
        url.push('?');
        url.push_str(&kept.join("&"));
    }
    if let Some(fragment) = fragment {
        url.push('#');
        url.push_str(fragment);
    }
    Ok((url, interval, cursor_claims))
}

#[async_trait]
impl Migrate for PostgresStore {
    async fn migrate(&self) -> Result<(), Error> {
        PostgresStore::migrate(self).await
    }

    async fn convert_layout(&self) -> Result<bool, Error> {
        self.convert_to_cursor_claims().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_options_are_taken_out_of_the_url() -> Result<(), Error> {
        let (url, interval, cursor) =
            take_table_options("postgres://u:p@h/db?sslmode=disable&partition_interval=1d")?;
        assert_eq!(url, "postgres://u:p@h/db?sslmode=disable");
        assert_eq!(interval, Some(Duration::from_secs(86_400)));
        assert_eq!(cursor, None);
        let (url, interval, _) = take_table_options("postgres://h/db?partition_interval=15m")?;
        assert_eq!(
            (url.as_str(), interval),
            ("postgres://h/db", Some(Duration::from_secs(900)))
        );
        let (url, interval, cursor) =
            take_table_options("postgres://h/db?cursor_claims=true&sslmode=require")?;
        assert_eq!(
            (url.as_str(), interval, cursor),
            ("postgres://h/db?sslmode=require", None, Some(true))
        );
        for bad in [
            "postgres://u:s3cret@h/db?partition_interval=1x",
            "postgres://u:s3cret@h/db?cursor_claims=yes",
        ] {
            let err = take_table_options(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)));
            assert!(!err.to_string().contains("s3cret"));
        }
        Ok(())
    }
}
