//! `OutboxAdmin::status` of the in-memory store: counts, the oldest age by the store's clock,
//! blocked keys with their head message, and the last minute's publications.

use std::time::Duration;

use outbox_memory::MemoryStore;
use outbox_traits::{
    ClaimRequest, FailAction, Failure, HeadPolicy, NewMessage, OutboxAdmin, OutboxStore,
};

#[tokio::test]
async fn status_reports_blocked_heads_and_ages_by_the_store_clock() {
    let store = MemoryStore::new();
    let messages: Vec<NewMessage> = ["ka", "ka", "kb", "kc", "kd"]
        .iter()
        .enumerate()
        .map(|(n, key)| {
            NewMessage::new(
                "order",
                format!("o-{n}"),
                "order.placed",
                serde_json::json!({}),
            )
            .with_partition_key(*key)
        })
        .collect();
    let ids: Vec<_> = messages.iter().map(|m| m.id).collect();
    store.enqueue(messages).unwrap();
    store.clock().advance(Duration::from_secs(30));
    let claim = store
        .claim(&ClaimRequest {
            limit: 10,
            lease: Duration::from_secs(60),
            head_policy: HeadPolicy::Block,
            shard: None,
        })
        .await
        .unwrap();
    store
        .fail(
            claim.token,
            &[
                Failure {
                    id: ids[0],
                    error: "refused".into(),
                    action: FailAction::Dead,
                },
                Failure {
                    id: ids[2],
                    error: "timeout".into(),
                    action: FailAction::Retry {
                        delay: Duration::from_secs(600),
                    },
                },
            ],
        )
        .await
        .unwrap();
    store.complete(claim.token, &[ids[4]]).await.unwrap();
    store.release(claim.token, &[ids[1]]).await.unwrap();

    let status = store.status(1).await.unwrap();
    assert_eq!((status.pending, status.leased, status.dead), (2, 1, 1));
    assert_eq!(status.oldest_pending_age_seconds, Some(30.0));
    assert_eq!(status.published_last_minute, Some(1));
    assert_eq!(status.blocked_keys, Some(2));
    assert_eq!(status.blocked.len(), 1, "limited to 1");
    assert_eq!(status.blocked[0].partition_key, "ka");
    assert_eq!(status.blocked[0].head_state, "dead");
    assert_eq!(status.blocked[0].last_error.as_deref(), Some("refused"));

    let all = store.status(10).await.unwrap();
    assert_eq!(all.blocked[1].partition_key, "kb");
    assert_eq!(all.blocked[1].head_state, "retrying");
    assert_eq!(all.blocked[1].attempts, 1);

    // A minute later the publication has left the window; the retry is still ahead.
    store.clock().advance(Duration::from_secs(61));
    let later = store.status(10).await.unwrap();
    assert_eq!(later.published_last_minute, Some(0));
    assert_eq!(later.blocked_keys, Some(2));
}
