//! Decoding rows into the contract's types (durations in microseconds and the helpers shared
//! with MariaDB are in `outbox_sqlx_support::row`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use outbox_sqlx_support::row::decode_error;
use outbox_traits::{Error, Message};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

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
