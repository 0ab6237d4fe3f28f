//! Rows that cannot become a [`Message`]: a store's claim meets them (a row
//! written by hand or by another tool with an id that is not a UUID, headers that are not a JSON
//! object of strings, a payload that is not text, ...). Such a row must not stop the other rows:
//! the store dead-letters it on its own, by `seq`, with a [`Poison::reason`] that names the
//! column and what is wrong with its value, and hands out the rest of the claim. Under
//! [`HeadPolicy::Block`] its key's later rows wait behind it like behind any dead head
//! ([`held_back`]).
//!
//! The helpers here are shared by the stores so that every backend words reasons the same way
//! and logs a quarantined row with the same line ([`Poison::log`]).

use std::collections::BTreeMap;
use std::fmt::Display;

use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::uuid::Uuid;

use outbox_traits::{validate_content_type, Binary, Error, HeadPolicy, Message};

/// How every quarantine [`reason`] begins: a dead row whose `last_error` starts with it was
/// dead-lettered because it did not decode, so a requeue checks it again
/// ([`requeue_refused`]). Stores may match it in SQL (`last_error LIKE 'undecodable row:%'`).
pub const REASON_PREFIX: &str = "undecodable row: ";

/// What a quarantine reason ends with; left out where the reason is quoted for a requeue.
const REASON_SUFFIX: &str = "; dead-lettered without publishing";

/// Longest quoted value in a reason; longer values are cut (at a character boundary) and marked.
const MAX_VALUE_CHARS: usize = 120;

/// A claimed row that does not decode: dead-lettered by `seq` instead of being handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poison {
    /// The row's `seq`.
    pub seq: i64,
    /// The row's partition key, when it could be read.
    pub partition_key: Option<String>,
    /// Why: the column and the value's problem, as stored in `last_error`.
    pub reason: String,
}

impl Poison {
    /// The one WARN line every store logs for a row it dead-lettered because it does not
    /// decode: `outbox row does not decode; dead-lettered`, with the table, the row's `seq`, its
    /// partition key (empty when unknown) and the reason.
    pub fn log(&self, table: &str) {
        tracing::warn!(
            table = %table,
            seq = self.seq,
            partition_key = self.partition_key.as_deref().unwrap_or(""),
            reason = %self.reason,
            "outbox row does not decode; dead-lettered"
        );
    }
}

/// The reason for a row whose `column` holds `value` (`None`: the value could not even be read
/// as text) with `problem`.
pub fn reason(column: &str, value: Option<&str>, problem: impl Display) -> String {
    let value = match value {
        Some(value) => {
            let mut shown: String = value.chars().take(MAX_VALUE_CHARS).collect();
            if shown.len() < value.len() {
                shown.push('…');
            }
            format!(" value {shown:?}")
        }
        None => String::new(),
    };
    format!("{REASON_PREFIX}column {column}{value}: {problem}{REASON_SUFFIX}")
}

/// The error of a requeue (by id or by seq) that meets dead rows of `table` that still cannot
/// be relayed: each is a [`Poison`] whose reason names the column and what is wrong with it.
/// [`Error::InvalidInput`], returned before anything is requeued; it says what to fix (or to
/// discard the row instead). A requeued row that does not decode would only be dead-lettered
/// again by the next claim.
pub fn requeue_refused(table: &str, refused: &[Poison]) -> Error {
    const SHOWN: usize = 5;
    let rows: Vec<String> = refused
        .iter()
        .take(SHOWN)
        .map(|p| {
            let what = p
                .reason
                .strip_prefix(REASON_PREFIX)
                .unwrap_or(&p.reason)
                .trim_end_matches(REASON_SUFFIX);
            let column = what
                .strip_prefix("column ")
                .and_then(|rest| rest.split([' ', ':']).next())
                .filter(|c| !c.is_empty())
                .unwrap_or("<column>");
            format!(
                "seq {seq}: {what}; fix it with UPDATE {table} SET {column} = ... WHERE seq = \
                 {seq}, then requeue it (or discard it)",
                seq = p.seq
            )
        })
        .collect();
    let more = match refused.len().saturating_sub(SHOWN) {
        0 => String::new(),
        n => format!("; and {n} more"),
    };
    Error::invalid_input(format!(
        "requeue refused, nothing requeued: {} dead message(s) of {table} still cannot be \
         relayed: {}{more}",
        refused.len(),
        rows.join("; ")
    ))
}

