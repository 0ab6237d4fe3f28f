//! Every SQL statement of the store, built once per config from validated, quoted names.
//!
//! MariaDB has no `UPDATE ... RETURNING`, so a claim is one short transaction of constant
//! shape (see `claim.rs`): find candidates with a plain read, lock them by primary key with
//! `FOR UPDATE SKIP LOCKED`, check per-key order in one query, lease the chosen rows in one
//! `UPDATE`, commit. Fenced transitions lock the
//! rows still held (`SELECT ... FOR UPDATE SKIP LOCKED`, then a bounded wait only for rows
//! still held that someone else had locked) and update them, in one transaction.
//!
//! Lists of ids, sequence numbers or failures travel as one JSON parameter read with
//! `JSON_TABLE`, so every statement has a fixed text: sqlx prepares it once per connection
//! instead of once per list length. Each such join is a `STRAIGHT_JOIN` that reads the list
//! first and probes the table by primary or unique key (forced: on a small table the optimizer
//! would rather scan it, and a locking scan waits for every row another transaction is
//! inserting), in list order (the callers sort ids, so concurrent calls lock shared rows in the
//! same order). Index hints name the index of every scan for the same reason.
//!
//! Every time decision uses the database clock, `UTC_TIMESTAMP(6)` (the session time zone
//! plays no part; columns are `DATETIME(6)`, stored and compared as UTC). Durations travel as
//! microseconds.
//!
//! A lease is not a state: a leased row stays `pending` with `lease_token` and `lease_until`
//! set, neither of which is indexed, so claiming, extending and releasing write no index
//! entries.

use outbox_sql_support::names::derived_name;

/// Most rows one `INSERT` can carry: MariaDB allows 65,535 placeholders per statement and a row
/// takes [`INSERT_PARAMS_PER_ROW`].
pub(crate) const MAX_INSERT_ROWS: usize = 65_535 / INSERT_PARAMS_PER_ROW;

/// Placeholders per row of the batch insert.
pub(crate) const INSERT_PARAMS_PER_ROW: usize = 11;

/// Longest accepted aggregate type, aggregate id, event type, partition key and dedup key, in
/// characters: the `VARCHAR(255)` columns (the length Debezium's outbox examples use, and short
/// enough that `(partition_key, state, seq)` and `dedup_key` fit in an InnoDB index).
pub(crate) const MAX_KEY_CHARS: usize = 255;

/// Name of the unique index on `dedup_key`, to recognise its violations.
pub(crate) const DEDUP_INDEX: &str = "uq_dedup_key";
/// Name of the unique index on `id`, to recognise a reused message id.
pub(crate) const ID_INDEX: &str = "uq_id";

/// Starts every transaction of the store. READ COMMITTED: locking reads then lock only the
/// rows they return (no gap locks that would block the producers' inserts), and the order
/// check reads the latest committed rows.
pub(crate) const BEGIN: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// The longest a fenced transition waits for a row lock another transaction holds, in seconds
/// (`innodb_lock_wait_timeout` for that one statement; MariaDB counts whole seconds, and 0
/// would mean not waiting at all). Past it the statement fails with `ER_LOCK_WAIT_TIMEOUT`
/// (1205), a transient error the relay retries. InnoDB's default is 50 s.
///
/// Claims never wait: their locking reads skip locked rows and their other reads do not lock.
/// A transition first locks the rows it still holds with `SKIP LOCKED` too; it waits only for
/// a row that a plain read shows it still holds while another transaction has it locked: a
/// passing lock (another statement's probe of the row; a claim's locking reads are by primary
/// key and release at once a row they reject, the last one listed too thanks to
/// [`LOCKING_SEQ_LIST`], so a claim, even a frozen one, holds only rows that no one else
/// leases).
pub(crate) const LOCK_WAIT_SECS: u32 = 2;

/// The longest a store transaction may sit idle between its statements, in seconds
/// (`idle_transaction_timeout`, set on the connections [`crate::MysqlStore::connect`] opens).
/// A relay frozen mid-claim or mid-transition (SIGSTOP, a paused VM) would otherwise keep the
/// rows it locked for as long as it is frozen: other claims skip them and hold back the rest
/// of their keys. Past this the server ends the session, which rolls the transaction back and
/// frees the rows; the frozen relay sees a lost connection (transient) when it resumes. No
/// other relay's store call waits for this: the rows a frozen claim or transition locked are
/// only its own (rows it was taking, or holds), never rows another relay holds.
pub(crate) const IDLE_TRANSACTION_SECS: u32 = 5;

/// The DDL of the key-lock table, appended after the outbox table's own so the two can change
/// independently. Idempotent like the rest.
fn key_locks_ddl(key_locks: &str) -> String {
    format!(
        r#"
-- ---------------------------------------------------------------------------------------------
-- Key locks. Kept apart from the outbox table's definition above.
--
-- Per-key order follows seq, the insert order. Two transactions writing one key at once can
-- commit in the other order, and then the later-inserted message is published first. A writer
-- that first upserts its keys here, in its transaction, holds their rows locked until it
-- commits or rolls back (a row lock is transaction-scoped; GET_LOCK is not); a second writer of
-- one of those keys waits on that statement, so it inserts (and commits) after the first. Keys
-- in sorted order, so two writers of the same keys cannot deadlock:
--   INSERT INTO {key_locks} (partition_key) VALUES ('order-42')
--       ON DUPLICATE KEY UPDATE partition_key = partition_key;
-- One small row per key ever locked; rows can be deleted at any time (a writer inserts its
-- key again). The relay's purge (`purge_published`) deletes the rows no writer holds, in
-- bounded batches.
CREATE TABLE IF NOT EXISTS {key_locks} (
    partition_key  VARCHAR({MAX_KEY_CHARS}) NOT NULL PRIMARY KEY
)
ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin;
"#
    )
}

/// [`NO_LEASE_END`], as a literal for `concat!`.
macro_rules! no_lease_end {
    () => {
        "1970-01-01 00:00:00"
    };
}

/// The lease end of a row that is not leased: the epoch, always in the past, so a row holding
/// it is claimable (see [`claimable`]) without a NULL test.
///
/// A row that is not leased holds `lease_token = ''` and this lease end (its columns' defaults,
/// and what every transition writes), not NULLs: leasing it then overwrites a 36-byte token and
/// an 8-byte time with values of the same size, which InnoDB does in place. Leasing a row whose
/// two columns were NULL grows it, and the update then rewrites the record (measured: 5 to 6 ms
/// for 500 rows with the commit, against 2.5 ms in place). NULLs still mean "not leased", for
/// rows written before these defaults or by an older relay.
pub(crate) const NO_LEASE_END: &str = no_lease_end!();

/// The `SET` list that ends a row's lease (alias `m`): the "not leased" values of
/// [`NO_LEASE_END`].
const CLEAR_LEASE: &str = concat!(
    "m.lease_token = '', m.lease_until = '",
    no_lease_end!(),
    "'"
);

/// [`CLEAR_LEASE`] without the alias, for a single-table `UPDATE`.
const CLEAR_LEASE_UNALIASED: &str =
    concat!("lease_token = '', lease_until = '", no_lease_end!(), "'");

/// What the relay's own row updates (lease, extend, complete, release, fail) start with: MariaDB
/// evaluates every CHECK of a row on every `UPDATE`, whatever the update changes, and these
/// change none of the columns the checks read (`id`, `payload`, `payload_bytes`, `headers`).
///
/// Checking them anyway parses each row's payload and headers as JSON and runs the headers'
/// regular expression, once when it is leased and once when it is completed. Over 100,000 rows
/// in batches of 500 (`bench/sql/mariadb-checks`, medians of three) that added 1.8 µs per
/// message to each lease and 4.8 to each completion with 200-byte payloads, and 5.8 and 4.5
/// with 2 KB ones (BENCHMARKS.md, "MariaDB's checks on the relay's updates"). It also made a
/// row that got past the checks (written with them off, or from before a check was added) fail
/// every claim that leased it, holding back every other row of that claim; now such a row is
/// published like any other. The quarantine and the requeues use it too.
const SKIP_CHECKS: &str = "SET STATEMENT check_constraint_checks = 0 FOR";

/// A row holds no lease token, through alias `a`: `''`, or NULL as older relays wrote.
pub(crate) fn unleased(a: &str) -> String {
    format!("COALESCE({a}.lease_token, '') = ''")
}

