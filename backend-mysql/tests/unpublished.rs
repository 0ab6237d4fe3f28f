//! Tables laid out with an unpublished table (`MysqlConfigBuilder::unpublished_table`): what the
//! conformance suite (`conformance.rs`, module `unpublished_table`) does not see. The layout's
//! own objects (the unpublished table, its triggers, the outbox table without claim indexes),
//! writers in plain SQL, deletes by hand, the status figures, and the migration refusing a
//! table of the other layout.

mod common;

use std::time::Duration;

use common::{db_with, ids, msg, names, Db};
use outbox_backend_mysql::{MysqlConfig, MysqlStore};
use outbox_traits::HeadPolicy::Block;
use outbox_traits::{Error, FailAction, Failure, OutboxAdmin, OutboxStore};
use sqlx::Row;

async fn db() -> Option<Db> {
    db_with(|b| b.unpublished_table(true)).await
}

/// The unpublished table's entries: `(state, seq)` in seq order.
async fn entries(db: &Db) -> Vec<(String, i64)> {
    let u = db.store.config().table().to_owned() + "_unpublished";
    sqlx::query(&format!(
        "SELECT CAST(state AS CHAR) AS state, seq FROM `{u}` ORDER BY seq"
    ))
    .fetch_all(db.pool())
    .await
    .unwrap()
    .iter()
    .map(|row| (row.get("state"), row.get("seq")))
    .collect()
}

/// The seqs of the outbox rows in state `state`.
async fn seqs_in(db: &Db, state: &str) -> Vec<i64> {
    sqlx::query_scalar(&format!(
        "SELECT seq FROM {} WHERE state = ? ORDER BY seq",
        db.table()
    ))
    .bind(state)
    .fetch_all(db.pool())
    .await
    .unwrap()
}

/// The outbox table's indexes.
async fn indexes(db: &Db) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT DISTINCT CAST(INDEX_NAME AS CHAR) FROM information_schema.STATISTICS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? ORDER BY 1",
    )
    .bind(db.store.config().table())
    .fetch_all(db.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_kept_completion_leaves_no_entry_and_no_index_of_the_outbox_row_holds_state() {
    let Some(db) = db().await else { return };
    // The outbox table keeps only its unique indexes: nothing indexes `state` or
    // `published_at`, so completing a row changes no index of it.
    assert_eq!(indexes(&db).await, ["PRIMARY", "uq_dedup_key", "uq_id"]);
    db.enqueue(&[msg("a", "1"), msg("a", "2"), msg("b", "3")])
        .await;
    let pending = seqs_in(&db, "pending").await;
    assert_eq!(
        entries(&db).await,
        pending
            .iter()
            .map(|&seq| ("pending".to_owned(), seq))
            .collect::<Vec<_>>()
    );
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["1", "2", "3"]);
    db.store
        .complete(claim.token, &ids(&claim)[..2])
        .await
        .unwrap();
    // The two completed rows are published and gone from the unpublished table; the third,
    // still leased, keeps its entry.
    assert_eq!(seqs_in(&db, "published").await, pending[..2]);
    assert_eq!(entries(&db).await, [("pending".to_owned(), pending[2])]);
    db.drop().await;
}