/// Stored headers as a map, or the reason they are refused (valid JSON that is not an object of
/// strings included).
pub fn headers(text: &str) -> Result<BTreeMap<String, String>, String> {
    serde_json::from_str(text).map_err(|e| {
        reason(
            "headers",
            Some(text),
            format!("not a JSON object of strings ({e})"),
        )
    })
}

/// The content type of a binary row that leaves `content_type` NULL.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

/// A row's binary payload from its `payload_bytes` and `content_type` columns, or the reason it
/// is refused. NULL bytes: a JSON message (`None`; its content type is not read). Bytes with a
/// NULL content type: [`DEFAULT_CONTENT_TYPE`]. Bytes with a content type that fails
/// [`validate_content_type`] (a SQL writer's line break, a missing `/`, ...): refused, naming the
/// `content_type` column, so the row is dead-lettered like any row that does not decode.
pub fn binary(
    bytes: Option<Vec<u8>>,
    content_type: Option<String>,
) -> Result<Option<Binary>, String> {
    let Some(data) = bytes else {
        return Ok(None);
    };
    let content_type = content_type.unwrap_or_else(|| DEFAULT_CONTENT_TYPE.to_owned());
    validate_content_type(&content_type)
        .map_err(|problem| reason("content_type", Some(&content_type), problem))?;
    Ok(Some(Binary { content_type, data }))
}

/// A stored id as a UUID, or the reason it is refused.
pub fn id(text: &str) -> Result<Uuid, String> {
    Uuid::parse_str(text).map_err(|e| reason("id", Some(text), format!("not a UUID ({e})")))
}

/// Whether a claimed message at `seq` with `key` must wait behind a poisoned row of the same
/// claim: under [`HeadPolicy::Block`], when an earlier poisoned row has the same key. (A
/// poisoned row whose key could not be read holds back nothing.)
pub fn held_back(poisoned: &[Poison], policy: HeadPolicy, seq: i64, key: Option<&str>) -> bool {
    let Some(key) = key else {
        return false;
    };
    policy == HeadPolicy::Block
        && poisoned
            .iter()
            .any(|p| p.seq < seq && p.partition_key.as_deref() == Some(key))
}