/// A JSON array of ids, as a table of one `id` column.
const ID_LIST: &str =
    "JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(36) CHARACTER SET ascii COLLATE ascii_bin PATH '$'))";

/// A JSON array of seqs, as a table of one `seq` column.
const SEQ_LIST: &str = "JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$'))";

/// [`SEQ_LIST`] for a locking read by primary key that may reject rows: the list with one more
/// seq, [`SENTINEL_SEQ`], at its end. MariaDB (seen on 10.11, READ COMMITTED) unlocks each row
/// the `WHERE` rejects when the join goes on to the next entry of the list, but not the last
/// entry's row: a claim whose last listed row had been leased by another relay in the meantime
/// kept that row locked until it committed, and, frozen there, made the other relay's
/// completion of it wait its lock bound and fail (`cli/tests/frozen.rs`; reproduced in the
/// `mariadb` client). The sentinel is looked up after the last real entry, which unlocks that
/// row. `AUTO_INCREMENT` never gives its seq; a row written by hand with it is claimed once
/// when listed, and dropped when it answers only for the sentinel (`claim::lock`).
const LOCKING_SEQ_LIST: &str =
    "JSON_TABLE(JSON_ARRAY_APPEND(?, '$', -1), '$[*]' COLUMNS (seq BIGINT PATH '$'))";

/// The most rows one purge of a table with an unpublished table reads to find its batch of old
/// enough published rows (it has no `published_at` index; see `purge_pick`).
pub(crate) const PURGE_EXAMINED_ROWS: u64 = 100_000;

/// The seq [`LOCKING_SEQ_LIST`] appends to its list.
pub(crate) const SENTINEL_SEQ: i64 = -1;

/// A row is claimable (pending, due, and not leased or with an expired lease) as seen through
/// alias `a`.
fn claimable(a: &str) -> String {
    format!(
        "{a}.state = 'pending' AND {a}.available_at <= UTC_TIMESTAMP(6) \
         AND ({a}.lease_until IS NULL OR {a}.lease_until <= UTC_TIMESTAMP(6))"
    )
}

/// [`claimable`] for a row read through the unpublished table (see [`Sql::build`]): its state
/// through alias `a`, the unpublished table's row, and the rest through `r`, the outbox row of
/// the same seq. With `a == r` (the table that holds its own claim indexes) exactly
/// [`claimable`].
fn claimable_in(a: &str, r: &str) -> String {
    if a == r {
        claimable(a)
    } else {
        format!(
            "{a}.state = 'pending' AND {r}.state = 'pending' \
             AND {r}.available_at <= UTC_TIMESTAMP(6) \
             AND ({r}.lease_until IS NULL OR {r}.lease_until <= UTC_TIMESTAMP(6))"
        )
    }
}

/// Whether row `a` is in the claim's shard ([`outbox_traits::ClaimShard`]): two parameters,
/// how many shards the keys are split into and which one the claim takes (`1, 0` for an
/// unsharded claim: every row). A keyed row maps by `CRC32` of its key, so every row of a key is
/// in one shard and per-key order needs nothing across shards; an unordered row (no key) by its
/// seq. The key's `CRC32` is the column [`KEY_HASH`] (NULL exactly when the key is), which the
/// claim index holds: a sharded window end reads that index alone, as an unsharded one does,
/// instead of every row of the window (see `past_bound_sharded`). The same shard as
/// `MOD(IF(partition_key IS NULL, seq, CRC32(partition_key)), n)`, which relays before the
/// column computed, so relays of both versions divide the keys alike.
fn in_shard(a: &str) -> String {
    format!("MOD(COALESCE({a}.{KEY_HASH}, {a}.seq), ?) = ?")
}

/// The column holding `CRC32(partition_key)` (see [`in_shard`]), written by an insert trigger.
///
/// A plain column, not a generated one: MariaDB 10.11 reads a `VIRTUAL` column's values from
/// an index only on some executions of a prepared statement (after another statement of the
/// connection had read the table's rows, the window end read every row again: measured 5–14 ms
/// against 1.6–5.7 ms for a plain column, `bench/src/bin/mysql_window.rs`), and a `PERSISTENT`
/// one cannot be added to an existing table without copying it. The partition key is never
/// changed after the insert, so the value never goes stale.
pub(crate) const KEY_HASH: &str = "key_hash";

/// The claim index's columns: the claim scan and the dead letters in seq order, and the key's
/// hash, so that a sharded scan tells a row's shard from the index entry alone.
const CLAIM_INDEX_COLUMNS: &str = "state, seq, key_hash";

/// Columns read for a [`outbox_traits::Message`], through alias `a`, in the order `row.rs`
/// reads them by name.
fn message_columns(a: &str) -> String {
    format!(
        "{a}.id, {a}.seq, {a}.aggregatetype, {a}.aggregateid, {a}.type, {a}.payload, \
         {a}.payload_bytes, {a}.content_type, {a}.headers, {a}.partition_key, {a}.dedup_key, {a}.attempts, {a}.created_at"
    )
}

/// The statements for one outbox table.
pub(crate) struct Sql {
    /// `` `database`.`table` `` or `` `table` ``.
    pub table: String,
    /// Idempotent DDL (database, table with its indexes, key-lock table).
    pub migrate: String,
    /// The key-lock table, quoted like `table`.
    pub key_locks: String,
    /// `INSERT ... VALUES` up to (not including) the rows; see [`Sql::insert`].
    insert_head: String,
    /// Claim candidates where dead messages block their key: their seqs and keys, by a plain
    /// read (no lock), and one more row with the lease end. Parameters: the window's bound, the
    /// shard twice (see [`in_shard`]), the limit, the lease.
    pub candidates_block: String,
    /// Claim candidates where dead messages are ignored for ordering.
    pub candidates_skip: String,
    /// Lock the listed candidates (a JSON array of seqs, sorted) that are still claimable, by
    /// primary key, skipping locked rows, at most the given number; their message columns.
    pub lock: String,
    /// The claim's window: the seq of its last row (none when the backlog fits in it).
    pub past_bound: String,
    /// [`Sql::past_bound`] of a sharded claim: the window of its shard's rows (shard parameters
    /// first, see [`in_shard`]).
    pub past_bound_sharded: String,
    /// Look past a full window: each key's first pending row, one index dive per key, at most
    /// the given number of keys (of the claim's shard: shard parameters first).
    pub past_keys: String,
    /// Look past a full window: lock the oldest listed rows (a JSON array of seqs, sorted) that
    /// are still claimable heads or unordered messages (at most the number still wanted), by
    /// primary key, skipping locked rows, dead messages blocking their key; their message
    /// columns.
    pub past_heads_block: String,
    /// The same, dead messages ignored for ordering.
    pub past_heads_skip: String,
    /// Look past a full window: the seqs of claimable unordered messages of the claim's shard
    /// past it (a plain read).
    pub past_unordered: String,
    /// Look past a full window with many keys: the seqs of the claimable heads and unordered
    /// messages of the claim's shard past it, reading the rows in seq order (a plain read);
    /// dead messages blocking their key.
    pub past_rows_block: String,
    /// The same, dead messages ignored for ordering.
    pub past_rows_skip: String,
    /// The lease end of a claim's rows, read just before they are leased (not when the claim
    /// began: the look-past statements in between would shorten the lease).
    pub lease_end: String,
    /// Lease the chosen rows.
    pub lease: String,
    /// Dead-letter undecodable rows of a claim (locked by it) by `seq`: a JSON list of
    /// `{"seq": .., "reason": ..}`.
    pub quarantine: String,
    /// Lock the listed rows (a JSON array of seqs, sorted) still held under a token, by primary
    /// key, skipping rows another transaction has locked; their ids and seqs.
    pub held: String,
    /// The listed rows (a JSON array of ids) still held under a token, by a plain read (no
    /// lock, no wait): the rows a transition locks, and which of the rows `held` skipped are
    /// still held, and so were only locked by someone else.
    pub held_unlocked: String,
    /// [`Sql::held`], waiting at most [`LOCK_WAIT_SECS`] for each row instead of skipping it.
    pub held_wait: String,
    /// Complete the held rows, by `seq` (a JSON array of seqs).
    pub complete: String,
    /// Run before [`Sql::complete`], with the same list, on a table with an unpublished table
    /// that keeps published rows: delete the rows' entries there.
    pub complete_first: Option<String>,
    /// The unpublished table, quoted like `table`, when the outbox table has one (see
    /// `unpublished_ddl`).
    pub unpublished: Option<String>,
    /// The unpublished table and its triggers (empty without one): what the conversion of a
    /// table with claim indexes creates before it fills the table (`crate::convert`).
    pub unpublished_ddl: String,
    /// Release the held rows, by `seq` (a JSON array of seqs).
    pub release: String,
    /// Fail the held rows, by id (a JSON list of `{"id", "error", "dead", "delay_us"}`).
    pub fail: String,
    /// The rows held under a token, and the extended lease end by the database clock.
    pub extend_find: String,
    pub extend: String,
    pub list_dead: String,
    pub requeue: String,
    pub discard: String,
    /// `requeue` by seq (a JSON array of seqs).
    pub requeue_seqs: String,
    /// Run after [`Sql::requeue`] with an unpublished table: the entries of the requeued rows.
    pub requeue_unpublished: Option<String>,
    /// [`Sql::requeue_unpublished`] by seq.
    pub requeue_seqs_unpublished: Option<String>,
    /// The dead rows among a JSON array of ids that were dead-lettered because they did not
    /// decode (`last_error` is a quarantine reason), with the message columns: a requeue
    /// checks that they decode now.
    pub requeue_check: String,
    /// [`Sql::requeue_check`] by seq (a JSON array of seqs).
    pub requeue_check_seqs: String,
    /// `discard` by seq (a JSON array of seqs).
    pub discard_seqs: String,
    /// The seqs of the next purge batch.
    pub purge_pick: String,
    /// Lock up to `?` key-lock rows that no writer holds (skipping those locked), in key
    /// order: the next batch of the key-lock purge.
    pub key_locks_pick: String,
    /// Delete the picked key-lock rows (a JSON array of keys), by primary key.
    pub key_locks_purge: String,
    pub purge: String,
    pub counts: String,
}

