//! Concurrent writers of one key: without the key lock a message inserted later but committed
//! first is published first; with it the second writer waits, and order is insert order.

mod common;

use common::{db, db_with, msg, names, Db};
use outbox_backend_mysql::{enqueue, enqueue_batch};
use outbox_traits::{Error, HeadPolicy};

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
    // This crate's enqueue with the option on waits for the first transaction. Seen without
    // timing anything: with the second session's lock wait cut to the server's minimum, its
    // enqueue fails with a lock wait timeout (1205) while the first is open, and MariaDB rolls
    // back only that statement, so the transaction carries on.
    let mut second = db.pool().begin().await.unwrap();
    sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
        .execute(&mut *second)
        .await
        .unwrap();
    let batch = [
        msg("k", "inserted-second"),
        msg("k", "inserted-third").with_header("h", "v'\\\"; --"),
    ];
    let err = enqueue_batch(&mut *second, &db.config, &batch)
        .await
        .expect_err("the second writer did not wait for the key lock");
    assert!(err.is_transient(), "{err}");
    assert!(err.to_string().contains("1205"), "{err}");
    assert_eq!(
        names(&db.claim(10, HeadPolicy::Block).await),
        ["other-key"],
        "nothing of key k is committed, and the waiting writer inserted nothing"
    );
    first.commit().await.unwrap();
    enqueue_batch(&mut *second, &db.config, &batch)
        .await
        .unwrap();
    sqlx::query("SET SESSION innodb_lock_wait_timeout = DEFAULT")
        .execute(&mut *second)
        .await
        .unwrap();
    second.commit().await.unwrap();
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

