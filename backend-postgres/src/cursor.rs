//! Cursor claims ([`PostgresConfigBuilder::cursor_claims`](crate::PostgresConfigBuilder::cursor_claims)):
//! the table layout of `docs/keep-cursor.md`, in which completing a message that is kept is a
//! HOT update.
//!
//! `state` is in no index and no index predicate. So the completion's `UPDATE ... SET state =
//! 'published'` changes no indexed value and, with the table's spare page space, writes no index
//! entry. The claim then cannot find the unpublished rows through a partial index. It starts
//! instead from a per-shard **cursor**, a seq below which every row of the shard is published,
//! **aside** or rolled back for good, and reads:
//! - the pending rows at or above the cursor, in the plain `(seq)` index;
//! - the pending rows aside below it, in a small partial index of their own.
//!
//! A row is aside when it failed, was released or requeued, was dead-lettered or is scheduled:
//! `last_error IS NOT NULL OR available_at > created_at`. Those paths are rare, and they keep a
//! row aside until it is published; the completion takes it out (`last_error = NULL`,
//! `available_at = LEAST(available_at, created_at)`, both unchanged for an ordinary row, so the
//! update stays HOT). So a row below a cursor never becomes plainly pending again: a cursor that
//! was right once stays right.
//!
//! **The cursor moves only over settled seqs** (`settle`, run in every claim's `BEGIN`). Seq
//! order is not commit order: a writer that drew seq 100 may commit after rows up to 10,000
//! were published. A move is in two steps, in two claims:
//! 1. Note a point: the identity sequence's last value L, then, in a later statement, V, the
//!    virtual transactions holding a write lock on the table or its sequence. A transaction
//!    that drew a seq up to L drew it before L was read, holding its lock on the table (taken
//!    before the seq is drawn, held to its end), so it had ended by the time V was read, or is
//!    in V.
//! 2. Once no transaction of V holds a lock any more, every seq up to L is committed or rolled
//!    back. A later statement, with a later snapshot, moves the cursor to the shard's first
//!    pending row not aside up to L, or to L + 1, and notes the next point.
//!
//! A transaction that holds a write lock on the table for long (a writer left open) stops the
//! cursor, not the claims: they read from where it stopped. Readers (`AccessShareLock`) do not
//! stop it.

use outbox_traits::Error;

use crate::config::PostgresConfig;
use crate::sql::derived_name;

/// The names the cursor layout adds to a table.
pub(crate) struct CursorNames {
    /// `"schema"."<table>_cursors"`: one cursor per claim shard.
    pub cursors: String,
    /// `"schema"."<table>_settle"`: the function that moves a shard's cursor.
    pub settle: String,
    /// The plain `(seq)` index's name (unqualified): its presence tells a table of this layout.
    pub seq_idx: String,
}

impl CursorNames {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        Self {
            cursors: format!("\"{schema}\".\"{}\"", derived_name(table, "cursors")),
            settle: format!("\"{schema}\".\"{}\"", derived_name(table, "settle")),
            seq_idx: seq_index_name(table),
        }
    }
}

/// Whether row `alias` is aside: failed, released, requeued, dead-lettered or scheduled. Spelled
/// exactly as the aside indexes' predicate, so that the planner matches it to them.
pub(crate) fn aside(alias: &str) -> String {
    format!("({alias}.last_error IS NOT NULL OR {alias}.available_at > {alias}.created_at)")
}

