//! A time-partitioned outbox table (`partition_interval`): the shared conformance suite against
//! it, and what only it does: partitions made by the migration, retention by dropping whole
//! partitions, order and dedup across partitions, and the refusals when a table and a
//! configuration disagree on the shape.

mod common;

use std::time::Duration;

use common::harness::PgHarness;
use common::{db_with, msg, random_schema, Db, URL_VAR};
use outbox_backend_postgres::{PostgresConfig, PostgresStore};
use outbox_conformance_tests::env::service_url;
use outbox_traits::{ClaimRequest, Error, HeadPolicy, OutboxAdmin, OutboxStore};
use sqlx::Executor;

/// The suite on one-minute partitions: the harness's clock control moves rows back in time, so
/// rows move between partitions and into the DEFAULT one as the checks run. Every check runs;
/// the two properties at an eighth of the cases (`reduced: 8`, 32 at CI's default count).
mod conformance {
    use super::*;

    outbox_conformance_tests::conformance_suite!(optional: PgHarness::from_env()
        .map(|h| h.partitioned(Duration::from_secs(60))), reduced: 8);
}

const HOUR: Duration = Duration::from_secs(3600);

async fn partitioned_db() -> Option<Db> {
    db_with(|b| b.partition_interval(Some(HOUR))).await
}

/// The names of the table's partitions, sorted.
async fn partitions(db: &Db) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = $1::regclass ORDER BY 1",
    )
    .bind(db.table())
    .fetch_all(db.pool())
    .await
    .unwrap()
}

/// Create the partitions from `hours_ago` hours back to now.
async fn premake_back(db: &Db, hours_ago: i32) {
    let premake = db.config.premake_function().unwrap().to_owned();
    sqlx::query(&format!(
        "SELECT {premake}($1, now() - $1 * interval '1 hour')"
    ))
    .bind(hours_ago)
    .execute(db.pool())
    .await
    .unwrap();
}

/// Insert a row as a SQL writer would, created `hours_ago` hours back, in `state` (published
/// rows were published when created); returns its seq.
async fn insert_at(db: &Db, key: &str, hours_ago: f64, state: &str, dedup: Option<&str>) -> i64 {
    sqlx::query_scalar(&format!(
        "INSERT INTO {} (aggregatetype, aggregateid, type, payload, state, dedup_key,
                         created_at, published_at)
         VALUES ('order', $1, 't', '{{}}', $2, $3,
                 now() - $4 * interval '1 hour',
                 CASE WHEN $2 = 'published' THEN now() - $4 * interval '1 hour' END)
         RETURNING seq",
        db.table()
    ))
    .bind(key)
    .bind(state)
    .bind(dedup)
    .bind(hours_ago)
    .fetch_one(db.pool())
    .await
    .unwrap()
}

