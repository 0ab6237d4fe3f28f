//! Connecting a sqlx pool (a probed connect whose errors name the real cause and never the
//! password) and the classification of sqlx errors that does not depend on the database.

use std::str::FromStr;
use std::time::Duration;

use outbox_traits::{BoxError, Error, ErrorKind};
use outbox_url::redact_url;

use crate::{password, tls};
use sqlx::pool::{Pool, PoolOptions};
use sqlx::{ConnectOptions, Connection, Database};

/// Parse `url` (after replacing a `password_file=PATH` option by the password the file holds),
/// connect once to check that the server answers, and return a lazy pool over
/// the same options whose calls wait at most `timeout` for a connection. `what` names the
/// database in errors (`"postgres"`, `"mysql"`).
///
/// Connecting once directly matters: a pool retries a refused connection until its timeout and
/// then reports only "timed out", while this gives the real cause at once.
///
/// # Errors
/// [`Error::InvalidInput`] for a malformed URL and [`Error::Unavailable`] when the server
/// cannot be reached within `timeout`; neither message contains the URL's password.
pub async fn connect_pool<DB: Database>(
    url: &str,
    what: &str,
    timeout: Duration,
) -> Result<Pool<DB>, Error> {
    connect_pool_with(url, what, timeout, PoolOptions::new()).await
}

/// [`connect_pool`] with the pool built from `pool` (its acquire timeout set to `timeout`).
///
/// # Errors
/// As [`connect_pool`].
pub async fn connect_pool_with<DB: Database>(
    url: &str,
    what: &str,
    timeout: Duration,
    pool: PoolOptions<DB>,
) -> Result<Pool<DB>, Error> {
    let url = password::resolve(url, what)?;
    let url = url.as_ref();
    let options = <<DB::Connection as Connection>::Options as FromStr>::from_str(url).map_err(
        |e: sqlx::Error| {
            Error::invalid_input(format!(
                "{what} URL {:?} is not valid: {}",
                redact_url(url),
                redact_url(&e.to_string())
            ))
        },
    )?;
    let probe = tokio::time::timeout(timeout, options.connect());
    let probe: DB::Connection = match probe.await {
        Ok(result) => result.map_err(|e| unavailable(what, url, e))?,
        Err(_elapsed) => {
            return Err(Error::Unavailable {
                what: what.to_owned(),
                message: format!(
                    "cannot connect to {}: no connection within {timeout:?}",
                    redact_url(url)
                ),
                source: None,
            })
        }
    };
    // Closing the probe is best effort: the server is known to be reachable.
    let _ = probe.close().await;
    Ok(pool.acquire_timeout(timeout).connect_lazy_with(options))
}

/// [`Error::Unavailable`] for a failed connection to `url`, with the password removed; the
/// source is kept only for errors that cannot quote the URL.
fn unavailable(what: &str, url: &str, e: sqlx::Error) -> Error {
    let mut text = redact_url(&outbox_url::error_chain_line(&e));
    if let Some(fix) = tls::fix(what, url, &text) {
        text = format!("{text}; {fix}");
    }
    let source: Option<BoxError> = match e {
        sqlx::Error::Configuration(_) => None,
        other => Some(Box::new(other)),
    };
    Error::Unavailable {
        what: what.to_owned(),
        message: format!("cannot connect to {}: {text}", redact_url(url)),
        source,
    }
}

/// Map a sqlx error from operation `op` on `table` to the contract's error; `what` names the
/// database.
///
/// Connection, I/O and pool errors are `Unavailable` (transient); a configuration error is
/// permanent and keeps only its redacted text (it may quote the connection string); a database
/// error goes to `database` with its redacted text, to be classified by its code; the rest is
/// permanent.
pub fn map_sqlx(
    err: sqlx::Error,
    what: &str,
    op: &str,
    table: &str,
    database: impl FnOnce(sqlx::Error, String) -> Error,
) -> Error {
    let text = redact_url(&err.to_string());
    match &err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => {
            Error::unavailable(what, format!("{op} on {table} failed: {text}"), err)
        }
        sqlx::Error::Configuration(_) => Error::Backend {
            message: format!("{op}: invalid {what} configuration: {text}"),
            kind: ErrorKind::Permanent,
            source: None,
        },
        sqlx::Error::Database(_) => database(err, text),
        _ => Error::permanent(
            format!("{op} on {table} failed: {text}"),
            Some(Box::new(err)),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_are_unavailable_and_configuration_errors_hide_their_source() {
        let io = sqlx::Error::Io(std::io::Error::other("reset"));
        let e = map_sqlx(io, "postgres", "claim", "t", |_, _| {
            Error::invalid_input("not a database error")
        });
        assert!(
            matches!(e, Error::Unavailable { ref what, .. } if what == "postgres"),
            "{e}"
        );
        assert!(e.is_transient());
        let refused = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused",
        ));
        for down in [refused, sqlx::Error::PoolTimedOut] {
            let e = map_sqlx(down, "mysql", "claim", "t", |_, _| {
                Error::invalid_input("not a database error")
            });
            assert!(matches!(e, Error::Unavailable { .. }), "{e}");
        }

        let config = sqlx::Error::Configuration("postgres://u:secret@h/db is bad".into());
        let e = map_sqlx(config, "postgres", "claim", "t", |_, _| {
            Error::invalid_input("not a database error")
        });
        match e {
            Error::Backend {
                message,
                kind: ErrorKind::Permanent,
                source: None,
            } => assert!(!message.contains("secret"), "{message}"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_bad_url_is_invalid_input_without_the_password() {
        let result = connect_pool::<sqlx::Postgres>(
            "postgres://u:secret@h:notaport/db",
            "postgres",
            Duration::from_secs(1),
        )
        .await;
        assert!(
            matches!(&result, Err(Error::InvalidInput(m)) if !m.contains("secret")),
            "{:?}",
            result.map(|_| ())
        );
    }
}
