//! Decoding rows into the contract's types (durations, error texts and the quarantine of rows
//! that do not decode are shared by every SQL store, in `outbox_sql_support`).

use chrono::{DateTime, Utc};
use outbox_sql_support::admin::LenientRow;
use outbox_sql_support::limits::decode_error;
use outbox_sql_support::quarantine::{self, Poison};
use outbox_traits::{Error, Message};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

/// A [`Message`] from a row holding the message columns, or the [`Poison`] saying which column
/// does not decode and why. `Err` only when not even the row's `seq` can be read.
pub(crate) fn decode(row: &PgRow, table: &str) -> Result<Result<Message, Poison>, Error> {
    let seq: i64 = row.try_get("seq").map_err(|e| decode_error(e, table))?;
    let partition_key: Result<Option<String>, _> = row.try_get("partition_key");
    let poison = |reason: String| Poison {
        seq,
        partition_key: partition_key.as_ref().ok().cloned().flatten(),
        reason,
    };
    match fields(row, seq) {
        Ok(message) => Ok(Ok(message)),
        Err(reason) => Ok(Err(poison(reason))),
    }
}

/// The message columns, or the reason naming the first one that does not decode.
fn fields(row: &PgRow, seq: i64) -> Result<Message, String> {
    fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T, String>
    where
        T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        row.try_get(column).map_err(|e| {
            let raw = row
                .try_get_unchecked::<Option<String>, _>(column)
                .ok()
                .flatten();
            quarantine::reason(column, raw.as_deref(), e)
        })
    }
    let headers: String = get(row, "headers")?;
    // A row with bytes is binary, whatever its `payload` holds.
    let binary = quarantine::binary(
        get::<Option<Vec<u8>>>(row, "payload_bytes")?,
        get::<Option<String>>(row, "content_type")?,
    )?;
    let attempts: i32 = get(row, "attempts")?;
    Ok(Message {
        id: get::<Uuid>(row, "id")?,
        seq,
        aggregate_type: get(row, "aggregatetype")?,
        aggregate_id: get(row, "aggregateid")?,
        event_type: get(row, "type")?,
        payload: match binary {
            Some(_) => "null".to_owned(),
            None => get(row, "payload")?,
        },
        binary,
        headers: quarantine::headers(&headers)?,
        partition_key: get(row, "partition_key")?,
        dedup_key: get(row, "dedup_key")?,
        attempts: u32::try_from(attempts)
            .map_err(|e| quarantine::reason("attempts", Some(&attempts.to_string()), e))?,
        created_at: get::<DateTime<Utc>>(row, "created_at")?,
    })
}

/// A dead row read leniently, for showing one that does not decode.
pub(crate) struct Lenient<'r>(pub(crate) &'r PgRow);

impl LenientRow for Lenient<'_> {
    fn text(&self, column: &str) -> Option<String> {
        match column {
            "id" => self
                .0
                .try_get::<Uuid, _>(column)
                .ok()
                .map(|id| id.to_string()),
            _ => self.0.try_get::<Option<String>, _>(column).ok().flatten(),
        }
    }

    fn bytes(&self) -> Option<Vec<u8>> {
        self.0
            .try_get::<Option<Vec<u8>>, _>("payload_bytes")
            .ok()
            .flatten()
    }

    fn attempts(&self) -> Option<u32> {
        outbox_sql_support::row::attempts(self.0)
    }

    fn created_at(&self) -> Option<DateTime<Utc>> {
        self.0.try_get("created_at").ok()
    }
}
