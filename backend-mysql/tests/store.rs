//! The MariaDB store against a real server: visibility, exclusivity, fencing, order, admin,
//! enqueue refusals, migration and connection errors.

mod common;

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{db, db_with, ids, msg, names, random_table, Db, URL_VAR};
use outbox_backend_mysql::{enqueue, enqueue_batch, migrate, MysqlConfig, MysqlStore};
use outbox_conformance_tests::env::service_url;
use outbox_traits::{
    ClaimRequest, ClaimShard, Error, ErrorKind, FailAction, Failure, HeadPolicy, LeaseToken,
    NewMessage, OutboxAdmin, OutboxStore,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{Connection, MySqlConnection};
use uuid::Uuid;

use HeadPolicy::{Block, Skip};

/// Three relays on their own pools claim, fail, release and complete the same backlog at
/// once: every message is published exactly once, each key in seq order, and no call fails
/// (no deadlock or lock timeout reaches the caller).
#[tokio::test]
async fn concurrent_relays_never_overlap_and_keep_key_order() {
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

    // Publications in the order the relays made them: a relay records a message before it
    // completes it, and a key's next message can be claimed only after that completion.
    let published: Arc<Mutex<Vec<(Uuid, i64)>>> = Arc::default();
    let mut relays = Vec::new();
    for (r, limit) in [17usize, 29, 41].into_iter().enumerate() {
        let store = MysqlStore::connect(&db.url, db.config.clone())
            .await
            .unwrap();
        let published = published.clone();
        relays.push(tokio::spawn(async move {
            let mut empty_in_a_row = 0;
            let mut round = 0usize;
            while empty_in_a_row < 3 {
                round += 1;
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
                // Every few rounds, the first message fails (due again at once) and the rest of
                // its key goes back, as the engine does after a failed publish.
                let failing = (round + r).is_multiple_of(4);
                let first = &claim.messages[0];
                let mut done = Vec::new();
                let mut back = Vec::new();
                for m in &claim.messages[usize::from(failing)..] {
                    if failing
                        && first.partition_key.is_some()
                        && m.partition_key == first.partition_key
                    {
                        back.push(m.id);
                    } else {
                        done.push(m);
                    }
                }
                if failing {
                    store
                        .fail(
                            claim.token,
                            &[Failure {
                                id: first.id,
                                error: "try again".into(),
                                action: FailAction::Retry {
                                    delay: Duration::ZERO,
                                },
                            }],
                        )
                        .await
                        .unwrap();
                    store.release(claim.token, &back).await.unwrap();
                }
                published
                    .lock()
                    .unwrap()
                    .extend(done.iter().map(|m| (m.id, m.seq)));
                let done: Vec<Uuid> = done.iter().map(|m| m.id).collect();
                store.complete(claim.token, &done).await.unwrap();
            }
        }));
    }
    for relay in relays {
        relay.await.unwrap();
    }
    let log = published.lock().unwrap().clone();
    let unique: HashSet<Uuid> = log.iter().map(|(id, _)| *id).collect();
    assert_eq!(unique.len(), log.len(), "a message was published twice");
    assert_eq!(
        unique.len(),
        messages.len(),
        "a message was never published"
    );
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    for (id, seq) in &log {
        if let Some(key) = &key_of[id] {
            let last = last_seq.insert(key.clone(), *seq);
            assert!(last.is_none_or(|l| l < *seq), "key {key} out of order");
        }
    }
    let counts = db.store.counts().await.unwrap();
    assert_eq!(
        (counts.published, counts.pending, counts.leased),
        (600, 0, 0)
    );
    db.drop().await;
}

#[tokio::test]
async fn the_lease_end_comes_from_the_database_clock() {
    let Some(db) = db().await else { return };
    db.enqueue(&[msg("a", "1")]).await;
    let claim = db.claim(1, Block).await;
    let (stored, now): (chrono::NaiveDateTime, chrono::NaiveDateTime) = sqlx::query_as(&format!(
        "SELECT lease_until, UTC_TIMESTAMP(6) FROM {}",
        db.table()
    ))
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(stored.and_utc(), claim.lease_until);
    // Ended 30 s after the database's "now" at the claim, which has passed since.
    assert!(stored - now <= chrono::Duration::seconds(30));
    // An empty claim still reports a lease end by the same clock.
    let empty = db.claim(1, Block).await;
    assert!(empty.messages.is_empty() && empty.lease_until >= claim.lease_until);
    db.drop().await;
}

/// The lease columns of every row, by seq: `(token, lease end)` as text, `NULL` for a NULL.
async fn lease_columns(db: &Db) -> Vec<(String, String)> {
    sqlx::query_as(&format!(
        "SELECT CAST(IFNULL(lease_token, 'NULL') AS CHAR CHARACTER SET utf8mb4),
                CAST(IFNULL(lease_until, 'NULL') AS CHAR CHARACTER SET utf8mb4)
         FROM {} ORDER BY seq",
        db.table()
    ))
    .fetch_all(db.pool())
    .await
    .unwrap()
}

/// A row that is not leased holds `''` and the epoch, never NULLs: written so by the column
/// defaults and by every transition that ends a lease (so that a lease overwrites values of the
/// same size, in place). Rows with NULLs, as older relays and tables left them, still count as
/// not leased: claimed, and counted as pending.
#[tokio::test]
async fn unleased_rows_hold_same_size_values_and_nulls_still_mean_unleased() {
    let Some(db) = db().await else { return };
    let free = ("".to_owned(), "1970-01-01 00:00:00.000000".to_owned());
    db.enqueue(&[
        msg("a", "a1"),
        msg("b", "b1"),
        msg("c", "c1"),
        msg("d", "d1"),
    ])
    .await;
    assert_eq!(lease_columns(&db).await, vec![free.clone(); 4]);

    let claim = db.claim(10, Block).await;
    let [a1, b1, c1, d1] = ids(&claim)[..] else {
        panic!("{claim:?}")
    };
    let leased = lease_columns(&db).await;
    assert!(
        leased
            .iter()
            .all(|(token, _)| *token == claim.token.0.to_string()),
        "{leased:?}"
    );
    db.store.complete(claim.token, &[a1]).await.unwrap();
    db.store.release(claim.token, &[b1]).await.unwrap();
    db.store
        .fail(
            claim.token,
            &[
                Failure {
                    id: c1,
                    error: "later".into(),
                    action: FailAction::Retry {
                        delay: Duration::ZERO,
                    },
                },
                Failure {
                    id: d1,
                    error: "poison".into(),
                    action: FailAction::Dead,
                },
            ],
        )
        .await
        .unwrap();
    assert_eq!(lease_columns(&db).await, vec![free.clone(); 4]);
    db.store.requeue(&[d1]).await.unwrap();
    assert_eq!(lease_columns(&db).await, vec![free.clone(); 4]);

    // An older relay's rows: NULLs. Pending, not leased, and claimed like the others.
    sqlx::query(&format!(
        "UPDATE {} SET lease_token = NULL, lease_until = NULL WHERE state = 'pending'",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    let counts = db.store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.leased), (3, 0), "{counts:?}");
    let status = db.store.status(10).await.unwrap();
    assert_eq!((status.pending, status.leased), (3, 0), "{status:?}");
    let again = db.claim(10, Block).await;
    assert_eq!(names(&again), ["b1", "c1", "d1"]);
    let counts = db.store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.leased), (0, 3), "{counts:?}");
    db.drop().await;
}