/// The SQL enqueue contract (README, "Writing from any language (SQL)"), for new tables and
/// tables made by earlier versions alike: the id default, the headers check (an object of
/// strings) and the trigger that gives `partition_key` its default.
/// Every statement is idempotent and none rewrites the table once it is up to date.
///
/// MariaDB syntax: MySQL 8 has no `ADD CONSTRAINT IF NOT EXISTS` nor `SET STATEMENT ... FOR`
/// (see the README for its variant).
fn sql_contract(t: &str, table: &str, key_trigger: &str, id_trigger: &Trigger) -> String {
    let headers_check = derived_name(table, "headers_strings");
    let Trigger {
        schema: id_trigger_schema,
        name: id_trigger_name,
        qualified: id_trigger,
        replaced,
    } = id_trigger;
    let replaced_names = replaced
        .iter()
        .map(|(name, _)| format!(", '{name}'"))
        .collect::<String>();
    let drop_replaced = replaced
        .iter()
        .map(|(_, qualified)| format!("DROP TRIGGER IF EXISTS {qualified};\n"))
        .collect::<String>();
    format!(
        r#"
-- New rows start with the "not leased" values instead of NULL, so that leasing them does not
-- grow the row (metadata-only, like the id default; rows already there keep their NULLs).
ALTER TABLE {t} ALTER COLUMN lease_token SET DEFAULT '',
    ALTER COLUMN lease_until SET DEFAULT '{NO_LEASE_END}';

-- Header values are strings: with escaped backslashes and quotes removed, taking out every
-- string value of the object leaves only the list's brackets and separators. Added without
-- checking the rows already there: a row that breaks it does not decode, so a claim
-- dead-letters it (with the checks off) before it would lease it.
SET STATEMENT check_constraint_checks = 0 FOR
ALTER TABLE {t} ADD CONSTRAINT IF NOT EXISTS `{headers_check}` CHECK (
    REGEXP_REPLACE(
        REPLACE(REPLACE(JSON_EXTRACT(headers, '$.*'),
                        CONCAT(CHAR(92 USING ascii), CHAR(92 USING ascii)), ''),
                CONCAT(CHAR(92 USING ascii), '"'), ''),
        '"[^"]*"', '') REGEXP '^[[][, ]*[]]$');

-- Tables made before binary payloads: the two nullable columns, added in place (an instant
-- change, no copy; existing rows read NULL, JSON messages). Without the size check of new
-- tables: adding a CHECK copies the table.
ALTER TABLE {t} ADD COLUMN IF NOT EXISTS payload_bytes LONGBLOB,
    ADD COLUMN IF NOT EXISTS content_type VARCHAR({MAX_KEY_CHARS});

-- `partition_key` defaults to the aggregate id; '' asks for an unordered message (stored as
-- NULL). A column default cannot read another column, hence a trigger.
CREATE TRIGGER IF NOT EXISTS {key_trigger} BEFORE INSERT ON {t} FOR EACH ROW
    SET NEW.partition_key = CASE
        WHEN NEW.partition_key IS NULL THEN NEW.aggregateid
        WHEN NEW.partition_key = '' THEN NULL
        ELSE NEW.partition_key
    END;

-- Ids are stored in lower case, the form the relay completes by: an id written in upper or
-- mixed case (the id check allows A-F) is lowered before it is stored, so claims, completions
-- and the admin statements find it with a plain comparison on the unique index. A table that
-- did not have this trigger may already hold such ids: they are lowered once, right after the
-- trigger is made (later migrations read `@outbox_lower_ids = 0` and skip the scan: an
-- impossible WHERE). A row whose lowered id another row already holds keeps its id (IGNORE)
-- and, if unpublished, is dead-lettered with a reason. Checks off, as for the relay's own
-- updates of old rows.
--
-- An id left out (the column's default, '') becomes a time-ordered UUIDv7, as the Rust enqueue
-- writes: the statement's time in milliseconds (48 bits), the version, 12 bits of UUID()'s clock
-- sequence, the variant, then the whole time_low of one UUID() call (which no two calls on a
-- server share within seven minutes) and 28 bits of its node. Time-ordered ids keep the id
-- index's inserts, and the completions and deletes that find rows through it, on its last
-- pages; a v1 UUID starts with its time's low bits and scatters them. The body is an IF
-- statement without variables: measured on bulk inserts, both a one-line IF() expression and
-- a body with DECLAREd variables cost every insert more, including those that give their id.
-- Tables made by earlier versions get this trigger in place of theirs (`..._id_case`, which
-- only lowered ids, and `..._ids`, the same v7 in the slower body), and then the new default
-- (in that order, so that no insert ever stores '').
SET @outbox_lower_ids = NOT EXISTS (
    SELECT 1 FROM information_schema.TRIGGERS
    WHERE TRIGGER_SCHEMA = {id_trigger_schema}
      AND TRIGGER_NAME IN ('{id_trigger_name}'{replaced_names}));
CREATE TRIGGER IF NOT EXISTS {id_trigger} BEFORE INSERT ON {t} FOR EACH ROW
BEGIN
    IF NEW.id IS NULL OR NEW.id = '' THEN
        SET NEW.id = CONCAT(
            LPAD(LOWER(HEX(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) DIV 65536)), 8, '0'), '-',
            LPAD(LOWER(HEX(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) & 65535)), 4, '0'), '-7',
            SUBSTR(UUID(), 21, 3), '-8', INSERT(SUBSTR(UUID(), 1, 8), 4, 0, '-'),
            SUBSTR(UUID(), 25, 7));
    ELSE
        SET NEW.id = LOWER(NEW.id);
    END IF;
END;
{drop_replaced}ALTER TABLE {t} ALTER COLUMN id SET DEFAULT '';
SET STATEMENT check_constraint_checks = 0 FOR
UPDATE IGNORE {t} SET id = LOWER(id) WHERE @outbox_lower_ids AND id <> LOWER(id);
SET STATEMENT check_constraint_checks = 0 FOR
UPDATE {t} SET state = 'dead', {CLEAR_LEASE_UNALIASED},
    last_error = CONCAT('undecodable row: column id value "', id, '": differs only in case from ',
        'the id of another message, so the relay cannot complete it; dead-lettered without ',
        'publishing')
WHERE @outbox_lower_ids AND id <> LOWER(id) AND state = 'pending';
SET @outbox_lower_ids = NULL;
"#
    )
}

