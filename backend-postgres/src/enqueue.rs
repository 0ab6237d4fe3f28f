//! Enqueue inside the caller's transaction: one INSERT for a whole batch.

use chrono::{DateTime, Utc};
use outbox_traits::{validate_batch, Error, NewMessage};
use sqlx::postgres::PgDatabaseError;
use sqlx::{Executor, Postgres};
use uuid::Uuid;

use crate::config::PostgresConfig;
use crate::error::map_sqlx;

/// Write one message to the outbox through `executor`: pass `&mut *tx` to write it in the same
/// transaction as your business rows, so both commit or neither does.
///
/// Same rules and errors as [`enqueue_batch`].
pub async fn enqueue<'c, E>(
    executor: E,
    config: &PostgresConfig,
    message: &NewMessage,
) -> Result<(), Error>
where
    E: Executor<'c, Database = Postgres>,
{
    enqueue_batch(executor, config, std::slice::from_ref(message)).await
}

/// Write several messages to the outbox in one statement (one round trip), through `executor`
/// (usually `&mut *tx`, the caller's transaction).
///
/// The messages get increasing `seq` values in slice order, so messages of one partition key
/// are published in that order. An empty slice writes nothing and makes no round trip.
///
/// # Errors
/// Checked before anything is written:
/// - [`Error::InvalidInput`]: a message fails [`NewMessage::validate`] (empty event or aggregate
///   type, empty partition or dedup key, empty header name, payload over the configured limit),
///   contains a NUL character (Postgres text and `jsonb` cannot store it), or two messages of the
///   batch share an id.
/// - [`Error::DuplicateKey`]: two messages of the batch share a dedup key.
///
/// From the database:
/// - [`Error::DuplicateKey`]: a message with the same dedup key is still in the table (purged
///   messages free their keys), or [`Error::InvalidInput`]: a message with the same id is. The
///   statement failed, so Postgres aborts the caller's transaction: roll it back (or enqueue
///   inside a savepoint, `tx.begin()`, to carry on without the message).
/// - Other errors are classified (`Unavailable`, transient or permanent `Backend`); a missing
///   table says to run the migration.
///
/// The call sends no `pg_notify` itself: the table's insert trigger (created by the migration
/// when NOTIFY is on) wakes listening relays when the transaction commits, as it does for any
/// writer's INSERT.
///
/// With [`PostgresConfigBuilder::lock_keys`](crate::PostgresConfigBuilder::lock_keys) on, the
/// same statement first locks the batch's partition keys until the transaction ends, so
/// writers of one key commit in the order they inserted: the call waits while another open
/// transaction holds one of its keys.
pub async fn enqueue_batch<'c, E>(
    executor: E,
    config: &PostgresConfig,
    messages: &[NewMessage],
) -> Result<(), Error>
where
    E: Executor<'c, Database = Postgres>,
{
    #[cfg(feature = "otel")]
    let messages = &*outbox_otel::capture(messages);
    if messages.is_empty() {
        return Ok(());
    }
    let columns = Columns::validate(config, messages)?;
    sqlx::query(insert_statement(config))
        .bind(columns.ids)
        .bind(columns.aggregate_types)
        .bind(columns.aggregate_ids)
        .bind(columns.event_types)
        .bind(columns.payloads)
        .bind(columns.headers)
        .bind(columns.partition_keys)
        .bind(columns.dedup_keys)
        .bind(columns.not_before)
        .bind(columns.payload_bytes)
        .bind(columns.content_types)
        .execute(executor)
        .await
        .map_err(|err| map_insert_error(err, config, messages))?;
    Ok(())
}

/// The batch insert, the same text for both drivers (sqlx here, diesel-async in
/// `crate::diesel`): `INSERT ... SELECT FROM UNNEST($1..$11)` in slice order, which first locks
/// the batch's keys when key locks are on; no `pg_notify` (the table's trigger sends it). Built
/// once per config.
pub(crate) fn insert_statement(config: &PostgresConfig) -> &str {
    &config.sql().insert
}

