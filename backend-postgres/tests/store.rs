//! The Postgres store against a real server: visibility, exclusivity, fencing, order, admin.

mod common;

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{db, db_with, ids, msg, names, random_schema, Db};
use outbox_backend_postgres::{enqueue, enqueue_batch, migrate, PostgresConfig, PostgresStore};
use outbox_traits::{
    ClaimRequest, ClaimShard, Error, ErrorKind, FailAction, Failure, HeadPolicy, OutboxAdmin,
    OutboxStore,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

use HeadPolicy::Block;

#[tokio::test]
async fn two_relays_on_separate_pools_never_overlap_and_keep_key_order() {
    let Some(db) = db().await else { return };
    let mut messages = Vec::new();
    for i in 0..600 {
        let m = msg(&format!("k{}", i % 23), &format!("{i}"));
        messages.push(if i % 7 == 0 { m.unordered() } else { m });
    }
    let key_of: HashMap<Uuid, Option<String>> = messages
        .iter()
        .map(|m| (m.id, m.partition_key.clone()))
        .collect();
    db.enqueue(&messages).await;

    // Every claim, recorded in the order the relays got them.
    let log: Arc<Mutex<Vec<(Uuid, i64)>>> = Arc::default();
    let mut relays = Vec::new();
    for limit in [17usize, 29] {
        let store = PostgresStore::connect(&db.url, db.config.clone())
            .await
            .unwrap();
        let log = log.clone();
        relays.push(tokio::spawn(async move {
            let mut empty_in_a_row = 0;
            while empty_in_a_row < 3 {
                let claim = store
                    .claim(&ClaimRequest {
                        limit,
                        lease: Duration::from_secs(60),
                        head_policy: Block,
                        shard: None,
                    })
                    .await
                    .unwrap();
                assert!(claim.messages.len() <= limit);
                if claim.messages.is_empty() {
                    empty_in_a_row += 1;
                    tokio::task::yield_now().await;
                    continue;
                }
                empty_in_a_row = 0;
                log.lock()
                    .unwrap()
                    .extend(claim.messages.iter().map(|m| (m.id, m.seq)));
                let claimed: Vec<Uuid> = claim.messages.iter().map(|m| m.id).collect();
                store.complete(claim.token, &claimed).await.unwrap();
            }
        }));
    }
    for relay in relays {
        relay.await.unwrap();
    }
    let log = log.lock().unwrap().clone();
    let unique: HashSet<Uuid> = log.iter().map(|(id, _)| *id).collect();
    assert_eq!(unique.len(), log.len(), "a message was claimed twice");
    assert_eq!(unique.len(), messages.len(), "a message was never claimed");
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    for (id, seq) in &log {
        if let Some(key) = &key_of[id] {
            let last = last_seq.insert(key.clone(), *seq);
            assert!(last.is_none_or(|l| l < *seq), "key {key} out of order");
        }
    }
    assert_eq!(db.store.counts().await.unwrap().published, 600);
    db.drop().await;
}

/// A shard's window is sized from its last claim: after a claim that found nothing held, the
/// next window is the limit and an eighth. When rows at its head have been leased meanwhile by
/// another relay, that window comes back short, and the look past it still fills the batch, in
/// seq order; the claim after reads a full window again.
#[tokio::test]
async fn a_window_sized_from_the_last_claim_still_fills_the_batch_when_rows_are_leased_ahead() {
    let Some(db) = db().await else { return };
    let names_of = |prefix: &str, range: std::ops::RangeInclusive<usize>| -> Vec<String> {
        range.map(|i| format!("{prefix}{i:02}")).collect()
    };
    // 40 messages of 40 keys: none waits for another.
    let messages: Vec<_> = names_of("m", 1..=40)
        .iter()
        .map(|name| msg(name, name))
        .collect();
    db.enqueue(&messages).await;
    // First claim: the largest window; it finds nothing held, so the next is 8 + 1 rows.
    let first = db.claim(8, Block).await;
    assert_eq!(names(&first), names_of("m", 1..=8));
    db.store.complete(first.token, &ids(&first)).await.unwrap();
    // Another relay (its own store, so its own windows) leases the next 4.
    let other = PostgresStore::connect(&db.url, db.config.clone())
        .await
        .unwrap();
    let taken = other
        .claim(&ClaimRequest {
            limit: 4,
            lease: Duration::from_secs(30),
            head_policy: Block,
            shard: None,
        })
        .await
        .unwrap();
    assert_eq!(names(&taken), names_of("m", 9..=12));
    // The window of 9 holds 4 leased rows and 5 claimable ones; the look past takes 3 more.
    let second = db.claim(8, Block).await;
    assert_eq!(names(&second), names_of("m", 13..=20));
    // Its window came back short: the next one is the largest again, and fills the batch.
    let third = db.claim(8, Block).await;
    assert_eq!(names(&third), names_of("m", 21..=28));
    other.pool().close().await;
    db.drop().await;
}

#[tokio::test]
async fn a_row_locked_by_a_concurrent_claim_holds_back_its_key() {
    let Some(db) = db().await else { return };
    db.enqueue(&[msg("k", "k1"), msg("k", "k2"), msg("j", "j1")])
        .await;
    // Hold k1's row lock as a concurrent claim would between its lock and its commit.
    let mut other = db.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE payload->>'name' = 'k1' FOR UPDATE",
        db.table()
    ))
    .execute(&mut *other)
    .await
    .unwrap();
    // SKIP LOCKED skips k1, but k2 must not overtake it.
    assert_eq!(names(&db.claim(10, Block).await), ["j1"]);
    other.rollback().await.unwrap();
    assert_eq!(names(&db.claim(10, Block).await), ["k1", "k2"]);
    db.drop().await;
}

