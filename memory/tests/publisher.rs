//! The recording publisher records deliveries, follows its script and keeps per-key order.

use outbox_memory::RecordingPublisher;
use outbox_traits::{Message, PublishOutcome, Publisher};
use uuid::Uuid;

fn message(key: Option<&str>, seq: i64) -> Message {
    Message {
        id: Uuid::now_v7(),
        seq,
        aggregate_type: "order".into(),
        aggregate_id: key.unwrap_or("none").into(),
        event_type: "order.placed".into(),
        payload: "{}".into(),
        binary: None,
        headers: Default::default(),
        partition_key: key.map(Into::into),
        dedup_key: None,
        attempts: 0,
        created_at: chrono::Utc::now(),
    }
}

#[tokio::test]
async fn acks_and_records_in_order() {
    let publisher = RecordingPublisher::new();
    let batch = [message(Some("a"), 1), message(Some("b"), 2)];
    let outcomes = publisher.publish(&batch).await;
    assert_eq!(outcomes, [PublishOutcome::Acked, PublishOutcome::Acked]);
    assert_eq!(publisher.published_ids(), [batch[0].id, batch[1].id]);
    assert_eq!(publisher.calls(), 1);
    assert_eq!(publisher.name(), "recording");
}

#[tokio::test]
async fn a_failed_message_stops_its_key_only() {
    let publisher = RecordingPublisher::new();
    let batch = [
        message(Some("a"), 1),
        message(Some("a"), 2),
        message(Some("b"), 3),
        message(None, 4),
    ];
    publisher.fail_next(batch[0].id, PublishOutcome::transient("down"));
    let outcomes = publisher.publish(&batch).await;
    assert_eq!(
        outcomes,
        [
            PublishOutcome::transient("down"),
            PublishOutcome::NotAttempted,
            PublishOutcome::Acked,
            PublishOutcome::Acked
        ]
    );
    assert_eq!(publisher.published_ids(), [batch[2].id, batch[3].id]);
    assert_eq!(
        publisher.sent().len(),
        3,
        "not-attempted messages are not sent"
    );
    // The script was used up: the next attempt is acknowledged.
    assert_eq!(
        publisher.publish(&batch[..1]).await,
        [PublishOutcome::Acked]
    );
}

#[tokio::test]
async fn ambiguous_counts_as_published_and_duplicates_are_numbered() {
    let publisher = RecordingPublisher::new();
    let m = message(Some("a"), 1);
    publisher.set_outcome(|_| PublishOutcome::Ambiguous {
        reason: "timeout".into(),
    });
    publisher.publish(std::slice::from_ref(&m)).await;
    publisher.ack_all();
    publisher.publish(std::slice::from_ref(&m)).await;
    let published = publisher.published();
    assert_eq!(published.len(), 2);
    assert_eq!(
        published.iter().map(|d| d.delivery).collect::<Vec<_>>(),
        [1, 2]
    );
}

#[tokio::test]
async fn wait_for_returns_once_enough_were_published() {
    let publisher = RecordingPublisher::new();
    let waiter = {
        let publisher = publisher.clone();
        tokio::spawn(async move { publisher.wait_for(2).await })
    };
    publisher.publish(&[message(Some("a"), 1)]).await;
    publisher.publish(&[message(Some("a"), 2)]).await;
    waiter.await.unwrap();
    publisher.wait_for(1).await;
}
