//! Enqueue inside the caller's transaction: one multi-row INSERT for a whole batch.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use chrono::NaiveDateTime;
use outbox_traits::{validate_batch, Error, NewMessage};
use sqlx::{Executor, MySql};

use crate::config::MysqlConfig;
use crate::error::{error_number, map_sqlx, DUPLICATE_ENTRY};
use crate::sql::{DEDUP_INDEX, ID_INDEX, MAX_INSERT_ROWS, MAX_KEY_CHARS};

/// Write one message to the outbox through `executor`: pass `&mut *tx` to write it in the same
/// transaction as your business rows, so both commit or neither does.
///
/// Same rules and errors as [`enqueue_batch`].
pub async fn enqueue<'c, E>(
    executor: E,
    config: &MysqlConfig,
    message: &NewMessage,
) -> Result<(), Error>
where
    E: Executor<'c, Database = MySql>,
{
    enqueue_batch(executor, config, std::slice::from_ref(message)).await
}

/// Write several messages to the outbox in one multi-row `INSERT` (one round trip), through
/// `executor` (usually `&mut *tx`, the caller's transaction).
///
/// The messages get increasing `seq` values in slice order, so messages of one partition key
/// are published in that order. An empty slice writes nothing and makes no round trip.
///
/// # Errors
/// Checked before anything is written:
/// - [`Error::InvalidInput`]: a message fails [`NewMessage::validate`] (empty event or aggregate
///   type, empty partition or dedup key, empty header name, payload over the configured limit);
///   its aggregate type, aggregate id, event type, partition key or dedup key is longer than
///   255 characters (the `VARCHAR(255)` columns); two messages of the batch share an id; or the
///   batch has more than 5,957 messages (MariaDB's 65,535 placeholders per statement): split it.
/// - [`Error::DuplicateKey`]: two messages of the batch share a dedup key.
///
/// From the database:
/// - [`Error::DuplicateKey`]: a message with the same dedup key is still in the table (purged
///   messages free their keys), or [`Error::InvalidInput`]: a message with the same id is.
///   MariaDB rolls back only the failed statement, so none of the batch is written and the
///   caller's transaction stays usable: commit it without the messages or roll it back.
/// - Other errors are classified (`Unavailable`, transient or permanent `Backend`); a missing
///   table says to run the migration. A batch larger than the server's `max_allowed_packet`
///   is refused by the server.
///
/// With [`MysqlConfigBuilder::lock_keys`](crate::MysqlConfigBuilder::lock_keys) on, the same
/// round trip first locks the batch's partition keys until the transaction ends, so writers of
/// one key commit in the order they inserted: the call waits while another open transaction
/// holds one of its keys.
pub async fn enqueue_batch<'c, E>(
    executor: E,
    config: &MysqlConfig,
    messages: &[NewMessage],
) -> Result<(), Error>
where
    E: Executor<'c, Database = MySql>,
{
    #[cfg(feature = "otel")]
    let messages = &*outbox_otel::capture(messages);
    if messages.is_empty() {
        return Ok(());
    }
    let rows = Rows::validate(config, messages)?;
    if let Some(text) = locked_insert(config, &rows) {
        // Without arguments: the text protocol, which runs both statements.
        executor
            .execute(text.as_str())
            .await
            .map_err(|err| map_insert_error(err, config, messages))?;
        return Ok(());
    }
    let sql = insert_statement(config, messages.len());
    let mut query = sqlx::query(&sql);
    for row in rows.0 {
        query = query
            .bind(row.id)
            .bind(row.aggregate_type)
            .bind(row.aggregate_id)
            .bind(row.event_type)
            .bind(row.payload)
            .bind(row.headers)
            .bind(row.partition_key)
            .bind(row.dedup_key)
            .bind(row.not_before)
            .bind(row.payload_bytes)
            .bind(row.content_type);
    }
    query
        .execute(executor)
        .await
        .map_err(|err| map_insert_error(err, config, messages))?;
    Ok(())
}