/// Brings a table made before claim shards were served from the claim index up to it: the
/// [`KEY_HASH`] column, the trigger that fills it, the rows already there filled once (only in
/// the migration that adds the column), then the claim index rebuilt with it, once (only while
/// the index lacks the column). A migration of an up-to-date table changes nothing.
///
/// Adding the nullable column at the end of the row changes only the table's metadata
/// (MariaDB's instant `ADD COLUMN`). The fill reads and writes every row once, by ranges of
/// 10,000 seqs in transactions of their own (measured: about 5 s per 100,000 rows on a busy
/// 2-core machine, so minutes for millions: migrate after a purge if you keep many). A keyed
/// row left without its hash (an insert whose transaction outlived the fill's wait) is only
/// claimed by its seq's shard: per-key order still holds (every claim checks its keys' earlier
/// rows in all shards), it only costs that key a claim of another shard. The index rebuild is
/// `ALGORITHM=INPLACE, LOCK=NONE`: the table is not copied, and writers and relays go on while it
/// reads every row once (it waits for the transactions open on the table when it starts and
/// takes a short exclusive lock at its end).
fn key_hash_ddl(
    t: &str,
    table: &str,
    schema: &str,
    key_trigger: &str,
    hash_trigger: &str,
    claim_index: bool,
) -> String {
    let rebuild_claim_index = if claim_index {
        format!(
            r#"SET @outbox_claim_index = IF(EXISTS (
        SELECT 1 FROM information_schema.STATISTICS
        WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = '{table}'
          AND INDEX_NAME = 'ix_claim' AND COLUMN_NAME = '{KEY_HASH}'),
    'DO 0',
    'ALTER TABLE {t} DROP INDEX ix_claim, ADD INDEX ix_claim ({CLAIM_INDEX_COLUMNS}), ALGORITHM = INPLACE, LOCK = NONE');
PREPARE outbox_claim_index FROM @outbox_claim_index;
EXECUTE outbox_claim_index;
DEALLOCATE PREPARE outbox_claim_index;
SET @outbox_claim_index = NULL;
"#
        )
    } else {
        String::new()
    };
    format!(
        r#"
-- Claim shards from the claim index: the key's hash in a column of its own, written by a trigger
-- on every insert (after the partition key trigger, which sets the key), and held by the claim
-- index. Tables made before it get the column, their keyed rows filled once, and their claim
-- index rebuilt with it, online, once.
SET @outbox_key_hash_new = NOT EXISTS (
    SELECT 1 FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = '{table}' AND COLUMN_NAME = '{KEY_HASH}');
ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {KEY_HASH} INT UNSIGNED;
CREATE TRIGGER IF NOT EXISTS {hash_trigger} BEFORE INSERT ON {t} FOR EACH ROW
    FOLLOWS `{key_trigger}`
    SET NEW.{KEY_HASH} = CRC32(NEW.partition_key);
-- The fill: by ranges of 10,000 seqs, each its own transaction, so that no statement holds
-- the locks of a big table's rows for long. Rows inserted before the trigger was made are in
-- the ranges (their seqs are below the last read after it). Checks off, as for the relay's own
-- updates of old rows.
BEGIN NOT ATOMIC
    DECLARE v_from BIGINT DEFAULT 0;
    DECLARE v_last BIGINT DEFAULT 0;
    IF @outbox_key_hash_new THEN
        SELECT COALESCE(MAX(seq), 0) INTO v_last FROM {t};
        WHILE v_from < v_last DO
            SET STATEMENT check_constraint_checks = 0 FOR
            UPDATE {t} FORCE INDEX (PRIMARY) SET {KEY_HASH} = CRC32(partition_key)
            WHERE seq > v_from AND seq <= v_from + 10000 AND partition_key IS NOT NULL;
            SET v_from = v_from + 10000;
        END WHILE;
    END IF;
END;
SET @outbox_key_hash_new = NULL;
{rebuild_claim_index}"#
    )
}

/// Refuses to migrate a table of the other layout: one with an unpublished table (see
/// [`unpublished_ddl`]) for a configuration without, or the other way round. The statements of
/// one layout cannot serve the other's table, and this migration would otherwise add what its
/// layout lacks (the claim index) and leave the other's objects stale.
fn layout_check(t: &str, table: &str, schema: &str, unpublished: bool) -> String {
    let unpublished_table = derived_name(table, "unpublished");
    let (found, message) = if unpublished {
        (
            format!(
                "SELECT 1 FROM information_schema.STATISTICS
        WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = '{table}' AND INDEX_NAME = 'ix_claim'"
            ),
            format!(
                "{t} has its own claim indexes, no unpublished table: migrate it with unpublished_table(false)"
            ),
        )
    } else {
        (
            format!(
                "SELECT 1 FROM information_schema.TABLES
        WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = '{unpublished_table}'"
            ),
            format!(
                "{t} is laid out with an unpublished table: migrate it with unpublished_table(true)"
            ),
        )
    };
    let message = message.replace('\'', "''");
    format!(
        r#"
-- The table's layout: with or without an unpublished table (`unpublished_table`).
BEGIN NOT ATOMIC
    IF EXISTS ({found}) THEN
        SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '{message}';
    END IF;
END;
"#
    )
}

/// The unpublished table of an outbox table laid out with one (`unpublished_table`): a row per
/// pending or dead outbox row, `(state, seq)` as its primary key (the claim scan, the dead
/// letters) and `(partition_key, state, seq)` as `ix_key` (per-key order), which the outbox
/// table itself then lacks, with `ix_published`. A completion that keeps its row deletes the
/// row's entry here and sets `state` and `published_at` on the outbox row, columns no index of
/// it holds, so InnoDB changes no secondary index for it (three index entries moved per row
/// before, the largest part of a kept completion's cost).
///
/// An insert trigger writes the entry of every row inserted (SQL writers included), a delete
/// trigger removes it with the row (purge, discard, a deleting completion, a delete by hand);
/// the relay's own state changes (dead-letter, requeue) move it in the same statement. A change
/// of `state` by hand would leave it stale: use the admin commands.
fn unpublished_ddl(t: &str, table: &str, u: &str, qualify: &dyn Fn(&str) -> String) -> String {
    let insert_trigger = qualify(&derived_name(table, "unpublished_insert"));
    let delete_trigger = qualify(&derived_name(table, "unpublished_delete"));
    format!(
        r#"
-- The unpublished rows, in place of the outbox table's claim indexes (see the README).
CREATE TABLE IF NOT EXISTS {u} (
    state          ENUM('pending', 'dead') NOT NULL DEFAULT 'pending',
    seq            BIGINT NOT NULL,
    partition_key  VARCHAR({MAX_KEY_CHARS}),
    {KEY_HASH}       INT UNSIGNED,
    -- Claim scan and dead letters, in seq order; the key's hash for sharded claims.
    PRIMARY KEY (state, seq),
    -- Per-key order: a key's first pending (or dead) rows, one probe per key.
    KEY ix_key (partition_key, state, seq)
)
ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin;
-- Every row inserted that is not published (after the BEFORE triggers, which set the key and
-- its hash), in the writer's transaction: a rolled-back insert leaves no entry.
CREATE TRIGGER IF NOT EXISTS {insert_trigger} AFTER INSERT ON {t} FOR EACH ROW
    INSERT INTO {u} (state, seq, partition_key, {KEY_HASH})
    SELECT CAST(NEW.state AS CHAR), NEW.seq, NEW.partition_key, NEW.{KEY_HASH} FROM DUAL
    WHERE NEW.state <> 'published';
CREATE TRIGGER IF NOT EXISTS {delete_trigger} AFTER DELETE ON {t} FOR EACH ROW
    DELETE FROM {u}
    WHERE OLD.state <> 'published' AND state IN ('pending', 'dead') AND seq = OLD.seq;
"#
    )
}

/// A trigger's schema (as a SQL expression), bare name and quoted, qualified name, and the
/// same names of the trigger it replaces on tables made by earlier versions.
struct Trigger {
    schema: String,
    name: String,
    qualified: String,
    /// Earlier versions' id triggers (name, qualified name), dropped once this one exists.
    replaced: Vec<(String, String)>,
}

