//! Decoding rows into the contract's types (durations in microseconds and the helpers shared
//! with Postgres are in `outbox_sqlx_support::row`).

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDateTime, Utc};
use outbox_traits::{Error, Message};
use sqlx::mysql::MySqlRow;
use sqlx::Row;
use uuid::Uuid;

pub(crate) use outbox_sqlx_support::row::{decode_error, micros};

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

/// A `DATETIME(6)` column, which holds UTC.
pub(crate) fn utc(row: &MySqlRow, column: &str, table: &str) -> Result<DateTime<Utc>, Error> {
    let naive: NaiveDateTime = row.try_get(column).map_err(|e| decode_error(e, table))?;
    Ok(naive.and_utc())
}

/// A message id stored as text.
pub(crate) fn uuid(text: &str, table: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(text).map_err(|e| decode_error(format!("id {text:?}: {e}"), table))
}

/// A [`Message`] from a row holding the message columns (claim and list queries).
pub(crate) fn message(row: &MySqlRow, table: &str) -> Result<Message, Error> {
    let get = |e: sqlx::Error| decode_error(e, table);
    let headers = text(row, "headers", table)?;
    let headers: BTreeMap<String, String> =
        serde_json::from_str(&headers).map_err(|e| decode_error(e, table))?;
    let attempts: i32 = row.try_get("attempts").map_err(get)?;
    Ok(Message {
        id: uuid(&text(row, "id", table)?, table)?,
        seq: row.try_get("seq").map_err(get)?,
        aggregate_type: text(row, "aggregatetype", table)?,
        aggregate_id: text(row, "aggregateid", table)?,
        event_type: text(row, "type", table)?,
        payload: text(row, "payload", table)?,
        headers,
        partition_key: optional_text(row, "partition_key", table)?,
        dedup_key: optional_text(row, "dedup_key", table)?,
        attempts: u32::try_from(attempts).map_err(|e| decode_error(e, table))?,
        created_at: utc(row, "created_at", table)?,
    })
}
