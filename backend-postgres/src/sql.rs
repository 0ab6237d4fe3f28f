//! Every SQL statement of the store, built once per config from validated, quoted names.
//!
//! States are stored as text (`pending`, `published`, `dead`) so operators can read the table
//! directly. A lease is not a state: a leased row stays `pending` with `lease_token` and
//! `lease_until` set. Neither lease column is indexed nor in an index predicate, so claiming,
//! extending, releasing and retrying a row change no indexed value and, with the table's spare
//! page space (`fillfactor`), are HOT updates that write no index entries. Claims were bound by
//! those index writes (a `state` change touched the primary key and both claim indexes).
//!
//! Durations travel as microseconds (`bigint`) and become intervals in SQL, so that every time
//! decision uses the database's clock (`now()`), never the relay host's.

pub(crate) use outbox_sql_support::names::derived_name;
use outbox_sql_support::names::{fnv1a, MAX_IDENT};

/// Percent of each table page filled by inserts. The rest takes the new row versions of
/// claims, extends, releases and retries on the row's own page, which HOT updates need.
pub(crate) const FILLFACTOR: u32 = 50;

/// [`FILLFACTOR`] of a table laid out for cursor claims (`crate::cursor`): there the completion
/// is a HOT update too, and a row's three versions (written; leased, 24 bytes longer; published)
/// must fit on its page without waiting for the first to be pruned, which a concurrent claim's
/// snapshot can hold off. At 50, about a fifth of the completions of a 100,000-message drain
/// found no room and wrote index entries; at 33, up to one in a hundred did with small rows on a
/// loaded machine; at 30, none (`BENCHMARKS.md`).
pub(crate) const CURSOR_FILLFACTOR: u32 = 30;

/// The most published rows one purge of a cursor-layout table reads, in seq order, to find its
/// batch of old enough ones (that layout has no `published_at` index; see `Sql::purge`).
pub(crate) const PURGE_EXAMINED_ROWS: u64 = 100_000;

/// The longest a fenced transition (complete, fail, release, extend) or a claim waits for a row
/// lock another transaction holds, as Postgres's `lock_timeout`; past it the statement fails
/// with `lock_not_available` (SQLSTATE 55P03), a transient error the relay retries.
///
/// Relays never wait for each other's row locks in normal operation: claims lock with
/// `SKIP LOCKED`, and a transition's fence matches only rows its own token holds. One lock
/// can still be in the way: a claim that read a row before another claim leased it, then
/// locked it (Postgres follows the update to the row's new version, locks it, and drops it
/// from the claim because its address changed) keeps that lock until its transaction ends;
/// if that relay freezes there, the row's holder waits for its completion until the server
/// ends the frozen claim, [`CLAIM_IDLE_TIMEOUT`] after its last statement: shorter than this
/// bound, so that such a wait ends in the row lock, not in an error.
pub(crate) const LOCK_TIMEOUT: &str = "2s";

/// The longest a claim's transaction may sit idle between its statements (Postgres's
/// `idle_in_transaction_session_timeout`, set for the claim's transaction only). A relay
/// frozen mid-claim (SIGSTOP, a paused VM) would otherwise keep the rows it locked for as long
/// as it is frozen: other claims skip them and hold back the rest of their keys. Past this
/// the server ends that session, which rolls the claim back and frees the rows; the frozen
/// relay sees a lost connection (transient) when it resumes.
///
/// Shorter than [`LOCK_TIMEOUT`]: a frozen claim may also hold a row another relay leased
/// (see there), and that relay's completion of it then waits at most this long and succeeds,
/// instead of failing after the lock bound and trying again (seen with 5 s: two failed
/// completions, 2 s each, in `cli/tests/frozen.rs` on a loaded machine). A claim's statements
/// follow each other with only the decoding of its rows between them, milliseconds; a claim
/// ended by this bound is a transient error, and nothing it leased is handed out.
pub(crate) const CLAIM_IDLE_TIMEOUT: &str = "1s";

/// The fence's clause that sets [`LOCK_TIMEOUT`] for the statement it is in: an uncorrelated
/// subquery, which Postgres runs once before reading any row (a one-time filter), in the
/// statement's own implicit transaction (`set_config(..., true)`, undone at its end).
fn bounded_lock_wait() -> String {
    format!("(SELECT set_config('lock_timeout', '{LOCK_TIMEOUT}', true)) IS NOT NULL")
}

/// The statements for one outbox table.
pub(crate) struct Sql {
    /// `"schema"."table"`.
    pub table: String,
    /// `LISTEN/NOTIFY` channel name.
    pub channel: String,
    /// Name of the unique constraint on `dedup_key`, to recognise its violations.
    pub dedup_constraint: String,
    /// Name of the primary key on `id`, to recognise a reused message id.
    pub pkey_constraint: String,
    /// Idempotent DDL (schema, table, indexes).
    pub migrate: String,
    /// Batch insert from arrays; first locks the batch's keys when configured. Sends no
    /// NOTIFY: the table's insert trigger does (see [`Sql::build`]).
    pub insert: String,
    /// `"schema"."<table>_lock_key"`: the function that serialises writers of a key.
    pub lock_function: String,
    /// Name of the statement-level insert trigger that notifies `channel`.
    pub notify_trigger: String,
    /// Claim where dead messages block their key.
    pub claim_block: String,
    /// Claim where dead messages are ignored for ordering.
    pub claim_skip: String,
    /// Second step of a claim that came back short from a full window, dead messages blocking
    /// their key: the claimable heads of keys (and unordered messages) past the window.
    pub claim_past_block: String,
    /// The same, dead messages ignored for ordering.
    pub claim_past_skip: String,
    pub complete: String,
    pub fail: String,
    pub release: String,
    /// Dead-letter undecodable rows of a claim by `seq`: `$1` the claim's token, `$2` the
    /// seqs, `$3` the reasons.
    pub quarantine: String,
    pub extend: String,
    pub list_dead: String,
    pub requeue: String,
    pub discard: String,
    /// `requeue` by seq (`$1` the seqs).
    pub requeue_seqs: String,
    /// `discard` by seq (`$1` the seqs).
    pub discard_seqs: String,
    /// The dead rows among `$1` (ids) that were dead-lettered because they did not decode
    /// (`last_error` is a quarantine reason), with the message columns: a requeue checks that
    /// they decode now.
    pub requeue_check: String,
    /// [`Sql::requeue_check`] by seq (`$1` the seqs).
    pub requeue_check_seqs: String,
    pub purge: String,
    pub counts: String,
    /// The statements of a partitioned table (`partition_interval`), `None` for a plain one.
    pub partitioned: Option<crate::partition::PartitionSql>,
    /// The cursor layout's names (`cursor_claims`), `None` for the partial-index layout.
    pub cursor: Option<crate::cursor::CursorNames>,
}

