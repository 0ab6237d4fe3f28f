//! The admin flows ([`OutboxAdmin`](outbox_traits::OutboxAdmin)) that differ between the SQL
//! stores only by dialect and driver: showing a dead row (also one that does not decode), the
//! check that refuses to requeue rows that would only be dead-lettered again, and the age of a
//! purge. Each backend runs its own statements and hands the rows here.

use std::time::Duration;

use outbox_traits::chrono::{DateTime, Utc};
use outbox_traits::{DeadMessage, Error, Message};

use crate::quarantine::{self, Poison};

/// What a dead row shows when it does not decode, read leniently from the backend's row.
pub trait LenientRow {
    /// A column's text, `None` when it has none or cannot be read as text.
    fn text(&self, column: &str) -> Option<String>;
    /// The `payload_bytes` column (a binary payload), `None` when NULL or unreadable.
    fn bytes(&self) -> Option<Vec<u8>>;
    /// The attempt counter, when it reads.
    fn attempts(&self) -> Option<u32>;
    /// When the message was enqueued, when it reads.
    fn created_at(&self) -> Option<DateTime<Utc>>;
}

/// A dead row as [`OutboxAdmin::list_dead`](outbox_traits::OutboxAdmin::list_dead) shows it:
/// the decoded message, or for a quarantined row everything that reads as text from `row`
/// ([`quarantine::lenient`]), with its stored `last_error`.
pub fn dead_message(
    decoded: Result<Message, Poison>,
    row: &impl LenientRow,
    last_error: String,
) -> DeadMessage {
    let (message, raw_id) = match decoded {
        Ok(message) => (message, None),
        Err(poison) => quarantine::lenient(
            poison.seq,
            |column| row.text(column),
            row.bytes(),
            row.attempts(),
            row.created_at(),
        ),
    };
    DeadMessage {
        message,
        last_error,
        raw_id,
    }
}

/// The check before a requeue (by id or by seq): every dead row it would requeue must decode
/// now, and, in a store that keeps ids as text, hold its id in the lower case completions
/// match. Feed it each row the backend's `requeue_check` statement returns, then
/// [`RequeueCheck::finish`] before anything is written.
#[derive(Debug, Default)]
pub struct RequeueCheck {
    refused: Vec<Poison>,
}

impl RequeueCheck {
    /// Look at one listed dead row: decoded (or why not), and its id as stored when the store
    /// keeps ids as text (`None` for a UUID column).
    pub fn row(&mut self, decoded: Result<Message, Poison>, stored_id: Option<&str>) {
        match decoded {
            Err(poison) => self.refused.push(poison),
            Ok(message) => {
                let Some(stored) = stored_id else { return };
                if stored != message.id.to_string() {
                    self.refused.push(Poison {
                        seq: message.seq,
                        partition_key: message.partition_key,
                        reason: quarantine::reason(
                            "id",
                            Some(stored),
                            "not in the lower case the relay completes by (another message \
                             holds it in lower case); give the row an id of its own",
                        ),
                    });
                }
            }
        }
    }

    /// `Ok` when every row may be requeued, else [`quarantine::requeue_refused`] for `table`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming each refused row and how to fix it.
    pub fn finish(self, table: &str) -> Result<(), Error> {
        if self.refused.is_empty() {
            Ok(())
        } else {
            Err(quarantine::requeue_refused(table, &self.refused))
        }
    }
}

/// The age of a purge in the store's unit (`unit` is [`crate::limits::micros`] or
/// [`crate::limits::millis`]), or `None` when it is longer than the contract's longest
/// duration: nothing was published that long ago, so the purge deletes nothing.
pub fn purge_age(
    older_than: Duration,
    unit: impl FnOnce(&str, Duration) -> Result<i64, Error>,
) -> Option<i64> {
    unit("purge age", older_than).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::{micros, MAX_DURATION};
    use outbox_traits::uuid::Uuid;

    struct Row;

    impl LenientRow for Row {
        fn text(&self, column: &str) -> Option<String> {
            match column {
                "id" => Some("not-a-uuid".to_owned()),
                "content_type" => Some("bad\ntype".to_owned()),
                _ => None,
            }
        }
        fn bytes(&self) -> Option<Vec<u8>> {
            Some(vec![0, 0xff])
        }
        fn attempts(&self) -> Option<u32> {
            Some(3)
        }
        fn created_at(&self) -> Option<DateTime<Utc>> {
            None
        }
    }

    fn message(id: Uuid) -> Message {
        let (mut m, _) = quarantine::lenient(1, |_| None, None, None, None);
        m.id = id;
        m
    }

    #[test]
    fn a_quarantined_row_shows_what_reads() {
        let poison = Poison {
            seq: 4,
            partition_key: None,
            reason: quarantine::id("not-a-uuid").unwrap_err(),
        };
        let dead = dead_message(Err(poison), &Row, "why".into());
        assert_eq!(dead.raw_id.as_deref(), Some("not-a-uuid"));
        assert_eq!(dead.message.seq, 4);
        assert_eq!(dead.message.attempts, 3);
        assert_eq!(dead.last_error, "why");
        // The bytes are shown, with the content type as stored.
        let binary = dead.message.binary.as_ref();
        assert_eq!(binary.map(|b| b.data.as_slice()), Some(&[0, 0xff][..]));
        assert_eq!(binary.map(|b| b.content_type.as_str()), Some("bad\ntype"));
        let ok = dead_message(Ok(message(Uuid::nil())), &Row, String::new());
        assert_eq!(ok.raw_id, None);
    }

    #[test]
    fn requeue_checks_refuse_poison_and_upper_case_ids() {
        let id = Uuid::now_v7();
        let mut check = RequeueCheck::default();
        check.row(Ok(message(id)), Some(&id.to_string()));
        check.row(Ok(message(id)), None);
        assert!(check.finish("t").is_ok());
        let mut check = RequeueCheck::default();
        check.row(Ok(message(id)), Some(&id.to_string().to_uppercase()));
        let err = check.finish("t").unwrap_err().to_string();
        assert!(err.contains("lower case"), "{err}");
    }

    #[test]
    fn a_purge_older_than_the_longest_duration_deletes_nothing() {
        assert_eq!(purge_age(Duration::from_secs(1), micros), Some(1_000_000));
        assert_eq!(
            purge_age(MAX_DURATION + Duration::from_secs(1), micros),
            None
        );
    }
}