/// Claims of two shards run side by side: the rows that one shard's claim holds locked (its
/// candidates, between its lock and its commit) hold back nothing of the other shard's claim,
/// which still fills its batch. An unsharded claim at that moment comes back short, its window
/// half full of locked rows: the control, which is why the relay used to run one claim at a
/// time.
#[tokio::test]
async fn a_claim_of_one_shard_is_not_held_back_by_another_shard_s_claim_in_progress() {
    let Some(db) = db().await else { return };
    let messages: Vec<_> = (0..400)
        .map(|i| msg(&format!("k{}", i % 40), &format!("{i}")))
        .collect();
    db.enqueue(&messages).await;
    // The shard of each row, as the claim computes it (`shard_predicate` in sql.rs).
    let shard = "(hashtext(partition_key)::bigint & 2147483647) % 2";
    let mut other = db.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE {shard} = 0 FOR UPDATE",
        db.table()
    ))
    .execute(&mut *other)
    .await
    .unwrap();
    let req = |shard| ClaimRequest {
        limit: 50,
        lease: Duration::from_secs(60),
        head_policy: Block,
        shard,
    };
    let sharded = db
        .store
        .claim(&req(Some(ClaimShard::new(1, 2).unwrap())))
        .await
        .unwrap();
    assert_eq!(sharded.messages.len(), 50, "shard 1 was held back");
    let in_shard_1: Vec<bool> = sqlx::query_scalar(&format!(
        "SELECT {shard} = 1 FROM {} WHERE id = ANY($1)",
        db.table()
    ))
    .bind(ids(&sharded))
    .fetch_all(db.pool())
    .await
    .unwrap();
    assert!(
        in_shard_1.iter().all(|&yes| yes),
        "a row of shard 0 came back"
    );
    db.store
        .release(sharded.token, &ids(&sharded))
        .await
        .unwrap();
    let unsharded = db.store.claim(&req(None)).await.unwrap();
    assert!(
        unsharded.messages.len() < 50,
        "control: the unsharded claim was expected to come back short, held back by the \
         locked rows; it got {}",
        unsharded.messages.len()
    );
    other.rollback().await.unwrap();
    db.drop().await;
}

#[tokio::test]
async fn the_limit_holds_even_when_the_planner_must_use_nested_loops() {
    let Some(db) = db().await else { return };
    let messages: Vec<_> = (0..300)
        .map(|i| msg(&format!("k{}", i % 5), &format!("{i}")))
        .collect();
    db.enqueue(&messages).await;
    let options = PgConnectOptions::from_str(&db.url)
        .unwrap()
        .options([("enable_hashjoin", "off"), ("enable_mergejoin", "off")]);
    let pool = PgPoolOptions::new().connect_with(options).await.unwrap();
    let hashjoin: String = sqlx::query_scalar("SHOW enable_hashjoin")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(hashjoin, "off");
    let store = PostgresStore::new(pool, db.config.clone());
    let mut seen = HashSet::new();
    loop {
        let claim = store
            .claim(&ClaimRequest {
                limit: 7,
                lease: Duration::from_secs(60),
                head_policy: Block,
                shard: None,
            })
            .await
            .unwrap();
        assert!(
            claim.messages.len() <= 7,
            "over-claim: {}",
            claim.messages.len()
        );
        if claim.messages.is_empty() {
            break;
        }
        for id in ids(&claim) {
            assert!(seen.insert(id));
        }
        store.complete(claim.token, &ids(&claim)).await.unwrap();
    }
    assert_eq!(seen.len(), 300);
    db.drop().await;
}

