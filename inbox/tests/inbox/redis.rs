//! The Redis inbox on the real server.

use std::time::Duration;

use outbox_conformance_tests::env::service_url;
use outbox_inbox::redis::RedisInbox;
use outbox_inbox::{Error, Receipt, Uuid};

const URL_VAR: &str = "OUTBOX_TEST_REDIS_URL";

#[tokio::test]
async fn set_nx_marks_once_per_consumer_expires_and_can_be_forgotten() {
    let Some(url) = service_url(URL_VAR) else {
        return;
    };
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let prefix = format!("inbox-test-{}", Uuid::new_v4().simple());
    let ttl = Duration::from_secs(600);
    let inbox = RedisInbox::new(prefix.clone(), ttl).unwrap();
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());

    assert_eq!(
        inbox.record(&mut conn, "mailer", a).await.unwrap(),
        Receipt::New
    );
    assert_eq!(
        inbox.record(&mut conn, "mailer", a).await.unwrap(),
        Receipt::Duplicate
    );
    assert_eq!(
        inbox.record(&mut conn, "ledger", a).await.unwrap(),
        Receipt::New
    );
    assert_eq!(
        inbox
            .record_batch(&mut conn, "mailer", &[b, a, b])
            .await
            .unwrap(),
        [Receipt::New, Receipt::Duplicate, Receipt::Duplicate]
    );

    // The mark expires: its time to live is set, at most the inbox's.
    let pttl: i64 = redis::cmd("PTTL")
        .arg(inbox.key("mailer", a))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= ttl.as_millis() as i64, "{pttl}");

    // A failed effect forgets its mark, and the redelivery is new again.
    inbox.forget(&mut conn, "mailer", a).await.unwrap();
    assert_eq!(
        inbox.record(&mut conn, "mailer", a).await.unwrap(),
        Receipt::New
    );

    assert!(matches!(
        inbox.record(&mut conn, "", a).await,
        Err(Error::InvalidInput(_))
    ));
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 3, "{keys:?}");
    let _: i64 = redis::cmd("DEL")
        .arg(&keys)
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn an_unreachable_server_is_unavailable() {
    let client = redis::Client::open("redis://127.0.0.1:1").unwrap();
    // Nothing listens on port 1: the connection itself fails, as the consumer would see it.
    let err = client.get_multiplexed_async_connection().await.unwrap_err();
    assert!(err.is_io_error() || err.is_connection_refusal(), "{err}");
}