/// A dead row that does not decode, shown as well as it can be for operators: the message with
/// every column that reads as text (`text` returns a column's text, `None` when it has none),
/// the others empty, its binary payload when `bytes` (the `payload_bytes` column) has one (with
/// the stored `content_type` as it is, even one a claim refuses, or [`DEFAULT_CONTENT_TYPE`]),
/// and the stored id when it is not a UUID (the message's id is then nil).
pub fn lenient(
    seq: i64,
    text: impl Fn(&str) -> Option<String>,
    bytes: Option<Vec<u8>>,
    attempts: Option<u32>,
    created_at: Option<DateTime<Utc>>,
) -> (Message, Option<String>) {
    let raw_id = text("id").unwrap_or_default();
    let (id, raw_id) = match Uuid::parse_str(&raw_id) {
        Ok(id) => (id, None),
        Err(_) => (Uuid::nil(), Some(raw_id)),
    };
    let message = Message {
        id,
        seq,
        aggregate_type: text("aggregatetype").unwrap_or_default(),
        aggregate_id: text("aggregateid").unwrap_or_default(),
        event_type: text("type").unwrap_or_default(),
        payload: text("payload").unwrap_or_default(),
        binary: bytes.map(|data| Binary {
            content_type: text("content_type").unwrap_or_else(|| DEFAULT_CONTENT_TYPE.to_owned()),
            data,
        }),
        headers: text("headers")
            .and_then(|h| headers(&h).ok())
            .unwrap_or_default(),
        partition_key: text("partition_key"),
        dedup_key: text("dedup_key"),
        attempts: attempts.unwrap_or(0),
        created_at: created_at.unwrap_or(DateTime::UNIX_EPOCH),
    };
    (message, raw_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_name_the_column_and_the_problem() {
        let err = headers(r#"{"n":1}"#).unwrap_err();
        assert!(err.contains("column headers"), "{err}");
        assert!(err.contains(r#"{\"n\":1}"#), "{err}");
        assert!(err.contains("not a JSON object of strings"), "{err}");
        assert!(headers("[1]").is_err());
        assert_eq!(headers(r#"{"a":"b"}"#).unwrap()["a"], "b");
        let err = id("nope").unwrap_err();
        assert!(
            err.contains("column id value \"nope\": not a UUID"),
            "{err}"
        );
        let long = "x".repeat(1000);
        assert!(reason("payload", Some(&long), "bad").len() < 300);
    }

    #[test]
    fn a_refused_requeue_names_each_row_its_column_and_the_fix() {
        let poison = |seq, reason| Poison {
            seq,
            partition_key: None,
            reason,
        };
        let err = requeue_refused(
            "`outbox`",
            &[
                poison(7, headers(r#"{"n":1}"#).unwrap_err()),
                poison(9, "a reason of another form".into()),
            ],
        );
        assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("nothing requeued: 2 dead message(s)"),
            "{text}"
        );
        assert!(
            text.contains("seq 7: column headers value")
                && text.contains("not a JSON object of strings")
                && text.contains("UPDATE `outbox` SET headers = ... WHERE seq = 7"),
            "{text}"
        );
        assert!(text.contains("seq 9: a reason of another form"), "{text}");
        assert!(!text.contains("dead-lettered without publishing"), "{text}");
        let many: Vec<Poison> = (0..8).map(|s| poison(s, id("x").unwrap_err())).collect();
        assert!(requeue_refused("t", &many)
            .to_string()
            .ends_with("and 3 more"));
    }

    #[test]
    fn binary_rows_decode_or_name_the_content_type_column() {
        assert_eq!(binary(None, Some("text/plain".into())), Ok(None));
        let bytes = vec![0x00, 0xff, 0x80];
        assert_eq!(
            binary(Some(bytes.clone()), None),
            Ok(Some(Binary::new(DEFAULT_CONTENT_TYPE, bytes.clone())))
        );
        assert_eq!(
            binary(Some(bytes.clone()), Some("application/x-protobuf".into())),
            Ok(Some(Binary::new("application/x-protobuf", bytes.clone())))
        );
        let err = binary(Some(bytes), Some("text/plain\nX-Injected: 1".into())).unwrap_err();
        assert!(err.starts_with(REASON_PREFIX), "{err}");
        assert!(err.contains("column content_type value"), "{err}");
        assert!(
            err.contains("line break") || err.contains("character"),
            "{err}"
        );
    }

    #[test]
    fn only_block_holds_later_rows_of_the_key() {
        let p = [Poison {
            seq: 5,
            partition_key: Some("k".into()),
            reason: String::new(),
        }];
        assert!(held_back(&p, HeadPolicy::Block, 6, Some("k")));
        assert!(!held_back(&p, HeadPolicy::Block, 4, Some("k")));
        assert!(!held_back(&p, HeadPolicy::Block, 6, Some("j")));
        assert!(!held_back(&p, HeadPolicy::Block, 6, None));
        assert!(!held_back(&p, HeadPolicy::Skip, 6, Some("k")));
    }
}
