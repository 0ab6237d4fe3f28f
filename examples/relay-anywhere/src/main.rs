//! `OUTBOX_BROKER_URL=nats://127.0.0.1:4222?subject=orders.{event_type}&stream=ORDERS&create_stream=true
//! cargo run -p outbox-example-relay-anywhere [-- FILE [ORDERS]]`
//!
//! Writes sample orders with their outbox messages into a SQLite file and relays them to the
//! broker `OUTBOX_BROKER_URL` names (default `stdout://`); only that variable changes between
//! brokers, e.g. `kafka://127.0.0.1:9092?topic=orders` or `redis://127.0.0.1:6379?stream=orders`.

use std::process::ExitCode;

use outbox_example_relay_anywhere::{run, BROKER_URL_VAR, DEFAULT_BROKER_URL};

#[tokio::main]
async fn main() -> ExitCode {
    let (path, orders) =
        match outbox_quickstart::fresh_file_from_args("outbox-relay-anywhere.sqlite") {
            Ok(parsed) => parsed,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
    let broker_url = std::env::var(BROKER_URL_VAR).unwrap_or_else(|_| DEFAULT_BROKER_URL.into());

    match run(&path, orders, &broker_url).await {
        Ok(s) => {
            eprintln!(
                "relayed to {}: {} orders committed, {} rolled back; {} messages published in \
                 {} ms ({} retried, {} dead); store now: {} published, {} pending, {} dead",
                s.broker,
                s.committed.len(),
                s.rolled_back.len(),
                s.stats.published,
                s.relay_millis,
                s.stats.retried,
                s.stats.dead,
                s.counts.published,
                s.counts.pending,
                s.counts.dead,
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("relay-anywhere failed: {e}");
            ExitCode::FAILURE
        }
    }
}