/// The multi-row insert of `rows` rows, the same text for both drivers (sqlx here, diesel-async
/// in `crate::diesel`); each row's placeholders take the fields of a [`Row`] in declaration
/// order.
pub(crate) fn insert_statement(config: &MysqlConfig, rows: usize) -> String {
    config.sql().insert(rows)
}

/// With key locks on ([`MysqlConfigBuilder::lock_keys`](crate::MysqlConfigBuilder::lock_keys))
/// and a key in the batch: the key-lock upsert and then the batch insert, as one text of two
/// statements, the same for both drivers (sent in one round trip). `None` otherwise.
///
/// Two statements cannot be one prepared statement, and the caller's executor can be used only
/// once, so this text carries its values as literals: every string as a hexadecimal literal
/// with a `utf8mb4` introducer (`_utf8mb4 X'..'`), which no value and no `sql_mode` can break
/// out of, and times as digits. The upsert locks the batch's distinct keys in sorted order
/// before any of its rows takes a `seq`.
pub(crate) fn locked_insert(config: &MysqlConfig, rows: &Rows<'_>) -> Option<String> {
    if !config.lock_keys() {
        return None;
    }
    let keys: BTreeSet<&str> = rows.0.iter().filter_map(|row| row.partition_key).collect();
    if keys.is_empty() {
        return None;
    }
    let mut text = format!(
        "INSERT INTO {} (partition_key) VALUES ",
        config.sql().key_locks
    );
    for (i, key) in keys.iter().enumerate() {
        text.push_str(if i == 0 { "(" } else { ", (" });
        push_string(&mut text, key);
        text.push(')');
    }
    text.push_str(" ON DUPLICATE KEY UPDATE partition_key = partition_key;\n");
    let insert = insert_statement(config, rows.0.len());
    let mut pieces = insert.split('?');
    let mut values = rows.0.iter().flat_map(|row| {
        [
            Some(Literal::Text(&row.id)),
            Some(Literal::Text(row.aggregate_type)),
            Some(Literal::Text(row.aggregate_id)),
            Some(Literal::Text(row.event_type)),
            Some(Literal::Text(&row.payload)),
            Some(Literal::Text(&row.headers)),
            row.partition_key.map(Literal::Text),
            row.dedup_key.map(Literal::Text),
            row.not_before.map(Literal::Time),
            row.payload_bytes.map(Literal::Bytes),
            row.content_type.map(Literal::Text),
        ]
    });
    // The placeholders are exactly the rows' values in order (see `insert_statement`).
    text.push_str(pieces.next().unwrap_or_default());
    for piece in pieces {
        match values.next().flatten() {
            Some(Literal::Text(value)) => push_string(&mut text, value),
            Some(Literal::Bytes(value)) => push_bytes(&mut text, value),
            Some(Literal::Time(at)) => {
                text.push_str(&at.format("'%Y-%m-%d %H:%M:%S%.6f'").to_string());
            }
            None => text.push_str("NULL"),
        }
        text.push_str(piece);
    }
    Some(text)
}

/// A value of [`locked_insert`]'s text.
enum Literal<'a> {
    Text(&'a str),
    Bytes(&'a [u8]),
    Time(NaiveDateTime),
}

/// `value` as a `utf8mb4` string literal written in hexadecimal.
fn push_string(text: &mut String, value: &str) {
    text.push_str("_utf8mb4 ");
    push_bytes(text, value.as_bytes());
}

/// `value` as a hexadecimal literal (`X'..'`): a binary string.
fn push_bytes(text: &mut String, value: &[u8]) {
    text.reserve(value.len() * 2 + 3);
    text.push_str("X'");
    for byte in value {
        let _ = write!(text, "{byte:02x}");
    }
    text.push('\'');
}

/// One message as the values of its row, in the order of its placeholders.
pub(crate) struct Row<'m> {
    pub(crate) id: String,
    pub(crate) aggregate_type: &'m str,
    pub(crate) aggregate_id: &'m str,
    pub(crate) event_type: &'m str,
    pub(crate) payload: String,
    pub(crate) headers: String,
    pub(crate) partition_key: Option<&'m str>,
    pub(crate) dedup_key: Option<&'m str>,
    pub(crate) not_before: Option<NaiveDateTime>,
    /// A binary message's bytes (NULL for a JSON message, whose `payload` holds it).
    pub(crate) payload_bytes: Option<&'m [u8]>,
    /// A binary message's content type.
    pub(crate) content_type: Option<&'m str>,
}