fn channel_name(schema: &str, table: &str) -> String {
    let full = format!("outbox.{schema}.{table}");
    if full.len() <= MAX_IDENT {
        return full;
    }
    let hash = format!("{:016x}", fnv1a(full.as_bytes()));
    let prefix = format!("outbox.{schema}.");
    let keep = MAX_IDENT - hash.len() - 1;
    format!("{}.{hash}", &prefix[..keep.min(prefix.len())])
}

/// Columns read back for a [`outbox_traits::Message`], in the order `row::decode` expects.
///
/// `partition_key` is read with the database's default collation whatever the column's is, so a
/// statement prepared before the README's `ALTER ... COLLATE "C"` keeps its result type; else
/// Postgres refuses to run it again on that connection ("cached plan must not change result
/// type").
const MESSAGE_COLUMNS: &str =
    "id, seq, aggregatetype, aggregateid, type, payload::text AS payload, payload_bytes, \
     content_type, headers::text AS headers, \
     partition_key COLLATE \"default\" AS partition_key, dedup_key, attempts, created_at";

/// Whether row `alias` belongs to the claim's shard: parameter `$count` is how many shards
/// the keys are split into (1: every row, the unsharded claim), `$index` which one this claim
/// takes (see [`outbox_traits::ClaimShard`]). A key maps by `hashtext` of the key, so every row
/// of a key is in one shard and per-key order needs nothing across shards; an unordered row
/// (no key) by its seq. The hash is computed on the rows the claim reads anyway (no index holds
/// it), which costs a sharded claim the rows of other shards it steps over in the claim index.
fn shard_predicate(alias: &str, count: u8, index: u8) -> String {
    shard_of(
        &format!("{alias}.partition_key"),
        &format!("{alias}.seq"),
        count,
        index,
    )
}

/// [`shard_predicate`] for a row whose key and seq are the expressions `key` and `seq`.
fn shard_of(key: &str, seq: &str, count: u8, index: u8) -> String {
    format!(
        "(${count}::int <= 1 OR (CASE WHEN {key} IS NULL THEN {seq} \
         ELSE hashtext({key})::bigint & 2147483647 END) % ${count}::int = ${index}::int)"
    )
}

/// What a claim returns for each leased row (`m`), in the order `row::decode` reads by name.
/// `partition_key` with the default collation: see [`MESSAGE_COLUMNS`].
const CLAIM_RETURNING: &str =
    "m.id, m.seq, m.aggregatetype, m.aggregateid, m.type, m.payload::text AS payload, \
     m.payload_bytes, m.content_type, m.headers::text AS headers, m.partition_key COLLATE \"default\" AS partition_key, \
     m.dedup_key, m.attempts, m.created_at";

/// The states of the rows that order a key: under Block a dead row still holds its key back.
fn ordered_states(dead_blocks: bool) -> &'static str {
    if dead_blocks {
        "('pending', 'dead')"
    } else {
        "('pending')"
    }
}

/// The SQL enqueue contract (README, "Writing from any language (SQL)"), for new tables and
/// tables made by earlier versions alike: the id default, the headers check, and the trigger
/// that gives `partition_key` its default. Each step runs only when missing, so a migration of
/// an up-to-date table takes no table lock.
fn sql_contract(schema: &str, table: &str, t: &str) -> String {
    let key_fn = derived_name(table, "partition_key");
    let key_trigger = derived_name(table, "partition_key");
    let headers_check = derived_name(table, "headers_check");
    let headers_ok = "jsonb_typeof(headers) = 'object' \
                      AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != \"string\")')";
    format!(
        r#"
-- SQL enqueue contract. `partition_key` defaults to the aggregate id; '' asks for an unordered
-- message (stored as NULL). A column default cannot read another column, hence a trigger. It
-- has no WHEN clause: one naming partition_key would forbid changing the column's type or
-- collation (the README's ALTER ... COLLATE "C" for older tables).
CREATE OR REPLACE FUNCTION "{schema}"."{key_fn}"() RETURNS trigger
LANGUAGE plpgsql AS $outbox_key$
BEGIN
    IF NEW.partition_key IS NULL THEN
        NEW.partition_key := NEW.aggregateid;
    ELSIF NEW.partition_key = '' THEN
        NEW.partition_key := NULL;
    END IF;
    RETURN NEW;
END
$outbox_key$;

DO $outbox_contract$
BEGIN
    -- Tables made before the contract: no id default (a catalog-only change).
    IF NOT EXISTS (
        SELECT 1 FROM pg_attrdef d
        JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
        WHERE d.adrelid = '{t}'::regclass AND a.attname = 'id'
    ) THEN
        ALTER TABLE {t} ALTER COLUMN id SET DEFAULT gen_random_uuid();
    END IF;
    -- Tables made before the headers check. Postgres checks every CHECK on every UPDATE, and
    -- the relay updates pending and dead rows (leases, retries, requeues): an unpublished row
    -- breaking it would stop every claim that takes it. So it is added (NOT VALID: published
    -- rows, never updated again, are not read) only when no unpublished row breaks it, with
    -- writers held off meanwhile; otherwise the relay dead-letters such rows as before, and a
    -- migration after they are discarded adds it.
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = '{t}'::regclass AND conname = '{headers_check}'
    ) THEN
        LOCK TABLE {t} IN SHARE ROW EXCLUSIVE MODE;
        IF NOT EXISTS (
            SELECT 1 FROM {t}
            WHERE state IN ('pending', 'dead') AND NOT ({headers_ok})
        ) THEN
            ALTER TABLE {t} ADD CONSTRAINT "{headers_check}" CHECK ({headers_ok}) NOT VALID;
        END IF;
    END IF;
    -- Tables made before binary payloads: the two nullable columns, added in place (a
    -- catalog-only change: no rewrite, existing rows read NULL, JSON messages).
    IF (SELECT count(*) FROM pg_attribute
        WHERE attrelid = '{t}'::regclass AND NOT attisdropped
          AND attname IN ('payload_bytes', 'content_type')) < 2 THEN
        ALTER TABLE {t}
            ADD COLUMN IF NOT EXISTS payload_bytes bytea,
            ADD COLUMN IF NOT EXISTS content_type text;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger WHERE tgrelid = '{t}'::regclass AND tgname = '{key_trigger}'
    ) THEN
        CREATE TRIGGER "{key_trigger}" BEFORE INSERT ON {t}
            FOR EACH ROW EXECUTE FUNCTION "{schema}"."{key_fn}"();
    END IF;
END
$outbox_contract$;
"#
    )
}

/// What the insert adds, with the key lock on, before its `ORDER BY`: lock the batch's keys
/// (`$7`, the partition keys) first. An uncorrelated scalar subquery is an init plan, run once
/// before the first row is read, and `seq` is drawn only after the sort has read every row:
/// so each key is locked before any of the batch's rows gets its `seq`. (`$7` appears a second
/// time here; the diesel query binds its parameters in order and leaves this one as written,
/// which names the same parameter.)
const LOCK_KEYS_FILTER: &str =
    "             WHERE (SELECT {lock_function}(VARIADIC $7::text[])) IS NOT NULL";

