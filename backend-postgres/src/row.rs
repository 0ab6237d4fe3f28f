//! Decoding rows into the contract's types, and durations into the microseconds the SQL takes.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_traits::{Error, Message};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

/// Longest accepted lease or retry delay: about 100 years. Longer values would overflow
/// Postgres's timestamps; they are refused as invalid input rather than failing in SQL.
const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `duration` in whole microseconds (rounded up, so a tiny positive value stays positive).
pub(crate) fn micros(what: &str, duration: Duration) -> Result<i64, Error> {
    if duration > MAX_DURATION {
        return Err(Error::invalid_input(format!(
            "{what} of {duration:?} is longer than 100 years; use a shorter one"
        )));
    }
    let us = duration.as_nanos().div_ceil(1000);
    // Bounded by MAX_DURATION above, far below i64::MAX microseconds.
    Ok(i64::try_from(us).unwrap_or(i64::MAX))
}

fn decode_error(err: impl std::fmt::Display, table: &str) -> Error {
    Error::permanent(
        format!("a row of {table} could not be decoded: {err}; was the table changed by hand?"),
        None,
    )
}

/// A [`Message`] from a row holding the message columns (claim and list queries).
pub(crate) fn message(row: &PgRow, table: &str) -> Result<Message, Error> {
    let get = |e: sqlx::Error| decode_error(e, table);
    let headers: String = row.try_get("headers").map_err(get)?;
    let headers: BTreeMap<String, String> =
        serde_json::from_str(&headers).map_err(|e| decode_error(e, table))?;
    let attempts: i32 = row.try_get("attempts").map_err(get)?;
    Ok(Message {
        id: row.try_get::<Uuid, _>("id").map_err(get)?,
        seq: row.try_get("seq").map_err(get)?,
        aggregate_type: row.try_get("aggregatetype").map_err(get)?,
        aggregate_id: row.try_get("aggregateid").map_err(get)?,
        event_type: row.try_get("type").map_err(get)?,
        payload: row.try_get("payload").map_err(get)?,
        headers,
        partition_key: row.try_get("partition_key").map_err(get)?,
        dedup_key: row.try_get("dedup_key").map_err(get)?,
        attempts: u32::try_from(attempts).map_err(|e| decode_error(e, table))?,
        created_at: row.try_get::<DateTime<Utc>, _>("created_at").map_err(get)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_and_are_bounded() {
        assert_eq!(micros("lease", Duration::from_secs(2)).unwrap(), 2_000_000);
        assert_eq!(micros("lease", Duration::from_nanos(1)).unwrap(), 1);
        assert_eq!(micros("lease", Duration::ZERO).unwrap(), 0);
        let err = micros("lease", Duration::MAX).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)));
    }
}
