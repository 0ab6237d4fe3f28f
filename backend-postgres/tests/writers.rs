//! Writers that are not this crate: a plain SQL INSERT wakes the relays through the table's
//! trigger, and the key lock keeps one key's concurrent writers in insert order.

mod common;

use std::time::Duration;

use common::{db, db_with, msg, names, Db};
use outbox_backend_postgres::{enqueue, enqueue_batch};
use outbox_traits::{Error, HeadPolicy, OutboxAdmin, OutboxStore};
use sqlx::{Postgres, Transaction};

/// Insert one message the way a service in another language does: the minimal columns, its
/// own id, no `pg_notify`.
async fn plain_insert(executor: &mut sqlx::PgConnection, db: &Db, key: &str, name: &str) {
    sqlx::query(&format!(
        "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, partition_key)
         VALUES (gen_random_uuid(), 'test', $1, 'test.event', jsonb_build_object('name', $2::text), $1)",
        db.table()
    ))
    .bind(key)
    .bind(name)
    .execute(executor)
    .await
    .unwrap();
}

async fn trigger_present(db: &Db) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = $2)",
    )
    .bind(db.table())
    .bind(db.config.notify_trigger())
    .fetch_one(db.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_plain_sql_insert_wakes_a_listening_relay() {
    let Some(db) = db().await else { return };
    assert!(trigger_present(&db).await);
    let mut wake = db.store.wakeups().await.unwrap().expect("a wake source");
    let mut conn = db.pool().acquire().await.unwrap();
    plain_insert(&mut conn, &db, "k", "1").await;
    // Guard against a hang only; the wake-up arrives as soon as the insert commits.
    tokio::time::timeout(Duration::from_secs(60), wake.wait())
        .await
        .expect("no wake-up after a plain SQL insert")
        .unwrap();
    // Closing the pool waits for every connection taken from it.
    drop(conn);
    db.drop().await;
}

#[tokio::test]
async fn migrate_adds_the_trigger_to_an_older_table_and_notify_off_removes_it() {
    let Some(db) = db().await else { return };
    // A table migrated by a release before the trigger.
    sqlx::query(&format!(
        "DROP TRIGGER \"{}\" ON {}",
        db.config.notify_trigger(),
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    assert!(!trigger_present(&db).await);
    db.store.migrate().await.unwrap();
    assert!(trigger_present(&db).await);
    // Idempotent.
    db.store.migrate().await.unwrap();
    assert!(trigger_present(&db).await);

    // The same table with NOTIFY off: the migration drops the trigger, and an insert then
    // sends nothing (a listener on the channel sees only the one sent by hand afterwards).
    let quiet_config = outbox_backend_postgres::PostgresConfig::builder()
        .schema(&db.schema)
        .notify(false)
        .build()
        .unwrap();
    outbox_backend_postgres::migrate(db.pool(), &quiet_config)
        .await
        .unwrap();
    assert!(!trigger_present(&db).await);
    let mut listener = sqlx::postgres::PgListener::connect_with(db.pool())
        .await
        .unwrap();
    listener.listen(db.config.notify_channel()).await.unwrap();
    let mut conn = db.pool().acquire().await.unwrap();
    plain_insert(&mut conn, &db, "k", "1").await;
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(db.config.notify_channel())
        .execute(&mut *conn)
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(60), listener.recv())
        .await
        .expect("no notification at all")
        .unwrap();
    assert_eq!(first.payload(), "marker", "the insert notified");
    drop((listener, conn));
    db.drop().await;
}

/// The backend pid of `tx`'s connection.
async fn pid(tx: &mut Transaction<'static, Postgres>) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **tx)
        .await
        .unwrap()
}

/// Wait until backend `pid` waits for an advisory lock (read from `pg_locks`, no timing).
async fn waits_for_key_lock(
    db: &Db,
    pid: i32,
    writer: &tokio::task::JoinHandle<Result<(), Error>>,
) {
    let waiting = async {
        loop {
            if writer.is_finished() {
                // Not waiting any more: the test's next `writer.await` reports how it ended.
                return;
            }
            let waiting: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_locks
                                WHERE pid = $1 AND locktype = 'advisory' AND NOT granted)",
            )
            .bind(pid)
            .fetch_one(db.pool())
            .await
            .unwrap();
            if waiting {
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
    // The precondition the README states: order follows seq only among committed rows, so
    // the relay publishes the later-inserted message while the earlier one is uncommitted.
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
    // The first writer is a foreign one: the documented SQL function, then a plain INSERT.
    let mut first = db.pool().begin().await.unwrap();
    let locked: i32 = sqlx::query_scalar(&format!("SELECT {}($1)", db.config.lock_function()))
        .bind("k")
        .fetch_one(&mut *first)
        .await
        .unwrap();
    assert_eq!(locked, 1);
    plain_insert(&mut first, &db, "k", "inserted-first").await;

    // The second writer, this crate's enqueue with the option on, waits for the first's
    // transaction before it inserts; a writer of another key does not wait.
    let mut other = db.pool().begin().await.unwrap();
    enqueue(&mut *other, &db.config, &msg("other", "other-key"))
        .await
        .unwrap();
    other.commit().await.unwrap();
    let mut second = db.pool().begin().await.unwrap();
    let second_pid = pid(&mut second).await;
    let config = db.config.clone();
    let writer = tokio::spawn(async move {
        enqueue_batch(
            &mut *second,
            &config,
            &[msg("k", "inserted-second"), msg("k", "inserted-third")],
        )
        .await?;
        second
            .commit()
            .await
            .map_err(|e| Error::transient(e.to_string(), None))
    });
    waits_for_key_lock(&db, second_pid, &writer).await;
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
    db.drop().await;
}

#[tokio::test]
async fn lock_keys_with_unordered_messages_only_takes_no_lock() {
    let Some(db) = db_with(|b| b.lock_keys(true)).await else {
        return;
    };
    let mut tx = db.pool().begin().await.unwrap();
    let unordered = msg("k", "unordered").unordered();
    enqueue(&mut *tx, &db.config, &unordered).await.unwrap();
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(held, 0);
    tx.commit().await.unwrap();
    assert_eq!(db.store.counts().await.unwrap().pending, 1);
    db.drop().await;
}
