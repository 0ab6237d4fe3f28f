//! Behaviour of the SQLite store against real database files (SQLite needs no server, so
//! these always run). Each test has its own temp file.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use outbox_backend_sqlite::{
    enqueue, enqueue_batch, open_connection, SqliteConfig, SqliteStore, Synchronous,
};
use outbox_traits::uuid::Uuid;
use outbox_traits::{
    ClaimRequest, Error, FailAction, Failure, HeadPolicy, Limits, NewMessage, OutboxAdmin,
    OutboxStore,
};
use rusqlite::{Connection, TransactionBehavior};
use tempfile::TempDir;

struct Db {
    dir: TempDir,
    path: PathBuf,
    config: SqliteConfig,
}

impl Db {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("outbox.db");
        Db {
            dir,
            path,
            config: SqliteConfig::default(),
        }
    }

    pub async fn store(&self) -> SqliteStore {
        let store = SqliteStore::open(&self.path, self.config.clone())
            .await
            .expect("open store");
        store.migrate().await.expect("migrate");
        store
    }

    fn conn(&self) -> Connection {
        open_connection(&self.path, &self.config).expect("open connection")
    }

    /// Enqueue and commit, in one IMMEDIATE transaction.
    fn enqueue(&self, messages: &[NewMessage]) {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        enqueue_batch(&tx, &self.config, messages).unwrap();
        tx.commit().unwrap();
    }

    /// Run one SQL statement on a separate connection; returns the changed row count.
    fn exec(&self, sql: &str) -> usize {
        self.conn().execute(sql, []).unwrap()
    }

    /// Make every lease end an hour ago (as if an hour passed for the leases).
    fn expire_leases(&self) {
        self.exec("UPDATE outbox SET lease_until = lease_until - 3600000 WHERE state = 'leased'");
    }

    fn state_of(&self, id: outbox_traits::uuid::Uuid) -> (String, i64) {
        self.conn()
            .query_row(
                "SELECT state, attempts FROM outbox WHERE id = ?1",
                [id.to_string()],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
    }
}

fn msg(key: &str, n: u32) -> NewMessage {
    NewMessage::new(
        "test",
        key,
        "test.event",
        serde_json::json!({ "key": key, "n": n }),
    )
}

fn unordered(n: u32) -> NewMessage {
    NewMessage::new("test", "u", "test.event", serde_json::json!({ "n": n })).unordered()
}

fn req(limit: usize) -> ClaimRequest {
    ClaimRequest {
        limit,
        lease: Duration::from_secs(60),
        head_policy: HeadPolicy::Block,
        shard: None,
    }
}

fn ids(claim: &outbox_traits::Claim) -> Vec<Uuid> {
    claim.messages.iter().map(|m| m.id).collect()
}

#[tokio::test]
async fn a_claim_waits_for_an_open_writer_and_then_sees_both_commits() {
    let db = Db::new();
    let store = db.store().await;
    let (first, second) = (msg("k", 1), msg("k", 2));

    // Writer A holds the write lock with an uncommitted insert.
    let mut conn_a = db.conn();
    let tx_a = conn_a
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    enqueue(&tx_a, &db.config, &first).unwrap();

    // Reads are never blocked in WAL mode and do not see A's row.
    assert_eq!(store.counts().await.unwrap().pending, 0);

    // Writer B and a claim both start while A is open: SQLite serializes writers, so B's insert
    // (and its seq) can only come after A commits; insert order cannot differ from commit order.
    let path = db.path.clone();
    let config = db.config.clone();
    let second_clone = second.clone();
    let writer_b = std::thread::spawn(move || {
        let mut conn = open_connection(&path, &config).unwrap();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        enqueue(&tx, &config, &second_clone).unwrap();
        tx.commit().unwrap();
    });
    let claimer = {
        let store = store.clone();
        tokio::spawn(async move { store.claim(&req(10)).await })
    };
    tx_a.commit().unwrap();
    writer_b.join().unwrap();
    let mut seen = ids(&claimer.await.unwrap().unwrap());
    // The claim ran after A committed (it needed the lock) and before or after B.
    assert_eq!(seen.first(), Some(&first.id));
    if seen.len() == 1 {
        // B committed after the claim: k's first message is leased, so B's waits behind it.
        let claim = store.claim(&req(10)).await.unwrap();
        assert!(claim.messages.is_empty(), "k is held by the first claim");
        db.expire_leases();
        let claim = store.claim(&req(10)).await.unwrap();
        seen = ids(&claim);
    }
    assert_eq!(seen, vec![first.id, second.id]);
}