#[tokio::test]
async fn a_row_locked_by_a_concurrent_claim_holds_back_its_key() {
    let Some(db) = db().await else { return };
    let k1 = msg("k", "k1");
    db.enqueue(&[k1.clone(), msg("k", "k2"), msg("j", "j1")])
        .await;
    // Hold k1's row lock as a concurrent claim would between its lock and its commit.
    let mut other = db.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} WHERE id = ? FOR UPDATE",
        db.table()
    ))
    .bind(k1.id.to_string())
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
/// which still fills its batch with its own rows only (keyed and unordered). An unsharded claim
/// at that moment comes back short, its window half full of locked rows: the control, which is
/// why the relay ran one claim at a time on MariaDB before it could shard.
#[tokio::test]
async fn a_claim_of_one_shard_is_not_held_back_by_another_shard_s_claim_in_progress() {
    let Some(db) = db().await else { return };
    let messages: Vec<_> = (0..400)
        .map(|i| {
            let m = msg(&format!("k{}", i % 40), &format!("{i}"));
            if i % 10 == 0 {
                m.unordered()
            } else {
                m
            }
        })
        .collect();
    db.enqueue(&messages).await;
    // The shard of each row, as relays before the `key_hash` column computed it; the claim's
    // `in_shard` (sql.rs) must give the same, so that relays of both versions agree.
    let shard = "MOD(IF(partition_key IS NULL, seq, CRC32(partition_key)), 2)";
    // READ COMMITTED and by primary key, as a claim locks: the scan keeps the locks of shard
    // 0's rows only (a locking scan of a secondary index would keep every row it read).
    let mut other = db
        .pool()
        .begin_with("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .await
        .unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {} FORCE INDEX (PRIMARY) WHERE {shard} = 0 FOR UPDATE",
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
    assert!(
        sharded.messages.iter().any(|m| m.partition_key.is_none()),
        "no unordered message came back"
    );
    assert_eq!(
        outside_shard(&db, &sharded, 1).await,
        0,
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
    db.store
        .release(unsharded.token, &ids(&unsharded))
        .await
        .unwrap();
    other.rollback().await.unwrap();
    // Nothing locked now: a claim of shard 0 room for every row takes shard 0's rows only.
    let all = db
        .store
        .claim(&ClaimRequest {
            limit: 400,
            ..req(Some(ClaimShard::new(0, 2).unwrap()))
        })
        .await
        .unwrap();
    assert!(!all.messages.is_empty() && all.messages.len() < 400);
    assert_eq!(
        outside_shard(&db, &all, 0).await,
        0,
        "a row of shard 1 came back"
    );
    db.drop().await;
}

/// The claim index's columns, in order.
async fn claim_index_columns(db: &Db) -> Vec<String> {
    let rows: Vec<(String,)> = sqlx::query_as(
        "SELECT CAST(COLUMN_NAME AS CHAR) FROM information_schema.STATISTICS
          WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND INDEX_NAME = 'ix_claim'
          ORDER BY SEQ_IN_INDEX",
    )
    .bind(db.config.table())
    .fetch_all(db.pool())
    .await
    .unwrap();
    rows.into_iter().map(|(c,)| c).collect()
}

/// A table made before sharded claims read the claim index alone (claim index `(state, seq)`,
/// no `key_hash` column nor its trigger), with rows in it: `migrate` adds the column and its
/// trigger, fills the rows already there, and rebuilds the index with it, once; the column holds
/// each key's `CRC32` for old and new rows; a sharded window end then reads the index alone
/// ("Using index": no row is read), and sharded claims take their shard's rows.
#[tokio::test]
async fn migrate_gives_an_older_table_the_key_hash_in_its_claim_index() {
    // Older tables have their own claim indexes (an unpublished table holds the hash from the
    // start).
    let Some(db) = db_with(|b| b.unpublished_table(false)).await else {
        return;
    };
    assert_eq!(claim_index_columns(&db).await, ["state", "seq", "key_hash"]);
    sqlx::raw_sql(&format!(
        "ALTER TABLE {t} DROP INDEX ix_claim, ADD INDEX ix_claim (state, seq);
         ALTER TABLE {t} DROP COLUMN key_hash;
         DROP TRIGGER `{trigger}`",
        t = db.table(),
        trigger = outbox_sql_support::names::derived_name(db.config.table(), "key_hash"),
    ))
    .execute(db.pool())
    .await
    .unwrap();
    assert_eq!(claim_index_columns(&db).await, ["state", "seq"]);
    let messages: Vec<_> = (0..200)
        .map(|i| {
            let m = msg(&format!("k{}", i % 20), &format!("{i}"));
            if i % 10 == 0 {
                m.unordered()
            } else {
                m
            }
        })
        .collect();
    // Seqs across several of the fill's ranges of 10,000.
    db.enqueue(&messages[..100]).await;
    sqlx::query(&format!(
        "ALTER TABLE {} AUTO_INCREMENT = 25000",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    db.enqueue(&messages[100..]).await;

    db.store.migrate().await.unwrap();
    assert_eq!(claim_index_columns(&db).await, ["state", "seq", "key_hash"]);
    // Rows written after the migration get theirs from the trigger.
    let later: Vec<_> = (200..240)
        .map(|i| msg(&format!("k{}", i % 20), &format!("{i}")))
        .collect();
    db.enqueue(&later).await;
    let table_id = || async {
        sqlx::query_scalar::<_, u64>(
            "SELECT TABLE_ID FROM information_schema.INNODB_SYS_TABLES WHERE NAME = CONCAT(DATABASE(), '/', ?)",
        )
        .bind(db.config.table())
        .fetch_one(db.pool())
        .await
        .unwrap()
    };
    let index_id = || async {
        sqlx::query_scalar::<_, u64>(
            "SELECT i.INDEX_ID FROM information_schema.INNODB_SYS_INDEXES i
              JOIN information_schema.INNODB_SYS_TABLES t ON t.TABLE_ID = i.TABLE_ID
             WHERE t.NAME = CONCAT(DATABASE(), '/', ?) AND i.NAME = 'ix_claim'",
        )
        .bind(db.config.table())
        .fetch_one(db.pool())
        .await
        .unwrap()
    };
    let (table_before, index_before) = (table_id().await, index_id().await);
    // Idempotent: the index is not built again, nor the table copied.
    db.store.migrate().await.unwrap();
    assert_eq!(claim_index_columns(&db).await, ["state", "seq", "key_hash"]);
    assert_eq!(
        (table_id().await, index_id().await),
        (table_before, index_before)
    );

    let wrong: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE NOT (key_hash <=> CRC32(partition_key))
            OR (partition_key IS NOT NULL AND key_hash IS NULL)",
        db.table()
    ))
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(wrong, 0);
    // The shape of the sharded window end (`past_bound_sharded` in sql.rs).
    let plan: Vec<Option<String>> = sqlx::query(&format!(
        "EXPLAIN SELECT w.seq FROM {} w FORCE INDEX (ix_claim)
          WHERE w.state = 'pending' AND MOD(COALESCE(w.key_hash, w.seq), ?) = ?
          ORDER BY w.seq LIMIT 10, 1",
        db.table()
    ))
    .bind(2)
    .bind(1)
    .fetch_all(db.pool())
    .await
    .unwrap()
    .iter()
    .map(|row| sqlx::Row::try_get(row, "Extra").unwrap())
    .collect();
    assert!(
        plan.iter()
            .any(|extra| extra.as_deref().is_some_and(|e| e.contains("Using index"))),
        "the sharded window end reads rows: {plan:?}"
    );

    for index in [0, 1] {
        let claim = db
            .store
            .claim(&ClaimRequest {
                limit: 200,
                lease: Duration::from_secs(60),
                head_policy: Block,
                shard: Some(ClaimShard::new(index, 2).unwrap()),
            })
            .await
            .unwrap();
        assert!(!claim.messages.is_empty());
        assert_eq!(outside_shard(&db, &claim, index).await, 0, "shard {index}");
    }
    db.drop().await;
}

/// How many of `claim`'s messages are not in shard `index` of 2, by the claim's shard function.
async fn outside_shard(db: &Db, claim: &outbox_traits::Claim, index: u32) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {}
          WHERE MOD(IF(partition_key IS NULL, seq, CRC32(partition_key)), 2) <> ?
            AND id IN (SELECT id FROM JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(36) PATH '$')) j)",
        db.table()
    ))
    .bind(index)
    .bind(serde_json::to_string(&ids(claim)).unwrap())
    .fetch_one(db.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_leased_message_behind_a_claimable_head_holds_back_the_rest_of_its_key() {
    let Some(db) = db().await else { return };
    db.enqueue(&[msg("k", "k1"), msg("k", "k2"), msg("k", "k3")])
        .await;
    let claim = db.claim(10, Block).await;
    // k1 is due again at once while k2 and k3 stay leased (a relay that crashed between its
    // fail and its release): k1 may go, k2 and k3 not, and nothing after them.
    db.store
        .fail(
            claim.token,
            &[Failure {
                id: claim.messages[0].id,
                error: "retry now".into(),
                action: FailAction::Retry {
                    delay: Duration::ZERO,
                },
            }],
        )
        .await
        .unwrap();
    db.enqueue(&[msg("k", "k4")]).await;
    assert_eq!(names(&db.claim(10, Block).await), ["k1"]);
    db.drop().await;
}

async fn kill(db: &Db, id: Uuid, token: LeaseToken) {
    db.store
        .fail(
            token,
            &[Failure {
                id,
                error: "poison".into(),
                action: FailAction::Dead,
            }],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn a_dead_message_behind_the_head_blocks_the_rest_of_its_key_under_block() {
    let Some(db) = db().await else { return };
    db.enqueue(&[msg("k", "k1"), msg("k", "k2"), msg("k", "k3")])
        .await;
    let claim = db.claim(10, Block).await;
    let [k1, k2, k3] = ids(&claim)[..] else {
        panic!()
    };
    // k2 dead while k1 is given back: k1 may go, k3 waits behind the dead k2.
    kill(&db, k2, claim.token).await;
    db.store.release(claim.token, &[k1, k3]).await.unwrap();
    assert_eq!(names(&db.claim(10, Block).await), ["k1"]);
    db.advance(Duration::from_secs(31)).await;
    assert_eq!(names(&db.claim(10, Skip).await), ["k1", "k3"]);
    db.drop().await;
}

#[tokio::test]
async fn the_limit_holds_for_every_claim() {
    let Some(db) = db().await else { return };
    let batch: Vec<_> = (0..300)
        .map(|i| {
            let m = msg(&format!("k{}", i % 5), &format!("{i}"));
            if i % 3 == 0 {
                m.unordered()
            } else {
                m
            }
        })
        .collect();
    db.enqueue(&batch).await;
    let mut seen = HashSet::new();
    loop {
        let claim = db.claim(7, Block).await;
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
        db.store.complete(claim.token, &ids(&claim)).await.unwrap();
    }
    assert_eq!(seen.len(), 300);
    db.drop().await;
}

/// Reads the session status counters `names` of `conn`.
async fn session_status(conn: &mut MySqlConnection, names: &[&str]) -> HashMap<String, u64> {
    let rows: Vec<(String, String)> = sqlx::query_as("SHOW SESSION STATUS")
        .fetch_all(&mut *conn)
        .await
        .unwrap();
    rows.into_iter()
        .filter(|(name, _)| names.contains(&name.as_str()))
        .map(|(name, value)| (name, value.parse().unwrap()))
        .collect()
}

#[tokio::test]
async fn a_batch_is_one_insert_statement_in_slice_order() {
    let Some(db) = db().await else { return };
    // The session's own counters: Com_insert counts INSERT statements (prepared ones too),
    // Handler_write rows written, on this connection only.
    let mut conn = MySqlConnection::connect(&db.url).await.unwrap();
    let counters = ["Com_insert", "Handler_write"];
    let before = session_status(&mut conn, &counters).await;
    let batch: Vec<_> = (0..25).map(|i| msg("k", &format!("{i:02}"))).collect();
    let mut tx = conn.begin().await.unwrap();
    enqueue_batch(&mut *tx, &db.config, &batch).await.unwrap();
    tx.commit().await.unwrap();
    let after = session_status(&mut conn, &counters).await;
    assert_eq!(
        after["Com_insert"] - before["Com_insert"],
        1,
        "INSERT statements"
    );
    // And each row's unpublished entry, written by the insert trigger, in a table laid out
    // with one.
    let per_row = if db.config.new_tables_use_unpublished_table() {
        2
    } else {
        1
    };
    assert_eq!(
        after["Handler_write"] - before["Handler_write"],
        25 * per_row,
        "rows written"
    );

    let claim = db.claim(100, Block).await;
    let expected: Vec<String> = (0..25).map(|i| format!("{i:02}")).collect();
    assert_eq!(names(&claim), expected);
    assert!(claim.messages.windows(2).all(|w| w[0].seq < w[1].seq));
    db.drop().await;
}

#[tokio::test]
async fn every_field_round_trips_byte_for_byte() {
    let Some(db) = db().await else { return };
    let payload = serde_json::json!({
        "text": "naïve \"quoted\" \\ back\\slash, tab\t, nul \u{0}, emoji 🦀",
        "nested": {"b": [1, 2.5, null, true], "a": "z"},
    });
    let m = NewMessage::new("order ✓", "k", "test.event", payload.clone())
        .with_header("traceparent", "00-abc-def-01")
        .with_header("tenant", "ácmé 🦀")
        .with_partition_key("pk 🔑 'quote'")
        .with_dedup_key("dk \u{0} nul");
    db.enqueue(std::slice::from_ref(&m)).await;
    let claim = db.claim(1, Block).await;
    let got = &claim.messages[0];
    assert_eq!(got.id, m.id);
    assert_eq!(got.aggregate_type, "order ✓");
    assert_eq!(got.aggregate_id, "k");
    assert_eq!(got.event_type, "test.event");
    assert_eq!(got.headers, m.headers);
    assert_eq!(got.partition_key.as_deref(), Some("pk 🔑 'quote'"));
    assert_eq!(got.dedup_key.as_deref(), Some("dk \u{0} nul"));
    assert_eq!(got.payload, serde_json::to_string(&payload).unwrap());
    // The claim's per-key check found the key's rows through the same collation.
    db.store.complete(claim.token, &ids(&claim)).await.unwrap();
    assert_eq!(db.store.counts().await.unwrap().published, 1);
    db.drop().await;
}

#[tokio::test]
async fn keys_differing_in_case_or_trailing_space_are_distinct() {
    let Some(db) = db().await else { return };
    db.enqueue(&[
        msg("k", "lower").with_dedup_key("d"),
        msg("K", "upper").with_dedup_key("D"),
        msg("k ", "spaced").with_dedup_key("d "),
    ])
    .await;
    let claim = db.claim(10, Block).await;
    assert_eq!(names(&claim), ["lower", "upper", "spaced"]);
    // A retry of "k" holds back nothing of "K" or "k ".
    db.store
        .fail(
            claim.token,
            &[Failure {
                id: claim.messages[0].id,
                error: "later".into(),
                action: FailAction::Retry {
                    delay: Duration::from_secs(60),
                },
            }],
        )
        .await
        .unwrap();
    db.store
        .release(claim.token, &ids(&claim)[1..])
        .await
        .unwrap();
    assert_eq!(names(&db.claim(10, Block).await), ["upper", "spaced"]);
    db.drop().await;
}

#[tokio::test]
async fn a_duplicate_dedup_key_is_refused_and_the_transaction_goes_on() {
    let Some(db) = db().await else { return };
    db.enqueue(&[msg("k", "1").with_dedup_key("once")]).await;
    let mut tx = db.pool().begin().await.unwrap();
    let err = enqueue_batch(
        &mut *tx,
        &db.config,
        &[msg("k", "2"), msg("k", "3").with_dedup_key("once")],
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::DuplicateKey { key } if key == "once"),
        "{err}"
    );
    // Only the statement was rolled back: the transaction commits other work.
    enqueue(&mut *tx, &db.config, &msg("k", "4")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(names(&db.claim(10, Block).await), ["1", "4"]);
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
    let mut conn = MySqlConnection::connect(&db.url).await.unwrap();
    let before = session_status(&mut conn, &["Com_insert", "Com_stmt_prepare"]).await;
    let mut tx = conn.begin().await.unwrap();
    let bad = [
        NewMessage::new("test", "k", "", serde_json::json!({})),
        msg("k", &"x".repeat(100)),
        msg("k", "long key").with_partition_key("k".repeat(256)),
        msg("k", "long dedup").with_dedup_key("d".repeat(256)),
        NewMessage::new("t".repeat(256), "k", "e", serde_json::json!({})),
    ];
    for m in &bad {
        let err = enqueue_batch(&mut *tx, &db.config, &[msg("k", "fine"), m.clone()])
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    }
    let twins = msg("k", "twin");
    let err = enqueue_batch(&mut *tx, &db.config, &[twins.clone(), twins])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    let err = enqueue_batch(
        &mut *tx,
        &db.config,
        &[
            msg("k", "a").with_dedup_key("same"),
            msg("k", "b").with_dedup_key("same"),
        ],
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::DuplicateKey { .. }), "{err}");
    let too_many: Vec<_> = (0..7_282).map(|i| msg("k", &i.to_string())).collect();
    let err = enqueue_batch(&mut *tx, &db.config, &too_many)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("split"), "{err}");
    tx.commit().await.unwrap();
    let after = session_status(&mut conn, &["Com_insert", "Com_stmt_prepare"]).await;
    assert_eq!(after, before, "a statement reached the server");
    assert_eq!(db.store.counts().await.unwrap().pending, 0);

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
    for table in ["out box", "out`box", "1x", "a;b", ""] {
        let err = MysqlConfig::builder().table(table).build().unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
        assert!(err.to_string().contains("not a valid SQL identifier"));
    }
    let err = MysqlConfig::builder()
        .database("db`; DROP DATABASE x")
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
}

#[tokio::test]
async fn an_unreachable_server_is_unavailable_without_the_password() {
    // Port 1 on loopback: nothing listens there.
    let url = "mysql://outbox:hunter2@127.0.0.1:1/test";
    let err = MysqlStore::connect(url, MysqlConfig::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.is_transient());
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("127.0.0.1:1"), "{text}");

    let err = MysqlStore::connect(
        "mysql://outbox:hunter2@127.0.0.1:notaport/x",
        MysqlConfig::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("hunter2"));

    // An existing store whose server went away: calls fail as Unavailable too, and neither
    // the errors nor the store's Debug show the password.
    let options = MySqlConnectOptions::from_str(url).unwrap();
    let pool = MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(options);
    let store = MysqlStore::new(pool, MysqlConfig::default());
    assert!(!format!("{store:?}").contains("hunter2"));
    let err = store.counts().await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("hunter2"));
}