/// The DDL for issue 17's wake-ups and key locks, appended after the table's own so the two
/// can change independently: the insert trigger that notifies relays (or, with NOTIFY off, its
/// removal) and the key-lock function. Idempotent like the rest.
fn wakeups_and_key_locks(
    schema: &str,
    t: &str,
    channel: &str,
    notify_trigger: &str,
    lock_function: &str,
    notify: bool,
) -> String {
    let notify_function = format!("\"{schema}\".\"{notify_trigger}\"");
    let trigger = if notify {
        format!(
            r#"DO $outbox$
BEGIN
    -- No CREATE OR REPLACE TRIGGER before Postgres 14.
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = '{t}'::regclass AND tgname = '{notify_trigger}') THEN
        CREATE TRIGGER "{notify_trigger}" AFTER INSERT ON {t}
            FOR EACH STATEMENT EXECUTE FUNCTION {notify_function}();
    END IF;
END
$outbox$;"#
        )
    } else {
        format!(
            "-- NOTIFY is off for this table: relays poll, and inserts send nothing.\n\
             DROP TRIGGER IF EXISTS \"{notify_trigger}\" ON {t};"
        )
    };
    let seed = fnv1a(t.as_bytes()) as i64;
    format!(
        r#"
-- ---------------------------------------------------------------------------------------------
-- Wake-ups and key locks. Kept apart from the table's definition above.
--
-- Every INSERT statement into the table, by any writer, sends one NOTIFY to the relays
-- listening on '{channel}' (a statement-level trigger: one per statement, not per row, and
-- Postgres folds equal notifications of one transaction into one). The notification is
-- delivered at commit and is only a hint: relays poll as well.
CREATE OR REPLACE FUNCTION {notify_function}() RETURNS trigger LANGUAGE plpgsql AS $outbox$
BEGIN
    PERFORM pg_notify('{channel}', '');
    RETURN NULL;
END
$outbox$;

{trigger}

-- Per-key order follows seq, the insert order. Two transactions writing one key at once can
-- commit in the other order, and then the later-inserted message is published first. A writer
-- that calls this function first, in its transaction, holds its keys until it commits or rolls
-- back; a second writer of one of those keys waits there, so it inserts (and commits) after
-- the first. Keys are locked in sorted order, so two writers of the same keys cannot deadlock.
-- Returns how many distinct keys it locked (NULLs are skipped: unordered messages).
--   SELECT {lock_function}('order-42');
CREATE OR REPLACE FUNCTION {lock_function}(VARIADIC keys text[]) RETURNS integer
LANGUAGE plpgsql AS $outbox$
DECLARE
    locked integer;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(k, {seed}))
    FROM (SELECT DISTINCT k FROM unnest(keys) AS k WHERE k IS NOT NULL ORDER BY k) s;
    GET DIAGNOSTICS locked = ROW_COUNT;
    RETURN locked;
END
$outbox$;
"#
    )
}

/// The end of both look-past statements: lock the candidates (`cand`) by row address, as the
/// claim does (a row locked elsewhere or changed since the snapshot is skipped; a head alone
/// breaks no order), lease them, and return them in seq order.
fn lease_locked(t: &str) -> String {
    format!(
        "locked AS MATERIALIZED (
    SELECT l.ctid AS tid FROM {t} l
    WHERE l.ctid = ANY(ARRAY(SELECT tid FROM cand))
    FOR UPDATE SKIP LOCKED
),
upd AS (
    UPDATE {t} m
    SET lease_token = $2,
        lease_until = now() + $3::bigint * interval '1 microsecond'
    WHERE m.ctid = ANY(ARRAY(SELECT tid FROM locked))
    RETURNING {CLAIM_RETURNING}
)
SELECT upd.* FROM upd"
    )
}

/// A migration step that raises when the table `t` has index `index`, which only a table of the
/// other layout has (`found`): a migration lays a new table out as `wanted` and never converts
/// one. `setting` is the `cursor_claims` value that takes the table as it is.
fn layout_guard(t: &str, index: &str, found: &str, wanted: &str, setting: &str) -> String {
    format!(
        r#"-- A table made with the other layout is never converted.
DO $outbox_layout$
BEGIN
    IF to_regclass('{index}') IS NOT NULL THEN
        RAISE EXCEPTION 'the outbox table {t} has {found} (index {index}), and this migration is for {wanted}; a migration never converts a table: take the migration of a configuration with cursor_claims {setting} (PostgresConfigBuilder::cursor_claims, or ?cursor_claims={setting} in the store URL)';
    END IF;
END
$outbox_layout$;

"#
    )
}