#[tokio::test]
async fn a_long_read_transaction_does_not_block_the_relay() {
    let db = Db::new();
    let store = db.store().await;
    db.enqueue(&[msg("k", 1), msg("k", 2)]);
    let reader = db.conn();
    reader.execute_batch("BEGIN DEFERRED").unwrap();
    let before: i64 = reader
        .query_row(
            "SELECT COUNT(*) FROM outbox WHERE state = 'pending'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(before, 2);
    // The reader's snapshot stays open while the relay claims and completes.
    let claim = store.claim(&req(10)).await.unwrap();
    assert_eq!(claim.messages.len(), 2);
    store.complete(claim.token, &ids(&claim)).await.unwrap();
    let still: i64 = reader
        .query_row(
            "SELECT COUNT(*) FROM outbox WHERE state = 'pending'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(still, 2, "the reader keeps its snapshot");
    reader.execute_batch("COMMIT").unwrap();
    assert_eq!(store.counts().await.unwrap().published, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_handles_claiming_concurrently_never_overlap_and_keep_key_order() {
    let db = Db::new();
    let a = db.store().await;
    let b = db.store().await;
    let mut all = Vec::new();
    for n in 0..40 {
        for key in ["k0", "k1", "k2", "k3", "k4"] {
            all.push(msg(key, n));
        }
        all.push(unordered(n));
    }
    db.enqueue(&all);
    let seq_of: HashMap<Uuid, usize> = all.iter().enumerate().map(|(i, m)| (m.id, i)).collect();

    let mut tasks = Vec::new();
    for i in 0..24 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move { store.claim(&req(7)).await }));
    }
    let mut holder: HashMap<Uuid, usize> = HashMap::new();
    let mut claims = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        let claim = task.await.unwrap().unwrap();
        assert!(claim.messages.len() <= 7);
        for m in &claim.messages {
            assert!(holder.insert(m.id, i).is_none(), "{} claimed twice", m.id);
        }
        claims.push(claim);
    }
    // Per-key order: a claim holding message n of a key holds every earlier unpublished one.
    for claim in &claims {
        for m in claim.messages.iter().filter(|m| m.partition_key.is_some()) {
            for earlier in all
                .iter()
                .filter(|e| e.partition_key == m.partition_key && seq_of[&e.id] < seq_of[&m.id])
            {
                assert!(
                    claim.messages.iter().any(|c| c.id == earlier.id),
                    "message {} returned without its predecessor {}",
                    m.id,
                    earlier.id
                );
            }
        }
        let seqs: Vec<i64> = claim.messages.iter().map(|m| m.seq).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "seq order: {seqs:?}");
    }
    // Drain: complete everything, alternating handles, until nothing is left.
    for claim in &claims {
        a.complete(claim.token, &ids(claim)).await.unwrap();
    }
    let mut published = holder.len();
    loop {
        let store = if published.is_multiple_of(2) { &a } else { &b };
        let claim = store.claim(&req(13)).await.unwrap();
        if claim.messages.is_empty() {
            break;
        }
        for m in &claim.messages {
            assert!(holder.insert(m.id, usize::MAX).is_none());
        }
        published += claim.messages.len();
        store.complete(claim.token, &ids(&claim)).await.unwrap();
    }
    assert_eq!(published, all.len());
    assert_eq!(a.counts().await.unwrap().published, all.len() as u64);
}