impl Sql {
    /// `max_payload_bytes` is the payload limit the table checks (the config's).
    pub(crate) fn build(
        database: Option<&str>,
        table: &str,
        delete_published: bool,
        max_payload_bytes: usize,
        unpublished: bool,
    ) -> Self {
        let qualify = |name: &str| match database {
            Some(db) => format!("`{db}`.`{name}`"),
            None => format!("`{name}`"),
        };
        let t = qualify(table);
        // The unpublished table (`unpublished`): a row per pending or dead row of the outbox,
        // keyed `(state, seq)` with a `(partition_key, state, seq)` index, in place of the
        // outbox table's own `ix_claim` and `ix_key`; a completion deletes its row there and
        // leaves every index of the outbox row alone (see `unpublished_ddl`).
        let u = unpublished.then(|| qualify(&derived_name(table, "unpublished")));
        // The table of the per-key index `ix_key` that the order probes read.
        let k = u.clone().unwrap_or_else(|| t.clone());
        // A scan of the claim index (`ix_claim`) or the per-key index (`ix_key`) through alias
        // `a`, with its outbox row (through the second alias: `a` itself when the outbox table
        // holds the index, else `{a}r`, joined by primary key).
        let scan = |a: &str, index: &str| -> (String, String) {
            match &u {
                None => (format!("{t} {a} FORCE INDEX ({index})"), a.to_owned()),
                Some(u) => {
                    let index = if index == "ix_claim" {
                        "PRIMARY"
                    } else {
                        index
                    };
                    (
                        format!(
                            "{u} {a} FORCE INDEX ({index})
 STRAIGHT_JOIN {t} {a}r FORCE INDEX (PRIMARY) ON {a}r.seq = {a}.seq"
                        ),
                        format!("{a}r"),
                    )
                }
            }
        };
        let key_trigger = qualify(&derived_name(table, "partition_key"));
        let id_trigger_name = derived_name(table, "id_v7");
        let id_trigger = Trigger {
            schema: match database {
                Some(db) => format!("'{db}'"),
                None => "DATABASE()".to_owned(),
            },
            qualified: qualify(&id_trigger_name),
            name: id_trigger_name,
            replaced: ["id_case", "ids"]
                .into_iter()
                .map(|suffix| {
                    let name = derived_name(table, suffix);
                    (name.clone(), qualify(&name))
                })
                .collect(),
        };
        let key_locks = qualify(&derived_name(table, "key_locks"));
        let create_database = database
            .map(|db| format!("CREATE DATABASE IF NOT EXISTS `{db}`;\n\n"))
            .unwrap_or_default();
        let migrate = format!(
            r#"{create_database}CREATE TABLE IF NOT EXISTS {t} (
    -- Debezium outbox event router columns: id, aggregatetype, aggregateid, type, payload.
    -- Ids and headers are checked so that a row written by plain SQL cannot hold what the
    -- relay cannot read (tables made before these checks keep their rows; the relay
    -- dead-letters a bad one, see the README).
    -- A SQL writer may leave id out: the insert trigger below writes a time-ordered v7 in place
    -- of the default '', as the Rust enqueue does.
    id             CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT ''
                   CHECK (id REGEXP '^[0-9a-fA-F]{{8}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{12}}$'),
    aggregatetype  VARCHAR({MAX_KEY_CHARS}) NOT NULL,
    aggregateid    VARCHAR({MAX_KEY_CHARS}) NOT NULL,
    type           VARCHAR({MAX_KEY_CHARS}) NOT NULL,
    payload        LONGTEXT NOT NULL CHECK (JSON_VALID(payload)),
    -- A binary payload (Protobuf, Avro, ...): its bytes, sent untouched, and their content
    -- type (NULL: application/octet-stream). NULL bytes: a JSON message, whose body is
    -- `payload`; a binary message's `payload` is JSON null.
    payload_bytes  LONGBLOB,
    content_type   VARCHAR({MAX_KEY_CHARS}),
    -- Relay columns.
    seq            BIGINT NOT NULL AUTO_INCREMENT,
    headers        LONGTEXT NOT NULL DEFAULT ('{{}}')
                   CHECK (JSON_VALID(headers) AND JSON_TYPE(headers) = 'OBJECT'),
    partition_key  VARCHAR({MAX_KEY_CHARS}),
    -- CRC32 of the key, for claim shards, written by a trigger (see `KEY_HASH`).
    {KEY_HASH}       INT UNSIGNED,
    dedup_key      VARCHAR({MAX_KEY_CHARS}),
    state          ENUM('pending', 'published', 'dead') NOT NULL DEFAULT 'pending',
    attempts       INT NOT NULL DEFAULT 0,
    available_at   DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    -- Not leased: '' and the epoch (or NULLs, in rows written before these defaults), which
    -- a lease overwrites with values of the same size, in place (see `NO_LEASE_END`).
    lease_token    CHAR(36) CHARACTER SET ascii COLLATE ascii_bin DEFAULT '',
    lease_until    DATETIME(6) DEFAULT '{NO_LEASE_END}',
    last_error     TEXT,
    created_at     DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    published_at   DATETIME(6){published_default},
    -- The payload limit of the Rust enqueue. New tables only: adding a CHECK to a table copies
    -- it. A row over the limit is still relayed: the relay's updates skip the checks.
    CONSTRAINT `{payload_check}` CHECK (OCTET_LENGTH(payload) <= {max_payload_bytes}),
    CONSTRAINT `{bytes_check}` CHECK (OCTET_LENGTH(payload_bytes) <= {max_payload_bytes}),
    -- InnoDB clusters rows by the primary key: seq keeps them in insert order, so inserts
    -- append and claims read neighbouring rows.
    PRIMARY KEY (seq),
    UNIQUE KEY {ID_INDEX} (id),
    -- NULLs do not collide: most messages have no dedup key.
    UNIQUE KEY {DEDUP_INDEX} (dedup_key){claim_indexes}
)
-- Binary, no-pad comparison: keys are equal only when their bytes are ('a' <> 'A' <> 'a ').
ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin;
{contract}"#,
            // With an unpublished table, a row not yet published holds the epoch here rather
            // than NULL (NULL still reads as not published): the completion then overwrites 8
            // bytes with 8 in place instead of growing the row, which InnoDB rewrites
            // (`NO_LEASE_END` does the same for the lease columns; measured in BENCHMARKS.md,
            // "An unpublished table").
            published_default = if u.is_some() {
                format!(" DEFAULT '{NO_LEASE_END}'")
            } else {
                String::new()
            },
            claim_indexes = if u.is_some() {
                String::new()
            } else {
                format!(
                    r#",
    -- Claim scan and dead letters, in seq order; the key's hash for sharded claims.
    KEY ix_claim ({CLAIM_INDEX_COLUMNS}),
    -- Per-key order: a key's first pending (or dead) rows, one probe per key.
    KEY ix_key (partition_key, state, seq),
    -- Purge of published rows, oldest first.
    KEY ix_published (state, published_at)"#
                )
            },
            contract = layout_check(&t, table, &id_trigger.schema, u.is_some())
                + &sql_contract(&t, table, &key_trigger, &id_trigger)
                + &key_hash_ddl(
                    &t,
                    table,
                    &id_trigger.schema,
                    &derived_name(table, "partition_key"),
                    &qualify(&derived_name(table, "key_hash")),
                    u.is_none(),
                )
                + &u.as_ref()
                    .map(|u| unpublished_ddl(&t, table, u, &qualify))
                    .unwrap_or_default(),
            payload_check = derived_name(table, "payload_size"),
            bytes_check = derived_name(table, "payload_bytes_size"),
        ) + &key_locks_ddl(&key_locks)
            + &crate::group::group_ddl(database, table);

        let insert_head = format!(
            "INSERT INTO {t} (id, aggregatetype, aggregateid, type, payload, headers, \
             partition_key, dedup_key, available_at, payload_bytes, content_type, created_at) \
             VALUES "
        );