impl Sql {
    pub(crate) fn build(
        schema: &str,
        table: &str,
        notify: bool,
        lock_keys: bool,
        delete_published: bool,
        partition_interval_s: Option<u64>,
        cursor_claims: bool,
    ) -> Self {
        let t = format!("\"{schema}\".\"{table}\"");
        let cursor = cursor_claims.then(|| crate::cursor::CursorNames::new(schema, table));
        let claim_idx = derived_name(table, "claim_idx");
        let key_idx = derived_name(table, "key_idx");
        let dead_idx = derived_name(table, "dead_idx");
        let published_idx = derived_name(table, "published_idx");
        let dedup_constraint = derived_name(table, "dedup_key");
        let pkey_constraint = derived_name(table, "pkey");
        let channel = channel_name(schema, table);
        let notify_trigger = derived_name(table, "notify");
        let lock_function = format!("\"{schema}\".\"{}\"", derived_name(table, "lock_key"));

        let migrate = format!(
            r#"DO $outbox$
DECLARE
    claim_pred text;
BEGIN
    -- CREATE SCHEMA IF NOT EXISTS checks the CREATE privilege even when the schema exists.
    IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = '{schema}') THEN
        CREATE SCHEMA "{schema}";
    END IF;
    -- Upgrade a table made by a version that stored leases as state 'leased': turn its leases
    -- into pending rows with a lease, give it spare page space, and drop the claim indexes so
    -- they are rebuilt below without 'leased' in their predicates. Runs once.
    -- The predicate is read for this one index only: deparsing other indexes (as the pg_indexes
    -- view may) fails when a concurrent transaction drops them.
    SELECT pg_get_expr(indpred, indrelid) INTO claim_pred
    FROM pg_index WHERE indexrelid = to_regclass('"{schema}"."{claim_idx}"');
    IF claim_pred LIKE '%leased%' THEN
        UPDATE {t} SET state = 'pending' WHERE state = 'leased';
        ALTER TABLE {t} SET (fillfactor = {FILLFACTOR});
        DROP INDEX "{schema}"."{claim_idx}";
        DROP INDEX "{schema}"."{key_idx}";
    END IF;
END
$outbox$;

CREATE TABLE IF NOT EXISTS {t} (
    -- Debezium outbox event router columns: id, aggregatetype, aggregateid, type, payload.
    -- A SQL writer may leave id out: a random UUID (v4); the Rust enqueue writes a v7.
    id             uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregatetype  text        NOT NULL,
    aggregateid    text        NOT NULL,
    type           text        NOT NULL,
    payload        jsonb       NOT NULL,
    -- A binary payload (Protobuf, Avro, ...): its bytes, sent untouched, and their content
    -- type (NULL: application/octet-stream). NULL bytes: a JSON message, whose body is
    -- `payload`; a binary message's `payload` is JSON null.
    payload_bytes  bytea,
    content_type   text,
    -- Relay columns.
    seq            bigint      GENERATED ALWAYS AS IDENTITY,
    headers        jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
    -- Compared bytewise (collation "C"): a key is an identifier, never sorted for people, and
    -- the claim compares keys in the per-key index and in its grouping. Under the database's
    -- default collation (e.g. C.UTF-8 or en_US) every comparison goes through the C library's
    -- strcoll; "C" is a memcmp, and the claim costs about a fifth less CPU. Equality is the
    -- same under any deterministic collation. Tables made before this column had a collation
    -- keep their default one (changing it rebuilds the per-key index under a lock), see the
    -- README.
    partition_key  text COLLATE "C",
    dedup_key      text,
    state          text        NOT NULL DEFAULT 'pending',
    attempts       integer     NOT NULL DEFAULT 0,
    available_at   timestamptz NOT NULL DEFAULT now(),
    lease_token    uuid,
    lease_until    timestamptz,
    last_error     text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz,
    CONSTRAINT "{pkey_constraint}" PRIMARY KEY (id),
    -- 'leased' is no longer written; it stays allowed so tables made by earlier versions and
    -- new ones have the same constraint.
    CONSTRAINT "{state_check}" CHECK (state IN ('pending', 'leased', 'published', 'dead')),
    -- Headers are a JSON object of strings: a row written by plain SQL with anything else is
    -- refused here rather than quarantined by the relay (tables made before this check keep
    -- their rows; the relay dead-letters a bad one, see the README).
    CONSTRAINT "{headers_check}" CHECK (
        jsonb_typeof(headers) = 'object'
        AND NOT jsonb_path_exists(headers, '$.* ? (@.type() != "string")'))
)
-- Spare space on every page, so that the new row version written by a claim, extend, release
-- or retry fits on the row's own page: a HOT update, with no index writes.
WITH (fillfactor = {fillfactor});

-- Dedup keys are unique. A partial index, not a UNIQUE constraint: most messages have no dedup
-- key, and a constraint would index their NULLs too, costing every claim and complete (each
-- writes a new row version) one more index insert.
CREATE UNIQUE INDEX IF NOT EXISTS "{dedup_constraint}" ON {t} (dedup_key)
    WHERE dedup_key IS NOT NULL;

{indexes}
{contract}"#,
            indexes = match &cursor {
                Some(names) =>
                    layout_guard(
                        &t,
                        &format!("\"{schema}\".\"{claim_idx}\""),
                        "the partial-index layout",
                        "cursor claims",
                        "false",
                    ) + &crate::cursor::ddl(table, &t, names, &shard_predicate("r", 1, 2)),
                None =>
                    layout_guard(
                        &t,
                        &format!("\"{schema}\".\"{}\"", crate::cursor::seq_index_name(table)),
                        "the cursor-claims layout",
                        "the partial-index layout",
                        "true",
                    ) + &format!(
                        r#"-- Claim scan: unpublished rows (leased or not) in seq order; stays small however much history
-- is kept.
CREATE INDEX IF NOT EXISTS "{claim_idx}" ON {t} (seq)
    WHERE state = 'pending';

-- Per-key order: a key's first unpublished (or dead) rows, one probe per key.
CREATE INDEX IF NOT EXISTS "{key_idx}" ON {t} (partition_key, seq)
    WHERE state IN ('pending', 'dead');

-- Dead letters, listed by seq.
CREATE INDEX IF NOT EXISTS "{dead_idx}" ON {t} (seq)
    WHERE state = 'dead';

-- Purge of published rows, oldest first.
CREATE INDEX IF NOT EXISTS "{published_idx}" ON {t} (published_at)
    WHERE state = 'published';"#
                    ),
            },
            state_check = derived_name(table, "state_check"),
            fillfactor = if cursor.is_some() {
                CURSOR_FILLFACTOR
            } else {
                FILLFACTOR
            },
            headers_check = derived_name(table, "headers_check"),
            contract = sql_contract(schema, table, &t),
        ) + &wakeups_and_key_locks(
            schema,
            &t,
            &channel,
            &notify_trigger,
            &lock_function,
            notify,
        );