/// The batch, validated.
pub(crate) struct Rows<'m>(pub(crate) Vec<Row<'m>>);

impl<'m> Rows<'m> {
    /// Check the batch (everything that can be checked before writing) and lay it out.
    pub(crate) fn validate(
        config: &MysqlConfig,
        messages: &'m [NewMessage],
    ) -> Result<Self, Error> {
        if messages.len() > MAX_INSERT_ROWS {
            return Err(Error::invalid_input(format!(
                "a batch of {} messages is more than one INSERT can carry ({MAX_INSERT_ROWS}); \
                 split it into several enqueue_batch calls in the same transaction",
                messages.len()
            )));
        }
        let limits = config.limits();
        let mut rows = Vec::with_capacity(messages.len());
        for valid in validate_batch(messages, &limits)? {
            let msg = valid.message;
            check_lengths(msg)?;
            let (payload, headers) = (valid.payload, valid.headers);
            rows.push(Row {
                id: msg.id.hyphenated().to_string(),
                aggregate_type: &msg.aggregate_type,
                aggregate_id: &msg.aggregate_id,
                event_type: &msg.event_type,
                payload,
                headers,
                partition_key: msg.partition_key.as_deref(),
                dedup_key: msg.dedup_key.as_deref(),
                not_before: msg.not_before.map(|at| at.naive_utc()),
                payload_bytes: msg.binary.as_ref().map(|b| b.data.as_slice()),
                content_type: msg.binary.as_ref().map(|b| b.content_type.as_str()),
            });
        }
        Ok(Rows(rows))
    }
}

/// Refuse values longer than their `VARCHAR(255)` column here, before the server refuses the
/// statement.
fn check_lengths(msg: &NewMessage) -> Result<(), Error> {
    let fields = [
        ("aggregate type", Some(&msg.aggregate_type)),
        ("aggregate id", Some(&msg.aggregate_id)),
        ("event type", Some(&msg.event_type)),
        ("partition key", msg.partition_key.as_ref()),
        ("dedup key", msg.dedup_key.as_ref()),
    ];
    for (name, value) in fields {
        let chars = value.map_or(0, |v| v.chars().count());
        if chars > MAX_KEY_CHARS {
            return Err(Error::invalid_input(format!(
                "{name} of message {} is {chars} characters, over the limit of {MAX_KEY_CHARS}; \
                 use a shorter one (e.g. a hash of it)",
                msg.id
            )));
        }
    }
    Ok(())
}

/// A duplicate on the dedup index becomes [`Error::DuplicateKey`], one on the id index
/// [`Error::InvalidInput`]; the rest is classified as usual.
fn map_insert_error(err: sqlx::Error, config: &MysqlConfig, messages: &[NewMessage]) -> Error {
    if error_number(&err) == Some(DUPLICATE_ENTRY) {
        let text = err
            .as_database_error()
            .map(|db| db.message().to_owned())
            .unwrap_or_default();
        if let Some(mapped) = duplicate_entry(&text, messages) {
            return mapped;
        }
    }
    map_sqlx(err, "enqueue", config.qualified_table())
}

