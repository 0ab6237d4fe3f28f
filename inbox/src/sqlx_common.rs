//! What the two sqlx inboxes share: the end of the `process` convenience.

use std::future::Future;
use std::pin::Pin;

use outbox_traits::Error;
use sqlx::{Database, Transaction};

use crate::common::{Outcome, Receipt};

/// The future a `process` handler returns: boxed and `Send`, borrowing the transaction, as
/// sqlx's own `Connection::transaction` takes it, so that `process` can run in a spawned
/// task. Write the handler as `|tx| Box::pin(async move { ... })`.
pub type HandlerFuture<'t, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>;

/// Finish a delivery recorded in `tx` as `receipt`: when it is new run `handler` in the same
/// transaction and commit; a duplicate rolls back without running the handler, a handler error
/// rolls back and is returned. `map` classifies sqlx errors of operation `op`.
pub(crate) async fn finish<DB, T, E, F>(
    mut tx: Transaction<'static, DB>,
    receipt: Receipt,
    map: fn(sqlx::Error, &str) -> Error,
    handler: F,
) -> Result<Outcome<T>, E>
where
    DB: Database,
    F: for<'t> FnOnce(&'t mut Transaction<'static, DB>) -> HandlerFuture<'t, T, E>,
    E: From<Error>,
{
    if receipt == Receipt::Duplicate {
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
