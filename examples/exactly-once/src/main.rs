//! `cargo run -p outbox-example-exactly-once [-- REDIS_URL]`: the order service writes orders
//! and their messages into `orders.sqlite`, the relay publishes them to a Redis stream, the
//! payment service books them into `payments.sqlite` with its inbox; then a second consumer
//! group reads the whole stream again under the same inbox name, as a crash before the acks
//! would, and books nothing twice. Files go to `exactly-once-demo/` (made afresh).
//!
//! `... -- relay STORE_URL BROKER_URL [SUFFIX [GROUP]]` and `... -- payments DB_URL CONSUMER_URL
//! [SUFFIX]` run one service as a process of its own instead (see `serve`).

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::relay::RelayConfig;
use outbox_consumer::{async_trait, CancellationToken, Delivery, Handled, Handler, HandlerError};
use outbox_example_exactly_once::{
    run_payments, run_relay, serve, Names, Order, OrderService, PaymentService,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const CUSTOMERS: [&str; 3] = ["alice", "bob", "carol"];
const ORDERS: usize = 24;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("relay" | "payments") => serve(&args).await.map_err(BoxError::from),
        Some("-h" | "--help") => {
            println!(
                "usage: outbox-example-exactly-once [REDIS_URL]   (default redis://127.0.0.1:6379)\n\
                 or one service: {}",
                outbox_example_exactly_once::SERVE_USAGE
            );
            Ok(())
        }
        redis => demo(redis.unwrap_or("redis://127.0.0.1:6379")).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("exactly-once example failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Counts what the payment service did with each delivery.
struct Counting {
    payments: PaymentService,
    processed: Arc<AtomicUsize>,
    duplicates: Arc<AtomicUsize>,
}

#[async_trait]
impl Handler for Counting {
    async fn handle(&self, delivery: &Delivery) -> Result<Handled, HandlerError> {
        let handled = self.payments.handle(delivery).await?;
        let counter = match handled {
            Handled::Processed => &self.processed,
            Handled::Duplicate => &self.duplicates,
        };
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(handled)
    }
}

async fn demo(redis: &str) -> Result<(), BoxError> {
    let dir = std::path::Path::new("exactly-once-demo");
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    let dir = std::fs::canonicalize(dir)?;
    let orders_url = format!("sqlite://{}", dir.join("orders.sqlite").display());
    let payments_url = format!("sqlite://{}", dir.join("payments.sqlite").display());
    // A stream of this run only: an earlier run's entries are not read again.
    let stream = format!("exactly-once.{}", outbox::uuid::Uuid::now_v7().simple());
    let names = Names::default();

    let orders = OrderService::connect(&orders_url, names.clone()).await?;
    orders.migrate().await?;
    let (mut committed, mut rolled_back) = (0, 0);
    for n in 0..ORDERS {
        let customer = CUSTOMERS[n % CUSTOMERS.len()];
        let order = Order {
            id: format!("order-{}", n + 1),
            customer: customer.into(),
            seq: (n / CUSTOMERS.len() + 1) as i64,
            amount_cents: 1_000 + 10 * n as i64,
        };
        // Every fourth order is refused: its row and its message vanish together.
        let commit = n % 4 != 3;
        orders.place(&[order], commit).await?;
        if commit {
            committed += 1;
        } else {
            rolled_back += 1;
        }
    }
    println!("order service: {committed} orders committed with their messages, {rolled_back} rolled back");

    let stop = CancellationToken::new();
    let relay = tokio::spawn({
        let (orders_url, names, stop) = (orders_url.clone(), names.clone(), stop.clone());
        let broker = format!("{redis}?stream={stream}");
        async move {
            run_relay(
                &orders_url,
                &names,
                &broker,
                RelayConfig::default(),
                stop.cancelled_owned(),
            )
            .await
        }
    });

    let payments = PaymentService::connect(&payments_url, names.clone(), "payments").await?;
    payments.migrate().await?;
    for group in ["payments", "payments-replay"] {
        let processed = Arc::new(AtomicUsize::new(0));
        let duplicates = Arc::new(AtomicUsize::new(0));
        let handler = Counting {
            payments: payments.clone(),
            processed: processed.clone(),
            duplicates: duplicates.clone(),
        };
        let consumer_stop = CancellationToken::new();
        let consumer = tokio::spawn({
            let url = format!("{redis}?stream={stream}&group={group}");
            let stop = consumer_stop.clone();
            async move { run_payments(handler, &url, stop).await }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while processed.load(Ordering::SeqCst) + duplicates.load(Ordering::SeqCst) < committed {
            if consumer.is_finished() || Instant::now() > deadline {
                consumer_stop.cancel();
                stop.cancel();
                consumer.await??;
                return Err(format!(
                    "consumer group {group} handled {} of {committed} messages in 30 s: is Redis \
                     running at {redis}?",
                    processed.load(Ordering::SeqCst) + duplicates.load(Ordering::SeqCst)
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        consumer_stop.cancel();
        consumer.await??;
        println!(
            "consumer group {group:16} booked {:2} payments, dropped {:2} duplicates",
            processed.load(Ordering::SeqCst),
            duplicates.load(Ordering::SeqCst)
        );
    }
    stop.cancel();
    relay.await??;

    let booked = payments.payments().await?;
    println!(
        "payment service: {} payments booked for {committed} committed orders",
        booked.len()
    );
    for (customer, total) in payments.balances().await? {
        println!("  balance of {customer}: {total} cents");
    }
    // Leave the local Redis as it was.
    let client = redis::Client::open(redis)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    redis::cmd("DEL")
        .arg(&stream)
        .query_async::<()>(&mut conn)
        .await?;
    if booked.len() != committed {
        return Err(format!("{} payments for {committed} orders", booked.len()).into());
    }
    Ok(())
}