/// The error for the server's duplicate-entry message `text` (`ER_DUP_ENTRY`) when it names
/// one of the outbox table's own unique indexes: a reused id is [`Error::InvalidInput`], a dedup
/// key still in the table [`Error::DuplicateKey`]. Shared by both drivers, so they report the
/// same errors.
pub(crate) fn duplicate_entry(text: &str, messages: &[NewMessage]) -> Option<Error> {
    let (value, index) = parse_duplicate(text)?;
    // MySQL 8 names the index `table.index`, MariaDB just `index`.
    let index = index.rsplit('.').next().unwrap_or(index);
    if index == ID_INDEX {
        return Some(Error::invalid_input(format!(
            "message id {value} was already enqueued; give every message its own id \
             (NewMessage::new makes a fresh one)"
        )));
    }
    if index == DEDUP_INDEX {
        return Some(Error::DuplicateKey {
            key: batch_dedup_key(value, messages),
        });
    }
    None
}

/// `Duplicate entry 'abc' for key 'uq_dedup_key'` -> (`abc`, `uq_dedup_key`).
fn parse_duplicate(text: &str) -> Option<(&str, &str)> {
    let rest = text.strip_prefix("Duplicate entry '")?;
    let split = rest.rfind("' for key '")?;
    let value = &rest[..split];
    let index = rest[split + "' for key '".len()..].strip_suffix('\'')?;
    Some((value, index))
}

/// The batch's dedup key that the server reported. The server shortens a long value (ending it
/// with `...`), so match it against the batch's keys.
fn batch_dedup_key(reported: &str, messages: &[NewMessage]) -> String {
    let keys = || messages.iter().filter_map(|m| m.dedup_key.as_deref());
    let prefix = reported.strip_suffix("...").unwrap_or(reported);
    keys()
        .find(|k| *k == reported)
        .or_else(|| keys().find(|k| k.starts_with(prefix)))
        .unwrap_or(reported)
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn duplicate_messages_are_parsed() {
        assert_eq!(
            parse_duplicate("Duplicate entry 'a ' for key 'b' for key 'uq_dedup_key'"),
            Some(("a ' for key 'b", "uq_dedup_key"))
        );
        assert_eq!(
            parse_duplicate("Duplicate entry 'x' for key 'outbox.uq_id'"),
            Some(("x", "outbox.uq_id"))
        );
        assert_eq!(parse_duplicate("something else"), None);
        let long = "k".repeat(200);
        let messages = [NewMessage::new("a", "b", "c", json!({})).with_dedup_key(&long)];
        assert_eq!(batch_dedup_key(&long[..64], &messages), long);
        assert_eq!(
            batch_dedup_key(&format!("{}...", &long[..60]), &messages),
            long
        );
        assert_eq!(batch_dedup_key("other", &messages), "other");
    }

    #[test]
    fn batch_duplicates_and_long_keys_are_refused_before_writing() {
        let config = MysqlConfig::default();
        let a = NewMessage::new("order", "o-1", "order.placed", json!({}));
        assert!(matches!(
            Rows::validate(&config, &[a.clone(), a.clone()]),
            Err(Error::InvalidInput(_))
        ));
        let b = NewMessage::new("order", "o-1", "x", json!({})).with_dedup_key("d");
        let c = NewMessage::new("order", "o-1", "x", json!({})).with_dedup_key("d");
        assert!(matches!(
            Rows::validate(&config, &[b, c]),
            Err(Error::DuplicateKey { key }) if key == "d"
        ));

        // 255 characters fit (however many bytes), 256 do not.
        let fits = NewMessage::new("order", "é".repeat(255), "x", json!({}));
        assert!(Rows::validate(&config, &[fits]).is_ok());
        let long =
            NewMessage::new("order", "o-1", "x", json!({})).with_partition_key("k".repeat(256));
        assert!(matches!(
            Rows::validate(&config, &[long]),
            Err(Error::InvalidInput(message)) if message.contains("partition key")
        ));
    }
}
