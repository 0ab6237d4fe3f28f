//! Row helpers of the sqlx stores: the counts row (the durations, error texts and decoding
//! errors every SQL store shares are in [`crate::limits`]).

use outbox_traits::{Counts, Error};
use sqlx::{ColumnIndex, Decode, Row, Type};

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
