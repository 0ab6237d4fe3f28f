//! Cursor claims (`cursor_claims`, `docs/keep-cursor.md`, the layout of a new table unless it
//! deletes published rows): the shared conformance suite on a
//! table of that layout, and what only it does: a cursor that moves over settled seqs only,
//! rows aside below it, and a completion that writes no index entry.

mod common;

use std::time::Duration;

use common::harness::PgHarness;
use common::{db_with, msg, names, Db};
use outbox_backend_postgres::enqueue_batch;
use outbox_traits::{Error, HeadPolicy, OutboxStore};

/// The suite on the cursor layout. Every check runs; the two properties at an eighth of the
/// cases (`reduced: 8`, as the partitioned table's): they passed at 1,000 cases when the layout
/// was built, and `scripts/mutants` scores this file at its full count.
mod conformance {
    use super::PgHarness;

    outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env()
        .map(PgHarness::cursor_claims), reduced: 8);
}

async fn cursor_db() -> Option<Db> {
    db_with(|b| b.cursor_claims(true)).await
}

/// A table of the partial-index layout, as an earlier release made it: what a conversion takes.
async fn partial_index_db() -> Option<Db> {
    db_with(|b| b.cursor_claims(false)).await
}

/// The unsharded claim's cursor: every row below it is published, aside or rolled back.
async fn cursor(db: &Db) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT below FROM \"{}\".\"outbox_cursors\" WHERE shards = 1 AND shard = 0",
        db.schema
    ))
    .fetch_one(db.pool())
    .await
    .unwrap()
}

async fn max_seq(db: &Db) -> i64 {
    sqlx::query_scalar(&format!("SELECT max(seq) FROM {}", db.table()))
        .fetch_one(db.pool())
        .await
        .unwrap()
}

/// Claim and complete up to `limit` messages; their names.
async fn drain_once(db: &Db, limit: usize) -> Vec<String> {
    let claim = db.claim(limit, HeadPolicy::Block).await;
    let ids: Vec<_> = claim.messages.iter().map(|m| m.id).collect();
    db.store.complete(claim.token, &ids).await.unwrap();
    names(&claim)
}

/// Claims enough for the cursor to settle twice over what was published (a move takes two
/// claims: one notes the point, the next moves to it).
async fn settle(db: &Db) {
    for _ in 0..3 {
        assert!(drain_once(db, 100).await.is_empty());
    }
}

#[tokio::test]
async fn the_cursor_moves_over_published_rows() {
    let Some(db) = cursor_db().await else {
        return;
    };
    let batch: Vec<_> = (0..20)
        .map(|i| msg(&format!("k{i}"), &i.to_string()))
        .collect();
    db.enqueue(&batch).await;
    assert_eq!(drain_once(&db, 100).await.len(), 20);
    settle(&db).await;
    // Past every row: the next claim reads none of them.
    assert_eq!(cursor(&db).await, max_seq(&db).await + 1);
    db.drop().await;
}

#[tokio::test]
async fn an_open_writer_holds_the_cursor_below_its_seq_and_is_published_in_its_key_order() {
    let Some(db) = cursor_db().await else {
        return;
    };
    // The writer draws the first seq for key k and stays open.
    let mut open = db.pool().begin().await.unwrap();
    enqueue_batch(&mut *open, &db.config, &[msg("k", "first")])
        .await
        .unwrap();
    let held: i64 = sqlx::query_scalar(&format!("SELECT max(seq) FROM {}", db.table()))
        .fetch_one(&mut *open)
        .await
        .unwrap();
    // Later rows commit and are published meanwhile.
    let later: Vec<_> = (0..20)
        .map(|i| msg(&format!("o{i}"), &i.to_string()))
        .collect();
    db.enqueue(&later).await;
    assert_eq!(drain_once(&db, 100).await.len(), 20);
    settle(&db).await;
    assert!(
        cursor(&db).await <= held,
        "the cursor passed seq {held}, which an open writer holds"
    );
    // It commits; a second writer of its key follows. The first is published first.
    open.commit().await.unwrap();
    db.enqueue(&[msg("k", "second")]).await;
    assert_eq!(drain_once(&db, 1).await, ["first"]);
    assert_eq!(drain_once(&db, 100).await, ["second"]);
    settle(&db).await;
    assert_eq!(cursor(&db).await, max_seq(&db).await + 1);
    db.drop().await;
}

#[tokio::test]
async fn a_rolled_back_seq_is_passed() {
    let Some(db) = cursor_db().await else {
        return;
    };
    let mut open = db.pool().begin().await.unwrap();
    enqueue_batch(&mut *open, &db.config, &[msg("k", "rolled back")])
        .await
        .unwrap();
    db.enqueue(&[msg("k", "kept")]).await;
    assert_eq!(drain_once(&db, 100).await, ["kept"]);
    settle(&db).await;
    let before = cursor(&db).await;
    open.rollback().await.unwrap();
    settle(&db).await;
    let after = cursor(&db).await;
    assert!(after > before, "the cursor stayed at {after}");
    assert_eq!(after, max_seq(&db).await + 1);
    db.drop().await;
}