/// The partition holding the row `seq`.
async fn partition_of(db: &Db, seq: i64) -> String {
    sqlx::query_scalar(&format!(
        "SELECT tableoid::regclass::text FROM {} WHERE seq = $1",
        db.table()
    ))
    .bind(seq)
    .fetch_one(db.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn migrate_creates_the_parent_the_default_and_the_partitions_ahead_idempotently() {
    let Some(db) = partitioned_db().await else {
        return;
    };
    let kind: String =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = $1::regclass")
            .bind(db.table())
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert_eq!(kind, "p");
    let made = partitions(&db).await;
    // The DEFAULT partition and the current hour's to four hours ahead.
    assert_eq!(made.len(), 6, "{made:?}");
    assert!(made.contains(&"outbox_default".to_owned()), "{made:?}");
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(db.pool())
        .await
        .unwrap();
    let current = format!("outbox_p{}", now.format("%Y%m%dt%H00"));
    assert!(made.contains(&current), "{current} not in {made:?}");
    db.store.migrate().await.unwrap();
    db.store.migrate().await.unwrap();
    assert_eq!(partitions(&db).await, made);
    // A message enqueued now lands in the current hour's partition.
    db.enqueue(&[msg("k", "now")]).await;
    let seq: i64 = sqlx::query_scalar(&format!("SELECT max(seq) FROM {}", db.table()))
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert!(
        partition_of(&db, seq)
            .await
            .ends_with(&format!("\"{current}\""))
            || partition_of(&db, seq).await.ends_with(&current)
    );
    db.drop().await;
}

#[tokio::test]
async fn purge_drops_old_published_partitions_and_keeps_the_unfinished_rows() {
    let Some(db) = partitioned_db().await else {
        return;
    };
    premake_back(&db, 6).await;
    // 6 h ago: published only (dropped whole). 5 h ago: published and one pending (kept,
    // published rows deleted). 4 h ago: published and one dead (likewise). 30 days ago: no
    // partition, the DEFAULT one.
    let mut seqs = Vec::new();
    for i in 0..3 {
        seqs.push(
            insert_at(
                &db,
                &format!("a{i}"),
                5.9,
                "published",
                Some(&format!("d{i}")),
            )
            .await,
        );
    }
    let pub5 = insert_at(&db, "b", 4.9, "published", None).await;
    let pending = insert_at(&db, "b", 4.9, "pending", Some("pending-key")).await;
    let pub4 = insert_at(&db, "c", 3.9, "published", None).await;
    let dead = insert_at(&db, "c", 3.9, "dead", None).await;
    let old = insert_at(&db, "z", 720.0, "published", Some("old")).await;
    let recent = insert_at(&db, "r", 0.0, "published", None).await;
    // 2.5 h ago, published just now: its partition ended before the cut-off, but the row is
    // not old enough to purge, so the partition stays.
    let late = insert_at(&db, "l", 2.5, "published", None).await;
    sqlx::query(&format!(
        "UPDATE {} SET published_at = now() WHERE seq = $1",
        db.table()
    ))
    .bind(late)
    .execute(db.pool())
    .await
    .unwrap();
    let old_partition = partition_of(&db, seqs[0]).await;
    assert!(old_partition.contains("outbox_p"), "{old_partition}");
    assert_ne!(partition_of(&db, pub5).await, old_partition);
    assert!(partition_of(&db, old).await.contains("outbox_default"));

    // Older than 2 hours: the partitions of 6, 5 and 4 hours ago ended before that.
    let removed = db
        .store
        .purge_published(Duration::from_secs(2 * 3600), 100)
        .await
        .unwrap();
    // 3 dropped with their partition, 2 deleted from pinned ones, 1 from the DEFAULT one.
    assert_eq!(removed, 6);
    let left = partitions(&db).await;
    assert!(
        !left
            .iter()
            .any(|p| old_partition.ends_with(p.as_str())
                || old_partition.ends_with(&format!("\"{p}\""))),
        "{left:?}"
    );
    let states: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT seq, state FROM {} ORDER BY seq",
        db.table()
    ))
    .fetch_all(db.pool())
    .await
    .unwrap();
    assert_eq!(
        states,
        [
            (pending, "pending".to_owned()),
            (dead, "dead".to_owned()),
            (recent, "published".to_owned()),
            (late, "published".to_owned())
        ]
    );
    let _ = (pub4, pub5);
    // The dropped rows' dedup keys are free again; the pending row's is not.
    db.enqueue(&[
        msg("k", "again").with_dedup_key("d0"),
        msg("k", "old").with_dedup_key("old"),
    ])
    .await;
    let mut tx = db.pool().begin().await.unwrap();
    let dup = outbox_backend_postgres::enqueue(
        &mut *tx,
        &db.config,
        &msg("k", "dup").with_dedup_key("pending-key"),
    )
    .await;
    assert!(
        matches!(dup, Err(Error::DuplicateKey { ref key }) if key == "pending-key"),
        "{dup:?}"
    );
    drop(tx);
    // Nothing more to remove: the relay's loop ends.
    assert_eq!(
        db.store
            .purge_published(Duration::from_secs(2 * 3600), 100)
            .await
            .unwrap(),
        0
    );
    db.drop().await;
}

#[tokio::test]
async fn a_key_with_rows_in_two_partitions_is_claimed_in_seq_order() {
    let Some(db) = partitioned_db().await else {
        return;
    };
    premake_back(&db, 3).await;
    // The key's first message is in the newer partition, its second in an older one.
    let first = insert_at(&db, "k", 0.0, "pending", None).await;
    let second = insert_at(&db, "k", 2.5, "pending", None).await;
    assert_ne!(
        partition_of(&db, first).await,
        partition_of(&db, second).await
    );
    let claim = db.claim(10, HeadPolicy::Block).await;
    let got: Vec<i64> = claim.messages.iter().map(|m| m.seq).collect();
    assert_eq!(got, [first, second]);
    // With the head leased, nobody else gets the second.
    db.store
        .release(claim.token, &[claim.messages[1].id])
        .await
        .unwrap();
    let other = db.claim(10, HeadPolicy::Block).await;
    assert!(other.messages.is_empty(), "{:?}", other.messages);
    db.drop().await;
}