#[tokio::test]
async fn seq_is_not_reused_after_purge_and_reopen_and_purge_keeps_unpublished() {
    let db = Db::new();
    let store = db.store().await;
    let done: Vec<NewMessage> = (0..3).map(unordered).collect();
    db.enqueue(&done);
    let claim = store.claim(&req(10)).await.unwrap();
    let max_seq = claim.messages.iter().map(|m| m.seq).max().unwrap();
    store.complete(claim.token, &ids(&claim)).await.unwrap();
    let (waiting, dying) = (msg("w", 1), msg("d", 1));
    db.enqueue(&[waiting.clone(), dying.clone()]);
    let claim = store.claim(&req(10)).await.unwrap();
    let dead = Failure {
        id: dying.id,
        error: "x".into(),
        action: FailAction::Dead,
    };
    store.fail(claim.token, &[dead]).await.unwrap();
    store.release(claim.token, &[waiting.id]).await.unwrap();

    // Too recent for an hour's retention.
    assert_eq!(
        store
            .purge_published(Duration::from_secs(3600), 100)
            .await
            .unwrap(),
        0
    );
    db.exec("UPDATE outbox SET published_at = published_at - 1000");
    assert_eq!(
        store.purge_published(Duration::ZERO, 2).await.unwrap(),
        2,
        "bounded"
    );
    assert_eq!(store.purge_published(Duration::ZERO, 100).await.unwrap(), 1);
    assert_eq!(store.purge_published(Duration::ZERO, 100).await.unwrap(), 0);
    let counts = store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.dead, counts.published), (1, 1, 0));
    // Delete the newest rows too, then reopen: without AUTOINCREMENT SQLite would reuse seqs.
    db.exec("DELETE FROM outbox");
    drop(store);
    let store = db.store().await;
    let fresh = unordered(9);
    db.enqueue(std::slice::from_ref(&fresh));
    let claim = store.claim(&req(10)).await.unwrap();
    assert_eq!(ids(&claim), vec![fresh.id]);
    assert!(
        claim.messages[0].seq > max_seq + 2,
        "seq {} reused",
        claim.messages[0].seq
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_and_two_relays_never_see_busy() {
    // FM-E3: 4 writer connections commit continuously while two store handles claim and
    // complete. A claim is a read (the walk) followed by writes; without BEGIN IMMEDIATE a
    // commit by a writer in between fails it with SQLITE_BUSY at once, busy_timeout or not.
    let db = Db::new();
    let a = db.store().await;
    let b = db.store().await;
    // Another connection holds a read transaction (a snapshot) for the whole test.
    let reader = db.conn();
    reader.execute_batch("BEGIN DEFERRED").unwrap();
    let _: i64 = reader
        .query_row("SELECT COUNT(*) FROM outbox", [], |r| r.get(0))
        .unwrap();

    const WRITERS: usize = 4;
    const PER_WRITER: usize = 250;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (path, config) = (db.path.clone(), db.config.clone());
        writers.push(std::thread::spawn(move || {
            let mut conn = open_connection(&path, &config).unwrap();
            for chunk in 0..PER_WRITER / 5 {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .unwrap();
                // Read-then-write inside the caller's transaction, as services do.
                let _: i64 = tx
                    .query_row("SELECT COUNT(*) FROM outbox", [], |r| r.get(0))
                    .unwrap();
                let batch: Vec<NewMessage> = (0..5)
                    .map(|i| msg(&format!("w{w}-{}", i % 3), (chunk * 5 + i) as u32))
                    .collect();
                enqueue_batch(&tx, &config, &batch).unwrap();
                tx.commit().unwrap();
            }
        }));
    }
    let relay = |store: SqliteStore| {
        tokio::spawn(async move {
            let mut done = 0usize;
            let mut idle_rounds = 0;
            while idle_rounds < 200 {
                let claim = store.claim(&req(16)).await.expect("claim never fails");
                if claim.messages.is_empty() {
                    idle_rounds += 1;
                    tokio::task::yield_now().await;
                    continue;
                }
                idle_rounds = 0;
                done += claim.messages.len();
                store
                    .complete(claim.token, &ids(&claim))
                    .await
                    .expect("complete never fails");
            }
            done
        })
    };
    let (ra, rb) = (relay(a.clone()), relay(b.clone()));
    for w in writers {
        w.join().unwrap();
    }
    let total = ra.await.unwrap() + rb.await.unwrap();
    // The relays stop after 200 idle rounds; drain whatever they left.
    let mut rest = 0;
    loop {
        let claim = a.claim(&req(100)).await.unwrap();
        if claim.messages.is_empty() {
            break;
        }
        rest += claim.messages.len();
        a.complete(claim.token, &ids(&claim)).await.unwrap();
    }
    assert_eq!(total + rest, WRITERS * PER_WRITER);
    let counts = a.counts().await.unwrap();
    assert_eq!(counts.published, (WRITERS * PER_WRITER) as u64);
    assert_eq!(counts.pending + counts.leased + counts.dead, 0);
    reader.execute_batch("COMMIT").unwrap();
}