#[tokio::test]
async fn a_transaction_that_only_reads_the_table_does_not_hold_the_cursor() {
    let Some(db) = cursor_db().await else {
        return;
    };
    // A report reading the table, left open.
    let mut reader = db.pool().begin().await.unwrap();
    let _: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.table()))
        .fetch_one(&mut *reader)
        .await
        .unwrap();
    db.enqueue(&[msg("a", "1"), msg("b", "2")]).await;
    assert_eq!(drain_once(&db, 100).await.len(), 2);
    settle(&db).await;
    assert_eq!(cursor(&db).await, max_seq(&db).await + 1);
    reader.rollback().await.unwrap();
    db.drop().await;
}

/// Released, failed and scheduled rows below the cursor are found through the aside indexes.
#[tokio::test]
async fn rows_aside_below_the_cursor_are_claimed_in_key_order() {
    let Some(db) = cursor_db().await else {
        return;
    };
    db.enqueue(&[msg("k", "1"), msg("k", "2"), msg("u", "3")])
        .await;
    let claim = db.claim(100, HeadPolicy::Block).await;
    assert_eq!(names(&claim), ["1", "2", "3"]);
    // k's rows go back; u's is published; later rows are published past them.
    let k: Vec<_> = claim.messages[..2].iter().map(|m| m.id).collect();
    db.store.release(claim.token, &k).await.unwrap();
    db.store
        .complete(claim.token, &[claim.messages[2].id])
        .await
        .unwrap();
    db.enqueue(&[msg("v", "4"), msg("w", "5")]).await;
    let more = db.claim(100, HeadPolicy::Block).await;
    assert_eq!(names(&more), ["1", "2", "4", "5"]);
    db.store
        .complete(
            more.token,
            &more.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    // Published, the released rows leave the aside indexes, which claims read in full.
    let aside: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE last_error IS NOT NULL OR available_at > created_at",
        db.table()
    ))
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(aside, 0);
    db.drop().await;
}

