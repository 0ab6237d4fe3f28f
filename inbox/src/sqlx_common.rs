//! What the two sqlx inboxes share: the `process` convenience around the caller's pool.

use outbox_traits::Error;
use sqlx::{Database, Pool, Transaction};

use crate::common::{Outcome, Receipt};

/// Begin a transaction on `pool`, `record` the delivery in it, and when it is new run
/// `handler` in the same transaction and commit; a duplicate rolls back without running the
/// handler, a handler error rolls back and is returned. `map` classifies sqlx errors of
/// operation `op`.
pub(crate) async fn process<DB, T, E, R, F>(
    pool: &Pool<DB>,
    map: fn(sqlx::Error, &str) -> Error,
    record: R,
    handler: F,
) -> Result<Outcome<T>, E>
where
    DB: Database,
    R: AsyncFnOnce(&mut DB::Connection) -> Result<Receipt, Error>,
    F: AsyncFnOnce(&mut Transaction<'static, DB>) -> Result<T, E>,
    E: From<Error>,
{
    let mut tx = pool.begin().await.map_err(|e| map(e, "begin"))?;
    if record(&mut tx).await? == Receipt::Duplicate {
        tx.rollback().await.map_err(|e| map(e, "rollback"))?;
        return Ok(Outcome::Duplicate);
    }
    match handler(&mut tx).await {
        Ok(value) => {
            tx.commit().await.map_err(|e| map(e, "commit"))?;
            Ok(Outcome::Handled(value))
        }
        Err(err) => {
            // The handler's error is what the caller needs; a failed rollback also ends the
            // transaction (the connection is closed), so it is not reported over it.
            let _ = tx.rollback().await;
            Err(err)
        }
    }
}