#[tokio::test]
async fn invalid_input_is_refused_before_anything_is_written() {
    let db = Db::new();
    let store = db.store().await;
    let mut conn = db.conn();
    conn.execute_batch("CREATE TABLE orders (id TEXT)").unwrap();
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    tx.execute("INSERT INTO orders VALUES ('o1')", []).unwrap();
    let mut bad = msg("k", 2);
    bad.event_type = String::new();
    let err = enqueue_batch(&tx, &db.config, &[msg("k", 1), bad]).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
    assert!(err.to_string().contains("event type"), "{err}");

    let small = SqliteConfig::builder()
        .limits(Limits {
            max_payload_bytes: 10,
        })
        .build()
        .unwrap();
    let err = enqueue(&tx, &small, &msg("k", 3)).unwrap_err();
    assert!(err.to_string().contains("over the limit"), "{err}");
    let err = SqliteConfig::builder().table("no;pe").build().unwrap_err();
    assert!(err.to_string().contains("table name"), "{err}");

    // Duplicate dedup keys: within the batch, and against a stored message (then the batch's
    // earlier messages are undone too, and the caller's own write survives).
    let first = msg("k", 5).with_dedup_key("order-1-placed");
    let twin = msg("k", 6).with_dedup_key("order-1-placed");
    let err = enqueue_batch(&tx, &db.config, &[first.clone(), twin.clone()]).unwrap_err();
    assert!(
        matches!(err, Error::DuplicateKey { ref key } if key == "order-1-placed"),
        "{err:?}"
    );
    enqueue(&tx, &db.config, &first).unwrap();
    let innocent = msg("k", 7);
    let err = enqueue_batch(&tx, &db.config, &[innocent.clone(), twin]).unwrap_err();
    assert!(matches!(err, Error::DuplicateKey { .. }), "{err:?}");
    let err = enqueue(&tx, &db.config, &msg("k", 8).with_id(first.id)).unwrap_err();
    assert!(
        matches!(err, Error::InvalidInput(_)),
        "duplicate id: {err:?}"
    );
    tx.commit().unwrap();

    let claim = store.claim(&req(10)).await.unwrap();
    assert_eq!(
        ids(&claim),
        vec![first.id],
        "only the valid message was written"
    );
    let orders: i64 = conn
        .query_row("SELECT COUNT(*) FROM orders", [], |r| r.get(0))
        .unwrap();
    assert_eq!(orders, 1);
}

