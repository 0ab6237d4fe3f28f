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

/// A table with claim indexes, holding published, retried, dead and pending rows, converted to
/// an unpublished table (`convert_to_unpublished_table`): refused while a message is leased,
/// then converted once; a store that names no layout then serves it through the unpublished
/// table, and every message goes on in its key's order, the dead ones after their requeue.
#[tokio::test]
async fn a_table_with_claim_indexes_converts_to_an_unpublished_table() {
    let Some(old) = db_with(|b| b.unpublished_table(false)).await else {
        return;
    };
    old.enqueue(&[
        msg("a", "a1"),
        msg("b", "b1"),
        msg("c", "c1"),
        msg("d", "d1"),
        msg("a", "a2"),
        msg("b", "b2"),
        msg("c", "c2"),
        msg("d", "d2"),
        msg("a", "a3"),
    ])
    .await;
    // a1 published, b1 to retry, c1 dead; d1 stays leased for now.
    let claim = old.claim(4, Block).await;
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
    let table = old.store.config().table().to_owned();
    let config = MysqlConfig::builder().table(&table).build().unwrap();
    let fresh = || MysqlStore::new(old.pool().clone(), config.clone());
    let err = fresh().convert_to_unpublished_table().await.unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert!(err.to_string().contains("1 message(s)"), "{err}");
    assert!(indexes(&old).await.contains(&"ix_claim".to_owned()));
    let deleting = MysqlConfig::builder()
        .table(&table)
        .delete_published(true)
        .build()
        .unwrap();
    let err = MysqlStore::new(old.pool().clone(), deleting)
        .convert_to_unpublished_table()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    old.store
        .release(claim.token, &[claim.messages[3].id])
        .await
        .unwrap();

    assert!(fresh().convert_to_unpublished_table().await.unwrap());
    assert_eq!(indexes(&old).await, ["PRIMARY", "uq_dedup_key", "uq_id"]);
    assert!(
        !fresh().convert_to_unpublished_table().await.unwrap(),
        "again"
    );
    // One entry per pending or dead row, in its state.
    let mut expected: Vec<(String, i64)> = seqs_in(&old, "pending")
        .await
        .into_iter()
        .map(|seq| ("pending".to_owned(), seq))
        .chain(
            seqs_in(&old, "dead")
                .await
                .into_iter()
                .map(|seq| ("dead".to_owned(), seq)),
        )
        .collect();
    expected.sort_by_key(|(_, seq)| *seq);
    assert_eq!(entries(&old).await, expected);

    let db = Db {
        url: old.url.clone(),
        store: fresh(),
        config: config.clone(),
    };
    db.store.migrate().await.unwrap();
    db.enqueue(&[msg("b", "b3"), msg("f", "f1")]).await;
    let mut published = Vec::new();
    for _ in 0..10 {
        let claim = db.claim(3, Block).await;
        db.store.complete(claim.token, &ids(&claim)).await.unwrap();
        published.extend(names(&claim));
    }
    // c is held by its dead head; the rest in order.
    assert_eq!(published, ["b1", "d1", "a2", "b2", "d2", "a3", "b3", "f1"]);
    let dead = db.store.list_dead(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(db.store.requeue(&[dead[0].message.id]).await.unwrap(), 1);
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["c1", "c2"]);
    db.store.complete(claim.token, &ids(&claim)).await.unwrap();
    assert!(entries(&db).await.is_empty());
    let counts = db.store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.dead, counts.published), (0, 0, 11));
    db.drop().await;
}

/// A writer whose transaction is open when the conversion starts: the conversion waits for it
/// (the triggers' metadata lock) while it goes on, and its row gets its entry and is claimed in
/// its key's order.
#[tokio::test]
async fn a_writer_open_during_the_conversion_is_waited_for_and_its_row_goes_on() {
    let Some(old) = db_with(|b| b.unpublished_table(false)).await else {
        return;
    };
    old.enqueue(&[msg("k", "before")]).await;
    let mut writer = old.pool().begin().await.unwrap();
    outbox_backend_mysql::enqueue(&mut *writer, &old.config, &msg("k", "during"))
        .await
        .unwrap();
    let table = old.store.config().table().to_owned();
    let config = MysqlConfig::builder().table(&table).build().unwrap();
    let store = MysqlStore::new(old.pool().clone(), config.clone());
    let conversion = tokio::spawn(async move { store.convert_to_unpublished_table().await });
    let start = std::time::Instant::now();
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST
             WHERE STATE LIKE 'Waiting for table metadata lock%' AND INFO LIKE ?",
        )
        .bind(format!("%{table}%"))
        .fetch_one(old.pool())
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(!conversion.is_finished(), "the conversion did not wait");
        assert!(start.elapsed() < Duration::from_secs(30), "never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writer.commit().await.unwrap();
    assert!(conversion.await.unwrap().unwrap());
    let db = Db {
        url: old.url.clone(),
        store: MysqlStore::new(old.pool().clone(), config.clone()),
        config,
    };
    assert_eq!(entries(&db).await.len(), 2);
    db.enqueue(&[msg("k", "after")]).await;
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["before", "during", "after"]);
    db.drop().await;
}
