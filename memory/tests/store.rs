//! The memory store follows each rule of the store contract.

use std::time::Duration;

use outbox_memory::MemoryStore;
use outbox_traits::{
    ClaimRequest, ClaimShard, Error, FailAction, Failure, HeadPolicy, LeaseToken, NewMessage,
    OutboxAdmin, OutboxStore,
};
use uuid::Uuid;

const LEASE: Duration = Duration::from_secs(30);

fn msg(key: &str, n: u32) -> NewMessage {
    NewMessage::new("order", key, "order.placed", serde_json::json!({ "n": n }))
}

fn req(limit: usize) -> ClaimRequest {
    ClaimRequest {
        limit,
        lease: LEASE,
        head_policy: HeadPolicy::Block,
        shard: None,
    }
}

fn ids(claim: &outbox_traits::Claim) -> Vec<Uuid> {
    claim.messages.iter().map(|m| m.id).collect()
}

fn retry(id: Uuid, secs: u64) -> Failure {
    Failure {
        id,
        error: "broker said no".into(),
        action: FailAction::Retry {
            delay: Duration::from_secs(secs),
        },
    }
}

fn dead(id: Uuid) -> Failure {
    Failure {
        id,
        error: "poison".into(),
        action: FailAction::Dead,
    }
}

#[tokio::test]
async fn claim_returns_at_most_the_limit_in_seq_order() {
    let store = MemoryStore::new();
    store
        .enqueue((0..5).map(|n| msg(&format!("k{n}"), n)))
        .unwrap();
    let claim = store.claim(&req(3)).await.unwrap();
    assert_eq!(claim.messages.len(), 3);
    let seqs: Vec<i64> = claim.messages.iter().map(|m| m.seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert_eq!(store.claim(&req(10)).await.unwrap().messages.len(), 2);
    assert!(store.claim(&req(10)).await.unwrap().messages.is_empty());
}

#[tokio::test]
async fn bad_claim_requests_are_refused() {
    let store = MemoryStore::new();
    assert!(matches!(
        store.claim(&req(0)).await,
        Err(Error::InvalidInput(_))
    ));
    let zero_lease = ClaimRequest {
        lease: Duration::ZERO,
        ..req(1)
    };
    assert!(matches!(
        store.claim(&zero_lease).await,
        Err(Error::InvalidInput(_))
    ));
}

fn sharded(limit: usize, index: u32, count: u32) -> ClaimRequest {
    ClaimRequest {
        shard: Some(ClaimShard { index, count }),
        ..req(limit)
    }
}

fn keys(claim: &outbox_traits::Claim) -> Vec<Option<&str>> {
    claim
        .messages
        .iter()
        .map(|m| m.partition_key.as_deref())
        .collect()
}

#[tokio::test]
async fn bad_shards_are_refused_before_anything_is_leased() {
    let store = MemoryStore::new();
    assert!(store.capabilities().sharded_claims);
    store.enqueue([msg("a", 1), msg("b", 1)]).unwrap();
    for (index, count) in [(0, 0), (2, 2), (3, 1)] {
        assert!(matches!(
            store.claim(&sharded(10, index, count)).await,
            Err(Error::InvalidInput(_))
        ));
    }
    assert_eq!(store.claim(&req(10)).await.unwrap().messages.len(), 2);
}

#[tokio::test]
async fn a_sharded_claim_takes_only_its_shard_by_a_fixed_hash() {
    let store = MemoryStore::new();
    // FNV-1a of the key modulo 2: "a", "order-2" -> 0; "b", "order-1" -> 1. Unordered messages
    // go by seq modulo 2: the one with seq 5 -> 1, seq 6 -> 0.
    store
        .enqueue([
            msg("a", 1),
            msg("b", 1),
            msg("order-1", 1),
            msg("order-2", 1),
            msg("u", 1).unordered(),
            msg("u", 2).unordered(),
            msg("a", 2),
        ])
        .unwrap();
    let zero = store.claim(&sharded(10, 0, 2)).await.unwrap();
    assert_eq!(keys(&zero), [Some("a"), Some("order-2"), None, Some("a")]);
    assert_eq!(zero.messages[2].seq, 6);
    let one = store.claim(&sharded(10, 1, 2)).await.unwrap();
    assert_eq!(keys(&one), [Some("b"), Some("order-1"), None]);
    assert_eq!(one.messages[2].seq, 5);
    assert!(store.claim(&req(10)).await.unwrap().messages.is_empty());
}

#[tokio::test]
async fn per_key_order_holds_within_a_shard_and_one_shard_is_everything() {
    let store = MemoryStore::new();
    store
        .enqueue([
            msg("a", 1),
            msg("a", 2),
            msg("b", 1),
            msg("u", 1).unordered(),
        ])
        .unwrap();
    let head = store.claim(&sharded(1, 0, 1)).await.unwrap();
    assert_eq!(keys(&head), [Some("a")]);
    // a#2 waits behind the leased a#1, as for an unsharded claim.
    let rest = store.claim(&sharded(10, 0, 1)).await.unwrap();
    assert_eq!(keys(&rest), [Some("b"), None]);
    store.complete(head.token, &ids(&head)).await.unwrap();
    let last = store.claim(&sharded(10, 0, 2)).await.unwrap();
    assert_eq!(keys(&last), [Some("a")]);
    assert!(store
        .claim(&sharded(10, 1, 2))
        .await
        .unwrap()
        .messages
        .is_empty());
}

#[tokio::test]
async fn an_unsharded_store_ignores_the_shard() {
    let store = MemoryStore::unsharded(std::sync::Arc::new(outbox_memory::Clock::new()));
    assert!(!store.capabilities().sharded_claims);
    store
        .enqueue([msg("a", 1), msg("b", 1), msg("u", 1).unordered()])
        .unwrap();
    let all = store.claim(&sharded(10, 1, 2)).await.unwrap();
    assert_eq!(keys(&all), [Some("a"), Some("b"), None]);
}

#[tokio::test]
async fn uncommitted_and_rolled_back_messages_are_invisible() {
    let store = MemoryStore::new();
    let mut open = store.begin();
    open.enqueue(msg("a", 1)).unwrap();
    let mut rolled = store.begin();
    rolled.enqueue(msg("b", 1)).unwrap();
    rolled.rollback();
    {
        let mut dropped = store.begin();
        dropped.enqueue(msg("c", 1)).unwrap();
    }
    assert!(store.claim(&req(10)).await.unwrap().messages.is_empty());
    assert_eq!(store.counts().await.unwrap().pending, 0);
    open.commit();
    let claim = store.claim(&req(10)).await.unwrap();
    assert_eq!(claim.messages.len(), 1);
    assert_eq!(claim.messages[0].aggregate_id, "a");
}

#[tokio::test]
async fn a_late_commit_with_a_lower_seq_is_still_claimed() {
    let store = MemoryStore::new();
    let mut early = store.begin();
    early.enqueue(msg("a", 1)).unwrap();
    let mut late = store.begin();
    late.enqueue(msg("b", 1)).unwrap();
    late.commit();
    let first = store.claim(&req(10)).await.unwrap();
    store.complete(first.token, &ids(&first)).await.unwrap();
    early.commit();
    let second = store.claim(&req(10)).await.unwrap();
    assert_eq!(second.messages.len(), 1);
    assert_eq!(second.messages[0].aggregate_id, "a");
    assert!(second.messages[0].seq < first.messages[0].seq);
}

#[tokio::test]
async fn a_leased_head_holds_back_its_key_only() {
    let store = MemoryStore::new();
    store.enqueue([msg("k", 1)]).unwrap();
    let head = store.claim(&req(1)).await.unwrap();
    store
        .enqueue([msg("k", 2), msg("other", 1), msg("x", 1).unordered()])
        .unwrap();
    let next = store.claim(&req(10)).await.unwrap();
    let keys: Vec<_> = next
        .messages
        .iter()
        .map(|m| m.aggregate_id.as_str())
        .collect();
    assert_eq!(keys, ["other", "x"]);
    store.complete(head.token, &ids(&head)).await.unwrap();
    let last = store.claim(&req(10)).await.unwrap();
    assert_eq!(last.messages.len(), 1);
    assert_eq!(last.messages[0].aggregate_id, "k");
}

#[tokio::test]
async fn the_limit_cuts_a_key_without_skipping_its_head() {
    let store = MemoryStore::new();
    store
        .enqueue([msg("k", 1), msg("k", 2), msg("k", 3)])
        .unwrap();
    let claim = store.claim(&req(2)).await.unwrap();
    let ns: Vec<_> = claim.messages.iter().map(|m| m.payload.clone()).collect();
    assert_eq!(ns, [r#"{"n":1}"#, r#"{"n":2}"#]);
}

#[tokio::test]
async fn a_retry_waits_for_its_delay_and_counts_one_attempt() {
    let store = MemoryStore::new();
    store.enqueue([msg("k", 1), msg("k", 2)]).unwrap();
    let claim = store.claim(&req(1)).await.unwrap();
    let id = claim.messages[0].id;
    assert_eq!(claim.messages[0].attempts, 0);
    store.fail(claim.token, &[retry(id, 60)]).await.unwrap();
    // Waiting for its retry, the head still holds back k#2.
    assert!(store.claim(&req(10)).await.unwrap().messages.is_empty());
    store.clock().advance(Duration::from_secs(59));
    assert!(store.claim(&req(10)).await.unwrap().messages.is_empty());
    store.clock().advance(Duration::from_secs(1));
    let again = store.claim(&req(10)).await.unwrap();
    assert_eq!(again.messages[0].id, id);
    assert_eq!(again.messages[0].attempts, 1);
    assert_eq!(again.messages.len(), 2);
}

#[tokio::test]
async fn release_gives_back_without_counting() {
    let store = MemoryStore::new();
    store.enqueue([msg("k", 1)]).unwrap();
    let claim = store.claim(&req(1)).await.unwrap();
    store.release(claim.token, &ids(&claim)).await.unwrap();
    let again = store.claim(&req(1)).await.unwrap();
    assert_eq!(again.messages[0].attempts, 0);
}

#[tokio::test]
async fn stale_tokens_change_nothing() {
    let store = MemoryStore::new();
    store.enqueue([msg("k", 1)]).unwrap();
    let claim = store.claim(&req(1)).await.unwrap();
    let id = claim.messages[0].id;
    let stale = LeaseToken::new();
    for result in [
        store.complete(stale, &[id]).await,
        store.fail(stale, &[dead(id)]).await,
        store.release(stale, &[id]).await,
    ] {
        match result {
            Err(Error::LeaseLost { ids }) => assert_eq!(ids, [id]),
            other => panic!("expected LeaseLost, got {other:?}"),
        }
    }
    assert!(matches!(
        store.extend(stale, LEASE).await,
        Err(Error::LeaseLost { ids }) if ids.is_empty()
    ));
    let counts = store.counts().await.unwrap();
    assert_eq!((counts.leased, counts.published, counts.dead), (1, 0, 0));
    store.complete(claim.token, &[id]).await.unwrap();
}

#[tokio::test]
async fn an_expired_lease_is_lost_and_reclaimable() {
    let store = MemoryStore::new();
    store.enqueue([msg("k", 1), msg("j", 1)]).unwrap();
    let first = store.claim(&req(10)).await.unwrap();
    store.clock().advance(LEASE);
    // Expired exactly at the lease end: completing now must fail for both.
    match store.complete(first.token, &ids(&first)).await {
        Err(Error::LeaseLost { ids: lost }) => assert_eq!(lost, ids(&first)),
        other => panic!("expected LeaseLost, got {other:?}"),
    }
    assert!(store.extend(first.token, LEASE).await.is_err());
    let second = store.claim(&req(10)).await.unwrap();
    assert_eq!(ids(&second), ids(&first));
    assert_ne!(second.token, first.token);
    assert!(store.complete(first.token, &ids(&first)).await.is_err());
    store.complete(second.token, &ids(&second)).await.unwrap();
    assert_eq!(store.counts().await.unwrap().published, 2);
}

#[tokio::test]
async fn extend_keeps_a_live_lease() {
    let store = MemoryStore::new();
    store.enqueue([msg("k", 1)]).unwrap();
    let claim = store.claim(&req(1)).await.unwrap();
    store.clock().advance(Duration::from_secs(20));
    let until = store.extend(claim.token, LEASE).await.unwrap();
    assert_eq!(until, store.clock().now() + chrono::Duration::seconds(30));
    store.clock().advance(Duration::from_secs(20));
    assert!(store.claim(&req(1)).await.unwrap().messages.is_empty());
    store.complete(claim.token, &ids(&claim)).await.unwrap();
}

#[tokio::test]
async fn dead_letters_block_or_skip_and_can_be_requeued_or_discarded() {
    let store = MemoryStore::new();
    store.enqueue([msg("k", 1), msg("k", 2)]).unwrap();
    let claim = store.claim(&req(1)).await.unwrap();
    let head = claim.messages[0].id;
    store.fail(claim.token, &[dead(head)]).await.unwrap();
    let dead_list = store.list_dead(None, 10).await.unwrap();
    assert_eq!(dead_list.len(), 1);
    assert_eq!(dead_list[0].last_error, "poison");
    assert_eq!(dead_list[0].message.attempts, 1);
    assert!(store.claim(&req(10)).await.unwrap().messages.is_empty());
    let skip = ClaimRequest {
        head_policy: HeadPolicy::Skip,
        shard: None,
        ..req(10)
    };
    let second = store.claim(&skip).await.unwrap();
    assert_eq!(second.messages.len(), 1);
    store.release(second.token, &ids(&second)).await.unwrap();

    assert_eq!(store.requeue(&[head, Uuid::now_v7()]).await.unwrap(), 1);
    let again = store.claim(&req(10)).await.unwrap();
    assert_eq!(again.messages[0].id, head);
    assert_eq!(again.messages[0].attempts, 0);
    store.fail(again.token, &[dead(head)]).await.unwrap();
    store.release(again.token, &ids(&again)[1..]).await.unwrap();
    assert_eq!(store.discard(&[head]).await.unwrap(), 1);
    assert_eq!(store.discard(&[head]).await.unwrap(), 0);
    let last = store.claim(&req(10)).await.unwrap();
    assert_eq!(last.messages.len(), 1);
    assert_eq!(store.counts().await.unwrap().dead, 0);
}

#[tokio::test]
async fn list_dead_pages_by_seq() {
    let store = MemoryStore::new();
    store
        .enqueue((0..3).map(|n| msg(&format!("k{n}"), n)))
        .unwrap();
    let claim = store.claim(&req(10)).await.unwrap();
    let failures: Vec<_> = ids(&claim).into_iter().map(dead).collect();
    store.fail(claim.token, &failures).await.unwrap();
    let page1 = store.list_dead(None, 2).await.unwrap();
    assert_eq!(page1.len(), 2);
    let page2 = store
        .list_dead(Some(page1[1].message.seq), 2)
        .await
        .unwrap();
    assert_eq!(page2.len(), 1);
    assert_eq!(page2[0].message.id, claim.messages[2].id);
}

#[tokio::test]
async fn purge_is_bounded_and_only_takes_old_published() {
    let store = MemoryStore::new();
    store
        .enqueue((0..5).map(|n| msg(&format!("k{n}"), n)))
        .unwrap();
    let claim = store.claim(&req(4)).await.unwrap();
    store.complete(claim.token, &ids(&claim)).await.unwrap();
    assert_eq!(
        store
            .purge_published(Duration::from_secs(60), 10)
            .await
            .unwrap(),
        0
    );
    store.clock().advance(Duration::from_secs(61));
    assert_eq!(
        store
            .purge_published(Duration::from_secs(60), 3)
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        store
            .purge_published(Duration::from_secs(60), 3)
            .await
            .unwrap(),
        1
    );
    let counts = store.counts().await.unwrap();
    assert_eq!((counts.published, counts.pending), (0, 1));
}

#[tokio::test]
async fn enqueue_refuses_bad_input_and_duplicates_writing_nothing() {
    let store = MemoryStore::new();
    store.enqueue([msg("k", 1).with_dedup_key("d1")]).unwrap();
    let dup = store.enqueue([msg("k", 2), msg("k", 3).with_dedup_key("d1")]);
    assert!(matches!(dup, Err(Error::DuplicateKey { key }) if key == "d1"));
    let bad = NewMessage::new("order", "k", "", serde_json::json!({}));
    assert!(matches!(
        store.enqueue([msg("k", 4), bad]),
        Err(Error::InvalidInput(_))
    ));
    let id = Uuid::now_v7();
    store.enqueue([msg("k", 5).with_id(id)]).unwrap();
    assert!(matches!(
        store.enqueue([msg("k", 6).with_id(id)]),
        Err(Error::InvalidInput(_))
    ));
    assert_eq!(store.counts().await.unwrap().pending, 2);
}

#[tokio::test]
async fn not_before_delays_a_message_and_its_key() {
    let store = MemoryStore::new();
    let later = store.clock().now() + chrono::Duration::seconds(100);
    store
        .enqueue([msg("k", 1).not_before(later), msg("k", 2), msg("j", 1)])
        .unwrap();
    let claim = store.claim(&req(10)).await.unwrap();
    assert_eq!(claim.messages.len(), 1);
    assert_eq!(claim.messages[0].aggregate_id, "j");
    store.complete(claim.token, &ids(&claim)).await.unwrap();
    store.clock().advance(Duration::from_secs(100));
    assert_eq!(store.claim(&req(10)).await.unwrap().messages.len(), 2);
}

#[tokio::test]
async fn wakeups_fire_on_commit() {
    let store = MemoryStore::new();
    let mut wake = store
        .wakeups()
        .await
        .unwrap()
        .expect("memory store has wake-ups");
    let waiter = tokio::spawn(async move { wake.wait().await });
    store.enqueue([msg("k", 1)]).unwrap();
    waiter.await.unwrap().unwrap();
}
