//! Binary payloads in the MariaDB store: a table made before them is upgraded in place, and
//! rows written by plain SQL (as a service in another language writes them) are claimed with
//! their bytes, or dead-lettered when their content type is not one.

mod common;

use common::{db, db_with, ids, msg, Db};
use outbox_traits::{
    Binary, Error, FailAction, Failure, HeadPolicy, NewMessage, OutboxAdmin, OutboxStore,
};
use uuid::Uuid;

/// The names of the binary columns the table has.
async fn binary_columns(db: &Db) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT CAST(COLUMN_NAME AS CHAR CHARACTER SET utf8mb4) FROM information_schema.COLUMNS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?
           AND COLUMN_NAME IN ('payload_bytes', 'content_type')
         ORDER BY COLUMN_NAME",
    )
    .bind(db.config.table())
    .fetch_all(db.pool())
    .await
    .unwrap()
}

/// Insert one row as a SQL writer does, with `bytes` and `content_type` as SQL expressions.
async fn insert(db: &Db, key: &str, bytes: &str, content_type: &str) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, payload_bytes, content_type)
         VALUES (?, 'order', ?, 'order.placed', 'null', {bytes}, {content_type})",
        db.table()
    ))
    .bind(id.to_string())
    .bind(key)
    .execute(db.pool())
    .await?;
    Ok(id)
}

#[tokio::test]
async fn migrate_adds_the_binary_columns_to_an_older_table_in_place_keeping_its_rows() {
    let Some(db) = db().await else { return };
    // A table made by the previous release: no binary columns, and a row written then.
    sqlx::query(&format!(
        "ALTER TABLE {} DROP COLUMN payload_bytes, DROP COLUMN content_type",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    assert!(binary_columns(&db).await.is_empty());
    let old = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload)
         VALUES (?, 'test', 'old', 'test.event', '{{\"name\": \"old\"}}')",
        db.table()
    ))
    .bind(old.to_string())
    .execute(db.pool())
    .await
    .unwrap();

    db.store.migrate().await.unwrap();
    assert_eq!(binary_columns(&db).await, ["content_type", "payload_bytes"]);
    // Idempotent.
    db.store.migrate().await.unwrap();
    assert_eq!(binary_columns(&db).await, ["content_type", "payload_bytes"]);

    let binary = NewMessage::binary(
        "test",
        "new",
        "test.event",
        Binary::new("application/x-protobuf", vec![0x08, 0x01, 0x00, 0xff]),
    );
    db.enqueue(&[binary.clone(), msg("json", "json")]).await;
    let claim = db.claim(10, HeadPolicy::Block).await;
    let got: Vec<_> = claim
        .messages
        .iter()
        .map(|m| (m.id, m.payload.as_str(), m.binary.clone()))
        .collect();
    assert_eq!(got.len(), 3, "{got:?}");
    // The old row is the JSON message it was.
    assert_eq!(got[0].0, old);
    assert_eq!(got[0].2, None);
    assert!(got[0].1.contains("old"), "{}", got[0].1);
    assert_eq!(
        (got[1].0, got[1].1, got[1].2.clone()),
        (binary.id, "null", binary.binary.clone())
    );
    assert_eq!(got[2].2, None);
    db.drop().await;
}