/// A SQL writer that leaves `id` out gets a time-ordered UUIDv7 (version 7, RFC variant, the
/// database's time in its first 48 bits), unique, in insert order by its time; one that gives
/// an id keeps it (lowered). Rows of one `INSERT ... SELECT` get distinct ids too.
#[tokio::test]
async fn an_omitted_id_is_a_time_ordered_v7() {
    let Some(db) = db().await else { return };
    let table = db.table().to_owned();
    let mut conn = db.pool().acquire().await.unwrap();
    let before: i64 =
        sqlx::query_scalar("SELECT CAST(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    for n in 0..50 {
        sqlx::query(&format!(
            "INSERT INTO {table} (aggregatetype, aggregateid, type, payload) \
             VALUES ('o', 'k{n}', 't', '{{}}')"
        ))
        .execute(&mut *conn)
        .await
        .unwrap();
    }
    sqlx::query(&format!(
        "INSERT INTO {table} (aggregatetype, aggregateid, type, payload) \
         SELECT 'o', CONCAT('bulk', seq), 't', '{{}}' FROM {table}"
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    // An explicit NULL is an id left out too.
    sqlx::query(&format!(
        "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload) \
         VALUES (NULL, 'o', 'null-id', 't', '{{}}')"
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload) \
         VALUES ('0192F0A4-1B2C-7D3E-8F40-123456789ABC', 'o', 'given', 't', '{{}}')"
    ))
    .execute(&mut *conn)
    .await
    .unwrap();
    let after: i64 =
        sqlx::query_scalar("SELECT CAST(FLOOR(UNIX_TIMESTAMP(NOW(3)) * 1000) AS SIGNED)")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    let rows: Vec<(String, String)> = sqlx::query_as(&format!(
        "SELECT CAST(id AS CHAR CHARACTER SET utf8mb4), \
                CAST(aggregateid AS CHAR CHARACTER SET utf8mb4) FROM {table} ORDER BY seq"
    ))
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert_eq!(rows.len(), 102);
    let (given, made) = rows.split_last().unwrap();
    assert_eq!(
        given.0, "0192f0a4-1b2c-7d3e-8f40-123456789abc",
        "a given id is kept, lowered"
    );
    let mut last_ms = 0;
    let mut seen = std::collections::HashSet::new();
    for (id, key) in made {
        let uuid = uuid::Uuid::parse_str(id).unwrap();
        assert_eq!(uuid.get_version_num(), 7, "{key}: {id}");
        assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{key}: {id}");
        assert_eq!(id, &id.to_lowercase(), "{key}: {id}");
        let ms = i64::from_str_radix(&id.replace('-', "")[..12], 16).unwrap();
        assert!(
            (before..=after).contains(&ms),
            "{key}: {id} is not from the insert's time"
        );
        assert!(ms >= last_ms, "{key}: {id} is older than the row before it");
        last_ms = ms;
        assert!(seen.insert(id.clone()), "{key}: {id} given twice");
    }
    drop(conn);
    db.drop().await;
}

/// A table made before v7 ids (ids defaulting to `UUID()`, the trigger that only lowered ids)
/// gets the v7 default from `migrate`, and a second migrate changes nothing.
#[tokio::test]
async fn migrate_gives_an_old_table_the_v7_default() {
    upgrade_from(
        "id_case",
        "SET NEW.id = LOWER(NEW.id)",
        "ALTER TABLE {table} ALTER COLUMN id SET DEFAULT (UUID());",
    )
    .await;
}

/// A table made with the first v7 trigger (`..._ids`, a slower body) gets the current one in
/// its place. Its stand-in here writes v1 ids, so that the test tells which trigger ran.
#[tokio::test]
async fn migrate_replaces_the_first_v7_trigger() {
    upgrade_from(
        "ids",
        "SET NEW.id = IF(NEW.id = '', UUID(), LOWER(NEW.id))",
        "",
    )
    .await;
}

/// Put the table back as an earlier version left it (its id trigger `{name}_{suffix}` with
/// `body`, then `extra` SQL), insert a row leaving the id out, migrate twice, insert again:
/// the first row has the earlier trigger's v1 id, the second a v7, and only the current id
/// trigger is left.
async fn upgrade_from(suffix: &str, body: &str, extra: &str) {
    let Some(db) = db().await else { return };
    let table = db.table().to_owned();
    let name = db.config.table().to_owned();
    let extra = extra.replace("{table}", &table);
    sqlx::raw_sql(&format!(
        "DROP TRIGGER `{name}_id_v7`;
         CREATE TRIGGER `{name}_{suffix}` BEFORE INSERT ON {table} FOR EACH ROW {body};
         {extra}"
    ))
    .execute(db.pool())
    .await
    .unwrap();
    let insert = format!(
        "INSERT INTO {table} (aggregatetype, aggregateid, type, payload) VALUES ('o', 'k', 't', '{{}}')"
    );
    sqlx::query(&insert).execute(db.pool()).await.unwrap();
    db.store.migrate().await.unwrap();
    db.store.migrate().await.unwrap();
    sqlx::query(&insert).execute(db.pool()).await.unwrap();
    let ids: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT CAST(id AS CHAR CHARACTER SET utf8mb4) FROM {table} ORDER BY seq"
    ))
    .fetch_all(db.pool())
    .await
    .unwrap();
    let versions: Vec<usize> = ids
        .iter()
        .map(|id| uuid::Uuid::parse_str(id).unwrap().get_version_num())
        .collect();
    assert_eq!(versions, [1, 7], "{ids:?}");
    let triggers: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(TRIGGER_NAME AS CHAR CHARACTER SET utf8mb4) FROM information_schema.TRIGGERS \
         WHERE EVENT_OBJECT_SCHEMA = DATABASE() AND EVENT_OBJECT_TABLE = ? ORDER BY TRIGGER_NAME",
    )
    .bind(&name)
    .fetch_all(db.pool())
    .await
    .unwrap();
    let id_triggers: Vec<&String> = triggers
        .iter()
        .filter(|t| t.starts_with(&format!("{name}_id")))
        .collect();
    assert_eq!(id_triggers, [&format!("{name}_id_v7")], "{triggers:?}");
    db.drop().await;
}