#[tokio::test]
async fn rows_written_in_plain_sql_are_claimed_and_a_rollback_leaves_no_entry() {
    let Some(db) = db().await else { return };
    let insert = format!(
        "INSERT INTO {} (aggregatetype, aggregateid, type, payload) VALUES ('order', ?, 'created', ?)",
        db.table()
    );
    let mut tx = db.pool().begin().await.unwrap();
    sqlx::query(&insert)
        .bind("k")
        .bind(r#"{"name": "rolled back"}"#)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    for name in ["1", "2"] {
        sqlx::query(&insert)
            .bind("k")
            .bind(format!(r#"{{"name": "{name}"}}"#))
            .execute(db.pool())
            .await
            .unwrap();
    }
    // Only the committed rows have entries, with the key the trigger gave them (the aggregate
    // id) and its hash.
    let u = db.store.config().table().to_owned() + "_unpublished";
    let keyed: Vec<(String, bool)> = sqlx::query(&format!(
        "SELECT CAST(partition_key AS CHAR) AS partition_key, key_hash <=> CRC32('k') AS hashed FROM `{u}` ORDER BY seq"
    ))
    .fetch_all(db.pool())
    .await
    .unwrap()
    .iter()
    .map(|row| (row.get("partition_key"), row.get("hashed")))
    .collect();
    assert_eq!(keyed, [("k".to_owned(), true), ("k".to_owned(), true)]);
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["1", "2"]);
    db.store.complete(claim.token, &ids(&claim)).await.unwrap();
    assert!(entries(&db).await.is_empty());
    db.drop().await;
}

#[tokio::test]
async fn a_row_deleted_by_hand_takes_its_entry_and_its_key_goes_on() {
    let Some(db) = db().await else { return };
    db.enqueue(&[msg("k", "1"), msg("k", "2")]).await;
    let first = seqs_in(&db, "pending").await[0];
    sqlx::query(&format!("DELETE FROM {} WHERE seq = ?", db.table()))
        .bind(first)
        .execute(db.pool())
        .await
        .unwrap();
    assert_eq!(entries(&db).await.len(), 1);
    // The key's next row is its head now, inside the window and past it.
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["2"]);
    db.drop().await;
}

#[tokio::test]
async fn dead_letters_move_their_entry_and_requeue_brings_it_back() {
    let Some(db) = db().await else { return };
    db.enqueue(&[msg("k", "1"), msg("k", "2"), msg("j", "3")])
        .await;
    let claim = db.claim(1, Block).await;
    let dead = ids(&claim)[0];
    db.store
        .fail(
            claim.token,
            &[Failure {
                id: dead,
                error: "broken".into(),
                action: FailAction::Dead,
            }],
        )
        .await
        .unwrap();
    let seqs = seqs_in(&db, "pending").await;
    let dead_seq = seqs_in(&db, "dead").await;
    assert_eq!(
        entries(&db).await,
        [
            ("dead".to_owned(), dead_seq[0]),
            ("pending".to_owned(), seqs[0]),
            ("pending".to_owned(), seqs[1])
        ]
    );
    // Under Block the dead head holds its key back; the other key goes on.
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["3"]);
    db.store.release(claim.token, &ids(&claim)).await.unwrap();
    let listed = db.store.list_dead(None, 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(db.store.requeue(&[dead]).await.unwrap(), 1);
    assert_eq!(
        entries(&db).await.first(),
        Some(&("pending".to_owned(), dead_seq[0]))
    );
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["1", "2", "3"]);
    db.drop().await;
}

#[tokio::test]
async fn status_reads_the_unpublished_table() {
    let Some(db) = db().await else { return };
    let batch: Vec<_> = (0..6)
        .map(|i| msg(&format!("k{i}"), &format!("{i}")))
        .collect();
    db.enqueue(&batch).await;
    // Six rows: two published, one leased, one dead, one waiting for a retry, one pending.
    let claim = db.claim(5, Block).await;
    let claimed = ids(&claim);
    db.store.complete(claim.token, &claimed[..2]).await.unwrap();
    db.store
        .fail(
            claim.token,
            &[
                Failure {
                    id: claimed[2],
                    error: "dead".into(),
                    action: FailAction::Dead,
                },
                Failure {
                    id: claimed[3],
                    error: "later".into(),
                    action: FailAction::Retry {
                        delay: Duration::from_secs(600),
                    },
                },
            ],
        )
        .await
        .unwrap();
    let status = db.store.status(10).await.unwrap();
    assert_eq!(
        (status.pending, status.leased, status.dead),
        (2, 1, 1),
        "{status:?}"
    );
    assert_eq!(status.blocked_keys, Some(2), "{status:?}");
    let states: Vec<&str> = status
        .blocked
        .iter()
        .map(|b| b.head_state.as_str())
        .collect();
    assert_eq!(states, ["dead", "retrying"]);
    assert_eq!(status.published_last_minute, Some(2));
    assert!(status.oldest_pending_age_seconds.is_some());
    // A minute later the two are no longer the last minute's.
    db.advance(Duration::from_secs(61)).await;
    let status = db.store.status(0).await.unwrap();
    assert_eq!(status.published_last_minute, Some(0));
    assert!(status.oldest_pending_age_seconds.unwrap_or(0.0) >= 61.0);
    db.drop().await;
}

