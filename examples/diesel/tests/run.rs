//! The example's whole job on the Postgres named by `OUTBOX_TEST_POSTGRES_URL`, in a fresh
//! schema: every committed order's message is published once, no rolled-back one is, and the
//! orders table holds exactly the committed orders.

use outbox::postgres::sqlx::{self, PgPool};
use outbox::postgres::PostgresConfig;
use outbox::SharedBuffer;
use outbox_conformance_tests::env::service_url;

#[tokio::test]
async fn committed_orders_are_relayed_and_rolled_back_ones_are_not() {
    let Some(url) = service_url("OUTBOX_TEST_POSTGRES_URL") else {
        return;
    };
    let schema = format!("outbox_example_diesel_{:016x}", rand::random::<u64>());
    let config = PostgresConfig::builder().schema(&schema).build().unwrap();
    let buffer = SharedBuffer::default();
    let summary = outbox_example_diesel::run(&url, config, 10, buffer.clone())
        .await
        .unwrap();

    assert_eq!(summary.committed.len(), 8);
    assert_eq!(summary.rolled_back.len(), 2);
    assert_eq!(summary.stats.published, 8);
    let output = buffer.contents();
    assert_eq!(output.lines().count(), 8, "{output}");
    for id in &summary.committed {
        let lines = output.lines().filter(|line| line.contains(id.as_str()));
        assert_eq!(
            lines.count(),
            1,
            "message {id} was not published once:\n{output}"
        );
    }
    for id in &summary.rolled_back {
        assert!(
            !output.contains(id.as_str()),
            "rolled-back message {id} was published"
        );
    }

    let pool = PgPool::connect(&url).await.unwrap();
    let orders: Vec<String> =
        sqlx::query_scalar(&format!("SELECT id FROM \"{schema}\".orders ORDER BY id"))
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut expected: Vec<String> = (1..=10)
        .filter(|n| n % 5 != 0)
        .map(|n| format!("order-{n}"))
        .collect();
    expected.sort();
    assert_eq!(orders, expected);
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}
