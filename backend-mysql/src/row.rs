//! Decoding rows into the contract's types (durations, error texts and the quarantine of rows
//! that do not decode are shared by every SQL store, in `outbox_sql_support`).

use chrono::NaiveDateTime;
use chrono::{DateTime, Utc};
use outbox_sql_support::admin::LenientRow;
use outbox_sql_support::quarantine::{self, Poison};
use outbox_traits::{Error, Message};
use sqlx::mysql::MySqlRow;
use sqlx::Row;
use uuid::Uuid;

pub(crate) use outbox_sql_support::limits::{decode_error, micros};

/// A text column. Read without sqlx's type check: MariaDB flags columns with a binary
/// collation (the table's `utf8mb4_nopad_bin`) as `BINARY`, which sqlx would refuse for
/// `String`, although their values are UTF-8 text.
pub(crate) fn text(row: &MySqlRow, column: &str, table: &str) -> Result<String, Error> {
    row.try_get_unchecked::<String, _>(column)
        .map_err(|e| decode_error(e, table))
}

/// A nullable text column (see [`text`]).
pub(crate) fn optional_text(
    row: &MySqlRow,
    column: &str,
    table: &str,
) -> Result<Option<String>, Error> {
    row.try_get_unchecked::<Option<String>, _>(column)
        .map_err(|e| decode_error(e, table))
}

/// A message id stored as text.
pub(crate) fn uuid(text: &str, table: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(text).map_err(|e| decode_error(format!("id {text:?}: {e}"), table))
}

/// A [`Message`] from a row holding the message columns, or the [`Poison`] saying which column
/// does not decode and why. `Err` only when not even the row's `seq` can be read.
pub(crate) fn decode(row: &MySqlRow, table: &str) -> Result<Result<Message, Poison>, Error> {
    let seq: i64 = row.try_get("seq").map_err(|e| decode_error(e, table))?;
    let partition_key = row
        .try_get_unchecked::<Option<String>, _>("partition_key")
        .ok()
        .flatten();
    Ok(fields(row, seq).map_err(|reason| Poison {
        seq,
        partition_key,
        reason,
    }))
}

/// The message columns, or the reason naming the first one that does not decode.
fn fields(row: &MySqlRow, seq: i64) -> Result<Message, String> {
    let reason = |column: &str, e: sqlx::Error| quarantine::reason(column, None, e);
    let text = |column: &str| {
        row.try_get_unchecked::<String, _>(column)
            .map_err(|e| reason(column, e))
    };
    let optional_text = |column: &str| {
        row.try_get_unchecked::<Option<String>, _>(column)
            .map_err(|e| reason(column, e))
    };
    let headers = quarantine::headers(&text("headers")?)?;
    // A row with bytes is binary, whatever its `payload` holds.
    let binary = quarantine::binary(
        row.try_get::<Option<Vec<u8>>, _>("payload_bytes")
            .map_err(|e| reason("payload_bytes", e))?,
        optional_text("content_type")?,
    )?;
    let attempts: i32 = row.try_get("attempts").map_err(|e| reason("attempts", e))?;
    let created_at: NaiveDateTime = row
        .try_get("created_at")
        .map_err(|e| reason("created_at", e))?;
    Ok(Message {
        id: quarantine::id(&text("id")?)?,
        seq,
        aggregate_type: text("aggregatetype")?,
        aggregate_id: text("aggregateid")?,
        event_type: text("type")?,
        payload: match binary {
            Some(_) => "null".to_owned(),
            None => text("payload")?,
        },
        binary,
        headers,
        partition_key: optional_text("partition_key")?,
        dedup_key: optional_text("dedup_key")?,
        attempts: u32::try_from(attempts)
            .map_err(|e| quarantine::reason("attempts", Some(&attempts.to_string()), e))?,
        created_at: created_at.and_utc(),
    })
}

/// A dead row read leniently, for showing one that does not decode.
pub(crate) struct Lenient<'r>(pub(crate) &'r MySqlRow);

impl LenientRow for Lenient<'_> {
    fn text(&self, column: &str) -> Option<String> {
        self.0
            .try_get_unchecked::<Option<String>, _>(column)
            .ok()
            .flatten()
    }

    fn bytes(&self) -> Option<Vec<u8>> {
        self.0
            .try_get_unchecked::<Option<Vec<u8>>, _>("payload_bytes")
            .ok()
            .flatten()
    }

    fn attempts(&self) -> Option<u32> {
        outbox_sql_support::row::attempts(self.0)
    }

    fn created_at(&self) -> Option<DateTime<Utc>> {
        self.0
            .try_get::<NaiveDateTime, _>("created_at")
            .ok()
            .map(|t| t.and_utc())
    }
}
