//! The Redis inbox (feature `redis`): one key per `(consumer, message id)`, set with
//! `SET key 1 NX PX ttl`, for handlers whose effect is not in a SQL database (a call to another
//! service, an e-mail, a file).
//!
//! # The guarantee is weaker than the SQL inboxes'
//! The mark and the effect are not in one transaction, so no order of the two makes the
//! effect exactly-once under crashes. What can happen, exactly:
//! - **Mark first** ([`RedisInbox::record`], then the effect, then the ack; on a handler error
//!   [`RedisInbox::forget`] so the redelivery runs it again): if the consumer dies (or `forget`
//!   fails) after the mark and before the effect is done, every redelivery finds the mark and
//!   skips the message: that effect is **lost** (at most once). Concurrent deliveries of one
//!   id run the effect once.
//! - **Effect first** (the effect, then `record`, then the ack): if the consumer dies between
//!   the effect and the mark, the redelivery applies the effect **again** (at least once), and
//!   two concurrent deliveries of one id may both apply it.
//! - **Expiry**: a mark lives for the inbox's time to live; a redelivery after that is new
//!   again. Choose a TTL longer than any redelivery can come.
//! - **Redis durability**: a mark written just before a Redis crash (without
//!   `appendfsync always`) or a failover to a replica that had not received it is forgotten,
//!   and the message is applied again.
//!
//! Prefer a SQL inbox in the effect's own transaction when the effect is in a database; use
//! this one to drop the duplicates of an effect that is idempotent or cheap to repeat, or
//! whose loss is the lesser harm (mark first).
//!
//! ```no_run
//! use outbox_inbox::redis::RedisInbox;
//! use outbox_inbox::Receipt;
//! # async fn run(mut conn: redis::aio::MultiplexedConnection, id: uuid::Uuid) -> Result<(), outbox_inbox::Error> {
//! let inbox = RedisInbox::new("inbox", std::time::Duration::from_secs(7 * 86_400))?;
//! if inbox.record(&mut conn, "mailer", id).await? == Receipt::New {
//!     if let Err(err) = send_mail().await {
//!         inbox.forget(&mut conn, "mailer", id).await?; // let the redelivery try again
//!         return Err(err);
//!     }
//! }
//! // acknowledge the message
//! # Ok(())
//! # }
//! # async fn send_mail() -> Result<(), outbox_inbox::Error> { Ok(()) }
//! ```

use std::time::Duration;

use outbox_traits::Error;
use redis::aio::ConnectionLike;
use redis::RedisError;
use uuid::Uuid;

use crate::common::{batch, check_consumer, receipts, Receipt};

/// A Redis inbox: keys `<prefix>:<consumer>:<message id>` that expire after a time to live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisInbox {
    prefix: String,
    ttl: Duration,
}

impl RedisInbox {
    /// An inbox whose keys start with `prefix` and live `ttl` (at least one millisecond).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an empty prefix or a TTL under a millisecond.
    pub fn new(prefix: impl Into<String>, ttl: Duration) -> Result<Self, Error> {
        let prefix = prefix.into();
        if prefix.is_empty() {
            return Err(Error::invalid_input(
                "the Redis inbox key prefix is empty; give one (e.g. \"inbox\") so its keys are \
                 told apart from others",
            ));
        }
        if ttl < Duration::from_millis(1) || u64::try_from(ttl.as_millis()).is_err() {
            return Err(Error::invalid_input(format!(
                "the Redis inbox time to live {ttl:?} is out of range; give at least 1 ms, \
                 longer than any redelivery can come (e.g. 7 days)"
            )));
        }
        Ok(Self { prefix, ttl })
    }

    /// The key that marks `id` for `consumer`: `<prefix>:<consumer>:<id>`.
    pub fn key(&self, consumer: &str, id: Uuid) -> String {
        format!("{}:{consumer}:{}", self.prefix, id.hyphenated())
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    /// Mark `id` for `consumer` unless it is marked: [`Receipt::New`] when this call set the
    /// key, [`Receipt::Duplicate`] when it was there. One round trip. See the module docs for
    /// what is and is not guaranteed.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad consumer name; [`Error::Unavailable`] when Redis
    /// cannot be reached (the key may or may not be set).
    pub async fn record<C: ConnectionLike>(
        &self,
        conn: &mut C,
        consumer: &str,
        id: Uuid,
    ) -> Result<Receipt, Error> {
        check_consumer(consumer)?;
        let set: Option<String> = set_nx(&self.key(consumer, id), self.ttl_ms())
            .query_async(conn)
            .await
            .map_err(|e| map_err(e, "record"))?;
        Ok(if set.is_some() {
            Receipt::New
        } else {
            Receipt::Duplicate
        })
    }

    /// [`RedisInbox::record`] for several ids in one pipeline (one round trip); one [`Receipt`]
    /// per id in the order given, an id given twice new at most once.
    ///
    /// # Errors
    /// As [`RedisInbox::record`]; more than [`MAX_BATCH`](crate::MAX_BATCH) ids is
    /// [`Error::InvalidInput`].
    pub async fn record_batch<C: ConnectionLike>(
        &self,
        conn: &mut C,
        consumer: &str,
        ids: &[Uuid],
    ) -> Result<Vec<Receipt>, Error> {
        let Some(rows) = batch(consumer, ids)? else {
            return Ok(Vec::new());
        };
        let mut pipe = redis::pipe();
        for id in &rows {
            pipe.add_command(set_nx(&self.key(consumer, *id), self.ttl_ms()));
        }
        let set: Vec<Option<String>> = pipe
            .query_async(conn)
            .await
            .map_err(|e| map_err(e, "record"))?;
        let inserted = rows
            .iter()
            .zip(set)
            .filter_map(|(id, set)| set.map(|_| *id))
            .collect();
        Ok(receipts(ids, &inserted))
    }

    /// Remove the mark of `id` for `consumer`, so that the next delivery is new again: call it
    /// when the effect failed after [`RedisInbox::record`] said new.
    ///
    /// # Errors
    /// As [`RedisInbox::record`].
    pub async fn forget<C: ConnectionLike>(
        &self,
        conn: &mut C,
        consumer: &str,
        id: Uuid,
    ) -> Result<(), Error> {
        check_consumer(consumer)?;
        redis::cmd("DEL")
            .arg(self.key(consumer, id))
            .query_async::<i64>(conn)
            .await
            .map_err(|e| map_err(e, "forget"))?;
        Ok(())
    }
}

fn set_nx(key: &str, ttl_ms: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("SET");
    cmd.arg(key).arg(1).arg("NX").arg("PX").arg(ttl_ms);
    cmd
}

fn map_err(err: RedisError, op: &str) -> Error {
    let message = format!("Redis inbox {op} failed: {err}");
    if err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_timeout()
        || err.is_cluster_error()
    {
        Error::unavailable("redis", message, err)
    } else {
        Error::permanent(message, Some(Box::new(err)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked() {
        assert!(RedisInbox::new("", Duration::from_secs(1)).is_err());
        assert!(RedisInbox::new("i", Duration::from_micros(10)).is_err());
        let inbox = RedisInbox::new("i", Duration::from_secs(1));
        let id = Uuid::nil();
        assert_eq!(
            inbox.map(|i| i.key("c", id)).ok().as_deref(),
            Some("i:c:00000000-0000-0000-0000-000000000000")
        );
    }
}