#[tokio::test]
async fn migrate_refuses_a_table_of_the_other_layout_and_changes_nothing() {
    let Some(db) = db().await else { return };
    let other = MysqlConfig::builder()
        .table(db.store.config().table())
        .unpublished_table(false)
        .build()
        .unwrap();
    let store = MysqlStore::new(db.pool().clone(), other);
    let err = store.migrate().await.unwrap_err();
    assert!(
        matches!(&err, Error::Backend { message, .. }
            if message.contains("laid out with an unpublished table")
                && message.contains("unpublished_table(true)")),
        "{err}"
    );
    assert_eq!(indexes(&db).await, ["PRIMARY", "uq_dedup_key", "uq_id"]);
    db.drop().await;

    let Some(plain) = db_with(|b| b.unpublished_table(false)).await else {
        return;
    };
    let other = MysqlConfig::builder()
        .table(plain.store.config().table())
        .unpublished_table(true)
        .build()
        .unwrap();
    let store = MysqlStore::new(plain.pool().clone(), other.clone());
    let err = store.migrate().await.unwrap_err();
    assert!(
        matches!(&err, Error::Backend { message, .. }
            if message.contains("has its own claim indexes")
                && message.contains("unpublished_table(false)")),
        "{err}"
    );
    let made: Option<String> = sqlx::query_scalar(
        "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(other.table().to_owned() + "_unpublished")
    .fetch_optional(plain.pool())
    .await
    .unwrap();
    assert_eq!(made, None);
    plain.drop().await;
}

#[tokio::test]
async fn a_store_that_names_no_layout_serves_the_table_in_the_layout_it_has() {
    // New tables: an unpublished table when published rows are kept, not when deleted.
    assert!(MysqlConfig::default().new_tables_use_unpublished_table());
    let deleting = MysqlConfig::builder()
        .delete_published(true)
        .build()
        .unwrap();
    assert!(!deleting.new_tables_use_unpublished_table());
    for layout in [false, true] {
        let Some(db) = db_with(|b| b.unpublished_table(layout)).await else {
            return;
        };
        db.enqueue(&[msg("k", "1"), msg("k", "2"), msg("j", "3")])
            .await;
        // A store that names no layout migrates the table in its own layout (the other
        // layout's migration would refuse it) and claims, completes and reports through it.
        let config = MysqlConfig::builder()
            .table(db.store.config().table())
            .build()
            .unwrap();
        assert_eq!(config.unpublished_table(), None);
        let store = MysqlStore::new(db.pool().clone(), config);
        store.migrate().await.unwrap();
        let indexes_now = indexes(&db).await;
        assert_eq!(indexes_now.contains(&"ix_claim".to_owned()), !layout);
        let claim = store
            .claim(&outbox_traits::ClaimRequest {
                limit: 2,
                lease: Duration::from_secs(30),
                head_policy: Block,
                shard: None,
            })
            .await
            .unwrap();
        assert_eq!(names(&claim), ["1", "2"], "layout {layout}");
        store.complete(claim.token, &ids(&claim)).await.unwrap();
        let status = store.status(0).await.unwrap();
        assert_eq!((status.pending, status.leased), (1, 0), "layout {layout}");
        if layout {
            assert_eq!(entries(&db).await.len(), 1);
        }
        assert_eq!(store.purge_published(Duration::ZERO, 10).await.unwrap(), 2);
        db.drop().await;
    }
}
