//! Concurrent writers of one key: without the key lock a message inserted later but committed
//! first is published first; with it the second writer waits, and order is insert order.

mod common;

use std::time::Duration;

use common::{db, db_with, msg, names, Db};
use outbox_backend_mysql::{enqueue, enqueue_batch};
use outbox_traits::{Error, HeadPolicy};
use sqlx::{MySql, Transaction};

/// Insert one message the way a service in another language does: the minimal columns and
/// its own id.
async fn plain_insert(executor: &mut sqlx::MySqlConnection, db: &Db, key: &str, name: &str) {
    sqlx::query(&format!(
        "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, partition_key)
         VALUES (UUID(), 'test', ?, 'test.event', JSON_OBJECT('name', ?), ?)",
        db.table()
    ))
    .bind(key)
    .bind(name)
    .bind(key)
    .execute(executor)
    .await
    .unwrap();
}

/// The connection id of `tx`'s connection.
async fn connection_id(tx: &mut Transaction<'static, MySql>) -> u64 {
    sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut **tx)
        .await
        .unwrap()
}

/// Wait until connection `id`'s transaction waits for a row lock (read from InnoDB's
/// transaction list, no timing).
async fn waits_for_row_lock(db: &Db, id: u64, writer: &tokio::task::JoinHandle<Result<(), Error>>) {
    let waiting = async {
        loop {
            if writer.is_finished() {
                // Not waiting any more: the test's next `writer.await` reports how it ended.
                return;
            }
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.INNODB_TRX
                 WHERE trx_mysql_thread_id = ? AND trx_state = 'LOCK WAIT'",
            )
            .bind(id)
            .fetch_one(db.pool())
            .await
            .unwrap();
            if waiting > 0 {
                return;
            }
            tokio::task::yield_now().await;
        }
    };
    // Guard against a hang only.
    tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("the second writer never waited for the key lock");
}

#[tokio::test]
async fn without_the_key_lock_a_later_insert_that_commits_first_is_published_first() {
    let Some(db) = db().await else { return };
    let mut first = db.pool().begin().await.unwrap();
    enqueue(&mut *first, &db.config, &msg("k", "inserted-first"))
        .await
        .unwrap();
    let mut second = db.pool().begin().await.unwrap();
    enqueue(&mut *second, &db.config, &msg("k", "inserted-second"))
        .await
        .unwrap();
    second.commit().await.unwrap();
    // The precondition the README states: order follows seq only among committed rows.
    let claim = db.claim(10, HeadPolicy::Block).await;
    assert_eq!(names(&claim), ["inserted-second"]);
    first.commit().await.unwrap();
    db.drop().await;
}

#[tokio::test]
async fn with_the_key_lock_a_second_writer_waits_and_order_is_commit_order() {
    let Some(db) = db_with(|b| b.lock_keys(true)).await else {
        return;
    };
    assert!(db.config.lock_keys());
    // The first writer is a foreign one: the documented upsert, then a plain INSERT.
    let mut first = db.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} (partition_key) VALUES (?)
             ON DUPLICATE KEY UPDATE partition_key = partition_key",
        db.config.key_locks_table()
    ))
    .bind("k")
    .execute(&mut *first)
    .await
    .unwrap();
    plain_insert(&mut first, &db, "k", "inserted-first").await;

    // A writer of another key does not wait.
    let mut other = db.pool().begin().await.unwrap();
    enqueue(&mut *other, &db.config, &msg("other", "other-key"))
        .await
        .unwrap();
    other.commit().await.unwrap();
    // This crate's enqueue with the option on waits for the first transaction.
    let mut second = db.pool().begin().await.unwrap();
    let second_id = connection_id(&mut second).await;
    let config = db.config.clone();
    let writer = tokio::spawn(async move {
        enqueue_batch(
            &mut *second,
            &config,
            &[
                msg("k", "inserted-second"),
                msg("k", "inserted-third").with_header("h", "v'\\\"; --"),
            ],
        )
        .await?;
        second
            .commit()
            .await
            .map_err(|e| Error::transient(e.to_string(), None))
    });
    waits_for_row_lock(&db, second_id, &writer).await;
    assert_eq!(
        names(&db.claim(10, HeadPolicy::Block).await),
        ["other-key"],
        "nothing of key k is committed yet"
    );
    if writer.is_finished() {
        panic!(
            "the second writer did not wait for the key lock: {:?}",
            writer.await
        );
    }
    first.commit().await.unwrap();
    writer.await.unwrap().unwrap();
    let claim = db.claim(10, HeadPolicy::Block).await;
    assert_eq!(
        names(&claim),
        ["inserted-first", "inserted-second", "inserted-third"]
    );
    // The values written as literals read back as given.
    let third = &claim.messages[2];
    assert_eq!(
        third.headers.get("h").map(String::as_str),
        Some("v'\\\"; --")
    );
    assert_eq!(third.partition_key.as_deref(), Some("k"));
    db.drop().await;
}

#[tokio::test]
async fn the_locked_insert_reports_the_same_errors() {
    let Some(db) = db_with(|b| b.lock_keys(true)).await else {
        return;
    };
    let first = msg("k", "a").with_dedup_key("d");
    db.enqueue(std::slice::from_ref(&first)).await;
    let mut tx = db.pool().begin().await.unwrap();
    let again = msg("k", "b").with_dedup_key("d");
    let err = enqueue(&mut *tx, &db.config, &again).await.unwrap_err();
    assert!(
        matches!(&err, Error::DuplicateKey { key } if key == "d"),
        "{err}"
    );
    let reused = msg("k", "c").with_id(first.id);
    let err = enqueue(&mut *tx, &db.config, &reused).await.unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    tx.rollback().await.unwrap();
    db.drop().await;
}
