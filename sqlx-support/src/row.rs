//! Row helpers both sqlx stores use: durations in the microseconds their SQL takes, decoding
//! errors, stored error texts, and the counts row.

use std::time::Duration;

use outbox_traits::{Counts, Error};
use sqlx::{ColumnIndex, Decode, Row, Type};

/// Longest accepted lease, retry delay or age: about 100 years. Longer values would overflow
/// the databases' timestamps (Postgres) or run past `DATETIME`'s year 9999 (MariaDB); they are
/// refused as invalid input rather than failing in SQL.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Longest stored error text; longer errors are cut (at a character boundary) so a broker that
/// returns a huge error body cannot bloat the table.
pub const MAX_ERROR_BYTES: usize = 8 * 1024;

/// `duration` in whole microseconds (rounded up, so a tiny positive value stays positive).
///
/// # Errors
/// [`Error::InvalidInput`] naming `what` when `duration` is longer than [`MAX_DURATION`].
pub fn micros(what: &str, duration: Duration) -> Result<i64, Error> {
    if duration > MAX_DURATION {
        return Err(Error::invalid_input(format!(
            "{what} of {duration:?} is longer than 100 years; use a shorter one"
        )));
    }
    let us = duration.as_nanos().div_ceil(1000);
    // Bounded by MAX_DURATION above, far below i64::MAX microseconds.
    Ok(i64::try_from(us).unwrap_or(i64::MAX))
}

/// The permanent error for a row of `table` that does not decode.
pub fn decode_error(err: impl std::fmt::Display, table: &str) -> Error {
    Error::permanent(
        format!("a row of {table} could not be decoded: {err}; was the table changed by hand?"),
        None,
    )
}

/// `text` cut to at most [`MAX_ERROR_BYTES`], at a character boundary.
pub fn truncate_error(text: &str) -> &str {
    let mut cut = text.len().min(MAX_ERROR_BYTES);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    &text[..cut]
}

/// The [`Counts`] in a row with the `BIGINT` columns `pending`, `leased`, `published` and
/// `dead` (the `counts` statement of both stores); `err` maps a decoding error.
pub fn counts<R>(row: &R, err: impl Fn(sqlx::Error) -> Error) -> Result<Counts, Error>
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
{
    let get = |name: &str| -> Result<u64, Error> {
        let n: i64 = row.try_get(name).map_err(&err)?;
        // COUNT is never negative.
        Ok(u64::try_from(n).unwrap_or(0))
    };
    Ok(Counts {
        pending: get("pending")?,
        leased: get("leased")?,
        published: get("published")?,
        dead: get("dead")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_and_are_bounded() {
        assert_eq!(
            micros("lease", Duration::from_secs(2)).ok(),
            Some(2_000_000)
        );
        assert_eq!(micros("lease", Duration::from_nanos(1)).ok(), Some(1));
        assert_eq!(micros("lease", Duration::ZERO).ok(), Some(0));
        let err = micros("lease", Duration::MAX).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
    }

    #[test]
    fn error_texts_are_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_ERROR_BYTES);
        let cut = truncate_error(&long);
        assert!(cut.len() <= MAX_ERROR_BYTES && cut.len() >= MAX_ERROR_BYTES - 1);
        assert_eq!(truncate_error("short"), "short");
    }
}