        let candidates = |dead_blocks: bool| -> String {
            // Under Block, a dead row holds back every later row of its key.
            let no_dead_before = if dead_blocks {
                format!(
                    "
            AND NOT EXISTS (
                SELECT 1 FROM {k} d FORCE INDEX (ix_key)
                WHERE d.partition_key = c.partition_key AND d.state = 'dead' AND d.seq < c.seq)"
                )
            } else {
                String::new()
            };
            let (from_c, c_row) = scan("c", "ix_claim");
            let (from_h, h_row) = scan("h", "ix_key");
            format!(
                r#"(SELECT c.seq, c.partition_key, NULL AS lease_until
 FROM {from_c}
 WHERE {claimable_c}
   -- The window: up to the last of the first rows of the backlog in seq order (leased ones
   -- included; `past_bound`, given as a value so that it bounds the index range), so a claim
   -- reads a bounded stretch however long a blocked backlog is; when it comes back short from
   -- a full window, the look-past statements take the heads past it.
   AND c.seq <= ?
   -- Only the claim's shard (every row of a key is in one, except a keyed row that the
   -- `key_hash` migration left without one: the second probe below accounts for it).
   AND {in_shard_c}
   -- Skip rows behind an earlier pending row of their key that is not claimable (leased to
   -- another relay, waiting for a retry, not yet due; anywhere in the key's backlog, not
   -- only its first row) or, under Block, behind a dead row, so that a blocked key's backlog
   -- cannot fill the LIMIT and starve every other key. These subqueries are plain reads:
   -- they neither lock nor skip locked rows.
   -- A key's first pending row passes at once (one entry of the per-key index, read from the
   -- index alone). A later row: the probe reads the key's pending rows in seq order up to the
   -- first that is either not claimable or the candidate itself, and the candidate passes if
   -- that is itself; it reads as many rows as the candidate has claimable rows before it.
   -- (A NOT EXISTS with `h.seq < c.seq` would read every pending entry of the key, the whole
   -- of a long backlog, for every candidate: the condition on seq cannot end its index
   -- lookup.) A candidate this statement's read view does not show yet reads as blocked: safe,
   -- and the next claim sees it.
   -- An earlier row of the key in another shard blocks it too: a keyed row that the migration
   -- adding `key_hash` left without one is in its seq's shard, not always its key's, and this
   -- claim cannot take it (the shard parameters appear a second time for this).
   -- So each key's candidates are its first pending rows in seq order, as this statement sees
   -- them (every earlier pending row of a candidate's key is claimable, in the shard and in the
   -- window, and the LIMIT cuts only later seqs): the claim keeps a key's candidates up to the
   -- first one it could not lock, with no further read (`keep_key_order` in `claim.rs`).
   AND (c.partition_key IS NULL OR (
            (c.seq = (
             SELECT f.seq FROM {k} f FORCE INDEX (ix_key)
             WHERE f.partition_key = c.partition_key AND f.state = 'pending'
             ORDER BY f.seq LIMIT 1)
            OR c.seq = (
             SELECT h.seq FROM {from_h}
             WHERE h.partition_key = c.partition_key AND h.state = 'pending'
               AND (h.seq >= c.seq OR NOT ({claimable_h}) OR NOT ({in_shard_h}))
             ORDER BY h.seq LIMIT 1)){no_dead_before}))
 ORDER BY c.seq
 LIMIT ?
 -- A plain read: it locks nothing (a locking scan of the claim index would keep the lock of
 -- every row it read and rejected, rows other relays lease among them, until the claim ends;
 -- see `lock`).
 )