/// A release sets `available_at` past `created_at` even when the database clock stepped back
/// since the row was written: otherwise the row would be neither aside nor above the cursor,
/// and no claim would find it again.
#[tokio::test]
async fn a_release_after_the_clock_stepped_back_keeps_the_row_aside() {
    let Some(db) = cursor_db().await else {
        return;
    };
    db.enqueue(&[msg("k", "scheduled")]).await;
    // Scheduled a little in the past of now, so aside (available_at > created_at) and due.
    sqlx::query(&format!(
        "UPDATE {} SET created_at = now() - interval '2 s', available_at = now() - interval '1 s'",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    db.enqueue(&[msg("o", "other")]).await;
    let claim = db.claim(100, HeadPolicy::Block).await;
    assert_eq!(names(&claim), ["scheduled", "other"]);
    db.store
        .complete(claim.token, &[claim.messages[1].id])
        .await
        .unwrap();
    // The cursor passes the leased row: it is aside.
    settle(&db).await;
    assert!(cursor(&db).await > claim.messages[0].seq);
    // The clock steps back an hour: the row reads as written in the future.
    sqlx::query(&format!(
        "UPDATE {} SET created_at = now() + interval '1 hour' WHERE seq = $1",
        db.table()
    ))
    .bind(claim.messages[0].seq)
    .execute(db.pool())
    .await
    .unwrap();
    db.store
        .release(claim.token, &[claim.messages[0].id])
        .await
        .unwrap();
    // Once the clock has caught up, a claim finds it below the cursor.
    db.advance(Duration::from_secs(7200)).await;
    assert_eq!(drain_once(&db, 100).await, ["scheduled"]);
    db.drop().await;
}

/// The completion that keeps a row writes no index entry: the indexes do not grow however
/// many rows are published.
#[tokio::test]
async fn completing_a_kept_row_writes_no_index_entry() {
    let Some(db) = cursor_db().await else {
        return;
    };
    let batch: Vec<_> = (0..2000)
        .map(|i| msg(&format!("k{}", i % 50), &i.to_string()))
        .collect();
    db.enqueue(&batch).await;
    let claim = db.claim(2000, HeadPolicy::Block).await;
    assert_eq!(claim.messages.len(), 2000);
    let sizes = format!(
        "SELECT sum(pg_relation_size(indexrelid))::bigint FROM pg_index
         WHERE indrelid = '{}'::regclass",
        db.table()
    );
    let before: i64 = sqlx::query_scalar(&sizes)
        .fetch_one(db.pool())
        .await
        .unwrap();
    let ids: Vec<_> = claim.messages.iter().map(|m| m.id).collect();
    db.store.complete(claim.token, &ids).await.unwrap();
    let after: i64 = sqlx::query_scalar(&sizes)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(after, before, "the completion wrote index entries");
    db.drop().await;
}

#[tokio::test]
async fn a_table_of_the_other_layout_is_refused() {
    let Some(plain) = partial_index_db().await else {
        return;
    };
    let cursor_config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&plain.schema)
        .cursor_claims(true)
        .build()
        .unwrap();
    let store = outbox_backend_postgres::PostgresStore::new(plain.pool().clone(), cursor_config);
    let err = store.migrate().await.unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert!(err.to_string().contains("partial-index layout"), "{err}");
    plain.drop().await;

    let Some(cursor) = cursor_db().await else {
        return;
    };
    let plain_config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&cursor.schema)
        .cursor_claims(false)
        .build()
        .unwrap();
    let store = outbox_backend_postgres::PostgresStore::new(cursor.pool().clone(), plain_config);
    let err = store
        .claim(&outbox_traits::ClaimRequest {
            limit: 1,
            lease: Duration::from_secs(30),
            head_policy: HeadPolicy::Block,
            shard: None,
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert!(err.to_string().contains("cursor_claims"), "{err}");
    cursor.drop().await;
}

/// Whether the table of `db` has the cursor layout's tables and indexes.
async fn laid_for_cursor(db: &Db) -> bool {
    sqlx::query_scalar(&format!(
        "SELECT to_regclass('\"{0}\".\"outbox_seq_idx\"') IS NOT NULL
            AND to_regclass('\"{0}\".\"outbox_cursors\"') IS NOT NULL",
        db.schema
    ))
    .fetch_one(db.pool())
    .await
    .unwrap()
}

/// Unset, `cursor_claims` lays a new table out for cursor claims when published rows are kept,
/// and for partial indexes when the configuration deletes them.
#[tokio::test]
async fn a_new_table_is_laid_out_for_cursor_claims_unless_published_rows_are_deleted() {
    let Some(keeping) = common::db().await else {
        return;
    };
    assert_eq!(keeping.config.cursor_claims(), None);
    assert!(keeping.config.new_tables_use_cursor_claims());
    assert!(laid_for_cursor(&keeping).await);
    // And its claims read from the cursor.
    keeping.enqueue(&[msg("k", "one")]).await;
    assert_eq!(drain_once(&keeping, 10).await, ["one"]);
    settle(&keeping).await;
    assert_eq!(cursor(&keeping).await, max_seq(&keeping).await + 1);
    keeping.drop().await;

    let Some(deleting) = db_with(|b| b.delete_published(true)).await else {
        return;
    };
    assert!(!deleting.config.new_tables_use_cursor_claims());
    assert!(!laid_for_cursor(&deleting).await);
    deleting.drop().await;
}

/// A table made by an earlier release (the partial-index layout) under a configuration that
/// names no layout: the migration keeps its layout, and every statement is that layout's.
#[tokio::test]
async fn an_unnamed_layout_takes_an_existing_table_as_it_is() {
    use outbox_traits::OutboxAdmin;
    let Some(old) = partial_index_db().await else {
        return;
    };
    old.enqueue(&[msg("k", "first"), msg("j", "other")]).await;
    let config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&old.schema)
        .build()
        .unwrap();
    assert!(config.new_tables_use_cursor_claims());
    let store = outbox_backend_postgres::PostgresStore::new(old.pool().clone(), config.clone());
    store.migrate().await.unwrap();
    let db = Db {
        url: old.url.clone(),
        store,
        config,
        schema: old.schema.clone(),
    };
    assert!(
        !laid_for_cursor(&db).await,
        "the migration converted the table"
    );
    // Claims, a dead letter and its requeue, counts and the status, on the old layout.
    let claim = db.claim(10, HeadPolicy::Block).await;
    assert_eq!(names(&claim), ["first", "other"]);
    db.store
        .fail(
            claim.token,
            &[outbox_traits::Failure {
                id: claim.messages[0].id,
                error: "broker said no".into(),
                action: outbox_traits::FailAction::Dead,
            }],
        )
        .await
        .unwrap();
    db.store
        .complete(claim.token, &[claim.messages[1].id])
        .await
        .unwrap();
    let dead = db.store.list_dead(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(db.store.requeue(&[dead[0].message.id]).await.unwrap(), 1);
    assert_eq!(drain_once(&db, 10).await, ["first"]);
    let counts = db.store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.dead, counts.published), (0, 0, 2));
    db.store.status(10).await.unwrap();
    db.drop().await;
}

/// The migration SQL run by hand (a team's own migration tool) on a table of the other layout
/// raises instead of laying a second layout over the first.
#[tokio::test]
async fn a_migration_run_by_hand_refuses_a_table_of_the_other_layout() {
    use sqlx::Executor;
    for (made, run) in [(false, true), (true, false)] {
        let Some(db) = db_with(|b| b.cursor_claims(made)).await else {
            return;
        };
        let other = outbox_backend_postgres::PostgresConfig::builder()
            .schema(&db.schema)
            .cursor_claims(run)
            .build()
            .unwrap();
        let err = db
            .pool()
            .execute(other.migration_sql())
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("never converts a table"), "{err}");
        assert_eq!(laid_for_cursor(&db).await, made);
        db.drop().await;
    }
}

