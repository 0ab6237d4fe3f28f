//! What every inbox shares: the table settings, the answer of a record, input checks.

use std::collections::HashSet;
use std::time::Duration;

use outbox_sql_support::validate_sql_identifier;
use outbox_traits::Error;
use uuid::Uuid;

/// The default inbox table: `outbox_inbox`.
pub const DEFAULT_TABLE: &str = "outbox_inbox";

/// The longest consumer name, in characters (the `consumer` column is `VARCHAR(200)`).
pub const MAX_CONSUMER_CHARS: usize = 200;

/// The most message ids one batch call records, and the largest purge batch: beyond it the
/// statement's parameters would pass what MariaDB and SQLite accept in one statement.
pub const MAX_BATCH: usize = 10_000;

/// What a `record` call found: whether this consumer sees the message for the first time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Receipt {
    /// The id was not in the inbox: it is now marked in the caller's transaction. Apply the
    /// message's effect in the same transaction, then commit; a rollback removes the mark too.
    New,
    /// The id was already marked by a committed transaction of this consumer (or earlier in the
    /// same batch): the effect was applied; skip it and acknowledge the message.
    Duplicate,
}

impl Receipt {
    /// `true` for [`Receipt::New`].
    pub fn is_new(self) -> bool {
        self == Receipt::New
    }
}

/// What a `process` convenience did with one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The message was new: the handler ran and its transaction, with the mark, committed.
    Handled(T),
    /// The message was already processed: the handler did not run and nothing was written.
    Duplicate,
}

impl<T> Outcome<T> {
    /// `true` for [`Outcome::Handled`].
    pub fn is_handled(&self) -> bool {
        matches!(self, Outcome::Handled(_))
    }
}

/// Where an inbox lives: its table and, optionally, the schema (Postgres), database
/// (MariaDB/MySQL) or attached database (SQLite) that holds it. Built with
/// [`InboxConfig::builder`] (or [`Default`]: table [`DEFAULT_TABLE`]) and read with getters of
/// the same names.
///
/// Both names are checked with [`validate_sql_identifier`] by [`InboxConfigBuilder::build`], so
/// they are safe to quote into statements.
///
/// ```
/// use outbox_inbox::InboxConfig;
/// let config = InboxConfig::builder().table("payments_inbox").schema("billing").build()?;
/// assert_eq!(config.table(), "payments_inbox");
/// assert_eq!(config.schema(), Some("billing"));
/// assert!(InboxConfig::builder().table("bad name").build().is_err());
/// # Ok::<(), outbox_inbox::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxConfig {
    schema: Option<String>,
    table: String,
}

impl Default for InboxConfig {
    /// Table [`DEFAULT_TABLE`], in the connection's default schema or database.
    fn default() -> Self {
        Self {
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
        }
    }
}

/// Builder of [`InboxConfig`] ([`InboxConfig::builder`]); [`InboxConfigBuilder::build`] checks
/// both names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxConfigBuilder {
    schema: Option<String>,
    table: String,
}

