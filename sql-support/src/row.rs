//! Row helpers of the sqlx stores: the counts row and the attempt counter (the durations, error texts and decoding
//! errors every SQL store shares are in [`crate::limits`]).

use outbox_traits::{Counts, Error};
use sqlx::{ColumnIndex, Decode, Row, Type};

/// The attempt counter of a row (the `INT` column `attempts`), when it reads as one: for
/// showing a dead row that does not decode.
pub fn attempts<R>(row: &R) -> Option<u32>
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    i32: for<'r> Decode<'r, R::Database> + Type<R::Database>,
{
    let n: i32 = row.try_get("attempts").ok()?;
    u32::try_from(n).ok()
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