#[test]
fn cursor_claims_and_partitions_do_not_combine() {
    let err = outbox_backend_postgres::PostgresConfig::builder()
        .cursor_claims(true)
        .partition_interval(Some(Duration::from_secs(3600)))
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
}

/// A prepared transaction (two-phase commit) that wrote a row keeps its lock on the table after
/// its session's transaction ended: the cursor waits for it, and the row is published once it
/// commits. On a private server: the shared one allows no prepared transactions.
#[tokio::test]
async fn a_prepared_transaction_holds_the_cursor_below_its_seq() {
    use outbox_conformance_tests::servers::{PostgresCluster, PostgresSetup};
    use sqlx::Connection;

    let Some(server) = PostgresCluster::start(PostgresSetup {
        conf: "max_prepared_transactions = 4".into(),
        ..Default::default()
    })
    .expect("a private Postgres") else {
        return;
    };
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port());
    let config = outbox_backend_postgres::PostgresConfig::builder()
        .schema("twophase")
        // A transaction that sent a NOTIFY (the insert trigger's) cannot be prepared.
        .notify(false)
        .cursor_claims(true)
        .build()
        .unwrap();
    let store = outbox_backend_postgres::PostgresStore::connect(&url, config.clone())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let db = Db {
        url: url.clone(),
        store,
        config,
        schema: "twophase".into(),
    };
    // A published row, and a point noted with no writer open.
    db.enqueue(&[msg("a", "first")]).await;
    assert_eq!(drain_once(&db, 100).await, ["first"]);
    assert!(drain_once(&db, 100).await.is_empty());
    // The writer draws a seq; the next claim moves the cursor and notes the writer in its point.
    let mut writer = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut writer).await.unwrap();
    enqueue_batch(&mut writer, &db.config, &[msg("k", "prepared")])
        .await
        .unwrap();
    let held: i64 = sqlx::query_scalar("SELECT max(seq) FROM twophase.outbox")
        .fetch_one(&mut writer)
        .await
        .unwrap();
    assert!(drain_once(&db, 100).await.is_empty());
    // It prepares: its session's transaction ends, its locks stay with the prepared one (on
    // Postgres 15 under the same virtual transaction id, with no pid).
    sqlx::query("PREPARE TRANSACTION 'outbox_test'")
        .execute(&mut writer)
        .await
        .unwrap();
    db.enqueue(&[msg("o", "later")]).await;
    assert_eq!(drain_once(&db, 100).await, ["later"]);
    settle(&db).await;
    assert!(
        cursor(&db).await <= held,
        "the cursor passed seq {held}, which a prepared transaction holds"
    );
    sqlx::query("COMMIT PREPARED 'outbox_test'")
        .execute(&mut writer)
        .await
        .unwrap();
    assert_eq!(drain_once(&db, 100).await, ["prepared"]);
    writer.close().await.unwrap();
    db.store.pool().close().await;
}