/// The batch as one array per column, for `UNNEST`: the parameters `$1`..`$11` of
/// [`insert_statement`]. A JSON message has NULL bytes and content type; a binary one has the
/// JSON `null` as its payload.
pub(crate) struct Columns {
    pub(crate) ids: Vec<Uuid>,
    pub(crate) aggregate_types: Vec<String>,
    pub(crate) aggregate_ids: Vec<String>,
    pub(crate) event_types: Vec<String>,
    pub(crate) payloads: Vec<String>,
    pub(crate) headers: Vec<String>,
    pub(crate) partition_keys: Vec<Option<String>>,
    pub(crate) dedup_keys: Vec<Option<String>>,
    pub(crate) not_before: Vec<Option<DateTime<Utc>>>,
    pub(crate) payload_bytes: Vec<Option<Vec<u8>>>,
    pub(crate) content_types: Vec<Option<String>>,
}

impl Columns {
    /// Check the batch (everything that can be checked before writing) and lay it out.
    pub(crate) fn validate(
        config: &PostgresConfig,
        messages: &[NewMessage],
    ) -> Result<Self, Error> {
        let limits = config.limits();
        let n = messages.len();
        let mut columns = Columns {
            ids: Vec::with_capacity(n),
            aggregate_types: Vec::with_capacity(n),
            aggregate_ids: Vec::with_capacity(n),
            event_types: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
            partition_keys: Vec::with_capacity(n),
            dedup_keys: Vec::with_capacity(n),
            not_before: Vec::with_capacity(n),
            payload_bytes: Vec::with_capacity(n),
            content_types: Vec::with_capacity(n),
        };
        for valid in validate_batch(messages, &limits)? {
            let msg = valid.message;
            check_no_nul(msg)?;
            let (payload, headers) = (valid.payload, valid.headers);
            columns.ids.push(msg.id);
            columns.aggregate_types.push(msg.aggregate_type.clone());
            columns.aggregate_ids.push(msg.aggregate_id.clone());
            columns.event_types.push(msg.event_type.clone());
            columns.payloads.push(payload);
            columns.headers.push(headers);
            columns.partition_keys.push(msg.partition_key.clone());
            columns.dedup_keys.push(msg.dedup_key.clone());
            columns.not_before.push(msg.not_before);
            let binary = msg.binary.as_ref();
            columns.payload_bytes.push(binary.map(|b| b.data.clone()));
            columns
                .content_types
                .push(binary.map(|b| b.content_type.clone()));
        }
        Ok(columns)
    }
}

/// Postgres refuses NUL in `text` and `\u0000` in `jsonb`; refuse it here, before the statement
/// fails and aborts the caller's transaction.
fn check_no_nul(msg: &NewMessage) -> Result<(), Error> {
    let fields = [
        ("aggregate type", Some(&msg.aggregate_type)),
        ("aggregate id", Some(&msg.aggregate_id)),
        ("event type", Some(&msg.event_type)),
        ("partition key", msg.partition_key.as_ref()),
        ("dedup key", msg.dedup_key.as_ref()),
    ];
    let header_has_nul = msg
        .headers
        .iter()
        .any(|(k, v)| k.contains('\0') || v.contains('\0'));
    let bad = fields
        .iter()
        .find(|(_, value)| value.is_some_and(|v| v.contains('\0')))
        .map(|(name, _)| *name)
        .or(header_has_nul.then_some("headers"))
        .or(json_has_nul(&msg.payload).then_some("payload"));
    match bad {
        Some(field) => Err(Error::invalid_input(format!(
            "{field} of message {} contains a NUL character, which Postgres cannot store; \
             remove it or encode the value",
            msg.id
        ))),
        None => Ok(()),
    }
}

fn json_has_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(json_has_nul),
        serde_json::Value::Object(map) => {
            map.iter().any(|(k, v)| k.contains('\0') || json_has_nul(v))
        }
        _ => false,
    }
}

