//! Row helpers of the rusqlite store (SQLite): the counts row and a column read as text.

use rusqlite::types::ValueRef;
use rusqlite::Row;

use outbox_traits::Counts;

/// The [`Counts`] in a row whose first four columns are the `pending`, `leased`, `published`
/// and `dead` counts.
///
/// # Errors
/// rusqlite's error when a column is not an integer.
pub fn counts(row: &Row<'_>) -> rusqlite::Result<Counts> {
    // COUNT is never negative.
    let n = |i: usize| row.get::<_, i64>(i).map(|n| u64::try_from(n).unwrap_or(0));
    Ok(Counts {
        pending: n(0)?,
        leased: n(1)?,
        published: n(2)?,
        dead: n(3)?,
    })
}

/// Column `i` as text, whatever its storage class (a number as its digits); `None` for NULL,
/// a blob, or a column that is not there.
pub fn text(row: &Row<'_>, i: usize) -> Option<String> {
    match row.get_ref(i).ok()? {
        ValueRef::Text(t) => Some(String::from_utf8_lossy(t).into_owned()),
        ValueRef::Integer(n) => Some(n.to_string()),
        ValueRef::Real(x) => Some(x.to_string()),
        ValueRef::Null | ValueRef::Blob(_) => None,
    }
}
