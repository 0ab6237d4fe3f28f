//! Wake-up hints from `LISTEN` on the table's channel.

use outbox_traits::{async_trait, Error, WakeSource};
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::PgPool;

use crate::config::PostgresConfig;
use crate::error::map_sqlx;

/// A [`WakeSource`] listening on [`PostgresConfig::notify_channel`] over its own connection.
pub(crate) struct PgWakeSource {
    listener: PgListener,
    /// A private pool: a listener on the caller's pool would hold one of its connections for
    /// good, and `pool.close()` would wait for the listener forever. Two connections, so a
    /// replacement can subscribe while the broken listener still holds the first.
    pool: PgPool,
    channel: String,
    table: String,
}

impl PgWakeSource {
    /// Open a dedicated connection (with the pool's connection settings) and `LISTEN`; the
    /// channel is subscribed when this returns, so any later commit that notifies is seen.
    pub(crate) async fn listen(pool: &PgPool, config: &PostgresConfig) -> Result<Self, Error> {
        let table = config.qualified_table().to_owned();
        let channel = config.notify_channel().to_owned();
        let own = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with(pool.connect_options().as_ref().clone());
        let listener = subscribe(&own, &channel)
            .await
            .map_err(|e| map_sqlx(e, "listen", &table))?;
        warn_without_trigger(pool, config).await;
        Ok(Self {
            listener,
            pool: own,
            channel,
            table,
        })
    }
}

/// Inserts notify through the table's trigger, which a table migrated by an earlier release
/// (whose enqueue sent the notification itself) lacks until its next migration: say so, since
/// until then the relay finds new rows only by polling. A failed check is only logged too: the
/// relay works either way.
async fn warn_without_trigger(pool: &PgPool, config: &PostgresConfig) {
    let present: Result<bool, sqlx::Error> = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_trigger
                        WHERE tgrelid = to_regclass($1) AND tgname = $2)",
    )
    .bind(config.qualified_table())
    .bind(config.notify_trigger())
    .fetch_one(pool)
    .await;
    match present {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            table = config.qualified_table(),
            trigger = config.notify_trigger(),
            "the outbox table has no insert trigger to wake relays; run the migration \
             (`outbox-relay migrate`) to add it. Until then new messages are found by polling"
        ),
        Err(e) => tracing::debug!(error = %e, "could not check for the outbox insert trigger"),
    }
}

async fn subscribe(pool: &PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}

#[async_trait]
impl WakeSource for PgWakeSource {
    /// Cancel safe: `PgListener::try_recv` is (sqlx ≥ 0.8.1), and a reconnect replaces the
    /// listener only once it is subscribed.
    async fn wait(&mut self) -> Result<(), Error> {
        match self.listener.try_recv().await {
            Ok(Some(_)) => Ok(()),
            // The connection dropped and sqlx reconnected: notifications may have been missed,
            // so wake the relay to poll.
            Ok(None) => Ok(()),
            // E.g. the server terminated the session: subscribe again on a new connection and
            // wake the relay to poll for what was missed; fail only if that is impossible.
            Err(first) => match subscribe(&self.pool, &self.channel).await {
                Ok(listener) => {
                    self.listener = listener;
                    Ok(())
                }
                Err(_) => Err(map_sqlx(first, "listen", &self.table)),
            },
        }
    }
}
