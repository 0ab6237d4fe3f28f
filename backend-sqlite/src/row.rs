//! Conversions between stored rows and contract types: messages, ids and times.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::uuid::Uuid;
use outbox_traits::{Error, Message};
use rusqlite::Row;

/// Longest duration accepted for leases, retry delays and purge ages: 100 years. Keeps every
/// computed time inside both `i64` milliseconds and chrono's range.
const MAX_DURATION_MS: i64 = 100 * 366 * 24 * 3600 * 1000;

/// `d` in whole milliseconds, rounded up (a 0.5 ms lease must not end at once), or
/// [`Error::InvalidInput`] naming `what` when it is over 100 years.
pub(crate) fn duration_ms(d: Duration, what: &str) -> Result<i64, Error> {
    let ms = d.as_micros().div_ceil(1000);
    if ms > MAX_DURATION_MS as u128 {
        return Err(Error::invalid_input(format!(
            "{what} of {d:?} is too long; use at most 100 years"
        )));
    }
    // Checked just above: ms <= MAX_DURATION_MS, which fits in i64.
    Ok(ms as i64)
}

/// A stored millisecond time as a chrono time.
pub(crate) fn to_time(ms: i64) -> DateTime<Utc> {
    // Stored times come from SQLite's clock plus at most 100 years, well inside chrono's range;
    // a hand-edited out-of-range value reads as the epoch rather than failing the claim.
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::UNIX_EPOCH)
}

/// A chrono time as stored milliseconds.
pub(crate) fn from_time(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

/// Read a [`Message`] from a row whose first columns are [`crate::sql::MESSAGE_COLUMNS`].
pub(crate) fn message(row: &Row<'_>) -> rusqlite::Result<Message> {
    let id: String = row.get(0)?;
    let id = Uuid::parse_str(&id).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, Box::new(e))
    })?;
    let headers: String = row.get(6)?;
    let attempts: i64 = row.get(9)?;
    Ok(Message {
        id,
        seq: row.get(1)?,
        aggregate_type: row.get(2)?,
        aggregate_id: row.get(3)?,
        event_type: row.get(4)?,
        payload: row.get(5)?,
        headers: parse_headers(&headers, id),
        partition_key: row.get(7)?,
        dedup_key: row.get(8)?,
        attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
        created_at: to_time(row.get(10)?),
    })
}

/// Headers are written by this crate as a JSON object of strings. A row edited by hand into
/// something else must not stall the relay on every claim (a poison message), so it is
/// published without headers and a warning names it.
fn parse_headers(text: &str, id: Uuid) -> BTreeMap<String, String> {
    match serde_json::from_str(text) {
        Ok(headers) => headers,
        Err(err) => {
            tracing::warn!(message_id = %id, error = %err, "outbox headers are not a JSON object of strings; publishing without headers");
            BTreeMap::new()
        }
    }
}

/// The stored text form of an id or token.
pub(crate) fn id_text(id: Uuid) -> String {
    id.hyphenated().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_and_are_bounded() {
        assert_eq!(duration_ms(Duration::from_micros(500), "lease").unwrap(), 1);
        assert_eq!(duration_ms(Duration::from_secs(2), "lease").unwrap(), 2000);
        assert_eq!(duration_ms(Duration::ZERO, "delay").unwrap(), 0);
        let err = duration_ms(Duration::from_secs(u64::MAX), "lease").unwrap_err();
        assert!(err.to_string().contains("lease"), "{err}");
    }

    #[test]
    fn bad_headers_do_not_fail() {
        assert!(parse_headers("not json", Uuid::nil()).is_empty());
        assert_eq!(
            parse_headers(r#"{"a":"b"}"#, Uuid::nil())
                .get("a")
                .map(String::as_str),
            Some("b")
        );
    }
}
