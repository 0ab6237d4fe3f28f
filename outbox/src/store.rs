//! Choose the store by configuration: a URL picks the backend and connects to it.
//!
//! | URL | backend | feature |
//! |---|---|---|
//! | `postgres://user:pass@host:5432/db` (or `postgresql://`) | PostgreSQL | `postgres` |
//! | `mysql://user:pass@host:3306/db` (or `mariadb://`) | MariaDB / MySQL | `mysql` |
//! | `sqlite:///absolute/path.db`, `sqlite://relative/path.db` (or `sqlite:path.db`) | SQLite | `sqlite` |
//!
//! The URL is the database's own connection URL (its query options, such as `sslmode`, go to
//! the driver); the outbox table is named by [`StoreOptions`]. The same URL then gives the
//! relay's view ([`OpenedStore::store`]) and the operator's ([`OpenedStore::admin`]).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), outbox::Error> {
//! let err = outbox::store::open("amqp://guest:secret@localhost", &Default::default())
//!     .await
//!     .err()
//!     .unwrap();
//! assert!(err.to_string().contains("postgres://"));
//! assert!(!err.to_string().contains("secret"));
//! # Ok(()) }
//! ```

use std::sync::Arc;

use outbox_traits::{redact_url, Error, OutboxAdmin, OutboxStore, RelayGroupStore};

use crate::schemes;

/// The schemes [`open`] understands, whether or not their feature is compiled in.
pub const SCHEMES: &[(&str, &str)] = &[
    ("postgres", "feature `postgres`"),
    ("mysql", "feature `mysql`"),
    ("sqlite", "feature `sqlite`"),
];

/// Where the outbox table is and how it treats published messages; the defaults are each
/// backend's own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// Table name (default `outbox`).
    pub table: Option<String>,
    /// Postgres schema (default `public`); refused for the other backends.
    pub schema: Option<String>,
    /// Delete messages as they are published instead of marking them published.
    pub delete_published: bool,
}

/// A store opened from a URL.
#[derive(Clone)]
pub struct OpenedStore {
    /// The relay's view: claim, complete, fail, release, extend.
    pub store: Arc<dyn OutboxStore>,
    /// The operator's view: counts, dead letters, purge.
    pub admin: Arc<dyn OutboxAdmin>,
    backend: Backend,
}

impl std::fmt::Debug for OpenedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedStore")
            .field("backend", &self.name())
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
enum Backend {
    #[cfg(feature = "postgres")]
    Postgres(outbox_backend_postgres::PostgresStore),
    #[cfg(feature = "mysql")]
    Mysql(outbox_backend_mysql::MysqlStore),
    #[cfg(feature = "sqlite")]
    Sqlite(outbox_backend_sqlite::SqliteStore),
    /// Only there so the enum is not empty when no backend is compiled in.
    #[allow(dead_code)]
    None,
}

impl OpenedStore {
    /// The backend's name: `postgres`, `mysql` or `sqlite`.
    pub fn name(&self) -> &'static str {
        match self.backend {
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => "postgres",
            #[cfg(feature = "mysql")]
            Backend::Mysql(_) => "mysql",
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => "sqlite",
            Backend::None => "none",
        }
    }

    /// Create the outbox table and its indexes if they do not exist (idempotent), with the
    /// backend's own `migrate`.
    ///
    /// # Errors
    /// As the backend's own `migrate`: a permanent error when the role may not create them.
    pub async fn migrate(&self) -> Result<(), Error> {
        match &self.backend {
            #[cfg(feature = "postgres")]
            Backend::Postgres(store) => store.migrate().await,
            #[cfg(feature = "mysql")]
            Backend::Mysql(store) => store.migrate().await,
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(store) => store.migrate().await,
            Backend::None => Ok(()),
        }
    }

    /// Where relay groups keep their leases, if the backend supports them (Postgres); MariaDB
    /// and SQLite do not yet, and a relay given a group there runs as without one.
    pub fn group_store(&self) -> Option<Arc<dyn RelayGroupStore>> {
        match &self.backend {
            #[cfg(feature = "postgres")]
            Backend::Postgres(store) => Some(Arc::new(store.clone())),
            _ => None,
        }
    }
}

fn choices() -> String {
    schemes::choices(SCHEMES)
}