/// A unique violation on the dedup constraint becomes [`Error::DuplicateKey`]; the rest is
/// classified as usual.
fn map_insert_error(err: sqlx::Error, config: &PostgresConfig, messages: &[NewMessage]) -> Error {
    if let Some(db) = err.as_database_error() {
        if db.code().as_deref() == Some("23505") {
            let detail = db
                .try_downcast_ref::<PgDatabaseError>()
                .and_then(|pg| pg.detail());
            if let Some(mapped) = unique_violation(config, messages, db.constraint(), detail) {
                return mapped;
            }
        }
    }
    map_sqlx(err, "enqueue", config.qualified_table())
}

/// The error for a unique violation (SQLSTATE 23505) of `constraint`, whose `detail` names the
/// key, when the constraint is the outbox table's own: a reused message id is
/// [`Error::InvalidInput`], a dedup key still in the table [`Error::DuplicateKey`]. Shared by
/// both drivers, so they report the same errors.
pub(crate) fn unique_violation(
    config: &PostgresConfig,
    messages: &[NewMessage],
    constraint: Option<&str>,
    detail: Option<&str>,
) -> Option<Error> {
    let detail = detail.and_then(key_from_detail);
    if constraint == Some(config.sql().pkey_constraint.as_str()) {
        let id = detail.unwrap_or_default();
        return Some(Error::invalid_input(format!(
            "message id {id} was already enqueued; give every message its own id \
             (NewMessage::new makes a fresh one)"
        )));
    }
    if constraint == Some(config.sql().dedup_constraint.as_str()) {
        let key = detail
            .or_else(|| {
                // Only one dedup key in the batch: it must be the one.
                let mut keys = messages.iter().filter_map(|m| m.dedup_key.as_ref());
                match (keys.next(), keys.next()) {
                    (Some(only), None) => Some(only.clone()),
                    _ => None,
                }
            })
            .unwrap_or_default();
        return Some(Error::DuplicateKey { key });
    }
    None
}

/// `Key (dedup_key)=(abc) already exists.` -> `abc`.
fn key_from_detail(detail: &str) -> Option<String> {
    let start = detail.find(")=(")? + 3;
    let end = detail.rfind(") already exists")?;
    (start <= end).then(|| detail[start..end].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detail_parsing() {
        assert_eq!(
            key_from_detail("Key (dedup_key)=(a (b) c) already exists.").as_deref(),
            Some("a (b) c")
        );
        assert_eq!(key_from_detail("something else"), None);
    }

    #[test]
    fn nul_characters_are_refused_anywhere() {
        let ok = NewMessage::new(
            "order",
            "o-1",
            "order.placed",
            json!({"a": ["b", {"c": 1}]}),
        );
        assert!(check_no_nul(&ok).is_ok());
        let cases = [
            ok.clone().with_header("h", "a\0b"),
            ok.clone().with_partition_key("k\0"),
            NewMessage::new("order", "o-1", "order.placed", json!({"a": ["x\u{0}"]})),
            NewMessage::new("order", "o-1", "order.placed", json!({"k\u{0}": 1})),
            NewMessage::new("order", "o\0", "order.placed", json!(1)),
        ];
        for case in cases {
            let err = check_no_nul(&case).unwrap_err();
            assert!(err.to_string().contains("NUL"), "{err}");
        }
    }

    #[test]
    fn batch_duplicates_are_refused_before_writing() {
        let config = PostgresConfig::default();
        let a = NewMessage::new("order", "o-1", "order.placed", json!({}));
        let err = Columns::validate(&config, &[a.clone(), a.clone()])
            .err()
            .unwrap();
        assert!(matches!(err, Error::InvalidInput(_)));
        let b = NewMessage::new("order", "o-1", "x", json!({})).with_dedup_key("d");
        let c = NewMessage::new("order", "o-1", "x", json!({})).with_dedup_key("d");
        let err = Columns::validate(&config, &[b, c]).err().unwrap();
        assert!(matches!(err, Error::DuplicateKey { key } if key == "d"));
    }
}