/// The migration gives the identity sequence a cache of 1: a session that cached a range would
/// hand out seqs drawn long before, past a cursor that read the sequence meanwhile.
#[tokio::test]
async fn the_migration_keeps_the_sequence_from_caching() {
    let Some(db) = cursor_db().await else {
        return;
    };
    let cache = || async {
        sqlx::query_scalar::<_, i64>(&format!(
            "SELECT seqcache FROM pg_sequence
             WHERE seqrelid = pg_get_serial_sequence('{}', 'seq')::regclass",
            db.table()
        ))
        .fetch_one(db.pool())
        .await
        .unwrap()
    };
    sqlx::query(&format!(
        "ALTER TABLE {} ALTER COLUMN seq SET CACHE 20",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    assert_eq!(cache().await, 20);
    db.store.migrate().await.unwrap();
    assert_eq!(cache().await, 1);
    db.drop().await;
}

/// A claim whose `BEGIN` fails after `BEGIN` itself (the settle of a table not made yet) leaves
/// no aborted transaction on a pooled session: the pool's next user, here on its only
/// connection, runs its statements.
#[tokio::test]
async fn a_claim_whose_settle_fails_hands_no_aborted_session_to_the_pool() {
    let Some(url) = outbox_conformance_tests::env::service_url(common::URL_VAR) else {
        return;
    };
    let schema = common::random_schema();
    let config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&schema)
        .build()
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let store = outbox_backend_postgres::PostgresStore::new(pool.clone(), config.clone());
    let request = outbox_traits::ClaimRequest {
        limit: 10,
        lease: Duration::from_secs(30),
        head_policy: HeadPolicy::Block,
        shard: None,
    };
    let err = store.claim(&request).await.unwrap_err().to_string();
    assert!(err.contains("outbox-relay migrate"), "{err}");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .expect("the pool handed out a session left in an aborted transaction");
    assert_eq!(one, 1);
    // Migrated, the same store claims.
    store.migrate().await.unwrap();
    let db = Db {
        url,
        store,
        config,
        schema,
    };
    db.enqueue(&[msg("k", "one")]).await;
    assert_eq!(drain_once(&db, 10).await, ["one"]);
    db.drop().await;
}

/// The status counts the last minute's publications on this layout too, below the cursor (which
/// passed them) and above it: the CLI's `relay_running` is read from it.
#[tokio::test]
async fn the_status_counts_the_last_minute_s_publications_on_both_sides_of_the_cursor() {
    use outbox_traits::OutboxAdmin;
    let Some(db) = cursor_db().await else {
        return;
    };
    let batch: Vec<_> = (0..5).map(|i| msg(&format!("k{i}"), "a")).collect();
    db.enqueue(&batch).await;
    assert_eq!(drain_once(&db, 100).await.len(), 5);
    settle(&db).await;
    assert_eq!(cursor(&db).await, max_seq(&db).await + 1, "not passed yet");
    // Three more, published and not yet passed by the cursor.
    let more: Vec<_> = (0..3).map(|i| msg(&format!("k{i}"), "b")).collect();
    db.enqueue(&more).await;
    let claim = db.claim(100, HeadPolicy::Block).await;
    let ids: Vec<_> = claim.messages.iter().map(|m| m.id).collect();
    db.store.complete(claim.token, &ids).await.unwrap();
    assert!(cursor(&db).await <= max_seq(&db).await);
    let status = db.store.status(0).await.unwrap();
    assert_eq!(status.published_last_minute, Some(8));
    // A minute later, none.
    db.advance(Duration::from_secs(61)).await;
    assert_eq!(
        db.store.status(0).await.unwrap().published_last_minute,
        Some(0)
    );
    db.drop().await;
}

/// The other direction: a configuration that deletes published rows (whose new tables get
/// partial indexes) over an existing table laid out for cursor claims takes it as it is.
#[tokio::test]
async fn a_deleting_configuration_takes_an_existing_cursor_table_as_it_is() {
    let Some(made) = cursor_db().await else {
        return;
    };
    made.enqueue(&[msg("k", "first"), msg("k", "second")]).await;
    let config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&made.schema)
        .delete_published(true)
        .build()
        .unwrap();
    assert!(!config.new_tables_use_cursor_claims());
    let store = outbox_backend_postgres::PostgresStore::new(made.pool().clone(), config.clone());
    store.migrate().await.unwrap();
    let db = Db {
        url: made.url.clone(),
        store,
        config,
        schema: made.schema.clone(),
    };
    assert!(
        laid_for_cursor(&db).await,
        "the migration converted the table"
    );
    assert_eq!(drain_once(&db, 1).await, ["first"]);
    assert_eq!(drain_once(&db, 10).await, ["second"]);
    settle(&db).await;
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.table()))
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(left, 0, "published rows were not deleted");
    // The claims were the cursor layout's: they moved its cursor past both rows.
    assert!(
        cursor(&db).await > 2,
        "the claims did not read from the cursor"
    );
    db.drop().await;
}

/// The purge deletes up to its batch of the old enough rows, whatever rows published since lie
/// below them in seq (found by MariaDB's model property on its side-table layout, which had
/// the same shape: the oldest batch by seq, then the old enough among those).
#[tokio::test]
async fn a_bounded_purge_finds_old_enough_rows_above_a_row_published_just_now() {
    use outbox_traits::OutboxAdmin;
    let Some(db) = cursor_db().await else {
        return;
    };
    db.enqueue(&[msg("a", "late"), msg("b", "early")]).await;
    let claim = db.claim(10, HeadPolicy::Block).await;
    assert_eq!(names(&claim), ["late", "early"]);
    db.store
        .complete(claim.token, &[claim.messages[1].id])
        .await
        .unwrap();
    // Ten minutes on: "early" is old enough; "late", lower in seq, is published only now.
    db.advance(Duration::from_secs(610)).await;
    assert_eq!(drain_once(&db, 10).await, ["late"]);
    let purged = db
        .store
        .purge_published(Duration::from_secs(600), 1)
        .await
        .unwrap();
    assert_eq!(purged, 1, "the old enough row above the young one");
    let left: Vec<uuid::Uuid> = sqlx::query_scalar(&format!("SELECT id FROM {}", db.table()))
        .fetch_all(db.pool())
        .await
        .unwrap();
    assert_eq!(left, [claim.messages[0].id], "the young row stays");
    db.drop().await;
}