#[tokio::test]
async fn bad_paths_and_missing_tables_are_typed_errors() {
    let db = Db::new();
    let missing = db.dir.path().join("no/such/dir/outbox.db");
    let err = SqliteStore::open(&missing, SqliteConfig::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
    assert!(err.to_string().contains("does not exist"), "{err}");
    assert!(matches!(
        open_connection(&missing, &db.config),
        Err(Error::InvalidInput(_))
    ));
    let err = SqliteConfig::builder().table("1bad").build().unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");

    // A connection to a database nobody migrated: enqueue says to run migrate.
    let mut conn = db.conn();
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    let err = enqueue(&tx, &db.config, &msg("k", 1)).unwrap_err();
    assert!(!err.is_transient());
    assert!(err.to_string().contains("migrate"), "{err}");
    drop(tx);
    // Opening a store does not create the table (as on every backend): its calls say to
    // migrate, and after `migrate()` they work.
    let store = SqliteStore::open(&db.path, db.config.clone())
        .await
        .unwrap();
    let err = store.claim(&req(1)).await.unwrap_err();
    assert!(!err.is_transient());
    assert!(err.to_string().contains("migrate"), "{err}");
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    assert!(store.claim(&req(1)).await.unwrap().messages.is_empty());
}

#[tokio::test]
async fn connections_are_configured_for_the_outbox() {
    let db = Db::new();
    let conn = db.conn();
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let sync: i64 = conn
        .query_row("PRAGMA synchronous", [], |r| r.get(0))
        .unwrap();
    assert_eq!(sync, 1, "NORMAL by default");
    let fk: i64 = conn
        .query_row("PRAGMA foreign_keys", [], |r| r.get(0))
        .unwrap();
    assert_eq!(fk, 1);
    let full = open_connection(
        &db.path,
        &SqliteConfig::builder()
            .synchronous(Synchronous::Full)
            .build()
            .unwrap(),
    )
    .unwrap();
    let sync: i64 = full
        .query_row("PRAGMA synchronous", [], |r| r.get(0))
        .unwrap();
    assert_eq!(sync, 2);
}

#[tokio::test]
async fn the_store_transaction_commits_on_ok_and_rolls_back_on_err() {
    let db = Db::new();
    let store = db.store().await;
    let kept = msg("k", 1);
    let k2 = kept.clone();
    store
        .transaction(move |tx, config| enqueue(tx, config, &k2))
        .await
        .unwrap();
    let dropped = msg("k", 2);
    let err = store
        .transaction(move |tx, config| {
            enqueue(tx, config, &dropped)?;
            Err::<(), Error>(Error::invalid_input("business rule failed"))
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("business rule"));
    let claim = store.claim(&req(10)).await.unwrap();
    assert_eq!(ids(&claim), vec![kept.id]);
}

#[tokio::test]
async fn fail_records_attempts_and_errors_in_one_call() {
    let db = Db::new();
    let store = db.store().await;
    let (a, b) = (unordered(1), unordered(2));
    db.enqueue(&[a.clone(), b.clone()]);
    let claim = store.claim(&req(10)).await.unwrap();
    let failures = [
        Failure {
            id: a.id,
            error: "timeout".into(),
            action: FailAction::Retry {
                delay: Duration::ZERO,
            },
        },
        Failure {
            id: b.id,
            error: "rejected".into(),
            action: FailAction::Dead,
        },
    ];
    store.fail(claim.token, &failures).await.unwrap();
    assert_eq!(db.state_of(a.id), ("pending".to_owned(), 1));
    assert_eq!(db.state_of(b.id), ("dead".to_owned(), 1));
    let claim = store.claim(&req(10)).await.unwrap();
    assert_eq!(ids(&claim), vec![a.id], "a zero delay is due at once");
    assert_eq!(claim.messages[0].attempts, 1);
    let counts = store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.leased, counts.dead), (0, 1, 1));
}

#[tokio::test]
async fn a_lock_held_past_the_busy_timeout_is_a_transient_error() {
    let mut db = Db::new();
    db.config = SqliteConfig::builder()
        .busy_timeout(Duration::from_millis(20))
        .build()
        .unwrap();
    let store = db.store().await;
    db.enqueue(&[msg("k", 1)]);
    let mut holder = db.conn();
    let tx = holder
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    let err = store.claim(&req(10)).await.unwrap_err();
    assert!(err.is_transient(), "{err:?}");
    assert!(err.to_string().contains("locked"), "{err}");
    tx.rollback().unwrap();
    assert_eq!(store.claim(&req(10)).await.unwrap().messages.len(), 1);
}

#[tokio::test]
async fn an_in_memory_store_works_through_its_own_transactions() {
    let store = SqliteStore::open(":memory:", SqliteConfig::default())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let m = msg("k", 1);
    let m2 = m.clone();
    store
        .transaction(move |tx, config| enqueue(tx, config, &m2))
        .await
        .unwrap();
    let claim = store.claim(&req(10)).await.unwrap();
    assert_eq!(ids(&claim), vec![m.id]);
    store.complete(claim.token, &[m.id]).await.unwrap();
    assert_eq!(store.counts().await.unwrap().published, 1);
}