impl InboxConfigBuilder {
    /// The inbox table's name (a plain SQL identifier). Default: [`DEFAULT_TABLE`].
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Put the table in `schema` (Postgres schema, MariaDB/MySQL database, SQLite attached
    /// database; a plain SQL identifier); the Postgres and MariaDB migrations create it when
    /// missing. Default: none, the connection's default schema or database.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// Check both names.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the table or schema name is not a plain SQL identifier.
    pub fn build(self) -> Result<InboxConfig, Error> {
        validate_sql_identifier("inbox table name", &self.table)?;
        if let Some(schema) = &self.schema {
            validate_sql_identifier("inbox schema name", schema)?;
        }
        Ok(InboxConfig {
            schema: self.schema,
            table: self.table,
        })
    }
}

impl InboxConfig {
    /// A builder starting from table [`DEFAULT_TABLE`] in the connection's default schema or
    /// database.
    pub fn builder() -> InboxConfigBuilder {
        let Self { schema, table } = Self::default();
        InboxConfigBuilder { schema, table }
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The schema (or database) name, if one was set.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The table's name quoted with `quote` (`"` for Postgres and SQLite, `` ` `` for
    /// MariaDB), schema-qualified when set: safe to put in statements of your own (e.g. a
    /// report on the marks), as both names are plain identifiers.
    pub fn qualified(&self, quote: char) -> String {
        match &self.schema {
            Some(schema) => format!("{quote}{schema}{quote}.{quote}{}{quote}", self.table),
            None => format!("{quote}{}{quote}", self.table),
        }
    }

    /// The name of an index or constraint of the table: `<table>_<suffix>`, quoted.
    #[allow(dead_code)] // not every feature set uses it
    pub(crate) fn derived(&self, suffix: &str, quote: char) -> String {
        format!("{quote}{}_{suffix}{quote}", self.table)
    }
}

/// Check a consumer name as every inbox call does, without touching a database: not empty,
/// at most [`MAX_CONSUMER_CHARS`] characters, no NUL.
///
/// # Errors
/// [`Error::InvalidInput`] saying what is wrong.
pub fn validate_consumer(consumer: &str) -> Result<(), Error> {
    check_consumer(consumer)
}

/// Check a consumer name: not empty, at most [`MAX_CONSUMER_CHARS`] characters, no NUL.
pub(crate) fn check_consumer(consumer: &str) -> Result<(), Error> {
    if consumer.is_empty() {
        return Err(Error::invalid_input(
            "the consumer name is empty; name each consumer (e.g. \"payments\") so its marks are \
             kept apart from other consumers'",
        ));
    }
    let chars = consumer.chars().count();
    if chars > MAX_CONSUMER_CHARS {
        return Err(Error::invalid_input(format!(
            "the consumer name has {chars} characters, more than the inbox's \
             {MAX_CONSUMER_CHARS}; use a shorter name"
        )));
    }
    if consumer.contains('\0') {
        return Err(Error::invalid_input(
            "the consumer name contains a NUL character, which the databases cannot store; \
             remove it",
        ));
    }
    Ok(())
}

/// The receipt of a single insert that changed `rows` rows: one is new, none a duplicate.
#[allow(dead_code)] // not every feature set uses it
pub(crate) fn receipt(rows: u64) -> Receipt {
    if rows == 1 {
        Receipt::New
    } else {
        Receipt::Duplicate
    }
}

/// The start of every `record_batch`: [`check_batch`], then the batch's [`distinct`] ids, or
/// `None` for an empty batch (nothing to run, no round trip).
#[allow(dead_code)] // not every feature set uses it
pub(crate) fn batch(consumer: &str, ids: &[Uuid]) -> Result<Option<Vec<Uuid>>, Error> {
    check_batch(consumer, ids)?;
    Ok((!ids.is_empty()).then(|| distinct(ids)))
}

/// The ids a batch insert of `table` read back (`RETURNING message_id`), each as parsed from
/// its column.
///
/// # Errors
/// Permanent, for an id that is not a UUID.
#[allow(dead_code)] // not every feature set uses it
pub(crate) fn inserted(
    table: &str,
    parsed: impl IntoIterator<Item = Result<Uuid, uuid::Error>>,
) -> Result<HashSet<Uuid>, Error> {
    parsed
        .into_iter()
        .map(|id| {
            id.map_err(|e| {
                Error::permanent(
                    format!("inbox record on {table} read back an id that is not a UUID: {e}"),
                    None,
                )
            })
        })
        .collect()
}

/// Check a batch: a valid consumer name and at most [`MAX_BATCH`] ids.
#[allow(dead_code)] // not every feature set uses it
pub(crate) fn check_batch(consumer: &str, ids: &[Uuid]) -> Result<(), Error> {
    check_consumer(consumer)?;
    if ids.len() > MAX_BATCH {
        return Err(Error::invalid_input(format!(
            "a batch of {} message ids is more than the {MAX_BATCH} one call records; \
             split it",
            ids.len()
        )));
    }
    Ok(())
}

/// The distinct ids of a batch, in first-seen order (one row per id in the statement).
#[allow(dead_code)] // not every feature set uses it
pub(crate) fn distinct(ids: &[Uuid]) -> Vec<Uuid> {
    let mut seen = HashSet::with_capacity(ids.len());
    ids.iter().copied().filter(|id| seen.insert(*id)).collect()
}

/// One [`Receipt`] per requested id, in request order, from the ids the statement inserted: an
/// inserted id is [`Receipt::New`] at its first occurrence, every other occurrence
/// [`Receipt::Duplicate`].
#[allow(dead_code)] // not every feature set uses it
pub(crate) fn receipts(ids: &[Uuid], inserted: &HashSet<Uuid>) -> Vec<Receipt> {
    let mut seen = HashSet::with_capacity(ids.len());
    ids.iter()
        .map(|id| {
            if seen.insert(*id) && inserted.contains(id) {
                Receipt::New
            } else {
                Receipt::Duplicate
            }
        })
        .collect()
}

/// Check purge arguments and give the age in whole microseconds.
#[allow(dead_code)] // not every feature set uses it
pub(crate) fn check_purge(older_than: Duration, batch: u32) -> Result<i64, Error> {
    if batch == 0 || batch as usize > MAX_BATCH {
        return Err(Error::invalid_input(format!(
            "purge batch {batch} is out of range; give 1 to {MAX_BATCH} marks per call and call \
             again while it returns a full batch"
        )));
    }
    const MAX_AGE: Duration = Duration::from_secs(100 * 366 * 86_400);
    if older_than > MAX_AGE {
        return Err(Error::invalid_input(format!(
            "purge age {older_than:?} is more than 100 years; give how long marks are kept \
             (longer than any redelivery can come, e.g. 7 days)"
        )));
    }
    i64::try_from(older_than.as_micros())
        .map_err(|_| Error::invalid_input("purge age does not fit in microseconds"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(InboxConfig::builder().table("inbox").build().is_ok());
        assert!(InboxConfig::builder().table("x\"; DROP").build().is_err());
        assert!(InboxConfig::builder().schema("a b").build().is_err());
        assert_eq!(
            InboxConfig::builder().build().ok(),
            Some(InboxConfig::default())
        );
        assert_eq!(
            InboxConfig::builder()
                .table("t")
                .schema("s")
                .build()
                .map(|c| c.qualified('"'))
                .ok()
                .as_deref(),
            Some("\"s\".\"t\"")
        );
        assert!(check_consumer("").is_err());
        assert!(check_consumer(&"x".repeat(201)).is_err());
        assert!(check_consumer(&"é".repeat(200)).is_ok());
        assert!(check_consumer("a\0").is_err());
        assert!(check_batch("c", &vec![Uuid::nil(); MAX_BATCH + 1]).is_err());
    }

    #[test]
    fn batch_receipts_mark_the_first_inserted_occurrence_only() {
        let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let inserted = HashSet::from([a, c]);
        assert_eq!(
            receipts(&[a, b, a, c], &inserted),
            [
                Receipt::New,
                Receipt::Duplicate,
                Receipt::Duplicate,
                Receipt::New
            ]
        );
        assert_eq!(distinct(&[a, b, a]), [a, b]);
    }

    #[test]
    fn purge_arguments_are_checked() {
        assert!(check_purge(Duration::from_secs(1), 0).is_err());
        assert!(check_purge(Duration::from_secs(1), 10_001).is_err());
        assert_eq!(
            check_purge(Duration::from_secs(1), 10).ok(),
            Some(1_000_000)
        );
        assert!(check_purge(Duration::from_secs(200 * 366 * 86_400), 10).is_err());
    }
}
