//! The admin flows ([`OutboxAdmin`](outbox_traits::OutboxAdmin)) of the sqlx stores (Postgres,
//! MariaDB), written once over the store's dialect ([`SqlxAdmin`]): listing dead rows, the
//! requeue check, requeue and discard by id or by seq, and the counts. What stays in a backend
//! is its statements, how it binds a limit and a list, and how it reads a row; the purge, whose
//! steps differ between the databases, stays there too.

use outbox_traits::uuid::Uuid;
use outbox_traits::{Counts, DeadMessage, Error, Message};
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Type};

use crate::admin::{dead_message, LenientRow, RequeueCheck};
use crate::quarantine::Poison;

/// The statements of the admin flows, named for [`SqlxAdmin::statement`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminStatement {
    /// The dead rows after a seq (bound first, as `i64`), at most a limit of them (bound
    /// second, as [`SqlxAdmin::Count`]), in seq order.
    ListDead,
    /// The dead rows among a list of ids ([`SqlxAdmin::Ids`]) that the requeue must check.
    RequeueCheck,
    /// [`AdminStatement::RequeueCheck`] by a list of seqs ([`SqlxAdmin::Seqs`]).
    RequeueCheckSeqs,
    /// Requeue the dead rows among a list of ids.
    Requeue,
    /// Requeue the dead rows among a list of seqs.
    RequeueSeqs,
    /// Delete the dead rows among a list of ids.
    Discard,
    /// Delete the dead rows among a list of seqs.
    DiscardSeqs,
    /// One row with the `BIGINT` columns `pending`, `leased`, `published` and `dead`.
    Counts,
}

/// What the shared admin flows need of a sqlx store: its pool, table, statements and error
/// mapping, and how its dialect binds and reads values.
pub trait SqlxAdmin: Sync {
    /// The store's database.
    type DB: Database;
    /// A limit as the dialect binds it (`i64` on Postgres, `u64` on MariaDB).
    type Count: for<'q> Encode<'q, Self::DB> + Type<Self::DB> + Send + 'static;
    /// A list of ids as the dialect binds it (an array, or a JSON text).
    type Ids: for<'q> Encode<'q, Self::DB> + Type<Self::DB> + Send + Clone + 'static;
    /// A list of seqs as the dialect binds it (an array, or a JSON text).
    type Seqs: for<'q> Encode<'q, Self::DB> + Type<Self::DB> + Send + Clone + 'static;

    /// The connection pool.
    fn pool(&self) -> &Pool<Self::DB>;
    /// The table as named in errors and logs.
    fn table(&self) -> &str;
    /// The text of one of the admin statements.
    fn statement(&self, which: AdminStatement) -> &str;
    /// A statement to run right after the requeue or discard `which`, in the same transaction
    /// and bound to the same list, whose count is not the result (a table whose claim indexes
    /// live in a second table moves the rows' entries there). None by default: the statement
    /// runs alone.
    fn follow_up(&self, which: AdminStatement) -> Option<&str> {
        let _ = which;
        None
    }
    /// The contract's error for a sqlx error of operation `op`.
    fn map_err(&self, err: sqlx::Error, op: &str) -> Error;

    /// `n` as bound to a `LIMIT`.
    fn count(n: usize) -> Self::Count;
    /// `ids` as bound to the `..._check`, requeue and discard statements by id.
    fn ids(ids: &[Uuid]) -> Self::Ids;
    /// `seqs` as bound to the statements by seq.
    fn seqs(seqs: &[i64]) -> Self::Seqs;
    /// How many rows a statement changed.
    fn rows_affected(done: &<Self::DB as Database>::QueryResult) -> u64;

    /// A [`Message`] from a row holding the message columns, or the [`Poison`] saying which
    /// column does not decode; `Err` only when not even the row's `seq` reads.
    fn decode(&self, row: &<Self::DB as Database>::Row) -> Result<Result<Message, Poison>, Error>;
    /// The `last_error` column of a dead row.
    fn last_error(&self, row: &<Self::DB as Database>::Row) -> Result<String, Error>;
    /// The row's id as stored, when the store keeps ids as text (`None` for a UUID column): a
    /// requeue refuses one not in the lower case completions match.
    fn stored_id(row: &<Self::DB as Database>::Row) -> Option<String>;
    /// The row read leniently, for showing a dead row that does not decode.
    fn lenient(row: &<Self::DB as Database>::Row) -> impl LenientRow + '_;
}

/// The admin flows over a store `S`; each method is the [`OutboxAdmin`] method of its name
/// (see its rules there).
///
/// [`OutboxAdmin`]: outbox_traits::OutboxAdmin
#[derive(Debug)]
pub struct Admin<'s, S>(pub &'s S);