/// The index section of the migration for a table of the cursor layout, the dead-letter check,
/// the cursor table and the settle function. `t` is `"schema"."table"`; `shard_r` is the shard
/// predicate over row `r` with the function's parameters (`$1` the count, `$2` the index).
pub(crate) fn ddl(table: &str, t: &str, names: &CursorNames, shard_r: &str) -> String {
    let seq_idx = &names.seq_idx;
    let key_seq_idx = derived_name(table, "key_seq_idx");
    let aside_idx = derived_name(table, "aside_idx");
    let aside_key_idx = derived_name(table, "aside_key_idx");
    let failed_key_idx = derived_name(table, "failed_key_idx");
    let dead_check = derived_name(table, "dead_check");
    let cursors = &names.cursors;
    let settle = &names.settle;
    let aside_r = aside("r");
    format!(
        r#"-- Cursor claims (docs/keep-cursor.md): `state` is in no index nor index predicate, so the
-- completion that marks a row published is a HOT update. Claims read from a per-shard cursor in
-- the plain seq index, and the rows aside (failed, released, requeued, dead or scheduled) below
-- it through the two aside indexes.
CREATE INDEX IF NOT EXISTS "{seq_idx}" ON {t} (seq);
CREATE INDEX IF NOT EXISTS "{key_seq_idx}" ON {t} (partition_key, seq);
CREATE INDEX IF NOT EXISTS "{aside_idx}" ON {t} (seq)
    WHERE last_error IS NOT NULL OR available_at > created_at;
CREATE INDEX IF NOT EXISTS "{aside_key_idx}" ON {t} (partition_key, seq)
    WHERE last_error IS NOT NULL OR available_at > created_at;
-- Dead and retrying rows by key: the claim's check for a dead row ahead of a key (Block).
CREATE INDEX IF NOT EXISTS "{failed_key_idx}" ON {t} (partition_key, seq)
    WHERE last_error IS NOT NULL;

DO $outbox_cursor$
BEGIN
    -- A dead row is aside through its last_error: one without would be passed by the cursor.
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = '{t}'::regclass AND conname = '{dead_check}'
    ) THEN
        ALTER TABLE {t} ADD CONSTRAINT "{dead_check}"
            CHECK (state <> 'dead' OR last_error IS NOT NULL);
    END IF;
    -- A sequence that caches hands a session's seqs out long after they were drawn, past a
    -- cursor that read the sequence meanwhile.
    -- Read from the catalog by the sequence's oid: the pg_sequences view, filtered by name,
    -- would resolve every sequence of the database, and fail when another schema is dropped
    -- meanwhile.
    IF EXISTS (
        SELECT 1 FROM pg_sequence s
        WHERE s.seqrelid = pg_get_serial_sequence('{t}', 'seq')::regclass
          AND s.seqcache <> 1
    ) THEN
        ALTER TABLE {t} ALTER COLUMN seq SET CACHE 1;
    END IF;
END
$outbox_cursor$;

-- One cursor per claim shard (`shards` keys split this many ways, this one `shard`; 1 and 0
-- for an unsharded claim).
CREATE TABLE IF NOT EXISTS {cursors} (
    shards  integer NOT NULL,
    shard   integer NOT NULL,
    -- Every row of the shard below this seq is published, aside, or was rolled back, for good.
    below   bigint  NOT NULL,
    -- The point noted for the next move: the identity sequence's last value, and the virtual
    -- transactions that then held a write lock on the table or its sequence.
    point_l bigint,
    point_v text[],
    PRIMARY KEY (shards, shard)
);

-- Move shard ($1 shards, this one $2)'s cursor over what has settled, and note the next point;
-- returns the cursor (NULL when another claim of the shard holds it, or it was just made).
-- Each statement of a plpgsql function takes a fresh snapshot (read committed), so the scan
-- below sees every transaction the check before it found ended.
CREATE OR REPLACE FUNCTION {settle}(integer, integer) RETURNS bigint
LANGUAGE plpgsql AS $outbox_settle$
DECLARE
    cur bigint;
    l bigint;
    v text[];
    seqrel regclass := pg_get_serial_sequence('{t}', 'seq')::regclass;
BEGIN
    SELECT c.below, c.point_l, c.point_v INTO cur, l, v
    FROM {cursors} c WHERE c.shards = $1 AND c.shard = $2
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM {cursors} c WHERE c.shards = $1 AND c.shard = $2) THEN
            -- Another claim of this shard is moving it.
            RETURN NULL;
        END IF;
        -- A new shard: below the smallest cursor of a shard count whose every shard has one,
        -- every row of every shard is settled and not plainly pending.
        INSERT INTO {cursors} (shards, shard, below)
        SELECT $1, $2, COALESCE(max(s.low), 0) FROM (
            SELECT min(c.below) AS low FROM {cursors} c
            GROUP BY c.shards HAVING count(*) = min(c.shards)
        ) s
        ON CONFLICT DO NOTHING;
        RETURN NULL;
    END IF;
    IF v IS NOT NULL THEN
        IF current_setting('transaction_isolation') <> 'read committed'
           OR EXISTS (
               SELECT 1 FROM pg_locks k
               WHERE k.virtualtransaction = ANY(v) AND k.relation IN ('{t}'::regclass, seqrel))
           OR EXISTS (
               -- A prepared transaction (two-phase commit) keeps its locks with no backend
               -- (pid NULL). Postgres 15 shows them under the virtual transaction noted; any
               -- prepared writer of the table waits whatever id a version shows.
               SELECT 1 FROM pg_locks k
               WHERE k.pid IS NULL AND k.relation IN ('{t}'::regclass, seqrel)
                 AND k.mode = 'RowExclusiveLock')
        THEN
            -- A writer of the point is still open (or the snapshot is not fresh per statement).
            RETURN cur;
        END IF;
        cur := GREATEST(cur, COALESCE((
            SELECT r.seq FROM {t} r
            WHERE r.seq >= cur AND r.seq <= l AND r.state = 'pending'
              AND NOT {aside_r} AND {shard_r}
            ORDER BY r.seq
            LIMIT 1), l + 1));
    END IF;
    -- The next point: L, then V in a later statement.
    l := COALESCE(pg_sequence_last_value(seqrel), 0);
    v := ARRAY(
        SELECT DISTINCT k.virtualtransaction FROM pg_locks k
        WHERE k.relation IN ('{t}'::regclass, seqrel)
          AND k.mode = 'RowExclusiveLock'
          AND k.pid IS DISTINCT FROM pg_backend_pid());
    UPDATE {cursors} c SET below = cur, point_l = l, point_v = v
    WHERE c.shards = $1 AND c.shard = $2;
    RETURN cur;