UNION ALL
-- One more row, so that even an empty claim returns its lease end by the database clock.
(SELECT NULL, NULL, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"#,
                claimable_c = claimable_in("c", &c_row),
                claimable_h = claimable_in("h", &h_row),
                in_shard_c = in_shard("c"),
                in_shard_h = in_shard("h"),
            )
        };

        // Under Block, a key with a dead row before its first pending row is held back.
        let no_dead_before = |a: &str, dead_blocks: bool| -> String {
            if dead_blocks {
                format!(
                    "
   AND NOT EXISTS (
       SELECT 1 FROM {k} d FORCE INDEX (ix_key)
       WHERE d.partition_key = {a}.partition_key AND d.state = 'dead' AND d.seq < {a}.seq)"
                )
            } else {
                String::new()
            }
        };
        let (bound_table, bound_index) = match &u {
            Some(u) => (u, "PRIMARY"),
            None => (&t, "ix_claim"),
        };
        let past_bound = format!(
            "SELECT w.seq FROM {bound_table} w FORCE INDEX ({bound_index})
             WHERE w.state = 'pending' ORDER BY w.seq LIMIT ?, 1"
        );
        // Reads the claim index alone too, which holds the key's hash: a sharded window end
        // costs about `count` times the index entries of an unsharded one, no row.
        let past_bound_sharded = format!(
            "SELECT w.seq FROM {bound_table} w FORCE INDEX ({bound_index})
             WHERE w.state = 'pending' AND {in_shard_w} ORDER BY w.seq LIMIT ?, 1",
            in_shard_w = in_shard("w"),
        );
        // A loose index scan ("Using index for group-by"): one dive per key of the per-key
        // index, giving each key's first pending row, at most the given number of keys of the
        // claim's shard (the HAVING keeps the loose scan; checked with EXPLAIN on 10.11).
        let past_keys = format!(
            "SELECT MIN(k.seq) AS head FROM {k} k FORCE INDEX (ix_key)
             WHERE k.state = 'pending' AND k.partition_key IS NOT NULL
             GROUP BY k.partition_key
             HAVING MOD(CRC32(k.partition_key), ?) = ?
             LIMIT ?"
        );
        // Every locking read of a claim is by primary key, over a list of seqs that plain reads
        // found: InnoDB keeps the lock of every row a locking scan of a secondary index read,
        // rejected ones included, until the transaction ends (seen on MariaDB 10.11 under READ
        // COMMITTED), and those are rows other relays lease. A claim that froze with such locks
        // would hold the other relays' completions of them until the server ended it. Through
        // the primary key, a row the WHERE rejects is unlocked at once: a claim holds only the
        // rows it takes, which are claimable, so no one else's lease. Rows locked by a
        // concurrent claim or transition are skipped; the claim then holds back the later
        // rows of their keys (`keep_key_order` in `claim.rs`). The list is sorted and the join keeps its order: the oldest rows
        // first, and the scan stops, and stops locking, at the number still wanted (an ORDER BY
        // would sort after locking every row).
        let lock = format!(
            r#"SELECT {columns}
FROM {LOCKING_SEQ_LIST} j
STRAIGHT_JOIN {t} c FORCE INDEX (PRIMARY) ON c.seq = j.seq
WHERE {claimable_c}
LIMIT ?
FOR UPDATE SKIP LOCKED"#,
            columns = message_columns("c"),
            claimable_c = claimable("c"),
        );
        // Past the window: lock the listed rows that are still claimable and unordered or their
        // key's first pending row (under Block, not behind a dead row), as `lock` does.
        let past_heads = |dead_blocks: bool| -> String {
            format!(
                r#"SELECT {columns}
FROM {LOCKING_SEQ_LIST} j
STRAIGHT_JOIN {t} c FORCE INDEX (PRIMARY) ON c.seq = j.seq
WHERE {claimable_c}
   -- Still its key's first pending row (one index entry read; a NOT EXISTS with
   -- `e.seq < c.seq` would read the key's whole backlog).
   AND (c.partition_key IS NULL OR (
       c.seq = (
       SELECT e.seq FROM {k} e FORCE INDEX (ix_key)
       WHERE e.partition_key = c.partition_key AND e.state = 'pending'
       ORDER BY e.seq LIMIT 1){dead}))
LIMIT ?
FOR UPDATE SKIP LOCKED"#,
                columns = message_columns("c"),
                claimable_c = claimable("c"),
                dead = no_dead_before("c", dead_blocks),
            )
        };
        // A plain read, like the two below: `past_heads` locks what they find.
        let (from_c, c_row) = scan("c", "ix_key");
        let past_unordered = format!(
            r#"SELECT c.seq
FROM {from_c}
WHERE c.partition_key IS NULL AND c.state = 'pending' AND c.seq > ?
  AND {claimable_c} AND {in_shard_c}
ORDER BY c.seq
LIMIT ?"#,
            claimable_c = claimable_in("c", &c_row),
            in_shard_c = in_shard("c"),
        );
        let past_rows = |dead_blocks: bool| -> String {
            let (from_c, c_row) = scan("c", "ix_claim");
            format!(
                r#"SELECT c.seq
FROM {from_c}
WHERE {claimable_c} AND c.seq > ? AND {in_shard_c}
  -- Heads only: the key's first pending row (a cached subquery per key), so a blocked key's
  -- rows cost no probe each.
  AND (c.partition_key IS NULL OR (
       c.seq = (SELECT h.seq FROM {k} h FORCE INDEX (ix_key)
                WHERE h.partition_key = c.partition_key AND h.state = 'pending'
                ORDER BY h.seq LIMIT 1){dead}))
ORDER BY c.seq
LIMIT ?"#,
                claimable_c = claimable_in("c", &c_row),
                in_shard_c = in_shard("c"),
                dead = no_dead_before("c", dead_blocks),
            )
        };

        // Fenced transitions run in one transaction: find the listed rows still held (token,
        // pending, lease unexpired by the database clock) by a plain read, lock those by
        // primary key, checking the fence again, then update exactly those. Through the
        // primary key a row that no longer passes the fence is unlocked at once (a locking
        // read through the id index would keep it locked until the transition ends: a relay
        // frozen in a transition that lists rows it lost would hold the new holder's calls).
        // A row another transaction has locked is skipped first (the caller then tells a row
        // it no longer holds from one that is only locked, with `held_unlocked` again), so
        // that a transition never waits on a relay that froze mid-claim with rows whose lease
        // this caller lost.
        let fence =
            "WHERE m.lease_token = ? AND m.state = 'pending' AND m.lease_until > UTC_TIMESTAMP(6)";
        let held_unlocked = format!(
            "SELECT m.id, m.seq
             FROM {ID_LIST} j
             STRAIGHT_JOIN {t} m FORCE INDEX ({ID_INDEX}) ON m.id = j.id
             {fence}"
        );
        let held_by_seq = format!(
            "SELECT m.id, m.seq
             FROM {LOCKING_SEQ_LIST} j
             STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
             {fence}"
        );
        let held = format!("{held_by_seq}\n             FOR UPDATE SKIP LOCKED");
        let held_wait = format!(
            "SET STATEMENT innodb_lock_wait_timeout = {LOCK_WAIT_SECS} FOR\n{held_by_seq}\n             FOR UPDATE"
        );

        // The unpublished table's row of outbox row `m` in state `state`, for an `UPDATE` that
        // moves it to another state (a pending row dead-lettered, a dead one requeued): a LEFT
        // JOIN, so that a row without one (written before the trigger, by hand) still changes.
        let join_u = |state: &str| -> String {
            match &u {
                Some(u) => format!(
                    "
                 LEFT JOIN {u} s FORCE INDEX (PRIMARY) ON s.state = '{state}' AND s.seq = m.seq"
                ),
                None => String::new(),
            }
        };
        let set_u = |value: &str| -> String {
            if u.is_some() {
                format!(", s.state = {value}")
            } else {
                String::new()
            }
        };
        let (extend_from, extend_row) = scan("c", "ix_claim");
        let (dead_from, dead_row) = scan("d", "ix_claim");

        Self {
            candidates_block: candidates(true),
            candidates_skip: candidates(false),
            past_bound,
            past_bound_sharded,
            past_keys,
            lock,
            past_heads_block: past_heads(true),
            past_heads_skip: past_heads(false),
            past_unordered,
            past_rows_block: past_rows(true),
            past_rows_skip: past_rows(false),
            lease_end: "SELECT UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND".to_owned(),
            lease: format!(
                "{SKIP_CHECKS}
                 UPDATE JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                 SET m.lease_token = ?, m.lease_until = ?"
            ),
            // MariaDB checks a row's CHECK constraints on every UPDATE: a row that got past
            // them (written with `check_constraint_checks` off) could not be dead-lettered.
            // Only state, error and lease change here, so the checks are skipped.
            quarantine: format!(
                "{SKIP_CHECKS}
                 UPDATE JSON_TABLE(?, '$[*]' COLUMNS (
                     seq BIGINT PATH '$.seq',
                     reason LONGTEXT PATH '$.reason')) j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq{join}
                 SET m.state = 'dead', m.last_error = j.reason, {CLEAR_LEASE}{set}
                 WHERE m.state = 'pending'",
                join = join_u("pending"),
                set = set_u("'dead'"),
            ),
            held,
            held_unlocked,
            held_wait,
            // The held rows are locked by the transition, so the delete needs no fence. By
            // `seq`, which `held` returns: a primary key lookup per row rather than a dive into
            // the id index and then the primary key.
            complete: if delete_published {
                format!(
                    "DELETE m FROM {SEQ_LIST} j
                     STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq"
                )
            } else {
                format!(
                    "{SKIP_CHECKS}
                     UPDATE {SEQ_LIST} j
                     STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                     SET m.state = 'published', m.published_at = UTC_TIMESTAMP(6),
                         {CLEAR_LEASE}"
                )
            },
            // A deleted row's entry goes with it (the delete trigger); a kept one's is deleted
            // here, so that the completion changes no index of the outbox row.
            complete_first: u.as_ref().filter(|_| !delete_published).map(|u| {
                format!(
                    "DELETE s FROM {SEQ_LIST} j
                     STRAIGHT_JOIN {u} s FORCE INDEX (PRIMARY) ON s.state = 'pending' AND s.seq = j.seq"
                )
            }),
            unpublished: u.clone(),
            unpublished_ddl: u
                .as_ref()
                .map(|u| unpublished_ddl(&t, table, u, &qualify))
                .unwrap_or_default(),
            release: format!(
                "{SKIP_CHECKS}
                 UPDATE {SEQ_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                 SET m.available_at = UTC_TIMESTAMP(6), {CLEAR_LEASE}"
            ),
            fail: format!(
                "{SKIP_CHECKS}
                 UPDATE JSON_TABLE(?, '$[*]' COLUMNS (
                     id CHAR(36) CHARACTER SET ascii COLLATE ascii_bin PATH '$.id',
                     error LONGTEXT PATH '$.error',
                     dead TINYINT PATH '$.dead',
                     delay_us BIGINT PATH '$.delay_us')) f
                 STRAIGHT_JOIN {t} m FORCE INDEX ({ID_INDEX}) ON m.id = f.id{join}
                 SET m.attempts = m.attempts + 1,
                     m.last_error = f.error,
                     m.state = IF(f.dead = 1, 'dead', 'pending'),
                     m.available_at = IF(f.dead = 1, m.available_at,
                                         UTC_TIMESTAMP(6) + INTERVAL f.delay_us MICROSECOND),
                     {CLEAR_LEASE}{set}",
                join = join_u("pending"),
                set = set_u("IF(f.dead = 1, 'dead', 'pending')"),
            ),
            // No index on lease_token (a claim would write it): the token's rows are found by
            // scanning the pending rows; extend is called rarely, once per long publish.
            extend_find: if u.is_some() {
                format!(
                    "SELECT c.seq, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND AS lease_until
                 FROM {extend_from}
                 WHERE c.state = 'pending' AND {extend_row}.state = 'pending'
                   AND {extend_row}.lease_token = ? AND {extend_row}.lease_until > UTC_TIMESTAMP(6)"
                )
            } else {
                format!(
                    "SELECT seq, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND AS lease_until
                 FROM {t} FORCE INDEX (ix_claim)
                 WHERE state = 'pending' AND lease_token = ? AND lease_until > UTC_TIMESTAMP(6)"
                )
            },
            // Waits at most `LOCK_WAIT_SECS` for a row lock (see `held`).
            extend: format!(
                "SET STATEMENT innodb_lock_wait_timeout = {LOCK_WAIT_SECS},
                               check_constraint_checks = 0 FOR
                 UPDATE JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                 SET m.lease_until = ?
                 WHERE m.state = 'pending' AND m.lease_token = ? AND m.lease_until > UTC_TIMESTAMP(6)"
            ),
            list_dead: if u.is_some() {
                format!(
                    "SELECT {columns}, COALESCE({dead_row}.last_error, '') AS last_error
                 FROM {dead_from}
                 WHERE d.state = 'dead' AND {dead_row}.state = 'dead' AND d.seq > ?
                 ORDER BY d.seq
                 LIMIT ?",
                    columns = message_columns(&dead_row)
                )
            } else {
                format!(
                    "SELECT {columns}, COALESCE(m.last_error, '') AS last_error
                 FROM {t} m FORCE INDEX (ix_claim)
                 WHERE m.state = 'dead' AND m.seq > ?
                 ORDER BY m.seq
                 LIMIT ?",
                    columns = message_columns("m")
                )
            },
            requeue_check: format!(
                "SELECT {columns}
                 FROM {ID_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX ({ID_INDEX}) ON m.id = j.id
                 WHERE m.state = 'dead' AND m.last_error LIKE '{quarantined}%'",
                columns = message_columns("m"),
                quarantined = outbox_sql_support::quarantine::REASON_PREFIX,
            ),
            requeue_check_seqs: format!(
                "SELECT {columns}
                 FROM {SEQ_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                 WHERE m.state = 'dead' AND m.last_error LIKE '{quarantined}%'",
                columns = message_columns("m"),
                quarantined = outbox_sql_support::quarantine::REASON_PREFIX,
            ),
            // Checks skipped as for `quarantine`: a requeued row keeps its values, and a
            // quarantined one was checked to decode (`requeue_check`). With the checks on, a
            // row that got past them would fail here with the raw CONSTRAINT error.
            requeue: format!(
                "{SKIP_CHECKS}
                 UPDATE {ID_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX ({ID_INDEX}) ON m.id = j.id
                 SET m.state = 'pending', m.attempts = 0, m.available_at = UTC_TIMESTAMP(6),
                     {CLEAR_LEASE}
                 WHERE m.state = 'dead'"
            ),
            // After `requeue`, in its transaction: the requeued rows' entries, dead until now
            // (a requeue's count is the outbox rows': the admin flow counts one statement).
            requeue_unpublished: u.as_ref().map(|u| {
                format!(
                    "UPDATE {ID_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX ({ID_INDEX}) ON m.id = j.id
                 STRAIGHT_JOIN {u} s FORCE INDEX (PRIMARY) ON s.state = 'dead' AND s.seq = m.seq
                 SET s.state = 'pending'
                 WHERE m.state = 'pending'"
                )
            }),
            requeue_seqs_unpublished: u.as_ref().map(|u| {
                format!(
                    "UPDATE {SEQ_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                 STRAIGHT_JOIN {u} s FORCE INDEX (PRIMARY) ON s.state = 'dead' AND s.seq = m.seq
                 SET s.state = 'pending'
                 WHERE m.state = 'pending'"
                )
            }),
            discard: format!(
                "DELETE m FROM {ID_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX ({ID_INDEX}) ON m.id = j.id
                 WHERE m.state = 'dead'"
            ),
            // Checks skipped as for `quarantine`: a requeued row keeps its values.
            requeue_seqs: format!(
                "{SKIP_CHECKS}
                 UPDATE {SEQ_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                 SET m.state = 'pending', m.attempts = 0, m.available_at = UTC_TIMESTAMP(6),
                     {CLEAR_LEASE}
                 WHERE m.state = 'dead'"
            ),
            discard_seqs: format!(
                "DELETE m FROM {SEQ_LIST} j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                 WHERE m.state = 'dead'"
            ),
            // MariaDB's single-table DELETE takes no index hint and would sort every published
            // row; so pick the batch through the purge index, then delete it by primary key
            // (published rows never change, so no transaction is needed in between).
            // With an unpublished table the outbox table has no index on `published_at`: the
            // batch is the old enough published rows in seq order (about publish order), read
            // from the primary key. `ROWS EXAMINED` bounds the read when few rows are old
            // enough: a purge then deletes what it found among the first
            // [`PURGE_EXAMINED_ROWS`] rows, and the next finds the rest as they age.
            purge_pick: if u.is_some() {
                format!(
                    "SELECT seq FROM {t} FORCE INDEX (PRIMARY)
                 WHERE state = 'published'
                   AND published_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
                 ORDER BY seq
                 LIMIT ? ROWS EXAMINED {PURGE_EXAMINED_ROWS}"
                )
            } else {
                format!(
                    "SELECT seq FROM {t} FORCE INDEX (ix_published)
                 WHERE state = 'published'
                   AND published_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
                 ORDER BY published_at
                 LIMIT ?"
                )
            },
            // A writer holds its keys' rows locked until it commits: skipped, so the purge
            // never waits for a writer, and a writer waits at most for this short transaction
            // (then inserts the key again).
            key_locks_pick: format!(
                "SELECT partition_key FROM {key_locks} FORCE INDEX (PRIMARY)
                 ORDER BY partition_key
                 LIMIT ?
                 FOR UPDATE SKIP LOCKED"
            ),
            key_locks_purge: format!(
                "DELETE k FROM JSON_TABLE(?, '$[*]' COLUMNS (
                     partition_key VARCHAR({MAX_KEY_CHARS}) CHARACTER SET utf8mb4
                         COLLATE utf8mb4_nopad_bin PATH '$')) j
                 STRAIGHT_JOIN {key_locks} k FORCE INDEX (PRIMARY)
                     ON k.partition_key = j.partition_key"
            ),
            purge: format!(
                "DELETE m FROM JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) j
                 STRAIGHT_JOIN {t} m FORCE INDEX (PRIMARY) ON m.seq = j.seq
                 WHERE m.state = 'published'"
            ),
            counts: format!(
                "SELECT COUNT(CASE WHEN m.state = 'pending' AND {free} THEN 1 END)
                            AS pending,
                        COUNT(CASE WHEN m.state = 'pending' AND NOT {free} THEN 1 END)
                            AS leased,
                        COUNT(CASE WHEN m.state = 'published' THEN 1 END) AS published,
                        COUNT(CASE WHEN m.state = 'dead' THEN 1 END) AS dead
                 FROM {t} m",
                free = unleased("m")
            ),
            insert_head,
            key_locks,
            migrate,
            table: t,
        }
    }

    /// A multi-row `INSERT` of `rows` rows (at most [`MAX_INSERT_ROWS`]), with
    /// [`INSERT_PARAMS_PER_ROW`] placeholders per row: id, aggregate type, aggregate id, event
    /// type, payload, headers, partition key, dedup key, not-before (NULL: now), payload bytes,
    /// content type (both NULL for a JSON message).
    pub(crate) fn insert(&self, rows: usize) -> String {
        // An unordered message (no partition key) is written as '', which the partition key
        // trigger stores as NULL: NULL itself means "the aggregate id", as for a SQL writer
        // that leaves the column out.
        const ROW: &str = "(?, ?, ?, ?, ?, ?, COALESCE(?, ''), ?, COALESCE(?, UTC_TIMESTAMP(6)), \
             ?, ?, UTC_TIMESTAMP(6))";
        let mut sql = String::with_capacity(self.insert_head.len() + rows * (ROW.len() + 2));
        sql.push_str(&self.insert_head);
        for i in 0..rows {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push_str(ROW);
        }
        sql
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_has_one_row_of_placeholders_per_message() {
        let sql = Sql::build(None, "outbox", false, 1024, false);
        let three = sql.insert(3);
        assert_eq!(three.matches('?').count(), 3 * INSERT_PARAMS_PER_ROW);
        assert!(three.starts_with("INSERT INTO `outbox` ("));
        const { assert!(MAX_INSERT_ROWS * INSERT_PARAMS_PER_ROW <= 65_535) };
    }

    #[test]
    fn names_are_quoted_everywhere() {
        for delete_published in [false, true] {
            let sql = Sql::build(Some("db"), "t", delete_published, 1024, false);
            assert_eq!(sql.table, "`db`.`t`");
            for statement in [
                &sql.candidates_block,
                &sql.held,
                &sql.complete,
                &sql.purge,
                &sql.counts,
            ] {
                assert!(statement.contains("`db`.`t`"), "{statement}");
            }
            assert_eq!(sql.complete.starts_with("DELETE"), delete_published);
        }
    }

    #[test]
    fn ending_a_lease_writes_the_unleased_values_not_nulls() {
        let sql = Sql::build(None, "t", false, 1024, false);
        let ends = [
            &sql.quarantine,
            &sql.complete,
            &sql.release,
            &sql.fail,
            &sql.requeue,
            &sql.requeue_seqs,
        ];
        for statement in ends {
            assert!(statement.contains(CLEAR_LEASE), "{statement}");
            assert!(!statement.contains("= NULL"), "{statement}");
        }
        assert!(CLEAR_LEASE.ends_with(&format!("'{NO_LEASE_END}'")));
        assert!(sql.migrate.contains(&format!(
            "lease_until    DATETIME(6) DEFAULT '{NO_LEASE_END}'"
        )));
    }
}