#[tokio::test]
async fn a_batch_is_one_insert_statement_in_slice_order() {
    let Some(db) = db().await else { return };
    // A statement-level trigger counts INSERT statements on the table.
    let counter = format!("\"{}\".inserts", db.schema);
    for sql in [
        format!("CREATE TABLE {counter} (n int NOT NULL)"),
        format!("INSERT INTO {counter} VALUES (0)"),
        format!(
            "CREATE FUNCTION \"{}\".count_insert() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN UPDATE {counter} SET n = n + 1; RETURN NULL; END $$",
            db.schema
        ),
        format!(
            "CREATE TRIGGER count_insert AFTER INSERT ON {} FOR EACH STATEMENT
             EXECUTE FUNCTION \"{}\".count_insert()",
            db.table(),
            db.schema
        ),
    ] {
        sqlx::query(&sql).execute(db.pool()).await.unwrap();
    }
    let batch: Vec<_> = (0..25).map(|i| msg("k", &format!("{i:02}"))).collect();
    db.enqueue(&batch).await;
    let statements: i32 = sqlx::query_scalar(&format!("SELECT n FROM {counter}"))
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(statements, 1);
    let claim = db.claim(100, Block).await;
    let expected: Vec<String> = (0..25).map(|i| format!("{i:02}")).collect();
    assert_eq!(names(&claim), expected);
    assert!(claim.messages.windows(2).all(|w| w[0].seq < w[1].seq));
    db.drop().await;
}

#[tokio::test]
async fn a_reused_message_id_is_invalid_input() {
    let Some(db) = db().await else { return };
    let first = msg("k", "1");
    db.enqueue(std::slice::from_ref(&first)).await;
    let again = msg("k", "2").with_id(first.id);
    let err = enqueue(db.pool(), &db.config, &again).await.unwrap_err();
    assert!(
        matches!(&err, Error::InvalidInput(text) if text.contains(&first.id.to_string())),
        "{err}"
    );
    db.drop().await;
}

#[tokio::test]
async fn enqueue_runs_in_a_transaction_inside_a_spawned_task() {
    let Some(db) = db().await else { return };
    let (pool, config) = (db.pool().clone(), db.config.clone());
    // Web handlers run on spawned tasks: the enqueue future must be Send.
    tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        enqueue_batch(&mut *tx, &config, &[msg("k", "spawned")])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    })
    .await
    .unwrap();
    assert_eq!(names(&db.claim(10, Block).await), ["spawned"]);
    db.drop().await;
}

#[tokio::test]
async fn invalid_messages_are_refused_before_anything_is_sent() {
    let Some(db) = db_with(|b| b.max_payload_bytes(64)).await else {
        return;
    };
    let mut tx = db.pool().begin().await.unwrap();
    let bad = [
        outbox_traits::NewMessage::new("test", "k", "", serde_json::json!({})),
        msg("k", &"x".repeat(100)),
        msg("k", "nul\0"),
    ];
    for m in &bad {
        let err = enqueue_batch(&mut *tx, &db.config, &[msg("k", "fine"), m.clone()])
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    }
    // Nothing reached the server: the transaction is not aborted and still commits work.
    enqueue(&mut *tx, &db.config, &msg("k", "ok"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(names(&db.claim(10, Block).await), ["ok"]);

    let err = db
        .store
        .claim(&ClaimRequest {
            limit: 0,
            lease: Duration::from_secs(1),
            head_policy: Block,
            shard: None,
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)));
    db.drop().await;
}

#[tokio::test]
async fn invalid_identifiers_are_refused() {
    for (schema, table) in [
        ("pub lic", "outbox"),
        ("public", "out\"box"),
        ("public", "1x"),
    ] {
        let err = PostgresConfig::builder()
            .schema(schema)
            .table(table)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
        assert!(err.to_string().contains("not a valid SQL identifier"));
    }
}

#[tokio::test]
async fn an_unreachable_server_is_unavailable_without_the_password() {
    // Port 1 on loopback: nothing listens there.
    let url = "postgres://outbox:hunter2@127.0.0.1:1/test";
    let err = PostgresStore::connect(url, PostgresConfig::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.is_transient());
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("127.0.0.1:1"), "{text}");

    // An existing store whose server went away: calls fail as Unavailable too.
    let options = PgConnectOptions::from_str(url).unwrap();
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(options);
    let store = PostgresStore::new(pool, PostgresConfig::default());
    let err = store.counts().await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("hunter2"));
}

