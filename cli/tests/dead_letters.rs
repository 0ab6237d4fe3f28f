//! `outbox-relay inbox dead-letters`, run as a separate process against the real Redis server:
//! a real consumer dead-letters some messages, and the command given that consumer's URL
//! counts and lists them, as a table and as JSON lines.

use std::collections::BTreeMap;

use outbox::chrono::Utc;
use outbox::{Message, PublishOutcome};
use outbox_conformance_tests::env::service_url;
use outbox_consumer::{handler_fn, CancellationToken, Consumer, Delivery, Handled, HandlerError};
use outbox_e2e::unique_suffix;
use uuid::Uuid;

mod common;
use common::{json_lines, run, BoxError, GUARD};

fn message(n: i64) -> Message {
    Message {
        id: Uuid::now_v7(),
        seq: n,
        aggregate_type: "order".into(),
        aggregate_id: format!("order-{n}"),
        event_type: "order.placed".into(),
        payload: serde_json::json!({ "n": n }).to_string(),
        binary: None,
        headers: BTreeMap::new(),
        partition_key: Some("customer-1".into()),
        dedup_key: None,
        attempts: 0,
        created_at: Utc::now(),
    }
}

#[tokio::test]
async fn dead_letters_of_a_redis_consumer_as_a_table_and_as_json() -> Result<(), BoxError> {
    let Some(redis) = service_url("OUTBOX_TEST_REDIS_URL") else {
        return Ok(());
    };
    let stream = format!("outbox-cli-dead:{}", unique_suffix());
    let url = format!("{redis}?stream={stream}&group=billing&concurrency=1");

    // Nothing dead-lettered yet (no dead-letter stream): a count of 0, exit 0.
    let lines = json_lines(["inbox", "dead-letters", "--consumer-url", &url, "--json"]).await?;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["count"], 0);
    assert_eq!(lines[0]["destination"], format!("{stream}:dead"));

    // Three messages; the handler refuses the first and the last for good.
    let batch: Vec<Message> = (1..=3).map(message).collect();
    let refused = [batch[0].id, batch[2].id];
    let publisher = outbox::broker::connect(&format!("{redis}?stream={stream}")).await?;
    let outcomes = publisher.publish(&batch).await;
    assert!(
        outcomes.iter().all(|o| *o == PublishOutcome::Acked),
        "{outcomes:?}"
    );
    let (handled_tx, mut handled) = tokio::sync::mpsc::unbounded_channel::<Uuid>();
    let consumer = Consumer::connect(&url).await?;
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run_until(
        handler_fn(move |d: Delivery| {
            let handled = handled_tx.clone();
            async move {
                let _ = handled.send(d.message_id);
                if refused.contains(&d.message_id) {
                    Err(HandlerError::permanent(format!(
                        "order {} is void",
                        d.aggregate_id
                    )))
                } else {
                    Ok(Handled::Processed)
                }
            }
        }),
        stop.clone(),
    ));
    // One lane, in stream order: once the last message was handled and the count shows both,
    // they are dead-lettered.
    let mut seen = Vec::new();
    while !seen.contains(&batch[2].id) {
        let id = tokio::time::timeout(GUARD, handled.recv())
            .await?
            .ok_or("the consumer stopped")?;
        seen.push(id);
    }
    let deadline = tokio::time::Instant::now() + GUARD;
    let lines = loop {
        let lines = json_lines(["inbox", "dead-letters", "--consumer-url", &url, "--json"]).await?;
        if lines[0]["count"] == 2 {
            break lines;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never 2 dead letters: {lines:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    stop.cancel();
    running.await?;

    // JSON: the count line, then the dead letters newest first.
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[0]["broker"], "redis");
    assert_eq!(lines[0]["listed"], 2);
    let newest_first = [&batch[2], &batch[0]];
    for (line, msg) in lines[1..].iter().zip(newest_first) {
        assert_eq!(line["message_id"], msg.id.to_string(), "{line}");
        assert_eq!(line["consumer"], "billing", "{line}");
        assert_eq!(line["attempts"], 1, "{line}");
        assert_eq!(line["partition_key"], "customer-1", "{line}");
        assert_eq!(line["body_bytes"], msg.payload.len(), "{line}");
        let reason = line["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains(&format!("order {} is void", msg.aggregate_id)),
            "{line}"
        );
        assert!(line["position"]["entry_id"].is_string(), "{line}");
        assert!(line["time"].is_string(), "{line}");
    }

    // --limit 1: the newest only; the count stays 2.
    let lines = json_lines([
        "inbox",
        "dead-letters",
        "--consumer-url",
        &url,
        "--json",
        "--limit",
        "1",
    ])
    .await?;
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["count"], 2);
    assert_eq!(lines[1]["message_id"], batch[2].id.to_string());

    // The table, the URL from the environment.
    let out = common::output({
        let mut command = common::command(["inbox", "dead-letters"]);
        command.env("OUTBOX_CONSUMER_URL", &url);
        command
    })
    .await?;
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout)?;
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(
        rows[0],
        format!("2 dead letters in redis stream {stream}:dead"),
        "{text}"
    );
    assert!(
        rows[1].starts_with("POSITION") && rows[1].contains("REASON"),
        "{text}"
    );
    assert_eq!(rows.len(), 4, "{text}");
    for (row, msg) in rows[2..].iter().zip(newest_first) {
        assert!(row.contains(&msg.id.to_string()), "{text}");
        assert!(row.contains("billing"), "{text}");
        assert!(row.contains("is void"), "{text}");
    }

    // An unreachable broker: exit 1, the broker named, the password not shown.
    let out = run(&[
        "inbox",
        "dead-letters",
        "--consumer-url",
        "redis://:s3cret@127.0.0.1:1?stream=s&group=g&timeout_ms=500",
    ])
    .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("redis unavailable"), "{stderr}");
    assert!(!stderr.contains("s3cret"), "{stderr}");
    Ok(())
}

/// A NATS token given as the URL's user name is a secret too: masked in the error.
#[tokio::test]
async fn a_nats_token_in_the_consumer_url_is_masked_in_errors() -> Result<(), BoxError> {
    let out = run(&[
        "inbox",
        "dead-letters",
        "--consumer-url",
        "nats://t0ken@127.0.0.1:4222?consumer=c",
    ])
    .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no stream option"), "{stderr}");
    assert!(stderr.contains("nats://***@127.0.0.1"), "{stderr}");
    assert!(!stderr.contains("t0ken"), "{stderr}");
    Ok(())
}
