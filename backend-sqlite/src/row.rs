//! Conversions between stored rows and contract types: messages, ids and times.

use outbox_sql_support::admin::LenientRow;
use outbox_sql_support::quarantine::{self, Poison};
use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::uuid::Uuid;
use outbox_traits::Message;
use rusqlite::types::ValueRef;
use rusqlite::Row;

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

/// A [`Message`] from a row whose first columns are [`crate::sql::MESSAGE_COLUMNS`], or the
/// [`Poison`] naming the first column that does not decode. `Err` only when not even the
/// row's `seq` can be read.
pub(crate) fn decode(row: &Row<'_>) -> rusqlite::Result<Result<Message, Poison>> {
    let seq: i64 = row.get(1)?;
    let partition_key = row.get::<_, Option<String>>(7).ok().flatten();
    Ok(fields(row, seq).map_err(|reason| Poison {
        seq,
        partition_key,
        reason,
    }))
}

/// The message columns, or the reason naming the first one that does not decode.
fn fields(row: &Row<'_>, seq: i64) -> Result<Message, String> {
    fn get<T: rusqlite::types::FromSql>(
        row: &Row<'_>,
        i: usize,
        column: &str,
    ) -> Result<T, String> {
        row.get::<_, T>(i).map_err(|e| {
            let raw = match row.get_ref(i) {
                Ok(ValueRef::Text(t)) => Some(String::from_utf8_lossy(t).into_owned()),
                Ok(ValueRef::Integer(n)) => Some(n.to_string()),
                Ok(ValueRef::Real(x)) => Some(x.to_string()),
                _ => None,
            };
            quarantine::reason(column, raw.as_deref(), e)
        })
    }
    let id = quarantine::id(&get::<String>(row, 0, "id")?)?;
    let headers = quarantine::headers(&get::<String>(row, 6, "headers")?)?;
    let attempts: i64 = get(row, 9, "attempts")?;
    // A row with bytes is binary, whatever its `payload` holds.
    let binary = quarantine::binary(
        get(row, 11, "payload_bytes")?,
        get(row, 12, "content_type")?,
    )?;
    Ok(Message {
        id,
        seq,
        aggregate_type: get(row, 2, "aggregatetype")?,
        aggregate_id: get(row, 3, "aggregateid")?,
        event_type: get(row, 4, "type")?,
        payload: match binary {
            Some(_) => "null".to_owned(),
            None => get(row, 5, "payload")?,
        },
        binary,
        headers,
        partition_key: get(row, 7, "partition_key")?,
        dedup_key: get(row, 8, "dedup_key")?,
        attempts: u32::try_from(attempts.max(0)).unwrap_or(u32::MAX),
        created_at: to_time(get(row, 10, "created_at")?),
    })
}

/// The stored text form of an id or token.
pub(crate) fn id_text(id: Uuid) -> String {
    id.hyphenated().to_string()
}

/// A dead row read leniently (columns as [`crate::sql::MESSAGE_COLUMNS`]), for showing one that
/// does not decode.
pub(crate) struct Lenient<'a, 'r>(pub(crate) &'a Row<'r>);

impl LenientRow for Lenient<'_, '_> {
    fn text(&self, column: &str) -> Option<String> {
        let i = crate::sql::MESSAGE_COLUMNS
            .split(", ")
            .position(|c| c == column)?;
        outbox_sql_support::rusqlite::text(self.0, i)
    }

    fn bytes(&self) -> Option<Vec<u8>> {
        match self.0.get_ref(11).ok()? {
            ValueRef::Blob(b) => Some(b.to_vec()),
            ValueRef::Text(t) => Some(t.to_vec()),
            _ => None,
        }
    }

    fn attempts(&self) -> Option<u32> {
        self.0
            .get::<_, i64>(9)
            .ok()
            .and_then(|n| u32::try_from(n).ok())
    }

    fn created_at(&self) -> Option<DateTime<Utc>> {
        self.0.get::<_, i64>(10).ok().map(to_time)
    }
}