#[tokio::test]
async fn a_missing_table_is_a_permanent_error_that_says_to_migrate() {
    let Some(url) = outbox_conformance_tests::env::service_url(common::URL_VAR) else {
        return;
    };
    let config = PostgresConfig::builder()
        .schema(random_schema())
        .build()
        .unwrap();
    let store = PostgresStore::connect(&url, config).await.unwrap();
    let err = store
        .claim(&ClaimRequest {
            limit: 1,
            lease: Duration::from_secs(1),
            head_policy: Block,
            shard: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Permanent);
    assert!(err.to_string().contains("migrate()"), "{err}");
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_when_run_concurrently() {
    let Some(url) = outbox_conformance_tests::env::service_url(common::URL_VAR) else {
        return;
    };
    let schema = random_schema();
    // Two tables in one new schema, each migrated by several processes at once.
    let mut runs = Vec::new();
    for i in 0..6 {
        let table = if i % 2 == 0 { "outbox" } else { "outbox_b" };
        let config = PostgresConfig::builder()
            .schema(&schema)
            .table(table)
            .build()
            .unwrap();
        let pool = PgPoolOptions::new().connect(&url).await.unwrap();
        runs.push(tokio::spawn(async move { migrate(&pool, &config).await }));
    }
    for run in runs {
        run.await.unwrap().unwrap();
    }
    let config = PostgresConfig::builder().schema(&schema).build().unwrap();
    let store = PostgresStore::connect(&url, config.clone()).await.unwrap();
    store.migrate().await.unwrap();
    let indexes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'outbox'",
    )
    .bind(&schema)
    .fetch_one(store.pool())
    .await
    .unwrap();
    // Primary key, dedup unique, and the cursor layout's (a new table's by default): seq, key
    // and seq, the two aside indexes, failed rows by key.
    assert_eq!(indexes, 7);
    let db = Db {
        url,
        store,
        config,
        schema,
    };
    db.drop().await;
}

#[tokio::test]
async fn a_listener_is_woken_after_a_commit() {
    let Some(db) = db().await else { return };
    assert!(db.store.capabilities().wakeups);
    assert!(db.store.capabilities().concurrent_claimers);
    let mut wake = db.store.wakeups().await.unwrap().expect("a wake source");
    let mut tx = db.pool().begin().await.unwrap();
    enqueue(&mut *tx, &db.config, &msg("k", "1")).await.unwrap();
    tx.commit().await.unwrap();
    // Guard against a hang only; the wake-up arrives as soon as the commit is delivered.
    tokio::time::timeout(Duration::from_secs(60), wake.wait())
        .await
        .expect("no wake-up after a committed enqueue")
        .unwrap();

    // The server ends the listening session: the source wakes the relay (notifications may
    // have been missed), listens again on a new connection, and sees the next commit.
    let terminated: bool = sqlx::query_scalar(
        "SELECT bool_and(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE query = 'LISTEN \"' || $1 || '\"'",
    )
    .bind(db.config.notify_channel())
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert!(terminated);
    tokio::time::timeout(Duration::from_secs(60), wake.wait())
        .await
        .expect("no wake-up after the listening session ended")
        .unwrap();
    enqueue(db.pool(), &db.config, &msg("k", "2"))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), wake.wait())
        .await
        .expect("no wake-up after a commit on the new connection")
        .unwrap();

    let quiet = db_with(|b| b.notify(false)).await.unwrap();
    assert!(!quiet.store.capabilities().wakeups);
    assert!(quiet.store.wakeups().await.unwrap().is_none());
    quiet.drop().await;
    db.drop().await;
}

