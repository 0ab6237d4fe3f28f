//! Wake-up hints from `LISTEN` on the table's channel.

use outbox_traits::{async_trait, Error, WakeSource};
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::PgPool;

use crate::config::PostgresConfig;
use crate::error::map_sqlx;

/// A [`WakeSource`] listening on [`PostgresConfig::notify_channel`] over its own connection.
pub(crate) struct PgWakeSource {
    listener: PgListener,
    table: String,
}

impl PgWakeSource {
    /// Open a dedicated connection (with the pool's connection settings) and `LISTEN`; the
    /// channel is subscribed when this returns, so any later commit that notifies is seen.
    pub(crate) async fn listen(pool: &PgPool, config: &PostgresConfig) -> Result<Self, Error> {
        let table = config.qualified_table().to_owned();
        // A private one-connection pool: a listener on the caller's pool would hold one of its
        // connections for good, and `pool.close()` would wait for the listener forever.
        let own = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with(pool.connect_options().as_ref().clone());
        let mut listener = PgListener::connect_with(&own)
            .await
            .map_err(|e| map_sqlx(e, "listen", &table))?;
        listener
            .listen(config.notify_channel())
            .await
            .map_err(|e| map_sqlx(e, "listen", &table))?;
        Ok(Self { listener, table })
    }
}

#[async_trait]
impl WakeSource for PgWakeSource {
    /// Cancel safe: `PgListener::try_recv` is, and this adds no state of its own.
    async fn wait(&mut self) -> Result<(), Error> {
        match self.listener.try_recv().await {
            Ok(Some(_)) => Ok(()),
            // The connection dropped and notifications may have been missed: wake the relay so
            // it polls. The next call reconnects and listens again.
            Ok(None) => Ok(()),
            Err(e) => Err(map_sqlx(e, "listen", &self.table)),
        }
    }
}
