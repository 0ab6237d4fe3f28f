//! Opening connections configured the way the outbox needs them.

use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use outbox_traits::Error;

use crate::config::SqliteConfig;
use crate::error::{map_err, Ctx};

/// Prepared statements kept per connection: the store uses about 16, and an application's own
/// statements share the cache.
const STATEMENT_CACHE: usize = 64;

/// Open (creating if needed) the database at `path`, configured for the outbox.
///
/// Sets `journal_mode = WAL` (readers never block the writer, and the writer never blocks
/// readers), `busy_timeout` and `synchronous` from `config`, and `foreign_keys = ON`. Use it for
/// your application's connections too, and begin write transactions with
/// [`rusqlite::TransactionBehavior::Immediate`] (see [`crate::enqueue`]).
///
/// `:memory:` opens a private in-memory database (WAL is not available there, and no other
/// connection can see it).
///
/// # Errors
/// [`Error::InvalidInput`] for a bad config or when the file's directory does not exist (SQLite
/// creates the file, never its directory); [`Error::Unavailable`] when the file cannot be opened.
pub fn open_connection(path: impl AsRef<Path>, config: &SqliteConfig) -> Result<Connection, Error> {
    let path = path.as_ref();
    check_directory(path)?;
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(|e| {
        let err = map_err(e, Ctx::Open, "");
        match err {
            Error::Unavailable {
                what,
                message,
                source,
            } => Error::Unavailable {
                what,
                message: format!("{} ({message})", path.display()),
                source,
            },
            other => other,
        }
    })?;
    configure(&conn, config)?;
    Ok(conn)
}

fn check_directory(path: &Path) -> Result<(), Error> {
    let text = path.to_string_lossy();
    if text == ":memory:" || text.is_empty() || text.starts_with("file:") {
        return Ok(());
    }
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => return Ok(()),
    };
    if dir.is_dir() {
        Ok(())
    } else {
        Err(Error::invalid_input(format!(
            "cannot open SQLite database {}: directory {} does not exist; create it first or fix \
             the path",
            path.display(),
            dir.display()
        )))
    }
}

fn configure(conn: &Connection, config: &SqliteConfig) -> Result<(), Error> {
    let err = |e| map_err(e, Ctx::Open, config.table());
    // Set first: switching to WAL needs a lock another connection may briefly hold.
    conn.busy_timeout(config.busy_timeout()).map_err(err)?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))
        .map_err(err)?;
    if !mode.eq_ignore_ascii_case("wal") && !mode.eq_ignore_ascii_case("memory") {
        return Err(Error::permanent(
            format!(
                "sqlite: could not switch the database to WAL mode (it reports {mode:?}); \
                 WAL is needed so readers do not block the relay"
            ),
            None,
        ));
    }
    conn.pragma_update(None, "synchronous", config.synchronous().as_sql())
        .map_err(err)?;
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(err)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    Ok(())
}