END
$outbox_settle$;
"#,
    )
}

/// The name of the plain `(seq)` index of a table laid out for cursor claims (unqualified): its
/// presence tells that layout.
pub(crate) fn seq_index_name(table: &str) -> String {
    derived_name(table, "seq_idx")
}

/// Refuse a plain table whose layout is not the one the configuration names (an unnamed layout
/// takes the table's): the cursor layout's claims would miss rows of a table without its cursors
/// and aside indexes, and the other claims would read every kept row of one without the partial
/// indexes. `laid_for_cursor`: whether the table has the cursor layout's seq index.
///
/// # Errors
/// [`Error::InvalidInput`] naming both layouts when they differ.
pub(crate) fn check_layout(config: &PostgresConfig, laid_for_cursor: bool) -> Result<(), Error> {
    let table = config.qualified_table();
    match (laid_for_cursor, config.cursor_claims()) {
        (false, Some(true)) => Err(Error::invalid_input(format!(
            "the outbox table {table} has the partial-index layout, but the configuration asks \
             for cursor claims; a migration never converts a table: convert it with \
             `outbox-relay convert-layout` (PostgresStore::convert_to_cursor_claims, relays \
             stopped), or drop cursor_claims for this table"
        ))),
        (true, Some(false)) => Err(Error::invalid_input(format!(
            "the outbox table {table} is laid out for cursor claims (index {}), but the \
             configuration asks for the partial-index layout; set cursor_claims to true or \
             leave it unset (`PostgresConfigBuilder::cursor_claims`, or `?cursor_claims=true` in \
             the store URL)",
            seq_index_name(config.table())
        ))),
        _ => Ok(()),
    }
}