impl<S> Admin<'_, S>
where
    S: SqlxAdmin,
    for<'c> &'c mut <S::DB as Database>::Connection: Executor<'c, Database = S::DB>,
    for<'q> <S::DB as Database>::Arguments<'q>: IntoArguments<'q, S::DB>,
    i64: for<'q> Encode<'q, S::DB> + for<'r> Decode<'r, S::DB> + Type<S::DB>,
    for<'a> &'a str: ColumnIndex<<S::DB as Database>::Row>,
{
    /// Up to `limit` dead messages after `after_seq`, quarantined ones shown leniently.
    ///
    /// # Errors
    /// The database's, classified; a `last_error` or `seq` that does not read.
    pub async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: usize,
    ) -> Result<Vec<DeadMessage>, Error> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let store = self.0;
        let rows = sqlx::query(store.statement(AdminStatement::ListDead))
            .bind(after_seq.unwrap_or(i64::MIN))
            .bind(S::count(limit))
            .fetch_all(store.pool())
            .await
            .map_err(|e| store.map_err(e, "list_dead"))?;
        rows.iter()
            .map(|row| {
                let last_error = store.last_error(row)?;
                Ok(dead_message(
                    store.decode(row)?,
                    &S::lenient(row),
                    last_error,
                ))
            })
            .collect()
    }

    /// Requeue the dead rows among `ids`, refused before anything is written when one of them
    /// still does not decode.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] from the requeue check; the database's, classified.
    pub async fn requeue(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        self.check_requeue(AdminStatement::RequeueCheck, S::ids(ids))
            .await?;
        self.run(AdminStatement::Requeue, S::ids(ids), "requeue")
            .await
    }

    /// Delete the dead rows among `ids`.
    ///
    /// # Errors
    /// The database's, classified.
    pub async fn discard(&self, ids: &[Uuid]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        self.run(AdminStatement::Discard, S::ids(ids), "discard")
            .await
    }

    /// [`Admin::requeue`] by seq.
    ///
    /// # Errors
    /// As [`Admin::requeue`].
    pub async fn requeue_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        if seqs.is_empty() {
            return Ok(0);
        }
        self.check_requeue(AdminStatement::RequeueCheckSeqs, S::seqs(seqs))
            .await?;
        self.run(AdminStatement::RequeueSeqs, S::seqs(seqs), "requeue")
            .await
    }

    /// [`Admin::discard`] by seq.
    ///
    /// # Errors
    /// As [`Admin::discard`].
    pub async fn discard_seqs(&self, seqs: &[i64]) -> Result<u64, Error> {
        if seqs.is_empty() {
            return Ok(0);
        }
        self.run(AdminStatement::DiscardSeqs, S::seqs(seqs), "discard")
            .await
    }

    /// The rows by state.
    ///
    /// # Errors
    /// The database's, classified (also for a count that does not read).
    pub async fn counts(&self) -> Result<Counts, Error> {
        let store = self.0;
        let row = sqlx::query(store.statement(AdminStatement::Counts))
            .fetch_one(store.pool())
            .await
            .map_err(|e| store.map_err(e, "counts"))?;
        crate::row::counts(&row, |e| store.map_err(e, "counts"))
    }

    /// Refuse a requeue of dead rows that still cannot be relayed: the quarantined rows among
    /// those listed (`statement` bound to `list`) must decode now, with their id in the lower
    /// case completions match where ids are stored as text.
    async fn check_requeue<L>(&self, statement: AdminStatement, list: L) -> Result<(), Error>
    where
        L: for<'q> Encode<'q, S::DB> + Type<S::DB> + Send + 'static,
    {
        let store = self.0;
        let rows = sqlx::query(store.statement(statement))
            .bind(list)
            .fetch_all(store.pool())
            .await
            .map_err(|e| store.map_err(e, "requeue"))?;
        let mut check = RequeueCheck::default();
        for row in &rows {
            let decoded = store.decode(row)?;
            check.row(decoded, S::stored_id(row).as_deref());
        }
        check.finish(store.table())
    }

    /// Run `statement` bound to `list` (and its [`SqlxAdmin::follow_up`], in one transaction);
    /// how many rows it changed. `op` names it in errors.
    async fn run<L>(&self, statement: AdminStatement, list: L, op: &str) -> Result<u64, Error>
    where
        L: for<'q> Encode<'q, S::DB> + Type<S::DB> + Send + Clone + 'static,
    {
        let store = self.0;
        let err = |e| store.map_err(e, op);
        let Some(follow_up) = store.follow_up(statement) else {
            let done = sqlx::query(store.statement(statement))
                .bind(list)
                .execute(store.pool())
                .await
                .map_err(err)?;
            return Ok(S::rows_affected(&done));
        };
        let mut tx = store.pool().begin().await.map_err(err)?;
        let done = sqlx::query(store.statement(statement))
            .bind(list.clone())
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        sqlx::query(follow_up)
            .bind(list)
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        tx.commit().await.map_err(err)?;
        Ok(S::rows_affected(&done))
    }
}