/// A table of the partial-index layout, with published, retried, dead (one dead by hand,
/// without an error) and plain pending rows, converted to the cursor layout
/// (`convert_to_cursor_claims`): refused while a message is leased, then converted once; a
/// store that names no layout then serves it with cursor claims, and every message goes on in
/// its key's order, the dead ones after their requeue.
#[tokio::test]
async fn a_table_of_the_partial_index_layout_converts_to_cursor_claims() {
    use outbox_traits::{FailAction, Failure, OutboxAdmin};
    let Some(old) = partial_index_db().await else {
        return;
    };
    old.enqueue(&[
        msg("a", "a1"),
        msg("b", "b1"),
        msg("c", "c1"),
        msg("d", "d1"),
        msg("e", "e1"),
        msg("a", "a2"),
        msg("b", "b2"),
        msg("c", "c2"),
        msg("d", "d2"),
        msg("e", "e2"),
        msg("a", "a3"),
    ])
    .await;
    // a1 published, b1 to retry, c1 dead with its error; e1 dead by hand, without one.
    let claim = old.claim(4, HeadPolicy::Block).await;
    assert_eq!(names(&claim), ["a1", "b1", "c1", "d1"]);
    old.store
        .complete(claim.token, &[claim.messages[0].id])
        .await
        .unwrap();
    let fail = |i: usize, action| Failure {
        id: claim.messages[i].id,
        error: "broker said no".into(),
        action,
    };
    let retry = FailAction::Retry {
        delay: Duration::ZERO,
    };
    old.store
        .fail(claim.token, &[fail(1, retry), fail(2, FailAction::Dead)])
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE {} SET state = 'dead' WHERE payload->>'name' = 'e1'",
        old.table()
    ))
    .execute(old.pool())
    .await
    .unwrap();
    // d1 is still leased: a relay is at work, and the conversion changes nothing.
    let config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&old.schema)
        .build()
        .unwrap();
    let fresh = || outbox_backend_postgres::PostgresStore::new(old.pool().clone(), config.clone());
    let err = fresh().convert_to_cursor_claims().await.unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert!(err.to_string().contains("1 message(s)"), "{err}");
    assert!(!laid_for_cursor(&old).await);
    old.store
        .release(claim.token, &[claim.messages[3].id])
        .await
        .unwrap();
    // The deleting configuration has nothing to convert to.
    let deleting = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&old.schema)
        .delete_published(true)
        .build()
        .unwrap();
    let store = outbox_backend_postgres::PostgresStore::new(old.pool().clone(), deleting);
    let err = store.convert_to_cursor_claims().await.unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");

    assert!(fresh().convert_to_cursor_claims().await.unwrap());
    assert!(laid_for_cursor(&old).await);
    let partial_indexes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_indexes WHERE schemaname = $1
           AND indexname IN ('outbox_claim_idx', 'outbox_key_idx', 'outbox_dead_idx',
                             'outbox_published_idx')",
    )
    .bind(&old.schema)
    .fetch_one(old.pool())
    .await
    .unwrap();
    assert_eq!(partial_indexes, 0);
    assert!(!fresh().convert_to_cursor_claims().await.unwrap(), "again");

    // A store naming no layout: cursor claims, every message in its key's order.
    let db = Db {
        url: old.url.clone(),
        store: fresh(),
        config: config.clone(),
        schema: old.schema.clone(),
    };
    db.store.migrate().await.unwrap();
    db.enqueue(&[msg("b", "b3"), msg("f", "f1")]).await;
    let mut published = Vec::new();
    for _ in 0..10 {
        published.extend(drain_once(&db, 3).await);
    }
    // c and e are held by their dead heads; the rest in order.
    assert_eq!(published, ["b1", "d1", "a2", "b2", "d2", "a3", "b3", "f1"]);
    settle(&db).await;
    assert!(cursor(&db).await > 1, "the cursor moved");
    let dead = db.store.list_dead(None, 10).await.unwrap();
    assert_eq!(dead.len(), 2, "c1 and e1");
    let ids: Vec<_> = dead.iter().map(|d| d.message.id).collect();
    assert_eq!(db.store.requeue(&ids).await.unwrap(), 2);
    let mut rest = Vec::new();
    for _ in 0..5 {
        rest.extend(drain_once(&db, 3).await);
    }
    assert_eq!(rest, ["c1", "e1", "c2", "e2"]);
    let counts = db.store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.dead, counts.published), (0, 0, 13));
    db.drop().await;
}

/// The converted table's cursor starts at its first pending row, or past its last seq when
/// nothing is pending, so the first claims after a conversion do not read the published history
/// from seq 0.
#[tokio::test]
async fn a_converted_table_s_cursor_starts_at_its_first_pending_row() {
    let Some(old) = partial_index_db().await else {
        return;
    };
    old.enqueue(&[msg("a", "a1"), msg("b", "b1"), msg("a", "a2")])
        .await;
    assert_eq!(drain_once(&old, 10).await, ["a1", "b1", "a2"]);
    let db = convert(&old).await;
    assert_eq!(cursor(&db).await, max_seq(&db).await + 1, "nothing pending");
    db.drop().await;

    let Some(old) = partial_index_db().await else {
        return;
    };
    old.enqueue(&[
        msg("a", "a1"),
        msg("b", "b1"),
        msg("c", "c1"),
        msg("a", "a2"),
    ])
    .await;
    assert_eq!(drain_once(&old, 2).await, ["a1", "b1"]);
    let first_pending = max_seq(&old).await - 1;
    let db = convert(&old).await;
    assert_eq!(cursor(&db).await, first_pending, "c1's seq");
    db.enqueue(&[msg("b", "b2")]).await;
    assert_eq!(drain_once(&db, 10).await, ["c1", "a2", "b2"]);
    db.drop().await;
}