#[tokio::test]
async fn a_missing_table_is_a_permanent_error_that_says_to_migrate() {
    let Some(url) = service_url(URL_VAR) else {
        return;
    };
    let config = MysqlConfig::builder()
        .table(random_table())
        .build()
        .unwrap();
    let store = MysqlStore::connect(&url, config).await.unwrap();
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
async fn purge_deletes_bounded_batches_of_old_published_messages_only() {
    let Some(db) = db().await else { return };
    let batch: Vec<_> = (0..10)
        .map(|i| msg(&format!("k{i}"), &format!("{i}")))
        .collect();
    db.enqueue(&batch).await;
    let claim = db.claim(7, Block).await;
    let claimed = ids(&claim);
    db.store.complete(claim.token, &claimed[..6]).await.unwrap();
    kill(&db, claimed[6], claim.token).await;
    db.advance(Duration::from_secs(7200)).await;
    // Published just now: too young to purge.
    db.enqueue(&[msg("z", "young")]).await;
    let young = db.claim(1, Block).await;
    db.store.complete(young.token, &ids(&young)).await.unwrap();

    let hour = Duration::from_secs(3600);
    assert_eq!(db.store.purge_published(hour, 4).await.unwrap(), 4);
    assert_eq!(db.store.purge_published(hour, 4).await.unwrap(), 2);
    assert_eq!(db.store.purge_published(hour, 4).await.unwrap(), 0);
    let counts = db.store.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.leased, counts.published, counts.dead),
        (3, 0, 1, 1)
    );
    // seq values are never reused after a purge.
    db.store
        .purge_published(Duration::ZERO, usize::MAX)
        .await
        .unwrap();
    db.enqueue(&[msg("n", "new")]).await;
    let seq: i64 = sqlx::query_scalar(&format!(
        "SELECT seq FROM {} WHERE JSON_VALUE(payload, '$.name') = 'new'",
        db.table()
    ))
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(seq, 12);
    db.drop().await;
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_when_run_concurrently() {
    let Some(url) = service_url(URL_VAR) else {
        return;
    };
    let database = format!("outbox_test_{:016x}", rand::random::<u64>());
    // Two tables in one new database, each migrated by several processes at once.
    let mut runs = Vec::new();
    for i in 0..6 {
        let table = if i % 2 == 0 { "outbox" } else { "outbox_b" };
        let config = MysqlConfig::builder()
            .database(&database)
            .table(table)
            .build()
            .unwrap();
        let pool = MySqlPoolOptions::new().connect(&url).await.unwrap();
        runs.push(tokio::spawn(async move { migrate(&pool, &config).await }));
    }
    for run in runs {
        run.await.unwrap().unwrap();
    }
    let config = MysqlConfig::builder().database(&database).build().unwrap();
    let store = MysqlStore::connect(&url, config.clone()).await.unwrap();
    store.migrate().await.unwrap();
    let mut indexes: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT CAST(INDEX_NAME AS CHAR CHARACTER SET utf8mb4)
         FROM information_schema.STATISTICS
         WHERE TABLE_SCHEMA = ? AND TABLE_NAME = 'outbox'",
    )
    .bind(&database)
    .fetch_all(store.pool())
    .await
    .unwrap();
    indexes.sort();
    // A new table that keeps published rows gets an unpublished table, and no index of its
    // own holding `state`.
    assert_eq!(
        indexes,
        ["PRIMARY", "uq_dedup_key", "uq_id"].map(String::from)
    );
    let unpublished: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES
         WHERE TABLE_SCHEMA = ? AND TABLE_NAME = 'outbox_unpublished'",
    )
    .bind(&database)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(unpublished, 1);
    // The migrated table works.
    let mut tx = store.pool().begin().await.unwrap();
    enqueue(&mut *tx, &config, &msg("k", "1")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(store.counts().await.unwrap().pending, 1);
    sqlx::query(&format!("DROP DATABASE `{database}`"))
        .execute(store.pool())
        .await
        .unwrap();
}