        // An unordered message (no partition key) is written as '', which the partition key
        // trigger of `sql_contract` stores as NULL: NULL itself means "the aggregate id", as
        // for a SQL writer that leaves the column out.
        let insert_rows = format!(
            "INSERT INTO {t} (id, aggregatetype, aggregateid, type, payload, headers, \
                              partition_key, dedup_key, available_at, payload_bytes, \
                              content_type)
             SELECT u.id, u.aggregatetype, u.aggregateid, u.type, u.payload::jsonb, \
                    u.headers::jsonb, COALESCE(u.partition_key, ''), u.dedup_key, \
                    COALESCE(u.not_before, now()), u.payload_bytes, u.content_type
             FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], \
                         $7::text[], $8::text[], $9::timestamptz[], $10::bytea[], $11::text[])
                  WITH ORDINALITY AS u(id, aggregatetype, aggregateid, type, payload, headers, \
                                       partition_key, dedup_key, not_before, payload_bytes, \
                                       content_type, ord)
             ORDER BY u.ord
             RETURNING 1"
        );
        // The table's insert trigger sends the NOTIFY, for this insert as for any writer's.
        let insert = if lock_keys {
            insert_rows
                .replacen(
                    "\n             ORDER BY u.ord",
                    &format!("\n{LOCK_KEYS_FILTER}\n             ORDER BY u.ord"),
                    1,
                )
                .replace("{lock_function}", &lock_function)
        } else {
            insert_rows
        };

        let returning = CLAIM_RETURNING;
        let claim = |dead_blocks: bool| -> String {
            // Under Block a dead row holds back every later row of its key. Dead rows are not
            // in the window: one probe per candidate of the per-key index, run only when the
            // table holds a dead row at all (a one-time check of the dead-letter index).
            // In the cursor layout a dead row has a `last_error` (a CHECK), which puts it in the
            // small index of failed rows by key.
            let failed = |alias: &str| {
                if cursor.is_some() {
                    format!("{alias}.last_error IS NOT NULL AND ")
                } else {
                    String::new()
                }
            };
            let dead_before = if dead_blocks {
                format!(
                    "
           AND (NOT (SELECT EXISTS (SELECT 1 FROM {t} x WHERE {failed_x}x.state = 'dead'))
                OR NOT EXISTS (
                    SELECT 1 FROM {t} d
                    WHERE d.partition_key = c.partition_key AND {failed_d}d.state = 'dead'
                      AND d.seq < c.seq))",
                    failed_x = failed("x"),
                    failed_d = failed("d"),
                )
            } else {
                String::new()
            };
            let claimable = |alias: &str| {
                format!(
                    "{alias}.available_at <= now() \
                     AND ({alias}.lease_until IS NULL OR {alias}.lease_until <= now())"
                )
            };
            // The window: the shard's first $4 unpublished rows in seq order.
            let (win, cursor_seq) = match &cursor {
                None => (
                    format!(
                        "SELECT w.ctid AS tid, w.id, w.seq, w.partition_key,
           {claimable_w} AS claimable
    FROM {t} w WHERE w.state = 'pending' AND {shard_w} ORDER BY w.seq LIMIT $4",
                        claimable_w = claimable("w"),
                        shard_w = shard_predicate("w", 5, 6),
                    ),
                    "",
                ),
                // From the shard's cursor (every row of the shard below it is published, aside or
                // rolled back, for good, as this statement's snapshot sees it: the claim's
                // `BEGIN` moved it in this transaction), and the pending rows aside below it.
                Some(_) => (
                    format!(
                        "SELECT x.* FROM (
        (SELECT w.ctid AS tid, w.id, w.seq, w.partition_key, {claimable_w} AS claimable
         FROM {t} w
         WHERE w.seq >= (SELECT seq FROM cur) AND w.state = 'pending' AND {shard_w}
         ORDER BY w.seq LIMIT $4)
        UNION ALL
        (SELECT a.ctid, a.id, a.seq, a.partition_key, {claimable_a}
         FROM {t} a
         WHERE {aside_a} AND a.seq < (SELECT seq FROM cur) AND a.state = 'pending'
           AND {shard_a}
         ORDER BY a.seq LIMIT $4)
    ) x ORDER BY x.seq LIMIT $4",
                        claimable_w = claimable("w"),
                        claimable_a = claimable("a"),
                        aside_a = crate::cursor::aside("a"),
                        shard_w = shard_predicate("w", 5, 6),
                        shard_a = shard_predicate("a", 5, 6),
                    ),
                    ", (SELECT seq FROM cur) AS cursor_seq",
                ),
            };
            let cur = match &cursor {
                None => String::new(),
                Some(names) => format!(
                    "cur AS MATERIALIZED (
    -- The shard's cursor, as this statement's snapshot sees it.
    SELECT COALESCE((SELECT c.below FROM {cursors} c WHERE c.shards = $5 AND c.shard = $6), 0)
        AS seq
),
",
                    cursors = names.cursors
                ),
            };
            format!(
                r#"WITH {cur}win AS MATERIALIZED (
    -- The window: the first $4 unpublished rows in seq order (leased or not). A claim reads
    -- at most these, however long a blocked key's backlog is; when it comes back short, the
    -- window's end tells `claim_past` where to look past it. Not locked here: only the chosen
    -- candidates are, below.
    {win}
),
-- How many of the window's rows are held (leased, or not due), counted once.
held AS MATERIALIZED (
    SELECT count(*) AS n FROM win h WHERE NOT h.claimable
),
ranked AS MATERIALIZED (
    -- The window is a prefix of the unpublished rows in seq order, so every unpublished
    -- row of a key before a window row is in the window too: a row's place in its key,
    -- and whether every earlier row of its key is claimable, come from the window alone,
    -- sorted by key, with no probe of the per-key index (a probe cost more than the rest
    -- of the claim: it steps over the index entries that the key's finished rows left
    -- behind). Only dead rows, which are not in the window, need a probe, and only when
    -- the table holds one.
    SELECT win.*,
           -- The row's place among its key's unpublished rows: 1 for the key's head.
           row_number() OVER keyed AS key_rank,
           bool_and(win.claimable) OVER keyed AS prefix_claimable
    FROM win
    -- Only when something is held (otherwise no row of it is read).
    WHERE (SELECT n FROM held) > 0
    WINDOW keyed AS (PARTITION BY win.partition_key ORDER BY win.seq
                     ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
),
cand AS MATERIALIZED (
    -- Nothing held in the window (the common case: no batch in flight ahead, no retry, no
    -- relay met): every row is claimable, so every key's rows pass the checks below, and the
    -- candidates are the window's first rows in seq order (each key's first ones), taken without
    -- sorting the window by key. Their place in their key (`key_rank`) is left NULL: the
    -- prefix check after the lock needs it only when a lock was refused, and then counts it
    -- from the candidates, of which each key's are its first unpublished rows.
    (SELECT c.tid, c.id, c.seq, c.partition_key, NULL::bigint AS key_rank
     FROM win c
     WHERE (SELECT n FROM held) = 0
       AND (c.partition_key IS NULL OR (true{dead_before}))
     ORDER BY c.seq
     LIMIT $1)
    UNION ALL
    (SELECT c.tid, c.id, c.seq, c.partition_key, c.key_rank
    FROM ranked c
    -- Due, and not leased or with an expired lease (reclaimed: the old token loses its fence).
    WHERE c.claimable
      -- Skip keys whose first unpublished row is not claimable (leased to another relay,
      -- waiting for a retry, not yet due) and rows behind any such row of their key (a key
      -- blocked in the middle of its backlog must not fill the LIMIT with rows the prefix
      -- check below drops, hiding other keys' claimable rows), so that a blocked key's
      -- backlog cannot fill the LIMIT and starve every other key.
      AND (c.partition_key IS NULL OR (c.prefix_claimable{dead_before}))
    ORDER BY c.seq
    LIMIT $1)
),
-- Lock the candidates by their row address. A row locked by a concurrent transaction is
-- skipped; so is one changed since this statement's snapshot (locking follows it to its new
-- version, whose address is not in the list). Either way the prefix check below holds back the
-- rest of its key.
locked AS MATERIALIZED (
    SELECT l.ctid AS tid FROM {t} l
    WHERE l.ctid = ANY(ARRAY(SELECT tid FROM cand))
    FOR UPDATE SKIP LOCKED
),
-- Whether the lock returned every candidate (`locked` holds only candidates, so as many rows
-- means the same rows), decided once.
all_locked AS MATERIALIZED (
    SELECT (SELECT count(*) FROM locked) = (SELECT count(*) FROM cand) AS yes
),
-- Prefix check: the i-th locked candidate of a key may go only if it is the key's i-th
-- unpublished row (its `key_rank`, from the window, read in this statement's snapshot as the
-- locks were). A key's candidates are its first unpublished rows, so a row skipped by the lock
-- breaks the match for every later row of its key: nothing passes an earlier message of its
-- key. Unordered messages (no key) go as they are.
chosen AS (
    -- Every candidate locked (a claim that met no other): each key's candidates are its first
    -- unpublished rows, ranks 1 to n, so all pass the check, and it is not run.
    SELECT c.tid FROM cand c
    WHERE (SELECT yes FROM all_locked)
    UNION ALL
    SELECT r.tid FROM (
        SELECT c.tid, c.partition_key, c.rank,
               row_number() OVER (PARTITION BY c.partition_key ORDER BY c.seq) AS rn
        FROM (
            SELECT cc.*, COALESCE(cc.key_rank, row_number() OVER (
                       PARTITION BY cc.partition_key ORDER BY cc.seq)) AS rank
            FROM cand cc
        ) c
        JOIN locked l ON l.tid = c.tid
        WHERE NOT (SELECT yes FROM all_locked)
    ) r
    WHERE r.partition_key IS NULL OR r.rn = r.rank
),
upd AS (
    -- Only the lease columns change: a HOT update when the page has room. By row address:
    -- these rows are locked and unchanged since the snapshot, so the address is theirs.
    UPDATE {t} m
    SET lease_token = $2,
        lease_until = now() + $3::bigint * interval '1 microsecond'
    WHERE m.ctid = ANY(ARRAY(SELECT tid FROM chosen))
    RETURNING {returning}
)
-- One row even when nothing was claimed, to return the lease end in the same round trip, and
-- the window's end: when the claim came back short, the seq of the window's last row if the
-- window was full (NULL if it held every unpublished row, as on an idle relay's polls, which
-- then need no second statement). `claim_past` looks past that seq. And how many of the
-- window's rows were held (leased or not due) or waited behind a held row of their key: the
-- store sizes the shard's next window by it.
SELECT l.*, upd.*
FROM (SELECT now() + $3::bigint * interval '1 microsecond' AS lease_until,
             CASE WHEN (SELECT count(*) FROM upd) < $1 THEN (
                 SELECT max(w.seq) FROM win w HAVING count(*) >= $4
             ) END AS window_end,
             (SELECT count(*) FROM ranked r
              WHERE NOT (r.claimable AND (r.partition_key IS NULL OR r.prefix_claimable)))
                 AS window_held{cursor_seq}) l