/// A sequence that cached before the conversion: a session may still hand out seqs it drew
/// earlier, below any point the conversion could read, so the cursor is not started (it starts
/// at 0 and settles as in any table).
#[tokio::test]
async fn a_caching_sequence_leaves_the_converted_cursor_at_0() {
    let Some(old) = partial_index_db().await else {
        return;
    };
    old.enqueue(&[msg("a", "a1"), msg("a", "a2")]).await;
    assert_eq!(drain_once(&old, 1).await, ["a1"]);
    sqlx::query(&format!(
        "ALTER TABLE {} ALTER COLUMN seq SET CACHE 20",
        old.table()
    ))
    .execute(old.pool())
    .await
    .unwrap();
    let db = convert(&old).await;
    let cursors: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".\"outbox_cursors\"",
        db.schema
    ))
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(cursors, 0, "a cursor was started over a caching sequence");
    assert_eq!(drain_once(&db, 10).await, ["a2"]);
    db.drop().await;
}

/// A transaction that drew a seq by hand (`nextval`) and has not written it yet when the
/// conversion ends: the cursor does not start past that seq, and the row it writes afterwards
/// is published.
#[tokio::test]
async fn a_seq_drawn_by_hand_during_the_conversion_is_not_passed() {
    let Some(old) = partial_index_db().await else {
        return;
    };
    old.enqueue(&[msg("a", "a1")]).await;
    assert_eq!(drain_once(&old, 10).await, ["a1"]);
    let t = old.table().to_owned();
    let mut writer = old.pool().begin().await.unwrap();
    let drawn: i64 = sqlx::query_scalar(&format!(
        "SELECT nextval(pg_get_serial_sequence('{t}', 'seq'))"
    ))
    .fetch_one(&mut *writer)
    .await
    .unwrap();
    // The writer holds the sequence only, not the table: nothing in the conversion waits for
    // it (the guard turns a wait into a failure instead of a hung suite).
    assert!(tokio::time::timeout(
        Duration::from_secs(120),
        converting_store(&old).convert_to_cursor_claims()
    )
    .await
    .expect("the conversion waited for a transaction that holds only the sequence")
    .unwrap());
    let db = converted(&old);
    db.enqueue(&[msg("b", "b1")]).await;
    assert_eq!(drain_once(&db, 10).await, ["b1"]);
    settle(&db).await;
    assert!(
        cursor(&db).await <= drawn,
        "the cursor passed the seq drawn by hand"
    );
    // The writer now writes its row under the seq it drew (a copy of b1 with that seq).
    outbox_backend_postgres::enqueue(&mut *writer, &old.config, &msg("c", "by hand"))
        .await
        .unwrap();
    for statement in [
        "INSERT INTO {t} OVERRIDING SYSTEM VALUE
         SELECT (jsonb_populate_record(NULL::{t}, to_jsonb(r)
                 || jsonb_build_object('seq', $1::bigint, 'id', gen_random_uuid()))).*
           FROM {t} r WHERE r.payload->>'name' = 'by hand'",
        "DELETE FROM {t} WHERE payload->>'name' = 'by hand' AND seq <> $1",
    ] {
        sqlx::query(&statement.replace("{t}", &t))
            .bind(drawn)
            .execute(&mut *writer)
            .await
            .unwrap();
    }
    writer.commit().await.unwrap();
    let mut published = Vec::new();
    for _ in 0..3 {
        published.extend(drain_once(&db, 10).await);
    }
    assert_eq!(published, ["by hand"]);
    db.drop().await;
}

/// A writer whose transaction is open when the conversion starts: the conversion waits for it
/// (a moment, well within its lock timeout) while it goes on, and its message is published in
/// its key's order.
#[tokio::test]
async fn a_writer_open_during_the_conversion_is_waited_for_and_its_message_goes_on() {
    let Some(old) = partial_index_db().await else {
        return;
    };
    old.enqueue(&[msg("k", "before")]).await;
    let mut writer = old.pool().begin().await.unwrap();
    outbox_backend_postgres::enqueue(&mut *writer, &old.config, &msg("k", "during"))
        .await
        .unwrap();
    let store = converting_store(&old);
    let conversion = tokio::spawn(async move { store.convert_to_cursor_claims().await });
    until_conversion_waits(&old, &conversion).await;
    writer.commit().await.unwrap();
    assert!(conversion.await.unwrap().unwrap());
    let db = converted(&old);
    assert!(laid_for_cursor(&db).await);
    db.enqueue(&[msg("k", "after")]).await;
    assert_eq!(drain_once(&db, 10).await, ["before", "during", "after"]);
    db.drop().await;
}

/// A conversion's store, naming no layout, on the schema of `old`.
fn converting_store(old: &Db) -> outbox_backend_postgres::PostgresStore {
    let config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&old.schema)
        .build()
        .unwrap();
    outbox_backend_postgres::PostgresStore::new(old.pool().clone(), config)
}

/// The table of `old` after its conversion, served by a store naming no layout.
fn converted(old: &Db) -> Db {
    Db {
        url: old.url.clone(),
        store: converting_store(old),
        config: old.config.clone(),
        schema: old.schema.clone(),
    }
}