#[tokio::test]
async fn migrate_upgrades_a_table_whose_leases_are_a_state() {
    // Such a table has the partial-index layout, which the migration of a configuration that
    // names no layout (the default) keeps.
    let Some(db) = db_with(|b| b.cursor_claims(false)).await else {
        return;
    };
    db.enqueue(&[msg("k", "held"), msg("k", "next")]).await;
    let t = db.table();
    // The claim indexes and a live lease as the version that wrote `state = 'leased'` made them.
    for sql in [
        format!("DROP INDEX \"{}\".outbox_claim_idx", db.schema),
        format!("DROP INDEX \"{}\".outbox_key_idx", db.schema),
        format!("CREATE INDEX outbox_claim_idx ON {t} (seq) WHERE state IN ('pending', 'leased')"),
        format!(
            "CREATE INDEX outbox_key_idx ON {t} (partition_key, seq) \
             WHERE state IN ('pending', 'leased', 'dead')"
        ),
        format!("ALTER TABLE {t} RESET (fillfactor)"),
        format!(
            "UPDATE {t} SET state = 'leased', lease_token = gen_random_uuid(), \
             lease_until = now() + interval '1 hour' WHERE seq = (SELECT min(seq) FROM {t})"
        ),
    ] {
        sqlx::query(&sql).execute(db.pool()).await.unwrap();
    }

    let unnamed = PostgresConfig::builder()
        .schema(&db.schema)
        .build()
        .unwrap();
    PostgresStore::new(db.pool().clone(), unnamed)
        .migrate()
        .await
        .unwrap();

    let counts = db.store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.leased), (1, 1));
    // The converted lease still holds its key until it expires, then both go in order.
    assert!(db.claim(10, Block).await.messages.is_empty());
    db.advance(Duration::from_secs(2 * 3600)).await;
    assert_eq!(names(&db.claim(10, Block).await), ["held", "next"]);
    let predicates: Vec<String> = sqlx::query_scalar(
        "SELECT pg_get_expr(indpred, indrelid) FROM pg_index \
         WHERE indrelid = $1::regclass AND indpred IS NOT NULL",
    )
    .bind(t)
    .fetch_all(db.pool())
    .await
    .unwrap();
    assert_eq!(predicates.len(), 5, "{predicates:?}");
    assert!(
        predicates.iter().all(|p| !p.contains("leased")),
        "{predicates:?}"
    );
    let options: Vec<String> =
        sqlx::query_scalar("SELECT unnest(reloptions) FROM pg_class WHERE oid = $1::regclass")
            .bind(t)
            .fetch_all(db.pool())
            .await
            .unwrap();
    assert_eq!(options, ["fillfactor=50"]);
    db.drop().await;
}

/// The collations of `partition_key` and, for comparison, `aggregatetype` in `db`'s table.
async fn key_collations(db: &Db) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT a.attname::text, c.collname::text
         FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
         WHERE a.attrelid = $1::regclass AND a.attname IN ('partition_key', 'aggregatetype')
         ORDER BY a.attname",
    )
    .bind(db.table())
    .fetch_all(db.pool())
    .await
    .unwrap()
}

fn collations(partition_key: &str) -> Vec<(String, String)> {
    vec![
        ("aggregatetype".to_owned(), "default".to_owned()),
        ("partition_key".to_owned(), partition_key.to_owned()),
    ]
}

/// New tables compare partition keys bytewise (the claim's per-key probes and grouping then
/// avoid the C library's locale-aware comparison). A table made before that keeps its
/// collation through later migrations and still claims in key order; the README's `ALTER`
/// upgrades it.
#[tokio::test]
async fn partition_keys_are_bytewise_in_new_tables_and_older_tables_are_left_alone() {
    let Some(mut db) = db().await else { return };
    assert_eq!(key_collations(&db).await, collations("C"));
    // One connection, so the claims and dead-letter listings after the ALTER run the
    // statements prepared before it (a relay running through the upgrade).
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    db.store = PostgresStore::new(pool, db.config.clone());

    // A table as earlier versions made it: the database's default collation.
    let table = db.table().to_owned();
    let alter = |collation: &str| {
        format!("ALTER TABLE {table} ALTER COLUMN partition_key TYPE text COLLATE \"{collation}\"")
    };
    sqlx::query(&alter("default"))
        .execute(db.pool())
        .await
        .unwrap();
    db.store.migrate().await.unwrap();
    assert_eq!(key_collations(&db).await, collations("default"));
    db.enqueue(&[msg("k", "k1"), msg("k", "k2"), msg("j", "j1")])
        .await;
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["k1", "k2", "j1"]);
    db.store.complete(claim.token, &ids(&claim)).await.unwrap();
    assert!(db.store.list_dead(None, 10).await.unwrap().is_empty());

    // The upgrade the README gives for such a table, while the store's statements are
    // prepared: they keep working.
    sqlx::query(&alter("C")).execute(db.pool()).await.unwrap();
    assert_eq!(key_collations(&db).await, collations("C"));
    db.enqueue(&[msg("k", "k3"), msg("d", "d1")]).await;
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["k3", "d1"]);
    let dead = claim.messages[1].id;
    db.store
        .fail(
            claim.token,
            &[Failure {
                id: dead,
                error: "poison".into(),
                action: FailAction::Dead,
            }],
        )
        .await
        .unwrap();
    let listed = db.store.list_dead(None, 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].message.partition_key.as_deref(), Some("d"));
    db.drop().await;
}

