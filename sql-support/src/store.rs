//! What a sqlx store holds (a pool and its configuration), how it connects, and how it shows
//! itself in `Debug` without the pool's password; each backend wraps [`SqlxStore`] in its own
//! store type and adds its dialect.

use std::fmt;
use std::time::Duration;

use outbox_traits::Error;
use sqlx::pool::PoolOptions;
use sqlx::{Database, Pool};

use crate::connect_pool_with;

/// How long [`SqlxStore::connect`] waits for a first connection, and the pool it makes waits
/// for a connection before a call fails with [`Error::Unavailable`].
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection pool and a store configuration `C`. Cloning is cheap and shares the pool.
pub struct SqlxStore<DB: Database, C> {
    pool: Pool<DB>,
    config: C,
}

impl<DB: Database, C: Clone> Clone for SqlxStore<DB, C> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            config: self.config.clone(),
        }
    }
}

impl<DB: Database, C> SqlxStore<DB, C> {
    /// A store over an existing pool.
    pub fn new(pool: Pool<DB>, config: C) -> Self {
        Self { pool, config }
    }

    /// Connect a new pool to `url` (sqlx's default size; [`CONNECT_TIMEOUT`] to get a
    /// connection); `what` names the database in errors.
    ///
    /// # Errors
    /// As [`connect_pool`](crate::connect_pool): [`Error::InvalidInput`] for a malformed URL and
    /// [`Error::Unavailable`] when the server cannot be reached; neither message contains the
    /// URL's password.
    pub async fn connect(url: &str, what: &str, config: C) -> Result<Self, Error> {
        Self::connect_with(url, what, config, PoolOptions::new()).await
    }

    /// [`SqlxStore::connect`] with the pool built from `pool` (e.g. with an
    /// [`after_connect`](PoolOptions::after_connect) that sets session variables); its acquire
    /// timeout is set to [`CONNECT_TIMEOUT`].
    ///
    /// # Errors
    /// As [`SqlxStore::connect`].
    pub async fn connect_with(
        url: &str,
        what: &str,
        config: C,
        pool: PoolOptions<DB>,
    ) -> Result<Self, Error> {
        let pool = connect_pool_with(url, what, CONNECT_TIMEOUT, pool).await?;
        Ok(Self::new(pool, config))
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &C {
        &self.config
    }
}

impl<DB: Database, C: fmt::Debug> SqlxStore<DB, C> {
    /// `Debug` output named `name`: the configuration and the pool's size, never the pool's
    /// options (they hold the password).
    pub fn fmt_as(&self, name: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(name)
            .field("config", &self.config)
            .field("pool_size", &self.pool.size())
            .finish()
    }
}
