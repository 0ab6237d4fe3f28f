//! Binary payloads in the Postgres store: a table made before them is upgraded in place, and
//! rows written by plain SQL (as a service in another language writes them) are claimed with
//! their bytes, or dead-lettered when their content type is not one.

mod common;

use common::{db, msg, Db};
use outbox_traits::{Binary, Error, HeadPolicy, NewMessage, OutboxAdmin, OutboxStore};
use uuid::Uuid;

/// The names of the binary columns `table` has.
async fn binary_columns(db: &Db) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT attname::text FROM pg_attribute
         WHERE attrelid = to_regclass($1) AND NOT attisdropped
           AND attname IN ('payload_bytes', 'content_type')
         ORDER BY attname",
    )
    .bind(db.table())
    .fetch_all(db.pool())
    .await
    .unwrap()
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
         VALUES ($1, 'test', 'old', 'test.event', '{{\"name\": \"old\"}}')",
        db.table()
    ))
    .bind(old)
    .execute(db.pool())
    .await
    .unwrap();

    db.store.migrate().await.unwrap();
    assert_eq!(binary_columns(&db).await, ["content_type", "payload_bytes"]);
    // Idempotent.
    db.store.migrate().await.unwrap();
    assert_eq!(binary_columns(&db).await, ["content_type", "payload_bytes"]);

    let bytes = vec![0x08, 0x01, 0x00, 0xff];
    let binary = NewMessage::binary(
        "test",
        "new",
        "test.event",
        Binary::new("application/x-protobuf", bytes.clone()),
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
    let t = db.table().to_owned();
    let insert = |key: &str, bytes: &str, content_type: &str| {
        format!(
            "INSERT INTO {t} (aggregatetype, aggregateid, type, payload, payload_bytes, content_type)
             VALUES ('order', '{key}', 'order.placed', 'null', {bytes}, {content_type})
             RETURNING id"
        )
    };
    let id = |sql: String| {
        let pool = db.pool().clone();
        async move {
            sqlx::query_scalar::<_, Uuid>(&sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    // A literal, as the README shows; no content type means application/octet-stream.
    let protobuf = id(insert("a", r"'\x0801'::bytea", "'application/x-protobuf'")).await;
    let octets = id(insert("b", r"'\x00ff'::bytea", "NULL")).await;
    // A bound parameter, as a driver sends it.
    let bound: Uuid = sqlx::query_scalar(&format!(
        "INSERT INTO {t} (aggregatetype, aggregateid, type, payload, payload_bytes, content_type)
         VALUES ('order', 'c', 'order.placed', 'null', $1, $2) RETURNING id"
    ))
    .bind(vec![0xc3_u8, 0x28])
    .bind("application/avro")
    .fetch_one(db.pool())
    .await
    .unwrap();
    // A content type with a line break (a header injection if it were sent), and a good row of
    // another key next to it.
    let bad = id(insert(
        "d",
        r"'\x01'::bytea",
        r"E'text/plain\nX-Injected: 1'",
    ))
    .await;
    let good = id(insert("e", r"'\x02'::bytea", "'text/plain'")).await;

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
    db.store.complete(claim.token, &[protobuf]).await.unwrap();

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
        "UPDATE {t} SET content_type = 'text/plain' WHERE id = $1"
    ))
    .bind(bad)
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
