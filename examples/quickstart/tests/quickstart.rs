//! The quickstart publishes exactly the committed orders, in order per customer.

use std::collections::HashMap;

use outbox::SharedBuffer;

#[tokio::test]
async fn relays_every_committed_order_once_and_in_order_per_customer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("quickstart.sqlite");
    let buffer = SharedBuffer::default();
    let summary = outbox_quickstart::run(&path, 40, buffer.clone())
        .await
        .unwrap();
    assert_eq!(summary.committed, 32);
    assert_eq!(summary.rolled_back, 8);
    assert_eq!(summary.stats.published, 32);
    assert_eq!(summary.counts.published, 32);
    assert_eq!(
        summary.counts.pending + summary.counts.leased + summary.counts.dead,
        0
    );

    let lines: Vec<serde_json::Value> = buffer
        .contents()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 32);
    let mut last_order: HashMap<String, u64> = HashMap::new();
    for line in &lines {
        let order: u64 = line["payload"]["order"].as_str().unwrap()["order-".len()..]
            .parse()
            .unwrap();
        assert_ne!(order % 5, 0, "order {order} was rolled back but published");
        let customer = line["partition_key"].as_str().unwrap().to_string();
        let previous = last_order.insert(customer.clone(), order).unwrap_or(0);
        assert!(
            previous < order,
            "{customer}: order {order} after {previous}"
        );
    }

    // A second run over the same file publishes nothing new.
    let again = outbox_quickstart::run(&path, 0, std::io::sink())
        .await
        .unwrap();
    assert_eq!(again.stats.published, 0);
}