/// Converts the table of `old` (asserting that it did) and serves it with a store naming no
/// layout.
async fn convert(old: &Db) -> Db {
    assert!(converting_store(old)
        .convert_to_cursor_claims()
        .await
        .unwrap());
    converted(old)
}

/// Waits until a conversion (`task`, not finished) is seen waiting for a lock.
async fn until_conversion_waits(old: &Db, task: &tokio::task::JoinHandle<Result<bool, Error>>) {
    let start = std::time::Instant::now();
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND query LIKE '%outbox_convert%'",
        )
        .fetch_one(old.pool())
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(!task.is_finished(), "the conversion did not wait");
        assert!(start.elapsed() < Duration::from_secs(30), "never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A writer's transaction open longer than the conversion's lock bound: the conversion gives up
/// with a transient error instead of holding up the writers queued behind it, the table keeps
/// its layout, and the conversion run again once the writer has committed converts it.
#[tokio::test]
async fn a_conversion_waits_a_bounded_time_for_a_lock_and_can_run_again() {
    let Some(old) = partial_index_db().await else {
        return;
    };
    let mut writer = old.pool().begin().await.unwrap();
    outbox_backend_postgres::enqueue(&mut *writer, &old.config, &msg("k", "open"))
        .await
        .unwrap();
    // Without its bound the conversion would wait for the writer for ever: a guard far above
    // the bound turns that into a failure instead of a hung suite.
    let err = tokio::time::timeout(
        Duration::from_secs(120),
        converting_store(&old).convert_to_cursor_claims(),
    )
    .await
    .expect("the conversion waited past its lock bound")
    .unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert!(err.to_string().contains("lock"), "{err}");
    assert!(!laid_for_cursor(&old).await, "the layout changed");
    writer.commit().await.unwrap();
    convert(&old).await;
    assert!(laid_for_cursor(&old).await);
    old.drop().await;
}

/// A second conversion of the table started while the first waits is refused at once (it would
/// otherwise take the first's half-built index for a failed run's), and the first goes on.
#[tokio::test]
async fn a_second_conversion_of_the_table_while_one_runs_is_refused() {
    let Some(old) = partial_index_db().await else {
        return;
    };
    let mut writer = old.pool().begin().await.unwrap();
    outbox_backend_postgres::enqueue(&mut *writer, &old.config, &msg("k", "open"))
        .await
        .unwrap();
    let store = converting_store(&old);
    let first = tokio::spawn(async move { store.convert_to_cursor_claims().await });
    until_conversion_waits(&old, &first).await;
    let err = converting_store(&old)
        .convert_to_cursor_claims()
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert!(err.to_string().contains("another conversion"), "{err}");
    assert!(
        !first.is_finished(),
        "the first conversion did not go on waiting"
    );
    writer.commit().await.unwrap();
    assert!(first.await.unwrap().unwrap());
    assert!(!converting_store(&old)
        .convert_to_cursor_claims()
        .await
        .unwrap());
    old.drop().await;
}

/// An index a failed build left invalid (here a unique build over duplicate keys, under the
/// names a conversion builds) is dropped and built again with the layout's definition.
#[tokio::test]
async fn a_conversion_rebuilds_the_invalid_indexes_a_failed_run_left() {
    let Some(old) = partial_index_db().await else {
        return;
    };
    old.enqueue(&[msg("k", "one"), msg("k", "two")]).await;
    for name in ["outbox_seq_idx_new", "outbox_aside_idx"] {
        let failed = sqlx::query(&format!(
            "CREATE UNIQUE INDEX CONCURRENTLY \"{name}\" ON {} (partition_key)",
            old.table()
        ))
        .execute(old.pool())
        .await;
        assert!(failed.is_err(), "the unique build over duplicates failed");
    }
    let invalid = |db: &Db| {
        let schema = db.schema.clone();
        let pool = db.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = $1 AND NOT i.indisvalid ORDER BY 1",
            )
            .bind(schema)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        invalid(&old).await,
        ["outbox_aside_idx", "outbox_seq_idx_new"]
    );
    convert(&old).await;
    assert!(invalid(&old).await.is_empty(), "an invalid index is left");
    let defs: Vec<String> = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = $1
           AND indexname IN ('outbox_seq_idx', 'outbox_aside_idx') ORDER BY indexname",
    )
    .bind(&old.schema)
    .fetch_all(old.pool())
    .await
    .unwrap();
    assert_eq!(defs.len(), 2, "{defs:?}");
    assert!(defs.iter().all(|d| !d.contains("UNIQUE")), "{defs:?}");
    assert!(
        defs[0].ends_with("(seq) WHERE ((last_error IS NOT NULL) OR (available_at > created_at))"),
        "{defs:?}"
    );
    assert!(defs[1].ends_with("USING btree (seq)"), "{defs:?}");
    let db = converted(&old);
    assert_eq!(drain_once(&db, 10).await, ["one", "two"]);
    db.drop().await;
}