#[tokio::test]
async fn no_wake_source_and_concurrent_claimers() {
    let Some(db) = db().await else { return };
    let capabilities = db.store.capabilities();
    assert!(capabilities.concurrent_claimers);
    assert!(!capabilities.wakeups);
    assert!(db.store.wakeups().await.unwrap().is_none());
    db.drop().await;
}

/// A transition that InnoDB picks as a deadlock victim is run again instead of failing.
///
/// The cycle is made by events, not timing (waiting on the complete's 2 s lock wait made an
/// earlier version of this test fail under load): a trigger makes the complete's update of
/// message `a` lock row 1 of a side table, wait for a user lock this test holds, then lock row
/// 2. Another transaction, heavier (it changed rows, so InnoDB rolls back the complete rather
/// than it), holds row 2 and asks for row 1. Releasing the user lock closes the cycle. Every
/// wait is one of the server's long ones (a user lock, the session's lock wait), never the
/// store's bounded one, so the outcome does not depend on how fast the machine is. (The
/// earlier version also watched `INNODB_TRX` for the complete's lock wait: MariaDB refreshes
/// that view only after 100 ms without a read by anyone, so other sessions polling it could
/// hide the wait past the store's 2 s lock wait.)
#[tokio::test]
async fn a_deadlock_victim_transition_is_run_again() {
    let Some(db) = db().await else { return };
    db.enqueue(&[msg("a", "a"), msg("b", "b")]).await;
    let claim = db.claim(10, Block).await;
    db.enqueue(
        &(0..20)
            .map(|i| msg("w", &i.to_string()))
            .collect::<Vec<_>>(),
    )
    .await;
    let name = db.config.table();
    let side = format!("`{name}_side`");
    let user_lock = format!("{name}_deadlock");
    for statement in [
        format!("CREATE TABLE {side} (id INT PRIMARY KEY) ENGINE = InnoDB"),
        format!("INSERT INTO {side} VALUES (1), (2)"),
        format!(
            "CREATE TRIGGER `{name}_deadlock` BEFORE UPDATE ON {table} FOR EACH ROW BEGIN
                 IF NEW.state = 'published' AND OLD.partition_key = 'a' THEN
                     SELECT id INTO @outbox_one FROM {side} WHERE id = 1 FOR UPDATE;
                     SET @outbox_paused = GET_LOCK('{user_lock}', 300);
                     SET @outbox_paused = RELEASE_LOCK('{user_lock}');
                     SELECT id INTO @outbox_two FROM {side} WHERE id = 2 FOR UPDATE;
                 END IF;
             END",
            table = db.table()
        ),
    ] {
        sqlx::query(&statement).execute(db.pool()).await.unwrap();
    }
    let mut holder = MySqlConnection::connect(&db.url).await.unwrap();
    take_user_lock(&mut holder, &user_lock).await;
    // The other transaction: it changes rows (its weight), holds side row 2, and waits as
    // long as it takes for row 1.
    let mut other = MySqlConnection::connect(&db.url).await.unwrap();
    for statement in [
        "SET SESSION innodb_lock_wait_timeout = 300".to_owned(),
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(),
        "START TRANSACTION".to_owned(),
        format!(
            "UPDATE {} SET attempts = attempts + 1 WHERE partition_key = 'w'",
            db.table()
        ),
        format!("SELECT id FROM {side} WHERE id = 2 FOR UPDATE"),
    ] {
        sqlx::query(&statement).execute(&mut other).await.unwrap();
    }
    let deadlocks = || async {
        let (_, n): (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
            .fetch_one(db.pool())
            .await
            .unwrap();
        n.parse::<u64>().unwrap()
    };
    let deadlocks_before = deadlocks().await;
    let store = db.store.clone();
    let (token, held) = (claim.token, ids(&claim));
    let complete = tokio::spawn(async move { store.complete(token, &held).await });
    // The complete's update holds side row 1 and waits for the user lock.
    until("the complete waits for the user lock", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST
             WHERE STATE = 'User lock' AND INFO LIKE ?",
        )
        .bind(format!("%{name}%"))
        .fetch_one(db.pool())
        .await
        .unwrap();
        n > 0
    })
    .await;
    // The other transaction asks for side row 1, and the complete goes on to side row 2: a
    // cycle, whichever of the two requests comes second (it is not waited for: the only view
    // that shows a row lock wait, INNODB_TRX, is a cache that any session's reads can keep
    // stale for seconds), and InnoDB rolls back the lighter transaction, the complete.
    let side_one = format!("SELECT id FROM {side} WHERE id = 1 FOR UPDATE");
    let waiting = tokio::spawn(async move {
        let result = sqlx::query(&side_one).execute(&mut other).await.map(drop);
        (other, result)
    });
    release_user_lock(&mut holder, &user_lock).await;
    // The complete was the victim: the other transaction got row 1 and commits; the complete,
    // run again, then gets through.
    let (mut other, got_row) = returns("the other transaction", waiting).await.unwrap();
    got_row.unwrap();
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    returns("the complete", complete).await.unwrap().unwrap();
    assert!(deadlocks().await > deadlocks_before, "no deadlock happened");
    for id in ids(&claim) {
        assert_eq!(db.state(id).await, "published");
    }
    sqlx::query(&format!("DROP TABLE {side}"))
        .execute(db.pool())
        .await
        .unwrap();
    db.drop().await;
}