/// Connect to (or, for SQLite, open) the store that `url` names.
///
/// # Errors
/// [`Error::InvalidInput`] for a URL without a scheme, an unknown scheme, a scheme whose feature
/// is not compiled in, or options the backend refuses (the message names the valid choices);
/// [`Error::Unavailable`] when the database cannot be reached. Passwords never appear in errors.
pub async fn open(url: &str, options: &StoreOptions) -> Result<OpenedStore, Error> {
    let scheme = url.split_once(':').map(|(s, _)| s).ok_or_else(|| {
        Error::invalid_input(format!(
            "store URL {:?} has no scheme; use one of: {}",
            redact_url(url),
            choices()
        ))
    })?;
    #[cfg_attr(
        not(any(feature = "mysql", feature = "sqlite")),
        allow(unused_variables)
    )]
    let no_schema = |backend: &str| -> Result<(), Error> {
        match &options.schema {
            Some(schema) => Err(Error::invalid_input(format!(
                "a schema ({schema:?}) is a Postgres option; {backend} has none (name the \
                 database in the URL instead)"
            ))),
            None => Ok(()),
        }
    };
    match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            use outbox_backend_postgres::{PostgresConfig, PostgresStore};
            let mut config = PostgresConfig::builder().delete_published(options.delete_published);
            if let Some(table) = &options.table {
                config = config.table(table.clone());
            }
            if let Some(schema) = &options.schema {
                config = config.schema(schema.clone());
            }
            let store = PostgresStore::connect(url, config.build()?).await?;
            Ok(OpenedStore {
                store: Arc::new(store.clone()),
                admin: Arc::new(store.clone()),
                backend: Backend::Postgres(store),
            })
        }
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            use outbox_backend_mysql::{MysqlConfig, MysqlStore};
            no_schema("MariaDB")?;
            let mut config = MysqlConfig::builder().delete_published(options.delete_published);
            if let Some(table) = &options.table {
                config = config.table(table.clone());
            }
            // sqlx names the driver `mysql` for both servers.
            let url = match url.strip_prefix("mariadb:") {
                Some(rest) => format!("mysql:{rest}"),
                None => url.to_owned(),
            };
            let store = MysqlStore::connect(&url, config.build()?).await?;
            Ok(OpenedStore {
                store: Arc::new(store.clone()),
                admin: Arc::new(store.clone()),
                backend: Backend::Mysql(store),
            })
        }
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            use outbox_backend_sqlite::{SqliteConfig, SqliteStore};
            no_schema("SQLite")?;
            let rest = &url["sqlite:".len()..];
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
            let store = SqliteStore::open(path, config.build()?).await?;
            Ok(OpenedStore {
                store: Arc::new(store.clone()),
                admin: Arc::new(store.clone()),
                backend: Backend::Sqlite(store),
            })
        }
        // Reached only for backends whose feature is off.
        #[allow(unreachable_patterns)]
        "postgres" | "postgresql" | "mysql" | "mariadb" | "sqlite" => not_compiled(scheme),
        other => Err(Error::invalid_input(format!(
            "unknown store scheme {other:?} in {:?}; use one of: {}",
            redact_url(url),
            choices()
        ))),
    }
}

/// The backends compiled into this build.
pub fn compiled_in() -> Vec<&'static str> {
    schemes::compiled(&[
        ("postgres", cfg!(feature = "postgres")),
        ("mysql", cfg!(feature = "mysql")),
        ("sqlite", cfg!(feature = "sqlite")),
    ])
}

#[cfg_attr(
    all(feature = "postgres", feature = "mysql", feature = "sqlite"),
    allow(dead_code)
)]
fn not_compiled(scheme: &str) -> Result<OpenedStore, Error> {
    let feature = match scheme {
        "postgresql" => "postgres",
        "mariadb" => "mysql",
        other => other,
    };
    Err(schemes::not_compiled(scheme, feature, &compiled_in()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unknown_and_malformed_urls_name_the_choices() {
        for url in ["amqp://guest:secret@localhost", "no-scheme"] {
            let err = open(url, &StoreOptions::default()).await.err();
            let text = err.map(|e| e.to_string()).unwrap_or_default();
            assert!(text.contains("postgres://"), "{url}: {text}");
            assert!(!text.contains("secret"), "{url}: {text}");
        }
    }

    /// Through `open` itself, in a build without the `postgres` feature (`scripts/test` runs
    /// this crate's tests once with no features).
    #[cfg(not(feature = "postgres"))]
    #[tokio::test]
    async fn a_store_url_whose_feature_is_off_names_the_feature() {
        let err = open(
            "postgres://app:secret@127.0.0.1/app",
            &StoreOptions::default(),
        )
        .await
        .err()
        .expect("postgres is not compiled in");
        let text = err.to_string();
        assert!(matches!(err, Error::InvalidInput(_)), "{text}");
        assert!(text.contains("`postgres` feature"), "{text}");
        assert!(!text.contains("secret"), "{text}");
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn sqlite_urls_name_a_file_and_refuse_postgres_options() {
        for url in ["sqlite://", "sqlite:", "sqlite://x.db?mode=rwc"] {
            let err = open(url, &StoreOptions::default()).await.err();
            assert!(
                matches!(err, Some(Error::InvalidInput(_))),
                "{url}: {err:?}"
            );
        }
        let options = StoreOptions {
            schema: Some("app".into()),
            ..StoreOptions::default()
        };
        let err = open("sqlite://x.db", &options).await.err();
        assert!(
            matches!(&err, Some(Error::InvalidInput(m)) if m.contains("Postgres option")),
            "{err:?}"
        );
    }
}