-- In no particular order: the store hands the batch out in seq order (it sorts it with the
-- rows a look past the window adds).
LEFT JOIN upd ON true"#,
            )
        };

        // Runs after `claim`, in its transaction, when that came back short: the rows past a
        // full window may hold claimable keys that a long blocked backlog kept out of it. Takes
        // only heads (a key's first unpublished row, always safe to take alone) and unordered
        // messages, oldest first. With few keys (at most the window's size) it finds them key
        // by key, one index probe per key, whatever the backlog (a backlog of keys whose heads
        // are leased: 3 ms instead of 92 over 100,000 rows and 100 keys); with more keys it
        // reads the rows past the window, which for rows not due costs less than a probe per
        // key (100,000 keys: 37 ms instead of 1.1 s). It sees the leases `claim` just took (same
        // transaction), so it takes no key twice.
        let claim_past = |dead_blocks: bool| -> String {
            let ordered_states = ordered_states(dead_blocks);
            format!(
                r#"WITH RECURSIVE bound AS MATERIALIZED (
    -- The last row of `claim`'s full window ($5, its `window_end`). Like `claim`, it looks
    -- only at the keys of its shard ($6 shards, this one $7; see `shard_predicate`).
    SELECT $5::bigint AS seq WHERE $5::bigint IS NOT NULL
),
keys AS (
    -- A loose scan of the per-key index: each step jumps to the next key. It stops after $4
    -- keys: past that, reading the rows past the window costs less than a probe per key.
    SELECT (SELECT min(k.partition_key) FROM {t} k
            WHERE k.state IN {ordered_states} AND k.partition_key IS NOT NULL) AS key,
           1 AS n
    FROM bound
    UNION ALL
    SELECT (SELECT min(k.partition_key) FROM {t} k
            WHERE k.state IN {ordered_states} AND k.partition_key > keys.key),
           keys.n + 1
    FROM keys
    WHERE keys.key IS NOT NULL AND keys.n <= $4
),
-- Whether the loose scan reached the last key (NULL when there is nothing past the window).
walked AS MATERIALIZED (
    SELECT bool_or(key IS NULL) AS all_keys FROM keys
),
cand AS MATERIALIZED (
    SELECT x.tid, x.seq FROM (
        -- Few keys: each key's head, when it is claimable and past the window.
        SELECT h.tid, h.seq
        FROM keys
        CROSS JOIN LATERAL (
            SELECT h.ctid AS tid, h.seq,
                   h.state = 'pending' AND h.available_at <= now()
                   AND (h.lease_until IS NULL OR h.lease_until <= now()) AS claimable
            FROM {t} h
            WHERE h.partition_key = keys.key AND h.state IN {ordered_states}
            ORDER BY h.seq
            LIMIT 1
        ) h
        WHERE (SELECT all_keys FROM walked) AND h.claimable AND h.seq > (SELECT seq FROM bound)
          AND {shard_h}
        UNION ALL
        (SELECT u.ctid, u.seq FROM {t} u
         WHERE (SELECT all_keys FROM walked)
           AND u.partition_key IS NULL AND u.state = 'pending'
           AND u.seq > (SELECT seq FROM bound) AND {shard_u}
           AND u.available_at <= now() AND (u.lease_until IS NULL OR u.lease_until <= now())
         ORDER BY u.seq
         LIMIT $1)
        UNION ALL
        -- Many keys: the rows past the window in seq order, keeping unordered ones and heads
        -- (the head probe is memoized per key, so a blocked key's rows cost no probe each).
        (SELECT c.ctid, c.seq
         FROM {t} c
         LEFT JOIN LATERAL (
             SELECT h.seq, h.state = 'pending' AND h.available_at <= now()
                    AND (h.lease_until IS NULL OR h.lease_until <= now()) AS claimable
             FROM {t} h
             WHERE h.partition_key = c.partition_key AND h.state IN {ordered_states}
             ORDER BY h.seq
             LIMIT 1
         ) head ON true
         WHERE NOT (SELECT all_keys FROM walked)
           AND c.state = 'pending' AND c.seq > (SELECT seq FROM bound) AND {shard_c}
           AND c.available_at <= now() AND (c.lease_until IS NULL OR c.lease_until <= now())
           AND (c.partition_key IS NULL OR (head.claimable AND head.seq = c.seq))
         ORDER BY c.seq
         LIMIT $1)
    ) x
    ORDER BY x.seq
    LIMIT $1
),
{lease_locked}"#,
                shard_h = shard_of("keys.key", "h.seq", 6, 7),
                lease_locked = lease_locked(&t),
                shard_u = shard_predicate("u", 6, 7),
                shard_c = shard_predicate("c", 6, 7),
            )
        };

        // `claim_past` in the cursor layout: as `claim_past`, with every read of unpublished
        // rows split in two, from the cursor up in the plain indexes and aside below it. The
        // loose scan of keys walks the plain per-key index, which holds every kept row: each
        // step is one descent to the next key, but keys whose rows are all published count
        // too, so a table with more than $4 keys in its kept history takes the many-keys path.
        // `$8` is the cursor the claim read (a cursor stays right for every later snapshot).
        let claim_past_cursor = |dead_blocks: bool| -> String {
            let ordered_states = ordered_states(dead_blocks);
            let claimable = |alias: &str| {
                format!(
                    "{alias}.state = 'pending' AND {alias}.available_at <= now() \
                     AND ({alias}.lease_until IS NULL OR {alias}.lease_until <= now())"
                )
            };
            // The first row in `ordered_states` of key `key`: its seq, and whether it is
            // claimable.
            let head = |key: &str| {
                format!(
                    "SELECT hh.tid, hh.seq, hh.claimable FROM (
                 (SELECT h.ctid AS tid, h.seq, {claimable_h} AS claimable FROM {t} h
                  WHERE h.partition_key = {key} AND h.seq >= $8::bigint
                    AND h.state IN {ordered_states}
                  ORDER BY h.seq LIMIT 1)
                 UNION ALL
                 (SELECT h.ctid, h.seq, {claimable_h} FROM {t} h
                  WHERE h.partition_key = {key} AND {aside_h} AND h.seq < $8::bigint
                    AND h.state IN {ordered_states}
                  ORDER BY h.seq LIMIT 1)
             ) hh ORDER BY hh.seq LIMIT 1",
                    claimable_h = claimable("h"),
                    aside_h = crate::cursor::aside("h"),
                )
            };
            // Rows `c` past the window, pending and due, in `range`, with `extra` conditions.
            let past = |range: &str, extra: &str| {
                format!(
                    "(SELECT c.ctid AS tid, c.seq
         FROM {t} c
         LEFT JOIN LATERAL ({head_c}) head ON true
         WHERE {range} AND c.seq > (SELECT seq FROM bound) AND c.state = 'pending'
           AND {shard_c}
           AND c.available_at <= now() AND (c.lease_until IS NULL OR c.lease_until <= now())
           AND {extra}
         ORDER BY c.seq
         LIMIT $1)",
                    head_c = head("c.partition_key"),
                    shard_c = shard_predicate("c", 6, 7),
                )
            };
            let aside_c = crate::cursor::aside("c");
            let many = "NOT (SELECT all_keys FROM walked) \
                        AND (c.partition_key IS NULL OR (head.claimable AND head.seq = c.seq))";
            let unordered = "(SELECT all_keys FROM walked) AND c.partition_key IS NULL";
            format!(
                r#"WITH RECURSIVE bound AS MATERIALIZED (
    -- The last row of `claim`'s full window ($5, its `window_end`).
    SELECT $5::bigint AS seq WHERE $5::bigint IS NOT NULL
),
keys AS (
    -- A loose scan of the per-key index, one descent per key. It stops after $4 keys.
    SELECT (SELECT min(k.partition_key) FROM {t} k WHERE k.partition_key IS NOT NULL) AS key,
           1 AS n
    FROM bound
    UNION ALL
    SELECT (SELECT min(k.partition_key) FROM {t} k WHERE k.partition_key > keys.key),
           keys.n + 1
    FROM keys
    WHERE keys.key IS NOT NULL AND keys.n <= $4
),
walked AS MATERIALIZED (
    SELECT bool_or(key IS NULL) AS all_keys FROM keys
),
cand AS MATERIALIZED (
    SELECT x.tid, x.seq FROM (
        -- Few keys: each key's head, when it is claimable and past the window.
        SELECT h.tid, h.seq
        FROM keys
        CROSS JOIN LATERAL ({head_keys}) h
        WHERE (SELECT all_keys FROM walked) AND h.claimable AND h.seq > (SELECT seq FROM bound)
          AND {shard_h}
        UNION ALL
        {unordered_above}
        UNION ALL
        {unordered_below}
        UNION ALL
        -- Many keys: the rows past the window in seq order, keeping unordered ones and heads.
        {many_above}
        UNION ALL
        {many_below}
    ) x
    ORDER BY x.seq
    LIMIT $1
),
{lease_locked}"#,
                head_keys = head("keys.key"),
                lease_locked = lease_locked(&t),
                shard_h = shard_of("keys.key", "h.seq", 6, 7),
                unordered_above = past("c.seq >= $8::bigint", unordered),
                unordered_below = past(&format!("{aside_c} AND c.seq < $8::bigint"), unordered),
                many_above = past("c.seq >= $8::bigint", many),
                many_below = past(&format!("{aside_c} AND c.seq < $8::bigint"), many),
            )
        };

        // Every transition is fenced on the token, an unexpired lease (database clock) and the
        // pending state (a lease is held by a pending row); RETURNING id tells which messages
        // were not held.
        // Each also bounds its wait for a row lock (see `LOCK_TIMEOUT`).
        let fence = format!(
            "lease_token = $1 AND state = 'pending' AND lease_until > now() AND {}",
            bounded_lock_wait()
        );

        // A released or requeued row is due now. In the cursor layout it must also stay aside
        // (`available_at > created_at`), whatever the database clock did since it was written.
        let due_now = if cursor.is_some() {
            "GREATEST(now(), created_at + interval '1 microsecond')"
        } else {
            "now()"
        };
        // The cursor layout lists dead rows through the aside index (a dead row is aside).
        let dead_listed = match &cursor {
            Some(_) => format!("{} AND ", crate::cursor::aside("dead_row")),
            None => String::new(),
        };
        let sql = Self {
            // Deleting writes no new row version and no index entries: about a third of the
            // cost of marking the row published.
            complete: if delete_published {
                format!(
                    "DELETE FROM {t}
                     WHERE id = ANY($2) AND {fence}
                     RETURNING id"
                )
            } else if cursor.is_some() {
                // Takes the row out of aside too; for an ordinary row neither value changes,
                // and no indexed one does: a HOT update.
                format!(
                    "UPDATE {t} SET state = 'published', published_at = now(), \
                     lease_token = NULL, lease_until = NULL, last_error = NULL, \
                     available_at = LEAST(available_at, created_at)
                     WHERE id = ANY($2) AND {fence}
                     RETURNING id"
                )
            } else {
                format!(
                    "UPDATE {t} SET state = 'published', published_at = now(), \
                     lease_token = NULL, lease_until = NULL
                     WHERE id = ANY($2) AND {fence}
                     RETURNING id"
                )
            },
            release: format!(
                "UPDATE {t} SET available_at = {due_now}, lease_token = NULL, lease_until = NULL
                 WHERE id = ANY($2) AND {fence}
                 RETURNING id"
            ),
            quarantine: format!(
                "UPDATE {t} m
                 SET state = 'dead', last_error = q.reason, lease_token = NULL, lease_until = NULL
                 FROM UNNEST($2::bigint[], $3::text[]) AS q(seq, reason)
                 WHERE m.seq = q.seq AND m.lease_token = $1 AND m.state = 'pending'"
            ),
            fail: format!(
                "UPDATE {t} m
                 SET attempts = m.attempts + 1,
                     last_error = f.error,
                     state = CASE WHEN f.dead THEN 'dead' ELSE 'pending' END,
                     available_at = CASE WHEN f.dead THEN m.available_at
                                         ELSE now() + f.delay_us * interval '1 microsecond' END,
                     lease_token = NULL, lease_until = NULL
                 FROM UNNEST($2::uuid[], $3::text[], $4::bool[], $5::bigint[])
                      AS f(id, error, dead, delay_us)
                 WHERE m.id = f.id AND m.lease_token = $1 AND m.state = 'pending' \
                   AND m.lease_until > now() AND {bounded}
                 RETURNING m.id",
                bounded = bounded_lock_wait()
            ),
            extend: format!(
                "WITH u AS (
                     UPDATE {t} SET lease_until = now() + $2::bigint * interval '1 microsecond'
                     WHERE {fence}
                     RETURNING 1
                 )
                 SELECT count(*) AS held, now() + $2::bigint * interval '1 microsecond' AS lease_until
                 FROM u"
            ),
            list_dead: format!(
                "SELECT {MESSAGE_COLUMNS}, COALESCE(last_error, '') AS last_error
                 FROM {t} dead_row
                 WHERE {dead_listed}state = 'dead' AND seq > $1
                 ORDER BY seq
                 LIMIT $2"
            ),
            requeue: format!(
                "UPDATE {t} SET state = 'pending', attempts = 0, available_at = {due_now}, \
                 lease_token = NULL, lease_until = NULL
                 WHERE state = 'dead' AND id = ANY($1)"
            ),
            discard: format!("DELETE FROM {t} WHERE state = 'dead' AND id = ANY($1)"),
            requeue_seqs: format!(
                "UPDATE {t} SET state = 'pending', attempts = 0, available_at = {due_now}, \
                 lease_token = NULL, lease_until = NULL
                 WHERE state = 'dead' AND seq = ANY($1)"
            ),
            discard_seqs: format!("DELETE FROM {t} WHERE state = 'dead' AND seq = ANY($1)"),
            requeue_check: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {t}
                 WHERE state = 'dead' AND id = ANY($1) AND last_error LIKE '{quarantined}%'",
                quarantined = outbox_sql_support::quarantine::REASON_PREFIX,
            ),
            requeue_check_seqs: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {t}
                 WHERE state = 'dead' AND seq = ANY($1) AND last_error LIKE '{quarantined}%'",
                quarantined = outbox_sql_support::quarantine::REASON_PREFIX,
            ),
            // The ctid list bounds the batch; a DELETE with a LIMIT needs that subquery, and
            // ctids are stable here because published rows are never updated.
            purge: if cursor.is_some() {
                // No index on `published_at` here: up to $2 of the old enough published rows,
                // read in seq order from the seq index. Rows are published about in seq order,
                // so this reads about a batch. The inner LIMIT bounds the read when few rows
                // are old enough: with more than [`PURGE_EXAMINED_ROWS`] young published rows
                // below the old ones a call deletes fewer than it could, and later calls find
                // the rest as they age. (Taking the oldest $2 by seq and keeping the old enough
                // among them broke the contract: one row published just now, low in seq, made
                // `purge(at most 1)` delete nothing while an older one was due.)
                format!(
                    "DELETE FROM {t}
                     WHERE ctid = ANY(ARRAY(
                         SELECT p.ctid FROM (
                             SELECT ctid, published_at FROM {t}
                             WHERE state = 'published'
                             ORDER BY seq
                             LIMIT {PURGE_EXAMINED_ROWS}) p
                         WHERE p.published_at < now() - $1::bigint * interval '1 microsecond'
                         LIMIT $2))
                       AND state = 'published'"
                )
            } else {
                format!(
                    "DELETE FROM {t}
                     WHERE ctid = ANY(ARRAY(
                         SELECT ctid FROM {t}
                         WHERE state = 'published'
                           AND published_at < now() - $1::bigint * interval '1 microsecond'
                         ORDER BY published_at
                         LIMIT $2))
                       AND state = 'published'"
                )
            },
            counts: format!(
                "SELECT count(*) FILTER (WHERE state = 'pending' AND lease_token IS NULL) AS pending,
                        count(*) FILTER (WHERE state = 'pending' AND lease_token IS NOT NULL)
                            AS leased,
                        count(*) FILTER (WHERE state = 'published') AS published,
                        count(*) FILTER (WHERE state = 'dead') AS dead
                 FROM {t}"
            ),
            claim_block: claim(true),
            claim_skip: claim(false),
            claim_past_block: if cursor.is_some() {
                claim_past_cursor(true)
            } else {
                claim_past(true)
            },
            claim_past_skip: if cursor.is_some() {
                claim_past_cursor(false)
            } else {
                claim_past(false)
            },
            insert,
            lock_function,
            notify_trigger,
            migrate,
            dedup_constraint,
            pkey_constraint,
            channel,
            table: t,
            partitioned: None,
            cursor,
        };
        match partition_interval_s {
            None => sql,
            Some(interval_s) => crate::partition::partitioned(sql, schema, table, interval_s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_insert_leaves_waking_to_the_trigger_and_locks_keys_only_when_asked(
    ) -> Result<(), Box<dyn std::error::Error>> {
        for notify in [false, true] {
            let plain = Sql::build("s", "t", notify, false, false, None, false);
            assert!(!plain.insert.contains("pg_notify"), "{}", plain.insert);
            assert!(!plain.insert.contains("lock_key"));
            let locked = Sql::build("s", "t", notify, true, false, None, false);
            assert!(locked
                .insert
                .contains(r#"WHERE (SELECT "s"."t_lock_key"(VARIADIC $7::text[])) IS NOT NULL"#));
            // The lock filter comes before the rows' order, which the seqs follow.
            let filter = locked
                .insert
                .find("WHERE (SELECT")
                .ok_or("no key-lock filter")?;
            let order = locked.insert.find("ORDER BY u.ord").ok_or("no ORDER BY")?;
            assert!(filter < order);
            assert_eq!(
                plain.migrate.contains("CREATE TRIGGER \"t_notify\""),
                notify,
                "{}",
                plain.migrate
            );
            assert_eq!(plain.migrate.contains("DROP TRIGGER IF EXISTS"), !notify);
            assert!(plain
                .migrate
                .contains(r#"CREATE OR REPLACE FUNCTION "s"."t_lock_key"(VARIADIC keys text[])"#));
        }
        Ok(())
    }
}