/// Take user lock `name` on `conn` (free: nobody else takes it).
async fn take_user_lock(conn: &mut MySqlConnection, name: &str) {
    let got: i64 = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
        .bind(name)
        .fetch_one(conn)
        .await
        .unwrap();
    assert_eq!(got, 1, "user lock {name} is taken");
}

/// Release user lock `name` that `conn` holds.
async fn release_user_lock(conn: &mut MySqlConnection, name: &str) {
    sqlx::query("DO RELEASE_LOCK(?)")
        .bind(name)
        .execute(conn)
        .await
        .unwrap();
}

/// Poll `condition` until it holds: a wait for an event another session causes, seen through
/// the server's views. Fails after [`HANG_DETECTOR`], a failure detector, not a timed
/// assertion.
async fn until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while !condition().await {
        assert!(start.elapsed() < HANG_DETECTOR, "{what}: never happened");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Failure detector for a store call that must not wait on another session's locks: a call
/// that hangs (as a transition did before it skipped locked rows, for InnoDB's 50 s lock wait)
/// fails the test here. It is not a speed assertion: a passing call returns at once, or after
/// the store's own bounded lock wait of a couple of seconds.
const HANG_DETECTOR: Duration = Duration::from_secs(30);

async fn returns<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG_DETECTOR, call)
        .await
        .unwrap_or_else(|_| panic!("{what} hung on another session's row locks"))
}