#[tokio::test]
async fn dedup_keys_are_unique_across_partitions() {
    let Some(db) = partitioned_db().await else {
        return;
    };
    premake_back(&db, 3).await;
    insert_at(&db, "k", 2.5, "pending", Some("once")).await;
    let mut tx = db.pool().begin().await.unwrap();
    let dup = outbox_backend_postgres::enqueue(
        &mut *tx,
        &db.config,
        &msg("k", "x").with_dedup_key("once"),
    )
    .await;
    assert!(
        matches!(dup, Err(Error::DuplicateKey { ref key }) if key == "once"),
        "{dup:?}"
    );
    drop(tx);
    // A SQL writer, into a third partition, is refused by the database too.
    let sql = sqlx::query(&format!(
        "INSERT INTO {} (aggregatetype, aggregateid, type, payload, dedup_key, created_at)
         VALUES ('o', 'k', 't', '{{}}', 'once', now() - interval '1 hour')",
        db.table()
    ))
    .execute(db.pool())
    .await;
    assert!(sql.is_err());
    // Deleting the row frees the key (the delete trigger).
    sqlx::query(&format!(
        "DELETE FROM {} WHERE dedup_key = 'once'",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    db.enqueue(&[msg("k", "x").with_dedup_key("once")]).await;
    db.drop().await;
}

#[tokio::test]
async fn a_table_and_a_configuration_of_different_shapes_are_refused() {
    let Some(url) = service_url(URL_VAR) else {
        return;
    };
    let schema = random_schema();
    let plain = PostgresConfig::builder()
        .schema(&schema)
        .table("plain")
        .build()
        .unwrap();
    let parted = PostgresConfig::builder()
        .schema(&schema)
        .table("parted")
        .partition_interval(Some(HOUR))
        .build()
        .unwrap();
    let open = |config: PostgresConfig| {
        let url = url.clone();
        async move { PostgresStore::connect(&url, config).await.unwrap() }
    };
    open(plain.clone()).await.migrate().await.unwrap();
    open(parted.clone()).await.migrate().await.unwrap();
    // The same tables asked for in the other shape.
    let plain_as_parted = PostgresConfig::builder()
        .schema(&schema)
        .table("plain")
        .partition_interval(Some(HOUR))
        .build()
        .unwrap();
    let parted_as_plain = PostgresConfig::builder()
        .schema(&schema)
        .table("parted")
        .build()
        .unwrap();
    let e = open(plain_as_parted.clone())
        .await
        .migrate()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidInput(_)), "{e}");
    assert!(
        e.to_string().contains("is a plain table") && e.to_string().contains("partitioned one"),
        "{e}"
    );
    let e = open(parted_as_plain.clone())
        .await
        .migrate()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidInput(_)), "{e}");
    assert!(
        e.to_string().contains("is partitioned") && e.to_string().contains("plain one"),
        "{e}"
    );
    // A relay whose configuration lacks the setting never claims from (or purges) the
    // partitioned table; nor the reverse.
    let request = ClaimRequest {
        limit: 10,
        lease: Duration::from_secs(30),
        head_policy: HeadPolicy::Block,
        shard: None,
    };
    for config in [parted_as_plain, plain_as_parted] {
        let store = open(config).await;
        let e = store.claim(&request).await.unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{e}");
        let e = store.purge_published(HOUR, 10).await.unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{e}");
    }
    let store = open(plain).await;
    store
        .pool()
        .execute(format!("DROP SCHEMA \"{schema}\" CASCADE").as_str())
        .await
        .unwrap();
}

#[tokio::test]
async fn the_url_parameter_gives_the_interval() {
    let Some(url) = service_url(URL_VAR) else {
        return;
    };
    let options = outbox_url::StoreOptions {
        schema: Some(random_schema()),
        ..Default::default()
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    let store = outbox_backend_postgres::url::open_url(
        &format!("{url}{sep}partition_interval=1d"),
        &options,
    )
    .await
    .unwrap();
    assert_eq!(
        store.config().partition_interval(),
        Some(Duration::from_secs(86_400))
    );
    store.migrate().await.unwrap();
    let kind: String =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = $1::regclass")
            .bind(store.config().qualified_table())
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(kind, "p");
    store
        .pool()
        .execute(format!("DROP SCHEMA \"{}\" CASCADE", store.config().schema()).as_str())
        .await
        .unwrap();
}
