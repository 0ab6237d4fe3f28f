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
//! Each backend owns its URL and its options: this module only picks the backend by scheme and
//! calls its `url::open_url(url, &StoreOptions)`, as [`broker`](crate::broker) calls each
//! publisher's `from_url`. A program that needs one backend only can call that directly.
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

use outbox_traits::{Error, OutboxAdmin, OutboxStore, RelayGroupStore};
use outbox_url::{redact_url, Migrate};

use crate::schemes;

pub use outbox_url::StoreOptions;

/// The schemes [`open`] understands, whether or not their feature is compiled in.
pub const SCHEMES: &[(&str, &str)] = &[
    ("postgres", "feature `postgres`"),
    ("mysql", "feature `mysql`"),
    ("sqlite", "feature `sqlite`"),
];

/// A store opened from a URL.
#[derive(Clone)]
pub struct OpenedStore {
    /// The relay's view: claim, complete, fail, release, extend.
    pub store: Arc<dyn OutboxStore>,
    /// The operator's view: counts, dead letters, purge.
    pub admin: Arc<dyn OutboxAdmin>,
    schema: Arc<dyn Migrate>,
    groups: Option<Arc<dyn RelayGroupStore>>,
    name: &'static str,
}

impl std::fmt::Debug for OpenedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedStore")
            .field("backend", &self.name())
            .finish_non_exhaustive()
    }
}

impl OpenedStore {
    /// The three views of one store, which the backend `name` opened.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    fn new<S: OutboxStore + OutboxAdmin + Migrate + 'static>(name: &'static str, store: S) -> Self {
        let store = Arc::new(store);
        Self {
            store: store.clone(),
            admin: store.clone(),
            schema: store,
            groups: None,
            name,
        }
    }

    /// The same, with the store's relay groups ([`OpenedStore::group_store`]).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    fn with_groups<S>(name: &'static str, store: S) -> Self
    where
        S: OutboxStore + OutboxAdmin + Migrate + RelayGroupStore + Clone + 'static,
    {
        let groups: Arc<dyn RelayGroupStore> = Arc::new(store.clone());
        Self {
            groups: Some(groups),
            ..Self::new(name, store)
        }
    }

    /// The backend's name: `postgres`, `mysql` or `sqlite`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Create the outbox table and its indexes if they do not exist (idempotent), with the
    /// backend's own `migrate`.
    ///
    /// # Errors
    /// As the backend's own `migrate`: a permanent error when the role may not create them.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.schema.migrate().await
    }

    /// Convert an existing table made in an older layout to the one this configuration gives
    /// new tables, with the backend's own conversion (Postgres: cursor claims, MariaDB: an
    /// unpublished table); `false` when there was nothing to convert (SQLite has one layout).
    /// Stop the table's relays first.
    ///
    /// # Errors
    /// As the backend's own conversion: [`Error::InvalidInput`] when the configuration gives
    /// new tables the old layout, the table is missing, or messages are leased.
    pub async fn convert_layout(&self) -> Result<bool, Error> {
        self.schema.convert_layout().await
    }

    /// Where relay groups keep their leases, if the backend supports them (Postgres, MariaDB);
    /// SQLite does not, and a relay given a group there runs as without one.
    pub fn group_store(&self) -> Option<Arc<dyn RelayGroupStore>> {
        self.groups.clone()
    }
}

fn choices() -> String {
    schemes::choices(SCHEMES)
}

/// Connect to (or, for SQLite, open) the store that `url` names, with the backend's own
/// `open_url` (`outbox::postgres::url::open_url` and the like), which reads its URL and applies
/// `options`.
///
/// # Errors
/// [`Error::InvalidInput`] for a URL without a scheme, an unknown scheme, a scheme whose feature
/// is not compiled in, or options the backend refuses (the message names the valid choices);
/// [`Error::Unavailable`] when the database cannot be reached. Passwords never appear in errors.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(unused_variables)
)]
pub async fn open(url: &str, options: &StoreOptions) -> Result<OpenedStore, Error> {
    let scheme = url.split_once(':').map(|(s, _)| s).ok_or_else(|| {
        Error::invalid_input(format!(
            "store URL {:?} has no scheme; use one of: {}",
            redact_url(url),
            choices()
        ))
    })?;
    match scheme {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(OpenedStore::with_groups(
            "postgres",
            outbox_backend_postgres::url::open_url(url, options).await?,
        )),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => Ok(OpenedStore::with_groups(
            "mysql",
            outbox_backend_mysql::url::open_url(url, options).await?,
        )),
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(OpenedStore::new(
            "sqlite",
            outbox_backend_sqlite::url::open_url(url, options).await?,
        )),
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
        .expect_err("postgres is not compiled in");
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