/// The locking steps of a claim, in transaction `tx`: claimable rows in seq order, by a plain
/// read, at most `limit`, then locked by primary key, skipping locked ones. Returns their seqs.
async fn lock_like_a_claim(
    tx: &mut sqlx::Transaction<'static, sqlx::MySql>,
    table: &str,
    limit: u32,
) -> Vec<i64> {
    let claimable =
        "state = 'pending' AND (lease_until IS NULL OR lease_until <= UTC_TIMESTAMP(6))";
    let seqs: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT seq FROM {table} FORCE INDEX (PRIMARY) WHERE {claimable} ORDER BY seq LIMIT ?"
    ))
    .bind(limit)
    .fetch_all(&mut **tx)
    .await
    .unwrap();
    sqlx::query_scalar(&format!(
        "SELECT c.seq FROM JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) j
         STRAIGHT_JOIN {table} c FORCE INDEX (PRIMARY) ON c.seq = j.seq
         WHERE {claimable} FOR UPDATE SKIP LOCKED"
    ))
    .bind(serde_json::to_string(&seqs).unwrap())
    .fetch_all(&mut **tx)
    .await
    .unwrap()
}

/// Other relays are frozen with their row locks held: one mid-claim (its transaction open
/// after locking rows whose lease this store lost), one mid-complete (its own rows locked).
/// The store still claims, extends and completes everything else, and its late complete of
/// the taken-over rows is refused as a lost lease instead of waiting for the frozen claim.
#[tokio::test]
async fn relays_frozen_mid_claim_or_mid_complete_block_no_other_call() {
    let Some(db) = db().await else { return };
    let begin = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";
    // The frozen relays' sessions, on a pool of their own: the store's connections would end
    // a transaction left idle this long, which is the point of them but not of this test.
    let frozen = MySqlPoolOptions::new().connect(&db.url).await.unwrap();
    let (f1, f2, a1, b1) = (
        msg("f", "f1"),
        msg("f", "f2"),
        msg("a", "a1"),
        msg("b", "b1"),
    );
    db.enqueue(&[f1.clone(), f2.clone(), a1.clone(), b1.clone()])
        .await;
    let slow = db.claim(10, Block).await;
    assert_eq!(names(&slow), ["f1", "f2", "a1", "b1"]);
    // The slow holder's lease ends on key f (it took too long over them) ...
    sqlx::query(&format!(
        "UPDATE {} SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND
         WHERE partition_key = 'f'",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    // ... and another relay's claim of two rows locks them, then freezes before its commit.
    let mut frozen_claim = frozen.begin_with(begin).await.unwrap();
    assert_eq!(
        lock_like_a_claim(&mut frozen_claim, db.table(), 2)
            .await
            .len(),
        2
    );
    // A third relay froze mid-complete: its own rows locked, as the transition's first step.
    db.enqueue(&[msg("c", "c1")]).await;
    let third = db.claim(10, Block).await;
    assert_eq!(names(&third), ["c1"]);
    let mut frozen_complete = frozen.begin_with(begin).await.unwrap();
    sqlx::query(&format!(
        "SELECT id FROM {} FORCE INDEX (uq_id) WHERE id = ? FOR UPDATE",
        db.table()
    ))
    .bind(third.messages[0].id.to_string())
    .execute(&mut *frozen_complete)
    .await
    .unwrap();

    // New work on other keys flows: claimed, extended, completed.
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
    // The slow holder's late complete: what it still holds is published, the rows taken over
    // are refused (lease lost) without waiting for the frozen claim.
    match returns("late complete", db.store.complete(slow.token, &ids(&slow))).await {
        Err(Error::LeaseLost { ids }) => {
            assert_eq!(
                ids.iter().collect::<HashSet<_>>(),
                HashSet::from([&f1.id, &f2.id])
            );
        }
        other => panic!("expected the lease on f1 and f2 to be lost: {other:?}"),
    }
    for id in [a1.id, b1.id] {
        assert_eq!(db.state(id).await, "published");
    }

    frozen_claim.rollback().await.unwrap();
    frozen_complete.rollback().await.unwrap();
    assert_eq!(names(&db.claim(10, Block).await), ["f1", "f2"]);
    frozen.close().await;
    db.drop().await;
}

/// A relay frozen inside the store's own claim, after its locking reads (held here inside the
/// claim's lease update by a trigger that waits for a user lock this test holds), holds no
/// other relay's message: another relay extends and completes a message it leases, which the
/// frozen claim's scan of the claim index passed over, at once. (When the claim locked the
/// rows it scanned, InnoDB kept that row locked until the claim ended: the complete waited its
/// 2 s and failed, again and again, until the server ended the frozen claim.) Likewise a relay
/// frozen inside a complete that lists a message it lost to another relay: the new holder
/// completes it at once, and the frozen complete, once it goes on, reports it lost.
#[tokio::test]
async fn relays_frozen_inside_a_claim_or_a_complete_hold_no_other_relay_s_message() {
    let Some(db) = db().await else { return };
    let name = db.config.table();
    let user_lock = format!("{name}_freeze");
    sqlx::query(&format!(
        "CREATE TRIGGER `{name}_freeze` BEFORE UPDATE ON {} FOR EACH ROW
         BEGIN
             IF OLD.partition_key = 'freeze' THEN
                 SET @outbox_frozen = GET_LOCK('{user_lock}', 300);
                 SET @outbox_frozen = RELEASE_LOCK('{user_lock}');
             END IF;
         END",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    let mut holder = MySqlConnection::connect(&db.url).await.unwrap();
    let frozen_inside = || async {
        until(
            "the frozen relay's call waits inside its update",
            || async {
                let n: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST
                 WHERE STATE = 'User lock' AND INFO LIKE ?",
                )
                .bind(format!("%{name}%"))
                .fetch_one(db.pool())
                .await
                .unwrap();
                n > 0
            },
        )
        .await;
    };
    // The relay that freezes: its own pool, as another process would have.
    let frozen = MysqlStore::connect(&db.url, db.config.clone())
        .await
        .unwrap();

    // This store (the other relay) leases `a`, the first row of the claim index.
    db.enqueue(&[msg("a", "a")]).await;
    let a = db.claim(10, Block).await;
    assert_eq!(names(&a), ["a"]);
    db.enqueue(&[msg("g", "g"), msg("freeze", "f")]).await;
    take_user_lock(&mut holder, &user_lock).await;
    let claiming = {
        let frozen = frozen.clone();
        tokio::spawn(async move {
            frozen
                .claim(&ClaimRequest {
                    limit: 10,
                    lease: Duration::from_secs(30),
                    head_policy: Block,
                    shard: None,
                })
                .await
        })
    };
    frozen_inside().await;
    // Frozen mid-claim: the other relay's calls on `a` go through at once.
    returns("extend", db.store.extend(a.token, Duration::from_secs(30)))
        .await
        .unwrap();
    returns("complete", db.store.complete(a.token, &ids(&a)))
        .await
        .unwrap();
    assert_eq!(db.state(a.messages[0].id).await, "published");
    release_user_lock(&mut holder, &user_lock).await;
    let taken = returns("the frozen claim", claiming)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(names(&taken), ["g", "f"]);

    // The frozen relay's lease on `g` ends, and this store takes `g` over.
    sqlx::query(&format!(
        "UPDATE {} SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND
         WHERE partition_key = 'g'",
        db.table()
    ))
    .execute(db.pool())
    .await
    .unwrap();
    let g = db.claim(10, Block).await;
    assert_eq!(names(&g), ["g"]);
    take_user_lock(&mut holder, &user_lock).await;
    let completing = {
        let (frozen, token, listed) = (frozen.clone(), taken.token, ids(&taken));
        tokio::spawn(async move { frozen.complete(token, &listed).await })
    };
    frozen_inside().await;
    // Frozen mid-complete, its list naming `g`: the new holder completes `g` at once.
    returns("complete", db.store.complete(g.token, &ids(&g)))
        .await
        .unwrap();
    assert_eq!(db.state(g.messages[0].id).await, "published");
    release_user_lock(&mut holder, &user_lock).await;
    match returns("the frozen complete", completing).await.unwrap() {
        Err(Error::LeaseLost { ids }) => assert_eq!(ids, [g.messages[0].id]),
        other => panic!("expected the lease on g to be lost: {other:?}"),
    }
    assert_eq!(db.state(taken.messages[1].id).await, "published");
    frozen.pool().close().await;
    db.drop().await;
}

/// The connections `MysqlStore::connect` opens end a transaction left idle (a relay frozen
/// mid-claim keeps its rows locked at most that long).
#[tokio::test]
async fn the_store_s_connections_end_idle_transactions() {
    let Some(db) = db().await else { return };
    let timeout: u64 = sqlx::query_scalar("SELECT @@session.idle_transaction_timeout")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert!((1..=10).contains(&timeout), "{timeout}");
    db.drop().await;
}

/// Ids written by plain SQL in upper or mixed case (the id check allows A-F) are stored in
/// lower case, the form completions match, so each such row is claimed once and ends
/// `published`; a table made before the id trigger gets it from `migrate`, which also lowers
/// the ids already stored, once (a row whose lowered id is taken is dead-lettered with a reason
/// instead of being republished forever).
#[tokio::test]
async fn ids_in_any_case_are_completed_and_migrate_lowers_old_ones() {
    const UPPER: &str = "BF3D6C4D-09A7-46F2-9F2F-5F7372B91D29";
    const MIXED: &str = "bf3d6c4d-09A7-46f2-9F2F-5f7372b91d2a";
    const TAKEN: &str = "BF3D6C4D-09A7-46F2-9F2F-5F7372B91D2B";
    const NEW: &str = "0B1E5A52-6C0E-4B8E-9D7E-6D1C2A0000FF";
    // A table made before the id trigger: one with its own claim indexes (an unpublished table
    // always had the trigger).
    let Some(db) = db_with(|b| b.unpublished_table(false)).await else {
        return;
    };
    let pool = db.pool().clone();
    let table = db.table().to_owned();
    let insert = |id: String, n: u32| {
        let sql = format!(
            "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload) \
             VALUES (?, 'o', 'k', 't', '{{\"n\": {n}}}')"
        );
        let pool = pool.clone();
        async move { sqlx::query(&sql).bind(id).execute(&pool).await }
    };
    // A table made before the trigger: rows keep the case they were written in.
    let trigger = format!("`{}_id_v7`", db.config.table());
    sqlx::query(&format!("DROP TRIGGER {trigger}"))
        .execute(db.pool())
        .await
        .unwrap();
    insert(UPPER.into(), 1).await.unwrap();
    insert(MIXED.into(), 2).await.unwrap();
    insert(TAKEN.into(), 3).await.unwrap();
    insert(TAKEN.to_lowercase(), 4).await.unwrap();
    db.store.migrate().await.unwrap();
    db.store.migrate().await.unwrap();
    let rows: Vec<(String, String, Option<String>)> = sqlx::query_as(&format!(
        "SELECT CAST(id AS CHAR CHARACTER SET utf8mb4), CAST(state AS CHAR CHARACTER SET utf8mb4), \
                CAST(last_error AS CHAR CHARACTER SET utf8mb4) FROM {} ORDER BY seq",
        db.table()
    ))
    .fetch_all(db.pool())
    .await
    .unwrap();
    assert_eq!(rows[0].0, UPPER.to_lowercase());
    assert_eq!(rows[1].0, MIXED.to_lowercase());
    assert_eq!((rows[2].0.as_str(), rows[2].1.as_str()), (TAKEN, "dead"));
    let reason = rows[2].2.as_deref().unwrap_or_default();
    assert!(reason.contains("differs only in case"), "{reason}");
    assert_eq!(rows[3].0, TAKEN.to_lowercase());
    // The trigger is back: a new row is lowered on insert; the same id in another case is the
    // same id.
    insert(NEW.into(), 5).await.unwrap();
    assert!(insert(NEW.to_lowercase(), 6).await.is_err());

    let claim = db.claim(10, Skip).await;
    let claimed: Vec<String> = claim.messages.iter().map(|m| m.id.to_string()).collect();
    let expected = [UPPER, MIXED, TAKEN, NEW].map(|id| id.to_lowercase());
    assert_eq!(claimed, expected);
    // Each completion matches its row: all published, none left leased to come round again.
    db.store.complete(claim.token, &ids(&claim)).await.unwrap();
    let counts = db.store.counts().await.unwrap();
    assert_eq!(
        (counts.published, counts.leased, counts.pending, counts.dead),
        (4, 0, 0, 1)
    );
    for id in expected {
        assert_eq!(db.state(Uuid::parse_str(&id).unwrap()).await, "published");
    }
    db.drop().await;
}

/// The key-lock table (`lock_keys`) gets a row per key ever locked; each `purge_published`
/// call also deletes a bounded batch of those rows that no writer holds, never waiting for a
/// writer that holds one, and writers lock the purged keys again as before.
#[tokio::test]
async fn purge_deletes_key_locks_no_writer_holds_in_bounded_batches() {
    let Some(db) = db_with(|b| b.lock_keys(true)).await else {
        return;
    };
    let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
    for key in &keys {
        db.enqueue(&[msg(key, key)]).await;
    }
    let key_locks = db.config.key_locks_table().to_owned();
    let locked = || async {
        let keys: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT CAST(partition_key AS CHAR CHARACTER SET utf8mb4) FROM {key_locks} \
             ORDER BY partition_key"
        ))
        .fetch_all(db.pool())
        .await
        .unwrap();
        keys
    };
    assert_eq!(locked().await, keys);
    // A writer holds k0 and k3 (its transaction is open).
    let mut writer = db.pool().begin().await.unwrap();
    enqueue_batch(&mut *writer, &db.config, &[msg("k3", "a"), msg("k0", "b")])
        .await
        .unwrap();
    // Bounded: two rows per call, k0 skipped.
    let purged = returns("purge", db.store.purge_published(Duration::ZERO, 2)).await;
    assert_eq!(purged.unwrap(), 0, "the count is of messages");
    assert_eq!(locked().await, ["k0", "k3", "k4"]);
    returns("purge", db.store.purge_published(Duration::ZERO, 2))
        .await
        .unwrap();
    assert_eq!(locked().await, ["k0", "k3"], "held rows are never deleted");
    writer.commit().await.unwrap();
    // The writers' keys lock and order as before: a purged key is inserted again.
    db.enqueue(&[msg("k1", "c")]).await;
    assert!(locked().await.contains(&"k1".to_owned()));
    returns("purge", db.store.purge_published(Duration::ZERO, 10))
        .await
        .unwrap();
    assert!(locked().await.is_empty());
    let claim = db.claim(20, Block).await;
    assert_eq!(claim.messages.len(), 8);
    db.drop().await;
}