/// Failure detector for a store call that must not wait on another session's locks: a call
/// that hangs (as a fenced transition did before it bounded its lock wait: Postgres waits for
/// a row lock forever by default) fails the test here. It is not a speed assertion: a passing
/// call returns at once, or after the store's own lock timeout of a couple of seconds.
const HANG_DETECTOR: Duration = Duration::from_secs(30);

async fn returns<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG_DETECTOR, call)
        .await
        .unwrap_or_else(|_| panic!("{what} hung on another session's row locks"))
}

/// Another relay froze mid-claim with row locks held: on rows it was about to lease, and on a
/// row this store leased meanwhile (a claim that read the row before the lease and locked it
/// after keeps that lock, although it drops the row). The store still claims, completes and
/// extends everything else, and its calls on the locked row fail as transient after the lock
/// timeout instead of waiting for the frozen relay; once the lock is gone they succeed.
#[tokio::test]
async fn a_relay_frozen_mid_claim_blocks_no_other_call() {
    let Some(db) = db().await else { return };
    let (f1, a1, c1) = (msg("f", "f1"), msg("a", "a1"), msg("c", "c1"));
    db.enqueue(&[f1.clone(), a1.clone()]).await;
    let held = db.claim(10, Block).await;
    assert_eq!(names(&held), ["f1", "a1"]);
    db.enqueue(std::slice::from_ref(&c1)).await;
    let mut frozen_claim = db.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE id = ANY($1) FOR UPDATE",
        db.table()
    ))
    .bind(vec![f1.id, c1.id])
    .execute(&mut *frozen_claim)
    .await
    .unwrap();

    // New work on other keys flows (c1, locked by the frozen claim, is skipped).
    db.enqueue(&[msg("d", "d1"), msg("e", "e1")]).await;
    let fresh = returns("claim", db.claim(10, Block)).await;
    assert_eq!(names(&fresh), ["d1", "e1"]);
    returns(
        "extend",
        db.store.extend(fresh.token, Duration::from_secs(30)),
    )
    .await
    .unwrap();
    returns("complete", db.store.complete(fresh.token, &ids(&fresh)))
        .await
        .unwrap();
    returns("complete of a1", db.store.complete(held.token, &[a1.id]))
        .await
        .unwrap();
    // The locked row: a transient error after the lock timeout, not a wait for the frozen
    // relay. The relay retries such a call while its lease lasts.
    let err = returns("complete of f1", db.store.complete(held.token, &[f1.id]))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    let err = returns(
        "extend",
        db.store.extend(held.token, Duration::from_secs(30)),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Transient, "{err}");
    frozen_claim.rollback().await.unwrap();
    db.store.complete(held.token, &[f1.id]).await.unwrap();
    assert_eq!(names(&db.claim(10, Block).await), ["c1"]);
    db.drop().await;
}

/// The lock timeout of the fenced transitions is set inside each statement's own transaction:
/// the pool's connection (perhaps your application's) keeps its own setting afterwards.
#[tokio::test]
async fn the_transitions_lock_timeout_stays_in_their_statements() {
    let Some(db) = db().await else { return };
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let store = PostgresStore::new(pool.clone(), db.config.clone());
    db.enqueue(&[msg("k", "k1"), msg("j", "j1")]).await;
    let claim = store
        .claim(&ClaimRequest {
            limit: 10,
            lease: Duration::from_secs(30),
            head_policy: Block,
            shard: None,
        })
        .await
        .unwrap();
    let show = || async {
        sqlx::query_scalar::<_, String>("SELECT current_setting('lock_timeout')")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = show().await;
    store
        .extend(claim.token, Duration::from_secs(30))
        .await
        .unwrap();
    store.complete(claim.token, &ids(&claim)).await.unwrap();
    assert_eq!(show().await, before);
    pool.close().await;
    db.drop().await;
}