#[tokio::test]
async fn binary_rows_written_by_plain_sql_are_claimed_and_a_bad_content_type_is_dead_lettered() {
    let Some(db) = db().await else { return };
    // A literal, as the README shows; no content type means application/octet-stream.
    let protobuf = insert(&db, "a", "X'0801'", "'application/x-protobuf'")
        .await
        .unwrap();
    let octets = insert(&db, "b", "X'00ff'", "NULL").await.unwrap();
    // A bound parameter, as a driver sends it.
    let bound = Uuid::now_v7();
    sqlx::query(&format!(
        "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, payload_bytes, content_type)
         VALUES (?, 'order', 'c', 'order.placed', 'null', ?, ?)",
        db.table()
    ))
    .bind(bound.to_string())
    .bind(vec![0xc3_u8, 0x28])
    .bind("application/avro")
    .execute(db.pool())
    .await
    .unwrap();
    // A content type with a line break (a header injection if it were sent), and a good row of
    // another key next to it.
    let bad = insert(
        &db,
        "d",
        "X'01'",
        "CONCAT('text/plain', CHAR(10), 'X-Injected: 1')",
    )
    .await
    .unwrap();
    let good = insert(&db, "e", "X'02'", "'text/plain'").await.unwrap();

    let claim = db.claim(10, HeadPolicy::Block).await;
    let got: Vec<(Uuid, Option<Binary>)> = claim
        .messages
        .iter()
        .map(|m| (m.id, m.binary.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (
                protobuf,
                Some(Binary::new("application/x-protobuf", [0x08, 0x01]))
            ),
            (
                octets,
                Some(Binary::new("application/octet-stream", [0x00, 0xff]))
            ),
            (bound, Some(Binary::new("application/avro", [0xc3, 0x28]))),
            (good, Some(Binary::new("text/plain", [0x02]))),
        ]
    );
    assert!(claim.messages.iter().all(|m| m.payload == "null"));

    // The bad row is dead, its reason naming the column; the listing shows its bytes.
    assert_eq!(db.state(bad).await, "dead");
    let dead = db.store.list_dead(None, 10).await.unwrap();
    let [shown] = dead.as_slice() else {
        panic!("{dead:?}")
    };
    assert_eq!(shown.message.id, bad);
    assert!(
        shown.last_error.contains("column content_type"),
        "{}",
        shown.last_error
    );
    assert_eq!(
        shown.message.binary.as_ref().map(|b| b.data.as_slice()),
        Some(&[0x01][..])
    );
    // A requeue is refused until the row is fixed, then the row is claimed with its bytes.
    let refused = db.store.requeue(&[bad]).await.unwrap_err();
    assert!(
        matches!(&refused, Error::InvalidInput(text) if text.contains("SET content_type")),
        "{refused}"
    );
    sqlx::query(&format!(
        "UPDATE {} SET content_type = 'text/plain' WHERE id = ?",
        db.table()
    ))
    .bind(bad.to_string())
    .execute(db.pool())
    .await
    .unwrap();
    assert_eq!(db.store.requeue(&[bad]).await.unwrap(), 1);
    let again = db.claim(10, HeadPolicy::Block).await;
    assert_eq!(again.messages.len(), 1);
    assert_eq!(
        again.messages[0].binary,
        Some(Binary::new("text/plain", [0x01]))
    );
    db.drop().await;
}

#[tokio::test]
async fn a_new_table_refuses_sql_written_bytes_over_the_payload_limit() {
    let Some(db) = db_with(|b| b.max_payload_bytes(16)).await else {
        return;
    };
    insert(&db, "a", "REPEAT(X'00', 16)", "NULL").await.unwrap();
    let err = insert(&db, "b", "REPEAT(X'00', 17)", "NULL")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("payload_bytes_size"), "{err}");
    db.drop().await;
}

/// A row that got past the table's checks (written with them off, or before a check was added)
/// is leased, extended, retried, released and published like any other row: the relay's own
/// updates change no column a check reads, so they do not run the checks. MariaDB runs every
/// check on every `UPDATE`, and with them on the first lease failed the whole claim, holding
/// back the row written beside it too.
#[tokio::test]
async fn a_row_past_the_tables_checks_goes_through_every_transition() {
    let Some(db) = db_with(|b| b.max_payload_bytes(16)).await else {
        return;
    };
    let big = Uuid::now_v7();
    sqlx::query(&format!(
        "SET STATEMENT check_constraint_checks = 0 FOR
         INSERT INTO {} (id, aggregatetype, aggregateid, type, payload)
         VALUES (?, 'order', 'big', 'order.placed', JSON_OBJECT('pad', REPEAT('x', 64)))",
        db.table()
    ))
    .bind(big.to_string())
    .execute(db.pool())
    .await
    .unwrap();
    db.enqueue(&[msg("small", "small")]).await;

    let claim = db.claim(10, HeadPolicy::Block).await;
    assert_eq!(claim.messages.len(), 2, "{claim:?}");
    assert_eq!(claim.messages[0].id, big);
    // Its payload comes through as written, over the limit.
    let payload: serde_json::Value =
        serde_json::from_str(claim.messages[0].payload.as_str()).unwrap();
    assert_eq!(payload, serde_json::json!({ "pad": "x".repeat(64) }));
    let small = claim.messages[1].id;
    db.store
        .extend(claim.token, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    db.store.complete(claim.token, &[small]).await.unwrap();
    db.store
        .fail(
            claim.token,
            &[Failure {
                id: big,
                error: "broker said no".into(),
                action: FailAction::Retry {
                    delay: std::time::Duration::ZERO,
                },
            }],
        )
        .await
        .unwrap();
    assert_eq!(db.state(big).await, "pending");

    let again = db.claim(10, HeadPolicy::Block).await;
    assert_eq!(ids(&again), [big]);
    db.store.release(again.token, &[big]).await.unwrap();
    let last = db.claim(10, HeadPolicy::Block).await;
    assert_eq!(ids(&last), [big]);
    db.store.complete(last.token, &[big]).await.unwrap();
    assert_eq!(db.state(big).await, "published");
    assert_eq!(db.state(small).await, "published");
    db.drop().await;
}
